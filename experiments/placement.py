"""Where a run's arrays live: one device, or sharded over a device mesh, possibly across processes."""

from __future__ import annotations

import dataclasses
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

  def loss(self, loss_fn: Callable) -> Callable:
    """``loss_fn`` computing with the parameters all-gathered over ``fsdp`` (:func:`jaxckpt.sharding.gathered_params`);
    itself without a mesh."""
    return sharding.gather_params_in_loss(loss_fn, self.mesh)

  def step_kwargs(self, state: Any, batch: Any, model: Any) -> dict[str, Any]:
    """``in_shardings``/``out_shardings`` of the train step (none without a mesh)."""
    return {} if self.mesh is None else sharding.step_shardings(state, batch, self.mesh, model=model)

  def batches(self, batch_at: Callable[[int], Any], state: Any, model: Any
              ) -> tuple[Callable[[int], Any], Any, dict[str, Any]]:
    """``(batch_at, example, step_kwargs)``: ``batch_at`` placing each host batch on the mesh, the batch of step
    0 (placed) and the train step's shardings; the host ``batch_at``, its batch and ``{}`` without a mesh."""
    placed = batch_at if self.mesh is None else (lambda step: self.batch(batch_at(step)))
    example = placed(0)
    return placed, example, self.step_kwargs(state, example, model)

  def check_policy(self, spec: Any) -> None:
    """Raises :class:`JaxckptError` for a budget with a mesh: plans are made for one device."""
    if self.mesh is not None and isinstance(spec, jaxckpt.policies.Budget):
      raise JaxckptError(f"--policy {spec} plans for one device; with --mesh give a per-block or layered policy "
                         "(plan it with jaxckpt-plan first)")

  def check_batch_size(self, batch_size: int, flag: str = "--batch-size") -> None:
    """Raises :class:`MeshSpecError` when the batch does not split over the mesh."""
    if self.mesh is not None:
      sharding.check_batch_size(batch_size, self.mesh, flag=flag)

  def describe(self) -> dict[str, Any]:
    """``{"mesh": {axis: size} | None, "device_count", "process_count"}`` for metrics.json."""
    return {"mesh": None if self.mesh is None else sharding.mesh_shape(self.mesh),
            "device_count": jax.device_count() if self.mesh is not None else 1,
            "process_count": jax.process_count()}


def setup_placement(options: RunOptions) -> Placement:
  """Joins the multi-process run (``--coordinator``) and builds the ``--mesh``; call before any JAX computation.

  Raises:
    MeshSpecError: bad ``--mesh``/``--coordinator``/``--num-processes``/``--process-id``.
  """
  if options.coordinator is not None:
    sharding.initialize_distributed(options.coordinator, num_processes=options.num_processes,
                                    process_id=options.process_id)
  return Placement(None if options.mesh is None else sharding.make_mesh(options.mesh))
