"""The step-time model on NVIDIA GPU clusters (:mod:`jaxckpt.timing`, :mod:`jaxckpt.timing._gpu`) beside the published
step times of MaxText's GPU runs.

Every bf16 row of ../shared/published-configs-gpu.md §3–§4 (G1–G3, MT-1…MT-4, DX-1…DX-6) is compiled deviceless by
XLA:GPU at its model's full depth on its cluster, with its mesh (MaxText's ``dcn_*`` axes across nodes before its
``ici_*`` axes inside a node), batch per GPU, sequence length, remat policy by MaxText's name, ``scan_layers``,
memory fraction, and the recipes' XLA flags (jaxckpt's default on GPU, :data:`jaxckpt.step.GPU_RECIPE_OPTIONS`).
Its step is estimated from the compiled program (the report's ``est. step``): kernels at the rates the public
measurements give (cuBLAS's maximum achievable matmul FLOPS, the flash attention kernels' measured FLOP/s), NCCL's
collectives over NVLink and the node's NICs, the compiled schedule replayed for overlap. No constant is fitted to
these rows (docs/timing.md).

Attention: the recipes run cuDNN's fused attention (``attention=cudnn_flash_te``). With ``nvidia-cudnn-cu12``
importable (``--attention cudnn``, e.g. ``pip install --target DIR nvidia-cudnn-cu12`` and ``PYTHONPATH=DIR``) the
rows compile and are timed with it; otherwise with the Pallas Triton kernel (``--attention pallas``, the default),
timed at its own rate (FlashAttention-2's), slower than cuDNN's.

Clusters: each row on the machines it ran on. MT-1…MT-4 on Google Cloud's A3 High VMs (MaxText's ``a3`` scripts of
2024-04 run on xpk's ``h100-80gb-8``, ``a3-highgpu-8g``: ``a3-high``, four 200 Gb/s NICs per 8 H100s), G2 on A3 Mega
(``a3-mega``, eight), G3 on A3 Ultra (H200, eight 400 Gb/s NICs: ``h200``), G1 and DX-1…DX-6 on DGX H100 nodes
(``h100``, eight 400 Gb/s NICs) (:data:`jaxckpt.sharding.CHIPS`).

Published step times: the rows' own seconds where the source gives them; MT-1…MT-4 give TFLOP/s per GPU by MaxText's
formula of the time (6 N per token plus causal attention 6 · L · S · H · D per token): step = that FLOP count per
GPU / the published rate.

Usage: ``python benchmarks/step_time_gpu.py [--rows G1 DX-1] [--attention cudnn] [--quick]`` (needs
``pip install -e ".[gpu]"``; ``--quick``: G1 and DX-1 at 4 layers). Each row is one XLA:GPU compile, seconds to
a few minutes on 2 cores.
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
from benchmarks.published_gpu_configs import ROWS as GPU_ROWS
from benchmarks.published_gpu_configs import Row, target
from jaxckpt.models import model_entry
from jaxckpt.report import build_report
from jaxckpt.sharding import resolve_placement

NAME = "step_time_gpu"


def formula_a_step(preset: str, per_device: int, seq_len: int, tflops: float) -> float:
  """Seconds per step from a published TFLOP/s per GPU by MaxText's formula of 2024-04 (6 N per token, N every
  parameter, plus causal attention 6 · L · S · H · D per token)."""
  config = model_entry("llm").override(preset)
  per_token = 6 * config.num_params + 6 * config.num_layers * seq_len * config.num_heads * config.head_dim
  return per_device * seq_len * per_token / (tflops * 1e12)


def _mt(key: str, topology: str, mesh: str, tflops: float) -> Row:
  return Row(key, "llama2-7b", topology, mesh, 4, 4096, "minimal_flash", False, 0.85,
             formula_a_step("llama2-7b", 4, 4096, tflops), f"{tflops:.0f} TFLOP/s/GPU (formula A)")


def _dx(key: str, topology: str, mesh: str, step: float) -> Row:
  return Row(key, "llama2-70b", topology, mesh, 2, 4096, "save_dot_except_mlpwi", True, 0.94, step,
             f"{step:.3f} s/step")


def rows() -> tuple[Row, ...]:
  """Every bf16 row of ../shared/published-configs-gpu.md §3–§4, in its order: §3's
  (:data:`benchmarks.published_gpu_configs.ROWS`, with the memory each recipe's launcher gives) and §4's."""
  return (
      *GPU_ROWS,
      _mt("MT-1", "a3-high:8", "fsdp=8", 492), _mt("MT-2", "a3-high:2x8", "data=2,fsdp=8", 422),
      _mt("MT-3", "a3-high:4x8", "data=4,fsdp=8", 407), _mt("MT-4", "a3-high:8x8", "data=8,fsdp=8", 409),
      _dx("DX-1", "h100:8x8", "fsdp=64", 6.999), _dx("DX-2", "h100:16x8", "fsdp=128", 7.072),
      _dx("DX-3", "h100:32x8", "fsdp=256", 7.153), _dx("DX-4", "h100:64x8", "data=4,fsdp=128", 7.091),
      _dx("DX-5", "h100:128x8", "data=8,fsdp=128", 7.084), _dx("DX-6", "h100:256x8", "data=16,fsdp=128", 7.066),
  )


def run_row(row: Row, *, attention: str, num_layers: int | None = None) -> dict[str, Any]:
  """Compiles one row on its cluster and estimates its step; the JSON record."""
  placement = resolve_placement(row.mesh, row.topology, memory_fraction=row.memory_fraction)
  built = target(row, placement.device_count, attention=attention, num_layers=num_layers)
  started = time.perf_counter()
  report = build_report(built, [row.policy], mesh=placement, residuals=False, progress=False)
  r = report.rows[0]
  estimate = r.get("step_time_estimate")
  out = {"key": row.key, "preset": row.preset, "topology": row.topology, "mesh": row.mesh,
         "per_device": row.per_device, "seq_len": row.seq_len, "policy": row.policy, "scan": row.scan,
         "attention": attention, "num_layers": num_layers, "status": r["status"], "error_message": r["error"],
         "footprint_bytes": r["footprint_bytes"], "limit_bytes": placement.memory()[0],
         "published_step_s": row.step_s, "source": row.published, "estimate": estimate,
         "collectives": r.get("collectives"), "compile_s": r["compile_s"], "wall_s": time.perf_counter() - started}
  if estimate:
    out["predicted_step_s"] = estimate["seconds"]
    out["error"] = estimate["seconds"] / row.step_s - 1.0
    print(f"{row.key} {row.preset} {row.topology} {row.mesh}: predicted {estimate['seconds']:.3f} s vs "
          f"{row.step_s:.3f} s published ({out['error']:+.1%}), bound by {estimate['bound']}; "
          f"{out['wall_s']:.0f} s", flush=True)
  else:
    print(f"{row.key}: {r['status']} {r['error']}", flush=True)
  return out


def _terms(r: Mapping[str, Any]) -> str:
  e = r["estimate"]
  parts = []
  for name, busy in sorted(e["terms"].items(), key=lambda kv: -kv[1])[:5]:
    exposed = e["exposed"].get(name)
    parts.append(f"{name} {busy:.3f}" + (f" ({exposed:.3f})" if exposed else ""))
  return "; ".join(parts)


def render(data: Mapping[str, Any]) -> str:
  """The docs table: per row the predicted step beside the published one, the error, the terms (busy seconds, and
  exposed ones in brackets); the checks of the issue's done-when under it."""
  lines = [f"Run: {common.header(data)}; XLA:GPU deviceless, full depth, attention kernel {data['attention']}.", "",
           "| row | model | cluster | mesh | seq × per GPU | policy | predicted step | published | error | bound by "
           "| terms: busy s (exposed s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  done = [r for r in data["rows"] if r.get("estimate")]
  for r in data["rows"]:
    if not r.get("estimate"):
      lines.append(f"| {r['key']} | {r['preset']} | {r['topology']} | {r['mesh']} | {r['seq_len']} × {r['per_device']} "
                   f"| {r['policy']} | {r['status']}: {r['error_message']} | {r['published_step_s']:.3f} s | | | |")
      continue
    lines.append(f"| {r['key']} | {r['preset']}{'' if r['scan'] else ' (unrolled)'} | {r['topology']} | {r['mesh']} | "
                 f"{r['seq_len']} × {r['per_device']} | {r['policy']} | {r['predicted_step_s']:.3f} s | "
                 f"{r['published_step_s']:.3f} s | {r['error']:+.1%} | {r['estimate']['bound']} | {_terms(r)} |")
  if done:
    within = sum(abs(r["error"]) <= 0.15 for r in done)
    lines += ["", f"Within ±15% of the published step: {within} of {len(done)}."]
    dx = [r["predicted_step_s"] for r in done if r["key"].startswith("DX")]
    if len(dx) > 1:
      lines.append(f"Llama 2 70B, 64 to 2,048 GPUs (DX): predicted {min(dx):.3f}–{max(dx):.3f} s "
                   f"({max(dx) / min(dx) - 1:+.1%} spread; published 6.999–7.153 s, +2.2%).")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles and estimates the rows asked for (default all) and writes ``benchmarks/results/step_time_gpu.json``."""
  parser = common.parser(NAME, __doc__)
  keys = [r.key for r in rows()]
  parser.add_argument("--rows", nargs="+", default=None, help=f"rows, in this order (default: {' '.join(keys)})")
  parser.add_argument("--attention", choices=("pallas", "cudnn"), default="pallas",
                      help="the attention kernel compiled (cudnn needs nvidia-cudnn-cu12 importable)")
  parser.add_argument("--layers", type=int, default=None, help="compile each row with this many layers (default: "
                      "its model's)")
  args = parser.parse_args(argv)
  chosen = args.rows or (keys if not args.quick else ["G1", "DX-1"])
  unknown = [k for k in chosen if k not in keys]
  if unknown:
    parser.error(f"unknown row(s) {', '.join(unknown)}; valid: {', '.join(keys)}")
  started = time.perf_counter()
  data = common.run_record(NAME, args)
  data.update(rows=[], attention=args.attention)
  path = common.out_path(NAME, args)
  by_key = {r.key: r for r in rows()}
  layers = 4 if args.quick else args.layers
  for key in dict.fromkeys(chosen):
    data["rows"].append(run_row(by_key[key], attention=args.attention, num_layers=layers))
    common.write_json(path, common.finish_record(data, started))
  print(render(data))
  return 0


if __name__ == "__main__":
  sys.exit(main())
