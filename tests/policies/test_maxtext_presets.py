"""MaxText's remat presets by name: each saves (or offloads) exactly the checkpoint names MaxText's table gives
(published-configs §4b, MaxText's ``Decoder.get_remat_policy``), and is refused in one line on a model that does not
emit MaxText's names."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.errors import PolicySpecError
from jaxckpt.policies._spec import MAXTEXT_OTHER_ARCHITECTURES, MAXTEXT_PRESETS
from tests.numerics import assert_trees_close
from tests.tiny import llm_batch, llm_loss_and_grads

ALL_MAXTEXT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj", "context",
                     "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")

# MaxText's table (../shared/published-configs.md §4b): preset -> (saved on device, offloaded to host), S expanded.
S = {"query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj"}
MLP = {"mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"}
EXPECTED = {
    "minimal_with_context": (S | {"out_proj", "context"} | MLP, set()),
    "minimal": (S | {"out_proj"} | MLP, set()),
    "save_dot_with_context_except_mlp": (S | {"context", "out_proj"}, set()),
    "save_dot_except_mlpwi": (S | {"out_proj", "mlpwo"}, set()),
    "save_dot_except_mlp": (S | {"out_proj"}, set()),
    "save_qkv_proj": (S, set()),
    "qkv_proj_offloaded": (set(), {"query_proj", "value_proj", "key_proj", "kv_proj"}),
    "minimal_offloaded": (set(), S | {"out_proj"} | MLP),
    "save_out_proj": ({"out_proj"}, set()),
    "full": (set(), set()),
}


def _layer(w, x):
  """A toy layer that tags one value with every MaxText name; value i is [4, 8 + i] wide, so a residual's shape tells
  its name also where JAX's analysis drops it (offloaded values are described as device_put outputs)."""
  h = checkpoint_name(x, "decoder_layer_input")
  total = 0.0
  for i, name in enumerate(ALL_MAXTEXT_NAMES[1:], start=1):
    total = total + jnp.sum(jnp.tanh(checkpoint_name(jnp.sin(h * (i + 1)) @ w[:, :8 + i], name)))
  return total


WIDTH = {8 + i: name for i, name in enumerate(ALL_MAXTEXT_NAMES[1:], start=1)}


def _saved(policy: str) -> tuple[set[str], set[str]]:
  """(names saved on device, names offloaded to host) by the preset on the toy layer, from JAX's saved-residual
  analysis (``jax.ad_checkpoint.print_saved_residuals``' source)."""
  from jax._src.ad_checkpoint import saved_residuals
  jax_policy = jaxckpt.parse_policy(policy).default.to_jax()
  w, x = jnp.ones((8, 8 + len(ALL_MAXTEXT_NAMES))), jnp.ones((4, 8))
  saved, offloaded = set(), set()
  for aval, where in saved_residuals(jax.checkpoint(_layer, policy=jax_policy), w, x):
    if "argument" in where:
      continue
    name = WIDTH[aval.shape[-1]]
    (offloaded if "<host>" in str(aval) else saved).add(name)
  return saved, offloaded


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_each_preset_saves_maxtexts_names(preset):
  saved, offloaded = _saved(preset)
  want_saved, want_offloaded = EXPECTED[preset]
  assert (saved, offloaded) == (want_saved - {"decoder_layer_input"}, want_offloaded), preset
  assert jaxckpt.parse_policy(preset).offloads == bool(want_offloaded)


def test_table_is_maxtexts_and_names_are_the_shipped_constants():
  assert set(MAXTEXT_PRESETS) | {"full"} == set(EXPECTED)
  for name, preset in MAXTEXT_PRESETS.items():
    assert (set(preset.save), set(preset.offload)) == EXPECTED[name], name
  shipped = set(jaxckpt.names.DECODER_NAMES) | set(MAXTEXT_OTHER_ARCHITECTURES)
  assert set().union(*(set(p.save) | set(p.offload) for p in MAXTEXT_PRESETS.values())) <= shipped
  assert str(jaxckpt.parse_policy("minimal_flash")) == "minimal_with_context"  # MaxText's deprecated alias


def test_preset_on_a_model_without_maxtexts_names_is_one_line():
  with pytest.raises(PolicySpecError) as err:
    jaxckpt.parse_policy("minimal").validate({"attn": {"qkv", "attn_out"}, "mlp": {"mlp_hidden"}})
  message = str(err.value)
  assert "\n" not in message and "MaxText preset 'minimal'" in message and "query_proj" in message
  assert "llm model family" in message


def test_preset_on_a_model_with_maxtexts_names_validates():
  emitted = {"decoder": {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj",
                         "mlpwi_0", "mlpwi_1", "mlpwo"}}
  for preset in MAXTEXT_PRESETS:
    jaxckpt.parse_policy(preset).validate(emitted)


def _presets_to_compile() -> list[str]:
  """Every preset; under JAX's next remat the offloading ones are refused (callables remat3 would ignore,
  tests/house/test_remat3.py)."""
  from jaxckpt._remat_impl import remat_implementation
  remat3 = remat_implementation() == "remat3"
  return [name for name in MAXTEXT_PRESETS if not (remat3 and jaxckpt.parse_policy(name).offloads)]


@pytest.mark.parametrize("preset", _presets_to_compile())
def test_preset_gradients_equal_no_remat(llm_tiny_reference, preset):
  """Each preset on the llm family (which emits MaxText's names): the loss and gradients of no remat (llama-tiny,
  float32, 2 layers, at 32 tokens: conftest.py), by the suite's float rule (tests/numerics.py), depth the decoder
  layers."""
  model, want, depth = llm_tiny_reference("llama-tiny")
  jaxckpt.set_policy(model, preset)
  try:
    got = llm_loss_and_grads(model, llm_batch())
  finally:
    jaxckpt.set_policy(model, "none")
  assert_trees_close(got, want, depth=depth, what=f"llama-tiny loss and gradients, {preset} vs none")
