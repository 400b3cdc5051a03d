"""The JAX internals jaxckpt reads, in one place, each checked against the installed JAX when first used.

JAX has no public API for four things jaxckpt needs: the saved-residual analysis behind
``jax.ad_checkpoint.print_saved_residuals`` (:mod:`jaxckpt.analysis._residuals`), dead-code elimination of a jaxpr
(:func:`jaxckpt.analysis._flops.count_live_flops`), source lines of equations (:mod:`jaxckpt.core._tagging`), and a
per-compile switch for the persistent compilation cache (:mod:`jaxckpt.step._compile`). Every ``jax._src`` import of
jaxckpt is here; a JAX release that moves one gives a one-line error naming it and the installed version, not an
``ImportError`` deep in a trace. Tested with the versions in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax

__all__ = ["internal", "source_info_util", "saved_residuals_parts", "dce_jaxpr", "compilation_cache_switch"]


def internal(module: str, name: str | None = None, *, needed_by: str) -> Any:
  """``jax._src.<module>`` (or its attribute ``name``), or a one-line error saying what needs it.

  Args:
    module: the module under ``jax._src`` (``"ad_checkpoint"``).
    name: an attribute of it, or ``None`` for the module.
    needed_by: what jaxckpt uses it for, for the message.

  Raises:
    RuntimeError: the installed JAX has no such module or attribute.
  """
  where = f"jax._src.{module}" + (f".{name}" if name else "")
  try:
    found = importlib.import_module(f"jax._src.{module}")
    return found if name is None else getattr(found, name)
  except (ImportError, AttributeError) as err:
    raise RuntimeError(f"{where} is not available in jax {jax.__version__}; {needed_by} needs it: install a JAX "
                       "version jaxckpt supports (pyproject.toml)") from err


source_info_util = internal("source_info_util", needed_by="jaxckpt.core._tagging (source lines of values)")
"""``jax._src.source_info_util``: summaries of equations' source lines, and the user context of re-evaluated ones."""


def saved_residuals_parts() -> tuple[Any, Any]:
  """``(jax._src.ad_checkpoint._saved_residuals, jax._src.api_util.debug_info)``: the half of JAX's
  ``saved_residuals`` after its trace, and what names its arguments.

  Raises:
    RuntimeError: the installed JAX lacks either.
  """
  need = "jaxckpt.analysis._residuals (the public jax.ad_checkpoint.print_saved_residuals is built on it)"
  return internal("ad_checkpoint", "_saved_residuals", needed_by=need), internal("api_util", "debug_info",
                                                                                  needed_by=need)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool]) -> tuple[Any, list[bool]]:
  """``jax._src.interpreters.partial_eval.dce_jaxpr``: ``jaxpr`` without the equations no used output needs.

  Raises:
    RuntimeError: the installed JAX lacks it (:func:`jaxckpt.analysis._flops.count_flops` counts dead code too).
  """
  dce = internal("interpreters.partial_eval", "dce_jaxpr", needed_by="count_live_flops (use count_flops instead)")
  return dce(jaxpr, used_outputs)


def compilation_cache_switch(enabled: bool) -> Any:
  """A context manager that turns JAX's persistent compilation cache on or off for the compiles inside it
  (``jax._src.config.enable_compilation_cache``).

  Raises:
    RuntimeError: the installed JAX lacks it.
  """
  return internal("config", "enable_compilation_cache", needed_by="jaxckpt.step._compile (XLA dumps)")(enabled)
