"""What every benchmark shares: the run record (machine, load, versions, date), interleaved timing, JSON and tables.

These machines are shared and noisy, so benchmarks publish *ratios measured within one run*: the variants being
compared are interleaved round by round (``A B C A B C …``), each round gives one time per variant, and the figure
is the median over rounds of ``time(variant) / time(baseline)`` in the same round. The machine's load average is
recorded at the start and the end of every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

import jaxckpt
from jaxckpt.cli import CLIParser, check_output_file  # noqa: F401 - CLIParser re-exported for readme.py
from jaxckpt.errors import JaxckptError

__all__ = ["RESULTS_DIR", "MIN_ROUNDS", "run_record", "finish_record", "interleaved", "write_json", "markdown_table",
           "parser", "out_path", "check_out", "header", "CompileLog", "mib", "own_stderr_lines"]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
"""Where the scripts write their JSON (``benchmarks/results/``)."""
MIN_ROUNDS = 5
"""Fewest interleaved rounds of a full (not ``--quick``) run."""

_CUDA_PLUGIN_LOG = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
                              r"|I\d{4} \S+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine")


def own_stderr_lines(text: str) -> list[str]:
  """A program's standard error as lines, less what JAX's CUDA plugin writes when ``import jax`` loads it.

  With the ``[gpu]`` extra installed (the compile-only ``jax-cuda12-plugin``), every ``import jax`` on a machine
  without a CUDA driver writes three ``cudart_stub.cc ... Could not find cuda drivers`` lines, each after absl's
  ``All log messages before absl::InitializeLog()`` line, straight to file descriptor 2 from C++ before JAX's logging
  starts (docs/gpu.md): not the program's own output, and no environment variable silences them.

  Args:
    text: the captured standard error (``str``).

  Returns:
    Its lines (``list[str]``, no line ends), those lines left out.
  """
  return [line for line in text.splitlines() if not _CUDA_PLUGIN_LOG.match(line)]


def parser(name: str, doc: str) -> argparse.ArgumentParser:
  """The common flags: ``--quick`` (tiny sizes, seconds: the smoke test's) and ``--out`` (the JSON path).

  Errors are one line on stderr, exit status 2 (:class:`jaxckpt._cli.CLIParser`).
  """
  p = CLIParser(prog=f"python benchmarks/{name}.py", description=doc.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test); writes <name>-quick.json")
  p.add_argument("--out", default=None, metavar="FILE.json",
                 help=f"JSON path (default benchmarks/results/{name}.json, or {name}-quick.json with --quick)")
  return p


def out_path(name: str, args: argparse.Namespace) -> str:
  """The JSON path of a run: ``--out``, else ``benchmarks/results/<name>[-quick].json``."""
  if args.out is not None:
    return args.out
  return os.path.join(RESULTS_DIR, f"{name}{'-quick' if args.quick else ''}.json")


def check_out(p: argparse.ArgumentParser, name: str, args: argparse.Namespace) -> None:
  """Exits 2 with one line, before any work, if the JSON path cannot be written."""
  try:
    check_output_file("--out", out_path(name, args))
  except JaxckptError as err:
    p.error(str(err))


def run_record(benchmark: str, args: argparse.Namespace | None = None) -> dict[str, Any]:
  """The header of a result: benchmark name, UTC date, machine (CPU cores, load average), backend, versions, flags."""
  device = jax.devices()[0]
  return {
      "benchmark": benchmark,
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
      "machine": {
          "cpu_count": os.cpu_count(),
          "platform": platform.platform(),
          "backend": jax.default_backend(),
          "device_kind": getattr(device, "device_kind", str(device)),
          "device_count": jax.device_count(),
          "loadavg_start": list(os.getloadavg()),
          "loadavg_end": None,
      },
      "versions": jaxckpt.schema.versions(),
      "args": {k: v for k, v in vars(args).items() if k != "out"} if args is not None else {},
  }


def finish_record(record: dict[str, Any], started: float) -> dict[str, Any]:
  """Adds the end-of-run load average, the run's wall seconds (``wall_s``) and the CPU seconds of this process and
  its finished children (``cpu_s``: on a machine shared with other jobs, wall ≫ cpu / cores tells of contention)."""
  record["machine"]["loadavg_end"] = list(os.getloadavg())
  record["wall_s"] = time.perf_counter() - started
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  record["cpu_s"] = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
  return record


def publish(record: dict[str, Any], started: float, render: Callable[[Mapping[str, Any]], str], name: str,
            args: argparse.Namespace) -> dict[str, Any]:
  """Finishes ``record`` (:func:`finish_record`), prints ``render(record)`` and writes it as JSON to
  :func:`out_path`; returns it."""
  finish_record(record, started)
  print(render(record))
  print(f"wrote {write_json(out_path(name, args), record)}")
  return record


def interleaved(runs: Mapping[str, Callable[[], Any]], *, rounds: int, baseline: str) -> dict[str, dict[str, Any]]:
  """Times each variant once per round, variants interleaved; ratios to ``baseline`` taken within each round.

  Args:
    runs: variant name -> a callable that does one timed unit of work and waits for it (``block_until_ready``).
    rounds: rounds ≥ 1; the order of the variants rotates each round, so none always runs first.
    baseline: the variant the ratios divide by.

  Returns:
    Per variant: ``times_s`` (one per round, seconds), ``median_s`` (seconds), ``ratios`` (time / baseline's time
    in the same round) and ``median_ratio``.
  """
  names = list(runs)
  times: dict[str, list[float]] = {n: [] for n in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      started = time.perf_counter()
      runs[name]()
      times[name].append(time.perf_counter() - started)
  out = {}
  for name in names:
    ratios = [t / b for t, b in zip(times[name], times[baseline])]
    out[name] = {"times_s": times[name], "median_s": statistics.median(times[name]), "ratios": ratios,
                 "median_ratio": statistics.median(ratios)}
  return out


def write_json(path: str, data: Mapping[str, Any]) -> str:
  """Writes ``data`` as indented JSON (creating the folder); returns the path."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
  return path


def header(data: Mapping[str, Any]) -> str:
  """``'2026-11-29 21:40 UTC, cpu (2 cores), load 4.9 → 6.7, 590 s wall / 310 s CPU'``: the run line of a result."""
  m = data["machine"]
  return (f"{data['date_utc']} UTC, {m['backend']} ({m['cpu_count']} cores), load {m['loadavg_start'][0]:.1f} → "
          f"{m['loadavg_end'][0]:.1f}, {data['wall_s']:.0f} s wall / {data.get('cpu_s', float('nan')):.0f} s CPU")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table (cells are ``str()``-ed)."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def save_plot(fig: Any, ax: Any, path: str) -> None:
  """Finishes a benchmark's matplotlib figure the one way the docs' plots look (grid, small legend, tight layout,
  80 dpi) and writes it to ``path`` (PNG), closing the figure."""
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib only where a benchmark plots
  plt.close(fig)


def mib(num_bytes: int | float | None) -> str:
  """Bytes as ``'123.4 MiB'`` (``'—'`` for ``None``)."""
  return "—" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


class CompileLog(logging.Handler):
  """Collects JAX's ``Compiling <fn> …`` log lines while ``jax_log_compiles`` is on (a context manager).

  ``events`` holds ``(mark, function name)`` pairs: ``mark`` is whatever :attr:`mark` was when the compile
  happened, so a caller can set it to "after step 1" and count what compiled after that.
  """

  def __init__(self) -> None:
    super().__init__(level=logging.DEBUG)
    self.events: list[tuple[Any, str]] = []
    self.mark: Any = None
    self._previous = None

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    if message.startswith("Compiling "):
      self.events.append((self.mark, message.split(" ")[1]))

  def __enter__(self) -> "CompileLog":
    self._previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    logger = logging.getLogger("jax")
    self._propagate = logger.propagate
    logger.propagate = False  # collected here, not printed by whatever handlers the root logger has
    logger.addHandler(self)
    return self

  def __exit__(self, *exc) -> None:
    logger = logging.getLogger("jax")
    logger.removeHandler(self)
    logger.propagate = self._propagate
    jax.config.update("jax_log_compiles", self._previous)
