"""Compiling a run's train step once, through the step core, and saying what was compiled (policy, memory, time)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

import jaxckpt
from jaxckpt.analysis import collectives_by_axis, describe_collectives, read_compiled
from jaxckpt.rendering import memory_table, policy_summary
from jaxckpt.step import ModelTarget, compile_policy
from jaxckpt import sharding

__all__ = ["CompiledStep", "compile_and_describe"]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A compiled train step and what was learnt compiling it.

  Attributes:
    fn: the executable, ``fn(state, batch) -> (state, metrics)`` (the state is donated).
    memory: compiled memory stats (int bytes, ``None`` where the backend has none; per device with a mesh).
    compile_s: seconds to build, trace, lower and compile the step.
    warnings: warnings raised while compiling, and the offload note for offload policies.
    block_types: block type -> checkpoint names of the run's model.
    step: the step function that was compiled (uncompiled; for benchmarks that time it by hand).
    collectives: with a mesh over several devices, what the compiled step sends per device, by kind and mesh axes
      (:func:`jaxckpt.analysis.collectives_by_axis`, as dicts); else ``None``.
  """

  fn: jax.stages.Compiled
  memory: dict[str, int | None]
  compile_s: float
  warnings: list[str]
  block_types: dict[str, frozenset[str]]
  step: Callable | None = None
  collectives: list[dict[str, Any]] | None = None


def compile_and_describe(
    target: ModelTarget, spec: Any, *, tx: Any, mesh: Any, block_types: Mapping[str, frozenset[str]], headline: str,
    log
) -> CompiledStep:
  """Compiles the run's train step once through the step core and logs the policy and compiled memory stats.

  The same compile path as the report and the planner (:func:`jaxckpt.step.compile_policy`: state donated, the
  CPU remat fix, sharded over ``mesh``), with full XLA optimisation since this executable runs.

  Args:
    target: the run's model, loss and batch shapes (:class:`jaxckpt.step.ModelTarget`).
    spec: the concrete policy (per block or per layer range).
    tx: the optimizer.
    mesh: the device mesh (:class:`experiments.placement.Placement`'s), or ``None``; memory stats are then per
      device.
    block_types: the run's block types (for the policy summary).
    headline: first line to log (model, data).
    log: where lines go.

  Returns:
    The :class:`CompiledStep`.

  Raises:
    PolicySpecError: ``spec`` names a block type or checkpoint name the run's model does not have; whatever XLA
      raises while compiling (e.g. out of memory).
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = compile_policy(target, spec, tx=tx, mesh=mesh, stats_only=False)
  messages = [str(w.message) for w in caught]
  offload = jaxckpt.training._xla.offload_warning(spec)
  if offload is not None:
    messages.append(offload)
  memory = dict(compiled.memory)
  log(headline)
  for message in messages:
    log(f"warning: {message}")
  log(f"policy {spec}: {policy_summary(spec, block_types)}")
  if mesh is not None:
    log(f"mesh {sharding.format_mesh(mesh)} over {jax.device_count()} devices in {jax.process_count()} "
        "process(es): memory below is per device")
  log(memory_table(memory))
  collectives = None
  if mesh is not None and jax.device_count() > 1:
    collectives = [u.as_dict() for u in collectives_by_axis(read_compiled(compiled.compiled),
                                                            sharding.mesh_shape(mesh))]
    log(f"collectives per step, per device: {describe_collectives(collectives)}")
  log(f"compiled in {compiled.seconds:.1f} s on {jax.default_backend()} "
      f"(compiler options {jaxckpt.remat_compiler_options() or 'none'})")
  return CompiledStep(compiled.compiled, memory, compiled.seconds, messages, dict(block_types), compiled.step.step,
                      collectives)
