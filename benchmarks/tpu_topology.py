"""Planning for a TPU without a TPU: GPT-2 small compiled by the TPU compiler (v5e:2x2, v4:2x2x1) beside XLA:CPU.

Per topology, the train step of GPT-2 small (``gpt2-small``: 12 layers, d=768, T=1024, V=50257, float32), sharded over
every chip on the ``data`` axis, compiled deviceless by libtpu's TPU compiler (:mod:`jaxckpt.sharding`) and
by XLA:CPU on one device at the per-chip batch (the report's ``--compare-cpu``):

1. the footprint per chip of each policy at 2 sequences per chip (``jaxckpt-report --topology T --compare-cpu``; on
   the TPU the footprint is the compiler's peak, :data:`jaxckpt.training._xla.PEAK_TEMP_BACKENDS`);
2. the largest micro-batch per chip within the chip's HBM less 10% (``jaxckpt-fit --topology T``; the CPU column is
   ``jaxckpt-fit`` on one CPU device with the same memory): where the two compilers disagree;
3. compile seconds of each.

Usage: ``python benchmarks/tpu_topology.py [--quick] [--topologies v5e:2x2 v4:2x2x1]`` (needs ``pip install -e
".[tpu]"``; ``--quick``: GPT tiny on v5e:2x2, two policies).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from jaxckpt.fit import fit_policies, resolve_memory
from jaxckpt.report import build_report
from jaxckpt.step import shipped_target
from jaxckpt.sharding import get_topology

NAME = "tpu_topology"
POLICIES = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
PER_CHIP = 2
"""Sequences per chip of the footprint comparison (the report's rows)."""


def footprints(preset: str, name: str, policies: Sequence[str]) -> list[dict[str, Any]]:
  """The report on the topology with the XLA:CPU comparison: one record per policy (bytes, seconds)."""
  topo = get_topology(name)
  target = shipped_target("gpt", preset, batch_size=PER_CHIP * topo.chips)
  report = build_report(target, list(policies), topology=topo, compare_cpu=True, residuals=False, progress=False)
  out = []
  for row in report.rows:
    cpu = row["cpu"] or {}
    out.append({"policy": row["policy"], "status": row["status"], "error": row["error"],
                "footprint_bytes": row["footprint_bytes"], "temp_bytes": row["temp_bytes"],
                "peak_memory_bytes": row["peak_memory_bytes"], "compile_s": row["compile_s"],
                "stages_s": row["stages_s"], "cpu_footprint_bytes": cpu.get("footprint_bytes"),
                "cpu_temp_bytes": cpu.get("temp_bytes"), "cpu_compile_s": cpu.get("compile_s")})
    print(f"{name} {row['policy']}: footprint {common.mib(row['footprint_bytes'])} (cpu "
          f"{common.mib(cpu.get('footprint_bytes'))}), compile {row['compile_s']:.1f} s", flush=True)
  return out


def largest_batches(preset: str, name: str | None, policies: Sequence[str], memory: int) -> dict[str, Any]:
  """The fit planner on the topology (``name``) or on one CPU device (``None``) within ``memory`` bytes per device:
  per policy the largest micro-batch per device, compiles and seconds."""
  target = shipped_target("gpt", preset)
  started = time.perf_counter()
  fits = fit_policies(target, list(policies), memory, topology=name, max_batch=2048)
  chips = get_topology(name).chips if name is not None else 1
  rows = {f.policy: {"max_batch_size": f.max_batch_size, "per_device": None if f.max_batch_size is None
                     else f.max_batch_size // chips, "footprint_bytes": f.footprint_bytes, "compiles": f.compiles,
                     "seconds": f.seconds, "method": f.method, "over_bytes_at_next": f.verified_over,
                     "compile_s": [p.compile_s for p in f.points]} for f in fits}
  print(f"{name or 'cpu'} fit within {common.mib(memory)}: "
        + ", ".join(f"{p} {r['per_device']}/device ({r['compiles']} compiles)" for p, r in rows.items()), flush=True)
  return {"memory_bytes": memory, "seconds": time.perf_counter() - started, "policies": rows}


def render(data: Mapping[str, Any]) -> str:
  """The docs block: per topology, per policy the footprint per chip and the largest micro-batch per chip, TPU
  compiler beside XLA:CPU, and where the two disagree."""
  lines = [f"Run: {common.header(data)}; model gpt:{data['preset']}, float32, every chip on the data axis.", ""]
  for topo in data["topologies"]:
    name, fits_tpu, fits_cpu = topo["topology"], topo["fit"]["policies"], topo["cpu_fit"]["policies"]
    base = next((r for r in topo["rows"] if r["policy"] == "none"), None)
    rows = []
    for r in topo["rows"]:
      t, c = fits_tpu.get(r["policy"], {}), fits_cpu.get(r["policy"], {})
      ratio = (f"{r['footprint_bytes'] / base['footprint_bytes']:.2f} / "
               f"{r['cpu_footprint_bytes'] / base['cpu_footprint_bytes']:.2f}") if base and r["footprint_bytes"] \
          and r["cpu_footprint_bytes"] else "—"
      rows.append([r["policy"], common.mib(r["footprint_bytes"]), common.mib(r["cpu_footprint_bytes"]), ratio,
                   t.get("per_device", "—"), c.get("per_device", "—"),
                   f"{r['compile_s']:.0f} / {r['cpu_compile_s']:.0f}" if r["cpu_compile_s"] else "—"])
    lines += [f"**{topo['describe']}** — footprint at {data['per_chip']} sequences per chip; largest micro-batch per "
              f"chip within {common.mib(topo['fit']['memory_bytes'])} ({topo['fit'].get('memory_source', 'given')}); "
              f"fit {topo['fit']['seconds']:.0f} s on the topology, {topo['cpu_fit']['seconds']:.0f} s on XLA:CPU:", "",
              common.markdown_table(["policy", "footprint (TPU)", "footprint (XLA:CPU)", "×none (TPU / CPU)",
                                     "max batch/chip (TPU)", "max batch/chip (XLA:CPU)", "compile s (TPU / CPU)"],
                                    rows), ""]
    order = lambda key: " < ".join(r["policy"] for r in sorted(topo["rows"], key=lambda r: r[key] or 0))  # noqa: E731
    lines.append(f"Order by footprint: TPU {order('footprint_bytes')}; XLA:CPU {order('cpu_footprint_bytes')}.")
    lines.append("")
  return "\n".join(lines).rstrip()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the result record."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--topologies", nargs="+", default=["v5e:2x2", "v4:2x2x1"], metavar="NAME")
  p.add_argument("--policies", nargs="+", default=list(POLICIES))
  args = p.parse_args(argv)
  preset = "gpt2-small"
  if args.quick:
    preset, args.topologies, args.policies = "tiny", ["v5e:2x2"], ["none", "nothing_saveable"]
  common.check_out(p, NAME, args)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  record.update(preset=preset, per_chip=PER_CHIP, topologies=[])
  partial = common.out_path(NAME, args) + ".partial"
  for name in args.topologies:
    topo = get_topology(name)
    memory, source = resolve_memory("auto", device=topo.devices[0]) if not args.quick else (24 * 2**20, "given")
    entry = {"topology": name, "describe": topo.describe(), "device_kind": topo.device_kind, "chips": topo.chips,
             "rows": footprints(preset, name, args.policies)}
    record["topologies"].append(entry)
    common.write_json(partial, record)
    entry["fit"] = {**largest_batches(preset, name, args.policies, memory), "memory_source": source}
    common.write_json(partial, record)
    entry["cpu_fit"] = largest_batches(preset, None, args.policies, memory)
    common.write_json(partial, record)
  record = common.publish(record, started, render, NAME, args)
  os.remove(partial)
  return record


if __name__ == "__main__":
  main()
