"""Benchmark: the default classifier run under every built-in policy — accuracy, wall time, temp bytes, step time.

Usage: ``python benchmarks/classifier_policies.py [--model vit] [--epochs 30] [--out benchmarks/results]``.
Each policy runs in its own process (``python -m experiments.classifier``) so wall time includes start-up and
compilation, as a user sees it. Prints a markdown table and writes ``classifier_policies.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxckpt import format_bytes

POLICIES = {
    "vit": [
        "none", "nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
        "save_only_these_names:qkv+mlp_hidden", "save_any_names_but_these:attn_weights",
        "save_and_offload_only_these_names:qkv/mlp_hidden", "offload_dot_with_no_batch_dims",
        "attn=dots_saveable,mlp=full",
    ],
    "mlp": ["none", "nothing_saveable", "dots_saveable", "save_only_these_names:mlp_hidden"],
    "cnn": ["none", "nothing_saveable", "dots_saveable", "save_only_these_names:conv_hidden"],
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=list(POLICIES), default="vit")
  parser.add_argument("--epochs", type=int, default=None, help="default: the experiment's default")
  parser.add_argument("--preset", default="small")
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args()
  rows = []
  for policy in POLICIES[args.model]:
    with tempfile.TemporaryDirectory() as tmp:
      cmd = [sys.executable, "-m", "experiments.classifier", "--model", args.model, "--preset", args.preset,
             "--policy", policy, "--out", tmp, "--no-progress"]
      if args.epochs is not None:
        cmd += ["--epochs", str(args.epochs)]
      started = time.perf_counter()
      subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
      wall = time.perf_counter() - started
      with open(os.path.join(tmp, "metrics.json")) as f:
        metrics = json.load(f)
    rows.append({"policy": metrics["policy"], "test_accuracy": metrics["test_accuracy"], "wall_s": wall,
                 "step_time_s": metrics["step_time_s"], "temp_bytes": metrics["memory"]["temp_bytes"],
                 "footprint_bytes": metrics["memory"]["footprint_bytes"]})
    print(f"{policy}: accuracy {metrics['test_accuracy']:.4f}, {wall:.0f} s", file=sys.stderr)
  none_temp = rows[0]["temp_bytes"]
  print(f"| policy | test accuracy | wall (s) | median step (ms) | temp | temp / none |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| `{r['policy']}` | {r['test_accuracy']:.4f} | {r['wall_s']:.0f} | {r['step_time_s'] * 1e3:.1f} | "
          f"{format_bytes(r['temp_bytes'])} | {r['temp_bytes'] / none_temp:.2f} |")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"classifier_policies_{args.model}.json"), "w") as f:
    json.dump({"model": args.model, "preset": args.preset, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
