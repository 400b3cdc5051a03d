"""The published MaxText configurations on Trillium (v6e), compiled deviceless by the TPU compiler: do they fit?

Every row of ../shared/published-configs.md §2 that names a dense model (T1–T8, T13, T17–T20) and the two Mixtral
rows with a published throughput (T11, T12) are compiled with jaxckpt's LLM family (:mod:`jaxckpt.models.llm`) on
their topology, without a TPU (:mod:`jaxckpt.sharding`): its per-device batch × chips sequences of its length, its
remat policy (MaxText's ``custom`` tensors as ``save_and_offload_only_these_names``, its presets by name), bfloat16
activations and its weight dtype, the splash kernel with its block sizes, and its mesh (FSDP over every chip; T12:
``fsdp=64,expert=4``). The table gives the footprint per chip against the chip's HBM, the host bytes per chip of the
offload policies, and the compile seconds.

Mapping of MaxText's settings:

- ``ici_fsdp_parallelism: -1`` and ``ici_fsdp_transpose_parallelism: N`` (T8, T17, T18) are both ``--mesh fsdp=N``:
  with every chip on one FSDP axis the per-chip shards are the same; ``fsdp_transpose`` only changes which physical
  ring the axis is laid on (MaxText's ``mesh_axes``), which a per-chip memory figure does not see.
- ``sa_block_*`` are the splash kernel's blocks (:class:`jaxckpt.models.llm.SplashBlockSizes`); an unset one is
  MaxText's default 512. ``sa_use_fused_bwd_kernel`` is ``fused_bwd``.
- The Mixtral rows are MaxText's ``*_dropped`` configurations: ``megablox: false``, ``sparse_matmul: false``,
  ``capacity_factor: 1.25`` is the dropping dispatch (``moe_dispatch="dropping"``, :mod:`jaxckpt.models.llm._moe`);
  T12's ``ici_expert_parallelism: 4`` with ``ici_fsdp_parallelism: 64`` is ``--mesh fsdp=64,expert=4`` (its
  ``custom_mesh: hybrid_ring_64x4``, a layout of the same axes over the torus, is not given); their
  ``MOE_VMEM_LIMIT_FLAG`` is 81920 KiB. T23 (Mixtral 8x7B dropless, full remat, no published number) is left out.
- MaxText's scoped VMEM limit is given as its runs give it (``xla_tpu_scoped_vmem_limit_kib``: 98304 KiB, MaxText's
  ``DENSE_VMEM_LIMIT_FLAG`` in ``benchmarks/xla_flags_library.py``, on every dense row; 114688 and 122880 KiB on the
  Gemma 2 rows, their ``CUSTOM_VMEM_LIMIT_FLAG``): without it the splash kernel at 2048-token blocks is refused
  (``CompileTimeScopedVmemOom``, measured on T1). The host-offload flags are given for offload policies
  (:data:`jaxckpt.step.HOST_OFFLOAD_OPTIONS`). XLA flags that change only scheduling or fusion (collective matmul,
  continuation fusion of all-gathers, SparseCore offload of all-reduces) are not.

Usage: ``python benchmarks/published_configs.py [--rows T1 T4] [--quick]`` (needs ``pip install -e ".[tpu]"``;
``--quick``: T13 at 2 layers, one compile, for the smoke test). Each row is one compile of a 256-chip program: minutes
on 2 cores; the whole table takes about an hour.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from jaxckpt.models import model_entry
from jaxckpt.models.llm import SplashBlockSizes
from jaxckpt.report import build_report
from jaxckpt.step import ModelTarget
from jaxckpt.sharding import get_topology
from jaxckpt import format_bytes

NAME = "published_configs"

OFFLOAD_5 = "save_and_offload_only_these_names:/decoder_layer_input+query_proj+key_proj+value_proj+out_proj"
"""MaxText ``custom`` with decoder_layer_input, query_proj, key_proj, value_proj and out_proj offloaded."""
OFFLOAD_4 = "save_and_offload_only_these_names:/decoder_layer_input+query_proj+key_proj+value_proj"
"""The same without out_proj (Llama 3.1 70B's rows)."""

ALL_2048 = SplashBlockSizes(q=2048, kv=2048, kv_compute=2048, q_dkv=2048, kv_dkv=2048, kv_dkv_compute=2048,
                            fused_bwd=True)
"""``sa_block_* = 2048`` with ``sa_use_fused_bwd_kernel`` (the Llama 3.1 rows)."""
Q1024 = SplashBlockSizes(q=1024, q_dkv=2048, q_dq=2048)
"""``sa_block_q 1024, sa_block_q_dkv 2048, sa_block_q_dq 2048``, the rest 512."""
Q2048 = SplashBlockSizes(q=2048, q_dkv=2048, q_dq=2048)
"""``sa_block_q, sa_block_q_dkv, sa_block_q_dq = 2048``, the rest 512."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One published configuration.

  Attributes:
    key: its row in ../shared/published-configs.md (``T1``…).
    preset: the :data:`jaxckpt.models.llm.LLM_PRESETS` name.
    topology: the slice (``v6e:16x16`` for v6e-256).
    per_device: MaxText's ``per_device_batch_size`` (sequences per chip).
    seq_len: ``max_target_length``.
    policy: the remat policy in jaxckpt's grammar.
    blocks: the splash kernel's blocks.
    weight_dtype: parameters' (and Adam's moments') dtype.
    vmem_kib: MaxText's ``xla_tpu_scoped_vmem_limit_kib`` for the row (KiB).
    published: the published throughput, as the source states it.
    note: what else the row says.
    moe_dispatch: a Mixture of Experts' dispatch (``dropping`` for MaxText's ``*_dropped`` rows), else ``None``.
    capacity_factor: the dropping dispatch's capacity factor.
    mesh: the mesh, ``None``: FSDP over every chip.
  """

  key: str
  preset: str
  topology: str
  per_device: int
  seq_len: int
  policy: str
  blocks: SplashBlockSizes
  weight_dtype: str = "float32"
  published: str = ""
  note: str = ""
  vmem_kib: int = 98304
  moe_dispatch: str | None = None
  capacity_factor: float | None = None
  mesh: tuple[tuple[str, int], ...] | None = None


ROWS: tuple[Row, ...] = (
    Row("T1", "llama3.1-8b", "v6e:16x16", 4, 8192, OFFLOAD_5, ALL_2048, published="45.46% MFU, 7,207 tok/s/chip"),
    Row("T2", "llama3.1-8b", "v6e:8x8", 5, 8192, OFFLOAD_5, ALL_2048, published="45.7% MFU, 7,247 tok/s/chip"),
    Row("T3", "llama3.1-8b", "v6e:4x4", 3, 8192, OFFLOAD_5, ALL_2048, published="419.5 TF/s, 7,243 tok/s/chip",
        note="also v6e-8 and v6e-32; v6e-16 compiled"),
    Row("T4", "llama3.1-70b", "v6e:16x16", 5, 8192, OFFLOAD_4, ALL_2048, published="50.33% MFU, 960 tok/s/chip"),
    Row("T5", "llama3.1-70b", "v6e:8x16", 4, 8192, OFFLOAD_4, ALL_2048, published="49.4% MFU, 942 tok/s/chip"),
    Row("T6", "llama3.1-70b", "v6e:8x8", 2, 8192, OFFLOAD_4, ALL_2048, published="46.0% MFU, 877 tok/s/chip"),
    Row("T7", "llama3.1-70b", "v6e:4x8", 2, 8192, OFFLOAD_4, ALL_2048, "bfloat16",
        published="48.3% MFU, 921 tok/s/chip"),
    Row("T8", "llama2-70b", "v6e:16x16", 2, 4096, "qkv_proj_offloaded", Q1024, published="43.8% MFU, 905 tok/s/chip",
        note="fsdp_transpose 256 as fsdp=256; pdb 2 of the published log (the config now says 3)"),
    Row("T11", "mixtral-8x7b", "v6e:16x16", 12, 4096, OFFLOAD_5, Q2048, published="35.23% MFU, 3,899 tok/s/chip",
        note="dropping MoE (megablox, sparse_matmul false), capacity factor 1.25", vmem_kib=81920,
        moe_dispatch="dropping", capacity_factor=1.25),
    Row("T12", "mixtral-8x22b", "v6e:16x16", 8, 4096, OFFLOAD_5, Q2048, "bfloat16", published="36.2% MFU, "
        "1,326 tok/s/chip", note="dropping MoE, capacity factor 1.25; ici fsdp 64 × expert 4 (hybrid_ring_64x4 not "
        "given); dtype and weight_dtype bfloat16", vmem_kib=81920, moe_dispatch="dropping", capacity_factor=1.25,
        mesh=(("fsdp", 64), ("expert", 4))),
    Row("T13", "mistral-7b", "v6e:2x4", 6, 8192, OFFLOAD_5, Q2048, published="47.1% MFU, 7,777 tok/s/chip"),
    Row("T17", "gemma2-9b", "v6e:16x16", 3, 8192, "full", Q2048, note="fsdp_transpose 256 as fsdp=256; tuned, "
        "no published number", vmem_kib=114688),
    Row("T18", "gemma2-27b", "v6e:16x16", 2, 8192, "full", Q2048, note="fsdp_transpose 256 as fsdp=256; tuned, "
        "no published number", vmem_kib=122880),
    Row("T19", "llama2-7b", "v6e:16x16", 12, 4096, "full", Q1024, note="'v6e (any)': v6e-256 compiled"),
    Row("T20", "llama3.1-8b", "v6e:16x16", 8, 8192, "full", SplashBlockSizes(),
        note="llama3-8b = llama3.1-8b's dimensions (§3); v6e-256 compiled"),
)
"""The dense Trillium rows and the Mixtral rows with a published number of ../shared/published-configs.md §2, in its
order."""


def target(row: Row, *, num_layers: int | None = None) -> tuple[ModelTarget, int]:
  """The row's train step as a target (``per_device × chips`` sequences) and the chip count."""
  entry = model_entry("llm")
  chips = get_topology(row.topology).chips
  config = entry.override(row.preset, seq_len=row.seq_len, weight_dtype=row.weight_dtype, attention="splash",
                          splash_blocks=row.blocks, num_layers=num_layers, batch_size=row.per_device * chips,
                          moe_dispatch=row.moe_dispatch, capacity_factor=row.capacity_factor)
  batch = entry.batch(row.per_device * chips, config)
  return ModelTarget(lambda: entry.build(config), batch, entry.loss_fn, name="llm", preset=row.preset), chips


def mesh_of(row: Row) -> dict[str, int]:
  """The row's mesh: its own, else FSDP over every chip of its topology."""
  return dict(row.mesh) if row.mesh else {"fsdp": get_topology(row.topology).chips}


def run_row(row: Row, *, num_layers: int | None = None) -> dict[str, Any]:
  """Compiles one row on its topology: the report's row (bytes per chip), the HBM, seconds."""
  built, chips = target(row, num_layers=num_layers)
  topo = get_topology(row.topology)
  started = time.perf_counter()
  report = build_report(built, [row.policy], topology=topo, mesh=mesh_of(row), residuals=False, progress=False,
                        compiler_options={"xla_tpu_scoped_vmem_limit_kib": row.vmem_kib})
  r = report.rows[0]
  hbm = topo.chip.memory_bytes
  out = {"key": row.key, "preset": row.preset, "topology": row.topology, "chips": chips, "per_device": row.per_device,
         "seq_len": row.seq_len, "policy": row.policy, "weight_dtype": row.weight_dtype,
         "blocks": dataclasses.asdict(row.blocks), "vmem_kib": row.vmem_kib, "num_layers": num_layers, "status": r["status"], "error": r["error"],
         "footprint_bytes": r["footprint_bytes"], "host_footprint_bytes": r["host_footprint_bytes"],
         "argument_bytes": r["argument_bytes"], "temp_bytes": r["temp_bytes"], "hbm_bytes": hbm,
         "fits": r["footprint_bytes"] is not None and r["footprint_bytes"] <= hbm, "flops": r["flops"],
         "mesh": mesh_of(row), "moe_dispatch": row.moe_dispatch,
         "compile_s": r["compile_s"], "wall_s": time.perf_counter() - started, "published": row.published,
         "note": row.note, "warnings": report.data["warnings"]}
  print(f"{row.key} {row.preset} {row.topology} pdb {row.per_device}: {r['status']} footprint "
        f"{common.mib(r['footprint_bytes'])} / HBM {common.mib(hbm)}, host {common.mib(r['host_footprint_bytes'])}, "
        f"{out['wall_s']:.0f} s" + (f" — {r['error']}" if r["error"] else ""), flush=True)
  return out


def predict(r: Mapping[str, Any]) -> dict[str, Any] | None:
  """The fit planner's time model (:mod:`jaxckpt.fit._speed`) for a compiled row: one micro-step per chip of the
  row's FLOPs (jaxpr count, recompute included) ÷ chips at v6e's peak, its host bytes moved out and back over the host
  link, and the collectives over ICI (:func:`jaxckpt.fit.traffic_seconds`: FSDP's gathers and reduce-scatter, an
  expert axis's all-to-alls and gradient all-reduce, from the preset's parameter bytes and its
  :func:`jaxckpt.fit.traffic_of`); no HBM term (the rows do not keep XLA's bytes accessed). Returns
  ``{"step_s", "bound", "tokens_per_s_chip", terms...}``, or ``None`` for a row without FLOPs."""
  from jaxckpt.fit import accelerator, traffic_seconds, state_bytes, traffic_of

  if not r.get("flops") or r.get("status") != "ok":
    return None
  row = next(x for x in ROWS if x.key == r["key"])
  built = target(row, num_layers=r.get("num_layers"))[0]
  params, traffic = state_bytes(built)[0], traffic_of(built)
  mesh = r.get("mesh") or mesh_of(row)
  chip = accelerator(r["topology"].split(":")[0])
  micro, step_s = traffic_seconds(chip, params, mesh, **traffic.per_device(r["per_device"]))
  terms = chip.terms(r["flops"] / r["chips"], None, host_bytes=2.0 * (r["host_footprint_bytes"] or 0),
                     collective_s=micro + step_s)
  terms.pop("hbm_s")
  step = max(terms.values()) + chip.overhead_s
  return {"step_s": step, "bound": max(terms, key=terms.get).removesuffix("_s"),
          "tokens_per_s_chip": r["per_device"] * r["seq_len"] / step, **terms}


_REFUSED = re.compile(r"RESOURCE_EXHAUSTED.*?\(([0-9.]+[KMGT]?)\) exceeds available HBM \(([0-9.]+[KMGT]?)\)", re.S)
"""The TPU compiler's refusal of a program over the chip's HBM (:func:`jaxckpt.fit.exhausted_bytes`' pattern)."""


def _gib(num_bytes: int | None) -> str:
  return "—" if num_bytes is None else format_bytes(num_bytes)


def render(data: Mapping[str, Any]) -> str:
  """The docs table: per row the footprint per chip against HBM, the host bytes per chip, the compile seconds."""
  lines = [f"Run: {common.header(data)}; compile s is the TPU compile's when it ran (a row compiled before is read "
           "back from the compiled-stats cache in seconds, docs/tpu.md)."]
  lines += [f"Rows {', '.join(run['rows'])} compiled in a later run: {common.header(run)}." for run in
            data.get("later_runs", ())]
  lines += ["",
           "| row | model | slice | seq × per chip | policy | footprint/chip | HBM | fits | host/chip | compile s |"
           " predicted step (bound by) | predicted tok/s/chip | published |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  done = {r["key"]: r for r in data["rows"]}
  for row in ROWS:  # in the source's order; a row this run did not reach says so
    r = done.get(row.key)
    policy = row.policy.replace("save_and_offload_only_these_names:/", "offload ")
    if r is None:
      lines.append(f"| {row.key} | {row.preset} | {row.topology} | {row.seq_len} × {row.per_device} | {policy} | — | — "
                   f"| not compiled in this run | — | — | — | — | {row.published or '—'} |")
      continue
    fits = "yes" if r["fits"] else ("no" if r["status"] == "ok" else f"error: {r['error']}")
    refused = _REFUSED.search(r.get("error") or "")
    if refused:
      fits = f"no: refused by the compiler, {refused.group(1)} of temporaries > {refused.group(2)} available"
    model = r["preset"] + (f" ({r['num_layers']} layers)" if r.get("num_layers") else "")
    guess = predict(r)
    step = f"{guess['step_s']:.2f} s ({guess['bound']})" if guess else "—"
    rate = f"{guess['tokens_per_s_chip']:,.0f}" if guess else "—"
    lines.append(f"| {r['key']} | {model} | {r['topology']} | {r['seq_len']} × {r['per_device']} | {policy} | "
                 f"{_gib(r['footprint_bytes'])} | {_gib(r['hbm_bytes'])} | {fits} | "
                 f"{_gib(r['host_footprint_bytes'])} | {r['compile_s'] or 0:.0f} | {step} | {rate} | "
                 f"{r['published'] or '—'} |")
  return "\n".join(lines)


def merge(done: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, Any]:
  """``done`` (a run's JSON) with the rows of ``later`` (a run of other rows) put in, replacing rows of the same key,
  and ``later``'s run line kept under ``later_runs`` (the table says which rows it compiled)."""
  keys = {r["key"] for r in later["rows"]}
  run = {k: later[k] for k in ("date_utc", "machine", "wall_s", "cpu_s") if k in later}
  return {**done, "rows": [r for r in done["rows"] if r["key"] not in keys] + list(later["rows"]),
          "later_runs": [*done.get("later_runs", ()), {**run, "rows": sorted(keys)}]}


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles the rows asked for (default all) and writes ``benchmarks/results/published_configs.json``."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--rows", nargs="+", default=None, help=f"rows to compile, in this order (default all: "
                      f"{' '.join(r.key for r in ROWS)})")
  parser.add_argument("--merge", default=None, metavar="JSON",
                      help="afterwards, put this run's rows into that earlier run's JSON (its other rows kept)")
  args = parser.parse_args(argv)
  keys = {r.key for r in ROWS}
  chosen = args.rows or ([r.key for r in ROWS] if not args.quick else ["T13"])
  unknown = [k for k in chosen if k not in keys]
  if unknown:
    parser.error(f"unknown row(s) {', '.join(unknown)}; valid: {', '.join(r.key for r in ROWS)}")
  started = time.perf_counter()
  data = common.run_record(NAME, args)
  data["rows"] = []
  path = common.out_path(NAME, args)
  by_key = {r.key: r for r in ROWS}
  for key in dict.fromkeys(chosen):  # in the order asked; the JSON after every row: a run stopped part-way keeps them
    data["rows"].append(run_row(by_key[key], num_layers=2 if args.quick else None))
    common.write_json(path, common.finish_record(data, started))
  if args.merge is not None:
    with open(args.merge) as f:
      data = merge(json.load(f), data)
    common.write_json(args.merge, data)
  print(render(data))
  return 0


if __name__ == "__main__":
  sys.exit(main())
