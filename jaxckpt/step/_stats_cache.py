"""Compiled statistics kept across runs for compiles JAX's persistent cache cannot keep: TPU topology compiles.

JAX's persistent compilation cache stores executables; for a TPU topology's compile-only devices it writes them but
cannot load them back (jax 0.10.2: "PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable"), so every ``--topology`` run compiled everything again — minutes per program for an
LLM on a 256-chip slice. What the tools read of such a compile is small: its memory stats, XLA's cost analysis and
the seconds it took, or the compiler's refusal (a program over the chip's HBM). This cache keeps exactly that, keyed
by what decides it: the lowered program's text (StableHLO with its shardings and mesh), the compiler options, the
platform, device kind and device count, and the versions of jax, jaxlib and libtpu. Beside the statistics it keeps
the compiled program's text (``compiled.as_text()``, gzip-compressed, ``<key>.hlo.gz``): what the step-time model
reads (:mod:`jaxckpt.timing`); an entry written before the text was kept has none (:attr:`CachedStats.has_program`).

Entries are one small JSON file each (and the program's text beside it), written to a temporary file and renamed
into place (``os.replace``), the text before the JSON that names it: a run stopped by Ctrl-C, or two runs at once,
never leave a torn entry, and a file that does not parse is a miss. Where:
``JAXCKPT_STATS_CACHE`` names the directory, ``off`` (or ``0``) disables it; unset, ``$XDG_CACHE_HOME/jaxckpt/
compiled-stats`` (``~/.cache/...``).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import jax

ENV = "JAXCKPT_STATS_CACHE"
"""Environment variable: the cache directory, or ``off``/``0`` to disable it."""

_VERSION = 2
"""Bumped when an entry's fields change meaning (2: a host-offload compile's ``temp_bytes`` no longer holds its host
bytes, :data:`jaxckpt.training._xla.PEAK_TEMP_BACKENDS`)."""


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


def cache_key(program_text: str, options: Mapping[str, Any], *, platform: str, device_kind: str,
              device_count: int) -> str:
  """The key of a compile: sha256 of the program, options, platform, device kind and count, and library versions.

  Args:
    program_text: the lowered module's text (``Lowered.as_text()``).
    options: the XLA options it is compiled with.
    platform, device_kind, device_count: what it is compiled for.
  """
  head = json.dumps({"v": _VERSION, "options": {k: str(v) for k, v in sorted(options.items())},
                     "platform": platform, "device_kind": device_kind, "devices": device_count,
                     "jax": jax.__version__, "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu")},
                    sort_keys=True)
  digest = hashlib.sha256(head.encode())
  digest.update(program_text.encode())
  return digest.hexdigest()


class StatsCache:
  """A directory of compiled statistics, one JSON file per key (module docstring).

  Args:
    directory: where the entries live (created on first write).
  """

  def __init__(self, directory: str):
    self.directory = directory
    self.hits = 0
    self.misses = 0
    self._warned = False

  def _path(self, key: str, suffix: str = ".json") -> str:
    return os.path.join(self.directory, key[:2], key + suffix)

  def program_path(self, key: str) -> str:
    """Where the compiled program's text of ``key`` is kept (gzip-compressed HLO text)."""
    return self._path(key, ".hlo.gz")

  def program_text(self, key: str) -> str | None:
    """The compiled program's text kept for ``key`` (``compiled.as_text()``), or ``None`` (none kept, unreadable)."""
    return read_program(self.program_path(key))

  def get(self, key: str) -> CachedStats | None:
    """The entry of ``key``, or ``None`` (a missing or unreadable entry is a miss)."""
    try:
      with open(self._path(key), encoding="utf-8") as f:
        data = json.load(f)
      entry = CachedStats(data["memory"], data.get("cost") or {}, float(data["compile_s"]), data.get("error"),
                          bool(data.get("has_program")) and os.path.exists(self.program_path(key)))
    except (OSError, ValueError, KeyError, TypeError):
      self.misses += 1
      return None
    self.hits += 1
    return entry

  def put(self, key: str, entry: CachedStats, *, program_text: str | None = None) -> None:
    """Writes ``entry`` atomically (a temporary file renamed into place), and ``program_text`` (the compiled
    program's HLO text) compressed beside it first, so an entry that says it has its text has it. A directory that
    cannot be written warns once (``RuntimeWarning`` naming it and :data:`ENV`) and the run goes on without the
    entry."""
    path = self._path(key)
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      if program_text is not None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".hlo.gz", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as f:
          f.write(program_text.encode())
        os.replace(tmp, self.program_path(key))
        entry = dataclasses.replace(entry, has_program=True)
      fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(entry), f)
      os.replace(tmp, path)
    except OSError as err:
      if not self._warned:
        self._warned = True
        warnings.warn(f"the compiled-stats cache {self.directory} cannot be written ({err}): this run's topology "
                      f"compiles will run again next time; set {ENV} to a writable directory, or {ENV}=off",
                      RuntimeWarning, stacklevel=2)


def read_program(path: str) -> str | None:
  """The gzip-compressed program text at ``path``, or ``None`` where it is missing or unreadable."""
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      return f.read()
  except (OSError, EOFError, UnicodeDecodeError):
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
