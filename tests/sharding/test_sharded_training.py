"""Sharded and multi-process training with remat: exact gradients on every mesh, in-sync replicas, FSDP memory.

The multi-device checks run ``tests/sharding/sharding_helper.py`` in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the flag must be set before JAX starts) and assert on its
JSON. The two-process run uses JAX's gloo CPU collectives on localhost.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt
from jaxckpt import sharding
from jaxckpt.errors import MeshSpecError
from jaxckpt.models import MODELS
from tests.numerics import assert_trees_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPER = os.path.join(ROOT, "tests", "sharding", "sharding_helper.py")


def run_helper(*args, devices=8, timeout=600):
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
         "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, HELPER, *args], env=env, capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


# --- the mesh grammar and the FSDP rule (one device, in process) ---

@pytest.mark.parametrize("spec, expected", [
    ("data=8", {"data": 8}), ("fsdp=8", {"fsdp": 8}), ("data=4,fsdp=2", {"data": 4, "fsdp": 2}),
    (" fsdp = 2 , data = 4 ", {"fsdp": 2, "data": 4}), ({"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 4}),
])
def test_parse_mesh(spec, expected):
  assert sharding.parse_mesh(spec, device_count=8) == expected
  assert list(sharding.parse_mesh(spec, device_count=8)) == list(expected)  # order kept


@pytest.mark.parametrize("spec, words", [
    ("dat=8", ["unknown mesh axis 'dat'", "valid axes: data, fsdp", "did you mean 'data'"]),
    ("model=8", ["unknown mesh axis 'model'", "data, fsdp"]),
    ("data=x", ["bad size 'x'", "integer ≥ 1"]),
    ("data=0", ["bad size '0'"]),
    ("data=-8", ["bad size '-8'"]),
    ("data=4,data=2", ["appears twice"]),
    ("data", ["bad mesh entry 'data'", "name=size"]),
    ("", ["bad mesh entry ''"]),
    ("data=4", ["covers 4 device(s) but there are 8", "xla_force_host_platform_device_count=4"]),
    ("data=4,fsdp=4", ["covers 16 device(s) but there are 8"]),
])
def test_bad_mesh_is_one_line_naming_the_value(spec, words):
  with pytest.raises(MeshSpecError) as info:
    sharding.parse_mesh(spec, device_count=8)
  message = str(info.value)
  assert "\n" not in message and isinstance(info.value, jaxckpt.errors.JaxckptError)
  for word in words:
    assert word in message, message


def test_fsdp_rule():
  p = sharding.fsdp_partition
  assert p((64, 256), 8) == jax_spec(None, "fsdp")  # largest divisible dimension
  assert p((256, 64), 8) == jax_spec("fsdp", None)
  assert p((128, 128), 8) == jax_spec(None, "fsdp")  # ties: the last
  assert p((12, 10), 8) == jax_spec()  # nothing divisible: replicated
  assert p((), 8) == jax_spec()
  assert p((64, 256), 1) == jax_spec()  # no fsdp axis
  # The scanned layer axis is never split, even when it is the largest divisible one.
  assert p((16, 8, 4), 8, layer_axis=0) == jax_spec(None, "fsdp", None)
  assert p((16, 4, 4), 8, layer_axis=0) == jax_spec()


def jax_spec(*axes):
  from jax.sharding import PartitionSpec
  return PartitionSpec(*axes)


def test_state_specs_follow_the_rule_for_params_and_adam_moments():
  import optax
  from flax import nnx

  from jaxckpt.models import MODELS, build_model

  make = lambda: build_model("vit", MODELS["vit"].presets["tiny"], image_shape=(8, 8, 1), num_classes=10)  # noqa: E731
  _, state = jaxckpt.training.abstract_train_state(make, optax.adamw(1e-3))
  model = nnx.eval_shape(make)
  # the Stack is found by what it declares (stacked_layers = "layers"), not by sharding importing its class
  assert sharding.stacked_layer_paths(model) == frozenset({("layers", "layers")})
  specs = sharding.state_partition_specs(state, {"fsdp": 8}, stacked=sharding.stacked_layer_paths(model))
  qkv = specs.params["layers"]["layers"]["attn"]["qkv"]["kernel"]
  qkv = qkv.get_value() if hasattr(qkv, "get_value") else qkv
  assert state.params["layers"]["layers"]["attn"]["qkv"]["kernel"].shape == (2, 32, 96)
  assert tuple(qkv) == (None, None, "fsdp")  # [L, D, 3D]: the 96 side, never L
  mu = specs.opt_state[0].mu["layers"]["layers"]["attn"]["qkv"]["kernel"]
  mu = mu.get_value() if hasattr(mu, "get_value") else mu
  assert tuple(mu) == (None, None, "fsdp")  # Adam's moments like their parameter
  assert tuple(specs.step) == () and tuple(specs.key) == ()  # counters and keys replicated


def test_initialize_distributed_rejects_bad_settings():
  for kwargs, word in [(dict(coordinator="localhost", num_processes=2, process_id=0), "HOST:PORT"),
                       (dict(coordinator="localhost:99999", num_processes=2, process_id=0), "HOST:PORT"),
                       (dict(coordinator="localhost:1234", num_processes=2, process_id=2), "valid ids are 0..1"),
                       (dict(coordinator="localhost:1234", num_processes=0, process_id=0), "≥ 1")]:
    with pytest.raises(MeshSpecError, match=word):
      sharding.initialize_distributed(**kwargs)


def test_report_cli_mesh_errors_exit_2(capsys):
  from jaxckpt.cli._report import main

  assert main(["--model", "mlp", "--mesh", "dta=1", "--policies", "none", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown mesh axis 'dta'" in err and "did you mean 'data'" in err
  assert main(["--model", "mlp", "--mesh", "data=1", "--measure", "--policies", "none", "--no-progress"]) == 2
  assert "does not take --mesh" in capsys.readouterr().err



# --- 8 fake devices, in a subprocess ---

TWO_PROCESS_RUN = dict(model="mlp", preset="tiny", epochs=2, batch_size=64, policy="full", aux_task="parity",
                       mesh="data=4,fsdp=2", ckpt_every=10, progress=False)
"""The classifier run of the two-process test (multi-task, remat'd, data and FSDP axes)."""


@pytest.fixture(scope="module")
def eight_devices():
  # One 8-device process (starting one costs seconds) for the checks below and the 1-process reference run of the
  # two-process test.
  return run_helper("all", json.dumps(TWO_PROCESS_RUN))


@pytest.mark.slow  # the 8-device subprocess of every mesh and policy (~100 s)
def test_every_mesh_and_policy_matches_single_device_no_remat(eight_devices):
  """The seed's DDP bug (remat + multi-task loss broke gradient sync): here loss, gradients and the loss curve of the
  multi-task model equal the single-device no-remat run on every mesh and policy, and replicas never diverge."""
  results = eight_devices["results"]
  assert eight_devices["device_count"] == 8
  assert {(r["mesh"], r["policy"]) for r in results} == {(m, p) for m in ("data=8", "fsdp=8", "data=4,fsdp=2")
                                                       for p in ("none", "nothing_saveable",
                                                                 "attn=dots_saveable,mlp=nothing_saveable")}
  for r in results:
    where = f"{r['mesh']} {r['policy']}"
    assert r["grad_leaves"] == r["param_leaves"] > 20, where
    assert r["grad_mismatches"] == [], where  # the first step's gradients, by tests/numerics.py's rule
    # the k-step loss curve: step k's loss has passed through k steps of the model's layers
    assert_trees_close(r["losses"], r["ref_losses"], depth=len(r["losses"]) * r["layers"], what=f"losses, {where}")
    assert r["replica_mismatches"] == [], where  # all replicas bit-identical after k AdamW steps
    if r["mesh"] == "data=8":
      assert r["min_replicas"] == 8 and r["fsdp_sharded_leaves"] == 0, where
    if r["mesh"] == "fsdp=8":
      assert r["fsdp_sharded_leaves"] >= r["param_leaves"] - 2, where  # all but the odd-sized (head bias, pos)
    if r["mesh"] == "data=4,fsdp=2":
      assert r["min_replicas"] == 4 and r["fsdp_sharded_leaves"] == r["param_leaves"], where


@pytest.mark.slow  # the 8-device subprocess of every mesh and policy (~100 s)
def test_fsdp_shards_parameters_and_optimizer_state(eight_devices):
  """Per-device argument bytes (parameters + AdamW state + batch) under fsdp=8 ≤ 1/4 of one unsharded device's."""
  result = eight_devices["bytes"]
  single, fsdp, data = result["None"], result["fsdp=8"], result["data=8"]
  assert single["mesh"] is None and fsdp["mesh"] == {"fsdp": 8} and data["mesh"] == {"data": 8}
  for policy in ("none", "nothing_saveable"):
    one, sharded, replicated = (r["rows"].get(policy, r["rows"]["none"]) for r in (single, fsdp, data))
    assert one["status"] == sharded["status"] == replicated["status"] == "ok"
    assert sharded["argument_bytes"] <= one["argument_bytes"] / 4, (sharded, one)
    assert replicated["argument_bytes"] > 0.9 * one["argument_bytes"]  # data parallel keeps a full copy
  # Remat still saves temp memory under a mesh (the CPU remat fix is applied to sharded compiles too).
  assert fsdp["rows"]["nothing_saveable"]["temp_bytes"] < fsdp["rows"]["none"]["temp_bytes"]
  assert data["rows"]["nothing_saveable"]["temp_bytes"] < data["rows"]["none"]["temp_bytes"]


# --- two processes × 4 CPU devices on localhost ---

@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_fsdp_gathers_one_layer_at_a_time_so_more_chips_hold_less():
  """FSDP per layer (docs/sharding.md): a 24-layer stack under full remat, one sequence per chip. Each block gathers
  its own layer inside its jax.checkpoint, so no chip holds the gathered stack (the old whole-model gather kept all
  of it from forward to backward: temp ≥ the stack's parameter bytes at any chip count), and the per-chip footprint
  falls from 4 to 16 chips."""
  r = run_helper("per_layer", devices=16)
  four, sixteen, stack = r["4"], r["16"], r["stack_param_bytes"]
  assert sixteen["temp_bytes"] < 0.6 * stack and four["temp_bytes"] < stack, r  # the rest: gradients, Adam's temps
  assert sixteen["footprint_bytes"] < four["footprint_bytes"], r
  assert sixteen["argument_bytes"] < 0.3 * four["argument_bytes"], r  # state split 16 ways, not 4


@pytest.mark.slow  # 10 compiles of llama-tiny on 4 fake devices (~40 s)
def test_tensor_parallel_llm_equals_one_device_and_splits_its_parameters():
  """Tensor parallelism (Megatron-style, by the LLM family's logical axis names): llama-tiny on 4 devices under
  tensor=4, fsdp=2,tensor=2 and data=2,tensor=2, each with none, full and minimal: the first step's loss and
  gradients equal one device without remat (tests/numerics.py), and each device holds the parameter bytes theory
  says. llama-tiny: 427,264 parameter bytes, of which 1,280 are RMSNorm scales (never split) and 2 × 16,384 the
  key/value projections (K = 2 heads: not split by tensor=4, whose size does not divide them)."""
  r = run_helper("tensor", devices=4)
  whole, norms, kv = r["param_bytes"], 1280, 2 * 16384
  matrices = whole - norms
  expected = {"tensor=4": (matrices - kv) / 4 + kv + norms, "fsdp=2,tensor=2": matrices / 4 + norms,
              "data=2,tensor=2": matrices / 2 + norms}
  assert whole == 427264 and len(r["results"]) == 9, r
  for row in r["results"]:
    assert row["mismatches"] == [], row
    assert row["param_bytes_per_device"] == expected[row["mesh"]], (row["mesh"], row["param_bytes_per_device"])


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_two_processes(config: dict, tmp_path) -> list[dict]:
  port = free_port()
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu"}
  procs = []
  for pid in range(2):
    request = {**config, "coordinator": f"localhost:{port}", "num_processes": 2, "process_id": pid}
    procs.append(subprocess.Popen([sys.executable, HELPER, "train", json.dumps(request)], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  results = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=300)
      assert proc.returncode == 0, err[-3000:]
      results.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return results


@pytest.mark.slow  # the 8-device subprocess of every mesh and policy (~100 s)
def test_two_processes_match_one_process_and_resume(tmp_path, eight_devices):
  """2 processes × 4 CPU devices (gloo) = the 1-process 8-device run's loss curve, also across a resume from the
  orbax checkpoint onto another mesh."""
  one = eight_devices["train"]
  assert one["mesh"] == {"data": 4, "fsdp": 2} and one["device_count"] == 8 and one["process_count"] == 1

  ckpt = str(tmp_path / "ckpt")
  first = run_two_processes({**TWO_PROCESS_RUN, "ckpt_dir": ckpt, "interrupt_at": "epoch 1/"}, tmp_path)
  assert all(r["interrupted"] for r in first)  # both stopped after epoch 1 (step 22); last checkpoint: step 20
  assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())[-1] == 20

  # Resumed onto another mesh: parameters and Adam state now split 8 ways across both processes (orbax reshards).
  resumed = run_two_processes({**TWO_PROCESS_RUN, "ckpt_dir": ckpt, "resume": True, "mesh": "fsdp=8"}, tmp_path)
  layers = MODELS[TWO_PROCESS_RUN["model"]].presets[TWO_PROCESS_RUN["preset"]].num_layers
  for r in resumed:
    assert not r["interrupted"] and any("resumed from step 20" in line for line in r["lines"])
    assert r["device_count"] == 8 and r["process_count"] == 2 and r["mesh"] == {"fsdp": 8}
    # the same loss curve: each epoch's mean loss has passed through every step so far (22 per epoch: 1437 // 64)
    assert_trees_close(r["train_loss"], one["train_loss"], depth=len(r["train_loss"]) * (1437 // 64) * layers,
                       what="2-process train loss per epoch vs 1 process")
    assert len(r["train_loss"]) == 2 and r["train_loss"][1] < r["train_loss"][0]
    assert abs(r["test_accuracy"] - one["test_accuracy"]) <= 1 / 360  # at most one test example flips
    assert r["test_aux_accuracy"] is not None
  assert resumed[0]["params_sha256"] == resumed[1]["params_sha256"]  # both processes hold the same model


# --- the experiments' flags, one device, in process ---

def test_aux_task_run_writes_its_metrics(tmp_path):
  from experiments.classifier import ClassifierConfig, train
  from experiments.options import configure
  from jaxckpt.schema import AUX_TASK_KEYS, METRICS_KEYS, PLACEMENT_KEYS

  config = configure(ClassifierConfig(), model="mlp", preset="tiny", epochs=2, policy="full", aux_task="parity",
                     aux_weight=0.5, progress=False, out=str(tmp_path))
  lines = []
  metrics = train(config, log=lines.append).metrics
  assert set(METRICS_KEYS) | set(PLACEMENT_KEYS) | set(AUX_TASK_KEYS) <= set(metrics)
  assert metrics["aux_task"] == "parity" and metrics["aux_weight"] == 0.5
  assert metrics["test_aux_accuracy"] >= 0.75  # parity of the digit, learnt from the shared features
  assert metrics["mesh"] is None and metrics["device_count"] == 1 and metrics["process_count"] == 1
  assert json.load(open(tmp_path / "metrics.json"))["test_aux_accuracy"] == metrics["test_aux_accuracy"]
  assert any(line.startswith("auxiliary task parity: test accuracy") for line in lines)


def test_multitask_loss_is_main_plus_weighted_aux():
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from jaxckpt.models import MODELS, build_model

  backbone = build_model("mlp", MODELS["mlp"].presets["tiny"], image_shape=(8, 8, 1), num_classes=10)
  model = jaxckpt.models.MultiTaskClassifier(backbone, "parity", rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(0), (6, 8, 8, 1))
  y = jnp.array([0, 1, 2, 3, 4, 9])
  batch = {"x": x, "y": y, "mask": jnp.array([True] * 5 + [False])}
  loss, metrics = jaxckpt.models.multitask_loss("parity", 0.25)(model, batch, dropout_key=None, deterministic=True)
  main, aux = model.both(x)
  ce = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(logits[:5], labels[:5]).mean()  # noqa
  depth = MODELS["mlp"].presets["tiny"].num_layers  # the losses of logits computed twice, through the backbone
  assert_trees_close((metrics["main_loss"], metrics["aux_loss"], loss),
                     (ce(main, y), ce(aux, y % 2), ce(main, y) + 0.25 * ce(aux, y % 2)), depth=depth,
                     what="multi-task losses vs cross-entropy of the heads' logits")
  np.testing.assert_array_equal(model(x), main)  # exact: model(x) is the main head, the same computation
  assert metrics["count"] == 5
  with pytest.raises(jaxckpt.errors.JaxckptError, match="valid: parity"):
    jaxckpt.models.multitask_loss("colour")


@pytest.mark.parametrize("argv, words", [
    (["--mesh", "data=3"], ["covers 3 device(s) but there are 1"]),
    (["--mesh", "gpu=1"], ["unknown mesh axis 'gpu'", "valid axes: data, fsdp"]),
    (["--coordinator", "localhost:1234"], ["--coordinator needs --mesh"]),
    (["--num-processes", "2"], ["need --coordinator"]),
    (["--aux-weight", "-1", "--aux-task", "parity"], ["--aux-weight must be finite and ≥ 0", "-1"]),
    (["--aux-weight", "inf", "--aux-task", "parity"], ["--aux-weight must be finite and ≥ 0", "inf"]),
    (["--aux-weight", "0.7"], ["--aux-weight 0.7 needs --aux-task", "parity"]),
    (["--aux-task", "colour"], ["invalid choice: 'colour'"]),
])
def test_experiment_flags_errors_exit_2(argv, words, capsys):
  from experiments.classifier import main

  try:
    status = main(["--preset", "tiny", "--no-progress", *argv])
  except SystemExit as exit_:  # argparse's own errors (CLIParser: one line, status 2)
    status = exit_.code
  assert status == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  for word in words:
    assert word in err, err


# --- FSDP's reduce-scatter and accumulation over a sharded batch: 8 fake devices, one subprocess ---

@pytest.fixture(scope="module")
def accumulation():
  return run_helper("accumulation")


def test_fsdp_and_accumulation_give_one_devices_gradients(accumulation):
  """An own nnx.scan decoder under data=2,fsdp=4 (its layers gathered per layer, their gradients reduced to shards):
  the first step's gradients equal one device's without remat, unaccumulated and as 4 micro-batches."""
  assert accumulation["device_count"] == 8
  assert accumulation["mismatches"] == {"k=1": [], "k=4": []}


def test_accumulation_over_a_sharded_batch_costs_the_accumulator_not_k_steps(accumulation):
  """Each micro-batch spans every device (jaxckpt.training.micro_batches): k × B/k under fsdp=8 takes the B/k step's
  footprint plus the gradient accumulator (one float32 copy of the parameters per device) and 5% of the step, where
  a plain reshape put each micro-batch on 1/k of the devices (≈ k × the activations)."""
  one, four = accumulation["footprints"]["1x8"], accumulation["footprints"]["4x8"]
  assert one <= four <= one + accumulation["param_bytes_per_device"] + 0.05 * one, accumulation["footprints"]


def test_the_experiment_runner_under_fsdp_reduces_its_gradients_to_shards(accumulation):
  """The classifier run on 8 host devices under fsdp=8: what its compiled step sends (metrics.json's collectives and
  the log line) has its layer gradients reduced to shards over fsdp in the layer loop. XLA:CPU has no reduce-scatter
  instruction: it all-reduces and each device slices its shard (sliced_bytes)."""
  run = accumulation["train"]
  assert run["mesh"] == {"fsdp": 8} and run["test_accuracy"] >= 0.7, run
  line = next(line for line in run["lines"] if line.startswith("collectives per step"))
  assert "over fsdp" in line and "in the layer loop" in line, line
  assert any(u["axes"] == ["fsdp"] and u["in_loop"] and (u["kind"] == "reduce-scatter" or u["sliced_bytes"])
             for u in run["collectives"]), run["collectives"]
