"""Smoke tests of the benchmark scripts: each runs at its ``--quick`` (tiny) size, so none of them can rot.

Timings are benchmarks, not tests: these check that each script runs, writes the JSON keys the tables of
docs/benchmarks.md come from, and that the values are sane (positive ratios, the fitted depth exponent of ``none``
≈ 1), not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import common, policy_sweep, report_speed, runner_overhead, structure_depth, truth_check  # noqa: E402

pytestmark = pytest.mark.slow

RECORD_KEYS = {"benchmark", "date_utc", "machine", "versions", "args", "wall_s", "cpu_s"}


def _run(module, tmp_path, *extra):
  out = tmp_path / f"{module.NAME}.json"
  data = module.main(["--quick", "--out", str(out), *extra])
  assert json.loads(out.read_text()) == json.loads(json.dumps(data))
  assert RECORD_KEYS <= set(data)
  assert data["machine"]["cpu_count"] >= 1 and len(data["machine"]["loadavg_end"]) == 3
  assert data["versions"]["jax"]
  return data


def test_policy_sweep(tmp_path):
  data = _run(policy_sweep, tmp_path)
  rows = {r["label"]: r for r in data["rows"]}
  assert list(rows)[0] == "none" and {"nothing_saveable", "nothing_saveable + nested:2"} <= set(rows)
  for r in rows.values():
    assert r["temp_bytes"] > 0 and r["flops"] > 0 and r["step_time_s"] > 0 and r["step_time_vs_none"] > 0
    assert len(r["step_time_ratios"]) == data["rounds"] == 2
  assert rows["none"]["temp_vs_none"] == rows["none"]["flops_vs_none"] == 1
  assert rows["nothing_saveable"]["temp_vs_none"] < 1 < rows["nothing_saveable"]["flops_vs_none"] <= 4 / 3
  assert data["reference"]["full_flops_within_bound"] is True
  assert data["reference"]["activation_floor_bytes"] > 0


def test_structure_depth(tmp_path):
  data = _run(structure_depth, tmp_path)
  rows = {r["label"]: r for r in data["rows"]}
  assert set(rows) == {"none", "full", "nested"} and data["depths"] == [2, 4, 8]
  assert 0.8 <= rows["none"]["fit_activation"]["p"] <= 1.2  # no remat: activations grow linearly with depth
  assert all(r["activation_bytes"]["8"] == r["temp_bytes"]["8"] - r["base_temp_bytes"]["8"] for r in rows.values())
  assert rows["nested"]["temp_bytes"]["8"] < rows["none"]["temp_bytes"]["8"]
  assert all(v >= 1 for v in rows["nested"]["flops_vs_none"].values())
  assert os.path.getsize(tmp_path / "structure_depth.png") > 0


def test_runner_overhead(tmp_path):
  data = _run(runner_overhead, tmp_path, "--steps-per-round", "3")
  (row,) = data["rows"]
  assert row["ratio"] > 0 and row["runner_steps_per_s"] > 0 and row["hand_steps_per_s"] > 0
  check = row["compile_check"]
  assert check["ok"], check  # nothing compiles after the first epoch, nothing compiles twice
  assert check["compiles"]["setup"]  # the train step compiled before training (the log is really captured)


def test_faults(tmp_path):
  from benchmarks import faults

  data = _run(faults, tmp_path)
  for part in ("kill", "signal"):
    assert data[part]["runs_lost"] == 0 and data[part]["bit_identical"], data[part]
  assert data["pairs"]["lost"] == 0 and data["pairs"]["bit_identical"], data["pairs"]
  assert [sorted(codes) for codes in data["pairs"]["codes"]] == [[0, 2]]


def test_fault_cases(tmp_path):
  from benchmarks import fault_cases

  data = _run(fault_cases, tmp_path)
  assert [c["name"] for c in data["cases"]] == [n for n, (_, _, quick) in fault_cases.CASES.items() if quick]
  assert all(c["held"] for c in data["cases"]), [c for c in data["cases"] if not c["held"]]


def test_report_speed(tmp_path):
  data = _run(report_speed, tmp_path)
  assert [r["policy"] for r in data["rows"]] == ["none", "nothing_saveable", "save_only_these_names:mlp_out"]
  assert data["policies"] == 3 and data["distinct"] == 2  # mlp_out saves nothing nothing_saveable does not
  none, full, named = data["rows"]
  assert named["same_program_as"] == "nothing_saveable" and named["temp_bytes"] == full["temp_bytes"]
  assert named["twin_s"] is None and none["twin_s"] > 0 and full["twin_s"] > 0
  assert data["report_wall_s"] > data["import_s"] > 0
  assert data["ratio"] == pytest.approx(data["report_wall_s"] / data["floor_s"])
  assert data["jax_ratio"] == pytest.approx(data["report_wall_s"] / data["jax_floor_s"])
  for row in (none, full):  # the JAX + NNX twin is the same program (to a few scalars); the plain-JAX one is close
    assert abs(row["twin_temp_bytes"] - row["temp_bytes"]) <= 1024
    assert row["jax_twin_temp_bytes"] == pytest.approx(row["temp_bytes"], rel=0.05)
    assert set(row["stages_s"]) == set(report_speed.STAGES) and row["stages_s"]["compile"] > 0


def test_truth_check(tmp_path):
  data = _run(truth_check, tmp_path)
  assert [r["policy"] for r in data["rows"]] == ["none", "nothing_saveable"]
  for r in data["rows"]:
    assert r["status"] == "ok" and r["footprint_bytes"] > 0
    assert r["ratio"] is None or r["ratio"] > 0  # None where /proc cannot be written


def test_bad_flag_is_one_line_exit_2():
  done = subprocess.run([sys.executable, "benchmarks/structure_depth.py", "--depths", "4"], cwd=ROOT,
                        capture_output=True, text=True)
  (line,) = common.own_stderr_lines(done.stderr)
  assert done.returncode == 2 and line.startswith("python benchmarks/structure_depth.py: error: --depths needs")


def test_gpu_script_parses():
  assert subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu.sh")]).returncode == 0


def test_readme_tables_equal_the_committed_json():
  from benchmarks import readme

  for page, modules in readme.PAGES.items():
    with open(page) as f:
      text = f.read()
    assert readme.rendered_readme(text, modules=modules) == text, f"{page} is stale: run python benchmarks/readme.py"
    for module in modules:  # every committed result has its table on its page
      path = os.path.join(ROOT, "benchmarks", "results", f"{module.NAME}.json")
      if os.path.exists(path):
        with open(path) as f:
          block = module.render(json.load(f))
        assert f"<!-- benchmark:{module.NAME} -->\n{block}\n<!-- /benchmark:{module.NAME} -->" in text


def test_budget_plans(tmp_path):
  from benchmarks import budget_plans

  out = tmp_path / "budget_plans.json"
  data = budget_plans.main(["--quick", "--no-plot", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(data))
  entries = {e["budget_percent"]: e for e in data["budgets"]}
  assert set(entries) == {10, 70, 100}
  assert entries[100]["feasible"] and entries[100]["policy"] == "none" and entries[100]["flops_ratio"] == 1
  for entry in entries.values():
    if entry["feasible"]:
      assert entry["temp_bytes"] <= entry["limit_bytes"] and entry["seconds_in_compiles"] > 0
      if entry["best_fixed"] is not None:  # never more recompute than the best fixed policy that fits
        assert entry["flops_ratio"] <= entry["best_fixed"]["flops_ratio"] + 1e-9
    else:
      assert entry["minimum_bytes"] > entry["limit_bytes"]


@pytest.mark.parametrize("bad", ["0", "150", "nan"])
def test_budget_plans_bad_budgets_exit_2(bad, capsys):
  from benchmarks import budget_plans

  with pytest.raises(SystemExit) as info:
    budget_plans.main(["--budgets", bad])
  assert info.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--rounds", "0"], "--rounds must be ≥ 1 (got --jobs 1, --rounds 0)"),  # was silently the default (2)
    (["--preset", "huge"], "--preset 'huge': valid presets: tiny, small, gpt2-small"),
    (["--three", "--policies", "none"], "give --three or --policies, not both"),
])
def test_report_speed_bad_flags_exit_2_before_any_work(argv, match, capsys, tmp_path):
  with pytest.raises(SystemExit) as info:
    report_speed.main([*argv, "--out", str(tmp_path / "x.json")])
  err = capsys.readouterr().err
  assert info.value.code == 2 and match in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, match", [
    ([], "PRESET POLICY… (PRESET: tiny, small, gpt2-small)"),
    (["--help"], "PRESET '--help' is not one of tiny, small, gpt2-small"),
    (["tiny", "attn=nothing_saveable"], "no policy 'attn=nothing_saveable'; valid: none, nothing_saveable"),
])
def test_twins_bad_arguments_exit_2_with_one_line(argv, match, capsys):
  from benchmarks import nnx_gpt, plain_gpt

  for twin in (nnx_gpt, plain_gpt):
    with pytest.raises(SystemExit) as info:
      twin.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and match in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_fit_planner_quick(tmp_path):
  from benchmarks import fit_planner

  record = fit_planner.main(["--quick", "--out", str(tmp_path / "fit.json")])
  assert record["rows"]
  for row in record["rows"]:  # the planner's verified answer is the binary search's, in fewer compiles
    assert row["planner"] == row["search"] and row["planner_compiles"] < row["search_compiles"]
    assert row["footprint_bytes"] <= row["limit_bytes"] < row["over_bytes_at_next"]


def test_published_rows_are_valid_llm_configurations():
  """Every row of benchmarks/published_configs.py builds (abstractly) with its blocks and sequence, its policy validates
  against the LLM family's checkpoint names, and its batch is per-chip × chips — no compile (the rows are 256-chip
  TPU programs: minutes each, a benchmark)."""
  from benchmarks import published_configs
  from flax import nnx

  import jaxckpt
  from jaxckpt.names import DECODER_NAMES
  from jaxckpt.sharding import get_topology

  assert [r.key for r in published_configs.ROWS] == ["T1", "T2", "T3", "T4", "T5", "T6", "T7", "T8", "T11", "T12",
                                                      "T13", "T17", "T18", "T19", "T20"]
  for row in published_configs.ROWS:
    target, chips = published_configs.target(row, num_layers=2)
    assert chips == get_topology(row.topology).chips
    assert target.batch["tokens"].shape == (row.per_device * chips, row.seq_len + 1), row.key
    model = nnx.eval_shape(target.make_model)
    assert jaxckpt.parse_policy(row.policy).validate({"decoder": set(DECODER_NAMES)}) is not None, row.key
    assert model.seq_len == row.seq_len


def test_step_time_rows_have_published_rates_flags_and_a_table():
  """benchmarks/step_time.py: every row with a published throughput (T1–T8, T13) has its rate parsed, MaxText's flags,
  its model's depth; the table renders from a record (no compile: each row is a multi-minute TPU program)."""
  from benchmarks import step_time

  rows = {r.key: r for r in step_time.PUBLISHED_ROWS if r.key in step_time.ROW_KEYS}
  assert list(rows) == list(step_time.ROW_KEYS) and set(step_time.MAXTEXT_FLAGS) == set(rows)
  assert [step_time.published_tokens(rows[k]) for k in step_time.ORDER] == [960, 942, 921, 877]
  assert step_time.real_layers(rows["T4"]) == 80 and step_time.real_layers(rows["T13"]) == 32
  estimate = {"schedule": {"terms": {"compute": 2.0, "collectives:ici": 0.5, "host:to_host": 1.0}, "bound": "compute",
                           "exposed": {"host:to_host": 0.25}, "seconds": 2.5},
              "roofline": {"tokens_per_s_chip": 20000.0}}
  record = {"date_utc": "2026-12-05 00:00", "machine": {"cpu_count": 2, "backend": "cpu", "loadavg_start": [1.0],
                                                       "loadavg_end": [1.0]}, "wall_s": 1.0,
            "cpu_s": 1.0, "layers": 4, "full_depth": [],
            "rows": [{"key": "T13", "preset": "mistral-7b", "topology": "v6e:2x4", "seq_len": 8192, "per_device": 6,
                      "predicted_tokens_per_s_chip": 19660.8, "published_tokens_per_s_chip": 7777.0,
                      "error": 19660.8 / 7777 - 1, "estimates": estimate}]}
  table = step_time.render(record)
  assert "| T13 | mistral-7b | v6e:2x4 | 8192 × 6 | 19,661 | 7,777 | +152.8% | compute | 2.50 | 2.00 |" in table
  assert "0.50 (0.00) | 1.00 (0.25) | 20,000 (+157.2%) |" in table and "Within ±15% of the published: 0 of 1." in table
