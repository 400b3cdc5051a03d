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

Only array leaves of a layer's output are tagged (RNG keys and Python values are left alone). Names the model tags
itself are kept (the automatic tag wraps the layer's output only). A layer that lies inside a nested matched block
is named by that inner block (relative to it), not by the outer one. NNX decides which layers are named when
``apply_remat`` runs (on the blocks as they are then, so ``block_types`` lists them without tracing; in a block
stacked with ``nnx.vmap`` every variable carries a leading layer axis, which is not counted, :func:`layer_axes`);
Linen decides at each call (its listing traces ``init``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.errors import JaxckptError

__all__ = ["NNX_LAYERS", "LINEN_LAYERS", "AUTO", "ALL", "NameRule", "names_rule", "auto_named", "layer_axes",
           "path_name", "tag_output"]

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
