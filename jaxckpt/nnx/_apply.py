"""Remat for your own NNX model, unedited: name the block classes, keep every parameter path.

:func:`apply_remat` finds the modules of an existing NNX model that are blocks (by class, tuple of classes or a
predicate ``(path, module) -> bool``, per block type) and changes how each matched *instance* is called, never where
it lives: the instance's ``__class__`` becomes a cached subclass of its own class whose ``__call__`` runs the original
``__call__`` under ``jax.checkpoint`` with the policy of its block type, the policy being a static attribute of the
instance (part of the graphdef, so changing it re-traces). Parameter and state paths stay exactly as they were, so a
train state saved before restores after (a wrapper module would add a level: ``…/attn/module/…``).

- Blocks in Python lists (``nnx.List``), dicts and nested modules are found at any depth; blocks inside ``nnx.vmap``
  / ``nnx.scan`` stacks are one instance with stacked parameters, and the scan body calls it remat'd.
- Array arguments go through the checkpoint; everything else (``deterministic=True``, ``None``, ints) is closed over
  as a static Python value.
- The block's variables (parameters and RNG streams such as the ``nnx.Dropout``'s own ``Rngs`` fork) are inputs of
  the checkpointed function, so the recomputation draws the forward pass's dropout masks; updated RNG counters and
  other state are written back after the call.
- Inside a remat'd block the outputs of its layers get checkpoint names from their attribute path
  (:mod:`jaxckpt.core._autonames`: ``attn.q_einsum``, ``mlp.up_proj``, ``attn.c_attn`` for a ``Conv1D`` of your
  own), so ``save_only_these_names:…`` works on models that never call ``checkpoint_name``; ``names=`` chooses
  which layers (default: standard Flax layers and your own modules that hold a weight). The named layers of a copy
  made inside the checkpoint get a cached subclass that tags their output; the model's own instances keep their
  classes, so the parameter tree, ``nnx.split``/``merge`` and saved train states are unchanged. A named layer that
  runs several projections in its own code (a GeGLU MLP's gate and up einsums) also names them, ``mlp.0``, ``mlp.1``
  (its parts: :mod:`jaxckpt.core._autonames`), found by tracing (:func:`checkpoint_names`).

:func:`jaxckpt.set_policy` and :func:`jaxckpt.block_types` see applied blocks too; calling :func:`apply_remat`
again, or ``set_policy``, changes the policy. Nothing matched, or a policy for a model without blocks, is an error
that lists the module classes the model has.

Idea: JAX's ``jax.checkpoint`` / ``nnx.remat`` (JAX docs, "Gradient checkpointing"); the block-class naming follows
PyTorch FSDP's ``auto_wrap_policy``/``ModuleWrapPolicy`` and Flax's ``nn.remat(cls)`` class-level lifting.

Example::

  >>> model = MyDecoder(cfg, rngs=nnx.Rngs(0))             # your model, unedited
  >>> jaxckpt.apply_remat(model, "dots_saveable", blocks={"layer": DecoderLayer})
  >>> jaxckpt.block_types(model)                           # {'layer': frozenset({'attn.q_einsum', ...})}
  >>> jaxckpt.set_policy(model, "save_only_these_names:mlp.up_proj")
"""

from __future__ import annotations

import contextlib
import re
import contextvars
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jaxckpt.core._arguments import split_arguments
from jaxckpt.core._autonames import (NameRule, layer_axes, mark_layer_call, mark_layer_return, names_parts, names_rule,
                                    outside_parts, path_name, tag_output, tag_parts)
from jaxckpt.core._matching import block_matchers, describe_blocks_value
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.analysis._jaxprs import checkpoint_name_of, iter_eqns
from jaxckpt.policies._spec import Policy, PolicySpec, parse_policy
from jaxckpt.core._remat import Remat, module_call
from jaxckpt.sharding._gather import gathering

BlockMatcher = "type | tuple[type, ...] | Callable[[tuple, nnx.Module], bool]"
"""What ``blocks=`` maps a block type to: an NNX module class, a tuple of classes (``isinstance``), or a predicate
``(path, module) -> bool`` where ``path`` is the module's path in the model as a tuple (``('layers', 0, 'attn')``)."""

_POLICY = "_jaxckpt_policy"
"""Instance attribute (static) holding the :class:`~jaxckpt.PolicySpec` of an applied block."""
_TYPE = "_jaxckpt_block_type"
"""Instance attribute (static) holding the block type of an applied block."""
_LEARNED = "_jaxckpt_names"
"""Instance attribute (static): checkpoint names the model tags itself, learned by :func:`checkpoint_names`."""
_PENDING = "_jaxckpt_pending_names"
"""Instance attribute (static): checkpoint names a policy set on the block refers to that no trace has shown yet (the
model tags them itself: known only once traced); checked when the block is first traced (:func:`_verify_pending`)."""
_NAMED_PATHS = "_jaxckpt_named_paths"
"""Instance attribute (static): paths (relative to the block) of the layers whose outputs get automatic names,
decided by ``names=`` when :func:`apply_remat` ran."""

_STACKED = "stacked_layers"
"""Instance attribute (static) ``True`` on an applied block whose parameters are stacked on a leading layer axis (an
``nnx.vmap`` stack called in ``nnx.scan``, :func:`jaxckpt.core._autonames.layer_axes`): the declaration
:func:`jaxckpt.sharding.stacked_layer_paths` reads, so FSDP never splits the layer axis and gathers one layer at a
time."""

_ORIGINAL: dict[type, type] = {}  # applied subclass -> the user's class
_APPLIED: dict[type, type] = {}  # the user's class -> applied subclass
_NAMED: dict[type, type] = {}  # named layer class -> subclass that tags its output
_ACTIVE_NAMES: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("jaxckpt_auto_names",
                                                                                      default=None)
_RECORD: contextvars.ContextVar[dict[str, set[str]] | None] = contextvars.ContextVar("jaxckpt_record_names",
                                                                                     default=None)


def is_applied(module: Any) -> bool:
  """Whether ``module`` is a block that :func:`apply_remat` matched (its class is an applied subclass)."""
  return type(module) in _ORIGINAL


def original_class(module: Any) -> type:
  """The user's class of ``module`` (its own class unless :func:`apply_remat` swapped it)."""
  return _ORIGINAL.get(type(module), type(module))


def model_classes(model: nnx.Module) -> list[str]:
  """Sorted names of the module classes in ``model`` (original names for applied blocks), for error messages."""
  return sorted({original_class(m).__name__ for _, m in nnx.iter_modules(model)})


def linen_error(model: Any, what: str) -> JaxckptError | None:
  """The error for an NNX-only operation given a Flax Linen module (or the ``RematModule`` of
  ``jaxckpt.linen.apply_remat``), naming the Linen way; ``None`` for anything else."""
  inner = model if isinstance(model, nn.Module) else getattr(model, "module", None) if not isinstance(
      model, nnx.Module) else None
  if not isinstance(inner, nn.Module):
    return None
  return JaxckptError(f"{what} is for NNX models; {type(inner).__name__} is a Flax Linen module: use "
                      "jaxckpt.linen.apply_remat(module, policy, blocks=...) and its .set_policy(...), "
                      "jaxckpt.linen._apply.block_types(model, key, *inputs), or jaxckpt.linen_model_target for the tools")


def no_blocks_error(model: nnx.Module, what: str) -> JaxckptError:
  """The error for an operation that found no block in ``model``: names the classes it has and the fix."""
  linen = linen_error(model, what)
  if linen is not None:
    return linen
  classes = model_classes(model)
  shown = ", ".join(classes[:30]) + (", ..." if len(classes) > 30 else "")
  return JaxckptError(
      f"{what}: {type(model).__name__} has no remat block (no jaxckpt block, no block applied by apply_remat); its "
      f"module classes: {shown or '(none)'}; name the blocks: jaxckpt.apply_remat(model, policy, "
      f"blocks={{'layer': {classes[0] if classes else 'MyBlock'}}})")


# ----------------------------------------------------------------------------------------------------- class swaps


def _named_class(cls: type) -> type:
  """A subclass of a named layer's class whose ``__call__`` tags the array leaves of its output with the name
  registered for the instance (only on copies made inside a block's checkpoint)."""
  if cls not in _NAMED:

    def __call__(self, *args, **kwargs):
      name = (_ACTIVE_NAMES.get() or {}).get(id(self))
      call = None if name is None else mark_layer_call((args, kwargs))  # where its parts are looked for (tag_parts)
      out = cls.__call__(self, *args, **kwargs)
      if name is None:
        return out
      out = tag_output(out, name)[0]
      mark_layer_return(call, (args, kwargs), name)
      return out

    _NAMED[cls] = type(cls)(cls.__name__, (cls,), {
        "__call__": __call__, "__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__})
  return _NAMED[cls]


def _named_paths(block: nnx.Module, rule: NameRule) -> tuple[tuple, ...]:
  """Paths relative to ``block`` of the layers ``rule`` names: callable submodules, not in nested blocks."""
  modules = list(nnx.iter_modules(block))
  nested = [path for path, m in modules if path and is_applied(m)]
  stacked = layer_axes(jax.tree.leaves(nnx.state(block)))
  return tuple(path for path, m in modules if path and callable(m) and not any(path[:len(r)] == r for r in nested)
               and rule(path, m, layer_axes=stacked))


def _auto_name_paths(block: nnx.Module) -> dict[tuple, nnx.Module]:
  """``{path relative to block: layer}`` of the layers ``block`` names (decided by :func:`apply_remat`)."""
  paths = getattr(block, _NAMED_PATHS, None)
  if paths is None:  # not decided yet (e.g. a block applied before names= existed): the default rule
    paths = _named_paths(block, names_rule(None))
  wanted = set(paths)
  return {path: m for path, m in nnx.iter_modules(block) if path in wanted}


def _static_names(block: nnx.Module) -> frozenset[str]:
  """Automatic names of ``block`` plus the names learned from a trace (:func:`checkpoint_names`)."""
  return frozenset(path_name(p) for p in _auto_name_paths(block)) | frozenset(getattr(block, _LEARNED, ()))


@contextlib.contextmanager
def _auto_names(block: nnx.Module) -> Iterator[None]:
  """Within: the named layers of ``block`` (a copy made inside the checkpoint) tag their outputs."""
  names: dict[int, str] = {}
  for path, layer in _auto_name_paths(block).items():
    if type(layer) is not _NAMED.get(type(layer)):
      object.__setattr__(layer, "__class__", _named_class(type(layer)))
    names[id(layer)] = path_name(path)
  token = _ACTIVE_NAMES.set(names)
  try:
    yield
  finally:
    _ACTIVE_NAMES.reset(token)


def _call_applied(self: nnx.Module, cls: type, args: tuple, kwargs: dict) -> Any:
  """``__call__`` of an applied block: the original ``cls.__call__`` under ``jax.checkpoint`` with its policy."""
  with outside_parts():  # a block names the parts of its own layers, not those of a block around it
    return _run_applied(self, cls, args, kwargs)


def _run_applied(self: nnx.Module, cls: type, args: tuple, kwargs: dict) -> Any:
  spec: PolicySpec = getattr(self, _POLICY)
  block_type: str = getattr(self, _TYPE)
  policy: Policy = spec.for_block(block_type)
  split = split_arguments(args, kwargs, is_leaf=lambda x: isinstance(x, nnx.Module))
  arrays = split.arrays

  def method(module: nnx.Module, *arrs):
    call_args, call_kwargs = split.merge(arrs)
    with _auto_names(module):
      return cls.__call__(module, *call_args, **call_kwargs)

  def traced_names() -> set[str]:
    """Every checkpoint name the block emits: a trace of it once more, on a copy."""
    graphdef, state = nnx.split(self)
    token = _RECORD.set(None)
    try:
      jaxpr = jax.make_jaxpr(tag_parts(lambda st, *arrs: method(nnx.merge(graphdef, st), *arrs)))(state, *arrays)
    finally:
      _RECORD.reset(token)
    return {n for e in iter_eqns(jaxpr) if (n := checkpoint_name_of(e)) is not None}

  record = _RECORD.get()
  if record is not None:  # listing names: trace the block once more, on a copy, to see every name it emits
    record.setdefault(block_type, set()).update(traced_names())
  if set(getattr(self, _PENDING, ())) & set(policy.checkpoint_names):
    _verify_pending(self, block_type, policy, traced_names)
  if not policy.remat and not gathering():
    return cls.__call__(self, *args, **kwargs)
  # no remat under an fsdp axis: still a block, whose parameters are gathered per call (module_call)
  return module_call(method, policy, parts=names_parts(policy.checkpoint_names))(self, *arrays)


def _verify_pending(block: nnx.Module, block_type: str, policy: Policy, traced_names: Callable[[], set[str]]) -> None:
  """The first trace of a block whose policy names checkpoint names no earlier trace showed: learn what it emits
  (the model's own ``checkpoint_name`` tags) and refuse a name it never emits, as validation would have.

  Raises:
    PolicySpecError: a pending name the block does not emit (one line, listing what it emits).
  """
  emitted = traced_names() | set(_static_names(block))
  missing = sorted(set(getattr(block, _PENDING)) & set(policy.checkpoint_names) - emitted)
  vars(block)[_LEARNED] = tuple(sorted(emitted - {path_name(p) for p in _auto_name_paths(block)}))
  vars(block).pop(_PENDING, None)  # plain attributes: this may be a copy of the block inside a trace
  if missing:
    raise PolicySpecError.unknown("checkpoint name", missing[0], sorted(emitted), spec=str(policy),
                                  context=f" (never emitted by block {block_type!r}, so it would save nothing)")


_PART = re.compile(r"(.*?)(?:\.[0-9]+)?\Z")


def _automatic_forms(block: nnx.Module) -> set[str]:
  """The names only jaxckpt's automatic naming gives in ``block``: the path of each of its submodules
  (``attn.q_proj``; a part is ``<path>.<k>``), whether the ``names=`` rule names that layer or not."""
  return {path_name(path) for path, _ in nnx.iter_modules(block) if path}


def validate_applied(model: nnx.Module, parsed: Any, types: Mapping[str, Collection[str]]) -> Any:
  """Validates a parsed policy against ``model``'s block types (``types``: block type -> names known now), letting
  through the checkpoint names of applied blocks that no trace has shown yet and that are not automatic names: a
  model may tag its own values (``checkpoint_name``), which only a trace sees. Those names are checked when each
  block is first traced (:func:`_verify_pending`), so a typo is still refused, then; a name of the automatic form (a
  submodule's path, or a part ``<path>.<k>``) that the blocks do not emit is refused now, as before.

  Args:
    model: the NNX model (its applied blocks get the pending names).
    parsed: a :class:`~jaxckpt.PolicySpec` or layered policy (anything with ``validate`` and ``segments_for``).
    types: block type -> checkpoint names known without tracing (:func:`jaxckpt.block_types`).

  Returns:
    ``parsed.validate(...)``'s result.

  Raises:
    PolicySpecError: a block type the model lacks; a name a jaxckpt block (whose names are all declared) never
      emits.
  """
  blocks = applied_blocks(model)
  specs = [s for _, s in parsed.layered.segments] if parsed.layered is not None else [parsed.base_spec]
  pending: dict[str, set[str]] = {}
  automatic = set().union(*(_automatic_forms(b) for _, b in blocks))
  for block_type in {getattr(b, _TYPE) for _, b in blocks}:
    wanted = set().union(*(s.for_block(block_type).checkpoint_names for s in specs))
    unseen = wanted - set(types.get(block_type, ()))
    unseen = {n for n in unseen if n not in automatic and _PART.match(n).group(1) not in automatic}
    if unseen:
      pending[block_type] = unseen
  result = parsed.validate({b: set(names) | pending.get(b, set()) for b, names in types.items()})
  for _, block in blocks:
    names = pending.get(getattr(block, _TYPE))
    if names:
      setattr(block, _PENDING, tuple(sorted(names)))
    elif _PENDING in vars(block):
      delattr(block, _PENDING)
  return result


def _applied_class(cls: type) -> type:
  """The cached subclass of ``cls`` whose ``__call__`` runs ``cls.__call__`` under remat (same slots, so
  ``__class__`` can be swapped on an instance)."""
  if cls in _ORIGINAL:
    return cls
  if cls not in _APPLIED:

    def __call__(self, *args, **kwargs):
      return _call_applied(self, cls, args, kwargs)

    __call__.__doc__ = f"{cls.__qualname__}.__call__ under jax.checkpoint with the block's policy (apply_remat)."
    sub = type(cls)(f"Remat{cls.__name__}", (cls,), {
        "__call__": __call__, "__slots__": (), "__module__": cls.__module__,
        "__qualname__": f"Remat{cls.__qualname__}"})
    _APPLIED[cls], _ORIGINAL[sub] = sub, cls
  return _APPLIED[cls]


def _unapply(module: nnx.Module) -> None:
  object.__setattr__(module, "__class__", original_class(module))
  for attr in (_POLICY, _TYPE, _LEARNED, _NAMED_PATHS, _PENDING, _STACKED):
    if attr in vars(module):
      delattr(module, attr)


# -------------------------------------------------------------------------------------------------------- matching


def _match(model: nnx.Module, blocks: Mapping[str, Any]) -> dict[str, list[tuple[tuple, nnx.Module]]]:
  matchers = block_matchers(blocks, unwrap=lambda cls: _ORIGINAL.get(cls, cls))
  found: dict[str, list[tuple[tuple, nnx.Module]]] = {b: [] for b in matchers}
  seen: set[int] = set()
  for path, module in nnx.iter_modules(model):
    if id(module) in seen:
      continue
    for block_type, match in matchers.items():
      if match(path, module):
        found[block_type].append((path, module))
        seen.add(id(module))
        break
  missing = [b for b, hits in found.items() if not hits]
  if missing:
    classes = model_classes(model)
    raise JaxckptError(
        f"blocks={{{', '.join(f'{b!r}: {describe_blocks_value(blocks[b])}' for b in missing)}}} matched no module of "
        f"{type(model).__name__}; its module classes: {', '.join(classes) or '(none)'}")
  return found


# ------------------------------------------------------------------------------------------------------ public API


def applied_blocks(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  """``(path, block)`` of every block :func:`apply_remat` applied in ``model``, in ``nnx.iter_modules`` order."""
  return [(path, m) for path, m in nnx.iter_modules(model) if is_applied(m)]


def applied_block_types(model: nnx.Module) -> dict[str, frozenset[str]]:
  """Block type -> checkpoint names of the blocks :func:`apply_remat` applied in ``model`` (automatic names, plus
  names learned by :func:`checkpoint_names`) and the block types of :class:`jaxckpt.Remat` wrappers (no names
  known); ``{}`` when none."""
  found: dict[str, set[str]] = {}
  for _, block in applied_blocks(model):
    found.setdefault(getattr(block, _TYPE), set()).update(_static_names(block))
  for wrapper in _remat_wrappers(model):  # jaxckpt.remat(module) wrappers: their block type, no names known
    found.setdefault(wrapper.block_type, set())
  return {k: frozenset(v) for k, v in sorted(found.items())}


def _remat_wrappers(model: nnx.Module) -> list[Remat]:
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Remat)]


def set_applied_policy(model: nnx.Module, spec: PolicySpec) -> int:
  """Sets ``spec`` (already validated) on every applied block of ``model`` and every :class:`jaxckpt.Remat` wrapper;
  returns how many it set."""
  blocks = applied_blocks(model)
  for _, block in blocks:
    setattr(block, _POLICY, spec)
  wrappers = _remat_wrappers(model)
  for wrapper in wrappers:
    wrapper.policy = spec
  return len(blocks) + len(wrappers)


def apply_remat(model: nnx.Module, policy: "str | Policy | PolicySpec | None", *, blocks: Mapping[str, Any],
                names: Any = None) -> nnx.Module:
  """Makes the blocks of an existing NNX model run under remat with ``policy``, in place, keeping every path.

  Each module matched by ``blocks`` keeps its place, parameters and state; only how it is called changes (its
  ``__call__`` runs under ``jax.checkpoint`` with the policy of its block type). Calling again replaces the previous
  application: blocks no longer matched get their own class back.

  Args:
    model: an NNX module (eager or abstract from ``nnx.eval_shape``).
    policy: a per-block policy spec (:func:`jaxckpt.parse_policy`): one policy for every block type, or a block map
      over the keys of ``blocks`` (``attn=dots_saveable,mlp=full``); ``none`` keeps the blocks applied without remat.
    blocks: block type -> what is a block of that type (:data:`BlockMatcher`): an NNX module class (instances and
      subclasses match), a tuple of classes, or a predicate ``(path, module) -> bool`` with ``path`` the module's
      path as a tuple. A module matching several types gets the first. Keys are block-type names (not ``default``).
    names: which submodules of a block get automatic checkpoint names (their path relative to the block,
      ``attn.c_attn``; :mod:`jaxckpt.core._autonames`): ``None``/``"auto"`` (default: the standard Flax layers and
      modules of your own classes that hold a weight, a parameter with ≥ 2 dimensions, themselves), ``"all"``
      (every callable submodule), an NNX module class or tuple of classes (exactly their instances; ``()`` names
      nothing), or a predicate ``(path, module) -> bool`` with ``path`` relative to the block (``("attn",
      "c_attn")``). Decided now, on the blocks as they are.

  Returns:
    ``model`` itself.

  Raises:
    JaxckptError: malformed ``blocks`` (not a class/tuple/predicate, a Linen class, a bad key), a block type
      that matched no module (the message lists the model's module classes), or a malformed ``names``.
    PolicySpecError: a malformed spec, a block type not in ``blocks``, or a checkpoint name the blocks never emit.

  Example::

    >>> jaxckpt.apply_remat(model, "attn=dots_saveable,mlp=full", blocks={"attn": Attention, "mlp": FeedForward})
    >>> jaxckpt.apply_remat(gpt2, "save_only_these_names:attn.c_attn", blocks={"block": Block}, names=(Conv1D,))
  """
  if isinstance(model, nn.Module):
    raise JaxckptError(f"apply_remat got a Flax Linen module ({type(model).__name__}); for Linen use "
                       "jaxckpt.linen.apply_remat(module, policy, blocks=...)")
  if not isinstance(model, nnx.Module):
    raise JaxckptError(f"apply_remat needs a flax.nnx.Module, got {type(model).__name__}")
  spec = parse_policy(policy)
  rule = names_rule(names, front_end="nnx")
  found = _match(model, blocks)
  matched = {id(m) for hits in found.values() for _, m in hits}
  for _, module in applied_blocks(model):
    if id(module) not in matched:
      _unapply(module)
  for block_type, hits in found.items():
    for _, module in hits:
      object.__setattr__(module, "__class__", _applied_class(original_class(module)))
      setattr(module, _TYPE, block_type)
      if layer_axes(jax.tree.leaves(nnx.state(module))):
        setattr(module, _STACKED, True)
  for _, block in applied_blocks(model):  # after every swap, so layers inside nested blocks are left to them
    setattr(block, _NAMED_PATHS, _named_paths(block, rule))
  validate_applied(model, spec, applied_block_types(model))  # names your model tags itself: checked when traced
  set_applied_policy(model, spec)
  return model


def checkpoint_names(model: nnx.Module, *args, **kwargs) -> dict[str, frozenset[str]]:
  """Every checkpoint name each block type of ``model`` emits, found by tracing ``model(*args, **kwargs)``.

  The automatic names (:mod:`jaxckpt.core._autonames`) are known without tracing (:func:`jaxckpt.block_types`); tracing
  also finds the names the model tags itself with ``checkpoint_name``. They are remembered on the blocks, so
  :func:`jaxckpt.set_policy` accepts them afterwards. Nothing is computed (``jax.eval_shape``) and the model's
  state is not changed.

  Args:
    model: an NNX model with blocks applied by :func:`apply_remat`.
    *args: its call's array arguments, arrays or ``jax.ShapeDtypeStruct`` (e.g. tokens ``[B, T] int32``).
    **kwargs: its call's keyword arguments (static flags such as ``deterministic=True``).

  Returns:
    ``{block_type: frozenset(names)}``.

  Raises:
    JaxckptError: ``model`` has no applied block.
  """
  if not applied_blocks(model):
    raise no_blocks_error(model, "checkpoint_names")
  graphdef, state = nnx.split(model)
  record: dict[str, set[str]] = {}
  token = _RECORD.set(record)
  try:
    jax.eval_shape(lambda st, *a: nnx.merge(graphdef, st)(*a, **kwargs), state, *args)
  finally:
    _RECORD.reset(token)
  learn_names(model, record)
  return applied_block_types(model)


def learn_names(model: nnx.Module, names: Mapping[str, Collection[str]]) -> None:
  """Teaches the applied blocks of ``model`` checkpoint names found by tracing (the model's own tags, the parts of
  its layers), so :func:`jaxckpt.set_policy` takes them: what :func:`checkpoint_names` does after its trace, for
  names traced elsewhere (a target's loss, :func:`loss_block_types`, on another instance of the same model).

  Args:
    model: an NNX model with blocks applied by :func:`apply_remat` (abstract is fine).
    names: block type -> checkpoint names its blocks emit; names of types the model does not have are ignored.
  """
  for _, block in applied_blocks(model):
    learned = set(names.get(getattr(block, _TYPE), ())) - {path_name(p) for p in _auto_name_paths(block)}
    if learned:
      setattr(block, _LEARNED, tuple(sorted(learned)))


def loss_block_types(make_model: Callable[[], nnx.Module], loss_fn: Callable[..., Any], batch: Any
                     ) -> dict[str, frozenset[str]]:
  """Block type -> checkpoint names of a model's applied blocks, found by tracing its loss on an abstract batch
  (automatic names and the names the model tags itself); nothing is allocated or computed.

  Args:
    make_model: ``() -> nnx.Module`` with blocks applied by :func:`apply_remat` (run under ``nnx.eval_shape``).
    loss_fn: jaxckpt's form ``loss_fn(model, batch, *, dropout_key, deterministic)``.
    batch: pytree of ``jax.ShapeDtypeStruct``.

  Returns:
    ``{block_type: frozenset(names)}`` (``{}`` for a model without applied blocks).
  """
  model = nnx.eval_shape(make_model)
  static = applied_block_types(model)
  if not static:
    return {}
  graphdef, state = nnx.split(model)
  record: dict[str, set[str]] = {}
  token = _RECORD.set(record)
  try:
    jax.eval_shape(lambda st, b: loss_fn(nnx.merge(graphdef, st), b, dropout_key=None, deterministic=False)[0],
                   state, batch)
  finally:
    _RECORD.reset(token)
  return {k: v | frozenset(record.get(k, ())) for k, v in static.items()}


def _path_key(path: tuple) -> list[tuple[int, Any]]:
  return [(0, p) if isinstance(p, int) else (1, str(p)) for p in path]


def applied_layers(model: nnx.Module) -> tuple[list[list[nnx.Module]], list[nnx.Module]]:
  """The applied blocks of ``model`` grouped into layers: blocks whose path holds a list index belong to the layer
  that index names (``layers/3/attn`` and ``layers/3/mlp`` are layer 3), in path order; the others (a head, a
  scanned stack's one stacked block) are returned apart.

  Returns:
    ``(layers, outside)``: a list of layers, each a list of blocks, and the blocks outside any layer.
  """
  groups: dict[tuple, list[nnx.Module]] = {}
  outside: list[nnx.Module] = []
  for path, block in applied_blocks(model):
    index = next((i for i, p in enumerate(path) if isinstance(p, int)), None)
    if index is None:
      outside.append(block)
    else:
      groups.setdefault(tuple(path[:index + 1]), []).append(block)
  return [groups[k] for k in sorted(groups, key=_path_key)], outside


def set_layered_policy(model: nnx.Module, layered: Any) -> None:
  """Gives layer i of ``model``'s applied blocks (:func:`applied_layers`) the spec of layer i of a
  :class:`~jaxckpt.policies.LayeredPolicy` (validated already); blocks outside layers get the first range's spec.

  Raises:
    JaxckptError: the model's blocks are not in separate layer instances (e.g. one scanned stack: give it one
      spec), or the policy covers another number of layers.
  """
  layers, outside = applied_layers(model)
  if not layers:
    raise JaxckptError(f"layered policy {str(layered)!r} needs separate layer instances (blocks in a list, such as "
                       f"layers[i]); the blocks of {type(model).__name__} are not in one (a scanned stack takes one "
                       "spec for all its layers)")
  if len(layers) != layered.num_layers:
    raise JaxckptError(f"layered policy {str(layered)!r} covers {layered.num_layers} layers but "
                       f"{type(model).__name__} has {len(layers)}: ranges must cover 0-{len(layers) - 1}")
  for blocks, spec in zip(layers, layered.layer_specs()):
    for block in blocks:
      setattr(block, _POLICY, spec)
  for block in outside:
    setattr(block, _POLICY, layered.segments[0][1])


def applied_block_type(module: Any) -> str | None:
  """The block type :func:`apply_remat` gave ``module``, or ``None`` when it is not an applied block."""
  return getattr(module, _TYPE, None) if is_applied(module) else None
