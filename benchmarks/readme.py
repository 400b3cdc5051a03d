"""Writes the benchmarks' tables into the manual from the committed JSON, so the manual shows the latest run.

Usage: ``python benchmarks/readme.py`` (rewrite) or ``python benchmarks/readme.py --check`` (exit 1 if a page
differs).

Each script's ``render(json)`` output goes between ``<!-- benchmark:NAME -->`` and ``<!-- /benchmark:NAME -->`` in
its page (:data:`PAGES`: docs/benchmarks.md, the benchmark log linked from README.md, docs/plans.md for the
budget plans, docs/tpu.md for the TPU topologies, docs/llm.md for MaxText's published configurations,
docs/timing.md for the step-time model beside their throughput); a script without a committed ``benchmarks/results/NAME.json`` (or
without markers) is skipped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import (budget_plans, common, fault_cases, faults, fit_planner, policy_sweep, published_configs,
                        report_speed, runner_overhead, step_time, step_time_gpu, structure_depth, tpu_topology,
                        truth_check)

_DOCS = os.path.normpath(os.path.join(os.path.dirname(common.RESULTS_DIR), os.pardir, "docs"))
PAGE = os.path.join(_DOCS, "benchmarks.md")
"""The benchmark log (README.md before the manual moved to docs/)."""
MODULES = (policy_sweep, structure_depth, runner_overhead, report_speed, truth_check, faults, fault_cases, fit_planner)
"""The scripts whose tables are on :data:`PAGE`."""
PAGES = {PAGE: MODULES, os.path.join(_DOCS, "plans.md"): (budget_plans,),
         os.path.join(_DOCS, "tpu.md"): (tpu_topology,), os.path.join(_DOCS, "llm.md"): (published_configs,),
         os.path.join(_DOCS, "timing.md"): (step_time, step_time_gpu)}
"""Each page holding tables -> the scripts whose tables it holds."""


def rendered_readme(text: str, results_dir: str = common.RESULTS_DIR, modules: Sequence[Any] = MODULES) -> str:
  """``text`` (a page's contents) with every marked block of ``modules`` replaced by its script's render of the
  committed JSON."""
  for module in modules:
    path = os.path.join(results_dir, f"{module.NAME}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      block = module.render(json.load(f))
    pattern = re.compile(rf"(<!-- benchmark:{module.NAME} -->\n)(?:.*?\n)?(<!-- /benchmark:{module.NAME} -->)", re.S)
    text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)
  return text


def main(argv: Sequence[str] | None = None) -> int:
  """Rewrites the pages of :data:`PAGES` (or with ``--check`` only compares); returns the exit status."""
  p = common.CLIParser(prog="python benchmarks/readme.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 if a page differs from the JSON")
  args = p.parse_args(argv)
  status = 0
  for path, modules in PAGES.items():
    with open(path) as f:
      text = f.read()
    new = rendered_readme(text, modules=modules)
    if args.check:
      if new != text:
        print(f"{path} differs from benchmarks/results/*.json: run python benchmarks/readme.py", file=sys.stderr)
        status = 1
      continue
    with open(path, "w") as f:
      f.write(new)
  return status


if __name__ == "__main__":
  raise SystemExit(main())
