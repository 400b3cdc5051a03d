"""Tensor plans: a ``tensor`` mesh axis for a model whose parameters carry no logical axis names, by layer path.

jaxckpt's LLM family names the axes of every parameter (``nnx.with_partitioning``) and one table,
:data:`jaxckpt.sharding.LOGICAL_RULES`, splits heads, the MLP width and the vocabulary over ``tensor``. A model
written as public Flax code writes models names none, so nothing of it could be split over ``tensor``. A tensor plan
names its layers by path and gives each a *style*, as PyTorch's ``parallelize_module`` plans do
(``torch.distributed.tensor.parallel``: ``{"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel()}``)
and as Megatron-LM splits a Transformer (Shoeybi et al. 2019, §3: a column-parallel layer, then a row-parallel one
that reads its split output, one all-reduce per pair in each pass):

- ``colwise``: the output dimension split over ``tensor``: an ``nnx.Linear`` kernel ``[in, out]`` by ``out``, its
  bias ``[out]`` with it; an ``nnx.Embed`` table ``[V, D]`` by ``D`` (PyTorch's ``ColwiseParallel`` on an
  ``nn.Embedding``).
- ``rowwise``: the input dimension split: a kernel by ``in``, its bias whole; an embedding table by ``V`` (the
  vocabulary-parallel embedding of Megatron-LM, PyTorch's ``RowwiseParallel`` on an ``nn.Embedding``).

**One reader of logical names.** A plan does not shard anything itself: when the model is built it writes logical
names onto the parameters it names, in Flax's ``out_sharding`` metadata, exactly as ``nnx.with_partitioning`` would
have (:data:`STYLES`: a colwise kernel gets ``("embed", "mlp")``, a rowwise one ``("mlp", "embed")``). Everything
downstream reads them through :func:`jaxckpt.sharding.param_logical_axes` as if you had written them: the state
shardings (``mlp``/``vocab`` over ``tensor``, ``embed`` over ``fsdp``), the parameters each block gathers (over
``fsdp`` only: the ``tensor`` split stays, so XLA inserts Megatron's all-reduces), the check that a ``tensor`` axis is
used (:func:`jaxckpt.step._compile.check_mesh_use`) and the fit's mesh search. Parameters the plan does not name keep the FSDP
rule. The plan also marks what it named (metadata ``tensor_plan``: the style), so a ``tensor`` size that does not
divide a planned dimension is an error at compile time (:func:`check_tensor_splits`) instead of a silent
replication.

**Stacked layers.** A layer stack made with ``nnx.vmap`` (run with ``nnx.scan``) holds each parameter once, with a
leading layer axis: ``nnx.Linear`` kernels ``[L, in, out]``, biases ``[L, out]``. A pattern names the stacked layer
as it names any other (``layers/self_attn/q_proj``: no index), and a style splits the same ``in`` or ``out``; the
leading axes get ``layers`` (never split: ``scan`` slices one layer per iteration). They are found by what the layer
declares, an ``nnx.Linear``'s ``in_features``/``out_features`` or an ``nnx.Embed``'s ``num_embeddings``/``features``
(a parameter with more dimensions than that has leading layer axes), or by a module's ``stacked_layers``
(:func:`jaxckpt.sharding.stacked_layer_paths`: jaxckpt's own ``Stack``).

**Patterns** (:data:`TENSOR_PLAN_GRAMMAR`) are glob patterns over paths as jaxckpt prints them, components joined by
``/`` (``layers/0/attn/q_proj``; list indices are numbers): ``*`` matches one component, ``**`` any number of them
(none too), ``?`` and ``[seq]`` as in :mod:`fnmatch`. A pattern names a *layer* (the module that holds the
parameters: ``layers/*/attn/q_proj`` covers its ``kernel`` and ``bias``) or one parameter
(``layers/*/attn/q_proj/kernel``). A pattern that matches nothing is an error naming it and listing the model's
layers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from flax import nnx

from jaxckpt.errors import MeshSpecError, TensorPlanError, closest, shorten
from jaxckpt.sharding._rules import LOGICAL_RULES, param_logical_axes
from jaxckpt.sharding._state import stacked_layer_paths

STYLES: dict[str, dict[str, tuple[str, ...]]] = {
    # [in, out] kernel, [V, D] embedding table, [out] bias -> the logical names the plan writes (the rule table's:
    # "embed" is split over fsdp; "mlp" and "vocab" over tensor).
    "colwise": {"kernel": ("embed", "mlp"), "embedding": ("embed", "mlp"), "bias": ("mlp",)},
    "rowwise": {"kernel": ("mlp", "embed"), "embedding": ("vocab", "embed"), "bias": ("embed",)},
}
"""Style -> kind of parameter -> the logical axis names a plan gives it. Kinds: ``embedding`` (a 2-D parameter named
``embedding``, ``nnx.Embed``'s ``[V, D]`` table), ``kernel`` (any other 2-D parameter, Flax's ``[in, out]``
layout), ``bias`` (a 1-D parameter). A parameter stacked on leading layer axes (an ``nnx.vmap`` stack, or a module
that declares ``stacked_layers``: module docstring) gets one ``layers`` in front per such axis."""

TENSOR_STYLES: tuple[str, ...] = tuple(STYLES)
"""The styles a plan may give a layer: ``colwise``, ``rowwise``."""

TENSOR_PLAN_GRAMMAR = ("'pattern=style[,pattern=style...]' or 'auto': pattern = a layer's or a parameter's "
                       "'/'-joined path (layers/*/attn/q_proj: * one component, ** any number, ? and [seq] as in "
                       "fnmatch), style = colwise (the output dimension split over tensor) or rowwise (the input "
                       "dimension)")
"""The grammar of ``tensor_plan=`` as text (also a ``--target-arg`` value a target function passes on): what the
docstrings and error messages say."""

STYLE_KEY = "tensor_plan"
"""The parameter metadata key a plan writes beside ``out_sharding``: the style it gave the parameter."""

_ENTRY = re.compile(r"\s*([^=,\s]+)\s*=\s*([^=,\s]*)\s*\Z")
_LISTED = 8  # layers an error lists


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """Which layers of a model are split over the ``tensor`` mesh axis, and how (module docstring).

  Attributes:
    rules: ``((pattern, style), ...)`` in order (a ``{pattern: style}`` mapping is accepted and kept in its order);
      ``pattern`` as :data:`TENSOR_PLAN_GRAMMAR`, ``style`` one of :data:`TENSOR_STYLES`.
    auto: the automatic plan (``rules`` empty): Megatron-LM's pairs in each block, resolved where the target's
      loss can be traced (:func:`jaxckpt.step.auto_tensor_plan`) into a plan with rules.

  Raises:
    TensorPlanError: an empty plan, a pattern with ``=``/``,``/spaces, an unknown style (the closest named), or
      ``auto`` with rules.

  Example::

    >>> plan = TensorPlan({"layers/*/attn/q_proj": "colwise", "layers/*/attn/o_proj": "rowwise"})
    >>> str(plan)
    'layers/*/attn/q_proj=colwise,layers/*/attn/o_proj=rowwise'
  """

  rules: tuple[tuple[str, str], ...] = ()
  auto: bool = False

  def __post_init__(self):
    rules = self.rules.items() if isinstance(self.rules, Mapping) else self.rules
    try:
      rules = tuple((str(pattern), str(style)) for pattern, style in rules)
    except (TypeError, ValueError):
      raise TensorPlanError(f"TensorPlan(rules={shorten(repr(self.rules))}) must be {{pattern: style}} or "
                            "((pattern, style), ...)") from None
    if self.auto and rules:
      raise TensorPlanError(f"TensorPlan(auto=True) takes no rules, got {len(rules)}: use one or the other")
    if not self.auto and not rules:
      raise TensorPlanError(f"tensor_plan is empty: write {TENSOR_PLAN_GRAMMAR}")
    for pattern, style in rules:
      if not pattern or re.search(r"[=,\s]", pattern):
        raise TensorPlanError(f"bad tensor_plan pattern {shorten(pattern)!r}: a path without '=', ',' or spaces; "
                              f"write {TENSOR_PLAN_GRAMMAR}")
      if style not in STYLES:
        hint = closest(style, TENSOR_STYLES)
        raise TensorPlanError(f"unknown tensor_plan style {shorten(style)!r} for {pattern!r}; valid styles: "
                              f"{', '.join(TENSOR_STYLES)}" + (f"; did you mean {hint!r}?" if hint else ""))
    object.__setattr__(self, "rules", rules)

  def __str__(self) -> str:
    """The plan in :data:`TENSOR_PLAN_GRAMMAR` (``parse_tensor_plan(str(plan)) == plan``)."""
    return "auto" if self.auto else ",".join(f"{pattern}={style}" for pattern, style in self.rules)

  def param_axes(self, model: nnx.Module) -> dict[str, PlannedParam]:
    """What the plan names in ``model``: parameter path -> :class:`PlannedParam`, in the model's order.

    Args:
      model: an NNX model (abstract from ``nnx.eval_shape`` is fine).

    Raises:
      TensorPlanError: an automatic plan not resolved yet; a pattern that matches no layer or parameter (some of
        the model's layers listed, the closest named); a parameter two patterns give different styles; a matched
        parameter that is neither 1-D nor 2-D (an ``nnx.Einsum`` kernel) or whose axes are named already.
    """
    if self.auto:
      raise TensorPlanError("tensor_plan='auto' is resolved where the model's loss can be traced: pass it to "
                            "nnx_model_target(..., tensor_plan='auto') or ModelTarget(..., tensor_plan='auto')")
    params = list(_params(model))
    stacked = stacked_layer_paths(model)
    modules = {tuple(str(p) for p in path): module for path, module in nnx.iter_modules(model)}
    out: dict[str, PlannedParam] = {}
    for pattern, style in self.rules:
      parts = pattern.split("/")
      hits = [(path, var) for path, var in params if _matches(parts, path[:-1]) or _matches(parts, path)]
      if not hits:
        raise _no_match(pattern, model, params)
      for path, var in hits:
        key = "/".join(path)
        if key in out and out[key].style != style:
          raise TensorPlanError(f"tensor_plan gives {key} two styles: {out[key].pattern!r}={out[key].style} and "
                                f"{pattern!r}={style}; give each layer one")
        declared = any(path[:len(p)] == p for p in stacked)
        out.setdefault(key, _planned(key, var, pattern, style, stacked=leading_layer_axes(modules.get(path[:-1]), path[-1],
                                                                                     var, declared=declared)))
    return out

  def apply(self, model: nnx.Module) -> nnx.Module:
    """Writes the plan's logical names onto ``model``'s parameters (``out_sharding`` metadata, as
    ``nnx.with_partitioning`` does, plus ``tensor_plan``: the style) in place, inside the function that builds the
    model (under ``nnx.eval_shape`` or ``jax.jit`` too).

    Returns:
      ``model`` itself.

    Raises:
      TensorPlanError: as :meth:`param_axes`.
    """
    for planned in self.param_axes(model).values():
      planned.variable.set_metadata("out_sharding", planned.names)
      planned.variable.set_metadata("eager_sharding", False)  # names, not mesh axes: never shard at creation
      planned.variable.set_metadata(STYLE_KEY, planned.style)
    return model


class PlannedParam(NamedTuple):
  """One parameter a :class:`TensorPlan` names."""

  path: str  # '/'-joined parameter path, e.g. "layers/0/attn/q_proj/kernel"
  variable: Any  # the nnx.Param
  pattern: str  # the plan's pattern that matched it
  style: str  # "colwise" or "rowwise"
  names: tuple[str, ...]  # the logical axis names written (STYLES; "layers" first per stacked layer axis)


def _params(model: nnx.Module) -> Iterator[tuple[tuple[str, ...], Any]]:
  """``(path as strings, nnx.Param)`` of every parameter of ``model`` (a shared one once, at its first path)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      yield tuple(str(p) for p in path), node


def _matches(parts: list[str], path: tuple[str, ...]) -> bool:
  """Whether glob components ``parts`` (``**``: any number of components) match ``path``."""
  if not parts:
    return not path
  if parts[0] == "**":
    return any(_matches(parts[1:], path[i:]) for i in range(len(path) + 1))
  return bool(path) and fnmatch.fnmatchcase(path[0], parts[0]) and _matches(parts[1:], path[1:])


def generalize_path(path: str) -> str:
  """``"layers/3/attn/q_proj"`` -> ``"layers/*/attn/q_proj"``: list indices as ``*``, so one pattern names the
  layer in every block."""
  return "/".join("*" if part.isdigit() else part for part in path.split("/"))


def _no_match(pattern: str, model: nnx.Module, params: list[tuple[tuple[str, ...], Any]]) -> TensorPlanError:
  layers = list(dict.fromkeys(generalize_path("/".join(path[:-1])) for path, _ in params if len(path) > 1))
  listed = ", ".join(layers[:_LISTED]) + (f", ... ({len(layers)} in all)" if len(layers) > _LISTED else "")
  hint = closest(pattern, layers)
  return TensorPlanError(f"tensor_plan pattern {shorten(pattern)!r} matches no layer or parameter of "
                         f"{type(model).__name__}; its layers: {listed or '(none)'}"
                         + (f"; did you mean {hint!r}?" if hint else ""))


def _unstacked_shape(module: Any, name: str) -> tuple[int, ...] | None:
  """The shape a standard Flax layer declares for its parameter ``name`` (one layer, not a stack), else ``None``."""
  if isinstance(module, nnx.Linear):
    return {"kernel": (module.in_features, module.out_features), "bias": (module.out_features,)}.get(name)
  if isinstance(module, nnx.Embed) and name == "embedding":
    return (module.num_embeddings, module.features)
  return None


def leading_layer_axes(module: Any, name: str, var: Any, *, declared: bool = False) -> int:
  """How many leading layer axes parameter ``name`` (an ``nnx.Param``, ``var``) of ``module`` has: 1 where a module
  declares its stack (``declared``), else what an ``nnx.Linear``/``nnx.Embed`` holds beyond the shape it declares
  (module docstring: stacked layers), else 0."""
  if declared:
    return 1
  shape, own = tuple(var.get_value().shape), _unstacked_shape(module, name)
  if own is None or len(shape) <= len(own) or shape[len(shape) - len(own):] != own:
    return 0
  return len(shape) - len(own)


def _planned(key: str, var: Any, pattern: str, style: str, *, stacked: int) -> PlannedParam:
  shape = tuple(var.get_value().shape)
  rank = len(shape) - stacked
  kind = {1: "bias", 2: "embedding" if key.rsplit("/", 1)[-1] == "embedding" else "kernel"}.get(rank)
  if kind is None:
    raise TensorPlanError(f"tensor_plan pattern {pattern!r} ({style}) matches {key} of shape {shape}; a style "
                          "splits 2-D kernels [in, out] (stacked by nnx.vmap: [L, in, out]) and embedding tables "
                          "[V, D] and their 1-D biases: name the axes of other parameters (an nnx.Einsum or "
                          "nnx.LinearGeneral kernel) with nnx.with_partitioning")
  if param_logical_axes(var) is not None and var.get_metadata().get(STYLE_KEY) != style:
    raise TensorPlanError(f"tensor_plan pattern {pattern!r} matches {key}, whose axes are named already "
                          f"({param_logical_axes(var)}, nnx.with_partitioning): leave it out of the plan")
  names = STYLES[style][kind]
  return PlannedParam(key, var, pattern, style, ("layers",) * stacked + names)


def parse_tensor_plan(spec: "str | Mapping[str, str] | TensorPlan | None") -> TensorPlan | None:
  """The one parser of ``tensor_plan=``: text (:data:`TENSOR_PLAN_GRAMMAR`), ``{pattern: style}``, a
  :class:`TensorPlan` (returned as it is) or ``None`` (no plan).

  Raises:
    TensorPlanError: a malformed entry, an unknown style, an empty plan, or another type — one line naming the bad
      value and the grammar.

  Example::

    >>> parse_tensor_plan("layers/*/mlp/up_proj=colwise, layers/*/mlp/down_proj=rowwise").rules
    (('layers/*/mlp/up_proj', 'colwise'), ('layers/*/mlp/down_proj', 'rowwise'))
  """
  if spec is None or isinstance(spec, TensorPlan):
    return spec
  if isinstance(spec, Mapping):
    return TensorPlan(tuple(spec.items()))
  if not isinstance(spec, str):
    raise TensorPlanError(f"tensor_plan={shorten(repr(spec))} must be text, {{pattern: style}} or a TensorPlan: "
                          f"write {TENSOR_PLAN_GRAMMAR}")
  if spec.strip() == "auto":
    return TensorPlan(auto=True)
  if not spec.strip():
    return TensorPlan(())
  rules = []
  for entry in spec.split(","):
    match = _ENTRY.match(entry)
    if match is None:
      raise TensorPlanError(f"bad tensor_plan entry {shorten(entry.strip())!r} in tensor_plan={shorten(spec)!r}: "
                            f"write {TENSOR_PLAN_GRAMMAR}")
    rules.append(match.groups())
  return TensorPlan(tuple(rules))


def planned_params(model: nnx.Module) -> Iterator[tuple[str, str, tuple[int, ...], tuple[str, ...]]]:
  """``(parameter path, style, shape, logical names)`` of every parameter of ``model`` a plan named (metadata
  ``tensor_plan``), e.g. to print what a plan did."""
  for path, var in _params(model):
    style = var.get_metadata().get(STYLE_KEY)
    if style is not None:
      yield "/".join(path), style, tuple(var.get_value().shape), param_logical_axes(var) or ()


def tensor_split_sizes(model: nnx.Module) -> list[tuple[str, int]]:
  """``(parameter path, size)`` of every dimension a plan splits over ``tensor`` (a colwise kernel's ``out``, a
  rowwise one's ``in``...): a ``tensor`` size must divide each (:func:`check_tensor_splits`; the fit's mesh search
  enumerates only such sizes)."""
  return [(path, shape[i]) for path, _, shape, names in planned_params(model)
          for i, name in enumerate(names) if "tensor" in LOGICAL_RULES.get(name, ())]


def check_tensor_splits(model: nnx.Module, mesh_shape: Mapping[str, int]) -> None:
  """Refuses a ``tensor`` size that does not divide a dimension the model's plan splits (the rule table would leave
  it whole, replicated on every tensor rank, against the plan).

  Args:
    model: the model, built with its plan (abstract is fine).
    mesh_shape: ``{mesh axis: size}``.

  Raises:
    MeshSpecError: one line naming the parameter, its dimension, the ``tensor`` size and the fix.
  """
  tensor = mesh_shape.get("tensor", 1)
  if tensor <= 1:
    return
  bad = [(path, size) for path, size in tensor_split_sizes(model) if size % tensor]
  if bad:
    path, size = bad[0]
    fits = [t for t in range(2, tensor) if math.gcd(*(s for _, s in tensor_split_sizes(model))) % t == 0]
    raise MeshSpecError(f"mesh axis tensor={tensor} does not divide dimension {size} of {path}, which tensor_plan "
                        f"splits over it ({len(bad)} parameter(s) so): use a tensor size that divides every planned "
                        f"dimension ({', '.join(map(str, fits)) or 'none below ' + str(tensor)}), or leave "
                        f"{generalize_path(path.rsplit('/', 1)[0])} out of the plan")
