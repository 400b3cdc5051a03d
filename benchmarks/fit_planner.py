"""Will it fit? The fit planner's largest batch vs a plain binary search of compiles, per model and policy.

For each (model, policy) at a device memory where the answer is a batch between 8 and 512, runs both
:func:`jaxckpt.fit.max_batch_size` (two probe compiles, an affine footprint model, one compile at the predicted
batch and one at its successor) and a binary search of compiles over batch 1..1024 (MaxText's estimator's method),
in the same process, one after the other, and records both answers, compile counts and wall seconds. Then, for a
global batch, checks the planner's choice against the exhaustive table of its time model and, on a small model,
times every fitting configuration on this CPU: the rank correlation of the time model with measurement, and how
far the planner's ``--measure`` choice (the best measured of its four fastest estimates) is from the best of all.

Usage: ``python benchmarks/fit_planner.py [--quick] [--models gpt:small vit:small gpt:gpt2-small]``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scipy import stats

from benchmarks import common
from jaxckpt.fit import accelerator, candidates, compile_point, max_batch_size, measure_candidates, plan_fit
from jaxckpt.fit.search import DEFAULT_POLICIES
from jaxckpt.step import shipped_target
from jaxckpt.units import format_bytes, parse_bytes

NAME = "fit_planner"
MEMORY = {"gpt:small": "4GiB", "vit:small": "48MiB", "gpt:gpt2-small": "40GiB", "gpt:tiny": "40MiB",
          "mlp:tiny": "1000KiB"}
"""Device memory per model, chosen so the largest batches fall between 8 and 512."""


def binary_search(target, policy: str, limit: int, top: int = 1024) -> dict[str, Any]:
  """Largest batch in 1..top whose compiled footprint ≤ limit, by bisection of compiles (no model)."""
  started = time.perf_counter()
  lo, hi, compiles = 0, top + 1, 0
  while hi - lo > 1:
    mid = (lo + hi) // 2
    compiles += 1
    if compile_point(target, policy, mid).footprint_bytes <= limit:
      lo = mid
    else:
      hi = mid
  return {"max_batch_size": lo or None, "compiles": compiles, "seconds": time.perf_counter() - started}


def compare(model: str, preset: str, memory: str, policies: Sequence[str]) -> list[dict[str, Any]]:
  """Planner vs binary search for each policy of one model."""
  target = shipped_target(model, preset)
  limit = parse_bytes(memory)
  rows = []
  for policy in policies:
    fit = max_batch_size(target, policy, limit, max_batch=1024)
    search = binary_search(target, policy, limit)
    rows.append({"model": f"{model}:{preset}", "memory": memory, "policy": policy,
                 "planner": fit.max_batch_size, "search": search["max_batch_size"],
                 "planner_compiles": fit.compiles, "search_compiles": search["compiles"],
                 "planner_s": fit.seconds, "search_s": search["seconds"], "method": fit.method,
                 "footprint_bytes": fit.footprint_bytes, "limit_bytes": limit,
                 "over_bytes_at_next": fit.verified_over, "slope_bytes": fit.model.slope})
    print(f"{model}:{preset} {policy}: planner {fit.max_batch_size} ({fit.compiles} compiles, {fit.seconds:.0f} s), "
          f"search {search['max_batch_size']} ({search['compiles']}, {search['seconds']:.0f} s)", flush=True)
  return rows


def global_choice(model: str, preset: str, memory: str, global_batch: int) -> dict[str, Any]:
  """The planner's choice for a global batch vs the exhaustive table of its time model (device: h100 and this CPU)."""
  target = shipped_target(model, preset)
  out = {}
  for dev in ("h100", "cpu"):
    plan = plan_fit(target, DEFAULT_POLICIES, memory, global_batch=global_batch, device=accelerator(dev))
    table = candidates(plan.fits, global_batch, plan.device)
    best = min(table, key=lambda c: c.est_step_s)
    w = plan.choice.winner
    out[dev] = {"winner": [w.policy, w.micro_batch, w.accum], "exhaustive_best": [best.policy, best.micro_batch,
                best.accum], "candidates": len(table), "footprint_bytes": plan.choice.footprint_bytes,
                "limit_bytes": plan.limit_bytes, "est_step_s": w.est_step_s}
  return {"model": f"{model}:{preset}", "memory": memory, "global_batch": global_batch, **out}


def measured_choice(model: str, preset: str, memory: str, global_batch: int, top: int = 4,
                    most: int = 10) -> dict[str, Any]:
  """Times up to ``most`` fitting configurations (fastest estimates first) on this CPU."""
  target = shipped_target(model, preset)
  plan = plan_fit(target, DEFAULT_POLICIES, memory, global_batch=global_batch, device=accelerator("cpu"))
  table = list(plan.choice.table)
  # spread over policies and micro-batches: round-robin over the policies, each in estimate order
  by_policy: dict[str, list] = {}
  for cand in table:
    by_policy.setdefault(cand.policy, []).append(cand)
  picked = table[:top]  # what --measure times: the fastest estimates
  for cand in picked:
    by_policy[cand.policy].remove(cand)
  while len(picked) < most and any(by_policy.values()):
    for queue in by_policy.values():
      if queue and len(picked) < most:
        picked.append(queue.pop(0))
  picked.sort(key=lambda c: c.est_step_s)
  timed = measure_candidates(target, picked, global_batch, top=len(picked), steps=5, warmup=2)
  est = [c.est_step_s for c in timed]
  meas = [c.measured_step_s for c in timed]
  best_all = min(meas)
  planner = min(timed[:top], key=lambda c: c.measured_step_s)
  return {"model": f"{model}:{preset}", "memory": memory, "global_batch": global_batch, "timed": len(timed),
          "policies": sorted({c.policy for c in timed}), "micro_batches": sorted({c.micro_batch for c in timed}),
          "spearman": float(stats.spearmanr(est, meas)[0]),
          "planner_choice": [planner.policy, planner.micro_batch, planner.accum],
          "planner_measured_s": planner.measured_step_s, "best_measured_s": best_all,
          "within": planner.measured_step_s / best_all - 1,
          "rows": [c.as_row() for c in timed]}


def render(data: Mapping[str, Any]) -> str:
  """README block: per (model, policy) both answers and compile counts; totals; the global-batch checks."""
  rows = data["rows"]
  table = common.markdown_table(
      ["model", "memory", "policy", "planner batch", "binary search", "compiles (planner / search)",
       "footprint at it", "at batch+1", "wall s (planner / search)"],
      [[r["model"], r["memory"], r["policy"], r["planner"], r["search"],
        f"{r['planner_compiles']} / {r['search_compiles']}", format_bytes(r["footprint_bytes"]),
        format_bytes(r["over_bytes_at_next"]) if r["over_bytes_at_next"] else "-",
        f"{r['planner_s']:.0f} / {r['search_s']:.0f}"] for r in rows])
  n = len(rows)
  agree = sum(r["planner"] == r["search"] for r in rows)
  pc = sum(r["planner_compiles"] for r in rows) / n
  sc = sum(r["search_compiles"] for r in rows) / n
  ratio = sum(r["planner_s"] for r in rows) / sum(r["search_s"] for r in rows)
  runs = [f"Run: {common.header(data)}."]
  for extra in data.get("merged_runs", []):  # rows measured by a second process of the same commit, in parallel
    runs.append(f"Rows of {', '.join(extra['models'])}: {common.header(extra)} (run alongside).")
  lines = [" ".join(runs), "", table, "",
           f"Same answer on {agree} of {n} (model, policy) pairs; compiles per policy {pc:.2f} (planner, "
           f"verification included) vs {sc:.2f} (binary search); planner wall time {ratio:.2f}× the search's."]
  for g in data.get("global", []):
    for dev in ("h100", "cpu"):
      d = g[dev]
      lines.append(f"Global batch {g['global_batch']} of {g['model']} in {g['memory']} ({dev} time model): chosen "
                   f"{d['winner'][0]} b={d['winner'][1]} × k={d['winner'][2]}, exhaustive best of {d['candidates']}: "
                   f"{d['exhaustive_best'][0]} b={d['exhaustive_best'][1]} × k={d['exhaustive_best'][2]}; "
                   f"compiled footprint with accumulation {format_bytes(d['footprint_bytes'])}.")
  m = data.get("measured")
  if m:
    when = f" on {m['date_utc']} UTC, load {m['loadavg'][0]:.1f}" if "date_utc" in m else ""
    lines.append(f"Measured on this CPU{when} ({m['model']}, G={m['global_batch']}, {m['timed']} configurations over "
                 f"{len(m['policies'])} policies and micro-batches {m['micro_batches']}): Spearman ρ of estimated vs "
                 f"measured step time {m['spearman']:.2f}; the planner's --measure choice {m['planner_choice'][0]} "
                 f"b={m['planner_choice'][1]} × k={m['planner_choice'][2]} is {m['within'] * 100:.1f}% slower than "
                 f"the best measured.")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the result record."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--models", nargs="+", default=["gpt:small", "vit:small", "gpt:gpt2-small"], metavar="MODEL:PRESET")
  p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
  p.add_argument("--no-choice", dest="choice", action="store_false",
                 help="only planner vs binary search (skip the global-batch and measured checks)")
  args = p.parse_args(argv)
  if args.quick:
    args.models, args.policies = ["mlp:tiny"], ["none", "nothing_saveable"]
  for m in args.models:
    if m not in MEMORY:
      p.error(f"--models {m}: valid: {', '.join(MEMORY)}")
  common.check_out(p, NAME, args)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  record["rows"], record["global"] = [], []
  partial = common.out_path(NAME, args) + ".partial"
  late = [m for m in args.models if m == "gpt:gpt2-small"]  # the slowest compiles last: the rest is recorded first
  for m in [m for m in args.models if m not in late]:
    model, preset = m.split(":")
    record["rows"] += compare(model, preset, MEMORY[m], args.policies)
    common.write_json(partial, record)
  if args.choice and not args.quick:
    record["global"].append(global_choice("gpt", "small", MEMORY["gpt:small"], 256))
    common.write_json(partial, record)
    record["measured"] = measured_choice("gpt", "tiny", MEMORY["gpt:tiny"], 64)
    common.write_json(partial, record)
  for m in late:
    model, preset = m.split(":")
    record["rows"] += compare(model, preset, MEMORY[m], args.policies)
    common.write_json(partial, record)
  record = common.publish(record, started, render, NAME, args)
  os.remove(partial)  # the whole record is written
  return record


if __name__ == "__main__":
  main()
