"""Remat wrappers: wrap any function or NNX module with a policy spec in one call.

``jax.checkpoint`` (alias ``jax.remat``) makes the backward pass recompute a function's intermediates instead of
storing them, except those the policy saves (JAX docs, "Gradient checkpointing"; Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"). The wrappers here take jaxckpt's policy strings (:mod:`jaxckpt.policies`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jaxckpt.errors import JaxckptError, StaticArgumentError, closest, shorten
from jaxckpt.policies._spec import DEFAULT_BLOCK, SAVE_TENSORS, Policy, PolicySpec, parse_policy
from jaxckpt.policies._meaning import check_policy
from jaxckpt.core._autonames import tag_parts
from jaxckpt.sharding._gather import constrain_batch, gather_block_state, gathering
from jaxckpt.core._tagging import tag_values

_REMAT_CALLS: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("jaxckpt_remat_calls", default=None)


@contextlib.contextmanager
def remat_calls() -> Iterator[list[bool]]:
  """Yields a list that gets one entry each time a jaxckpt remat wrapper puts a block under ``jax.checkpoint`` while
  the body traces (:func:`jaxckpt.training._xla.watch_remat` warns when such a step is compiled on CPU without the
  remat compiler option)."""
  seen: list[bool] = []
  token = _REMAT_CALLS.set(seen)
  try:
    yield seen
  finally:
    _REMAT_CALLS.reset(token)


def note_remat() -> None:
  """Records (at trace time) that a remat wrapper put a block under ``jax.checkpoint``, for :func:`remat_calls`."""
  seen = _REMAT_CALLS.get()
  if seen is not None:
    seen.append(True)


def _policy_for(spec: "str | Policy | PolicySpec | None", block_type: str) -> Policy:
  return parse_policy(spec).for_block(block_type)


def _static_argnums(value: Any) -> tuple[int, ...]:
  if isinstance(value, int) and not isinstance(value, bool):
    return (value,)
  if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
    return tuple(value)
  raise StaticArgumentError(f"static_argnums must be an int or a tuple of ints (positions of static arguments), "
                            f"got {value!r}")


def _static_argnames(value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  if isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise StaticArgumentError(f"static_argnames must be a str or a tuple of str (names of static keyword arguments), "
                            f"got {value!r}")


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
  """``fn``'s parameters, or ``None`` when its signature cannot be read (builtins, some C callables)."""
  try:
    return list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_static_names(fn: Callable, names: tuple[str, ...], params: list[inspect.Parameter] | None) -> None:
  """Every name in ``static_argnames`` can be passed by keyword to ``fn``."""
  if params is None or not names:
    return
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return
  by_name = {p.name: p for p in params}
  keyword = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     inspect.Parameter.KEYWORD_ONLY)]
  fn_name = getattr(fn, "__name__", type(fn).__name__)
  for name in names:
    if name in by_name and by_name[name].kind is inspect.Parameter.POSITIONAL_ONLY:
      index = params.index(by_name[name])
      raise StaticArgumentError(
          f"static_argnames names {name!r}, a positional-only parameter of {fn_name}: it cannot be passed by keyword; "
          f"declare it static_argnums=({index},) instead", argument=name)
    if name not in by_name:
      message = (f"static_argnames names {name!r}, which is not a parameter of {fn_name}; its keyword parameters: "
                 f"{', '.join(keyword) or '(none)'}")
      if (close := closest(name, keyword)) is not None:
        message += f"; did you mean {close!r}?"
      raise StaticArgumentError(message, argument=name)


def _reject_tracer(name: str, value: Any, how: str) -> None:
  if isinstance(value, jax.core.Tracer):
    raise StaticArgumentError(
        f"static argument {name!r} ({how}) got a traced value {shorten(repr(value), 60)}; a static argument is a "
        f"Python value (bool, int, str, tuple…) read while tracing: pass a Python value, or drop it from "
        f"static_argnums/static_argnames so that it is traced like an array", argument=name)


def _check_call(
    fn_name: str,
    params: list[inspect.Parameter] | None,
    argnums: tuple[int, ...],
    argnames: tuple[str, ...],
    args: tuple,
    kwargs: dict[str, Any],
) -> None:
  """Raises :class:`StaticArgumentError` when a call passes a static argument another way than it is declared."""
  positional = [p.name for p in params if p.kind in _POSITIONAL] if params is not None else []
  for i in argnums:
    index = i if i >= 0 else len(args) + i
    if 0 <= index < len(args):
      name = positional[index] if index < len(positional) else f"#{index}"
      _reject_tracer(name, args[index], f"static_argnums position {i}")
      continue
    name = positional[i] if 0 <= i < len(positional) else None
    if name is not None and name in kwargs:
      raise StaticArgumentError(
          f"argument {name!r} of {fn_name} is declared static by position (static_argnums={argnums}) but was passed "
          f"by keyword ({name}={shorten(repr(kwargs[name]), 40)}); pass it positionally (as argument {i}), or declare "
          f"it by name: static_argnames=({name!r},)", argument=name)
    label = f"{i} ({name!r})" if name is not None else str(i)
    raise StaticArgumentError(
        f"static_argnums={argnums} declares positional argument {label} of {fn_name} static, but the call passed "
        f"{len(args)} positional argument(s); pass it positionally, or declare static arguments passed by keyword "
        f"with static_argnames", argument=name or f"#{i}")
  for name in argnames:
    if name in kwargs:
      _reject_tracer(name, kwargs[name], "static_argnames")
    elif name in positional and positional.index(name) < len(args):
      index = positional.index(name)
      raise StaticArgumentError(
          f"argument {name!r} of {fn_name} is declared static by name (static_argnames={argnames}) but was passed "
          f"positionally (argument {index}); pass it by keyword ({name}=...), or declare it by position: "
          f"static_argnums=({index},)", argument=name)


def checkpoint(
    fn: Callable,
    policy: "str | Policy | PolicySpec | None",
    *,
    block_type: str = DEFAULT_BLOCK,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    static_argnames: str | tuple[str, ...] = (),
) -> Callable:
  """Wraps a pure JAX function in ``jax.checkpoint`` with a jaxckpt policy (or returns it unchanged for ``none``).

  Static arguments are Python values (flags such as ``train=True``) that the function reads while it is traced, e.g.
  in an ``if``; they are not traced and not differentiated. Declare those passed by position with
  ``static_argnums`` and those passed by keyword with ``static_argnames``. Keyword static arguments are bound to
  ``fn`` (``functools.partial``) before ``jax.checkpoint`` sees it, so they stay Python values (JAX 0.10's own
  ``jax.checkpoint(static_argnames=...)`` is accepted but ignored: the keyword is traced). Closing over static
  values (``lambda x: fn(x, train=True)``) is the other way (JAX docs, ``jax.checkpoint``).

  Args:
    fn: a function of arrays/pytrees (use :func:`remat` or :class:`Remat` for NNX modules).
    policy: a policy spec (:func:`jaxckpt.parse_policy`); with a block map, the policy of ``block_type`` is used.
      A JAX policy (a ``jax.checkpoint_policies`` member or a predicate ``(prim, *avals, **params) -> bool``) is
      passed to ``jax.checkpoint`` as it is; under JAX's next remat (``JAX_REMAT3=1``) only JAX's policy objects
      are, a predicate is refused (remat3 would run it as full remat).
    block_type: which block type ``fn`` is, for block maps (default: the map's ``default`` policy).
    prevent_cse: passed to ``jax.checkpoint``.
    static_argnums: positions of static arguments passed positionally (int or tuple of ints; negative counts from
      the end), as ``jax.checkpoint``'s.
    static_argnames: names of static arguments passed by keyword (str or tuple of str).

  Returns:
    The wrapped function, same signature. For ``none`` (no remat) it is ``fn`` itself.

  Raises:
    PolicySpecError: a malformed spec; under remat3, a callable policy that is not one of JAX's policy objects.
    StaticArgumentError: ``static_argnums``/``static_argnames`` malformed, or a name that is not a keyword parameter
      of ``fn``. When the wrapped function is called: a static argument passed the other way than declared (by
      keyword while declared in ``static_argnums``, positionally while declared in ``static_argnames``), a declared
      position the call does not reach, or a traced value given as a static argument; the message names the
      argument and the fix.

  Example::

    >>> def block(w, x, *, train):
    ...   return jnp.tanh(x @ w) * (0.5 if train else 1.0)
    >>> ck = checkpoint(block, "dots_saveable", static_argnames="train")
    >>> y = ck(w, x, train=True)
  """
  argnums, argnames = _static_argnums(static_argnums), _static_argnames(static_argnames)
  params = _parameters(fn)
  _check_static_names(fn, argnames, params)
  fn_name = getattr(fn, "__name__", type(fn).__name__)
  if callable(policy) and not isinstance(policy, (str, Policy, PolicySpec)):
    # A JAX policy object or predicate, as jax.checkpoint takes it: remat3 honours only JAX's policy objects.
    jax_policy = check_policy(policy, what="the policy passed to jaxckpt.checkpoint")
  else:
    chosen = _policy_for(policy, block_type)
    if not chosen.remat:
      return fn
    if chosen.name == SAVE_TENSORS:
      fn = tag_values(fn, chosen.names)
    jax_policy = chosen.to_jax()
  if not argnums and not argnames:
    return jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    _check_call(fn_name, params, argnums, argnames, args, kwargs)
    static = {name: kwargs.pop(name) for name in argnames if name in kwargs}
    bound = functools.partial(fn, **static) if static else fn
    return jax.checkpoint(bound, policy=jax_policy, prevent_cse=prevent_cse, static_argnums=argnums)(*args, **kwargs)

  return wrapped


def module_call(method: Callable[..., Any], policy: Policy, *, prevent_cse: bool = True,
                share_traces: bool = False, parts: bool = False) -> Callable[..., Any]:
  """Returns ``call(module, *args)`` that runs ``method(module, *args)`` under ``jax.checkpoint(policy=...)``.

  The module is split into graphdef and state, and the state goes into the checkpointed function as an argument, so
  the recomputation sees the same parameters and RNG state (same dropout masks) and the call works wherever the
  module's variables were created (eagerly or inside a trace). Non-parameter state the method changes (batch
  statistics, RNG counters) is written back to ``module`` after the call. ``none`` returns ``method`` unchanged.

  Args:
    method: ``(module, *args) -> output``; static flags are closed over.
    policy: the :class:`~jaxckpt.Policy` to apply.
    prevent_cse: passed to ``jax.checkpoint``.
    share_traces: modules of one graph definition go through one ``jax.checkpoint`` function, so JAX's trace cache
      traces ``method`` once for all of them (the layers of an unrolled stack); ``method`` must then depend on the
      module's graph and state only. Not for ``save_tensors`` (it tags values per module).
    parts: name the parts of the module's named layers (:func:`jaxckpt.core._autonames.tag_parts`; a policy that saves
      ``mlp.0``); the policy's names are checked against the parts found.
  """
  if not policy.remat:
    return functools.partial(_gathered_call, method)
  jax_policy = policy.to_jax()
  shared: dict[Any, Callable[..., Any]] = {}  # graph definition -> its jax.checkpoint function (share_traces)

  def call(module: nnx.Module, *args):
    note_remat()  # a train step traced under nnx.jit on CPU then warns (jaxckpt.training._xla.watch_remat)
    graphdef, state = nnx.split(module)
    checkpointed = shared.get(graphdef) if share_traces else None
    if checkpointed is None:
      def pure(state, *args):
        state = gather_block_state(state)  # FSDP per block, inside the checkpoint: gathered again in the backward pass
        inner = nnx.merge(graphdef, state)
        out = method(inner, *args)
        return out, nnx.state(inner, nnx.Not(nnx.Param))

      fn = tag_values(pure, policy.names, owner=module) if policy.name == SAVE_TENSORS else pure
      if parts and policy.name != SAVE_TENSORS:
        fn = tag_parts(fn, policy.checkpoint_names, spec=str(policy))
      checkpointed = jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse)
      if share_traces and policy.name != SAVE_TENSORS:
        shared[graphdef] = checkpointed
    out, updates = checkpointed(state, *constrain_batch(args))
    nnx.update(module, updates)
    return constrain_batch(out)

  return call


def _gathered_call(method: Callable[..., Any], module: nnx.Module, *args) -> Any:
  """``method(module, *args)`` for a block without remat (policy ``none``). Under a mesh with an ``fsdp`` axis the
  block's parameters are gathered first (:func:`jaxckpt.sharding._gather.gather_block_state`) inside a
  ``jax.checkpoint(nothing_saveable)`` of the gather alone: the backward pass gathers again instead of keeping every
  layer's gathered parameters (FSDP re-gathers, ZeRO stage 3); the block's activations are kept, as ``none`` says."""
  if not gathering():
    return method(module, *args)
  graphdef, state = nnx.split(module)
  state = jax.checkpoint(gather_block_state, policy=jax.checkpoint_policies.nothing_saveable)(state)
  inner = nnx.merge(graphdef, state)
  out = method(inner, *constrain_batch(args))
  nnx.update(module, nnx.state(inner, nnx.Not(nnx.Param)))
  return constrain_batch(out)


class Remat(nnx.Module):
  """An NNX module whose call is rematerialized with a jaxckpt policy.

  ``Remat(module, "dots_saveable")(x)`` computes ``module(x)`` inside ``nnx.remat``: in the backward pass its
  intermediates are recomputed except those the policy saves. Static flags (``deterministic=True``…) are passed as
  keyword arguments and closed over, never traced.

  Args:
    module: any NNX module (its ``__call__`` is wrapped).
    policy: a policy spec string, :class:`~jaxckpt.Policy` or :class:`~jaxckpt.PolicySpec`.
    block_type: the block type this module is, for block maps (default: the map's ``default``).

  Raises:
    PolicySpecError: a malformed spec.
    JaxckptError: ``module`` is not an NNX module or has no ``__call__``.
  """

  def __init__(self, module: nnx.Module, policy: "str | Policy | PolicySpec | None", *, block_type: str = DEFAULT_BLOCK):
    if not isinstance(module, nnx.Module):
      raise JaxckptError(
          f"Remat wraps an flax.nnx.Module, got {type(module).__name__}; for a plain function use "
          "jaxckpt.checkpoint(fn, policy), for Linen use the blocks of jaxckpt.linen"
      )
    if not callable(module):
      raise JaxckptError(
          f"{type(module).__name__} has no __call__ to rematerialize; wrap the method you call with "
          "jaxckpt.checkpoint(lambda m, *a: m.method(*a), policy) through nnx.remat instead"
      )
    self.module = module
    self.block_type = block_type
    self.policy = parse_policy(policy)

  def __call__(self, *args, **kwargs) -> Any:
    """Calls the wrapped module; array arguments are positional, static flags keyword arguments."""
    policy = self.policy.for_block(self.block_type)
    call = module_call(lambda module, *a: module(*a, **kwargs), policy)
    return call(self.module, *args)


def remat(
    target: "Callable | nnx.Module",
    policy: "str | Policy | PolicySpec | None",
    *,
    block_type: str = DEFAULT_BLOCK,
    static_argnums: int | tuple[int, ...] = (),
    static_argnames: str | tuple[str, ...] = (),
) -> "Callable | Remat":
  """Wraps a function or an NNX module with a policy spec: the one-call entry point.

  Args:
    target: an NNX module (returns a :class:`Remat` module) or a pure function (returns
      ``jax.checkpoint(fn, policy=...)``, or ``fn`` itself for ``none``).
    policy: a policy spec string such as ``"dots_saveable"`` or ``"save_only_these_names:qkv"``.
    block_type: which block type the target is, for block maps.
    static_argnums, static_argnames: for a function, as :func:`checkpoint`. A module's keyword arguments are
      always static (closed over), so these must be empty for a module.

  Returns:
    The wrapped module or function.

  Raises:
    PolicySpecError: a malformed spec.
    JaxckptError: ``target`` is neither callable nor an NNX module; a module class (NNX or Linen) or a Linen module
      (use :func:`jaxckpt.apply_remat` / :func:`jaxckpt.linen.apply_remat`, which keep parameter paths).
    StaticArgumentError: as :func:`checkpoint`, or static arguments declared for a module.

  Example::

    >>> mlp = jaxckpt.remat(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "nothing_saveable")
    >>> y = mlp(jnp.ones((2, 4)))
  """
  if isinstance(target, nn.Module) or (isinstance(target, type) and issubclass(target, (nn.Module, nnx.Module))):
    linen = isinstance(target, nn.Module) or issubclass(target, nn.Module)
    name, kind = (target.__name__, "class") if isinstance(target, type) else (type(target).__name__, "instance")
    raise JaxckptError(f"remat got the {'Linen' if linen else 'NNX'} module {kind} "
                       f"{name}: name your block classes instead, jaxckpt.{'linen.' if linen else ''}apply_remat("
                       f"model, policy, blocks={{'block': {name}}}) (parameter paths stay as they are)")
  if isinstance(target, nnx.Module):
    if static_argnums or static_argnames:
      raise StaticArgumentError(
          f"remat of an NNX module ({type(target).__name__}) takes no static_argnums/static_argnames (got "
          f"{static_argnums!r}/{static_argnames!r}): pass static flags as keyword arguments of the call, "
          f"Remat(...)(x, train=True); they are always closed over, never traced")
    return Remat(target, policy, block_type=block_type)
  if not callable(target):
    raise JaxckptError(f"remat needs a function or an flax.nnx.Module, got {type(target).__name__}: {target!r}")
  return checkpoint(target, policy, block_type=block_type, static_argnums=static_argnums,
                    static_argnames=static_argnames)
