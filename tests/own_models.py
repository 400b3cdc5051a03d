"""Models written the way public Flax example code writes them, NOT built from jaxckpt blocks (tests only).

- :class:`Decoder` (NNX): a decoder in the style of an NNX LM example: a Python list of layers, einsum attention
  (``q_einsum``, ``kv_einsum``, ``attn_vec_einsum``), a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``), RMSNorm,
  and ``nnx.Dropout`` drawing from the model's own ``nnx.Rngs``.
- :class:`LinenTransformerLM` (Linen): a Transformer LM in the style of a Linen LM example: ``nn.compact``
  submodules, a ``deterministic`` flag, ``nn.Dropout`` from the ``'dropout'`` RNG stream.

Written for these tests; tiny by default (d=32, 2 layers, seq 8).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
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
