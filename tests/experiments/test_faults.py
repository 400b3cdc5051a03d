"""Faults: kill -9 at arbitrary moments, half-written and corrupt checkpoints, foreign directories, NaN losses."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxckpt
from experiments import classifier
from experiments.classifier import ClassifierConfig, main, train
from experiments.options import configure
from benchmarks.common import own_stderr_lines
from experiments.outputs import params_digest
from jaxckpt.training._saving import TMP_MARKER

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
    proc = subprocess.Popen([*CLI, "--ckpt-dir", str(ckpt), "--out", str(out), "--resume", "auto"], env=env,
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


@pytest.mark.slow  # trains real runs end to end (~15-20 s)
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


@pytest.mark.slow  # trains real runs end to end (~10 s)
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


@pytest.mark.slow  # trains real runs end to end (~10 s)
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


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_config_change_needs_to_be_allowed(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  train(configure(TINY, epochs=1, ckpt_dir=ckpt), log=quiet)
  with pytest.raises(jaxckpt.errors.CheckpointError, match="epochs: saved 1 vs now 2"):
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


@pytest.mark.slow  # trains real runs end to end (~15-20 s)
def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, nan_at_step_30):
  ckpt = tmp_path / "ckpt"
  with pytest.raises(jaxckpt.errors.NonFiniteLossError) as info:
    train(configure(TINY, ckpt_dir=str(ckpt)), log=quiet)
  assert info.value.step == 30
  message = str(info.value)
  assert "step 30" in message and "learning rate" in message and "last good checkpoint (step 30)" in message
  assert step_dirs(ckpt)[-1] == 30
  lines = []  # the kept checkpoint is good: resuming it (past the bad batch with skip) works
  result = train(configure(TINY, ckpt_dir=str(ckpt), resume=True, nan_policy="skip"), log=lines.append)
  assert any("resumed from step 30" in line for line in lines)
  assert np.isfinite(result.metrics["train_loss"][0])


@pytest.mark.slow  # trains real runs end to end (~10 s)
def test_nan_skip_drops_only_that_update(nan_at_step_30):
  result = train(configure(TINY, nan_policy="skip"), log=quiet)
  assert result.metrics["skipped_steps"] == [30]
  assert all(np.isfinite(np.asarray(p)).all() for p in jax_leaves(result.state.params))
  assert result.metrics["test_accuracy"] > 0.3


def jax_leaves(tree):
  import jax

  return jax.tree.leaves(tree)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_nan_stop_exit_code(capsys, nan_at_step_30):
  assert main(["--preset", "tiny", "--epochs", "2"]) == 1  # progress on, but no terminal: no bar fragment before it
  err = capsys.readouterr().err
  assert "non-finite loss" in err and "--nan-policy skip" in err and "Traceback" not in err
  assert "\r" not in err and err.count("\n") == 1, repr(err)


# --- saved work is never lost -----------------------------------------------------------------------------------


def corrupt(step_dir):
  for root, _, files in os.walk(step_dir / "state"):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")


class Stop(Exception):
  pass


def stop_at(prefix, lines=None):
  def log(line):
    if lines is not None:
      lines.append(line)
    if line.startswith(prefix):
      raise Stop(line)
  return log


@pytest.fixture(scope="module")
def straight():
  return train(TINY, log=quiet)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_save_after_rollback_lands_and_the_next_resume_continues_from_it(tmp_path, straight):
  """Steps 20, 30 and an unreadable 40: the resume falls back to 30, moves 40 aside (kept), and its own save of step
  40 is written, so the next resume continues from 40 and ends bit-identical to a straight run."""
  ckpt = tmp_path / "ckpt"
  with pytest.raises(Stop):  # "epoch 2/" is logged after step 44, before its save: steps 20, 30, 40 are on disk
    train(configure(TINY, ckpt_dir=str(ckpt)), log=stop_at("epoch 2/"))
  assert step_dirs(ckpt) == [20, 30, 40]
  corrupt(ckpt / "40")
  lines = []
  with pytest.raises(Stop):
    train(configure(TINY, ckpt_dir=str(ckpt), resume=True), log=stop_at("epoch 2/", lines))
  assert any("resumed from step 30" in line for line in lines), lines
  assert any("moved the unreadable step(s) aside" in line for line in lines), lines
  assert step_dirs(ckpt) == [20, 30, 40]  # the new step 40 was written (it used to be skipped silently)
  aside = [d for d in os.listdir(ckpt) if d.startswith("40.corrupt-")]
  assert len(aside) == 1 and (ckpt / aside[0] / "state").is_dir()  # kept for inspection, not deleted
  lines = []
  resumed = train(configure(TINY, ckpt_dir=str(ckpt), resume=True), log=lines.append)
  assert any("resumed from step 40" in line for line in lines), lines
  assert params_digest(resumed.state.params) == params_digest(straight.state.params)
  assert resumed.metrics["train_loss"] == straight.metrics["train_loss"]


def test_a_save_that_would_write_nothing_fails_loudly(tmp_path):
  ckpt = tmp_path / "ckpt"
  saver = jaxckpt.TrainStateSaver(ckpt, config={"a": 1}, save_every=2, resume=False)
  state = {"w": np.arange(3.0)}
  assert saver.maybe_save(2, state) and not saver.maybe_save(3, state)  # written; not due
  assert not saver.maybe_save(2, state, force=True)  # this saver wrote step 2 already
  other = jaxckpt.TrainStateSaver(ckpt, config={"a": 1}, save_every=2, resume=True)
  with pytest.raises(jaxckpt.errors.CheckpointError, match=r"cannot save step 2 .* holds step\(s\) \[2\]"):
    other.maybe_save(2, state)
  saver.close()
  other.close()
  assert jaxckpt.TrainStateSaver is jaxckpt.TrainStateSaver  # the old name still imports


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_resume_of_a_finished_run_says_nothing_left_to_train(tmp_path, capsys):
  ckpt = str(tmp_path / "ckpt")
  argv = ["--preset", "tiny", "--epochs", "1", "--no-progress", "--ckpt-dir", ckpt]
  assert main(argv) == 0
  capsys.readouterr()
  assert main([*argv, "--resume", "--out", str(tmp_path / "out")]) == 0
  out = capsys.readouterr().out
  assert "nothing left to train" in out and "step 22 of 22" in out and "median step time" not in out, out
  assert json.loads((tmp_path / "out" / "metrics.json").read_text())["steps"] == 22


def test_directory_lock_names_the_holder_and_a_killed_holder_is_stale(tmp_path):
  from jaxckpt.training._saving import DirectoryLock

  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from jaxckpt.training._saving import DirectoryLock; "
       f"lock = DirectoryLock({str(tmp_path)!r}, flag='--out').acquire(); print('held', flush=True); "
       "time.sleep(60)"],
      stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(jaxckpt.errors.DirectoryInUseError, match=rf"--out {tmp_path} is in use by another run \(pid "
                                                          rf"{holder.pid} on host .*, started 20"):
      DirectoryLock(tmp_path, flag="--out").acquire()
  finally:
    holder.kill()  # SIGKILL: no release; the OS drops the flock
    holder.wait()
    holder.stdout.close()
  lock = DirectoryLock(tmp_path, flag="--out").acquire()  # a killed holder's lock is stale: taken over at once
  assert lock.stale is not None and f"pid {holder.pid}" in lock.stale
  lock.release()
  again = DirectoryLock(tmp_path, flag="--out").acquire()  # a released lock is not stale
  assert again.stale is None
  again.release()


@pytest.mark.slow  # trains real runs end to end (~15-20 s)
def test_a_second_run_into_the_same_directories_is_refused_before_compiling(tmp_path, capsys):
  out, ckpt = tmp_path / "out", tmp_path / "ckpt"
  first = subprocess.Popen([*CLI, "--epochs", "6", "--out", str(out), "--ckpt-dir", str(ckpt)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
  for line in first.stdout:  # the first run holds both directories from before it compiles
    if line.startswith("compiled in"):
      break
  assert main(["--preset", "tiny", "--epochs", "1", "--no-progress", "--seed", "1", "--out", str(out),
               "--ckpt-dir", str(ckpt)]) == 2
  captured = capsys.readouterr()
  assert captured.err.count("\n") == 1 and f"is in use by another run (pid {first.pid} on host" in captured.err
  assert "compiled" not in captured.out and "model " not in captured.out  # refused before building anything
  rest = first.stdout.read()
  assert first.wait() == 0, rest
  first.stdout.close()
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["config"]["seed"] == 0 and metrics["steps"] == 132  # the first run's results, intact
  assert step_dirs(ckpt) == [126, 129, 132]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_a_signal_stops_cleanly_with_one_line_and_the_resume_is_bit_identical(tmp_path, capsys, monkeypatch, signum,
                                                                               code, straight):
  real = classifier.train_batch
  sent = []

  def signalling(data, step, **kwargs):
    if step == 25 and not sent:
      sent.append(step)
      os.kill(os.getpid(), signum)  # delivered to this (main) thread: the loop stops at the next bytecode
    return real(data, step, **kwargs)

  monkeypatch.setattr(classifier, "train_batch", signalling)
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  argv = ["--preset", "tiny", "--epochs", "2", "--no-progress", "--ckpt-every", "10", "--ckpt-dir", ckpt,
          "--out", out]
  # What was installed before the run (SIG_IGN where the tests were started in the background, else Python's default).
  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  assert main(argv) == code
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert f"stopped by {signal.Signals(signum).name} at step " in err and " of 44" in err
  assert f"last complete checkpoint: step 20 in {ckpt}" in err
  command = err.split("resume with: ")[1].split()
  assert command[:3] == ["python", "-m", "experiments.classifier"] and command[3:] == [*argv, "--resume"]
  assert {s: signal.getsignal(s) for s in handlers} == handlers  # handlers restored
  assert main(command[3:]) == 0
  assert "resumed from step 20" in capsys.readouterr().out
  assert json.loads(open(os.path.join(out, "metrics.json")).read())["params_sha256"] == straight.metrics[
      "params_sha256"]


def test_a_signal_during_a_save_lets_the_save_complete(tmp_path, monkeypatch):
  real_save = jaxckpt.TrainStateSaver.maybe_save

  def save_and_signal(self, step, state, **kwargs):
    if step == 20:
      os.kill(os.getpid(), signal.SIGINT)  # arrives while the save is in flight
    return real_save(self, step, state, **kwargs)

  monkeypatch.setattr(jaxckpt.TrainStateSaver, "maybe_save", save_and_signal)
  from experiments.loop import RunInterrupted

  with pytest.raises(RunInterrupted) as info:
    train(configure(TINY, ckpt_dir=str(tmp_path)), log=quiet)
  assert (info.value.step, info.value.checkpoint, info.value.exit_code) == (20, 20, 130)
  assert step_dirs(tmp_path) == [10, 20] and not any(TMP_MARKER in d for d in os.listdir(tmp_path))


@pytest.mark.slow
def test_sigint_to_a_real_process_then_resume_is_bit_identical(tmp_path):
  """Ctrl-C of a real CLI run: exit 130, one line on stderr naming the step and the checkpoint; the printed resume
  command finishes the run bit-identical to an uninterrupted one."""
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  straight = tmp_path / "straight"
  subprocess.run([*CLI, "--out", str(straight)], check=True, env=env, capture_output=True)
  expected = json.loads((straight / "metrics.json").read_text())
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  proc = subprocess.Popen([*CLI, "--ckpt-dir", str(ckpt), "--out", str(out)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if line.startswith("compiled in"):
      break
  time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  rest, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, rest + err
  # The signal lands at a step, or (on a loaded machine) still before the first one: either way one line.
  stopped = "stopped by SIGINT at step" in err or "stopped by SIGINT before training began" in err
  assert len(own_stderr_lines(err)) == 1 and stopped and "Traceback" not in err, err
  command = err.split("resume with: ")[1].split()
  assert command[:3] == ["python", "-m", "experiments.classifier"]
  done = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout + done.stderr
  resumed = json.loads((out / "metrics.json").read_text())
  assert resumed["params_sha256"] == expected["params_sha256"]
  assert resumed["train_loss"] == expected["train_loss"]


class _Sqrt(nnx.Module):
  """``loss = Σ sqrt(w)``: finite at ``w = 0`` while its gradient there is +inf; ``w: [6] float32``."""

  def __init__(self, w):
    self.w = nnx.Param(jnp.asarray(w, jnp.float32))
    self.b = nnx.Param(jnp.ones((3, 4), jnp.float32))


def _sqrt_loss(model, batch, *, dropout_key, deterministic):
  del dropout_key, deterministic
  value = jnp.sqrt(model.w[...] * batch["scale"]).sum() + (model.b[...] * batch["scale"]).sum()
  return value, {}


@pytest.mark.parametrize("w, scale, finite", [
    ([1.0, 4.0, 9.0, 1.0, 1.0, 1.0], 1.0, True),
    ([1.0, 4.0, 0.0, 1.0, 1.0, 1.0], 1.0, False),  # loss finite, one gradient element +inf
    ([1.0, 4.0, 9.0, 1.0, 1.0, 1.0], float("nan"), False),  # loss and every gradient NaN
    ([1.0, 4.0, 9.0, 1.0, 1.0, 1.0], 3e38, False),  # the loss overflows to inf, gradients finite
])
def test_finite_metric_flags_any_nonfinite_gradient_element_and_skip_keeps_the_state(w, scale, finite):
  tx = optax.sgd(0.1)
  graphdef, state = jaxckpt.create_train_state(_Sqrt(w), tx, seed=0)
  batch = {"scale": jnp.float32(scale)}
  new, metrics = jax.jit(jaxckpt.make_train_step(graphdef, tx, _sqrt_loss, skip_nonfinite=True))(state, batch)
  assert bool(metrics["finite"]) is finite
  # exact: a skipped update hands the old arrays back, no arithmetic on them
  kept = [bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))]
  assert all(kept) is not finite  # skipped: every parameter kept; applied: SGD moved them
  assert int(new.step) == 1


@pytest.mark.parametrize("skip", [True, False])
def test_an_update_that_overflows_a_parameter_is_not_finite(skip):
  """Loss and gradients finite (the ``b`` gradient is 10), but SGD with learning rate 1e38 sends ``b`` to −inf: the
  step says so (the loop stops or skips there), and ``skip_nonfinite`` keeps the old parameters."""
  tx = optax.sgd(1e38)
  graphdef, state = jaxckpt.create_train_state(_Sqrt([1.0, 4.0, 9.0, 1.0, 1.0, 1.0]), tx, seed=0)
  batch = {"scale": jnp.float32(10.0)}
  new, metrics = jax.jit(jaxckpt.make_train_step(graphdef, tx, _sqrt_loss, skip_nonfinite=skip))(state, batch)
  assert not bool(metrics["finite"])
  # exact: a skipped update hands the old arrays back, no arithmetic on them
  kept = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)))
  assert kept is skip
  assert skip or bool(jnp.isinf(new.params["b"][...]).all())  # applied: the overflow is there, and flagged


def _sqrt_metrics_loss(model, batch, *, dropout_key, deterministic):
  value, _ = _sqrt_loss(model, batch, dropout_key=dropout_key, deterministic=deterministic)
  return value, {"loss": value, "half": value / 2}


def test_plain_step_returns_the_loss_only_and_the_same_update():
  """``metrics=False`` is the plain step the report compiles: the same parameters, ``{"loss"}`` only (``finite``
  too when it skips non-finite updates, which needs it)."""
  tx = optax.sgd(0.1)
  graphdef, state = jaxckpt.create_train_state(_Sqrt([1.0, 4.0, 0.0, 1.0, 1.0, 1.0]), tx, seed=0)
  batch = {"scale": jnp.float32(1.0)}
  full_new, full = jax.jit(jaxckpt.make_train_step(graphdef, tx, _sqrt_metrics_loss))(state, batch)
  plain_new, plain = jax.jit(jaxckpt.make_train_step(graphdef, tx, _sqrt_metrics_loss, metrics=False))(state, batch)
  assert set(full) == {"loss", "half", "finite"} and set(plain) == {"loss"}
  # exact: the same loss, gradient and update operations on a 6-element toy; the metrics only add outputs
  assert float(plain["loss"]) == float(full["loss"])
  assert all(bool(jnp.array_equal(a, b, equal_nan=True))
             for a, b in zip(jax.tree.leaves(plain_new.params), jax.tree.leaves(full_new.params)))
  skip = jaxckpt.make_train_step(graphdef, tx, _sqrt_metrics_loss, metrics=False, skip_nonfinite=True)
  skip_new, skipped = jax.jit(skip)(state, batch)
  assert set(skipped) == {"loss", "finite"} and not bool(skipped["finite"])  # one gradient element is +inf
  kept = zip(jax.tree.leaves(skip_new.params), jax.tree.leaves(state.params))
  assert all(bool(jnp.array_equal(a, b)) for a, b in kept)  # exact: skipped, the old arrays handed back


@pytest.mark.parametrize("kwargs, match", [
    ({"metrics": "false"}, "metrics='false' must be True or False"),  # a truthy string: metrics on, silently
    ({"metrics": None}, "metrics=None must be True or False"),
    ({"skip_nonfinite": 1}, "skip_nonfinite=1 must be True or False"),
    ({"grad_accum_steps": 2.0}, "grad_accum_steps must be an int ≥ 1, got 2.0"),
    ({"grad_accum_steps": 0}, "grad_accum_steps must be an int ≥ 1, got 0"),
])
def test_make_train_step_refuses_non_bool_flags_and_non_int_accumulation(kwargs, match):
  tx = optax.sgd(0.1)
  graphdef, _ = jaxckpt.create_train_state(_Sqrt([1.0, 4.0]), tx, seed=0)
  with pytest.raises(jaxckpt.errors.JaxckptError, match=re.escape(match)):
    jaxckpt.make_train_step(graphdef, tx, _sqrt_metrics_loss, **kwargs)
  assert jaxckpt.make_train_step(graphdef, tx, _sqrt_metrics_loss, metrics=np.bool_(False)) is not None


# --- a checkpoint whose file is still readable but whose data is not what was saved --------------------------------


def _flip_a_bit(step_dir):
  """Flips one bit in the middle of the largest data file of a saved step (random float32 data: zstd stores it raw,
  so the file stays readable and one value changes)."""
  files = [os.path.join(root, name) for root, _, names in os.walk(step_dir / "state") for name in names]
  largest = max(files, key=os.path.getsize)
  data = bytearray(open(largest, "rb").read())
  data[len(data) // 2] ^= 0x10
  with open(largest, "wb") as f:
    f.write(bytes(data))


def test_a_flipped_bit_is_caught_on_restore_and_the_resume_falls_back(tmp_path):
  """One flipped bit in an orbax data file restored silently (62 of 67 parameter leaves of a resumed classifier
  differed from the straight run's, exit 0). Each save now writes a checksum per array with the step; the corrupt step
  is named, skipped and moved aside, and the restore falls back to the newest step that verifies."""
  rng = np.random.RandomState(0)
  state = {"w": rng.randn(256, 256).astype(np.float32), "b": rng.randn(256).astype(np.float32),
           "step": np.asarray(1, np.int32)}
  ckpt = tmp_path / "ckpt"
  saver = jaxckpt.TrainStateSaver(ckpt, config={"a": 1}, save_every=1, resume=False)
  assert saver.maybe_save(1, state) and saver.maybe_save(2, {**state, "step": np.asarray(2, np.int32)})
  saver.close()
  _flip_a_bit(ckpt / "2")
  resumed = jaxckpt.TrainStateSaver(ckpt, config={"a": 1}, save_every=1, resume=True)
  restored, _ = resumed.restore(state)
  assert resumed.latest_step == 1 and int(restored["step"]) == 1
  assert all(np.array_equal(np.asarray(restored[k]), state[k]) for k in ("w", "b"))
  assert any(f"checkpoint step 2 in {ckpt} is corrupt: 1 of 3 arrays differ from the checksums saved with them "
             "(['w'])" in w for w in resumed.warnings), resumed.warnings
  assert step_dirs(ckpt) == [1] and any(d.startswith("2.corrupt-") for d in os.listdir(ckpt))
  resumed.close()


def test_array_checksums_do_not_depend_on_where_they_are_computed():
  """The host's checksum (an array held whole) and the devices' (an array spread over processes) are two methods;
  each is the same however the array is laid out, and each catches a flipped bit."""
  from jaxckpt.training._saving import array_checksums

  tree = {"f": jnp.arange(12.0).reshape(3, 4), "h": jnp.ones(5, jnp.bfloat16), "k": jax.random.key(1),
          "i": np.int32(7), "m": jnp.array([True, False])}
  host = array_checksums(tree)
  assert set(host) == {"['f']", "['h']", "['i']", "['k']", "['m']"} and all(v.startswith("blake2b:") for v in
                                                                             host.values())
  spread = array_checksums(tree, {k: "sum64" for k in host})
  assert all(v.startswith("sum64:") for v in spread.values()) and array_checksums(tree, {"['f']": "sum64"}) == {
      **host, "['f']": spread["['f']"]}
  flipped = np.asarray(tree["f"]).copy()
  flipped.reshape(-1).view(np.uint32)[5] ^= 1 << 9
  assert array_checksums({"f": flipped}, {"['f']": "sum64"})["['f']"] != spread["['f']"]
  assert array_checksums({"f": flipped})["['f']"] != host["['f']"]


def test_a_save_that_fails_for_space_is_one_line(tmp_path):
  """A checkpoint save on a full disk printed ~330 lines of orbax tracebacks; now one CheckpointError line, its
  unfinished directory removed, the last complete step named."""
  ckpt = tmp_path / "ckpt"
  saver = jaxckpt.TrainStateSaver(ckpt, config={"a": 1}, save_every=1, resume=False)
  saver.maybe_save(1, {"w": np.zeros(4, np.float32)})

  def full(step, **kwargs):
    (ckpt / f"{step}{TMP_MARKER}-1700000000").mkdir()
    raise ValueError(f"RESOURCE_EXHAUSTED: Error writing \"w/0.0\" in OCDBT database at local file \"{ckpt}\": "
                     "Failed to write 3716881 bytes to file 7: No space left on device [os_error_code='28']")

  saver._manager.save = full
  with pytest.raises(jaxckpt.errors.CheckpointError) as info:
    saver.maybe_save(2, {"w": np.ones(4, np.float32)})
  assert str(info.value) == (f"saving checkpoint step 2 in {ckpt} failed (no space left on device); the last complete "
                             "checkpoint is step 1; free space or choose another ckpt_dir")
  assert sorted(os.listdir(ckpt)) == ["1"]


@pytest.mark.slow  # two training processes (~30 s each case)
@pytest.mark.parametrize("victim, line", [
    (1, "process 0 of 2: lost process 1 (no heartbeat for 5 s"),  # found by process 0's peer watch
    (0, "process 1 of 2: lost a process of the run (JAX's distributed runtime aborted this one"),  # its supervisor
])
def test_a_killed_process_ends_its_peer_within_seconds_with_one_line(tmp_path, victim, line):
  """kill -9 of one process of a --num-processes 2 run: the other printed a Gloo traceback, stalled ~60 s and aborted
  (exit 134). Now the peer watch finds a lost process within seconds, and the loss of the coordinator (process 0),
  which JAX's runtime answers by aborting the others at once, is one line from each one's supervisor: exit 1."""
  import socket

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.getcwd()}
  procs = [subprocess.Popen([*CLI[:5], "--epochs", "50", "--no-progress", "--mesh", "data=8", "--coordinator",
                             f"localhost:{port}", "--num-processes", "2", "--process-id", str(p)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
  try:
    for printed in procs[0].stdout:
      if printed.startswith("compiled in"):
        break
    time.sleep(1)
    procs[victim].kill()  # the process a user started (its supervisor): its training child dies with it
    killed_at = time.perf_counter()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=60)
    elapsed = time.perf_counter() - killed_at
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.communicate()
  lines = [text for text in own_stderr_lines(err) if "joining the run" not in text]
  assert survivor.returncode == 1 and elapsed < 15, (survivor.returncode, elapsed, err[-3000:])
  assert len(lines) == 1 and lines[0].startswith(line), err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("status,teardown", [(130, False), (143, False), (2, True)])
def test_an_interrupted_experiment_leaves_without_the_interpreters_teardown(status, teardown):
  """After SIGINT/SIGTERM the process ends by ``os._exit`` with its output flushed: the teardown beside XLA's compile
  threads, still running when Ctrl-C lands in the first compile, crashed (exit -11 after the one-line message).
  Other statuses leave as usual."""
  code = ("import atexit, sys; from experiments.flags import exit_with; atexit.register(print, 'teardown'); "
          f"print('the one line', file=sys.stderr, end=''); exit_with({status})")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
  assert done.returncode == status
  assert done.stderr.endswith("the one line")
  assert ("teardown" in done.stdout) == teardown
