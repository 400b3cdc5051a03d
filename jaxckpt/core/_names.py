"""Checkpoint names: the tags jaxckpt's layers give their intermediates with ``jax.ad_checkpoint.checkpoint_name``.

A name-based policy (``save_only_these_names:qkv+mlp_hidden``) saves exactly the tagged values whose names it lists.
Every name a shipped layer emits is defined here, once; ``tests/test_layers.py`` checks that each is emitted.

Shapes use B = batch, T = tokens, D = model width, H = heads, K = head width (D / H), F = MLP hidden width,
h/w/C = image height, width and channels.
"""

from __future__ import annotations

# Attention block (block type "attn").
QKV = "qkv"
"""Fused query/key/value projection, ``[B, T, 3, H, K]``."""
ATTN_WEIGHTS = "attn_weights"
"""Attention weights after softmax (and dropout), ``[B, H, T, T]``."""
ATTN_CONTEXT = "attn_context"
"""Weighted sum of values before the output projection, ``[B, T, H, K]``."""
ATTN_OUT = "attn_out"
"""Output projection of the attention block, before the residual add, ``[B, T, D]``."""

# MLP block (block type "mlp").
MLP_HIDDEN = "mlp_hidden"
"""MLP hidden activation after the nonlinearity, ``[..., F]``."""
MLP_OUT = "mlp_out"
"""MLP output projection, before the residual add, ``[..., D]``."""

# Convolution block (block type "conv").
CONV_HIDDEN = "conv_hidden"
"""First convolution's activation after the nonlinearity, ``[B, h, w, C]``."""
CONV_OUT = "conv_out"
"""Second convolution's output, before the residual add, ``[B, h, w, C]``."""

ALL_NAMES: tuple[str, ...] = (QKV, ATTN_WEIGHTS, ATTN_CONTEXT, ATTN_OUT, MLP_HIDDEN, MLP_OUT, CONV_HIDDEN, CONV_OUT)
"""Every checkpoint name a shipped layer emits."""
