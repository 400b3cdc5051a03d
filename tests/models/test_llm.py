"""The LLM family (jaxckpt.models.llm): parameter counts of every preset against the built model and the public figures,
remat keeps gradients, MaxText's checkpoint names at MaxText's places, the float32-logsumexp cross-entropy, vocabulary
tiling, Gemma 2's local/global layers and soft caps, the kernel seam, and one-line errors for bad configs.

Real-size presets are only ever built abstractly (``nnx.eval_shape``: nothing allocated, nothing compiled); the
numerics run on the float32 tiny presets. Float comparisons follow the suite's rule (tests/numerics.py: per leaf
C·u·depth of its largest magnitude), depth = the preset's decoder layers for whole-model losses and gradients, the
number of matmuls for single functions.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.analysis import saved_residuals
from jaxckpt.analysis._jaxprs import emitted_checkpoint_names
from jaxckpt.names import DECODER_NAMES
from jaxckpt.errors import JaxckptError
from jaxckpt.models import MODEL_REGISTRY
from jaxckpt.models.llm import (LLM, LLM_PRESETS, DecoderBlock, attention, build_llm, cross_entropy, llm_loss,
                                rope_frequencies, select_kernel, xla_attention)
from jaxckpt.policies._spec import MAXTEXT_PRESETS
from tests.extras import needs_libtpu, skip_without_libtpu
from tests.numerics import assert_trees_close
from tests.tiny import LLM_GRAD_SEQ, llm_batch, llm_loss_and_grads


PUBLIC_BILLIONS = {  # the model cards' and papers' parameter counts, as published (rounded as there)
    "llama2-7b": "6.74", "llama2-13b": "13.0", "llama2-70b": "69.0", "llama3.1-8b": "8.03", "llama3.1-70b": "70.6",
    "llama3.1-405b": "405.9", "mistral-7b": "7.24", "gemma-7b": "8.54", "gemma2-9b": "9.24", "gemma2-27b": "27.2",
    # Mixtures of Experts (sources: tests/models/test_moe.py)
    "mixtral-8x7b": "46.7", "mixtral-8x22b": "141", "qwen3-30b-a3b": "30.5", "qwen3-235b-a22b": "235",
    "deepseek-v3": "671",
}
TINY = ("llama-tiny", "gemma2-tiny")


def _abstract(config):
  return nnx.eval_shape(lambda: LLM(config, rngs=nnx.Rngs(0)))


def _count(model) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


# --- presets ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LLM_PRESETS))
def test_parameter_count_in_closed_form_equals_the_built_model(name):
  config = LLM_PRESETS[name]
  model = _abstract(config)
  assert _count(model) == config.num_params
  if name in PUBLIC_BILLIONS:
    published = PUBLIC_BILLIONS[name]
    decimals = len(published.partition(".")[2])
    assert f"{config.num_params / 1e9:.{decimals}f}" == published, (name, config.num_params)


def test_presets_carry_maxtexts_dimensions():
  shape = lambda c: (c.dim, c.num_heads, c.num_kv_heads, c.mlp_dim, c.num_layers, c.head_dim, c.vocab_size)  # noqa
  assert shape(LLM_PRESETS["llama3.1-8b"]) == (4096, 32, 8, 14336, 32, 128, 128256)
  assert shape(LLM_PRESETS["llama3.1-405b"]) == (16384, 128, 8, 53248, 126, 128, 128256)
  assert shape(LLM_PRESETS["gemma-7b"]) == (3072, 16, 16, 24576, 28, 256, 256128)
  assert shape(LLM_PRESETS["gemma2-27b"]) == (4608, 32, 16, 36864, 46, 128, 256128)
  gemma2 = LLM_PRESETS["gemma2-9b"]
  assert gemma2.num_blocks == 21 and gemma2.layer_pattern == ("local", "global")  # MaxText's 21 scanned pairs
  assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.sliding_window) == (50.0, 30.0, 4096)
  assert LLM_PRESETS["gemma2-27b"].query_scale == pytest.approx(144 ** -0.5)
  assert (LLM_PRESETS["llama3.1-8b"].seq_len, LLM_PRESETS["llama3.1-8b"].batch_size) == (8192, 4)  # MaxText's T1
  assert (LLM_PRESETS["llama2-7b"].seq_len, LLM_PRESETS["llama2-7b"].batch_size) == (4096, 12)  # T19
  real = [c for n, c in LLM_PRESETS.items() if n in PUBLIC_BILLIONS]
  assert {(c.compute_dtype, c.weight_dtype, c.attention) for c in real} == {("bfloat16", "float32", "auto")}


def test_parameters_carry_logical_axis_names_in_their_dtype():
  config = dataclasses.replace(LLM_PRESETS["llama3.1-8b"], weight_dtype="bfloat16")
  model = _abstract(config)
  params = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  names = {path: v.get_metadata()["out_sharding"] for path, v in params.items()}
  layer = "decoder/layers/sublayers/0/"
  assert names["embedding"] == ("vocab", "embed") and names["head"] == ("embed", "vocab")
  assert names[layer + "attention/query"] == ("layers", "embed", "heads", "head_dim")
  assert names[layer + "attention/key"] == ("layers", "embed", "kv_heads", "head_dim")
  assert names[layer + "attention/out"] == ("layers", "heads", "head_dim", "embed")
  assert names[layer + "mlp/wi_0"] == ("layers", "embed", "mlp")
  assert names[layer + "mlp/wo"] == ("layers", "mlp", "embed")
  assert names[layer + "pre_attention_norm/scale"] == ("layers", "norm") and names["final_norm/scale"] == ("norm",)
  assert params[layer + "attention/query"].get_value().shape == (32, 4096, 32, 128)
  assert {v.get_value().dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}


# --- remat keeps the numbers ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=TINY)
def reference(request, llm_tiny_reference):
  """A tiny preset at LLM_GRAD_SEQ tokens without remat, and its loss and gradients (built once a run: conftest.py)."""
  return llm_tiny_reference(request.param)


@pytest.mark.parametrize("policy", ["full", "dots_saveable", "save_only_these_names:query_proj+key_proj+value_proj",
                                    "minimal"])
def test_gradients_equal_no_remat(reference, policy):
  model, (ref_loss, ref_grads), depth = reference
  jaxckpt.set_policy(model, policy)
  try:
    loss, grads = llm_loss_and_grads(model, llm_batch())
  finally:
    jaxckpt.set_policy(model, "none")
  assert_trees_close((loss, grads), (ref_loss, ref_grads), depth=depth, what=f"loss and gradients, {policy} vs none")


def test_training_lowers_the_loss():
  model = build_llm(dataclasses.replace(LLM_PRESETS["llama-tiny"], seq_len=LLM_GRAD_SEQ), policy="full")
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  batch = llm_batch(vocab=16)  # a small alphabet: learnable in a few steps

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: llm_loss(m, batch)[0])(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(8)]
  assert losses[-1] < losses[0] - 0.5, losses


# --- MaxText's names at MaxText's places ------------------------------------------------------------------------------


def test_every_maxtext_name_is_emitted_and_declared():
  model = build_llm("gemma2-tiny")
  assert jaxckpt.block_types(model) == {"decoder": frozenset(DECODER_NAMES)}
  traced = emitted_checkpoint_names(lambda t: model(t), jnp.zeros((2, 16), jnp.int32))
  assert traced == frozenset(DECODER_NAMES)


@pytest.mark.parametrize("preset", sorted(MAXTEXT_PRESETS))
def test_maxtexts_remat_presets_apply(preset):
  model = nnx.eval_shape(lambda: build_llm("llama-tiny"))
  assert str(jaxckpt.set_policy(model, preset)) == preset


def test_saved_names_have_maxtexts_shapes():
  """Under a policy saving every decoder name, one block keeps each name at the shape MaxText's tensor has: q after
  RoPE and scale [B, S, N, Dh], k/v [B, S, K, Dh], the MLP's two projections [B, S, M] each, per layer of the pair."""
  config = LLM_PRESETS["gemma2-tiny"]
  block = DecoderBlock(config, policy="save_only_these_names:" + "+".join(DECODER_NAMES), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  x = jax.ShapeDtypeStruct((2, 32, config.dim), jnp.float32)
  saved = [r for r in saved_residuals(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
           if r.kind == "checkpoint_name"]
  shapes = {}
  for r in saved:
    shapes.setdefault(r.name, []).append(r.shape)
  b, s, n, k, dh, m = 2, 32, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim
  assert shapes["query_proj"] == [(b, s, n, dh)] * 2 and shapes["key_proj"] == [(b, s, k, dh)] * 2
  assert shapes["value_proj"] == [(b, s, k, dh)] * 2 and shapes["context"] == [(b, s, n, dh)] * 2
  assert shapes["mlpwi_0"] == shapes["mlpwi_1"] == [(b, s, m)] * 2
  assert shapes["out_proj"] == shapes["mlpwo"] == [(b, s, config.dim)] * 2
  assert shapes["decoder_layer_input"] == [(b, s, config.dim)]  # once per scanned block, at its top


def test_query_proj_is_the_kernels_input_after_rope_and_scale(monkeypatch):
  """The value tagged query_proj is what xla_attention receives: rotated and scaled (MaxText's place)."""
  config = LLM_PRESETS["gemma2-tiny"]
  seen = {}
  real = xla_attention

  def spy(q, k, v, **kwargs):
    seen["q"], seen["k"] = q, k
    return real(q, k, v, **kwargs)

  layer = DecoderBlock(config, rngs=nnx.Rngs(0)).sublayers[1]
  x = jax.random.normal(jax.random.key(0), (1, 8, config.dim))
  h = layer.pre_attention_norm(x)
  monkeypatch.setattr("jaxckpt.models.llm._kernels.xla_attention", spy)
  layer.attention(h)
  q = jnp.einsum("bse,enh->bsnh", h, layer.attention.query[...])
  freqs = rope_frequencies(config.head_dim, config.rope_theta)
  angles = np.arange(8)[:, None] * freqs[None, :]
  first, second = np.split(np.asarray(q), 2, axis=-1)
  cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
  expected = np.concatenate([first * cos - second * sin, second * cos + first * sin], -1) * config.query_scale
  assert_trees_close(seen["q"], expected, depth=1, what="rotary query")


# --- the loss -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_equals_optax(dtype):
  logits = (4 * jax.random.normal(jax.random.key(0), (3, 5, 50))).astype(dtype)
  targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 50)
  weights = jax.random.uniform(jax.random.key(2), (3, 5))

  def ours(x):
    return (cross_entropy(x, targets) * weights).sum()

  def theirs(x):
    return (optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), targets) * weights).sum()

  value, grad = jax.value_and_grad(ours)(logits)
  ref_value, ref_grad = jax.value_and_grad(theirs)(logits)
  assert value.dtype == jnp.float32 and grad.dtype == dtype
  # bfloat16: the gradient is rounded to 8 bits of mantissa (the rule takes bfloat16's u from compute_dtype)
  assert_trees_close((value, grad.astype(jnp.float32)), (ref_value, ref_grad.astype(jnp.float32)), depth=1,
                     what=f"cross-entropy vs optax, {jnp.dtype(dtype).name}", compute_dtype=dtype)


def test_cross_entropy_keeps_no_float32_copy_of_the_logits():
  logits = jax.ShapeDtypeStruct((4, 16, 1000), jnp.bfloat16)
  targets = jnp.zeros((4, 16), jnp.int32)
  saved = saved_residuals(lambda x: cross_entropy(x, targets).sum(), logits)
  vocab_wide = [r for r in saved if r.shape and r.shape[-1] == 1000]
  assert vocab_wide and all(r.dtype == "bfloat16" for r in vocab_wide), saved
  plain = saved_residuals(lambda x: optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32),
                                                                                    targets).sum(), logits)
  assert any(r.shape[-1:] == (1000,) and r.dtype == "float32" for r in plain)  # what the custom VJP avoids


@pytest.mark.parametrize("preset", TINY)
def test_vocab_tiling_equals_the_plain_loss(preset):
  config = dataclasses.replace(LLM_PRESETS[preset], seq_len=LLM_GRAD_SEQ)
  plain = build_llm(config)
  tiled = build_llm(dataclasses.replace(config, vocab_tiles=4))
  batch = llm_batch()
  (loss, grads), (tiled_loss, tiled_grads) = llm_loss_and_grads(plain, batch), llm_loss_and_grads(tiled, batch)
  assert_trees_close((tiled_loss, tiled_grads), (loss, grads), depth=config.num_layers, what="vocab tiles 4 vs 1")
  metrics = [llm_loss(m, batch)[1] for m in (plain, tiled)]
  assert_trees_close(metrics[1], metrics[0], depth=config.num_layers, what="metrics, vocab tiles 4 vs 1")


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_vocab_tiling_never_holds_the_whole_logits():
  """A wide vocabulary: the compiled gradient's temporaries shrink with 8 tiles (one [B, S/8, V] chunk at a time)."""
  config = dataclasses.replace(LLM_PRESETS["llama-tiny"], vocab_size=16384, seq_len=64, num_layers=1)
  logits_bytes = 2 * 64 * 16384 * 4

  def temp(tiles):
    model = build_llm(dataclasses.replace(config, vocab_tiles=tiles), policy="full")
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    grad = jax.grad(lambda p, b: llm_loss(nnx.merge(graphdef, p, other), b)[0])
    batch = {"tokens": jax.ShapeDtypeStruct((2, 65), jnp.int32)}
    return jaxckpt.jit(grad).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  plain, tiled = temp(1), temp(8)
  assert plain >= logits_bytes and tiled < plain - logits_bytes / 2, (plain, tiled, logits_bytes)


# --- Gemma 2: local/global layers, soft caps ----------------------------------------------------------------------


def test_local_layers_see_only_their_window():
  config = dataclasses.replace(LLM_PRESETS["gemma2-tiny"], seq_len=LLM_GRAD_SEQ)
  window = config.sliding_window
  tokens = llm_batch(batch=1)["tokens"][:, :-1]
  local_global = build_llm(config)(tokens)
  all_global = build_llm(dataclasses.replace(config, layer_pattern=("global", "global")))(tokens)
  # the same parameters (same tree, same seed): within the window nothing differs, beyond it the local layers do
  assert_trees_close(local_global[:, :window], all_global[:, :window], depth=config.num_layers,
                     what="logits within the window")
  assert not np.allclose(local_global[:, window:], all_global[:, window:], atol=1e-3)


def test_sliding_window_masks_keys_older_than_the_window():
  q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 12, 2, 8))
  out = xla_attention(q, k, v, sliding_window=4)
  moved = xla_attention(q, k.at[:, 0].set(9.0), v.at[:, 0].set(9.0), sliding_window=4)
  np.testing.assert_array_equal(out[:, 4:], moved[:, 4:])  # position 0 is outside every window from 4 on
  assert not np.allclose(out[:, :4], moved[:, :4])


def test_soft_caps_bound_and_change_the_logits():
  config = LLM_PRESETS["gemma2-tiny"]
  tokens = llm_batch(batch=1, seq=16)["tokens"][:, :-1]
  capped = build_llm(dataclasses.replace(config, final_logit_softcap=0.5))(tokens)
  free = build_llm(dataclasses.replace(config, final_logit_softcap=None))(tokens)
  assert float(jnp.abs(capped).max()) <= 0.5 and float(jnp.abs(free).max()) > 0.5
  assert_trees_close(capped, 0.5 * jnp.tanh(free / 0.5), depth=1, what="final soft cap")
  q, k, v = 10 * jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 8))
  uncapped = xla_attention(q, k, v)
  # a cap of 1e6 is tanh(x / 1e6)·1e6 ≈ x to float32 (x ≤ ~300 here: the cubic term is 1e-7 relative)
  assert_trees_close(xla_attention(q, k, v, logit_soft_cap=1e6), uncapped, depth=2, what="attention, cap 1e6")
  assert not np.allclose(xla_attention(q, k, v, logit_soft_cap=1.0), uncapped, atol=1e-2)


def test_grouped_query_attention_equals_repeated_kv_heads():
  q = jax.random.normal(jax.random.key(0), (2, 6, 4, 8))
  k, v = jax.random.normal(jax.random.key(1), (2, 2, 6, 2, 8))
  grouped = xla_attention(q, k, v)
  full = xla_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
  assert_trees_close(grouped, full, depth=2, what="grouped vs repeated kv heads")
  reference = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), is_causal=True,
                                          scale=1.0)  # our q comes scaled
  assert_trees_close(grouped, reference, depth=2, what="grouped vs jax.nn.dot_product_attention")


# --- the kernel seam --------------------------------------------------------------------------------------------------


def test_auto_is_xla_off_a_tpu_and_splash_on_one_from_128_tokens():
  assert select_kernel("auto", 8192) == "xla" and select_kernel("xla", 8192) == "xla"
  assert select_kernel("splash", 64) == "splash"
  skip_without_libtpu()
  mesh = jaxckpt.sharding.topology_mesh("v5e:2x2")
  with jax.set_mesh(mesh):
    assert select_kernel("auto", 128) == "splash" and select_kernel("auto", 64) == "xla"


def test_splash_in_interpret_mode_equals_xla():
  q = jax.random.normal(jax.random.key(0), (1, 128, 2, 128))
  k, v = jax.random.normal(jax.random.key(1), (2, 1, 128, 1, 128))
  for window, cap in ((None, None), (32, 50.0)):
    splash = attention(q, k, v, kernel="splash", sliding_window=window, logit_soft_cap=cap, splash_interpret=True)
    xla = attention(q, k, v, kernel="xla", sliding_window=window, logit_soft_cap=cap)
    assert_trees_close(splash, xla, depth=2, what=f"splash (interpret) vs xla, window {window}, cap {cap}")


# --- bad input --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"num_heads": 30, "num_kv_heads": 8}, "num_heads=30 must be a multiple of num_kv_heads=8"),
    ({"weight_dtype": "fp16"}, "weight_dtype='fp16' is unknown; valid: float32, bfloat16"),
    ({"compute_dtype": "bf16"}, "compute_dtype='bf16' is unknown; valid: float32, bfloat16"),
    ({"attention": "flash"}, "attention='flash' is unknown; valid: auto, xla, splash"),
    ({"mlp_activation": "relu"}, "mlp_activation='relu' is unknown; valid: silu, gelu"),
    ({"vocab_tiles": 3}, "vocab_tiles=3 must divide seq_len=64"),
    ({"num_layers": 3, "layer_pattern": ("local", "global"), "sliding_window": 8},
     "num_layers=3 must be a multiple of len(layer_pattern)=2"),
    ({"layer_pattern": ("local",)}, "layer_pattern=('local',) has local layers: give sliding_window"),
    ({"layer_pattern": ("sliding",)}, "layer_pattern=('sliding',) must be a non-empty tuple of global, local"),
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"norm_scale_offset": 0.5}, "norm_scale_offset=0.5 must be 0 (Llama) or 1 (Gemma)"),
])
def test_bad_config_is_one_line_naming_the_argument(overrides, message):
  with pytest.raises(JaxckptError) as info:
    dataclasses.replace(LLM_PRESETS["llama-tiny"], **overrides)
  assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_splash_blocks_must_tile_the_sequence():
  with pytest.raises(JaxckptError, match=r"seq_len=1000 is not a multiple of the splash block \w+=512"):
    dataclasses.replace(LLM_PRESETS["llama3.1-8b"], attention="splash", seq_len=1000)
  dataclasses.replace(LLM_PRESETS["llama3.1-8b"], attention="splash", seq_len=2048)  # 4 blocks of 512
  dataclasses.replace(LLM_PRESETS["llama3.1-8b"], attention="auto", seq_len=1000)  # auto: checked where it picks


def test_unknown_preset_names_the_closest():
  entry = MODEL_REGISTRY["llm"]
  with pytest.raises(JaxckptError) as info:
    entry.config("llama3-8b")
  message = str(info.value)
  assert message.startswith("unknown preset 'llama3-8b' for model llm; valid presets: llama2-7b")
  assert message.endswith("did you mean 'llama3.1-8b'?") and "\n" not in message
  with pytest.raises(JaxckptError, match="did you mean 'gemma2-27b'"):
    build_llm("gemma2-72b")


def test_registry_and_target_flags_take_the_llm_fields():
  target = jaxckpt.step.shipped_target("llm", "llama3.1-8b", weight_dtype="bfloat16", vocab_tiles=4, seq_len=4096)
  assert target.batch["tokens"].shape == (4, 4097) and target.ref["vocab_tiles"] == 4
  model = nnx.eval_shape(target.make_model)
  assert model.vocab_tiles == 4 and model.embedding.get_value().dtype == jnp.bfloat16
  with pytest.raises(JaxckptError, match="weight_dtype applies to llm only, got weight_dtype='bfloat16'"):
    jaxckpt.step.shipped_target("gpt", "tiny", weight_dtype="bfloat16")
  with pytest.raises(JaxckptError, match="vocab_tiles applies to sequence models only \\(llm\\)"):
    jaxckpt.step.shipped_target("vit", "tiny", vocab_tiles=2)
  with pytest.raises(JaxckptError, match="attention='splash' is unknown; valid: xla, dot_product_attention"):
    jaxckpt.step.shipped_target("gpt", "tiny", attention="splash")


def test_cli_flags_name_the_flag(capsys):
  from jaxckpt.cli._report import main as report_main

  assert report_main(["--model", "gpt", "--weight-dtype", "bfloat16", "--policies", "none", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "--weight-dtype applies to llm only, got --weight-dtype 'bfloat16'" in err and err.count("\n") == 1, err
  assert report_main(["--model", "llm", "--preset", "tiny", "--vocab-tiles", "5", "--policies", "none",
                      "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "--vocab-tiles 5 must divide --seq-len 64" in err and err.count("\n") == 1, err


@pytest.mark.slow  # two compiles of a 128-token model, one in Pallas' interpret mode: ~20 s on 2 busy cores
def test_the_model_on_the_splash_kernel_equals_the_model_on_xla():
  """gemma2-tiny (GQA, a sliding window, soft caps) at 128 tokens through the splash kernel (Pallas interpret mode on
  CPU), under a policy that saves its context: the loss and gradients of the xla model (the suite's rule, depth the
  layers: float32 through a blocked softmax)."""
  config = dataclasses.replace(LLM_PRESETS["gemma2-tiny"], seq_len=128)
  batch = llm_batch(batch=1, seq=128)
  xla = build_llm(config, policy="minimal_with_context")
  splash = build_llm(dataclasses.replace(config, attention="splash", splash_interpret=True),
                     policy="minimal_with_context")
  (loss, grads), (splash_loss, splash_grads) = llm_loss_and_grads(xla, batch), llm_loss_and_grads(splash, batch)
  assert_trees_close((splash_loss, splash_grads), (loss, grads), depth=config.num_layers,
                     what="gemma2-tiny on splash vs xla, minimal_with_context")


@needs_libtpu
@pytest.mark.slow  # three TPU compiles of the tiny preset on v5e:2x2 (~30 s on 2 cores)
def test_report_rows_ok_on_a_topology_with_a_tensor_axis(tmp_path):
  """fsdp=2 × tensor=2 on v5e:2x2 (deviceless): every row compiles; ``none`` (whose blocks gather their parameters
  in a checkpoint of the gather alone) is not taken for a model that remats by itself; remat lowers the footprint."""
  import json
  from jaxckpt.cli._report import main as report_main
  out = tmp_path / "r.json"
  assert report_main(["--model", "llm", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "fsdp=2,tensor=2",
                      "--policies", "none", "full", "minimal", "--no-progress", "--json", str(out)]) == 0
  data = json.loads(out.read_text())
  rows = {r["policy"]: r for r in data["rows"]}
  assert data["mesh"] == {"fsdp": 2, "tensor": 2} and all(r["status"] == "ok" for r in rows.values()), rows
  full = rows["nothing_saveable"]  # full is its alias
  assert full["footprint_bytes"] < rows["minimal"]["footprint_bytes"] < rows["none"]["footprint_bytes"], rows


@needs_libtpu
@pytest.mark.slow  # five TPU compiles of the tiny preset at 8 layers on v5e:2x2 (~1 min on 2 cores)
def test_offload_row_on_a_topology_is_below_every_fixed_policy_and_within_the_host(tmp_path):
  """MaxText's T1 policy (the layer input and q/k/v/out_proj offloaded) on llama tiny at 8 layers × 1024 tokens,
  bfloat16, fsdp=4 on v5e:2x2: its device footprint is below every fixed policy's at the same batch (full remat keeps
  each layer's input on the device, the offload row on the host), and its host bytes per chip hold the offloaded
  residuals, within the chip table's host memory."""
  import json
  from jaxckpt.cli._report import main as report_main
  from jaxckpt.sharding import CHIPS
  out = tmp_path / "r.json"
  offload = "save_and_offload_only_these_names:/decoder_layer_input+query_proj+key_proj+value_proj+out_proj"
  layers, seq, batch = 8, 1024, 8
  assert report_main(["--model", "llm", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--layers",
                      str(layers), "--seq-len", str(seq), "--batch-size", str(batch), "--compute-dtype", "bfloat16",
                      "--policies", "none", "full", "minimal", "dots_saveable", offload, "--no-residuals",
                      "--no-progress", "--json", str(out)]) == 0
  rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
  assert all(r["status"] == "ok" for r in rows.values()), rows
  config = LLM_PRESETS["tiny"]
  per_token = 2 * config.dim + config.num_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim
  offloaded = layers * batch // 4 * seq * per_token * 2  # the five names' bf16 values per chip: 8 MiB
  # the compiler's host buffers hold them, with its own layout (10 MiB measured, libtpu 0.0.42.1; T1's 8B shapes:
  # exactly the offloaded bytes)
  assert offloaded <= rows[offload]["host_footprint_bytes"] <= 1.25 * offloaded, rows[offload]
  assert rows[offload]["host_footprint_bytes"] <= CHIPS["v5e"].host_memory_bytes
  fixed = {p: r["footprint_bytes"] for p, r in rows.items() if p != offload}
  assert rows[offload]["footprint_bytes"] < min(fixed.values()), (rows[offload]["footprint_bytes"], fixed)
