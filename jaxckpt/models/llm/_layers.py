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
from jaxckpt.models.llm._moe import MoE, MoEDispatch
from jaxckpt.models.llm._params import param as _param
from jaxckpt.nnx._layers import PolicyLike, RematBlock

EMBED_AXES = ("activation_batch", "activation_length", "activation_embed")
"""Logical names of the residual stream ``[B, S, E]``."""
QUERY_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
"""Logical names of queries and attention outputs ``[B, S, N, Dh]``."""
KV_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
"""Logical names of keys and values ``[B, S, K, Dh]``."""
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")
"""Logical names of the MLP's hidden activations ``[B, S, M]``."""


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
    qk_norm: RMSNorm over each head's Dh channels of q and k before RoPE (Qwen3; parameters ``query_norm``,
      ``key_norm [Dh]``, epsilon ``norm_eps``).
    norm_eps: the qk norms' epsilon.
    dtype: compute dtype.
    param_dtype: parameter dtype.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, query_scale: float | None = None,
               sliding_window: int | None = None, logit_soft_cap: float | None = None, rope_theta: float = 10_000.0,
               rope_scaling: str | None = None, kernel: str = "auto",
               splash_blocks: kernels.SplashBlockSizes | None = None, splash_interpret: bool = False,
               qk_norm: bool = False, norm_eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
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
    norm = lambda: RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)  # noqa: E731
    self.query_norm, self.key_norm = (norm(), norm()) if qk_norm else (None, None)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype, normalised) -> ``[B, S, E]`` (compute dtype), causal."""
    dtype = self.dtype
    q = constrain(jnp.einsum("bse,enh->bsnh", x, self.query[...].astype(dtype)), QUERY_AXES)
    k = constrain(jnp.einsum("bse,ekh->bskh", x, self.key[...].astype(dtype)), KV_AXES)
    v = constrain(jnp.einsum("bse,ekh->bskh", x, self.value[...].astype(dtype)), KV_AXES)
    if self.query_norm is not None:
      q, k = self.query_norm(q), self.key_norm(k)
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


class LatentAttention(nnx.Module):
  """Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", §2.1): keys and values from one compressed
  latent per token, queries from a low-rank one, RoPE on a few channels per head with one RoPE key shared by the heads.

  Parameters (logical names): with ``q_lora_rank`` Rq > 0 ``query_a [E, Rq]`` (embed, q_lora), ``query_a_norm [Rq]``,
  ``query_b [Rq, N, Dh + Dr]`` (q_lora, heads, head_dim), else ``query [E, N, Dh + Dr]``; ``kv_a [E, Rkv + Dr]``
  (embed, kv_lora), ``kv_a_norm [Rkv]``, ``kv_b [Rkv, N, Dh + Dv]`` (kv_lora, heads, head_dim), ``out [N, Dv, E]``.
  Tags MaxText's names (``layers/attention_mla.py``): ``query_wa_proj`` and ``mla_q`` (the low-rank query before and
  after its norm), ``kv_wa_proj`` (latent and RoPE key), ``mla_kv`` (the normalised latent), then ``query_proj``,
  ``key_proj`` ``[B, S, N, Dh + Dr]``, ``value_proj`` ``[B, S, N, Dv]``, ``context`` and ``out_proj``. Queries are
  scaled by ``(Dh + Dr) ** -0.5`` (DeepSeek-V3's YaRN rescaling is left out). A kernel that needs one head width
  (splash, the GPU kernels) gets values zero-padded to Dh + Dr and its output cut back to Dv.

  Args:
    config: the model's :class:`~jaxckpt.models.llm.LLMConfig` (``head_dim`` Dh, ``qk_rope_head_dim`` Dr,
      ``v_head_dim`` Dv, ``q_lora_rank``, ``kv_lora_rank``, RoPE, kernel, dtypes).
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, config: LLMConfig, *, rngs: nnx.Rngs):
    dtype = dtype_named(config.compute_dtype, argument="compute_dtype")
    param_dtype = dtype_named(config.weight_dtype, argument="weight_dtype")
    e, n, dh, dr, dv = config.dim, config.num_heads, config.head_dim, config.qk_rope_head_dim, config.v_head_dim
    rq, rkv = config.q_lora_rank, config.kv_lora_rank
    fan_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    heads_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
    heads_out = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)

    def norm(width: int) -> RMSNorm:
      return RMSNorm(width, eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    if rq:
      self.query_a = _param(rngs, fan_in, (e, rq), ("embed", "q_lora"), param_dtype)
      self.query_a_norm = norm(rq)
      self.query_b = _param(rngs, heads_in, (rq, n, dh + dr), ("q_lora", "heads", "head_dim"), param_dtype)
      self.query = None
    else:
      self.query_a = self.query_a_norm = self.query_b = None
      self.query = _param(rngs, heads_in, (e, n, dh + dr), ("embed", "heads", "head_dim"), param_dtype)
    self.kv_a = _param(rngs, fan_in, (e, rkv + dr), ("embed", "kv_lora"), param_dtype)
    self.kv_a_norm = norm(rkv)
    self.kv_b = _param(rngs, heads_in, (rkv, n, dh + dv), ("kv_lora", "heads", "head_dim"), param_dtype)
    self.out = _param(rngs, heads_out, (n, dv, e), ("heads", "head_dim", "embed"), param_dtype)
    self.head_dim, self.rope_dim, self.v_head_dim, self.kv_rank = dh, dr, dv, rkv
    self.rope_theta, self.rope_scaling, self.kernel = config.rope_theta, config.rope_scaling, config.attention
    self.splash_blocks, self.splash_interpret, self.dtype = config.splash_blocks, config.splash_interpret, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype, normalised) -> ``[B, S, E]`` (compute dtype), causal."""
    dtype, dh = self.dtype, self.head_dim
    if self.query_a is not None:
      low = checkpoint_name(jnp.einsum("bse,er->bsr", x, self.query_a[...].astype(dtype)), names.QUERY_WA_PROJ)
      low = checkpoint_name(self.query_a_norm(low), names.MLA_Q)  # [B, S, Rq]
      q = jnp.einsum("bsr,rnh->bsnh", low, self.query_b[...].astype(dtype))
    else:
      q = jnp.einsum("bse,enh->bsnh", x, self.query[...].astype(dtype))
    q = constrain(q, QUERY_AXES)  # [B, S, N, Dh + Dr]
    kv = checkpoint_name(jnp.einsum("bse,er->bsr", x, self.kv_a[...].astype(dtype)), names.KV_WA_PROJ)
    latent, k_rope = kv[..., :self.kv_rank], kv[..., self.kv_rank:]  # [B, S, Rkv], [B, S, Dr]
    latent = checkpoint_name(self.kv_a_norm(latent), names.MLA_KV)
    kv = constrain(jnp.einsum("bsr,rnh->bsnh", latent, self.kv_b[...].astype(dtype)), QUERY_AXES)
    k_nope, v = kv[..., :dh], kv[..., dh:]  # [B, S, N, Dh], [B, S, N, Dv]
    freqs = rope_frequencies(self.rope_dim, self.rope_theta, self.rope_scaling)
    q = jnp.concatenate([q[..., :dh], apply_rope(q[..., dh:], freqs)], axis=-1)
    k_rope = jnp.broadcast_to(apply_rope(k_rope[:, :, None, :], freqs), (*k_nope.shape[:3], self.rope_dim))
    k = jnp.concatenate([k_nope, k_rope], axis=-1)  # [B, S, N, Dh + Dr]
    q = (q * jnp.asarray((dh + self.rope_dim) ** -0.5, dtype)).astype(dtype)
    q = checkpoint_name(q, names.QUERY_PROJ)
    k = checkpoint_name(k, names.KEY_PROJ)
    v = checkpoint_name(v, names.VALUE_PROJ)
    context = kernels.attention(q, k, v, kernel=self.kernel, causal=True, splash_blocks=self.splash_blocks,
                                splash_interpret=self.splash_interpret)
    context = constrain(context, QUERY_AXES)  # [B, S, N, Dv]
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

  Parameters: ``pre_attention_norm``, ``attention`` (:class:`Attention`, or :class:`LatentAttention` with
  ``kv_lora_rank``), ``post_attention_norm`` (``None`` without post norms), ``pre_mlp_norm``, ``mlp`` (:class:`GatedMLP`,
  or in an MoE layer :class:`~jaxckpt.models.llm.MoE`), ``shared_mlp`` (an MoE layer's shared experts as one
  :class:`GatedMLP` of ``shared_experts · F``, else ``None``), ``post_mlp_norm``.

  Args:
    config: the model's :class:`~jaxckpt.models.llm.LLMConfig` (widths, heads, norms, kernel, experts, dtypes).
    kind: ``"global"`` (causal over every earlier token) or ``"local"`` (the last ``config.sliding_window``).
    experts: an MoE layer (``config.num_experts`` experts) or a dense one.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, config: LLMConfig, kind: str = "global", *, experts: bool = False, rngs: nnx.Rngs):
    dtype = dtype_named(config.compute_dtype, argument="compute_dtype")
    param_dtype = dtype_named(config.weight_dtype, argument="weight_dtype")

    def norm() -> RMSNorm:
      return RMSNorm(config.dim, eps=config.norm_eps, scale_offset=config.norm_scale_offset, dtype=dtype,
                     param_dtype=param_dtype, rngs=rngs)

    self.pre_attention_norm = norm()
    if config.is_mla:
      self.attention = LatentAttention(config, rngs=rngs)
    else:
      self.attention = Attention(
          config.dim, config.num_heads, config.num_kv_heads, config.head_dim, query_scale=config.query_scale,
          sliding_window=config.sliding_window if kind == "local" else None,
          logit_soft_cap=config.attn_logit_softcap, rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
          kernel=config.attention, splash_blocks=config.splash_blocks, splash_interpret=config.splash_interpret,
          qk_norm=config.qk_norm, norm_eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_norm = norm() if config.post_norms else None
    self.pre_mlp_norm = norm()
    if experts:
      self.mlp = MoE(config.dim, config.expert_dim, config.num_experts, config.experts_per_token,
                     dispatch=config.moe_dispatch, capacity_factor=config.capacity_factor, router=config.router,
                     routed_scale=config.routed_scale, activation=config.mlp_activation,
                     gmm_interpret=config.gmm_interpret, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.shared_mlp = GatedMLP(config.dim, config.shared_experts * config.expert_dim,
                                 activation=config.mlp_activation, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs) if config.shared_experts else None
    else:
      self.mlp = GatedMLP(config.dim, config.mlp_dim, activation=config.mlp_activation, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
      self.shared_mlp = None
    self.post_mlp_norm = norm() if config.post_norms else None
    self.kind = kind

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]`` (compute dtype)."""
    h = self.attention(self.pre_attention_norm(x))
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = constrain(x + h, EMBED_AXES)
    normed = self.pre_mlp_norm(x)
    h = constrain(self.mlp(normed), EMBED_AXES)
    if self.shared_mlp is not None:
      h = h + self.shared_mlp(normed)
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return constrain(x + h, EMBED_AXES)


def decoder_checkpoint_names(config: LLMConfig, *, experts: bool = False) -> tuple[str, ...]:
  """The checkpoint names a decoder block of ``config`` emits: MaxText's decoder names (:data:`jaxckpt.names.
  DECODER_NAMES`), MLA's with ``kv_lora_rank``, and in an MoE block the experts' (:data:`jaxckpt.names.MOE_NAMES`;
  the dropping dispatch has no ``moe_x_sorted`` or ``moe_routing_maps``, and the dropless one tags the experts' up
  projection ``moe_mlpwi_1`` only, so its block emits ``mlpwi_1`` only through shared experts)."""
  out = list(names.DECODER_NAMES)
  if config.is_mla:
    out += [n for n in names.MLA_NAMES if config.q_lora_rank or n not in (names.QUERY_WA_PROJ, names.MLA_Q)]
  if experts and config.moe_dispatch is MoEDispatch.DROPPING:
    out += [names.MOE_MLPWI_0, names.MOE_MLPWI_1, names.MOE_MLPWO]
  elif experts:
    out += list(names.MOE_NAMES)
    if not config.shared_experts:  # the dropless experts' up projection is moe_mlpwi_1 alone
      out.remove(names.MLPWI_1)
  return tuple(out)


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
    experts: its layers are MoE layers (:func:`decoder_checkpoint_names` gives the names they add).
    policy: policy spec (the ``decoder`` entry applies), usually set later with :func:`jaxckpt.set_policy`.
    rngs: initialisation keys (keyword-only).

  Example::

    >>> block = DecoderBlock(LLM_PRESETS["llama-tiny"], policy="save_only_these_names:query_proj", rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 64, 64))).shape
    (2, 64, 64)
  """

  block_type = "decoder"
  checkpoint_names = names.DECODER_NAMES

  def __init__(self, config: LLMConfig, *, experts: bool = False, policy: PolicyLike = None, rngs: nnx.Rngs):
    super().__init__(policy)
    self.sublayers = nnx.List([DecoderLayer(config, kind, experts=experts, rngs=rngs)
                               for kind in config.layer_pattern])
    self.checkpoint_names = decoder_checkpoint_names(config, experts=experts)

  def forward(self, x: jax.Array, dropout_key: jax.Array | None, deterministic: bool) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]``; no dropout (``dropout_key`` and ``deterministic`` are
    accepted for the block protocol)."""
    x = checkpoint_name(constrain(x, EMBED_AXES), names.DECODER_LAYER_INPUT)
    for i, layer in enumerate(self.sublayers):
      with jax.named_scope(f"{layer.kind}_{i}"):
        x = layer(x)
    return x
