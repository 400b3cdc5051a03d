"""Which weights each matmul of a jaxpr reads from: the data flow between a model's linear layers, in call order.

A linear layer is a ``dot_general`` of an activation by a weight (a jaxpr input: a parameter). Walking the jaxpr in
program order, every value carries the set of weights whose matmuls it depends on; each matmul of a weight records
that set for its activation operand (:class:`MatmulRead`). Within one Transformer block the result shows the
Megatron-LM pattern (Shoeybi et al. 2019, §3) by data flow alone, whatever the layers are called: attention's
query/key/value projections read nothing of each other and its output projection reads all three; the MLP's gate and
up projections read nothing of each other and its down projection reads both (:func:`jaxckpt.step.auto_tensor_plan`).
Reshapes, slices, rotary embeddings (products with constants), the attention's own matmuls and its softmax keep the
dependencies as they are.

**Modulation.** A value broadcast to more elements (smaller than the elementwise operation's result, or grown by a
``broadcast_in_dim`` before it: a per-example vector spread over the tokens) and combined elementwise with a
full-size value that is not itself such a broadcast *modulates* it: its dependencies are recorded apart (``mods``),
not as data the matmul reads. That is adaLN's shift, scale and gate (Peebles & Xie 2023: ``x * (1 + scale[:, None])
+ shift[:, None]``), a per-example ``[B, 6D]`` projection that scales the ``[B, N, D]`` token stream, and also a
norm's mean and a softmax's maximum (whose dependencies are the data's own, so nothing changes there). A broadcast
read by a matmul (grouped query attention's ``jnp.repeat`` of the keys) is data.

Calls whose inputs and outputs map one to one onto a body's (``jit``, ``jax.checkpoint``, custom JVP/VJP calls,
``scan``: a stacked weight's per-iteration slice is the weight) are followed inside; a ``scan``'s carry enters its
body with the dependencies it starts with. Other control flow (``while``, ``cond``) is not followed: its outputs
depend on everything its inputs depend on, and matmuls inside it are not recorded.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, NamedTuple

import jax.extend.core as jex_core

from jaxckpt.analysis._jaxprs import sub_jaxprs

PASS_WEIGHT = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint", "reshard", "mesh_cast",
                         "optimization_barrier"})
"""Primitives whose output is still the weight they take (a dtype cast, a copy, a sharding constraint)."""


class MatmulRead(NamedTuple):
  """One matmul of a weight, in program order."""

  weight: int  # index of the jaxpr input that is the matmul's weight operand
  reads: frozenset[int]  # indices of the weights whose matmuls the other operand depends on as data
  mods: frozenset[int] = frozenset()  # ... only through a modulation (a broadcast scale or shift; module docstring)


class _Value(NamedTuple):
  weight: int | None  # the weight input this value is (through PASS_WEIGHT), else None
  deps: frozenset[int]  # weights whose matmul outputs this value depends on as data
  mods: frozenset[int] = frozenset()  # weights whose outputs only modulate it (module docstring), disjoint from deps
  spread: bool = False  # broadcast to more elements and not yet combined with a full-size value


_NONE = _Value(None, frozenset())


def matmul_reads(jaxpr: Any, weights: Collection[int]) -> list[MatmulRead]:
  """Every ``dot_general`` of one of ``weights`` (by one operand; the other is not a weight), in program order, with
  the weights its other operand depends on (module docstring).

  Args:
    jaxpr: a (closed) jaxpr, e.g. ``jax.make_jaxpr(loss)(params, batch)``.
    weights: indices into its inputs (``jaxpr.invars``) of the weights to follow.

  Returns:
    One :class:`MatmulRead` per matmul of a weight (a weight used twice appears twice).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  wanted = frozenset(weights)
  values = [_Value(i if i in wanted else None, frozenset()) for i in range(len(jaxpr.invars))]
  out: list[MatmulRead] = []
  _walk(jaxpr, values, out)
  return out


def _shape(atom: Any) -> tuple[int, ...]:
  return tuple(getattr(getattr(atom, "aval", None), "shape", ()))


def _size(atom: Any) -> int:
  return math.prod(_shape(atom))


def _broadcast(atom: Any, out: Any) -> bool:
  """Whether ``atom`` is an operand an elementwise operation broadcasts to its result ``out``: the same rank, each
  dimension the result's or 1, fewer elements."""
  shape, full = _shape(atom), _shape(out)
  return (len(shape) == len(full) and all(a in (1, b) for a, b in zip(shape, full))
          and math.prod(shape) < math.prod(full))


def _merge(values: list[_Value], *, spread: bool) -> _Value:
  deps = frozenset().union(*(v.deps for v in values))
  mods = frozenset().union(*(v.mods for v in values)) - deps
  return _Value(None, deps, mods, spread)


def _combine(eqn: Any, ins: list[_Value]) -> _Value:
  """The value of an operation without a body: spread operands beside a full-size unspread one modulate it (module
  docstring); a matmul's operands are data; a one-operand operation keeps what its operand is."""
  arrays = [(atom, v) for atom, v in zip(eqn.invars, ins) if not isinstance(atom, jex_core.Literal)]
  name = eqn.primitive.name
  if name == "broadcast_in_dim" and arrays and _size(eqn.outvars[0]) > _size(arrays[0][0]):
    return _merge([arrays[0][1]], spread=True)
  if name == "dot_general" or len(arrays) < 2:
    return _merge(ins, spread=name != "dot_general" and any(v.spread for _, v in arrays))
  spread = [v.spread or _broadcast(atom, eqn.outvars[0]) for atom, v in arrays]
  if all(spread):
    return _merge(ins, spread=True)
  data = _merge([v for (_, v), s in zip(arrays, spread) if not s], spread=False)
  scale = _merge([v for (_, v), s in zip(arrays, spread) if s], spread=False)
  return _Value(None, data.deps, (data.mods | scale.deps | scale.mods) - data.deps)


def _walk(jaxpr: Any, inputs: list[_Value], out: list[MatmulRead]) -> list[_Value]:
  env = dict(zip(jaxpr.invars, inputs))

  def read(atom: Any) -> _Value:
    return _NONE if isinstance(atom, jex_core.Literal) else env.get(atom, _NONE)

  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    name = eqn.primitive.name
    if name == "dot_general" and len(ins) == 2 and (ins[0].weight is None) != (ins[1].weight is None):
      weight, other = (ins[0], ins[1]) if ins[0].weight is not None else (ins[1], ins[0])
      out.append(MatmulRead(weight.weight, other.deps, other.mods))
      outs = [_Value(None, other.deps | {weight.weight}, other.mods - {weight.weight})]
    elif name in PASS_WEIGHT and len(ins) == len(eqn.outvars):
      outs = ins
    else:
      subs = list(sub_jaxprs(eqn))
      body = getattr(subs[0], "jaxpr", subs[0]) if len(subs) == 1 else None
      if body is not None and len(body.invars) == len(ins) and len(body.outvars) == len(eqn.outvars):
        outs = _walk(body, ins, out)  # a call, a checkpoint, a scan: followed inside (module docstring)
      elif subs:
        outs = [_merge(ins, spread=False)] * len(eqn.outvars)
      else:
        outs = [_combine(eqn, ins)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(a) for a in jaxpr.outvars]
