"""Writes the benchmarks' tables into docs/benchmarks.md from the committed JSON, so the manual shows the latest run.

Usage: ``python benchmarks/readme.py`` (rewrite) or ``python benchmarks/readme.py --check`` (exit 1 if the page
differs).

Each script's ``render(json)`` output goes between ``<!-- benchmark:NAME -->`` and ``<!-- /benchmark:NAME -->`` in
docs/benchmarks.md (the benchmark log, linked from README.md); a script without a committed
``benchmarks/results/NAME.json`` (or without markers) is skipped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import (common, faults, fit_planner, policy_sweep, report_speed, runner_overhead, structure_depth,
                        truth_check)

PAGE = os.path.join(os.path.dirname(common.RESULTS_DIR), os.pardir, "docs", "benchmarks.md")
"""The page holding the tables (README.md before the manual moved to docs/)."""
MODULES = (policy_sweep, structure_depth, runner_overhead, report_speed, truth_check, faults, fit_planner)


def rendered_readme(text: str, results_dir: str = common.RESULTS_DIR) -> str:
  """``text`` (the page's contents) with every marked block replaced by its script's render of the committed JSON."""
  for module in MODULES:
    path = os.path.join(results_dir, f"{module.NAME}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      block = module.render(json.load(f))
    pattern = re.compile(rf"(<!-- benchmark:{module.NAME} -->\n)(?:.*?\n)?(<!-- /benchmark:{module.NAME} -->)", re.S)
    text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)
  return text


def main(argv: Sequence[str] | None = None) -> int:
  """Rewrites docs/benchmarks.md (or with ``--check`` only compares); returns the exit status."""
  p = common.CLIParser(prog="python benchmarks/readme.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md differs from the JSON")
  args = p.parse_args(argv)
  path = os.path.normpath(PAGE)
  with open(path) as f:
    text = f.read()
  new = rendered_readme(text)
  if args.check:
    if new != text:
      print(f"{path} differs from benchmarks/results/*.json: run python benchmarks/readme.py", file=sys.stderr)
      return 1
    return 0
  with open(path, "w") as f:
    f.write(new)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
