"""The published JAX GPU training configurations (MaxText on NVIDIA H100 and H200), compiled by XLA:GPU without a GPU:
do they fit, and what does the time model predict beside the measured throughput?

The rows of ../shared/published-configs-gpu.md §3, each with jaxckpt's LLM family (:mod:`jaxckpt.models.llm`) on its
cluster (:mod:`jaxckpt.sharding`: ``h100:8``, ``a3-mega:32x8`` — the H100s of Google Cloud's A3 Mega —,
``h200:32x8``): its batch per GPU × GPUs sequences of its
length, its remat policy by MaxText's name, bfloat16 activations over float32 weights (MaxText's defaults; the rows
set no ``weight_dtype``), its layers scanned or unrolled as its config says, flash attention (the Pallas Triton
kernel: MaxText's ``cudnn_flash_te`` runs cuDNN through Transformer Engine, which needs cuDNN to compile; jaxckpt's
``cudnn`` kernel is the same cuDNN attention and gives its bytes where ``nvidia-cudnn-cu12`` is installed), and its
mesh (MaxText's ``dcn_*`` axes across nodes before its ``ici_*`` axes inside a node: ``data=32,fsdp=8`` for
``dcn_data 32 × ici_fsdp 8``). The memory a GPU may use is its memory × the row's ``XLA_PYTHON_CLIENT_MEM_FRACTION``
(0.90 in JAX-Toolbox's example job and the A3 Mega recipe's launcher, 0.92 in the A3 Ultra one).

Sources: G1 NVIDIA/JAX-Toolbox ``docs/frameworks/maxtext/README.md`` and ``example_slurm.sub`` (Llama 2 7B, 8 × H100,
2 per GPU, 4096 tokens, minimal_flash, scan off, fsdp 8: 0.721 s/step); G2 AI-Hypercomputer/gpu-recipes
``src/frameworks/a3mega/maxtext-configs/llama-2-7b-256gpus-a3mega-bf16.yaml`` (dcn_data 32 × ici_fsdp 8, 4 per GPU,
minimal_flash, scan off: 1.500 s/step, 10,923 tok/s/GPU) and its launcher (fraction 0.9); G3 gpu-recipes
``src/frameworks/a3ultra/maxtext-configs/llama-3.1-70b-256gpus-a3u-bf16.yaml`` (dcn_data 2 × dcn_fsdp 16 × ici_fsdp 8,
2 per GPU, 8192 tokens, save_dot_with_context_except_mlp, scan on: 15.516 s/step, 1,056 tok/s/GPU) and its launcher
(fraction 0.92).

Usage: ``python benchmarks/published_gpu_configs.py [--rows G1 G3] [--quick]`` (needs ``pip install -e ".[gpu]"``;
``--quick``: G1 at 2 layers). Each row is one XLA:GPU compile: seconds to a minute on 2 cores.
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

from benchmarks import common
from jaxckpt import format_bytes
from jaxckpt.fit import accelerator, traffic_seconds
from jaxckpt.models import model_entry
from jaxckpt.report import build_report
from jaxckpt.sharding import mesh_shape, resolve_placement
from jaxckpt.step import ModelTarget

NAME = "published_gpu_configs"


@dataclasses.dataclass(frozen=True)
class Row:
  """One published GPU configuration.

  Attributes:
    key: its row in ../shared/published-configs-gpu.md (``G1``…).
    preset: the :data:`jaxckpt.models.llm.LLM_PRESETS` name.
    topology: the cluster (``h100:32x8``: 32 nodes of 8).
    mesh: the ``--mesh`` (axes across nodes first).
    per_device: MaxText's ``per_device_batch_size`` (sequences per GPU).
    seq_len: ``max_target_length``.
    policy: MaxText's ``remat_policy``, by its name.
    scan: ``scan_layers``.
    memory_fraction: the recipe's ``XLA_PYTHON_CLIENT_MEM_FRACTION``.
    step_s: the published seconds per step.
    published: the published throughput, as the source states it.
  """

  key: str
  preset: str
  topology: str
  mesh: str
  per_device: int
  seq_len: int
  policy: str
  scan: bool
  memory_fraction: float
  step_s: float
  published: str


ROWS: tuple[Row, ...] = (
    Row("G1", "llama2-7b", "h100:8", "fsdp=8", 2, 4096, "minimal_flash", False, 0.90, 0.721,
        "0.721 s/step, 11,361 tok/s/GPU"),
    Row("G2", "llama2-7b", "a3-mega:32x8", "data=32,fsdp=8", 4, 4096, "minimal_flash", False, 0.90, 1.500,
        "1.500 s/step, 10,923 tok/s/GPU, 51.4% MFU"),
    Row("G3", "llama3.1-70b", "h200:32x8", "data=2,fsdp=128", 2, 8192, "save_dot_with_context_except_mlp", True,
        0.92, 15.516, "15.516 s/step, 1,056 tok/s/GPU, 51.4% MFU"),
)
"""The rows of ../shared/published-configs-gpu.md §3."""


def target(row: Row, gpus: int, *, num_layers: int | None = None, attention: str = "pallas") -> ModelTarget:
  """The row's train step as a target: ``per_device × gpus`` sequences, flash attention by ``attention`` (the Pallas
  Triton kernel by default; ``"cudnn"`` needs ``nvidia-cudnn-cu12``)."""
  entry = model_entry("llm")
  config = entry.override(row.preset, seq_len=row.seq_len, attention=attention, scan=row.scan, num_layers=num_layers,
                          batch_size=row.per_device * gpus)
  return ModelTarget(lambda: entry.build(config), entry.batch(row.per_device * gpus, config), entry.loss_fn,
                     name="llm", preset=row.preset)


def predict(row: Row, r: Mapping[str, Any], param_bytes: int) -> dict[str, Any]:
  """The fit planner's time model for the compiled row (:mod:`jaxckpt.fit._speed`): the row's FLOPs (jaxpr count,
  recompute included) per GPU at the GPU's peak, and FSDP's gathers and reduce-scatter and the data all-reduce per
  mesh axis over its link (NVLink inside a node, the network across nodes); XLA:GPU gives no bytes accessed
  deviceless, so no HBM term. Returns ``{"step_s", "bound", "tokens_per_s_gpu", terms...}``."""
  chip = accelerator(row.topology.split(":")[0])
  shape = mesh_shape(resolve_placement(row.mesh, row.topology).mesh)
  micro, step = traffic_seconds(chip, param_bytes, shape)
  terms = chip.terms(r["flops"] / r["device_count"], None, collective_s=micro)
  terms.pop("hbm_s")
  terms["collectives_s"] += step
  total = max(terms.values()) + chip.overhead_s
  return {"step_s": total, "bound": max(terms, key=terms.get).removesuffix("_s"),
          "tokens_per_s_gpu": row.per_device * row.seq_len / total, **terms}


def run_row(row: Row, *, num_layers: int | None = None) -> dict[str, Any]:
  """Compiles one row on its cluster: the report's row (bytes per GPU), the memory XLA may use, the prediction."""
  placement = resolve_placement(row.mesh, row.topology, memory_fraction=row.memory_fraction)
  built = target(row, placement.device_count, num_layers=num_layers)
  started = time.perf_counter()
  report = build_report(built, [row.policy], mesh=placement, residuals=False, progress=False)
  r, limit = report.rows[0], placement.memory()[0]
  from jaxckpt.fit import state_bytes  # the preset's parameter bytes, from its abstract model

  params = state_bytes(built)[0]
  out = {"key": row.key, "preset": row.preset, "topology": row.topology, "mesh": row.mesh,
         "per_device": row.per_device, "seq_len": row.seq_len, "policy": row.policy, "scan": row.scan,
         "num_layers": num_layers, "memory_fraction": row.memory_fraction, "status": r["status"], "error": r["error"],
         "footprint_bytes": r["footprint_bytes"], "temp_bytes": r["temp_bytes"],
         "argument_bytes": r["argument_bytes"], "limit_bytes": limit,
         "fits": r["footprint_bytes"] is not None and r["footprint_bytes"] <= limit, "flops": r["flops"],
         "device_count": placement.device_count, "compile_s": r["compile_s"],
         "wall_s": time.perf_counter() - started, "published": row.published, "published_step_s": row.step_s,
         "compiler": report.data["compiler"], "warnings": report.data["warnings"]}
  out["prediction"] = predict(row, out, params) if r["flops"] else None
  print(f"{row.key} {row.preset} {row.topology} {row.mesh} {row.per_device} per GPU: {r['status']} footprint "
        f"{common.mib(r['footprint_bytes'])} / {common.mib(limit)}, {out['wall_s']:.0f} s", flush=True)
  return out


def render(data: Mapping[str, Any]) -> str:
  """The docs table: per row the footprint per GPU against the memory XLA may use, the prediction, the published."""
  lines = [f"Run: {common.header(data)}; XLA:GPU deviceless ({data['rows'][0]['compiler'] if data['rows'] else ''}).",
           "", "| row | model | cluster | mesh | seq × per GPU | policy | footprint/GPU | XLA may use (fraction) | fits "
           "| roofline at peak (bound by) | roofline tok/s/GPU | published |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    guess = r.get("prediction")
    model = r["preset"] + (f" ({r['num_layers']} layers)" if r.get("num_layers") else "") + \
        ("" if r["scan"] else ", unrolled")
    fits = "yes" if r["fits"] else "no" if r["status"] == "ok" or "does not fit" in (r["error"] or "") else \
        f"error: {r['error']}"
    lines.append(f"| {r['key']} | {model} | {r['topology']} | {r['mesh']} | {r['seq_len']} × {r['per_device']} | "
                 f"{r['policy']} | {format_bytes(r['footprint_bytes']) if r['footprint_bytes'] else '—'} | "
                 f"{format_bytes(r['limit_bytes'])} ({r['memory_fraction']}) | {fits} | "
                 + (f"{guess['step_s']:.3f} s ({guess['bound']}) | {guess['tokens_per_s_gpu']:,.0f} | " if guess
                    else "— | — | ") + f"{r['published']} |")
  return "\n".join(lines)


def repredict(data: Mapping[str, Any]) -> dict[str, Any]:
  """``data`` (a run's JSON) with each row's prediction made again from its stored FLOPs by the current time model
  (:func:`predict`; nothing compiled), and the date of that in ``repredicted_utc``."""
  from jaxckpt.fit import state_bytes  # the preset's parameter bytes, from its abstract model

  by_key = {r.key: r for r in ROWS}
  rows = []
  for r in data["rows"]:
    row = by_key[r["key"]]
    params = state_bytes(target(row, r["device_count"], num_layers=r.get("num_layers")))[0]
    rows.append({**r, "prediction": predict(row, r, params) if r["flops"] else None})
  return {**data, "rows": rows, "repredicted_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles the rows asked for (default all) and writes ``benchmarks/results/published_gpu_configs.json``."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--rows", nargs="+", default=None,
                      help=f"rows to compile, in this order (default all: {' '.join(r.key for r in ROWS)})")
  parser.add_argument("--repredict", metavar="JSON", default=None,
                      help="make the predictions of a run's JSON again with the current time model (no compile) "
                           "and write it back")
  args = parser.parse_args(argv)
  if args.repredict:
    if not os.path.isfile(args.repredict):
      parser.error(f"--repredict {args.repredict}: no such file")
    with open(args.repredict, encoding="utf-8") as f:
      data = repredict(json.load(f))
    common.write_json(args.repredict, data)
    print(render(data))
    return 0
  keys = [r.key for r in ROWS]
  chosen = args.rows or (keys if not args.quick else ["G1"])
  unknown = [k for k in chosen if k not in keys]
  if unknown:
    parser.error(f"unknown row(s) {', '.join(unknown)}; valid: {', '.join(keys)}")
  started = time.perf_counter()
  data = common.run_record(NAME, args)
  data["rows"] = []
  path = common.out_path(NAME, args)
  by_key = {r.key: r for r in ROWS}
  for key in dict.fromkeys(chosen):
    data["rows"].append(run_row(by_key[key], num_layers=2 if args.quick else None))
    common.write_json(path, common.finish_record(data, started))
  print(render(data))
  return 0


if __name__ == "__main__":
  sys.exit(main())
