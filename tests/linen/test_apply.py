"""jaxckpt.linen.apply_remat on a Linen model written like public Flax code (tests/own_models.py), not built from
jaxckpt blocks: the same parameter tree and gradients equal no remat, block types and policies changed afterwards,
and one clear line for every misuse (the NNX twin: tests/nnx/test_apply.py)."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.analysis._jaxprs import count_remat_regions
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.linen import _apply as linen_apply
from tests.numerics import assert_trees_close
from tests.own_models import (BATCH, LAYERS, SEQ, VOCAB, Decoder, DecoderLayer, LinenEncoderDecoderLayer,
                              LinenMlpBlock, LinenTransformerLM)


def one_line(excinfo) -> str:
  text = str(excinfo.value)
  assert "\n" not in text
  return text


LINEN_CASES = [
    ("nothing_saveable", {"layer": LinenEncoderDecoderLayer}, 2),
    ("dots_saveable", {"layer": LinenEncoderDecoderLayer}, 2),
    # nested: 2 layer regions, 2 mlp regions inside them, and 2 more in the layers' recomputation
    ("layer=dots_saveable,mlp=full", {"layer": LinenEncoderDecoderLayer, "mlp": LinenMlpBlock}, 6),
    ("save_only_these_names:LinenMlpBlock_0.wi+SelfAttention_0.query", {"layer": LinenEncoderDecoderLayer}, 2),
    ("full", {"layer": lambda path, module: path[-1:] == ("decoder_block_1",)}, 1),
]


def linen_tokens():
  return jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)


def linen_loss_and_grads(model, variables):
  import optax
  tokens = linen_tokens()

  def loss(params):
    logits = model.apply({"params": params}, tokens[:, :-1], deterministic=False, rngs={"dropout": jax.random.key(2)})
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  grad = jax.value_and_grad(loss)
  return jax.jit(grad)(variables["params"]), count_remat_regions(jax.make_jaxpr(grad)(variables["params"]))


@pytest.fixture(scope="module")
def linen_reference():
  lm = LinenTransformerLM()
  variables = lm.init(jax.random.key(0), linen_tokens()[:, :-1])
  return variables, linen_loss_and_grads(lm, variables)[0]


@pytest.mark.parametrize("policy,blocks,regions", LINEN_CASES)
def test_linen_same_parameter_tree_and_gradients(linen_reference, policy, blocks, regions):
  variables, (ref_loss, ref_grads) = linen_reference
  model = linen_apply.apply_remat(LinenTransformerLM(), policy, blocks=blocks)
  mine = model.init(jax.random.key(0), linen_tokens()[:, :-1])
  chex.assert_trees_all_equal(mine, variables)  # same tree, same values: exact, the same init from the same key
  (loss, grads), found = linen_loss_and_grads(model, variables)
  assert found == regions
  assert_trees_close(loss, ref_loss, depth=LAYERS, what=f"Linen LM loss, {policy} vs no remat")
  assert_trees_close(grads, ref_grads, depth=LAYERS, what=f"Linen LM gradients, {policy} vs no remat")


def test_linen_block_types_and_set_policy():
  model = linen_apply.apply_remat(LinenTransformerLM(), "none", blocks={"layer": LinenEncoderDecoderLayer,
                                                                         "mlp": LinenMlpBlock})
  x = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
  types = linen_apply.block_types(model, jax.random.key(0), x)
  assert types["mlp"] == {"wi", "wo"}
  attention = {"SelfAttention_0.query", "SelfAttention_0.key", "SelfAttention_0.value", "SelfAttention_0.out"}
  assert attention <= types["layer"]
  assert jaxckpt.linen.apply_remat is linen_apply.apply_remat
  assert model.with_policy("mlp=full").spec == jaxckpt.parse_policy("mlp=full")
  with pytest.raises(PolicySpecError, match="valid block types: default, layer, mlp") as err:
    model.with_policy("attn=full")
  one_line(err)


def test_linen_errors_are_one_line():
  with pytest.raises(JaxckptError, match="NNX module class") as err:
    linen_apply.apply_remat(LinenTransformerLM(), "full", blocks={"layer": DecoderLayer})
  one_line(err)
  with pytest.raises(JaxckptError, match="jaxckpt.apply_remat") as err:
    linen_apply.apply_remat(Decoder(rngs=nnx.Rngs(0)), "full", blocks={"layer": DecoderLayer})
  one_line(err)
  model = linen_apply.apply_remat(LinenTransformerLM(), "full", blocks={"layer": nn_conv()})
  with pytest.raises(JaxckptError, match="'layer' of apply_remat matched no module") as err:
    model.init(jax.random.key(0), linen_tokens()[:, :-1])
  one_line(err)


def nn_conv():
  import flax.linen as nn
  return nn.Conv
