"""Will it fit? The fit planner's largest batch vs a plain binary search of compiles, per model and policy.

For each (model, policy) at a device memory where the answer is a batch between 8 and 512, runs both
:func:`jaxckpt.fit.fit_policies` (two probe compiles, or one and the previous policy's batch-independent bytes, an
affine footprint model, one compile at the predicted batch and one at its successor) and a binary search of compiles over batch 1..1024 (MaxText's estimator's method),
in the same process, one after the other, and records both answers, compile counts and wall seconds. Then, for a
global batch, checks the planner's choice against the exhaustive table of its time model and, on a small model,
times every fitting configuration on this CPU (calibrated time model; interleaved rounds, least of each
configuration's steps): the rank correlation of the time model with measurement, and how far the planner's
``--measure 6`` choice (the best measured of its :func:`jaxckpt.fit.spread` picks, timed in the same rounds) is from
the best of all.

Usage: ``python benchmarks/fit_planner.py [--quick] [--models gpt:small vit:small gpt:gpt2-small]``;
``--search-from OLD.json`` takes the binary search's columns (deterministic compiles: same answers and counts) from an
earlier run instead of repeating its ~10 compiles per policy, ``--rows-from ROWS.json`` takes whole rows (planner
and search) from an earlier run, so the timed part can run alone on a quiet machine; both are recorded and printed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scipy import stats

from benchmarks import common
from jaxckpt.fit import accelerator, candidates, compile_point, fit_policies, measure_candidates, plan_fit, spread
from jaxckpt.fit import DEFAULT_POLICIES
from jaxckpt.step import shipped_target
from jaxckpt import format_bytes, parse_bytes

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


def compare(model: str, preset: str, memory: str, policies: Sequence[str],
            searched: Mapping[tuple[str, str, str], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
  """Planner (all policies of the model, as ``jaxckpt-fit`` runs them) vs binary search for each policy of one model.

  ``searched`` maps (model, memory, policy) to an earlier run's binary search (its answer, compiles, seconds)."""
  target = shipped_target(model, preset)
  limit = parse_bytes(memory)
  rows = []
  fits = fit_policies(target, policies, limit, max_batch=1024)
  for policy, fit in zip(policies, fits):
    old = (searched or {}).get((f"{model}:{preset}", memory, policy))
    search = binary_search(target, policy, limit) if old is None else \
        {"max_batch_size": old["search"], "compiles": old["search_compiles"], "seconds": old["search_s"]}
    rows.append({"model": f"{model}:{preset}", "memory": memory, "policy": policy,
                 "planner": fit.max_batch_size, "search": search["max_batch_size"],
                 "planner_compiles": fit.compiles, "search_compiles": search["compiles"],
                 "planner_s": fit.seconds, "search_s": search["seconds"], "method": fit.method,
                 "footprint_bytes": fit.footprint_bytes, "limit_bytes": limit,
                 "over_bytes_at_next": fit.verified_over, "slope_bytes": fit.model.slope,
                 "planner_batches": [p.batch for p in fit.points], "search_reused": old is not None})
    print(f"{model}:{preset} {policy}: planner {fit.max_batch_size} ({fit.compiles} compiles, {fit.seconds:.0f} s), "
          f"search {search['max_batch_size']} ({search['compiles']}, {search['seconds']:.0f} s)", flush=True)
  return rows


def global_choice(model: str, preset: str, memory: str, global_batch: int) -> dict[str, Any]:
  """The planner's choice for a global batch vs the exhaustive table of its time model (device: h100 and this CPU,
  calibrated), from one set of batch fits: the CPU's choice is verified the way :func:`jaxckpt.fit.plan_fit` does
  (the first candidate whose step, compiled with its accumulation, fits)."""
  target = shipped_target(model, preset)
  plan = plan_fit(target, DEFAULT_POLICIES, memory, global_batch=global_batch, device=accelerator("h100"))
  out = {}
  for dev in ("h100", "cpu"):
    device = plan.device if dev == "h100" else accelerator(dev)
    table = candidates(plan.fits, global_batch, device)
    best = min(table, key=lambda c: c.est_step_s)
    if dev == "h100":
      w, foot = plan.choice.winner, plan.choice.footprint_bytes
    else:
      for w in table:
        foot = w.footprint_bytes if w.accum == 1 and w.compiled else \
            compile_point(target, w.policy, global_batch, grad_accum_steps=w.accum).footprint_bytes
        if foot <= plan.limit_bytes:
          break
    out[dev] = {"winner": [w.policy, w.micro_batch, w.accum], "exhaustive_best": [best.policy, best.micro_batch,
                best.accum], "candidates": len(table), "footprint_bytes": foot,
                "limit_bytes": plan.limit_bytes, "est_step_s": w.est_step_s}
  return {"model": f"{model}:{preset}", "memory": memory, "global_batch": global_batch, **out}


def measured_choice(model: str, preset: str, memory: str, global_batch: int, top: int = 6,
                    most: int = 24, rounds: int = 2) -> dict[str, Any]:
  """Times every fitting configuration (up to ``most``, spread over policies and micro-batches) on this CPU, in
  interleaved rounds (least of each configuration's steps), and checks ``--measure top``'s choice against the best.

  The planner with ``--measure top`` times :func:`jaxckpt.fit.spread` ``(table, top)`` and picks the fastest of those;
  here those picks are timed in the same interleaved rounds as the rest (paired timings), so the gap between the
  planner's choice and the best of all is not a difference of load between two runs."""
  target = shipped_target(model, preset)
  device = accelerator("cpu")
  plan = plan_fit(target, DEFAULT_POLICIES, memory, global_batch=global_batch, device=device)
  table = list(plan.choice.table)
  mine = spread(table, top)
  timed_set = {id(c) for c in mine} | {id(c) for c in spread(table, most)}
  picked = [c for c in table if id(c) in timed_set]
  started = time.perf_counter()
  timed = measure_candidates(target, picked, global_batch, top=len(picked), pick="top", steps=2, warmup=1,
                             rounds=rounds)
  timing_s = time.perf_counter() - started
  est = [c.est_step_s for c in timed]
  meas = [c.measured_step_s for c in timed]
  best_all = min(timed, key=lambda c: c.measured_step_s)
  keys = {(c.policy, c.micro_batch) for c in mine}
  planner = min((c for c in timed if (c.policy, c.micro_batch) in keys), key=lambda c: c.measured_step_s)
  return {"model": f"{model}:{preset}", "memory": memory, "global_batch": global_batch, "timed": len(timed),
          "fitting": len(table), "measure_n": top, "rounds": rounds, "timing_s": timing_s,
          "device": dataclasses.asdict(device),
          "policies": sorted({c.policy for c in timed}), "micro_batches": sorted({c.micro_batch for c in timed}),
          "spearman": float(stats.spearmanr(est, meas)[0]),
          "estimate_best": [table[0].policy, table[0].micro_batch, table[0].accum],
          "planner_choice": [planner.policy, planner.micro_batch, planner.accum],
          "best_measured": [best_all.policy, best_all.micro_batch, best_all.accum],
          "planner_measured_s": planner.measured_step_s, "best_measured_s": best_all.measured_step_s,
          "within": planner.measured_step_s / best_all.measured_step_s - 1,
          "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "loadavg": list(os.getloadavg()),
          "rows": [c.as_row() for c in timed]}


def _estimate_gap(m: Mapping[str, Any]) -> str:
  """How far the time model's own first choice (no measurement) is from the best measured, when it was timed."""
  if "estimate_best" not in m:
    return ""
  policy, micro, accum = m["estimate_best"]
  row = next((r for r in m["rows"] if (r["policy"], r["micro_batch"]) == (policy, micro)), None)
  if row is None:
    return ""
  gap = row["measured_step_s"] / m["best_measured_s"] - 1
  return f"; the estimate's own first choice ({policy} b={micro} × k={accum}, no measurement) is {gap * 100:.0f}% slower"


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
  if data.get("rows_from"):
    runs.append(f"Planner and search rows: {common.header(data['rows_from'])}.")
  src = data.get("search_from") or (data.get("rows_from") or {}).get("search_from")
  if src:
    runs.append(f"Binary-search columns (answers, compiles, seconds) from the run of {common.header(src)} "
                "(deterministic compiles; the wall ratio compares the two runs).")
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
    n = f" with --measure {m['measure_n']}" if "measure_n" in m else ""
    best = (f" ({m['best_measured'][0]} b={m['best_measured'][1]} × k={m['best_measured'][2]}, "
            f"{m['best_measured_s'] * 1e3:.0f} ms)") if "best_measured" in m else ""
    rounds = f", least of {m['rounds']} interleaved rounds, {m['timing_s']:.0f} s of timing" if "rounds" in m else ""
    lines.append(f"Measured on this CPU{when} ({m['model']}, G={m['global_batch']}, {m['timed']} of "
                 f"{m.get('fitting', '?')} fitting configurations over {len(m['policies'])} policies and micro-batches "
                 f"{m['micro_batches']}{rounds}): Spearman ρ of estimated vs measured step time {m['spearman']:.2f}; "
                 f"the planner's choice{n} {m['planner_choice'][0]} b={m['planner_choice'][1]} × "
                 f"k={m['planner_choice'][2]} is {m['within'] * 100:.1f}% slower than the best measured{best}"
                 + _estimate_gap(m) + ".")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the result record."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--models", nargs="+", default=["gpt:small", "vit:small", "gpt:gpt2-small"], metavar="MODEL:PRESET")
  p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
  p.add_argument("--no-choice", dest="choice", action="store_false",
                 help="only planner vs binary search (skip the global-batch and measured checks)")
  p.add_argument("--search-from", default=None, metavar="OLD.json",
                 help="binary-search columns from an earlier run's JSON (not repeated)")
  p.add_argument("--rows-from", default=None, metavar="ROWS.json",
                 help="planner and search rows (and with --no-global its global-batch check) from an earlier run")
  p.add_argument("--no-global", dest="global_", action="store_false",
                 help="skip the global-batch check of GPT small (with --rows-from: keep the earlier run's)")
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
  searched = None
  if args.search_from:
    with open(args.search_from) as fh:
      old = json.load(fh)
    searched = {(r["model"], r["memory"], r["policy"]): r for r in old["rows"]}
    record["search_from"] = {k: old[k] for k in ("date_utc", "machine", "wall_s", "cpu_s") if k in old}
  if args.rows_from:
    with open(args.rows_from) as fh:
      old = json.load(fh)
    record["rows"] = old["rows"]
    record["rows_from"] = old.get("rows_from") or \
        {k: old[k] for k in ("date_utc", "machine", "wall_s", "cpu_s", "search_from") if k in old}
    if not args.global_:
      record["global"] = old.get("global", [])
    args.models = []
  late = [m for m in args.models if m == "gpt:gpt2-small"]  # the slowest compiles last: the rest is recorded first
  for m in [m for m in args.models if m not in late]:
    model, preset = m.split(":")
    record["rows"] += compare(model, preset, MEMORY[m], args.policies, searched)
    common.write_json(partial, record)
  if args.choice and not args.quick:
    if args.global_:
      record["global"].append(global_choice("gpt", "small", MEMORY["gpt:small"], 256))
      common.write_json(partial, record)
    record["measured"] = measured_choice("gpt", "tiny", MEMORY["gpt:tiny"], 64)
    common.write_json(partial, record)
  for m in late:
    model, preset = m.split(":")
    record["rows"] += compare(model, preset, MEMORY[m], args.policies, searched)
    common.write_json(partial, record)
  record = common.publish(record, started, render, NAME, args)
  os.remove(partial)  # the whole record is written
  return record


if __name__ == "__main__":
  main()
