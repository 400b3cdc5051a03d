"""Automatic checkpoint names: tag chosen intermediate values of a function so a plain JAX policy can save them.

``jax.checkpoint_policies.save_only_these_names`` saves values tagged with ``jax.ad_checkpoint.checkpoint_name``;
hand-written blocks tag a few (``qkv``, ``mlp_hidden``). A per-tensor plan (:mod:`jaxckpt.planner._tensors`) picks
*any* intermediate. :func:`tag_values` makes that a real JAX policy: it traces the function to a jaxpr, evaluates
the jaxpr again equation by equation (calls to ``jit`` functions such as ``jax.nn.gelu`` are inlined, so their
insides can be tagged) and wraps each chosen output in ``checkpoint_name``. The automatic name of a value is
``t<n>_<primitive>``: ``n`` counts the outputs of the evaluated equations in program order (:func:`walk_values`
gives the same numbering without evaluating), the primitive guards against a different program (a value whose
producer differs from its name is not tagged, e.g. the dropout-free evaluation graph).

The result under ``jax.checkpoint(..., policy=save_only_these_names(*names))`` is plain JAX; JAX's saved-residual
analysis lists the saved values as ``named 't12_tanh' from <source line>``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core

from jaxckpt.analysis._internals import source_info_util

TAG_PREFIX = "t"
"""Automatic names are ``t<index>_<primitive>``."""

_NAME_RE = re.compile(r"t(?P<index>[0-9]+)_(?P<prim>[A-Za-z0-9_\-]+)\Z")
_INLINED = ("jit", "pjit", "closed_call", "core_call")

_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxckpt_record_tagged", default=None)


def value_name(index: int, primitive: str) -> str:
  """The automatic checkpoint name of value ``index`` produced by ``primitive``, e.g. ``t12_tanh``."""
  return f"{TAG_PREFIX}{index}_{primitive.replace('-', '_')}"


def parse_value_name(name: str) -> tuple[int, str] | None:
  """``(index, primitive)`` of an automatic name, ``None`` for other names."""
  match = _NAME_RE.match(name)
  return (int(match["index"]), match["prim"]) if match else None


@dataclasses.dataclass(frozen=True)
class ValueInfo:
  """One value of a walked jaxpr.

  Attributes:
    index: its number in walk order (the ``n`` of its name).
    op: the number of the equation producing it (several outputs share one).
    primitive: the producing primitive's name.
    shape, dtype: of the value.
    bytes: ``prod(shape) * itemsize``.
    inputs: the value numbers of the equation's inputs; ``-1 - i`` for input ``i`` of the walked jaxpr, ``None``
      entries (literals, constants) are left out.
    source: ``file:line (function)`` of the user code, when JAX has it.
    taggable: a numeric or bool array (extended dtypes such as PRNG keys cannot be named).
    eqn: the equation (for cost counting).
  """

  index: int
  op: int
  primitive: str
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  inputs: tuple[int, ...]
  source: str
  taggable: bool
  eqn: Any = dataclasses.field(repr=False, compare=False)

  @property
  def name(self) -> str:
    return value_name(self.index, self.primitive)


def _taggable(aval: Any) -> bool:
  # jax.numpy's issubdtype: NumPy's says bfloat16 and float8 (ml_dtypes) are not numbers, which left every value of
  # a bfloat16 model untaggable (no plan could save one, every cut looked free)
  try:
    return bool(jax.numpy.issubdtype(aval.dtype, jax.numpy.number)) or np.dtype(aval.dtype) == np.bool_
  except TypeError:
    return False


def _nbytes(aval: Any) -> int:
  try:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
  except TypeError:
    return 0


def walk_values(closed: jex_core.ClosedJaxpr) -> list[ValueInfo]:
  """Every value :func:`tag_values` can tag in ``closed``, numbered as it numbers them.

  Args:
    closed: a closed jaxpr (``jax.make_jaxpr(fn)(*args)``).

  Returns:
    One :class:`ValueInfo` per output of every equation not inlined, in program order.
  """
  return walk_top_level(closed)[0]


def walk_top_level(closed: jex_core.ClosedJaxpr) -> tuple[list[ValueInfo], list[tuple[int, list[int | None]]]]:
  """:func:`walk_values`, plus where each top-level equation's values are (to cut a jaxpr into regions).

  Args:
    closed: a closed jaxpr.

  Returns:
    ``(values, top)``: ``values`` as :func:`walk_values`; ``top[i] = (first, outs)`` for top-level equation ``i``:
    ``first`` the number of its first value (its values are ``first`` up to the next equation's ``first``),
    ``outs`` the value number of each of its outputs (``-1 - j`` when an inlined call returns input ``j`` of
    ``closed``; ``None`` for a literal).
  """
  values: list[ValueInfo] = []
  ops = [0]
  top: list[tuple[int, list[int | None]]] = []

  def walk(jaxpr, env, depth):
    for eqn in jaxpr.eqns:
      first = len(values)
      ins = [env.get(a) if not isinstance(a, jex_core.Literal) else None for a in eqn.invars]
      if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
        sub = eqn.params["jaxpr"]
        sub_env = {v: i for v, i in zip(sub.jaxpr.invars, ins) if i is not None}
        outs = walk(sub.jaxpr, sub_env, depth + 1)
      else:
        op = ops[0]
        ops[0] += 1
        outs = []
        for var in eqn.outvars:
          info = ValueInfo(len(values), op, eqn.primitive.name, tuple(int(d) for d in var.aval.shape),
                           str(var.aval.dtype), _nbytes(var.aval), tuple(i for i in ins if i is not None),
                           source_info_util.summarize(eqn.source_info), _taggable(var.aval), eqn)
          values.append(info)
          outs.append(info.index)
      for var, out in zip(eqn.outvars, outs):
        if out is not None:
          env[var] = out
      if depth == 0:
        top.append((first, list(outs)))
    return [env.get(v) if not isinstance(v, jex_core.Literal) else None for v in jaxpr.outvars]

  walk(closed.jaxpr, {v: -1 - i for i, v in enumerate(closed.jaxpr.invars)}, 0)
  return values, top


def evaluate_tagged(closed: jex_core.ClosedJaxpr, args: Sequence[Any], tags: dict[int, str], *,
                    identity: frozenset[int] = frozenset()) -> list[Any]:
  """Evaluates a jaxpr equation by equation, wrapping the values named in ``tags`` in ``checkpoint_name``.

  Values are numbered as :func:`walk_values` numbers them (``jit``/``closed_call`` bodies inlined); value ``i``
  gets ``checkpoint_name(value, tags[i])``. An automatic name (:func:`value_name`) is applied only when its primitive
  part matches the producing primitive (a stale name is ignored, never applied to another value); other names (the
  parts of a layer, :func:`jaxckpt.core._autonames.tag_parts`) come from this jaxpr and are applied as they are. Each
  equation is re-bound under its own source location and name stack, so JAX's saved-residual analysis still reports
  the model's source lines.

  Args:
    closed: the jaxpr to run (e.g. a block's function as :func:`record_tagged` records it).
    args: its arguments, flat, in ``closed.in_avals`` order (arrays or tracers).
    tags: value number -> checkpoint name.
    identity: value numbers of one-input, one-output equations to drop (their output is their input), e.g. the
      markers a trace left for :func:`jaxckpt.core._autonames.tag_parts`.

  Returns:
    The jaxpr's outputs, flat.
  """
  env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  evaluate_equations(closed.jaxpr.eqns, env, tags, identity=identity)
  return [a.val if isinstance(a, jex_core.Literal) else env[a] for a in closed.jaxpr.outvars]


def evaluate_equations(eqns: Sequence[Any], env: dict[Any, Any], tags: dict[int, str], start: int = 0, *,
                       identity: frozenset[int] = frozenset()) -> int:
  """:func:`evaluate_tagged` of a run of equations: binds each one, reading and writing ``env`` (var -> value).

  Args:
    eqns: consecutive equations of a jaxpr (e.g. one region of a whole loss, :mod:`jaxckpt.planner._whole`).
    env: the values of the variables they read (updated in place with the ones they define).
    tags: value number -> checkpoint name, numbered over the whole jaxpr.
    start: the number of the first value these equations produce (:func:`walk_top_level`).
    identity: value numbers whose equations are dropped, their input passed on (see :func:`evaluate_tagged`).

  Returns:
    The number after the last value produced.
  """
  counter = [start]

  def run(eqns, env):
    read = lambda a: a.val if isinstance(a, jex_core.Literal) else env[a]  # noqa: E731
    for eqn in eqns:
      invals = [read(a) for a in eqn.invars]
      if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
        sub = eqn.params["jaxpr"]
        sub_env = dict(zip(sub.jaxpr.constvars, sub.consts))
        sub_env.update(zip(sub.jaxpr.invars, invals))
        run(sub.jaxpr.eqns, sub_env)
        outs = [a.val if isinstance(a, jex_core.Literal) else sub_env[a] for a in sub.jaxpr.outvars]
      elif counter[0] in identity:  # a marker: its input, unchanged
        counter[0] += 1
        outs = invals[:1]
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
          outs = eqn.primitive.bind(*invals, **params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for k, out in enumerate(outs):
          index = counter[0]
          counter[0] += 1
          name = tags.get(index)
          parsed = None if name is None else parse_value_name(name)
          if name is not None and (parsed is None or parsed[1] == eqn.primitive.name.replace("-", "_")):
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
              outs[k] = checkpoint_name(out, name)
      for var, out in zip(eqn.outvars, outs):
        env[var] = out

  run(eqns, env)
  return counter[0]


@contextlib.contextmanager
def record_tagged() -> Iterator[list]:
  """Within this context every function made by :func:`tag_values` appends ``(owner, closed_jaxpr)`` to the yielded
  list each time it is traced: how the planner sees a block's jaxpr exactly as the train step traces it."""
  found: list = []
  token = _RECORD.set(found)
  try:
    yield found
  finally:
    _RECORD.reset(token)


def recording() -> bool:
  """Whether a :func:`record_tagged` context is open (a trace made now has side effects the caller reads)."""
  return _RECORD.get() is not None


def tag_values(fn: Callable[..., Any], names: Sequence[str], *, owner: Any = None) -> Callable[..., Any]:
  """``fn`` with the values named by automatic names wrapped in ``checkpoint_name``.

  Args:
    fn: a function of pytrees of arrays.
    names: automatic names (:func:`value_name`, e.g. ``("t12_tanh", "t30_dot_general")``).
    owner: recorded with the jaxpr under :func:`record_tagged` (e.g. the block module).

  Returns:
    A function with ``fn``'s signature and outputs; under ``jax.checkpoint(policy=save_only_these_names(*names))``
    it saves exactly the named values the backward pass needs.

  Raises:
    ValueError: a name that is not an automatic name.
  """
  tags: dict[int, str] = {}
  for name in names:
    parsed = parse_value_name(name)
    if parsed is None:
      raise ValueError(f"{name!r} is not an automatic value name (t<index>_<primitive>, e.g. t12_tanh)")
    tags[parsed[0]] = name

  def tagged(*args, **kwargs):
    flat, in_tree = jax.tree.flatten((args, kwargs))
    closed, out_shape = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(in_tree, leaves)[0],
                                                          **jax.tree.unflatten(in_tree, leaves)[1]),
                                       return_shape=True)(*flat)
    record = _RECORD.get()
    if record is not None:
      record.append((owner, closed))
    outs = evaluate_tagged(closed, flat, tags)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return tagged
