"""A budget plan for your own scanned stack (layers made with ``nnx.vmap``, applied with ``nnx.scan``): it covers every
layer with one policy (a scan body takes one), and its exported code runs for each of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from tests import own_models as om
from jaxckpt.planner import plan_policy
from jaxckpt.planner._export import export_code

LAYERS = 4


def scanned_target():
  """``--target test_scanned_own_model:scanned_target``: the own decoder's 4 layers scanned."""
  return jaxckpt.nnx_model_target(lambda: om.ScannedDecoder(layers=LAYERS, rngs=nnx.Rngs(0)),
                                  jax.ShapeDtypeStruct((4, om.SEQ + 1), jnp.int32), loss="next_token",
                                  blocks={"layer": om.DecoderLayer})


@pytest.fixture(scope="module")
def plan():
  return plan_policy(scanned_target(), "budget:60%")


def test_the_plan_covers_every_scanned_layer_with_one_policy(plan):
  assert plan.num_layers == LAYERS
  ranges = plan.layer_ranges()
  assert [(first, last) for first, last, _ in ranges] == [(0, LAYERS - 1)]
  assert "layers 0-3:" in plan.explain() and "layer 0:" not in plan.explain()


def test_the_exported_plan_runs_for_every_layer(plan):
  code = export_code(plan, ("layer",))
  scope: dict = {}
  exec(code, scope)  # noqa: S102 - the exported snippet is plain JAX
  for layer in range(LAYERS):  # layer 1 raised IndexError before
    wrapped = scope["remat_block"](lambda p, x: x * p, layer, "layer")
    assert float(wrapped(2.0, 3.0)) == 6.0
  with pytest.raises(IndexError, match="layer 4 is not in the plan"):
    scope["remat_block"](lambda p, x: x, LAYERS, "layer")
