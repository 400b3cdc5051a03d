"""A plain JAX + NNX twin of jaxckpt's GPT train step, written by hand as Flax's NNX guides write models: the floor
the report's time is held to.

Same shapes and math as :class:`jaxckpt.models._gpt.GPT` (pre-LN decoder, fused QKV projection, tied embeddings, learned
positions, dropout on the attention weights and on each sublayer's output, tanh-GELU MLP, the same checkpoint names
as :mod:`jaxckpt.names`), built from ``nnx.Linear`` / ``nnx.LayerNorm`` / ``nnx.Embed``; the layers are created
with ``nnx.vmap`` and run with ``nnx.scan`` (Flax's "scan over layers" pattern), each sublayer under ``nnx.remat``
with a ``jax.checkpoint_policies`` policy (``none``: no remat); one ``optax.adamw(1e-3)`` update in a functional
step over ``nnx.split`` state (NNX's performance guide), compiled with the same XLA options as the report. No
jaxckpt code: this is what a user of Flax NNX would write to get the same program. :mod:`benchmarks.plain_gpt` is
the same step without NNX (a stricter floor).
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from benchmarks.plain_gpt import policy_of, timed_compile, twin_args
from jaxckpt.models import GPTConfig

__all__ = ["GPT", "train_step", "lower_and_compile"]


def _dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0)


class Attention(nnx.Module):
  """``x + Dropout(Wo · Dropout(softmax(QKᵀ/√K)) V)`` on ``LayerNorm(x)``; ``x: [B, T, D]`` float32."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.num_heads, self.rate = config.num_heads, config.dropout_rate
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)
    self.qkv = nnx.Linear(config.dim, 3 * config.dim, rngs=rngs)
    self.out = nnx.Linear(config.dim, config.dim, rngs=rngs)

  def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
    b, t, d = x.shape
    k_weights, k_out = jax.random.split(key)
    qkv = checkpoint_name(self.qkv(self.norm(x)).reshape(b, t, 3, self.num_heads, d // self.num_heads), "qkv")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, K]
    logits = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(d // self.num_heads)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    weights = checkpoint_name(_dropout(jax.nn.softmax(logits, axis=-1), self.rate, k_weights), "attn_weights")
    context = checkpoint_name(jnp.einsum("bhts,bshk->bthk", weights, v), "attn_context")
    y = checkpoint_name(self.out(context.reshape(b, t, d)), "attn_out")
    return x + _dropout(y, self.rate, k_out)


class MLP(nnx.Module):
  """``x + Dropout(W2 · gelu(W1 · LayerNorm(x)))``; ``x: [B, T, D]`` float32."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.rate = config.dropout_rate
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)
    self.fc1 = nnx.Linear(config.dim, config.mlp_dim, rngs=rngs)
    self.fc2 = nnx.Linear(config.mlp_dim, config.dim, rngs=rngs)

  def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
    hidden = checkpoint_name(jax.nn.gelu(self.fc1(self.norm(x))), "mlp_hidden")
    y = checkpoint_name(self.fc2(hidden), "mlp_out")
    return x + _dropout(y, self.rate, key)


class Layer(nnx.Module):
  """One decoder layer: attention then MLP, each under ``nnx.remat(policy=...)`` unless the policy is ``None``."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.attn = Attention(config, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array, key: jax.Array, policy: Any) -> jax.Array:
    k_attn, k_mlp = jax.random.split(key)
    call = lambda block, h, k: block(h, k)  # noqa: E731
    if policy is not None:
      call = nnx.remat(call, policy=policy)
    return call(self.mlp, call(self.attn, x, k_attn), k_mlp)


class GPT(nnx.Module):
  """Embed + positions → L layers (``nnx.vmap``-created, ``nnx.scan``-applied) → LayerNorm → tied logits."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(config.vocab_size, config.dim, embedding_init=init, rngs=rngs)
    self.pos = nnx.Param(init(rngs.params(), (config.seq_len, config.dim)))

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs: nnx.Rngs) -> Layer:
      return Layer(config, rngs=rngs)

    self.layers = make_layers(rngs)
    self.num_layers = config.num_layers
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)

  def __call__(self, tokens: jax.Array, key: jax.Array, policy: Any) -> jax.Array:
    """``tokens: [B, T] int32`` -> ``[B, T, V]`` float32 logits (dropout on, from ``key``)."""
    h = self.embed(tokens) + self.pos[: tokens.shape[1]]

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(layer: Layer, h: jax.Array, key: jax.Array) -> jax.Array:
      return layer(h, key, policy)

    h = forward(self.layers, h, jax.random.split(key, self.num_layers))
    return self.embed.attend(self.norm(h))


def train_step(graphdef: nnx.GraphDef, policy: Any):
  """``step(params, opt_state, batch, key) -> (params, opt_state, loss)``: value_and_grad of the mean next-token
  cross-entropy and one ``optax.adamw(1e-3)`` update (``batch = {"tokens": [B, T+1] int32}``)."""
  tx = optax.adamw(1e-3)

  def loss_fn(params, tokens, key):
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1], key, policy)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["tokens"], key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def lower_and_compile(config: GPTConfig, policy_text: str, *, options: dict[str, Any] | None = None
                      ) -> dict[str, float | int]:
  """Builds the abstract model, traces, lowers and compiles the twin's step under one policy (nothing is allocated).

  Returns:
    ``{"trace_s", "lower_s", "compile_s", "total_s"}`` (wall seconds; ``trace_s`` includes building the abstract
    model and optimizer state), ``"cpu_s"`` (CPU seconds of this process over the three, XLA's threads included)
    and ``"temp_bytes"`` (int bytes).
  """
  started = time.perf_counter(), time.process_time()
  graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
  batch = {"tokens": jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)}
  key = jax.eval_shape(lambda: jax.random.key(0))
  return timed_compile(train_step(graphdef, policy_of(policy_text)), (params, opt_state, batch, key),
                       options=options, started=started)

def main(argv: list[str] | None = None) -> None:
  """``python -m benchmarks.nnx_gpt PRESET POLICY…``: compiles the twin per policy in this fresh process and prints
  one JSON object: ``{"policies": {policy: lower_and_compile(...)}}``."""
  config, policies = twin_args("python -m benchmarks.nnx_gpt", sys.argv[1:] if argv is None else argv)
  print(json.dumps({"policies": {p: lower_and_compile(config, p) for p in policies}}))


if __name__ == "__main__":
  main()
