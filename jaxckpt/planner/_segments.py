"""Cutting a whole loss into regions at its narrowest points (the residual stream between blocks), each region a
function of its own inputs, so a segmented plan (:mod:`jaxckpt.planner._segmented`) can run each under its own
``jax.checkpoint``.

A cut is a top-level position of the loss's jaxpr after which the fewest activation bytes live on (parameter slices
not counted); every region keeps at least :data:`MIN_REGION_SHARE` of the forward FLOPs. The idea of segments is
Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; where to cut follows the min-cut partitioners'
observation that the narrowest activations are the cheapest to keep.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxckpt.core._tagging import evaluate_equations, value_name, walk_top_level
from jaxckpt.errors import JaxckptError
from jaxckpt.planner._tensors import (BlockGraph, block_graph)
from jaxckpt.planner._whole import WholeLoss, check_graph, whole_graph

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
    graph: the :class:`~jaxckpt.planner._tensors.BlockGraph` of ``closed`` (value ``n`` is named ``first_value +
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


def var_bytes(var: Any) -> int:
  try:
    return int(math.prod(var.aval.shape)) * jnp.dtype(var.aval.dtype).itemsize
  except TypeError:  # PRNG keys: no plain itemsize
    return 0


def is_var(a: Any) -> bool:
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
  check_graph(loss, graph)
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
      if is_var(a) and a in defined:
        last[a] = i
  for a in jaxpr.outvars:
    if is_var(a) and a in defined:
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
  check_graph(loss, graph)
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
  out_vars = {a for a in jaxpr.outvars if is_var(a)}
  regions, kept = [], {}
  consts = set(jaxpr.constvars)
  for k in range(len(bounds) - 1):
    a, b = bounds[k], bounds[k + 1]
    eqns = jaxpr.eqns[a:b]
    defined = {v for e in eqns for v in e.outvars}
    inputs: list = []
    for e in eqns:
      for x in e.invars:
        if is_var(x) and x not in defined and x not in consts and x not in inputs:
          inputs.append(x)
    read_after = {x for e in jaxpr.eqns[b:] for x in e.invars if is_var(x)} | out_vars
    outputs = tuple(v for e in eqns for v in e.outvars if v in read_after)
    parameter_like = [i for i, x in enumerate(inputs)
                      if x in params or (x in value_of and value_of[x] >= 0 and value_of[x] in graph.parameter_only)
                      or (x in value_of and value_of[x] < 0 and -1 - value_of[x] < loss.num_parameters)]
    fn = region_fn(loss.closed.consts, jaxpr.constvars, eqns, tuple(inputs), outputs, 0, {})
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in inputs))
    region_graph = block_graph(f"region{k}", closed, parameter_inputs=parameter_like)
    for i, x in enumerate(inputs):
      if i not in parameter_like:
        kept[x] = var_bytes(x)
    produced = {}
    for eqn, (_, outs) in zip(closed.jaxpr.eqns, walk_top_level(closed)[1]):
      produced.update((var, value) for var, value in zip(eqn.outvars, outs) if value is not None and value >= 0)
    output_values = tuple(produced.get(v) if is_var(v) else None for v in closed.jaxpr.outvars)
    regions.append(Region(k, a, b, first, tuple(inputs), outputs, closed, region_graph,
                          sum(var_bytes(x) for i, x in enumerate(inputs) if i not in parameter_like),
                          frozenset(parameter_like), output_values))
    first += len(region_graph.values)
  return Segments(loss, tuple(regions), sum(kept.values()))


def region_fn(consts: Sequence[Any], constvars: Sequence[Any], eqns: Sequence[Any], inputs: Sequence[Any],
               outputs: Sequence[Any], first: int, tags: dict[int, str]) -> Callable[..., list[Any]]:
  """``(*inputs) -> [*outputs]``: the equations run one by one, values in ``tags`` named (numbered from ``first``)."""

  def run(*args):
    env = dict(zip(constvars, consts))
    env.update(zip(inputs, args))
    evaluate_equations(eqns, env, tags, first)
    return [a.val if not is_var(a) else env[a] for a in outputs]

  return run
