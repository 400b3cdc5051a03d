"""The classifier experiment end to end: training reaches accuracy, metrics.json, resume, and bad input → exit 2."""

import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from experiments import classifier
from experiments.classifier import ClassifierConfig, main, train
from experiments.options import configure
from jaxckpt.models import MODELS
from jaxckpt.schema import MEMORY_KEYS, METRICS_KEYS
from tests.numerics import assert_trees_close

TINY = configure(ClassifierConfig(preset="tiny", epochs=3, batch_size=64), progress=False)


def quiet(*_):
  pass


@pytest.fixture(scope="module")
def tiny_run():
  return train(configure(TINY, epochs=8, policy="attn=dots_saveable,mlp=full"), log=quiet)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_tiny_vit_learns_the_digits(tiny_run):
  metrics = tiny_run.metrics
  assert metrics["test_accuracy"] >= 0.85, metrics["test_accuracy"]
  assert len(metrics["train_loss"]) == 8 and metrics["train_loss"][-1] < metrics["train_loss"][0] / 3


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_metrics_schema(tiny_run, tmp_path):
  metrics = tiny_run.metrics
  assert set(METRICS_KEYS) <= set(metrics)
  assert set(metrics["memory"]) == set(MEMORY_KEYS)
  assert metrics["policy"] == "attn=dots_saveable,mlp=nothing_saveable"
  assert metrics["policy_per_block"] == {"attn": "dots_saveable", "mlp": "nothing_saveable"}
  assert metrics["memory"]["temp_bytes"] > 0 and metrics["step_time_s"] > 0
  assert metrics["versions"]["jax"] == jax.__version__
  assert metrics["aux_task"] is None and metrics["test_aux_accuracy"] is None  # single task (jaxckpt.schema)
  assert metrics["mesh"] is None and metrics["device_count"] == 1 and metrics["process_count"] == 1
  json.dumps(metrics)  # serialisable


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_other_models_learn(model):
  result = train(configure(TINY, model=model, epochs=10, policy="full"), log=quiet)
  assert result.metrics["test_accuracy"] >= 0.85, result.metrics["test_accuracy"]


class Interrupt(Exception):
  pass


@pytest.mark.slow  # three runs end to end (~15 s)
def test_resume_after_interruption_is_bit_identical(tmp_path):
  config = configure(TINY, epochs=3, policy="nothing_saveable", ckpt_every=10)
  straight = train(config, log=quiet)

  def interrupt_in_epoch_2(line):
    if line.startswith("epoch 2/"):
      raise Interrupt  # like a kill after step 44: the last checkpoint is step 40

  ckpt = str(tmp_path / "ckpt")
  with pytest.raises(Interrupt):
    train(configure(config, ckpt_dir=ckpt), log=interrupt_in_epoch_2)
  assert sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())[-1] == 40
  lines = []
  resumed = train(configure(config, ckpt_dir=ckpt, resume=True), log=lines.append)
  assert any("resumed from step 40" in line for line in lines)
  assert int(resumed.state.step) == int(straight.state.step) == 3 * (1437 // 64)
  # exact: the resumed run restores the saved arrays and runs the same compiled steps on the same batches
  chex.assert_trees_all_equal(resumed.state.params, straight.state.params)
  assert resumed.metrics["train_loss"] == straight.metrics["train_loss"]


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_existing_run_is_never_overwritten(tmp_path, capsys):
  ckpt = str(tmp_path / "ckpt")
  train(configure(TINY, epochs=1, ckpt_dir=ckpt), log=quiet)
  assert main(["--preset", "tiny", "--epochs", "1", "--ckpt-dir", ckpt, "--no-progress"]) == 2
  assert "pass --resume" in capsys.readouterr().err
  # A different run (other seed) in the same directory is refused, naming the difference.
  assert main(["--preset", "tiny", "--epochs", "1", "--ckpt-dir", ckpt, "--resume", "--seed", "1",
               "--no-progress"]) == 2
  assert "seed: saved 0 vs now 1" in capsys.readouterr().err


def write_npz(path, **arrays):
  np.savez(path, **arrays)
  return str(path)


def bad_inputs(tmp_path):
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(20, 6, 6)).astype(np.float32), np.arange(20) % 3
  x120 = rng.normal(size=(120, 6, 6)).astype(np.float32)
  empty = tmp_path / "empty.npz"
  empty.write_bytes(b"")
  np.save(tmp_path / "plain.npy", x)
  np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
  a_file = tmp_path / "a_file"
  a_file.write_text("mine")
  return {
      "npy": (["--data", str(tmp_path / "plain.npy")], ["a single .npy array"]),
      "pickled": (["--data", str(tmp_path / "pickled.npy")], ["never loads pickled data"]),
      "data dir": (["--data", str(tmp_path)], ["is a directory"]),
      "huge labels": (["--data", write_npz(tmp_path / "k.npz", x=x, y=y * 10**9)], ["labels go up to 2000000000"]),
      "odd vit": (["--data", write_npz(tmp_path / "o.npz", x=x[:, :5], y=y), "--batch-size", "4"],
                  ["need both sides divisible by 2", "--model mlp"]),
      "seed": (["--seed", "-1"], ["--seed must be in 0..4294967295"]),
      "split seed": (["--split-seed", str(2**40)], ["--split-seed must be in"]),
      "out is a file": (["--out", str(a_file)], ["exists and is not a directory"]),
      "long policy": (["--policy", "x" * 100000], ["unknown policy 'xxxxx", "..."]),
      "policy": (["--policy", "dots_savable"], ["dots_saveable", "did you mean"]),
      "block type": (["--policy", "atn=full"], ["'atn'", "attn, default, mlp", "did you mean 'attn'"]),
      "name": (["--policy", "save_only_these_names:qvk"], ["'qvk'", "qkv", "would save nothing"]),
      "name for model": (["--model", "cnn", "--policy", "save_only_these_names:qkv"], ["conv_hidden, conv_out"]),
      "model": (["--model", "resnet"], ["invalid choice", "'vit', 'mlp', 'cnn'"]),
      "preset": (["--preset", "huge"], ["'huge'", "tiny, small"]),
      "dtype": (["--compute-dtype", "float16"], ["invalid choice", "bfloat16"]),
      "epochs": (["--epochs", "0"], ["--epochs must be ≥ 1"]),
      "switch": (["--gradient-checkpointing", "--policy", "dots_saveable"], ["conflicts with --policy dots_saveable"]),
      "structure": (["--structure", "nestd"], ["did you mean 'nested'"]),
      "accumulation": (["--grad-accum-steps", "3"], ["must divide --batch-size 64"]),
      "resume": (["--resume"], ["--resume needs --ckpt-dir"]),
      "missing file": (["--data", str(tmp_path / "nope.npz")], ["no such file"]),
      "empty file": (["--data", str(empty)], ["not a readable .npz"]),
      "missing y": (["--data", write_npz(tmp_path / "a.npz", x=x)], ["missing array(s) y"]),
      "bad rank": (["--data", write_npz(tmp_path / "b.npz", x=x[:, 0], y=y)], ["x has shape (20, 6)"]),
      "length": (["--data", write_npz(tmp_path / "c.npz", x=x, y=y[:5])], ["20 examples but y has 5"]),
      "labels": (["--data", write_npz(tmp_path / "d.npz", x=x, y=y - 1)], ["labels must be in 0..K-1"]),
      "float labels": (["--data", write_npz(tmp_path / "e.npz", x=x, y=y.astype(float))], ["need [N] integers"]),
      "no examples": (["--data", write_npz(tmp_path / "f.npz", x=x[:0], y=y[:0])], ["no examples"]),
      "one class": (["--data", write_npz(tmp_path / "g.npz", x=x, y=y * 0)], ["need at least 2"]),
      "nan": (["--data", write_npz(tmp_path / "h.npz", x=x * np.nan, y=y)], ["NaN or Inf"]),
      "empty classes": (["--data", write_npz(tmp_path / "i.npz", x=x120, y=100 + np.arange(120) % 10)],
                        ["labels 100..109 leave 100 of the 110 inferred classes", "without an example: 0..99",
                         "--num-classes K"]),
      "gaps": (["--data", write_npz(tmp_path / "j.npz", x=x120, y=np.arange(120) % 3 * 2)],
               ["leave 2 of the 5 inferred classes", "without an example: 1, 3"]),
      "label over k": (["--data", write_npz(tmp_path / "l.npz", x=x, y=y), "--num-classes", "2"],
                       ["labels must be in 0..1 (--num-classes 2), found 2"]),
      "num classes": (["--num-classes", "1"], ["--num-classes must be ≥ 2, got 1"]),
      "num classes digits": (["--num-classes", "12"], ["--num-classes 12 does not fit the digits (10 classes)"]),
  }


def test_bad_input_exits_2_with_one_line_naming_valid_choices(tmp_path, capsys):
  for case, (argv, fragments) in bad_inputs(tmp_path).items():
    try:
      code = main(["--preset", "tiny", "--epochs", "1", "--no-progress", *argv])
    except SystemExit as exit_:  # argparse's own errors
      code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, (case, err)
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 1000, (case, err)
    for fragment in fragments:
      assert fragment in err, (case, fragment, err)


def test_user_npz_data_trains(tmp_path):
  digits_like = np.load(write_npz(tmp_path / "d.npz", x=np.tile(np.eye(6, dtype=np.float32), (60, 1, 1)),
                                  y=np.arange(60) % 2))
  del digits_like
  result = train(configure(TINY, model="mlp", epochs=1, batch_size=16, data=str(tmp_path / "d.npz")),
                 log=quiet)
  assert result.metrics["data"].endswith("d.npz")


def test_num_classes_allows_empty_classes(tmp_path):
  """Labels 100..109 with --num-classes 110: a 110-way head (classes 0..99 have no example, as declared)."""
  rng = np.random.default_rng(0)
  y = 100 + np.arange(120) % 10
  x = (rng.normal(size=(120, 6, 6)) + (y - 100)[:, None, None]).astype(np.float32)
  path = write_npz(tmp_path / "k.npz", x=x, y=y)
  lines = []
  result = train(configure(TINY, model="mlp", epochs=1, batch_size=16, data=path, num_classes=110), log=lines.append)
  assert any("110 classes" in line for line in lines), lines
  assert any(np.shape(leaf)[-1:] == (110,) for leaf in jax.tree.leaves(result.state.params))  # the output head
  assert result.metrics["config"]["num_classes"] == 110


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_cli_smoke(tmp_path):
  out = tmp_path / "out"
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  ok = subprocess.run([sys.executable, "-m", "experiments.classifier", "--preset", "tiny", "--epochs", "1",
                       "--policy", "dots_saveable", "--out", str(out)], capture_output=True, text=True, env=env)
  assert ok.returncode == 0, ok.stderr
  assert "compiled train step memory" in ok.stdout and "temp" in ok.stdout and "test accuracy" in ok.stdout
  assert "\r" not in ok.stdout + ok.stderr  # no terminal: no bar, so a log file gets whole lines
  assert json.loads((out / "metrics.json").read_text())["policy"] == "dots_saveable"
  bad = subprocess.run([sys.executable, "-m", "experiments.classifier", "--policy", "dots_savable"],
                       capture_output=True, text=True, env=env)
  assert bad.returncode == 2 and "Traceback" not in bad.stderr and "did you mean 'dots_saveable'" in bad.stderr


def test_help_lists_block_types_and_grammar(capsys):
  with pytest.raises(SystemExit):
    main(["--help"])
  out = capsys.readouterr().out
  assert "vit: attn, mlp" in out and "cnn: conv" in out and "BLOCK=POLICY" in out and "budget:SIZE" in out
  assert classifier.build_parser().prog.startswith("python -m experiments.classifier")


@pytest.mark.slow  # trains a run end to end (~10 s)
def test_gradient_checkpointing_switch_means_full_remat():
  on = train(configure(TINY, epochs=1, policy=None, gradient_checkpointing=True), log=quiet)
  off = train(configure(TINY, epochs=1, policy=None, gradient_checkpointing=False), log=quiet)
  assert on.metrics["policy"] == "nothing_saveable" and off.metrics["policy"] == "none"
  assert on.metrics["memory"]["temp_bytes"] < off.metrics["memory"]["temp_bytes"]
  # Remat recomputes the same values; XLA may fuse the recomputation differently, so compare to rounding: the epoch's
  # mean loss has passed through every step's layers (tests/numerics.py).
  depth = int(on.state.step) * MODELS[on.metrics["model"]].presets["tiny"].num_layers
  assert_trees_close(on.metrics["train_loss"], off.metrics["train_loss"], depth=depth,
                     what="epoch train loss, gradient checkpointing on vs off")


@pytest.mark.slow  # trains a run end to end (~10 s)
def test_offload_policy_on_cpu_says_it_saves_nothing():
  if jax.default_backend() != "cpu":
    pytest.skip("host and device memory differ off CPU")
  result = train(configure(TINY, epochs=1, policy="offload_dot_with_no_batch_dims"), log=quiet)
  assert any("offloading saves no memory here" in w for w in result.metrics["warnings"])


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_profile_traces_warm_steps_and_changes_no_number(tmp_path):
  """--profile DIR writes one XProf run for the policy (the files XProf reads) and the run's results are those of a
  run without it."""
  from jaxckpt.training._profile import profile_slug, trace_files

  logs = []
  config = configure(TINY, epochs=1, policy="full")
  plain = train(config, log=quiet)
  profiled = train(configure(config, profile=str(tmp_path / "prof"), profile_steps=2), log=logs.append)
  run_dir = tmp_path / "prof" / profile_slug("nothing_saveable")
  files = trace_files(run_dir)
  assert len(files) == 1 and files[0].endswith(".xplane.pb") and os.path.getsize(files[0]) > 0
  assert any(line.startswith("profiled steps 1-2 into ") for line in logs)
  assert profiled.metrics["train_loss"] == plain.metrics["train_loss"]
  assert profiled.metrics["test_accuracy"] == plain.metrics["test_accuracy"]


def test_profile_flag_errors(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert main(["--preset", "tiny", "--epochs", "1", "--profile", str(blocker), "--no-progress"]) == 2
  assert main(["--preset", "tiny", "--epochs", "1", "--profile", str(tmp_path), "--profile-steps", "0"]) == 2


def test_a_bad_jax_remat3_value_is_one_line_before_jax_starts():
  """The experiments import optax (and JAX) right after jaxckpt: ``experiments/__init__`` imports jaxckpt first, so an
  unknown ``JAX_REMAT3`` is jaxckpt's one line and exit 2, not JAX's ValueError traceback."""
  env = {**os.environ, "JAX_REMAT3": "maybe"}
  done = subprocess.run([sys.executable, "-m", "experiments.classifier", "--help"], env=env, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
  assert "JAX_REMAT3='maybe' is not a value JAX accepts" in done.stderr

