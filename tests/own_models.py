"""Models written the way public Flax example code writes them, NOT built from jaxckpt blocks (tests only).

- :class:`Decoder` (NNX): a decoder in the style of an NNX LM example: a Python list of layers, einsum attention
  (``q_einsum``, ``kv_einsum``, ``attn_vec_einsum``), a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``), RMSNorm,
  and ``nnx.Dropout`` drawing from the model's own ``nnx.Rngs``.
- :class:`LinenTransformerLM` (Linen): a Transformer LM in the style of a Linen LM example: ``nn.compact``
  submodules, a ``deterministic`` flag, ``nn.Dropout`` from the ``'dropout'`` RNG stream.
- :class:`DiT` (NNX): a diffusion transformer as the DiT paper's code writes it (Peebles & Xie 2023,
  facebookresearch/DiT ``models.py``): patch embedding, timestep and label conditioning, adaLN-Zero blocks
  (``adaLN_modulation`` = SiLU + Linear to 6 × hidden: shift/scale/gate for attention and MLP), timm-style attention
  (one fused ``qkv`` Linear, ``proj``) and MLP (``fc1``, ``fc2``), a final adaLN layer; blocks in a Python list or,
  with ``scan_blocks``, stacked with ``nnx.vmap`` and applied with ``nnx.scan``. :meth:`DiTConfig.tiny` keeps
  DiT-XL/2's head dim 72 (hidden 144, 2 heads).
- :class:`Llama` (NNX): a Llama as Hugging Face's Flax Llama names it (``embed_tokens``, ``self_attn.q_proj`` ...
  ``o_proj``, ``mlp.gate_proj``/``up_proj``/``down_proj``, ``input_layernorm``), with rotary embeddings and grouped
  query attention, its layers stacked with ``nnx.vmap`` (kernels ``[L, in, out]``) and applied with ``nnx.scan``
  (``scan_layers=False``: a Python list).

Written for these tests; tiny by default (d=32, 2 layers, seq 8).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 2, 8, 4


# ----------------------------------------------------------------------------------------------------------- NNX


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(jnp.zeros((dim,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1.0 + self.scale[...])


class Attention(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads, self.head_dim = heads, dim // heads
    self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (dim, heads, self.head_dim), rngs=rngs)
    self.kv_einsum = nnx.Einsum("BSD,CDNH->CBSNH", (2, dim, heads, self.head_dim), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (heads, self.head_dim, dim), rngs=rngs)

  def __call__(self, x):
    q = self.q_einsum(x)                                   # [B, T, N, H]
    k, v = self.kv_einsum(x)                               # [B, S, N, H] each
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(self.head_dim)
    t = x.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    probs = jax.nn.softmax(logits, axis=-1)
    return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", probs, v))


class FeedForward(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  def __init__(self, dim: int, heads: int, hidden: int, dropout: float, *, rngs: nnx.Rngs):
    self.pre_attention_norm = RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, heads, rngs=rngs)
    self.pre_ffw_norm = RMSNorm(dim, rngs=rngs)
    self.mlp = FeedForward(dim, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x, *, deterministic: bool = False):
    x = x + self.dropout(self.attn(self.pre_attention_norm(x)), deterministic=deterministic)
    return x + self.dropout(self.mlp(self.pre_ffw_norm(x)), deterministic=deterministic)


class Decoder(nnx.Module):
  def __init__(self, *, vocab=VOCAB, dim=DIM, heads=HEADS, hidden=HIDDEN, layers=LAYERS, dropout=0.1,
               rngs: nnx.Rngs):
    self.embedder = nnx.Embed(vocab, dim, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(dim, heads, hidden, dropout, rngs=rngs) for _ in range(layers)])
    self.final_norm = RMSNorm(dim, rngs=rngs)

  def __call__(self, tokens, *, deterministic: bool = False):
    x = self.embedder(tokens)                              # [B, T, D]
    for layer in self.layers:
      x = layer(x, deterministic=deterministic)
    return self.embedder.attend(self.final_norm(x))        # [B, T, V]


def decoder_loss(model: Decoder, batch) -> jax.Array:
  """Plain next-token cross-entropy; dropout from the model's own Rngs."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def decoder_batch(seed: int = 1, batch: int = BATCH, seq: int = SEQ):
  return {"tokens": jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, VOCAB)}


class ScannedDecoder(nnx.Module):
  """The same layers stacked with ``nnx.vmap`` (one dropout RNG stream per layer) and applied with ``nnx.scan``."""

  def __init__(self, *, vocab=VOCAB, dim=DIM, heads=HEADS, hidden=HIDDEN, layers=LAYERS, dropout=0.1,
               rngs: nnx.Rngs):
    self.embedder = nnx.Embed(vocab, dim, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return DecoderLayer(dim, heads, hidden, dropout, rngs=rngs)

    self.layers = create(rngs)
    self.final_norm = RMSNorm(dim, rngs=rngs)

  def __call__(self, tokens, *, deterministic: bool = False):
    x = self.embedder(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x, deterministic=deterministic)

    x = body(x, self.layers)
    return self.embedder.attend(self.final_norm(x))


# ----------------------------------------------------------------------------------------------------------- DiT


@dataclasses.dataclass(frozen=True)
class DiTConfig:
  """A DiT's dimensions (facebookresearch/DiT ``models.py``: ``DiT_XL_2`` is depth 28, hidden 1152, 16 heads, patch
  2 on 32 × 32 × 4 latents)."""

  input_size: int = 8             # latent height = width, in latent pixels
  patch_size: int = 2             # patch side, in latent pixels: (input_size / patch_size)² tokens
  in_channels: int = 4            # latent channels (Stable Diffusion's VAE: 4)
  hidden_size: int = 144          # model width D
  depth: int = 2                  # DiT blocks
  num_heads: int = 2              # attention heads; head dim = hidden_size / num_heads (72 here, as DiT-XL/2's)
  mlp_ratio: float = 4.0          # MLP width / D
  num_classes: int = 10           # class labels (one more table row: the classifier-free guidance null label)
  learn_sigma: bool = True        # the output has 2 × in_channels channels: ε and the variance's interpolation
  adaln_zero: bool = True         # the adaLN modulations and the final layer start at zero (adaLN-Zero); False:
                                  # Xavier like the other Linears, so every gradient is nonzero from the first step
  scan_blocks: bool = False       # blocks stacked with nnx.vmap and applied with nnx.scan; False: a Python list
  dtype: str = "float32"          # compute dtype of the Linears, the attention and the patch embedding

  @classmethod
  def tiny(cls, **overrides) -> "DiTConfig":
    return cls(**overrides)

  @classmethod
  def xl_2(cls, **overrides) -> "DiTConfig":
    """DiT-XL/2: 675M parameters."""
    return cls(**{"input_size": 32, "hidden_size": 1152, "depth": 28, "num_heads": 16, "num_classes": 1000,
                  **overrides})


def modulate(x, shift, scale):
  """adaLN: ``x`` [B, N, D] scaled and shifted by per-example ``shift``, ``scale`` [B, D]."""
  return x * (1 + scale[:, None]) + shift[:, None]


def _xavier():
  return nnx.initializers.xavier_uniform()


class TimestepEmbedder(nnx.Module):
  """Sinusoidal frequencies of the diffusion timestep through a two-layer MLP."""

  def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, *, dtype, rngs: nnx.Rngs):
    self.frequency_embedding_size = frequency_embedding_size
    init = nnx.initializers.normal(0.02)
    self.mlp = nnx.Sequential(nnx.Linear(frequency_embedding_size, hidden_size, kernel_init=init, dtype=dtype,
                                         rngs=rngs),
                              nnx.silu,
                              nnx.Linear(hidden_size, hidden_size, kernel_init=init, dtype=dtype, rngs=rngs))

  @staticmethod
  def timestep_embedding(t, dim: int, max_period: int = 10000):
    """``t`` [B] -> [B, dim] float32: cosines then sines of ``t`` at geometric frequencies (as GLIDE's)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)

  def __call__(self, t):                                   # t: [B] int32
    return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))  # [B, D]


class DiTAttention(nnx.Module):
  """timm's ``Attention``: one fused ``qkv`` projection, softmax attention over every token, ``proj``."""

  def __init__(self, dim: int, num_heads: int, *, dtype, rngs: nnx.Rngs):
    self.num_heads, self.head_dim = num_heads, dim // num_heads
    self.qkv = nnx.Linear(dim, 3 * dim, kernel_init=_xavier(), dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, kernel_init=_xavier(), dtype=dtype, rngs=rngs)

  def __call__(self, x):                                   # x: [B, N, D]
    b, n, d = x.shape
    qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]     # [B, N, H, hd] each
    logits = jnp.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(self.head_dim)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhnm,bmhd->bnhd", probs, v)          # [B, N, H, hd]
    return self.proj(out.reshape(b, n, d))


class DiTMlp(nnx.Module):
  """timm's ``Mlp``: ``fc1``, GELU (tanh), ``fc2``."""

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, hidden, kernel_init=_xavier(), dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, kernel_init=_xavier(), dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class DiTBlock(nnx.Module):
  """A DiT block with adaptive layer norm zero (adaLN-Zero) conditioning."""

  def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, *, zero: bool, dtype, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(hidden_size, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
    self.attn = DiTAttention(hidden_size, num_heads, dtype=dtype, rngs=rngs)
    self.norm2 = nnx.LayerNorm(hidden_size, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
    self.mlp = DiTMlp(hidden_size, int(hidden_size * mlp_ratio), dtype=dtype, rngs=rngs)
    init = nnx.initializers.zeros_init() if zero else _xavier()
    self.adaLN_modulation = nnx.Sequential(  # pylint: disable=invalid-name - the public code's name
        nnx.silu, nnx.Linear(hidden_size, 6 * hidden_size, kernel_init=init, dtype=dtype, rngs=rngs))

  def __call__(self, x, c):                                # x: [B, N, D] tokens, c: [B, D] conditioning
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(self.adaLN_modulation(c), 6, axis=1)
    x = x + gate_msa[:, None] * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
    return x + gate_mlp[:, None] * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nnx.Module):
  """adaLN, then a Linear to each patch's pixels."""

  def __init__(self, hidden_size: int, patch_size: int, out_channels: int, *, zero: bool, dtype, rngs: nnx.Rngs):
    init = nnx.initializers.zeros_init() if zero else _xavier()
    self.norm_final = nnx.LayerNorm(hidden_size, epsilon=1e-6, use_scale=False, use_bias=False, rngs=rngs)
    self.linear = nnx.Linear(hidden_size, patch_size * patch_size * out_channels, kernel_init=init, dtype=dtype,
                             rngs=rngs)
    self.adaLN_modulation = nnx.Sequential(  # pylint: disable=invalid-name
        nnx.silu, nnx.Linear(hidden_size, 2 * hidden_size, kernel_init=init, dtype=dtype, rngs=rngs))

  def __call__(self, x, c):
    shift, scale = jnp.split(self.adaLN_modulation(c), 2, axis=1)
    return self.linear(modulate(self.norm_final(x), shift, scale))  # [B, N, p * p * C_out]


def sincos_pos_embed(dim: int, grid: int) -> np.ndarray:
  """The fixed 2-D sine-cosine position embedding of MAE and DiT: [grid * grid, dim] float32."""
  def one_d(d, pos):
    omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)

  w, h = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
  return np.concatenate([one_d(dim // 2, h), one_d(dim // 2, w)], axis=1).astype(np.float32)


class DiT(nnx.Module):
  """A diffusion transformer: latents, timesteps and labels -> predicted noise (and variance) per latent pixel."""

  def __init__(self, cfg: DiTConfig = DiTConfig(), *, rngs: nnx.Rngs):
    self.cfg = cfg
    dtype, d, p = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.patch_size
    self.out_channels = cfg.in_channels * 2 if cfg.learn_sigma else cfg.in_channels
    self.x_embedder = nnx.Conv(cfg.in_channels, d, kernel_size=(p, p), strides=(p, p), padding="VALID",
                               kernel_init=_xavier(), dtype=dtype, rngs=rngs)
    self.t_embedder = TimestepEmbedder(d, dtype=dtype, rngs=rngs)
    self.y_embedder = nnx.Embed(cfg.num_classes + 1, d, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

    def block(rngs):
      return DiTBlock(d, cfg.num_heads, cfg.mlp_ratio, zero=cfg.adaln_zero, dtype=dtype, rngs=rngs)

    if cfg.scan_blocks:
      self.blocks = nnx.split_rngs(splits=cfg.depth)(nnx.vmap(block, in_axes=(0,), out_axes=0))(rngs)
    else:
      self.blocks = nnx.List([block(rngs) for _ in range(cfg.depth)])
    self.final_layer = FinalLayer(d, p, self.out_channels, zero=cfg.adaln_zero, dtype=dtype, rngs=rngs)

  def __call__(self, x, t, y):                             # x: [B, H, W, C] latents, t: [B] int32, y: [B] int32
    cfg = self.cfg
    x = self.x_embedder(x.astype(jnp.dtype(cfg.dtype)))   # [B, H/p, W/p, D]
    b, gh, gw, d = x.shape
    x = x.reshape(b, gh * gw, d) + sincos_pos_embed(d, gh).astype(x.dtype)  # [B, N, D]
    c = self.t_embedder(t) + self.y_embedder(y)           # [B, D]
    if cfg.scan_blocks:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x, c)

      x = body(x, self.blocks)
    else:
      for block in self.blocks:
        x = block(x, c)
    x = self.final_layer(x, c)                             # [B, N, p * p * C_out]
    p, ch = cfg.patch_size, self.out_channels
    x = x.reshape(b, gh, gw, p, p, ch).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, gh * p, gw * p, ch).astype(jnp.float32)  # [B, H, W, C_out]


DIFFUSION_STEPS = 1000


def dit_loss(model: DiT, batch) -> jax.Array:
  """DiT's training loss, the ε-prediction mean squared error of DDPM (Ho et al. 2020) on the linear β schedule
  (1e-4 to 0.02 over 1000 steps): the latents noised to step ``t``, the model's ε against the noise. (DiT adds a
  variational bound term for the learned variance; left out here.)

  Args:
    batch: ``{"latents": [B, H, W, C] float32, "labels": [B] int32, "t": [B] int32 in [0, 1000), "noise": [B, H, W,
      C] float32}`` (timesteps and noise drawn by the input pipeline, so a step is deterministic).
  """
  alphas_cumprod = jnp.cumprod(1.0 - jnp.linspace(1e-4, 0.02, DIFFUSION_STEPS, dtype=jnp.float32))
  ab = alphas_cumprod[batch["t"]][:, None, None, None]
  x_t = jnp.sqrt(ab) * batch["latents"] + jnp.sqrt(1.0 - ab) * batch["noise"]
  eps = model(x_t, batch["t"], batch["labels"])[..., :batch["noise"].shape[-1]]
  return jnp.mean(jnp.square(eps - batch["noise"]))


def dit_batch(cfg: DiTConfig = DiTConfig(), batch: int = BATCH, *, seed: int | None = None):
  """The batch :func:`dit_loss` reads: abstract (``jax.ShapeDtypeStruct``) or, with ``seed``, drawn."""
  image = (batch, cfg.input_size, cfg.input_size, cfg.in_channels)
  if seed is None:
    return {"latents": jax.ShapeDtypeStruct(image, jnp.float32), "labels": jax.ShapeDtypeStruct((batch,), jnp.int32),
            "t": jax.ShapeDtypeStruct((batch,), jnp.int32), "noise": jax.ShapeDtypeStruct(image, jnp.float32)}
  keys = jax.random.split(jax.random.key(seed), 4)
  return {"latents": jax.random.normal(keys[0], image), "labels": jax.random.randint(keys[1], (batch,), 0,
                                                                                     cfg.num_classes),
          "t": jax.random.randint(keys[2], (batch,), 0, DIFFUSION_STEPS), "noise": jax.random.normal(keys[3], image)}


# --------------------------------------------------------------------------------------------------------- Llama


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama's dimensions (Hugging Face's ``LlamaConfig`` names)."""

  vocab_size: int = VOCAB
  hidden_size: int = DIM
  intermediate_size: int = HIDDEN       # the gated MLP's width
  num_hidden_layers: int = LAYERS
  num_attention_heads: int = HEADS
  num_key_value_heads: int = 2          # grouped query attention: each key/value head serves 2 query heads here
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  scan_layers: bool = True              # layers stacked with nnx.vmap ([L, in, out] kernels), applied with nnx.scan


def rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
  """Rotary position embeddings (Su et al. 2021) as Hugging Face applies them: ``q``, ``k`` [B, T, N, H]; ``cos``,
  ``sin`` [T, H]."""
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_cos_sin(seq: int, head_dim: int, theta: float):
  """``(cos, sin)``, each [T, H] float32."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  freqs = jnp.outer(jnp.arange(seq, dtype=jnp.float32), inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


class LlamaAttention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, n, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    self.num_heads, self.num_kv_heads, self.head_dim, self.theta = n, kv, d // n, cfg.rope_theta
    self.q_proj = nnx.Linear(d, n * self.head_dim, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(d, kv * self.head_dim, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(d, kv * self.head_dim, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(n * self.head_dim, d, use_bias=False, rngs=rngs)

  def __call__(self, x):                                   # x: [B, T, D]
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)       # [B, T, N, H]
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)    # [B, T, K, H]
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    q, k = apply_rotary_pos_emb(q, k, *rotary_cos_sin(t, self.head_dim, self.theta))
    groups = self.num_heads // self.num_kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)   # [B, T, N, H]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(self.head_dim)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
    return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class LlamaMLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.input_layernorm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
    self.self_attn = LlamaAttention(cfg, rngs=rngs)
    self.post_attention_layernorm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
    self.mlp = LlamaMLP(cfg, rngs=rngs)

  def __call__(self, x):
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
  """A Llama LM: token ids [B, T] int32 -> logits [B, T, V] float32."""

  def __init__(self, cfg: LlamaConfig = LlamaConfig(), *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_hidden_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def create(rngs):
        return LlamaDecoderLayer(cfg, rngs=rngs)

      self.layers = create(rngs)
    else:
      self.layers = nnx.List([LlamaDecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens):                              # tokens: [B, T] int32
    x = self.embed_tokens(tokens)                          # [B, T, D]
    if self.cfg.scan_layers:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, layer):
        return layer(x)

      x = body(x, self.layers)
    else:
      for layer in self.layers:
        x = layer(x)
    return self.lm_head(self.norm(x))                      # [B, T, V]


LLAMA_PLAN = {"layers/self_attn/q_proj": "colwise", "layers/self_attn/k_proj": "colwise",
              "layers/self_attn/v_proj": "colwise", "layers/self_attn/o_proj": "rowwise",
              "layers/mlp/gate_proj": "colwise", "layers/mlp/up_proj": "colwise", "layers/mlp/down_proj": "rowwise"}
"""Megatron-LM's pairs of the scanned :class:`Llama` by path: its stacked kernels ``[L, in, out]``."""


# --------------------------------------------------------------------------------------------------------- Linen


class LinenMlpBlock(nn.Module):
  hidden: int
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, deterministic: bool):
    h = nn.Dense(self.hidden, name="wi")(x)
    h = nn.gelu(h)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return nn.Dense(x.shape[-1], name="wo")(h)


class LinenEncoderDecoderLayer(nn.Module):
  heads: int
  hidden: int
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, deterministic: bool):
    t = x.shape[1]
    mask = nn.make_causal_mask(jnp.ones((x.shape[0], t)))
    h = nn.LayerNorm()(x)
    h = nn.SelfAttention(num_heads=self.heads, qkv_features=x.shape[-1], deterministic=deterministic,
                         dropout_rate=0.0)(h, mask=mask)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    x = x + h
    h = nn.LayerNorm()(x)
    return x + LinenMlpBlock(self.hidden, self.dropout_rate)(h, deterministic=deterministic)


class LinenTransformerLM(nn.Module):
  vocab: int = VOCAB
  dim: int = DIM
  heads: int = HEADS
  hidden: int = HIDDEN
  layers: int = LAYERS
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, tokens, *, deterministic: bool = True):
    embed = nn.Embed(self.vocab, self.dim, name="embed")
    x = embed(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, tokens.shape[1], self.dim))
    x = nn.Dropout(self.dropout_rate)(x + pos, deterministic=deterministic)
    for i in range(self.layers):
      x = LinenEncoderDecoderLayer(self.heads, self.hidden, self.dropout_rate, name=f"decoder_block_{i}")(
          x, deterministic=deterministic)
    x = nn.LayerNorm(name="final_norm")(x)
    return nn.Dense(self.vocab, name="logits_dense")(x)


# ------------------------------------------------------------------------------------------------- report targets


def decoder_target(policy: str = "none", *, batch: int = BATCH, blocks=None):
  """``--target tests.own_models:decoder_target``: the NNX decoder, its layers named as blocks, a plain loss."""
  import jaxckpt
  from jaxckpt.step import ModelTarget

  def make_model():
    return jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), policy, blocks=blocks or {"layer": DecoderLayer})

  return ModelTarget(make_model=make_model, batch={"tokens": jax.ShapeDtypeStruct((batch, SEQ + 1), jnp.int32)},
                     loss_fn=decoder_loss, name="own-decoder")


def linen_loss(apply_fn, params, batch):
  """Plain next-token loss for :func:`jaxckpt.step.linen_target` (dropout on)."""
  tokens = batch["tokens"]
  logits = apply_fn(params, tokens[:, :-1], deterministic=False)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def linen_lm_target():
  """``--target tests.own_models:linen_lm_target``: the Linen LM, its decoder blocks named."""
  from jaxckpt.linen import _apply as linen_apply
  from jaxckpt.step import linen_target

  model = linen_apply.apply_remat(LinenTransformerLM(), "none", blocks={"layer": LinenEncoderDecoderLayer})
  return linen_target(model, batch={"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}, loss_fn=linen_loss,
                      init_args=(jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32),), name="own-linen-lm")


def dit_target(*, preset: str = "tiny", batch_size: int = BATCH, num_layers: int | None = None,
               compute_dtype: str = "float32", scan: bool = False, adaln_zero: bool = True, tensor_plan=None):
  """``--target tests.own_models:dit_target``: the :class:`DiT` (``preset`` ``tiny`` or ``xl_2``), its blocks named,
  :func:`dit_loss`; ``--target-arg scan=true`` stacks the blocks under ``nnx.scan``."""
  from jaxckpt.step import ModelTarget

  overrides = {"dtype": str(jnp.dtype(compute_dtype)), "scan_blocks": scan, "adaln_zero": adaln_zero,
               **({"depth": num_layers} if num_layers else {})}
  cfg = {"tiny": DiTConfig.tiny, "xl_2": DiTConfig.xl_2}[preset](**overrides)
  return ModelTarget(make_model=lambda: jaxckpt_blocks(DiT(cfg, rngs=nnx.Rngs(0)), {"block": DiTBlock}),
                     batch=dit_batch(cfg, batch_size), loss_fn=dit_loss, name=f"own-dit-{preset}",
                     tensor_plan=tensor_plan)


def llama_target(*, batch_size: int = 8, seq_len: int = SEQ, num_layers: int = LAYERS, scan: bool = True,
                 tensor_plan=None):
  """``--target tests.own_models:llama_target``: the :class:`Llama` (scanned unless ``scan=False``), its layers
  named as blocks, next-token loss on ``[batch_size, seq_len + 1]`` tokens."""
  import jaxckpt

  cfg = LlamaConfig(num_hidden_layers=num_layers, scan_layers=scan)
  return jaxckpt.nnx_model_target(lambda: Llama(cfg, rngs=nnx.Rngs(0)),
                                  jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32), loss="next_token",
                                  blocks={"layer": LlamaDecoderLayer}, tensor_plan=tensor_plan,
                                  name="own-llama-scan" if scan else "own-llama")


def jaxckpt_blocks(model: nnx.Module, blocks):
  """``jaxckpt.apply_remat(model, "none", blocks=blocks)``: the tools set each policy."""
  import jaxckpt

  return jaxckpt.apply_remat(model, "none", blocks=blocks)
