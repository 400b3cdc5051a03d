"""The step-time model where decisions are made: ``jaxckpt-report`` gives each policy's estimated step
time, its bound and the seconds its recomputation costs; ``jaxckpt-fit`` ranks a global batch's configurations by
their compiled programs' estimates. Compiled for one H100 node without a GPU (the ``[gpu]`` extra)."""

from __future__ import annotations

import json

import pytest

from jaxckpt.cli import fit as fit_main, report as report_main
from jaxckpt.errors import JaxckptError
from jaxckpt.fit import plan_fit
from jaxckpt.step import shipped_target
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
  # Full remat runs the forward pass again: more matmul work, a longer step, the difference its recompute seconds.
  assert est["nothing_saveable"]["terms"]["compute"] > est["none"]["terms"]["compute"]
  assert est["nothing_saveable"]["recompute_s"] == pytest.approx(est["nothing_saveable"]["seconds"]
                                                                 - est["none"]["seconds"])
  assert est["nothing_saveable"]["recompute_s"] > est["dots_saveable"]["recompute_s"]
  notes = out.replace("\n  ", " ").splitlines()  # a note wrapped to the width continues indented
  line = next(x for x in notes if x.startswith("est. step nothing_saveable: "))
  assert f"bound by {est['nothing_saveable']['bound']} (" in line


@needs_cuda_plugin
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
  assert "compiled est." in out and "winner's compiled step: " in out


@needs_cuda_plugin
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
