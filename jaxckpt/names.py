"""Checkpoint names: the tags jaxckpt's layers give their intermediates with ``jax.ad_checkpoint.checkpoint_name``.

A name-based policy (``save_only_these_names:qkv+mlp_hidden``) saves exactly the tagged values whose names it lists.
Every name a shipped layer emits is defined here, once; ``tests/nnx/test_layers.py`` checks that each is emitted.

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

# The LLM family's decoder layer (block type "decoder"): MaxText's checkpoint names at MaxText's places
# (AI-Hypercomputer/maxtext, layers/decoders.py, layers/attentions.py, layers/linears.py, layers/attention_op.py), so a
# plan made on jaxckpt's model reads as a MaxText config and back. S = sequence length, N = query heads, K = KV heads,
# Dh = head width, E = model width, M = MLP hidden width.
DECODER_LAYER_INPUT = "decoder_layer_input"
"""The decoder layer's input (the residual stream at the top of the scanned body), ``[B, S, E]``."""
QUERY_PROJ = "query_proj"
"""Queries after projection, RoPE and the query scale: what enters the attention kernel, ``[B, S, N, Dh]``."""
KEY_PROJ = "key_proj"
"""Keys after projection and RoPE, ``[B, S, K, Dh]``."""
VALUE_PROJ = "value_proj"
"""Values after projection, ``[B, S, K, Dh]``."""
CONTEXT = "context"
"""The attention kernel's residuals: the splash kernel's output and logsumexp (``residual_checkpoint_name``); the
output ``[B, S, N, Dh]`` of XLA's dot-product attention."""
OUT_PROJ = "out_proj"
"""The attention output projection, before the residual add, ``[B, S, E]``."""
MLPWI_0 = "mlpwi_0"
"""The gated MLP's gate projection, before the activation, ``[B, S, M]``."""
MLPWI_1 = "mlpwi_1"
"""The gated MLP's up (linear) projection, ``[B, S, M]``."""
MLPWO = "mlpwo"
"""The MLP's output projection, before the residual add, ``[B, S, E]``."""

DECODER_NAMES: tuple[str, ...] = (DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, CONTEXT, OUT_PROJ, MLPWI_0,
                                  MLPWI_1, MLPWO)
"""The checkpoint names of the LLM family's decoder layer, MaxText's names."""

# The experts of a Mixture-of-Experts layer (MaxText's layers/moe.py, commit e591f30c). Every expert matmul is tagged
# twice, as MaxText tags it: the inner tag is the dense MLP's name, so MaxText's presets that save mlpwi_0 / mlpwo
# (minimal…) save the experts' too; the outer one is the MoE knob's. X = experts, C = capacity per sequence (the
# dropping dispatch), T·k = tokens × experts per token (the dropless dispatch, tokens sorted by expert), F = each
# expert's hidden width.
MOE_MLPWI_0 = "moe_mlpwi_0"
"""The experts' gate projection, before the activation: ``[X, B, C, F]`` (dropping) or ``[T·k, F]`` (dropless);
tagged ``mlpwi_0`` inside."""
MOE_MLPWI_1 = "moe_mlpwi_1"
"""The experts' up projection: ``[X, B, C, F]`` (dropping, tagged ``mlpwi_1`` inside) or ``[T·k, F]`` (dropless: this
name only, as MaxText's sparse path tags it, so ``minimal`` does not save it there)."""
MOE_MLPWO = "moe_mlpwo"
"""The experts' output projection: ``[X, B, C, E]`` or ``[T·k, E]``; tagged ``mlpwo`` inside."""
MOE_X_SORTED = "moe_x_sorted"
"""Dropless dispatch: the tokens sorted by expert, what the first grouped matmul reads, ``[T·k, E]`` (MaxText's knob
``moe_x_sorted``)."""
MOE_ROUTING_MAPS = "moe_routing_maps"
"""Dropless dispatch: the routing metadata the backward pass needs to undo the sort: the sort order ``[T·k]`` int32,
the tokens per expert ``[X]`` int32 and the routing weights ``[T·k]`` float32 (MaxText's knob ``moe_routing_maps``)."""

MOE_NAMES: tuple[str, ...] = (MOE_MLPWI_0, MOE_MLPWI_1, MOE_MLPWO, MOE_X_SORTED, MOE_ROUTING_MAPS)
"""The checkpoint names only an MoE layer emits."""

# Multi-head latent attention (DeepSeek's MLA; MaxText's layers/attention_mla.py): R = a low rank.
QUERY_WA_PROJ = "query_wa_proj"
"""MLA: the query's low-rank projection, before its norm, ``[B, S, Rq]``."""
MLA_Q = "mla_q"
"""MLA: the normalised low-rank query, ``[B, S, Rq]``."""
KV_WA_PROJ = "kv_wa_proj"
"""MLA: the key/value latent and the shared RoPE key, before the norm, ``[B, S, Rkv + Dr]``."""
MLA_KV = "mla_kv"
"""MLA: the normalised key/value latent, ``[B, S, Rkv]``."""

MLA_NAMES: tuple[str, ...] = (QUERY_WA_PROJ, MLA_Q, KV_WA_PROJ, MLA_KV)
"""The checkpoint names only multi-head latent attention emits."""

ALL_NAMES: tuple[str, ...] = (QKV, ATTN_WEIGHTS, ATTN_CONTEXT, ATTN_OUT, MLP_HIDDEN, MLP_OUT, CONV_HIDDEN, CONV_OUT,
                              *DECODER_NAMES, *MOE_NAMES, *MLA_NAMES)
"""Every checkpoint name a shipped layer emits."""
