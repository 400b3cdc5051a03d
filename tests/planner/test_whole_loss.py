"""Whole-loss per-tensor plans (:mod:`jaxckpt.planner._whole`): the program against exhaustive search on a tiny loss,
the remat'd loss saving exactly the chosen set, gradients equal to no remat, caps honoured, bad caps refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.errors import JaxckptError
from jaxckpt.models._gpt import GPT_PRESETS
from jaxckpt.planner._tensors import PARAMETER_ONLY_WEIGHT, exhaustive_block, recompute_closure
from jaxckpt.planner._whole import measure_whole, remat_whole_loss, whole_graph, whole_loss, whole_plan
from jaxckpt.step import concrete_inputs, default_optimizer
from tests.numerics import assert_trees_close

B, D, H = 4, 6, 8


def _loss(params, batch):
  """A two-layer toy loss: x: [B, D] float32 (closed over), w1: [D, H], w2: [H, D] float32; a transposed weight is a
  parameter-only value."""
  x = batch["x"]
  h = jnp.tanh(x @ params["w1"])
  y = jnp.sin(h) @ params["w2"]
  z = y @ params["w2"].T  # w2.T: parameter-only
  return jnp.sum(z * z)


def _concrete():
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  params = {"w1": jax.random.normal(k1, (D, H)) / 3, "w2": jax.random.normal(k2, (H, D)) / 3}
  return params, {"x": jax.random.normal(k3, (B, D))}


@pytest.fixture(scope="module")
def toy():
  params, batch = _concrete()
  loss = whole_loss(_loss, params, batch)
  return loss, whole_graph(loss)


def test_toy_graph_marks_parameter_only_values_and_keeps_the_batch(toy):
  loss, graph = toy
  assert loss.num_parameters == 2
  transposes = [v.index for v in graph.values if v.primitive == "transpose"]
  assert transposes and set(transposes) <= graph.parameter_only
  assert not any(graph.values[v].primitive in ("tanh", "sin") for v in graph.parameter_only)
  assert graph.fixed_bytes == B * D * 4  # the batch: closed over, read by the backward when it recomputes x @ w1


def test_whole_program_equals_exhaustive_search(toy):
  loss, graph = toy
  top = whole_plan(loss, graph=graph).choice
  assert top.cost == 0 and recompute_closure(graph, top.saved) == set()
  for cap in np.linspace(graph.fixed_bytes, graph.fixed_bytes + top.bytes, 6):
    ours = whole_plan(loss, max_bytes=float(cap), graph=graph).choice
    brute = exhaustive_block(graph, float(cap))
    weighted = lambda c: sum(graph.values[v].bytes * (PARAMETER_ONLY_WEIGHT if v in graph.parameter_only else 1)  # noqa: E731
                             for v in c.saved)
    assert ours.activation_bytes <= cap
    assert ours.cost == pytest.approx(brute.cost) and weighted(ours) == pytest.approx(weighted(brute)), cap


@pytest.mark.parametrize("share", [1.0, 0.5, 0.0])
def test_toy_remat_saves_exactly_the_chosen_set_and_gradients_equal(toy, share):
  loss, graph = toy
  top = whole_plan(loss, graph=graph).choice
  plan = whole_plan(loss, max_bytes=graph.fixed_bytes + share * top.activation_bytes, graph=graph)
  measured = measure_whole(loss, plan.loss_fn)
  assert measured.saved_names == frozenset(plan.choice.names)
  assert measured.activation_residual_bytes <= plan.choice.activation_bytes
  params, batch = _concrete()
  want = jax.grad(_loss)(params, batch)
  got = jax.grad(plan.loss_fn)(params, batch)
  assert_trees_close(got, want, depth=3, what=f"toy gradients, plan at {share:.0%} vs no remat")  # three matmuls


def test_bad_caps_and_params_are_refused(toy):
  loss, graph = toy
  with pytest.raises(JaxckptError, match="max_bytes=10 .* every whole-loss plan keeps"):
    whole_plan(loss, max_bytes=10, graph=graph)
  with pytest.raises(JaxckptError, match="max_flops=-1"):
    whole_plan(loss, max_flops=-1, graph=graph)
  with pytest.raises(JaxckptError, match="minimise='speed'"):
    whole_plan(loss, minimise="speed", graph=graph)
  with pytest.raises(JaxckptError, match="float leaves only"):
    whole_loss(_loss, {"w1": jnp.zeros((D, H), jnp.int32)}, {"x": jnp.zeros((B, D))})
  with pytest.raises(JaxckptError, match=r"\['qkv'\] name no value of this loss .* t0_dot_general"):
    remat_whole_loss(loss, ["qkv"])


@pytest.mark.parametrize("kwargs, match", [
    ({"max_bytes": float("nan")}, "max_bytes=nan must be a number"),
    ({"max_flops": float("nan")}, "max_flops=nan must be a number"),
    ({"max_bytes": "1e6"}, "max_bytes='1e6' must be a number"),
    ({"time_limit": 0}, "time_limit=0 must be > 0"),
    ({"time_limit": float("nan")}, "time_limit=nan must be a number"),
])
def test_nan_and_non_numeric_caps_are_refused(toy, kwargs, match):
  loss, graph = toy
  with pytest.raises(JaxckptError, match=match):
    whole_plan(loss, graph=graph, **kwargs)


def test_both_caps_infeasible_names_the_least_bytes_at_that_recompute(toy):
  loss, graph = toy
  least = whole_plan(loss, max_flops=0, minimise="bytes", graph=graph).choice.activation_bytes
  assert least > graph.fixed_bytes
  with pytest.raises(JaxckptError, match=f"meets both max_bytes={graph.fixed_bytes} and max_flops=0; the least saved "
                                         f"bytes at max_flops=0 is {least}"):
    whole_plan(loss, max_bytes=graph.fixed_bytes, max_flops=0, graph=graph)
  both = whole_plan(loss, max_bytes=least, max_flops=0, graph=graph).choice  # exactly feasible
  assert both.flops == 0 and both.activation_bytes <= least


def test_bad_losses_and_names_are_refused_not_silently_planned(toy):
  loss, graph = toy
  params, batch = _concrete()
  with pytest.raises(JaxckptError, match="params has no array leaves"):
    whole_loss(lambda p, b: jnp.sum(b["x"]), {}, batch)
  with pytest.raises(JaxckptError, match=r"one float scalar; got float32\[4, 8\]"):
    whole_loss(lambda p, b: b["x"] @ p["w1"], params, batch)
  # a name of the right form that no value of this loss has would tag nothing: JAX would save nothing, silently
  for name in ("t999_tanh", "t1_sin"):  # out of range; right index, wrong primitive (t1 is the tanh)
    with pytest.raises(JaxckptError, match=f"'{name}'.* name no value of this loss"):
      remat_whole_loss(loss, [name])
  with pytest.raises(JaxckptError, match="not the string 't1_tanh'"):
    remat_whole_loss(loss, "t1_tanh")
  other = whole_loss(lambda p, b: jnp.sum(p["w1"]), params, batch)
  with pytest.raises(JaxckptError, match="graph is not this loss's"):
    whole_plan(other, graph=graph)
  assert measure_whole(loss, remat_whole_loss(loss, ["t1_tanh"])).saved_names == {"t1_tanh"}


@pytest.fixture(scope="module")
def gpt_tiny(gpt_tiny_whole_loss):
  target, loss, graph = gpt_tiny_whole_loss  # conftest.py: traced once a run
  return target, loss, graph, measure_whole(loss)


def test_gpt_whole_plan_saves_the_chosen_set_within_the_cap(gpt_tiny):
  _, loss, graph, none = gpt_tiny
  assert graph.fixed_bytes > 0 and graph.parameter_only  # tokens and key; per-layer weight slices
  previous = None
  for share in (0.5, 0.2):
    cap = share * none.activation_residual_bytes
    plan = whole_plan(loss, max_bytes=cap, graph=graph)
    measured = measure_whole(loss, plan.loss_fn)
    assert measured.saved_names == frozenset(plan.choice.names)
    assert measured.activation_residual_bytes <= plan.choice.activation_bytes <= cap
    assert measured.flops > 0.99 * none.flops
    if previous is not None:  # less memory, more recompute
      assert plan.choice.flops > previous.flops
    previous = plan.choice
  # a FLOPs cap: the least bytes that recompute nothing saves less than no remat
  least = whole_plan(loss, max_flops=0, minimise="bytes", graph=graph).choice
  assert least.flops == 0 and least.activation_bytes < none.activation_residual_bytes


@pytest.mark.slow
def test_gpt_whole_plan_gradients_equal_no_remat(gpt_tiny):
  target, loss, graph, none = gpt_tiny
  plan = whole_plan(loss, max_bytes=0.2 * none.activation_residual_bytes, graph=graph)
  state, batch = concrete_inputs(target, default_optimizer())()
  key = jax.random.key(3)
  want = jax.jit(jax.grad(loss.fn))(state.params, batch, key)
  got = jax.jit(jax.grad(plan.loss_fn))(state.params, batch, key)
  depth = GPT_PRESETS["tiny"].num_layers  # shipped_target("gpt", "tiny") builds that preset
  assert_trees_close(got, want, depth=depth, what="GPT tiny gradients, whole plan at 20% vs no remat")
