"""The step-time model where decisions are made: ``jaxckpt-report`` gives each policy's estimated step
time, its bound and the seconds its recomputation costs; ``jaxckpt-fit`` ranks a global batch's configurations by
their compiled programs' estimates. Compiled for one H100 node without a GPU (the ``[gpu]`` extra)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxckpt.cli import fit as fit_main, report as report_main
from jaxckpt._units import format_seconds
from jaxckpt.errors import JaxckptError
from jaxckpt.fit import plan_fit
from jaxckpt.models import model_entry
from jaxckpt.models.llm import LLM_PRESETS
from jaxckpt.report import build_report
from jaxckpt.step import ModelTarget, shipped_target
from tests.extras import needs_cuda_plugin

NODE = "h100:8"
TINY = ["--model", "llm", "--preset", "llama-tiny"]


@needs_cuda_plugin
def test_the_report_gives_each_policys_compiled_step_time_and_its_recompute_seconds(tmp_path, capsys):
  path = tmp_path / "report.json"
  assert report_main([*TINY, "--batch-size", "8", "--topology", NODE, "--policies", "none", "nothing_saveable",
                      "dots_saveable", "--no-residuals", "--no-progress", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  est = {r["policy"]: r["step_time_estimate"] for r in json.loads(path.read_text())["rows"]}
  for e in est.values():
    assert e["seconds"] > 0 and e["bound"] in e["terms"] and e["terms"]["collectives:nvlink"] > 0, e
  assert est["none"]["recompute_s"] == 0
  assert est["nothing_saveable"]["recompute_s"] == pytest.approx(est["nothing_saveable"]["seconds"]
                                                                 - est["none"]["seconds"])
  notes = out.replace("\n  ", " ").splitlines()  # a note wrapped to the width continues indented
  line = next(x for x in notes if x.startswith("est. step nothing_saveable: "))
  assert f"bound by {est['nothing_saveable']['bound']} (" in line
  basis = next(x for x in notes if x.startswith("est. step rests on: "))
  assert "cuBLAS at 76.3% of 989 TFLOP/s" in basis and "nvlink 414 GB/s" in basis, basis


@needs_cuda_plugin
@pytest.mark.slow
def test_recomputation_costs_time_on_a_gpu_node_where_the_matmuls_are_not_launch_bound():
  """A 2-layer Llama 2048 wide with flash attention, 2 × 1024 tokens per GPU (GEMMs of tens of µs, not launch-bound):
  full remat runs the forward matmuls again, so its compute term exceeds none's by about those matmuls' FLOPs at the
  rate cuBLAS sustains, and its step is no shorter than none's. dots_saveable keeps the matmuls' outputs: its compute
  is none's. (Its step may be shorter than none's: it writes and reads fewer residuals, and the elementwise work it
  recomputes is fused into the backward pass; docs/timing.md.) The estimate reads the cuBLAS calls' FLOPs, and the
  unrolled twin of the step gets the scanned one's estimate within 10%."""
  entry = model_entry("llm")
  config = dataclasses.replace(LLM_PRESETS["llama-tiny"], num_layers=2, dim=2048, num_heads=16, num_kv_heads=8,
                               head_dim=128, mlp_dim=5632, seq_len=1024, compute_dtype="bfloat16", attention="pallas")
  target = ModelTarget(make_model=lambda: entry.build(config), batch=entry.batch(16, config), loss_fn=entry.loss_fn,
                       name="llm")
  report = build_report(target, ["none", "full", "dots_saveable"], topology=NODE, mesh="data=8", residuals=False,
                        progress=False)
  rows = {r["policy"]: r for r in report.rows}
  est = {p: r["step_time_estimate"] for p, r in rows.items()}
  full, dots, none = est["nothing_saveable"], est["dots_saveable"], est["none"]
  recomputed = (full["flops"] - none["flops"]) / (989e12 * 755 / 989)  # the extra GEMM FLOPs per GPU, sustained
  assert full["terms"]["compute"] - none["terms"]["compute"] == pytest.approx(recomputed, rel=0.25)
  assert dots["terms"]["compute"] == pytest.approx(none["terms"]["compute"], rel=0.01)
  assert full["recompute_s"] >= 0, full["recompute_s"]
  # the cuBLAS calls carry their FLOPs: the compiled program's matmul and attention FLOPs per GPU are the jaxpr's
  assert full["flops"] == pytest.approx(rows["nothing_saveable"]["flops"] / 8, rel=0.05)
  # the same step with its layers unrolled is the same work: its estimate within 10% of the scanned one's
  unrolled = dataclasses.replace(config, scan=False)
  twin = ModelTarget(make_model=lambda: entry.build(unrolled), batch=entry.batch(16, unrolled), loss_fn=entry.loss_fn,
                     name="llm")
  row = build_report(twin, ["full"], topology=NODE, mesh="data=8", residuals=False, progress=False).rows[0]
  assert row["step_time_estimate"]["seconds"] == pytest.approx(full["seconds"], rel=0.10)


@needs_cuda_plugin
@pytest.mark.slow
def test_the_fit_ranks_the_fastest_configurations_by_their_compiled_programs(tmp_path, capsys):
  path = tmp_path / "fit.json"
  assert fit_main([*TINY, "--topology", NODE, "--mesh", "data=8", "--global-batch-size", "64", "--policies", "none",
                   "nothing_saveable", "--rank-compiled", "2", "--no-progress", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  choice = json.loads(path.read_text())["global_batch"]
  assert choice["ranked_by"] == "compiled"
  timed = [c for c in choice["table"] if c["compiled_step"]]
  assert len(timed) == 2 and timed == choice["table"][:2]  # the timed ones first, fastest compiled estimate first
  assert timed[0]["compiled_step"]["seconds"] <= timed[1]["compiled_step"]["seconds"]
  assert choice["compiled_step"] == timed[0]["compiled_step"] and choice["policy"] == timed[0]["policy"]
  assert "winner's compiled step: " in out
  # one step-time column: each configuration's compiled estimate, the roofline's only where none was compiled (≈)
  table = out[out.index("global batch 64 on"):]
  header = next(line for line in table.splitlines() if line.lstrip().startswith("policy"))
  assert header.count("est. step") == 1 and "compiled est." not in out, header
  winner = next(line for line in out.splitlines() if line.startswith("* "))
  assert format_seconds(choice["compiled_step"]["seconds"]) in winner, winner


@needs_cuda_plugin
@pytest.mark.slow
def test_rank_compiled_zero_is_the_roofline_alone():
  plan = plan_fit(shipped_target("llm", "llama-tiny"), ["none", "nothing_saveable"], global_batch=64,
                  topology=NODE, mesh="data=8", rank_compiled=0)
  assert plan.choice.ranked_by == "estimate" and all(c.compiled_step is None for c in plan.choice.table)
  assert plan.choice.winner.step_s == plan.choice.winner.est_step_s


def test_bad_rank_compiled_is_one_line(capsys):
  with pytest.raises(JaxckptError, match=r"rank_compiled=-1 must be ≥ 0"):
    plan_fit(shipped_target("llm", "llama-tiny"), ["none"], global_batch=8, rank_compiled=-1)
  for argv, message in ((["--topology", NODE, "--global-batch-size", "64", "--rank-compiled", "-1"],
                         "--rank-compiled -1 must be ≥ 0"),
                        (["--global-batch-size", "64", "--rank-compiled", "2"],
                         "--rank-compiled 2 times the configurations of a --global-batch-size compiled for a "
                         "--topology: give --topology"),
                        (["--topology", NODE, "--global-batch-size", "64", "--device", "v5e"],
                         "--device v5e times another chip than --topology h100:8 compiles for (h100): drop --device")):
    assert fit_main([*TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_configurations_within_the_resolution_are_named_a_tie():
  """Two estimates closer than ``RESOLUTION`` (the spread of the model's errors among one model's published rows) are
  a tie to the time model: the fit's compiled notes name the runner-up with how much slower it is, and not one
  beyond it."""
  from jaxckpt.fit._plan import GlobalChoice
  from jaxckpt.fit._speed import Candidate
  from jaxckpt.fit._tables import compiled_lines
  from jaxckpt.timing import RESOLUTION, within_resolution

  assert RESOLUTION == 0.04
  assert within_resolution(1.03, 1.0) == pytest.approx(0.03) and within_resolution(1.05, 1.0) is None

  def cand(policy, seconds):
    return Candidate(policy, 4, 2, 1 << 30, True, 1e15, None, 9.0,
                     compiled_step={"seconds": seconds, "bound": "compute", "terms": {"compute": seconds},
                                    "exposed": {}})

  winner, close, far = cand("full", 2.0), cand("dots_saveable", 2.06), cand("none", 2.2)
  lines = compiled_lines(GlobalChoice(8, winner, 1 << 30, (winner, close, far), ranked_by="compiled"))
  assert lines[-1].startswith("within 4% of the winner's estimate, a tie to the time model")
  assert lines[-1].endswith(": dots_saveable 4 × 2 (+3.0%)")
  assert not any("tie" in line for line in compiled_lines(GlobalChoice(8, winner, 1 << 30, (winner, far))))
