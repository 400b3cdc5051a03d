"""Ratchets that only fall: what the tree may still hold of three habits, each listed where it stands today with its
reason, so that a new case fails and a fixed one must be struck off (a count below its ceiling fails too: lower it).

- No reference to a file that is not in the repository: the team's shared notes live beside it (``../shared/``), so a
  fact taken from them is stated where it is used; where a page still cites them it says where they are
  (``../shared/<name>``), and the library cites them nowhere.
- No function of ``jaxckpt/`` takes more than :data:`MAX_PARAMETERS` parameters, but those of
  :data:`WIDE_FUNCTIONS`, at their count today.
- No ``mesh`` or ``policy`` parameter typed ``Any`` (or not typed) below the faces: a public function may take a
  string, a mapping or a ``Mesh`` and resolve it; what it hands down has a type (:data:`ANY_MESH_OR_POLICY`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import re

from jaxckpt import _deprecations

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxckpt"

# --- files outside the repository ----------------------------------------------------------------------------------

SHARED_NOTES = ("NOTES" + ".md", "STYLE" + ".md", "published-configs" + ".md", "published-configs-gpu" + ".md")
"""The team's shared notes, kept beside the repository (``../shared/``) and not in it (names written in two parts so
that this file does not cite them)."""

OUTSIDE_REFERENCES: dict[str, int] = {
    "benchmarks/published_configs.py": 3,
    "benchmarks/published_gpu_configs.py": 3,
    "benchmarks/step_time.py": 2,
    "benchmarks/step_time_gpu.py": 2,
    "docs/gpu.md": 1,
    "docs/llm.md": 1,
    "docs/timing.md": 2,
    "tests/policies/test_maxtext_presets.py": 1,
}
"""Files that cite the shared notes (as ``../shared/<name>``), with how many times: the published MaxText rows each
benchmark compiles are numbered as the notes number them (T1…, G1…, MT-1…), each row's own source is in the script. A
count only falls."""

_TEXT_FILES = ("jaxckpt/**/*.py", "jaxckpt/**/*.j2", "tests/**/*.py", "experiments/**/*.py", "benchmarks/**/*.py",
               "benchmarks/**/*.sh", "docs/*.md", "README.md", "pyproject.toml")


def outside_references(root: pathlib.Path = ROOT) -> tuple[dict[str, int], list[str]]:
  """``({file: references to the shared notes written ../shared/<name>}, [bare references: "file:line name"])``."""
  here = pathlib.Path(__file__).resolve()
  names = "|".join(re.escape(n) for n in SHARED_NOTES)
  pattern = re.compile(rf"((?:[\w.-]*/)*)(?<![\w-])({names})\b")
  counts: dict[str, int] = {}
  bare: list[str] = []
  for glob in _TEXT_FILES:
    for path in sorted(root.glob(glob)):
      if path.resolve() == here or not path.is_file():
        continue
      rel = path.relative_to(root).as_posix()
      text = path.read_text(encoding="utf-8")
      for m in pattern.finditer(text):
        if m.group(1) == "../shared/" and not rel.startswith("jaxckpt/"):
          counts[rel] = counts.get(rel, 0) + 1
        else:
          bare.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1} {m.group(0)}")
  return counts, bare


def test_no_reference_to_a_file_that_is_not_in_the_repository():
  counts, bare = outside_references()
  assert not bare, ("references to the shared notes, which are not in the repository: state the fact where it is "
                    "used (the library always), or cite ../shared/<name> from a page or a benchmark:\n"
                    + "\n".join(bare))
  new = {f: n for f, n in counts.items() if n > OUTSIDE_REFERENCES.get(f, 0)}
  assert not new, f"more citations of ../shared/ than allowed (state the fact instead): {new}"
  fell = {f: (counts.get(f, 0), n) for f, n in OUTSIDE_REFERENCES.items() if counts.get(f, 0) != n}
  assert not fell, f"citations of ../shared/ fell (lower OUTSIDE_REFERENCES to them, or drop the entry): {fell}"


def test_the_reference_check_finds_a_bare_and_a_new_citation(tmp_path):
  (tmp_path / "jaxckpt").mkdir()
  (tmp_path / "docs").mkdir()
  (tmp_path / "jaxckpt" / "m.py").write_text(f'"""As ../shared/{SHARED_NOTES[0]} says."""\n')
  (tmp_path / "docs" / "a.md").write_text(f"see {SHARED_NOTES[0]} §3 and ../shared/{SHARED_NOTES[2]} §2\n")
  counts, bare = outside_references(tmp_path)
  assert counts == {"docs/a.md": 1}
  assert bare == [f"jaxckpt/m.py:1 ../shared/{SHARED_NOTES[0]}", f"docs/a.md:1 {SHARED_NOTES[0]}"]


# --- functions ----------------------------------------------------------------------------------------------------


@functools.cache
def functions(root: pathlib.Path = ROOT) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
  """Every function of ``jaxckpt/`` by ``"path:qualified.name"`` (a method as ``Class.method``, a nested function as
  ``outer.inner``)."""
  out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

  def visit(node: ast.AST, rel: str, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out[f"{rel}:{prefix}{child.name}"] = child
        visit(child, rel, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        visit(child, rel, f"{prefix}{child.name}.")
      else:
        visit(child, rel, prefix)

  for path in sorted((root / "jaxckpt").rglob("*.py")):
    visit(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(root).as_posix(), "")
  return out


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
  """A function's parameters, ``self``/``cls`` of a method left out, ``*args`` and ``**kwargs`` one each."""
  a = node.args
  params = [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else [])]
  return params[1:] if params and params[0].arg in ("self", "cls") else params


MAX_PARAMETERS = 10

_RESOLVED_BELOW = ("the keywords of a public entry for API users; what it resolves (mesh, topology, memory fraction, "
                   "policies) goes down as one compile job, which takes these parameters")
_STAGE = "a stage of the fit or the planner that takes the run piece by piece until the compile job carries it"

WIDE_FUNCTIONS: dict[str, tuple[int, str]] = {
    "jaxckpt/core/_blocks.py:attention": (11, "the block math's attention: q, k, v and every option of the blocks "
                                              "that call it (mask, causal, heads, dropout and its key, implementation)"),
    "jaxckpt/fit/_meshes.py:search_meshes": (12, _RESOLVED_BELOW),
    "jaxckpt/fit/_names.py:custom_plans": (12, _STAGE),
    "jaxckpt/fit/_plan.py:_fit_custom_lists": (12, _STAGE),
    "jaxckpt/fit/_plan.py:_fits_and_lists": (11, _STAGE),
    "jaxckpt/fit/_plan.py:plan_fit": (14, _RESOLVED_BELOW),
    "jaxckpt/fit/_search.py:max_batch_size": (17, _RESOLVED_BELOW),
    "jaxckpt/models/llm/_layers.py:Attention.__init__": (17, "a public layer's dimensions and variants, as Flax's "
                                                              "nnx.MultiHeadAttention takes them one by one"),
    "jaxckpt/models/llm/_moe.py:MoE.__init__": (13, "a public layer's dimensions and options, one by one as the "
                                                    "other layers take theirs (the config's MoEConfig holds them)"),
    "jaxckpt/planner/_plan.py:_dominance_guard": (12, _STAGE),
    "jaxckpt/planner/_plan.py:_rounds": (13, _STAGE),
    "jaxckpt/planner/_plan.py:plan_policy": (11, _RESOLVED_BELOW),
    "jaxckpt/report/_build.py:build_report": (17, _RESOLVED_BELOW),
    "jaxckpt/report/_compile.py:_RowCompiles.__init__": (13, "the report's compile queue, made from build_report's "
                                                          "arguments until the compile job carries them"),
    "jaxckpt/step/_targets.py:shipped_target": (14, "a shipped model's config overrides by name (the CLI's model "
                                                    "flags) beside the target's own options"),
}
"""Functions allowed over :data:`MAX_PARAMETERS` parameters (``self`` not counted; ``*args``, ``**kwargs`` one
each): their count today as a ceiling that only falls, and the reason."""


def wide_functions(root: pathlib.Path = ROOT) -> dict[str, int]:
  return {key: len(_parameters(node)) for key, node in functions(root).items()
          if len(_parameters(node)) > MAX_PARAMETERS}


def test_no_function_takes_more_than_ten_parameters():
  wide = wide_functions()
  new = {k: n for k, n in wide.items() if k not in WIDE_FUNCTIONS}
  assert not new, (f"functions over {MAX_PARAMETERS} parameters: pass a record (a config, a compile job) instead: "
                   f"{new}")
  moved = {k: (wide.get(k), ceiling) for k, (ceiling, _) in WIDE_FUNCTIONS.items() if wide.get(k) != ceiling}
  assert not moved, ("allow-listed functions whose parameters are not their ceiling (count, ceiling): lower the "
                     f"ceiling, or drop the entry at {MAX_PARAMETERS} or fewer: {moved}")


def test_the_parameter_check_counts_a_wide_function(tmp_path):
  (tmp_path / "jaxckpt").mkdir()
  (tmp_path / "jaxckpt" / "m.py").write_text(
      "class C:\n  def f(self, a, b, c, d, e, f, g, h, i, j, *, k, **rest):\n    def inner(x):\n      pass\n")
  assert wide_functions(tmp_path) == {"jaxckpt/m.py:C.f": 12}


# --- Any-typed meshes and policies --------------------------------------------------------------------------------

FACES = (*_deprecations.PUBLIC_FACES, "jaxckpt.timing", "jaxckpt.analysis.hlo")
"""The modules whose public functions (and the methods of their public classes) are the faces: they may take what a
user writes and resolve it."""

_JOB = "takes what its public caller was given, resolved again below it: the compile job hands it down typed"

ANY_MESH_OR_POLICY: dict[str, str] = {
    "jaxckpt/fit/_plan.py:_check_global_batch:mesh": _JOB,
    "jaxckpt/fit/_search.py:_Search.start:policy": _JOB,
    "jaxckpt/fit/_search.py:_compiled_point:mesh": _JOB,
    "jaxckpt/fit/_search.py:_concrete:mesh": _JOB,
    "jaxckpt/fit/_search.py:_concrete:policy": _JOB,
    "jaxckpt/fit/_search.py:_lowered_point:mesh": _JOB,
    "jaxckpt/fit/_search.py:_lowered_point:policy": _JOB,
    "jaxckpt/planner/_plan.py:_min_saved_guarded.point:policy": "a candidate's concrete policy, as the planner's "
                                                                 "stages pass it",
    "jaxckpt/planner/_plan.py:_min_saved_guarded:mesh": _JOB,
    "jaxckpt/planner/_plan.py:_offload_hint:mesh": _JOB,
    "jaxckpt/planner/_plan.py:plan_policy.compile_point:policy": "a candidate's concrete policy, as the planner's "
                                                                 "stages pass it",
    "jaxckpt/report/_compile.py:_RowCompiles.__init__:mesh": _JOB,
    "jaxckpt/report/_compile.py:step_time_estimate:mesh": _JOB,
    "jaxckpt/step/_build.py:check_plain_step:policy": "only printed in its message: the policy's text or object",
    "jaxckpt/step/_targets.py:linen_target.loss:policy": "the loss protocol's policy keyword, whatever the "
                                                               "step core passes (a concrete policy or None)",
}
"""``mesh`` and ``policy`` parameters typed ``Any`` (or not typed) below the faces, with the reason each still is: a
list that only falls."""


def _public(root: pathlib.Path) -> set[str]:
  """``"path:qualified.name"`` of every public function of :data:`FACES` and every method of their public classes."""
  out = set()
  for face in FACES:
    module = importlib.import_module(face)
    for name in getattr(module, "__all__", ()):
      value = getattr(module, name)
      members = ([value] if inspect.isfunction(value) else
                 [m for m in vars(value).values() if inspect.isfunction(m)] if inspect.isclass(value) else [])
      for fn in members:
        source = inspect.getsourcefile(fn)
        if source and pathlib.Path(source).resolve().is_relative_to(root):
          out.add(f"{pathlib.Path(source).resolve().relative_to(root).as_posix()}:{fn.__qualname__}")
  return out


def any_mesh_or_policy(root: pathlib.Path = ROOT, public: set[str] | None = None) -> set[str]:
  """``"path:function:parameter"`` of every ``mesh`` or ``policy`` parameter typed ``Any`` or not typed, in
  functions that are not on a face."""
  public = _public(root) if public is None else public
  out = set()
  for key, node in functions(root).items():
    if key in public:
      continue
    for arg in _parameters(node):
      typed = ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else "Any"
      if arg.arg in ("mesh", "policy") and typed == "Any":
        out.add(f"{key}:{arg.arg}")
  return out


def test_no_any_typed_mesh_or_policy_below_the_faces():
  found = any_mesh_or_policy()
  new = sorted(found - set(ANY_MESH_OR_POLICY))
  assert not new, ("mesh/policy parameters typed Any below the faces: give them the type the face resolved to "
                   f"(Mesh, Placement, a concrete policy): {new}")
  gone = sorted(set(ANY_MESH_OR_POLICY) - found)
  assert not gone, f"typed now or removed: strike them off ANY_MESH_OR_POLICY: {gone}"


def test_the_any_check_finds_an_untyped_mesh(tmp_path):
  (tmp_path / "jaxckpt").mkdir()
  (tmp_path / "jaxckpt" / "m.py").write_text(
      "from typing import Any\n\ndef f(mesh: Any, policy: 'Policy'): ...\n\ndef g(policy, mesh: 'Any' = None): ...\n")
  assert any_mesh_or_policy(tmp_path, public={"jaxckpt/m.py:g"}) == {"jaxckpt/m.py:f:mesh"}
