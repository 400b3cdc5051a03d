"""Per-tensor plans: automatic value names, the min-cut program against exhaustive search, re-traced blocks saving
exactly the chosen set, gradients, ``min_saved``, ``activation_residual_bytes`` and per-tensor budget plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.models._gpt import GPT_PRESETS, build_gpt, lm_loss
from jaxckpt.planner import min_saved_policy, resolve_policy
from jaxckpt.planner._plan import layer_probe
from jaxckpt.planner._tensors import (block_graph, exhaustive_block, min_saved_layer, recompute_closure,
                                     record_block_graphs, solve_block, tensor_options)
from jaxckpt.policies import MinSaved
from jaxckpt import Policy, PolicySpec, parse_model_policy
from jaxckpt.report._residuals import analyse_residuals
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.step import default_optimizer, policy_step, shipped_target
from jaxckpt.core._tagging import parse_value_name, tag_values, value_name
from tests.numerics import assert_trees_close

D, H, B = 8, 16, 4


def _block(x, w1, w2):
  """A small MLP-like block: LayerNorm-ish centring, tanh-GELU, a second matmul, a residual. x: [B, D] float32."""
  c = x - jnp.mean(x, axis=-1, keepdims=True)
  h = c @ w1
  g = 0.5 * h * (1 + jnp.tanh(0.8 * (h + 0.04 * h ** 3)))
  return x + jnp.sin(g) @ w2


def _args():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k1, (B, D)), jax.random.normal(k2, (D, H)) / 3, jax.random.normal(k3, (H, D)) / 4)


@pytest.fixture(scope="module")
def graph():
  return block_graph("toy", jax.make_jaxpr(_block)(*_args()))


def test_value_names_round_trip_and_number_like_the_walk(graph):
  assert parse_value_name(value_name(12, "tanh")) == (12, "tanh") and parse_value_name("qkv") is None
  assert [v.index for v in graph.values] == list(range(len(graph.values)))
  assert {v.primitive for v in graph.values} >= {"dot_general", "tanh", "sin", "mul"}
  # the backward reads the matmul inputs (the centred x, sin's output) among others; block inputs are not values
  needed = {graph.values[v].primitive for v in graph.needed}
  assert {"sub", "sin"} <= needed and all(v >= 0 for v in graph.needed)
  with pytest.raises(ValueError, match="t<index>_<primitive>"):
    tag_values(_block, ["qkv"])


def test_solver_equals_exhaustive_search(graph):
  top = solve_block(graph)
  assert top.cost == 0 and recompute_closure(graph, top.saved) == set()
  checked = 0
  for cap in np.linspace(0, top.bytes, 7):
    ours, brute = solve_block(graph, max_bytes=float(cap)), exhaustive_block(graph, float(cap))
    assert ours.bytes <= cap
    assert ours.cost == pytest.approx(brute.cost) and ours.bytes <= brute.bytes + 1e-9, cap
    checked += 1
  assert checked == 7
  nothing = solve_block(graph, max_bytes=0)
  assert nothing.saved == () and nothing.cost > 0


def _named_residuals(fn, *args):
  return sorted(r.name for r in saved_residuals(fn, *args) if r.kind == "checkpoint_name")


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_retraced_block_saves_exactly_the_chosen_set_and_gradients_equal(graph, fraction):
  top = solve_block(graph)
  choice = solve_block(graph, max_bytes=fraction * top.bytes)
  assert choice.names
  policy = Policy("save_tensors", choice.names)
  fn = jaxckpt.checkpoint(_block, policy)
  args = _args()
  assert _named_residuals(fn, *args) == sorted(choice.names)
  unnamed = [r for r in saved_residuals(fn, *args) if r.kind not in ("argument", "checkpoint_name")]
  assert unnamed == []
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
  want = jax.grad(loss(_block), argnums=(0, 1, 2))(*args)
  got = jax.grad(loss(fn), argnums=(0, 1, 2))(*args)
  assert_trees_close(got, want, depth=1, what=f"block gradients, save_tensors at {fraction:.0%} vs no remat")


def test_save_tensors_policy_parses_and_passes_validation():
  spec = jaxckpt.parse_policy("mlp=save_tensors:t3_add+t7_tanh")
  assert spec.for_block("mlp") == Policy("save_tensors", ("t3_add", "t7_tanh"))
  spec.validate({"mlp": {"mlp_hidden"}})  # automatic names are not emitted names, and that is fine


# ---------------------------------------------------------------------------------------------------------------------
# GPT tiny: blocks inside a scanned stack


@pytest.fixture(scope="module")
def gpt():
  target = shipped_target("gpt", "tiny")
  _, probe = layer_probe(target)
  graphs = record_block_graphs(probe)
  return target, probe, graphs


def test_gpt_blocks_have_graphs_and_options(gpt):
  _, _, graphs = gpt
  assert set(graphs) == {"attn", "mlp"}
  options = tensor_options(graphs)
  for block, policies in options.items():
    assert len(policies) >= 3 and all(p.name == "save_tensors" and p.names for p in policies)
    assert len({p.names for p in policies}) == len(policies)


def test_layer_saves_exactly_the_chosen_tensors(gpt):
  _, probe, graphs = gpt
  chosen = min_saved_layer(graphs, 0.01)
  spec = PolicySpec(blocks=tuple((b, chosen[b].policy) for b in sorted(chosen)))
  probe.measure(spec)
  named = sorted(r.name for r in probe.last_residuals if r.kind == "checkpoint_name")
  assert named == sorted(n for c in chosen.values() for n in c.names)
  # nothing else but the mlp block's input (the attn block's output, an argument of the mlp checkpoint)
  others = [r for r in probe.last_residuals if r.kind not in ("argument", "checkpoint_name")]
  assert [(r.primitive, r.shape) for r in others] == [("add", (8, 64, 64))]
  assert "attention" in others[0].source.lower()


def _grads(policy, scan=True):
  cfg = GPT_PRESETS["tiny"]
  model = build_gpt(cfg, policy=None)
  jaxckpt.set_policy(model, policy)
  tokens = jax.random.randint(jax.random.key(1), (cfg.batch_size, cfg.seq_len + 1), 0, cfg.vocab_size)
  batch = {"tokens": tokens}
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return lm_loss(nnx.merge(graphdef, p, rest), batch, dropout_key=jax.random.key(2), deterministic=False)

  return jax.jit(jax.value_and_grad(lambda p: loss(p)[0]))(params)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_min_saved_resolves_to_save_tensors_and_gradients_equal_no_remat(gpt):
  target, _, graphs = gpt
  spec, plan = resolve_policy(target, "min_saved")
  assert plan is None and {b for b, _ in spec.blocks} == {"attn", "mlp"}
  assert all(p.name == "save_tensors" for _, p in spec.blocks)
  loose, _ = min_saved_policy(target, 0.5, graphs)
  saved = lambda s: sum(sum(graphs[b].values[parse_value_name(n)[0]].bytes for n in p.names)  # noqa: E731
                        for b, p in s.blocks)
  assert saved(loose) < saved(spec)  # more recompute allowed, less saved
  loss0, grads0 = _grads("none")
  loss1, grads1 = _grads(spec)
  depth = GPT_PRESETS["tiny"].num_layers
  assert_trees_close(loss1, loss0, depth=depth, what="GPT tiny loss, min_saved vs no remat")
  assert_trees_close(grads1, grads0, depth=depth, what="GPT tiny gradients, min_saved vs no remat")


@pytest.mark.parametrize("text, expected", [("min_saved", MinSaved()), ("min_saved:tol=1%", MinSaved(tolerance=0.01)),
                                            ("min_saved: tol = 0%", MinSaved(tolerance=0.0))])
def test_min_saved_parses_and_round_trips(text, expected):
  parsed = parse_model_policy(text)
  assert parsed == expected and parse_model_policy(str(parsed)) == parsed


@pytest.mark.parametrize("text, bad", [("min_saved:tol=x", "x"), ("min_saved:tol=100%", "100%"),
                                       ("min_saved:x=1%", "x=1%")])
def test_bad_min_saved_names_the_bad_part(text, bad):
  with pytest.raises(PolicySpecError) as info:
    parse_model_policy(text)
  assert info.value.bad == bad


def test_set_policy_refuses_unresolved_min_saved():
  model = nnx.eval_shape(lambda: build_gpt(GPT_PRESETS["tiny"]))
  with pytest.raises(JaxckptError, match="resolve_policy"):
    jaxckpt.set_policy(model, "min_saved")


def test_activation_residual_bytes_exclude_the_parameter_slices():
  target = shipped_target("gpt", "tiny")
  cfg = GPT_PRESETS["tiny"]
  # per-layer slices of the stacked attn/mlp weights the unrolled analysis keeps (LayerNorm scales included)
  out = {}
  for policy in ("none", "nothing_saveable"):
    summary = analyse_residuals(policy_step(target, jaxckpt.parse_policy(policy), default_optimizer()))
    out[policy] = summary
    assert 0 < summary["activation_bytes"] < summary["bytes"]
  param_only = {p: s["bytes"] - s["activation_bytes"] for p, s in out.items()}
  assert param_only["none"] > 0 and param_only["nothing_saveable"] > 0
  params = nnx.state(nnx.eval_shape(lambda: build_gpt(cfg)), nnx.Param)
  total_params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  assert max(param_only.values()) <= total_params
  assert out["nothing_saveable"]["activation_bytes"] < out["none"]["activation_bytes"]


@pytest.mark.slow
def test_per_tensor_budget_plan_fits_explains_and_exports(gpt):
  target, _, _ = gpt
  plan = jaxckpt.planner.plan_policy(target, "budget:40%")
  assert plan.compiled.temp_bytes <= plan.limit_bytes
  assert any(p.name == "save_tensors" for c in plan.candidates for _, p in c.spec.blocks)
  text = plan.explain()
  policies = [p for _, _, s in plan.layer_ranges() for _, p in s.blocks]
  if any(p.name == "save_tensors" for p in policies):
    assert "chosen tensors" in text and ".py:" in text
  code = jaxckpt.planner.export_code(plan, ("attn", "mlp"))
  namespace = {}
  exec(compile(code, "<plan>", "exec"), namespace)
  loss0, grads0 = _grads("none")
  loss1, grads1 = _grads(plan.policy)
  depth = GPT_PRESETS["tiny"].num_layers
  assert_trees_close(loss1, loss0, depth=depth, what=f"GPT tiny loss, {plan.policy} vs no remat")
  assert_trees_close(grads1, grads0, depth=depth, what=f"GPT tiny gradients, {plan.policy} vs no remat")


def test_exported_tagging_helper_saves_the_named_values(graph):
  from jaxckpt.planner._export import TAGGING_CODE  # noqa: PLC0415

  namespace = {"jax": jax}
  exec(compile(TAGGING_CODE, "<tagging>", "exec"), namespace)
  choice = solve_block(graph, max_bytes=0.5 * solve_block(graph).bytes)
  fn = jax.checkpoint(namespace["tag_values"](_block, choice.names),
                      policy=jax.checkpoint_policies.save_only_these_names(*choice.names))
  assert _named_residuals(fn, *_args()) == sorted(choice.names)
