"""What a remat policy saves for the backward pass: residuals, by name, primitive and source.

Built on JAX's own analysis, ``jax._src.ad_checkpoint.saved_residuals`` (the function behind the public
``jax.ad_checkpoint.print_saved_residuals``). It traces ``jax.vjp(fn, *args)`` to a jaxpr and lists every value the
backward pass reads -- the residuals -- as ``(aval, description)`` pairs. This module parses the descriptions into
``Residual`` records and adds grouping and byte totals.

JAX's description strings (jax 0.10) and the ``kind`` each becomes:

=============================================================  =====================  ================
description                                                    kind                   primitive
=============================================================  =====================  ================
``from the argument x`` / ``... ws[0]`` / ``... p['w1']``      ``"argument"``         None
``named 'qkv' from file.py:12:8 (fn)``                         ``"checkpoint_name"``  ``"name"``
``output of scan from file.py:30:4 (fn)``                      ``"scan_output"``      ``"scan"``
``output of dot_general from file.py:12:8 (fn)``               ``"primitive"``        ``"dot_general"``
``output of jitted function 'f' from file.py:3:4 (g)``         ``"primitive"``        ``"jit"``
``from a literal`` / ``from a constant``                       ``"other"``            None
=============================================================  =====================  ================

Scanned layers. When layers are stacked with ``jax.lax.scan`` (or ``nnx.scan``), the residuals of all iterations are
stacked by the scan itself, so JAX reports them as ``output of scan`` with a leading layer axis ``[L, ...]`` and the
checkpoint names are lost. To see names, analyse one layer (the scan body, e.g. the block function with one layer's
weights) or an unrolled trace, then use ``scale_residuals(body_residuals, L)`` to get the whole stack: its total
bytes equal those of the scanned analysis.

Nested remat (checkpoint structures). A ``jax.checkpoint`` around a group of remat'd blocks (``every:K``,
``nested``) saves only the group's inputs across the forward pass -- that is all ``saved_residuals`` of the whole
function shows, whatever the blocks' own policies. The blocks' policies act when the backward pass recomputes the
group: the group is run again and differentiated, and what *its* backward reads stays alive until that group's
backward is done. ``recomputed_residuals(remat_eqn)`` lists those values for one group (found with
:func:`jaxckpt.analysis._jaxprs.outermost_remats`). The most saved values alive at once is then the outer residuals plus one
group's recomputed residuals at each level (Chen et al. 2016: N/K group inputs + one group of K).

Your own line. JAX names the innermost frame outside JAX itself, which for a model written with Flax layers is
Flax's (``linear.py:431``, the bias add of every ``nnx.Linear``) and under jaxckpt's layer stacks jaxckpt's
(``_structure.py:168``). Each residual made by an equation also gets its ``site``: the innermost frame of the
equation's traceback in *your* files, outside the standard library, site-packages (jax, flax, optax…) and jaxckpt's
machinery (jaxckpt's shipped models and their block math count as yours, :data:`jaxckpt.errors.MODEL_CODE`), so a
residual reads as the line of your model that made it (``own_model.py:124``, the call of the projection whose bias add
it is).

Bytes are ``elements * dtype itemsize``, an upper bound on what is stored: XLA may fuse some residuals away or, on
XLA:CPU, undo remat in unrolled code (its ``cse_barrier_expander`` pass, unless disabled per compile:
:mod:`jaxckpt.training._xla`); compiled memory stats are the ground truth.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jaxckpt.analysis._internals import saved_residuals_parts, source_info_util
from jaxckpt.errors import is_library_file
from jaxckpt.analysis._jaxprs import inline_calls, is_remat, remat_body

KINDS: tuple[str, ...] = ("argument", "checkpoint_name", "primitive", "scan_output", "other")
"""Every value ``Residual.kind`` can take."""

GROUP_BY: tuple[str, ...] = ("name", "primitive", "source", "site", "kind")
"""Valid ``by`` values of ``group_residuals``."""


@dataclasses.dataclass(frozen=True)
class Residual:
  """One value saved by the forward pass for the backward pass.

  Attributes:
    shape: the residual's shape, e.g. ``(B, T, 3 * D)``.
    dtype: its dtype name, e.g. ``"float32"``, ``"bfloat16"``.
    bytes: ``prod(shape) * itemsize`` in bytes (int).
    name: the checkpoint name when the value came from ``jax.ad_checkpoint.checkpoint_name`` (the ``name``
      primitive), else None.
    kind: one of ``KINDS``: ``"argument"`` (an input of the differentiated function, kept alive anyway),
      ``"checkpoint_name"``, ``"primitive"`` (output of an unnamed op, see ``primitive``), ``"scan_output"``
      (stacked by a ``scan``: leading layer axis, names hidden) or ``"other"`` (literals, constants).
    primitive: the producing primitive's name (``"dot_general"``, ``"name"``, ``"scan"``, ``"jit"``, ...), or None
      for arguments and other.
    source: ``"file.py:line:col (function)"`` of the user code that produced it, when JAX gives one, else None.
    argument: for kind ``"argument"``, the argument's path as JAX prints it (``"x"``, ``"ws[0]"``,
      ``"p['w1']"``), else None.
    description: JAX's raw description string.
    site: ``"file.py:line:col (function)"`` of the line of *your* code that made it (module docstring: the innermost
      frame outside the standard library, site-packages and jaxckpt's machinery), when :func:`traced_residuals`
      found one, else None.
  """

  shape: tuple[int, ...]
  dtype: str
  bytes: int
  name: str | None
  kind: str
  primitive: str | None
  source: str | None
  description: str
  argument: str | None = None
  site: str | None = None


@dataclasses.dataclass(frozen=True)
class ResidualGroup:
  """Residuals sharing one key (see ``group_residuals``).

  Attributes:
    key: the shared value of the grouping field (a name, primitive, source or kind); None when that field is None
      (e.g. the unnamed residuals when grouping by name).
    count: number of residuals in the group.
    bytes: their summed size in bytes (int).
    residuals: the residuals themselves, in their original order.
  """

  key: str | None
  count: int
  bytes: int
  residuals: tuple[Residual, ...]


_NAMED_RE = re.compile(r"named '(?P<name>.*)' from (?P<src>.*)\Z", re.S)
_JITTED_RE = re.compile(r"output of jitted function '(?P<fn>.*)' from (?P<src>.*)\Z", re.S)
_OUTPUT_RE = re.compile(r"output of (?P<prim>\S+) from (?P<src>.*)\Z", re.S)
_ARG_PREFIX = "from the argument "
_FLAT_INDEX_PREFIX = "from the argument at flattened index"


def _source(text: str) -> str | None:
  text = text.strip()
  return text or None


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
  itemsize = getattr(dtype, "itemsize", None)
  if itemsize is None:
    itemsize = np.dtype(dtype).itemsize
  return math.prod(int(d) for d in shape) * int(itemsize)


def parse_residual(aval: Any, description: str) -> Residual:
  """Turns one ``(aval, description)`` pair from JAX's ``saved_residuals`` into a ``Residual``.

  Args:
    aval: an abstract value with ``shape`` and ``dtype`` (``jax.core.ShapedArray`` or ``jax.ShapeDtypeStruct``).
    description: JAX's text, e.g. ``"named 'qkv' from model.py:12:8 (attn)"``. Unrecognised text gives kind
      ``"other"``, so a JAX wording change degrades the classification rather than failing.

  Returns:
    The parsed ``Residual``.
  """
  shape = tuple(int(d) for d in aval.shape)
  common = dict(shape=shape, dtype=str(aval.dtype), bytes=_nbytes(shape, aval.dtype), description=description)
  if description.startswith(_FLAT_INDEX_PREFIX):
    # JAX 0.10 forgets the f-string here and prints a literal "{i}"; the index is not recoverable.
    return Residual(name=None, kind="argument", primitive=None, source=None, **common)
  if description.startswith(_ARG_PREFIX):
    return Residual(name=None, kind="argument", primitive=None, source=None,
                    argument=description[len(_ARG_PREFIX):], **common)
  if m := _NAMED_RE.match(description):
    return Residual(name=m["name"], kind="checkpoint_name", primitive="name", source=_source(m["src"]), **common)
  if m := _JITTED_RE.match(description):
    return Residual(name=None, kind="primitive", primitive="jit", source=_source(m["src"]), **common)
  if m := _OUTPUT_RE.match(description):
    prim = m["prim"]
    kind = "scan_output" if prim == "scan" else "primitive"
    return Residual(name=None, kind=kind, primitive=prim, source=_source(m["src"]), **common)
  return Residual(name=None, kind="other", primitive=None, source=None, **common)


def _jax_residual_parts() -> tuple[Callable[..., list[tuple[Any, str]]], Callable[..., Any]]:
  """JAX's ``_saved_residuals(jaxpr, arg_names)`` (the half of ``saved_residuals`` after its trace) and
  ``api_util.debug_info`` (its argument names)."""
  return saved_residuals_parts()


def _named_function(fn: Callable[..., Any]) -> Callable[..., Any]:
  """The function whose parameter names label the arguments: under JAX's next remat (remat3), ``jax.checkpoint(f)``
  is a ``functools.partial`` of JAX's ``_remat3`` with ``f`` last, whose own signature names no argument (JAX then
  prints ``args[0]``); ``f`` is looked through to. Other functions are returned as they are."""
  while isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "_remat3" and fn.args:
    fn = fn.args[-1]
  return fn


@dataclasses.dataclass(frozen=True)
class TracedResiduals:
  """The residuals of one ``jax.vjp`` trace and the trace itself, for analyses that need both.

  Attributes:
    residuals: as :func:`saved_residuals` returns them.
    jaxpr: the ``jax.extend.core.Jaxpr`` of ``jax.vjp(fn, *flat_args)``: its invars are the flattened arguments,
      its constvars the values closed over (tracers of an enclosing trace, constants), its last
      ``num_residuals`` outvars the residuals (in the order of ``residuals``' non-literal, non-argument entries).
    num_residuals: how many of ``jaxpr``'s outvars are residuals.
  """

  residuals: list[Residual]
  jaxpr: Any
  num_residuals: int


def traced_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TracedResiduals:
  """:func:`saved_residuals` and the ``jax.vjp`` jaxpr it was read from, from one trace.

  The same steps as JAX's ``jax._src.ad_checkpoint.saved_residuals`` (``make_jaxpr`` of ``jax.vjp`` over the
  flattened arguments, then its ``_saved_residuals`` over the residual outputs), with the jaxpr kept, so a second
  analysis of the same vjp (e.g. :func:`jaxckpt.analysis._activations.parameter_only_bytes`) needs no second trace.

  Args, Raises: as :func:`saved_residuals`.

  Returns:
    The :class:`TracedResiduals`.
  """
  if not callable(fn):
    raise TypeError(f"saved_residuals expects a callable as its first argument, got {type(fn).__name__}")
  import jax  # pylint: disable=g-import-not-at-top

  jax_saved_residuals, debug_info_of = _jax_residual_parts()
  in_leaves, in_tree = jax.tree.flatten((args, kwargs))

  def flat_fn(*leaves):
    a, k = jax.tree.unflatten(in_tree, leaves)
    return fn(*a, **k)

  debug_info = debug_info_of("saved_residuals", _named_function(fn), args, kwargs)
  closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(flat_fn, *xs), return_shape=True)(*in_leaves)
  call_sites: dict[int, Any] = {}
  jaxpr = inline_calls(closed.jaxpr, call_sites=call_sites)  # calls made only to share traces, read as the code
  num_res = jax.tree.structure(out_shape[1]).num_leaves
  residual_jaxpr = jaxpr.replace(outvars=jaxpr.outvars[len(jaxpr.outvars) - num_res:],
                                 debug_info=debug_info._replace(result_paths=None))
  pairs = jax_saved_residuals(residual_jaxpr, debug_info.arg_names or ("unknown",) * len(jaxpr.invars))
  residuals = [parse_residual(aval, description) for aval, description in pairs]
  return TracedResiduals(_with_sites(residuals, residual_jaxpr, call_sites), jaxpr, num_res)


def _producers(jaxpr: Any) -> list[Any]:
  """The equation that makes each residual of ``jaxpr`` (its outvars), in the order JAX's ``_saved_residuals`` lists
  the residuals equations make (after literals, constants and arguments)."""
  import jax.extend.core as jex_core  # pylint: disable=g-import-not-at-top

  wanted = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  through = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}
  wanted = {through.get(v, v) for v in wanted}  # JAX looks through reduce_precision to its operand's maker
  return [eqn for eqn in jaxpr.eqns for v in eqn.outvars if v in wanted]


def user_site(*source_infos: Any) -> str | None:
  """``"file.py:line:col (function)"`` of the innermost frame in your code (module docstring) of the first of
  ``source_infos`` (an equation's, then the shared call's it was inlined from) that has one, else ``None``."""
  for info in source_infos:
    for frame in source_info_util.user_frames(getattr(info, "traceback", None)):
      if not is_library_file(frame.file_name, model_code=False):
        return f"{frame.file_name}:{frame.start_line}:{frame.start_column} ({frame.function_name})"
  return None


def _with_sites(residuals: list[Residual], jaxpr: Any, call_sites: dict[int, Any]) -> list[Residual]:
  """``residuals`` (JAX's order) with the :func:`user_site` of each one an equation made (``call_sites``: from
  :func:`jaxckpt.analysis._jaxprs.inline_calls`)."""
  made = _producers(jaxpr)
  first = len(residuals) - len(made)
  if first < 0 or any(r.kind in ("argument", "other") for r in residuals[first:]):
    return residuals  # not JAX's order as this module reads it: no sites rather than wrong ones
  return residuals[:first] + [dataclasses.replace(r, site=user_site(eqn.source_info, call_sites.get(id(eqn))))
                              for r, eqn in zip(residuals[first:], made)]


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
  """Lists what the forward pass of ``fn(*args, **kwargs)`` saves for its backward pass.

  Traces ``jax.vjp(fn, *args, **kwargs)`` (no compilation, nothing executed) and reports every residual. Wrap
  ``fn``'s blocks in ``jax.checkpoint(..., policy=...)`` to see what that policy keeps. For a layer stack built with
  ``scan``, analyse one layer and use ``scale_residuals`` (see the module docstring).

  Args:
    fn: the function to differentiate; its outputs must be float arrays (pytrees allowed).
    *args: positional arguments: pytrees of arrays or ``jax.ShapeDtypeStruct`` (JAX traces with abstract values,
      so shapes and dtypes are enough and nothing is allocated).
    **kwargs: keyword arguments, treated like ``args``.

  Returns:
    One ``Residual`` per saved value, in JAX's order: literals and constants, then arguments, then values produced
    inside ``fn`` in program order. ``bytes`` is per residual; see ``total_residual_bytes``.

  Raises:
    TypeError: if ``fn`` is not callable.
    RuntimeError: if the installed JAX lacks ``jax._src.ad_checkpoint._saved_residuals``.
    Any exception raised by tracing ``jax.vjp`` of ``fn`` with these arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> def block(x, w):  # x: [B, D] float32, w: [D, H] float32
    ...   return jnp.sum(jnp.tanh(checkpoint_name(x @ w, "hidden")))
    >>> policy = jax.checkpoint_policies.save_only_these_names("hidden")
    >>> x, w = jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> [(r.name, r.shape, r.bytes) for r in saved_residuals(jax.checkpoint(block, policy=policy), x, w)
    ...  if r.kind == "checkpoint_name"]
    [('hidden', (4, 16), 256)]
  """
  return traced_residuals(fn, *args, **kwargs).residuals


_GROUP_FIELDS = {"name": "name", "primitive": "primitive", "source": "source", "site": "site", "kind": "kind"}


def group_residuals(residuals: Iterable[Residual], by: str) -> list[ResidualGroup]:
  """Groups residuals by one field and sums their bytes.

  Args:
    residuals: residuals from ``saved_residuals`` or ``scale_residuals``.
    by: the field to group on, one of ``GROUP_BY``: ``"name"`` (checkpoint name; unnamed ones share key None),
      ``"primitive"``, ``"source"`` (``file:line:col (function)``), ``"site"`` (the same, of your code) or
      ``"kind"``.

  Returns:
    One ``ResidualGroup`` per distinct key, sorted by ``bytes`` descending (ties by key, None last).

  Raises:
    ValueError: if ``by`` is not one of ``GROUP_BY``; the message names the bad value and the valid ones.

  Example:
    >>> r = Residual((4, 16), "float32", 256, "hidden", "checkpoint_name", "name", None, "named 'hidden' from ?")
    >>> [(g.key, g.count, g.bytes) for g in group_residuals([r, r], by="name")]
    [('hidden', 2, 512)]
  """
  if by not in _GROUP_FIELDS:
    message = f"unknown group_residuals 'by' value {by!r}; valid values: {', '.join(GROUP_BY)}"
    close = difflib.get_close_matches(str(by), GROUP_BY, n=1, cutoff=0.6)
    if close:
      message += f"; did you mean {close[0]!r}?"
    raise ValueError(message)
  field = _GROUP_FIELDS[by]
  groups: dict[str | None, list[Residual]] = {}
  for r in residuals:
    groups.setdefault(getattr(r, field), []).append(r)
  out = [ResidualGroup(key=k, count=len(rs), bytes=sum(r.bytes for r in rs), residuals=tuple(rs))
         for k, rs in groups.items()]
  out.sort(key=lambda g: (-g.bytes, g.key is None, g.key or ""))
  return out


def total_residual_bytes(residuals: Iterable[Residual], *, include_arguments: bool = True) -> int:
  """Sums the bytes of residuals.

  Args:
    residuals: residuals from ``saved_residuals`` or ``scale_residuals``.
    include_arguments: whether to count residuals of kind ``"argument"``. Arguments (parameters, inputs) are alive
      during the step anyway, so ``False`` gives the extra memory a policy costs. Default True.

  Returns:
    The total in bytes (int).
  """
  return sum(r.bytes for r in residuals if include_arguments or r.kind != "argument")


def scale_residuals(residuals: Iterable[Residual], factor: int) -> list[Residual]:
  """Scales a one-layer residual analysis to a stack of ``factor`` identical layers.

  Why: when layers are stacked with ``jax.lax.scan``, JAX reports every residual as ``output of scan`` with a
  leading layer axis, so checkpoint names are only visible when analysing one layer (the scan body). Scaling that
  analysis by the depth gives, residual by residual, what the scanned stack stores: each residual gains a leading
  axis of size ``factor`` (``shape = (factor, *shape)``, ``bytes *= factor``) and keeps its name, kind, primitive and
  source. For the body's arguments this models the stacked weights and the per-layer carry the scan saves.
  Summing the result matches ``total_residual_bytes`` of the scanned analysis (when the scan body's inputs are the
  layer's arguments).

  Args:
    residuals: residuals of one layer, e.g. ``saved_residuals(remat_block, x, layer_params)``.
    factor: number of layers (int >= 1).

  Returns:
    New ``Residual`` objects; ``description`` gets a ``" (x{factor} layers)"`` suffix.

  Raises:
    ValueError: if ``factor`` is not an int >= 1.
  """
  if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) or factor < 1:
    raise ValueError(f"scale_residuals factor must be an int >= 1 (the number of layers), got {factor!r}")
  factor = int(factor)
  return [dataclasses.replace(r, shape=(factor, *r.shape), bytes=r.bytes * factor,
                              description=f"{r.description} (x{factor} layers)")
          for r in residuals]


def recomputed_residuals(remat_eqn: Any) -> list[Residual]:
  """What one ``jax.checkpoint`` keeps for its own backward pass while the backward pass recomputes it.

  The checkpointed function (the equation's body jaxpr) is differentiated w.r.t. its float inputs (the values the
  outer level saved: a group's input activation, its layers' parameters); non-float inputs (PRNG keys, integers) are
  held fixed. Remats inside the body keep their policies, so for a group of remat'd blocks the result is what the
  blocks' policies save during the group's recomputation. Nothing is compiled or executed.

  Args:
    remat_eqn: a ``jax.checkpoint`` equation (primitive ``remat2``), e.g. from
      :func:`jaxckpt.analysis._jaxprs.outermost_remats` of a traced loss.

  Returns:
    ``Residual`` records as :func:`saved_residuals` gives them; the body's float inputs have kind ``"argument"``.

  Raises:
    ValueError: ``remat_eqn`` is not a ``jax.checkpoint`` equation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> from jaxckpt.analysis._jaxprs import outermost_remats
    >>> save_s = jax.checkpoint_policies.save_only_these_names("s")
    >>> block = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(jnp.sin(x), "s")), policy=save_s)
    >>> group = jax.checkpoint(lambda x: block(block(x)), policy=jax.checkpoint_policies.nothing_saveable)
    >>> (eqn,) = outermost_remats(jax.make_jaxpr(lambda x: group(x).sum())(jnp.ones(4)))
    >>> [(r.name, r.bytes) for r in recomputed_residuals(eqn) if r.kind != "argument"]  # [4] float32 each
    [('s', 16), (None, 16), ('s', 16)]
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.extend.core as jex_core  # pylint: disable=g-import-not-at-top

  body = remat_body(remat_eqn) if hasattr(remat_eqn, "primitive") and hasattr(remat_eqn, "params") else None
  if body is None or not is_remat(remat_eqn):
    raise ValueError(f"recomputed_residuals needs a jax.checkpoint equation (primitive remat2), got "
                     f"{getattr(getattr(remat_eqn, 'primitive', None), 'name', type(remat_eqn).__name__)!r}")
  closed = body if isinstance(body, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(body, ())
  fn = jex_core.jaxpr_as_fun(closed)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
  floats = [i for i, s in enumerate(structs) if jax.dtypes.issubdtype(s.dtype, np.inexact)]
  fixed = [i for i in range(len(structs)) if i not in set(floats)]
  found: list[Residual] = []

  def outer(*held):
    # The non-float inputs are tracers of this outer trace: the inner vjp sees them as constants, not as inputs.
    def of_floats(*values):
      args: list[Any] = [None] * len(structs)
      for i, v in zip(floats, values):
        args[i] = v
      for i, v in zip(fixed, held):
        args[i] = v
      return fn(*args)

    found.extend(saved_residuals(of_floats, *(structs[i] for i in floats)))
    return 0

  jax.make_jaxpr(outer)(*(structs[i] for i in fixed))
  return found
