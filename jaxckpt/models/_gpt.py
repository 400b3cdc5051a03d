"""A GPT-style decoder built from jaxckpt's remat-wrapped blocks, with a frozen config, presets and its LM loss.

``GPT``: token embedding + learned positions → L pre-LN causal Transformer layers (:class:`~jaxckpt.TransformerBlock`,
block types ``attn`` and ``mlp``) in a :class:`~jaxckpt.Stack` → final LayerNorm → logits over the vocabulary, through
the token embedding (tied, ``embed.attend``) or a separate bias-free linear head (untied). The layout of GPT-2
(Radford et al., 2019, "Language Models are Unsupervised Multitask Learners").

Attention: ``attention="xla"`` writes it with ``einsum`` (``dot_general``), so ``dots_saveable`` and friends save its
matmuls, and dropout applies to the attention weights. ``attention="dot_product_attention"`` calls
``jax.nn.dot_product_attention``, which on GPU with a bfloat16/float16 compute dtype runs cuDNN flash attention: a
custom call, **not** a ``dot_general``, so the dots policies do not save it (the whole attention is recomputed in the
backward pass unless named). Its output is therefore tagged with the checkpoint name ``attn_context``
(:data:`jaxckpt.names.ATTN_CONTEXT`): save it with ``save_only_these_names:attn_context`` on any backend. Where
cuDNN does not apply (CPU, float32) JAX falls back to an ``einsum`` implementation whose matmuls the dots policies
do see, so dots-policy memory differs between backends for this mode; the name-based policies behave the same. There
are no ``attn_weights`` and no attention-weight dropout in this mode.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxckpt.models._gpt import GPT_PRESETS, build_gpt, lm_loss
    >>> model = build_gpt(GPT_PRESETS["tiny"], policy="attn=dots_saveable,mlp=full")
    >>> tokens = jnp.zeros((8, 65), jnp.int32)                    # [B, T+1] int32
    >>> loss, metrics = lm_loss(model, {"tokens": tokens}, dropout_key=None, deterministic=True)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.models._configs import check_config, compute_dtype
from jaxckpt.errors import JaxckptError
from jaxckpt.nnx._layers import Stack, TransformerBlock, set_policy
from jaxckpt.policies._spec import Policy, PolicySpec

GPT_BLOCK_TYPES: tuple[str, ...] = ("attn", "mlp")
"""Block types of :class:`GPT` (policy specs like ``attn=dots_saveable,mlp=full`` name these)."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """A GPT-style decoder (``gpt``). Presets in :data:`GPT_PRESETS`; override with :func:`jaxckpt.models._configs.override`.

  Checked when made (:func:`jaxckpt.models._configs.check_config`): sizes ≥ 1, ``vocab_size`` ≥ 2, ``num_heads`` divides
  ``dim``, known ``attention``, ``structure`` and ``compute_dtype``.

  Raises:
    JaxckptError: a bad field, named as its argument (``seq_len=0 must be a whole number ≥ 1``).
  """

  num_layers: int = 6  # Transformer layers L.
  dim: int = 256  # Model width d (channels per token).
  num_heads: int = 4  # Attention heads H (divides d).
  mlp_dim: int = 1024  # MLP hidden width F (4·d).
  seq_len: int = 256  # Context length T (tokens); also the number of learned positions.
  vocab_size: int = 256  # Vocabulary V (tokens); 256 = bytes.
  batch_size: int = 8  # Sequences per training step B (read by the experiment and the report, not by the model).
  dropout_rate: float = 0.1  # Dropout on attention weights (xla attention only) and on each sublayer's output.
  tie_embeddings: bool = True  # Logits through the token embedding (True) or a separate [d, V] head (False).
  attention: str = "xla"  # "xla" (einsum + softmax) or "dot_product_attention" (jax.nn.dot_product_attention).
  scan: bool = True  # Scan over layers (True) or unroll them.
  structure: str = "block"  # Remat structure of the stack: "block", "every:K", "nested", "nested:D" (see Stack).
  compute_dtype: str = "float32"  # "float32" or "bfloat16" (parameters stay float32; logits are float32).

  def __post_init__(self):
    check_config(self)


GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(num_layers=2, dim=64, num_heads=2, mlp_dim=256, seq_len=64, vocab_size=256, batch_size=8),
    "small": GPTConfig(num_layers=6, dim=256, num_heads=4, mlp_dim=1024, seq_len=256, vocab_size=256, batch_size=8),
    "gpt2-small": GPTConfig(num_layers=12, dim=768, num_heads=12, mlp_dim=3072, seq_len=1024, vocab_size=50257,
                            batch_size=8),
}
"""Preset name -> :class:`GPTConfig`: ``tiny`` (tests, seconds), ``small`` (byte-level, minutes on a CPU) and
``gpt2-small`` (GPT-2's 124M shapes, BPE vocabulary; for compiled-memory reports, not for CPU training)."""


class GPT(nnx.Module):
  """GPT-style causal decoder: embed + positions → L causal Transformer layers → LayerNorm → logits.

  Args:
    config: :class:`GPTConfig`.
    rngs: initialisation keys (keyword-only). Embeddings and positions are ``normal(0.02)`` as in GPT-2.

  Raises:
    JaxckptError: a bad config value (sizes < 1, ``num_heads`` not dividing ``dim``, unknown attention, dtype or
      structure).
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    dtype = compute_dtype(config.compute_dtype)
    self.dtype, self.seq_len, self.tie_embeddings = dtype, config.seq_len, config.tie_embeddings
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, embedding_init=init, rngs=rngs)
    self.pos = nnx.Param(init(rngs.params(), (config.seq_len, config.dim)))  # [T, d]
    self.layers = Stack(
        lambda r: TransformerBlock(
            config.dim, config.num_heads, config.mlp_dim, dropout_rate=config.dropout_rate, causal=True,
            attention=config.attention, dtype=dtype, rngs=r,
        ),
        config.num_layers,
        scan=config.scan,
        rngs=rngs,
        structure=config.structure,
    )
    self.norm = nnx.LayerNorm(config.dim, dtype=dtype, rngs=rngs)
    if not config.tie_embeddings:
      self.head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` int32 token ids in ``0..V-1``, T ≤ ``config.seq_len`` (position t sees tokens ≤ t).
      dropout_key: PRNG key for dropout; required when ``deterministic=False`` and ``dropout_rate > 0``.
      deterministic: ``True`` turns dropout off (evaluation).

    Returns:
      ``[B, T, V]`` float32 logits; ``logits[:, t]`` predicts ``tokens[:, t + 1]``.

    Raises:
      JaxckptError: more tokens than learned positions.
    """
    tokens_per_row = tokens.shape[1]
    if tokens_per_row > self.seq_len:
      raise JaxckptError(f"{tokens_per_row} tokens per sequence exceed the model's seq_len={self.seq_len} positions")
    h = self.embed(tokens) + self.pos[:tokens_per_row].astype(self.dtype)  # [B, T, d]
    h = self.layers(h, dropout_key=dropout_key, deterministic=deterministic)  # [B, T, d]
    h = self.norm(h)
    logits = self.embed.attend(h) if self.tie_embeddings else self.head(h)  # [B, T, V]
    return logits.astype(jnp.float32)


def build_gpt(config: GPTConfig | None = None, *, policy: "str | Policy | PolicySpec | None" = None,
              seed: int = 0) -> GPT:
  """Builds a :class:`GPT` with a policy spec validated against its block types (``attn``, ``mlp``).

  Args:
    config: default the ``small`` preset.
    policy: policy spec (see :func:`jaxckpt.parse_policy`).
    seed: parameter initialisation seed.

  Returns:
    The model. ``nnx.eval_shape(lambda: build_gpt(GPT_PRESETS["gpt2-small"]))`` gives its shapes without
    allocating.

  Raises:
    JaxckptError: a bad config value. PolicySpecError: a policy invalid for this model.
  """
  config = GPT_PRESETS["small"] if config is None else config
  if not isinstance(config, GPTConfig):
    raise JaxckptError(f"build_gpt takes a GPTConfig, got {type(config).__name__}")
  model = GPT(config, rngs=nnx.Rngs(seed))
  set_policy(model, policy)
  return model


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None,
            deterministic: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy; the :data:`jaxckpt.training._train.LossFn` of language models.

  Args:
    model: maps ``[B, T]`` int32 tokens to ``[B, T, V]`` float32 logits.
    batch: ``{"tokens": [B, T+1] int32}``: inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
    dropout_key: PRNG key for dropout (``None`` when deterministic).
    deterministic: turn dropout off.

  Returns:
    ``(loss, {"loss", "perplexity", "accuracy"})``: loss in nats per token (mean over B·T), perplexity
    ``exp(loss)``, accuracy the share of targets that are the argmax of the logits (0–1). All float32 scalars.
  """
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1], dropout_key=dropout_key, deterministic=deterministic)  # [B, T, V]
  targets = tokens[:, 1:]  # [B, T]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  accuracy = (logits.argmax(-1) == targets).mean(dtype=jnp.float32)
  return loss, {"loss": loss, "perplexity": jnp.exp(loss), "accuracy": accuracy}


def lm_batch_struct(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract batch of :func:`lm_loss` (for compiling); also ``MODEL_REGISTRY["gpt"].batch``.

  Args:
    batch_size: sequences B.
    seq_len: tokens per sequence T (the model's input length; the batch holds T+1 for the shifted targets).

  Returns:
    ``{"tokens": ShapeDtypeStruct([B, T+1], int32)}``.
  """
  return {"tokens": jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)}
