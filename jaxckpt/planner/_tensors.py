"""Per-tensor candidates: which intermediate values of a block to save, chosen optimally by an integer program.

Per-block policies choose among a few fixed sets (matmul outputs, the hand-tagged names). A *min-cut* chooses any
set: the backward pass of a block reads some of its forward values (JAX's own analysis says which: tag every value,
let every tag be saveable, and list the saved residuals); each one it reads must be saved or recomputed, and a
recomputed value needs its producer's inputs saved or recomputed in turn, down to the block's inputs (always
there). Minimising recompute cost under a cap on saved bytes is a min-cut of the forward graph (Jain et al. 2020,
"Checkmate", solve the general schedule as an integer program; PyTorch's AOTAutograd partitioner solves the
no-extra-recompute case as a max-flow min-cut). Here it is a small 0-1 program solved exactly with
:func:`scipy.optimize.milp` (HiGHS):

- binaries ``s_v`` (save value ``v``; only numeric/bool values can be named) and ``r_o`` (recompute op ``o``);
- for every value ``v`` the backward reads: ``s_v + r_op(v) ≥ 1``;
- for every recomputed op ``o`` and input ``u`` of it produced inside the block: ``s_u + r_op(u) ≥ r_o``;
- ``Σ bytes_v s_v ≤ cap``; minimise ``Σ cost_o r_o``, then bytes (lexicographic, two solves).

``cost_o`` = FLOPs + transcendentals of the op (:mod:`jaxckpt.analysis._flops`'s per-equation rules) + :data:`BYTE_COST` per
output byte, so memory-bound elementwise ops and copies are not recomputed for nothing. A chosen set becomes a real
JAX policy, ``save_tensors:t12_tanh+…`` (:mod:`jaxckpt.core._tagging`), and JAX's saved-residual analysis confirms it
saves exactly those values.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core

from jaxckpt.errors import JaxckptError
from jaxckpt.analysis._flops import equation_flops
from jaxckpt.nnx._apply import applied_block_type
from jaxckpt.policies._spec import Policy, PolicySpec
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.core._tagging import ValueInfo, evaluate_tagged, record_tagged, walk_values
from jaxckpt._units import format_bytes

BYTE_COST = 1 / 16
"""Cost units (FLOPs) per output byte of a recomputed op: a float32 elementwise op costs 0.25 FLOP per element
more than its FLOPs, a copy or transpose is no longer free."""

PARAMETER_ONLY_WEIGHT = 1 / 1024
"""Weight of a parameter-only value's bytes under the byte cap (graphs with parameters among their inputs, e.g. the
whole loss of :mod:`jaxckpt.planner._whole`): such values (per-layer weight slices) are not activations, so they
barely count, but not zero, so the program saves none it does not need."""

FRONT_POINTS = 6
"""Byte caps per block type swept for the front (from the no-recompute set down to nothing)."""

FLOPS_SHARES = (0.0, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2)
"""Recompute-FLOPs caps (shares of the block's forward FLOPs) at which the front also takes the least-bytes set.
The steps between 1% and 5% find sets a few KiB larger that skip a reduction (e.g. keeping LayerNorm's statistics):
on GPT ``small`` 3 more options, −1 to −7 MFLOP per block at +8 KiB to +4 MiB."""


@dataclasses.dataclass(frozen=True)
class BlockGraph:
  """One block's forward graph as the min-cut sees it.

  Attributes:
    block_type: e.g. ``"attn"``.
    values: every value of the block's jaxpr (:func:`jaxckpt.core._tagging.walk_values`).
    needed: value numbers the backward pass reads (when every value is available).
    op_cost: op number -> recompute cost (FLOPs + transcendentals + :data:`BYTE_COST` × output bytes).
    op_flops: op number -> FLOPs (transcendentals excluded, as in XLA's ``"flops"`` and :mod:`jaxckpt.analysis._flops`).
    forward_flops: Σ ``op_flops`` (the block's forward).
    parameter_only: value numbers computed from parameter inputs (and constants) alone; empty for a block, whose
      parameters are not among its jaxpr inputs. Their bytes count ×:data:`PARAMETER_ONLY_WEIGHT` under a cap.
    fixed_bytes: bytes the region may keep whatever is chosen, counted in every choice's ``activation_bytes``
      (for the whole loss: its batch and dropout key, kept when the backward pass reads them, an upper bound);
      0 for a block.
    needed_inputs: positions of the differentiated inputs the backward pass reads directly (a region keeps them).
  """

  block_type: str
  values: tuple[ValueInfo, ...]
  needed: frozenset[int]
  op_cost: dict[int, float]
  op_flops: dict[int, int]
  forward_flops: int
  parameter_only: frozenset[int] = frozenset()
  fixed_bytes: int = 0
  needed_inputs: frozenset[int] = frozenset()

  def describe(self, index: int) -> str:
    """``t12_tanh [8, 256, 1024] float32 4.0 MiB from file.py:40 (forward)``; a value JAX made without a source
    line says so (as :mod:`jaxckpt.planner._whole` does)."""
    v = self.values[index]
    where = f"from {v.source}" if v.source else "(no source line: made by JAX)"
    return f"{v.name} {list(v.shape)} {v.dtype} {format_bytes(v.bytes)} {where}"


@dataclasses.dataclass(frozen=True)
class TensorChoice:
  """A saved set of one block and what the model predicts for it.

  Attributes:
    block_type: the block type.
    saved: value numbers saved, sorted.
    names: their automatic names (``save_tensors`` arguments).
    bytes: Σ bytes of the saved values.
    cost: Σ cost of the recomputed ops.
    flops: Σ FLOPs of the recomputed ops (transcendentals excluded).
    activation_bytes: Σ bytes of the saved values that are not parameter-only, plus the graph's ``fixed_bytes``
      (equal to ``bytes`` for a block).
    mip_gap: the relative optimality gap HiGHS proved for the first objective: 0.0 optimal, > 0 when a time limit
      stopped the solve (:func:`solve_block`'s ``time_limit``).
  """

  block_type: str
  saved: tuple[int, ...]
  names: tuple[str, ...]
  bytes: int
  cost: float
  flops: int
  activation_bytes: int | None = None
  mip_gap: float = 0.0

  @property
  def policy(self) -> Policy:
    """``save_tensors:<names>``, or ``nothing_saveable`` for the empty set."""
    return Policy("save_tensors", self.names) if self.names else Policy("nothing_saveable")


def _op_cost(eqn) -> tuple[int, float]:
  tally = equation_flops(eqn)  # the same per-equation rules as count_flops
  out_bytes = sum(int(np.prod(v.aval.shape, dtype=np.int64)) * getattr(v.aval.dtype, "itemsize", 0)
                  for v in eqn.outvars)
  return tally.total, tally.total + tally.transcendentals + BYTE_COST * out_bytes


def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


def _needed(closed: jex_core.ClosedJaxpr, values: Sequence[ValueInfo],
            num_parameters: int = 0) -> tuple[frozenset[int], frozenset[int]]:
  """The values JAX's backward pass reads when every value may be saved (saved-residual analysis): differentiated
  w.r.t. the first ``num_parameters`` inputs, or (0) w.r.t. every float input. Also the positions of the
  differentiated inputs it reads directly (each input is named ``input<i>`` for the analysis)."""
  tags = {v.index: v.name for v in values if v.taggable}
  if num_parameters:
    floats = list(range(num_parameters))
  else:
    floats = [i for i, a in enumerate(closed.in_avals) if _is_float(a)]
  input_names = {i: f"{_INPUT_TAG}{i}" for i in floats}
  policy = jax.checkpoint_policies.save_only_these_names(*tags.values(), *input_names.values())
  others = [i for i in range(len(closed.in_avals)) if i not in set(floats)]
  found: list = []

  def outer(*other_vals):
    def fn(*float_vals):
      args = [None] * len(closed.in_avals)
      for i, x in zip(floats, float_vals):
        args[i] = x
      for i, x in zip(others, other_vals):
        args[i] = x

      def tagged(*a):
        a = [checkpoint_name(x, input_names[i]) if i in input_names else x for i, x in enumerate(a)]
        return evaluate_tagged(closed, a, tags)

      outs = jax.checkpoint(tagged, policy=policy)(*args)
      return [o for o in outs if _is_float(o.aval if hasattr(o, "aval") else o)]

    found.extend(saved_residuals(fn, *(jax.ShapeDtypeStruct(closed.in_avals[i].shape, closed.in_avals[i].dtype)
                                       for i in floats)))
    return 0

  jax.make_jaxpr(outer)(*(jax.ShapeDtypeStruct(closed.in_avals[i].shape, closed.in_avals[i].dtype) for i in others))
  by_name = {v.name: v.index for v in values}
  needed = {by_name[r.name] for r in found if r.name in by_name}
  by_input = {name: i for i, name in input_names.items()}
  inputs = {by_input[r.name] for r in found if r.name in by_input}
  # closed-over inputs (token ids, keys) and constants read as "from a constant": available without recomputing
  unknown = [r.description for r in found if r.kind not in ("argument", "checkpoint_name")
             and not r.description.startswith("from a constant")]
  if unknown:
    raise JaxckptError(f"the backward pass reads values the per-tensor analysis cannot name: {unknown[:3]}")
  return frozenset(needed), frozenset(inputs)


_INPUT_TAG = "jaxckpt_input"


def block_graph(block_type: str, closed: jex_core.ClosedJaxpr, *, num_parameters: int = 0,
                parameter_inputs: Iterable[int] = ()) -> BlockGraph:
  """The :class:`BlockGraph` of a block's (or a whole loss's) traced jaxpr.

  Float inputs are differentiated (the parameters only when ``num_parameters`` is given), the others (token ids,
  PRNG keys) closed over, as in the train step.

  Args:
    block_type: the block type (for names in plans; ``"whole"`` for the whole loss).
    closed: the block's function as :func:`jaxckpt.core._tagging.record_tagged` records it (the remat'd function of
      ``(state, *args)``), or a whole loss ``(*param_leaves, *batch_leaves, key) -> scalar``.
    num_parameters: how many leading inputs are parameters (the whole loss); values computed from them alone are
      the graph's ``parameter_only`` values, and the bytes of the non-parameter inputs its ``fixed_bytes``. 0 for a
      block (its inputs are kept outside it).
    parameter_inputs: positions of inputs that are parameters or parameter-only values, with every float input
      still differentiated (a region of a whole loss, :func:`jaxckpt.planner._whole.segment_loss`): values computed
      from them alone are marked parameter-only; ``fixed_bytes`` stays 0.

  Returns:
    The graph with the values the backward reads (JAX's analysis) and each op's cost.

  Raises:
    JaxckptError: ``num_parameters`` outside ``[0, number of inputs]``; the backward pass reads a value the
      analysis cannot name.
  """
  if not 0 <= num_parameters <= len(closed.in_avals):
    raise JaxckptError(f"num_parameters={num_parameters} must be in [0, {len(closed.in_avals)}] (the jaxpr's inputs)")
  values = list(walk_values(closed))
  # values of constants only (a dropout's sampling bounds): JAX folds them into the backward pass, never saves them
  constant: set[int] = set()
  for v in values:
    if all(u >= 0 and u in constant for u in v.inputs) and v.primitive not in ("random_bits", "iota"):
      constant.add(v.index)
  values = tuple(dataclasses.replace(v, taggable=False) if v.index in constant else v for v in values)
  parameter_only: set[int] = set()
  fixed_bytes = 0
  marked = set(range(num_parameters)) | set(parameter_inputs)
  if marked:
    for v in values:
      if v.index not in constant and all((u < 0 and -1 - u in marked) or u in constant or u in parameter_only
                                         for u in v.inputs):
        parameter_only.add(v.index)
  if num_parameters:
    fixed_bytes = sum(int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize
                      for a in closed.in_avals[num_parameters:])
  op_flops: dict[int, int] = {}
  op_cost: dict[int, float] = {}
  for v in values:
    if v.op not in op_cost:
      op_flops[v.op], op_cost[v.op] = (0, 0.0) if v.index in constant else _op_cost(v.eqn)
  needed, needed_inputs = _needed(closed, values, num_parameters)
  return BlockGraph(block_type, values, needed, op_cost, op_flops, sum(op_flops.values()), frozenset(parameter_only),
                    fixed_bytes, needed_inputs)


def recompute_closure(graph: BlockGraph, saved: Iterable[int]) -> set[int]:
  """The ops the backward pass must recompute when ``saved`` values are kept (the model behind the program)."""
  saved = set(saved)
  ops: set[int] = set()
  todo = [v for v in graph.needed if v not in saved]
  seen: set[int] = set()
  while todo:
    v = todo.pop()
    if v < 0 or v in seen:
      continue
    seen.add(v)
    info = graph.values[v]
    if info.op in ops:
      continue
    ops.add(info.op)
    todo.extend(u for u in info.inputs if u >= 0 and u not in saved)
  return ops


def _choice(graph: BlockGraph, saved: Iterable[int]) -> TensorChoice:
  saved = tuple(sorted(saved))
  ops = recompute_closure(graph, saved)
  return TensorChoice(graph.block_type, saved, tuple(graph.values[v].name for v in saved),
                      sum(graph.values[v].bytes for v in saved), sum(graph.op_cost[o] for o in ops),
                      sum(graph.op_flops[o] for o in ops),
                      graph.fixed_bytes + sum(graph.values[v].bytes for v in saved if v not in graph.parameter_only))


def _weighted_bytes(graph: BlockGraph, v: int) -> float:
  """A value's bytes as the byte cap counts them (parameter-only values ×:data:`PARAMETER_ONLY_WEIGHT`)."""
  return graph.values[v].bytes * (PARAMETER_ONLY_WEIGHT if v in graph.parameter_only else 1.0)


class BlockProgram(NamedTuple):
  """The 0-1 program of one graph (:func:`block_program`): ``x[i] = 1`` saves value ``saved_values[i]``;
  ``x[len(saved_values) + j] = 1`` recomputes op ``ops[j]``. Every array has one entry per variable."""

  saved_values: list[int]  # candidate values to save (graph value indices), the first variables
  num_vars: int  # len(saved_values) + len(ops)
  covering: Any  # scipy.sparse.csr_array [rows, num_vars]: covering rows, covering @ x ≥ lows
  lows: np.ndarray  # [rows] float: right-hand sides of the covering rows
  var_bytes: np.ndarray  # [num_vars] float bytes as the byte cap counts them (parameter-only weighted; 0 for ops)
  var_cost: np.ndarray  # [num_vars] float recompute cost (0 for saved values)
  var_flops: np.ndarray  # [num_vars] float recompute FLOPs (0 for saved values)
  ops: list[int]  # ops that may be recomputed, after the saved values


def block_program(graph: BlockGraph) -> BlockProgram:
  """The 0-1 program of one graph: variables (saved values, then ops), and the covering constraints, as a sparse
  matrix (:func:`solve_block` solves it; :func:`jaxckpt.planner._segmented.segmented_plan` joins several).

  Returns:
    A :class:`BlockProgram` (a value is available in the backward pass if it is saved or its op is recomputed;
    a recomputed op needs each input saved or recomputed: Checkmate's covering constraints, Jain et al. 2020).
  """
  # scipy is imported where a program is built or solved: importing it costs 0.3 s that only planning pays.
  from scipy import sparse  # pylint: disable=g-import-not-at-top
  op_values: dict[int, list[ValueInfo]] = {}
  for w in graph.values:
    op_values.setdefault(w.op, []).append(w)
  op_inputs = {o: sorted({u for w in ws for u in w.inputs if u >= 0}) for o, ws in op_values.items()}
  relevant_ops: set[int] = set()
  todo, seen = list(graph.needed), set()
  while todo:  # only ancestors of needed values matter
    v = todo.pop()
    if v < 0 or v in seen:
      continue
    seen.add(v)
    op = graph.values[v].op
    if op not in relevant_ops:
      relevant_ops.add(op)
      todo.extend(op_inputs[op])
  svals = sorted(v for v in seen if graph.values[v].taggable)
  ops = sorted(relevant_ops)
  s_at = {v: i for i, v in enumerate(svals)}
  r_at = {o: len(svals) + i for i, o in enumerate(ops)}
  n = len(svals) + len(ops)
  data, cols, indptr, lows = [], [], [0], []

  def row(entries, low):
    for j, c in entries:
      cols.append(j)
      data.append(c)
    indptr.append(len(cols))
    lows.append(low)

  for v in sorted(graph.needed):
    if v < 0:
      continue
    row([(r_at[graph.values[v].op], 1.0)] + ([(s_at[v], 1.0)] if v in s_at else []), 1.0)
  for o in ops:
    for u in op_inputs[o]:
      if graph.values[u].op == o:
        continue
      row([(r_at[graph.values[u].op], 1.0), (r_at[o], -1.0)] + ([(s_at[u], 1.0)] if u in s_at else []), 0.0)
  bytes_ = np.array([_weighted_bytes(graph, v) for v in svals] + [0.0] * len(ops), float)
  cost = np.array([0.0] * len(svals) + [graph.op_cost[o] for o in ops], float)
  flops = np.array([0.0] * len(svals) + [graph.op_flops[o] for o in ops], float)
  a = sparse.csr_array((np.array(data, float), np.array(cols, np.int64), np.array(indptr, np.int64)),
                       shape=(len(lows), n))
  return BlockProgram(svals, n, a, np.array(lows), bytes_, cost, flops, ops)


def solve_milp(c, n, constraints, time_limit: float | None = None):
  """``(x, gap)``: HiGHS's 0-1 solution of ``min c @ x`` over ``n`` binaries under ``constraints`` (a list of
  ``scipy.optimize.LinearConstraint``) and its proven relative gap (0: optimal; > 0 when ``time_limit`` seconds
  stopped it with a feasible solution), or ``None`` when infeasible (or stopped before any feasible solution)."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  options = {"mip_rel_gap": 0.0}
  if time_limit is not None:
    options["time_limit"] = float(time_limit)
  res = optimize.milp(c, constraints=constraints, integrality=np.ones(n), bounds=optimize.Bounds(0, 1),
                       options=options)
  if res.success:
    return np.round(res.x), 0.0
  if res.status == 1 and res.x is not None:  # time limit, with a feasible solution
    return np.round(res.x), float(res.mip_gap)
  return None


def solve_block(graph: BlockGraph, *, max_bytes: float | None = None, max_flops: float | None = None,
                minimise: str = "cost", time_limit: float | None = None) -> TensorChoice | None:
  """The optimal saved set of one block.

  Args:
    graph: from :func:`block_graph`.
    max_bytes: cap on saved bytes (``None``: no cap): Σ bytes of the saved values, parameter-only ones
      ×:data:`PARAMETER_ONLY_WEIGHT`, plus the graph's ``fixed_bytes``.
    max_flops: cap on recomputed FLOPs (``None``: no cap).
    minimise: ``"cost"`` (recompute cost, then bytes) or ``"bytes"`` (saved bytes, then cost).
    time_limit: seconds HiGHS may spend on each of the two solves (``None``: until proven optimal). Past it the
      best feasible set found is taken and its proven gap kept in ``mip_gap`` (whole-loss graphs: thousands of
      binaries, six identical layers' symmetric choices make proofs slow).

  Returns:
    The :class:`TensorChoice`, or ``None`` when no set meets the caps.

  Raises:
    JaxckptError: an unknown ``minimise``.
  """
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  if minimise not in ("cost", "bytes"):
    raise JaxckptError(f"minimise={minimise!r}; valid: cost, bytes")
  svals, n, a, lows, bytes_, cost, flops, _ = block_program(graph)
  base = [optimize.LinearConstraint(a, lows, np.inf)] if len(lows) else []
  if max_bytes is not None:
    base.append(optimize.LinearConstraint(bytes_[None], -np.inf, max_bytes - graph.fixed_bytes))
  if max_flops is not None:
    base.append(optimize.LinearConstraint(flops[None], -np.inf, max_flops))
  first, second = (cost, bytes_) if minimise == "cost" else (bytes_, cost)
  found = solve_milp(first, n, base, time_limit)
  if found is None:
    return None
  x, gap = found
  best = float(first @ x)
  tie = optimize.LinearConstraint(first[None], -np.inf, best + 1e-6 * max(1.0, abs(best)))
  found2 = solve_milp(second, n, base + [tie], time_limit)
  x = x if found2 is None else found2[0]
  return dataclasses.replace(_choice(graph, _used(graph, [v for i, v in enumerate(svals) if x[i] > 0.5])),
                             mip_gap=gap)


def tensor_choice(graph: BlockGraph, saved: Iterable[int]) -> TensorChoice:
  """The :class:`TensorChoice` of a program's saved values (value numbers of ``graph``), those nothing reads
  dropped; its recompute cost and FLOPs follow from :func:`recompute_closure`."""
  return _choice(graph, _used(graph, saved))


def _used(graph: BlockGraph, saved: Iterable[int]) -> list[int]:
  """``saved`` without values nothing reads (neither the backward pass nor a recomputed op): a solve stopped by its
  time limit may keep some, and JAX would not save them."""
  saved = list(saved)
  ops = recompute_closure(graph, saved)
  read = set(graph.needed) | {u for v in graph.values if v.op in ops for u in v.inputs}
  return [v for v in saved if v in read]


def min_saved_choice(graph: BlockGraph, tolerance: float) -> TensorChoice:
  """The least saved bytes whose recomputation costs at most ``tolerance`` × the block's forward FLOPs."""
  found = solve_block(graph, max_flops=tolerance * graph.forward_flops, minimise="bytes")
  assert found is not None  # saving every needed value recomputes nothing
  return found


def min_saved_layer(graphs: Mapping[str, BlockGraph], tolerance: float) -> dict[str, TensorChoice]:
  """``min_saved`` for a layer: the least total saved bytes over its blocks whose recomputation costs at most
  ``tolerance`` × the layer's forward FLOPs (Σ over blocks), shared between the blocks as the program finds best.

  Args:
    graphs: block type -> :class:`BlockGraph` of one layer.
    tolerance: share of the layer's forward FLOPs, in [0, 1).

  Returns:
    Block type -> its :class:`TensorChoice`.
  """
  from scipy import optimize, sparse  # pylint: disable=g-import-not-at-top
  blocks = sorted(graphs)
  if not blocks:
    return {}
  programs = [block_program(graphs[b]) for b in blocks]
  sizes = [p.num_vars for p in programs]
  n = sum(sizes)
  offsets = np.cumsum([0] + sizes)
  bytes_, cost, flops = (np.concatenate([getattr(p, k) for p in programs]) for k in ("var_bytes", "var_cost",
                                                                                       "var_flops"))
  covering = sparse.block_diag([p.covering for p in programs], format="csr")
  cap = tolerance * sum(graphs[b].forward_flops for b in blocks)
  base = [optimize.LinearConstraint(covering, np.concatenate([p.lows for p in programs]), np.inf),
          optimize.LinearConstraint(flops[None], -np.inf, cap)]
  x = solve_milp(bytes_, n, base)[0]
  best = float(bytes_ @ x)
  x2 = solve_milp(cost, n, base + [optimize.LinearConstraint(bytes_[None], -np.inf, best + 0.5)])
  x = x if x2 is None else x2[0]
  out = {}
  for k, b in enumerate(blocks):
    svals = programs[k].saved_values
    out[b] = _choice(graphs[b], [v for i, v in enumerate(svals) if x[offsets[k] + i] > 0.5])
  return out


def block_front(graph: BlockGraph, points: int = FRONT_POINTS, tolerance: float | None = None) -> list[TensorChoice]:
  """Optimal saved sets of one block for byte caps from the no-recompute set down to nothing, Pareto-filtered.

  Args:
    graph: from :func:`block_graph`.
    points: byte caps swept (linearly spaced).
    tolerance: also add :func:`min_saved_choice` at this tolerance.

  Returns:
    Distinct :class:`TensorChoice` by increasing bytes, none beaten on both bytes and cost by another.
  """
  top = solve_block(graph)
  found = {top.saved: top}
  if tolerance is not None:
    extra = min_saved_choice(graph, tolerance)
    found[extra.saved] = extra
  for cap in np.linspace(top.bytes, 0, points + 1)[1:]:
    choice = solve_block(graph, max_bytes=float(cap))
    if choice is not None:
      found.setdefault(choice.saved, choice)
  for share in FLOPS_SHARES:  # least bytes at each recompute-FLOPs cap: the front as the FLOPs metric sees it
    choice = solve_block(graph, max_flops=share * graph.forward_flops, minimise="bytes")
    found.setdefault(choice.saved, choice)
  front: list[TensorChoice] = []
  for key in ("cost", "flops"):
    best = None
    for choice in sorted(found.values(), key=lambda c: (c.bytes, getattr(c, key))):
      if best is None or getattr(choice, key) < best:
        best = getattr(choice, key)
        if choice not in front:
          front.append(choice)
  return sorted(front, key=lambda c: (c.bytes, c.cost))


LAYER_SHARES = (0.0, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
"""Tolerances (shares of a layer's forward FLOPs) of the joint ``min_saved`` sets added to the options."""


def tensor_options(graphs: Mapping[str, BlockGraph]) -> dict[str, list[Policy]]:
  """Per-tensor candidate policies per block type: each block's :func:`block_front` and each block's part of the
  joint :func:`min_saved_layer` sets at :data:`LAYER_SHARES`, empty sets left out (that is ``nothing_saveable``).

  Returns:
    Block type -> distinct ``save_tensors`` policies, by increasing saved bytes.
  """
  chosen: dict[str, dict[tuple[int, ...], TensorChoice]] = {b: {} for b in graphs}
  for b, g in graphs.items():
    for c in block_front(g):
      chosen[b].setdefault(c.saved, c)
  for share in LAYER_SHARES:
    for b, c in min_saved_layer(graphs, share).items():
      chosen[b].setdefault(c.saved, c)
  return {b: [c.policy for c in sorted(found.values(), key=lambda c: (c.bytes, c.cost)) if c.names]
          for b, found in chosen.items()}


def exhaustive_block(graph: BlockGraph, max_bytes: float) -> TensorChoice:
  """:func:`solve_block` by trying every subset of the values (tests only; 2^n): the least cost, then the least
  bytes as the cap counts them, among the subsets within ``max_bytes``."""
  pool = sorted({v for v in range(len(graph.values)) if graph.values[v].taggable})
  best, best_key = None, None
  for k in range(len(pool) + 1):
    for subset in itertools.combinations(pool, k):
      weighted = graph.fixed_bytes + sum(_weighted_bytes(graph, v) for v in subset)
      if weighted > max_bytes:
        continue
      choice = _choice(graph, subset)
      if best is None or (choice.cost, weighted) < best_key:
        best, best_key = choice, (choice.cost, weighted)
  return best


def record_block_graphs(probe) -> dict[str, BlockGraph]:
  """The :class:`BlockGraph` of each block type of one layer, traced as the train step traces it.

  Args:
    probe: a :class:`jaxckpt.planner._candidates.LayerProbe` of the model's stack, or a
      :class:`jaxckpt.planner._own.OwnModelProbe` (your own blocks, NNX or Linen: each type's first call).

  Returns:
    Block type -> graph, for every remat block type of the layer.
  """
  with record_tagged() as recorded:
    probe.measure(PolicySpec(default=Policy("save_tensors", ("t0_probe",))))
  graphs: dict[str, BlockGraph] = {}
  for owner, closed in recorded:
    block_type = getattr(owner, "block_type", None) or applied_block_type(owner)  # jaxckpt / Linen / NNX applied
    if block_type is not None and block_type not in graphs:
      graphs[block_type] = block_graph(block_type, closed)
  return graphs
