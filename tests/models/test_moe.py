"""The LLM family's Mixtures of Experts: presets at their published sizes, the router, the three dispatches computing
one function, MaxText's MoE checkpoint names at MaxText's places, and DeepSeek's latent attention.

Published parameter counts (total / activated per token), the sources of ``tests/test_llm.py``'s MoE rows:

- Mixtral 8x7B: 46.7B / 12.9B (Mistral AI, "Mixtral of experts", mistral.ai/news/mixtral-of-experts, 2023-12-11:
  "46.7B total parameters but only uses 12.9B parameters per token"; Jiang et al. 2024, arXiv:2401.04088: 47B / 13B).
- Mixtral 8x22B: 141B / 39B (Mistral AI, "Cheaper, Better, Faster, Stronger", mistral.ai/news/mixtral-8x22b,
  2024-04-17: "39B active parameters out of 141B").
- Qwen3-30B-A3B: 30.5B / 3.3B; Qwen3-235B-A22B: 235B / 22B (the Qwen3 model cards on Hugging Face, "Number of
  Parameters: 30.5B in total and 3.3B activated"; Qwen Team 2025, "Qwen3 Technical Report", Table 2).
- DeepSeek-V3: 671B / 37B (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, abstract: "671B total
  parameters with 37B activated for each token"; the 685B of its Hugging Face card add the 14B multi-token-prediction
  module, which is not part of the model trained here).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt import names
from jaxckpt.analysis._jaxprs import emitted_checkpoint_names
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.errors import JaxckptError
from jaxckpt.models import MODEL_REGISTRY, config_record, field_names
from jaxckpt.models.llm import (LLM_PRESETS, DecoderBlock, LLMConfig, MLAConfig, MoEConfig, MoEDispatch, build_llm,
                                dropping_moe, expert_capacity, llm_loss, route, sorted_moe)
from tests.numerics import assert_trees_close

ACTIVE_BILLIONS = {"mixtral-8x7b": "12.9", "mixtral-8x22b": "39", "qwen3-30b-a3b": "3.3", "qwen3-235b-a22b": "22",
                   "deepseek-v3": "37"}
"""Activated parameters per token, as published (module docstring), rounded as there."""


@pytest.mark.parametrize("name", sorted(ACTIVE_BILLIONS))
def test_activated_parameters_are_the_published_ones(name):
  """At the published precision, rounded — or, for Qwen3-30B-A3B and DeepSeek-V3, cut: their "3.3B" and "37B" are our
  3.353B and 37.55B truncated (Mixtral's "12.9B" is our 12.88B rounded); neither source says how it rounds, nor
  whether it counts the input embedding, of which a token reads one row (without it: 3.04B and 36.6B)."""
  config = LLM_PRESETS[name]
  published = ACTIVE_BILLIONS[name]
  decimals = len(published.partition(".")[2])
  rounded = f"{config.active_params / 1e9:.{decimals}f}"
  cut = f"{int(config.active_params / 10 ** (9 - decimals)) / 10 ** decimals:.{decimals}f}"
  assert rounded == published or (name in ("qwen3-30b-a3b", "deepseek-v3") and cut == published), (
      name, config.active_params)


def test_presets_carry_maxtexts_moe_dimensions():
  mixtral = LLM_PRESETS["mixtral-8x22b"]
  assert (mixtral.dim, mixtral.num_heads, mixtral.num_kv_heads, mixtral.expert_dim, mixtral.num_layers,
          mixtral.vocab_size, mixtral.num_experts, mixtral.experts_per_token) == (6144, 48, 8, 16384, 56, 32768, 8, 2)
  assert (mixtral.seq_len, mixtral.batch_size, mixtral.rope_theta) == (4096, 8, 1e6)  # MaxText's T12
  deepseek = LLM_PRESETS["deepseek-v3"]
  assert (deepseek.num_dense_layers, deepseek.num_moe_layers, deepseek.shared_experts, deepseek.router) == (
      3, 58, 1, "sigmoid")
  assert (deepseek.q_lora_rank, deepseek.kv_lora_rank, deepseek.qk_rope_head_dim, deepseek.v_head_dim) == (
      1536, 512, 64, 128)
  assert LLM_PRESETS["qwen3-30b-a3b"].qk_norm and LLM_PRESETS["qwen3-30b-a3b"].num_experts == 128
  # the counts of an MoE layer and of MLA by hand: Mixtral 8x7B's 8 experts of 3·4096·14336 and its router
  assert LLM_PRESETS["mixtral-8x7b"].moe_layer_params == 8 * 3 * 4096 * 14336 + 4096 * 8
  assert deepseek.attention_params == (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
                                       + 128 * 128 * 7168)


@pytest.mark.parametrize("overrides, message", [
    (dict(experts_per_token=5), "experts_per_token=5 must be at most num_experts=4"),
    (dict(moe_dispatch="megablox"), "moe_dispatch='megablox' is unknown"),
    (dict(capacity_factor=0), "capacity_factor=0 must be a number > 0"),
    (dict(first_dense_layers=2), "first_dense_layers=2 must be below num_layers=2"),
    (dict(router="topk"), "router='topk' is unknown"),
    (dict(v_head_dim=16), "give kv_lora_rank > 0 too"),
])
def test_bad_moe_field_is_one_line(overrides, message):
  with pytest.raises(JaxckptError, match=message) as err:
    dataclasses.replace(LLM_PRESETS["mixtral-tiny"], **overrides)
  assert "\n" not in str(err.value)


def test_the_moe_and_mla_fields_are_parts_that_the_config_still_takes_and_reads_flat():
  """LLMConfig groups a variant's fields into frozen parts (moe, mla, kernel); construction, dataclasses.replace and
  a model entry's override take the flat names, the attributes read them, and metrics' flat record is unchanged. The
  dispatch is read once into a str-valued enum: members compare, the text stays in JSON and on the command line."""
  config = LLM_PRESETS["deepseek-tiny"]
  assert isinstance(config.moe, MoEConfig) and isinstance(config.mla, MLAConfig)
  assert (config.moe.num_experts, config.num_experts, config.mla.kv_lora_rank, config.kernel.attention) == (
      8, 8, 16, "xla")
  made = LLMConfig(num_layers=3, first_dense_layers=1, num_heads=4, num_kv_heads=4, num_experts=8,
                   moe_dispatch="dropping", kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16)
  assert made.moe == MoEConfig(num_experts=8, first_dense_layers=1, moe_dispatch=MoEDispatch.DROPPING)
  assert made.moe_dispatch is MoEDispatch.DROPPING and made.moe_dispatch == "dropping"
  assert (str(made.moe_dispatch), f"{made.moe_dispatch}", json.dumps(made.moe_dispatch)) == (
      "dropping", "dropping", '"dropping"')
  replaced = dataclasses.replace(config, moe_dispatch="ragged", routed_scale=1.5)
  assert (replaced.moe_dispatch, replaced.routed_scale, replaced.router, replaced.mla) == (
      MoEDispatch.RAGGED, 1.5, "sigmoid", config.mla)
  whole = LLMConfig(moe=MoEConfig(num_experts=4), experts_per_token=1)  # a part given whole, one field beside it
  assert (whole.num_experts, whole.experts_per_token) == (4, 1)
  overridden = MODEL_REGISTRY["llm"].override("mixtral-tiny", moe_dispatch="gmm", capacity_factor=2.0)
  assert overridden.moe_dispatch is MoEDispatch.GMM and overridden.capacity_factor == 2.0
  record = config_record(config)
  assert record["moe_dispatch"] == "auto" and record["kv_lora_rank"] == 16 and "moe" not in record
  assert set(record) == set(field_names(LLMConfig)) - {"moe", "mla", "kernel"}
  assert len(dataclasses.fields(LLMConfig)) <= 31  # 45 flat fields before the parts
  with pytest.raises(TypeError, match="unexpected keyword argument 'num_expert'"):
    LLMConfig(num_expert=4)
  with pytest.raises(JaxckptError, match="moe=4 must be a MoEConfig"):
    LLMConfig(moe=4)


# --- the router ---

def test_softmax_routing_equals_qwens_renormalised_softmax_and_sigmoid_routing_chooses_by_score_plus_bias():
  logits = jax.random.normal(jax.random.key(0), (5, 8))
  indices, weights = route(logits, 2)
  full = jax.nn.softmax(logits, axis=-1)
  picked = jnp.take_along_axis(full, indices, axis=-1)
  np.testing.assert_allclose(weights, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
  assert (indices == jax.lax.top_k(logits, 2)[1]).all()
  bias = jnp.zeros(8).at[3].set(100.0)  # expert 3 chosen for every token, weighted by its score, not the bias
  indices, weights = route(logits, 2, router="sigmoid", bias=bias, scale=2.5)
  assert (indices[:, 0] == 3).all()
  scores = jax.nn.sigmoid(logits)
  chosen = jnp.take_along_axis(scores, indices, axis=-1)
  np.testing.assert_allclose(weights, 2.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


# --- the dispatches ---

def _experts(key, x=8, e=16, f=32):
  k1, k2, k3 = jax.random.split(key, 3)
  return (jax.random.normal(k1, (x, e, f)) / 4, jax.random.normal(k2, (x, e, f)) / 4,
          jax.random.normal(k3, (x, f, e)) / 6)


def test_the_three_dispatches_compute_one_function_when_nothing_is_dropped():
  x = jax.random.normal(jax.random.key(1), (2, 16, 16))
  indices, weights = route(jax.random.normal(jax.random.key(2), (2, 16, 8)), 2)
  wi_0, wi_1, wo = _experts(jax.random.key(3))
  dropping = dropping_moe(x, indices, weights, wi_0, wi_1, wo, capacity_factor=4.0, activation="silu")
  flat = lambda kind: sorted_moe(x.reshape(32, 16), indices.reshape(32, 2), weights.reshape(32, 2), wi_0, wi_1, wo,
                                 kernel=kind, activation="silu", interpret=True).reshape(2, 16, 16)  # noqa: E731
  assert_trees_close(flat("ragged"), dropping, depth=3, what="ragged vs dropping dispatch")
  assert_trees_close(flat("gmm"), dropping, depth=3, what="gmm vs dropping dispatch")
  # by hand: each token's two experts' SwiGLU outputs, weighted
  per_token = jnp.einsum("bsxf,xfe->bsxe", jax.nn.silu(jnp.einsum("bse,xef->bsxf", x, wi_0))
                         * jnp.einsum("bse,xef->bsxf", x, wi_1), wo)
  want = jnp.einsum("bsxe,bsx->bse", per_token,
                    jnp.sum(jax.nn.one_hot(indices, 8) * weights[..., None], axis=2))
  assert_trees_close(dropping, want, depth=3, what="dropping dispatch vs every expert by hand")


def test_the_dropping_dispatch_drops_tokens_past_each_experts_capacity():
  assert expert_capacity(4096, 8, 2, 1.25) == 1280  # MaxText's int(ceil(S·k/X)·cf): T11/T12
  assert expert_capacity(4, 8, 2, 1.0) == 1
  x = jax.random.normal(jax.random.key(1), (1, 4, 16))
  indices = jnp.array([[[0, 1], [0, 2], [0, 1], [3, 1]]], jnp.int32)  # expert 0 wanted 3 times, expert 1 3 times
  weights = jnp.full((1, 4, 2), 0.5)
  wi_0, wi_1, wo = _experts(jax.random.key(3))
  got = dropping_moe(x, indices, weights, wi_0, wi_1, wo, capacity_factor=2.0, activation="silu")  # capacity 2
  kept = jnp.array([[[1, 1], [1, 1], [0, 1], [1, 0]]], jnp.float32)  # the third to come to an expert is dropped
  dense = sorted_moe(x.reshape(4, 16), indices.reshape(4, 2), (weights * kept).reshape(4, 2), wi_0, wi_1, wo,
                     kernel="ragged", activation="silu")
  assert_trees_close(got, dense.reshape(1, 4, 16), depth=3, what="dropping vs the kept pairs")


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-tiny"])
def test_the_model_trains_alike_on_every_dispatch(preset):
  tokens = jax.random.randint(jax.random.key(0), (2, 65), 0, 256)

  def loss_and_grads(dispatch):
    model = build_llm(dataclasses.replace(LLM_PRESETS[preset], moe_dispatch=dispatch, capacity_factor=8.0,
                                          gmm_interpret=True), policy="full")
    return nnx.value_and_grad(lambda m: llm_loss(m, {"tokens": tokens})[0])(model)

  want = loss_and_grads("ragged")
  for dispatch in ("dropping", "gmm"):
    got = loss_and_grads(dispatch)
    assert_trees_close(jax.tree.map(jnp.asarray, got), jax.tree.map(jnp.asarray, want),
                       depth=LLM_PRESETS[preset].num_layers, what=f"loss and gradients, {dispatch} vs ragged")


def test_gmm_off_a_tpu_without_interpret_is_one_line():
  model = build_llm(dataclasses.replace(LLM_PRESETS["mixtral-tiny"], moe_dispatch="gmm"))
  with pytest.raises(JaxckptError, match="moe_dispatch='gmm' runs the megablox Pallas TPU kernel") as err:
    model(jnp.zeros((2, 64), jnp.int32))
  assert "\n" not in str(err.value)


# --- checkpoint names at MaxText's places ---

def _block_names(config):
  block = DecoderBlock(config, experts=True, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  traced = emitted_checkpoint_names(lambda s, x: nnx.merge(graphdef, s)(x), state, jnp.ones((2, 16, 64)))
  return traced, frozenset(block.checkpoint_names)


def test_expert_matmuls_carry_both_names_as_maxtext_tags_them():
  dropping, declared = _block_names(dataclasses.replace(LLM_PRESETS["mixtral-tiny"], moe_dispatch="dropping"))
  assert dropping == declared == frozenset(names.DECODER_NAMES) | {"moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"}
  dropless, declared = _block_names(LLM_PRESETS["mixtral-tiny"])
  assert dropless == declared  # MaxText's sparse path: the up projection is moe_mlpwi_1 only
  assert dropless == (frozenset(names.DECODER_NAMES) - {"mlpwi_1"}) | frozenset(names.MOE_NAMES)


def _saved(policy: str, dispatch: str) -> set[str]:
  config = dataclasses.replace(LLM_PRESETS["mixtral-tiny"], moe_dispatch=dispatch)
  block = DecoderBlock(config, experts=True, policy=policy, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  res = saved_residuals(lambda x: nnx.merge(graphdef, state)(x).sum(), jnp.ones((2, 16, 64)))
  return {r.name for r in res if r.name is not None}


def test_maxtexts_presets_save_the_experts_through_their_inner_names():
  # minimal saves mlpwi_0/mlpwi_1/mlpwo: on the dropping path every expert matmul (inner names)
  assert {"mlpwi_0", "mlpwi_1", "mlpwo"} <= _saved("minimal", "dropping")
  # on the dropless path MaxText's minimal reaches the gate and output projections, not moe_mlpwi_1
  dropless = _saved("minimal", "ragged")
  assert {"mlpwi_0", "mlpwo"} <= dropless and "moe_mlpwi_1" not in dropless
  # the MoE knobs by their own names: custom moe_x_sorted and moe_routing_maps = device
  knobs = _saved("save_only_these_names:moe_x_sorted+moe_routing_maps+moe_mlpwi_1", "ragged")
  assert knobs == {"moe_x_sorted", "moe_routing_maps", "moe_mlpwi_1"}


def test_a_dropping_model_refuses_the_dropless_knobs_in_one_line():
  model = build_llm(dataclasses.replace(LLM_PRESETS["mixtral-tiny"], moe_dispatch="dropping"))
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="moe_x_sorted") as err:
    jaxckpt.set_policy(model, "save_only_these_names:moe_x_sorted")
  assert "\n" not in str(err.value)
  jaxckpt.set_policy(model, "minimal")  # MaxText's preset applies


# --- DeepSeek's latent attention ---

def test_latent_attention_emits_mlas_names_and_narrow_values():
  config = LLM_PRESETS["deepseek-tiny"]
  traced, declared = _block_names(config)
  assert traced == declared and set(names.MLA_NAMES) <= traced
  block = DecoderBlock(config, experts=True, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  shapes = {}

  def record(q, k, v, **kwargs):
    shapes.update(q=q.shape, k=k.shape, v=v.shape)
    return jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype)

  from jaxckpt.models.llm import _layers
  original = _layers.kernels.attention
  _layers.kernels.attention = record
  try:
    jax.eval_shape(lambda s: nnx.merge(graphdef, s)(jnp.ones((2, 16, 64))), state)
  finally:
    _layers.kernels.attention = original
  assert shapes == {"q": (2, 16, 4, 24), "k": (2, 16, 4, 24), "v": (2, 16, 4, 16)}  # Dh + Dr = 16 + 8; Dv = 16
