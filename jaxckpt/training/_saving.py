"""Saving and resuming the train state with orbax, refusing to overwrite or mix runs; holding a run's directories.

Each checkpoint step holds the :class:`~jaxckpt.training._train.TrainState` (orbax ``StandardSave``; restores bit-identically)
and the run's config as JSON. Saves are synchronous: the train step donates its state, so the arrays must be written
before the next step reuses their buffers. orbax writes each step to a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it when complete, so a half-written step is never listed; the
temporary directories a killed save leaves behind are deleted when the directory is opened again. A step that is
listed but cannot be read (corrupted on disk) is skipped with a warning in favour of the previous good one, and moved
aside (renamed ``<step>.corrupt-<UTC time>``, kept for inspection, never deleted) so that the resumed run's save of
that step lands. A save that is asked for and writes nothing raises instead of returning quietly.

:class:`DirectoryLock` holds a directory for one run (``filelock``: an OS ``flock`` on ``DIR/.jaxckpt.lock``), so
a second run started into the same directories is refused at once, naming the holder.

**Each step is verified on restore.** orbax checks the index of its files (a CRC32C of the zarr shard index) but
not the array data: a flipped bit inside a data file restores silently as a wrong value (one flipped bit changed 62
of 67 parameter leaves of a resumed run, and the run went on). So every save also writes, as a JSON item of the same
orbax step (committed with it, atomically), a checksum of each saved array (:func:`array_checksums`: 64 bits per
array, a sum of mixed 32-bit words, equal whatever the array's sharding); a restore recomputes them, and a step whose
arrays do not match is named corrupt, skipped and moved aside like an unreadable one, and the resume falls back to the
newest step that verifies. A step saved before checksums were written restores unverified. A save that fails (a full
disk) raises one :class:`~jaxckpt.errors.CheckpointError` line naming the step and the reason, its unfinished
directory removed.

Multi-process runs (``jax.distributed``, :mod:`jaxckpt.sharding`): every process creates the same
:class:`TrainStateSaver` on a directory they all see and calls the same methods in the same order; orbax writes each
array's shards from the process that holds them and the metadata and JSON items from process 0, and a restore places
every array on the template's sharding (so a state saved under one mesh restores onto the current one). Only process
0 deletes unfinished saves.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import filelock
import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.errors import CheckpointError, DirectoryInUseError

TMP_MARKER = ".orbax-checkpoint-tmp"
"""Part of the name of orbax's temporary directories (an unfinished save)."""
CORRUPT_MARKER = ".corrupt-"
"""Part of the name a step that cannot be read is moved aside to (``<step>.corrupt-<UTC time>``)."""
LOCK_NAME = ".jaxckpt.lock"
"""The lock file :class:`DirectoryLock` holds in a directory; the holder's pid, host and start time are in
``LOCK_NAME + ".owner"`` beside it."""
_STEP_RE = re.compile(r"\d+\Z")
_TMP_RE = re.compile(r"\d+" + re.escape(TMP_MARKER))
_CORRUPT_RE = re.compile(r"\d+" + re.escape(CORRUPT_MARKER))


def _ours(entry: str) -> bool:
  """Whether a directory entry is something this module writes (a step, an unfinished or moved-aside step, a lock)."""
  return bool(_STEP_RE.match(entry) or TMP_MARKER in entry or _CORRUPT_RE.match(entry) or entry.startswith(LOCK_NAME))


def check_checkpoint_directory(directory: str | os.PathLike) -> None:
  """Raises :class:`CheckpointError` when ``directory`` cannot be a checkpoint directory (call it before writing).

  Args:
    directory: the checkpoint directory; it need not exist.

  Raises:
    CheckpointError: the path exists and is not a directory, or the directory is not empty and holds no checkpoints
      (it belongs to something else).
  """
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise CheckpointError(f"checkpoint path {directory} exists and is not a directory")
  entries = os.listdir(directory) if os.path.isdir(directory) else []
  foreign = sorted(e for e in entries if not _ours(e))
  if foreign and not any(_STEP_RE.match(e) for e in entries):
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    raise CheckpointError(
        f"checkpoint directory {directory} is not empty and holds no checkpoints (found {shown}); "
        "choose a new or empty ckpt_dir"
    )


_MIX = (0x85EBCA6B, 0xC2B2AE35)
"""murmur3's 32-bit finalizer constants (``fmix32``, Austin Appleby's MurmurHash3): every input bit flips about half
the output bits."""
_SEEDS = (0x9E3779B9, 0x7F4A7C15)
"""The two lanes' seeds (64 bits of checksum per array)."""
CHECKSUMS_ITEM = "checksums"
"""The orbax item of a step that holds its arrays' checksums (JSON: ``{leaf path: "<method>:<16 hex digits>"}``)."""


def _fmix(x):
  x = x ^ (x >> jnp.uint32(16))
  x = x * jnp.uint32(_MIX[0])
  x = x ^ (x >> jnp.uint32(13))
  x = x * jnp.uint32(_MIX[1])
  return x ^ (x >> jnp.uint32(16))


def _words(x):
  """An array's bits as 32-bit words (``uint32``, flat): narrower items widened, 8-byte items split in two."""
  if x.dtype == bool:
    return x.reshape(-1).astype(jnp.uint32)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.concatenate([_words(x.real), _words(x.imag)])
  kind = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, kind).astype(jnp.uint32).reshape(-1)


@jax.jit
def _spread_checksum(x):
  """``uint32[2]`` of one array, computed where its shards are: per lane, the wrapping sum over elements of
  ``fmix(word ^ fmix(index + seed))``; a sum is exact in any order, so it is the same whatever the sharding."""
  words = _words(x)
  index = jnp.arange(words.shape[0], dtype=jnp.uint32)
  return jnp.stack([jnp.sum(_fmix(words ^ _fmix(index + jnp.uint32(seed))), dtype=jnp.uint32) for seed in _SEEDS])


def _leaf_checksum(x: Any, method: str | None = None) -> str | None:
  """``"blake2b:<hex>"`` of an array this process holds whole (its C-order bytes, dtype and shape), ``"sum64:<hex>"``
  of one spread over processes (:func:`_spread_checksum`); ``method`` asks for one (``None`` where it cannot be
  computed here: a ``blake2b`` of an array this process does not hold whole)."""
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  whole = not isinstance(x, jax.Array) or x.is_fully_addressable
  method = method or ("blake2b" if whole else "sum64")
  if method == "blake2b":
    if not whole:
      return None
    host = np.ascontiguousarray(np.asarray(x))
    digest = hashlib.blake2b(f"{host.dtype.str}{host.shape}".encode(), digest_size=8)
    digest.update(memoryview(host.reshape(-1).view(np.uint8)))
    return f"blake2b:{digest.hexdigest()}"
  value = np.asarray(_spread_checksum(x).addressable_data(0))
  return "sum64:" + "".join(f"{int(v):08x}" for v in value)


def array_checksums(tree: Any, methods: Mapping[str, str] | None = None) -> dict[str, str | None]:
  """A 64-bit checksum of each array leaf of ``tree`` (parameters, optimizer state, step), by leaf path
  (``jax.tree_util.keystr``).

  An array this process holds whole (every single-process run) is hashed on the host: BLAKE2b (``hashlib``, 8 bytes)
  of its bytes in C order, its dtype and shape, so a sharded array gives the same checksum on any mesh. An array spread
  over processes is summed where it lies: per lane of two, the wrapping 32-bit sum over its elements of murmur3's
  finalizer of the element's bits xor the finalized index (a flipped bit always changes it; a sum does not depend on
  its order, so again any mesh gives the same).

  Args:
    tree: a pytree of arrays (``jax.Array``, NumPy, scalars; typed PRNG keys by their key data).
    methods: per path, the method of a saved checksum to recompute (``"blake2b"`` or ``"sum64"``); default: as
      above.

  Returns:
    ``{path: "blake2b:0123456789abcdef"}`` in leaf order; ``None`` for a leaf whose saved method cannot be computed
    here (a ``blake2b`` array that is now spread over processes).
  """
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    out[name] = _leaf_checksum(leaf, (methods or {}).get(name))
  return out


def _utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _HeldLogs(logging.Filter):
  """Holds back what orbax logs (absl's logger) while a save runs: a failed save logs the same error from each of its
  threads with a traceback (~330 lines on a full disk) before it raises; :meth:`release` logs them after a save that
  succeeded, and they are dropped when the save raised (its one-line error says it)."""

  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    self.records.append(record)
    return False

  def release(self) -> None:
    for name in _HELD_LOGGERS:
      logging.getLogger(name).removeFilter(self)
    for record in self.records:
      logging.getLogger(record.name).handle(record)
    self.records = []


@contextlib.contextmanager
def _held_logs():
  held = _HeldLogs()
  for name in _HELD_LOGGERS:
    logging.getLogger(name).addFilter(held)
  try:
    yield held
  finally:
    for name in _HELD_LOGGERS:
      logging.getLogger(name).removeFilter(held)


_HELD_LOGGERS = ("absl", "asyncio")
"""What a save logs through: orbax (absl's logger) and its event loops (asyncio's: "Future exception was never
retrieved" for each abandoned write of a failed save)."""


def _drain_abandoned_writes(settle_s: float = 0.5) -> None:
  """After a failed save: lets the writes orbax abandoned finish in TensorStore's threads and collects their
  coroutines and futures now, while their reports are held (else they print at interpreter exit)."""
  time.sleep(settle_s)
  gc.collect()
  gc.collect()


class _HeldUnraisables:
  """Holds back the unraisable errors (``sys.unraisablehook``) reported while a save runs: :meth:`release` reports
  them after a save that succeeded; after a failed one they are orbax's abandoned writes
  (:func:`_quiet_abandoned_writes`)."""

  def __init__(self):
    self.held: list[Any] = []
    self.previous = sys.unraisablehook

  def __call__(self, unraisable: Any) -> None:
    self.held.append(unraisable)

  def release(self) -> None:
    for unraisable in self.held:
      sys.unraisablehook(unraisable)
    self.held = []


@contextlib.contextmanager
def _held_unraisables():
  held = _HeldUnraisables()
  sys.unraisablehook = held
  try:
    yield held
  finally:
    sys.unraisablehook = held.previous


def _quiet_abandoned_writes(directory: str, reason: str) -> None:
  """After a failed save, the array writes orbax abandoned go on reporting, one traceback each (dozens on a full
  disk), until the interpreter exits: TensorStore's threads into the event loop orbax closed (``RuntimeError: Event
  loop is closed``, through ``sys.unraisablehook``), their coroutines when collected at exit, and asyncio's "Task
  exception was never retrieved" naming the failed step's directory or the failure (``reason``: "No space left on
  device"). From here on those are dropped; every other report goes through as before."""
  previous = sys.unraisablehook

  def hook(unraisable):
    value, where = unraisable.exc_value, getattr(unraisable.object, "__qualname__", "")
    abandoned = ((isinstance(value, RuntimeError) and str(value) == "Event loop is closed")
                 or "async_serialize" in where or "write_fragment" in where)
    if not abandoned:
      previous(unraisable)

  sys.unraisablehook = hook

  class Abandoned(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
      message = record.getMessage()
      return not ("exception was never retrieved" in message and (directory in message or reason in message))

  logging.getLogger("asyncio").addFilter(Abandoned())


class DirectoryLock:
  """Holds a directory for one run: a second run asking for it is refused at once, naming the holder.

  The lock is ``filelock``'s (on Linux and macOS an ``flock(2)`` on ``DIR/.jaxckpt.lock``); the holder's pid, host,
  start time and command line are written beside it (``.jaxckpt.lock.owner``) and removed on release. The operating
  system drops an ``flock`` when its process dies, so a lock left by a killed run (``kill -9``, a crash, a lost
  node) is stale: the next run takes it over at once and says whose it was. Network file systems without ``flock``
  make filelock fall back to its soft lock, which a killed run leaves held; delete ``.jaxckpt.lock`` by hand then.

  Args:
    directory: the directory to hold (created if missing).
    flag: the CLI flag that named it (for messages), e.g. ``"--ckpt-dir"``.

  Attributes:
    stale: after :meth:`acquire`, the owner line of a run that died holding the lock, or ``None``.
  """

  def __init__(self, directory: str | os.PathLike, *, flag: str):
    self.directory = os.path.abspath(os.fspath(directory))
    self.flag = flag
    self.stale: str | None = None
    self._lock = filelock.FileLock(os.path.join(self.directory, LOCK_NAME), timeout=0)
    self._owner = os.path.join(self.directory, LOCK_NAME + ".owner")

  def _holder(self) -> str:
    try:
      with open(self._owner) as f:
        owner = json.load(f)
      return f"pid {owner['pid']} on host {owner['host']}, started {owner['started']}"
    except (OSError, ValueError, KeyError, TypeError):
      return "holder unknown: no readable .jaxckpt.lock.owner"

  def acquire(self) -> "DirectoryLock":
    """Takes the lock without waiting and writes the owner file.

    Returns:
      ``self``.

    Raises:
      DirectoryInUseError: another live process holds the directory (the message names its pid, host and start
        time).
    """
    os.makedirs(self.directory, exist_ok=True)
    try:
      self._lock.acquire()
    except filelock.Timeout:
      raise DirectoryInUseError(
          f"{self.flag} {self.directory} is in use by another run ({self._holder()}); wait for it to finish or "
          f"choose another {self.flag}"
      ) from None
    if os.path.exists(self._owner):  # the last holder died without releasing: the OS dropped its flock
      self.stale = self._holder()
    with open(self._owner, "w") as f:
      json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": _utc_now(),
                 "command": sys.argv}, f)
    return self

  def release(self) -> None:
    """Removes the owner file and releases the lock (idempotent)."""
    if self._lock.is_locked:
      try:
        os.remove(self._owner)
      except OSError:
        pass
      self._lock.release()


class TrainStateSaver:
  """A run's checkpoint directory: save every ``save_every`` steps, resume from the latest complete step.

  Args:
    directory: checkpoint directory (created if missing).
    config: the run-defining config (JSON-serialisable; e.g. model, data, seed, batch size, optimizer). Resuming
      from a directory whose stored config differs is refused, naming the differing keys.
    save_every: save when ``step % save_every == 0`` (steps ≥ 1).
    resume: continue from the latest checkpoint if there is one. Without it, a directory that already holds
      checkpoints is refused, so an existing run is never overwritten.
    max_to_keep: complete checkpoints kept (older ones are deleted after a newer one is complete).
    allow_config_change: resume even if the stored config differs (the differences become :attr:`warnings`).

  Attributes:
    warnings: things the user should hear about (cleaned-up temporary directories, skipped and moved-aside corrupt
      steps, config differences allowed), one line each.

  Raises:
    CheckpointError: ``save_every`` < 1; the directory holds checkpoints and ``resume`` is false; the directory is
      not empty but holds no checkpoints (it is not a checkpoint directory); its stored config differs from
      ``config``; or the path exists and is not a directory.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      config: Mapping[str, Any],
      save_every: int,
      resume: bool,
      max_to_keep: int = 3,
      allow_config_change: bool = False,
  ):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  (only runs that save pay its import)

    if save_every < 1:
      raise CheckpointError(f"checkpoint interval {save_every} must be ≥ 1 step")
    self.directory = os.path.abspath(os.fspath(directory))
    check_checkpoint_directory(self.directory)
    self.config = dict(config)
    self.save_every = save_every
    self.allow_config_change = allow_config_change
    self.warnings: list[str] = []
    entries = os.listdir(self.directory) if os.path.isdir(self.directory) else []
    unfinished = sorted(e for e in entries if _TMP_RE.match(e))
    self._written: set[int] = set()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
        ),
    )
    for name in unfinished if jax.process_index() == 0 else ():  # orbax's own cleanup runs in a thread that may
      shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)  # not finish; one process deletes
    if unfinished:
      self.warnings.append(
          f"deleted {len(unfinished)} unfinished save(s) left by an interrupted run in {self.directory}: "
          + ", ".join(unfinished)
      )
    latest = self._manager.latest_step()
    if latest is not None and not resume:
      raise CheckpointError(
          f"checkpoint directory {self.directory} already holds a run (latest step {latest}); pass resume=True to "
          "continue it, or choose another ckpt_dir"
      )
    self.latest_step = latest

  def restore(self, state: Any) -> tuple[Any, dict[str, Any]]:
    """Returns the latest readable checkpoint's ``(state, meta)``, or ``(state, {})`` if there is none.

    Steps are tried newest first; a step that cannot be read, or whose arrays do not match the checksums saved with
    them (:func:`array_checksums`), is skipped with a line in :attr:`warnings`. Once an older step restores and
    verifies (so the template is right and the newer ones are damaged), the skipped steps are moved aside
    to ``<step>.corrupt-<UTC time>`` (kept, not deleted), so that saving those steps again writes them.

    Args:
      state: a template :class:`~jaxckpt.training._train.TrainState` (arrays or ``jax.ShapeDtypeStruct``s); sharded arrays
        are restored with the same shardings (each process reads its own shards).

    Returns:
      The restored state, structured like ``state``, and the JSON ``meta`` saved with it (e.g. metric history).
      :attr:`latest_step` is set to the step restored.

    Raises:
      CheckpointError: the stored config differs from this run's (unless ``allow_config_change``), or no listed step
        can be read.
    """
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return state, {}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    errors = []
    for step in steps:
      try:
        items = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        )
        self._check_config(dict(items.config))
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        corrupt = self._unverified(step, restored.state)
      except CheckpointError:
        raise
      except Exception as err:  # noqa: BLE001 - orbax raises many types; name the directory and step instead
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        errors.append(f"step {step}: {reason}")
        self.warnings.append(f"checkpoint step {step} in {self.directory} cannot be read ({reason}); trying older")
        continue
      if corrupt is not None:
        errors.append(f"step {step}: corrupt ({corrupt})")
        self.warnings.append(f"checkpoint step {step} in {self.directory} is corrupt: {corrupt}; trying older")
        continue
      self.latest_step = step
      self._move_aside([s for s in steps if s > step])
      return restored.state, dict(items.meta)
    raise CheckpointError(f"no checkpoint in {self.directory} can be read: {'; '.join(errors)}")

  def _unverified(self, step: int, state: Any) -> str | None:
    """What is wrong with the restored arrays of ``step`` against the checksums saved with it (which arrays differ),
    or ``None`` when they match (or the step was saved without checksums)."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    if not os.path.isdir(os.path.join(self.directory, str(step), CHECKSUMS_ITEM)):
      return None
    saved = dict(self._manager.restore(step, args=ocp.args.Composite(
        **{CHECKSUMS_ITEM: ocp.args.JsonRestore()})).get(CHECKSUMS_ITEM))
    now = array_checksums(state, {k: str(v).split(":")[0] for k, v in saved.items()})
    bad = sorted(k for k, v in now.items() if v is not None and saved.get(k) != v)
    missing = sorted(set(saved) ^ set(now))
    if not bad and not missing:
      return None
    shown = ", ".join((bad + missing)[:3]) + (", ..." if len(bad) + len(missing) > 3 else "")
    return (f"{len(bad) + len(missing)} of {len(saved)} arrays differ from the checksums saved with them ({shown})"
            if not missing else f"its arrays are not those saved with it ({shown})")

  def _move_aside(self, steps: list[int]) -> None:
    """Renames unreadable steps ``<step>.corrupt-<time>`` (process 0) and forgets them."""
    if not steps:
      return
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    moved = []
    for step in steps:
      target = f"{step}{CORRUPT_MARKER}{stamp}"
      if jax.process_index() == 0:
        os.rename(os.path.join(self.directory, str(step)), os.path.join(self.directory, target))
      moved.append(target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process runs only

      multihost_utils.sync_global_devices("jaxckpt-move-aside")
    self._manager.reload()
    self.warnings.append(f"moved the unreadable step(s) aside in {self.directory}, kept for inspection: "
                         + ", ".join(moved))

  def _check_config(self, stored: dict[str, Any]) -> None:
    differing = sorted(k for k in set(stored) | set(self.config) if stored.get(k) != self.config.get(k))
    if not differing:
      return
    details = ", ".join(f"{k}: saved {stored.get(k)!r} vs now {self.config.get(k)!r}" for k in differing)
    if not self.allow_config_change:
      raise CheckpointError(
          f"checkpoint directory {self.directory} is from a different run ({details}); use another ckpt_dir, or "
          "allow_config_change=True to resume it anyway"
      )
    self.warnings.append(f"resuming {self.directory} with a changed config ({details})")

  def maybe_save(self, step: int, state: Any, *, meta: Mapping[str, Any] | None = None, force: bool = False) -> bool:
    """Saves ``state`` (and JSON ``meta``) as checkpoint ``step`` if ``step`` is a multiple of ``save_every``.

    Args:
      step: the state's step count.
      state: the pytree to save.
      meta: JSON-serialisable run metadata to save beside it (e.g. per-epoch losses).
      force: save whatever the step (e.g. at the end of training).

    Returns:
      Whether a checkpoint was written: ``False`` only when ``step`` is not due (and not forced) or this saver
      already wrote that very step.

    Raises:
      CheckpointError: the directory already holds step ``step`` or a later one that this saver did not write (it
        would not be written, or not be the latest), the save failed (a full disk: one line, its unfinished directory
        removed), or the save finished without the step on disk.
    """
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    if not force and step % self.save_every:
      return False
    if step in self._written:
      return False
    ahead = [s for s in self._manager.all_steps() if s >= step]
    if ahead:
      raise CheckpointError(
          f"cannot save step {step} in {self.directory}: it already holds step(s) {sorted(ahead)} that this run did "
          "not write (another run writing there?); nothing was overwritten"
      )
    items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(self.config),
             "meta": ocp.args.JsonSave(dict(meta or {})), CHECKSUMS_ITEM: ocp.args.JsonSave(array_checksums(state))}
    failure = None
    with _held_logs() as held, _held_unraisables() as unraisables:
      try:
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
      except Exception as err:  # noqa: BLE001 - orbax and TensorStore raise many types (a full disk among them)
        failure = err
        _drain_abandoned_writes()  # their reports land here, held, and are dropped with the held logs
    if failure is not None:
      self._failed_save(step, failure)  # one line: orbax's logged tracebacks of the same error are dropped
    held.release()
    unraisables.release()
    self._manager.reload()
    if step not in self._manager.all_steps():
      raise CheckpointError(f"saving step {step} in {self.directory} finished but the step is not on disk")
    self._written.add(step)
    return True

  def _failed_save(self, step: int, err: BaseException) -> None:
    """Removes what a failed save of ``step`` left (its unfinished directory) and raises one line naming the step,
    the directory and the reason (a full disk: "no space left on device")."""
    if jax.process_index() == 0:
      for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
        if name == str(step) or name.startswith(f"{step}{TMP_MARKER}"):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    text = str(err)
    full = "No space left" in text or getattr(err, "errno", None) == errno.ENOSPC
    reason = "no space left on device" if full else (text.strip().splitlines() or [type(err).__name__])[0][:200]
    _quiet_abandoned_writes(self.directory, "No space left on device" if full else reason)
    latest = max((s for s in self._manager.all_steps() if s != step), default=None)
    kept = f"the last complete checkpoint is step {latest}" if latest is not None else "no earlier checkpoint exists"
    raise CheckpointError(f"saving checkpoint step {step} in {self.directory} failed ({reason}); {kept}; free space "
                          "or choose another ckpt_dir") from None

  def latest_saved_step(self) -> int | None:
    """The newest complete checkpoint step on disk, or ``None``."""
    return self._manager.latest_step()

  def close(self) -> None:
    """Waits for pending writes and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()


Checkpointer = TrainStateSaver
"""The old name of :class:`TrainStateSaver` (kept so that existing code imports)."""
