"""The LLM family's model: token embedding → a scanned stack of decoder blocks → final RMSNorm → logits.

One class for Llama 2, Llama 3.1, Mistral, Gemma and Gemma 2 (their differences are config fields,
:class:`~jaxckpt.models.llm.LLMConfig`), as MaxText's decoder serves its model configs. The decoder blocks are
:class:`~jaxckpt.models.llm.DecoderBlock` s (block type ``decoder``) in a :class:`jaxckpt.nnx.Stack`: scanned, the
policy on the scan body, one ``jax.checkpoint`` per block as MaxText's ``nn.remat`` inside ``nn.scan``.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.models._configs import dtype_named, unknown_preset
from jaxckpt.models.llm._config import LLM_PRESETS, LLMConfig
from jaxckpt.models.llm._layers import EMBED_AXES, DecoderBlock, RMSNorm
from jaxckpt.models.llm._moe import MoEDispatch, expert_capacity
from jaxckpt.nnx._layers import Stack, set_policy
from jaxckpt.policies._spec import Policy, PolicySpec
from jaxckpt.sharding._gather import gather_param
from jaxckpt.sharding._rules import constrain

LLM_BLOCK_TYPES: tuple[str, ...] = ("decoder",)
"""Block types of :class:`LLM`: one, the decoder block (``decoder=save_only_these_names:query_proj`` names it)."""

LOGIT_AXES = ("activation_batch", "activation_length", "activation_vocab")
"""Logical names of the logits ``[B, S, V]``."""


def project_logits(h: jax.Array, weight: jax.Array, *, tied: bool, soft_cap: float | None, dtype) -> jax.Array:
  """Logits from final hidden states, in the compute dtype.

  Args:
    h: ``[B, S, E]`` normalised hidden states (compute dtype).
    weight: the embedding ``[V, E]`` (``tied``) or the head ``[E, V]``, any dtype (cast to ``dtype``).
    tied: whether ``weight`` is the token embedding.
    soft_cap: Gemma 2's final soft cap ``c``: logits become ``tanh(x / c) · c``; ``None`` for none.
    dtype: the compute dtype.

  Returns:
    ``[B, S, V]`` in ``dtype``.
  """
  w = gather_param(weight, ("vocab", "embed") if tied else ("embed", "vocab")).astype(dtype)  # FSDP: here, per use
  logits = jnp.einsum("bse,ve->bsv", h, w) if tied else jnp.einsum("bse,ev->bsv", h, w)
  if soft_cap is not None:
    logits = jnp.tanh(logits / soft_cap) * soft_cap
  return constrain(logits, LOGIT_AXES)


class LLM(nnx.Module):
  """A decoder-only language model: embed → ``num_layers`` decoder layers (scanned blocks) → RMSNorm → logits.

  Parameters (logical names): ``embedding [V, E]`` (vocab, embed), the stack ``decoder`` (each parameter with
  ``layers`` in front; an MoE's experts ``exp`` first), before it an MoE's first dense layers ``dense_decoder``
  (``None`` otherwise), ``final_norm [E]`` (norm), and, untied, ``head [E, V]`` (embed, vocab). The embedded tokens
  are multiplied by ``sqrt(E)`` when ``scale_embeddings`` (Gemma). Logits are in the compute dtype; the loss
  (:func:`jaxckpt.models.llm.llm_loss`) takes their logsumexp in float32.

  Touvron et al. 2023 (Llama 2), Grattafiori et al. 2024 (Llama 3), Gemma Team 2024 (Gemma, Gemma 2).

  Args:
    config: :class:`~jaxckpt.models.llm.LLMConfig`.
    rngs: initialisation keys (keyword-only). The embedding is ``normal(1 / sqrt(E))``, projections
      fan-in truncated normal, norm scales constant.

  Raises:
    JaxckptError: a config of another class.

  Example::

    >>> model = LLM(LLM_PRESETS["llama-tiny"], rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 64), jnp.int32)).shape                    # [B, S, V]
    (2, 64, 256)
  """

  gathered_in_use: ClassVar[tuple[str, ...]] = ("embedding", "head")
  """Parameters gathered over ``fsdp`` where they are used, not at the start of the loss
  (:func:`jaxckpt.sharding.gathered_in_use_paths`): with vocabulary tiling each chunk gathers the output
  weight inside its ``jax.checkpoint``, so a chip holds it gathered for one chunk at a time."""

  def __init__(self, config: LLMConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, LLMConfig):
      raise JaxckptError(f"LLM takes an LLMConfig, got {type(config).__name__}")
    self.dtype = dtype_named(config.compute_dtype, argument="compute_dtype")
    param_dtype = dtype_named(config.weight_dtype, argument="weight_dtype")
    embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=0)
    self.embedding = nnx.Param(nnx.with_partitioning(embed_init, ("vocab", "embed"), eager_sharding=False)(
        rngs.params(), (config.vocab_size, config.dim), param_dtype))
    per_block = len(config.layer_pattern)
    self.dense_decoder = Stack(lambda r: DecoderBlock(config, rngs=r), config.first_dense_layers // per_block,
                               scan=config.scan, structure=config.structure,
                               rngs=rngs) if config.is_moe and config.first_dense_layers else None
    self.decoder = Stack(lambda r: DecoderBlock(config, experts=config.is_moe, rngs=r),
                         (config.num_moe_layers if config.is_moe else config.num_layers) // per_block,
                         scan=config.scan, structure=config.structure, rngs=rngs)
    self.final_norm = RMSNorm(config.dim, eps=config.norm_eps, scale_offset=config.norm_scale_offset,
                              dtype=self.dtype, param_dtype=param_dtype, rngs=rngs)
    head_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    self.head = None if config.tie_embeddings else nnx.Param(nnx.with_partitioning(
        head_init, ("embed", "vocab"), eager_sharding=False)(rngs.params(), (config.dim, config.vocab_size),
                                                             param_dtype))
    self.seq_len, self.scale_embeddings = config.seq_len, config.scale_embeddings
    self.final_logit_softcap, self.vocab_tiles = config.final_logit_softcap, config.vocab_tiles
    self.num_layers, self.dim, self.num_heads = config.num_layers, config.dim, config.num_heads
    self.num_experts, self.experts_per_token, self.num_moe_layers = (config.num_experts, config.experts_per_token,
                                                                     config.num_moe_layers)
    self.moe_dispatch, self.capacity_factor = config.moe_dispatch, config.capacity_factor

  def tensor_allreduce_bytes_per_example(self) -> int:
    """Bytes a ``tensor`` mesh axis all-reduces per sequence in one train step (before the all-reduce's own
    2 (t − 1)/t factor): Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3) sums the
    attention output and the MLP output of every layer over the axis in the forward pass, and their input gradients in
    the backward pass: 4 × L × S × E values in the compute dtype. Read by the fit planner's time model
    (:func:`jaxckpt.fit.candidates`)."""
    return 4 * self.num_layers * self.seq_len * self.dim * jnp.dtype(self.dtype).itemsize

  def expert_alltoall_bytes_per_example(self) -> int:
    """Bytes an ``expert`` mesh axis's all-to-alls move per sequence in one train step (before the all-to-all's own
    (e − 1)/e factor): the dropping dispatch sends every expert's ``[C, E]`` buffer to the expert's device and its
    output back (GShard's dispatch and combine, Lepikhin et al. 2020), in the forward pass, and their transposes in
    the backward pass: 4 × (MoE layers) × X × C × E values in the compute dtype (C =
    :func:`~jaxckpt.models.llm.expert_capacity`; a remat policy that recomputes the dispatch moves more). 0 for a
    dense model and for the dropless dispatches (they gather their experts' weights over the axis instead). Read by
    the fit planner's time model (:func:`jaxckpt.fit.traffic_of`)."""
    if not self.num_experts or self.moe_dispatch is not MoEDispatch.DROPPING:
      return 0
    capacity = expert_capacity(self.seq_len, self.num_experts, self.experts_per_token, self.capacity_factor)
    return (4 * self.num_moe_layers * self.num_experts * capacity * self.dim
            * jnp.dtype(self.dtype).itemsize)

  def hidden(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True
             ) -> jax.Array:
    """The final hidden states, after the final norm.

    Args:
      tokens: ``[B, S]`` int32 token ids in ``0 .. V-1``, S ≤ ``config.seq_len`` (position s sees tokens ≤ s).
      dropout_key: unused (no dropout in this family); accepted for the model protocol.
      deterministic: unused, as ``dropout_key``.

    Returns:
      ``[B, S, E]`` in the compute dtype.

    Raises:
      JaxckptError: more tokens per sequence than ``config.seq_len``.
    """
    if tokens.shape[1] > self.seq_len:
      raise JaxckptError(f"{tokens.shape[1]} tokens per sequence exceed the model's seq_len={self.seq_len}")
    h = jnp.take(gather_param(self.embedding[...], ("vocab", "embed"), lookup=True), tokens, axis=0).astype(self.dtype)  # [B, S, E]
    if self.scale_embeddings:
      h = h * jnp.asarray(h.shape[-1] ** 0.5, self.dtype)
    h = constrain(h, EMBED_AXES)
    if self.dense_decoder is not None:  # an MoE's first dense layers (DeepSeek-V3's three)
      h = self.dense_decoder(h, dropout_key=dropout_key, deterministic=deterministic)
    h = self.decoder(h, dropout_key=dropout_key, deterministic=deterministic)
    return self.final_norm(h)

  @property
  def output_weight(self) -> jax.Array:
    """The weight the logits are computed with: the embedding ``[V, E]`` when tied, else the head ``[E, V]``."""
    return self.embedding[...] if self.head is None else self.head[...]

  def logits(self, h: jax.Array) -> jax.Array:
    """``[B, S, E]`` final hidden states -> ``[B, S, V]`` logits in the compute dtype (:func:`project_logits`)."""
    return project_logits(h, self.output_weight, tied=self.head is None, soft_cap=self.final_logit_softcap,
                          dtype=self.dtype)

  def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: ``[B, S]`` int32 token ids.
      dropout_key: unused (no dropout in this family).
      deterministic: unused.

    Returns:
      ``[B, S, V]`` logits in the compute dtype; ``logits[:, s]`` predicts ``tokens[:, s + 1]``.

    Raises:
      JaxckptError: more tokens per sequence than ``config.seq_len``.
    """
    return self.logits(self.hidden(tokens, dropout_key=dropout_key, deterministic=deterministic))


def build_llm(config: LLMConfig | str = "llama-tiny", *, policy: "str | Policy | PolicySpec | None" = None,
              seed: int = 0) -> LLM:
  """Builds an :class:`LLM` with a policy spec validated against its block type (``decoder``).

  Args:
    config: an :class:`~jaxckpt.models.llm.LLMConfig` or a preset name (:data:`~jaxckpt.models.llm.LLM_PRESETS`).
    policy: policy spec (:func:`jaxckpt.parse_policy`), e.g. ``"save_only_these_names:query_proj+key_proj"``.
    seed: parameter initialisation seed.

  Returns:
    The model. ``nnx.eval_shape(lambda: build_llm("llama3.1-405b"))`` gives its shapes without allocating.

  Raises:
    JaxckptError: an unknown preset (with the closest name) or a config of another class. PolicySpecError: a policy
      invalid for this model.
  """
  if isinstance(config, str):
    if config not in LLM_PRESETS:
      raise unknown_preset("llm", config, LLM_PRESETS)
    config = LLM_PRESETS[config]
  model = LLM(config, rngs=nnx.Rngs(seed))
  set_policy(model, policy)
  return model
