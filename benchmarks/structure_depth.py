"""Benchmark: compiled temp bytes of the full AdamW train step vs depth, per checkpoint structure (compile only).

Usage: ``python benchmarks/structure_depth.py [--out benchmarks/results]``.

Residual MLP, d=128, hidden 512, 8192 examples per step (activation-heavy, so activations dominate weights and
optimizer temporaries), XLA:CPU with jaxckpt's remat fix. Prints (1) temp vs depth for ``block`` (no structure),
``nested`` and ``nested:3`` under policy ``none`` and ``full``, with the growth ratios, and (2) the ``every:K`` curve at
N = 64 for policies ``none`` and ``full``. Writes ``structure_depth.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import numpy as np
import optax

import jaxckpt
from jaxckpt.models import MODELS


def train_step_temp(num_layers: int, structure: str, policy: str) -> int:
  """Compiled temp bytes of the train step (nothing is allocated)."""
  config = dataclasses.replace(MODELS["mlp"].presets["small"], num_layers=num_layers, dim=128, hidden_dim=512,
                               structure=structure)
  tx = optax.adamw(1e-3)
  graphdef, state = jaxckpt.abstract_train_state(
      lambda: jaxckpt.build_model("mlp", config, image_shape=(8, 8, 1), num_classes=10, policy=policy), tx)
  batch = {"x": jax.ShapeDtypeStruct((8192, 8, 8, 1), np.float32), "y": jax.ShapeDtypeStruct((8192,), np.int32)}
  return jaxckpt.memory_stats(jaxckpt.compile_train_step(jaxckpt.make_train_step(graphdef, tx), state, batch))[
      "temp_bytes"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args()
  mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
  depth = {}
  print("| structure | policy | L=16 | L=64 | L=512 | temp(64)/temp(16) | temp(512)/temp(64) |")
  print("|---|---|---|---|---|---|---|")
  for structure in ("block", "nested", "nested:3"):
    for policy in ("none", "full"):
      depths = (16, 64, 512) if structure != "block" else (16, 64)
      temps = {n: train_step_temp(n, structure, policy) for n in depths}
      depth[f"{structure}/{policy}"] = temps
      t512 = temps.get(512)
      print(f"| `{structure}` | `{policy}` | {mib(temps[16])} MiB | {mib(temps[64])} MiB | "
            f"{'—' if t512 is None else mib(t512) + ' MiB'} | {temps[64] / temps[16]:.2f} | "
            f"{'—' if t512 is None else f'{t512 / temps[64]:.2f}'} |")
  every = {policy: {k: train_step_temp(64, f"every:{k}", policy) for k in (1, 2, 4, 8, 16, 32, 64)}
           for policy in ("none", "full")}
  print("\n| every:K at N=64 | " + " | ".join(f"K={k}" for k in every["none"]) + " |")
  print("|---|" + "---|" * len(every["none"]))
  for policy, temps in every.items():
    print(f"| policy `{policy}` | " + " | ".join(f"{mib(t)} MiB" for t in temps.values()) + " |")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "structure_depth.json"), "w") as f:
    json.dump({"depth": depth, "every": every, "versions": jaxckpt.versions()}, f, indent=2)


if __name__ == "__main__":
  main()
