"""Old paths that keep working: module paths that moved, and names that left a package face, each with a warning.

jaxckpt's public names live on the package faces (``jaxckpt``, ``jaxckpt.nnx``, ``jaxckpt.linen``, ...; the list is
:data:`PUBLIC_FACES`), each name on exactly one of them; the modules behind them are private (``_name.py``). What an
earlier release offered elsewhere still imports:

- an old module path (``jaxckpt.layers``, ``jaxckpt.report.compile``) is a :class:`MovedModule` in ``sys.modules``
  (table :data:`MOVED_MODULES`): every name read through it is forwarded, with a ``DeprecationWarning`` naming the
  name's public path;
- a name that left a face (``jaxckpt.Stack`` is ``jaxckpt.nnx.Stack`` now) is served by the face's module
  ``__getattr__`` (:func:`forward_names`), with the same warning.

The idea is optax's ``_deprecations`` table served by a module ``__getattr__`` (PEP 562).

This module is at the ground floor: it imports no other jaxckpt module at import time.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable, Mapping

PUBLIC_FACES: tuple[str, ...] = (
    "jaxckpt", "jaxckpt.nnx", "jaxckpt.linen", "jaxckpt.models", "jaxckpt.models.llm", "jaxckpt.policies",
    "jaxckpt.step", "jaxckpt.planner", "jaxckpt.report", "jaxckpt.fit", "jaxckpt.sharding", "jaxckpt.cli",
    "jaxckpt.rendering",
    "jaxckpt.training", "jaxckpt.analysis", "jaxckpt.core", "jaxckpt.errors", "jaxckpt.schema", "jaxckpt.names",
)
"""The modules whose ``__all__`` names are public; every public name is on exactly one of them
(``tests/house/test_face.py``)."""

_OLD_TOP_LEVEL = {
    "jaxckpt.remat": "jaxckpt.core._remat", "jaxckpt.blocks": "jaxckpt.core._blocks",
    "jaxckpt.structure": "jaxckpt.core._structure", "jaxckpt.autonames": "jaxckpt.core._autonames",
    "jaxckpt.tagging": "jaxckpt.core._tagging", "jaxckpt.jaxprs": "jaxckpt.analysis._jaxprs",
    "jaxckpt.flops": "jaxckpt.analysis._flops", "jaxckpt.residuals": "jaxckpt.analysis._residuals",
    "jaxckpt.activations": "jaxckpt.analysis._activations", "jaxckpt.diagnostics": "jaxckpt.core._diagnostics",
    "jaxckpt.render": "jaxckpt.rendering._text", "jaxckpt.layers": "jaxckpt.nnx._layers",
    "jaxckpt.apply": "jaxckpt.nnx._apply", "jaxckpt.linen_apply": "jaxckpt.linen._apply",
    "jaxckpt.gpt": "jaxckpt.models._gpt", "jaxckpt.configs": "jaxckpt.models._configs",
    "jaxckpt.multitask": "jaxckpt.models._multitask", "jaxckpt.train": "jaxckpt.training._train",
    "jaxckpt.xla": "jaxckpt.training._xla", "jaxckpt.saving": "jaxckpt.training._saving",
    "jaxckpt.profile": "jaxckpt.training._profile",
}
"""Module paths of jaxckpt 0.0's flat layout (before the folders)."""

_PACKAGE_MODULES = {
    "analysis": ("activations", "flops", "internals", "jaxprs", "residuals"),
    "core": ("arguments", "autonames", "blocks", "diagnostics", "matching", "names", "remat", "structure", "tagging"),
    "fit": ("html", "model", "plan", "plot", "search", "speed"),
    "linen": ("apply", "layers"),
    "models": ("classifiers", "configs", "gpt", "multitask", "registry"),
    "nnx": ("apply", "layers"),
    "planner": ("cache", "candidates", "export", "own", "plan", "segmented", "segments", "solve", "tensors", "whole"),
    "policies": ("model", "spec"),
    "report": ("build", "compile", "formats", "html", "keys", "measure", "outputs", "plot", "policies", "residuals",
               "xla_dump"),
    "step": ("build", "compile", "targets"),
    "training": ("profile", "saving", "train", "xla"),
}
"""Modules that were public in jaxckpt 0.0 and are private (``_name``) behind the faces now."""

MOVED_MODULES: dict[str, str] = {
    **_OLD_TOP_LEVEL,
    **{f"jaxckpt.{package}.{module}": f"jaxckpt.{package}._{module}"
       for package, modules in _PACKAGE_MODULES.items() for module in modules},
    "jaxckpt.units": "jaxckpt._units", "jaxckpt.remat_impl": "jaxckpt._remat_impl",
    # jaxckpt 0.2: the CLI room (jaxckpt.cli: the three tools' mains, their shared flags and parser)
    "jaxckpt.step.flags": "jaxckpt.cli._flags", "jaxckpt.fit.cli": "jaxckpt.cli._fit",
    "jaxckpt.planner.cli": "jaxckpt.cli._plan", "jaxckpt.report.cli": "jaxckpt.cli._report",
    # jaxckpt 0.2: the sharding room (meshes, logical rules, state shardings, chips and topologies in one package)
    "jaxckpt.topology": "jaxckpt.sharding", "jaxckpt.training.sharding": "jaxckpt.sharding",
    "jaxckpt.core.names": "jaxckpt.names",
    # jaxckpt 0.2: the one HLO reader (jaxckpt.analysis.hlo: parse, module, collectives, transfers, buffers)
    "jaxckpt.analysis._hlo": "jaxckpt.analysis.hlo",
    "jaxckpt.analysis._memory_spaces": "jaxckpt.analysis.hlo._buffers",
    # jaxckpt 0.2: analysis/ reads traced and compiled steps only; policy meaning, effect and rendering moved to the
    # rooms that use them (the 0.0 public paths, jaxckpt.analysis.<module>, and the 0.1 private ones)
    **{f"jaxckpt.analysis.{prefix}{old}": new for old, new in (
        ("policy_meaning", "jaxckpt.policies._meaning"), ("effect", "jaxckpt.planner._effect"),
        ("render", "jaxckpt.rendering._text"), ("tables", "jaxckpt.rendering._tables"),
        ("pages", "jaxckpt.rendering._pages")) for prefix in ("", "_") if (prefix, old) != ("", "pages")},
}
"""Old module path -> the module behind it now (a private module, or the public face that replaced it)."""

REMOVED_IN = "0.3.0"
"""The jaxckpt release that removes every old path of :data:`MOVED_MODULES` and every name a face forwards."""

def public_path(name: str, default: str) -> str:
  """Where ``name`` is public now: ``"<face>.<name>"`` for the first face of :data:`PUBLIC_FACES` whose ``__all__``
  holds it, else ``"<default>.<name>"`` (an internal name, reached through its private module)."""
  for face in PUBLIC_FACES:
    module = sys.modules.get(face)
    if module is not None and name in getattr(module, "__all__", ()):
      return f"{face}.{name}"
  return f"{default}.{name} (internal: not a public name)"


class MovedModule(types.ModuleType):
  """An old module path kept importable: each name read through it warns where it went and is forwarded.

  ``from jaxckpt.layers import Stack`` gives :class:`jaxckpt.nnx.Stack` and a ``DeprecationWarning`` saying
  ``jaxckpt.layers is not a public module any more: use jaxckpt.nnx.Stack``.

  Args:
    old: the old dotted module path.
    new: the dotted path of the private module behind it now.

  Raises:
    AttributeError: for a name the new module does not have (as a plain module would).
  """

  def __init__(self, old: str, new: str):
    super().__init__(old, f"Moved to :mod:`{new}`; this alias warns on use.")
    self.__moved_to__ = new

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    new = self.__moved_to__
    value = getattr(importlib.import_module(new), name)
    warnings.warn(f"{self.__name__} is not a public module any more (moved to {new}): use {public_path(name, new)} "
                  f"(the old path is removed in jaxckpt {REMOVED_IN})", DeprecationWarning, stacklevel=2)
    return value


def install_moved_modules() -> None:
  """Puts a :class:`MovedModule` in ``sys.modules`` for every old path of :data:`MOVED_MODULES` (the package face
  calls it once, after every real module is imported)."""
  for old, new in MOVED_MODULES.items():
    sys.modules.setdefault(old, MovedModule(old, new))


def forward_names(face: str, moved: Mapping[str, tuple[str, str]]) -> Callable[[str], object]:
  """A module ``__getattr__`` for a face whose names moved: ``moved[name] = (module, new name)``.

  Args:
    face: the face's dotted name (for messages), e.g. ``"jaxckpt"``.
    moved: old name -> ``(module that holds it now, its name there)``; the module may be private (an internal name).

  Returns:
    ``__getattr__(name)``: the moved value, with a ``DeprecationWarning`` naming its public path; an old module path
    of :data:`MOVED_MODULES` under ``face`` (``jaxckpt.nnx.layers``) gives its :class:`MovedModule`.

  Raises:
    AttributeError: (from the returned function) for a name neither on the face nor in ``moved``.
  """

  def __getattr__(name: str):
    old_module = f"{face}.{name}"
    if old_module in MOVED_MODULES:  # an old module path read as an attribute: ``jaxckpt.nnx.layers.Stack``
      return sys.modules.setdefault(old_module, MovedModule(old_module, MOVED_MODULES[old_module]))
    if name not in moved:
      raise AttributeError(f"module {face!r} has no attribute {name!r}")
    module, new_name = moved[name]
    value = getattr(importlib.import_module(module), new_name)
    where = (f"{module}.{new_name}" if not module.rpartition(".")[2].startswith("_")
             else public_path(new_name, module))
    warnings.warn(f"{face}.{name} moved: use {where} (the old name is removed in jaxckpt {REMOVED_IN})",
                  DeprecationWarning, stacklevel=2)
    return value

  return __getattr__
