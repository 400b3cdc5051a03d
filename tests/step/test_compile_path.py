"""The step core (jaxckpt.step): one compile path for the report, the planner, --measure and the experiments."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.planner import resolve_policy
from jaxckpt import Budget, LayeredPolicy, parse_model_policy, parse_policy
from jaxckpt.report import build_report
from jaxckpt.step import (
    LossTarget,
    ModelTarget,
    StepBuilder,
    compile_policy,
    default_optimizer,
    lower_policy,
    policy_step,
    shipped_target,
    step_builder,
    step_compiler_options,
)

POLICIES = ("none", "nothing_saveable", "dots_saveable", "save_only_these_names:mlp_hidden",
            "save_only_these_names:mlp_out")


@pytest.fixture(scope="module")
def mlp_target():
  return shipped_target("mlp", "tiny")  # scanned layers, batch 64


@pytest.fixture(scope="module")
def compiled_one_by_one(mlp_target):
  """Each policy compiled on its own (a fresh builder, no deduplication): the reference the report must equal."""
  return {p: compile_policy(mlp_target, parse_policy(p)) for p in POLICIES}


def test_compile_policy_orders_temp_bytes_as_theory_says(compiled_one_by_one):
  temp = {p: c.memory["temp_bytes"] for p, c in compiled_one_by_one.items()}
  assert temp["nothing_saveable"] < temp["dots_saveable"] < temp["none"]
  flops = {p: c.flops for p, c in compiled_one_by_one.items()}
  assert flops["none"] < flops["dots_saveable"] < flops["nothing_saveable"]  # recompute costs FLOPs
  for c in compiled_one_by_one.values():
    assert set(c.stages) == {"build", "trace", "lower", "compile"} and c.seconds > 0


def test_report_rows_equal_policies_compiled_one_by_one(mlp_target, compiled_one_by_one):
  """The shared builder and the deduplication of identical programs change no number of any row."""
  report = build_report(mlp_target, list(POLICIES), progress=False)
  for policy, compiled in compiled_one_by_one.items():
    row = report.row(str(parse_policy(policy)))
    assert row["status"] == "ok"
    for key, value in compiled.memory.items():
      assert row[key] == value, (policy, key)
    assert row["flops"] == compiled.flops
  # mlp_out feeds only the residual add, which needs nothing saved: the program equals nothing_saveable's.
  named = report.row("save_only_these_names:mlp_out")
  assert named["same_program_as"] == "nothing_saveable"
  assert compiled_one_by_one["save_only_these_names:mlp_out"].fingerprint == (
      compiled_one_by_one["nothing_saveable"].fingerprint)
  assert report.row("dots_saveable")["same_program_as"] is None


def test_remat_regions_per_row(mlp_target):
  report = build_report(mlp_target, ["none", "nothing_saveable"], residuals=False, progress=False)
  assert report.row("none")["remat_regions"] == 0
  assert report.row("nothing_saveable")["remat_regions"] == 1  # the scan body's one block, counted once
  unrolled = shipped_target("mlp", "tiny", batch_size=8, scan=False)
  report = build_report(unrolled, ["none", "nothing_saveable"], residuals=False, progress=False)
  assert report.row("none")["remat_regions"] == 0
  assert report.row("nothing_saveable")["remat_regions"] == 2  # two layers, one remat region each


def _foreign_mlp_target() -> ModelTarget:
  """A model with no jaxckpt blocks: ``none`` is true as it is, a remat policy is refused by set_policy."""

  class Plain(nnx.Module):
    def __init__(self, *, rngs):
      self.a = nnx.Linear(4, 16, rngs=rngs)
      self.b = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, *, dropout_key=None, deterministic=True):
      return self.b(jnp.tanh(self.a(x.reshape(x.shape[0], -1))))

  batch = {"x": jax.ShapeDtypeStruct((8, 2, 2, 1), jnp.float32), "y": jax.ShapeDtypeStruct((8,), jnp.int32)}
  return ModelTarget(make_model=lambda: Plain(rngs=nnx.Rngs(0)), batch=batch, name="plain")


def test_policy_not_applied_is_an_error_row():
  report = build_report(_foreign_mlp_target(), ["none", "nothing_saveable"], residuals=False, progress=False)
  assert report.row("none")["status"] == "ok" and report.row("none")["remat_regions"] == 0
  row = report.row("nothing_saveable")
  # refused before tracing: set_policy finds no block and names the model's classes (jaxckpt.apply_remat)
  assert row["status"] == "error" and row["remat_regions"] is None
  assert "no remat block" in row["error"] and "Linear, Plain" in row["error"] and "apply_remat" in row["error"]
  assert row["temp_bytes"] is None  # never the none row's figures under this label


def test_step_builder_equals_a_fresh_policy_step(mlp_target):
  builder = StepBuilder(mlp_target, default_optimizer())
  for policy in ("nothing_saveable", "none", "dots_saveable"):
    spec = parse_policy(policy)
    shared = lower_policy(mlp_target, spec, builder=builder)
    fresh = lower_policy(mlp_target, spec)
    assert shared.fingerprint == fresh.fingerprint, policy
  assert builder.step(parse_policy("full")).state is builder.step(parse_policy("none")).state  # built once


def test_layered_policy_compiles_through_the_core():
  target = shipped_target("mlp", "tiny", batch_size=8)
  layered = parse_model_policy("0:nothing_saveable;1:none")
  assert isinstance(layered, LayeredPolicy)
  temp = {p: compile_policy(target, parse_model_policy(p)).memory["temp_bytes"]
          for p in ("none", "nothing_saveable")}
  mixed = compile_policy(target, layered).memory["temp_bytes"]
  assert temp["nothing_saveable"] < mixed < temp["none"] + 2 ** 16  # one range recomputes: between the two


def test_loss_target_through_the_core():
  def loss(params, batch, *, policy):
    block = jaxckpt.checkpoint(lambda w, x: jnp.tanh(x @ w), policy, block_type="mlp")
    h = batch["x"]
    for w in params["w"]:
      h = block(w, h)
    return jnp.mean(h ** 2)

  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  target = LossTarget(loss, params={"w": [w] * 4}, batch={"x": jax.ShapeDtypeStruct((32, 64), jnp.float32)},
                      block_types={"mlp": set()})
  temp = {p: compile_policy(target, parse_policy(p)).memory["temp_bytes"] for p in ("none", "full")}
  assert temp["full"] < temp["none"]
  step = policy_step(target, parse_policy("full"), default_optimizer())
  assert jax.tree.structure(step.params) == jax.tree.structure({"w": [w] * 4})


def test_resolve_policy_is_the_one_place_budgets_become_plans(mlp_target):
  spec, plan = resolve_policy(mlp_target, "dots_saveable")
  assert spec == parse_policy("dots_saveable") and plan is None
  assert isinstance(parse_model_policy("budget:60%"), Budget)


def test_step_compiler_options():
  options = step_compiler_options({"xla_backend_optimization_level": 2}, stats_only=True)
  assert options["xla_backend_optimization_level"] == 2  # the caller wins
  if jax.default_backend() == "cpu":
    assert options["xla_disable_hlo_passes"] == jaxckpt.training.CPU_REMAT_FIX["xla_disable_hlo_passes"]
  assert "xla_backend_optimization_level" not in step_compiler_options(stats_only=False)


def test_step_builder_under_a_mesh_is_built_for_the_sharded_target(mlp_target):
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  builder = step_builder(mlp_target, mesh=mesh)
  assert builder.target is not mlp_target and builder.target.loss_fn is not mlp_target.loss_fn
  assert dataclasses.replace(builder.target, loss_fn=mlp_target.loss_fn) == mlp_target


def test_xla_dump_compiles_bypass_the_persistent_cache(mlp_target, tmp_path):
  # The suite runs with JAX's persistent compilation cache (tests/conftest.py); its key ignores dump options, so a
  # dump compile that hit the cache would write nothing. The first compile fills the cache; the dump one must not
  # be served from it.
  from jaxckpt.report import _xla_dump as xla_dump

  assert jax.config.jax_compilation_cache_dir, "tests/conftest.py sets a compilation cache for the run"
  lowered = lower_policy(mlp_target, parse_policy("full"))
  plain = lowered.compile()
  dumped = lowered.compile(xla_dump.dump_options(str(tmp_path)))
  assert dumped.memory == plain.memory
  files = xla_dump.dump_files(str(tmp_path))
  assert files["buffer_assignment"] is not None and files["hlo"] is not None, files  # a cache hit writes neither
