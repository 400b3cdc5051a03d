"""One set of verbs for both front-ends: ``apply_remat``, ``set_policy``, ``with_policy``, ``block_types``.

The Flax NNX front-end (:mod:`jaxckpt.nnx`) and the Flax Linen one (:mod:`jaxckpt.linen`) each register a
:class:`FrontEnd` when imported; the top-level verbs (``jaxckpt.apply_remat``, ...) pick the front-end that owns the
model and call it, so the same verb means the same thing on both:

- ``apply_remat(model, policy, blocks=...)``: your model with its blocks under remat, parameter tree unchanged
  (NNX: the same model object, its blocks' calls changed; Linen: a :class:`jaxckpt.linen.RematModule` wrapping it).
- ``set_policy(model, policy)``: changes the policy **in place** (NNX only: Linen modules are immutable, so for them
  it is an error naming ``with_policy``).
- ``with_policy(model, policy)``: returns a **copy** under another policy (both; an NNX copy shares the arrays).
- ``block_types(model, *example_inputs)``: block type -> the checkpoint names its blocks emit.

This module imports neither Flax front-end (the core floor stays framework-free); they register themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxckpt.errors import JaxckptError


@dataclasses.dataclass(frozen=True)
class FrontEnd:
  """What one front-end does for the top-level verbs.

  Attributes:
    name: ``"nnx"`` or ``"linen"``.
    owns: ``model -> bool``: whether a model belongs to this front-end.
    apply_remat: ``(model, policy, *, blocks, names=None) -> model``.
    with_policy: ``(model, policy) -> a copy under policy``.
    block_types: ``(model, *args, **kwargs) -> {block type: frozenset of checkpoint names}``.
    set_policy: ``(model, policy) -> the parsed policy``, changing the model in place; ``None`` where models are
      immutable (Linen).
  """

  name: str
  owns: Callable[[Any], bool]
  apply_remat: Callable[..., Any]
  with_policy: Callable[[Any, Any], Any]
  block_types: Callable[..., dict]
  set_policy: Callable[[Any, Any], Any] | None = None


_FRONT_ENDS: dict[str, FrontEnd] = {}


def register_front_end(front_end: FrontEnd) -> None:
  """Registers a front-end (``jaxckpt.nnx`` and ``jaxckpt.linen`` do, on import); a second one of that name
  replaces the first."""
  _FRONT_ENDS[front_end.name] = front_end


def front_end_of(model: Any, verb: str) -> FrontEnd:
  """The front-end owning ``model``.

  Raises:
    JaxckptError: no registered front-end owns it (the message names its type and the front-ends).
  """
  for front_end in _FRONT_ENDS.values():
    if front_end.owns(model):
      return front_end
  raise JaxckptError(f"jaxckpt.{verb} takes a Flax model ({' or '.join(sorted(_FRONT_ENDS)) or 'no front-end loaded'}"
                     f" module); got {type(model).__name__}")


def apply_remat(model: Any, policy: Any = "none", *, blocks: Any, names: Any = None) -> Any:
  """Makes the blocks of your own Flax model (NNX or Linen) run under remat with ``policy``; parameter paths kept.

  Args:
    model: an NNX module (changed in place and returned) or an unbound Linen module (wrapped: a
      :class:`jaxckpt.linen.RematModule` is returned).
    policy: a policy spec (``"dots_saveable"``, ``"attn=dots_saveable,mlp=full"``, ``"0-3:full;4-11:none"``).
    blocks: block type -> your block class, a tuple of classes, or a predicate ``(path, module) -> bool``.
    names: which submodules of a block get automatic checkpoint names (``None``/``"auto"``, ``"all"``, classes, or a
      predicate): :func:`jaxckpt.nnx.apply_remat`, :func:`jaxckpt.linen.apply_remat`.

  Returns:
    The model to train (NNX) or to ``init``/``apply`` (Linen).

  Raises:
    JaxckptError: ``model`` is no Flax module; what the front-end's ``apply_remat`` raises (malformed ``blocks``, a
      block type matching nothing).
    PolicySpecError: a malformed policy.
  """
  return front_end_of(model, "apply_remat").apply_remat(model, policy, blocks=blocks, names=names)


def set_policy(model: Any, policy: Any) -> Any:
  """Changes the policy of an NNX model's blocks **in place** (parameters untouched) and returns the parsed policy.

  Args:
    model: an NNX module with jaxckpt blocks or blocks from ``apply_remat``.
    policy: a concrete policy: a spec, a block map, or a layered policy.

  Returns:
    The parsed, validated policy.

  Raises:
    JaxckptError: ``model`` is a Linen module (immutable: the message names :func:`with_policy`), no Flax module, or
      what :func:`jaxckpt.nnx.set_policy` raises.
    PolicySpecError: a malformed policy, a block type or checkpoint name the model does not have.
  """
  front_end = front_end_of(model, "set_policy")
  if front_end.set_policy is None:
    raise JaxckptError(f"{type(model).__name__} is a Flax {front_end.name} module: {front_end.name} modules are "
                       "immutable, so set_policy cannot change it in place; use "
                       "model = jaxckpt.with_policy(model, policy), which returns a copy")
  return front_end.set_policy(model, policy)


def with_policy(model: Any, policy: Any) -> Any:
  """Returns a **copy** of ``model`` under another policy (NNX or Linen); ``model`` is unchanged.

  Args:
    model: an NNX module (the copy shares its arrays: nothing is allocated) or a Linen module with jaxckpt blocks,
      or the :class:`jaxckpt.linen.RematModule` of ``apply_remat``.
    policy: a concrete policy.

  Returns:
    The copy.

  Raises:
    JaxckptError, PolicySpecError: as :func:`set_policy` (a Linen model is fine here).
  """
  return front_end_of(model, "with_policy").with_policy(model, policy)


def block_types(model: Any, *args: Any, **kwargs: Any) -> dict[str, frozenset[str]]:
  """Block type -> the checkpoint names its blocks emit, for an NNX or Linen model.

  Args:
    model: an NNX module; or a Linen module with jaxckpt blocks, or the ``RematModule`` of ``apply_remat`` (then
      ``*args``/``**kwargs`` are what its ``init`` takes: an RNG key and example inputs, since Linen modules are
      known only once traced).

  Returns:
    ``{block type: frozenset(checkpoint names)}``.

  Raises:
    JaxckptError: no Flax module; a Linen ``RematModule`` without ``init`` arguments.
  """
  return front_end_of(model, "block_types").block_types(model, *args, **kwargs)
