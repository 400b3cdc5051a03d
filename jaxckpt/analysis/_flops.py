"""FLOPs of a JAX function, counted from its jaxpr, one rule per primitive (a table, ``_RULES``).

XLA's own ``cost_analysis()["flops"]`` walks the compiled HLO once, so a ``scan`` over layers counts one layer; the
jaxpr keeps each ``scan``'s length, so counting there gives the whole step, recomputation included. The rules follow
XLA's ``HloCostAnalysis`` (a ``dot_general`` is ``2·B·M·N·K``, transcendentals are reported apart, data movement is
free), control flow multiplies bodies by trip counts, and a primitive without a rule is listed in
:attr:`FlopCount.uncounted_primitives`, never silently 0. The cost model, the control-flow rules and the agreement
with XLA measured on jax 0.10.2: docs/flops.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

from jaxckpt.analysis._internals import dce_jaxpr
from jaxckpt.analysis._jaxprs import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class FlopCount:
  """FLOPs of one evaluation of a jaxpr.

  Attributes:
    total: total FLOPs (int). Transcendental ops are not included, matching
      XLA's ``cost_analysis()["flops"]``.
    by_primitive: FLOPs per primitive name (``{"dot_general": ..., "add":
      ...}``), summing to ``total``. Primitives that cost 0 are omitted.
    transcendentals: number of transcendental evaluations (``exp``, ``tanh``,
      ``sqrt``, ...), matching XLA's ``"transcendentals"`` key.
    unbounded_loops: number of ``while`` loops whose trip count could not be
      read from the jaxpr; each one's body was counted once, so ``total`` is
      a lower bound when this is > 0.
    uncounted_primitives: sorted names of primitives that have no cost rule
      and were counted as 0 FLOPs (e.g. ``random_bits``, ``top_k``).
  """

  total: int
  by_primitive: dict[str, int]
  transcendentals: int
  unbounded_loops: int
  uncounted_primitives: tuple[str, ...] = ()


class _Tally:
  """Mutable accumulator behind a ``FlopCount``."""

  __slots__ = ("flops", "transcendentals", "unbounded_loops", "uncounted")

  def __init__(self) -> None:
    self.flops: dict[str, int] = {}
    self.transcendentals = 0
    self.unbounded_loops = 0
    self.uncounted: set[str] = set()

  @property
  def total(self) -> int:
    return sum(self.flops.values())

  def add_flops(self, name: str, n: int) -> None:
    if n:
      self.flops[name] = self.flops.get(name, 0) + int(n)

  def add(self, other: _Tally, times: int = 1) -> None:
    for k, v in other.flops.items():
      self.add_flops(k, v * times)
    self.transcendentals += other.transcendentals * times
    # A loop nested in a repeated body is still one loop in the program.
    self.unbounded_loops += other.unbounded_loops
    self.uncounted |= other.uncounted

  def freeze(self) -> FlopCount:
    return FlopCount(
        total=self.total,
        by_primitive=dict(sorted(self.flops.items(), key=lambda kv: -kv[1])),
        transcendentals=self.transcendentals,
        unbounded_loops=self.unbounded_loops,
        uncounted_primitives=tuple(sorted(self.uncounted)),
    )


# ---------------------------------------------------------------------------
# Per-primitive cost tables.

# Primitives that only move, relabel or annotate data: 0 FLOPs.
_ZERO_COST = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "rev", "gather", "scatter", "iota", "copy", "copy_p", "tile", "split",
    "stack", "unstack", "device_put", "sharding_constraint", "mesh_cast",
    "reshard", "pvary", "name", "stop_gradient", "optimization_barrier",
    "tie", "empty", "empty2", "dce_sink", "create_token", "after_all",
    "random_wrap", "random_unwrap", "random_seed", "random_fold_in",
    "random_split", "random_clone", "to_edtype", "from_edtype",
    "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_to_all",
    "all_gather", "all_gather_invariant", "reduce_scatter", "axis_index",
    "psum_invariant", "unreduced_psum", "core_map_tokens", "axis_size",
    "zeros_like", "broadcast", "convert_layout", "layout_constraint",
    "platform_index", "state_get", "get", "swap", "addupdate", "program_id", "num_programs",
})

# (FLOPs, transcendentals) per output element.
_ELEMENTWISE: dict[str, tuple[int, int]] = {
    name: (1, 0) for name in (
        "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg",
        "abs", "sign", "floor", "ceil", "round", "nextafter", "is_finite",
        "square", "clamp", "convert_element_type", "bitcast_convert_type",
        "reduce_precision", "eq", "ne", "lt", "le", "gt", "ge", "eq_to",
        "le_to", "lt_to", "and", "or", "xor", "not", "shift_left",
        "shift_right_arithmetic", "shift_right_logical", "population_count",
        "clz", "conj", "real", "imag", "complex", "mulhi",
    )
}
_ELEMENTWISE.update({
    name: (0, 1) for name in (
        "exp", "log", "tanh", "sin", "cos", "tan", "asin", "acos", "atan",
        "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt",
        "cbrt", "pow", "log1p", "expm1", "erf",
    )
})
_ELEMENTWISE.update({
    # XLA rewrites these into arithmetic + transcendentals before counting;
    # numbers measured with cost_analysis() on XLA:CPU (jax 0.10.2).
    "logistic": (3, 1),   # 1 / (1 + exp(-x))
    "exp2": (1, 1),       # exp(x * ln 2)
    "erf_inv": (37, 2),
    "erfc": (60, 1),
    "lgamma": (52, 4),
    "digamma": (73, 3),
})

# Cost per combine step (input elements - output elements).
_REDUCTIONS: dict[str, int] = {
    "reduce_sum": 1, "reduce_max": 1, "reduce_min": 1, "reduce_prod": 1,
    "reduce_and": 1, "reduce_or": 1, "reduce_xor": 1,
    "argmax": 9, "argmin": 9,
}

_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin",
                         "cumlogsumexp"})

_REDUCE_WINDOW = frozenset({"reduce_window_sum", "reduce_window_max",
                            "reduce_window_min"})

_SCATTER_COMBINE = frozenset({"scatter-add", "scatter_add", "scatter-mul",
                              "scatter_mul", "scatter-min", "scatter_min",
                              "scatter-max", "scatter_max"})


def _size(aval: Any) -> int:
  """Number of elements of an abstract value (0 for tokens and the like)."""
  shape = getattr(aval, "shape", None)
  if shape is None:
    return 0
  return math.prod(int(d) for d in shape)


def _out_size(eqn: Any) -> int:
  return sum(_size(v.aval) for v in eqn.outvars)


def _integer_pow_multiplies(y: int) -> int:
  """Multiplies done by square-and-multiply for ``x ** y`` (+1 div if y<0)."""
  n = abs(int(y))
  if n == 0:
    return 0
  muls = (n.bit_length() - 1) + (bin(n).count("1") - 1)
  return muls + (1 if y < 0 else 0)


def _dot_general_flops(eqn: Any) -> int:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  batch = math.prod(int(lhs.shape[d]) for d in lb)
  contract = math.prod(int(lhs.shape[d]) for d in lc)
  m = math.prod(int(s) for i, s in enumerate(lhs.shape)
                if i not in lc and i not in lb)
  rb = eqn.params["dimension_numbers"][1][1]
  n = math.prod(int(s) for i, s in enumerate(rhs.shape)
                if i not in rc and i not in rb)
  if contract == 1:
    # An outer product: one multiply per output, nothing to accumulate (XLA rewrites it to a multiply).
    return batch * m * n
  return 2 * batch * m * n * contract


def _ragged_dot_flops(eqn: Any) -> int:
  """``ragged_dot_general`` (``jax.lax.ragged_dot``: a grouped matmul, e.g. the expert matmuls of a dropless MoE):
  ``2 · (lhs elements) · (rhs dimensions neither contracted, batch nor group)`` multiply-adds, in every mode of the
  primitive: rows of a ragged non-contracting dimension each meet one group's ``[K, N]`` matrix (the forward pass,
  ``[M, K] × [G, K, N]``: 2·M·K·N), a ragged contracting dimension sums each group's rows into its own ``[K, N]``
  output (the weight gradient, ``[M, K] × [M, N] → [G, K, N]``: 2·M·K·N again), and a ragged batch dimension is a
  batched matmul. The group sizes are values, not shapes: every row is counted, also rows past the sum of the group
  sizes (padding a kernel skips), so an upper bound there and exact where the groups cover the rows."""
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (_, rc), (_, rb) = numbers.dot_dimension_numbers
  skip = set(rc) | set(rb) | set(numbers.rhs_group_dimensions)
  n = math.prod(int(s) for i, s in enumerate(rhs.shape) if i not in skip)
  return 2 * _size(lhs) * n


def _conv_flops(eqn: Any) -> int:
  rhs = eqn.invars[1].aval
  dn = eqn.params["dimension_numbers"]
  rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, *spatial dims)
  kernel_in = int(rhs.shape[rhs_spec[1]])
  kernel_spatial = math.prod(int(rhs.shape[d]) for d in rhs_spec[2:])
  return 2 * _out_size(eqn) * kernel_spatial * kernel_in


def _literal_int(atom: Any) -> int | None:
  """The integer value of a jaxpr Literal, else None."""
  if isinstance(atom, jex_core.Literal):
    try:
      val = np.asarray(atom.val)
    except Exception:  # pragma: no cover - exotic literal payloads
      return None
    if val.shape == () and np.issubdtype(val.dtype, np.integer):
      return int(val)
  return None


def _fori_trip_count(eqn: Any) -> int | None:
  """Trip count of a ``while`` that is a ``fori_loop`` with static bounds.

  Recognises the pattern ``jax.lax.fori_loop`` / ``while_loop`` produce:
  cond_jaxpr is the single equation ``lt i upper``; the body returns
  ``add i 1`` for carry slot ``i``; the start value of ``i`` is a literal and
  ``upper`` is a literal, a literal cond const, or a loop-invariant carry slot
  whose start value is a literal. Returns None for anything else.
  """
  p = eqn.params
  cond_cj, body_cj = p["cond_jaxpr"], p["body_jaxpr"]
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond_consts = eqn.invars[:cn]
  init = eqn.invars[cn + bn:]
  cond, body = cond_cj.jaxpr, body_cj.jaxpr
  if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
    return None
  lt = cond.eqns[0]
  cond_carry = cond.invars[cn:]
  cond_const_vars = cond.invars[:cn]

  def static_value(atom: Any) -> int | None:
    lit = _literal_int(atom)
    if lit is not None:
      return lit
    if atom in cond_const_vars:
      return _literal_int(cond_consts[cond_const_vars.index(atom)])
    if atom in cond_carry:
      k = cond_carry.index(atom)
      # Loop-invariant carry slot: the body passes it through unchanged.
      if body.outvars[k] is body.invars[bn + k]:
        return _literal_int(init[k])
    return None

  counter, bound = lt.invars
  if counter not in cond_carry:
    return None
  k = cond_carry.index(counter)
  start, upper = _literal_int(init[k]), static_value(bound)
  if start is None or upper is None:
    return None
  # The body must compute carry[k] + 1.
  out = body.outvars[k]
  body_in = body.invars[bn + k]
  for e in body.eqns:
    if out in e.outvars:
      if e.primitive.name != "add":
        return None
      a, b = e.invars
      if not ((a is body_in and _literal_int(b) == 1)
              or (b is body_in and _literal_int(a) == 1)):
        return None
      return max(0, upper - start)
  return None


def _mesh_devices(eqn: Any) -> int:
  """Devices a ``shard_map`` body runs on (product of manual axis sizes)."""
  p = eqn.params
  mesh_shape = dict(getattr(p.get("mesh"), "shape", {}) or {})
  axes = (p.get("newly_manual_axes") or p.get("manual_axes")
          or p.get("axis_names") or mesh_shape.keys())
  return math.prod(int(mesh_shape.get(a, 1)) for a in axes)


class _Counter:
  """Walks a jaxpr; memoises sub-jaxprs by identity within one count. Each equation's cost comes from
  :data:`_RULES` (primitive name -> rule); a primitive with no rule is counted by its sub-jaxprs, or as uncounted."""

  def __init__(self) -> None:
    self._memo: dict[int, tuple[Any, _Tally]] = {}

  def jaxpr(self, jaxpr: Any) -> _Tally:
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
      jaxpr = jaxpr.jaxpr
    hit = self._memo.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
      return hit[1]
    tally = _Tally()
    for eqn in jaxpr.eqns:
      self.equation(eqn, tally)
    self._memo[id(jaxpr)] = (jaxpr, tally)
    return tally

  def equation(self, eqn: Any, tally: _Tally) -> None:
    """Adds one equation's cost to ``tally``."""
    _RULES.get(eqn.primitive.name, _sub_jaxprs_rule)(self, eqn, tally)


# ---------------------------------------------------------------------------
# Rules: ``rule(counter, eqn, tally)`` adds one equation's cost to ``tally``.

Rule = Callable[[_Counter, Any, _Tally], None]


def _zero_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  """Data movement and annotations: 0 FLOPs."""


def _flops_rule(cost: Callable[[Any], int]) -> Rule:
  """A leaf primitive costing ``cost(eqn)`` FLOPs."""

  def rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
    tally.add_flops(eqn.primitive.name, cost(eqn))

  return rule


def _elementwise_rule(flops: int, transcendentals: int) -> Rule:
  """``flops`` FLOPs and ``transcendentals`` transcendentals per output element."""

  def rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
    n = _out_size(eqn)
    tally.add_flops(eqn.primitive.name, flops * n)
    tally.transcendentals += transcendentals * n

  return rule


def _reduction_steps(eqn: Any) -> int:
  """Combine steps of a reduction: input elements - output elements."""
  return max(_size(eqn.invars[0].aval) - _size(eqn.outvars[0].aval), 0)


def _window_steps(eqn: Any) -> int:
  """Combine steps of a windowed reduction: output elements * (window size - 1)."""
  window = math.prod(int(d) for d in eqn.params["window_dimensions"])
  return _size(eqn.outvars[0].aval) * max(window - 1, 0)


def _sort_flops(eqn: Any) -> int:
  dim = eqn.params.get("dimension", -1)
  shape = eqn.invars[0].aval.shape
  n = int(shape[dim]) if shape else 1
  return _size(eqn.invars[0].aval) * max(math.ceil(math.log2(n)) if n > 1 else 0, 0)


def _cumlogsumexp_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  n = _out_size(eqn)
  tally.add_flops(eqn.primitive.name, n)
  tally.transcendentals += 2 * n


def _scan_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  tally.add(counter.jaxpr(eqn.params["jaxpr"]), times=int(eqn.params["length"]))


def _cond_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  branches = [counter.jaxpr(b) for b in eqn.params["branches"]]
  best = max(branches, key=lambda b: (b.total, b.transcendentals))
  tally.add(best)
  tally.unbounded_loops += max(b.unbounded_loops for b in branches) - best.unbounded_loops
  for b in branches:
    tally.uncounted |= b.uncounted


def _while_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  body = counter.jaxpr(eqn.params["body_jaxpr"])
  cond = counter.jaxpr(eqn.params["cond_jaxpr"])
  trips = _fori_trip_count(eqn)
  if trips is None:
    tally.add(body)
    tally.add(cond)
    tally.unbounded_loops += 1
  else:
    tally.add(body, times=trips)
    tally.add(cond, times=trips + 1)


def _repeated_rule(key: str, times: Callable[[Any], int]) -> Rule:
  """The sub-jaxpr ``params[key]`` counted ``times(eqn)`` times (``shard_map``, ``xla_pmap``)."""

  def rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
    tally.add(counter.jaxpr(eqn.params[key]), times=times(eqn))

  return rule


def _custom_call_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  """The primal function of a custom-derivative call (or its sub-jaxprs when it names none)."""
  primal = eqn.params.get("call_jaxpr")
  if primal is None:
    primal = eqn.params.get("fun_jaxpr")
  if primal is None:
    _sub_jaxprs_rule(counter, eqn, tally)
  else:
    tally.add(counter.jaxpr(primal))


def _generic_reduce_rule(steps: Callable[[Any], int]) -> Rule:
  """``reduce`` / ``reduce_window`` with the scalar combiner as a jaxpr: its FLOPs (at least 1) per step."""

  def rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
    combiner = next(sub_jaxprs(eqn), None)
    per_step = counter.jaxpr(combiner).total if combiner is not None else 1
    tally.add_flops(eqn.primitive.name, max(per_step, 1) * steps(eqn))

  return rule


def _pallas_call_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  """A Pallas kernel: its ``cost_estimate`` (``pl.CostEstimate``: FLOPs and transcendentals the kernel's author
  states) when it has one; else its body counted once per grid step (the product of ``grid_mapping.grid``): every
  block's work, also blocks a mask lets the kernel skip at run time (the splash kernel's above the causal diagonal),
  so an upper bound there. Without this rule a kernel counted its body once, a few percent of its work."""
  estimate = eqn.params.get("cost_estimate")
  flops = getattr(estimate, "flops", None)
  if flops is not None:
    tally.add_flops("pallas_call", int(flops))
    tally.transcendentals += int(getattr(estimate, "transcendentals", 0) or 0)
    return
  grid = getattr(eqn.params.get("grid_mapping"), "grid", ()) or ()
  steps = math.prod(int(g) for g in grid if isinstance(g, int)) if grid else 1
  tally.add(counter.jaxpr(eqn.params["jaxpr"]), times=max(steps, 1))


def _sub_jaxprs_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  """Anything else that carries jaxprs (``jit``, ``remat2``, ``closed_call``...): each counted once; else uncounted."""
  subs = list(sub_jaxprs(eqn))
  for sub in subs:
    tally.add(counter.jaxpr(sub))
  if not subs:
    tally.uncounted.add(eqn.primitive.name)


def _rules() -> dict[str, Rule]:
  """Builds :data:`_RULES`; a primitive in two tables is a bug, so it raises."""
  entries: list[tuple[str, Rule]] = [
      *((name, _zero_rule) for name in _ZERO_COST),
      *((name, _elementwise_rule(f, t)) for name, (f, t) in _ELEMENTWISE.items()),
      ("integer_pow", _flops_rule(lambda e: _integer_pow_multiplies(e.params["y"]) * _out_size(e))),
      ("select_n", _flops_rule(lambda e: max(len(e.invars) - 2, 0) * _out_size(e))),  # one select per extra case
      ("dot_general", _flops_rule(_dot_general_flops)),
      ("ragged_dot_general", _flops_rule(_ragged_dot_flops)),
      ("conv_general_dilated", _flops_rule(_conv_flops)),
      *((name, _flops_rule(lambda e, c=cost: c * _reduction_steps(e))) for name, cost in _REDUCTIONS.items()),
      *((name, _flops_rule(_out_size)) for name in _CUMULATIVE - {"cumlogsumexp"}),
      ("cumlogsumexp", _cumlogsumexp_rule),
      *((name, _flops_rule(_window_steps)) for name in _REDUCE_WINDOW),
      *((name, _flops_rule(lambda e: _size(e.invars[-1].aval))) for name in _SCATTER_COMBINE),  # per update
      ("sort", _flops_rule(_sort_flops)),
      ("top_k", _flops_rule(_sort_flops)),  # XLA's TopkDecomposer makes it a sort of each row
      ("scan", _scan_rule),
      ("cond", _cond_rule),
      ("while", _while_rule),
      ("shard_map", _repeated_rule("jaxpr", _mesh_devices)),
      ("xla_pmap", _repeated_rule("call_jaxpr", lambda e: int(e.params.get("axis_size", 1)))),
      *((name, _custom_call_rule) for name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")),
      ("pallas_call", _pallas_call_rule),
      ("reduce", _generic_reduce_rule(_reduction_steps)),
      ("reduce_window", _generic_reduce_rule(_window_steps)),
  ]
  rules: dict[str, Rule] = {}
  for name, rule in entries:
    if name in rules:
      raise AssertionError(f"primitive {name!r} has two FLOP rules")
    rules[name] = rule
  return rules


_RULES: dict[str, Rule] = _rules()
"""Primitive name -> rule; primitives not listed go to :func:`_sub_jaxprs_rule`."""


def _reduce_precision_rule(counter: _Counter, eqn: Any, tally: _Tally) -> None:
  """An elementwise op, except to its own dtype's exponent and mantissa bits: jax.checkpoint wraps every saved
  residual in one (JAX PR 22244) and XLA's simplifier removes it, so it costs nothing."""
  try:
    info = jax.numpy.finfo(eqn.invars[0].aval.dtype)
    identity = eqn.params.get("exponent_bits") == info.nexp and eqn.params.get("mantissa_bits") == info.nmant
  except ValueError:
    identity = False
  if not identity:
    _elementwise_rule(1, 0)(counter, eqn, tally)


_RULES["reduce_precision"] = _reduce_precision_rule


def jaxpr_flops(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> FlopCount:
  """Counts the FLOPs of one evaluation of a jaxpr.

  Walks every equation, recursing into sub-jaxprs (``scan`` bodies times their
  ``length``, ``jit``, ``remat2``/checkpoint, ``cond`` branches, ``while``,
  custom-derivative primals, ``shard_map``, ...). See the module docstring for
  the per-primitive cost model, which follows XLA's ``HloCostAnalysis``.

  Args:
    jaxpr: a ``jax.extend.core.ClosedJaxpr`` (what ``jax.make_jaxpr`` returns)
      or a ``jax.extend.core.Jaxpr``. Shapes must be static.

  Returns:
    A ``FlopCount``: ``total`` FLOPs (transcendentals excluded, as in XLA's
    ``"flops"``), FLOPs ``by_primitive``, the ``transcendentals`` count, the
    number of ``unbounded_loops`` (``while`` loops whose body was counted once
    because their trip count is not static), and ``uncounted_primitives``.

  Raises:
    TypeError: if ``jaxpr`` is neither a ``ClosedJaxpr`` nor a ``Jaxpr``; for
      a Python function use ``count_flops(fn, *args)`` instead.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    >>> jaxpr_flops(cj).total  # 2 * M * N * K
    48
  """
  if not isinstance(jaxpr, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
    raise TypeError(
        f"jaxpr_flops expects a jax.extend.core.ClosedJaxpr or Jaxpr, got "
        f"{type(jaxpr).__name__}. To count a Python function, call "
        f"count_flops(fn, *args) (it runs jax.make_jaxpr for you).")
  return _Counter().jaxpr(jaxpr).freeze()


def equation_flops(eqn: jex_core.JaxprEqn) -> FlopCount:
  """Counts the FLOPs of one jaxpr equation with the same rules as :func:`jaxpr_flops`.

  What the per-tensor planner (:mod:`jaxckpt.planner._tensors`) charges for recomputing one op.

  Args:
    eqn: one equation of a jaxpr (``closed.jaxpr.eqns[i]``); one with sub-jaxprs counts them as ``jaxpr_flops``
      does (a ``scan`` body times its length, ...).

  Returns:
    A ``FlopCount`` of that equation alone (units: FLOPs; transcendentals apart).
  """
  counter, tally = _Counter(), _Tally()
  counter.equation(eqn, tally)
  return tally.freeze()


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
  """Counts the FLOPs of ``fn(*args, **kwargs)`` from its jaxpr.

  Traces ``jax.make_jaxpr(fn)(*args, **kwargs)`` -- nothing is compiled or
  executed -- and counts with ``jaxpr_flops``. Unlike XLA's
  ``cost_analysis()["flops"]``, loop bodies are multiplied by their trip
  count, so a ``scan`` over L layers costs L layers.

  To count a training step, pass the whole step (e.g. a function calling
  ``jax.value_and_grad``); the backward pass, including the recomputation a
  remat policy adds, is then part of the jaxpr.

  Args:
    fn: the function to count. May be ``jax.jit``-wrapped.
    *args: positional arguments: pytrees of arrays or ``jax.ShapeDtypeStruct``
      (shape + dtype only, so nothing is allocated). Non-array Python values
      are passed through as static values by ``make_jaxpr``'s tracing rules.
    **kwargs: keyword arguments, passed to ``fn`` the same way.

  Returns:
    A ``FlopCount`` (units: FLOPs; see ``jaxpr_flops``).

  Raises:
    TypeError: if ``fn`` is not callable.
    Any exception raised by tracing ``fn`` with these arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> w = jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)   # [L, D, D]
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)       # [B, D]
    >>> def stack(w, x):
    ...   return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]
    >>> count_flops(stack, w, x).by_primitive["dot_general"]  # L * 2*B*D*D
    16384
  """
  if not callable(fn):
    raise TypeError(
        f"count_flops expects a callable as its first argument, got "
        f"{type(fn).__name__}. To count an existing jaxpr use jaxpr_flops().")
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))


def live_jaxpr(closed: jex_core.ClosedJaxpr) -> jex_core.Jaxpr:
  """``closed`` without dead code: equations whose results reach no output (nor an effect) are dropped, inside
  ``scan``/``cond``/``jit``/``remat`` bodies too, as XLA drops them before running anything.

  Built on JAX's own dead-code elimination, ``jax._src.interpreters.partial_eval.dce_jaxpr`` (the pass JAX runs on
  ``scan`` bodies and remat'd functions; no public API has it).

  Why it matters: ``jax.make_jaxpr`` keeps dead code. E.g. the JVP of ``jax.nn.softmax``'s ``stop_gradient``-ed
  max (an ``eq``, a ``convert_element_type`` and a ``reduce_sum`` per attention logit) survives in an unrolled
  step without remat but is removed wherever JAX runs its own DCE (scan bodies, remat): counted raw, the same
  program looked 0.05% more expensive unrolled than scanned on GPT ``small``.

  Args:
    closed: a ``ClosedJaxpr`` (what ``jax.make_jaxpr`` returns).

  Returns:
    The live ``Jaxpr`` (every output kept; unused inputs may be dropped).

  Raises:
    RuntimeError: the installed JAX lacks ``dce_jaxpr``.
  """
  jaxpr, _ = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return jaxpr


def count_live_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
  """:func:`count_flops` of what XLA will run: the jaxpr after dead-code elimination (:func:`live_jaxpr`).

  Use it to compare programs traced differently (a layer alone vs inside a scan, PyTorch's partitioned graphs,
  which are dead-code free): raw jaxprs may differ by dead code only.

  Args:
    fn: the function to count.
    *args: positional arguments (pytrees of arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: keyword arguments, passed to ``fn``.

  Returns:
    A ``FlopCount`` (units: FLOPs).

  Raises:
    TypeError: if ``fn`` is not callable.
    RuntimeError: the installed JAX lacks dead-code elimination (see :func:`live_jaxpr`).

  Example:
    >>> import jax.numpy as jnp
    >>> def f(x):
    ...   unused = x * 2.0            # dead: never reaches the output
    ...   return x + 1.0
    >>> count_flops(f, jnp.ones(8)).total, count_live_flops(f, jnp.ones(8)).total
    (16, 8)
  """
  if not callable(fn):
    raise TypeError(f"count_live_flops expects a callable as its first argument, got {type(fn).__name__}.")
  return jaxpr_flops(live_jaxpr(jax.make_jaxpr(fn)(*args, **kwargs)))
