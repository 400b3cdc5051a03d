"""The Flax NNX front-end: remat-wrapped blocks and stacks, remat for your own NNX model unedited, and the verbs.

- Blocks and stacks (:mod:`~jaxckpt.nnx._layers`): :class:`AttentionBlock`, :class:`MLPBlock`, :class:`ConvBlock`,
  :class:`TransformerBlock` (attention + MLP), :class:`Stack` (``scan`` or unrolled layers, checkpoint structures).
- Your own model (:mod:`~jaxckpt.nnx._apply`): :func:`apply_remat` (blocks named by class; parameter paths kept),
  :func:`checkpoint_names`.
- The verbs, as for Linen: :func:`set_policy` (in place), :func:`with_policy` (a copy), :func:`block_types`; the
  top-level ``jaxckpt.set_policy`` / ``with_policy`` / ``block_types`` / ``apply_remat`` pick this front-end for an
  NNX model (:mod:`jaxckpt.core._frontends`).

Its twin for Flax Linen is :mod:`jaxckpt.linen`, file for file.
"""

from __future__ import annotations

from typing import Any

from flax import nnx as _nnx

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.core._frontends import FrontEnd as _FrontEnd, register_front_end as _register
from jaxckpt.errors import JaxckptError as _JaxckptError
from jaxckpt.nnx._apply import apply_remat, checkpoint_names
from jaxckpt.core._blocks import ATTENTION_IMPLEMENTATIONS
from jaxckpt.nnx._layers import (
    AttentionBlock,
    ConvBlock,
    MLPBlock,
    RematBlock,
    Stack,
    TransformerBlock,
    block_types,
    set_policy,
)


def with_policy(model: _nnx.Module, policy: Any) -> _nnx.Module:
  """Returns a copy of an NNX model under another policy; ``model`` keeps its own.

  The copy has its own module objects and ``nnx.Variable`` s over the same arrays (``nnx.merge(..., copy=True)`` of
  ``nnx.split(model)``: JAX arrays are immutable, so nothing is allocated); :func:`set_policy` then sets the policy
  on it. The counterpart of :func:`jaxckpt.linen.with_policy`.

  Args:
    model: an NNX module with jaxckpt blocks, or your model from :func:`apply_remat`.
    policy: a concrete policy (spec, block map or layered policy).

  Returns:
    The copy.

  Raises:
    PolicySpecError, JaxckptError: as :func:`set_policy`.
  """
  graphdef, state = _nnx.split(model)
  copy = _nnx.merge(graphdef, state, copy=True)
  set_policy(copy, policy)
  return copy


def _block_types(model: _nnx.Module, *args: Any, **kwargs: Any) -> dict[str, frozenset[str]]:
  if args or kwargs:
    raise _JaxckptError(f"block_types({type(model).__name__}) of an NNX model takes no example inputs (its blocks "
                        "are known without tracing); call block_types(model)")
  return block_types(model)


_register(_FrontEnd("nnx", lambda model: isinstance(model, _nnx.Module), apply_remat, with_policy, _block_types,
                    set_policy))

__all__ = [
    "AttentionBlock",
    "MLPBlock",
    "ConvBlock",
    "TransformerBlock",
    "Stack",
    "RematBlock",
    "ATTENTION_IMPLEMENTATIONS",
    "apply_remat",
    "checkpoint_names",
    "set_policy",
    "with_policy",
    "block_types",
]

__getattr__ = _forward_names(__name__, {
    **{name: ("jaxckpt.nnx._layers", name) for name in ("remat_blocks", "record_stack_inputs", "shared_block_traces")},
    **{name: ("jaxckpt.nnx._apply", name) for name in (
        "BlockMatcher", "applied_blocks", "applied_block_types", "set_applied_policy", "loss_block_types",
        "applied_layers", "set_layered_policy", "is_applied", "original_class", "model_classes", "no_blocks_error")},
})
