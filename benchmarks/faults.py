"""Benchmark: kill -9, SIGINT and SIGTERM a training run at random moments, start two runs into the same directories,
and count what was lost.

Usage: ``python benchmarks/faults.py [--kills 12] [--signals 8] [--pairs 4] [--seed 0] [--quick] [--out FILE.json]``.

Runs the tiny classifier (3 epochs, a checkpoint every 3 steps) once straight through, then:

- *kill -9*: again under repeated ``SIGKILL`` at random delays after start-up, each time relaunched with
  ``--resume auto``. A kill is classified by what it interrupted: start-up/compile (no new step on disk), a save (an
  unfinished ``*.orbax-checkpoint-tmp*`` directory is left), or training steps.
- *SIGINT / SIGTERM*: the same with a random one of the two signals; each must exit 130 / 143 with one line on stderr
  (the step reached, the last checkpoint, the resume command) and leave no unfinished save.
- *two starters*: two runs (seeds 0 and 1) started together into the same ``--out`` and ``--ckpt-dir``; one must
  finish (exit 0) with its own results on disk and the other be refused (exit 2, naming the holder).

"Runs lost" counts resumes that did not continue from the newest complete checkpoint on disk, signals that did not
stop cleanly, and starter pairs where both or neither finished or the files are not the finisher's. "Bit-identical"
compares the final parameters' SHA-256 of every interrupted sequence with the straight run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from jaxckpt.training import TMP_MARKER

NAME = "faults"
CLI = [sys.executable, "-m", "experiments.classifier", "--preset", "tiny", "--epochs", "3", "--no-progress",
       "--ckpt-every", "3", "--policy", "nothing_saveable"]
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}


def latest_step(ckpt: str) -> int | None:
  steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
  return max(steps) if steps else None


def unfinished(ckpt: str) -> bool:
  return os.path.isdir(ckpt) and any(TMP_MARKER in d for d in os.listdir(ckpt))


def resumed_from(lines: Sequence[str]) -> int | None:
  found = [int(m.group(1)) for line in lines if (m := re.search(r"resumed from step (\d+)", line))]
  return found[0] if found else None


def interrupted_sequence(tmp: str, rng: random.Random, *, faults: int, signals: Sequence[int]) -> dict[str, Any]:
  """Starts ``--resume`` runs into one directory, each stopped by a random one of ``signals`` at a random moment,
  then one run to the end; returns counts by what was interrupted, resumes, runs lost and the final digest."""
  ckpt, out, log_path = f"{tmp}/ckpt", f"{tmp}/out", f"{tmp}/log.txt"
  counts: dict[str, int] = {}
  lost = resumes = unclean = 0
  for _ in range(faults):
    before = latest_step(ckpt)
    with open(log_path, "w") as log, open(f"{log_path}.err", "w") as err:
      proc = subprocess.Popen([*CLI, "--ckpt-dir", ckpt, "--out", out, "--resume", "auto"], stdout=log, stderr=err, env=ENV)
      # A third of the faults land in start-up (imports, data, compile: 0.5-6 s), the rest at a random moment of
      # training (0-3 s after the compile).
      in_startup = rng.random() < 1 / 3
      while proc.poll() is None and not in_startup and "compiled in" not in open(log_path).read():
        time.sleep(0.02)
      try:
        proc.wait(timeout=rng.uniform(0.5, 6.0) if in_startup else rng.uniform(0.0, 3.0))
      except subprocess.TimeoutExpired:
        pass
    finished = proc.poll() is not None
    sig = rng.choice(signals)
    proc.send_signal(sig)
    code = proc.wait()
    lines = open(log_path).read().splitlines()
    if (step := resumed_from(lines)) is not None:
      resumes += 1
      lost += step != before
    if finished:
      break
    kind = ("a save" if unfinished(ckpt) else "start-up/compile" if latest_step(ckpt) == before
            else "training steps")
    if sig != signal.SIGKILL:  # a clean stop: its exit code, one line, no half-written save left
      err_lines = common.own_stderr_lines(open(f"{log_path}.err").read())
      if code == -sig or (code == 0 and "KeyboardInterrupt" in "".join(err_lines)):
        # Python's default action: the signal came while Python imported jax, before run() installed its handlers
        # (or Python dropped the KeyboardInterrupt, raised in a gc callback, and the run went on to the end)
        kind = "Python imports (before the run's handlers)"
        clean = not unfinished(ckpt)
      else:
        clean = (code == EXIT_CODES[sig] and len(err_lines) == 1 and "stopped by" in err_lines[0]
                 and not unfinished(ckpt))
      unclean += not clean
    key = f"{signal.Signals(sig).name} during {kind}"
    counts[key] = counts.get(key, 0) + 1
  before = latest_step(ckpt)
  done = subprocess.run([*CLI, "--ckpt-dir", ckpt, "--out", out, "--resume", "auto"], capture_output=True, text=True,
                        check=True, env=ENV)
  if (step := resumed_from(done.stdout.splitlines())) is not None:
    resumes += 1
    lost += step != before
  return {"faults": counts, "resumes": resumes, "runs_lost": lost + unclean,
          "params_sha256": json.load(open(f"{out}/metrics.json"))["params_sha256"]}


def concurrent_pair(tmp: str) -> dict[str, Any]:
  """Two runs (seeds 0 and 1) started at once into the same directories; returns who finished and what was lost."""
  ckpt, out = f"{tmp}/ckpt", f"{tmp}/out"
  procs = [subprocess.Popen([*CLI, "--seed", str(seed), "--ckpt-dir", ckpt, "--out", out], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in (0, 1)]
  results = [(p.returncode, out, err) for p in procs for out, err in [p.communicate()]]
  codes = [code for code, _, _ in results]
  winners = [seed for seed, code in enumerate(codes) if code == 0]
  refused = [seed for seed, (code, _, err) in enumerate(results) if code == 2 and len(common.own_stderr_lines(err)) == 1]
  intact = (len(winners) == 1 and len(refused) == 1 and os.path.exists(f"{out}/metrics.json")
            and json.load(open(f"{out}/metrics.json"))["config"]["seed"] == winners[0])
  return {"codes": codes, "lost": not intact, "winner": winners[0] if len(winners) == 1 else None,
          "params_sha256": json.load(open(f"{out}/metrics.json"))["params_sha256"] if intact else None}


def render(data: Mapping[str, Any]) -> str:
  """The result as markdown: a header line and the table (docs/benchmarks.md)."""
  rows = [[f"`{kind.split(' during ')[0].replace('SIGKILL', 'kill -9')}` during {kind.split(' during ')[1]}", count,
           "", ""] for part in ("kill", "signal") for kind, count in sorted(data[part]["faults"].items())]
  for part, label in (("kill", "all `kill -9`"), ("signal", "all SIGINT / SIGTERM")):
    d = data[part]
    rows.append([label, sum(d["faults"].values()), f"{d['runs_lost']} ({d['resumes']} resumes checked)",
                 "yes" if d["bit_identical"] else "NO"])
  pairs = data["pairs"]
  rows.append(["two runs started into the same directories", len(pairs["codes"]), f"{pairs['lost']} of "
               f"{len(pairs['codes'])} pairs", "yes" if pairs["bit_identical"] else "NO"])
  return "\n".join([f"Measured {common.header(data)}; bit-identical: final parameters' SHA-256 equal to an "
                    "uninterrupted run's.", "",
                    common.markdown_table(["fault", "count", "runs lost", "resumes bit-identical"], rows)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the result record."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--kills", type=int, default=12, help="kill -9 faults (default %(default)s)")
  p.add_argument("--signals", type=int, default=8, help="SIGINT/SIGTERM faults (default %(default)s)")
  p.add_argument("--pairs", type=int, default=4, help="pairs of concurrent starters (default %(default)s)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.quick:
    args.kills, args.signals, args.pairs = 1, 1, 1
  common.check_out(p, NAME, args)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([*CLI, "--out", f"{tmp}/straight"], check=True, capture_output=True, env=ENV)
    expected = {0: json.load(open(f"{tmp}/straight/metrics.json"))["params_sha256"]}
    for part, faults, signals in (("kill", args.kills, [signal.SIGKILL]),
                                  ("signal", args.signals, [signal.SIGINT, signal.SIGTERM])):
      os.makedirs(f"{tmp}/{part}")
      d = interrupted_sequence(f"{tmp}/{part}", rng, faults=faults, signals=signals)
      record[part] = {**d, "bit_identical": d.pop("params_sha256") == expected[0]}
    pairs = []
    for i in range(args.pairs):
      os.makedirs(f"{tmp}/pair{i}")
      pairs.append(concurrent_pair(f"{tmp}/pair{i}"))
    if any(pair["winner"] == 1 for pair in pairs):
      subprocess.run([*CLI, "--seed", "1", "--out", f"{tmp}/straight1"], check=True, capture_output=True, env=ENV)
      expected[1] = json.load(open(f"{tmp}/straight1/metrics.json"))["params_sha256"]
  record["pairs"] = {"codes": [pair["codes"] for pair in pairs], "lost": sum(pair["lost"] for pair in pairs),
                     "bit_identical": all(pair["params_sha256"] == expected.get(pair["winner"]) for pair in pairs)}
  return common.publish(record, started, render, NAME, args)


if __name__ == "__main__":
  main()
