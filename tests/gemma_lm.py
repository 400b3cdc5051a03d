"""A Gemma-style Linen LM written the way public Flax code is: 4 layers, grouped-query attention (GQA), layers
alternating local (sliding-window) and global attention, a GeGLU MLP whose gate and up projections share one scope
(one ``einsum`` each on one ``(2, d, f)`` parameter). Issue 33's model for plans that must not lose to fixed policies."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

BATCH, SEQ = 4, 64
TOKENS = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  vocab_size: int = 256
  embed_dim: int = 128
  hidden_dim: int = 384
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  num_layers: int = 4
  sliding_window: int = 16


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class Attention(nn.Module):
  config: GemmaConfig
  local: bool

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    q = nn.DenseGeneral((cfg.num_heads, cfg.head_dim), use_bias=False, name="q_proj")(x)
    kv = self.param("kv_einsum", nn.initializers.normal(0.02), (2, cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim))
    k, v = jnp.einsum("btd,cdkh->cbtkh", x, kv)
    groups = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q * cfg.head_dim ** -0.5, k)
    t = x.shape[1]
    pos = jnp.arange(t)
    mask = pos[:, None] >= pos[None, :]
    if self.local:
      mask = mask & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return nn.DenseGeneral(cfg.embed_dim, axis=(-2, -1), use_bias=False, name="o_proj")(out)


class FeedForward(nn.Module):
  """GeGLU: gate and up projections in one scope, one einsum each on one stacked parameter."""

  config: GemmaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    w = self.param("gating_einsum", nn.initializers.normal(0.02), (2, cfg.embed_dim, cfg.hidden_dim))
    gate = jnp.einsum("btd,df->btf", x, w[0])
    up = jnp.einsum("btd,df->btf", x, w[1])
    down = self.param("linear", nn.initializers.normal(0.02), (cfg.hidden_dim, cfg.embed_dim))
    return jnp.einsum("btf,fd->btd", jax.nn.gelu(gate) * up, down)


class Block(nn.Module):
  config: GemmaConfig
  local: bool

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.config, self.local, name="attn")(RMSNorm(name="pre_attention_norm")(x))
    return x + FeedForward(self.config, name="mlp")(RMSNorm(name="pre_ffw_norm")(x))


class GemmaLM(nn.Module):
  config: GemmaConfig = GemmaConfig()

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.embed_dim, name="embedder")
    x = embed(tokens) * jnp.sqrt(cfg.embed_dim).astype(jnp.float32)
    for i in range(cfg.num_layers):
      x = Block(cfg, local=i % 2 == 0, name=f"layer_{i}")(x)
    return embed.attend(RMSNorm(name="final_norm")(x))


def gemma_target(policy: str = "none"):
  """``--target tests.gemma_lm:gemma_target``: the Gemma-style LM, its ``Block`` s the blocks."""
  import jaxckpt

  model = jaxckpt.linen.apply_remat(GemmaLM(), policy, blocks={"block": Block})
  return jaxckpt.linen_model_target(model, TOKENS, loss="next_token")
