"""Key names of the memory report's JSON (``jaxckpt-report --json``), in one place.

Memory keys are :data:`jaxckpt.schema.MEMORY_KEYS` (the classifier's ``metrics.json`` uses the same), so report rows
and experiment metrics can be joined. Bytes are ints, FLOPs ints, seconds floats; a missing value is ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxckpt.schema import MEMORY_KEYS

STATUS_OK = "ok"
STATUS_ERROR = "error"
STRUCTURES = ("scan", "unrolled")
"""How the report's ``structure`` starts: layers stacked with ``scan`` or unrolled (then ", every:K" / ", nested:D"
when the stacks group their blocks, see :mod:`jaxckpt.core._structure`)."""

REPORT_KEYS: tuple[str, ...] = (
    "schema_version",  # jaxckpt.schema.SCHEMA_VERSION.
    "model",  # Model name (shipped: vit/mlp/cnn) or the target's name.
    "preset",  # Preset name, or None for user targets.
    "backend",  # The platform the steps were compiled for: cpu, gpu, tpu (a topology's: tpu, compiled without a TPU).
    "device_kind",  # JAX's device_kind of those devices: "cpu", "TPU v5 lite", "NVIDIA H100 80GB HBM3".
    "compiler",  # What compiled them: "XLA:CPU (jaxlib 0.10.2)", "XLA:TPU (libtpu 0.0.42.1)", "XLA:GPU (jax-cuda12-...)".
    "topology",  # The TPU slice or GPU cluster compiled for without its hardware ("v5e:2x2", "h100:8"), else None.
    "device_count",  # Devices compiled for: the mesh's (a topology's chips), else jax.device_count().
    "mesh",  # {axis: size} of the mesh the step was sharded over; None: one device, unsharded.
    "mesh_given",  # Whether the mesh was given (mesh=, --mesh); false: none, or a topology's default (all on data).
    "structure",  # "scan" or "unrolled", then ", <checkpoint structure>" unless block (e.g. "scan, nested:2").
    "batch_size",  # Examples per train step, global (over the mesh's batch axes; all micro-batches together).
    "grad_accum_steps",  # Micro-batches per train step (1 = no gradient accumulation).
    "versions",  # jaxckpt.schema.versions().
    "compiler_options",  # XLA options every policy was compiled with (the CPU remat fix; dump options excluded).
    "warnings",  # One line each: invalid specs, policies that save nothing, measurement caveats.
    "units",  # Row key -> what its number counts: "bytes per GPU", "FLOPs per step, global (every device)", ...
    "rows",  # One per policy, keys ROW_KEYS.
)
"""Top-level keys of the report JSON, in order."""

ROW_KEYS: tuple[str, ...] = (
    "policy",  # Canonical policy spec (str(parse_model_policy(...))); for a budget the budget (plan in "plan").
    "status",  # "ok" or "error".
    "error",  # One-line message when status is "error", else None.
    "warning",  # One line when an ok row's policy had no effect in the compiled program (report.effect), else None.
    *MEMORY_KEYS,  # XLA's CompiledMemoryStats under the schema's names (bytes), footprint_bytes last.
    "flops",  # FLOPs of the whole train step from the jaxpr (scan bodies × trip count).
    "flops_xla_raw",  # XLA's cost_analysis()["flops"] (counts a loop body once).
    "residual_bytes",  # Bytes saved for the backward pass, arguments (params, batch) excluded.
    "activation_residual_bytes",  # residual_bytes minus values of the params only (per-layer parameter slices).
    "residuals",  # {"count", "bytes", "groups", "by_source", "items", "analysed"}: see report.residuals.
    "remat_regions",  # jax.checkpoint equations in the traced step (a scan body once): 0 for none, > 0 otherwise.
    "remat_impl",  # JAX's remat implementation that compiled the row: "remat2" (default) or "remat3" (JAX_REMAT3=1).
    "backend",  # The platform this row was compiled for (the report's backend): cpu, gpu, tpu.
    "cpu",  # --compare-cpu: the same policy on XLA:CPU at the per-chip batch ({"backend", "batch_size", memory keys,
    # "flops_xla_raw", "compile_s"}, one device, unsharded); else None.
    "same_program_as",  # Policy of an earlier row that lowered to the identical program (stats reused), else None.
    "compile_s",  # Seconds to trace, lower and compile the step (trace + lower only when the program was reused).
    "stages_s",  # Seconds per stage of this row: {"build", "trace", "lower", "flops", "residuals", "compile"}.
    "step_time_s",  # --measure: median seconds per step after warm-up; else None.
    "step_time_estimate",  # A topology's compile: its program's step time (report._compile.step_time_estimate:
    # StepTime.as_dict(): "seconds", "bound", "terms", "exposed", ...; and "recompute_s"; one device); else None.
    "collectives",  # A topology's compile over a mesh: what the step sends, one record per (kind, mesh axes, in the
    # layer loop or not) (jaxckpt.analysis.CollectiveUse.as_dict(): "kind", "axes", "in_loop", "group_size",
    # "instructions", "runs", "bytes" per device per step, "largest_bytes" of one run; all-reduces: "sliced_bytes",
    # results only sliced afterwards, a reduction to shards run as an all-reduce, and "largest_kept_bytes"), the most
    # bytes first; else None.
    "peak_bytes_measured",  # --measure: measured peak bytes of the step (see report.measure); else None.
    "xla_dump",  # --xla-dump: {"dir", "files", "peak_buffers"}; else None.
    "profile",  # --profile DIR: {"dir": DIR/<policy slug>, "files": [*.xplane.pb]} (jaxckpt.training._profile); else None.
    "plan",  # Budget rows (budget:40%, auto): jaxckpt.planner.Plan.to_json() without candidates; else None.
)
"""Keys of every report row, in order."""


def empty_row(policy: str) -> dict:
  """A row with every key of :data:`ROW_KEYS`: ``policy`` set, ``status`` ok, every statistic ``None``."""
  row = dict.fromkeys(ROW_KEYS)
  row.update(policy=policy, status=STATUS_OK)
  return row


UNITS: dict[str, str] = {
    "footprint_bytes": "device", "host_footprint_bytes": "device", "temp_bytes": "device",
    "peak_bytes_measured": "device", "cpu.footprint_bytes": "device", "cpu.temp_bytes": "device",
    "flops_xla_raw": "device",
    "residual_bytes": "global", "flops": "global",
    "step_time_s": "/step", "step_time_estimate.seconds": "/step", "step_time_estimate.recompute_s": "/step",
}
"""What each number of a row counts (``cpu.<key>``: a key of the row's ``cpu`` dict): ``device`` one device's (the
compiled program each device runs: memory, XLA's own FLOP count; ``--compare-cpu``'s one CPU device at the per-chip
batch; ``--measure``'s one device), ``global`` the whole batch over every device (the residual analysis, before the
compiler; the train step's FLOPs from the jaxpr), ``/step`` seconds per train step. Every number is one train
step's; ``compile_s`` is the tool's own seconds."""


def device_word(data: Mapping[str, Any], key: str = "footprint_bytes") -> str:
  """What one device is in a report (``data``: its JSON): ``chip`` (a TPU topology), ``GPU`` (a GPU cluster), else
  ``device`` (and for the ``cpu.`` keys of ``--compare-cpu``)."""
  if data.get("topology") and not key.startswith("cpu."):
    return "GPU" if data.get("backend") == "gpu" else "chip"
  return "device"


def unit_descriptions(data: Mapping[str, Any]) -> dict[str, str]:
  """Row key -> what its number is, in words (the JSON's ``units``): ``"bytes per GPU"``, ``"FLOPs per step, global
  (every device)"``, ``"seconds per step"``."""
  words = {"global": "global (the whole batch, every device)", "/step": "per step"}
  out = {}
  for key, unit in UNITS.items():
    what = "FLOPs per step" if key.startswith("flops") else "seconds" if unit == "/step" else "bytes"
    where = f"per {device_word(data, key)}" if unit == "device" else words[unit]
    out[key] = f"{what} {where}" + (" (one CPU device at the per-chip batch)" if key.startswith("cpu.") else "")
  return out
