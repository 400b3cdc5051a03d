"""Remat wrappers: wrap any function or NNX module with a policy spec in one call.

``jax.checkpoint`` (alias ``jax.remat``) makes the backward pass recompute a function's intermediates instead of
storing them, except those the policy saves (JAX docs, "Gradient checkpointing"; Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"). The wrappers here take jaxckpt's policy strings (:mod:`jaxckpt.policies`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.policies import DEFAULT_BLOCK, SAVE_TENSORS, Policy, PolicySpec, parse_policy
from jaxckpt.tagging import tag_values

__all__ = ["checkpoint", "remat", "Remat"]


def _policy_for(spec: "str | Policy | PolicySpec | None", block_type: str) -> Policy:
  return parse_policy(spec).for_block(block_type)


def checkpoint(
    fn: Callable,
    policy: "str | Policy | PolicySpec | None",
    *,
    block_type: str = DEFAULT_BLOCK,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable:
  """Wraps a pure JAX function in ``jax.checkpoint`` with a jaxckpt policy (or returns it unchanged for ``none``).

  Args:
    fn: a function of arrays/pytrees (use :func:`remat` or :class:`Remat` for NNX modules).
    policy: a policy spec (:func:`jaxckpt.parse_policy`); with a block map, the policy of ``block_type`` is used.
    block_type: which block type ``fn`` is, for block maps (default: the map's ``default`` policy).
    prevent_cse: passed to ``jax.checkpoint``.
    static_argnums: passed to ``jax.checkpoint`` (prefer closing over static Python values).

  Returns:
    The wrapped function, same signature.

  Raises:
    PolicySpecError: a malformed spec (see :func:`jaxckpt.parse_policy`).

  Example::

    >>> block = checkpoint(lambda w, x: jnp.tanh(x @ w), "dots_saveable")
  """
  chosen = _policy_for(policy, block_type)
  if not chosen.remat:
    return fn
  if chosen.name == SAVE_TENSORS:
    fn = tag_values(fn, chosen.names)
  return jax.checkpoint(fn, policy=chosen.to_jax(), prevent_cse=prevent_cse, static_argnums=static_argnums)


def module_call(method: Callable[..., Any], policy: Policy, *, prevent_cse: bool = True) -> Callable[..., Any]:
  """Returns ``call(module, *args)`` that runs ``method(module, *args)`` under ``jax.checkpoint(policy=...)``.

  The module is split into graphdef and state, and the state goes into the checkpointed function as an argument, so
  the recomputation sees the same parameters and RNG state (same dropout masks) and the call works wherever the
  module's variables were created (eagerly or inside a trace). Non-parameter state the method changes (batch
  statistics, RNG counters) is written back to ``module`` after the call. ``none`` returns ``method`` unchanged.

  Args:
    method: ``(module, *args) -> output``; static flags are closed over.
    policy: the :class:`~jaxckpt.Policy` to apply.
    prevent_cse: passed to ``jax.checkpoint``.
  """
  if not policy.remat:
    return method
  jax_policy = policy.to_jax()

  def call(module: nnx.Module, *args):
    graphdef, state = nnx.split(module)

    def pure(state, *args):
      inner = nnx.merge(graphdef, state)
      out = method(inner, *args)
      return out, nnx.state(inner, nnx.Not(nnx.Param))

    fn = tag_values(pure, policy.names, owner=module) if policy.name == SAVE_TENSORS else pure
    out, updates = jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse)(state, *args)
    nnx.update(module, updates)
    return out

  return call


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
) -> "Callable | Remat":
  """Wraps a function or an NNX module with a policy spec: the one-call entry point.

  Args:
    target: an NNX module (returns a :class:`Remat` module) or a pure function (returns
      ``jax.checkpoint(fn, policy=...)``, or ``fn`` itself for ``none``).
    policy: a policy spec string such as ``"dots_saveable"`` or ``"save_only_these_names:qkv"``.
    block_type: which block type the target is, for block maps.

  Returns:
    The wrapped module or function.

  Raises:
    PolicySpecError: a malformed spec.
    JaxckptError: ``target`` is neither callable nor an NNX module.

  Example::

    >>> mlp = jaxckpt.remat(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "nothing_saveable")
    >>> y = mlp(jnp.ones((2, 4)))
  """
  if isinstance(target, nnx.Module):
    return Remat(target, policy, block_type=block_type)
  if not callable(target):
    raise JaxckptError(f"remat needs a function or an flax.nnx.Module, got {type(target).__name__}: {target!r}")
  return checkpoint(target, policy, block_type=block_type)
