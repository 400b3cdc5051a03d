"""The house: jaxckpt's modules import one way (experiments → report → planner → step core → layers/policies), with
no import cycle and no import of jaxckpt placed inside a function to dodge one."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxckpt"

# Lower layers never import higher ones. Each entry: a package prefix -> prefixes it must not import.
LAYERS = {
    "jaxckpt.step": ("jaxckpt.report", "jaxckpt.planner", "experiments"),
    "jaxckpt.planner": ("jaxckpt.report", "experiments"),
    "jaxckpt.report": ("experiments",),
    "jaxckpt.fit": ("experiments",),
    "jaxckpt.policies": ("jaxckpt.step", "jaxckpt.report", "jaxckpt.planner", "jaxckpt.layers", "jaxckpt.linen"),
}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool, int]]:
  """``(imported module, inside a function, line)`` of every jaxckpt/experiments import in a file."""
  tree = ast.parse(path.read_text(), filename=str(path))
  out = []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        out.extend((a.name, in_function, child.lineno) for a in child.names)
      elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
        out.extend((f"{child.module}.{a.name}", in_function, child.lineno) for a in child.names)
      elif isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
        continue
      visit(child, nested)

  visit(tree, False)
  return [(name, inside, line) for name, inside, line in out if name.split(".")[0] in ("jaxckpt", "experiments")]


def _graph() -> dict[str, set[str]]:
  files = sorted(PACKAGE.rglob("*.py"))
  modules = {_module_name(f): f for f in files}
  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    deps = set()
    for imported, _, _ in _imports(path):
      # `from a.b import c` names module a.b.c if it exists, else a.b.
      target = imported if imported in modules else imported.rpartition(".")[0]
      while target and target not in modules:
        target = target.rpartition(".")[0]
      if target and target != name:
        deps.add(target)
    graph[name] = deps
  return graph


def test_no_import_cycle_in_the_package():
  graph = _graph()
  # A package's __init__ re-exports its submodules: edges into a package from its own submodules are not cycles
  # of meaning, but any other cycle is.
  state: dict[str, int] = {}
  stack: list[str] = []

  def dfs(node: str) -> list[str] | None:
    state[node] = 1
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if node.startswith(dep + ".") or dep.startswith(node + "."):
        continue  # a module and its own package (re-exports)
      if state.get(dep) == 1:
        return stack[stack.index(dep):] + [dep]
      if dep not in state and (cycle := dfs(dep)):
        return cycle
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = dfs(node)
      assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle(tmp_path):
  """The checker itself: a package whose two modules import each other is reported."""
  pkg = tmp_path / "jaxckpt"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from jaxckpt.b import x\n")
  (pkg / "b.py").write_text("from jaxckpt.a import y\n")
  global ROOT, PACKAGE
  saved = ROOT, PACKAGE
  ROOT, PACKAGE = tmp_path, pkg
  try:
    with pytest.raises(AssertionError, match="import cycle: jaxckpt.a -> jaxckpt.b -> jaxckpt.a"):
      test_no_import_cycle_in_the_package()
  finally:
    ROOT, PACKAGE = saved


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_imports_run_one_way(layer):
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    name = _module_name(path)
    if name != layer and not name.startswith(layer + "."):
      continue
    for imported, _, line in _imports(path):
      if any(imported == p or imported.startswith(p + ".") for p in LAYERS[layer]):
        bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
  assert not bad, f"{layer} must not import {', '.join(LAYERS[layer])}:\n" + "\n".join(bad)


def test_no_jaxckpt_import_inside_a_function():
  bad = []
  for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]):
    for imported, inside, line in _imports(path):
      if inside:
        bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported} inside a function")
  assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name():
  """``from jaxckpt.x import _name`` couples a module to another's internals: give the name a public, documented
  name instead (e.g. :func:`jaxckpt.flops.equation_flops`, :func:`jaxckpt.tagging.evaluate_tagged`)."""
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxckpt":
        bad.extend(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                   for a in node.names if a.name.startswith("_"))
  assert not bad, "\n".join(bad)
