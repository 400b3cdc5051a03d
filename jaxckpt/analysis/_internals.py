"""The JAX internals jaxckpt reads, in one place, each checked against the installed JAX when first used.

JAX has no public API for five things jaxckpt needs: the saved-residual analysis behind
``jax.ad_checkpoint.print_saved_residuals`` (:mod:`jaxckpt.analysis._residuals`), dead-code elimination of a jaxpr
(:func:`jaxckpt.analysis._flops.count_live_flops`), source lines of equations (:mod:`jaxckpt.core._tagging`), a
per-compile switch for the persistent compilation cache (:mod:`jaxckpt.step._compile`), and whether JAX's backends
and its CUDA plugin's compile-only topology are set up (:mod:`jaxckpt.sharding._topology`). Every ``jax._src`` import of
jaxckpt is here; a JAX release that moves one gives a one-line error naming it and the installed version, not an
``ImportError`` deep in a trace. Tested with the versions in ``pyproject.toml``.
"""

from __future__ import annotations

import glob
import importlib
import logging
from typing import Any

import jax



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


class _NoCudaWithoutGpu(logging.Filter):
  """Drops JAX's logged traceback of the CUDA plugin failing to start (``Unable to load CUDA``) on a machine with no
  NVIDIA device (no ``/dev/nvidia<N>``): with the ``[gpu]`` extra installed for compiling without a GPU, JAX logs it
  whenever its backends start with CUDA among the platforms, and then runs on the CPU, as a machine without a GPU
  must. Where an NVIDIA device exists the traceback stays: CUDA failing there is a real problem."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not message.startswith("Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda"):
      return True
    error = record.exc_info[1] if record.exc_info else None
    return "Unable to load CUDA" not in str(error) or bool(glob.glob("/dev/nvidia[0-9]*"))


def quiet_cuda_plugin_without_gpu() -> None:
  """Installs :class:`_NoCudaWithoutGpu` on JAX's backend logger (once; :mod:`jaxckpt` does at import)."""
  logger = logging.getLogger("jax._src.xla_bridge")
  if not any(isinstance(f, _NoCudaWithoutGpu) for f in logger.filters):
    logger.addFilter(_NoCudaWithoutGpu())


def cpu_backends_first() -> None:
  """Starts JAX's backends on the CPU alone when nothing has started them and ``jax_platforms`` is unset: a compile
  for a topology's compile-only devices needs no other backend, and with the ``[gpu]`` extra installed JAX's CUDA
  plugin would otherwise log a traceback (``Unable to load CUDA``) when the backends start on a machine without a GPU,
  and libtpu would probe for a TPU. Used before a TPU topology loads (XLA:GPU's: :func:`cuda_compile_only`)."""
  bridge = internal("xla_bridge", needed_by="compiling for a topology without its chips")
  if not bridge.backends_are_initialized() and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")


def cuda_compile_only() -> str | None:
  """Makes JAX's CUDA plugin (XLA:GPU) available for compiling without a GPU, or says why it cannot be.

  The plugin registers itself when JAX discovers its plugins (the first backend or topology asked for), but only
  where it finds CUDA or where ``jax_platforms`` excludes CUDA; on a machine without a GPU that means
  ``jax_platforms="cpu"`` before JAX starts (JAX's own deviceless test does so). This sets it when nothing started
  JAX's backends yet; when they started on the CPU alone (the plugin gave up then), it registers the plugin now with
  the CPU platform chosen (its ``initialize()``, which then skips the CUDA check); any other started platform is left
  alone.

  Returns:
    ``None`` when XLA:GPU's topologies are available (or will be at discovery), else the reason, one line.
  """
  bridge = internal("xla_bridge", needed_by="compiling for a GPU topology without a GPU")
  if "cuda" in getattr(bridge, "_topology_factories", {}):
    return None
  if not bridge.backends_are_initialized():
    if not jax.config.jax_platforms:
      jax.config.update("jax_platforms", "cpu")
    return None
  platforms = {d.platform for d in jax.devices()}
  if platforms != {"cpu"}:
    return (f"JAX's backends started on {', '.join(sorted(platforms))} before the CUDA plugin registered for "
            "compiling without a GPU")
  jax.config.update("jax_platforms", "cpu")  # the backends run already: this only tells the plugin to skip CUDA
  importlib.import_module("jax_plugins.xla_cuda12").initialize()
  return None if "cuda" in bridge._topology_factories else "JAX's CUDA plugin did not register"  # noqa: SLF001
