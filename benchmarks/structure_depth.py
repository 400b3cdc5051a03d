"""Benchmark 2, depth scaling: compiled temp bytes of the train step vs depth L per checkpoint structure, fitted.

Usage: ``python benchmarks/structure_depth.py [--depths 4 8 … 256] [--no-every-k] [--out FILE.json]``.

Residual MLP (d=128, hidden 128, no dropout, 8192 examples per step: activation-heavy, and a block's working set
is only ~12 block inputs, so it does not hide the L-dependent part of a structure's memory), full AdamW train step,
compile only (:func:`jaxckpt.report.build_report`, nothing is allocated), XLA:CPU with jaxckpt's remat fix. Rows:

- ``none``: no remat; ``full``: every block recomputed (policy ``nothing_saveable``), structure ``block``;
- ``every:4``, ``nested`` (= ``nested:2``), ``nested:3``: those checkpoint structures with policy ``full`` inside
  (Chen et al. 2016's scheme: a group's backward keeps only block inputs).

Each point is compiled twice: at the batch size and at ``--base-batch`` (8). The difference is the *activation*
temp; what stays at batch 8 is batch-independent (parameter gradients and optimizer temporaries, which grow with L
for every structure, and the copies a structure makes of the stacked weights). Per row it fits
``temp(L) = a + b·L^p`` (least squares on relative error, ``p`` on a grid of 0.001) to the activations and to the
total — expected for activations ``p ≈ 1`` for ``none``/``full``/``every:4``, ``≈ 0.5`` for ``nested``, ``≈ 0.33``
for ``nested:3`` — and reports the FLOPs overhead (FLOPs counted from the jaxpr, :mod:`jaxckpt.analysis._flops`) vs ``none`` at each depth. Then, unless
``--no-every-k``, the ``every:K`` curve at L=64 for policies ``none`` and ``full``. Writes the JSON and a log-log
plot (PNG beside it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks import common
from jaxckpt.models import MODELS, build_model
from jaxckpt.step import ModelTarget
from jaxckpt.report import build_report

NAME = "structure_depth"
ROWS: dict[str, tuple[str, str]] = {
    "none": ("none", "block"),
    "full": ("nothing_saveable", "block"),
    "every:4": ("nothing_saveable", "every:4"),
    "nested": ("nothing_saveable", "nested:2"),
    "nested:3": ("nothing_saveable", "nested:3"),
}
"""Row label -> (policy, checkpoint structure)."""
EXPECTED_P = {"none": 1.0, "full": 1.0, "every:4": 1.0, "nested": 0.5, "nested:3": 1 / 3}
"""The exponent each row should show (memory ∝ L, √L, ∛L)."""
EVERY_K = (1, 2, 4, 8, 16, 32, 64)
DIM, HIDDEN = 128, 128
IMAGE_SHAPE = (8, 8, 1)


def build_parser():
  """The flags (``--quick`` = depths 2, 4, 8, batch 256, rows none/full/nested, no every:K curve: the smoke test)."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--depths", type=int, nargs="+", default=None, help="depths L (default 4 8 16 32 64 128 256)")
  p.add_argument("--batch-size", type=int, default=None, help="examples per step (default 8192; 256 with --quick)")
  p.add_argument("--base-batch", type=int, default=8,
                 help="batch of the second compile per point; activations = temp(batch) − temp(base batch)")
  p.add_argument("--every-k", action=argparse.BooleanOptionalAction, default=None, help="also the every:K curve at L=64")
  p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write a log-log PNG beside the JSON")
  return p


def target(num_layers: int, structure: str, batch_size: int) -> ModelTarget:
  """The residual MLP (d=128, hidden 128, no dropout) at depth ``num_layers`` under ``structure``, on 8×8 images."""
  config = dataclasses.replace(MODELS["mlp"].presets["small"], num_layers=num_layers, dim=DIM, hidden_dim=HIDDEN,
                               dropout_rate=0.0, structure=structure)
  batch = {"x": jax.ShapeDtypeStruct((batch_size, *IMAGE_SHAPE), np.float32),
           "y": jax.ShapeDtypeStruct((batch_size,), np.int32)}
  return ModelTarget(make_model=lambda: build_model("mlp", config, image_shape=IMAGE_SHAPE, num_classes=10),
                     batch=batch, name="mlp-d128", preset=None)


def compiled(num_layers: int, structure: str, policies: Sequence[str], batch_size: int) -> list[dict[str, Any]]:
  """``temp_bytes``, ``flops`` and ``compile_s`` per policy at one depth and structure (compile only)."""
  report = build_report(target(num_layers, structure, batch_size), list(policies), residuals=False, progress=False)
  for row in report.rows:
    if row["status"] != "ok":
      raise SystemExit(f"{NAME}: error: L={num_layers} {structure} {row['policy']}: {row['error']}")
  return [{k: row[k] for k in ("temp_bytes", "flops", "compile_s")} for row in report.rows]


def fit_power(depths: Sequence[int], temps: Sequence[float]) -> dict[str, float]:
  """Fits ``temp(L) = a + b·L^p`` by least squares on the relative error, ``p`` on a grid in [0.05, 2].

  Args:
    depths: depths L (≥ 3 distinct values).
    temps: bytes at those depths.

  Returns:
    ``{"a": bytes, "b": bytes, "p": exponent, "rel_rms": relative RMS error of the fit}``.
  """
  L = np.asarray(depths, float)
  y = np.asarray(temps, float)
  best = None
  for p in np.arange(0.05, 2.0005, 0.001):
    design = np.stack([np.ones_like(L), L ** p], axis=1) / y[:, None]  # relative residuals
    coef, *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    err = float(np.sqrt(np.mean((design @ coef - 1) ** 2)))
    if best is None or err < best[0]:
      best = (err, float(p), coef)
  err, p, (a, b) = best
  return {"a": float(a), "b": float(b), "p": round(p, 3), "rel_rms": err}


def plot(path: str, depths: Sequence[int], curves: dict[str, list[int]], fits: dict[str, dict[str, float]]) -> str:
  """A small log-log PNG: activation temp (MiB) vs L per row, with the fitted curves dashed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
  L = np.asarray(depths, float)
  grid = np.geomspace(L.min(), L.max(), 100)
  for label, temps in curves.items():
    f = fits[label]
    (line,) = ax.plot(L, np.asarray(temps) / 2**20, "o", ms=4, label=f"{label}: p={f['p']:.2f}")
    ax.plot(grid, (f["a"] + f["b"] * grid ** f["p"]) / 2**20, "--", lw=1, color=line.get_color())
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("layers L")
  ax.set_ylabel("activation temp (MiB)")
  ax.set_title("activation temp(L) = a + b·L^p, residual MLP train step", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


def render(data: dict[str, Any]) -> str:
  """The result as markdown: the depth table with fits and FLOPs, then the every:K table (docs/benchmarks.md)."""
  depths, rows, m = data["depths"], data["rows"], data["model"]
  last = str(depths[-1])
  lines = [f"Residual MLP d={m['dim']}, hidden {m['hidden_dim']}, no dropout, batch {m['batch_size']}; compiled temp "
           f"in MiB (total / activations = total − the same step's at batch {m['base_batch_size']}); {common.header(data)}",
           "",
           common.markdown_table(
               ["row (policy, structure)", *(f"L={L}" for L in depths), "p of activations (expected)",
                "p of total", f"FLOPs / none at L={last}"],
               [[f"`{r['label']}` ({r['policy']}, {r['structure']})",
                 *(f"{r['temp_bytes'][str(L)] / 2**20:.0f} / {r['activation_bytes'][str(L)] / 2**20:.0f}"
                   for L in depths),
                 f"{r['fit_activation']['p']:.2f} ({r['expected_p']:.2f}), error "
                 f"{r['fit_activation']['rel_rms'] * 100:.0f}%",
                 f"{r['fit_total']['p']:.2f}", f"{r['flops_vs_none'][last]:.2f}"] for r in rows])]
  every = data.get("every_k_at_64")
  if every:
    ks = list(next(iter(every.values())))
    lines += ["", common.markdown_table(["every:K at L=64 (MiB)", *(f"K={k}" for k in ks)],
                                        [[f"policy `{pol}`", *(f"{t / 2**20:.0f}" for t in temps.values())]
                                         for pol, temps in every.items()])]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Compiles every row at every depth, fits, prints the tables and writes the JSON (and PNG); returns the JSON."""
  p = build_parser()
  args = p.parse_args(argv)
  common.check_out(p, NAME, args)
  args.depths = args.depths or ([2, 4, 8] if args.quick else [4, 8, 16, 32, 64, 128, 256])
  args.batch_size = args.batch_size or (256 if args.quick else 8192)
  args.every_k = (not args.quick) if args.every_k is None else args.every_k
  if len(set(args.depths)) < 3 or min(args.depths) < 1 or not 1 <= args.base_batch < args.batch_size:
    p.error("--depths needs ≥ 3 distinct depths ≥ 1, and 1 ≤ --base-batch < --batch-size")
  depths = sorted(set(args.depths))
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  labels_run = ["none", "full", "nested"] if args.quick else list(ROWS)
  data: dict[str, dict[int, dict[str, Any]]] = {label: {} for label in labels_run}
  for L in depths:
    by_structure: dict[str, list[str]] = {}
    for label in labels_run:
      policy, structure = ROWS[label]
      by_structure.setdefault(structure, []).append(label)
    for structure, labels in by_structure.items():
      policies = [ROWS[lb][0] for lb in labels]
      for label, stats, base in zip(labels, compiled(L, structure, policies, args.batch_size),
                                    compiled(L, structure, policies, args.base_batch)):
        data[label][L] = {**stats, "base_temp_bytes": base["temp_bytes"],
                          "activation_bytes": stats["temp_bytes"] - base["temp_bytes"]}
    print(f"L={L}: " + ", ".join(f"{lb} {common.mib(data[lb][L]['temp_bytes'])}" for lb in labels_run),
          file=sys.stderr)
  rows = []
  for label in labels_run:
    policy, structure = ROWS[label]
    series = {key: {str(L): data[label][L][key] for L in depths}
              for key in ("temp_bytes", "base_temp_bytes", "activation_bytes", "flops")}
    rows.append({
        "label": label, "policy": policy, "structure": structure, **series,
        "flops_vs_none": {str(L): data[label][L]["flops"] / data["none"][L]["flops"] for L in depths},
        "fit_activation": fit_power(depths, list(series["activation_bytes"].values())),
        "fit_total": fit_power(depths, list(series["temp_bytes"].values())),
        "expected_p": EXPECTED_P[label],
    })
  every = None
  if args.every_k:
    every = {}
    for policy in ("none", "nothing_saveable"):
      every[policy] = {str(k): compiled(64, f"every:{k}", [policy], args.batch_size)[0]["temp_bytes"] for k in EVERY_K}
  record.update({"model": {"name": "mlp", "dim": DIM, "hidden_dim": HIDDEN, "dropout_rate": 0.0,
                           "batch_size": args.batch_size,
                           "base_batch_size": args.base_batch},
                 "depths": depths, "rows": rows, "every_k_at_64": every})
  common.finish_record(record, started)

  print(render(record))
  path = common.out_path(NAME, args)
  if args.plot:
    png = plot(path[:-5] + ".png" if path.endswith(".json") else path + ".png", depths,
               {r["label"]: [r["activation_bytes"][str(L)] for L in depths] for r in rows},
               {r["label"]: r["fit_activation"] for r in rows})
    record["plot"] = os.path.basename(png)
    print(f"wrote {png}")
  print(f"wrote {common.write_json(path, record)}")
  return record


if __name__ == "__main__":
  main()
