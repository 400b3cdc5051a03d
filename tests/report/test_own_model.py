"""Your own model in the tools: jaxckpt's report (and planner) on models written like public Flax code, prepared with
jaxckpt.apply_remat; every row's compiled temp equals a hand-written jax.checkpoint version compiled with the same
options; rows whose policy was not applied are error rows."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.step import ModelTarget
from jaxckpt.report import build_report
from jaxckpt.cli._report import main as report_main
from jaxckpt.report._policies import expand_policies
from jaxckpt.step import step_compiler_options, target_block_types
from jaxckpt.step._targets import plain_loss_fn
from jaxckpt.training._train import abstract_train_state, make_train_step
from tests.own_models import BATCH, SEQ, Attention, Decoder, FeedForward, decoder_loss, decoder_target

TOKENS = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
CP = jax.checkpoint_policies
HAND = {"none": None, "dots_saveable": CP.dots_saveable, "nothing_saveable": CP.nothing_saveable,
        "save_only_these_names:mlp.up_proj": CP.save_only_these_names("mlp.up_proj")}


class HandDecoder(Decoder):
  """The same decoder with remat written by hand: each layer under nnx.remat (jax.checkpoint) with a JAX policy."""

  def __init__(self, policy, **kwargs):
    super().__init__(**kwargs)
    self.policy = policy

  def __call__(self, tokens, *, deterministic=False):
    x = self.embedder(tokens)
    for layer in self.layers:
      if self.policy is None:
        x = layer(x, deterministic=deterministic)
      else:
        x = nnx.remat(lambda layer, h: layer(h, deterministic=deterministic), policy=self.policy)(layer, x)
    return self.embedder.attend(self.final_norm(x))


class TaggedFeedForward(FeedForward):
  """FeedForward whose up projection the user tagged by hand (for the hand-written name-policy twin)."""

  def __call__(self, x):
    from jax.ad_checkpoint import checkpoint_name
    return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * checkpoint_name(self.up_proj(x), "mlp.up_proj"))


def hand_temp(policy: str) -> int:
  """Compiled temp bytes of the hand-written version, same train step (the plain one: loss, gradients, one AdamW
  update) and options as the report."""
  def make():
    model = HandDecoder(HAND[policy], rngs=nnx.Rngs(0))
    for layer in model.layers:
      object.__setattr__(layer.mlp, "__class__", TaggedFeedForward)
    return model

  tx = optax.adamw(1e-3)
  graphdef, state = abstract_train_state(make, tx)
  step = make_train_step(graphdef, tx, plain_loss_fn(decoder_loss), metrics=False)
  with jaxckpt.training._xla.remat_fix_applied():  # the options go to .compile() below, which the trace-time check cannot see
    traced = jax.jit(step, donate_argnums=0).trace(state, TOKENS)
  compiled = traced.lower().compile(compiler_options=step_compiler_options())
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_report_on_own_decoder_orders_and_equals_hand_written():
  report = build_report(decoder_target(), list(HAND), progress=False)
  rows = {r["policy"]: r for r in report.rows}
  assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
  temp = {p: rows[p]["temp_bytes"] for p in HAND}
  assert temp["nothing_saveable"] < temp["dots_saveable"] < temp["none"]
  assert temp["nothing_saveable"] <= temp["save_only_these_names:mlp.up_proj"] < temp["dots_saveable"]
  assert rows["none"]["remat_regions"] == 0
  assert all(rows[p]["remat_regions"] == 2 for p in HAND if p != "none")
  assert rows["save_only_these_names:mlp.up_proj"]["residual_bytes"] > rows["nothing_saveable"]["residual_bytes"]
  for policy in HAND:
    assert temp[policy] == hand_temp(policy), policy
  # The one warning: dropout's PRNG bits have no FLOP rule, and the report says the FLOPs are a lower bound.
  assert [w for w in report.data["warnings"] if not w.startswith("FLOPs do not count random_bits")] == []


@pytest.mark.remat3
def test_all_expands_the_automatic_names():
  types = target_block_types(decoder_target())
  assert types == {"layer": frozenset({"attn.q_einsum", "attn.kv_einsum", "attn.attn_vec_einsum", "mlp.gate_proj",
                                       "mlp.up_proj", "mlp.down_proj"})}
  specs = [str(s) for s in expand_policies(["all"], types, backend="cpu")]
  assert "save_only_these_names:attn.q_einsum" in specs and "save_only_these_names:mlp.down_proj" in specs
  assert specs[0] == "none" and "dots_saveable" in specs


@pytest.mark.remat3
def test_target_names_include_the_models_own_tags():
  def make():
    model = Decoder(rngs=nnx.Rngs(0))
    for layer in model.layers:
      object.__setattr__(layer.mlp, "__class__", TaggedFeedForward)
    return jaxckpt.apply_remat(model, "none", blocks={"mlp": FeedForward})

  types = target_block_types(ModelTarget(make_model=make, batch=TOKENS, loss_fn=decoder_loss))
  assert types == {"mlp": frozenset({"gate_proj", "up_proj", "down_proj", "mlp.up_proj"})}


@pytest.mark.remat3
def test_policy_not_applied_is_an_error_row():
  class SpareDecoder(Decoder):  # a block that is never called: the policy cannot apply
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.spare = FeedForward(8, 8, rngs=nnx.Rngs(1))

  def spare():
    return jaxckpt.apply_remat(SpareDecoder(rngs=nnx.Rngs(0)), "none", blocks={"spare": lambda p, m: p == ("spare",)})

  def hand():  # remat by hand, plus an applied block: "none" cannot turn the hand-written remat off
    return jaxckpt.apply_remat(HandDecoder(CP.nothing_saveable, rngs=nnx.Rngs(0)), "none",
                               blocks={"norm": lambda p, m: p == ("final_norm",)})

  for make, policy, words in [(spare, "nothing_saveable", "was not applied"), (hand, "none", "asks for no remat")]:
    report = build_report(ModelTarget(make_model=make, batch=TOKENS, loss_fn=decoder_loss), [policy],
                          progress=False, residuals=False)
    (row,) = report.rows
    assert row["status"] == "error" and words in row["error"] and "\n" not in row["error"]
    assert (row["remat_regions"] == 0) == (policy != "none")


def test_plain_loss_is_converted_once():
  target = decoder_target()
  assert target.loss_fn.plain is decoder_loss
  import dataclasses
  assert dataclasses.replace(target, name="x").loss_fn is target.loss_fn


@pytest.mark.slow
def test_report_cli_on_a_target_and_list_blocks(capsys):
  assert report_main(["--target", "tests.own_models:decoder_target", "--list-blocks"]) == 0
  out = capsys.readouterr().out
  assert "layer" in out and "attn.q_einsum" in out and "mlp.up_proj" in out
  assert report_main(["--target", "tests.own_models:decoder_target", "--policies", "none", "full", "--no-progress",
                      "--no-residuals"]) == 0
  out = capsys.readouterr().out
  assert "nothing_saveable" in out


# ------------------------------------------------------------------------------------------------------------ Linen

import flax.linen as nn  # noqa: E402

from jaxckpt.step import LossTarget  # noqa: E402
from jaxckpt.step import compile_policy  # noqa: E402
from tests.own_models import LinenEncoderDecoderLayer, LinenTransformerLM, linen_lm_target, linen_loss  # noqa: E402

LINEN_HAND = {"none": None, "dots_saveable": CP.dots_saveable, "nothing_saveable": CP.nothing_saveable}


class HandLinenLM(LinenTransformerLM):
  """The same LM with remat written by hand: each layer class swapped for nn.remat(cls, policy=...)."""

  policy: object = None

  @nn.compact
  def __call__(self, tokens, *, deterministic: bool = True):
    embed = nn.Embed(self.vocab, self.dim, name="embed")
    x = embed(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, tokens.shape[1], self.dim))
    x = nn.Dropout(self.dropout_rate)(x + pos, deterministic=deterministic)
    layer = LinenEncoderDecoderLayer if self.policy is None else nn.remat(
        LinenEncoderDecoderLayer, policy=self.policy, static_argnums=(2,))  # self counts: deterministic is 2
    for i in range(self.layers):
      x = layer(self.heads, self.hidden, self.dropout_rate, name=f"decoder_block_{i}")(x, deterministic)
    x = nn.LayerNorm(name="final_norm")(x)
    return nn.Dense(self.vocab, name="logits_dense")(x)


def linen_hand_temp(policy: str, target: LossTarget) -> int:
  lm = HandLinenLM(policy=LINEN_HAND[policy])

  def loss(params, wrapped, *, policy):
    key = jax.random.key(wrapped["dropout_seed"])
    apply_fn = lambda p, *a, **k: lm.apply({"params": p}, *a, rngs={"dropout": key}, **k)  # noqa: E731
    return linen_loss(apply_fn, params, wrapped["batch"])

  hand = LossTarget(loss, params=target.params, batch=target.batch, block_types={"default": set()})
  return compile_policy(hand, jaxckpt.parse_policy("none")).memory["temp_bytes"]


@pytest.mark.slow
def test_report_on_own_linen_lm_orders_and_equals_hand_written():
  target = linen_lm_target()
  assert "SelfAttention_0.query" in target.block_types["layer"]
  report = build_report(target, [*LINEN_HAND, "save_only_these_names:LinenMlpBlock_0.wi"], progress=False)
  rows = {r["policy"]: r for r in report.rows}
  assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
  temp = {p: rows[p]["temp_bytes"] for p in rows}
  assert temp["nothing_saveable"] < temp["dots_saveable"] < temp["none"]
  assert temp["nothing_saveable"] < temp["save_only_these_names:LinenMlpBlock_0.wi"] < temp["none"]
  assert rows["none"]["remat_regions"] == 0 and all(rows[p]["remat_regions"] == 2 for p in rows if p != "none")
  for policy in LINEN_HAND:
    assert temp[policy] == linen_hand_temp(policy, target), policy


# ---------------------------------------------------------------------------------------------------- budget plans

from jaxckpt.planner import plan_policy  # noqa: E402
from jaxckpt.planner._export import export_code  # noqa: E402
from jaxckpt import LayeredPolicy  # noqa: E402
from tests.own_models import ScannedDecoder  # noqa: E402


@pytest.mark.slow
def test_budget_plan_per_layer_for_a_list_of_layers():
  target = decoder_target(batch=32)  # activations dominate: 60% of none's temp is reachable
  plan = plan_policy(target, "budget:60%")
  assert plan.num_layers == 2
  assert plan.compiled.memory["temp_bytes"] <= plan.limit_bytes < plan.none.temp_bytes
  assert plan.compiled.flops < min(p.flops for p in plan.history if str(p.policy) == "nothing_saveable")
  if isinstance(plan.policy, LayeredPolicy):  # per-layer: each instance got its range's spec
    model = target.make_model()
    jaxckpt.set_policy(model, plan.policy)
    assert [layer._jaxckpt_policy for layer in model.layers] == plan.policy.layer_specs()
  code = export_code(plan, ("layer",))
  assert "PLAN = [" in code and "jax.checkpoint" in code
  compile(code, "export", "exec")


@pytest.mark.slow
def test_budget_plan_per_block_type_for_a_scanned_stack():
  def make():
    return jaxckpt.apply_remat(ScannedDecoder(rngs=nnx.Rngs(0)), "none", blocks={"attn": Attention, "mlp": FeedForward})

  target = ModelTarget(make_model=make, batch={"tokens": jax.ShapeDtypeStruct((32, SEQ + 1), jnp.int32)},
                       loss_fn=decoder_loss)
  plan = plan_policy(target, "budget:80%")
  assert plan.num_layers == 1 and not isinstance(plan.policy, LayeredPolicy)
  assert plan.compiled.memory["temp_bytes"] <= plan.limit_bytes < plan.none.temp_bytes


# --- residuals named by your own lines ---

def _residuals(target, policy: str) -> dict:
  from jaxckpt.report._residuals import analyse_residuals
  from jaxckpt.step import default_optimizer, policy_step

  return analyse_residuals(policy_step(target, jaxckpt.parse_model_policy(policy), default_optimizer()))


@pytest.mark.parametrize("which", ["own-dit", "llama-tiny"])
def test_a_residual_row_is_the_line_of_the_models_own_code_and_its_bytes_are_its_own(which):
  """Unnamed residuals are grouped by primitive and the innermost line of the model's own code (your file, or a
  shipped model's), never Flax's ``linear.py:431`` or jaxckpt's ``_structure.py``; each group's bytes are the sum of
  its own residuals, and the groups add up to the row."""
  import os
  import re
  from tests import own_models
  from jaxckpt.errors import MODEL_CODE
  from jaxckpt.step import shipped_target

  if which == "own-dit":
    target, home = own_models.dit_target(), (os.path.abspath(own_models.__file__),)
  else:
    target, home = shipped_target("llm", "llama-tiny", num_layers=2), MODEL_CODE
  res = _residuals(target, "dots_saveable")
  saved = [i for i in res["items"] if i["kind"] != "argument"]
  unnamed = [g for g in res["groups"] if g["by"] == "primitive"]
  assert unnamed and all(g["site"] and g["site"].startswith(home) for g in unnamed), [g["site"] for g in unnamed]
  line = lambda site: re.sub(r"^(.*?:\d+):\d+", r"\1", site or "")  # noqa: E731 - a row is a line
  for g in unnamed:
    assert g["bytes"] == sum(i["bytes"] for i in saved if i["name"] is None and i["primitive"] == g["key"]
                             and line(i["site"] or i["source"]) == g["site"])
  assert sum(g["bytes"] for g in res["groups"] if g["key"] != "argument") == res["bytes"]
  if which == "own-dit":  # the matmul inside flax's nnx.Linear is the model's qkv line
    qkv = next(n for n, text in enumerate(open(home[0]), 1) if "qkv = self.qkv(x)" in text)
    assert any(g["site"].startswith(f"{home[0]}:{qkv} ") and g["key"] == "dot_general" for g in unnamed)
    assert not any("linear.py" in (i["site"] or "") for i in saved)


def test_the_table_labels_a_residual_by_its_checkpoint_name_or_your_line():
  from jaxckpt.report._formats import residual_label

  group = {"key": "add", "by": "primitive", "site": "/home/me/model.py:124:8 (Block.__call__)", "count": 2,
           "bytes": 64}
  assert residual_label(group, {}, short=True, brief=True) == "add at model.py:124"
  assert residual_label(group, {}) == "add at model.py:124 (Block.__call__)"
  assert residual_label({"key": "qkv", "by": "name", "count": 1, "bytes": 8}, {}, brief=True) == "qkv"



# --- the smaller frictions of your own model in the report ---

@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_a_scanned_model_reads_as_scanned_before_any_remat_row_is_traced(scan):
  """``nnx.vmap``-stacked blocks say so themselves: the header of a ``none``-only report, of ``--no-residuals``
  or of error rows (nothing traced with remat regions) is "scan layers" too."""
  from tests import own_models
  from jaxckpt.step._build import target_structure

  assert target_structure(own_models.dit_target(scan=scan)) == ("scan" if scan else "unrolled")
  assert target_structure(own_models.llama_target(scan=scan)) == ("scan" if scan else "unrolled")


def test_a_checkpoint_name_typo_exits_2_in_one_line_like_a_policy_typo(capsys):
  assert report_main(["--target", "tests.own_models:decoder_target", "--policies", "none",
                      "save_only_these_names:mlp.up_projj"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown checkpoint name 'mlp.up_projj'" in err and "did you mean 'mlp.up_proj'" in err


def test_the_report_accumulates_your_own_model_as_the_fit_chose(tmp_path, capsys):
  """``--grad-accum-steps`` beside ``--target``: the step the fit's winner runs, its micro-batches in the title."""
  import json

  path = tmp_path / "r.json"
  assert report_main(["--target", "tests.own_models:decoder_target", "--grad-accum-steps", "2", "--policies", "none",
                      "--no-residuals", "--json", str(path)]) == 0
  data = json.loads(path.read_text())
  assert (data["grad_accum_steps"], data["batch_size"], data["rows"][0]["status"]) == (2, BATCH, "ok")
  assert f"batch {BATCH}, as 2 micro-batches of {BATCH // 2}" in " ".join(capsys.readouterr().out.split())
  assert report_main(["--target", "tests.own_models:decoder_target", "--grad-accum-steps", "3"]) == 2
  assert "--grad-accum-steps 3 must be ≥ 1 and divide the target's batch size 4" in capsys.readouterr().err


def test_a_gpu_report_of_unrolled_layers_says_remat_needs_scan():
  from jaxckpt.report._build import GPU_UNROLLED_NOTE, gpu_unrolled_note

  rows = [{"policy": "none"}, {"policy": "nothing_saveable"}]
  assert gpu_unrolled_note("unrolled", "gpu", rows) == [GPU_UNROLLED_NOTE]
  assert "docs/gpu.md" in GPU_UNROLLED_NOTE and "scan" in GPU_UNROLLED_NOTE
  assert gpu_unrolled_note("scan", "gpu", rows) == gpu_unrolled_note("unrolled", "tpu", rows) == []
  assert gpu_unrolled_note("unrolled", "gpu", rows[:1]) == []
