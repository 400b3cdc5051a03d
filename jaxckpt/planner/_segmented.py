"""The segmented whole-loss plan: every region's 0-1 program (:func:`~jaxckpt.planner._tensors.block_program`) solved
as one under a shared cap on saved activation bytes, each region input kept only when a recomputed op or the
region's backward reads it, and the policy ``mincut:<cap>`` built from it (:func:`mincut_policy`, a
:class:`~jaxckpt.policies.LossPolicy` the report and the planner compile).

References: Jain et al. 2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization" (the
integer program); PyTorch's AOTAutograd min-cut partitioner (``activation_memory_budget``), the plan this one is
compared with (``benchmarks/pertensor_front.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.core._tagging import parse_value_name
from jaxckpt.errors import JaxckptError
from jaxckpt.planner._tensors import (BlockProgram, TensorChoice, block_program, solve_milp,
                                     tensor_choice)
from jaxckpt.policies._model import LossPolicy, MinCut
from jaxckpt.step._build import check_plain_step
from jaxckpt._units import format_bytes
from jaxckpt.planner._cache import PlanCache
from jaxckpt.planner._segments import Region, Segments, is_var, region_fn, segment_loss, var_bytes
from jaxckpt.planner._whole import TIME_LIMIT, check_caps, measure_whole, target_whole_loss, whole_graph

@dataclasses.dataclass(frozen=True)
class SegmentedPlan:
  """A per-tensor plan of a segmented whole loss (:func:`segmented_plan`).

  Attributes:
    segments: the regions.
    choices: one :class:`~jaxckpt.planner._tensors.TensorChoice` per region (its graph's numbering).
    names: the loss's automatic names of every saved value, per region.
    activation_bytes: predicted saved activation bytes: the regions' saved values that are not parameter-only,
      plus their inputs that are activations, token ids or keys (each once).
    flops: predicted recomputed forward FLOPs, all regions (``loop_flops`` included).
    mip_gap: HiGHS's proven relative gap of the first objective (0: optimal).
    loop_flops: per region, forward FLOPs of its differentiated ``scan``/``while`` loops: one opaque value each to
      the plan, their bodies' residuals have no automatic name, so ``jax.checkpoint`` reruns every such loop in the
      backward pass whatever is saved (a ``scan`` over layers: the whole stack recomputed, its residuals never
      saved).
  """

  segments: Segments
  choices: tuple[TensorChoice, ...]
  names: tuple[tuple[str, ...], ...]
  activation_bytes: int
  flops: int
  mip_gap: float
  loop_flops: tuple[int, ...] = ()

  @property
  def loss_fn(self) -> Callable[..., jax.Array]:
    """``(params, batch[, key]) -> loss``: each region under its own ``jax.checkpoint`` saving its chosen names."""
    return remat_segments(self.segments, self.names)

  def explain(self) -> str:
    """The plan as text: totals, then per region its equations, recompute FLOPs and every saved value with its
    shape, dtype, bytes and source line (``t155_add [8, 256, 256] float32 2.00 MiB from …/layers.py:129``)."""
    lines = [f"{len(self.segments.regions)} regions; saved activations {format_bytes(self.activation_bytes)} "
             f"(predicted: saved values + kept region inputs + token ids and keys); recompute "
             f"{self.flops / 1e6:.1f} MFLOP per step" + (f"; HiGHS gap {self.mip_gap:.2g}" if self.mip_gap else "")]
    loops = self.loop_flops or (0,) * len(self.choices)
    for region, choice, loop in zip(self.segments.regions, self.choices, loops):
      lines.append(f"region {region.index} (equations {region.start}..{region.stop - 1}, "
                   f"{region.graph.forward_flops / 1e6:.1f} MFLOP forward): saves {len(choice.saved)} values, "
                   f"{format_bytes(choice.activation_bytes)}, recomputes {(choice.flops + loop) / 1e6:.1f} MFLOP"
                   + (f" ({loop / 1e6:.1f} MFLOP of scan/while loops, rerun whole: their bodies' values cannot be "
                      "saved; unroll them to plan inside)" if loop else ""))
      for v in choice.saved:
        info = region.graph.values[v]
        lines.append(f"  {region.global_name(v)} {list(info.shape)} {info.dtype} {format_bytes(info.bytes)}"
                     + (f" from {info.source}" if info.source else " (no source line: made by JAX)")
                     + (" (parameter-only)" if v in region.graph.parameter_only else ""))
    return "\n".join(lines)


class JointProgram(NamedTuple):
  """The regions' 0-1 programs as one (:func:`joint_program`): each region's :class:`BlockProgram` at its column
  offset, then one column per kept region-input array. Caps are added by the caller."""

  programs: list[BlockProgram]  # per region, in order
  offsets: list[int]  # column where each region's variables start; offsets[-1]: first kept-input column
  var_bytes: np.ndarray  # [columns] float bytes the byte cap counts
  var_cost: np.ndarray  # [columns] float recompute cost
  var_flops: np.ndarray  # [columns] float recompute FLOPs
  constraints: list[Any]  # scipy.optimize.LinearConstraint: covering rows of every region and the kept inputs
  kept: dict[Any, int]  # region input var -> its column (an output saved where it is made shares that column)
  save_col: dict[Any, tuple[int, int, int]]  # region output var -> (column, region, value) of saving it there
  fixed_bytes: int  # bytes of the token ids and keys regions read: always kept


def joint_program(segments: Segments) -> JointProgram:
  """One 0-1 program over every region of ``segments``: the regions' covering rows side by side, plus, per region
  input that a recomputed op or the region's backward reads, a column that keeps it (a value cannot be recomputed
  across a cut); an input that is an earlier region's saved output shares that column, so its bytes count once.

  Args:
    segments: from :func:`~jaxckpt.planner._segments.segment_loss`.

  Returns:
    The :class:`JointProgram`.
  """
  from scipy import optimize, sparse  # pylint: disable=g-import-not-at-top
  regions = segments.regions
  programs = [block_program(r.graph) for r in regions]
  offsets = [0, *itertools.accumulate(p.num_vars for p in programs)]
  bytes_, cost, flops = ([float(c) for p in programs for c in getattr(p, k)] for k in ("var_bytes", "var_cost",
                                                                                         "var_flops"))
  save_col: dict[Any, tuple[int, int, int]] = {}
  for k, (region, program) in enumerate(zip(regions, programs)):
    s_at = {v: i for i, v in enumerate(program.saved_values)}
    for var, v in zip(region.outputs, region.output_values):
      if v is not None and v in s_at:
        save_col[var] = (offsets[k] + s_at[v], k, v)
  kept: dict[Any, int] = {}
  fixed: dict[Any, int] = {}
  extra: list[tuple[list[tuple[int, float]], float]] = []
  for k, (region, program) in enumerate(zip(regions, programs)):
    r_at = {o: offsets[k] + len(program.saved_values) + i for i, o in enumerate(program.ops)}
    readers: dict[int, set[int]] = {}
    for value in region.graph.values:
      for u in value.inputs:
        if u < 0:
          readers.setdefault(-1 - u, set()).add(value.op)
    for i, var in enumerate(region.inputs):
      if i in region.parameter_inputs or (i not in readers and i not in region.graph.needed_inputs):
        continue
      if not jnp.issubdtype(var.aval.dtype, jnp.floating):
        fixed[var] = var_bytes(var)
        continue
      if var not in kept:
        if var in save_col:
          kept[var] = save_col[var][0]
        else:
          kept[var] = len(bytes_)
          bytes_.append(float(var_bytes(var)))
          cost.append(0.0)
          flops.append(0.0)
      col = kept[var]
      if i in region.graph.needed_inputs:
        extra.append(([(col, 1.0)], 1.0))
      extra.extend(([(col, 1.0), (r_at[o], -1.0)], 0.0) for o in sorted(readers.get(i, ())) if o in r_at)
  n = len(bytes_)
  blocks = [p.covering for p in programs if p.covering.shape[0]]
  rows = (sparse.block_diag([p.covering for p in programs], format="csr") if blocks
          else sparse.csr_array((0, offsets[-1])))
  rows = sparse.hstack([rows, sparse.csr_array((rows.shape[0], n - offsets[-1]))], format="csr")
  lows = [low for p in programs for low in p.lows]
  if extra:
    data = [c for entries, _ in extra for _, c in entries]
    cols = [j for entries, _ in extra for j, _ in entries]
    indptr = [0, *itertools.accumulate(len(entries) for entries, _ in extra)]
    rows = sparse.vstack([rows, sparse.csr_array((data, cols, indptr), shape=(len(extra), n))], format="csr")
    lows += [low for _, low in extra]
  constraints = [optimize.LinearConstraint(rows, np.array(lows, float), np.inf)] if lows else []
  return JointProgram(programs, offsets, np.array(bytes_), np.array(cost), np.array(flops), constraints, kept,
                      save_col, sum(fixed.values()))


def segmented_plan(segments: Segments, *, max_bytes: float | None = None, max_flops: float | None = None,
                   minimise: str = "cost", time_limit: float | None = TIME_LIMIT) -> SegmentedPlan:
  """The optimal saved sets of all regions of a segmented loss, under one cap on their total.

  The regions' 0-1 programs (:func:`jaxckpt.planner._tensors.solve_block`'s) are solved as one program with a shared
  byte or FLOPs cap, lexicographically (cost then bytes, or bytes then cost). A value cannot be recomputed across a
  cut (an earlier region's recomputation runs after a later region's backward pass), so every region input that a
  recomputed op or the region's backward reads is kept: one more 0-1 variable per input array, its bytes counted
  once.

  Args:
    segments: from :func:`segment_loss`.
    max_bytes: cap on saved activation bytes: chosen values that are not parameter-only, the regions' inputs they
      keep (an input is kept when the region's backward pass or a recomputed op reads it; an output saved where it
      is made and kept as a later region's input counts once), and the token ids and keys regions read; ``None``:
      no cap.
    max_flops: cap on recomputed forward FLOPs; ``None``: no cap.
    minimise: ``"cost"`` or ``"bytes"`` (as :func:`whole_plan`).
    time_limit: seconds per HiGHS solve (``None``: until proven optimal).

  Returns:
    The :class:`SegmentedPlan`.

  Raises:
    JaxckptError: a cap that is not a number, NaN, negative ``max_flops``; an unknown ``minimise``; no plan meets
      the caps (a byte cap alone: the message gives the least bytes any plan saves), or none was found within
      ``time_limit``.
  """
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  check_caps(max_bytes=max_bytes, max_flops=max_flops, time_limit=time_limit)
  if minimise not in ("cost", "bytes"):
    raise JaxckptError(f"minimise={minimise!r}; valid: cost, bytes")
  if max_flops is not None and max_flops < 0:
    raise JaxckptError(f"max_flops={max_flops:g} must be ≥ 0 (0: recompute nothing)")
  program = joint_program(segments)
  base = list(program.constraints)
  if max_bytes is not None:
    base.append(optimize.LinearConstraint(program.var_bytes[None], -np.inf, max_bytes - program.fixed_bytes))
  if max_flops is not None:
    base.append(optimize.LinearConstraint(program.var_flops[None], -np.inf, max_flops))
  regions, programs, offsets = segments.regions, program.programs, program.offsets
  bytes_, cost, n = program.var_bytes, program.var_cost, len(program.var_bytes)
  first, second = (cost, bytes_) if minimise == "cost" else (bytes_, cost)
  found = solve_milp(first, n, base, time_limit)
  if found is None:
    if max_bytes is not None and max_flops is None:
      least = segmented_plan(segments, minimise="bytes", time_limit=time_limit).activation_bytes
      raise JaxckptError(f"no plan of these {len(regions)} regions saves at most max_bytes={max_bytes:.0f} bytes of "
                         f"activations; the least any plan of this loss saves is {least} bytes "
                         f"({format_bytes(least)})")
    raise JaxckptError(f"no segmented plan meets max_bytes={max_bytes} and max_flops={max_flops} (or HiGHS found "
                       f"none within time_limit={time_limit} s): raise a cap")
  x, gap = found
  best = float(first @ x)
  tie = optimize.LinearConstraint(first[None], -np.inf, best + 1e-6 * max(1.0, abs(best)))
  found2 = solve_milp(second, n, base + [tie], time_limit)
  x = x if found2 is None else found2[0]
  choices, names = [], []
  arrays: dict[Any, int] = {}  # what is kept, each array once: (region, value) or a kept var
  for k, region in enumerate(regions):
    svals = programs[k].saved_values
    choice = tensor_choice(region.graph, [v for i, v in enumerate(svals) if x[offsets[k] + i] > 0.5])
    choices.append(choice)
    names.append(tuple(region.global_name(v) for v in choice.saved))
    arrays.update(((k, v), region.graph.values[v].bytes) for v in choice.saved if v not in region.graph.parameter_only)
  for var, col in program.kept.items():
    if x[col] > 0.5:
      saved_at = program.save_col.get(var)
      arrays[(saved_at[1], saved_at[2]) if saved_at else var] = var_bytes(var)
  activation = program.fixed_bytes + sum(arrays.values())
  loops = tuple(_loop_flops(region) for region in regions)
  return SegmentedPlan(segments, tuple(choices), tuple(names), activation, sum(c.flops for c in choices) + sum(loops),
                       gap, loops)


LOOPS = ("scan", "while")
"""Primitives whose bodies' residuals the plan cannot name (:attr:`SegmentedPlan.loop_flops`)."""


def _floating(dtype: Any) -> bool:
  """Whether ``dtype`` (a dtype or its name) is a float type; PRNG key types are not."""
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:  # 'key<fry>': no NumPy dtype
    return False


def _loop_flops(region: Region) -> int:
  """Forward FLOPs of the region's ``scan``/``while`` ops with a float output that depends on a float input (each
  region input is differentiated): ``jax.checkpoint`` reruns them in the backward pass whatever the plan saves."""
  values = region.graph.values
  inputs = region.closed.in_avals
  differentiated = [False] * len(values)
  for v in values:
    differentiated[v.index] = _floating(v.dtype) and any(
        differentiated[u] if u >= 0 else _floating(inputs[-1 - u].dtype) for u in v.inputs)
  ops = {v.op for v in values if v.primitive in LOOPS and differentiated[v.index]}
  return sum(region.graph.op_flops[o] for o in ops)


def remat_segments(segments: Segments, names: Sequence[Sequence[str]]) -> Callable[..., jax.Array]:
  """The loss with each region under its own ``jax.checkpoint`` saving exactly the values named for it.

  Args:
    segments: from :func:`segment_loss`.
    names: per region, automatic names of the loss's values in that region (a :class:`SegmentedPlan`'s
      ``names``).

  Returns:
    ``(params, batch[, key]) -> scalar``: plain JAX; gradients equal ``segments.loss.fn``'s.

  Raises:
    JaxckptError: not one sequence of names per region, or a name that is no value of its region.
  """
  regions = segments.regions
  if isinstance(names, str) or len(names) != len(regions) or any(isinstance(ns, str) for ns in names):
    raise JaxckptError(f"names must hold one sequence of automatic names per region ({len(regions)}), got {names!r}")
  fns = []
  for region, ns in zip(regions, names):
    valid = {region.global_name(v.index) for v in region.graph.values}
    unknown = [n for n in ns if n not in valid]
    if unknown:
      raise JaxckptError(f"{unknown[:5]} name no value of region {region.index} (its names run from "
                         f"{region.global_name(0)}): use a SegmentedPlan's names")
    tags = {parse_value_name(n)[0]: n for n in ns}
    closed = region.closed
    fn = region_fn(closed.consts, closed.jaxpr.constvars, closed.jaxpr.eqns, closed.jaxpr.invars,
                    closed.jaxpr.outvars, region.first_value, tags)
    policy = (jax.checkpoint_policies.save_only_these_names(*ns) if ns
              else jax.checkpoint_policies.nothing_saveable)
    fns.append(jax.checkpoint(fn, policy=policy))
  jaxpr = segments.loss.closed.jaxpr

  def remat_loss(params, batch, *key):
    env = dict(zip(jaxpr.invars, [*jax.tree.leaves(params), *jax.tree.leaves(batch), *key]))
    for region, fn in zip(regions, fns):
      env.update(zip(region.outputs, fn(*(env[x] for x in region.inputs))))
    out = jaxpr.outvars[0]
    return out.val if not is_var(out) else env[out]

  return remat_loss


def mincut_policy(target: Any, policy: "MinCut", cache: PlanCache | None = None,
                  time_limit: float | None = TIME_LIMIT) -> LossPolicy:
  """Resolves ``mincut:<cap>`` for a target: its whole loss, cut at the narrowest points, one plan under the cap.

  Args:
    target: a :class:`jaxckpt.step.ModelTarget` or :class:`jaxckpt.step.LossTarget` whose loss can be traced with
      its layers unrolled (jaxckpt's :class:`~jaxckpt.Stack` is unrolled for this; a ``scan`` the target runs
      itself stays one opaque equation, inside one region).
    policy: the parsed :class:`~jaxckpt.policies.MinCut`.
    cache: shared between resolutions of one target (the report's), to trace and cut the loss once.
    time_limit: seconds per HiGHS solve.

  Returns:
    A :class:`~jaxckpt.policies.LossPolicy` whose ``loss_fn`` is the plan's remat'd loss and ``plan`` the
    :class:`SegmentedPlan`.

  Raises:
    JaxckptError: the target asks for gradient accumulation, metrics or skipping non-finite steps (the plain step a
      mincut plan builds has none of them: refused before any planning, not after); the cap is below what every
      plan keeps (the message gives the least), or no plan was found.
  """
  check_plain_step(target, policy)
  cache = PlanCache() if cache is None else cache
  if cache.segments is None:
    cache.whole_loss = target_whole_loss(target)
    cache.segments = segment_loss(cache.whole_loss, None, whole_graph(cache.whole_loss))
  loss, segments = cache.whole_loss, cache.segments
  if policy.fraction is not None:
    if cache.none_activation_bytes is None:
      cache.none_activation_bytes = measure_whole(loss).activation_residual_bytes
    cap = policy.fraction * cache.none_activation_bytes
  else:
    cap = float(policy.bytes)
  try:
    plan = segmented_plan(segments, max_bytes=cap, time_limit=time_limit)
  except JaxckptError as err:
    raise JaxckptError(f"no {policy} plan: {err}") from None
  return LossPolicy(plan.loss_fn, str(policy), plan)
