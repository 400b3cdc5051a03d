"""jaxckpt's console scripts while they start: which process is one, and Ctrl-C before the tool's own handlers.

``jaxckpt-report``, ``jaxckpt-plan`` and ``jaxckpt-fit`` (and ``python -m jaxckpt.report``, ``.fit``, ``.planner``)
import the package first, and the import takes seconds (JAX, XLA, Flax). Python's own SIGINT handling does badly
there, measured with jax 0.10.2: a Ctrl-C 0.5 s in raised ``KeyboardInterrupt`` inside JAX's garbage-collection
callback, where Python prints "Exception ignored" and goes on, so the run finished and exited 0 (the interrupt
lost); 1–2 s in it ended in a ``KeyboardInterrupt`` traceback from inside an import. :func:`stop_while_starting`
gives the start the tools' contract (:mod:`jaxckpt.cli._exits`): one line and exit 130 (SIGINT) or 143 (SIGTERM).
Nothing has been written yet at that point; the tool replaces these handlers with its own when it runs.

A ground module: it imports no JAX.
"""

from __future__ import annotations

import os
import signal
import sys

CONSOLE_SCRIPTS: tuple[str, ...] = ("jaxckpt-report", "jaxckpt-plan", "jaxckpt-fit")
"""jaxckpt's console scripts (``pyproject.toml``): programs, whose contract for bad input is one line and exit 2."""

TOOL_MODULES: tuple[str, ...] = ("jaxckpt.report", "jaxckpt.planner", "jaxckpt.fit")
"""The packages whose ``__main__`` runs a tool (``python -m jaxckpt.report``)."""


def running_console_script(argv0: str | None = None, orig_argv: list[str] | None = None) -> bool:
  """Whether this process is one of jaxckpt's tools: a console script of :data:`CONSOLE_SCRIPTS` (its ``sys.argv[0]``'s
  file name) or ``python -m`` one of :data:`TOOL_MODULES` (``sys.orig_argv``). Then ``import jaxckpt`` reports a bad
  environment as one line and exit 2, as the tools report bad flags, instead of raising.

  Args:
    argv0: the program path (default ``sys.argv[0]``).
    orig_argv: the interpreter's command line (default ``sys.orig_argv``).
  """
  program = sys.argv[0] if argv0 is None and sys.argv else (argv0 or "")
  if os.path.basename(program) in CONSOLE_SCRIPTS:
    return True
  argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
  return any(flag == "-m" and module in TOOL_MODULES for flag, module in zip(argv, argv[1:]))


def _stop(signum: int, _frame: object) -> None:
  name = signal.Signals(signum).name
  program = os.path.basename(sys.argv[0]) if sys.argv else ""
  program = program if program in CONSOLE_SCRIPTS else "jaxckpt"
  try:
    os.write(2, f"\n{program}: stopped by {name}{' (Ctrl-C)' * (signum == signal.SIGINT)} while starting; nothing was "
                f"written\n".encode("ascii", "replace"))
  finally:
    os._exit(128 + signum)


def stop_while_starting() -> None:
  """SIGINT and SIGTERM end the process at once while it imports: one line on stderr, exit 130 or 143, no traceback
  (module docstring). Call it first thing in a tool's process; the tool's own handlers replace these, and take both
  signals as these do, also where the process started with them ignored (a background job of a non-interactive
  shell ignores SIGINT). Outside the main thread, nothing is changed."""
  try:
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, _stop)
  except ValueError:  # not the main thread
    return
