"""The LLM family's layers (Flax NNX): RMSNorm, rotary embeddings, grouped-query attention, the gated MLP, the decoder
layer, and the decoder block, the one remat'd unit the layer stack scans.

Shapes: B = batch, S = tokens, E = model width, N = query heads, K = key/value heads, Dh = head width, M = MLP hidden
width. Every parameter carries logical axis names (``nnx.with_partitioning``; :mod:`jaxckpt.sharding._rules`), and
activations are constrained by name (:func:`jaxckpt.sharding._rules.constrain`, the identity without a mesh), so the
same layers run on one CPU and FSDP/tensor-sharded over a TPU slice. Parameters are kept in ``param_dtype`` (the
config's ``weight_dtype``) and cast to the compute ``dtype`` where they are used.

The decoder block (:class:`DecoderBlock`, block type ``decoder``) is one :class:`jaxckpt.nnx.RematBlock`: a policy
applies per block as MaxText's ``nn.remat(layer)`` does inside its ``nn.scan``. It tags MaxText's checkpoint names at
MaxText's places (:data:`jaxckpt.names.DECODER_NAMES`; AI-Hypercomputer/maxtext ``layers/decoders.py``,
``layers/attentions.py``, ``layers/linears.py``), so a plan made here reads as a MaxText ``remat_policy`` and back.
The layout follows the Llama and Gemma papers and Flax's NNX Gemma example (``examples/gemma/modules.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt import names
from jaxckpt.sharding._rules import constrain
from jaxckpt.models._configs import dtype_named
from jaxckpt.models.llm import _kernels as kernels
from jaxckpt.models.llm._config import LLAMA31_ROPE_SCALING, LLMConfig
from jaxckpt.nnx._layers import PolicyLike, RematBlock

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
"""Logical names of the residual stream ``[B, S, E]``."""
QUERY_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
"""Logical names of queries and attention outputs ``[B, S, N, Dh]``."""
KV_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
"""Logical names of keys and values ``[B, S, K, Dh]``."""
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")
"""Logical names of the MLP's hidden activations ``[B, S, M]``."""


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> nnx.Param:
  """A parameter of ``shape`` and ``dtype`` whose axes carry the logical names ``axes`` (not sharded when made)."""
  return nnx.Param(nnx.with_partitioning(init, axes, eager_sharding=False)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm: ``x / sqrt(mean(x²) + eps) · (offset + scale)`` over the last axis, in float32.

  Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Gemma's variant multiplies by ``1 + scale`` with the
  scale starting at 0 (``scale_offset=1``), Llama's by ``scale`` starting at 1 (``scale_offset=0``).

  Args:
    dim: width E of ``x: [..., E]``.
    eps: added to the mean square.
    scale_offset: 0 (Llama) or 1 (Gemma).
    dtype: output dtype (the compute dtype).
    param_dtype: dtype of the ``[E]`` scale (logical axis ``norm``).
    rngs: initialisation keys (keyword-only; the scale is constant-initialised).
  """

  def __init__(self, dim: int, *, eps: float, scale_offset: float = 0.0, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    init = nnx.initializers.zeros if scale_offset else nnx.initializers.ones
    self.scale = _param(rngs, init, (dim,), ("norm",), param_dtype)
    self.eps, self.scale_offset, self.dtype = eps, scale_offset, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [..., E]`` (any float dtype) -> ``[..., E]`` in ``dtype``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (self.scale_offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: str | None = None) -> np.ndarray:
  """RoPE's rotation frequencies (radians per token) for the ``head_dim / 2`` channel pairs.

  ``theta ** (-2i / head_dim)`` (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding");
  with ``scaling="llama3.1"`` the low frequencies are divided by 8, smoothly between wavelengths of 2048 and 8192
  tokens (:data:`jaxckpt.models.llm._config.LLAMA31_ROPE_SCALING`).

  Args:
    head_dim: Dh, even.
    theta: the base wavelength (tokens).
    scaling: ``None`` or ``"llama3.1"``.

  Returns:
    ``[Dh / 2]`` float64 numpy array.
  """
  freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return freqs
  s = LLAMA31_ROPE_SCALING
  wavelength = 2 * math.pi / freqs
  long_, short = s["original_max_position"] / s["low_freq_factor"], s["original_max_position"] / s["high_freq_factor"]
  smooth = (s["original_max_position"] / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"]
                                                                                - s["low_freq_factor"])
  between = (1 - smooth) * freqs / s["factor"] + smooth * freqs
  return np.where(wavelength < short, freqs, np.where(wavelength > long_, freqs / s["factor"], between))


def apply_rope(x: jax.Array, freqs: np.ndarray) -> jax.Array:
  """Rotates channel pairs ``(i, i + Dh/2)`` of every head by ``position · freqs[i]`` (positions ``0 .. S-1``).

  Args:
    x: ``[B, S, H, Dh]`` queries or keys, any float dtype.
    freqs: ``[Dh / 2]`` (:func:`rope_frequencies`).

  Returns:
    ``[B, S, H, Dh]``, the dtype of ``x`` (rotated in float32).
  """
  positions = jnp.arange(x.shape[1], dtype=jnp.float32)
  angles = positions[:, None] * jnp.asarray(freqs, jnp.float32)[None, :]  # [S, Dh/2]
  sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, behind the kernel seam (:func:`jaxckpt.models.llm._kernels.attention`).

  Parameters (logical names): ``query [E, N, Dh]`` (embed, heads, head_dim), ``key`` and ``value [E, K, Dh]`` (embed,
  kv_heads, head_dim), ``out [N, Dh, E]`` (heads, head_dim, embed); no biases. Tags ``query_proj`` ``[B, S, N, Dh]``
  (after RoPE and the query scale), ``key_proj`` ``[B, S, K, Dh]`` (after RoPE), ``value_proj`` ``[B, S, K, Dh]``
  (what enters the kernel, as MaxText tags them), ``context`` (the kernel's) and ``out_proj`` ``[B, S, E]``.
  Ainslie et al. 2023 (GQA).

  Args:
    dim: model width E.
    num_heads: N, a multiple of ``num_kv_heads``.
    num_kv_heads: K.
    head_dim: Dh (even).
    query_scale: the factor queries are multiplied by (``head_dim ** -0.5`` when ``None``).
    sliding_window: local attention over this many tokens, or ``None`` (global).
    logit_soft_cap: attention soft cap, or ``None``.
    rope_theta: RoPE base wavelength (tokens).
    rope_scaling: ``None`` or ``"llama3.1"``.
    kernel: ``"auto"``, ``"xla"`` or ``"splash"``.
    splash_blocks: the splash kernel's block sizes, or ``None`` for its default.
    splash_interpret: the splash kernel in interpret mode.
    dtype: compute dtype.
    param_dtype: parameter dtype.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, query_scale: float | None = None,
               sliding_window: int | None = None, logit_soft_cap: float | None = None, rope_theta: float = 10_000.0,
               rope_scaling: str | None = None, kernel: str = "auto",
               splash_blocks: kernels.SplashBlockSizes | None = None, splash_interpret: bool = False,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    heads_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
    heads_out = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
    self.query = _param(rngs, heads_in, (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype)
    self.key = _param(rngs, heads_in, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.value = _param(rngs, heads_in, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.out = _param(rngs, heads_out, (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), param_dtype)
    self.query_scale = head_dim ** -0.5 if query_scale is None else query_scale
    self.head_dim, self.rope_theta, self.rope_scaling = head_dim, rope_theta, rope_scaling
    self.sliding_window, self.logit_soft_cap, self.kernel = sliding_window, logit_soft_cap, kernel
    self.splash_blocks, self.splash_interpret, self.dtype = splash_blocks, splash_interpret, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype, normalised) -> ``[B, S, E]`` (compute dtype), causal."""
    dtype = self.dtype
    q = constrain(jnp.einsum("bse,enh->bsnh", x, self.query[...].astype(dtype)), QUERY_AXES)
    k = constrain(jnp.einsum("bse,ekh->bskh", x, self.key[...].astype(dtype)), KV_AXES)
    v = constrain(jnp.einsum("bse,ekh->bskh", x, self.value[...].astype(dtype)), KV_AXES)
    freqs = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
    q = (apply_rope(q, freqs) * jnp.asarray(self.query_scale, dtype)).astype(dtype)
    k = apply_rope(k, freqs)
    q = checkpoint_name(q, names.QUERY_PROJ)  # [B, S, N, Dh]: what enters the kernel
    k = checkpoint_name(k, names.KEY_PROJ)  # [B, S, K, Dh]
    v = checkpoint_name(v, names.VALUE_PROJ)  # [B, S, K, Dh]
    context = kernels.attention(q, k, v, kernel=self.kernel, causal=True, sliding_window=self.sliding_window,
                                logit_soft_cap=self.logit_soft_cap, splash_blocks=self.splash_blocks,
                                splash_interpret=self.splash_interpret)
    context = constrain(context, QUERY_AXES)  # [B, S, N, Dh]
    out = jnp.einsum("bsnh,nhe->bse", context, self.out[...].astype(dtype))
    return checkpoint_name(constrain(out, EMBED_AXES), names.OUT_PROJ)  # [B, S, E]


class GatedMLP(nnx.Module):
  """Gated MLP ``wo · (act(wi_0 · x) ⊙ (wi_1 · x))``: SwiGLU with ``silu``, GeGLU with ``gelu`` (tanh-approximate).

  Shazeer 2020, "GLU Variants Improve Transformer". Parameters: ``wi_0`` (gate) and ``wi_1`` (up) ``[E, M]`` (embed,
  mlp), ``wo [M, E]`` (mlp, embed). Tags ``mlpwi_0`` and ``mlpwi_1`` ``[B, S, M]`` (before the activation) and
  ``mlpwo`` ``[B, S, E]``, MaxText's names (``"mlp" + "wi_{i}"``).

  Args:
    dim: model width E.
    mlp_dim: hidden width M.
    activation: ``"silu"`` or ``"gelu"``.
    dtype: compute dtype.
    param_dtype: parameter dtype.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, dim: int, mlp_dim: int, *, activation: str = "silu", dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    self.wi_0 = _param(rngs, init, (dim, mlp_dim), ("embed", "mlp"), param_dtype)
    self.wi_1 = _param(rngs, init, (dim, mlp_dim), ("embed", "mlp"), param_dtype)
    self.wo = _param(rngs, init, (mlp_dim, dim), ("mlp", "embed"), param_dtype)
    self.activation, self.dtype = activation, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]`` (compute dtype)."""
    dtype = self.dtype
    gate = checkpoint_name(constrain(jnp.einsum("bse,em->bsm", x, self.wi_0[...].astype(dtype)), MLP_AXES),
                           names.MLPWI_0)
    up = checkpoint_name(constrain(jnp.einsum("bse,em->bsm", x, self.wi_1[...].astype(dtype)), MLP_AXES),
                         names.MLPWI_1)
    act = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    out = jnp.einsum("bsm,me->bse", act * up, self.wo[...].astype(dtype))
    return checkpoint_name(constrain(out, EMBED_AXES), names.MLPWO)


class DecoderLayer(nnx.Module):
  """One pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with ``post_norms`` (Gemma 2) each
  sublayer's output is normalised again before its residual add.

  Parameters: ``pre_attention_norm``, ``attention`` (:class:`Attention`), ``post_attention_norm`` (``None``
  without post norms), ``pre_mlp_norm``, ``mlp`` (:class:`GatedMLP`), ``post_mlp_norm``.

  Args:
    config: the model's :class:`~jaxckpt.models.llm.LLMConfig` (widths, heads, norms, kernel, dtypes).
    kind: ``"global"`` (causal over every earlier token) or ``"local"`` (the last ``config.sliding_window``).
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, config: LLMConfig, kind: str = "global", *, rngs: nnx.Rngs):
    dtype = dtype_named(config.compute_dtype, argument="compute_dtype")
    param_dtype = dtype_named(config.weight_dtype, argument="weight_dtype")

    def norm() -> RMSNorm:
      return RMSNorm(config.dim, eps=config.norm_eps, scale_offset=config.norm_scale_offset, dtype=dtype,
                     param_dtype=param_dtype, rngs=rngs)

    self.pre_attention_norm = norm()
    self.attention = Attention(
        config.dim, config.num_heads, config.num_kv_heads, config.head_dim, query_scale=config.query_scale,
        sliding_window=config.sliding_window if kind == "local" else None,
        logit_soft_cap=config.attn_logit_softcap, rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        kernel=config.attention, splash_blocks=config.splash_blocks, splash_interpret=config.splash_interpret,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_norm = norm() if config.post_norms else None
    self.pre_mlp_norm = norm()
    self.mlp = GatedMLP(config.dim, config.mlp_dim, activation=config.mlp_activation, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)
    self.post_mlp_norm = norm() if config.post_norms else None
    self.kind = kind

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]`` (compute dtype)."""
    h = self.attention(self.pre_attention_norm(x))
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = constrain(x + h, EMBED_AXES)
    h = self.mlp(self.pre_mlp_norm(x))
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return constrain(x + h, EMBED_AXES)


class DecoderBlock(RematBlock):
  """The scanned unit of the decoder: one :class:`DecoderLayer` per entry of ``config.layer_pattern``, remat'd as one
  block (block type ``decoder``).

  Llama, Mistral and Gemma have one global layer per block; Gemma 2 a local then a global layer, as MaxText scans
  Gemma 2's pairs. The block input is tagged ``decoder_layer_input`` ``[B, S, E]`` at the top of the block (MaxText
  tags it once per scanned layer); every layer tags ``query_proj``, ``key_proj``, ``value_proj``, ``context``,
  ``out_proj``, ``mlpwi_0``, ``mlpwi_1`` and ``mlpwo``. With the splash kernel ``context`` names its residuals (output
  and logsumexp), with xla attention its output.

  Args:
    config: the model's :class:`~jaxckpt.models.llm.LLMConfig`.
    policy: policy spec (the ``decoder`` entry applies), usually set later with :func:`jaxckpt.set_policy`.
    rngs: initialisation keys (keyword-only).

  Example::

    >>> block = DecoderBlock(LLM_PRESETS["llama-tiny"], policy="save_only_these_names:query_proj", rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 64, 64))).shape
    (2, 64, 64)
  """

  block_type = "decoder"
  checkpoint_names = names.DECODER_NAMES

  def __init__(self, config: LLMConfig, *, policy: PolicyLike = None, rngs: nnx.Rngs):
    super().__init__(policy)
    self.sublayers = nnx.List([DecoderLayer(config, kind, rngs=rngs) for kind in config.layer_pattern])

  def forward(self, x: jax.Array, dropout_key: jax.Array | None, deterministic: bool) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]``; no dropout (``dropout_key`` and ``deterministic`` are
    accepted for the block protocol)."""
    x = checkpoint_name(constrain(x, EMBED_AXES), names.DECODER_LAYER_INPUT)
    for i, layer in enumerate(self.sublayers):
      with jax.named_scope(f"{layer.kind}_{i}"):
        x = layer(x)
    return x
