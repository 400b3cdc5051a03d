"""The fit planner (jaxckpt.fit): the planned batch fits and the next does not, by an independent compile; bad input
exits 2 with one line; the JSON keys scripts read."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import jaxckpt
from jaxckpt.errors import JaxckptError
from jaxckpt.fit import (AffineModel, NothingFitsError, accelerator, candidates, fit_affine, max_batch_size,
                         with_batch)
from jaxckpt.cli._fit import main
from jaxckpt.step import LossTarget, compile_policy, shipped_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEMORY = "1000KiB"  # mlp tiny: none fits ~30 examples, nothing_saveable ~75


def footprint(target, policy: str, batch: int) -> int:
  """The compiled footprint at ``batch``, compiled here without jaxckpt.fit."""
  sized = shipped_target("mlp", "tiny", batch_size=batch) if target is None else with_batch(target, batch)
  return compile_policy(sized, jaxckpt.parse_policy(policy)).memory["footprint_bytes"]


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory):
  path = tmp_path_factory.mktemp("fit") / "fit.json"
  out = io.StringIO()
  with mock.patch.dict(os.environ, {"COLUMNS": "100"}), contextlib.redirect_stdout(out):
    code = main(["--model", "mlp", "--memory", MEMORY, "--policies", "none", "--global-batch-size", "32",
                 "--device", "h100", "--json", str(path), "--html", str(path.with_suffix(".html")), "--no-progress"])
  assert code == 0
  path.with_suffix(".txt").write_text(out.getvalue())
  return json.loads(path.read_text())


def test_tables_fit_the_terminal(cli_json, tmp_path_factory):
  text = (tmp_path_factory.getbasetemp() / "fit0" / "fit.txt").read_text()
  assert max(len(line) for line in text.splitlines() if not line.startswith(("wrote ", "  "))) <= 100
  assert "largest micro-batch within" in text and "* none" in text and "--grad-accum-steps" in text


def test_planned_batch_fits_and_next_does_not(cli_json):
  row = cli_json["rows"][0]
  assert set(row) >= {"policy", "max_batch_size", "footprint_bytes", "compiles"}
  assert row["policy"] == "none" and row["compiles"] <= 6
  b, limit = row["max_batch_size"], cli_json["limit_bytes"]
  assert limit == 1000 * 1024 and 8 <= b < 100
  at_b, at_next = footprint(None, "none", b), footprint(None, "none", b + 1)
  assert at_b == row["footprint_bytes"] <= limit < at_next


def test_global_batch_choice_json(cli_json):
  choice = cli_json["global_batch"]
  assert set(choice) >= {"global_batch_size", "policy", "micro_batch_size", "grad_accum_steps", "flags", "table"}
  b, k = choice["micro_batch_size"], choice["grad_accum_steps"]
  assert b * k == 32 and b <= cli_json["rows"][0]["max_batch_size"]
  assert choice["footprint_bytes"] <= cli_json["limit_bytes"]  # compiled with its accumulation
  times = [c["est_step_s"] for c in choice["table"]]
  assert choice["est_step_s"] == min(times)
  assert choice["flags"] == f"--policy none --batch-size 32 --grad-accum-steps {k}"


def test_html_page_has_the_rows_and_the_plot(cli_json, tmp_path_factory):
  page = (tmp_path_factory.getbasetemp() / "fit0" / "fit.html").read_text()
  row = cli_json["rows"][0]
  assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "table class=\"sortable\"" in page
  # the per-policy row: policy, largest batch (sortable by its raw value), compiles
  assert f'<td class="text">none</td><td data-sort="{row["max_batch_size"]}">{row["max_batch_size"]}</td>' in page
  assert f'data-sort="{row["compiles"]}">{row["compiles"]}</td>' in page
  choice = cli_json["global_batch"]
  assert page.count("<tr>") == 1 + 1 + 1 + len(choice["table"])  # two header rows, one policy, the candidates
  assert choice["flags"] in page


def test_spread_spans_policies_and_micro_batches():
  from jaxckpt.fit import Candidate, spread  # noqa: PLC0415

  table = [Candidate(p, b, 64 // b, 0, True, 1.0, None, t) for t, (p, b) in enumerate(
      [("a", 32), ("a", 16), ("a", 64), ("a", 8), ("b", 16), ("b", 8), ("a", 4), ("c", 2)])]
  # the best estimate, each other policy's best, then a policy's next best at another micro-batch octave
  assert [(c.policy, c.micro_batch) for c in spread(table, 4)] == [("a", 32), ("a", 16), ("b", 16), ("c", 2)]
  assert [(c.policy, c.micro_batch) for c in spread(table, 5)] == [("a", 32), ("a", 16), ("b", 16), ("b", 8),
                                                                   ("c", 2)]
  assert spread(table, 1) == [table[0]] and spread(table, 20) == table


def test_bandwidth_by_working_set_and_calibrate_is_cached():
  from jaxckpt.fit import Accelerator, calibrate  # noqa: PLC0415

  dev = Accelerator("x", 1e9, 1e9, 0.0, None, ((2**20, 4e9), (2**24, 2e9)))
  assert dev.bandwidth_at(None) == 1e9 and dev.bandwidth_at(2**10) == 4e9 and dev.bandwidth_at(2**30) == 2e9
  assert dev.bandwidth_at(2**22) == pytest.approx(3e9)  # halfway in log size
  assert dev.micro_step_s(0.0, 4e9, 2**20) == pytest.approx(1.0)  # 4 GB at 4 GB/s, compute-free
  cpu = calibrate(repeats=1)
  assert calibrate(repeats=1) is cpu  # measured once per process
  assert cpu.peak_flops > 1e8 and cpu.overhead_s > 0 and len(cpu.bandwidth_curve) == 4
  assert all(b > 1e7 for _, b in cpu.bandwidth_curve) and cpu.bandwidth == cpu.bandwidth_curve[-1][1]
  assert accelerator("cpu", bandwidth=5e9).bandwidth_at(2**20) == 5e9  # a given bandwidth holds at every size


@pytest.mark.slow
def test_measure_ranks_by_measured_time():
  from jaxckpt.fit import plan_fit  # noqa: PLC0415

  plan = plan_fit(shipped_target("mlp", "tiny"), ["none", "nothing_saveable"], MEMORY, global_batch=32,
                  device=accelerator("h100"), measure=3)
  c = plan.choice
  assert c.ranked_by == "measured" and len(c.measured) == 3
  assert {m.policy for m in c.measured} == {"none", "nothing_saveable"}  # spread over the policies
  key = lambda m: (m.policy, m.micro_batch)  # noqa: E731
  assert key(c.measured[0]) == key(c.table[0])  # the fastest estimate is always timed
  assert c.winner == min(c.measured, key=lambda m: m.measured_step_s) and c.winner.measured_step_s > 0
  assert c.footprint_bytes <= plan.limit_bytes and c.spearman is not None


def test_affine_model():
  model = fit_affine([(16, 1000 + 16 * 7), (64, 1000 + 64 * 7)])
  assert model.intercept == pytest.approx(1000) and model.slope == pytest.approx(7)
  assert model.largest_within(1000 + 7 * 50 + 3) == 50
  assert model.largest_within(1000 + 7 * 50 + 3, step=8) == 48
  with pytest.raises(JaxckptError, match="does not grow with the batch"):
    AffineModel(1000.0, 0.0, ((16, 1000), (64, 1000))).largest_within(2000)


def test_with_batch_resizes_a_loss_target():
  x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
  target = LossTarget(lambda p, b, *, policy: jnp.sum(b["x"] @ p), params=jax.ShapeDtypeStruct((3,), jnp.float32),
                      batch={"x": x, "seed": jax.ShapeDtypeStruct((), jnp.uint32)})
  sized = with_batch(target, 10)
  assert sized.batch["x"].shape == (10, 3) and sized.batch["seed"].shape == ()
  with pytest.raises(JaxckptError, match="no gradient accumulation"):
    with_batch(target, 10, grad_accum_steps=2)
  with pytest.raises(JaxckptError, match="no batch axis"):
    max_batch_size(LossTarget(lambda p, b, *, policy: p @ p, params=jax.ShapeDtypeStruct((3,), jnp.float32),
                              batch={"seed": jax.ShapeDtypeStruct((), jnp.uint32)}), "none", "1GiB")


def test_nothing_fits_names_the_least_footprint(capsys):
  assert main(["--model", "mlp", "--memory", "64KiB", "--policies", "none", "--max-batch", "1",
               "--no-progress"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert "fits no policy even at batch size 1" in err and "with policy none" in err


@pytest.mark.parametrize("argv, needle", [
    (["--min-batch", "10", "--max-batch", "5"], "batch range is empty"),
    (["--min-batch", "8", "--global-batch-size", "6"], "--global-batch-size 6: no micro-batch"),
    (["--memory", "16GB"], "bad size '16GB'"),
    (["--batch-size", "8"], "what jaxckpt-fit chooses"),
    (["--policies", "budget:1GiB"], "the nothing_saveable row"),
    (["--global-batch-size", "8", "--device", "k80"], "--device 'k80' is unknown"),
    (["--global-batch-size", "8", "--device", "k80"], "(or give --peak-flops FLOPS and --bandwidth BYTES_PER_S)"),
    (["--device", "h100"], "give --global-batch-size G"),  # was ignored silently without a global batch
    (["--html", "fit.txt"], "--html fit.txt: use a .html file"),
])
def test_bad_input_exits_2(capsys, argv, needle):
  assert main(["--model", "mlp", "--no-progress", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("jaxckpt-fit: error:")
  if needle:
    assert needle in err


def test_global_batch_no_divisor():
  from jaxckpt.fit._search import BatchFit  # noqa: PLC0415

  # micro-batches 2 and 4 fit (a data=2 mesh: multiples of 2); G=7 is reachable by neither
  fit = BatchFit(policy="none", max_batch_size=4, footprint_bytes=10, limit_bytes=100, compiles=4,
                 model=AffineModel(0.0, 1.0), points=(), method="affine", capped=False, verified_over=None, unit=2,
                 seconds=0.0)
  with pytest.raises(JaxckptError, match="global_batch_size=7: no micro-batch that fits divides it"):
    candidates([fit], 7, accelerator("h100"))


def test_mesh_that_does_not_divide_the_batch_exits_2():
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
  done = subprocess.run([sys.executable, "-m", "jaxckpt.fit", "--model", "mlp", "--mesh", "data=4",
                         "--global-batch-size", "6", "--memory", "1GiB", "--no-progress"],
                        capture_output=True, text=True, env=env, cwd=ROOT)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("jaxckpt-fit: error: --global-batch-size 6 cannot be split")


@pytest.mark.slow
def test_own_nnx_and_linen_models():
  from tests import own_models  # noqa: PLC0415

  for target in (own_models.decoder_target(), own_models.linen_lm_target()):
    fit = max_batch_size(target, "nothing_saveable", 16 * 2**20, max_batch=512)
    b = fit.max_batch_size
    assert b is not None and fit.compiles <= 6
    assert footprint(target, "nothing_saveable", b) <= 16 * 2**20 < footprint(target, "nothing_saveable", b + 1)


@pytest.mark.slow
def test_mesh_memory_per_device(tmp_path):
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  out = tmp_path / "fit.json"
  done = subprocess.run([sys.executable, "-m", "jaxckpt.fit", "--model", "gpt", "--mesh", "data=2,fsdp=4",
                         "--memory", "4MiB", "--policies", "none", "--json", str(out), "--no-progress"],
                        capture_output=True, text=True, env=env, cwd=ROOT)
  assert done.returncode == 0, done.stderr
  row = json.loads(out.read_text())["rows"][0]
  assert row["max_batch_size"] % 8 == 0 and row["footprint_bytes"] <= 4 * 2**20 < row["over_bytes_at_next"]


def test_nothing_fits_error_is_a_jaxckpt_error():
  assert issubclass(NothingFitsError, JaxckptError)


def test_experiment_fit_flags_bad_input(capsys):
  from experiments import lm  # noqa: PLC0415

  assert lm.main(["--global-batch-size", "16", "--grad-accum-steps", "2", "--steps", "1"]) == 2
  assert "--global-batch-size 16 chooses the batch size and accumulation; drop --grad-accum-steps" in \
      capsys.readouterr().err
  assert lm.main(["--batch-size", "auto", "--policy", "budget:1GiB", "--steps", "1"]) == 2
  assert "is a memory budget for one batch size" in capsys.readouterr().err


@pytest.mark.slow
def test_experiment_global_batch_size_recorded(tmp_path):
  from experiments import lm  # noqa: PLC0415

  out = tmp_path / "run"
  assert lm.main(["--preset", "tiny", "--global-batch-size", "16", "--memory", "8MiB", "--policy", "auto",
                  "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--corpus-max-mib", "0.2",
                  "--out", str(out), "--no-progress"]) == 0
  metrics = json.loads((out / "metrics.json").read_text())
  fit = metrics["config"]["fit"]
  assert fit["batch_size"] == 16 == metrics["config"]["batch_size"]
  assert fit["micro_batch_size"] * fit["grad_accum_steps"] == 16
  assert metrics["config"]["policy"] == fit["policy"] and fit["footprint_bytes"] <= 8 * 2**20


def test_parabola_corrects_a_curved_footprint():
  from jaxckpt.fit._model import tangent_at_crossing  # noqa: PLC0415

  curve = lambda t: 1000 + 3 * t + 0.01 * t * t  # noqa: E731 - attention's T² term
  points = [(t, int(curve(t))) for t in (256, 1024, 300)]
  truth = max(t for t in range(1, 2048) if curve(t) <= 6000)
  line = tangent_at_crossing(points, 6000, 300, 1024)
  assert abs(line.largest_within(6000) - truth) <= 1  # the chord through 300 and 1024 says 384
  assert fit_affine([points[2], points[1]]).largest_within(6000) < truth - 50
  assert tangent_at_crossing(points[:2], 6000, 300, 1024) is None  # two sizes: no parabola


def test_seq_len_search_needs_a_sequence_model():
  from jaxckpt.fit import max_seq_len  # noqa: PLC0415

  with pytest.raises(JaxckptError, match="seq_len"):
    max_seq_len(shipped_target("vit", "tiny"), "none", "1GiB")


@pytest.mark.slow  # a sequence-length search: compiles at several lengths
def test_max_seq_len_fits_and_next_does_not():
  from jaxckpt.fit import max_seq_len  # noqa: PLC0415

  tiny = {"batch_size": 1, "num_layers": 1}  # one GPT tiny layer: ~17 KB per token over ~0.2 MB, fast compiles
  limit = 3 * 2**20
  fit = max_seq_len(shipped_target("gpt", "tiny", **tiny), "nothing_saveable", limit, max_seq_len=512,
                    probes=(64, 256))
  length = fit.max_batch_size
  assert 64 < length < 256 and fit.compiles <= 8  # curved (attention grows as T²): a parabola step or two

  def at(seq_len: int) -> int:  # compiled here, without jaxckpt.fit
    sized = shipped_target("gpt", "tiny", seq_len=seq_len, **tiny)
    return compile_policy(sized, jaxckpt.parse_policy("nothing_saveable")).memory["footprint_bytes"]

  assert at(length) == fit.footprint_bytes <= limit < at(length + 1) == fit.verified_over


def test_time_model_terms_fsdp_collectives_and_host_transfers():
  """The pod-scale terms (jaxckpt.fit._speed): under fsdp=256 a v6e chip moves 3 × 255/256 of the parameter bytes
  per micro-step over ICI (two all-gathers and a reduce-scatter; the whole 16x16 torus: the chip's 400 GB/s), so 4 micro-steps of 1 cost 4 × that where 1 of 4
  costs it once; an offload policy's host bytes cross PCIe twice per micro-step. Each term is reported, the step is
  the largest plus the overhead."""
  from jaxckpt.fit._search import BatchFit, FitPoint  # noqa: PLC0415
  from jaxckpt.fit._speed import collective_bytes  # noqa: PLC0415

  params = 32e9  # an 8B model's float32 parameters, bytes
  per_micro, per_step = collective_bytes(params, {"fsdp": 256})
  assert per_micro == pytest.approx(3 * 255 / 256 * params) and per_step == 0.0
  assert collective_bytes(params, {"data": 4, "fsdp": 2})[1] == pytest.approx(2 * 3 / 4 * params / 2)
  assert collective_bytes(params, None) == (0.0, 0.0)

  v6e = accelerator("v6e")
  unit = 256  # the batch is split over 256 chips: micro-batches are multiples of 256
  points = tuple(FitPoint(b, 10 * 2**30 + b * 2**20, int(1e15 * b / unit), 1e12 * b / unit, 1.0,
                          host_bytes=int(2**30 * b / unit), param_bytes=int(params)) for b in (unit, 4 * unit))
  fit = BatchFit(policy="offload", max_batch_size=4 * unit, footprint_bytes=points[-1].footprint_bytes,
                 limit_bytes=32 * 2**30, compiles=2, model=AffineModel(2**20, 10 * 2**30),
                 points=points, method="affine", capped=False, verified_over=None, unit=unit, seconds=0.0)
  table = {c.micro_batch: c for c in candidates([fit], 4 * unit, v6e, mesh_shape={"fsdp": 256})}
  big, small = table[4 * unit], table[unit]
  assert (big.accum, small.accum) == (1, 4)
  assert small.terms["collectives_s"] == pytest.approx(4 * per_micro / v6e.ici_bandwidth)
  assert big.terms["collectives_s"] == pytest.approx(per_micro / v6e.ici_bandwidth)
  assert big.terms["host_s"] == pytest.approx(2 * 4 * 2**30 / v6e.host_bandwidth)
  assert big.terms["compute_s"] == pytest.approx(4e15 / unit / v6e.peak_flops)
  for cand in (big, small):
    ceilings = [cand.terms[k] for k in ("compute_s", "hbm_s", "host_s", "collectives_s")]
    assert cand.est_step_s == pytest.approx(max(ceilings) + cand.terms["overhead_s"])
  assert small.est_step_s > big.est_step_s and small.dominant == "collectives"


def test_progress_lines_in_a_log(capsys):
  """Not at a terminal (a log, CI), the fit prints one whole line per compile on stderr, so a long search is never
  silent; --no-progress turns them off."""
  assert main(["--model", "mlp", "--memory", "64MiB", "--policies", "full", "--max-batch", "64"]) == 0
  err = capsys.readouterr().err.splitlines()
  assert err and all(line.startswith("jaxckpt-fit: compile ") and " elapsed)" in line for line in err), err
  assert main(["--model", "mlp", "--memory", "64MiB", "--policies", "full", "--max-batch", "64", "--no-progress"]) == 0
  assert capsys.readouterr().err == ""


def test_a_candidate_over_the_memory_once_accumulated_is_counted_and_named():
  """The global batch's winner is verified by compiling it with its accumulation; a candidate that is then over the
  memory is dropped, counted among the refusals and named in the table and the JSON (it used to leave
  ``"refusals": 0``)."""
  from jaxckpt.fit._plan import _choose, FitPlan
  from jaxckpt.fit._speed import Candidate

  cands = [Candidate("none", 256, 4, 10, True, 1.0, None, 0.1), Candidate("full", 256, 4, 5, True, 1.3, None, 0.2)]

  class Verify:  # the fit's _Verifier: the footprint of each candidate compiled with its accumulation at G
    global_batch, compiles = 1024, 0

    def __call__(self, cand, *, time_it=False):
      self.compiles += 1
      return {"none": 120 << 30, "full": 30 << 30}[cand.policy], None

  choice = _choose(None, cands, Verify(), limit=64 << 30, timed=0, measure=0)
  assert choice.winner.policy == "full" and choice.dropped == (("none", 256, 4, 120 << 30),)
  assert choice.as_json()["dropped_for_memory"] == [{"policy": "none", "micro_batch_size": 256,
                                                     "grad_accum_steps": 4, "footprint_bytes": 120 << 30}]
  plan = FitPlan(fits=(), limit_bytes=64 << 30, memory_source="given", device=None, choice=choice, seconds=0.0)
  assert plan.refusals == 1 and plan.as_json()["refusals"] == 1
