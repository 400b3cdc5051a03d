"""The Flax Linen front-end: the same blocks, math, parameter trees and policy strings as :mod:`jaxckpt.nnx`
(:mod:`~jaxckpt.linen.layers`), and remat for your own Linen model, unedited (:mod:`~jaxckpt.linen.apply`).

Its twin for Flax NNX is :mod:`jaxckpt.nnx`, file for file.
"""

from __future__ import annotations

from jaxckpt.linen import apply, layers
from jaxckpt.linen.layers import (
    apply_remat,
    RematBlock,
    AttentionBlock,
    MLPBlock,
    ConvBlock,
    TransformerBlock,
    Stack,
    block_types,
    with_policy,
    linen_params_from_nnx,
    nnx_update_from_linen,
)
from jaxckpt.linen.apply import (
    RematModule,
    traced_block_types,
)

__all__ = [
    "apply",
    "layers",
    "apply_remat",
    "RematBlock",
    "AttentionBlock",
    "MLPBlock",
    "ConvBlock",
    "TransformerBlock",
    "Stack",
    "block_types",
    "with_policy",
    "linen_params_from_nnx",
    "nnx_update_from_linen",
    "RematModule",
    "traced_block_types",
]
