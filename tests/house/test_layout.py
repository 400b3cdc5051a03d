"""The tests' own layout: a folder per package (``tests/<package>/test_<feature>.py``), every folder a package, and
the remat3 tier chosen by markers at the tests (``@pytest.mark.remat3``), not by a table of names that a renamed test
silently leaves."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WHOLE_TREE = ("experiments", "benchmarks", "house")
"""Folders that are not a jaxckpt package: the programs' tests, and ``house/`` (checks of the whole tree)."""

REMAT3_MARK = re.compile(r"\bpytest\.mark\.remat3\b")


def _test_files() -> list[pathlib.Path]:
  return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_is_in_the_folder_of_its_package():
  packages = {p.parent.name for p in (ROOT / "jaxckpt").glob("*/__init__.py")}
  misplaced = [str(p.relative_to(TESTS)) for p in _test_files()
               if len(p.relative_to(TESTS).parts) != 2 or p.parent.name not in packages | set(WHOLE_TREE)]
  assert not misplaced, (f"test files belong in tests/<package>/ (a jaxckpt package, or one of {WHOLE_TREE}): "
                         f"{misplaced}")


def test_every_folder_of_tests_is_a_package():
  """``__init__.py`` in every folder: files of the same name in two folders import as different modules
  (``tests.nnx.test_layers``, ``tests.linen.test_layers``), and helpers as ``tests.numerics``."""
  folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
  missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
  assert not missing, f"add an __init__.py to {missing}"


def test_the_remat3_tier_is_marked_at_the_tests_and_selects_them():
  """No test file reads the removed table of remat3 cases (conftest.py's, by test name); the files that mark tests ``remat3`` each have a test
  that ``-m remat3`` selects (.ci/run's third leg runs them), so a mark never goes unseen."""
  table = "REMAT3" + "_CASES"
  readers = [str(p.relative_to(ROOT)) for p in sorted(TESTS.rglob("*.py")) if table in p.read_text()]
  assert not readers, f"the {table} table is gone (mark the tests @pytest.mark.remat3): {readers}"
  marked = [str(p.relative_to(ROOT)) for p in _test_files()
            if REMAT3_MARK.search(p.read_text()) and p != pathlib.Path(__file__).resolve()]
  assert marked, "no test is marked remat3: .ci/run's remat3 leg would run nothing"
  done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                         "-m", "remat3", *marked], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  selected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
  assert selected == set(marked), f"marked remat3 but nothing selected: {sorted(set(marked) - selected)}"
