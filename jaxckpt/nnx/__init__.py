"""The Flax NNX front-end: remat-wrapped blocks and stacks (:mod:`~jaxckpt.nnx.layers`), ``set_policy`` and
``block_types``, and remat for your own NNX model, unedited (:mod:`~jaxckpt.nnx.apply`).

Its twin for Flax Linen is :mod:`jaxckpt.linen`, file for file.
"""

from __future__ import annotations

from jaxckpt.nnx import apply, layers
from jaxckpt.nnx.layers import (
    RematBlock,
    AttentionBlock,
    MLPBlock,
    ConvBlock,
    TransformerBlock,
    Stack,
    block_types,
    remat_blocks,
    set_policy,
    record_stack_inputs,
    shared_block_traces,
    ATTENTION_IMPLEMENTATIONS,
)
from jaxckpt.nnx.apply import (
    BlockMatcher,
    apply_remat,
    applied_blocks,
    applied_block_types,
    set_applied_policy,
    checkpoint_names,
    loss_block_types,
    applied_layers,
    set_layered_policy,
    is_applied,
    original_class,
    model_classes,
    no_blocks_error,
)

__all__ = [
    "apply",
    "layers",
    "RematBlock",
    "AttentionBlock",
    "MLPBlock",
    "ConvBlock",
    "TransformerBlock",
    "Stack",
    "block_types",
    "remat_blocks",
    "set_policy",
    "record_stack_inputs",
    "shared_block_traces",
    "ATTENTION_IMPLEMENTATIONS",
    "BlockMatcher",
    "apply_remat",
    "applied_blocks",
    "applied_block_types",
    "set_applied_policy",
    "checkpoint_names",
    "loss_block_types",
    "applied_layers",
    "set_layered_policy",
    "is_applied",
    "original_class",
    "model_classes",
    "no_blocks_error",
]
