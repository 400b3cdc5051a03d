"""Budget plans: the least-recompute policy per layer range whose compiled train step fits a memory budget.

Steps of :func:`plan_policy`:

1. **Candidates** (:mod:`jaxckpt.planner._candidates`): per-layer specs with their saved bytes and recompute FLOPs,
   measured on one layer of the model's stack; per block type they include the per-tensor min-cut choices of
   :mod:`jaxckpt.planner._tensors` (``save_tensors`` policies).
2. **Anchors**: the train step compiled under ``none`` and ``full``. Predicted and compiled bytes differ (XLA fuses
   some residuals away and adds temporaries of its own), so compiled temp bytes are predicted from the plan's total
   saved bytes S by interpolating between compiled points (S, temp), starting from these two.
3. **Solve** (:mod:`jaxckpt.planner._solve`) for the largest S the prediction lets fit, exactly.
4. **Verify** by compiling the plan; the point joins the interpolation and, if the plan did not fit or the
   prediction moved, solve again: at most ``max_rounds`` verification compiles. The answer is the least-recompute
   compiled plan that fits, so a plan is never returned on a prediction alone.

A budget no plan meets raises :class:`InfeasibleBudgetError`, stating the least memory reached and by which plan.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from flax import nnx

from jaxckpt.planner._effect import row_warning
from jaxckpt.errors import JaxckptError
from jaxckpt.nnx._layers import Stack, record_stack_inputs, stacks
from jaxckpt.planner._cache import PlanCache
from jaxckpt.planner._candidates import LayerCandidate, LayerProbe, candidate_table, layer_candidates, pareto_front
from jaxckpt.nnx._apply import applied_block_types, no_blocks_error
from jaxckpt.planner._own import OwnModelProbe, plan_layers, scanned_layers
from jaxckpt.planner._solve import Assignment, solve
from jaxckpt.planner._tensors import BlockGraph, min_saved_layer, record_block_graphs, tensor_options
from jaxckpt.planner._segmented import mincut_policy
from jaxckpt.policies._spec import SAVE_TENSORS, Policy, PolicySpec
from jaxckpt.policies._model import (
    Budget,
    ConcretePolicy,
    LayeredPolicy,
    MinCut,
    MinSaved,
    ModelPolicy,
    parse_model_policy,
)
from jaxckpt.step._targets import ModelTarget, Target
from jaxckpt.step._compile import boundary_names, compile_policy, forward_jaxpr, step_builder
from jaxckpt.step._build import default_optimizer, policy_step
from jaxckpt.step._job import CompileJob, compile_job
from jaxckpt.sharding import Placement, Topology, mesh_platform
from jaxckpt.rendering._tables import render_table, wrap_lines
from jaxckpt._units import format_bytes


MAX_ROUNDS = 3
"""Default cap on verification compiles (after the two anchors): five compiles, plus the dominance guard's
(:data:`MAX_GUARD_COMPILES`)."""
MAX_GUARD_COMPILES = 2
"""Compiles the dominance guard may add to a plan (fixed candidates not compiled yet, least recompute first): a plan
costs at most 2 anchors + :data:`MAX_ROUNDS` verifications + this many compiles."""


class InfeasibleBudgetError(JaxckptError):
  """No plan fits the budget.

  Attributes:
    budget: the :class:`~jaxckpt.policies.Budget`.
    limit_bytes: the budget in bytes of ``key``.
    key: ``"temp_bytes"`` (percentage budgets) or ``"footprint_bytes"`` (sizes, ``auto``).
    minimum_bytes: the least compiled ``key`` bytes any candidate plan reached.
    policy: the plan that reached it (text).
  """

  def __init__(self, message: str, *, budget: Budget, limit_bytes: int, key: str, minimum_bytes: int, policy: str):
    super().__init__(message)
    self.budget, self.limit_bytes, self.key = budget, limit_bytes, key
    self.minimum_bytes, self.policy = minimum_bytes, policy


@dataclasses.dataclass(frozen=True)
class CompiledPoint:
  """One compiled train step of the planning.

  Attributes:
    policy: the spec or layered policy compiled.
    saved_bytes: predicted bytes the plan's layers save (Σ candidate ``saved_bytes``).
    memory: compiled memory stats (keys of :data:`jaxckpt.schema.MEMORY_KEYS`, bytes).
    flops: FLOPs of the whole step from its jaxpr.
    compile_s: seconds to trace, lower and compile.
  """

  policy: PolicySpec | LayeredPolicy
  saved_bytes: int
  memory: Mapping[str, int | None]
  flops: int
  compile_s: float

  @property
  def temp_bytes(self) -> int:
    return self.memory["temp_bytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """A verified budget plan.

  Attributes:
    budget: what was asked.
    policy: the plan: a :class:`~jaxckpt.PolicySpec` (one spec for every layer) or a
      :class:`~jaxckpt.policies.LayeredPolicy`; pass it to :func:`jaxckpt.set_policy` or as ``--policy``.
    key: the compiled stat the budget bounds, ``"temp_bytes"`` or ``"footprint_bytes"``.
    limit_bytes: the budget in bytes of ``key``.
    predicted_temp_bytes: temp bytes predicted for the plan before its compile.
    compiled: the plan's compiled point (``compiled.memory[key] ≤ limit_bytes``).
    none: the ``none`` anchor (no remat), for ratios.
    assignment: layers per candidate.
    candidates: every measured layer candidate (``--explain``).
    history: every compile, anchors first.
    num_layers: layers of the stack.
    seconds: wall seconds of the whole planning.
    memory_source: for ``auto``, where the memory size came from; else ``None``.
    temp_limit_bytes: the budget as temp bytes (``limit_bytes`` minus argument + output − alias for footprints).
    predictor: the calibrated temp predictor after the last compile, ``predictor(saved_bytes, layered) -> bytes``
      (``None`` when ``none`` fit at once).
    converged: the last solve chose a plan already compiled (else ``max_rounds`` ran out first); then the plan
      is optimal over the candidates for the final predictor.
  """

  budget: Budget
  policy: PolicySpec | LayeredPolicy
  key: str
  limit_bytes: int
  predicted_temp_bytes: int
  compiled: CompiledPoint
  none: CompiledPoint
  assignment: Assignment
  candidates: tuple[LayerCandidate, ...]
  history: tuple[CompiledPoint, ...]
  num_layers: int
  seconds: float
  memory_source: str | None = None
  temp_limit_bytes: int | None = None
  predictor: Any = dataclasses.field(default=None, repr=False, compare=False)
  converged: bool = True
  tensors: Mapping[str, BlockGraph] | None = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def rounds(self) -> int:
    """Verification compiles (after the two anchors)."""
    return max(0, len(self.history) - 2)

  @property
  def flops_ratio(self) -> float:
    """Step FLOPs relative to ``none`` (1.0 = no recompute)."""
    return self.compiled.flops / self.none.flops

  def layer_ranges(self) -> list[tuple[int, int, PolicySpec]]:
    """``(first, last, spec)`` per range of layers (inclusive)."""
    segments = self.policy.segments_for(self.num_layers)
    out, first = [], 0
    for count, spec in segments:
      out.append((first, first + count - 1, spec))
      first += count
    return out

  def explain(self, *, candidates: bool = False, width: int | None = None, wide: bool = False) -> str:
    """The plan in words: ranges and the tensors they save, predicted vs compiled bytes, recompute FLOPs, rounds;
    with ``candidates`` the candidate table too.

    Args:
      candidates: add every candidate per layer (saved bytes, recompute FLOPs, policy; ``*`` = Pareto front).
      width: characters per line, lines wrapped to it (:func:`jaxckpt.rendering._tables.render_table`); ``None`` = the
        terminal's width (``COLUMNS``, else 100).
      wide: no wrapping.
    """
    limit = format_bytes(self.limit_bytes)
    if self.key == "temp_bytes":
      limit += f" ({self.budget.fraction * 100:g}% of none's temp {format_bytes(self.none.temp_bytes)})"
    lines = [f"plan for {self.budget}: {self.key.replace('_bytes', '')} ≤ {limit}"
             + (f" [{self.memory_source}]" if self.memory_source else "")]
    for first, last, spec in self.layer_ranges():
      what = _saves(spec)
      where = f"layers {first}-{last}" if last > first else f"layer {first}"
      lines.append(f"  {where}: {spec}   saves {what}")
      lines.extend(_tensor_lines(spec, self.tensors))
    memory = self.compiled.memory
    lines.append(f"  temp: predicted {format_bytes(self.predicted_temp_bytes)}, compiled {format_bytes(memory['temp_bytes'])}"
                 f" ({memory['temp_bytes'] / self.none.temp_bytes:.2f}× none); footprint {format_bytes(memory['footprint_bytes'])}")
    lines.append(f"  FLOPs: {self.flops_ratio:.3f}× none (+{self.compiled.flops - self.none.flops:.3e} recompute)")
    lines.append(f"  {len(self.history)} compiles (none, full + {self.rounds} verification), {self.seconds:.1f} s")
    text = "\n".join(wrap_lines(lines, width=width, wide=wide, indent="    "))
    if candidates:
      rows = [["*" if row["pareto"] else "", format_bytes(row["saved_bytes"]), f"{row['recompute_flops']:.4g}",
               row["spec"]] for row in candidate_table(self.candidates, pareto_front(self.candidates))]
      text += "\n" + render_table(["", "saved", "recompute FLOPs", "policy"], rows, width=width, wide=wide,
                                  right=(1, 2), no_wrap=(0, 1, 2),
                                  title="  candidates per layer (saved bytes, recompute FLOPs; * = Pareto front):")
    return text

  def to_json(self) -> dict[str, Any]:
    """JSON-able summary: policy, budget, bytes, FLOPs, ranges, history and candidates."""
    return {
        "budget": str(self.budget),
        "policy": str(self.policy),
        "key": self.key,
        "limit_bytes": self.limit_bytes,
        "predicted_temp_bytes": self.predicted_temp_bytes,
        "compiled": dict(self.compiled.memory),
        "flops": self.compiled.flops,
        "flops_none": self.none.flops,
        "ranges": [{"first": f, "last": l, "spec": str(s)} for f, l, s in self.layer_ranges()],
        "rounds": self.rounds,
        "converged": self.converged,
        "compiles": len(self.history),
        "seconds": self.seconds,
        "memory_source": self.memory_source,
        "history": [{"policy": str(p.policy), "saved_bytes": p.saved_bytes, "temp_bytes": p.temp_bytes,
                     "footprint_bytes": p.memory["footprint_bytes"], "flops": p.flops, "compile_s": p.compile_s}
                    for p in self.history],
        "candidates": candidate_table(self.candidates, pareto_front(self.candidates)),
    }


_SAVES = {"none": "everything (no remat)", "nothing_saveable": "nothing (recomputed from the layer input)",
          "everything_saveable": "everything", "dots_saveable": "matmul outputs",
          "dots_with_no_batch_dims_saveable": "weight-matmul outputs"}


def _saves(spec: PolicySpec) -> str:
  pairs = spec.blocks or (("all blocks", spec.default),)

  def what(p: Policy) -> str:
    if p.name == SAVE_TENSORS:
      return f"{len(p.names)} chosen tensors (below)"
    return "+".join(p.names) if p.names else _SAVES.get(p.name, p.name)

  return "; ".join(f"{b}: {what(p)}" for b, p in pairs)


def _tensor_lines(spec: PolicySpec, tensors: Mapping[str, BlockGraph] | None) -> list[str]:
  """One line per value a ``save_tensors`` policy saves: name, shape, dtype, bytes and source line."""
  lines = []
  for block, policy in spec.blocks or (("*", spec.default),):
    if policy.name != SAVE_TENSORS:
      continue
    graph = (tensors or {}).get(block)
    by_name = {v.name: v.index for v in graph.values} if graph else {}
    for name in policy.names:
      lines.append(f"      {block}: {graph.describe(by_name[name]) if name in by_name else name}")
  return lines


def layer_probe(target: Any, builder: Any = None) -> tuple[Stack, LayerProbe]:
  """The model's layer stack and a :class:`~jaxckpt.planner._candidates.LayerProbe` on its first layer's input as the
  train step sees it (micro-batching included; shapes only, traced with ``jax.eval_shape``, nothing allocated).

  Args:
    target: a :class:`~jaxckpt.step.ModelTarget` whose model has exactly one :class:`~jaxckpt.Stack`.
    builder: the target's :class:`~jaxckpt.step.StepBuilder` when one exists (its abstract state is reused).

  Returns:
    ``(stack, probe)``.

  Raises:
    JaxckptError: the model has no or several stacks, or a stack of another structure than ``block``.
  """
  stack = _only_stack(builder.abstract_model if builder is not None else nnx.eval_shape(target.make_model))
  probe_step = builder.step(PolicySpec()) if builder is not None else policy_step(target, PolicySpec(),
                                                                                  default_optimizer())
  with record_stack_inputs() as seen:
    jax.eval_shape(probe_step.step, probe_step.state, probe_step.batch)
  return stack, LayerProbe(stack, seen[0][1])


def min_saved_policy(target: Any, tolerance: float, tensors: Mapping[str, BlockGraph] | None = None,
                     ) -> tuple[PolicySpec, dict[str, BlockGraph]]:
  """The ``min_saved`` policy of a model: the least saved sets of a layer's blocks recomputing ≤ ``tolerance`` × the
  layer's forward FLOPs in all (:func:`jaxckpt.planner._tensors.min_saved_layer`).

  Args:
    target: a :class:`~jaxckpt.step.ModelTarget` with one :class:`~jaxckpt.Stack`, or your own model's target (NNX
      blocks applied by :func:`jaxckpt.apply_remat`; a Linen model's :func:`jaxckpt.linen_model_target`): its
      blocks' graphs are recorded from the whole loss, each block type's first call.
    tolerance: share of the layer's forward FLOPs the recomputation may cost, in [0, 1).
    tensors: block graphs already recorded (else traced here).

  Returns:
    ``(spec, graphs)``: a spec of ``save_tensors`` policies per block type, and the block graphs.

  Raises:
    JaxckptError: a model target without exactly one stack and without blocks of its own, or a block type whose
      graph could not be recorded (named).
  """
  if tensors is None:
    builder = step_builder(target, tx=default_optimizer())
    own_layers = plan_layers(target, builder)
    probe = (OwnModelProbe(target, own_layers, default_optimizer(), builder) if own_layers is not None
             else layer_probe(target, builder)[1])
    tensors = record_block_graphs(probe)
    missing = sorted(set(builder.block_types) - set(tensors))
    if own_layers is not None and missing:
      raise JaxckptError(f"min_saved found no graph for block type(s) {', '.join(missing)} of {target.name} (their "
                         "blocks never ran under a per-tensor policy); use a fixed policy for them")
  chosen = min_saved_layer(tensors, tolerance)
  blocks = tuple((b, chosen[b].policy) for b in sorted(chosen))
  return PolicySpec(blocks=blocks), dict(tensors)


def _only_stack(model: nnx.Module) -> Stack:
  found = stacks(model)
  if not found and not applied_block_types(model):
    raise no_blocks_error(model, "budget plans")
  if len(found) != 1:
    raise JaxckptError(f"budget plans need a model with exactly one jaxckpt Stack (the layers they plan); this one "
                       f"has {len(found)}")
  if found[0].structure.levels != 1:
    raise JaxckptError(f"budget plans need the stack's structure to be block, not {found[0].structure} (a plan "
                       "gives each layer range its own policy)")
  return found[0]


@dataclasses.dataclass(frozen=True)
class _Predictor:
  """Compiled temp bytes of a plan from its saved bytes S, calibrated on compiled points.

  Base: ``temp(full) + (S − S_full)`` (a scanned stack stores its residuals as they are), plus ``range_bytes`` when
  the plan has several layer ranges (each range slices the stacked parameters, which XLA materialises: measured
  + the stack's parameter bytes on XLA:CPU). Correction: the error of that base at every compiled point (``none``,
  ``full`` and each verified plan), interpolated linearly in S: ``none`` pulls predictions near no-remat down
  (XLA fuses some residuals away), each verified plan pins its neighbourhood.
  """

  full_saved: int
  full_temp: int
  range_bytes: int
  points: tuple[tuple[int, bool, int], ...]  # (saved, layered, compiled temp)

  def base(self, saved: float, layered: bool) -> float:
    return self.full_temp + (saved - self.full_saved) + (self.range_bytes if layered else 0)

  def __call__(self, saved: float, layered: bool) -> float:
    errors = sorted((s, t - self.base(s, l)) for s, l, t in self.points)
    xs = [s for s, _ in errors]
    i = min(max(bisect.bisect_left(xs, saved), 1), len(errors) - 1)
    (s0, e0), (s1, e1) = errors[i - 1], errors[i]
    error = e0 + (saved - s0) * (e1 - e0) / (s1 - s0) if s1 != s0 else max(e0, e1)
    return self.base(saved, layered) + error

  def cap(self, limit: float, layered: bool, high: float) -> float:
    """The largest S in [0, high] predicted to fit ``limit`` (bisection; ``-1`` if none does)."""
    if self(0, layered) > limit:
      return -1.0
    lo, hi = 0.0, float(high)
    if self(hi, layered) <= limit:
      return hi
    for _ in range(60):
      mid = (lo + hi) / 2
      lo, hi = (mid, hi) if self(mid, layered) <= limit else (lo, mid)
    return lo


def _choose(predictor: _Predictor, candidates: Sequence[LayerCandidate], num_layers: int, temp_limit: int,
            high: int, *, layered_ok: bool = True) -> Assignment | None:
  """The least-recompute assignment predicted to fit: one candidate for every layer (one range) or a mix (several
  ranges, each slicing the stacked parameters), whichever recomputes less; one range only without ``layered_ok``
  (your own scanned stack: its scan body takes one policy)."""
  choices = []
  for layered in (False, True) if layered_ok else (False,):
    cap = predictor.cap(temp_limit, layered, high)
    if layered:
      found = solve(candidates, num_layers, cap)
    else:
      pool = [c for c in candidates if c.saved_bytes * num_layers <= cap]
      best = min(pool, key=lambda c: (c.recompute_flops, c.saved_bytes)) if pool else None
      found = None if best is None else Assignment(((best, num_layers),), best.saved_bytes * num_layers,
                                                    best.recompute_flops * num_layers)
    if found is not None:
      choices.append(found)
  return min(choices, key=lambda a: (a.recompute_flops, a.saved_bytes)) if choices else None


def _offload_hint(target: Any, builder: Any, mesh: Any, limit: int) -> str:
  """The tail of the error of a footprint budget below full remat's, where the fit planner's per-name offload can
  go lower: a model target whose remat regions take a tagged input (the layer input, ``decoder_layer_input``: full
  remat keeps it on the device, offloading it does not), on a device with host memory (a TPU topology's chip, a
  GPU); else ``""``."""
  if mesh_platform(mesh) not in ("tpu", "gpu") or not isinstance(target, ModelTarget):
    return ""
  inputs = boundary_names(forward_jaxpr(builder))
  if not inputs:
    return ""
  batch = max((a.shape[0] for a in jax.tree.leaves(target.batch) if len(a.shape)), default=1)
  return (f"; or offload {', '.join(sorted(inputs))} to host memory, below full remat: the fit planner's "
          f"custom:search with the batch pinned at {batch} in {format_bytes(limit)} (docs/fit.md, \"When no fixed "
          "policy fits the batch\")")


def plan_policy(
    target: Any,
    budget: "Budget | str",
    *,
    tx: optax.GradientTransformation | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    max_rounds: int = MAX_ROUNDS,
    cache: PlanCache | None = None,
    candidates: Sequence[LayerCandidate] | None = None,
    per_tensor: bool = True,
    mesh: "str | Mapping[str, int] | jax.sharding.Mesh | Placement | None" = None,
    topology: "str | Topology | None" = None,
    memory_fraction: float | None = None,
) -> Plan:
  """Finds the least-recompute per-layer policy whose compiled train step fits ``budget`` (module docstring).

  Args:
    target: a :class:`jaxckpt.step.ModelTarget` whose model has one :class:`~jaxckpt.Stack` (structure
      ``block``), e.g. ``shipped_target("gpt", "small")``; or your own model: NNX with blocks named by
      :func:`jaxckpt.apply_remat`, or Linen through :func:`jaxckpt.linen_model_target` / :func:`jaxckpt.report.linen_target`
      (per-layer plans for layers in a list or loop, one spec for a scanned stack: :mod:`jaxckpt.planner._own`).
    budget: ``budget:<size>`` (compiled ``footprint_bytes`` ≤ size), ``budget:<p>%`` (compiled ``temp_bytes`` ≤ p%
      of ``none``'s), ``auto`` / ``auto:margin=<p>%`` (footprint ≤ :func:`jaxckpt.sharding.device_memory` × (1 − margin)), or
      the parsed :class:`~jaxckpt.policies.Budget`.
    tx: the optimizer of the step (default ``optax.adamw(1e-3)``; its state counts in the footprint).
    compiler_options: extra XLA options (merged with the CPU remat fix).
    max_rounds: verification compiles after the two anchors (≥ 1).
    cache: compiled points and the traced whole loss, shared between calls (the report plans several budgets with
      it).
    candidates: measured layer candidates to reuse (from an earlier plan's ``candidates``).
    per_tensor: add each block type's per-tensor min-cut front (``save_tensors`` options,
      :mod:`jaxckpt.planner._tensors`) to the candidates.
    mesh: plan for the step sharded over a mesh (a ``--mesh`` spec, ``{axis: size}``, a ``jax.sharding.Mesh``, or a
      :class:`~jaxckpt.sharding.Placement`): the anchors and verification compiles are sharded over it and the
      budget is per device (a topology's mesh, :mod:`jaxckpt.sharding`: planned with its compiler, ``auto`` from the
      chip's memory, a GPU's × its memory fraction). The candidates stay the step's (saved bytes of the whole
      batch): the prediction interpolates between compiled per-device points, which calibrates the scale. ``None``:
      one device.
    topology: plan for a TPU slice or GPU cluster without its hardware (``"v5e:2x2"``, ``"h100:8"``): ``mesh`` (a
      ``--mesh`` spec or ``None``: every chip on ``data``) laid over its chips (:func:`jaxckpt.sharding.topology_mesh`).
    memory_fraction: a GPU topology's share of memory XLA may use (:func:`jaxckpt.sharding.memory_fraction`).

  Returns:
    The verified :class:`Plan`.

  Raises:
    InfeasibleBudgetError: even the least-memory plan (``full`` on every layer) exceeds the budget; the message
      gives its compiled bytes.
    JaxckptError: a model without blocks of its own and without one block-structured stack (the message lists
      its module classes), ``max_rounds`` < 1, a spec that is not a budget.
    TopologyError: a bad topology, its compiler missing (:func:`jaxckpt.sharding.get_topology`).
    MeshSpecError: a mesh that does not cover the topology's chips, or a batch it cannot split.
  """
  started = time.perf_counter()
  job = compile_job(target, mesh=mesh, topology=topology, memory_fraction=memory_fraction, tx=tx,
                    compiler_options=compiler_options)
  placement, mesh, tx = job.placement, job.mesh, job.tx
  parsed = parse_model_policy(budget)
  if not isinstance(parsed, Budget):
    raise JaxckptError(f"{str(parsed)!r} is not a budget; write budget:<size>, budget:<percent>% or auto")
  if max_rounds < 1:
    raise JaxckptError(f"max_rounds must be ≥ 1, got {max_rounds}")
  cache = PlanCache() if cache is None else cache
  builder = step_builder(target, tx=tx)  # the abstract model and state, shared by the probes of the planning
  compiling = builder if mesh is None else step_builder(target, tx=tx, mesh=mesh)  # and by its compiles
  stack, num_layers, candidates, tensors = _layers_and_candidates(target, builder, tx, candidates, per_tensor)
  by_spec, layered_ok = {str(c.spec): c for c in candidates}, _layered_ok(target, stack, builder)

  def compile_point(policy, saved: int) -> CompiledPoint:
    text = str(policy)
    if text not in cache.points:
      compiled = compile_policy(target, policy, tx=tx, mesh=mesh, options=compiler_options, builder=compiling)
      cache.points[text] = CompiledPoint(policy, saved, compiled.memory, compiled.flops, compiled.seconds)
    return dataclasses.replace(cache.points[text], saved_bytes=saved)

  none_spec, full_spec = PolicySpec(), PolicySpec(default=Policy("nothing_saveable"))
  none_cand, full_cand = by_spec[str(none_spec)], by_spec[str(full_spec)]
  none = compile_point(none_spec, none_cand.saved_bytes * num_layers)
  full = compile_point(full_spec, full_cand.saved_bytes * num_layers)
  history = [none, full]
  for point in history:
    if point.temp_bytes is None or point.memory["footprint_bytes"] is None:
      raise JaxckptError(f"the backend ({mesh_platform(mesh)}) reports no compiled memory stats; budget plans need "
                         "them")

  key, limit, memory_source = _budget_limit(parsed, none, placement)
  overhead = none.memory[key] - none.temp_bytes  # argument + output − alias: the same for every plan
  temp_limit = limit - overhead

  def fits(point: CompiledPoint) -> bool:
    return point.memory[key] <= limit

  def make(point: CompiledPoint, assignment: Assignment, predicted: int, predictor=None, converged=True) -> Plan:
    return Plan(budget=parsed, policy=point.policy, key=key, limit_bytes=limit, predicted_temp_bytes=predicted,
                compiled=point, none=none, assignment=assignment, candidates=tuple(candidates),
                history=tuple(history), num_layers=num_layers, seconds=time.perf_counter() - started,
                memory_source=memory_source, temp_limit_bytes=temp_limit, predictor=predictor, converged=converged,
                tensors=tensors)

  uniform = lambda cand: Assignment(((cand, num_layers),), cand.saved_bytes * num_layers,  # noqa: E731
                                    cand.recompute_flops * num_layers)
  if fits(none):
    return make(none, uniform(none_cand), none.temp_bytes)
  if not fits(full):
    least = min(history, key=lambda p: p.memory[key])
    what = f"{key.replace('_bytes', '')} {format_bytes(least.memory[key])}"
    if key == "temp_bytes":
      what += f" ({least.temp_bytes / none.temp_bytes:.0%} of none's)"
    raise InfeasibleBudgetError(
        f"no plan fits {parsed} ({key.replace('_bytes', '')} ≤ {format_bytes(limit)}): the least memory any plan "
        f"reaches is {what}, with policy {least.policy} on every layer (footprint "
        f"{format_bytes(least.memory['footprint_bytes'])}); to go lower "
        + ("use a smaller batch or grad_accum_steps > 1 (or a fixed policy with structure='nested', which plans do not "
           "take)" if isinstance(target, ModelTarget) else f"give {target.name}'s target a smaller batch")
        + (_offload_hint(target, builder, mesh, limit) if key == "footprint_bytes" else ""),
        budget=parsed, limit_bytes=limit, key=key, minimum_bytes=least.memory[key], policy=str(least.policy))

  params = nnx.state(stack.layers, nnx.Param) if stack is not None else {}  # own layers: no slicing of a stack
  range_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  tried: set[str] = {str(none_spec), str(full_spec)}
  (best, best_assignment, best_predicted), points = _rounds(
      max_rounds, (full, uniform(full_cand), full.temp_bytes), none, full, range_bytes, candidates, num_layers,
      temp_limit, tried, history, compile_point, fits, layered_ok=layered_ok)
  predictor = _Predictor(full.saved_bytes, full.temp_bytes, range_bytes, tuple(points))
  best, best_assignment, best_predicted = _dominance_guard(
      (best, best_assignment, best_predicted), candidates, num_layers, predictor, temp_limit, none, tried, history,
      compile_point, fits, uniform, set(cache.points))
  final = _choose(predictor, candidates, num_layers, temp_limit, none.saved_bytes, layered_ok=layered_ok)
  converged = final is None or str(final.policy()) in tried
  return make(best, best_assignment, best_predicted, predictor, converged)


def _layered_ok(target: Target, stack: Any, builder: Any) -> bool:
  """Whether a plan may give its layer ranges different policies: not for your own scanned stack (its scan body
  takes one policy, :func:`jaxckpt.planner._own.scanned_layers`)."""
  return not (stack is None and isinstance(target, ModelTarget) and scanned_layers(builder.abstract_model))


def _layers_and_candidates(target: Target, builder: Any, tx: Any, candidates: Sequence[LayerCandidate] | None,
                           per_tensor: bool) -> tuple[Any, int, list[LayerCandidate], Any]:
  """``(stack or None, layers, candidates, per-tensor graphs or None)`` of a plan: your own model's layers (NNX or
  Linen, :func:`plan_layers`) or the Stack's, and each layer's measured candidates (given ones reused)."""
  types = builder.block_types
  own_layers = plan_layers(target, builder)
  if own_layers is not None:
    if candidates is None:
      candidates = layer_candidates(OwnModelProbe(target, own_layers, tx, builder), types)
    return None, own_layers, list(candidates), None
  stack, probe = layer_probe(target, builder)
  tensors = None
  if candidates is None:
    tensors = record_block_graphs(probe) if per_tensor else None
    candidates = layer_candidates(probe, types, tensor_options(tensors) if tensors else None)
  elif any(p.name == SAVE_TENSORS for c in candidates for _, p in (c.spec.blocks or (("*", c.spec.default),))):
    tensors = record_block_graphs(probe)
  return stack, stack.num_layers, list(candidates), tensors


def _budget_limit(parsed: Budget, none: CompiledPoint, placement: Placement) -> tuple[str, int, str | None]:
  """``(key, limit, memory source)`` a budget bounds: ``temp_bytes`` at a share of ``none``'s temp, or
  ``footprint_bytes`` at a size or at the device's memory less a margin (``auto``: :meth:`Placement.memory`)."""
  if parsed.fraction is not None:
    return "temp_bytes", int(parsed.fraction * none.temp_bytes), None
  if not parsed.auto:
    return "footprint_bytes", parsed.bytes, None
  available, source = placement.memory()
  return ("footprint_bytes", int(available * (1 - parsed.margin)),
          f"{source} {format_bytes(available)} − {parsed.margin * 100:g}% margin")


def _rounds(max_rounds, start, none, full, range_bytes, candidates, num_layers, temp_limit, tried, history,
            compile_point, fits, *, layered_ok: bool = True):
  """The planner's rounds (:func:`plan_policy`): choose the least-recompute assignment the predictor says fits,
  compile it, add its point to the predictor; returns ``((best point, its assignment, its predicted temp), the
  predictor's points)``, ``best`` the fewest-FLOPs compile that fit and had an effect."""
  best, best_assignment, best_predicted = start
  points = [(none.saved_bytes, False, none.temp_bytes), (full.saved_bytes, False, full.temp_bytes)]
  for _ in range(max_rounds):
    predictor = _Predictor(full.saved_bytes, full.temp_bytes, range_bytes, tuple(points))
    assignment = _choose(predictor, candidates, num_layers, temp_limit, none.saved_bytes, layered_ok=layered_ok)
    if assignment is None or str(assignment.policy()) in tried:
      break
    policy = assignment.policy()
    tried.add(str(policy))
    layered = len(assignment.counts) > 1
    predicted = int(predictor(assignment.saved_bytes, layered))
    point = compile_point(policy, assignment.saved_bytes)
    history.append(point)
    points.append((point.saved_bytes, layered, point.temp_bytes))
    if fits(point) and point.flops < best.flops and not _no_effect(point, none):
      best, best_assignment, best_predicted = point, assignment, predicted
  return (best, best_assignment, best_predicted), points


def _dominance_guard(chosen, candidates, num_layers, predictor, temp_limit, none, tried, history, compile_point,
                     fits, uniform, compiled):
  """The plan never loses to a uniform fixed policy of the candidate set (``dots_saveable`` … on every layer).

  A fixed candidate whose measured layer recompute (× layers) is at most the chosen plan's compiled recompute
  (+ 0.5% of ``none``'s step FLOPs) and that is already compiled (``cache.points``) or predicted to fit is compiled
  (once, cached; at most :data:`MAX_GUARD_COMPILES` new compiles, least recompute first) and becomes the plan when it
  fits with fewer FLOPs, or as many FLOPs and no more temp. The layer
  estimates of per-tensor options can miss what XLA does to the whole step, so the guard compares
  compiled steps, never estimates.

  Returns:
    ``(point, assignment, predicted_temp_bytes)`` of the plan kept.
  """
  best, best_assignment, best_predicted = chosen
  slack = best.flops - none.flops + 0.005 * none.flops
  new_compiles = 0
  for cand in sorted(candidates, key=lambda c: c.recompute_flops):  # the likeliest to dominate first
    policies = [p for _, p in (cand.spec.blocks or (("*", cand.spec.default),))]
    if any(p.name == SAVE_TENSORS for p in policies) or len({str(p) for p in policies}) != 1:
      continue
    if str(cand.spec) == str(best.policy) or cand.recompute_flops * num_layers > slack:
      continue
    predicted = int(predictor(cand.saved_bytes * num_layers, False))
    known = str(cand.spec) in tried | compiled
    if not known and (predicted > temp_limit or new_compiles >= MAX_GUARD_COMPILES):
      continue
    new_compiles += not known
    tried.add(str(cand.spec))
    point = compile_point(cand.spec, cand.saved_bytes * num_layers)
    if all(str(h.policy) != str(point.policy) for h in history):
      history.append(point)
    if not fits(point) or _no_effect(point, none):
      continue
    if point.flops < best.flops or (point.flops == best.flops and point.temp_bytes <= best.temp_bytes):
      best, best_assignment, best_predicted = point, uniform(cand), predicted
  return best, best_assignment, best_predicted


def _min_saved_guarded(target: Any, tolerance: float, tx: optax.GradientTransformation,
                       compiler_options: Mapping[str, Any] | None, cache: PlanCache, mesh: Any = None
                       ) -> ConcretePolicy:
  """``min_saved``, unless a fixed dots policy is at least as good: its compiled step and those of
  ``dots_saveable`` and ``dots_with_no_batch_dims_saveable`` (compiled once per ``cache``) are compared; a fixed one
  with temp and FLOPs both ≤ the plan's is returned instead (a per-type graph can name the wrong values in
  blocks of the type that trace differently, docs/plans.md). The compiles are sharded over ``mesh`` when given (a
  TPU topology's: the TPU compiler decides).

  Returns:
    The ``save_tensors`` spec of :func:`min_saved_policy` or the dominating fixed policy's spec.
  """
  spec = min_saved_policy(target, tolerance)[0]
  builder = step_builder(target, tx=tx, mesh=mesh)

  def point(policy) -> CompiledPoint:
    text = str(policy)
    if text not in cache.points:
      compiled = compile_policy(target, policy, tx=tx, mesh=mesh, options=compiler_options, builder=builder)
      cache.points[text] = CompiledPoint(policy, 0, compiled.memory, compiled.flops, compiled.seconds)
    return cache.points[text]

  plan = point(spec)
  for name in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
    fixed = point(PolicySpec(default=Policy(name)))
    if fixed.temp_bytes <= plan.temp_bytes and fixed.flops <= plan.flops:
      spec, plan = fixed.policy, fixed
  return spec


def _no_effect(point: CompiledPoint, none: CompiledPoint) -> bool:
  """Whether a compiled candidate shows the report's "no compiled effect" sign (:mod:`jaxckpt.report.effect`): its
  predicted saved bytes at most half of none's while its compiled temp stays at 90% of none's or more. Such a
  candidate is never chosen: XLA undid its remat, so its memory is luck, not the plan."""
  def row(p: CompiledPoint, policy: str) -> dict[str, Any]:
    return {"policy": policy, "status": "ok", "residual_bytes": p.saved_bytes, "temp_bytes": p.temp_bytes}

  return row_warning(row(point, f"candidate {point.policy}"), row(none, "none"), backend="gpu") is not None


def resolve_policy(
    target: Target,
    policy: ModelPolicy | str,
    *,
    tx: optax.GradientTransformation | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    mesh: "jax.sharding.Mesh | Placement | None" = None,
    cache: PlanCache | None = None,
    candidates: Sequence[LayerCandidate] | None = None,
) -> tuple[ConcretePolicy, Plan | None]:
  """Turns a model-level policy into one that can be applied as it is: the one place a budget becomes a plan.

  Every entry point (the report, the experiments, ``jaxckpt-plan``) calls this where a ``--policy`` enters, so the
  code below it sees only a :class:`~jaxckpt.PolicySpec` or a :class:`~jaxckpt.policies.LayeredPolicy`.

  Args:
    target: the :class:`~jaxckpt.step.ModelTarget` the policy is for (used only for budgets).
    policy: a spec string or parsed policy (:func:`jaxckpt.policies.parse_model_policy`).
    tx, compiler_options, cache, candidates: as :func:`plan_policy`.
    mesh: where the step will be compiled: a :class:`~jaxckpt.sharding.Placement` (a topology's mesh and a GPU's
      memory fraction: ``auto`` budgets are planned at the memory its device may use,
      :meth:`~jaxckpt.sharding.Placement.memory`), or a ``jax.sharding.Mesh`` of this machine's devices. Budgets
      are planned and ``min_saved``'s fixed rivals compiled sharded over its mesh (per-device memory).

  Returns:
    ``(policy, plan)``: the concrete policy and the :class:`Plan` it came from (``None`` when ``policy`` was not a
    budget). ``min_saved`` becomes a spec of ``save_tensors`` policies (:func:`min_saved_policy`), no plan;
    ``mincut:<cap>`` a :class:`~jaxckpt.policies.LossPolicy` (:func:`jaxckpt.planner._whole.mincut_policy`; its
    :class:`~jaxckpt.planner._whole.SegmentedPlan` is the policy's ``plan``).

  Raises:
    PolicySpecError: a spec that does not parse.
    InfeasibleBudgetError: no plan fits the budget.
    JaxckptError: a target the planner cannot plan (see :func:`plan_policy`).
  """
  parsed = parse_model_policy(policy)
  if parsed.resolved:
    return parsed, None
  job = compile_job(target, mesh=mesh, tx=tx, compiler_options=compiler_options, check_batch=False)
  return _RESOLVERS[type(parsed)](job, parsed, cache=PlanCache() if cache is None else cache, candidates=candidates)


def _resolve_min_saved(job: CompileJob, parsed: MinSaved, *, cache, candidates):  # noqa: ARG001
  return _min_saved_guarded(job.target, parsed.tolerance, job.tx, job.compiler_options, cache, job.mesh), None


def _resolve_mincut(job: CompileJob, parsed: MinCut, *, cache, candidates):  # noqa: ARG001
  return mincut_policy(job.target, parsed, cache), None


def _resolve_budget(job: CompileJob, parsed: Budget, *, cache, candidates):
  plan = plan_policy(job.target, parsed, tx=job.tx, compiler_options=job.compiler_options, cache=cache,
                     candidates=candidates, mesh=job.placement)
  return plan.policy, plan


_RESOLVERS: dict[type, Callable[..., tuple[ConcretePolicy, Plan | None]]] = {
    MinSaved: _resolve_min_saved, MinCut: _resolve_mincut, Budget: _resolve_budget}
"""How each model-level policy that is not concrete (``resolved`` False) becomes one for a :class:`CompileJob`: a
table, not a ladder."""
