"""Remat for your own Flax Linen model, unedited: name the block classes, keep the parameter tree.

:func:`apply_remat` returns a :class:`RematModule` that you ``init`` / ``apply`` exactly like the module: while it
runs, ``flax.linen.intercept_methods`` intercepts the ``__call__`` of every module matched by ``blocks`` and runs it
through the lifted ``nn.checkpoint`` (a function taking the module, so variables and RNG streams are lifted and the
recomputation draws the forward pass's dropout masks) with the policy of its block type. Nothing is renamed or
re-nested: the parameter tree is the module's own, so existing checkpoints load.

- Array arguments go through the checkpoint; everything else (``deterministic=True``, ``train=False``, ``None``) is
  closed over as a static Python value.
- Inside a remat'd block the outputs of its layers are tagged with checkpoint names from their module path relative
  to the block (``MlpBlock_0.Dense_1``, ``attention.query``, ``attn.c_attn``), so ``save_only_these_names:…``
  works; :func:`block_types` lists them. ``names=`` chooses which layers (:mod:`jaxckpt.core._autonames`; default:
  the standard Linen layers :data:`~jaxckpt.core._autonames.LINEN_LAYERS` and modules of your own classes that hold
  a weight themselves, such as GPT-2's ``Conv1D``), decided at each call once the layer's parameters exist. A named
  layer that runs several projections in its own code (a GeGLU MLP's gate and up einsums) also names them,
  ``mlp.0``, ``mlp.1`` (its parts: :mod:`jaxckpt.core._autonames`), when the block is listed or a policy names one.
- Only ``__call__`` of a matched module is remat'd (call a block through another method and it runs as written).
- **Jits inside the model** (``@nn.jit`` on the model's or a block's ``__call__``, ``nn.jit(Block)``): while a
  :class:`RematModule` runs, its module, policy, blocks, ``names=`` and layers are part of every ``jax.jit`` cache
  key (``jax.make_user_context``), so such a jit traces once per policy and reuses a trace only for the same policy.
  A cache that does not key on JAX's trace context (one of your own, a compiled function kept from before) reuses a
  trace made under another policy: that is an error naming the wrapper (``Transformer.__call__ is wrapped in
  nn.jit``), never a silent success.
- **Layers** (per-layer policies, :class:`~jaxckpt.policies.LayeredPolicy`): the matched blocks are grouped by their
  scope path, as NNX groups ``layers[i]``: the layer axis is the shallowest path position where the blocks' names
  end in an integer that varies under one parent and prefix (``h_0``, ``h_1`` … from a list attribute
  ``self.h = [Block(...) ...]``; ``DecoderBlock_0`` … or ``layers_0`` … from a loop in ``nn.compact``; ``0``, ``1`` …
  from ``name=str(i)``); layer i is every block under the i-th such name, in integer order (:func:`group_layers`).
  Blocks not under one (a head) use the first range's spec. Blocks inside an ``nn.scan`` stack are one call, so a
  scanned model has no layers: one spec per block type.

Idea: Flax's ``nn.remat`` / ``nn.checkpoint`` lifted transform and ``nn.intercept_methods``; swapping a block class
for ``nn.remat(cls, policy=…)`` gives the same parameters and gradients, but needs the model's code edited.

Example::

  >>> model = jaxckpt.linen.apply_remat(TransformerLM(cfg), "dots_saveable", blocks={"layer": DecoderBlock})
  >>> variables = model.init(jax.random.key(0), tokens)                    # same tree as TransformerLM(cfg).init
  >>> logits = model.apply(variables, tokens, deterministic=False, rngs={"dropout": key})
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import lift as flax_lift
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.core._matching import block_matcher, block_matchers
from jaxckpt.core._arguments import split_arguments
from jaxckpt.core._autonames import (NameRule, mark_layer_call, mark_layer_return, names_parts, names_rule,
                                    outside_parts, path_name, tag_output, tag_parts)
from jaxckpt.core._tagging import recording, tag_values
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.analysis._jaxprs import checkpoint_name_of, sub_jaxprs
from jaxckpt.policies._spec import DEFAULT_BLOCK, SAVE_TENSORS, Policy, PolicySpec
from jaxckpt.policies._model import LayeredPolicy, parse_model_policy


@dataclasses.dataclass
class _Run:
  """State of one ``init``/``apply`` of a :class:`RematModule` (one trace)."""

  spec: PolicySpec | LayeredPolicy
  matchers: tuple[tuple[str, Callable[[tuple, nn.Module], bool]], ...]
  layers: tuple[tuple[str, ...], ...] = ()  # layer keys (scope path prefixes) for a LayeredPolicy, in layer order
  skip_next: bool = False  # the next intercepted __call__ is the block's own call, inside its checkpoint
  active_type: str = ""  # the block type of that call
  active: list[tuple[str, tuple]] = dataclasses.field(default_factory=list)  # (block type, path) of running blocks
  matched: dict[str, int] = dataclasses.field(default_factory=dict)  # block type -> calls
  record: dict[str, set[str]] | None = None  # block type -> names emitted (when listing names)
  names: NameRule = NameRule("auto")  # which layers inside a block get automatic names (apply_remat's names=)
  paths: list[tuple] = dataclasses.field(default_factory=list)  # scope path of every matched call, in call order
  classes: set[type] = dataclasses.field(default_factory=set)  # classes of the matched modules
  layers_seen: set[int] = dataclasses.field(default_factory=set)  # layers (of a LayeredPolicy) whose blocks ran

  def policy_for(self, block_type: str, path: tuple) -> Policy:
    """The policy of a matched block: its layer's spec (layered policies), then its block type's policy."""
    spec, layered = self.spec, self.spec.layered
    if layered is not None:
      layer = _layer_index(self.layers, path)
      spec = layered.base_spec if layer is None else layered.layer_specs()[layer]
    return spec.for_block(block_type)


@dataclasses.dataclass(frozen=True)
class _BlockOwner:
  """What a ``save_tensors`` block records with its jaxpr (:func:`jaxckpt.core._tagging.record_tagged`)."""

  block_type: str
  path: tuple


_MARKER = "__jaxckpt_block__:"
"""Prefix of the name that marks a block's remat region while listing names (never in a compiled step)."""

_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("jaxckpt_linen_run", default=None)
_LISTING: contextvars.ContextVar[dict[str, set[str]] | None] = contextvars.ContextVar("jaxckpt_linen_listing",
                                                                                      default=None)
_PATHS: contextvars.ContextVar[list[tuple] | None] = contextvars.ContextVar("jaxckpt_linen_paths", default=None)

_TRACE_KEY = jax.make_user_context(None)
"""Part of every ``jax.jit`` cache key while a :class:`RematModule` runs (``jax.make_user_context``; module
docstring): ``RematModule._trace_key``, so a jit inside the model (``nn.jit``) traces once per policy."""

_MATCHED: dict[Any, tuple[frozenset[str], frozenset[int]]] = {}
"""Trace key -> (block types, layers) matched when a trace ran under that key. A jit inside the model that reuses
its trace (same key: same module and policy) runs no interceptor; these are the blocks that trace holds."""

_EVER: dict[Any, set[str]] = {}
"""Module -> block types matched under any key: blocks that match nothing now but did under another policy mean a
cache jaxckpt cannot key reused an old trace (:meth:`RematModule._cached_wrappers` names it)."""

_CLASSES: dict[Any, set[type]] = {}
"""Module -> classes of its matched blocks (a block class under ``nn.jit`` shares one trace among equal blocks)."""

_CACHED_TRANSFORMS = {flax_lift.jit: "nn.jit"}
"""Flax's lifted transforms that cache traces (``nn.jit``), by the ``flax.core.lift`` function behind them."""


def _block_type(run: _Run, module: nn.Module) -> str | None:
  path = tuple(module.path)
  for block_type, match in run.matchers:
    if match(path, module):
      return block_type
  return None


def _interceptor(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
  run = _RUN.get()
  module = context.module
  if run is None or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  if run.skip_next:  # the matched block's own call, now inside nn.checkpoint: run it as written
    run.skip_next = False
    run.active.append((run.active_type, tuple(module.path)))
    try:
      return next_fun(*args, **kwargs)
    finally:
      run.active.pop()
  if run.active and tuple(module.path) == run.active[-1][1]:  # the running block's own nested __call__ (super())
    return next_fun(*args, **kwargs)
  block_type = _block_type(run, module)
  if run.active and block_type is None:  # a layer inside a block: names= decides (after the call: params exist)
    outer_type, block_path = run.active[-1]
    path = tuple(module.path)[len(block_path):]
    call = mark_layer_call((args, kwargs))  # where its parts are looked for (tag_parts traces only)
    out = next_fun(*args, **kwargs)
    if not run.names(path, module):
      mark_layer_return(call, (args, kwargs), None)
      return out
    out, tagged = tag_output(out, path_name(path))
    if tagged and run.record is not None:
      run.record.setdefault(outer_type, set()).add(path_name(path))
    mark_layer_return(call, (args, kwargs), path_name(path))
    return out
  if block_type is None:
    return next_fun(*args, **kwargs)
  with outside_parts():  # a block names the parts of its own layers, not those of a block around it
    return _call_block(run, module, block_type, next_fun, args, kwargs)


def _call_block(run: _Run, module: nn.Module, block_type: str, next_fun: Callable, args: tuple, kwargs: dict) -> Any:
  """A matched block's ``__call__`` under the lifted checkpoint with its policy (the interceptor's block case)."""
  run.matched[block_type] = run.matched.get(block_type, 0) + 1
  run.paths.append(tuple(module.path))
  run.classes.add(type(module))
  if run.layers and (layer := _layer_index(run.layers, tuple(module.path))) is not None:
    run.layers_seen.add(layer)
  policy: Policy = run.policy_for(block_type, tuple(module.path))
  split = split_arguments(args, kwargs)
  arrays = split.arrays

  def fn(mdl: nn.Module, *arrs):
    call_args, call_kwargs = split.merge(arrs)
    if run.record is not None and arrs:  # listing names: mark this remat region as a block of this type
      checkpoint_name(arrs[0], _MARKER + block_type)
    run.skip_next, run.active_type = True, block_type
    return mdl(*call_args, **call_kwargs)

  if run.record is not None and not policy.remat:
    # names are only tagged under remat; list them with a remat that saves everything (same numbers)
    policy = Policy("everything_saveable")
  if not policy.remat:
    return fn(module, *arrays)
  if policy.name == SAVE_TENSORS:  # per-tensor: tag the chosen values of the block's function, save exactly them
    tag = functools.partial(tag_values, names=policy.names, owner=_BlockOwner(block_type, tuple(module.path)))
    return nn.transforms.lift_transform(_tagged_checkpoint, fn, policy=policy, tag=tag)(module, *arrays)
  if run.record is not None or names_parts(policy.checkpoint_names):  # listing, or a policy naming parts (mlp.0)
    tag = functools.partial(tag_parts, wanted=policy.checkpoint_names, spec=str(policy))
    return nn.transforms.lift_transform(_tagged_checkpoint, fn, policy=policy, tag=tag)(module, *arrays)
  return nn.checkpoint(fn, policy=policy.to_jax(), prevent_cse=True)(module, *arrays)


def _hashable(value: Any) -> Any:
  """``value`` if it can key a dict, else ``None``."""
  try:
    hash(value)
  except TypeError:
    return None
  return value


def _cached_transform(value: Any) -> str | None:
  """``"nn.jit"`` when ``value`` (a method) is wrapped by one of Flax's caching lifted transforms
  (:data:`_CACHED_TRANSFORMS`), found by the ``flax.core.lift`` function it closes over; else ``None``."""
  free = getattr(getattr(value, "__code__", None), "co_freevars", ())
  for var, cell in zip(free, getattr(value, "__closure__", None) or ()):
    if var != "transform":
      continue
    try:
      transform = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    if _hashable(transform) is not None and transform in _CACHED_TRANSFORMS:
      return _CACHED_TRANSFORMS[transform]
  return None


def _wrappers_of(cls: type) -> list[str]:
  """``"Transformer.__call__ is wrapped in nn.jit"`` for each method of ``cls`` (and its bases) under a caching
  Flax transform, and ``"Block is wrapped in nn.jit (class JitBlock)"`` for a class transform of ``cls`` (Flax runs
  the block as ``cls`` inside it, so the subclass is what was called)."""
  found = []
  for owner in cls.__mro__:
    if owner in (nn.Module, object):
      continue
    for attr, value in vars(owner).items():
      if (transform := _cached_transform(value)) is not None:
        found.append(f"{cls.__name__}.{attr} is wrapped in {transform}")
  for sub in cls.__subclasses__():
    if sub.__module__ == nn.transforms.__name__:  # nn.jit(cls) and the other class transforms
      for attr, value in vars(sub).items():
        if (transform := _cached_transform(value)) is not None:
          found.append(f"{cls.__name__} is wrapped in {transform} (class {sub.__name__}, its {attr})")
  return found


def _tagged_checkpoint(fn: Callable, *, policy: Policy, tag: Callable[[Callable], Callable]) -> Callable:
  """Flax's lifted ``lift.checkpoint`` (variables and RNGs lifted, ``prevent_cse``) with the function under
  ``jax.checkpoint`` first tagged by ``tag``: :func:`jaxckpt.core._tagging.tag_values` (a ``save_tensors`` policy saves
  the values it names) or :func:`jaxckpt.core._autonames.tag_parts` (the parts of the block's layers get names)."""
  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    def pure(variable_groups, rng_groups, *args):
      scope = scope_fn(variable_groups, rng_groups)
      return fn(scope, *args), repack_fn(scope)

    tagged = tag(pure)
    return jax.checkpoint(tagged, policy=policy.to_jax(), prevent_cse=True)(variable_groups, rng_groups, *args)

  return flax_lift.pack(inner, (True,), (True,), (True,), name="remat")  # as flax.core.lift.checkpoint packs


_INDEXED = re.compile(r"(?P<prefix>.*?)(?P<index>[0-9]+)\Z")


def group_layers(paths: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
  """The layers of a model from the scope paths of its matched blocks: the rule of the module docstring.

  The layer axis is the shallowest depth d at which some parent path ``p[:d]`` and name prefix have at least two
  blocks whose name at d is ``<prefix><integer>`` with different integers (``h_0``/``h_1``, ``layers_2``,
  ``DecoderBlock_0``, ``"3"``); each distinct such name is a layer, ordered by its integer.

  Args:
    paths: scope paths of the matched blocks, e.g. ``[("h_0",), ("h_1",)]`` or ``[("layers_0", "mlp"), ...]``.

  Returns:
    The layer keys (path prefixes, e.g. ``(("h_0",), ("h_1",))``) in layer order; ``()`` when the blocks are not
    in separate layers (one block, an ``nn.scan`` stack).
  """
  for depth in range(max((len(p) for p in paths), default=0)):
    groups: dict[tuple, dict[int, str]] = {}
    for path in paths:
      if len(path) > depth and (match := _INDEXED.match(str(path[depth]))):
        groups.setdefault((tuple(path[:depth]), match["prefix"]), {})[int(match["index"])] = str(path[depth])
    if groups:
      (parent, _), names = max(groups.items(), key=lambda item: len(item[1]))
      if len(names) > 1:
        return tuple((*parent, names[i]) for i in sorted(names))
  return ()


def _layer_index(layers: tuple[tuple[str, ...], ...], path: tuple) -> int | None:
  for i, key in enumerate(layers):
    if tuple(path[:len(key)]) == key:
      return i
  return None


@dataclasses.dataclass(frozen=True)
class RematModule:
  """A Linen module whose matched blocks run under remat while it is initialised or applied.

  Use it where you used the module: :meth:`init`, :meth:`apply`, :meth:`init_with_output` take the same arguments
  and give the same variables. Other attributes are the module's.

  Attributes:
    module: your Linen module, unchanged.
    spec: the policy in use: a :class:`~jaxckpt.PolicySpec`, or a :class:`~jaxckpt.policies.LayeredPolicy` (a spec
      per range of layers, module docstring).
    blocks: ``(block type, matcher)`` pairs, from ``blocks=``.
    name_rule: which layers inside a block get automatic checkpoint names, from ``names=``.
    layers: the layer keys (scope path prefixes, :func:`group_layers`) once known (:meth:`with_layers`); found by
      tracing at the first ``init``/``apply`` under a layered policy otherwise.
  """

  module: nn.Module
  spec: PolicySpec | LayeredPolicy
  blocks: tuple[tuple[str, Any], ...]
  name_rule: NameRule = NameRule("auto")
  layers: tuple[tuple[str, ...], ...] | None = None

  @property
  def block_type_names(self) -> tuple[str, ...]:
    """The block types named in ``blocks=``."""
    return tuple(b for b, _ in self.blocks)

  def _matchers(self) -> tuple[tuple[str, Callable[[tuple, nn.Module], bool]], ...]:
    return tuple((b, block_matcher(b, v, front_end="linen")) for b, v in self.blocks)

  def _trace_key(self, spec: PolicySpec | LayeredPolicy, layers: tuple, *, fresh: bool) -> Any:
    """What a trace of this run depends on beyond its arguments (:data:`_TRACE_KEY`): the module, ``spec``, blocks,
    names rule and ``layers``; a new object (never equal: every jit inside traces) when ``fresh`` (a run whose trace
    has side effects jaxckpt reads) or when something in it is unhashable."""
    key = ("jaxckpt.linen", self.module, spec, self.blocks, self.name_rule, layers)
    try:
      hash(key)
    except TypeError:
      return object()
    return object() if fresh else key

  def _cached_wrappers(self) -> list[str]:
    """The model's and its matched blocks' methods under a caching Flax transform (:func:`_wrappers_of`)."""
    classes = {type(self.module), *_CLASSES.get(_hashable(self.module), ())}
    return [w for cls in sorted(classes, key=lambda c: c.__name__) for w in _wrappers_of(cls)]

  def _layers_for(self, spec: PolicySpec | LayeredPolicy, call: Callable[[], Any]) -> tuple[tuple[str, ...], ...]:
    """The layer keys a layered ``spec`` needs (traced from ``call`` when unknown), checked against its ranges."""
    if spec.layered is None:
      return ()
    layers = self.layers
    if layers is None:
      layers = group_layers(traced_block_paths(lambda: self.with_policy(PolicySpec())._run_traced(call)))
      object.__setattr__(self, "layers", layers)  # a cache of what the module's code determines
    name = type(self.module).__name__
    if not layers:
      wrappers = "; ".join(self._cached_wrappers())
      why = (f"; {wrappers}, whose trace equal blocks share, so only one is seen" if wrappers else
             " (blocks in an nn.scan stack take one spec for all layers)")
      raise JaxckptError(f"layered policy {str(spec)!r} needs separate layers (blocks under scope names ending in an "
                         f"index, such as h_0, layers_1 from a list or a loop); the blocks of {name} are not{why}: "
                         "give one spec")
    if len(layers) != spec.num_layers:
      raise JaxckptError(f"layered policy {str(spec)!r} covers {spec.num_layers} layers but {name} has {len(layers)} "
                         f"({', '.join('/'.join(k) for k in layers[:4])}{', ...' if len(layers) > 4 else ''}): "
                         f"ranges must cover 0-{len(layers) - 1}")
    return layers

  @contextlib.contextmanager
  def _running(self, call: Callable[[], Any] | None = None) -> Iterator[_Run]:
    record = _LISTING.get()  # listing names: every block remat'd (everything_saveable, same numbers) and recorded
    spec = self.spec if record is None else PolicySpec(default=Policy("everything_saveable"))
    paths = _PATHS.get()  # finding layers: no remat, every matched call's path recorded
    if paths is not None:
      spec = PolicySpec()
    layers = self._layers_for(spec, call) if call is not None else ()
    run = _Run(spec, self._matchers(), layers=layers, record=record, paths=[] if paths is None else paths,
               names=self.name_rule)
    key = self._trace_key(spec, layers, fresh=record is not None or paths is not None or recording())
    token = _RUN.set(run)
    try:
      with _TRACE_KEY(key), nn.intercept_methods(_interceptor):
        yield run
    finally:
      _RUN.reset(token)
    self._check_matched(run, key)

  def _check_matched(self, run: _Run, key: Any) -> None:
    """Raises unless every block type matched in this run or in the trace a jit inside reused (same ``key``)."""
    stable = type(key) is tuple  # a fresh key (an object) is never seen again
    types, layers = frozenset(b for b, n in run.matched.items() if n), frozenset(run.layers_seen)
    if stable:
      old_types, old_layers = _MATCHED.get(key, (frozenset(), frozenset()))
      types, layers = types | old_types, layers | old_layers
      if types:
        _MATCHED[key] = types, layers
    missing = [b for b in self.block_type_names if b not in types]
    module_key = _hashable(self.module)
    if module_key is not None:
      _EVER.setdefault((module_key, repr(self.blocks)), set()).update(b for b, n in run.matched.items() if n)
      _CLASSES.setdefault(module_key, set()).update(run.classes)
    name, blocks = type(self.module).__name__, ", ".join(repr(b) for b in missing)
    wrappers = self._cached_wrappers()
    unseen = sorted(set(range(len(run.layers))) - layers) if not missing else []
    if unseen:  # a layered run where some layers' blocks did not run: a jit shared another layer's trace
      where = "; ".join(wrappers) or "a cache around the blocks"
      raise JaxckptError(
          f"layered policy {str(run.spec)!r}: the blocks of layer(s) {', '.join(map(str, unseen))} of {name} were "
          f"not traced: a trace cache reused another layer's trace under its spec ({where}: equal blocks share one "
          "trace); fix: one spec for all layers, or drop that cache while remat'ing")
    if not missing:
      return
    earlier = module_key is not None and set(missing) <= _EVER.get((module_key, repr(self.blocks)), set())
    if earlier:
      where = "; ".join(wrappers) or f"a cache around the call of {name}"
      raise JaxckptError(
          f"blocks {blocks} of apply_remat matched in an earlier trace of {name} but not in this one: a trace "
          f"cache that ignores JAX's trace context reused a trace made under another policy ({where}); fix: drop "
          f"that cache while remat'ing, or call jax.clear_caches() before changing the policy")
    hint = f" ({'; '.join(wrappers)}: jaxckpt sees through it)" if wrappers else ""
    raise JaxckptError(
        f"blocks {blocks} of apply_remat matched no module called in {name}: check the classes or predicates (only "
        f"__call__ of a module is matched){hint}")

  def init(self, *args, **kwargs) -> Any:
    """``module.init(*args, **kwargs)`` with the blocks remat'd: the same variables."""
    with self._running(lambda: self.module.init(*args, **kwargs)):
      return self.module.init(*args, **kwargs)

  def init_with_output(self, *args, **kwargs) -> Any:
    """``module.init_with_output(*args, **kwargs)`` with the blocks remat'd."""
    with self._running(lambda: self.module.init_with_output(*args, **kwargs)):
      return self.module.init_with_output(*args, **kwargs)

  def apply(self, *args, **kwargs) -> Any:
    """``module.apply(variables, *args, **kwargs)`` with the blocks remat'd (pass ``rngs={'dropout': key}`` as
    usual)."""
    with self._running(lambda: self.module.apply(*args, **kwargs)):
      return self.module.apply(*args, **kwargs)

  def _run_traced(self, call: Callable[[], Any]) -> Any:
    with self._running():
      return call()

  def with_layers(self, *args, **kwargs) -> "RematModule":
    """A copy that knows its layers (:func:`group_layers` of the blocks matched while tracing
    ``module.init(*args, **kwargs)``; nothing is computed), so layered policies need no tracing later.

    Args:
      *args, **kwargs: what ``init`` takes: an RNG key, then inputs (arrays or ``jax.ShapeDtypeStruct``).
    """
    return dataclasses.replace(self, layers=group_layers(traced_block_paths(lambda: self.init(*args, **kwargs))))

  def set_policy(self, policy: Any) -> "RematModule":
    """Deprecated name of :meth:`with_policy`: Linen modules are immutable, so this never changed the module in place
    (as :func:`jaxckpt.set_policy` does for NNX); it returns the copy and warns (``DeprecationWarning``)."""
    warnings.warn(f"{type(self.module).__name__}.set_policy returns a copy (Linen modules are immutable): call "
                  "with_policy(policy), or jaxckpt.with_policy(model, policy)", DeprecationWarning, stacklevel=2)
    return self.with_policy(policy)

  def with_policy(self, policy: Any) -> "RematModule":
    """A copy with another policy: any concrete policy the NNX side takes (a spec string, :class:`~jaxckpt.Policy`,
    :class:`~jaxckpt.PolicySpec`, or a :class:`~jaxckpt.policies.LayeredPolicy` / ``first-last:spec;...``).
    Block-map keys are checked against ``blocks=``; names by :func:`block_types`.

    Raises:
      PolicySpecError: a malformed spec or a block type not in ``blocks=``.
      JaxckptError: layer ranges that do not cover the model's layers, when they are known (a target's model;
        otherwise at the first ``init``/``apply``); a policy that needs the planner first (``budget:…``, ``min_saved``: resolve it with
        :func:`jaxckpt.planner.resolve_policy`), or a whole-loss ``mincut`` plan (it remats the train step's loss,
        not the module).
    """
    parsed = parse_model_policy(policy)
    name = type(self.module).__name__
    if not parsed.resolved:
      raise JaxckptError(f"policy {str(parsed)!r} is planned for a target, not set on {name}: resolve it first "
                         "(jaxckpt.planner.resolve_policy(target, policy)) and set the plan's policy")
    if parsed.whole_loss is not None:
      raise JaxckptError(f"policy {str(parsed)!r} remats the whole loss of the train step the tools build; it cannot "
                         f"be set on {name} (set a per-block or per-layer policy)")
    if parsed.layered is not None:
      for _, spec in parsed.layered.segments:
        _checked(spec, self.block_type_names)
      if self.layers is not None:  # layers already known (a target's model): the ranges must cover them now
        self._layers_for(parsed, lambda: None)
      return dataclasses.replace(self, spec=parsed)
    return dataclasses.replace(self, spec=_checked(parsed, self.block_type_names))

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__"):
      raise AttributeError(name)
    return getattr(self.module, name)


def _checked(spec: PolicySpec, block_types: tuple[str, ...]) -> PolicySpec:
  text = spec.text or str(spec)
  for block, _ in spec.blocks:
    if block not in block_types:
      raise PolicySpecError.unknown("block type", block, [*block_types, DEFAULT_BLOCK], spec=text)
  return spec


def apply_remat(module: nn.Module, policy: "str | Policy | PolicySpec | None", *, blocks: Mapping[str, Any],
                names: Any = None) -> RematModule:
  """Makes the blocks of an existing Linen model run under remat with ``policy``, keeping its parameter tree.

  Args:
    module: your Linen module (unbound), unedited; a :class:`RematModule` is re-applied with the new arguments.
    policy: a per-block policy spec (:func:`jaxckpt.parse_policy`): one policy, or a block map over the keys of
      ``blocks`` (``attn=dots_saveable,mlp=full``); ``none`` runs the blocks as written; or a spec per range of
      layers (``0-1:nothing_saveable;2-3:dots_saveable``, layers as the module docstring says).
    blocks: block type -> a Linen module class (instances of it and its subclasses match), a tuple of classes, or a
      predicate ``(path, module) -> bool`` where ``path`` is the module's scope path (``('decoder_block_0',)``).
    names: which submodules of a block get automatic checkpoint names (their scope path relative to the block,
      ``attn.c_attn``; :mod:`jaxckpt.core._autonames`): ``None``/``"auto"`` (default: the standard Linen layers and
      modules of your own classes that hold a weight, a parameter with ≥ 2 dimensions, themselves), ``"all"``
      (every submodule whose output holds arrays), a Linen module class or tuple of classes (exactly their
      instances; ``()`` names nothing), or a predicate ``(path, module) -> bool`` with ``path`` relative to the block
      (``("attn", "c_attn")``), called after the submodule's call.

  Returns:
    The :class:`RematModule` to ``init`` / ``apply``. A block type that matches no module raises at the first
    ``init``/``apply`` (only then are the submodules known).

  Raises:
    JaxckptError: ``module`` is not a Linen module (an NNX one: use :func:`jaxckpt.apply_remat`), malformed
      ``blocks`` or ``names``.
    PolicySpecError: a malformed spec, or a block map naming a type not in ``blocks``.

  Example::

    >>> model = apply_remat(MyLM(), "save_only_these_names:MlpBlock_0.Dense_0", blocks={"layer": DecoderLayer})
    >>> gpt2 = apply_remat(GPT2(), "save_only_these_names:attn.c_attn", blocks={"block": Block}, names=(Conv1D,))
  """
  if isinstance(module, RematModule):
    module = module.module
  if isinstance(module, nnx.Module):
    raise JaxckptError(f"{type(module).__name__} is an NNX module: use jaxckpt.apply_remat(model, policy, blocks=...)")
  if not isinstance(module, nn.Module):
    raise JaxckptError(f"jaxckpt.linen.apply_remat needs a flax.linen.Module, got {type(module).__name__}")
  block_matchers(blocks, front_end="linen")
  rule = names_rule(names, front_end="linen")
  return RematModule(module, PolicySpec(), tuple(blocks.items()), rule).with_policy(policy)


def traced_block_paths(fn: Callable[..., Any], *args) -> list[tuple]:
  """Scope paths of the blocks matched while ``fn(*args)`` — which inits or applies :class:`RematModule` s, e.g. a
  loss — is traced with no remat (``jax.eval_shape``: nothing is computed), in call order.

  Args:
    fn: e.g. ``lambda: model.init(key, x)`` or a loss that calls ``model.apply``.
    *args: arrays or ``jax.ShapeDtypeStruct`` s.

  Raises:
    JaxckptError: a block type that matched no module.
  """
  paths: list[tuple] = []
  tokens = _LISTING.set(None), _PATHS.set(paths)
  try:
    jax.eval_shape(fn, *args)
  finally:
    _PATHS.reset(tokens[1])
    _LISTING.reset(tokens[0])
  return paths


def traced_block_types(fn: Callable[..., Any], *args, block_type_names: tuple[str, ...] = ()
                       ) -> dict[str, frozenset[str]]:
  """Block type -> checkpoint names emitted while tracing ``fn(*args)``, which initialises or applies
  :class:`RematModule` s (automatic names and the model's own tags). Nothing is computed.

  Args:
    fn: e.g. ``lambda key, x: model.init(key, x)`` or a loss that calls ``model.apply``.
    *args: arrays or ``jax.ShapeDtypeStruct`` s.
    block_type_names: block types to list even when they emit no name.

  Returns:
    ``{block_type: frozenset(names)}``.
  """
  record: dict[str, set[str]] = {b: set() for b in block_type_names}
  token = _LISTING.set(record)
  try:
    jaxpr = jax.make_jaxpr(fn)(*args)
  finally:
    _LISTING.reset(token)
  for block_type, names in _region_names(jaxpr).items():
    record.setdefault(block_type, set()).update(names)
  return {b: frozenset(v) for b, v in sorted(record.items())}


def block_types(model: RematModule, *args, **kwargs) -> dict[str, frozenset[str]]:
  """Block type -> checkpoint names its blocks emit (automatic names and the model's own tags), by tracing
  ``model.init(*args, **kwargs)``; nothing is computed.

  Args:
    model: from :func:`apply_remat`.
    *args: what ``model.init`` takes: an RNG key then the inputs (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: keyword arguments of ``init`` (static flags such as ``deterministic=True``).

  Returns:
    ``{block_type: frozenset(names)}`` for every block type of ``blocks=``.

  Raises:
    JaxckptError: ``model`` is not a :class:`RematModule`; a block type that matched no module.
  """
  if not isinstance(model, RematModule):
    raise JaxckptError(f"block_types needs the RematModule from jaxckpt.linen.apply_remat, got {type(model).__name__}")
  return traced_block_types(lambda *a: model.init(*a, **kwargs), *args, block_type_names=model.block_type_names)


def _region_names(jaxpr: Any) -> dict[str, set[str]]:
  """Names emitted directly inside each marked remat region (nested regions count for their own block)."""
  found: dict[str, set[str]] = {}

  def walk(jx: Any, block: str | None) -> None:
    jx = getattr(jx, "jaxpr", jx)
    named = [(eqn, checkpoint_name_of(eqn)) for eqn in jx.eqns]
    marks = [n for _, n in named if n is not None and n.startswith(_MARKER)]
    if marks:
      block = marks[0][len(_MARKER):]
    for eqn, name in named:
      if name is not None and block is not None and not name.startswith(_MARKER):
        found.setdefault(block, set()).add(name)
      for sub in sub_jaxprs(eqn):  # remat2 and remat3 bodies, scans, jit…
        walk(sub, block)

  walk(jaxpr, None)
  return found
