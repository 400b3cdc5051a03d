"""Compiled statistics kept across runs for compiles JAX's persistent cache cannot keep: TPU and GPU topology compiles.

JAX's persistent compilation cache stores executables; for a topology's compile-only devices it writes them but
cannot load them back (jax 0.10.2: "PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable"), so every ``--topology`` run compiled everything again — minutes per program for an
LLM on a 256-chip slice. What the tools read of such a compile is small: its memory stats, XLA's cost analysis and
the seconds it took, or the compiler's refusal (a program over the chip's HBM). This cache keeps exactly that. Beside
the statistics it keeps the compiled program's text (``compiled.as_text()``, gzip-compressed, ``<key>.hlo.gz``): what
the step-time model reads (:mod:`jaxckpt.timing`); an entry written before the text was kept has none
(:attr:`CachedStats.has_program`).

**The key** (:func:`cache_key`) is a hash of everything that changes the compiled program, as JAX's own cache key
(``jax._src.cache_key``) hashes it: the lowered program's text (StableHLO with its shardings and mesh); the compile
options (jaxckpt's and the caller's, :func:`jaxckpt.step.step_compiler_options`, whatever they hold); the
``CompileOptions`` JAX builds for the compile (its executable build options from JAX's configuration, the debug options
XLA parsed from ``XLA_FLAGS``, the device assignment; :func:`jaxckpt.analysis._internals.compile_request`); the
environment the compilers read (:data:`COMPILER_ENV`: ``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``, libtpu's ``TPU_*``, XLA's
memory fraction and allocator variables); the compilers and their versions (:data:`COMPILER_PACKAGES`: jax, jaxlib,
libtpu, the CUDA plugin, and the backend's own version string); the target (platform, device kind and count, XLA's
fingerprint of the topology, a GPU's target config, ``gpu_specs/*.txtpb``, with its memory size). The memory fraction
a tool is given (``--memory-fraction``) is not read by a compile for a topology, only by jaxckpt's verdict after it,
so it is not in the key; the environment's fraction is.

**Entries are checked on read.** An entry is one small JSON file (and the program's text beside it), written to a
temporary file in the same directory, flushed to disk and renamed into place (``os.replace``), the text before the
JSON that names it; a failed write removes its temporary file. A file that does not parse, or parses to the wrong
types (``"memory": null`` without an error, ``"temp_bytes": "lots"``), or whose program text is damaged, is a miss:
one warning names it, it is removed, and the compile runs afresh and writes it again. Temporary files left by a run
that was killed (``kill -9``) or stopped by a full disk are removed when a later run opens the cache (a writer's
own, named with its host and process id, once that process is gone; any after :data:`STALE_TMP_S`). A cache that
cannot be written warns once per run (:class:`StatsCacheWarning`) and the run goes on without it.

Where: ``JAXCKPT_STATS_CACHE`` names the directory, ``off`` (or ``0``) disables it; unset,
``$XDG_CACHE_HOME/jaxckpt/compiled-stats`` (``~/.cache/...``).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import math
import os
import socket
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Any

from jax.sharding import Mesh

from jaxckpt.analysis._internals import compile_request, topology_fingerprint
from jaxckpt.schema import MEMORY_KEYS
from jaxckpt.sharding._topology import target_config, topology_of

ENV = "JAXCKPT_STATS_CACHE"
"""Environment variable: the cache directory, or ``off``/``0`` to disable it."""

_VERSION = 3
"""Bumped when an entry's fields change meaning (2: a host-offload compile's ``temp_bytes`` no longer holds its host
bytes, :data:`jaxckpt.training._xla.PEAK_TEMP_BACKENDS`; 3: the key holds the environment, the compile options JAX
builds, the compiler packages and the target)."""

COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                     "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvcc")
"""The distributions whose versions are in the key: JAX, jaxlib (XLA:CPU), libtpu (the TPU compiler), JAX's CUDA
plugin (XLA:GPU) and the CUDA compiler it calls (``ptxas``); a missing one is ``None``."""

COMPILER_ENV = ("XLA_", "LIBTPU_", "TPU_", "TF_XLA_FLAGS")
"""Prefixes of the environment variables in the key: ``XLA_FLAGS`` (XLA), ``LIBTPU_INIT_ARGS`` and libtpu's ``TPU_*``
(the TPU compiler), ``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_*`` (the
memory fraction and allocator). Less :data:`KEY_FREE_ENV` and the ``XLA_FLAGS`` words of :data:`KEY_FREE_FLAGS`."""

KEY_FREE_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
"""Variables jaxckpt itself sets for a TPU topology (:func:`jaxckpt.sharding.get_topology`) that change no compiled
program (measured: the same stats under another accelerator type); in the key they would only make the first
topology a process loads differ from a later one."""

KEY_FREE_FLAGS = ("--xla_dump", "--xla_force_host_platform_device_count", "--xla_gpu_cuda_data_dir")
"""``XLA_FLAGS`` words that change no compiled program (dumps, the host platform's device count, where CUDA lives):
left out of the key, as JAX's own key leaves them (``jax._src.cache_key.xla_flags_to_exclude_from_cache_key``)."""

STALE_TMP_S = 3600.0
"""Age, seconds, past which a temporary file of another host's writer is taken as left behind and removed."""

_TMP = ".tmp-"
"""Prefix of the temporary files (``.tmp-<host>-<pid>-<random><suffix>``)."""


class StatsCacheWarning(RuntimeWarning):
  """The compiled-stats cache could not be written, or held a damaged entry: one line, once per run (per directory
  and kind), naming the directory or the entry and what was done."""


@dataclasses.dataclass(frozen=True)
class CachedStats:
  """What a cached compile left.

  Attributes:
    memory: memory stats (keys :data:`jaxckpt.schema.MEMORY_KEYS`, bytes), or ``None`` for a refused compile.
    cost: XLA's cost analysis (``{"flops": ..., "bytes accessed": ...}``), ``{}`` where it had none.
    compile_s: seconds the compile took when it ran.
    error: the compiler's refusal (its message), or ``None``.
    has_program: the compiled program's text is kept beside the entry (:meth:`StatsCache.program_text`).
  """

  memory: Mapping[str, int | None] | None
  cost: Mapping[str, float]
  compile_s: float
  error: str | None = None
  has_program: bool = False


def _version(package: str) -> str | None:
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


@functools.lru_cache(maxsize=1)
def compiler_versions() -> dict[str, str | None]:
  """``{distribution: version}`` of :data:`COMPILER_PACKAGES` (read once per process)."""
  return {p: _version(p) for p in COMPILER_PACKAGES}


def compiler_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment variables the compilers read (:data:`COMPILER_ENV`), less those that change no program
  (:data:`KEY_FREE_ENV`, :data:`KEY_FREE_FLAGS`); ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` as their sorted words.

  Args:
    environ: the environment (default ``os.environ``).
  """
  environ = os.environ if environ is None else environ
  out = {}
  for name in sorted(environ):
    if not name.startswith(COMPILER_ENV) or name in KEY_FREE_ENV:
      continue
    value = environ[name]
    if name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TF_XLA_FLAGS"):
      value = " ".join(sorted(w for w in value.split() if not w.split("=")[0].startswith(KEY_FREE_FLAGS)))
    out[name] = value
  return out


def cache_key(program_text: str, options: Mapping[str, Any], *, platform: str, device_kind: str,
              device_count: int, target: Mapping[str, Any] | None = None, compile_options: bytes = b"",
              environ: Mapping[str, str] | None = None, versions: Mapping[str, str | None] | None = None) -> str:
  """The key of a compile: sha256 of every input that changes the compiled program (module docstring).

  Args:
    program_text: the lowered module's text (``Lowered.as_text()``).
    options: the XLA options it is compiled with (any keys and values: each value hashed with its type).
    platform, device_kind, device_count: what it is compiled for.
    target: the rest of the target (:func:`target_of`: the backend's version, the topology's fingerprint, a GPU's
      target config), ``None`` = none.
    compile_options: the serialized ``CompileOptions`` JAX builds for it, in the form to hash
      (:func:`jaxckpt.analysis._internals.compile_request` with ``for_key=True``); ``b""`` = none.
    environ: the environment (default ``os.environ``; :func:`compiler_environment` reads it).
    versions: ``{distribution: version}`` (default :func:`compiler_versions`).

  Returns:
    64 hexadecimal digits.
  """
  head = json.dumps({"v": _VERSION, "options": {k: f"{type(v).__name__}:{v}" for k, v in sorted(options.items())},
                     "platform": platform, "device_kind": device_kind, "devices": device_count,
                     "target": dict(target or {}), "env": compiler_environment(environ),
                     "versions": dict(compiler_versions() if versions is None else versions)},
                    sort_keys=True, default=str)
  digest = hashlib.sha256(head.encode())
  digest.update(hashlib.sha256(compile_options).digest())
  digest.update(program_text.encode())
  return digest.hexdigest()


def target_of(mesh: Mesh) -> dict[str, Any]:
  """What a compile is for beyond platform, kind and count: the backend's version string (libtpu's build, the CUDA
  plugin's), XLA's fingerprint of the topology (chips, coordinates, links), the topology's name and, for a GPU, the
  sha256 of its target config (``GpuTargetConfigProto``: the GPU's memory size, SM count, ...)."""
  devices = list(mesh.devices.flat)
  out: dict[str, Any] = {"backend": getattr(getattr(devices[0], "client", None), "platform_version", None),
                         "topology": topology_fingerprint(devices), "name": topology_of(devices)}
  if devices[0].platform == "gpu" and out["name"] is not None:
    out["target_config"] = hashlib.sha256(target_config(out["name"].split(":")[0]).encode()).hexdigest()
  return out


def compile_key(lowered: Any, options: Mapping[str, Any], mesh: Mesh, *, platform: str, device_kind: str,
                device_count: int) -> str:
  """:func:`cache_key` of ``lowered.compile(compiler_options=options)`` over ``mesh`` (a topology's mesh): the
  lowered text, ``options``, the ``CompileOptions`` JAX builds, the environment, versions and :func:`target_of`."""
  _, built = compile_request(lowered, options, for_key=True)
  return cache_key(lowered.as_text(), options, platform=platform, device_kind=device_kind, device_count=device_count,
                   target=target_of(mesh), compile_options=built)


_WARNED: set[tuple[str, str]] = set()
"""``(directory, kind)`` pairs warned about in this process: one warning per run."""
_SWEPT: set[str] = set()
"""Directories whose left-behind temporary files this process has removed."""
_LOCK = threading.Lock()


def _warn_once(directory: str, kind: str, message: str) -> None:
  with _LOCK:
    if (directory, kind) in _WARNED:
      return
    _WARNED.add((directory, kind))
  warnings.warn(StatsCacheWarning(message), stacklevel=3)


def _checked(data: Any, has_text: bool) -> CachedStats:
  """The entry a parsed JSON file holds, or ``ValueError`` naming what is wrong with it."""
  if not isinstance(data, dict):
    raise ValueError(f"a JSON {type(data).__name__}, not an object")
  memory, cost, seconds, error = data.get("memory"), data.get("cost") or {}, data.get("compile_s"), data.get("error")
  if error is not None and not isinstance(error, str):
    raise ValueError(f"error is {error!r}, not text")
  if memory is None and error is None:
    raise ValueError("no memory stats and no error")
  if memory is not None:
    if not isinstance(memory, dict) or not memory or any(k not in MEMORY_KEYS for k in memory):
      raise ValueError(f"memory is {str(memory)[:80]!r}, not a mapping of {', '.join(MEMORY_KEYS[:2])}, ...")
    bad = {k: v for k, v in memory.items() if v is not None and (type(v) is not int or v < 0)}
    if bad:
      raise ValueError(f"memory {', '.join(f'{k}={v!r}' for k, v in bad.items())} is not a byte count")
  if not isinstance(cost, dict) or any(type(v) not in (int, float) or not math.isfinite(v) for v in cost.values()):
    raise ValueError(f"cost is {str(cost)[:80]!r}, not a mapping of numbers")
  if type(seconds) not in (int, float) or not math.isfinite(seconds) or seconds < 0:
    raise ValueError(f"compile_s is {seconds!r}, not seconds")
  return CachedStats(memory, {str(k): float(v) for k, v in cost.items()}, float(seconds), error,
                     bool(data.get("has_program")) and has_text)


class StatsCache:
  """A directory of compiled statistics, one JSON file per key (module docstring).

  Args:
    directory: where the entries live (created on first write).
  """

  def __init__(self, directory: str):
    self.directory = directory
    self.hits = 0
    self.misses = 0
    self.damaged = 0
    self._sweep()

  def _path(self, key: str, suffix: str = ".json") -> str:
    return os.path.join(self.directory, key[:2], key + suffix)

  def program_path(self, key: str) -> str:
    """Where the compiled program's text of ``key`` is kept (gzip-compressed HLO text)."""
    return self._path(key, ".hlo.gz")

  def program_text(self, key: str) -> str | None:
    """The compiled program's text kept for ``key`` (``compiled.as_text()``), or ``None`` (none kept, unreadable)."""
    return read_program(self.program_path(key))

  def get(self, key: str) -> CachedStats | None:
    """The entry of ``key``, or ``None``: a missing entry is a miss; so is a damaged one (it does not parse, holds
    the wrong types, or the program text it says it has does not decompress: empty, truncated, not gzip), which is
    removed with one warning naming it.

    Args:
      key: the entry's key (:func:`cache_key`).
    """
    path = self._path(key)
    try:
      with open(path, encoding="utf-8") as f:
        raw = f.read()
    except FileNotFoundError:
      self.misses += 1
      return None
    except OSError as err:
      self.misses += 1
      _warn_once(self.directory, "read", f"the compiled-stats cache entry {path} cannot be read ({_reason(err)}); "
                                         "compiling afresh")
      return None
    has_text = os.path.exists(self.program_path(key))
    try:
      entry = _checked(json.loads(raw), has_text)
      if entry.has_program and not read_program(self.program_path(key)):  # missing, damaged or empty
        raise ValueError(f"its program text {self.program_path(key)} does not decompress")
    except ValueError as err:  # json.JSONDecodeError is a ValueError
      self._discard(key, path, str(err).splitlines()[0] if str(err) else "empty")
      self.misses += 1
      return None
    self.hits += 1
    return entry

  def _discard(self, key: str, path: str, reason: str) -> None:
    """Removes a damaged entry (and its program text) and warns once per run, naming it."""
    self.damaged += 1
    for target in (path, self.program_path(key)):
      try:
        os.remove(target)
      except OSError:
        pass
    _warn_once(self.directory, "damaged", f"the compiled-stats cache entry {path} was damaged ({reason[:160]}); "
                                          "removed it, compiling afresh")

  def put(self, key: str, entry: CachedStats, *, program_text: str | None = None) -> None:
    """Writes ``entry`` atomically (a temporary file in the same directory, flushed to disk, renamed into place), and
    ``program_text`` (the compiled program's HLO text) compressed beside it first, so an entry that says it has its
    text has it. A write that fails removes its temporary file; a directory that cannot be written (permissions, a
    full disk) warns once per run (:class:`StatsCacheWarning`, naming it and :data:`ENV`) and the run goes on
    without the entry."""
    path = self._path(key)
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      if program_text is not None:
        with _replacing(self.program_path(key), "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as f:
          f.write(program_text.encode())
        entry = dataclasses.replace(entry, has_program=True)
      with _replacing(path, "w") as f:
        json.dump(dataclasses.asdict(entry), f)
    except OSError as err:
      _warn_once(self.directory, "write", f"the compiled-stats cache {self.directory} cannot be written "
                                          f"({_reason(err)}): this run's topology compiles will run again next time; "
                                          f"set {ENV} to a writable directory, or {ENV}=off")

  def _sweep(self) -> None:
    """Removes the temporary files writers left behind (module docstring), once per process per directory."""
    with _LOCK:
      if self.directory in _SWEPT:
        return
      _SWEPT.add(self.directory)
    for path in _temporaries(self.directory):
      if _left_behind(path):
        try:
          os.remove(path)
        except OSError:
          pass


def _reason(err: OSError) -> str:
  return (err.strerror or str(err) or type(err).__name__).lower()


def _temporaries(directory: str) -> Iterator[str]:
  try:
    shards = [e.path for e in os.scandir(directory) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
  except OSError:
    return
  for shard in shards:
    try:
      yield from (e.path for e in os.scandir(shard) if e.name.startswith(_TMP))
    except OSError:
      continue


def _left_behind(path: str) -> bool:
  """Whether a temporary file's writer is gone: this host's process that named it no longer runs, or (another host's)
  it is older than :data:`STALE_TMP_S`."""
  parts = os.path.basename(path)[len(_TMP):].split("-")
  if len(parts) >= 3 and parts[0] == _host() and parts[1].isdigit():
    try:
      os.kill(int(parts[1]), 0)
    except ProcessLookupError:
      return True
    except OSError:  # a process of another user: alive
      return False
    return _age(path) > STALE_TMP_S  # a live writer's (or a reused process id's, once old)
  return _age(path) > STALE_TMP_S


def _age(path: str) -> float:
  try:
    return time.time() - os.stat(path).st_mtime
  except OSError:
    return 0.0


@functools.lru_cache(maxsize=1)
def _host() -> str:
  return socket.gethostname().replace("-", "_") or "host"


class _replacing:  # noqa: N801 - a context manager used like open()
  """``with _replacing(path, mode) as f``: a file written to a temporary beside ``path`` (named with this host and
  process), flushed and fsync'ed, then renamed over ``path``; on any error the temporary is removed."""

  def __init__(self, path: str, mode: str):
    self.path, self.mode = path, mode

  def __enter__(self):
    suffix = os.path.basename(self.path)[-8:]
    fd, self.tmp = tempfile.mkstemp(prefix=f"{_TMP}{_host()}-{os.getpid()}-", suffix=suffix,
                                    dir=os.path.dirname(self.path))
    self.file = os.fdopen(fd, self.mode, **({} if "b" in self.mode else {"encoding": "utf-8"}))
    return self.file

  def __exit__(self, kind, value, traceback):
    done = False
    try:
      if kind is None:
        self.file.flush()
        os.fsync(self.file.fileno())
      self.file.close()
      if kind is None:
        os.replace(self.tmp, self.path)
        done = True
    finally:
      if not done:
        self.file.close()
        try:
          os.remove(self.tmp)
        except OSError:
          pass
    return False


def read_program(path: str) -> str | None:
  """The gzip-compressed program text at ``path``, or ``None`` where it is missing or unreadable (truncated, not
  gzip, not UTF-8)."""
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      return f.read()
  except (OSError, EOFError, UnicodeDecodeError, zlib.error):
    return None


def stats_cache() -> StatsCache | None:
  """The cache :envvar:`JAXCKPT_STATS_CACHE` names (default ``$XDG_CACHE_HOME/jaxckpt/compiled-stats``), or ``None``
  when it is ``off``/``0``."""
  value = os.environ.get(ENV)
  if value is not None and value.strip().lower() in ("off", "0", "false", "no", ""):
    return None
  if value is None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    value = os.path.join(base, "jaxckpt", "compiled-stats")
  return StatsCache(value)

