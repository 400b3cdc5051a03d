"""A per-tensor plan over the whole loss: one remat region around ``loss(params, batch, key)``, layers unrolled.

Per-block plans (:mod:`jaxckpt.planner.tensors`) keep every block's input (the region's arguments) and leave the
final LayerNorm, head and loss un-remat'd. PyTorch's AOTAutograd min-cut partitioner instead cuts the whole
forward/backward graph: it keeps no block inputs (the residual stream is rebuilt from saved sublayer outputs) and
little outside the layers. This module does the same in JAX: trace the whole loss to one jaxpr, build its
:class:`~jaxckpt.planner.tensors.BlockGraph` with the same code as a block's (parameter inputs marked, so
parameter-only values such as per-layer weight slices barely count), choose the saved set with the same exact 0-1
program (:func:`~jaxckpt.planner.tensors.solve_block`, scipy's ``milp``/HiGHS) under a byte or FLOPs cap, and apply
it as plain JAX: :func:`jaxckpt.core.tagging.tag_values` on the whole loss under
``jax.checkpoint(policy=save_only_these_names(*chosen))``. JAX's saved-residual analysis then lists exactly the
chosen values (plus the batch and dropout key, which every plan keeps).

One region does not lower compiled memory on XLA:CPU (JAX emits the whole region's recomputation ahead of its
backward pass, and the recomputed values live together), so the loss can also be **segmented**
(:func:`segment_loss`): cut at its narrowest points (the residual stream between blocks), each region traced on its
own, all regions' programs solved as one under a shared cap with each region input kept only when read
(:func:`segmented_plan`), and each region run under its own ``jax.checkpoint`` (:func:`remat_segments`): the policy
``mincut:<cap>`` (:func:`mincut_policy`, a :class:`~jaxckpt.policies.LossPolicy` the report and the planner compile).
On GPT ``small`` its plans equal the one-region plans' bytes and FLOPs at every torch point and compile to 200–338
MiB temp instead of 515–519 MiB.

References: Jain et al. 2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization" (the
integer program); Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (segments); PyTorch's AOTAutograd min-cut rematerialization partitioner (``torch._functorch.partitioners``,
``activation_memory_budget``), the plan this one is compared with (``benchmarks/pertensor_front.py``).

On GPT ``small`` (6 layers, 851 equations, 1181 values) the program has 2100 binaries × 1549 covering rows; HiGHS
solves most caps in 0.3–13 s on one CPU core and needs minutes to prove some optimal, hence a time limit per solve
(:data:`TIME_LIMIT`; the proven gap is kept).

Example::

    >>> from jaxckpt.step import shipped_target
    >>> from jaxckpt.planner.whole import target_whole_loss, whole_plan
    >>> plan = whole_plan(target_whole_loss(shipped_target("gpt", "tiny")), max_bytes=2 * 2**20)
    >>> loss, grads = jax.value_and_grad(plan.loss_fn)(params, batch, key)  # layers unrolled, one remat region
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxckpt.analysis.activations import parameter_only_bytes
from jaxckpt.errors import JaxckptError
from jaxckpt.analysis.flops import count_flops, count_live_flops
from jaxckpt.planner.tensors import (BlockGraph, TensorChoice, block_graph, block_program, solve_block, solve_milp,
                                     tensor_choice)
from jaxckpt.policies import LossPolicy, MinCut, parse_model_policy
from jaxckpt.analysis.residuals import total_residual_bytes, traced_residuals
from jaxckpt.step import default_optimizer, policy_step
from jaxckpt.step.build import check_plain_step, dropout_key_struct
from jaxckpt.units import format_bytes
from jaxckpt.core.tagging import evaluate_equations, parse_value_name, tag_values, value_name, walk_top_level, walk_values

__all__ = ["WholeLoss", "WholePlan", "WholeMeasure", "whole_loss", "target_whole_loss", "whole_graph", "whole_plan",
           "remat_whole_loss", "measure_whole", "WHOLE", "TIME_LIMIT", "Region", "Segments", "SegmentedPlan",
           "narrow_cuts", "segment_loss", "segmented_plan", "remat_segments", "mincut_policy"]

WHOLE = "whole"
"""The ``block_type`` of the whole loss's graph and choices."""

TIME_LIMIT = 20.0
"""Seconds HiGHS may spend on each of a whole-loss plan's two solves by default (then the best set found is taken,
its proven gap in ``choice.mip_gap``). On GPT ``small`` most caps solve to optimality in 0.5–20 s, some take minutes
to prove (six identical layers: many symmetric optima)."""


@dataclasses.dataclass(frozen=True)
class WholeLoss:
  """A loss as one function of flat leaves, with its abstract arguments and traced jaxpr.

  Attributes:
    fn: ``(params, batch, key) -> scalar float32`` as given.
    params: pytree of ``jax.ShapeDtypeStruct`` (float leaves; differentiated).
    batch: pytree of ``jax.ShapeDtypeStruct`` (closed over by the backward pass, e.g. ``{"tokens": [B, T+1]
      int32}``).
    key: ``jax.ShapeDtypeStruct`` of a typed PRNG key (dropout), or ``None`` when ``fn`` takes none.
    closed: ``jax.make_jaxpr`` of :meth:`flat` over ``(*param_leaves, *batch_leaves, key)``.
    num_parameters: how many leading inputs of ``closed`` are parameter leaves.
  """

  fn: Callable[..., jax.Array]
  params: Any
  batch: Any
  key: Any
  closed: Any
  num_parameters: int

  def flat(self, *leaves: Any) -> jax.Array:
    """``fn`` of ``(*param_leaves, *batch_leaves[, key])``, the signature of :attr:`closed`."""
    p_tree = jax.tree.structure(self.params)
    b_tree = jax.tree.structure(self.batch)
    n, m = self.num_parameters, b_tree.num_leaves
    params = jax.tree.unflatten(p_tree, leaves[:n])
    batch = jax.tree.unflatten(b_tree, leaves[n:n + m])
    return self.fn(params, batch, leaves[n + m]) if self.key is not None else self.fn(params, batch)


def whole_loss(fn: Callable[..., jax.Array], params: Any, batch: Any, key: Any = None) -> WholeLoss:
  """Traces ``fn(params, batch[, key])`` once (abstract values only) for a whole-loss plan.

  Args:
    fn: the loss, ``(params, batch, key) -> scalar float32`` (or ``(params, batch)`` when ``key`` is ``None``),
      with layers unrolled (a ``scan`` over layers is one opaque equation to the plan).
    params: pytree of arrays or ``jax.ShapeDtypeStruct``, float leaves only.
    batch: pytree of arrays or ``jax.ShapeDtypeStruct`` (integer token ids, labels, ...).
    key: a typed PRNG key (or its ``ShapeDtypeStruct``), or ``None``.

  Returns:
    The :class:`WholeLoss`.

  Raises:
    JaxckptError: no parameter leaf, a non-float parameter leaf (the plan differentiates every parameter leaf), or
      ``fn`` does not return a float scalar.
  """
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  params, batch = jax.tree.map(shape, params), jax.tree.map(shape, batch)
  key = None if key is None else shape(key)
  bad = [(jax.tree_util.keystr(path), str(leaf.dtype)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
         if not jnp.issubdtype(leaf.dtype, jnp.floating)]
  if bad:
    raise JaxckptError(f"params must have float leaves only (they are differentiated); got {bad[:3]}: pass integer "
                       "inputs in batch")
  if not jax.tree.leaves(params):
    raise JaxckptError(f"params has no array leaves (got {params!r}): a whole-loss plan differentiates w.r.t. them")
  loss = WholeLoss(fn, params, batch, key, None, len(jax.tree.leaves(params)))
  leaves = [*jax.tree.leaves(params), *jax.tree.leaves(batch)] + ([] if key is None else [key])
  closed = jax.make_jaxpr(loss.flat)(*leaves)
  outs = closed.out_avals
  if len(outs) != 1 or outs[0].shape != () or not jnp.issubdtype(outs[0].dtype, jnp.floating):
    got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
    raise JaxckptError(f"the loss must return one float scalar; got {got or 'nothing'}")
  return dataclasses.replace(loss, closed=closed)


def target_whole_loss(target: Any) -> WholeLoss:
  """The :class:`WholeLoss` of a target's train step: its loss w.r.t. the params, layers unrolled, no remat
  (:attr:`jaxckpt.step.PolicyStep.loss_of_params` under ``none``), dropout on.

  Args:
    target: a :class:`jaxckpt.step.ModelTarget` or :class:`jaxckpt.step.LossTarget`.

  Returns:
    The :class:`WholeLoss` of ``(params, batch, dropout_key) -> loss``.
  """
  step = policy_step(target, parse_model_policy("none"), default_optimizer())
  return whole_loss(step.loss_of_params, step.params, step.batch, dropout_key_struct())


def whole_graph(loss: WholeLoss) -> BlockGraph:
  """The min-cut graph of the whole loss (:func:`jaxckpt.planner.tensors.block_graph`, parameters marked).

  Args:
    loss: from :func:`whole_loss` or :func:`target_whole_loss`.

  Returns:
    A :class:`~jaxckpt.planner.tensors.BlockGraph` with ``block_type="whole"``; its ``parameter_only`` values are
    computed from the params alone, its ``fixed_bytes`` are the batch's and key's bytes (kept by every plan).
  """
  return block_graph(WHOLE, loss.closed, num_parameters=loss.num_parameters)


@dataclasses.dataclass(frozen=True)
class WholePlan:
  """A whole-loss per-tensor plan.

  Attributes:
    loss: the traced loss.
    graph: its graph.
    choice: the chosen saved set (``choice.names`` are automatic names, ``choice.activation_bytes`` the predicted
      saved activation bytes, ``choice.flops`` the predicted recomputed forward FLOPs).
  """

  loss: WholeLoss
  graph: BlockGraph
  choice: TensorChoice

  @property
  def loss_fn(self) -> Callable[..., jax.Array]:
    """``(params, batch[, key]) -> loss`` under one ``jax.checkpoint`` saving exactly ``choice.names``."""
    return remat_whole_loss(self.loss, self.choice.names)


def whole_plan(loss: WholeLoss, *, max_bytes: float | None = None, max_flops: float | None = None,
               minimise: str = "cost", graph: BlockGraph | None = None,
               time_limit: float | None = TIME_LIMIT) -> WholePlan:
  """The optimal saved set of the whole loss under a cap on saved activation bytes or on recomputed FLOPs.

  Args:
    loss: from :func:`whole_loss` or :func:`target_whole_loss`.
    max_bytes: cap on saved activation bytes (the chosen values that are not parameter-only, plus the batch and
      key); ``None``: no cap.
    max_flops: cap on recomputed forward FLOPs (transcendentals excluded); ``None``: no cap.
    minimise: ``"cost"`` (recompute cost, then bytes) or ``"bytes"`` (saved bytes, then cost; with ``max_flops``
      this is the least-memory plan at a given recompute).
    graph: :func:`whole_graph` of ``loss`` when already built (sweeps of caps reuse it).
    time_limit: seconds per HiGHS solve (:data:`TIME_LIMIT`; ``None``: until proven optimal).

  Returns:
    The :class:`WholePlan`.

  Raises:
    JaxckptError: a cap that is not a number or is NaN; ``max_bytes`` below what every plan keeps (the batch and
      key) or negative ``max_flops``; both caps given and no set meets both (the message gives the least bytes at
      that ``max_flops``); ``time_limit`` not ``None`` or > 0; an unknown ``minimise``; a ``graph`` that is not
      ``loss``'s.
  """
  _check_caps(max_bytes=max_bytes, max_flops=max_flops, time_limit=time_limit)
  graph = whole_graph(loss) if graph is None else graph
  _check_graph(loss, graph)
  if max_bytes is not None and max_bytes < graph.fixed_bytes:
    raise JaxckptError(f"max_bytes={max_bytes:g} is below the {graph.fixed_bytes} bytes every whole-loss plan keeps "
                       f"(its batch and key); give max_bytes ≥ {graph.fixed_bytes}")
  if max_flops is not None and max_flops < 0:
    raise JaxckptError(f"max_flops={max_flops:g} must be ≥ 0 (0: recompute nothing)")
  choice = solve_block(graph, max_bytes=max_bytes, max_flops=max_flops, minimise=minimise, time_limit=time_limit)
  if choice is None:  # both caps (saving nothing / everything meets either alone), or no set found in time_limit
    if max_bytes is None or max_flops is None:
      raise JaxckptError(f"HiGHS found no whole-loss plan within time_limit={time_limit} s (max_bytes={max_bytes}, "
                         f"max_flops={max_flops}): give a longer time_limit, or None")
    least = solve_block(graph, max_flops=max_flops, minimise="bytes", time_limit=time_limit)
    hint = "" if least is None else f"; the least saved bytes at max_flops={max_flops:g} is {least.activation_bytes}"
    raise JaxckptError(f"no whole-loss plan meets both max_bytes={max_bytes:g} and max_flops={max_flops:g}{hint}: "
                       "raise one cap or give one only")
  return WholePlan(loss, graph, choice)


def _check_caps(**caps: Any) -> None:
  """Raises :class:`JaxckptError` for a cap that is not a number (or ``None``), is NaN, or a ``time_limit`` ≤ 0."""
  for name, cap in caps.items():
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real) or math.isnan(cap)):
      raise JaxckptError(f"{name}={cap!r} must be a number (or None: no limit)")
  if caps.get("time_limit") is not None and caps["time_limit"] <= 0:
    raise JaxckptError(f"time_limit={caps['time_limit']:g} must be > 0 seconds (None: solve until proven optimal)")


def _check_graph(loss: WholeLoss, graph: BlockGraph) -> None:
  """Raises :class:`JaxckptError` when ``graph`` is not ``loss``'s (another loss's graph gives names that tag
  nothing in this one: a silent no-op plan)."""
  ours = [(v.name, v.shape) for v in walk_values(loss.closed)]
  if graph.block_type != WHOLE or [(v.name, v.shape) for v in graph.values] != ours:
    raise JaxckptError(f"graph is not this loss's (block_type {graph.block_type!r}, {len(graph.values)} values; the "
                       f"loss has {len(ours)}): pass whole_graph(loss) or omit graph")


def remat_whole_loss(loss: WholeLoss, names: Sequence[str]) -> Callable[..., jax.Array]:
  """``loss.fn`` under one ``jax.checkpoint`` that saves exactly the values named (automatic names).

  Args:
    loss: from :func:`whole_loss`.
    names: automatic names (:func:`jaxckpt.core.tagging.value_name`), e.g. a :class:`WholePlan`'s ``choice.names``.

  Returns:
    ``(params, batch[, key]) -> scalar``: plain JAX (``tag_values`` + ``save_only_these_names``); gradients equal
    ``loss.fn``'s.

  Raises:
    JaxckptError: ``names`` is a string, or a name that is not the automatic name of one of the loss's values (it
      would tag nothing and save nothing: the message lists a few valid names).
  """
  if isinstance(names, str):
    raise JaxckptError(f"names must be a sequence of automatic names, not the string {names!r}")
  valid = {v.name for v in walk_values(loss.closed)}
  unknown = [n for n in names if n not in valid]
  if unknown:
    some = ", ".join(v.name for v in walk_values(loss.closed)[:4])
    raise JaxckptError(f"{unknown[:5]} name no value of this loss ({len(valid)} values; valid names look like "
                       f"{some}, …: use a WholePlan's choice.names or whole_graph(loss).values)")
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  inner = jax.checkpoint(tag_values(loss.flat, names), policy=policy)

  def remat_loss(params, batch, *key):
    return inner(*jax.tree.leaves(params), *jax.tree.leaves(batch), *key)

  return remat_loss


@dataclasses.dataclass(frozen=True)
class WholeMeasure:
  """What a loss (remat'd or not) saves and computes, measured from traces (nothing compiled or run).

  Attributes:
    activation_residual_bytes: JAX's saved residuals w.r.t. the params, arguments and parameter-only values
      excluded (as the report's ``activation_residual_bytes``), bytes.
    residual_bytes: the same with parameter-only values, bytes.
    flops: FLOPs of ``jax.value_and_grad`` of the loss w.r.t. the params (forward + backward, all ops,
      :func:`jaxckpt.count_flops`; transcendentals excluded).
    saved_names: the checkpoint names among the residuals.
    live_flops: the same after dead-code elimination (:func:`jaxckpt.count_live_flops`: what XLA runs; without
      remat the backward's jaxpr has dead code that a remat'd one does not).
  """

  activation_residual_bytes: int
  residual_bytes: int
  flops: int
  saved_names: frozenset[str]
  live_flops: int


def measure_whole(loss: WholeLoss, fn: Callable[..., jax.Array] | None = None) -> WholeMeasure:
  """Measures ``fn`` (default ``loss.fn``, no remat), a function with ``loss.fn``'s signature.

  Args:
    loss: gives the abstract arguments.
    fn: e.g. :attr:`WholePlan.loss_fn`.

  Returns:
    The :class:`WholeMeasure`.
  """
  fn = loss.fn if fn is None else fn
  key = () if loss.key is None else (loss.key,)
  found = {}

  def outer(batch, *k):  # batch and key closed over by the vjp, as in the train step's residual analysis
    traced = traced_residuals(lambda p: fn(p, batch, *k), loss.params)
    found["bytes"] = total_residual_bytes(traced.residuals, include_arguments=False)
    found["param_only"] = parameter_only_bytes(traced.jaxpr, traced.num_residuals)
    found["names"] = frozenset(r.name for r in traced.residuals if r.kind == "checkpoint_name")
    return 0

  jax.make_jaxpr(outer)(loss.batch, *key)
  grad = lambda p, b, *k: jax.value_and_grad(fn)(p, b, *k)  # noqa: E731
  flops = count_flops(grad, loss.params, loss.batch, *key).total
  live = count_live_flops(grad, loss.params, loss.batch, *key).total
  return WholeMeasure(found["bytes"] - found["param_only"], found["bytes"], flops, found["names"], live)


# --- Segmented plans: the whole-loss program, applied one region at a time ---------------------------------------


INNER_SHARE = 0.01
"""A cut needs at least this share of the loss's forward FLOPs on each side (:func:`narrow_cuts`). At 0.1% a
classifier's pooled features (``[B, D]`` before a small head) were narrower than its residual stream, so they were its
only narrow cut and every region but one was merged away (ViT and MLP ``tiny``, a Linen Transformer classifier: one
region, compiled temp above no remat's at half its saved bytes)."""

MIN_REGION_SHARE = 0.01
"""Least share of the forward FLOPs a region of the default cuts holds (:func:`segment_loss`). On GPT ``small`` a
separate region for the final LayerNorm cost one more recomputed logits matmul (+0.4% of the step's FLOPs) at every
cap below 122 MiB."""


@dataclasses.dataclass(frozen=True)
class Region:
  """Consecutive top-level equations of a whole loss, run under one ``jax.checkpoint``.

  Attributes:
    index: its position among the loss's regions.
    start, stop: its top-level equations, ``loss.closed.jaxpr.eqns[start:stop]``.
    first_value: the automatic-name number of its first value: a segmented loss's values are numbered region after
      region, each region as its own trace numbers them (re-tracing a region may fold a constant the loss's trace
      kept, so these numbers are not the whole loss's).
    inputs: the jaxpr variables it reads that earlier regions (or the loss's arguments) define; JAX keeps those the
      region's backward pass or recomputation reads (the region's arguments).
    outputs: the variables it defines that later regions read or the loss returns.
    closed: the region as one function of its inputs, ``(*inputs) -> [*outputs]``, traced once (what is run).
    graph: the :class:`~jaxckpt.planner.tensors.BlockGraph` of ``closed`` (value ``n`` is named ``first_value +
      n``), every float input differentiated, parameter inputs marked.
    input_bytes: bytes of its inputs that are neither parameters nor parameter-only values (activations, token
      ids, keys): at most what it keeps as arguments.
    parameter_inputs: positions of its inputs that are parameters or parameter-only values.
    output_values: the graph's value number of each output (``None``: an input passed through).
  """

  index: int
  start: int
  stop: int
  first_value: int
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]
  closed: Any
  graph: BlockGraph
  input_bytes: int
  parameter_inputs: frozenset[int]
  output_values: tuple[int | None, ...]

  def global_name(self, local: int) -> str:
    """The segmented loss's automatic name of the graph's value ``local``."""
    return value_name(self.first_value + local, self.graph.values[local].primitive)


@dataclasses.dataclass(frozen=True)
class Segments:
  """A whole loss cut into regions (:func:`segment_loss`).

  Attributes:
    loss: the traced loss.
    regions: its regions in program order; every top-level equation is in exactly one.
    input_bytes: bytes of the distinct region inputs that are activations, token ids or keys (each kept once).
  """

  loss: WholeLoss
  regions: tuple[Region, ...]
  input_bytes: int


def _var_bytes(var: Any) -> int:
  try:
    return int(math.prod(var.aval.shape)) * jnp.dtype(var.aval.dtype).itemsize
  except TypeError:  # PRNG keys: no plain itemsize
    return 0


def _is_var(a: Any) -> bool:
  return not isinstance(a, jex_core.Literal)


def narrow_cuts(loss: WholeLoss, graph: BlockGraph | None = None) -> list[tuple[int, int, int]]:
  """Where a whole loss can be cut cheaply: the top-level positions after which the fewest activation bytes live on.

  The bytes crossing position ``p`` are those of the values defined before top-level equation ``p`` and read at or
  after it, parameter-only values and constants excluded. The narrow cuts are the positions whose crossing bytes
  are at most the least crossing of any position with ≥ :data:`INNER_SHARE` of the forward FLOPs on each side
  (+ 1%), among those positions: in a Transformer, the residual stream between blocks (a cut after the last matmul,
  e.g. before a loss's final mean, would save nothing). Runs of consecutive narrow positions (parameter slicing between
  two layers) count once, at their first position, so a region starts where the previous one's values die.

  Args:
    loss: from :func:`whole_loss`.
    graph: its :func:`whole_graph` (built when omitted).

  Returns:
    ``[(position, crossing_bytes, forward_flops_before), ...]`` in program order.
  """
  graph = whole_graph(loss) if graph is None else graph
  _check_graph(loss, graph)
  jaxpr = loss.closed.jaxpr
  _, top = walk_top_level(loss.closed)
  m = len(jaxpr.eqns)
  firsts = [f for f, _ in top] + [len(graph.values)]
  flops_before = [0]
  for i in range(m):
    ops = {graph.values[v].op for v in range(firsts[i], firsts[i + 1])}
    flops_before.append(flops_before[-1] + sum(graph.op_flops[o] for o in ops))
  total = flops_before[-1]
  defined: dict[Any, int] = {}
  weight: dict[Any, int] = {}
  for i, (eqn, (_, outs)) in enumerate(zip(jaxpr.eqns, top)):
    for var, value in zip(eqn.outvars, outs):
      defined[var] = i
      light = value is None or value < 0 or value in graph.parameter_only or not graph.values[value].taggable
      weight[var] = 0 if light else graph.values[value].bytes
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for a in eqn.invars:
      if _is_var(a) and a in defined:
        last[a] = i
  for a in jaxpr.outvars:
    if _is_var(a) and a in defined:
      last[a] = m
  delta = [0] * (m + 2)  # crossing(p) = Σ weight of vars with defined < p ≤ last
  for var, d in defined.items():
    if var in last and last[var] > d:
      delta[d + 1] += weight[var]
      delta[last[var] + 1] -= weight[var]
  crossing, running = [], 0
  for p in range(m + 1):
    running += delta[p]
    crossing.append(running)
  inner = [p for p in range(1, m) if min(flops_before[p], total - flops_before[p]) >= INNER_SHARE * total]
  if not inner:
    return []
  width = min(crossing[p] for p in inner) * 1.01
  cuts, previous = [], None
  for p in inner:
    if crossing[p] <= width:
      if previous != p - 1:
        cuts.append((p, crossing[p], flops_before[p]))
      previous = p
  return cuts


def segment_loss(loss: WholeLoss, regions: int | Sequence[int] | None = None,
                 graph: BlockGraph | None = None) -> Segments:
  """Cuts a whole loss into regions, each to run under its own ``jax.checkpoint``.

  One region (the whole loss under one ``jax.checkpoint``) is what the 0-1 program models best, but JAX emits the
  whole forward's recomputation ahead of the backward pass and XLA:CPU keeps it alive at once (compiled temp
  barely drops); regions bound that to one region at a time, at the price of keeping each region's inputs (one
  residual-stream tensor per cut in a Transformer). This is per-block remat's structure (Chen et al. 2016) with
  the per-tensor program inside every region, solved jointly (:func:`segmented_plan`).

  Args:
    loss: from :func:`whole_loss`.
    regions: ``None`` (default): cut at every narrowest point (the :func:`narrow_cuts` whose crossing bytes are
      the least, within 0.1%: in a Transformer, between every two blocks and before the head), except where a
      region would hold less than :data:`MIN_REGION_SHARE` of the forward FLOPs (it joins the next one: a cut
      between a final LayerNorm and the logits would make the logits' input a kept input while the LayerNorm
      alone saves nothing); an int ≥ 1: that
      many regions, the cuts chosen among :func:`narrow_cuts` so that the largest region's forward FLOPs are least
      (ties: the earliest cuts); or the explicit top-level cut positions, increasing, each in
      ``1 .. len(loss.closed.jaxpr.eqns) - 1``.
    graph: the loss's :func:`whole_graph` (built when omitted).

  Returns:
    The :class:`Segments`.

  Raises:
    JaxckptError: ``regions`` not an int ≥ 1 nor increasing positions in range; more regions than narrow cuts + 1
      (the message gives the most).
  """
  graph = whole_graph(loss) if graph is None else graph
  _check_graph(loss, graph)
  jaxpr = loss.closed.jaxpr
  m = len(jaxpr.eqns)
  if regions is None:
    narrow = narrow_cuts(loss, graph)
    least = min((c[1] for c in narrow), default=0)
    total, cuts, last = graph.forward_flops, [], 0
    for position, crossing, before in narrow:
      # the narrowest cuts, but no region under MIN_REGION_SHARE of the FLOPs (a final LayerNorm joins the head)
      if crossing <= least * 1.001 and min(before - last, total - before) >= MIN_REGION_SHARE * total:
        cuts.append(position)
        last = before
    return _segments(loss, graph, cuts)
  if isinstance(regions, np.ndarray) and regions.ndim == 1 and np.issubdtype(regions.dtype, np.integer):
    regions = [int(r) for r in regions]
  if isinstance(regions, bool) or not isinstance(regions, (numbers.Integral, Sequence)) or isinstance(regions, str):
    raise JaxckptError(f"regions={regions!r} must be a number of regions ≥ 1 or a sequence of cut positions")
  if isinstance(regions, numbers.Integral):
    if regions < 1:
      raise JaxckptError(f"regions={regions} must be ≥ 1 (1: the whole loss under one jax.checkpoint)")
    narrow = narrow_cuts(loss, graph)
    if regions - 1 > len(narrow):
      raise JaxckptError(f"regions={regions}: this loss has {len(narrow)} narrow cuts, so at most "
                         f"{len(narrow) + 1} regions")
    cuts = _balanced_cuts([c[0] for c in narrow], [c[2] for c in narrow], graph.forward_flops, regions - 1)
  else:
    cuts = list(regions)
    if (any(isinstance(c, bool) or not isinstance(c, numbers.Integral) for c in cuts)
        or any(not 0 < c < m for c in cuts) or cuts != sorted(set(cuts))):
      raise JaxckptError(f"cut positions {cuts!r} must be increasing whole numbers in 1..{m - 1} (the loss has {m} "
                         "top-level equations)")
  return _segments(loss, graph, cuts)


def _balanced_cuts(positions: Sequence[int], before: Sequence[int], total: int, k: int) -> list[int]:
  """``k`` of ``positions`` minimising the largest region's FLOPs (dynamic program; ties: earliest)."""
  if k == 0:
    return []
  points = [0, *before, total]
  n = len(positions)
  best: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}

  def solve(i: int, left: int) -> tuple[int, tuple[int, ...]]:  # last cut at points[i]; `left` cuts to place after
    if (i, left) in best:
      return best[(i, left)]
    if left == 0:
      out = (total - points[i], ())
    else:
      out = None
      for j in range(i + 1, n + 1 - left + 1):
        worst, rest = solve(j, left - 1)
        cand = (max(points[j] - points[i], worst), (j,) + rest)
        if out is None or cand[0] < out[0]:
          out = cand
    best[(i, left)] = out
    return out

  return [positions[j - 1] for j in solve(0, k)[1]]


def _segments(loss: WholeLoss, graph: BlockGraph, cuts: Sequence[int]) -> Segments:
  jaxpr = loss.closed.jaxpr
  values, top = walk_top_level(loss.closed)
  m = len(jaxpr.eqns)
  bounds = [0, *cuts, m]
  params = set(jaxpr.invars[:loss.num_parameters])
  value_of: dict[Any, int] = {}
  for eqn, (_, outs) in zip(jaxpr.eqns, top):
    for var, value in zip(eqn.outvars, outs):
      if value is not None:
        value_of[var] = value
  first = 0
  out_vars = {a for a in jaxpr.outvars if _is_var(a)}
  regions, kept = [], {}
  consts = set(jaxpr.constvars)
  for k in range(len(bounds) - 1):
    a, b = bounds[k], bounds[k + 1]
    eqns = jaxpr.eqns[a:b]
    defined = {v for e in eqns for v in e.outvars}
    inputs: list = []
    for e in eqns:
      for x in e.invars:
        if _is_var(x) and x not in defined and x not in consts and x not in inputs:
          inputs.append(x)
    read_after = {x for e in jaxpr.eqns[b:] for x in e.invars if _is_var(x)} | out_vars
    outputs = tuple(v for e in eqns for v in e.outvars if v in read_after)
    parameter_like = [i for i, x in enumerate(inputs)
                      if x in params or (x in value_of and value_of[x] >= 0 and value_of[x] in graph.parameter_only)
                      or (x in value_of and value_of[x] < 0 and -1 - value_of[x] < loss.num_parameters)]
    fn = _region_fn(loss.closed.consts, jaxpr.constvars, eqns, tuple(inputs), outputs, 0, {})
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in inputs))
    region_graph = block_graph(f"region{k}", closed, parameter_inputs=parameter_like)
    for i, x in enumerate(inputs):
      if i not in parameter_like:
        kept[x] = _var_bytes(x)
    produced = {}
    for eqn, (_, outs) in zip(closed.jaxpr.eqns, walk_top_level(closed)[1]):
      produced.update((var, value) for var, value in zip(eqn.outvars, outs) if value is not None and value >= 0)
    output_values = tuple(produced.get(v) if _is_var(v) else None for v in closed.jaxpr.outvars)
    regions.append(Region(k, a, b, first, tuple(inputs), outputs, closed, region_graph,
                          sum(_var_bytes(x) for i, x in enumerate(inputs) if i not in parameter_like),
                          frozenset(parameter_like), output_values))
    first += len(region_graph.values)
  return Segments(loss, tuple(regions), sum(kept.values()))


def _region_fn(consts: Sequence[Any], constvars: Sequence[Any], eqns: Sequence[Any], inputs: Sequence[Any],
               outputs: Sequence[Any], first: int, tags: dict[int, str]) -> Callable[..., list[Any]]:
  """``(*inputs) -> [*outputs]``: the equations run one by one, values in ``tags`` named (numbered from ``first``)."""

  def run(*args):
    env = dict(zip(constvars, consts))
    env.update(zip(inputs, args))
    evaluate_equations(eqns, env, tags, first)
    return [a.val if not _is_var(a) else env[a] for a in outputs]

  return run


@dataclasses.dataclass(frozen=True)
class SegmentedPlan:
  """A per-tensor plan of a segmented whole loss (:func:`segmented_plan`).

  Attributes:
    segments: the regions.
    choices: one :class:`~jaxckpt.planner.tensors.TensorChoice` per region (its graph's numbering).
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


def segmented_plan(segments: Segments, *, max_bytes: float | None = None, max_flops: float | None = None,
                   minimise: str = "cost", time_limit: float | None = TIME_LIMIT) -> SegmentedPlan:
  """The optimal saved sets of all regions of a segmented loss, under one cap on their total.

  The regions' 0-1 programs (:func:`jaxckpt.planner.tensors.solve_block`'s) are solved as one program with a shared
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
  from scipy import optimize, sparse  # pylint: disable=g-import-not-at-top
  _check_caps(max_bytes=max_bytes, max_flops=max_flops, time_limit=time_limit)
  if minimise not in ("cost", "bytes"):
    raise JaxckptError(f"minimise={minimise!r}; valid: cost, bytes")
  if max_flops is not None and max_flops < 0:
    raise JaxckptError(f"max_flops={max_flops:g} must be ≥ 0 (0: recompute nothing)")
  regions = segments.regions
  programs = [block_program(r.graph) for r in regions]
  offsets = [0, *itertools.accumulate(p[1] for p in programs)]
  bytes_, cost, flops = ([float(c) for p in programs for c in p[k]] for k in (4, 5, 6))
  save_col: dict[Any, tuple[int, int, int]] = {}  # region output var -> (column, region, value) of saving it there
  for k, (region, program) in enumerate(zip(regions, programs)):
    s_at = {v: i for i, v in enumerate(program[0])}
    for var, v in zip(region.outputs, region.output_values):
      if v is not None and v in s_at:
        save_col[var] = (offsets[k] + s_at[v], k, v)
  kept: dict[Any, int] = {}  # var -> column: kept as a region's argument (one column per array)
  fixed: dict[Any, int] = {}  # token ids, keys a region reads: always kept
  extra: list[tuple[list[tuple[int, float]], float]] = []
  for k, (region, program) in enumerate(zip(regions, programs)):
    svals, ops = program[0], program[7]
    r_at = {o: offsets[k] + len(svals) + i for i, o in enumerate(ops)}
    readers: dict[int, set[int]] = {}
    for value in region.graph.values:
      for u in value.inputs:
        if u < 0:
          readers.setdefault(-1 - u, set()).add(value.op)
    for i, var in enumerate(region.inputs):
      if i in region.parameter_inputs or (i not in readers and i not in region.graph.needed_inputs):
        continue
      if not jnp.issubdtype(var.aval.dtype, jnp.floating):
        fixed[var] = _var_bytes(var)
        continue
      if var not in kept:
        if var in save_col:
          kept[var] = save_col[var][0]
        else:
          kept[var] = len(bytes_)
          bytes_.append(float(_var_bytes(var)))
          cost.append(0.0)
          flops.append(0.0)
      col = kept[var]
      if i in region.graph.needed_inputs:
        extra.append(([(col, 1.0)], 1.0))
      extra.extend(([(col, 1.0), (r_at[o], -1.0)], 0.0) for o in sorted(readers.get(i, ())) if o in r_at)
  n = len(bytes_)
  bytes_, cost, flops = np.array(bytes_), np.array(cost), np.array(flops)
  fixed_bytes = sum(fixed.values())
  blocks = [p[2] for p in programs if p[2].shape[0]]
  rows = sparse.block_diag([p[2] for p in programs], format="csr") if blocks else sparse.csr_array((0, offsets[-1]))
  rows = sparse.hstack([rows, sparse.csr_array((rows.shape[0], n - offsets[-1]))], format="csr")
  lows = [low for p in programs for low in p[3]]
  if extra:
    data = [c for entries, _ in extra for _, c in entries]
    cols = [j for entries, _ in extra for j, _ in entries]
    indptr = [0, *itertools.accumulate(len(entries) for entries, _ in extra)]
    rows = sparse.vstack([rows, sparse.csr_array((data, cols, indptr), shape=(len(extra), n))], format="csr")
    lows += [low for _, low in extra]
  base = [optimize.LinearConstraint(rows, np.array(lows, float), np.inf)] if lows else []
  if max_bytes is not None:
    base.append(optimize.LinearConstraint(bytes_[None], -np.inf, max_bytes - fixed_bytes))
  if max_flops is not None:
    base.append(optimize.LinearConstraint(flops[None], -np.inf, max_flops))
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
    svals = programs[k][0]
    choice = tensor_choice(region.graph, [v for i, v in enumerate(svals) if x[offsets[k] + i] > 0.5])
    choices.append(choice)
    names.append(tuple(region.global_name(v) for v in choice.saved))
    arrays.update(((k, v), region.graph.values[v].bytes) for v in choice.saved if v not in region.graph.parameter_only)
  for var, col in kept.items():
    if x[col] > 0.5:
      arrays[(save_col[var][1], save_col[var][2]) if var in save_col else var] = _var_bytes(var)
  activation = fixed_bytes + sum(arrays.values())
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
    fn = _region_fn(closed.consts, closed.jaxpr.constvars, closed.jaxpr.eqns, closed.jaxpr.invars,
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
    return out.val if not _is_var(out) else env[out]

  return remat_loss


def mincut_policy(target: Any, policy: "MinCut", cache: MutableMapping[str, Any] | None = None,
                  time_limit: float | None = TIME_LIMIT) -> LossPolicy:
  """Resolves ``mincut:<cap>`` for a target: its whole loss, cut at the narrowest points, one plan under the cap.

  Args:
    target: a :class:`jaxckpt.step.ModelTarget` or :class:`jaxckpt.step.LossTarget` whose loss can be traced with
      its layers unrolled (jaxckpt's :class:`~jaxckpt.Stack` is unrolled for this; a ``scan`` the target runs
      itself stays one opaque equation, inside one region).
    policy: the parsed :class:`~jaxckpt.policies.MinCut`.
    cache: a dict shared between resolutions of one target (the report's), to trace and cut the loss once.
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
  cache = {} if cache is None else cache
  key = "mincut segments"
  if key not in cache:
    loss = target_whole_loss(target)
    graph = whole_graph(loss)
    cache[key] = (loss, segment_loss(loss, None, graph))
  loss, segments = cache[key]
  if policy.fraction is not None:
    if "mincut none" not in cache:
      cache["mincut none"] = measure_whole(loss).activation_residual_bytes
    cap = policy.fraction * cache["mincut none"]
  else:
    cap = float(policy.bytes)
  try:
    plan = segmented_plan(segments, max_bytes=cap, time_limit=time_limit)
  except JaxckptError as err:
    raise JaxckptError(f"no {policy} plan: {err}") from None
  return LossPolicy(plan.loss_fn, str(policy), plan)
