"""Benchmark: the memory/recompute front of per-tensor plans on GPT ``small`` vs PyTorch's min-cut partitioner.

Usage: ``python benchmarks/pertensor_front.py [--preset small] [--budgets 50 30] [--quick] [--out FILE.json]``.

Saved = ``activation_residual_bytes`` (JAX's saved residuals of the unrolled model, parameter-only values excluded),
FLOPs = the train step's forward + backward FLOPs (:func:`jaxckpt.count_flops` of the step minus its optimizer
update, all ops) ÷ ``none``'s. The PyTorch reference is ``benchmarks/results/torch_mincut.json``, written by
``benchmarks/torch_mincut.py`` (a separate torch venv): the AOTAutograd min-cut partitioner's graphs at each
``activation_memory_budget``, counted with jaxckpt's per-element FLOP rules, so both sides share one FLOP
convention. Each torch point is compared two ways: FLOPs ÷ torch's own no-remat step (``own``), and torch's FLOPs ÷
jaxckpt's no-remat step (``common``: the same denominator, i.e. absolute FLOPs; torch's no-remat step counts 0.06%
more than jaxckpt's). The figures quoted in the issue (torch 2.14, another FLOP count) are kept as ``quoted``.

Steps: the layer candidates of the planner (built-ins, name subsets and the per-tensor min-cut options), timed; the
model-level front of their layer assignments (:func:`jaxckpt.planner.pareto_totals`, predicted); for each torch
point the least-recompute assignment predicted to save no more, then measured exactly (residual analysis + FLOPs of
the traced step); ``min_saved`` and the built-ins measured the same way; then budget plans with per-tensor options
compiled and checked against their budget (``--budgets``, percent of no-remat temp). Then the **whole-loss** front
(:mod:`jaxckpt.planner._whole`: one remat region around the loss, layers unrolled, one 0-1 program over the whole
graph): for each torch point (both conventions and the quoted figures) the least-recompute whole-loss plan saving no
more, measured the same way (``jax.value_and_grad`` of the loss w.r.t. the params, FLOPs ÷ the same loss without
remat; ``common``: its extra FLOPs over that ÷ the step's no-remat FLOPs). ``--whole-only`` recomputes just that
part into an existing JSON (the block part and its run header are kept). Writes
``benchmarks/results/pertensor_front.json`` and a PNG of the fronts beside it. ``--quick``: GPT ``tiny``.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxckpt.analysis import count_flops  # noqa: E402
from jaxckpt.planner import InfeasibleBudgetError, layer_candidates, pareto_totals, plan_policy, resolve_policy  # noqa: E402
from jaxckpt.planner import layer_probe  # noqa: E402
from jaxckpt.planner import block_program, record_block_graphs, tensor_options  # noqa: E402
from jaxckpt.planner import (measure_whole, segment_loss, segmented_plan, target_whole_loss, whole_graph,  # noqa: E402
                             whole_plan)
from jaxckpt.policies import LossPolicy
from jaxckpt import parse_model_policy  # noqa: E402
from jaxckpt.report import analyse_residuals  # noqa: E402
from jaxckpt.step import compile_policy, default_optimizer, policy_step, shipped_target, target_block_types  # noqa: E402

NAME = "pertensor_front"
MIB = 2**20

TORCH_JSON = os.path.join(common.RESULTS_DIR, "torch_mincut.json")
"""PyTorch's min-cut points in jaxckpt's FLOP convention (``benchmarks/torch_mincut.py``)."""
QUOTED_TORCH_VERSION = "2.14"
QUOTED_TORCH_POINTS = (  # activation_memory_budget, saved MiB, FLOPs ÷ none, as quoted in NOTES §5
    (1.0, 312.5, 0.9998), (0.9, 190.6, 1.0010), (0.6, 170.6, 1.0013), (0.5, 154.0, 1.0095), (0.45, 138.0, 1.0176),
    (0.4, 122.0, 1.0257), (0.35, 108.0, 1.0529), (0.3, 92.0, 1.0839), (0.25, 78.0, 1.1111), (0.2, 62.0, 1.1421),
    (0.15, 46.0, 1.1731), (0.1, 30.0, 1.2042))
BEFORE = (  # jaxckpt before per-tensor plans (same units; from the issue)
    ("none", 688.8, 1.0000), ("budget:90%", 591.8, 1.0007), ("budget:75%", 494.7, 1.0015),
    ("budget:60%", 324.4, 1.0036), ("budget:50%", 214.7, 1.0054), ("dots_saveable", 178.1, 1.0060),
    ("budget:40%", 138.1, 1.0251), ("dots_with_no_batch_dims_saveable", 118.1, 1.0522), ("budget:30%", 82.1, 1.1215),
    ("save_only_these_names:qkv", 70.1, 1.1447), ("nothing_saveable", 34.1, 1.2143))
FLOPS_SLACK = 0.001
"""A jaxckpt plan meets a torch point with saved ≤ torch's and FLOPs ÷ none ≤ torch's + this."""


def _optimizer_flops(target) -> int:
  """FLOPs of the step's optimizer update alone (the same for every policy; left out of the forward + backward)."""
  tx = default_optimizer()
  state = policy_step(target, parse_model_policy("none"), tx).state
  return count_flops(lambda s: optax.apply_updates(s.params, tx.update(s.params, s.opt_state,
                                                                 s.params)[0]), state).total


def _measure(target, policy, none_flops=None, optimizer_flops=0) -> dict:
  """Exact saved activation bytes and forward + backward FLOPs of a concrete policy (traces only)."""
  step = policy_step(target, policy, default_optimizer())
  summary = analyse_residuals(step)
  count = count_flops(step.step, step.state, step.batch)
  flops = count.total - optimizer_flops
  return {"policy": str(policy), "activation_residual_bytes": summary["activation_bytes"],
          "residual_bytes": summary["bytes"], "flops": flops, "matmul_flops": count.by_primitive.get("dot_general", 0),
          "flops_ratio": None if none_flops is None else flops / none_flops}


def main(argv: list[str] | None = None) -> dict:
  """Runs the benchmark; returns what it writes as JSON (bytes, FLOPs, seconds)."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--preset", default="small")
  parser.add_argument("--budgets", type=float, nargs="*", default=[50, 30],
                      help="budget plans to compile and check, percent of no-remat temp")
  parser.add_argument("--points", type=int, default=14, help="extra front points measured for the plot")
  parser.add_argument("--no-plot", dest="plot", action="store_false")
  parser.add_argument("--whole-only", action="store_true",
                      help="only (re)measure the whole-loss front into the existing JSON at --out")
  parser.add_argument("--mincut-only", action="store_true",
                      help="only (re)measure the mincut (segmented whole-loss) front into the existing JSON at --out")
  args = parser.parse_args(argv)
  if args.quick:
    args.preset, args.budgets, args.points = "tiny", [40], 4
  common.check_out(parser, NAME, args)
  started = time.perf_counter()
  target = shipped_target("gpt", args.preset)
  if args.whole_only or args.mincut_only:
    return _whole_only(parser, target, args, "mincut" if args.mincut_only else "whole")
  record = common.run_record(NAME, args)

  t0 = time.perf_counter()
  stack, probe = layer_probe(target)
  graphs = record_block_graphs(probe)
  options = tensor_options(graphs)
  candidates = layer_candidates(probe, target_block_types(target), options)
  candidate_s = time.perf_counter() - t0
  num_layers = stack.num_layers
  print(f"{len(candidates)} layer candidates ({sum(map(len, options.values()))} per-tensor block options) in "
        f"{candidate_s:.1f} s", flush=True)

  optimizer_flops = _optimizer_flops(target)
  none = _measure(target, parse_model_policy("none"), optimizer_flops=optimizer_flops)
  none["flops_ratio"] = 1.0
  none["matmul_flops_ratio"] = 1.0
  full = _measure(target, parse_model_policy("nothing_saveable"), none["flops"], optimizer_flops)
  by_spec = {str(c.spec): c for c in candidates}
  full_layer = by_spec["nothing_saveable"].saved_bytes
  totals = pareto_totals(candidates, num_layers)

  def predicted(a) -> tuple[float, float]:
    act = full["activation_residual_bytes"] + a.saved_bytes - num_layers * full_layer
    return act, (none["flops"] + a.recompute_flops) / none["flops"]

  measured: dict[str, dict] = {}

  def measure(policy) -> dict:
    key = str(policy)
    if key not in measured:
      measured[key] = _measure(target, policy, none["flops"], optimizer_flops)
      measured[key]["matmul_flops_ratio"] = measured[key]["matmul_flops"] / none["matmul_flops"]
    return measured[key]

  def best_within(limit: float):
    """The least-recompute assignment predicted to save ≤ limit bytes, measured; the next ones if it saves more."""
    fits = sorted((a for a in totals if predicted(a)[0] <= limit), key=lambda a: a.recompute_flops)
    for a in fits[:3]:
      got = measure(a.policy())
      if got["activation_residual_bytes"] <= limit:
        return got
    return None

  torch = _torch_reference(TORCH_JSON, none["flops"]) if args.preset == "small" else None
  points, quoted = [], []
  for row in (torch or {}).get("points", []):
    found = best_within(row["saved_mib"] * MIB)
    entry = dict(row, jaxckpt=found)
    for conv in ("own", "common"):
      entry[f"met_{conv}"] = bool(found and found["flops_ratio"] <= row[f"flops_ratio_{conv}"] + FLOPS_SLACK)
    entry["met_matmul_only"] = bool(found and found["matmul_flops_ratio"] <= row["matmul_flops_ratio"] + FLOPS_SLACK)
    points.append(entry)
    what = (f"{found['activation_residual_bytes'] / MIB:.1f} MiB ×{found['flops_ratio']:.5f}" if found else "none fits")
    print(f"torch {row['budget']:g}: {row['saved_mib']:.1f} MiB ×{row['flops_ratio_own']:.5f} own, "
          f"×{row['flops_ratio_common']:.5f} common | jaxckpt {what} met own {entry['met_own']}, common "
          f"{entry['met_common']}", flush=True)
  for budget, saved_mib, torch_ratio in QUOTED_TORCH_POINTS if args.preset == "small" else ():
    found = best_within(saved_mib * MIB)
    quoted.append({"budget": budget, "saved_mib": saved_mib, "flops_ratio": torch_ratio, "jaxckpt": found,
                   "met": bool(found and found["flops_ratio"] <= torch_ratio + FLOPS_SLACK)})

  # min_saved and the built-ins, measured; more front points for the plot
  named = {}
  for text in ("min_saved", "min_saved:tol=0%", "min_saved:tol=1%", "dots_saveable", "nothing_saveable"):
    policy, _ = resolve_policy(target, text)
    named[text] = measure(policy)
    print(f"{text}: {named[text]['activation_residual_bytes'] / MIB:.1f} MiB ×{named[text]['flops_ratio']:.4f}",
          flush=True)
  step = max(1, len(totals) // max(1, args.points))
  front = [measure(a.policy()) for a in totals[::step]]

  # budget plans with per-tensor options: compiled, checked against the budget; planning time in compiles
  budgets, cache = [], {}
  for pct in args.budgets:
    try:
      plan = plan_policy(target, f"budget:{pct:g}%", cache=cache, candidates=candidates)
    except InfeasibleBudgetError as err:
      budgets.append({"budget_percent": pct, "feasible": False, "error": str(err)})
      continue
    compile_s = sum(p.compile_s for p in plan.history) / len(plan.history)
    got = measure(plan.policy)
    budgets.append({"budget_percent": pct, "feasible": True, "policy": str(plan.policy),
                    "temp_bytes": plan.compiled.temp_bytes, "limit_bytes": plan.limit_bytes,
                    "fits": plan.compiled.temp_bytes <= plan.limit_bytes, "compiles": len(plan.history),
                    "flops_ratio": got["flops_ratio"], "activation_residual_bytes": got["activation_residual_bytes"],
                    "planning_s": plan.seconds + candidate_s / max(1, len(args.budgets)),
                    "mean_compile_s": compile_s})
    b = budgets[-1]
    print(f"budget:{pct:g}%: temp {b['temp_bytes'] / MIB:.1f} ≤ {b['limit_bytes'] / MIB:.1f} MiB: {b['fits']}, "
          f"{b['activation_residual_bytes'] / MIB:.1f} MiB ×{b['flops_ratio']:.4f}, planning {b['planning_s']:.0f} s "
          f"= {b['planning_s'] / compile_s:.1f} compiles", flush=True)
  ms_policy, _ = resolve_policy(target, "min_saved")
  ms_compiled = compile_policy(target, ms_policy)
  record.update({
      "preset": args.preset, "flops_slack": FLOPS_SLACK, "optimizer_flops": optimizer_flops,
      "torch": None if torch is None else {k: v for k, v in torch.items() if k != "points"},
      "quoted_torch_version": QUOTED_TORCH_VERSION, "quoted_torch_points": quoted,
      "candidates": len(candidates), "candidate_s": candidate_s,
      "tensor_options": {b: len(o) for b, o in options.items()},
      "none": none, "nothing_saveable": full, "named": named, "torch_points": points, "front": front,
      "budgets": budgets, "min_saved_compiled": {"temp_bytes": ms_compiled.memory["temp_bytes"],
                                                 "none_temp_bytes": cache["none"].temp_bytes if "none" in cache
                                                 else None},
      "before": [{"policy": p, "saved_mib": s, "flops_ratio": r} for p, s, r in BEFORE],
      "whole": whole_front(target, torch, none["flops"]),
      "mincut": whole_front(target, torch, none["flops"], segmented=True),
  })
  common.publish(record, started, _render, NAME, args)
  if args.plot:
    path = os.path.splitext(common.out_path(NAME, args))[0] + ".png"
    _plot(record, path)
    print(f"wrote {path}")
  return record


WHOLE_SHARES = (0.5, 0.2)
"""Caps (shares of no remat's saved activation bytes) of the whole-loss front when there are no torch points."""


def whole_front(target, torch: dict | None, step_none_flops: int, segmented: bool = False) -> dict:
  """The whole-loss per-tensor front at each torch point's saved bytes (:mod:`jaxckpt.planner._whole`), measured.

  Args:
    target: the GPT target.
    torch: :func:`_torch_reference`'s result, or ``None`` (then caps at :data:`WHOLE_SHARES` of no remat's bytes).
    step_none_flops: the train step's forward + backward FLOPs without remat (the block front's denominator).
    segmented: the ``mincut:<cap>`` plans instead (the loss cut into regions at its narrowest points, one program,
      each region under its own ``jax.checkpoint``), each also compiled as the policy's train step (``temp_bytes``;
      ``none_temp_bytes``: the same unrolled step without remat).

  Returns:
    ``{"graph": {...sizes, seconds}, "none": {...}, "plans": [{cap_bytes, predicted, measured, solve_s}],
    "torch_points": [...], "quoted_torch_points": [...]}``; ratios: ``flops_ratio`` ÷ the same loss without remat
    (count_flops), ``live_flops_ratio`` likewise after dead-code elimination, ``flops_ratio_step``: 1 + extra FLOPs ÷
    ``step_none_flops``.
  """
  t0 = time.perf_counter()
  loss = target_whole_loss(target)
  graph = whole_graph(loss)
  graph_s = time.perf_counter() - t0
  svals, n, a, *_ = block_program(graph)
  none = measure_whole(loss)
  segments = segment_loss(loss, None, graph) if segmented else None
  label = "mincut" if segmented else "whole"
  compiled_none = compile_policy(target, LossPolicy(loss.fn, "none (unrolled)")) if segmented else None
  print(f"whole loss: {len(loss.closed.jaxpr.eqns)} equations, {len(graph.values)} values, {len(graph.needed)} read "
        f"by the backward; program {n} binaries ({len(svals)} values, {n - len(svals)} ops), {a.shape[0]} rows; "
        f"graph {graph_s:.1f} s; no remat {none.activation_residual_bytes / MIB:.1f} MiB", flush=True)
  plans: dict[int, dict] = {}

  def plan_at(cap: float) -> dict:
    key = int(cap)
    if key not in plans:
      t1 = time.perf_counter()
      if segmented:
        plan = segmented_plan(segments, max_bytes=cap)
        names = frozenset(n for region in plan.names for n in region)
        gap, predicted_bytes, predicted_flops = plan.mip_gap, plan.activation_bytes, plan.flops
      else:
        plan = whole_plan(loss, max_bytes=cap, graph=graph)
        names = frozenset(plan.choice.names)
        gap, predicted_bytes, predicted_flops = plan.choice.mip_gap, plan.choice.activation_bytes, plan.choice.flops
      solve_s = time.perf_counter() - t1
      got = measure_whole(loss, plan.loss_fn)
      extra = got.flops - none.flops
      plans[key] = {"cap_bytes": key, "solve_s": solve_s, "mip_gap": gap, "saved": len(names),
                    "predicted_activation_bytes": predicted_bytes, "predicted_recompute_flops": predicted_flops,
                    "activation_residual_bytes": got.activation_residual_bytes,
                    "residual_bytes": got.residual_bytes, "flops": got.flops, "live_flops": got.live_flops,
                    "flops_ratio": got.flops / none.flops, "live_flops_ratio": got.live_flops / none.live_flops,
                    "flops_ratio_step": 1 + extra / step_none_flops,
                    "saves_exactly_the_chosen_set": got.saved_names == names}
      if segmented:
        compiled = compile_policy(target, LossPolicy(plan.loss_fn, f"mincut:{key}B"))
        plans[key].update(temp_bytes=compiled.memory["temp_bytes"], compile_s=compiled.seconds,
                          saves_only_chosen_values=got.saved_names <= names)
      p = plans[key]
      print(f"{label} ≤ {cap / MIB:.1f} MiB: {p['activation_residual_bytes'] / MIB:.1f} MiB ×{p['flops_ratio']:.5f} "
            f"(live ×{p['live_flops_ratio']:.5f}, step ×{p['flops_ratio_step']:.5f}), solve {solve_s:.1f} s "
            f"(gap {p['mip_gap']:.2g}), "
            f"exact set {p['saves_exactly_the_chosen_set']}"
            + (f", temp {p['temp_bytes'] / MIB:.1f} MiB" if segmented else ""), flush=True)
    return plans[key]

  t1 = time.perf_counter()
  if segmented:
    least = segmented_plan(segments, max_flops=0, minimise="bytes")
    least_bytes, least_gap = least.activation_bytes, least.mip_gap
  else:
    least = whole_plan(loss, max_flops=0, minimise="bytes", graph=graph)
    least_bytes, least_gap = least.choice.activation_bytes, least.choice.mip_gap
  least_s = time.perf_counter() - t1
  least_got = plan_at(least_bytes)  # the cheapest plan within those bytes: recomputes nothing
  print(f"{label}, no recompute: least {least_bytes / MIB:.1f} MiB ({least_s:.1f} s)", flush=True)
  points, quoted = [], []
  if torch is not None:
    for row in torch["points"]:
      got = plan_at(row["saved_mib"] * MIB)
      fits = got["activation_residual_bytes"] <= row["saved_mib"] * MIB
      points.append({"budget": row["budget"], "saved_mib": row["saved_mib"],
                     "flops_ratio_own": row["flops_ratio_own"], "flops_ratio_common": row["flops_ratio_common"],
                     "cap_bytes": int(row["saved_mib"] * MIB),
                     "miss_own": got["flops_ratio"] - row["flops_ratio_own"] - FLOPS_SLACK,
                     "miss_common": got["flops_ratio_step"] - row["flops_ratio_common"] - FLOPS_SLACK,
                     "met_own": fits and got["flops_ratio"] <= row["flops_ratio_own"] + FLOPS_SLACK,
                     "met_common": fits and got["flops_ratio_step"] <= row["flops_ratio_common"] + FLOPS_SLACK})
    for budget, saved_mib, torch_ratio in QUOTED_TORCH_POINTS:
      got = plan_at(saved_mib * MIB)
      quoted.append({"budget": budget, "saved_mib": saved_mib, "flops_ratio": torch_ratio,
                     "cap_bytes": int(saved_mib * MIB), "miss": got["flops_ratio"] - torch_ratio - FLOPS_SLACK,
                     "met": got["activation_residual_bytes"] <= saved_mib * MIB
                     and got["flops_ratio"] <= torch_ratio + FLOPS_SLACK})
  else:
    for share in WHOLE_SHARES:
      plan_at(share * none.activation_residual_bytes)
  return {"graph": {"equations": len(loss.closed.jaxpr.eqns), "values": len(graph.values),
                    "needed": len(graph.needed), "binaries": n, "saveable": len(svals), "rows": int(a.shape[0]),
                    "graph_s": graph_s, "fixed_bytes": graph.fixed_bytes,
                    "parameter_only_bytes": sum(graph.values[v].bytes for v in graph.parameter_only)},
          "none": {"activation_residual_bytes": none.activation_residual_bytes, "residual_bytes": none.residual_bytes,
                   "flops": none.flops, "live_flops": none.live_flops},
          "step_none_flops": step_none_flops, "seconds": time.perf_counter() - t0,
          "no_recompute": {"cap_bytes": least_got["cap_bytes"], "solve_s": least_s, "mip_gap": least_gap},
          "regions": None if segments is None else [[r.start, r.stop] for r in segments.regions],
          "none_temp_bytes": None if compiled_none is None else compiled_none.memory["temp_bytes"],
          "plans": sorted(plans.values(), key=lambda p: p["cap_bytes"]), "torch_points": points,
          "quoted_torch_points": quoted}


def _whole_only(parser, target, args, key: str = "whole") -> dict:
  """``--whole-only`` / ``--mincut-only``: that front into the JSON at :func:`common.out_path` (its other keys
  kept)."""
  path = common.out_path(NAME, args)
  if not os.path.exists(path):
    parser.error(f"--{key}-only needs the JSON of a full run at {path}; run without --{key}-only first")
  with open(path) as fh:
    record = json.load(fh)
  load = os.getloadavg()
  t0 = time.perf_counter()
  torch = _torch_reference(TORCH_JSON, record["none"]["flops"]) if args.preset == "small" else None
  record[key] = whole_front(target, torch, record["none"]["flops"], segmented=key == "mincut")
  record[key].update({"date_utc": common.run_record(NAME, args)["date_utc"], "loadavg_start": list(load),
                          "loadavg_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t0})
  print(_render(record))
  print(f"wrote {common.write_json(path, record)}")
  if args.plot:
    png = os.path.splitext(path)[0] + ".png"
    _plot(record, png)
    print(f"wrote {png}")
  return record


def _torch_reference(path: str, jax_none_flops: int) -> dict | None:
  """PyTorch's min-cut points from ``torch_mincut.json`` (None when absent): per budget saved MiB, FLOPs ÷ torch's
  own no-remat step, ÷ jaxckpt's (``common``), matmul-only ÷ torch's own."""
  if not os.path.exists(path):
    return None
  with open(path) as fh:
    data = json.load(fh)
  none = next(r for r in data["rows"] if r["label"] == "none")
  points = [{"budget": r["budget"], "saved_mib": r["activation_mib"], "flops_ratio_own": r["flops_ratio"],
             "flops_ratio_common": r["flops"] / jax_none_flops, "matmul_flops_ratio": r["matmul_flops_ratio"],
             "torch_flops": r["flops"]} for r in data["rows"] if "budget" in r and r["activation_mib"] >= 1]
  return {"version": data["torch_version"], "date_utc": data["date_utc"], "none_flops": none["flops"],
          "none_saved_mib": none["activation_mib"], "jax_none_flops": jax_none_flops,
          "none_ratio_common": none["flops"] / jax_none_flops, "points": points}


def _render(data) -> str:
  rows = []
  for p in data["torch_points"]:
    j = p["jaxckpt"]
    rows.append([f"{p['budget']:g}", f"{p['saved_mib']:.1f}", f"{p['flops_ratio_own']:.5f}",
                 f"{p['flops_ratio_common']:.5f}",
                 "—" if j is None else f"{j['activation_residual_bytes'] / MIB:.1f}",
                 "—" if j is None else f"{j['flops_ratio']:.5f}",
                 "yes" if p["met_own"] else "no", "yes" if p["met_common"] else "no",
                 f"{p['matmul_flops_ratio']:.5f}", "—" if j is None else f"{j['matmul_flops_ratio']:.5f}"])
  table = common.markdown_table(["torch budget", "torch saved MiB", "torch FLOPs÷own none",
                                 "torch FLOPs÷jaxckpt none", "jaxckpt saved MiB", "jaxckpt FLOPs÷none",
                                 "met (own)", "met (common)", "torch matmul÷none", "jaxckpt matmul÷none"], rows)
  named = "\n".join(f"- `{k}`: {v['activation_residual_bytes'] / MIB:.1f} MiB, FLOPs ×{v['flops_ratio']:.5f}"
                    for k, v in data["named"].items())
  budgets = "\n".join(
      f"- budget:{b['budget_percent']:g}%: compiled temp {b['temp_bytes'] / MIB:.1f} MiB ≤ {b['limit_bytes'] / MIB:.1f}"
      f" MiB ({b['fits']}), {b['activation_residual_bytes'] / MIB:.1f} MiB saved, FLOPs ×{b['flops_ratio']:.4f}, "
      f"planning {b['planning_s']:.0f} s = {b['planning_s'] / b['mean_compile_s']:.1f} compiles"
      if b["feasible"] else f"- budget:{b['budget_percent']:g}%: {b['error']}" for b in data["budgets"])
  quoted = "\n".join(
      f"- quoted torch {q['budget']:g}: {q['saved_mib']} MiB ×{q['flops_ratio']:.4f} | jaxckpt "
      + ("—" if q["jaxckpt"] is None else
         f"{q['jaxckpt']['activation_residual_bytes'] / MIB:.1f} MiB ×{q['jaxckpt']['flops_ratio']:.5f}")
      + f" met {q['met']}" for q in data.get("quoted_torch_points", []))
  return (f"{common.header(data)}\n\n{table}\n\n{named}\n\n{budgets}\n\n{quoted}\n\n{_render_whole(data)}\n\n"
          f"{_render_whole(data, 'mincut')}")


def _render_whole(data, key: str = "whole") -> str:
  """The whole-loss (``key="whole"``) or mincut front beside the torch points (empty when the JSON has none)."""
  whole = data.get(key)
  if not whole:
    return ""
  temps = key == "mincut"
  by_cap = {p["cap_bytes"]: p for p in whole["plans"]}
  rows = []
  for t in whole["torch_points"]:
    p = by_cap[t["cap_bytes"]]
    rows.append([f"{t['budget']:g}", f"{t['saved_mib']:.1f}", f"{t['flops_ratio_own']:.5f}",
                 f"{t['flops_ratio_common']:.5f}", f"{p['activation_residual_bytes'] / MIB:.1f}",
                 f"{p['flops_ratio']:.5f}", f"{p['flops_ratio_step']:.5f}",
                 "yes" if t["met_own"] else f"no (by {t['miss_own']:.5f})",
                 "yes" if t["met_common"] else f"no (by {t['miss_common']:.5f})",
                 f"{p['solve_s']:.1f}" + (f" ({p['mip_gap']:.1e})" if p["mip_gap"] else "")]
                + ([f"{p['temp_bytes'] / MIB:.1f}"] if temps else []))
  table = common.markdown_table(["torch budget", "torch saved MiB", "torch FLOPs÷own none", "torch FLOPs÷jaxckpt none",
                                 f"{key} saved MiB", f"{key} FLOPs÷none", f"{key} FLOPs÷step none", "met (own)",
                                 "met (common)", "solve s (gap)"] + (["temp MiB"] if temps else []), rows)
  quoted = "\n".join(
      f"- quoted torch {q['budget']:g}: {q['saved_mib']} MiB ×{q['flops_ratio']:.4f} | {key} "
      f"{by_cap[q['cap_bytes']]['activation_residual_bytes'] / MIB:.1f} MiB ×{by_cap[q['cap_bytes']]['flops_ratio']:.5f}"
      f" met {q['met']}" + ("" if q["met"] else f" (by {q['miss']:.5f})") for q in whole["quoted_torch_points"])
  g = whole["graph"]
  head = (f"{'Whole-loss' if key == 'whole' else 'Mincut (segmented whole-loss)'} plans: {g['equations']} equations, "
          f"{g['values']} values, program {g['binaries']} binaries × {g['rows']} rows; {whole['seconds']:.0f} s")
  if temps:
    head += (f"; {len(whole['regions'])} regions; compiled temp without remat (the same unrolled step) "
             f"{whole['none_temp_bytes'] / MIB:.1f} MiB")
  if whole.get("no_recompute"):
    p = by_cap[whole["no_recompute"]["cap_bytes"]]
    head += (f"\n\nLeast saved with no recompute: {p['activation_residual_bytes'] / MIB:.1f} MiB "
             f"×{p['flops_ratio']:.5f} (live ×{p['live_flops_ratio']:.5f})")
  return f"{head}\n\n{table}\n\n{quoted}" if rows else head



def _extra(ratio: float) -> float:
  """FLOPs ratio as extra percent (torch's 0.9998 shows as −0.02%)."""
  return (ratio - 1) * 100


def _plot(data, path: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  tp = data["torch_points"]
  if tp:
    ax.plot([p["saved_mib"] for p in tp], [_extra(p["flops_ratio_own"]) for p in tp], "s-", color="tab:red",
            label=f"PyTorch {data['torch']['version']} min-cut, jaxckpt's FLOP rules, / torch's none", zorder=3)
    ax.plot([p["saved_mib"] for p in tp], [_extra(p["flops_ratio_common"]) for p in tp], "s--", color="salmon",
            label="the same / jaxckpt's none (absolute FLOPs)", zorder=3)
  qp = data.get("quoted_torch_points") or []
  if qp:
    ax.plot([q["saved_mib"] for q in qp], [_extra(q["flops_ratio"]) for q in qp], "x:", color="tab:purple",
            label=f"PyTorch {data['quoted_torch_version']} as quoted in the issue (other FLOP count)", zorder=2)
  ax.plot([b["saved_mib"] for b in data["before"]], [_extra(b["flops_ratio"]) for b in data["before"]], "o:",
          color="gray",
          label="jaxckpt before (budgets, built-ins)", zorder=2)
  pts = sorted(list(data["front"]) + [p["jaxckpt"] for p in tp if p["jaxckpt"]] + list(data["named"].values()),
               key=lambda f: f["activation_residual_bytes"])
  front, best = [], None
  for f in pts:
    if best is None or f["flops_ratio"] < best:
      best = f["flops_ratio"]
      front.append(f)
  ax.plot([f["activation_residual_bytes"] / MIB for f in front], [_extra(f["flops_ratio"]) for f in front], "D-",
          color="tab:blue", label="jaxckpt per-block per-tensor plans (measured)", zorder=4)
  for key, style, color, label in (
      ("whole", "^-", "tab:green", "jaxckpt whole-loss per-tensor plans (one remat region, measured)"),
      ("mincut", "v--", "darkgreen", "jaxckpt mincut:<cap> (the same, one region per block + head, measured)")):
    if not data.get(key):
      continue
    wp, best = [], None
    for p in sorted(data[key]["plans"], key=lambda p: (p["activation_residual_bytes"], p["flops_ratio"])):
      if best is None or p["flops_ratio"] < best:  # Pareto-filtered, as the block front
        best = p["flops_ratio"]
        wp.append(p)
    ax.plot([p["activation_residual_bytes"] / MIB for p in wp], [_extra(p["flops_ratio"]) for p in wp], style,
            color=color, label=label, zorder=4)
  ms = data["named"]["min_saved"]
  ax.scatter([ms["activation_residual_bytes"] / MIB], [_extra(ms["flops_ratio"])], marker="*", s=150, color="gold",
             edgecolor="k", label="min_saved", zorder=5)
  ax.set_xlabel("saved for backward, MiB (parameters excluded)")
  ax.set_ylabel("extra train-step FLOPs vs no remat, % (symlog)")
  ax.set_yscale("symlog", linthresh=0.1)
  ax.set_title(f"GPT {data['preset']}: memory/recompute fronts", fontsize=9)
  common.save_plot(fig, ax, path)


if __name__ == "__main__":
  main()
