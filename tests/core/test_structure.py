"""Checkpoint structure (every:K, nested[:D]): plans, gradients equal to no remat, memory growth with depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.nnx._layers import MLPBlock, Stack
from jaxckpt.models import MODELS
from jaxckpt.core._structure import Structure, parse_structure
from tests.numerics import assert_trees_close


@pytest.mark.parametrize("text,expected", [
    ("block", Structure()), (None, Structure()), ("every:4", Structure("every", 4)), (" nested ", Structure("nested", 2)),
    ("nested:3", Structure("nested", 3)),
])
def test_parse(text, expected):
  assert parse_structure(text) == expected
  assert parse_structure(str(expected)) == expected


@pytest.mark.parametrize("text,fragment", [
    ("nestd", "did you mean 'nested'"), ("every", "whole number"), ("every:x", "whole number"), ("every:0", "≥ 1"),
    ("nested:1", "D ≥ 2"), ("block:2", "takes no argument"), ("", "unknown structure"),
])
def test_parse_errors(text, fragment):
  with pytest.raises(jaxckpt.errors.JaxckptError, match=fragment):
    parse_structure(text)


def test_group_plans_cover_every_block():
  assert Structure("every", 4).groups(10, 0) == [(2, 4), (1, 2)]
  assert Structure("every", 16).groups(10, 0) == [(1, 10)]
  assert Structure("nested", 2).groups(16, 0) == [(4, 4)]
  assert Structure("nested", 2).groups(10, 0) == [(2, 3), (2, 2)]
  assert Structure("nested", 3).groups(64, 0) == [(4, 16)] and Structure("nested", 3).groups(16, 1) == [(4, 4)]
  for structure in (Structure("every", 3), Structure("nested", 2), Structure("nested", 3)):
    for n in range(1, 40):
      plan = structure.groups(n, 0)
      assert sum(c * s for c, s in plan) == n and all(s >= 1 for _, s in plan)


LAYERS = 7  # MLP blocks of the stack: the depth of the comparisons (tests/numerics.py)


def stack_grads(structure, policy, scan, x, key):
  stack = Stack(lambda r: MLPBlock(8, 16, dropout_rate=0.3, policy=policy, rngs=r), LAYERS, scan=scan,
                structure=structure, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(stack)

  def loss(params, x):
    return jnp.sum(jnp.tanh(nnx.merge(graphdef, params)(x, dropout_key=key, deterministic=False)) ** 2)

  return jaxckpt.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


@pytest.fixture(scope="module")
def reference():
  x, key = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.key(1)
  return x, key, stack_grads("block", "none", True, x, key)


@pytest.mark.parametrize("structure", ["every:1", "every:3", "nested", "nested:3"])
@pytest.mark.parametrize("policy", ["none", "full", pytest.param("dots_saveable", marks=pytest.mark.remat3)])
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_gradients_equal_no_remat(reference, structure, policy, scan):
  x, key, (ref_loss, ref_grads) = reference
  loss, grads = stack_grads(structure, policy, scan, x, key)
  what = f"{structure} {policy} {'scan' if scan else 'unrolled'} vs block none scan"
  assert_trees_close(loss, ref_loss, depth=LAYERS, what=f"loss, {what}")
  assert_trees_close(grads, ref_grads, depth=LAYERS, what=f"gradients, {what}")


@pytest.mark.slow  # trains two models (~20 s)
def test_vit_with_structure_trains_like_without():
  config = dataclasses.replace(MODELS["vit"].presets["tiny"], num_layers=3)
  data = {"x": np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32),
          "y": np.arange(4, dtype=np.int32)}
  grads = {}
  for structure in ("block", "nested"):
    model = jaxckpt.models.build_model("vit", dataclasses.replace(config, structure=structure), image_shape=(8, 8, 1),
                                num_classes=10, policy="attn=dots_saveable,mlp=full")
    graphdef, params = nnx.split(model)
    loss = lambda p: jaxckpt.models.classification_loss(  # noqa: E731
        nnx.merge(graphdef, p), data, dropout_key=jax.random.key(0), deterministic=False)[0]
    grads[structure] = jaxckpt.jit(jax.grad(loss))(params)
  assert_trees_close(grads["nested"], grads["block"], depth=config.num_layers, what="ViT gradients, nested vs block")


def train_step_temp(num_layers: int, structure: str, policy: str = "none") -> int:
  """Compiled temp bytes of the full AdamW train step of a residual MLP, d=128, 8192 examples (activation-heavy)."""
  config = dataclasses.replace(MODELS["mlp"].presets["small"], num_layers=num_layers, dim=128, hidden_dim=512,
                               structure=structure)
  tx = optax.adamw(1e-3)
  graphdef, state = jaxckpt.training.abstract_train_state(
      lambda: jaxckpt.models.build_model("mlp", config, image_shape=(8, 8, 1), num_classes=10, policy=policy), tx)
  batch = {"x": jax.ShapeDtypeStruct((8192, 8, 8, 1), np.float32), "y": jax.ShapeDtypeStruct((8192,), np.int32)}
  compiled = jaxckpt.training.compile_train_step(jaxckpt.make_train_step(graphdef, tx, jaxckpt.models.classification_loss), state, batch)
  return jaxckpt.memory_stats(compiled)["temp_bytes"]


@pytest.mark.slow
def test_memory_grows_linearly_without_structure_and_like_sqrt_nested():
  none = train_step_temp(64, "block") / train_step_temp(16, "block")
  nested = train_step_temp(64, "nested") / train_step_temp(16, "nested")
  assert none >= 3.5, none  # linear: 4× the layers
  assert nested <= 2.2, nested  # ~√4 = 2
  nested_512, nested3_512 = train_step_temp(512, "nested"), train_step_temp(512, "nested:3")
  assert nested3_512 / train_step_temp(64, "nested:3") < nested_512 / train_step_temp(64, "nested")


@pytest.mark.slow
def test_every_k_memory_has_its_optimum_near_sqrt_depth():
  """Chen et al.: with blocks recomputed inside their group (policy full), N/K boundaries + K block inputs are
  kept, minimal at K = √N; measured at N = 16."""
  temps = {k: train_step_temp(16, f"every:{k}", "full") for k in (1, 2, 4, 8, 16)}
  assert temps[1] > temps[2] > temps[4], temps
  assert temps[4] <= temps[8] < temps[16], temps
