"""apply_remat with the checkpoint names your model tags itself (``checkpoint_name`` in its own code): accepted before
any trace, as the CLI (which traces) accepts them, and checked when a block is first traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.errors import PolicySpecError
from tests.numerics import assert_trees_close


class Layer(nnx.Module):
  """Tags its projections with MaxText's names itself."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.q_proj = nnx.Linear(8, 8, rngs=rngs)
    self.k_proj = nnx.Linear(8, 8, rngs=rngs)
    self.v_proj = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    q = checkpoint_name(self.q_proj(x), "query_proj")
    k = checkpoint_name(self.k_proj(x), "key_proj")
    v = checkpoint_name(self.v_proj(x), "value_proj")
    return x + jnp.tanh(q * k) * v


class Model(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.layers = nnx.List([Layer(rngs=rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


X = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)


def test_a_models_own_names_are_accepted_and_saved():
  model = jaxckpt.apply_remat(Model(rngs=nnx.Rngs(0)), "save_only_these_names:query_proj+key_proj+value_proj",
                              blocks={"layer": Layer})  # refused before: "never emits key_proj"
  graphdef, state = nnx.split(model)
  saved = {r.name for r in saved_residuals(lambda s: nnx.merge(graphdef, s)(X).sum(), state) if r.name}
  assert saved == {"query_proj", "key_proj", "value_proj"}
  reference = Model(rngs=nnx.Rngs(0))
  want = nnx.grad(lambda m: m(X).sum())(reference)
  assert_trees_close(nnx.grad(lambda m: m(X).sum())(model), want, depth=2, what="gradients, own names vs none")
  assert {"query_proj", "key_proj", "value_proj"} <= jaxckpt.block_types(model)["layer"]  # learnt at the trace


def test_a_typo_is_refused_at_the_first_trace_in_one_line():
  model = jaxckpt.apply_remat(Model(rngs=nnx.Rngs(0)), "save_only_these_names:query_prj", blocks={"layer": Layer})
  with pytest.raises(PolicySpecError) as err:
    jax.eval_shape(lambda: model(X))
  message = str(err.value)
  assert "\n" not in message and "'query_prj'" in message and "did you mean 'query_proj'" in message


def test_an_automatic_names_form_is_still_refused_at_once():
  with pytest.raises(PolicySpecError, match="q_proj"):
    jaxckpt.apply_remat(Model(rngs=nnx.Rngs(0)), "save_only_these_names:q_proj.3", blocks={"layer": Layer})
