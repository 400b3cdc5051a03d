"""The LLM family's loss: next-token cross-entropy with a float32 logsumexp over compute-dtype logits, and MaxText's
vocabulary tiling, which never holds the logits of the whole batch.

- :func:`cross_entropy` is a ``jax.custom_vjp``: its residuals are the logits in their own dtype (bfloat16 in
  production) and the per-token float32 logsumexp; the backward pass makes ``softmax − onehot`` from them. Plain
  autodiff of a float32 log-softmax would keep a float32 copy of the ``[B, S, V]`` logits for the backward pass, twice
  the bytes of bfloat16 logits (for Llama 3.1 8B at 4 × 8192 tokens: 16.8 GB instead of 8.4 GB).
- With ``vocab_tiles`` = T > 1 (MaxText's ``num_vocab_tiling``; AI-Hypercomputer/maxtext ``docs/explanations/
  tiling.md``), :func:`tiled_loss` splits every sequence into T chunks and computes each chunk's logits, soft cap
  and cross-entropy inside ``jax.checkpoint`` (nothing saved but the chunk's inputs) in a ``jax.lax.scan``: the
  backward pass recomputes one chunk's logits at a time, so the step holds ``[B, S/T, V]`` logits, not ``[B, S, V]``.
  Chunks are slices of the sequence (every chunk holds every batch row), so batch-sharded hidden states stay where
  they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.models.llm._model import project_logits


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token cross-entropy ``logsumexp(logits) − logits[target]``, in float32, from logits of any float dtype.

  The backward pass keeps only ``logits`` (their dtype) and the float32 logsumexp ``[...]``, and returns
  ``(softmax(logits) − onehot(target)) · g`` in the dtype of ``logits``.

  Args:
    logits: ``[..., V]``, e.g. ``[B, S, V]`` bfloat16.
    targets: ``[...]`` int32 class ids in ``0 .. V-1``.

  Returns:
    ``[...]`` float32 losses in nats; equal to ``optax.softmax_cross_entropy_with_integer_labels`` of float32
    logits.
  """
  return _forward(logits, targets)[0]


def _forward(logits: jax.Array, targets: jax.Array):
  logits32 = logits.astype(jnp.float32)  # fused into the reductions below, never a residual
  lse = jax.nn.logsumexp(logits32, axis=-1)
  onehot = targets[..., None] == jnp.arange(logits.shape[-1])  # a sum, not a gather: fine over a split vocabulary
  target_logit = jnp.sum(jnp.where(onehot, logits32, 0.0), axis=-1)
  return lse - target_logit, (logits, targets, lse)


def _backward(residuals, g):
  logits, targets, lse = residuals
  probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  onehot = targets[..., None] == jnp.arange(logits.shape[-1])
  grad = (probs - onehot.astype(jnp.float32)) * g[..., None]
  return grad.astype(logits.dtype), None


cross_entropy.defvjp(_forward, _backward)


def tiled_loss(h: jax.Array, targets: jax.Array, weight: jax.Array, *, tiles: int, tied: bool,
               soft_cap: float | None, dtype) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy and correct predictions over ``tiles`` sequence chunks, one chunk's logits at a time.

  Each chunk runs :func:`jaxckpt.models.llm._model.project_logits` and :func:`cross_entropy` under
  ``jax.checkpoint(policy=nothing_saveable)`` in a ``jax.lax.scan``, so only the chunk's inputs are kept for the
  backward pass, which recomputes that chunk's logits (MaxText's ``num_vocab_tiling``).

  Args:
    h: ``[B, S, E]`` final hidden states (compute dtype).
    targets: ``[B, S]`` int32.
    weight: the output weight (``[V, E]`` tied, ``[E, V]`` untied).
    tiles: chunks T ≥ 1 dividing S.
    tied: whether ``weight`` is the embedding.
    soft_cap: final logit soft cap or ``None``.
    dtype: compute dtype of the logits.

  Returns:
    ``(loss sum, correct count)``: float32 scalars over the ``B·S`` tokens.

  Raises:
    JaxckptError: ``tiles`` does not divide S.
  """
  batch, seq, dim = h.shape
  if seq % tiles:
    raise JaxckptError(f"vocab_tiles={tiles} must divide the {seq} tokens per sequence")
  chunk = seq // tiles
  h_chunks = h.reshape(batch, tiles, chunk, dim).swapaxes(0, 1)  # [T, B, S/T, E]
  t_chunks = targets.reshape(batch, tiles, chunk).swapaxes(0, 1)  # [T, B, S/T]

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def one_chunk(weight, h_chunk, t_chunk):
    logits = project_logits(h_chunk, weight, tied=tied, soft_cap=soft_cap, dtype=dtype)  # [B, S/T, V]
    correct = (jnp.argmax(logits, axis=-1) == t_chunk).sum(dtype=jnp.float32)
    return cross_entropy(logits, t_chunk).sum(), correct

  def body(carry, xs):
    loss, correct = one_chunk(weight, *xs)
    return (carry[0] + loss, carry[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (loss, correct), _ = jax.lax.scan(body, (zero, zero), (h_chunks, t_chunks))
  return loss, correct


def llm_loss(model: nnx.Module, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None = None,
             deterministic: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy of an :class:`~jaxckpt.models.llm.LLM`; the family's
  :data:`jaxckpt.training.LossFn`.

  With ``vocab_tiles`` > 1 the logits are computed a sequence chunk at a time (:func:`tiled_loss`); the value and
  the gradients equal the plain loss's.

  Args:
    model: an :class:`~jaxckpt.models.llm.LLM`.
    batch: ``{"tokens": [B, S+1] int32}``: inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
    dropout_key: passed to the model (unused: no dropout in this family).
    deterministic: passed to the model.

  Returns:
    ``(loss, {"loss", "perplexity", "accuracy"})``: nats per token (mean over B·S), ``exp(loss)``, and the share of
    targets that are the argmax of the logits (0–1); float32 scalars.

  Raises:
    JaxckptError: ``vocab_tiles`` does not divide S.
  """
  tokens = batch["tokens"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  h = model.hidden(inputs, dropout_key=dropout_key, deterministic=deterministic)  # [B, S, E]
  count = targets.size
  if model.vocab_tiles == 1:
    logits = model.logits(h)  # [B, S, V] compute dtype
    total = cross_entropy(logits, targets).sum()
    correct = (jnp.argmax(logits, axis=-1) == targets).sum(dtype=jnp.float32)
  else:
    total, correct = tiled_loss(h, targets, model.output_weight, tiles=model.vocab_tiles, tied=model.head is None,
                                soft_cap=model.final_logit_softcap, dtype=model.dtype)
  loss = total / count
  return loss, {"loss": loss, "perplexity": jnp.exp(loss), "accuracy": correct / count}
