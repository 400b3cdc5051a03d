"""The deviceless GPU figures checked on a real GPU: the same train steps compiled on the GPU and, in a second process,
without it (``--topology <gpu>:1``, XLA:GPU of the CUDA plugin with jaxckpt's target config of that GPU); their memory
statistics side by side, and each step's measured peak (``peak_bytes_in_use``) beside its compiled footprint.

What it answers: does the target config jaxckpt ships make XLA:GPU compile the same buffers as the GPU's own
description (temp, arguments, host bytes of an offload policy), and does a step that the verdict says fits run in
that much memory? Run it on a machine with an NVIDIA GPU and an accelerator build of JAX (``benchmarks/gpu.sh`` does);
without a GPU it exits 2 with one line.

Usage: ``python benchmarks/gpu_check.py [--out FILE] [--preset llama-tiny] [--seq-len 1024] [--batch-size 8]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

NAME = "gpu_check"

POLICIES = ("none", "full", "dots_saveable", "minimal_flash",
            "save_and_offload_only_these_names:/decoder_layer_input")
"""Fixed policies, a MaxText preset and a host-offload list (its host bytes are what the CPU cannot show)."""


def _report(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
  """Runs ``jaxckpt-report`` in a fresh process and returns its JSON."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "r.json")
    done = subprocess.run([sys.executable, "-m", "jaxckpt.report", *argv, "--json", path, "--no-progress"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=3600)
    if done.returncode not in (0, 1):
      raise RuntimeError(f"jaxckpt-report {' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1:]}")
    with open(path) as fh:
      return json.load(fh)


def compare(on_device: Mapping[str, Any], deviceless: Mapping[str, Any]) -> list[dict[str, Any]]:
  """Per policy: the two compiles' memory statistics, their ratio, the measured peak and its ratio to the
  compiled footprint."""
  rows = []
  offline = {r["policy"]: r for r in deviceless["rows"]}
  for r in on_device["rows"]:
    d = offline.get(r["policy"], {})
    row = {"policy": r["policy"], "status": r["status"], "deviceless_status": d.get("status")}
    for key in ("temp_bytes", "argument_bytes", "footprint_bytes", "host_footprint_bytes"):
      row[key], row[f"deviceless_{key}"] = r.get(key), d.get(key)
      row[f"{key}_ratio"] = (d[key] / r[key]) if r.get(key) and d.get(key) else None
    row["peak_bytes_measured"] = r.get("peak_bytes_measured")
    row["peak_over_footprint"] = (r["peak_bytes_measured"] / r["footprint_bytes"]
                                  if r.get("peak_bytes_measured") and r.get("footprint_bytes") else None)
    rows.append(row)
  return rows


def render(data: Mapping[str, Any]) -> str:
  """The table for the README."""
  lines = [f"Run: {common.header(data)}; {data.get('device_kind')}; deviceless with topology {data.get('topology')}",
           "", "| policy | temp on GPU | temp deviceless | ratio | footprint | measured peak | peak/footprint | "
           "host on GPU | host deviceless |", "|---|---|---|---|---|---|---|---|---|"]
  for r in data.get("rows", []):
    lines.append(f"| {r['policy']} | {common.mib(r['temp_bytes'])} | {common.mib(r['deviceless_temp_bytes'])} | "
                 f"{r['temp_bytes_ratio'] or 0:.3f} | {common.mib(r['footprint_bytes'])} | "
                 f"{common.mib(r['peak_bytes_measured'])} | {r['peak_over_footprint'] or 0:.3f} | "
                 f"{common.mib(r['host_footprint_bytes'])} | {common.mib(r['deviceless_host_footprint_bytes'])} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles on the GPU (and measures), then deviceless, and writes ``benchmarks/results/gpu_check.json``."""
  parser = common.parser(NAME, __doc__)
  parser.add_argument("--preset", default="llama-tiny", help="--model llm preset (default llama-tiny)")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch-size", type=int, default=8)
  args = parser.parse_args(argv)
  import jax  # here: the check needs an accelerator build of JAX, the others do not

  device = jax.devices()[0]
  if device.platform != "gpu":
    print(f"gpu_check: error: JAX sees no GPU (platform {device.platform}); run on an NVIDIA GPU with "
          "jax[cuda12]", file=sys.stderr)
    return 2
  from jaxckpt.sharding import CHIPS, chip_for_kind

  chip = chip_for_kind(device.device_kind)
  if chip is None or not chip.is_gpu:
    print(f"gpu_check: error: {device.device_kind!r} is not a GPU of jaxckpt's table "
          f"({', '.join(k for k, c in CHIPS.items() if c.is_gpu)})", file=sys.stderr)
    return 2
  key = next(k for k, c in CHIPS.items() if c is chip)
  started = time.perf_counter()
  data = common.run_record(NAME, args)
  shape = ["--model", "llm", "--preset", args.preset, "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--attention", "pallas", "--policies", *POLICIES]
  on_device = _report([*shape, "--measure"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  deviceless = _report([*shape, "--topology", f"{key}:1"], {"JAX_PLATFORMS": "cpu"})
  data.update(device_kind=device.device_kind, topology=f"{key}:1", rows=compare(on_device, deviceless),
              compiler_options={"on_device": on_device["compiler_options"],
                                "deviceless": deviceless["compiler_options"]})
  common.write_json(common.out_path(NAME, args), common.finish_record(data, started))
  print(render(data))
  return 0


if __name__ == "__main__":
  sys.exit(main())
