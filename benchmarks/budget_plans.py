"""Benchmark: budget plans vs the best fixed built-in policy that fits, on the GPT ``small`` preset (compile only).

Usage: ``python benchmarks/budget_plans.py [--preset small] [--budgets 10 20 ... 100] [--quick] [--out FILE.json]``.

For each budget p% of no-remat temp: the plan (:func:`jaxckpt.planner.plan_policy`, planned from scratch, no shared
cache), its compiled temp and step FLOPs relative to ``none``, and the fixed built-in policies (``none``, ``full``,
the dots policies, ``save_only_these_names:<name>`` per name: the report's ``all``) that fit the same budget, with
the least-FLOPs one among them. Planning time is given in units of one compile of the step (the ``none`` compile
of the built-in sweep), the issue's "at most 6 compiles" target. Writes ``benchmarks/results/budget_plans.json``
(``--out``) and a PNG Pareto chart beside it; ``--quick`` plans the tiny MLP at 10, 70 and 100% (the smoke test).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from jaxckpt.errors import PolicySpecError  # noqa: E402
from jaxckpt.planner import InfeasibleBudgetError, plan_policy  # noqa: E402
from jaxckpt import Budget, parse_model_policy  # noqa: E402
from jaxckpt.report import build_report
from jaxckpt.step import shipped_target  # noqa: E402

NAME = "budget_plans"


def _count(match: re.Match) -> str:
  n = len(match.group(1).split("+"))
  return f"save_tensors:({n} tensor{'s' if n > 1 else ''})"


def _label(policy: str) -> str:
  """``policy`` with each ``save_tensors:`` list shortened to its count (the full string is in the JSON)."""
  short = re.sub(r"save_tensors:([^,;]+)", _count, policy)
  return f"`{short}`"


def render(data: Mapping[str, Any]) -> str:
  """The result as markdown: the run line and one row per budget (docs/plans.md)."""
  rows = []
  for e in data["budgets"]:
    fixed = ("none fits" if e["best_fixed"] is None else
             f"`{e['best_fixed']['policy']}` ×{e['best_fixed']['flops_ratio']:.4f}")
    budget = f"{e['budget_percent']:g}% ({e['limit_bytes'] / 2**20:.1f} MiB)"
    if e["feasible"]:
      rows.append([budget, _label(e["policy"]), f"{e['temp_bytes'] / 2**20:.1f} MiB", f"×{e['flops_ratio']:.4f}",
                   fixed, f"{e['compiles']} / {e['seconds_in_compiles']:.1f}"])
    else:
      rows.append([budget, f"infeasible: exit 2, least temp {e['minimum_bytes'] / 2**20:.1f} MiB", "—", "—", fixed,
                   "—"])
  none = data["none"]
  return "\n".join([
      f"Measured {common.header(data)}; {data['model']} `{data['preset']}`, none's temp "
      f"{none['temp_bytes'] / 2**20:.1f} MiB, one compile of the step {none['compile_s']:.1f} s:", "",
      common.markdown_table(["budget (temp ≤)", "plan", "compiled temp", "FLOPs vs none",
                             "best fixed built-in that fits", "compiles / time in compiles"], rows)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns what it writes as JSON (bytes, FLOPs, seconds)."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--model", default="gpt")
  parser.add_argument("--preset", default="small")
  parser.add_argument("--budgets", type=float, nargs="+", default=[10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
                      help="percent of no-remat temp, each in (0, 100]")
  parser.add_argument("--no-plot", dest="plot", action="store_false")
  args = parser.parse_args(argv)
  if args.quick:
    args.model, args.preset, args.budgets = "mlp", "tiny", [10, 70, 100]
  for pct in args.budgets:
    try:
      if not isinstance(parse_model_policy(f"budget:{pct:g}%"), Budget):
        raise PolicySpecError(f"--budgets {pct:g} is not a percentage", spec=str(pct), bad=str(pct))
    except PolicySpecError as err:
      parser.error(str(err))
  common.check_out(parser, NAME, args)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  target = shipped_target(args.model, args.preset)
  fixed = build_report(target, ["all"], residuals=False, progress=False)
  rows = [r for r in fixed.rows if r["status"] == "ok"]
  none = fixed.row("none")
  compile_s = none["compile_s"]
  results = []
  for pct in args.budgets:
    limit = int(pct / 100 * none["temp_bytes"])
    fits = [r for r in rows if r["temp_bytes"] <= limit]
    best_fixed = min(fits, key=lambda r: (r["flops"], r["temp_bytes"])) if fits else None
    entry = {"budget_percent": pct, "limit_bytes": limit,
             "best_fixed": None if best_fixed is None else {
                 "policy": best_fixed["policy"], "temp_bytes": best_fixed["temp_bytes"],
                 "flops_ratio": best_fixed["flops"] / none["flops"]}}
    try:
      plan = plan_policy(target, f"budget:{pct:g}%")
    except InfeasibleBudgetError as err:
      entry.update(feasible=False, error=str(err), minimum_bytes=err.minimum_bytes)
    else:
      entry.update(feasible=True, policy=str(plan.policy), temp_bytes=plan.compiled.temp_bytes,
                   predicted_temp_bytes=plan.predicted_temp_bytes, flops_ratio=plan.flops_ratio,
                   compiles=len(plan.history), converged=plan.converged, seconds=plan.seconds,
                   seconds_in_compiles=plan.seconds / compile_s)
    results.append(entry)
    status = (f"{entry['policy']}  temp {entry['temp_bytes'] / 2**20:.1f} MiB  FLOPs ×{entry['flops_ratio']:.4f}  "
              f"{entry['compiles']} compiles  {entry['seconds']:.1f} s = {entry['seconds_in_compiles']:.1f} compiles"
              if entry["feasible"] else f"infeasible (least temp {entry['minimum_bytes'] / 2**20:.1f} MiB)")
    print(f"budget {pct:g}% (temp ≤ {limit / 2**20:.1f} MiB): {status}", flush=True)
  record.update(model=args.model, preset=args.preset,
                none={"temp_bytes": none["temp_bytes"], "flops": none["flops"], "compile_s": compile_s},
                median_fixed_compile_s=statistics.median(r["compile_s"] for r in rows),
                fixed=[{"policy": r["policy"], "temp_bytes": r["temp_bytes"], "flops_ratio": r["flops"] / none["flops"]}
                       for r in rows],
                budgets=results)
  data = common.publish(record, started, render, NAME, args)
  if args.plot:
    plot_path = os.path.splitext(common.out_path(NAME, args))[0] + ".png"
    _plot(data, plot_path)
    print(f"wrote {plot_path}")
  return data


def _plot(data: dict, path: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  none_temp = data["none"]["temp_bytes"]
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  fixed = data["fixed"]
  ax.scatter([f["flops_ratio"] for f in fixed], [f["temp_bytes"] / none_temp for f in fixed], color="tab:blue",
             label="fixed built-in policies", zorder=3)
  plans = [b for b in data["budgets"] if b["feasible"]]
  ax.scatter([b["flops_ratio"] for b in plans], [b["temp_bytes"] / none_temp for b in plans], color="tab:orange",
             marker="D", label="budget plans", zorder=4)
  for b in plans:
    ax.annotate(f"{b['budget_percent']:g}%", (b["flops_ratio"], b["temp_bytes"] / none_temp), fontsize=7,
                xytext=(4, 3), textcoords="offset points")
  ax.set_xlabel("train-step FLOPs / none")
  ax.set_ylabel("compiled temp / none")
  ax.set_title(f"{data['model']} ({data['preset']}): budget plans vs fixed policies", fontsize=9)
  common.save_plot(fig, ax, path)


if __name__ == "__main__":
  main()
