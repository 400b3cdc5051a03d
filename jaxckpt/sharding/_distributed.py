"""Multi-process runs: ``jax.distributed`` over several processes (or hosts), the rows of the global batch each
process feeds, and a check that replicas agree.

:func:`initialize_distributed` starts ``jax.distributed.initialize`` with JAX's gloo CPU collectives on CPU, so N
processes on one machine (or N hosts of a GPU/TPU pod slice) form one mesh over all their devices; each process feeds
the rows of the global batch its devices hold (:func:`process_rows`, :func:`shard_batch`). Because the loss is one
global mean over the *global* batch and the gradient is taken of that one function, there is no per-replica gradient
to synchronise by hand, so the failure mode of PyTorch DDP + gradient checkpointing + a multi-task loss (hooks firing
twice or never, replicas drifting apart) has nothing to act on here; :func:`replica_mismatches` checks it.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxckpt.analysis._internals import distributed_client
from jaxckpt.errors import MeshSpecError, shorten
from jaxckpt.sharding._mesh import check_batch_size, format_mesh
from jaxckpt.sharding._state import batch_sharding, path_names

def process_rows(global_batch_size: int, mesh: Mesh) -> slice:
  """The rows of the global batch this process's devices hold (what it must feed), as a slice of axis 0.

  Args:
    global_batch_size: examples per step over all processes.
    mesh: the mesh.

  Raises:
    MeshSpecError: the batch does not split over the mesh, or this process's rows are not contiguous (a mesh
      whose device order interleaves processes on the batch axes).
  """
  check_batch_size(global_batch_size, mesh)
  sharding = batch_sharding(mesh)
  spans = sorted({(i[0].start or 0, global_batch_size if i[0].stop is None else i[0].stop)
                  for i in sharding.addressable_devices_indices_map((global_batch_size,)).values()})
  start, stop = spans[0][0], spans[-1][1]
  if sum(b - a for a, b in spans) != stop - start:
    raise MeshSpecError(f"process {jax.process_index()}'s devices hold non-contiguous batch rows {spans} under "
                        f"mesh={format_mesh(mesh)!r}")
  return slice(start, stop)


def shard_batch(batch: Any, mesh: Mesh, *, global_batch_size: int, local: bool = False) -> Any:
  """Turns host batch arrays into global ``jax.Array``s split over the batch axes.

  Args:
    batch: pytree of host arrays ``[B, ...]`` (the global batch) or, with ``local=True``, ``[B_p, ...]`` = the
      rows :func:`process_rows` names for this process.
    mesh: the mesh.
    global_batch_size: B, examples per step over all processes.
    local: ``batch`` holds only this process's rows.

  Returns:
    The global batch; each process transferred only its own rows
    (``jax.make_array_from_process_local_data``).

  Raises:
    MeshSpecError: B does not split over the mesh.
  """
  rows = process_rows(global_batch_size, mesh)

  def put(a):
    a = np.asarray(a)
    local_rows = a if local else a[rows]
    return jax.make_array_from_process_local_data(batch_sharding(mesh, a.ndim), local_rows,
                                                  (global_batch_size, *a.shape[1:]))

  return jax.tree.map(put, batch)


INIT_TIMEOUT_S = 120
"""Seconds a process waits for the others (and for the coordinator) in :func:`initialize_distributed`."""


def initialize_distributed(coordinator: str, *, num_processes: int, process_id: int) -> None:
  """Joins a multi-process JAX run: ``jax.distributed.initialize`` (gloo collectives on CPU).

  Call it before anything touches a JAX device. On CPU it selects JAX's gloo collectives
  (``jax_cpu_collectives_implementation``) so processes on one machine can all-reduce; on GPU/TPU JAX picks NCCL /
  ICI itself. Calling it again with the same settings is a no-op.

  Args:
    coordinator: ``HOST:PORT`` of process 0 (it listens there; the others connect).
    num_processes: N ≥ 1.
    process_id: this process, 0..N−1.

  Raises:
    MeshSpecError: a malformed ``coordinator``, ``num_processes`` < 1, ``process_id`` out of range, a second
      call with other settings, or the processes not all joining within :data:`INIT_TIMEOUT_S` seconds.
  """
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise MeshSpecError(f"bad coordinator={shorten(coordinator)!r}: write 'HOST:PORT', e.g. 'localhost:12345'")
  if num_processes < 1:
    raise MeshSpecError(f"num_processes={num_processes} must be ≥ 1")
  if not 0 <= process_id < num_processes:
    raise MeshSpecError(f"process_id={process_id} is out of range for num_processes={num_processes}: "
                        f"valid ids are 0..{num_processes - 1}")
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
      raise MeshSpecError(f"this process already joined a run as process {jax.process_index()} of "
                          f"{jax.process_count()}; cannot rejoin as {process_id} of {num_processes}")
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  print(f"process {process_id} of {num_processes}: joining the run at {coordinator} (waits up to "
        f"{INIT_TIMEOUT_S} s for the other processes)", file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=INIT_TIMEOUT_S)
  except Exception as err:  # noqa: BLE001 - JAX raises runtime errors of several types on a failed join
    raise MeshSpecError(f"process {process_id} could not join the run at {coordinator} within {INIT_TIMEOUT_S} s "
                        f"(are all {num_processes} processes started with the same coordinator?): "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None


HEARTBEAT_S = 0.5
"""Seconds between a process's heartbeats in :class:`PeerWatch`."""
LOST_AFTER_S = 5.0
"""Seconds without a heartbeat after which :class:`PeerWatch` takes a process as lost: long beside a heartbeat (the
beating thread needs the GIL, which a compile or a collective releases), short beside JAX's own detection (its
``heartbeat_timeout_seconds``, 100 s by default, after which the survivors abort)."""
_DONE = "done"


class PeerWatch:
  """Watches the other processes of a ``jax.distributed`` run, so that a lost one (``kill -9``, a crash, a lost host)
  ends the others within seconds, each with one line, instead of a collective's traceback, a stall until JAX's
  heartbeat timeout and an abort.

  A thread writes this process's heartbeat (a counter) to the distributed key-value store every
  :data:`HEARTBEAT_S` and reads the others'; a process whose counter stays still for :data:`LOST_AFTER_S` is lost, and
  so is the coordinator (process 0, which holds the store) once the store stops answering. ``on_lost`` is then called
  from the thread with one line saying which. A process that ends its run says so first (:meth:`stop`), and is not
  taken as lost.

  Args:
    on_lost: called once with the line (a program ends its process there, ``os._exit``).
    lost_after_s: seconds without a heartbeat that make a process lost.
  """

  def __init__(self, on_lost: Callable[[str], None], *, lost_after_s: float = LOST_AFTER_S):
    self.on_lost, self.lost_after_s = on_lost, lost_after_s
    self.me, self.count = jax.process_index(), jax.process_count()
    self._client = distributed_client()
    self._stopped = threading.Event()
    self._lost = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxckpt peer watch", daemon=True)
    atexit.register(self.stop)  # before JAX's shutdown (atexit runs last-registered first)

  def start(self) -> "PeerWatch":
    """Starts the thread; returns ``self``."""
    self._thread.start()
    return self

  def _run(self) -> None:
    seen = {p: (None, time.monotonic()) for p in range(self.count) if p != self.me}
    beat = 0
    while not self._stopped.wait(HEARTBEAT_S if beat else 0):
      beat += 1
      try:
        self._client.key_value_set(f"jaxckpt/alive/{self.me}", str(beat), allow_overwrite=True)
        values = {k.rsplit("/", 1)[-1]: v for k, v in self._client.key_value_dir_get("jaxckpt/alive/")}
      except Exception as err:  # noqa: BLE001 - the store is process 0's: it is gone
        if not self._stopped.is_set():
          reason = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
          self._lose(f"lost the run's coordinator, process 0 ({reason})")
        return
      now = time.monotonic()
      for peer, (last, since) in list(seen.items()):
        value = values.get(str(peer))
        if value == _DONE:
          del seen[peer]
        elif value != last:
          seen[peer] = (value, now)
        elif now - since > self.lost_after_s:
          self._lose(f"lost process {peer} (no heartbeat for {self.lost_after_s:g} s: killed, crashed or its host "
                     "is gone)")
          return

  def _lose(self, what: str) -> None:
    try:
      self.on_lost(f"process {self.me} of {self.count}: {what}; stopping this process too")
    finally:
      self._lost.set()  # after on_lost: a program's ends the process before a waiting error is reported

  def stop(self) -> None:
    """Says this process has ended its run (others do not take it as lost) and stops the thread (idempotent)."""
    if self._stopped.is_set():
      return
    self._stopped.set()
    try:
      self._client.key_value_set(f"jaxckpt/alive/{self.me}", _DONE, allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the store may be gone already
      pass

  def await_loss(self, slack_s: float = 10.0) -> bool:
    """Waits (at most :data:`LOST_AFTER_S` and ``slack_s`` more, for a loaded machine) for the thread to find a lost
    process: what a collective's error in the main thread usually means; ``True`` if it did (``on_lost`` has run)."""
    return self._lost.wait(self.lost_after_s + slack_s) if self._thread.is_alive() else self._lost.is_set()


def replica_mismatches(tree: Any) -> list[str]:
  """Names the arrays whose replicas differ between this process's devices (all in sync: ``[]``).

  Every device holding the same slice of an array (a replica, e.g. each ``data`` rank's copy of a parameter) must
  hold the same bytes; this is the check a DDP gradient-synchronisation bug would fail.

  Args:
    tree: pytree of ``jax.Array`` (e.g. ``state.params``).

  Returns:
    One ``"path: slice"`` line per array slice whose copies are not bit-identical.
  """
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    copies: dict[str, np.ndarray] = {}
    for shard in leaf.addressable_shards:
      key = str(shard.index)
      data = np.asarray(shard.data)
      if key in copies and not np.array_equal(copies[key], data):
        bad.append(f"{'/'.join(path_names(path))}: {key}")
      copies.setdefault(key, data)
  return bad


def gather(tree: Any) -> Any:
  """The full value of every array on the host (numpy), also when its shards live in other processes.

  Uses ``jax.experimental.multihost_utils.process_allgather`` for arrays not fully addressable here (every process
  must call it), ``jax.device_get`` for the rest.
  """
  from jax.experimental import multihost_utils

  def one(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return jax.device_get(leaf)

  return jax.tree.map(one, tree)
