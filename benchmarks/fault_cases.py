"""Benchmark: the fault cases of the tools, as a careful user would meet them, each run for real (subprocesses).

Usage: ``python benchmarks/fault_cases.py [--quick] [--only NAME ...] [--out FILE.json]``.

A sibling of ``benchmarks/faults.py`` (kills and signals of a training run): every case here runs the CLIs or an
experiment as a user would (``jaxckpt-report``, ``jaxckpt-fit``, ``jaxckpt-plan``,
``python -m experiments.classifier``),
with a stale or damaged compiled-stats cache, a full disk, a closed pipe, an ASCII terminal, Ctrl-C during a compile,
a flipped bit in a checkpoint, a killed process of a two-process run, absurd shapes, a 29,000-character spec and a
compiler that crashes on one mesh of the fit's search, and checks what the user sees: the table's columns are the
case, what is expected, what was observed, and whether it held. A full disk is a small tmpfs mounted for the case
(root with ``CAP_SYS_ADMIN``); where none can be mounted the case says so and does not count. ``--quick`` runs the
cases that need no topology compile and no training run (the smoke test's).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

NAME = "fault_cases"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
REPORT = [PY, "-m", "jaxckpt.report", "--no-progress"]
FIT = [PY, "-m", "jaxckpt.fit", "--no-progress"]
PLAN = [PY, "-m", "jaxckpt.planner"]
TRAIN = [PY, "-m", "experiments.classifier", "--preset", "tiny", "--no-progress", "--policy", "nothing_saveable"]
MLP = ["--model", "mlp", "--preset", "tiny"]
LLAMA_H100 = ["--model", "llm", "--preset", "llama-tiny", "--topology", "h100:8", "--policies", "none"]
MESH_SEARCH = ["--model", "llm", "--preset", "tiny", "--topology", "v5e:2x2", "--seq-len", "64", "--global-batch-size",
               "16", "--mesh", "auto", "--max-meshes", "2", "--memory", "64MiB", "--policies", "nothing_saveable"]
LONG_SPEC = ";".join(f"{i}-{i}:dots_saveable" for i in range(1300))


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "LIBTPU_INIT_ARGS"))}
  return {**env, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAXCKPT_STATS_CACHE": "off", **extra}


def run(argv: Sequence[str] | str, **extra: str) -> subprocess.CompletedProcess:
  """Runs a command (a shell line when a string) in the repository with a clean compiler environment."""
  return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(**extra), shell=isinstance(argv, str),
                        errors="replace")


def lines(text: str) -> list[str]:
  """stderr's lines less the CUDA plugin's start-up noise and progress lines (what the user reads as the error)."""
  progress = ("jaxckpt-fit: mesh", "jaxckpt-fit: compile")
  return [line for line in common.own_stderr_lines(text) if line.strip() and not line.startswith(progress)]


def _traceback(text: str) -> bool:
  return "Traceback" in text or "Check failure" in text


@contextlib.contextmanager
def full_disk(size: str = "1m") -> Iterator[str | None]:
  """A tmpfs of ``size`` mounted for one case (its path), or ``None`` where none can be mounted."""
  path = tempfile.mkdtemp(prefix="jaxckpt-full-")
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                           capture_output=True).returncode
  try:
    yield path if mounted == 0 else None
  finally:
    if mounted == 0:
      subprocess.run(["umount", path], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _fill(path: str, leave: int) -> None:
  """Fills the file system of ``path`` but ``leave`` bytes."""
  free = shutil.disk_usage(path).free - leave
  with open(os.path.join(path, "filler"), "wb") as f:
    f.write(b"\0" * max(0, free))


MEMORY = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "footprint_bytes", "peak_memory_bytes")


def _row(report: Mapping[str, Any]) -> dict[str, Any]:
  """The first row's memory figures, bytes."""
  return {k: report["rows"][0][k] for k in MEMORY}


# --- the cases: each returns (expected, observed, held) ---------------------------------------------------------


def stale_cache(tmp: str) -> tuple[str, str, bool]:
  cache = os.path.join(tmp, "cache")
  out = {k: os.path.join(tmp, f"{k}.json") for k in ("a", "b", "truth")}
  run([*REPORT, *LLAMA_H100, "--json", out["a"]], JAXCKPT_STATS_CACHE=cache)
  run([*REPORT, *LLAMA_H100, "--json", out["b"]], JAXCKPT_STATS_CACHE=cache,
      XLA_FLAGS="--xla_gpu_enable_triton_gemm=false")
  run([*REPORT, *LLAMA_H100, "--json", out["truth"]], XLA_FLAGS="--xla_gpu_enable_triton_gemm=false")
  temp = {k: _row(json.load(open(p)))["temp_bytes"] for k, p in out.items()}
  return (f"XLA_FLAGS changed: a miss, temp = the cache-off truth {temp['truth']:,} B",
          f"temp {temp['b']:,} B (before the flag: {temp['a']:,} B)", temp["b"] == temp["truth"] != temp["a"])


def damaged_cache(tmp: str) -> tuple[str, str, bool]:
  cache = os.path.join(tmp, "cache")
  first, second = os.path.join(tmp, "first.json"), os.path.join(tmp, "second.json")
  run([*REPORT, *LLAMA_H100, "--json", first], JAXCKPT_STATS_CACHE=cache)
  for path in glob.glob(f"{cache}/*/*.hlo.gz"):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])  # truncated
  got = run([*REPORT, *LLAMA_H100, "--json", second], JAXCKPT_STATS_CACHE=cache)
  warned = [line for line in lines(got.stderr) if "warning: the compiled-stats cache entry" in line]
  a, b = _row(json.load(open(first))), _row(json.load(open(second)))
  healed = all(gzip.open(p).read() for p in glob.glob(f"{cache}/*/*.hlo.gz"))
  same = a == b and json.load(open(second))["rows"][0].get("step_time_estimate") is not None
  return ("truncated .hlo.gz: a miss, one warning naming it, compiled afresh, the same row with est. step",
          f"exit {got.returncode}, {len(warned)} warning(s), same row: {same}, entry rewritten: {healed}",
          got.returncode == 0 and len(warned) == 1 and same and healed)


def wrong_types(tmp: str) -> tuple[str, str, bool]:
  cache = os.path.join(tmp, "cache")
  first, second = os.path.join(tmp, "first.json"), os.path.join(tmp, "second.json")
  run([*REPORT, *LLAMA_H100, "--json", first], JAXCKPT_STATS_CACHE=cache)
  for path in glob.glob(f"{cache}/*/*.json"):
    data = json.load(open(path))
    json.dump({**data, "memory": {**data["memory"], "temp_bytes": "lots"}}, open(path, "w"))
  got = run([*REPORT, *LLAMA_H100, "--json", second], JAXCKPT_STATS_CACHE=cache)
  same = _row(json.load(open(first))) == _row(json.load(open(second)))
  return ('"temp_bytes": "lots": a miss with one warning, the true row', f"exit {got.returncode}, same row: {same}",
          got.returncode == 0 and same and "was damaged" in got.stderr)


def _outputs_on_full_disk(tmp: str) -> tuple[str, str, bool]:
  with full_disk("1m") as disk:
    if disk is None:
      return "previous file kept, one line, exit 1", "not run: cannot mount a tmpfs here", True
    path = os.path.join(disk, "r.json")
    open(path, "w").write('{"previous": true}')
    _fill(disk, 16 * 1024)  # the up-front check's byte fits; the report's JSON (~48 KB) does not
    got = run([*REPORT, *MLP, "--policies", "none", "--json", path])
    kept = open(path).read() == '{"previous": true}'
    left = sorted(set(os.listdir(disk)) - {"r.json", "filler"})
    err = lines(got.stderr)
  return ("exit 1, one line naming the file, the previous file kept, no temporary left",
          f"exit {got.returncode}, {len(err)} line(s), kept: {kept}, left: {left or 'nothing'}",
          got.returncode == 1 and len(err) == 1 and path in err[0] and kept and not left)


def dev_full(tmp: str) -> tuple[str, str, bool]:
  got = run([*REPORT, *MLP, "--policies", "none", "--json", "/dev/full"])
  err = lines(got.stderr)
  return ("refused before any work: exit 2, one line", f"exit {got.returncode}: {err[-1][:90] if err else ''}",
          got.returncode == 2 and len(err) == 1)


def _tools(tmp: str) -> dict[str, list[str]]:
  return {"report": [*REPORT, *MLP, "--policies", "none", "full", "--json", os.path.join(tmp, "report.json")],
          "fit": [*FIT, *MLP, "--memory", "16MiB", "--max-batch", "64", "--json", os.path.join(tmp, "fit.json")],
          "plan": [*PLAN, *MLP, "--budget", "70%", "--json", os.path.join(tmp, "plan.json")]}


def closed_pipe(tmp: str) -> tuple[str, str, bool]:
  seen, held = [], True
  for tool, argv in _tools(tmp).items():
    got = run(" ".join(argv) + " | head -1")
    ok = os.path.getsize(argv[-1]) > 100 and not _traceback(got.stderr)
    seen.append(f"{tool} {'ok' if ok else 'FAILED'}")
    held &= ok
  return "| head -1: the JSON written, no traceback (report, fit, plan)", ", ".join(seen), held


def ascii_terminal(tmp: str) -> tuple[str, str, bool]:
  seen, held = [], True
  for tool, argv in _tools(tmp).items():
    got = run(argv, PYTHONIOENCODING="ascii")
    ok = got.returncode == 0 and not _traceback(got.stderr)
    seen.append(f"{tool} exit {got.returncode}")
    held &= ok
  return "PYTHONIOENCODING=ascii: exit 0, the table in ASCII (report, fit, plan)", ", ".join(seen), held


def ctrl_c(tmp: str) -> tuple[str, str, bool]:
  proc = subprocess.Popen([*REPORT, "--model", "llm", "--preset", "llama-tiny", "--topology", "v5e:2x2", "--policies",
                           "all"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  time.sleep(10)  # imports done, compiles running
  sent = time.perf_counter()
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  waited = time.perf_counter() - sent
  err_lines = lines(err)
  return ("Ctrl-C during a compile: exit 130 at once, one line, no traceback",
          f"exit {proc.returncode} after {waited:.2f} s, {len(err_lines)} line(s)",
          proc.returncode == 130 and waited < 2 and len(err_lines) == 1 and not _traceback(err))


def _flip(step_dir: str) -> None:
  files = [os.path.join(r, n) for r, _, names in os.walk(os.path.join(step_dir, "state")) for n in names]
  largest = max(files, key=os.path.getsize)
  data = bytearray(open(largest, "rb").read())
  data[len(data) // 2] ^= 0x10
  open(largest, "wb").write(bytes(data))


def bit_flip(tmp: str) -> tuple[str, str, bool]:
  ckpt, out, straight = (os.path.join(tmp, d) for d in ("ckpt", "out", "straight"))
  run([*TRAIN, "--epochs", "2", "--out", straight])
  run([*TRAIN, "--epochs", "2", "--ckpt-every", "10", "--ckpt-dir", ckpt])  # steps 30, 40, 44 kept
  steps = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
  _flip(os.path.join(ckpt, str(steps[-1])))
  got = run([*TRAIN, "--epochs", "2", "--ckpt-every", "10", "--ckpt-dir", ckpt, "--out", out, "--resume"])
  same = (json.load(open(f"{out}/metrics.json"))["params_sha256"] ==
          json.load(open(f"{straight}/metrics.json"))["params_sha256"]) if got.returncode == 0 else False
  named = f"step {steps[-1]}" in got.stdout and "is corrupt" in got.stdout
  return ("a flipped bit: the step named corrupt and skipped, resumed from the one before, bit-identical",
          f"exit {got.returncode}, named: {named}, resumed from step {steps[-2]}: "
          f"{f'resumed from step {steps[-2]}' in got.stdout}, bit-identical: {same}",
          got.returncode == 0 and named and f"resumed from step {steps[-2]}" in got.stdout and same)


def save_on_full_disk(tmp: str) -> tuple[str, str, bool]:
  with full_disk("2m") as disk:
    if disk is None:
      return "one line, exit 2", "not run: cannot mount a tmpfs here", True
    _fill(disk, 48 * 1024)  # room for the lock and the first files, not for a step's arrays
    got = run([*TRAIN, "--epochs", "1", "--ckpt-every", "2", "--ckpt-dir", os.path.join(disk, "ckpt")])
    err = lines(got.stderr)
  return ("a checkpoint save on a full disk: one line naming the step, no traceback",
          f"exit {got.returncode}, {len(err)} line(s): {err[-1][:80] if err else ''}",
          got.returncode != 0 and len(err) == 1 and "no space left on device" in err[0] and not _traceback(got.stderr))


def lost_peer(tmp: str) -> tuple[str, str, bool]:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [subprocess.Popen([*TRAIN, "--epochs", "50", "--mesh", "data=8", "--coordinator", f"localhost:{port}",
                             "--num-processes", "2", "--process-id", str(p)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
  for line in procs[0].stdout:
    if line.startswith("compiled in"):
      break
  time.sleep(1)
  procs[1].kill()
  killed = time.perf_counter()
  try:
    _, err = procs[0].communicate(timeout=120)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  waited = time.perf_counter() - killed
  err_lines = [line for line in lines(err) if "joining the run" not in line]
  return ("kill -9 of process 1: process 0 ends within seconds, one line",
          f"exit {procs[0].returncode} after {waited:.1f} s, {len(err_lines)} line(s)",
          procs[0].returncode == 1 and waited < 15 and len(err_lines) == 1)


def cache_temporaries(tmp: str) -> tuple[str, str, bool]:
  cache = os.path.join(tmp, "cache")
  run([*REPORT, *LLAMA_H100], JAXCKPT_STATS_CACHE=cache)
  shard = glob.glob(f"{cache}/*/")[0]
  dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
  host = socket.gethostname().replace("-", "_")
  left = os.path.join(shard, f".tmp-{host}-{dead}-abc.json")  # what a kill -9 mid-write leaves
  open(left, "w").write("{")
  run([*REPORT, *LLAMA_H100], JAXCKPT_STATS_CACHE=cache)
  swept = not os.path.exists(left)
  with full_disk("256k") as disk:
    if disk is None:
      return "swept at the next start", f"swept: {swept}; full disk not run (no tmpfs)", swept
    _fill(disk, 2048)  # room for an entry's JSON, not for its program text
    got = run([*REPORT, *LLAMA_H100], JAXCKPT_STATS_CACHE=os.path.join(disk, "cache"))
    temps = glob.glob(f"{disk}/cache/*/.tmp-*")
    warned = [line for line in lines(got.stderr) if "warning: the compiled-stats cache" in line]
  return ("a killed writer's temporary swept at the next start; none left by a full disk; one warning",
          f"swept: {swept}; after a full disk: {len(temps)} temporaries, {len(warned)} warning(s), exit "
          f"{got.returncode}", swept and not temps and len(warned) == 1 and got.returncode == 0)


def unwritable_cache(tmp: str) -> tuple[str, str, bool]:
  got = run([*FIT, "--model", "gpt", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "data=4", "--memory",
             "1GiB", "--max-batch", "64"], JAXCKPT_STATS_CACHE="/proc/jaxckpt-cache")
  warned = [line for line in lines(got.stderr) if "compiled-stats cache" in line]
  clean = all(line.startswith("jaxckpt-fit: warning:") for line in warned) and "warnings.warn" not in got.stderr
  return ("an unwritable cache: one warning line per run", f"exit {got.returncode}, {len(warned)} line(s), "
          f"one-line format: {clean}", got.returncode == 0 and len(warned) == 1 and clean)


def absurd_shapes(tmp: str) -> tuple[str, str, bool]:
  seen, held = [], True
  for flag, value in (("--batch-size", "1099511627776"), ("--seq-len", "110000000")):
    got = run([*REPORT, "--model", "llm", "--preset", "llama-tiny", "--policies", "none", flag, value])
    err = lines(got.stderr)
    ok = got.returncode == 2 and len(err) == 1 and f"{flag} {value}" in err[0]
    seen.append(f"{flag} {value}: exit {got.returncode}, {len(err)} line(s)")
    held &= ok
  return "one line naming the flag, exit 2 (no ok row, no abort in XLA)", "; ".join(seen), held


def long_spec(tmp: str) -> tuple[str, str, bool]:
  fit = run([*FIT, "--model", "gpt", "--preset", "tiny", "--memory", "1GiB", "--policies", LONG_SPEC])
  report = run([*REPORT, "--model", "gpt", "--preset", "tiny", "--policies", LONG_SPEC])
  err = lines(fit.stderr)
  return (f"a {len(LONG_SPEC):,}-character layered spec: its error cut (fit: one line; report: a short table)",
          f"fit exit {fit.returncode}, {len(err)} line(s) of {max(map(len, err), default=0)} characters; report "
          f"{len(report.stdout.splitlines())} lines", fit.returncode == 2 and len(err) == 1 and len(err[0]) < 400
          and len(report.stdout.splitlines()) < 30)


def compiler_crash(tmp: str) -> tuple[str, str, bool]:
  path = os.path.join(tmp, "m.json")
  got = run([*FIT, *MESH_SEARCH, "--json", path], JAXCKPT_CRASH_COMPILE_ON_MESH="fsdp=4")
  if got.returncode != 0:
    return "the crashed mesh's row, the answer from the others", f"exit {got.returncode}", False
  rows = {json.dumps(r["mesh"]): r for r in json.load(open(path))["mesh_search"]["meshes"]}
  crashed = rows[json.dumps({"fsdp": 4})]
  fitted = [r for r in rows.values() if r["status"] == "fitted"]
  return ("an aborting compile on mesh fsdp=4: its row 'compiler crashed', the search answers from the others",
          f"exit 0, fsdp=4: {crashed['reason'][:60]}; {len(fitted)} other meshes fitted",
          crashed["status"] == "compiler crashed" and "SIGABRT" in crashed["reason"] and len(fitted) == 2)


CASES: dict[str, tuple[str, Callable[[str], tuple[str, str, bool]], bool]] = {
    "stale_cache": ("compiled-stats cache under a changed XLA_FLAGS", stale_cache, False),
    "damaged_cache": ("a truncated cache entry", damaged_cache, False),
    "wrong_types": ("a cache entry with the wrong types", wrong_types, False),
    "output_full_disk": ("an output file on a full disk", _outputs_on_full_disk, True),
    "dev_full": ("--json /dev/full", dev_full, True),
    "closed_pipe": ("the table into a closed pipe", closed_pipe, True),
    "ascii": ("an ASCII terminal", ascii_terminal, True),
    "ctrl_c": ("Ctrl-C during a compile", ctrl_c, False),
    "bit_flip": ("a flipped bit in a checkpoint", bit_flip, False),
    "save_full_disk": ("a checkpoint save on a full disk", save_on_full_disk, False),
    "lost_peer": ("a killed process of a 2-process run", lost_peer, False),
    "cache_temporaries": ("cache temporaries after kill -9 and a full disk", cache_temporaries, False),
    "unwritable_cache": ("an unwritable cache", unwritable_cache, False),
    "absurd_shapes": ("absurd shapes", absurd_shapes, True),
    "long_spec": ("a 29,000-character spec", long_spec, True),
    "compiler_crash": ("a compiler crash in the mesh search", compiler_crash, False),
}
"""name -> (case, function, in ``--quick``)."""


def render(data: Mapping[str, Any]) -> str:
  """The result as markdown: a header line and the table (docs/benchmarks.md)."""
  cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731 - a pipe in a case ends a Markdown cell
  rows = [[cell(c["case"]), cell(c["expected"]), cell(c["observed"]), "yes" if c["held"] else "**NO**"]
          for c in data["cases"]]
  held = sum(c["held"] for c in data["cases"])
  return "\n".join([f"Measured {common.header(data)}; {held} of {len(rows)} cases held.", "",
                    common.markdown_table(["case", "expected", "observed", "held"], rows)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the cases; returns (and writes) the result record."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--only", nargs="+", default=None, choices=list(CASES), metavar="NAME",
                 help=f"run these cases only: {', '.join(CASES)}")
  args = p.parse_args(argv)
  common.check_out(p, NAME, args)
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  record["cases"] = []
  names = args.only or [n for n, (_, _, quick) in CASES.items() if quick or not args.quick]
  for name in names:
    case, function, _ = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.perf_counter()
      try:
        expected, observed, held = function(tmp)
      except Exception as err:  # noqa: BLE001 - a case that breaks is a case that did not hold
        expected, observed, held = "(the case ran)", f"{type(err).__name__}: {str(err)[:120]}", False
    record["cases"].append({"name": name, "case": case, "expected": expected, "observed": observed, "held": held,
                            "seconds": round(time.perf_counter() - t0, 1)})
    print(f"{name}: {'held' if held else 'FAILED'} ({observed})", file=sys.stderr, flush=True)
  return common.publish(record, started, render, NAME, args)


if __name__ == "__main__":
  main()
