"""How a tool's run ends: Ctrl-C at once, a closed pipe, a narrow terminal encoding, an output that cannot be written.

:func:`run_tool` wraps each tool's ``main`` (``jaxckpt-report``, ``jaxckpt-plan``, ``jaxckpt-fit``):

- **Ctrl-C (SIGINT) and SIGTERM stop the run at once**, with one line on stderr and exit status 130 (143), no
  traceback, even while a compile runs in native code (which holds the main thread until it returns: 6.8 s seen).
  Python's C-level handler writes the signal to a wakeup file descriptor, whichever thread it lands in, and a
  watcher thread reading it removes the temporary files of outputs being written
  (:func:`jaxckpt._paths.remove_temporaries`), ends the compile workers
  (:func:`jaxckpt.step.end_workers`) and leaves with ``os._exit``. What finished is kept: outputs are written whole
  or not at all, and finished compiles are in the compiled-stats cache.
- **A closed pipe** (``jaxckpt-report ... | head -1``) ends the printing quietly; the outputs are written before the
  table is printed, and the exit status is the run's.
- **A narrow encoding** (``PYTHONIOENCODING=ascii``, an ASCII terminal): the tables' ``×``, ``µ``, ``≥`` and box
  lines are written as ASCII (``x``, ``u``, ``>=``, ``-``), anything else as ``?`` (:data:`ASCII_FALLBACK`).
- **An output that cannot be written** after the work (a full disk: :class:`~jaxckpt.errors.OutputWriteError`) is one
  line naming the file, exit status 1; its previous content is kept.
- The compiled-stats cache's warnings (:class:`jaxckpt.step.StatsCacheWarning`) are one line each,
  ``jaxckpt-fit: warning: ...``, not Python's two-line warning format.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxckpt._paths import remove_temporaries
from jaxckpt.cli._parser import EXIT_OUTPUT
from jaxckpt.errors import OutputWriteError
from jaxckpt.step._isolated import end_workers
from jaxckpt.step._stats_cache import StatsCacheWarning

STOP_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The signals that stop a tool, with their exit status (128 + the signal's number, as a shell reports it)."""

ASCII_FALLBACK = {"×": "x", "µ": "u", "≥": ">=", "≤": "<=", "−": "-", "–": "-", "—": "-", "→": "->", "←": "<-",
                  "…": "...", "·": "*", "≈": "~", "±": "+/-", "²": "^2", "’": "'", "‘": "'", "“": '"', "”": '"',
                  "─": "-", "━": "-", "│": "|", "┃": "|", "┼": "+", "╇": "+", "┬": "+", "┴": "+", "├": "+",
                  "┤": "+", "┌": "+", "┐": "+", "└": "+", "┘": "+", "•": "*", "✓": "v", "✗": "x"}
"""What the tools' own characters become on a stream whose encoding cannot write them."""

_ERRORS = "jaxckpt-ascii"


def _ascii_fallback(err: UnicodeError) -> tuple[str, int]:
  if not isinstance(err, UnicodeEncodeError):
    raise err
  return "".join(ASCII_FALLBACK.get(c, "?") for c in err.object[err.start:err.end]), err.end


codecs.register_error(_ERRORS, _ascii_fallback)


def _narrow(stream: Any) -> bool:
  try:
    "×µ≥─".encode(stream.encoding or "ascii")
    return False
  except (UnicodeEncodeError, LookupError):
    return True
  except AttributeError:
    return False


@contextlib.contextmanager
def _encodings() -> Iterator[None]:
  """stdout and stderr write the tools' characters as ASCII where their encoding cannot (restored after)."""
  changed = []
  for stream in (sys.stdout, sys.stderr):
    if isinstance(stream, io.TextIOWrapper) and _narrow(stream):
      changed.append((stream, stream.errors))
      stream.reconfigure(errors=_ERRORS)
  try:
    yield
  finally:
    for stream, errors in changed:
      with contextlib.suppress(ValueError):
        stream.reconfigure(errors=errors)


class _PipeSafe(io.TextIOBase):
  """A text stream that stops writing, quietly, once its reader is gone (``BrokenPipeError``): the descriptor is then
  pointed at ``/dev/null``, so Python's final flush finds nothing to complain about."""

  def __init__(self, stream: Any):
    super().__init__()
    self.stream = stream
    self.closed_pipe = False

  def write(self, text: str) -> int:
    if not self.closed_pipe:
      try:
        self.stream.write(text)
      except BrokenPipeError:
        self._gone()
    return len(text)

  def flush(self) -> None:
    if not self.closed_pipe:
      try:
        self.stream.flush()
      except BrokenPipeError:
        self._gone()

  def _gone(self) -> None:
    self.closed_pipe = True
    with contextlib.suppress(OSError, ValueError, AttributeError):
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, self.stream.fileno())
      os.close(devnull)

  def isatty(self) -> bool:
    return bool(getattr(self.stream, "isatty", lambda: False)())

  def fileno(self) -> int:
    return self.stream.fileno()

  @property
  def encoding(self) -> str:  # type: ignore[override]
    return self.stream.encoding

  @property
  def errors(self) -> str | None:  # type: ignore[override]
    return self.stream.errors


@contextlib.contextmanager
def _pipe_safe() -> Iterator[None]:
  saved = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)
  try:
    yield
  finally:
    with contextlib.suppress(BrokenPipeError, ValueError):
      sys.stdout.flush()
    sys.stdout, sys.stderr = saved


def _stop(prog: str, signum: int) -> None:
  """Ends the process now: one line, temporaries removed, workers ended, ``os._exit``."""
  name = signal.Signals(signum).name
  with contextlib.suppress(OSError):
    os.write(2, f"\n{prog}: stopped by {name}{' (Ctrl-C)' * (signum == signal.SIGINT)}; outputs written so far and "
                f"finished compiles (in the compiled-stats cache) are kept\n".encode("ascii", "replace"))
  remove_temporaries()
  with contextlib.suppress(Exception):
    end_workers()
  flusher = threading.Thread(target=lambda: sys.stdout.flush(), daemon=True)  # the main thread may hold its lock
  flusher.start()
  flusher.join(0.5)
  os._exit(STOP_SIGNALS[signum])


@contextlib.contextmanager
def _stoppable(prog: str) -> Iterator[None]:
  """SIGINT and SIGTERM stop the run at once (module docstring); handlers restored after the block. Outside the main
  thread, nothing is changed.

  Python runs a signal's handler in the main thread between bytecodes, so a handler waits for a compile in native code
  to return; but Python's own C-level handler, in whichever thread the kernel picks, writes the signal's number to
  the wakeup file descriptor (``signal.set_wakeup_fd``) at once. A watcher thread reading it stops the run.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}  # the watcher acts, not the handler

  def watch() -> None:
    while True:
      try:
        got = os.read(read_fd, 1)
      except OSError:
        return
      if not got or got[0] == 0:  # the block ended
        return
      if got[0] in STOP_SIGNALS:
        _stop(prog, got[0])

  watcher = threading.Thread(target=watch, name=f"{prog} signal watcher", daemon=True)
  watcher.start()
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    signal.set_wakeup_fd(previous_fd)
    os.write(write_fd, b"\0")
    watcher.join()
    os.close(read_fd)
    os.close(write_fd)


@contextlib.contextmanager
def _one_line_warnings(prog: str) -> Iterator[None]:
  """The compiled-stats cache's warnings as ``prog: warning: message``, one line (others as Python shows them)."""
  show = warnings.showwarning

  def showwarning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, StatsCacheWarning):
      print(f"{prog}: warning: {message}", file=file or sys.stderr)
    else:
      show(message, category, filename, lineno, file, line)

  warnings.showwarning = showwarning
  try:
    yield
  finally:
    warnings.showwarning = show


def run_tool(prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
  """Runs a tool's ``main(argv)`` as its process should end (module docstring).

  Args:
    prog: the tool's name, for its lines (``"jaxckpt-report"``).
    main: the tool's entry point; returns its exit status.
    argv: its flags (``None``: ``sys.argv[1:]``).

  Returns:
    ``main``'s exit status; 1 when an output could not be written (:data:`EXIT_OUTPUT`); 130 after a
    ``KeyboardInterrupt`` that reached the main thread (a SIGINT the watcher did not take first).
  """
  with _encodings(), _pipe_safe(), _one_line_warnings(prog), _stoppable(prog):
    try:
      return main(argv)
    except OutputWriteError as err:
      print(f"{prog}: error: {err}", file=sys.stderr)
      return EXIT_OUTPUT
    except KeyboardInterrupt:
      remove_temporaries()
      end_workers()
      print(f"\n{prog}: stopped by SIGINT (Ctrl-C); outputs written so far and finished compiles (in the "
            "compiled-stats cache) are kept", file=sys.stderr)
      return STOP_SIGNALS[signal.SIGINT]
