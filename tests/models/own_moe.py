"""A Mixtral-style decoder written the way public Flax NNX code writes one: no checkpoint names, no jaxckpt imports,
experts as one ``nnx.Param`` of shape ``[experts, in, out]`` (tests of MoE FLOPs, policies and the expert axis).

``nnx.Embed``; per layer ``nnx.RMSNorm``, a causal attention of ``nnx.Linear`` projections and ``jnp.einsum``, and a
top-2-of-8 Mixture of Experts: a ``nnx.Linear`` router, softmax over the two largest logits, SwiGLU experts. Two
dispatches, as public MoE code writes them:

- ``dense``: every expert on every token (one-hot weights, ``einsum`` over the expert axis): simple and FLOP-wasteful;
- ``dropless``: the (token, expert) pairs sorted by expert, ``jax.lax.ragged_dot`` per projection, unsorted, weighted
  (MegaBlocks' idea, Gale et al. 2023).

``exp_axis=True`` gives the experts' parameters logical axis names ``("exp", "embed", "mlp")`` (Flax's
``nnx.with_partitioning``), the way MaxText names them, for expert parallelism; ``router_nan=True`` makes the router
return NaN (a broken model, for ``--measure``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, HIDDEN, EXPERTS, TOP_K, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 8, 2, 2, 16, 8


class Attention(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads, self.head_dim = heads, dim // heads
    self.q_proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):                                                   # x: [B, T, D]
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.heads, self.head_dim)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(self.head_dim)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
    return self.o_proj(out.reshape(b, t, -1))


class MoE(nnx.Module):
  def __init__(self, dim: int, hidden: int, experts: int, top_k: int, *, dispatch: str, exp_axis: bool = False,
               router_nan: bool = False, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    if exp_axis:
      wi, wo = (nnx.with_partitioning(init, ("exp", "embed", "mlp"), eager_sharding=False),
                nnx.with_partitioning(init, ("exp", "mlp", "embed"), eager_sharding=False))
    else:
      wi = wo = init
    self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
    self.gate = nnx.Param(wi(rngs.params(), (experts, dim, hidden)))
    self.up = nnx.Param(wi(rngs.params(), (experts, dim, hidden)))
    self.down = nnx.Param(wo(rngs.params(), (experts, hidden, dim)))
    self.top_k, self.dispatch, self.router_nan = top_k, dispatch, router_nan

  def __call__(self, x):                                                   # x: [B, T, D]
    b, t, d = x.shape
    logits = self.router(x)                                                # [B, T, E]
    if self.router_nan:
      logits = logits * jnp.nan
    top, idx = jax.lax.top_k(logits, self.top_k)                           # [B, T, k]
    weights = jax.nn.softmax(top, axis=-1)
    if self.dispatch == "dense":
      combine = jnp.sum(jax.nn.one_hot(idx, logits.shape[-1]) * weights[..., None], axis=2)   # [B, T, E]
      h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, self.gate[...])) * jnp.einsum("btd,edf->btef", x, self.up[...])
      y = jnp.einsum("btef,efd->bted", h, self.down[...])
      return jnp.einsum("bted,bte->btd", y, combine)
    tokens = x.reshape(b * t, d)
    flat = idx.reshape(-1)                                                 # [T·k]
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=self.gate.shape[0])
    xs = tokens[order // self.top_k]                                       # [T·k, D], grouped by expert
    h = jax.nn.silu(jax.lax.ragged_dot(xs, self.gate[...], sizes)) * jax.lax.ragged_dot(xs, self.up[...], sizes)
    ys = jax.lax.ragged_dot(h, self.down[...], sizes)                      # [T·k, D]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(b * t, self.top_k, d)
    return jnp.einsum("tkd,tk->td", y, weights.reshape(b * t, self.top_k)).reshape(b, t, d)


class DecoderLayer(nnx.Module):
  def __init__(self, dim: int, heads: int, hidden: int, experts: int, top_k: int, *, dispatch: str,
               exp_axis: bool = False, router_nan: bool = False, rngs: nnx.Rngs):
    self.input_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, heads, rngs=rngs)
    self.post_attention_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.moe = MoE(dim, hidden, experts, top_k, dispatch=dispatch, exp_axis=exp_axis, router_nan=router_nan,
                   rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.input_norm(x))
    return x + self.moe(self.post_attention_norm(x))


class Mixtral(nnx.Module):
  def __init__(self, *, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, hidden: int = HIDDEN,
               experts: int = EXPERTS, top_k: int = TOP_K, layers: int = LAYERS, dispatch: str = "dropless",
               exp_axis: bool = False, router_nan: bool = False, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(dim, heads, hidden, experts, top_k, dispatch=dispatch, exp_axis=exp_axis,
                                         router_nan=router_nan, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):                                              # tokens: [B, T] int32
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x))                                      # logits: [B, T, V]


def matmul_flops(*, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN,
                 experts: int = EXPERTS, top_k: int = TOP_K, layers: int = LAYERS, dispatch: str = "dropless") -> int:
  """FLOPs of the matmuls of one train step (forward, and backward twice the forward: the input and the weight
  gradients), by arithmetic: 2 FLOPs per multiply-add. Per token and layer: the q, k, v, o projections 4·2·D², the
  attention scores and weighted values 2·2·T·D, the router 2·D·E, and the experts 3·2·D·F for each of the k (dropless)
  or E (dense) experts the token meets; per token the head 2·D·V. The embedding is a lookup (no FLOPs)."""
  tokens = batch * seq
  met = top_k if dispatch == "dropless" else experts
  per_layer = tokens * (4 * 2 * dim * dim + 2 * 2 * seq * dim + 2 * dim * experts + met * 3 * 2 * dim * hidden)
  forward = layers * per_layer + tokens * 2 * dim * vocab
  return 3 * forward


def target(*, dispatch: str = "dropless", exp_axis: bool = False, router_nan: bool = False, blocks: bool = True,
           batch: int = BATCH, layers: int = LAYERS, dim: int = DIM, hidden: int = HIDDEN, seq: int = SEQ):
  """The model as a report/plan/fit target (next-token loss on ``[batch, seq + 1]`` tokens), layers as blocks."""
  import jaxckpt  # pylint: disable=g-import-not-at-top

  def make():
    return Mixtral(dispatch=dispatch, exp_axis=exp_axis, router_nan=router_nan, layers=layers, dim=dim,
                   hidden=hidden, rngs=nnx.Rngs(0))

  return jaxckpt.nnx_model_target(make, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32), loss="next_token",
                                  blocks={"layer": DecoderLayer} if blocks else None, name=f"own-moe-{dispatch}")
