"""Tensor plans: a ``tensor`` mesh axis for your own NNX model without logical axis names.

The model (:mod:`own_llama`) is written as public Flax code writes a Llama: ``nnx.Embed``, ``nnx.Linear``
projections, einsum attention, ``nnx.RMSNorm``; no ``nnx.with_partitioning`` anywhere. ``tests/own_models.py`` adds a
Llama whose layers ``nnx.vmap`` stacks (kernels ``[L, in, out]``, applied with ``nnx.scan``) and a DiT (adaLN-Zero
blocks, in a loop and under ``nnx.scan``). The multi-device checks run
``tests/sharding/tensor_plan_helper.py`` once, in a subprocess with 8 fake CPU devices, and assert on its JSON: the
sharded steps' gradients equal one device's (``tests/numerics.py``), each parameter's bytes per device are what the
plan says, the compiled steps hold Megatron's all-reduces over the tensor groups, and the model without a plan is
refused under ``tensor=4``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from tests import own_models
from tests.extras import needs_cuda_plugin, needs_libtpu
from tests.sharding import own_llama
from jaxckpt import nnx_model_target, sharding
from jaxckpt.cli import report as report_main
from jaxckpt.errors import MeshSpecError, TensorPlanError
from jaxckpt.fit._meshes import mesh_shapes, state_bytes
from jaxckpt.sharding import TensorPlan, parse_tensor_plan
from jaxckpt.step import load_target, shipped_target
from jaxckpt.training import abstract_train_state

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
P = jax.sharding.PartitionSpec
ATTN = ("q_proj", "k_proj", "v_proj")
COLWISE = {f"attn/{n}" for n in ATTN} | {"mlp/gate_proj", "mlp/up_proj"}
ROWWISE = {"attn/o_proj", "mlp/down_proj"}


# --- the grammar (no model) ---

def test_the_text_form_round_trips_and_keeps_its_order():
  plan = parse_tensor_plan(" layers/*/mlp/up_proj = colwise ,layers/**/down_proj=rowwise")
  assert plan.rules == (("layers/*/mlp/up_proj", "colwise"), ("layers/**/down_proj", "rowwise"))
  assert parse_tensor_plan(str(plan)) == plan == parse_tensor_plan(dict(plan.rules))
  assert parse_tensor_plan("auto") == TensorPlan(auto=True) and str(TensorPlan(auto=True)) == "auto"
  assert parse_tensor_plan(None) is None


@pytest.mark.parametrize("spec, words", [
    ("layers/*/attn/q_proj=colwize", ["unknown tensor_plan style 'colwize'", "colwise, rowwise",
                                      "did you mean 'colwise'?"]),
    ("layers/*/attn/q_proj", ["bad tensor_plan entry 'layers/*/attn/q_proj'", "pattern=style"]),
    ("a=colwise,,b=rowwise", ["bad tensor_plan entry ''"]),
    ("", ["tensor_plan is empty"]),
    ({"a b": "colwise"}, ["bad tensor_plan pattern 'a b'"]),
    (3, ["tensor_plan=3 must be text"]),
])
def test_a_bad_plan_is_one_line_naming_the_value(spec, words):
  with pytest.raises(TensorPlanError) as raised:
    parse_tensor_plan(spec)
  message = str(raised.value)
  assert "\n" not in message and all(w in message for w in words), message


# --- the plan on the model (abstract, one device) ---

def _specs(target, mesh_shape):
  _, state = abstract_train_state(target.make_model, optax.adamw(1e-3))
  specs = sharding.state_partition_specs(state, mesh_shape)
  return {"/".join(str(k.key) for k in path[:-1]): spec for path, spec in jax.tree_util.tree_flatten_with_path(
      specs.params, is_leaf=lambda x: isinstance(x, P))[0]}


def test_the_plan_writes_the_rule_tables_names_and_the_rest_keeps_the_fsdp_rule():
  specs = _specs(own_llama.target(), {"fsdp": 2, "tensor": 4})
  for i in range(own_llama.LAYERS):
    for layer in COLWISE:  # kernel [in, out]: out over tensor, in over fsdp; the bias [out] with its output
      assert specs[f"layers/{i}/{layer}/kernel"] == P("fsdp", "tensor"), layer
    for layer in ROWWISE:
      assert specs[f"layers/{i}/{layer}/kernel"] == P("tensor", "fsdp"), layer
    for name in ATTN:
      assert specs[f"layers/{i}/attn/{name}/bias"] == P("tensor")
    assert specs[f"layers/{i}/input_norm/scale"] == P("fsdp")  # not planned: the FSDP rule, as before
  assert specs["embed/embedding"] == P("tensor", "fsdp")  # rowwise [V, D]: the vocabulary over tensor
  assert specs["lm_head/kernel"] == P("fsdp", "tensor")  # colwise [D, V]: the vocabulary over tensor
  assert specs["norm/scale"] == P("fsdp")
  unplanned = _specs(own_llama.target(tensor_plan=None), {"fsdp": 2, "tensor": 4})
  assert unplanned["layers/0/attn/q_proj/kernel"] == P(None, "fsdp") and "tensor" not in str(unplanned)


def test_a_pattern_that_matches_nothing_names_it_and_lists_the_layers():
  with pytest.raises(TensorPlanError) as raised:
    own_llama.target(tensor_plan={"layers/*/attn/q_proj": "colwise", "layers/*/atn/o_proj": "rowwise"})
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith("tensor_plan pattern 'layers/*/atn/o_proj' matches no layer or parameter of Llama; its "
                            "layers: embed, layers/*/attn/k_proj, layers/*/attn/o_proj, ")
  assert message.endswith("(12 in all); did you mean 'layers/*/attn/o_proj'?")


def test_a_layer_given_two_styles_and_a_kernel_no_style_splits_are_refused():
  with pytest.raises(TensorPlanError, match=r"gives layers/0/mlp/up_proj/kernel two styles: "
                                            r"'layers/\*/mlp/up_proj'=colwise and 'layers/0/mlp/\*'=rowwise"):
    own_llama.target(tensor_plan="layers/*/mlp/up_proj=colwise,layers/0/mlp/*=rowwise")
  from tests import own_models  # tests/own_models.py: a decoder with nnx.Einsum projections (3-D kernels)

  with pytest.raises(TensorPlanError, match=r"matches layers/0/attn/q_einsum/kernel of shape \(32, 4, 8\); a style "
                                            r"splits 2-D kernels"):
    TensorPlan({"layers/*/attn/q_einsum": "colwise"}).apply(nnx.eval_shape(lambda: own_models.Decoder(
        rngs=nnx.Rngs(0))))


def test_a_stacked_layer_axis_stays_whole():
  """A scanned stack (jaxckpt's GPT with ``scan``: kernels ``[L, in, out]``) gets ``layers`` in front of the plan's
  names: the layer axis is never split (checked by hand: its gradients under ``fsdp=2,tensor=2`` with ``full`` and
  under ``tensor=4`` equal one device's)."""
  target = dataclasses.replace(shipped_target("gpt", "tiny", scan=True), tensor_plan={
      "layers/layers/attn/qkv": "colwise", "layers/layers/attn/out": "rowwise",
      "layers/layers/mlp/fc1": "colwise", "layers/layers/mlp/fc2": "rowwise"})
  model = nnx.eval_shape(target.make_model)
  planned = {path: names for path, _, _, names in sharding.planned_params(model)}
  assert planned["layers/layers/mlp/fc1/kernel"] == ("layers", "embed", "mlp")
  assert planned["layers/layers/mlp/fc2/bias"] == ("layers", "embed")
  _, state = abstract_train_state(target.make_model, optax.adamw(1e-3))
  specs = sharding.state_partition_specs(state, {"fsdp": 2, "tensor": 4},
                                         stacked=sharding.stacked_layer_paths(model)).params["layers"]["layers"]
  assert specs["attn"]["qkv"]["kernel"].get_value() == P(None, "fsdp", "tensor")
  assert specs["mlp"]["fc2"]["kernel"].get_value() == P(None, "tensor", "fsdp")


def test_a_tensor_size_that_does_not_divide_a_planned_dimension_is_refused_and_the_fit_skips_it():
  model = nnx.eval_shape(own_llama.target().make_model)
  assert dict(sharding.tensor_split_sizes(model))["layers/0/mlp/down_proj/kernel"] == own_llama.HIDDEN
  with pytest.raises(MeshSpecError) as raised:
    sharding.check_tensor_splits(model, {"tensor": 3})
  assert str(raised.value) == ("mesh axis tensor=3 does not divide dimension 64 of embed/embedding, which tensor_plan "
                               "splits over it (22 parameter(s) so): use a tensor size that divides every planned "
                               "dimension (2), or leave embed out of the plan")
  sharding.check_tensor_splits(model, {"fsdp": 2, "tensor": 4})  # 32 and 64 divide
  # The fit's mesh search: tensor sizes dividing every planned dimension (gcd 32), none without a plan.
  assert state_bytes(own_llama.target())[2:] == (32, True)
  assert state_bytes(own_llama.target(tensor_plan=None))[2:] == (None, False)
  assert {s.get("tensor", 1) for s in mesh_shapes(96, tensor_divides=32, max_tensor=64)} == {1, 2, 4, 8, 16, 32}


# --- the automatic plan ---

def test_auto_finds_megatron_pairs_by_data_flow_not_by_names_or_attribute_order(capsys):
  """``down_proj`` is defined before ``up_proj`` (as Hugging Face's Flax Llama does): the call order and the data
  flow decide, and the plan covers each block's projections only."""
  target = own_llama.target(tensor_plan="auto")
  expected = TensorPlan({**{f"layers/*/attn/{n}": "colwise" for n in ATTN}, "layers/*/attn/o_proj": "rowwise",
                         "layers/*/mlp/gate_proj": "colwise", "layers/*/mlp/up_proj": "colwise",
                         "layers/*/mlp/down_proj": "rowwise"})
  assert target.tensor_plan == expected
  assert capsys.readouterr().err == f"own-llama: tensor_plan='auto' chose {expected}\n"


class _LoneBlock(nnx.Module):
  def __init__(self, d, *, rngs):
    self.proj = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):  # x: [B, T, D]
    return x + jax.nn.gelu(self.proj(x))


class _LoneModel(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.layers = nnx.List([_LoneBlock(8, rngs=rngs) for _ in range(2)])

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embed.attend(x)


def test_auto_refuses_a_block_without_pairs_in_one_line():
  with pytest.raises(TensorPlanError) as raised:
    nnx_model_target(lambda: _LoneModel(rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 5), jnp.int32),
                     loss="next_token", blocks={"layer": _LoneBlock}, tensor_plan="auto")
  assert str(raised.value) == (
      "tensor_plan='auto' finds no Megatron pair in block layers/0: no later linear layer of the block reads "
      "layers/0/proj (a colwise layer needs a rowwise one after it, or, as adaLN's modulation, its output scales or "
      "shifts what a later one reads); write a path plan for this model (tensor_plan={pattern: style})")


def test_a_target_function_gets_its_plan_as_text_as_the_cli_passes_it():
  """``--target tests.sharding.own_llama:target --target-arg tensor_plan=...`` calls ``target(tensor_plan="...")``."""
  target = load_target("tests.sharding.own_llama:target", {"tensor_plan": "layers/*/mlp/up_proj=colwise,"
                                                           "layers/*/mlp/down_proj=rowwise"})
  assert target.tensor_plan == TensorPlan({"layers/*/mlp/up_proj": "colwise", "layers/*/mlp/down_proj": "rowwise"})
  model = nnx.eval_shape(target.make_model)
  assert [p for p, *_ in sharding.planned_params(model)] == [
      f"layers/{i}/mlp/{n}/kernel" for i in range(own_llama.LAYERS) for n in ("down_proj", "up_proj")]


# --- stacked layers (nnx.vmap, nnx.scan) and a DiT: tests/own_models.py ---

SCANNED_AUTO = TensorPlan(own_models.LLAMA_PLAN)


def test_a_path_plan_names_a_stacked_kernel_and_splits_its_in_or_out_never_its_layer_axis():
  """The Llama's layers stacked by ``nnx.vmap``: kernels ``[L, in, out]`` found by the ``nnx.Linear``'s own
  ``in_features``/``out_features``, ``layers`` in front of the style's names."""
  target = own_models.llama_target(tensor_plan=own_models.LLAMA_PLAN)
  planned = {path: (style, shape, names) for path, style, shape, names in
             sharding.planned_params(nnx.eval_shape(target.make_model))}
  assert planned["layers/self_attn/k_proj/kernel"] == ("colwise", (2, 32, 16), ("layers", "embed", "mlp"))
  assert planned["layers/mlp/down_proj/kernel"] == ("rowwise", (2, 64, 32), ("layers", "mlp", "embed"))
  specs = _specs(target, {"fsdp": 4, "tensor": 4})
  assert specs["layers/self_attn/q_proj/kernel"] == P(None, "fsdp", "tensor")
  assert specs["layers/self_attn/o_proj/kernel"] == P(None, "tensor", "fsdp")
  assert specs["layers/input_layernorm/scale"] == P(None, "fsdp")  # not planned: the FSDP rule


def test_auto_follows_a_scanned_stack_through_rope_and_grouped_query_attention(capsys):
  assert own_models.llama_target(tensor_plan="auto").tensor_plan == SCANNED_AUTO
  assert capsys.readouterr().err == f"own-llama-scan: tensor_plan='auto' chose {SCANNED_AUTO}\n"
  unrolled = own_models.llama_target(tensor_plan="auto", scan=False).tensor_plan
  assert unrolled == TensorPlan({p.replace("layers/", "layers/*/"): s for p, s in own_models.LLAMA_PLAN.items()})


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_auto_splits_a_dit_block_and_its_adaln_modulation_colwise(scan, capsys):
  """adaLN's ``[D, 6D]`` modulation scales and shifts what ``qkv`` and ``fc1`` read: colwise on its own; timm's fused
  ``qkv`` ``[D, 3D]`` pairs with ``proj`` ``[D, D]``; the timestep embedder and the final layer are outside blocks."""
  block = "blocks" if scan else "blocks/*"
  assert own_models.dit_target(scan=scan, tensor_plan="auto").tensor_plan == TensorPlan({
      f"{block}/adaLN_modulation/layers/*": "colwise", f"{block}/attn/qkv": "colwise",
      f"{block}/attn/proj": "rowwise", f"{block}/mlp/fc1": "colwise", f"{block}/mlp/fc2": "rowwise"})


class _HalfBlock(nnx.Module):
  """Two projections of the block input, and a third that reads one of them: no pair."""

  def __init__(self, d, *, rngs):
    self.a = nnx.Linear(d, d, rngs=rngs)
    self.b = nnx.Linear(d, d, rngs=rngs)
    self.c = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):  # x: [B, T, D]
    a, b = self.a(x), self.b(x)
    return x + self.c(b) + a


def test_auto_names_the_link_it_could_not_follow():
  with pytest.raises(TensorPlanError) as raised:
    nnx_model_target(lambda: _HalfModel(rngs=nnx.Rngs(0)),
                     jax.ShapeDtypeStruct((2, 5), jnp.int32), loss="next_token", blocks={"layer": _HalfBlock},
                     tensor_plan="auto")
  assert str(raised.value) == (
      "tensor_plan='auto' finds no Megatron pair in block layers/0: layers/0/c reads layers/0/b but not layers/0/a; "
      "write a path plan for this model (tensor_plan={pattern: style})")


class _HalfModel(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.layers = nnx.List([_HalfBlock(8, rngs=rngs) for _ in range(2)])

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embed.attend(x)


@pytest.mark.parametrize("topology, target, plan", [
    pytest.param("v5e:4x4", "dit_target", "auto", marks=needs_libtpu),
    pytest.param("h100:2x8", "llama_target", str(SCANNED_AUTO), marks=needs_cuda_plugin)],
    ids=["v5e-dit", "h100-llama"])
def test_the_plans_compile_on_fsdp4_tensor4_of_16_chips(topology, target, plan, tmp_path):
  """Rows ok on a TPU and a GPU topology: the DiT's automatic plan, the scanned Llama's path plan (which is its
  automatic plan, above)."""
  argv = ["--target", f"tests.own_models:{target}", "--target-arg", f"tensor_plan={plan}", "--topology", topology,
          "--mesh", "fsdp=4,tensor=4", "--policies", "none", "--no-residuals", "--json", str(tmp_path / "r.json")]
  assert report_main(argv) == 0
  data = json.loads((tmp_path / "r.json").read_text())
  assert data["mesh"] == {"fsdp": 4, "tensor": 4} and [r["status"] for r in data["rows"]] == ["ok"]


# --- eight fake devices ---

@pytest.fixture(scope="module")
def sharded():
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  done = subprocess.run([sys.executable, os.path.join(HERE, "tensor_plan_helper.py")], env=env, capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _expected_bytes(layer: str, full: int) -> int:
  """What one device holds of a parameter under ``tensor=4``: the plan's layers (their kernels and biases, the
  embedding and the head) 1/4; the rest whole."""
  relative = "/".join(layer.split("/")[2:]) if layer.startswith("layers/") else layer
  return full // 4 if relative in COLWISE | ROWWISE or layer in ("embed", "lm_head") else full


def test_sharded_gradients_equal_one_device_and_each_device_holds_what_the_plan_says(sharded):
  assert sharded["device_count"] == 8
  assert [(r["mesh"], r["policy"], r["plan"]) for r in sharded["results"]] == [("tensor=4", "none", "path")]
  for run in sharded["results"]:
    assert run["mismatches"] == [], (run["mesh"], run["plan"], run["mismatches"])
    assert len(run["per_device"]) == 27
    for path, got in run["per_device"].items():
      layer = path.rpartition("/")[0]
      assert got["per_device"] == _expected_bytes(layer, got["bytes"]), (run["mesh"], path, got)
  tensor4 = sharded["results"][0]["per_device"]
  assert tensor4["layers/0/mlp/up_proj/kernel"] == {"bytes": 32 * 64 * 4, "per_device": 32 * 64 * 4 // 4}
  assert tensor4["layers/0/input_norm/scale"] == {"bytes": 32 * 4, "per_device": 32 * 4}  # replicated


def test_the_compiled_steps_hold_megatrons_all_reduces_over_the_tensor_groups(sharded):
  """Two all-reduces per layer forward (after o_proj and down_proj) and two backward (the colwise layers' input
  gradients), over groups of tensor=4 devices; FSDP's all-gathers over groups of fsdp=2 (the stacked models')."""
  for run in sharded["results"] + sharded["stacked"]:
    kinds = {}
    for c in run["collectives"]:
      kinds[(c["kind"], c["group_size"])] = kinds.get((c["kind"], c["group_size"]), 0) + c["count"]
    assert kinds.get(("all-reduce", 4), 0) >= 4 * own_llama.LAYERS, (run["mesh"], kinds)
    assert (kinds.get(("all-gather", 2), 0) > 0) == run["mesh"].startswith("fsdp=2"), (run["mesh"], kinds)


def test_an_unannotated_model_without_a_plan_is_refused_pointing_at_the_plan(sharded):
  assert sharded["refusal"].startswith("mesh axis tensor=4 splits parameters by their logical axis names, but no "
                                       "parameter of own-llama carries one: give the target a tensor plan")
  assert "tensor_plan='auto'" in sharded["refusal"] and "\n" not in sharded["refusal"]
  assert sharded["auto_plan"] == str(own_llama.target(tensor_plan="auto").tensor_plan)


def test_stacked_and_dit_plans_keep_gradients_and_divide_each_planned_parameter(sharded):
  """Under ``fsdp=2,tensor=4``: the scanned Llama's path plan and the DiT's automatic plan (adaLN's modulation
  colwise) give the one-device gradients, and each device holds 1/8 of a planned kernel (``tensor`` × ``fsdp``;
  a stacked kernel's layer axis whole), 1/4 of a colwise bias, and 1/2 of everything else (the FSDP rule)."""
  runs = {r["model"]: r for r in sharded["stacked"]}
  assert list(runs) == ["llama-scan", "dit"]
  for name, run in runs.items():
    assert run["mismatches"] == [], (name, run["mismatches"])
    for path, got in run["per_device"].items():
      kind = path.rsplit("/", 1)[-1]
      divisor = {None: 2, "colwise": 4 if kind == "bias" else 8, "rowwise": 2 if kind == "bias" else 8}[got["style"]]
      assert got["per_device"] * divisor == got["bytes"], (name, path, got)
  llama = runs["llama-scan"]["per_device"]
  assert llama["layers/self_attn/q_proj/kernel"] == {"bytes": 2 * 32 * 32 * 4, "per_device": 2 * 32 * 32 * 4 // 8,
                                                     "style": "colwise"}
  assert sum(v["style"] is not None for v in llama.values()) == 7
  dit = runs["dit"]["per_device"]
  assert dit["blocks/1/adaLN_modulation/layers/1/kernel"]["style"] == "colwise"
  assert dit["t_embedder/mlp/layers/0/kernel"]["style"] is None and dit["final_layer/linear/kernel"]["style"] is None
