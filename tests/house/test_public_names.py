"""Programs use the library through its faces: ``experiments/`` and ``benchmarks/`` import public names only (a name
on a face of :data:`jaxckpt._deprecations.PUBLIC_FACES`), never a private module (``jaxckpt.*._name``) or a private
name; what they need is public, or it is not theirs to need."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = ("experiments", "benchmarks")


def private_imports(path: pathlib.Path) -> list[str]:
  """Every import of a private jaxckpt module or name in ``path``: ``"file:line module.name"``."""
  bad = []
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxckpt":
      private_module = any(part.startswith("_") for part in node.module.split("."))
      bad.extend(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                 if private_module or a.name.startswith("_"))
    elif isinstance(node, ast.Import):
      bad.extend(f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                 if a.name.split(".")[0] == "jaxckpt" and any(p.startswith("_") for p in a.name.split(".")))
  return bad


def test_programs_import_public_names_only():
  bad = [line for folder in PROGRAMS for path in sorted((ROOT / folder).rglob("*.py")) for line in private_imports(path)]
  assert not bad, "experiments/benchmarks import private jaxckpt names (use a face):\n" + "\n".join(bad)


def test_the_check_finds_a_private_import(tmp_path):
  global ROOT
  path = tmp_path / "p.py"
  path.write_text("from jaxckpt.fit._search import resolve_memory\nfrom jaxckpt.training import _saving\n"
                  "import jaxckpt.step._compile\nfrom jaxckpt.fit import plan_fit\n")
  saved, ROOT = ROOT, tmp_path
  try:
    assert private_imports(path) == ["p.py:1 jaxckpt.fit._search.resolve_memory", "p.py:2 jaxckpt.training._saving",
                                     "p.py:3 jaxckpt.step._compile"]
  finally:
    ROOT = saved
