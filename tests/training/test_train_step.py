"""make_train_step with a user's own NNX model and its plain ``loss_fn(model, batch)``; the once-only warning when
such a remat'd step is jitted on XLA:CPU without jaxckpt's compiler option (nnx.jit, plain jax.jit)."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.training import _xla as xla
from tests.numerics import assert_trees_close

DIM, LAYERS, BATCH = 16, 3, 8


class Layer(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
    self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + self.down(self.drop(jnp.tanh(self.up(x))))


class Net(nnx.Module):
  """What a user writes: a Python list of layers, dropout from the model's own Rngs."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.layers = nnx.List([Layer(rngs=rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(DIM, 1, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x)[:, 0]


def mse(model, batch):  # the plain loss ModelTarget takes: (model, batch) -> scalar
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _setup(policy):
  model = jaxckpt.apply_remat(Net(rngs=nnx.Rngs(0)), policy, blocks={"layer": Layer})
  tx = optax.adam(1e-2)
  graphdef, state = jaxckpt.create_train_state(model, tx, seed=0)
  return jaxckpt.make_train_step(graphdef, tx, mse), state


def _batch():
  x = jax.random.normal(jax.random.key(1), (BATCH, DIM))
  return {"x": x, "y": jnp.sin(x.sum(-1))}


def test_users_nnx_model_trains_with_its_plain_loss():
  batch = _batch()
  step, state = _setup("nothing_saveable")
  run = jaxckpt.jit(step, donate_argnums=0)
  losses = []
  for _ in range(15):
    state, metrics = run(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.5 * losses[0], losses
  # Remat changes no number: one step with and without it gives the same parameters (same dropout masks).
  none_step, none_state = _setup("none")
  remat_step, remat_state = _setup("nothing_saveable")
  a, _ = jaxckpt.jit(none_step)(none_state, batch)
  b, _ = jaxckpt.jit(remat_step)(remat_state, batch)
  assert_trees_close(b.params, a.params, depth=LAYERS, what="parameters after one step, nothing_saveable vs none")
  evaluated = jax.jit(jaxckpt.make_eval_step(nnx.graphdef(Net(rngs=nnx.Rngs(0))), mse))(none_state, batch)
  assert set(evaluated) == {"loss"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the cse_barrier_expander problem is XLA:CPU's")
def test_plain_jit_of_a_remat_step_warns_once_on_cpu(monkeypatch):
  monkeypatch.setattr(xla, "_WARNED", set())
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  step, state = _setup("nothing_saveable")
  batch = _batch()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jaxckpt.jit(step).lower(state, batch)  # jaxckpt's option: no warning
    assert caught == []
    jax.jit(step).lower(state, batch)  # what nnx.jit does: no compiler options
    jax.jit(step, donate_argnums=0).lower(state, batch)  # a second time: not again
    none_step, none_state = _setup("none")
    jax.jit(none_step).lower(none_state, batch)  # no remat: nothing to warn about
  remat = [w for w in caught if issubclass(w.category, jaxckpt.RematIneffectiveWarning)]
  assert len(remat) == 1 and "jaxckpt.jit" in str(remat[0].message) and "nnx.jit" in str(remat[0].message)
