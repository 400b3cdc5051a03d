"""The Flax Linen front-end: the same blocks, math, parameter trees and policy strings as :mod:`jaxckpt.nnx`
(:mod:`~jaxckpt.linen._layers`), and remat for your own Linen model, unedited (:mod:`~jaxckpt.linen._apply`).

The verbs, as for NNX: :func:`apply_remat` (your model -> a :class:`RematModule`), :func:`with_policy` (a copy under
another policy: Linen modules are immutable, so there is no in-place ``set_policy``), :func:`block_types`. The
top-level ``jaxckpt.apply_remat`` / ``with_policy`` / ``block_types`` pick this front-end for a Linen module
(:mod:`jaxckpt.core._frontends`).

Its twin for Flax NNX is :mod:`jaxckpt.nnx`, file for file.
"""

from __future__ import annotations

import flax.linen as _nn

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.core._frontends import FrontEnd as _FrontEnd, register_front_end as _register
from jaxckpt.linen._apply import RematModule, apply_remat
from jaxckpt.linen._layers import (
    AttentionBlock,
    ConvBlock,
    MLPBlock,
    RematBlock,
    Stack,
    TransformerBlock,
    block_types,
    linen_params_from_nnx,
    nnx_update_from_linen,
    with_policy,
)

_register(_FrontEnd("linen", lambda model: isinstance(model, (_nn.Module, RematModule)), apply_remat, with_policy,
                    block_types))

__all__ = [
    "AttentionBlock",
    "MLPBlock",
    "ConvBlock",
    "TransformerBlock",
    "Stack",
    "RematBlock",
    "RematModule",
    "apply_remat",
    "with_policy",
    "block_types",
    "linen_params_from_nnx",
    "nnx_update_from_linen",
]

__getattr__ = _forward_names(__name__, {"traced_block_types": ("jaxckpt.linen._apply", "traced_block_types")})
