"""One process of a multi-process run, watched from outside: when the run's distributed runtime aborts it (its
coordinator is gone), one line instead of the runtime's C++ log and stack trace.

Within a process, :class:`jaxckpt.sharding.PeerWatch` turns a lost peer into one line within seconds. One loss it
cannot reach: when process 0 dies, the coordination service it hosted goes with it, and JAX's distributed client in
every other process aborts the process at once from a C++ thread (``Polled an error from coordination service``, a
``LOG(FATAL)`` with its stack trace, or gloo's ``terminate called``), before any Python runs. So a multi-process
experiment started as a program runs its training in a child process (the same command, marked supervised) whose
stderr passes through this one: the runtime's lines are held back; if the child then dies of a signal they become
one line, if its peer watch says which process was lost they are dropped, and otherwise they are printed as they
were. The child dies with this process (``PR_SET_PDEATHSIG``),
so ``kill -9`` of either ends both; Ctrl-C reaches the child (the terminal signals the process group) and SIGTERM is
passed on; the exit status is the child's.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence

SUPERVISED = "JAXCKPT_SUPERVISED"
"""Set in the child's environment to the supervisor's process id: it trains instead of supervising again."""

EXIT_LOST = 1
"""The exit status when the child was aborted by the distributed runtime (the run lost a process)."""

RUNTIME_NOISE = ("coordination_service", "Check failure", "terminate called", "what():", "*** ", "    @ ",
                 "Additional GRPC error", ":UNKNOWN:Error received from peer", "preemption_sync_manager", "gloo",
                 "Terminating process because", "=== Source Location Trace", "PC: @", "*** SIGABRT")
"""Text of the lines JAX's distributed runtime (and gloo) write as they abort a process whose run lost a process."""

_PR_SET_PDEATHSIG = 1
_LOST = re.compile(r"^process \d+ of \d+: lost ")
"""The line of the child's peer watch (:class:`jaxckpt.sharding.PeerWatch`) when the run lost a process."""
_ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")


def die_with_supervisor() -> None:
  """In a supervised child: SIGKILL when the supervising process dies (Linux ``prctl``), and an exit now if it has
  died already."""
  supervisor = os.environ.get(SUPERVISED)
  if not supervisor:
    return
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass
  if str(os.getppid()) != supervisor:
    os._exit(EXIT_LOST)


def wanted(argv: Sequence[str] | None, coordinator: str | None, num_processes: int) -> bool:
  """Whether to supervise: a program's own command line (``argv`` is ``None``) of a multi-process run, not already
  supervised."""
  return argv is None and coordinator is not None and num_processes > 1 and not os.environ.get(SUPERVISED)


def supervise(process_id: int, num_processes: int) -> int:
  """Runs this program's command again as a child (module docstring); returns the exit status to end with.

  Args:
    process_id, num_processes: this process of the run (for the line).
  """
  main = sys.modules["__main__"]
  spec = getattr(main, "__spec__", None)
  command = [sys.executable, "-m", spec.name] if spec is not None else [sys.executable, sys.argv[0]]
  env = {**os.environ, SUPERVISED: str(os.getpid())}
  child = subprocess.Popen([*command, *sys.argv[1:]], env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                           bufsize=1)
  previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),  # the terminal signals the child too
              signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))}
  held: list[str] = []
  try:
    for line in child.stderr:
      if any(word in line for word in RUNTIME_NOISE):
        held.append(line)
        continue
      if not _LOST.search(line):  # the peer watch's line says it all: the runtime's lines about it are dropped
        sys.stderr.write("".join(held))
      sys.stderr.write(line)
      held = []
      sys.stderr.flush()
    code = child.wait()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if code < 0 and held:  # aborted by the runtime (process 0, its coordinator, is gone)
    reason = next((line for line in held if "Polled an error" in line or "terminate called" in line), held[0])
    reason = _ABSL_PREFIX.sub("", reason.strip())
    print(f"process {process_id} of {num_processes}: lost a process of the run (JAX's distributed runtime aborted "
          f"this one: {reason[:160]}); stopping; resume every process with --resume", file=sys.stderr)
    return EXIT_LOST
  sys.stderr.write("".join(held))
  return code if code >= 0 else 128 - code
