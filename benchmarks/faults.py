"""Benchmark: kill -9 a training run at random moments, resume each time, and count what was lost.

Usage: ``python benchmarks/faults.py [--kills 12] [--seed 0] [--out benchmarks/results]``.

Runs the tiny classifier (3 epochs, a checkpoint every 3 steps) once straight through, then again under repeated
``SIGKILL`` at random delays after start-up, each time relaunched with ``--resume``. A kill is classified by what it
interrupted: start-up/compile (no new step on disk), a save (an unfinished ``*.orbax-checkpoint-tmp*`` directory is
left), or training steps. "Data lost" counts resumes that did not continue from the newest complete checkpoint on
disk; "bit-identical" compares the final parameters' SHA-256 with the straight run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from jaxckpt.saving import TMP_MARKER

CLI = [sys.executable, "-m", "experiments.classifier", "--preset", "tiny", "--epochs", "3", "--no-progress",
       "--ckpt-every", "3", "--policy", "nothing_saveable"]


def latest_step(ckpt: str) -> int | None:
  steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
  return max(steps) if steps else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kills", type=int, default=12)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([*CLI, "--out", f"{tmp}/straight"], check=True, capture_output=True)
    expected = json.load(open(f"{tmp}/straight/metrics.json"))["params_sha256"]
    ckpt, out = f"{tmp}/ckpt", f"{tmp}/out"
    counts = {"start-up/compile": 0, "save": 0, "training steps": 0}
    lost = resumes = 0
    for _ in range(args.kills):
      before = latest_step(ckpt)
      log_path = f"{tmp}/log.txt"
      with open(log_path, "w") as log:
        proc = subprocess.Popen([*CLI, "--ckpt-dir", ckpt, "--out", out, "--resume"], stdout=log,
                                stderr=subprocess.STDOUT)
        # A third of the kills land in start-up/compile, the rest at a random moment of training (~1-3 s).
        in_startup = rng.random() < 1 / 3
        delay = rng.uniform(0.0, 3.0)
        while proc.poll() is None and not in_startup and "compiled in" not in open(log_path).read():
          time.sleep(0.02)
        try:
          proc.wait(timeout=delay if not in_startup else rng.uniform(0.5, 2.0))
        except subprocess.TimeoutExpired:
          pass

      finished = proc.poll() is not None
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      lines = open(log_path).read().splitlines()
      resumed = [int(m.group(1)) for line in lines if (m := re.search(r"resumed from step (\d+)", line))]
      if resumed:
        resumes += 1
        lost += resumed[0] != before
      if finished:
        break
      if any(TMP_MARKER in d for d in os.listdir(ckpt)) if os.path.isdir(ckpt) else False:
        counts["save"] += 1
      elif latest_step(ckpt) == before:
        counts["start-up/compile"] += 1
      else:
        counts["training steps"] += 1
    before = latest_step(ckpt)
    done = subprocess.run([*CLI, "--ckpt-dir", ckpt, "--out", out, "--resume"], capture_output=True, text=True,
                          check=True)
    final = re.search(r"resumed from step (\d+)", done.stdout)
    resumes += final is not None
    lost += final is not None and int(final.group(1)) != before
    identical = json.load(open(f"{out}/metrics.json"))["params_sha256"] == expected
  print("| fault | count | data lost | resumes bit-identical |")
  print("|---|---|---|---|")
  for kind, count in counts.items():
    print(f"| kill -9 during {kind} | {count} | | |")
  print(f"| all kills | {sum(counts.values())} | {lost} of {resumes} resumes | {'yes' if identical else 'NO'} "
        "(final parameters vs uninterrupted run) |")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "faults.json"), "w") as f:
    json.dump({"kills": counts, "resumes": resumes, "data_lost": lost, "bit_identical": identical}, f, indent=2)


if __name__ == "__main__":
  main()
