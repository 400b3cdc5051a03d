"""Which weights each matmul of a jaxpr reads from: the data flow between a model's linear layers, in call order.

A linear layer is a ``dot_general`` of an activation by a weight (a jaxpr input: a parameter). Walking the jaxpr in
program order, every value carries the set of weights whose matmuls it depends on; each matmul of a weight records
that set for its activation operand (:class:`MatmulRead`). Within one Transformer block the result shows the
Megatron-LM pattern (Shoeybi et al. 2019, §3) by data flow alone, whatever the layers are called: attention's
query/key/value projections read nothing of each other and its output projection reads all three; the MLP's gate and
up projections read nothing of each other and its down projection reads both (:func:`jaxckpt.step.auto_tensor_plan`).

Calls whose inputs and outputs map one to one onto a body's (``jit``, ``jax.checkpoint``, custom JVP/VJP calls,
``scan``: a stacked weight's per-iteration slice is the weight) are followed inside; a ``scan``'s carry enters its
body with the dependencies it starts with. Other control flow (``while``, ``cond``) is not followed: its outputs
depend on everything its inputs depend on, and matmuls inside it are not recorded.
"""

from __future__ import annotations

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
  reads: frozenset[int]  # indices of the weights whose matmuls the other operand depends on


class _Value(NamedTuple):
  weight: int | None  # the weight input this value is (through PASS_WEIGHT), else None
  deps: frozenset[int]  # weights whose matmul outputs this value depends on


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


def _walk(jaxpr: Any, inputs: list[_Value], out: list[MatmulRead]) -> list[_Value]:
  env = dict(zip(jaxpr.invars, inputs))

  def read(atom: Any) -> _Value:
    return _NONE if isinstance(atom, jex_core.Literal) else env.get(atom, _NONE)

  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    name = eqn.primitive.name
    deps = frozenset().union(*(v.deps for v in ins))
    if name == "dot_general" and len(ins) == 2 and (ins[0].weight is None) != (ins[1].weight is None):
      weight, other = (ins[0], ins[1]) if ins[0].weight is not None else (ins[1], ins[0])
      out.append(MatmulRead(weight.weight, other.deps))
      outs = [_Value(None, other.deps | {weight.weight})]
    elif name in PASS_WEIGHT and len(ins) == len(eqn.outvars):
      outs = ins
    else:
      subs = list(sub_jaxprs(eqn))
      body = getattr(subs[0], "jaxpr", subs[0]) if len(subs) == 1 else None
      if body is not None and len(body.invars) == len(ins) and len(body.outvars) == len(eqn.outvars):
        outs = _walk(body, ins, out)  # a call, a checkpoint, a scan: followed inside (module docstring)
      else:
        outs = [_Value(None, deps)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(a) for a in jaxpr.outvars]
