"""Remat never changes the numbers: loss and gradients under every policy equal the no-remat ones (dropout on)."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.policies import CANONICAL_POLICIES, REGISTRY
from jaxckpt.policies._spec import parse_policy, refused
from jaxckpt._remat_impl import remat_implementation
from tests.numerics import assert_trees_close

# Checkpoint names each model emits, to give the name-taking policies real arguments.
NAMES = {
    "vit": ("qkv+mlp_hidden", "attn_weights", "qkv/mlp_hidden"),
    "mlp": ("mlp_hidden", "mlp_out", "mlp_hidden/mlp_out"),
    "cnn": ("conv_hidden", "conv_out", "conv_hidden/conv_out"),
}
MIXED = {"vit": "attn=dots_saveable,mlp=full", "mlp": "mlp=save_only_these_names:mlp_out", "cnn": "conv=full"}


def policy_specs(model: str) -> list[str]:
  save, except_, offload = NAMES[model]
  args = {"save_only_these_names": save, "save_anything_except_these_names": except_,
          "save_any_names_but_these": except_, "save_and_offload_only_these_names": offload}
  # save_tensors takes automatic value names the planner finds per block (jaxckpt.core._tagging): its gradients are checked
  # against no remat in tests/planner/test_pertensor.py, on the blocks those names come from.
  # A policy the installed JAX does not implement as named is refused by the parser (test_policies checks that).
  # Under JAX's next remat the offload policies are refused (callables remat3 would ignore; tests/house/test_remat3.py).
  remat3 = remat_implementation() == "remat3"
  # MaxText's presets save MaxText's names, which these models do not emit (refused in one line there,
  # tests/policies/test_maxtext_presets.py); their gradients are checked on the llm family there.
  specs = [name if REGISTRY[name].arity == "none" else f"{name}:{args[name]}" for name in CANONICAL_POLICIES
           if name != "save_tensors" and REGISTRY[name].preset is None and refused(name) is None and not (
               remat3 and parse_policy(
               name if REGISTRY[name].arity == "none" else f"{name}:{args[name]}").offloads)]
  return [*specs, MIXED[model]]


def batch():
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(8, 8, 8, 1)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}


def loss_and_grads(model, data, key):
  graphdef, params, other = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, other)
    return jaxckpt.models.classification_loss(m, data, dropout_key=key, deterministic=False)[0]

  return jaxckpt.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def models():
  """One tiny model per kind (dropout 0.1) and its no-remat loss and gradients, computed once."""
  out = {}
  data, key = batch(), jax.random.key(42)
  for name, entry in jaxckpt.models.MODELS.items():
    model = jaxckpt.models.build_model(name, entry.presets["tiny"], image_shape=(8, 8, 1), num_classes=10, policy="none")
    out[name] = (model, loss_and_grads(model, data, key))
  return out, data, key


def gradient_cases() -> list:
  """``(model, policy)`` for every model and policy but ``none``; marked ``remat3`` (run again under JAX's next
  remat, .ci/run): every policy on the ViT, the two extremes and the mixed spec on the others."""
  cases = []
  for m in jaxckpt.models.MODELS:
    for p in policy_specs(m):
      remat3 = m == "vit" or p in ("nothing_saveable", "dots_saveable", MIXED[m])
      if p != "none":
        cases.append(pytest.param(m, p, marks=pytest.mark.remat3 if remat3 else ()))
  return cases


@pytest.mark.parametrize("model_name,policy", gradient_cases())
def test_gradients_equal_no_remat(models, model_name, policy):
  built, data, key = models
  model, (ref_loss, ref_grads) = built[model_name]
  jaxckpt.set_policy(model, policy)
  try:
    loss, grads = loss_and_grads(model, data, key)
  finally:
    jaxckpt.set_policy(model, "none")
  depth = jaxckpt.models.MODELS[model_name].presets["tiny"].num_layers
  assert_trees_close(loss, ref_loss, depth=depth, what=f"{model_name} loss, {policy} vs no remat")
  assert_trees_close(grads, ref_grads, depth=depth, what=f"{model_name} gradients, {policy} vs no remat")


@pytest.mark.remat3
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "attn=save_only_these_names:qkv,mlp=full"])
def test_unrolled_vit_gradients_equal_scanned_no_remat(models, policy):
  built, data, key = models
  _, (ref_loss, ref_grads) = built["vit"]
  config = jaxckpt.models.MODELS["vit"].presets["tiny"]
  import dataclasses

  unrolled = jaxckpt.models.build_model("vit", dataclasses.replace(config, scan=False), image_shape=(8, 8, 1),
                                 num_classes=10, policy=policy)
  loss, grads = loss_and_grads(unrolled, data, key)
  what = f"unrolled {policy} vs scanned no remat"
  assert_trees_close(loss, ref_loss, depth=config.num_layers, what=f"ViT loss, {what}")
  assert_trees_close(grads, ref_grads, depth=config.num_layers, what=f"ViT gradients, {what}")


def test_dropout_is_really_on(models):
  """Guards the tests above: with another dropout key the loss changes, so equal losses mean equal masks."""
  built, data, _ = models
  model, (ref_loss, _) = built["vit"]
  other_loss, _ = loss_and_grads(model, data, jax.random.key(7))
  assert abs(float(other_loss) - float(ref_loss)) > 1e-4
