"""Compiles in a worker process: a compiler's native crash (a segfault or abort in libtpu or XLA:GPU) ends one
compile, not the run.

A search that compiles many candidates for a topology (the fit's mesh search, :func:`jaxckpt.fit.search_meshes`)
meets compilers that crash on some of them: libtpu's SparseCore code generation overflowed its stack on one mesh of
the Mixtral 8x7B search and took the whole process with it. A crash in native code cannot be caught in the process
it happens in (a signal handler cannot resume a compiler whose state is gone), so inside :func:`isolated_compiles`
every topology compile runs in a worker process instead: the parent lowers the step as always and hands the worker
exactly what JAX would hand the compiler (the StableHLO module and XLA's ``CompileOptions``,
:func:`jaxckpt.analysis._internals.compile_request`); the worker, which loaded the same topology, compiles and sends
back what the tools read of the executable (memory stats, cost analysis, program text, the compiler's log). The
results are the same as a compile in the process (checked: memory stats, cost analysis and program text equal).

One worker serves the whole search, its compiles in threads (the fit's ``jobs`` run at once, as in the process), so
its start-up (importing JAX, loading the topology: about 4 s) is paid once, while the parent traces its first step.
Its standard error passes through the parent, which keeps its last lines. When the worker dies, a compile that was
alone in it raises :class:`CompilerCrashError`, naming the signal and the compiler's last line; compiles that were
in flight beside others are each run again alone in a fresh worker, so the one that crashes is the one named, and
the others answer. The next compile starts a fresh worker. The worker ignores Ctrl-C (the parent ends it) and ends
with the parent.

Fault injection: ``JAXCKPT_CRASH_COMPILE_ON_MESH=<mesh>`` (e.g. ``data=2,fsdp=2``) makes the worker ``os.abort()``
when asked to compile over that mesh, the way tests and ``benchmarks/fault_cases.py`` show a crash handled.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.analysis._internals import compile_request, compile_serialized
from jaxckpt.errors import JaxckptError
from jaxckpt.schema import MEMORY_FIELDS
from jaxckpt.sharding import format_mesh, get_topology, mesh_shape
from jaxckpt.sharding._topology import topology_of
from jaxckpt.training._xla import compiler_log

CRASH_ENV = "JAXCKPT_CRASH_COMPILE_ON_MESH"
"""Fault injection: the worker asked to compile over this mesh (its text, ``data=2,fsdp=2``) calls ``os.abort()``."""

_TAIL_LINES = 40
"""Lines of the worker's standard error the parent keeps (the last one names a crash)."""


class CompilerCrashError(JaxckptError):
  """The compiler crashed (the worker process compiling died of a signal or exited): the message names the signal,
  the mesh and the compiler's last line."""


class CompiledInWorker:
  """What the tools read of an executable compiled in a worker, in the shape of ``jax.stages.Compiled``:
  :meth:`memory_analysis`, :meth:`cost_analysis`, :meth:`as_text`, :attr:`input_shardings` (over the mesh, so
  :func:`jaxckpt.training._xla.memory_stats` knows the platform) and the compiler's log lines. Nothing runs it.

  Args:
    mesh: the mesh the step was compiled over.
    memory: XLA's ``CompiledMemoryStats`` fields (``temp_size_in_bytes``, ..., bytes).
    cost: XLA's cost analysis (``{"flops": ..., "bytes accessed": ...}``).
    text: the compiled program's HLO text.
    log: the compiler's warning and error messages.
  """

  def __init__(self, mesh: Mesh, memory: Mapping[str, int], cost: Mapping[str, float], text: str,
               log: tuple[str, ...] = ()):
    self.input_shardings = (NamedSharding(mesh, PartitionSpec()),)
    self._memory, self._cost, self._text, self.compiler_log = dict(memory), dict(cost), text, tuple(log)

  def memory_analysis(self) -> Any:
    """XLA's memory stats (attributes as ``CompiledMemoryStats``'s)."""
    return types.SimpleNamespace(**self._memory)

  def cost_analysis(self) -> dict[str, float]:
    """XLA's cost analysis."""
    return dict(self._cost)

  def as_text(self) -> str:
    """The compiled program's HLO text (``jax.stages.Compiled.as_text()``)."""
    return self._text


class _Died(Exception):
  """The worker died with requests in flight: ``alone`` when this request was its only one."""

  def __init__(self, alone: bool, message: str):
    super().__init__(message)
    self.alone = alone


class _Worker:
  """One worker process: requests over a pipe, answers read by a thread, its stderr passed through by another."""

  def __init__(self, stderr: int):
    parent_read, child_write = os.pipe()
    child_read, parent_write = os.pipe()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    self.process = subprocess.Popen(
        [sys.executable, "-c", f"from jaxckpt.step._isolated import serve; serve({child_read}, {child_write})"],
        pass_fds=(child_read, child_write), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    os.close(child_read)
    os.close(child_write)
    self.send, self.recv = Connection(parent_write, readable=False), Connection(parent_read, writable=False)
    self.stderr, self.tail = stderr, collections.deque(maxlen=_TAIL_LINES)
    self.pending: dict[int, concurrent.futures.Future] = {}
    self.lock = threading.Lock()
    self.dead = False
    self.ids = itertools.count()
    threading.Thread(target=self._answers, daemon=True, name="jaxckpt compile worker answers").start()
    self._passing = threading.Thread(target=self._stderr, daemon=True, name="jaxckpt compile worker stderr")
    self._passing.start()

  def submit(self, request: dict[str, Any]) -> concurrent.futures.Future:
    """Sends ``request``; its future holds the answer, or raises :class:`_Died`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self.lock:
      if self.dead:
        raise _Died(True, "the worker had died")
      number = next(self.ids)
      self.pending[number] = future
      try:
        self.send.send((number, request))
      except OSError:
        pass  # it died: the answers thread fails every pending request
    return future

  def _answers(self) -> None:
    while True:
      try:
        number, answer = self.recv.recv()
      except (EOFError, OSError):
        break
      with self.lock:
        future = self.pending.pop(number, None)
      if future is not None:
        future.set_result(answer)
    code = self.process.wait()
    time.sleep(0.05)  # the stderr thread reads the compiler's last words
    with self.lock:
      self.dead = True
      pending, self.pending = list(self.pending.values()), {}
    message = _crash_reason(code, self.tail)
    for future in pending:
      future.set_exception(_Died(len(pending) == 1, message))

  def _stderr(self) -> None:
    for line in iter(self.process.stderr.readline, b""):
      self.tail.append(line.decode(errors="replace").rstrip())
      with contextlib.suppress(OSError):
        os.write(self.stderr, line)

  def end(self) -> None:
    """Ends the worker (it holds nothing worth keeping)."""
    for conn in (self.send, self.recv):
      conn.close()
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()
    self._passing.join(1.0)  # its last lines written before the descriptor it writes to is closed


def _crash_reason(code: int | None, tail: Any) -> str:
  """``SIGABRT: <the compiler's last line>``."""
  if code is not None and code < 0:
    how = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else f"signal {-code}"
  else:
    how = f"exit status {code}"
  skip = ("***", "@", "PC:", "Fatal Python error", "Current thread", "Thread 0x", "File ", "Extension modules",
          "WARNING: All log messages", "I0000")
  last = next((line.strip() for line in reversed(tail) if line.strip() and not line.strip().startswith(skip)), "")
  return how + (f": {last[:200]}" if last else "")


class _Pool:
  """The worker the compiles share, started again after it dies; a crash's survivors run again alone."""

  def __init__(self):
    self.stderr = os.dup(2)  # the real stderr: a compile capturing fd 2 must not take the worker's lines
    self.lock = threading.Lock()
    self.alone = threading.Lock()
    self.worker: _Worker | None = None

  def start(self) -> None:
    """Starts the worker now (it imports JAX while the caller traces its first step)."""
    self._worker()

  def _worker(self) -> _Worker:
    with self.lock:
      if self.worker is None or self.worker.dead:
        if self.worker is not None:
          self.worker.end()
        self.worker = _Worker(self.stderr)
      return self.worker

  def compile(self, lowered: Any, options: Mapping[str, Any], mesh: Mesh) -> CompiledInWorker:
    module, compile_options = compile_request(lowered, options)
    shape = format_mesh(mesh_shape(mesh))
    request = {"topology": topology_of(mesh), "devices": [d.id for d in mesh.devices.flat], "module": module,
               "compile_options": compile_options, "mesh": shape,
               "platform": next(iter(mesh.devices.flat)).platform}
    try:
      answer = self._worker().submit(request).result()
    except _Died as died:
      if died.alone:
        raise CompilerCrashError(f"compiler crashed ({died}) compiling over mesh {shape}") from None
      answer = self._alone(request, shape)  # which of the compiles in flight crashed? each runs again alone
    if "error" in answer:
      raise jax.errors.JaxRuntimeError(answer["error"])
    return CompiledInWorker(mesh, answer["memory"], answer["cost"], answer["text"], tuple(answer["log"]))

  def _alone(self, request: dict[str, Any], shape: str) -> dict[str, Any]:
    with self.alone:
      worker = _Worker(self.stderr)
      try:
        return worker.submit(request).result()
      except _Died as died:
        raise CompilerCrashError(f"compiler crashed ({died}) compiling over mesh {shape}") from None
      finally:
        worker.end()

  def close(self) -> None:
    with self.lock:
      worker, self.worker = self.worker, None
    if worker is not None:
      worker.end()
    fd, self.stderr = self.stderr, -1
    if fd >= 0:
      os.close(fd)


_POOL: _Pool | None = None
_DEPTH = 0
_POOL_LOCK = threading.Lock()


@contextlib.contextmanager
def isolated_compiles() -> Iterator[None]:
  """Inside it, every compile for a topology's compile-only devices runs in the worker process (module docstring),
  started at once; the worker ends with it. Nested uses share one worker."""
  global _POOL, _DEPTH
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = _Pool()
      _POOL.start()
    _DEPTH += 1
  try:
    yield
  finally:
    with _POOL_LOCK:
      _DEPTH -= 1
      pool = _POOL if _DEPTH == 0 else None
      if pool is not None:
        _POOL = None
    if pool is not None:
      pool.close()


def end_workers() -> None:
  """Ends the worker now (a Ctrl-C: the parent exits without waiting on its compiles)."""
  pool = _POOL
  if pool is not None:
    pool.close()


def compile_lowered(lowered: Any, options: Mapping[str, Any], mesh: Mesh) -> Any:
  """``lowered.compile(compiler_options=options)``, in the worker process when :func:`isolated_compiles` is on and
  ``mesh`` is over a topology's compile-only devices (a :class:`CompiledInWorker` then), else in this process.

  Raises:
    CompilerCrashError: the worker died compiling it (the compiler crashed). Whatever the compiler raises (a
      ``JaxRuntimeError`` with the compiler's message: a program over the chip's memory...).
  """
  pool = _POOL
  if pool is None or topology_of(mesh) is None:
    return lowered.compile(compiler_options=dict(options) or None)
  return pool.compile(lowered, options, mesh)


def _answer(request: dict[str, Any]) -> dict[str, Any]:
  """Compiles one request (in the worker): its memory fields, cost, text and log, or the compiler's error."""
  if request["mesh"] == os.environ.get(CRASH_ENV):
    os.abort()
  topology = get_topology(request["topology"])
  by_id = {d.id: d for d in topology.devices}
  devices = [by_id[i] for i in request["devices"]]
  with compiler_log(request["platform"] == "gpu") as log:  # XLA:GPU's warnings, one compile at a time (a lock)
    try:
      executable = compile_serialized(request["module"], request["compile_options"], devices)
    except Exception as err:  # noqa: BLE001 - the compiler's refusal goes back as its message
      return {"error": str(err)}
  try:
    stats = executable.get_compiled_memory_stats()
  except Exception:  # noqa: BLE001 - as jaxckpt.training._xla.memory_stats: a backend without them
    stats = None
  try:
    cost = executable.cost_analysis()
  except Exception:  # noqa: BLE001 - as jaxckpt.step.xla_cost: XLA:GPU deviceless has none ("UNIMPLEMENTED")
    cost = {}
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  return {"memory": {attr: getattr(stats, attr, None) for attr in MEMORY_FIELDS.values()},
          "cost": {str(k): float(v) for k, v in (cost if isinstance(cost, Mapping) else {}).items()
                   if isinstance(v, (int, float))},
          "text": "\n\n".join(m.to_string() for m in executable.hlo_modules()), "log": list(log)}


def serve(read_fd: int, write_fd: int) -> None:
  """The worker's loop: each request from the parent compiled in a thread (several at once, as the parent's jobs),
  its answer sent back, until the parent closes the pipe."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
  receive, reply = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
  sending = threading.Lock()

  def handle(number: int, request: dict[str, Any]) -> None:
    answer = _answer(request)
    with sending:
      reply.send((number, answer))

  while True:
    try:
      number, request = receive.recv()
    except (EOFError, OSError):
      return
    threading.Thread(target=handle, args=(number, request), daemon=True).start()
