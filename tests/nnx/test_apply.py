"""jaxckpt.apply_remat on models written like public Flax code (tests/own_models.py), not built from jaxckpt blocks:
gradients equal no remat, parameter paths unchanged (orbax save before, restore after), automatic checkpoint names,
policies changed afterwards, and one clear line for every misuse (the Linen twin: tests/linen/test_apply.py)."""

import chex
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.analysis._jaxprs import count_remat_regions
from tests.numerics import assert_trees_close
from tests.own_models import (LAYERS, Attention, Decoder, DecoderLayer, FeedForward, ScannedDecoder, decoder_batch,
                        decoder_loss)

LAYER_NAMES = {"attn.q_einsum", "attn.kv_einsum", "attn.attn_vec_einsum", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"}
SPLIT = {"attn": Attention, "mlp": FeedForward}
# (policy, blocks, remat regions in the traced gradient of the 2-layer decoder)
CASES = [
    ("nothing_saveable", {"layer": DecoderLayer}, 2),
    ("dots_saveable", {"layer": DecoderLayer}, 2),
    ("attn=dots_saveable,mlp=full", SPLIT, 4),
    ("save_only_these_names:attn.q_einsum+mlp.up_proj", {"layer": DecoderLayer}, 2),
    ("mlp=save_only_these_names:up_proj+gate_proj", SPLIT, 2),
    ("nothing_saveable", {"layer": lambda path, module: path[:1] == ("layers",) and len(path) == 2}, 2),
]


def loss_and_grads(model, batch):
  """Traced and run under jit: ((loss, grads), remat regions of the traced gradient)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return decoder_loss(nnx.merge(graphdef, p, rest, copy=True), batch)

  grad = jax.value_and_grad(loss)
  return jax.jit(grad)(params), count_remat_regions(jax.make_jaxpr(grad)(params))


def regions(model, batch) -> int:
  """Remat regions of the traced gradient (traced only, not compiled)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grad = jax.grad(lambda p: decoder_loss(nnx.merge(graphdef, p, rest, copy=True), batch))
  return count_remat_regions(jax.make_jaxpr(grad)(params))


@pytest.fixture(scope="module")
def reference():
  return loss_and_grads(Decoder(rngs=nnx.Rngs(0)), decoder_batch())[0]


@pytest.mark.parametrize("policy,blocks,regions", CASES)
def test_gradients_equal_no_remat(reference, policy, blocks, regions):
  model = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), policy, blocks=blocks)  # dropout 0.1 on, own Rngs
  (loss, grads), found = loss_and_grads(model, decoder_batch())
  assert found == regions
  assert_trees_close(loss, reference[0], depth=LAYERS, what=f"Decoder loss, {policy} vs no remat")
  assert_trees_close(grads, reference[1], depth=LAYERS, what=f"Decoder gradients, {policy} vs no remat")


def test_dropout_is_on_and_drawn_from_the_models_rngs(reference):
  """The reference itself depends on dropout (deterministic loss differs), so equal gradients above mean equal
  masks in forward pass and recomputation."""
  model = Decoder(rngs=nnx.Rngs(0))
  batch = decoder_batch()
  logits = model(batch["tokens"][:, :-1], deterministic=True)
  import optax
  det = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
  assert abs(float(det) - float(reference[0])) > 1e-4


def test_scanned_stack_keeps_remat_in_the_scan_body():
  batch = decoder_batch()
  (ref_loss, ref_grads), regions = loss_and_grads(ScannedDecoder(rngs=nnx.Rngs(0)), batch)
  assert regions == 0
  model = jaxckpt.apply_remat(ScannedDecoder(rngs=nnx.Rngs(0)), "nothing_saveable", blocks={"layer": DecoderLayer})
  (loss, grads), regions = loss_and_grads(model, batch)
  assert regions == 1  # one remat equation, inside the scan body
  assert_trees_close(loss, ref_loss, depth=LAYERS, what="ScannedDecoder loss, nothing_saveable vs no remat")
  assert_trees_close(grads, ref_grads, depth=LAYERS, what="ScannedDecoder gradients, nothing_saveable vs no remat")
  assert jaxckpt.block_types(model) == {"layer": frozenset(LAYER_NAMES)}


def test_nested_blocks_name_their_own_layers():
  model = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "none", blocks={"layer": DecoderLayer, "attn": Attention})
  assert jaxckpt.block_types(model) == {"attn": {"q_einsum", "kv_einsum", "attn_vec_einsum"},
                                        "layer": {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}}


def _paths(model):
  return sorted(jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0])


def test_parameter_paths_unchanged_and_orbax_restores(tmp_path):
  model = Decoder(rngs=nnx.Rngs(0))
  before = _paths(model)
  assert "layers" in str(before) and any("attn" in p and "q_einsum" in p for p in before)
  saved = nnx.state(model)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "before", saved)
  jaxckpt.apply_remat(model, "dots_saveable", blocks=SPLIT)
  assert _paths(model) == before
  fresh = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(7)), "dots_saveable", blocks=SPLIT)
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "before", nnx.state(fresh))
  nnx.update(fresh, restored)
  # exact: a save/restore round trip copies the arrays, no arithmetic
  chex.assert_trees_all_equal(nnx.state(fresh, nnx.Param), nnx.state(Decoder(rngs=nnx.Rngs(0)), nnx.Param))


def test_set_policy_and_reapply_change_the_policy():
  model = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "none", blocks={"layer": DecoderLayer})
  batch = decoder_batch()
  assert regions(model, batch) == 0
  assert jaxckpt.block_types(model) == {"layer": frozenset(LAYER_NAMES)}
  jaxckpt.set_policy(model, "nothing_saveable")
  assert regions(model, batch) == 2
  jaxckpt.set_policy(model, "none")
  assert regions(model, batch) == 0
  jaxckpt.apply_remat(model, "full", blocks=SPLIT)  # replaces the previous application
  assert set(jaxckpt.block_types(model)) == {"attn", "mlp"}
  assert type(model.layers[0]) is DecoderLayer and type(model.layers[0].attn).__name__ == "RematAttention"
  assert regions(model, batch) == 4
  jaxckpt.set_policy(model, "attn=full")  # mlp falls back to the default, none
  assert regions(model, batch) == 2


def test_automatic_names_are_emitted_and_model_names_kept():
  class TaggedFeedForward(FeedForward):
    def __call__(self, x):
      hidden = checkpoint_name(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x), "ffw_hidden")
      return self.down_proj(hidden)

  model = Decoder(rngs=nnx.Rngs(0))
  for layer in model.layers:
    object.__setattr__(layer.mlp, "__class__", TaggedFeedForward)
  jaxckpt.apply_remat(model, "full", blocks={"layer": DecoderLayer})
  x = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  jaxckpt.set_policy(model, "save_only_these_names:ffw_hidden")  # the model's own name: checked when traced
  jaxckpt.set_policy(model, "save_only_these_names:ffw_hiden")
  with pytest.raises(PolicySpecError, match="ffw_hiden.*did you mean 'ffw_hidden'"):  # a typo: refused then
    jax.eval_shape(lambda: model(jnp.zeros((2, 8), jnp.int32)))
  jaxckpt.set_policy(model, "full")
  names = jaxckpt.nnx.checkpoint_names(model, x)
  assert names == {"layer": frozenset(LAYER_NAMES | {"ffw_hidden"})}
  jaxckpt.set_policy(model, "save_only_these_names:ffw_hidden+mlp.up_proj")
  from jaxckpt.analysis._jaxprs import emitted_checkpoint_names
  graphdef, state = nnx.split(model)
  emitted = emitted_checkpoint_names(lambda s, t: nnx.merge(graphdef, s)(t), state, x)
  assert emitted == LAYER_NAMES | {"ffw_hidden"}


def test_name_policy_saves_what_it_names():
  from jaxckpt.analysis._residuals import saved_residuals
  model = jaxckpt.apply_remat(Decoder(dropout=0.0, rngs=nnx.Rngs(0)), "save_only_these_names:mlp.up_proj",
                              blocks={"layer": DecoderLayer})
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = decoder_batch()
  found = saved_residuals(lambda p: decoder_loss(nnx.merge(graphdef, p, rest, copy=True), batch), params)
  named = [r for r in found if "mlp.up_proj" in str(r)]
  assert len(named) == 2  # one per layer


# --------------------------------------------------------------------------------------------- one clear line each


def one_line(excinfo) -> str:
  text = str(excinfo.value)
  assert "\n" not in text
  return text


def test_no_match_names_the_model_classes():
  with pytest.raises(JaxckptError) as err:
    jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "full", blocks={"layer": nnx.Conv})
  text = one_line(err)
  assert "matched no module" in text and "DecoderLayer" in text and "Attention" in text and "RMSNorm" in text


def test_set_policy_without_blocks_is_an_error():
  with pytest.raises(JaxckptError) as err:
    jaxckpt.set_policy(Decoder(rngs=nnx.Rngs(0)), "dots_saveable")
  text = one_line(err)
  assert "no remat block" in text and "DecoderLayer" in text and "apply_remat" in text
  model = Decoder(rngs=nnx.Rngs(0))
  assert jaxckpt.set_policy(model, "none") == jaxckpt.parse_policy("none")  # true as it is: nothing remats


def test_block_map_over_unknown_block_type_lists_the_applied_ones():
  model = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "none", blocks=SPLIT)
  with pytest.raises(PolicySpecError) as err:
    jaxckpt.set_policy(model, "layer=full")
  assert "valid block types: attn, default, mlp" in one_line(err)
  jaxckpt.set_policy(model, "save_only_these_names:q_proj")  # not an automatic name: the model's own, until traced
  with pytest.raises(PolicySpecError) as err:
    jax.eval_shape(lambda: model(jnp.zeros((2, 8), jnp.int32)))
  assert "q_einsum" in one_line(err)
  with pytest.raises(PolicySpecError) as err:  # an automatic name's form (a part of a layer) is refused at once
    jaxckpt.set_policy(model, "save_only_these_names:q_einsum.7")
  assert "q_einsum" in one_line(err)


@pytest.mark.parametrize("blocks,match", [
    ({"layer": nnx.Module.__subclasses__}, "must take \\(path, module\\)"),
    ({"default": DecoderLayer}, "not a valid block type"),
    ({}, "non-empty dict"),
    ({"layer": (DecoderLayer, 3)}, "not a class"),
])
def test_bad_blocks(blocks, match):
  with pytest.raises(JaxckptError, match=match) as err:
    jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "full", blocks=blocks)
  one_line(err)


def test_linen_class_or_instance_to_remat_points_to_linen_apply():
  from tests.own_models import LinenMlpBlock
  for target in (LinenMlpBlock, LinenMlpBlock(8)):
    with pytest.raises(JaxckptError, match="jaxckpt.linen.apply_remat") as err:
      jaxckpt.remat(target, "full")
    one_line(err)
  with pytest.raises(JaxckptError, match="jaxckpt.apply_remat") as err:
    jaxckpt.remat(DecoderLayer, "full")
  with pytest.raises(JaxckptError, match="linen.apply_remat") as err:
    jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "full", blocks={"layer": LinenMlpBlock})
  one_line(err)


def test_layered_policy_gives_each_layer_instance_its_spec():
  model = jaxckpt.apply_remat(Decoder(rngs=nnx.Rngs(0)), "none", blocks=SPLIT)
  batch = decoder_batch()
  jaxckpt.set_policy(model, "0:full;1:none")
  assert regions(model, batch) == 2  # layer 0's attn and mlp
  assert [layer.attn._jaxckpt_policy for layer in model.layers] == [jaxckpt.parse_policy("full"),
                                                                      jaxckpt.parse_policy("none")]
  with pytest.raises(JaxckptError, match="covers 3 layers but Decoder has 2") as err:
    jaxckpt.set_policy(model, "0-2:full")
  one_line(err)
  scanned = jaxckpt.apply_remat(ScannedDecoder(rngs=nnx.Rngs(0)), "none", blocks={"layer": DecoderLayer})
  with pytest.raises(JaxckptError, match="separate layer instances") as err:
    jaxckpt.set_policy(scanned, "0:full;1:none")
  one_line(err)


def test_set_policy_reaches_remat_wrappers():
  class Net(nnx.Module):
    def __init__(self):
      self.body = jaxckpt.remat(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "none", block_type="mlp")

    def __call__(self, x):
      return self.body(x)

  net = Net()
  assert jaxckpt.block_types(net) == {"mlp": frozenset()}
  jaxckpt.set_policy(net, "mlp=full")
  assert net.body.policy == jaxckpt.parse_policy("mlp=full")
  grad = jax.grad(lambda m, x: m(x).sum())
  assert count_remat_regions(jax.make_jaxpr(lambda x: grad(net, x))(jnp.ones((2, 4)))) == 1


def test_a_region_that_only_gathers_parameters_is_not_a_policys_remat():
  """Policy ``none`` under an FSDP mesh gathers each block's parameters inside a jax.checkpoint of the gather alone
  (jaxckpt.core._remat._gathered_call): no activation is recomputed, so the report's "none has no remat region"
  check must not count it; a checkpoint that computes is counted."""
  from jax.sharding import NamedSharding, PartitionSpec

  from jaxckpt.analysis._jaxprs import count_remat_regions, uses_remat

  mesh = jax.make_mesh((1,), ("fsdp",))
  gather = jax.checkpoint(lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec())))
  compute = jax.checkpoint(jnp.sin)
  w = jnp.ones((4, 4))
  only_gather = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(gather(w) @ w)))(w)
  computing = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(compute(gather(w)) @ w)))(w)
  assert (count_remat_regions(only_gather), uses_remat(only_gather)) == (0, False)
  assert (count_remat_regions(computing), uses_remat(computing)) == (1, True)
