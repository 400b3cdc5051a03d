"""Layers: checkpoint names emitted, block types declared, dropout keys per layer, wrappers of user code."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt import names
from jaxckpt.analysis._jaxprs import emitted_checkpoint_names, uses_remat
from jaxckpt.nnx._layers import AttentionBlock, ConvBlock, MLPBlock, Stack, TransformerBlock
from jaxckpt.models.llm import LLM_PRESETS, DecoderBlock
from tests.numerics import assert_trees_close

BLOCKS = {
    "attn": (lambda r, p: AttentionBlock(16, 2, dropout_rate=0.2, policy=p, rngs=r), (2, 5, 16)),
    "mlp": (lambda r, p: MLPBlock(16, 32, dropout_rate=0.2, policy=p, rngs=r), (2, 5, 16)),
    "conv": (lambda r, p: ConvBlock(8, dropout_rate=0.2, policy=p, rngs=r), (2, 4, 4, 8)),
    "decoder": (lambda r, p: DecoderBlock(LLM_PRESETS["llama-tiny"], policy=p, rngs=r), (2, 8, 64)),
    "decoder/moe": (lambda r, p: DecoderBlock(LLM_PRESETS["deepseek-tiny"], experts=True, policy=p, rngs=r),
                    (2, 8, 64)),
}


def _names(block, shape):
  graphdef, state = nnx.split(block)
  return emitted_checkpoint_names(
      lambda s, x, k: nnx.merge(graphdef, s)(x, dropout_key=k, deterministic=False), state, jnp.ones(shape),
      jax.random.key(0),
  )


@pytest.mark.remat3
@pytest.mark.parametrize("block_type", sorted(BLOCKS))
def test_block_emits_exactly_its_declared_names(block_type):
  make, shape = BLOCKS[block_type]
  block = make(nnx.Rngs(0), "full")
  assert block.block_type == block_type.split("/")[0]
  assert _names(block, shape) == frozenset(block.checkpoint_names)


def test_every_shipped_name_is_emitted_by_some_layer():
  emitted = set()
  for make, shape in BLOCKS.values():
    emitted |= _names(make(nnx.Rngs(0), None), shape)
  assert emitted == set(names.ALL_NAMES)


@pytest.mark.parametrize("name", sorted(jaxckpt.models.MODELS))
def test_models_declare_their_block_types(name):
  entry = jaxckpt.models.MODELS[name]
  model = jaxckpt.models.build_model(name, entry.presets["tiny"], image_shape=(8, 8, 1), num_classes=10)
  types = jaxckpt.block_types(model)
  assert tuple(types) == tuple(sorted(entry.block_types))
  traced = emitted_checkpoint_names(lambda x: model(x), jnp.ones((2, 8, 8, 1)))
  assert traced == frozenset().union(*types.values())


@pytest.mark.remat3
def test_policy_none_adds_no_remat_and_full_does():
  make, shape = BLOCKS["mlp"]
  for policy, expected in (("none", False), ("full", True), ("attn=full", False), ("mlp=full", True)):
    graphdef, state = nnx.split(make(nnx.Rngs(0), policy))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: nnx.merge(graphdef, state)(x).sum()))(jnp.ones(shape))
    assert uses_remat(jaxpr) is expected, policy


def test_set_policy_validates_against_the_model():
  model = jaxckpt.models.build_model("vit", jaxckpt.models.MODELS["vit"].presets["tiny"], image_shape=(8, 8, 1), num_classes=10)
  spec = jaxckpt.set_policy(model, "attn=save_only_these_names:qkv,mlp=full")
  assert all(b.policy == spec for _, b in nnx.iter_modules(model) if isinstance(b, jaxckpt.nnx.RematBlock))
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="conv"):
    jaxckpt.set_policy(model, "conv=full")
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="conv_out"):
    jaxckpt.set_policy(model, "save_only_these_names:conv_out")


def _stack(scan, num_layers=3):
  return Stack(lambda r: MLPBlock(8, 16, dropout_rate=0.5, policy="full", rngs=r), num_layers, scan=scan,
               rngs=nnx.Rngs(0))


@pytest.mark.parametrize("scan", [True, False])
def test_stack_layers_draw_different_dropout_masks(scan):
  stack = _stack(scan)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  key = jax.random.key(2)
  out = stack(x, dropout_key=key, deterministic=False)
  graphdef, params = nnx.split(stack.layers)
  layer = lambda i: nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params))  # noqa: E731
  keys = jax.random.split(key, 3)
  manual = x
  for i in range(3):
    manual = layer(i)(manual, dropout_key=keys[i], deterministic=False)
  assert_trees_close(out, manual, depth=3, what=f"{'scanned' if scan else 'unrolled'} stack vs layer by layer")
  same_key = x
  for i in range(3):
    same_key = layer(i)(same_key, dropout_key=keys[0], deterministic=False)
  assert not jnp.allclose(out, same_key)  # one key for all layers would give other masks


def test_dropout_without_key_is_a_clear_error():
  block = BLOCKS["mlp"][0](nnx.Rngs(0), "full")
  with pytest.raises(jaxckpt.errors.JaxckptError, match="no dropout_key"):
    block(jnp.ones((2, 5, 16)), deterministic=False)


@pytest.mark.remat3
def test_scan_and_unrolled_stacks_agree():
  x = jax.random.normal(jax.random.key(1), (4, 8))
  key = jax.random.key(3)
  scanned, unrolled = _stack(True), _stack(False)
  assert_trees_close(scanned(x, dropout_key=key, deterministic=False),
                     unrolled(x, dropout_key=key, deterministic=False), depth=3, what="scanned vs unrolled stack")


def test_bad_layer_arguments():
  with pytest.raises(jaxckpt.errors.JaxckptError, match="num_heads=3"):
    AttentionBlock(16, 3, rngs=nnx.Rngs(0))
  with pytest.raises(jaxckpt.errors.JaxckptError, match="dropout_rate=1.5"):
    MLPBlock(4, 4, dropout_rate=1.5, rngs=nnx.Rngs(0))
  with pytest.raises(jaxckpt.errors.JaxckptError, match="num_layers=0"):
    _stack(True, num_layers=0)


def test_remat_wraps_a_user_module_in_one_call():
  linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  wrapped = jaxckpt.remat(linear, "nothing_saveable")
  assert isinstance(wrapped, jaxckpt.Remat)
  x = jnp.arange(8.0).reshape(2, 4)
  loss = lambda m: (jnp.tanh(m(x)) ** 2).sum()  # noqa: E731
  assert_trees_close(nnx.grad(loss)(wrapped).module, nnx.grad(loss)(linear), depth=1,
                     what="gradients of a remat'd nnx.Linear vs the plain one")
  assert uses_remat(jax.make_jaxpr(lambda x: wrapped(x))(x))


@pytest.mark.remat3
def test_remat_wraps_a_function_and_keeps_gradients():
  f = lambda w, x: jnp.sin(jnp.tanh(x @ w) @ w).sum()  # noqa: E731
  w, x = jax.random.normal(jax.random.key(0), (2, 8, 8))
  for policy in ("none", "full", "dots_saveable"):
    g = jaxckpt.remat(f, policy)
    assert_trees_close(jax.grad(g)(w, x), jax.grad(f)(w, x), depth=2, what=f"{policy} vs plain function")
    assert uses_remat(jax.make_jaxpr(jax.grad(g))(w, x)) == (policy != "none")


def test_remat_rejects_what_it_cannot_wrap():
  with pytest.raises(jaxckpt.errors.JaxckptError, match="function or an flax.nnx.Module"):
    jaxckpt.remat(3, "full")

  class NoCall(nnx.Module):
    pass

  with pytest.raises(jaxckpt.errors.JaxckptError, match="no __call__"):
    jaxckpt.remat(NoCall(), "full")


@pytest.mark.remat3
def test_transformer_block_gives_each_sublayer_its_policy():
  block = TransformerBlock(16, 2, 32, policy="attn=dots_saveable,mlp=full", rngs=nnx.Rngs(0))
  assert block.attn.policy.for_block("attn").name == "dots_saveable"
  assert block.mlp.policy.for_block("mlp").name == "nothing_saveable"


@pytest.mark.parametrize("name", sorted(jaxckpt.models.MODEL_REGISTRY))
def test_every_registry_entry_builds_feeds_and_trains_its_tiny_preset(name):
  entry = jaxckpt.models.MODEL_REGISTRY[name]
  config = entry.override("tiny", num_layers=3)
  assert config.num_layers == 3 and isinstance(config, entry.config_cls)
  model = nnx.eval_shape(lambda: entry.build(config, policy="full"))
  assert tuple(jaxckpt.block_types(model)) == tuple(sorted(entry.block_types))
  batch = entry.batch(2, config)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape[0] == 2 for leaf in jax.tree.leaves(batch))
  graphdef, state = nnx.split(model)
  loss, metrics = jax.eval_shape(
      lambda s, b: entry.loss_fn(nnx.merge(graphdef, s), b, dropout_key=jax.random.key(0), deterministic=False),
      state, batch)
  assert loss.shape == () and loss.dtype == jnp.float32 and metrics["loss"].shape == ()
  assert entry.default_batch_size(config) >= 1


def test_registry_overrides_name_python_arguments():
  gpt, vit = jaxckpt.models.MODEL_REGISTRY["gpt"], jaxckpt.models.MODEL_REGISTRY["vit"]
  assert gpt.override("tiny", seq_len=None) is gpt.presets["tiny"]  # None keeps the preset's value
  assert gpt.batch(4, gpt.override("tiny", seq_len=32))["tokens"].shape == (4, 33)
  cases = [
      (gpt, {"seq_len": 0}, "seq_len=0 must be a whole number ≥ 1"),
      (gpt, {"num_heads": 3}, "num_heads=3 must be a positive divisor of dim=64"),
      (gpt, {"attention": "flash"}, "attention='flash' is unknown; valid: xla, dot_product_attention"),
      (gpt, {"nm_layers": 2}, "did you mean 'num_layers'"),
      (vit, {"seq_len": 128}, "seq_len applies to sequence models only (gpt, llm), got seq_len=128"),
      (vit, {"compute_dtype": "float16"}, "compute_dtype='float16' is unknown; valid: float32, bfloat16"),
      (vit, {"structure": "nestd"}, "did you mean 'nested'"),
      (vit, {"dropout_rate": 1.0}, "dropout_rate=1.0 must be in [0, 1)"),
  ]
  for entry, overrides, message in cases:
    with pytest.raises(jaxckpt.errors.JaxckptError) as info:
      entry.override("tiny", **overrides)
    assert message in str(info.value), (overrides, str(info.value))
  with pytest.raises(jaxckpt.errors.JaxckptError, match="unknown preset 'huge' for model vit; valid presets: tiny, small"):
    vit.config("huge")
  with pytest.raises(jaxckpt.errors.JaxckptError, match="batch_size=0"):
    vit.batch(0)
