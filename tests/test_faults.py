"""Faults: kill -9 at arbitrary moments, half-written and corrupt checkpoints, foreign directories, NaN losses."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxckpt
from experiments import classifier
from experiments.classifier import ClassifierConfig, main, train
from experiments.options import configure
from experiments.outputs import params_digest
from jaxckpt.saving import TMP_MARKER

TINY = configure(ClassifierConfig(preset="tiny", epochs=2, batch_size=64), progress=False, ckpt_every=10)
CLI = [sys.executable, "-m", "experiments.classifier", "--preset", "tiny", "--epochs", "3", "--no-progress",
       "--ckpt-every", "3", "--policy", "nothing_saveable"]


def quiet(*_):
  pass


def step_dirs(ckpt):
  return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(tmp_path):
  """Kills a real training process at several moments (compile, steps, saves); every resume continues from the last
  complete checkpoint and the final parameters equal an uninterrupted run's, bit for bit."""
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  straight = tmp_path / "straight"
  subprocess.run([*CLI, "--out", str(straight)], check=True, env=env, capture_output=True)
  expected = json.loads((straight / "metrics.json").read_text())

  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  seen_unfinished = 0
  for delay in (0.0, 0.4, 0.9, 1.4, 2.0):
    proc = subprocess.Popen([*CLI, "--ckpt-dir", str(ckpt), "--out", str(out), "--resume"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until training starts, then kill at `delay` seconds
      if line.startswith("compiled in"):
        break
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    if ckpt.exists():
      seen_unfinished += sum(TMP_MARKER in d for d in os.listdir(ckpt))
  done = subprocess.run([*CLI, "--ckpt-dir", str(ckpt), "--out", str(out), "--resume"], env=env,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "resumed from step" in done.stdout
  resumed = json.loads((out / "metrics.json").read_text())
  assert resumed["params_sha256"] == expected["params_sha256"]
  assert resumed["train_loss"] == expected["train_loss"]
  assert not any(TMP_MARKER in d for d in os.listdir(ckpt))
  print(f"unfinished saves seen after kills: {seen_unfinished}")


def test_half_written_checkpoint_is_ignored_and_cleaned(tmp_path):
  ckpt = tmp_path / "ckpt"
  train(configure(TINY, epochs=1, ckpt_dir=str(ckpt)), log=quiet)
  assert step_dirs(ckpt)[-1] == 22
  partial = ckpt / f"30{TMP_MARKER}-1700000000"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half").write_bytes(b"\0" * 100)
  lines = []
  result = train(configure(TINY, epochs=2, ckpt_dir=str(ckpt), resume=True,
                                     allow_config_change=True), log=lines.append)
  assert any("resumed from step 22" in line for line in lines)
  assert any("deleted 1 unfinished save" in line for line in lines)
  assert not partial.exists()
  assert int(result.state.step) == 44


def test_corrupt_latest_step_falls_back_to_previous(tmp_path):
  ckpt = tmp_path / "ckpt"
  straight = train(configure(TINY, ckpt_dir=str(ckpt)), log=quiet)
  assert step_dirs(ckpt) == [30, 40, 44]
  for root, _, files in os.walk(ckpt / "44" / "state"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  lines = []
  resumed = train(configure(TINY, ckpt_dir=str(ckpt), resume=True), log=lines.append)
  assert any("step 44" in line and "cannot be read" in line for line in lines), lines
  assert any("resumed from step 40" in line for line in lines)
  assert params_digest(resumed.state.params) == params_digest(straight.state.params)


def test_all_steps_corrupt_is_a_clear_error(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  train(configure(TINY, epochs=1, ckpt_dir=str(ckpt), ckpt_every=100), log=quiet)
  shutil.rmtree(ckpt / "22" / "state")
  assert main(["--preset", "tiny", "--epochs", "1", "--ckpt-dir", str(ckpt), "--resume", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "no checkpoint in" in err and str(ckpt) in err and err.count("\n") == 1


def test_foreign_directory_is_refused(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("my thesis")
  assert main(["--preset", "tiny", "--epochs", "1", "--ckpt-dir", str(tmp_path), "--no-progress"]) == 2
  assert "not empty and holds no checkpoints" in capsys.readouterr().err
  assert (tmp_path / "notes.txt").read_text() == "my thesis"  # nothing touched


def test_config_change_needs_to_be_allowed(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  train(configure(TINY, epochs=1, ckpt_dir=ckpt), log=quiet)
  with pytest.raises(jaxckpt.CheckpointError, match="epochs: saved 1 vs now 2"):
    train(configure(TINY, epochs=2, ckpt_dir=ckpt, resume=True), log=quiet)
  lines = []
  train(configure(TINY, epochs=2, ckpt_dir=ckpt, resume=True, allow_config_change=True), log=lines.append)
  assert any("changed config" in line for line in lines)


@pytest.fixture
def nan_at_step_30(monkeypatch):
  real = classifier.train_batch

  def poisoned(data, step, **kwargs):
    batch = real(data, step, **kwargs)
    if step == 30:
      batch = {**batch, "x": np.full_like(batch["x"], np.nan)}
    return batch

  monkeypatch.setattr(classifier, "train_batch", poisoned)


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, nan_at_step_30):
  ckpt = tmp_path / "ckpt"
  with pytest.raises(jaxckpt.NonFiniteLossError) as info:
    train(configure(TINY, ckpt_dir=str(ckpt)), log=quiet)
  assert info.value.step == 30
  message = str(info.value)
  assert "step 30" in message and "learning rate" in message and "last good checkpoint (step 30)" in message
  assert step_dirs(ckpt)[-1] == 30
  lines = []  # the kept checkpoint is good: resuming it (past the bad batch with skip) works
  result = train(configure(TINY, ckpt_dir=str(ckpt), resume=True, nan_policy="skip"), log=lines.append)
  assert any("resumed from step 30" in line for line in lines)
  assert np.isfinite(result.metrics["train_loss"][0])


def test_nan_skip_drops_only_that_update(nan_at_step_30):
  result = train(configure(TINY, nan_policy="skip"), log=quiet)
  assert result.metrics["skipped_steps"] == [30]
  assert all(np.isfinite(np.asarray(p)).all() for p in jax_leaves(result.state.params))
  assert result.metrics["test_accuracy"] > 0.3


def jax_leaves(tree):
  import jax

  return jax.tree.leaves(tree)


def test_nan_stop_exit_code(capsys, nan_at_step_30):
  assert main(["--preset", "tiny", "--epochs", "2", "--no-progress"]) == 1
  err = capsys.readouterr().err
  assert "non-finite loss" in err and "--nan-policy skip" in err and "Traceback" not in err
