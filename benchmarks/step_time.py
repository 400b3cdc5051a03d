"""The step-time model read from the compiled program (:mod:`jaxckpt.timing`) beside MaxText's measured throughput.

Every Trillium row of ../shared/published-configs.md §2 with a published tokens/s/chip and a dense model (T1–T8, T13;
the rows of :mod:`benchmarks.published_configs`) is compiled deviceless by the TPU compiler on its topology, with the
XLA flags MaxText ran it with (:data:`MAXTEXT_FLAGS`), and its step is estimated from the compiled program:
``predicted tokens/s/chip = per-chip batch × sequence length / estimated step seconds``. Beside it: the published
figure, the error, the term that bounds the step, the busy seconds per term and what of them the schedule leaves
exposed, and the roofline at peak of jaxckpt's fit planner (``roofline``: the step's dot FLOPs per chip at the chip's
peak), the model this one replaces.

Depth. Each row is compiled with ``--layers`` layers (default 4) instead of its model's: the scanned decoder's loop
body is the same program at any depth, and the estimate runs each layer loop ``real − compiled`` more times
(:func:`jaxckpt.timing.layer_trip_counts`). ``--full-depth T13`` also compiles a row at its real depth and records
both estimates (docs/timing.md gives the check).

No constant is fitted to the published rows: every figure comes from the chip table (:data:`jaxckpt.sharding.CHIPS`,
each with its source) and the compiled program.

Usage: ``python benchmarks/step_time.py [--rows T1 T4] [--layers 4] [--full-depth T13] [--quick]`` (needs
``pip install -e ".[tpu]"``). Each row is one TPU compile of a 8–256-chip program, 5–15 minutes on 2 cores; the
compiled program is kept in the compiled-stats cache (``JAXCKPT_STATS_CACHE``), so a second run (or a change to the
model) re-estimates in seconds. ``--quick``: T13 at 3 layers.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.published_configs import ROWS as PUBLISHED_ROWS
from benchmarks.published_configs import Row, target
from jaxckpt import parse_model_policy
from jaxckpt.analysis import parse_hlo
from jaxckpt.models import model_entry
from jaxckpt.sharding import get_topology
from jaxckpt.step import lower_policy
from jaxckpt.timing import OVERLAP_RULES, estimate_step_time, layer_trip_counts, links_for

NAME = "step_time"

ROW_KEYS = ("T1", "T2", "T3", "T4", "T5", "T6", "T7", "T8", "T13")
"""The rows with a published throughput (../shared/published-configs.md §2), in its order."""

ORDER = ("T4", "T5", "T7", "T6")
"""Llama 3.1 70B's four rows in the order of their measured throughput (960 > 942 > 921 > 877 tokens/s/chip)."""

CF_FOR_ALL_GATHER = {"xla_tpu_enable_async_collective_fusion": True,
                     "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
                     "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
                     "xla_tpu_overlap_compute_collective_tc": True, "xla_enable_async_all_gather": True}
LAYOUT_FOR_ALL_REDUCE_SCATTER = {"xla_tpu_use_minor_sharding_for_major_trivial_input": True,
                                 "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": 1,
                                 "xla_tpu_assign_all_reduce_scatter_layout": True}
DATA_PARALLEL_OVERLAP = {"xla_tpu_enable_data_parallel_all_reduce_opt": True,
                         "xla_tpu_data_parallel_opt_different_sized_ops": True}
DISABLE_COLLECTIVE_MATMUL = {"xla_jf_spmd_threshold_for_windowed_einsum_mib": 1000000}
"""MaxText's flag sets (``benchmarks/xla_flags_library.py`` at MT@e591f30c), as compiler options."""

_BASE = {**LAYOUT_FOR_ALL_REDUCE_SCATTER, **DATA_PARALLEL_OVERLAP, **CF_FOR_ALL_GATHER}
MAXTEXT_FLAGS: dict[str, dict[str, Any]] = {
    "T1": _BASE, "T2": _BASE, "T3": {**_BASE, **DISABLE_COLLECTIVE_MATMUL}, "T4": _BASE, "T5": _BASE, "T6": _BASE,
    "T7": {**_BASE, **DISABLE_COLLECTIVE_MATMUL}, "T8": CF_FOR_ALL_GATHER, "T13": {**_BASE, **DISABLE_COLLECTIVE_MATMUL},
}
"""Per row, the XLA flags of its MaxText config (``benchmarks/maxtext_trillium_model_configs.py``) that this compile
gives: ``DENSE_VMEM_LIMIT_FLAG`` (every row, :attr:`Row.vmem_kib`), ``LAYOUT_FOR_ALL_REDUCE_SCATTER``,
``DATA_PARALLEL_OVERLAP``, ``CF_FOR_ALL_GATHER``, ``DISABLE_COLLECTIVE_MATMUL`` where the config has them;
``HOST_OFFLOAD_FLAGS`` come with every offload policy (:data:`jaxckpt.step.HOST_OFFLOAD_OPTIONS`). Not given:
``ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE`` (T1–T3, T8, T13), which moves all-reduces to the SparseCore and
needs a chip configuration the deviceless topology does not take (its configs remove the megachip flag)."""


def published_tokens(row: Row) -> float:
  """The published tokens/s/chip of a row (its ``published`` text: "… 7,207 tok/s/chip")."""
  m = re.search(r"([\d,]+) tok/s", row.published)
  return float(m.group(1).replace(",", ""))


def real_layers(row: Row) -> int:
  """The layers of the row's model (its preset's)."""
  return model_entry("llm").override(row.preset).num_layers


def compile_row(row: Row, layers: int | None) -> tuple[Any, Any, Any]:
  """``(CompiledPolicy, topology, mesh)`` of a row at ``layers`` (``None``: its real depth), with its program text
  (from the compiled-stats cache when compiled before)."""
  built, chips = target(row, num_layers=layers)
  topo = get_topology(row.topology)
  mesh = topo.mesh({"fsdp": chips})
  options = {"xla_tpu_scoped_vmem_limit_kib": row.vmem_kib, **MAXTEXT_FLAGS[row.key]}
  lowered = lower_policy(built, parse_model_policy(row.policy), mesh=mesh, options=options)
  return lowered.compile(program_text=True), topo, mesh


def estimate_row(text: str, row: Row, topo: Any, mesh: Any, compiled_layers: int | None) -> dict[str, Any]:
  """The row's estimates from its compiled program: per overlap rule, and the roofline at peak."""
  module = parse_hlo(text)
  depth = real_layers(row)
  trips = layer_trip_counts(module, compiled_layers, depth) if compiled_layers and compiled_layers < depth else {}
  links = links_for(topo, mesh)
  tokens = row.per_device * row.seq_len
  out: dict[str, Any] = {"trip_counts": trips, "loops": {w.name: w.trip_count for w in module.while_loops}}
  for rule in OVERLAP_RULES:
    step = estimate_step_time(module, topo.chip, links=links, overlap=rule, trip_counts=trips)
    out[rule] = {**step.as_dict(ops=12 if rule == "schedule" else 0), "tokens_per_s_chip": tokens / step.seconds}
  flops = out["schedule"]["flops"]
  roofline_s = flops / topo.chip.peak_flops
  out["roofline"] = {"seconds": roofline_s, "tokens_per_s_chip": tokens / roofline_s, "flops": flops}
  return out


def run_row(row: Row, *, layers: int | None) -> dict[str, Any]:
  """Compiles one row and estimates its step; the JSON record."""
  started = time.perf_counter()
  compiled, topo, mesh = compile_row(row, layers)
  estimates = estimate_row(compiled.hlo_text(), row, topo, mesh, layers)
  published = published_tokens(row)
  predicted = estimates["schedule"]["tokens_per_s_chip"]
  out = {"key": row.key, "preset": row.preset, "topology": row.topology, "chips": topo.chips,
         "per_device": row.per_device, "seq_len": row.seq_len, "policy": row.policy, "weight_dtype": row.weight_dtype,
         "layers": real_layers(row), "compiled_layers": layers or real_layers(row),
         "flags": sorted(MAXTEXT_FLAGS[row.key]), "memory": dict(compiled.memory), "compile_s": compiled.compile_s,
         "cached": compiled.cached, "published_tokens_per_s_chip": published, "predicted_tokens_per_s_chip": predicted,
         "error": predicted / published - 1.0, "estimates": estimates, "wall_s": time.perf_counter() - started}
  print(f"{row.key} {row.preset} {row.topology} ({out['compiled_layers']} of {out['layers']} layers): predicted "
        f"{predicted:,.0f} tok/s/chip vs {published:,.0f} published ({out['error']:+.1%}), bound by "
        f"{estimates['schedule']['bound']}; {out['wall_s']:.0f} s", flush=True)
  return out


def _pct(x: float) -> str:
  return f"{x:+.1%}"


def render(data: Mapping[str, Any]) -> str:
  """The docs table: per row the predicted tokens/s/chip beside the published, the error, the bound, the terms."""
  rows = {r["key"]: r for r in data["rows"]}
  lines = [f"Run: {common.header(data)}; compiled with {data['layers']} layers, timed at each model's depth "
           "(layer loops × their real trip counts).", "",
           "| row | model | slice | tokens/chip | predicted tok/s/chip | published | error | bound by | step s "
           "| compute s | memory s | custom calls s | collectives s (exposed) | host s (exposed) | roofline tok/s "
           "(error) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for key in ROW_KEYS:
    r = rows.get(key)
    if r is None:
      continue
    s = r["estimates"]["schedule"]
    terms, exposed = s["terms"], s["exposed"]
    coll = sum(v for k, v in terms.items() if k.startswith("collectives"))
    coll_x = sum(v for k, v in exposed.items() if k.startswith("collectives"))
    host = sum(v for k, v in terms.items() if k.startswith("host"))
    host_x = sum(v for k, v in exposed.items() if k.startswith("host"))
    roof = r["estimates"]["roofline"]["tokens_per_s_chip"]
    lines.append(
        f"| {key} | {r['preset']} | {r['topology']} | {r['seq_len']} × {r['per_device']} | "
        f"{r['predicted_tokens_per_s_chip']:,.0f} | {r['published_tokens_per_s_chip']:,.0f} | {_pct(r['error'])} | "
        f"{s['bound']} | {s['seconds']:.2f} | {terms.get('compute', 0):.2f} | {terms.get('memory', 0):.2f} | "
        f"{terms.get('custom_calls', 0):.2f} | {coll:.2f} ({coll_x:.2f}) | {host:.2f} ({host_x:.2f}) | "
        f"{roof:,.0f} ({_pct(roof / r['published_tokens_per_s_chip'] - 1)}) |")
  done = [rows[k] for k in ROW_KEYS if k in rows]
  if done:
    within = sum(abs(r["error"]) <= 0.15 for r in done)
    lines += ["", f"Within ±15% of the published: {within} of {len(done)}."]
    if all(k in rows for k in ORDER):
      predicted = sorted(ORDER, key=lambda k: -rows[k]["predicted_tokens_per_s_chip"])
      rates = ", ".join(format(rows[k]["predicted_tokens_per_s_chip"], ",.0f") for k in predicted)
      lines.append(f"Llama 3.1 70B, predicted order: {' > '.join(predicted)} ({rates}); "
                   f"measured: {' > '.join(ORDER)} (960, 942, 921, 877).")
  for check in data.get("full_depth", []):
    lines.append(f"Full depth, {check['key']}: {check['compiled_layers']} layers compiled → "
                 f"{check['predicted_tokens_per_s_chip']:,.0f} tok/s/chip ({check['estimates']['schedule']['seconds']:.3f} s); "
                 f"{check['reduced_layers']} layers scaled → {check['reduced_prediction']:,.0f} "
                 f"({check['reduced_seconds']:.3f} s): {_pct(check['reduced_seconds'] / check['estimates']['schedule']['seconds'] - 1)}.")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles and estimates the rows asked for (default all) and writes ``benchmarks/results/step_time.json``."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--rows", nargs="+", default=None, help=f"rows, in this order (default: {' '.join(ROW_KEYS)})")
  parser.add_argument("--layers", type=int, default=4, help="layers each row is compiled with (default 4)")
  parser.add_argument("--full-depth", nargs="*", default=[], help="rows also compiled at their real depth")
  parser.add_argument("--compile-only", action="store_true", help="compile (fill the cache) without writing JSON")
  args = parser.parse_args(argv)
  by_key = {r.key: r for r in PUBLISHED_ROWS if r.key in ROW_KEYS}
  chosen = args.rows or (list(ROW_KEYS) if not args.quick else ["T13"])
  unknown = [k for k in [*chosen, *args.full_depth] if k not in by_key]
  if unknown:
    parser.error(f"unknown row(s) {', '.join(unknown)}; valid: {', '.join(ROW_KEYS)}")
  layers = 3 if args.quick else args.layers
  started = time.perf_counter()
  data = common.run_record(NAME, args)
  data.update(rows=[], layers=layers, full_depth=[])
  path = common.out_path(NAME, args)
  for key in dict.fromkeys(chosen):
    if args.compile_only:
      compiled = compile_row(by_key[key], layers)[0]
      print(f"{key}: compiled in {compiled.compile_s:.0f} s (cached: {compiled.cached})", flush=True)
      continue
    data["rows"].append(run_row(by_key[key], layers=layers))
    common.write_json(path, common.finish_record(data, started))
  for key in args.full_depth:
    row = by_key[key]
    if args.compile_only:
      compile_row(row, None)
      continue
    full = run_row(row, layers=None)
    reduced = next((r for r in data["rows"] if r["key"] == key), None)
    if reduced is not None:
      full.update(reduced_layers=reduced["compiled_layers"], reduced_prediction=reduced["predicted_tokens_per_s_chip"],
                  reduced_seconds=reduced["estimates"]["schedule"]["seconds"])
    data["full_depth"].append(full)
    common.write_json(path, common.finish_record(data, started))
  if not args.compile_only:
    print(render(data))
  return 0


if __name__ == "__main__":
  sys.exit(main())
