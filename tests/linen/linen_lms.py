"""Three Linen LMs (and an NNX twin) written the way public Flax code writes them, NOT built from jaxckpt blocks (tests
only).

- :class:`FlaxGPT2LMHeadModel`: GPT-2 in the style of the Hugging Face Flax port: a ``Conv1D`` dense layer of its
  own (weight ``(in, out)``, ``self.param`` + ``jnp.dot``), ``FlaxGPT2Block`` s held in a list built in ``setup``
  (scope names ``h_0``, ``h_1``, …) and called in a Python loop with a ``deterministic`` flag, dropout, LayerNorm,
  tied input/output embeddings.
- :class:`LlamaForCausalLM`: a Llama-style LM: RMSNorm, rotary position embeddings, a SwiGLU MLP of
  ``nn.Dense(use_bias=False)``, decoder layers created in an ``nn.compact`` loop named ``layers_{i}``, no dropout.
- :class:`JittedDecoder`: a decoder LM whose ``__call__`` is under ``nn.jit`` (as some published Flax code compiles
  its model), grouped-query attention of ``nn.DenseGeneral`` s, blocks in a ``setup`` list.
- :class:`NNXGPT2`: the GPT-2 LM in NNX, its projections an NNX class of its own (:class:`NNXConv1D`), blocks in
  an ``nnx.List`` (``h[i]``), for "the same holds for NNX".

All tiny (GPT-2 and Llama: 5 layers, d=64, seq 32, batch 32: activations dominate the temp bytes, as in training, and
full remat keeps about 1/5 of them, so budget:30% is reachable; the jitted decoder: 4 layers, d=32, seq 16, batch 8),
so compiles are quick on CPU.
:func:`gpt2_target` / :func:`llama_target` are ``--target`` functions (two lines each with
:func:`jaxckpt.linen_model_target`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 5, 32, 32


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int = VOCAB        # tokens
  n_positions: int = SEQ         # longest sequence
  n_embd: int = DIM              # model width D
  n_head: int = HEADS            # attention heads
  n_layer: int = LAYERS          # blocks
  resid_pdrop: float = 0.1       # dropout after attention / MLP
  embd_pdrop: float = 0.1        # dropout after the embeddings
  attn_pdrop: float = 0.1        # dropout on attention weights
  layer_norm_epsilon: float = 1e-5


class Conv1D(nn.Module):
  """GPT-2's dense layer: weight ``(in, out)`` (transposed w.r.t. ``nn.Dense``'s naming in the original code)."""

  features: int

  @nn.compact
  def __call__(self, inputs):
    kernel = self.param("kernel", nn.initializers.normal(stddev=0.02), (inputs.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    return jnp.dot(inputs, kernel) + bias


class FlaxGPT2Attention(nn.Module):
  config: GPT2Config

  def setup(self):
    d = self.config.n_embd
    self.head_dim = d // self.config.n_head
    self.c_attn = Conv1D(3 * d)
    self.c_proj = Conv1D(d)
    self.attn_dropout = nn.Dropout(rate=self.config.attn_pdrop)
    self.resid_dropout = nn.Dropout(rate=self.config.resid_pdrop)

  def _split_heads(self, x):
    return x.reshape(x.shape[:2] + (self.config.n_head, self.head_dim))   # [B, T, N, H]

  def __call__(self, hidden_states, deterministic: bool = True):
    qkv = self.c_attn(hidden_states)                                      # [B, T, 3D]
    query, key, value = (self._split_heads(t) for t in jnp.split(qkv, 3, axis=2))
    t = hidden_states.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    weights = jnp.einsum("bqhd,bkhd->bhqk", query, key) / math.sqrt(self.head_dim)
    weights = jax.nn.softmax(jnp.where(causal, weights, jnp.finfo(weights.dtype).min), axis=-1)
    weights = self.attn_dropout(weights, deterministic=deterministic)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, value).reshape(hidden_states.shape)
    return self.resid_dropout(self.c_proj(out), deterministic=deterministic)


class FlaxGPT2MLP(nn.Module):
  config: GPT2Config
  intermediate_size: int

  def setup(self):
    self.c_fc = Conv1D(self.intermediate_size)
    self.c_proj = Conv1D(self.config.n_embd)
    self.dropout = nn.Dropout(rate=self.config.resid_pdrop)

  def __call__(self, hidden_states, deterministic: bool = True):
    hidden_states = nn.gelu(self.c_fc(hidden_states), approximate=True)
    return self.dropout(self.c_proj(hidden_states), deterministic=deterministic)


class FlaxGPT2Block(nn.Module):
  config: GPT2Config

  def setup(self):
    eps = self.config.layer_norm_epsilon
    self.ln_1 = nn.LayerNorm(epsilon=eps)
    self.attn = FlaxGPT2Attention(self.config)
    self.ln_2 = nn.LayerNorm(epsilon=eps)
    self.mlp = FlaxGPT2MLP(self.config, 4 * self.config.n_embd)

  def __call__(self, hidden_states, deterministic: bool = True):
    hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), deterministic=deterministic)
    return hidden_states + self.mlp(self.ln_2(hidden_states), deterministic=deterministic)


class FlaxGPT2LMHeadModel(nn.Module):
  config: GPT2Config = GPT2Config()

  def setup(self):
    cfg = self.config
    self.wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=nn.initializers.normal(stddev=0.02))
    self.wpe = nn.Embed(cfg.n_positions, cfg.n_embd, embedding_init=nn.initializers.normal(stddev=0.02))
    self.dropout = nn.Dropout(rate=cfg.embd_pdrop)
    self.h = [FlaxGPT2Block(cfg) for _ in range(cfg.n_layer)]               # scope names h_0 … h_{L-1}
    self.ln_f = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon)

  def __call__(self, input_ids, deterministic: bool = True):
    positions = jnp.arange(input_ids.shape[1])[None]
    hidden_states = self.dropout(self.wte(input_ids) + self.wpe(positions), deterministic=deterministic)
    for block in self.h:
      hidden_states = block(hidden_states, deterministic=deterministic)
    hidden_states = self.ln_f(hidden_states)
    return self.wte.attend(hidden_states)                                  # [B, T, V], tied embeddings


# ----------------------------------------------------------------------------------------------------------- Llama


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int = VOCAB
  hidden_size: int = DIM
  intermediate_size: int = 172   # ≈ 8/3 · D
  num_hidden_layers: int = LAYERS
  num_attention_heads: int = HEADS
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + self.eps) * weight


def rotary(x, theta: float):
  """Rotary position embedding of ``x: [B, T, N, H]`` (H even)."""
  t, h = x.shape[1], x.shape[-1]
  freqs = 1.0 / theta ** (jnp.arange(0, h, 2) / h)                          # [H/2]
  angles = jnp.arange(t)[:, None] * freqs[None]                           # [T, H/2]
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


class LlamaAttention(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    n, h = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    dense = lambda name: nn.Dense(n * h, use_bias=False, name=name)  # noqa: E731
    q = rotary(dense("q_proj")(x).reshape(x.shape[:2] + (n, h)), cfg.rope_theta)
    k = rotary(dense("k_proj")(x).reshape(x.shape[:2] + (n, h)), cfg.rope_theta)
    v = dense("v_proj")(x).reshape(x.shape[:2] + (n, h))
    t = x.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(h)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(x.shape[:2] + (n * h,))
    return nn.Dense(cfg.hidden_size, use_bias=False, name="o_proj")(out)


class LlamaMLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    gate = nn.Dense(cfg.intermediate_size, use_bias=False, name="gate_proj")(x)
    up = nn.Dense(cfg.intermediate_size, use_bias=False, name="up_proj")(x)
    return nn.Dense(cfg.hidden_size, use_bias=False, name="down_proj")(nn.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    eps = self.config.rms_norm_eps
    x = x + LlamaAttention(self.config, name="self_attn")(RMSNorm(eps, name="input_layernorm")(x))
    return x + LlamaMLP(self.config, name="mlp")(RMSNorm(eps, name="post_attention_layernorm")(x))


class LlamaForCausalLM(nn.Module):
  config: LlamaConfig = LlamaConfig()

  @nn.compact
  def __call__(self, input_ids):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed_tokens")(input_ids)
    for i in range(cfg.num_hidden_layers):
      x = LlamaDecoderLayer(cfg, name=f"layers_{i}")(x)
    x = RMSNorm(cfg.rms_norm_eps, name="norm")(x)
    return nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head")(x)   # [B, T, V]


# ------------------------------------------------------------------------------- a decoder whose __call__ is jitted


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab_size: int = 64           # tokens
  emb_dim: int = 32              # model width D
  num_heads: int = 4             # query heads N
  num_kv_heads: int = 2          # key/value heads K (grouped-query attention, N % K == 0)
  mlp_dim: int = 96              # MLP width F
  num_layers: int = 4            # decoder blocks
  max_len: int = 16              # longest sequence
  dropout_rate: float = 0.1      # after attention and MLP


class GroupedQueryAttention(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    cfg = self.config
    head_dim, group = cfg.emb_dim // cfg.num_heads, cfg.num_heads // cfg.num_kv_heads
    q = nn.DenseGeneral((cfg.num_heads, head_dim), use_bias=False, name="query")(x)      # [B, T, N, H]
    k = nn.DenseGeneral((cfg.num_kv_heads, head_dim), use_bias=False, name="key")(x)     # [B, T, K, H]
    v = nn.DenseGeneral((cfg.num_kv_heads, head_dim), use_bias=False, name="value")(x)   # [B, T, K, H]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)                    # [B, T, N, H]
    t = x.shape[1]
    logits = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(head_dim)
    logits = jnp.where(nn.make_causal_mask(jnp.ones((1, t)))[0], logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(logits, axis=-1), v)
    return nn.DenseGeneral(cfg.emb_dim, axis=(-2, -1), use_bias=False, name="out")(out)


class MlpBlock(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.config.mlp_dim, name="wi")(x))
    return nn.Dense(self.config.emb_dim, name="wo")(h)


class DecoderBlock(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    drop = nn.Dropout(self.config.dropout_rate, deterministic=deterministic)
    x = x + drop(GroupedQueryAttention(self.config, name="attention")(nn.LayerNorm(name="ln_1")(x)))
    return x + drop(MlpBlock(self.config, name="mlp")(nn.LayerNorm(name="ln_2")(x)))


class JittedDecoder(nn.Module):
  """A decoder LM whose top-level ``__call__`` is compiled by ``nn.jit`` (``deterministic`` static), its blocks made
  in ``setup`` as a list (scope names ``layers_0`` …)."""

  config: DecoderConfig = DecoderConfig()

  def setup(self):
    cfg = self.config
    self.embed = nn.Embed(cfg.vocab_size, cfg.emb_dim)
    self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.max_len, cfg.emb_dim))
    self.layers = [DecoderBlock(cfg) for _ in range(cfg.num_layers)]
    self.ln_f = nn.LayerNorm()

  @functools.partial(nn.jit, static_argnames=("deterministic",))
  def __call__(self, tokens, deterministic: bool = True):
    x = self.embed(tokens) + self.pos_embed[: tokens.shape[1]]                            # [B, T, D]
    for layer in self.layers:
      x = layer(x, deterministic=deterministic)
    return self.embed.attend(self.ln_f(x))                                                # [B, T, V]


DECODER_TOKENS = jax.ShapeDtypeStruct((8, DecoderConfig.max_len + 1), jnp.int32)
"""The jitted decoder's example batch: token ids ``[B, T+1] int32``."""


def jitted_decoder_target():
  """``--target tests.linen.linen_lms:jitted_decoder_target``: the nn.jit decoder, unedited, its ``DecoderBlock`` s
  the blocks."""
  import jaxckpt

  return jaxckpt.linen_model_target(JittedDecoder(), DECODER_TOKENS, loss="next_token", blocks={"block": DecoderBlock},
                                    call_kwargs={"deterministic": False})


# ------------------------------------------------------------------------------------------------- report targets

TOKENS = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
"""The example batch of both targets: token ids ``[B, T+1] int32`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""


def gpt2_target(policy: str = "none"):
  """``--target tests.linen.linen_lms:gpt2_target``: the GPT-2 LM, its ``FlaxGPT2Block`` s the blocks, dropout on."""
  import jaxckpt

  model = jaxckpt.linen.apply_remat(FlaxGPT2LMHeadModel(), policy, blocks={"block": FlaxGPT2Block})
  return jaxckpt.linen_model_target(model, TOKENS, loss="next_token", call_kwargs={"deterministic": False})


def llama_target(policy: str = "none"):
  """``--target tests.linen.linen_lms:llama_target``: the Llama LM, its ``LlamaDecoderLayer`` s the blocks."""
  import jaxckpt

  model = jaxckpt.linen.apply_remat(LlamaForCausalLM(), policy, blocks={"layer": LlamaDecoderLayer})
  return jaxckpt.linen_model_target(model, TOKENS, loss="next_token")


# ------------------------------------------------------------------------------- NNX twin with its own projection


class NNXConv1D(nnx.Module):
  """GPT-2's dense layer as an NNX module of its own class: weight ``(in, out)``, ``x @ kernel + bias``."""

  def __init__(self, nx: int, nf: int, *, rngs: nnx.Rngs):
    self.kernel = nnx.Param(0.02 * jax.random.normal(rngs.params(), (nx, nf)))
    self.bias = nnx.Param(jnp.zeros((nf,)))

  def __call__(self, x):
    return jnp.dot(x, self.kernel[...]) + self.bias[...]


class NNXGPT2Block(nnx.Module):
  def __init__(self, d: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
    self.heads = heads
    self.ln_1, self.ln_2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.c_attn, self.attn_proj = NNXConv1D(d, 3 * d, rngs=rngs), NNXConv1D(d, d, rngs=rngs)
    self.c_fc, self.c_proj = NNXConv1D(d, 4 * d, rngs=rngs), NNXConv1D(4 * d, d, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x, *, deterministic: bool = False):
    b, t, d = x.shape
    q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in jnp.split(self.c_attn(self.ln_1(x)), 3, -1))
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), w, -1e9), axis=-1)
    x = x + self.dropout(self.attn_proj(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)),
                         deterministic=deterministic)
    h = self.c_proj(jax.nn.gelu(self.c_fc(self.ln_2(x)), approximate=True))
    return x + self.dropout(h, deterministic=deterministic)


class NNXGPT2(nnx.Module):
  def __init__(self, *, vocab=VOCAB, d=DIM, heads=HEADS, layers=LAYERS, dropout=0.1, rngs: nnx.Rngs):
    self.wte = nnx.Embed(vocab, d, rngs=rngs)
    self.wpe = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, d)))
    self.h = nnx.List([NNXGPT2Block(d, heads, dropout, rngs=rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)

  def __call__(self, tokens, *, deterministic: bool = False):
    x = self.wte(tokens) + self.wpe[...][: tokens.shape[1]]
    for block in self.h:
      x = block(x, deterministic=deterministic)
    return self.wte.attend(self.ln_f(x))                                   # [B, T, V]


def nnx_gpt2_loss(model: NNXGPT2, batch) -> jax.Array:
  """Next-token cross-entropy; dropout from the model's own Rngs."""
  import optax

  tokens = batch["tokens"]
  return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def nnx_gpt2_target():
  """``--target tests.linen.linen_lms:nnx_gpt2_target``: the NNX twin, its blocks named (per-layer plans over
  ``h[i]``)."""
  import jaxckpt
  from jaxckpt.step import ModelTarget

  return ModelTarget(make_model=lambda: jaxckpt.apply_remat(NNXGPT2(rngs=nnx.Rngs(0)), "none",
                                                            blocks={"block": NNXGPT2Block}),
                     batch={"tokens": TOKENS}, loss_fn=nnx_gpt2_loss, name="NNXGPT2")
