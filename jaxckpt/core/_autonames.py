"""Automatic checkpoint names for models that never call ``checkpoint_name``.

Inside a block matched by :func:`jaxckpt.apply_remat` (NNX) or :func:`jaxckpt.linen.apply_remat` (Linen), the
output of each *named layer* is tagged with ``jax.ad_checkpoint.checkpoint_name`` under the layer's attribute path
relative to the block, joined by ``.`` (:func:`path_name`): in a decoder layer with ``self.attn.q_einsum`` and
``self.mlp.up_proj`` the names are ``attn.q_einsum`` and ``mlp.up_proj``; in a GPT-2 block with its own ``Conv1D``
projections they are ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``. So
``save_only_these_names:attn.c_attn+mlp.c_fc`` works on the model as it was written.

Which layers are named, the ``names=`` argument of both ``apply_remat`` s (:func:`names_rule`):

- ``"auto"`` (default): the standard Flax layers (:data:`NNX_LAYERS`, :data:`LINEN_LAYERS`), and every module of a
  class *not from Flax* that holds a weight itself — a parameter with ≥ 2 dimensions created by the module, not by
  a submodule (``self.weight = nnx.Param(...)`` in NNX, ``self.param("weight", init, (nin, nout))`` in Linen). That
  is the projections and convolutions of ported code (GPT-2's ``Conv1D``, a hand-written dense layer), and not
  norms (a rank-1 scale), dropout, activations or modules that only hold submodules (``attn``, ``mlp``), so each
  matmul output gets one name and the planner's candidate list stays short. Flax's own other classes
  (``LayerNorm``, ``Dropout``, ``Embed``) are not named.
- ``"all"``: every submodule called through ``__call__`` whose output holds arrays, nested ones too (``attn`` and
  ``attn.c_attn``; a value may then carry two names, and saving either saves it).
- a module class or a tuple of classes: exactly the instances of these (``names=(Conv1D, nnx.LayerNorm)``);
  ``()`` names nothing.
- a predicate ``(path, module) -> bool``: exactly the submodules it accepts; ``path`` is relative to the block
  (``("attn", "c_attn")``; NNX list indices are ints). Extend the default with
  ``names=lambda path, m: jaxckpt.core._autonames.auto_named(path, m) or isinstance(m, MyNorm)``.

**Names below one scope** (:func:`tag_parts`). A named layer whose own code runs several projections -- matmuls
(``dot_general``, grouped ``ragged_dot_general``) or convolutions between something computed from its inputs and
something that is not (a weight) --
covers several tensors with one name, e.g. a GeGLU MLP that keeps its gate and up projections in one scope, one
``einsum`` each on one stacked ``(2, d, f)`` parameter. Its projections are named ``<layer>.<k>``, ``k`` counting
them in the order the layer's code runs them from 0: ``mlp.0`` (gate), ``mlp.1`` (up); the one whose result is the
layer's output (``down``) keeps the layer's name alone (``mlp``), so it gets none. Order is what tells such parts
apart: both einsums there read ``btd,df->btf`` and slice one parameter, so neither the equation's operands nor the
parameter's name would. Projections inside a named layer within it are that layer's; a layer with one projection
(``nn.Dense``, GPT-2's ``Conv1D``) has no parts. Parts are found by tracing the block: ``block_types`` of a Linen
model lists them; on NNX, :func:`jaxckpt.checkpoint_names` (or a target's listing, ``jaxckpt-report --list-blocks``)
learns them, and ``set_policy`` takes them afterwards.

Only array leaves of a layer's output are tagged (RNG keys and Python values are left alone). Names the model tags
itself are kept (the automatic tag wraps the layer's output only). A layer that lies inside a nested matched block
is named by that inner block (relative to it), not by the outer one. NNX decides which layers are named when
``apply_remat`` runs (on the blocks as they are then, so ``block_types`` lists them without tracing; in a block
stacked with ``nnx.vmap`` every variable carries a leading layer axis, which is not counted, :func:`layer_axes`);
Linen decides at each call (its listing traces ``init``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.analysis._jaxprs import checkpoint_name_of
from jaxckpt.core._tagging import evaluate_tagged, walk_values
from jaxckpt.errors import JaxckptError, PolicySpecError

NNX_LAYERS: tuple[type, ...] = tuple(
    cls for cls in (
        getattr(nnx, "Linear", None), getattr(nnx, "LinearGeneral", None), getattr(nnx, "Einsum", None),
        getattr(nnx, "Conv", None), getattr(nnx, "ConvTranspose", None), getattr(nnx, "MultiHeadAttention", None),
    ) if cls is not None)
"""NNX layers whose outputs get an automatic checkpoint name inside a matched block."""

LINEN_LAYERS: tuple[type, ...] = tuple(
    cls for cls in (
        getattr(nn, "Dense", None), getattr(nn, "DenseGeneral", None), getattr(nn, "Einsum", None),
        getattr(nn, "Conv", None), getattr(nn, "ConvTranspose", None),
        getattr(nn, "MultiHeadDotProductAttention", None),
    ) if cls is not None)
"""Linen layers whose outputs get an automatic checkpoint name inside a matched block."""

AUTO = "auto"
"""``names=`` default: standard Flax layers and modules of your own that hold a weight (see the module docstring)."""
ALL = "all"
"""``names=``: every submodule whose output holds arrays."""


def path_name(path: Sequence[object]) -> str:
  """The checkpoint name of a layer at ``path`` (attribute names / list indices) relative to its block.

  Args:
    path: e.g. ``("attn", "q_einsum")`` or ``("mlps", 0)``.

  Returns:
    ``"attn.q_einsum"``, ``"mlps.0"``; characters outside ``[A-Za-z0-9_.-]`` become ``_``.
  """
  text = ".".join(str(p) for p in path)
  return "".join(c if c.isalnum() or c in "_.-" else "_" for c in text)


def _is_flax_class(cls: type) -> bool:
  return cls.__module__.split(".")[0] == "flax"


def _rank(value: Any) -> int:
  value = nn.meta.unbox(value) if isinstance(value, nn.meta.AxisMetadata) else value
  return len(getattr(value, "shape", ()))


def _holds_weight(module: Any, layer_axes: int = 0) -> bool:
  """Whether ``module`` itself (not a submodule) holds a parameter with ≥ 2 dimensions (not counting
  ``layer_axes`` leading stacking axes).

  NNX: an ``nnx.Param`` attribute. Linen (bound, after its call): a leaf of its own ``params`` collection.
  """
  if isinstance(module, nnx.Module):
    return any(isinstance(v, nnx.Param) and _rank(v.get_value() if hasattr(v, "get_value") else v.value)
               - layer_axes >= 2 for v in vars(module).values())
  if isinstance(module, nn.Module) and module.scope is not None:
    params = module.variables.get("params", {})
    return any(not isinstance(v, Mapping) and _rank(v) - layer_axes >= 2 for v in params.values())
  return False


def layer_axes(variables: Sequence[Any]) -> int:
  """1 if the variables of a block (arrays or ``jax.ShapeDtypeStruct`` s) look stacked on a leading layer axis (an
  NNX block made with ``nnx.vmap``, called in ``nnx.scan``), else 0.

  Stacked: every variable has a leading axis of one size ``n``, and either a stacked RNG key or counter is among
  them (not floating, shape ``(n,)``) or no other axis has size ``n`` (so an unstacked block of square ``[D, D]``
  weights and ``[D]`` biases is not stacked). A block with fewer than two variables is never taken as stacked.
  """
  shapes = [tuple(getattr(v, "shape", ())) for v in variables]
  if len(shapes) < 2 or any(not s for s in shapes):
    return 0
  n = shapes[0][0]
  if any(s[0] != n for s in shapes):
    return 0
  rng = any(s == (n,) and not jax.dtypes.issubdtype(v.dtype, jax.numpy.inexact) for s, v in zip(shapes, variables))
  return int(rng or all(n not in s[1:] for s in shapes))


def auto_named(path: tuple, module: Any, *, layer_axes: int = 0) -> bool:
  """The default rule (``names="auto"``): ``module`` is a standard Flax layer (:data:`NNX_LAYERS`,
  :data:`LINEN_LAYERS`), or of a class not from Flax that holds a parameter with ≥ 2 dimensions itself.

  Args:
    path: the module's path relative to its block (unused; there so the rule composes with predicates).
    module: an NNX module, or a bound Linen module after its call (its parameters exist then, in ``init`` too).
    layer_axes: leading stacking axes of the block's parameters, not counted (:func:`layer_axes`).
  """
  del path
  if isinstance(module, NNX_LAYERS + LINEN_LAYERS):
    return True
  return not _is_flax_class(type(module)) and _holds_weight(module, layer_axes)


@dataclasses.dataclass(frozen=True)
class NameRule:
  """Which submodules of a block get automatic checkpoint names: a checked ``names=`` value (:func:`names_rule`).

  Hashable (an NNX block keeps the paths it names as static data; a Linen run keeps the rule).

  Attributes:
    kind: ``"auto"``, ``"all"``, ``"classes"`` or ``"predicate"``.
    classes: the classes of ``"classes"``.
    predicate: the user's predicate of ``"predicate"``.
  """

  kind: str
  classes: tuple[type, ...] = ()
  predicate: Callable[[tuple, Any], bool] | None = None

  def __call__(self, path: tuple, module: Any, *, layer_axes: int = 0) -> bool:
    """Whether the submodule ``module`` at ``path`` (relative to its block) is named; ``layer_axes``: see
    :func:`auto_named`."""
    if self.kind == AUTO:
      return auto_named(path, module, layer_axes=layer_axes)
    if self.kind == ALL:
      return True
    if self.kind == "classes":
      return isinstance(module, self.classes)
    return bool(self.predicate(path, module))

  def __str__(self) -> str:
    if self.kind == "classes":
      return "(" + ", ".join(c.__name__ for c in self.classes) + ")"
    if self.kind == "predicate":
      return getattr(self.predicate, "__name__", repr(self.predicate))
    return repr(self.kind)


def names_rule(names: Any, *, front_end: str = "nnx") -> NameRule:
  """Checks a ``names=`` argument of ``apply_remat`` and returns its :class:`NameRule`.

  Args:
    names: ``None`` or ``"auto"`` (default rule), ``"all"``, a module class of the front-end, a tuple of them, or a
      predicate ``(path, module) -> bool`` (``path`` relative to the block).
    front_end: ``"nnx"`` or ``"linen"`` (which module classes are valid).

  Returns:
    The rule.

  Raises:
    JaxckptError: any other value (another string, a list, a class that is not a module of the front-end, a
      callable that cannot take ``(path, module)``); one line naming the value and the valid forms.
  """
  base, other = (nnx.Module, nn.Module) if front_end == "nnx" else (nn.Module, nnx.Module)
  name, other_name = ("NNX", "Linen") if front_end == "nnx" else ("Linen", "NNX")
  forms = (f"give 'auto' (default), 'all', {'an' if name == 'NNX' else 'a'} {name} module class, a tuple of them, "
           "or a predicate (path, module) -> bool")
  shown = _show(names)
  if names is None or names == AUTO:
    return NameRule(AUTO)
  if isinstance(names, NameRule):  # an applied model's own rule, passed on
    return names
  if isinstance(names, str):
    if names == ALL:
      return NameRule(ALL)
    raise JaxckptError(f"names={shown} is not a names rule: {forms}")
  if isinstance(names, list):
    raise JaxckptError(f"names={shown} is a list: {forms} (a tuple, not a list)")
  classes = names if isinstance(names, tuple) else (names,) if isinstance(names, type) else None
  if classes is not None:
    for cls in classes:
      what = f"names={shown}" if cls is names else f"names={shown} holds {getattr(cls, '__name__', repr(cls))}, which"
      if not isinstance(cls, type):
        raise JaxckptError(f"{what} is not a class: {forms}")
      if issubclass(cls, other):
        raise JaxckptError(f"{what} is a Flax {other_name} module class, and this model is {name}: {forms}")
      if not issubclass(cls, base):
        raise JaxckptError(f"{what} is not {'an' if name == 'NNX' else 'a'} {name} module class: {forms}")
    return NameRule("classes", classes=classes)
  if callable(names):
    try:
      inspect.signature(names).bind(("path",), None)
    except (TypeError, ValueError):
      raise JaxckptError(f"names={shown} cannot take (path, module): {forms}") from None
    return NameRule("predicate", predicate=names)
  raise JaxckptError(f"names={shown} is not a names rule: {forms}")


def _show(value: Any) -> str:
  """A ``names=`` value as written: a class name, ``(A, B)``, a function's name, else ``repr``."""
  if isinstance(value, type):
    return value.__name__
  if isinstance(value, (tuple, list)):
    text = ", ".join(v.__name__ if isinstance(v, type) else repr(v) for v in value)
    return f"[{text}]" if isinstance(value, list) else f"({text},)" if len(value) == 1 else f"({text})"
  if callable(value) and hasattr(value, "__name__"):
    return value.__name__
  return repr(value)


def _taggable(value: Any) -> bool:
  return isinstance(value, jax.Array) and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended)


def tag_output(out: Any, name: str) -> tuple[Any, bool]:
  """Tags every array leaf of a layer's output ``out`` with ``checkpoint_name(leaf, name)``.

  Returns:
    ``(tagged output, whether any leaf was tagged)``; RNG keys and non-array leaves are left unchanged.
  """
  tagged = False

  def tag(value: Any) -> Any:
    nonlocal tagged
    if not _taggable(value):
      return value
    tagged = True
    return checkpoint_name(value, name)

  return jax.tree.map(tag, out), tagged



# ------------------------------------------------------------------------------------------- names below one scope

PROJECTIONS: tuple[str, ...] = ("dot_general", "ragged_dot_general", "conv_general_dilated")
"""Primitives that are a layer's projections when one operand comes from its inputs and another does not
(``ragged_dot_general``: the grouped matmuls of a dropless Mixture of Experts, ``jax.lax.ragged_dot``, whose group
sizes come from the inputs and whose experts' weights do not)."""

_PART_NAME = re.compile(r".+\.[0-9]+\Z")
_ENTER = "jaxckpt.part-enter:"
_EXIT = "jaxckpt.part-exit:"
"""Prefixes of the markers a trace under :func:`tag_parts` leaves around layer calls (never in a compiled step)."""

_MARKING: contextvars.ContextVar[Iterator[int] | None] = contextvars.ContextVar("jaxckpt_part_marks", default=None)


def names_parts(names: Collection[str]) -> bool:
  """Whether any of ``names`` (a policy's checkpoint names) has the form of a part, ``<layer>.<k>``."""
  return any(_PART_NAME.match(name) for name in names)


def _array_leaves(tree: Any) -> list[jax.Array]:
  """The arrays among a call's arguments (modules passed along are not looked into)."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (nnx.Module, nn.Module)))
  return [leaf for leaf in leaves if _taggable(leaf)]


def mark_layer_call(inputs: Any) -> int | None:
  """Marks the start of a layer call while :func:`tag_parts` traces a block (a no-op otherwise).

  Args:
    inputs: the call's arguments (any pytree); its array leaves are what the layer's projections are computed from.

  Returns:
    The call's number for :func:`mark_layer_return`, or ``None`` (not tracing for parts, or no array input).
  """
  calls = _MARKING.get()
  if calls is None:
    return None
  leaves = _array_leaves(inputs)
  if not leaves:
    return None
  call = next(calls)
  for leaf in leaves:
    checkpoint_name(leaf, f"{_ENTER}{call}")
  return call


def mark_layer_return(call: int | None, inputs: Any, name: str | None) -> None:
  """Marks the end of a layer call started by :func:`mark_layer_call`.

  Args:
    call: what :func:`mark_layer_call` returned (``None``: nothing to mark).
    inputs: the same arguments.
    name: the layer's checkpoint name, or ``None`` for a layer that is not named (its projections count for the
      named layer around it).
  """
  if call is not None and _MARKING.get() is not None:
    checkpoint_name(_array_leaves(inputs)[0], f"{_EXIT}{call}:{name or ''}")


@contextlib.contextmanager
def outside_parts() -> Iterator[None]:
  """Within: layer calls leave no markers (a block called inside a block being traced for parts: a nested block
  names its own layers)."""
  token = _MARKING.set(None)
  try:
    yield
  finally:
    _MARKING.reset(token)


@dataclasses.dataclass
class _Frame:
  """A layer call being read from the jaxpr.

  Attributes:
    call: its number (:func:`mark_layer_call`).
    reach: value numbers computed from its inputs (its inputs included).
    projections: value numbers of its projections, in program order.
    named: ``(value number, checkpoint name)`` of the values named within it.
  """

  call: str
  reach: set[int] = dataclasses.field(default_factory=set)
  projections: list[int] = dataclasses.field(default_factory=list)
  named: list[tuple[int, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Parts:
  """What :func:`part_names` read from a block's jaxpr."""

  tags: dict[int, str]  # value number -> part name
  markers: frozenset[int]  # value numbers of the markers (dropped when the jaxpr is evaluated again)
  layers: dict[str, tuple[str, ...]]  # named layer -> its part names (empty: fewer than two projections)
  emitted: frozenset[str]  # every checkpoint name the jaxpr emits (the model's own included)


def part_names(closed: Any) -> _Parts:
  """The parts of the named layers in a block's jaxpr traced under :func:`tag_parts` (see the module docstring).

  A layer call is the stretch between its markers; a projection is a :data:`PROJECTIONS` equation of that stretch,
  outside any named layer called within it, with one operand that depends on the call's inputs and one that does
  not.

  Args:
    closed: the closed jaxpr.

  Returns:
    The value numbers (:func:`jaxckpt.core._tagging.walk_values`) to tag, the markers, each named layer's parts.
  """
  values = walk_values(closed)
  frames: list[_Frame] = []  # the layer calls open at this point of the program, innermost last
  tags: dict[int, str] = {}
  markers: set[int] = set()
  layers: dict[str, tuple[str, ...]] = {}
  emitted: set[str] = set()
  for value in values:
    label = checkpoint_name_of(value.eqn)
    if label is not None and label.startswith(_ENTER):
      markers.add(value.index)
      call = label[len(_ENTER):]
      if not frames or frames[-1].call != call:  # one marker per array input, in a row
        frames.append(_Frame(call))
      frames[-1].reach.update(value.inputs)
      continue
    if label is not None and label.startswith(_EXIT):
      markers.add(value.index)
      frame = frames.pop()
      name = label[len(_EXIT):].partition(":")[2]
      if not name:  # a layer without a name: its projections are the named layer's around it
        if frames:
          frames[-1].projections.extend(frame.projections)
        continue
      own_outputs = {i for i, n in frame.named if n == name}
      parts = [] if len(frame.projections) < 2 else [
          (v, f"{name}.{k}") for k, v in enumerate(frame.projections) if v not in own_outputs]
      tags.update(parts)
      layers[name] = tuple(sorted(set(layers.get(name, ())) | {n for _, n in parts}))
      continue
    if label is not None:
      emitted.add(label)
      if frames:
        frames[-1].named.extend((i, label) for i in value.inputs)
    for frame in frames:
      if any(i in frame.reach for i in value.inputs):
        frame.reach.add(value.index)
    if frames and value.primitive in PROJECTIONS and value.taggable:
      from_inputs = [i in frames[-1].reach for i in value.inputs]
      missing = len(value.eqn.invars) - len(value.inputs)  # literals and constants: not from the inputs
      if any(from_inputs) and (missing or not all(from_inputs)):
        frames[-1].projections.append(value.index)
  return _Parts(tags, frozenset(markers), layers, frozenset(emitted))


def _check_wanted(found: _Parts, wanted: Collection[str], spec: str) -> None:
  """Raises for a part-like name of a named layer of this block that is not one of its parts (nor a name the model
  emits itself): a policy that would save nothing it was meant to."""
  for name in sorted(wanted):
    layer, _, index = name.rpartition(".")
    if not _PART_NAME.match(name) or layer not in found.layers or name in found.emitted or name in found.tags.values():
      continue
    parts = found.layers[layer]
    have = (f"its parts are {', '.join(parts)}" if parts else
            f"it has no parts (fewer than two projections): save {layer!r} itself")
    raise PolicySpecError(f"checkpoint name {name!r} names no part of layer {layer!r}: {have}", spec=spec,
                          bad=name, valid=parts)


def tag_parts(fn: Callable[..., Any], wanted: Collection[str] = (), *, spec: str = "") -> Callable[..., Any]:
  """``fn`` (a block's pure function) with the parts of its named layers tagged ``<layer>.<k>`` (module docstring).

  Traces ``fn`` once with markers around every layer call (:func:`mark_layer_call`, made by both front-ends' named
  layers), reads the parts from the jaxpr (:func:`part_names`) and evaluates it again with the parts wrapped in
  ``checkpoint_name`` and the markers dropped (:func:`jaxckpt.core._tagging.evaluate_tagged`), so a name policy
  saves them as it saves any checkpoint name. Nothing else changes: the values, and the gradients, are ``fn``'s.

  Args:
    fn: a function of positional pytrees of arrays, e.g. the function a block's ``jax.checkpoint`` wraps.
    wanted: the checkpoint names the block's policy saves, checked against the parts found.
    spec: that policy as text, for the message.

  Returns:
    The tagged function, same signature and outputs.

  Raises:
    PolicySpecError: (when called) a name in ``wanted`` of the form ``<layer>.<k>`` for a named layer of the block
      that has no such part (the message lists its parts).
  """

  def tagged(*args):
    flat, in_tree = jax.tree.flatten(args)
    token = _MARKING.set(itertools.count())
    try:
      closed, out_shape = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(in_tree, leaves)),
                                         return_shape=True)(*flat)
    finally:
      _MARKING.reset(token)
    found = part_names(closed)
    _check_wanted(found, wanted, spec)
    outs = evaluate_tagged(closed, flat, found.tags, identity=found.markers)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return tagged
