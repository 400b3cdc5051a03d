"""Compiles in worker processes: a compiler's native crash (a segfault or abort in libtpu or XLA:GPU) ends one
compile, not the run.

A search that compiles many candidates for a topology (the fit's mesh search, :func:`jaxckpt.fit.search_meshes`)
meets compilers that crash on some of them: libtpu's SparseCore code generation overflowed its stack on one mesh of
the Mixtral 8x7B search and took the whole process with it. A crash in native code cannot be caught in the process
it happens in (a signal handler cannot resume a compiler whose state is gone), so inside :func:`isolated_compiles`
every topology compile runs in a worker process instead: the parent lowers the step as always and hands the worker
exactly what JAX would hand the compiler (the StableHLO module and XLA's ``CompileOptions``,
:func:`jaxckpt.analysis._internals.compile_request`); the worker loads the same topology, compiles, and sends back
what the tools read of the executable (memory stats, cost analysis, program text, the compiler's log). A worker that
dies raises :class:`CompilerCrashError` for that compile, naming the signal and the compiler's last words (its log
kept on disk), and a fresh worker takes the next compile. The results are the same (checked: the same memory stats,
cost analysis and program text as a compile in the process).

Workers are started on first use, one per compile running at once (the fit's ``jobs``), and reused: a worker's
start-up (importing JAX, loading the topology, about 3 s) is paid once per search, not per compile. They ignore
Ctrl-C (the parent ends them) and end with the parent.

Fault injection: ``JAXCKPT_CRASH_COMPILE_ON_MESH=<mesh>`` (e.g. ``data=2,fsdp=2``) makes a worker ``os.abort()``
when asked to compile over that mesh, the way tests and ``benchmarks/faults.py`` show a crash handled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxckpt.analysis._internals import compile_request, compile_serialized
from jaxckpt.errors import JaxckptError
from jaxckpt.schema import MEMORY_FIELDS
from jaxckpt.sharding import format_mesh, get_topology, mesh_shape
from jaxckpt.sharding._topology import topology_of
from jaxckpt.training._xla import compiler_log_lines

CRASH_ENV = "JAXCKPT_CRASH_COMPILE_ON_MESH"
"""Fault injection: a worker asked to compile over this mesh (its text, ``data=2,fsdp=2``) calls ``os.abort()``."""


class CompilerCrashError(JaxckptError):
  """The compiler crashed (the worker process compiling died of a signal or exited): the message names the signal,
  the mesh and the compiler's last log line, and where its whole log is kept."""


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

  def __init__(self, mesh: Any, memory: Mapping[str, int], cost: Mapping[str, float], text: str,
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


class _Worker:
  """One worker process and the pipe to it."""

  def __init__(self, logs: str, stderr: int):
    parent_read, child_write = os.pipe()
    child_read, parent_write = os.pipe()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    self.process = subprocess.Popen(
        [sys.executable, "-c", f"from jaxckpt.step._isolated import serve; serve({child_read}, {child_write})"],
        pass_fds=(child_read, child_write), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=stderr)
    os.close(child_read)
    os.close(child_write)
    self.send, self.recv = Connection(parent_write, readable=False), Connection(parent_read, writable=False)
    self.logs = logs

  def call(self, request: dict[str, Any]) -> Any:
    """Sends ``request``; returns the worker's answer, or raises ``EOFError`` when it died."""
    self.send.send(request)
    return self.recv.recv()

  def end(self) -> None:
    """Ends the worker (it holds nothing worth keeping)."""
    for conn in (self.send, self.recv):
      conn.close()
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()


class _Pool:
  """Workers started on demand, one per compile at once; a dead one is replaced by the next compile's."""

  def __init__(self):
    self.logs = tempfile.mkdtemp(prefix="jaxckpt-compiles-")
    self.stderr = os.dup(2)  # the real stderr: a worker started while a compile captures fd 2 must not inherit that
    self.idle: list[_Worker] = []
    self.everyone: set[_Worker] = set()
    self.lock = threading.Lock()
    self.count = 0

  def start(self, count: int) -> None:
    """Starts ``count`` idle workers (they import JAX while the caller traces its first step)."""
    for _ in range(count):
      worker = _Worker(self.logs, self.stderr)
      with self.lock:
        self.everyone.add(worker)
        self.idle.append(worker)

  def compile(self, lowered: Any, options: Mapping[str, Any], mesh: Any) -> CompiledInWorker:
    module, compile_options = compile_request(lowered, options)
    name = topology_of(mesh)
    with self.lock:
      self.count += 1
      log = os.path.join(self.logs, f"compile-{self.count}.log")
      worker = self.idle.pop() if self.idle else None
    if worker is None:
      worker = _Worker(self.logs, self.stderr)
      with self.lock:
        self.everyone.add(worker)
    shape = format_mesh(mesh_shape(mesh))
    request = {"topology": name, "devices": [d.id for d in mesh.devices.flat], "module": module,
               "compile_options": compile_options, "mesh": shape, "log": log,
               "platform": next(iter(mesh.devices.flat)).platform}
    try:
      answer = worker.call(request)
    except (EOFError, OSError):
      with self.lock:
        self.everyone.discard(worker)
      worker.end()
      message = _crash_message(worker.process.returncode, shape, log)
      if os.path.exists(log) and not os.path.getsize(log):
        os.remove(log)  # nothing said: nothing to keep
      raise CompilerCrashError(message) from None
    with self.lock:
      self.idle.append(worker)
    with contextlib.suppress(OSError):
      os.remove(log)
    if "error" in answer:
      raise jax.errors.JaxRuntimeError(answer["error"])
    return CompiledInWorker(mesh, answer["memory"], answer["cost"], answer["text"], tuple(answer["log"]))

  def close(self) -> None:
    with self.lock:
      workers, self.everyone, self.idle = list(self.everyone), set(), []
    for worker in workers:
      worker.end()
    fd, self.stderr = self.stderr, -1
    if fd >= 0:
      os.close(fd)
    with contextlib.suppress(OSError):
      if not os.listdir(self.logs):  # crash logs are kept (their messages name them); nothing else is
        shutil.rmtree(self.logs, ignore_errors=True)


def _crash_message(code: int | None, mesh: str, log: str) -> str:
  """``compiler crashed (SIGABRT) compiling over mesh data=2,fsdp=2: <its last log line>; its log: <path>``."""
  if code is not None and code < 0:
    how = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else f"signal {-code}"
  else:
    how = f"exit status {code}"
  try:
    with open(log, errors="replace") as f:
      lines = [line.strip() for line in f.read().splitlines() if line.strip()]
  except OSError:
    lines = []
  last = next((line for line in reversed(lines) if not line.startswith(("***", "@", "PC:", "Fatal Python error",
                                                                         "Current thread", "Thread 0x", "  File",
                                                                         "Extension modules"))), "")
  return (f"compiler crashed ({how}) compiling over mesh {mesh}" + (f": {last[:200]}" if last else "")
          + (f"; its log: {log}" if lines else ""))


_POOL: _Pool | None = None
_DEPTH = 0
_POOL_LOCK = threading.Lock()


@contextlib.contextmanager
def isolated_compiles(*, workers: int = 1) -> Iterator[None]:
  """Inside it, every compile for a topology's compile-only devices runs in a worker process (module docstring);
  the workers end with it. Nested uses share one pool.

  Args:
    workers: workers started at once (their start-up overlaps the caller's tracing); more start when more compiles
      run at once.
  """
  global _POOL, _DEPTH
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = _Pool()
      _POOL.start(workers)
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
  """Ends every worker now (a Ctrl-C: the parent exits without waiting on their compiles)."""
  pool = _POOL
  if pool is not None:
    pool.close()


def compile_lowered(lowered: Any, options: Mapping[str, Any], mesh: Any) -> Any:
  """``lowered.compile(compiler_options=options)``, in a worker process when :func:`isolated_compiles` is on and
  ``mesh`` is over a topology's compile-only devices (a :class:`CompiledInWorker` then), else in this process.

  Raises:
    CompilerCrashError: the worker died (the compiler crashed). Whatever the compiler raises (a
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
  started = time.perf_counter()
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
          "text": "\n\n".join(m.to_string() for m in executable.hlo_modules()),
          "seconds": time.perf_counter() - started}


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
  """File descriptor 2 into ``path`` while the block runs (a crash leaves the compiler's last words there); after it,
  the text is written to the real stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 2)
  os.close(fd)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def serve(read_fd: int, write_fd: int) -> None:
  """A worker's loop: answer compile requests from the parent until it closes the pipe."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
  receive, reply = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
  while True:
    try:
      request = receive.recv()
    except (EOFError, OSError):
      return
    with _stderr_to(request["log"]):
      answer = _answer(request)
    try:
      with open(request["log"], errors="replace") as f:
        text = f.read()
    except OSError:
      text = ""
    if text:
      sys.stderr.write(text)
      sys.stderr.flush()
    answer["log"] = compiler_log_lines(text) if request["platform"] == "gpu" else []
    reply.send(answer)
