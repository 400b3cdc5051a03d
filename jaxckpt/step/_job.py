"""A compile job: what a tool compiles and where, resolved once at its entry and handed down whole.

MaxText makes its ``config`` and ``topology_mesh`` once in ``train_compile.py`` and hands them to each stage;
torchtitan's ``JobConfig`` is the same idea. Here :func:`compile_job` turns the keywords an API user gives
(``mesh=``, ``topology=``, ``memory_fraction=``, ``tx=``, ``compiler_options=``) into one frozen
:class:`CompileJob`: the placement resolved (:func:`jaxckpt.sharding.resolve_placement`), the target's batch checked
against the mesh, and a run of steps beside a mesh or a topology refused (:func:`runs_beside_refusal`, the one
wording of that refusal, in Python names here and in flags at a CLI's door). Below the entry points
(:func:`jaxckpt.report.build_report`, :func:`jaxckpt.planner.plan_policy`, ...) the job is read, never rebuilt from
its parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jaxckpt.errors import JaxckptError, TopologyError
from jaxckpt.sharding import MemoryFraction, Placement, Topology, TopologyName, format_mesh, resolve_placement
from jaxckpt.step._build import default_optimizer
from jaxckpt.step._targets import Target


def runs_beside_refusal(runs: str, *, topology: str | None = None, mesh: str | None = None) -> JaxckptError:
  """The one refusal of a run of steps beside a topology or a mesh, in the caller's names.

  Args:
    runs: what runs steps, as the caller named it: ``"measure=True"`` (an API keyword) or ``"--measure"`` (a flag).
    topology: the topology given, as named: ``"topology='h100:8'"`` or ``"--topology h100:8"``.
    mesh: the mesh given (when no topology is), as named: ``"mesh='data=4'"`` or ``"--mesh"``.

  Returns:
    The error to raise: a :class:`~jaxckpt.errors.TopologyError` beside a topology (nothing here to run on), a
    :class:`~jaxckpt.errors.JaxckptError` beside a mesh (steps run on one device).
  """
  if topology is not None:
    return TopologyError(f"{runs} runs steps on this machine, but {topology} compiles for hardware that is not here: "
                         "there is nothing to run them on (drop one of them)")
  return JaxckptError(f"{runs} runs each policy on one device; it does not take {mesh} (drop one of them)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileJob:
  """What a tool compiles and where, resolved once (:func:`compile_job`).

  Attributes:
    target: the :class:`~jaxckpt.step.ModelTarget` or :class:`~jaxckpt.step.LossTarget` compiled.
    placement: where (:class:`~jaxckpt.sharding.Placement`: the mesh, the topology it is laid over, a GPU's memory
      fraction).
    tx: the optimizer of the train step (its state counts in the footprint).
    compiler_options: extra XLA options, or ``None`` (jaxckpt's for the platform,
      :func:`jaxckpt.step.step_compiler_options`).
  """

  target: Target
  placement: Placement
  tx: optax.GradientTransformation
  compiler_options: Mapping[str, Any] | None = None

  @property
  def mesh(self) -> Mesh | None:
    """The placement's mesh (``None``: one device, unsharded)."""
    return self.placement.mesh

  @property
  def topology(self) -> Topology | None:
    """The placement's topology (``None``: this machine's devices)."""
    return self.placement.topology


def compile_job(target: Target, *,
                mesh: str | Mapping[str, int] | Mesh | Placement | None = None,
                topology: str | TopologyName | Topology | None = None,
                memory_fraction: float | MemoryFraction | None = None,
                tx: optax.GradientTransformation | None = None,
                compiler_options: Mapping[str, Any] | None = None,
                runs: str | None = None,
                check_batch: bool = True) -> CompileJob:
  """The :class:`CompileJob` of an entry point's keywords: the placement resolved, the batch checked, a run of
  steps beside a mesh or topology refused.

  Args:
    target: what to compile.
    mesh: a ``--mesh`` spec (``"data=4,fsdp=2"``), ``{axis: size}``, a ``jax.sharding.Mesh``, a
      :class:`~jaxckpt.sharding.Placement` (taken as it is), or ``None`` (a topology: every chip on ``data``; else
      one device, unsharded).
    topology: a TPU slice or GPU cluster to compile for without its hardware (``"v5e:2x2"``, ``"h100:8"``).
    memory_fraction: a GPU topology's share of memory XLA may use (:func:`jaxckpt.sharding.memory_fraction`).
    tx: the optimizer (default :func:`jaxckpt.step.default_optimizer`).
    compiler_options: extra XLA options.
    runs: what runs steps on this machine, as the caller's keyword (``"measure=True"``), or ``None``: refused
      beside a topology or a mesh.
    check_batch: check that the target's batch splits over the mesh's batch axes (``False`` where the caller
      chooses the batch sizes itself: the fit).

  Returns:
    The frozen :class:`CompileJob`.

  Raises:
    TopologyError: ``runs`` beside a topology; a bad topology, its compiler missing.
    MeshSpecError: a bad mesh, one that does not cover the devices, or a batch it cannot split.
    JaxckptError: ``runs`` beside a mesh; a bad memory fraction, or one given where no GPU is compiled for.
  """
  given = mesh.topology if isinstance(mesh, Placement) else topology
  if given is not None and runs is not None:
    name = given.name if isinstance(given, (Topology, TopologyName)) else str(given)
    raise runs_beside_refusal(runs, topology=f"topology={name!r}")
  placement = resolve_placement(mesh, topology, memory_fraction=memory_fraction)
  if placement.mesh is not None:
    if check_batch:
      for size in sorted({a.shape[0] for a in jax.tree.leaves(target.batch) if len(a.shape)}):
        placement.check_batch_size(size)
    if runs is not None:
      raise runs_beside_refusal(runs, mesh=f"mesh={format_mesh(placement.mesh)!r}")
  return CompileJob(target=target, placement=placement, tx=tx or default_optimizer(),
                    compiler_options=compiler_options)
