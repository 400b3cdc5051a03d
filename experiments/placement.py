"""Where a run's arrays live: one device, or sharded over a device mesh, possibly across processes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax

import jaxckpt
from experiments.options import RunOptions
from jaxckpt import sharding
from jaxckpt.errors import JaxckptError

__all__ = ["Placement", "setup_placement"]


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a run's arrays live: one device (``mesh`` is ``None``), or sharded over a mesh (:mod:`jaxckpt.sharding`).

  Attributes:
    mesh: the device mesh, or ``None``.
  """

  mesh: Any = None

  def state(self, state: Any, model: Any) -> Any:
    """The train state placed on the mesh (parameters and Adam moments by the FSDP rule); unchanged without one."""
    if self.mesh is None:
      return state
    return sharding.shard_state(state, sharding.state_shardings(state, self.mesh, model=model))

  def batch(self, batch: Any) -> Any:
    """A global host batch as global arrays; each process transfers only the rows its devices hold."""
    if self.mesh is None:
      return batch
    size = jax.tree.leaves(batch)[0].shape[0]
    return sharding.shard_batch(batch, self.mesh, global_batch_size=size)

  def batches(self, batch_at: Callable[[int], Any]) -> Callable[[int], Any]:
    """``batch_at`` placing each host batch on the mesh (:meth:`batch`); ``batch_at`` itself without a mesh. (The
    train step's shardings come from the step core: :func:`jaxckpt.step.compile_policy` with this ``mesh``.)"""
    return batch_at if self.mesh is None else (lambda step: self.batch(batch_at(step)))

  def check_policy(self, spec: Any) -> None:
    """Raises :class:`JaxckptError` for a budget with a mesh: plans are made for one device."""
    if self.mesh is not None and isinstance(spec, jaxckpt.Budget):
      raise JaxckptError(f"--policy {spec} plans for one device; with --mesh give a per-block or layered policy "
                         "(plan it with jaxckpt-plan first)")

  def check_batch_size(self, batch_size: int, flag: str = "batch_size") -> None:
    """Raises :class:`MeshSpecError` when the batch does not split over the mesh."""
    if self.mesh is not None:
      sharding.check_batch_size(batch_size, self.mesh, flag=flag)

  def describe(self) -> dict[str, Any]:
    """``{"mesh": {axis: size} | None, "device_count", "process_count"}`` for metrics.json."""
    return {"mesh": None if self.mesh is None else sharding.mesh_shape(self.mesh),
            "device_count": jax.device_count() if self.mesh is not None else 1,
            "process_count": jax.process_count()}


EXIT_LOST_PEER = 1
"""The exit status of a process whose run lost another process (:func:`watch_peers`)."""

_WATCH: list[sharding.PeerWatch] = []


def _lost(line: str) -> None:
  """A lost process ends this one at once: one line, no traceback, no wait for JAX's shutdown barrier."""
  try:
    os.write(2, (line + "; resume every process with --resume\n").encode())
  finally:
    os._exit(EXIT_LOST_PEER)


def watch_peers() -> None:
  """Starts this process's :class:`jaxckpt.sharding.PeerWatch` (once): a lost process of the run ends this one within
  seconds, with one line (:func:`await_lost_peer` holds a collective's error back meanwhile)."""
  if not _WATCH and jax.process_count() > 1:
    _WATCH.append(sharding.PeerWatch(_lost).start())


def await_lost_peer() -> None:
  """In a multi-process run, gives the peer watch time to find a lost process before an error is reported (a
  collective fails at once when a peer dies; the watch then ends this process with its one line instead)."""
  if _WATCH:
    _WATCH[0].await_loss()


def setup_placement(options: RunOptions) -> Placement:
  """Joins the multi-process run (``--coordinator``) and builds the ``--mesh``; call before any JAX computation.

  Raises:
    MeshSpecError: bad ``--mesh``/``--coordinator``/``--num-processes``/``--process-id``.
  """
  if options.coordinator is not None:
    sharding.initialize_distributed(options.coordinator, num_processes=options.num_processes,
                                    process_id=options.process_id)
    watch_peers()
  return Placement(None if options.mesh is None else sharding.make_mesh(options.mesh))
