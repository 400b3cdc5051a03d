"""Benchmark 5, truth check: measured peak memory of the train step vs the compiled ``footprint_bytes``, per policy.

Usage: ``python benchmarks/truth_check.py [--cases mlp:16384 vit:2048] [--policies …] [--out FILE.json]``.

Per case (a shipped model, ``small`` preset, at a batch size where every policy's footprint is ≥ 300 MiB, so the
process's own noise of a few tens of MiB does not decide the ratio), :func:`jaxckpt.report.build_report` with
``measure=True``: each policy's step is compiled (compile-only stats: ``footprint_bytes`` = argument + output + temp
− alias) and then run in a fresh process (:mod:`jaxckpt.report._measure`): on CPU the kernel's peak-RSS counter is
reset after warm-up and ``VmHWM − baseline`` is read; on GPU/TPU ``peak_bytes_in_use``. The figure per policy is
``measured / footprint``; target within 20% on CPU (10% on GPU). Rows whose footprint is below 300 MiB are flagged
(``footprint_ok``: false), not dropped.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks import common
from jaxckpt.report import build_report
from jaxckpt.step import shipped_target

NAME = "truth_check"
MIN_FOOTPRINT = 300 * 2**20
"""Smallest footprint (bytes) at which the measured/compiled ratio is meaningful on CPU."""
TOLERANCE = {"cpu": 0.20, "gpu": 0.10, "tpu": 0.10}
"""Allowed |measured / footprint − 1| per backend."""
DEFAULT_POLICIES = {
    "mlp": ["all"],  # none, every zero-argument built-in policy, save_only_these_names per checkpoint name
    "vit": ["none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable"],
}


def parse_case(text: str) -> tuple[str, int]:
  """``'mlp:16384'`` -> ``("mlp", 16384)`` (model of the report's shipped targets, batch size)."""
  model, _, batch = text.partition(":")
  if not batch.isdigit() or int(batch) < 1:
    raise ValueError(f"bad case {text!r}: write MODEL:BATCH, e.g. mlp:16384")
  return model, int(batch)


def render(data: dict[str, Any]) -> str:
  """The result as markdown: a header line and the table (docs/benchmarks.md)."""
  rows = data["rows"]
  return "\n".join([
      f"{data['backend']}, {data['method']}; target within {data['tolerance']:.0%}; {common.header(data)}", "",
      common.markdown_table(
          ["model, batch", "policy", "footprint", "measured peak", "measured / footprint"],
          [[f"{r['model']} {r['preset']}, B={r['batch_size']}", f"`{r['policy']}`", common.mib(r["footprint_bytes"]),
            common.mib(r["peak_bytes_measured"]),
            (r["error"] or "error") if r["ratio"] is None else
            f"{r['ratio']:.2f}{'' if r['within_tolerance'] else ' (outside)'}"
            f"{'' if r['footprint_ok'] else ' (footprint < 300 MiB)'}"] for r in rows])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Measures every case and policy, prints the table and writes the JSON; returns the JSON's contents."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--cases", nargs="+", default=None, metavar="MODEL:BATCH",
                 help="models and batch sizes (default mlp:16384 vit:2048; mlp:64 with --quick)")
  p.add_argument("--preset", default=None, help="preset of every case (default small; tiny with --quick)")
  p.add_argument("--policies", nargs="+", default=None, metavar="SPEC",
                 help="policy specs for every case (default: mlp all; vit the five zero-argument built-ins)")
  p.add_argument("--steps", type=int, default=3, help="measured steps per policy (default 3)")
  args = p.parse_args(argv)
  common.check_out(p, NAME, args)
  args.preset = args.preset or ("tiny" if args.quick else "small")
  try:
    cases = [parse_case(c) for c in (args.cases or (["mlp:64"] if args.quick else ["mlp:16384", "vit:2048"]))]
  except ValueError as err:
    p.error(str(err))
  if args.steps < 1:
    p.error("--steps must be ≥ 1")
  backend = jax.default_backend()
  tolerance = TOLERANCE.get(backend, 0.20)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  rows = []
  for model, batch in cases:
    policies = args.policies or (["none", "full"] if args.quick else DEFAULT_POLICIES.get(model, ["all"]))
    try:
      target = shipped_target(model, args.preset, batch_size=batch)
    except ValueError as err:
      p.error(str(err).splitlines()[0])
    report = build_report(target, policies, measure=True, steps=args.steps, residuals=False, progress=False)
    for r in report.rows:
      measured, footprint = r["peak_bytes_measured"], r["footprint_bytes"]
      ratio = measured / footprint if measured is not None and footprint else None
      rows.append({"model": model, "preset": args.preset, "batch_size": batch, "policy": r["policy"],
                   "status": r["status"], "error": r["error"], "footprint_bytes": footprint,
                   "temp_bytes": r["temp_bytes"], "peak_bytes_measured": measured, "ratio": ratio,
                   "within_tolerance": None if ratio is None else abs(ratio - 1) <= tolerance,
                   "footprint_ok": footprint is not None and footprint >= MIN_FOOTPRINT,
                   "step_time_s": r["step_time_s"]})
      print(f"{model} B={batch} {r['policy']}: {ratio}", file=sys.stderr)
  record.update({"backend": backend, "tolerance": tolerance, "min_footprint_bytes": MIN_FOOTPRINT, "rows": rows,
                 "method": "VmHWM − baseline after clear_refs (CPU)" if backend == "cpu" else "peak_bytes_in_use"})
  return common.publish(record, started, render, NAME, args)


if __name__ == "__main__":
  main()
