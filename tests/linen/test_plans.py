"""Budget plans, min_saved and layered policies for Linen models (tests/linen/linen_lms.py: GPT-2 with its own Conv1D
layer, Llama; written like public Flax code), through the planner's one code path; the glue-free Linen target."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.analysis._jaxprs import count_remat_regions
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.errors import JaxckptError
from jaxckpt.linen._apply import apply_remat, group_layers
from jaxckpt.planner import plan_policy, resolve_policy
from jaxckpt.planner._plan import MAX_GUARD_COMPILES, MAX_ROUNDS
from jaxckpt.planner._cache import PlanCache
from jaxckpt.cli._plan import main as plan_main
from jaxckpt.planner._export import linen_export_code
from jaxckpt import LayeredPolicy, parse_model_policy
from jaxckpt.step import LossTarget
from jaxckpt.report import build_report
from jaxckpt.step import compile_policy
from tests.numerics import assert_trees_close
from tests.linen.linen_lms import (TOKENS, FlaxGPT2Block, FlaxGPT2LMHeadModel, LlamaConfig, LlamaDecoderLayer,
                       LlamaForCausalLM, gpt2_target, llama_target)

LAYERED = "0-1:nothing_saveable;2-4:dots_saveable"
FIXED = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")


# ------------------------------------------------------------------------------------------------------ layers


@pytest.mark.parametrize("paths, layers", [
    ([("h_0",), ("h_1",), ("h_2",)], [("h_0",), ("h_1",), ("h_2",)]),                    # list attribute in setup
    ([("layers_10", "attn"), ("layers_2", "mlp"), ("layers_2", "attn")], [("layers_2",), ("layers_10",)]),  # ints
    ([("Decoder_0", "DecoderBlock_0"), ("Decoder_0", "DecoderBlock_1")],                  # one auto-named parent
     [("Decoder_0", "DecoderBlock_0"), ("Decoder_0", "DecoderBlock_1")]),
    ([("transformer", "h", "0"), ("transformer", "h", "1")], [("transformer", "h", "0"), ("transformer", "h", "1")]),
    ([("ScanBlock_0",)], []),                                                             # nn.scan: one call
    ([("encoder",), ("decoder",)], []),
])
def test_group_layers_rule(paths, layers):
  assert list(group_layers(paths)) == layers


def test_linen_targets_know_their_layers():
  gpt2, llama = gpt2_target(), llama_target()
  assert (gpt2.num_layers, llama.num_layers) == (5, 5)
  assert gpt2.name == "FlaxGPT2LMHeadModel" and gpt2.model.layers == (("h_0",), ("h_1",), ("h_2",), ("h_3",), ("h_4",))
  assert llama.model.layers[4] == ("layers_4",)
  assert "mlp.up_proj" in llama.block_types["layer"]


class ScannedLM(nn.Module):
  """Llama layers stacked with nn.scan (one block call for all layers)."""

  @nn.compact
  def __call__(self, tokens):
    cfg = LlamaConfig()
    x = nn.Embed(cfg.vocab_size, cfg.hidden_size)(tokens)
    stack = nn.scan(lambda mdl, h, _: (mdl(h), None), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=5)
    x, _ = stack(LlamaDecoderLayer(cfg, name="layers"), x, None)
    return nn.Dense(cfg.vocab_size, use_bias=False)(x)


def test_scanned_linen_model_has_one_layer_and_refuses_a_layered_policy():
  target = jaxckpt.linen_model_target(ScannedLM(), TOKENS, loss="next_token", blocks={"layer": LlamaDecoderLayer})
  assert target.num_layers == 1
  with pytest.raises(JaxckptError, match=r"needs separate layers; the loss of ScannedLM has one"):
    compile_policy(target, parse_model_policy(LAYERED))


@pytest.mark.remat3
def test_layered_policy_per_layer_and_params_unchanged():
  tokens = jnp.zeros((2, 8), jnp.int32)
  model = apply_remat(LlamaForCausalLM(), "none", blocks={"layer": LlamaDecoderLayer})
  plain = jax.eval_shape(lambda: LlamaForCausalLM().init(jax.random.key(0), tokens))
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
  assert jax.tree.structure(variables) == jax.tree.structure(plain)
  layered = model.with_policy(LAYERED)
  assert isinstance(layered.spec, LayeredPolicy)
  loss = lambda p: layered.apply({"params": p}, tokens).sum()  # noqa: E731
  closed = jax.make_jaxpr(loss)(variables["params"])
  assert count_remat_regions(closed) == 5  # every layer under its range's policy: 2 save nothing, 3 save matmuls
  if remat_implementation() == "remat2":  # remat3's equations print their policy differently
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(variables["params"]))
    assert jaxpr.count("policy=<function nothing_saveable") == 2
    assert jaxpr.count("policy=DotsSaveable(only_if_no_batch_dims=False)") == 3


def test_set_policy_refusals_name_the_module():
  model = apply_remat(LlamaForCausalLM(), "none", blocks={"layer": LlamaDecoderLayer})
  tokens = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(JaxckptError, match=r"covers 2 layers but LlamaForCausalLM has 5 .*layers_0.*0-4"):
    model.with_policy("0-1:nothing_saveable").init(jax.random.key(0), tokens)
  with pytest.raises(JaxckptError, match=r"'budget:50%' is planned for a target, not set on LlamaForCausalLM"):
    model.with_policy("budget:50%")


# ---------------------------------------------------------------------------------------- glue-free targets


def test_linen_model_target_refusals():
  with pytest.raises(JaxckptError, match=r"linen_model_target\(FlaxGPT2LMHeadModel\(...\)\) needs blocks="):
    jaxckpt.linen_model_target(FlaxGPT2LMHeadModel(), TOKENS, loss="next_token")
  with pytest.raises(JaxckptError, match=r"loss='next_tokens'\): valid names are next_token, classification"):
    jaxckpt.linen_model_target(FlaxGPT2LMHeadModel(), TOKENS, loss="next_tokens", blocks={"b": FlaxGPT2Block})
  with pytest.raises(JaxckptError, match=r"got an NNX module \(Linear\)"):
    jaxckpt.linen_model_target(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), TOKENS, loss="next_token")
  with pytest.raises(JaxckptError, match=r"needs batch=\{'inputs'"):
    jaxckpt.linen_model_target(FlaxGPT2LMHeadModel(), TOKENS, loss="classification", blocks={"b": FlaxGPT2Block})
  with pytest.raises(JaxckptError, match=r"matched no module called in FlaxGPT2LMHeadModel"):
    jaxckpt.linen_model_target(FlaxGPT2LMHeadModel(), TOKENS, loss="next_token", blocks={"b": LlamaDecoderLayer})


def test_linen_model_target_classifier_in_two_lines():
  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      for i in range(3):
        x = x + nn.Dropout(0.1)(nn.Dense(16, name=f"block_{i}")(x), deterministic=not train)
      return nn.Dense(10)(x)

  batch = {"inputs": jax.ShapeDtypeStruct((8, 16), jnp.float32), "labels": jax.ShapeDtypeStruct((8,), jnp.int32)}
  target = jaxckpt.linen_model_target(Classifier(), batch, loss="classification", blocks={"block": nn.Dense},
                                      call_kwargs={"train": True})
  assert target.num_layers == 3 and target.name == "Classifier"
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), target.params)
  wrapped = {"batch": {"inputs": jnp.ones((8, 16)), "labels": jnp.arange(8)}, "dropout_seed": jnp.uint32(3)}
  a = jax.grad(lambda p: target.loss(p, wrapped, policy=parse_model_policy("none")))(params)
  b = jax.grad(lambda p: target.loss(p, wrapped, policy=parse_model_policy("0:none;1-2:nothing_saveable")))(params)
  assert_trees_close(b, a, depth=target.num_layers, what="Classifier gradients, 0:none;1-2:nothing_saveable vs none")


# --------------------------------------------------------------------------------------------------- plans


def _grads(target: LossTarget, policy) -> list[np.ndarray]:
  leaves, tree = jax.tree.flatten(target.params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  params = tree.unflatten([0.02 * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)])
  batch = {"batch": jax.random.randint(jax.random.key(1), TOKENS.shape, 0, 128), "dropout_seed": jnp.uint32(7)}
  return jax.tree.leaves(jax.jit(jax.grad(lambda p: target.loss(p, batch, policy=policy)))(params))


class PlannedLlama(LlamaForCausalLM):
  """The Llama LM with the exported plan applied by hand: layer i's class from the snippet's remat_block_class."""

  remat_block_class: object = None

  @nn.compact
  def __call__(self, input_ids):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed_tokens")(input_ids)
    for i in range(cfg.num_hidden_layers):
      x = self.remat_block_class(LlamaDecoderLayer, i, "layer")(cfg, name=f"layers_{i}")(x)
    from tests.linen.linen_lms import RMSNorm
    x = RMSNorm(cfg.rms_norm_eps, name="norm")(x)
    return nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head")(x)


@pytest.mark.slow
@pytest.mark.parametrize("make, budget", [(gpt2_target, "budget:50%"), (llama_target, "budget:30%")],
                         ids=["gpt2", "llama"])
def test_budget_plans_fit_beat_fixed_policies_and_keep_gradients(make, budget):
  """One budget per model (50% of no remat's temp for GPT-2, 30% for Llama: each plan ≈ 2 min of CI's slow tier)."""
  target = make()
  cache = PlanCache()
  plans = {budget: plan_policy(target, budget, cache=cache)}
  none = plans[budget].none
  fixed = {p: (cache.points[p].flops, cache.points[p].temp_bytes) if p in cache.points else
           (lambda c: (c.flops, c.memory["temp_bytes"]))(compile_policy(target, parse_model_policy(p))) for p in FIXED}
  reference = _grads(target, parse_model_policy("none"))
  for budget, plan in plans.items():
    assert plan.compiled.temp_bytes <= plan.limit_bytes < none.temp_bytes, budget
    # none, full, at most 3 verification compiles and at most 2 of the dominance guard (docs/plans.md)
    assert len(plan.history) <= 2 + MAX_ROUNDS + MAX_GUARD_COMPILES
    fitting = [flops for flops, temp in fixed.values() if temp <= plan.limit_bytes]
    assert fitting and plan.compiled.flops <= min(fitting), budget
  min_saved, _ = resolve_policy(target, "min_saved")
  for policy in (*(p.policy for p in plans.values()), min_saved, parse_model_policy(LAYERED)):
    assert_trees_close(_grads(target, policy), reference, depth=target.num_layers,
                       what=f"{target.name} gradients, {policy} vs none")
  # (min_saved's compiled row, below none's temp: test_report_rows_for_a_linen_target)


@pytest.mark.slow
def test_exported_linen_plan_compiles_to_the_same_temp():
  target = llama_target()
  plan = plan_policy(target, "budget:50%", max_rounds=1)
  code = linen_export_code(plan, target.model)
  assert "nn.remat(block_cls" in code and "jaxckpt.linen.apply_remat(LlamaForCausalLM(...)" in code
  namespace: dict = {}
  exec(compile(code, "export", "exec"), namespace)  # noqa: S102 - our own generated code
  lm = PlannedLlama(remat_block_class=namespace["remat_block_class"])

  def loss(params, wrapped, *, policy):  # noqa: ARG001 - the plan is in the model
    tokens = wrapped["batch"]
    logits = lm.apply({"params": params}, tokens[:, :-1])
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  hand = LossTarget(loss, params=target.params, batch=target.batch, block_types={"default": set()})
  assert compile_policy(hand, parse_model_policy("none")).memory["temp_bytes"] == plan.compiled.temp_bytes


@pytest.mark.slow
def test_plan_cli_on_a_linen_target(capsys):
  assert plan_main(["--target", "tests.linen.linen_lms:gpt2_target", "--budget", "50%", "--max-rounds", "1", "--export",
                    "--explain"]) == 0
  out = capsys.readouterr().out
  assert "plan for budget:50%" in out and "remat_block_class" in out and "policy: " in out
  assert "candidates per layer" in out and "nothing_saveable" in out


def tiny_llama_target():
  """A --target small enough for a CLI refusal test: 2 layers, d=32, 8 tokens."""
  config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
  return jaxckpt.linen_model_target(LlamaForCausalLM(config), jax.ShapeDtypeStruct((4, 9), jnp.int32),
                                    loss="next_token", blocks={"layer": LlamaDecoderLayer})


@pytest.mark.slow
def test_plan_cli_infeasible_budget_is_one_line(capsys):
  assert plan_main(["--target", "tests.linen.test_plans:tiny_llama_target", "--budget", "1%"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "no plan fits budget:1%" in err and "LlamaForCausalLM" in err


def bad_blocks_target():
  """A --target whose block class matches nothing in the model."""
  return jaxckpt.linen_model_target(FlaxGPT2LMHeadModel(), TOKENS, loss="next_token", blocks={"b": LlamaDecoderLayer})


def test_plan_cli_bad_block_class_is_one_line(capsys):
  assert plan_main(["--target", "tests.linen.test_plans:bad_blocks_target", "--budget", "50%"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "matched no module called in FlaxGPT2LMHeadModel" in err


@pytest.mark.slow
def test_report_rows_for_a_linen_target():
  target = gpt2_target()
  assert target.block_types["block"] >= {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}  # Conv1D's outputs
  policies = ["none", "min_saved", LAYERED, "budget:50%", "nothing_saveable", "save_only_these_names:attn.c_attn"]
  report = build_report(target, policies, progress=False)
  rows = {r["policy"]: r for r in report.rows}
  assert all(r["status"] == "ok" for r in rows.values()), [r.get("error") for r in rows.values()]
  none = rows["none"]["temp_bytes"]
  assert all(rows[p]["temp_bytes"] < none for p in policies[1:])
  # a name policy on the custom layer's automatic name saves more than full remat, less than none
  assert rows["nothing_saveable"]["temp_bytes"] < rows["save_only_these_names:attn.c_attn"]["temp_bytes"] < none


@pytest.mark.remat3
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_min_saved_for_an_nnx_own_model_through_the_same_path():
  from tests.own_models import decoder_target

  policy, _ = resolve_policy(decoder_target(), "min_saved")  # refused before: it needed a jaxckpt Stack
  chosen = policy.for_block("layer")
  assert chosen.name == "save_tensors" and chosen.names


@pytest.mark.slow
def test_budget_plan_for_the_nnx_twin_with_its_own_projection_class():
  from tests.linen.linen_lms import nnx_gpt2_target

  target = nnx_gpt2_target()
  plan = plan_policy(target, "budget:50%", max_rounds=2)
  assert plan.num_layers == 5 and plan.compiled.temp_bytes <= plan.limit_bytes < plan.none.temp_bytes
  assert len(plan.history) <= 4
  tokens = {"tokens": jax.random.randint(jax.random.key(1), TOKENS.shape, 0, 128)}

  def grads(policy):
    model = target.make_model()
    jaxckpt.set_policy(model, policy)
    return jax.tree.leaves(nnx.jit(nnx.grad(lambda m: target.loss_fn(m, tokens, dropout_key=None,
                                                                        deterministic=False)[0]))(model))

  assert_trees_close(grads(plan.policy), grads("none"), depth=plan.num_layers,
                     what=f"NNX GPT-2 gradients, {plan.policy} vs none")


def test_linen_model_target_keeps_the_models_names_rule():
  model = apply_remat(FlaxGPT2LMHeadModel(), "none", blocks={"block": FlaxGPT2Block}, names=())  # names nothing
  target = jaxckpt.linen_model_target(model, TOKENS, loss="next_token", blocks={"block": FlaxGPT2Block})
  assert not target.block_types["block"] and gpt2_target().block_types["block"]


def test_newcomer_frictions_block_types_and_uncovered_layers():
  target = gpt2_target()
  # jaxckpt.linen.block_types takes the model from apply_remat (it used to say "declares no block types")
  found = jaxckpt.linen.block_types(target.model, jax.random.key(0), jax.ShapeDtypeStruct((4, 32), jnp.int32))
  assert found["block"] == target.block_types["block"]
  with pytest.raises(JaxckptError, match="give an RNG key and example inputs"):
    jaxckpt.linen.block_types(target.model)
  # the target's model knows its 5 layers: ranges that do not cover them are refused at set_policy, not later
  with pytest.raises(JaxckptError, match="covers 2 layers but FlaxGPT2LMHeadModel has 5"):
    target.model.with_policy("0-1:nothing_saveable")
  assert isinstance(target.model.with_policy(LAYERED).spec, LayeredPolicy)
