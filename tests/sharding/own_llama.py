"""A Llama-style decoder written the way public Flax NNX code writes one, with no logical axis names anywhere (tests
of tensor plans, :mod:`jaxckpt.sharding._tensor_plan`).

``nnx.Embed``; per layer ``nnx.Linear`` query/key/value (with biases, as Qwen's) and output projections, a causal
attention with ``jnp.einsum``, a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``; ``down_proj`` is defined
before ``up_proj``, as Hugging Face's Flax Llama defines them, so attribute order is not call order), ``nnx.RMSNorm``
before each, and an ``nnx.Linear`` LM head. Tiny: vocabulary 64, width 32, 4 heads of 8, MLP 64, 2 layers, 8 tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 2, 8, 8


class Attention(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads, self.head_dim = heads, dim // heads
    self.q_proj = nnx.Linear(dim, heads * self.head_dim, rngs=rngs)
    self.k_proj = nnx.Linear(dim, heads * self.head_dim, rngs=rngs)
    self.v_proj = nnx.Linear(dim, heads * self.head_dim, rngs=rngs)
    self.o_proj = nnx.Linear(heads * self.head_dim, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):                                                   # x: [B, T, D]
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)            # [B, T, N, H]
    k = self.k_proj(x).reshape(b, t, self.heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.heads, self.head_dim)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(self.head_dim)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
    return self.o_proj(out.reshape(b, t, self.heads * self.head_dim))


class MLP(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
    self.input_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, heads, rngs=rngs)
    self.post_attention_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.mlp = MLP(dim, hidden, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.input_norm(x))
    return x + self.mlp(self.post_attention_norm(x))


class Llama(nnx.Module):
  def __init__(self, *, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, hidden: int = HIDDEN,
               layers: int = LAYERS, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):                                              # tokens: [B, T] int32
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x))                                      # logits: [B, T, V]


PLAN = {"embed": "rowwise",
        "layers/*/attn/q_proj": "colwise", "layers/*/attn/k_proj": "colwise", "layers/*/attn/v_proj": "colwise",
        "layers/*/attn/o_proj": "rowwise",
        "layers/*/mlp/gate_proj": "colwise", "layers/*/mlp/up_proj": "colwise", "layers/*/mlp/down_proj": "rowwise",
        "lm_head": "colwise"}
"""A Megatron-LM plan by path: the blocks' pairs, the embedding split over the vocabulary, the head over it too."""


def target(*, tensor_plan=PLAN, blocks: bool = True, batch: int = BATCH):
  """The model as a report/fit target (next-token loss on ``[batch, SEQ + 1]`` tokens)."""
  import jaxckpt  # pylint: disable=g-import-not-at-top

  return jaxckpt.nnx_model_target(lambda: Llama(rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((batch, SEQ + 1), jnp.int32),
                                  loss="next_token", blocks={"layer": DecoderLayer} if blocks else None,
                                  tensor_plan=tensor_plan, name="own-llama")
