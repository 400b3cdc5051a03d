"""The JAX internals jaxckpt reads, in one place, each checked against the installed JAX when first used.

JAX has no public API for five things jaxckpt needs: the saved-residual analysis behind
``jax.ad_checkpoint.print_saved_residuals`` (:mod:`jaxckpt.analysis._residuals`), dead-code elimination of a jaxpr
(:func:`jaxckpt.analysis._flops.count_live_flops`), source lines of equations (:mod:`jaxckpt.core._tagging`), a
per-compile switch for the persistent compilation cache (:mod:`jaxckpt.step._compile`), whether JAX's backends
and its CUDA plugin's compile-only topology are set up (:mod:`jaxckpt.sharding._topology`), and what a compile hands
the compiler (the module and ``CompileOptions``: compiled in another process, :mod:`jaxckpt.step._isolated`, and keyed
by the compiled-stats cache, :mod:`jaxckpt.step._stats_cache`). Every ``jax._src`` import of
jaxckpt is here; a JAX release that moves one gives a one-line error naming it and the installed version, not an
``ImportError`` deep in a trace. Tested with the versions in ``pyproject.toml``.
"""

from __future__ import annotations

import glob
import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np



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


_KEY_FREE_DEBUG_OPTIONS = {"xla_dump_to": "", "xla_dump_hlo_module_re": "", "xla_dump_hlo_pass_re": "",
                           "xla_dump_hlo_pipeline_re": "", "xla_gpu_cuda_data_dir": "",
                           "xla_force_host_platform_device_count": 0}
"""Debug options that change no compiled program (where XLA writes dumps, where CUDA lives, the host platform's device
count), cleared before :func:`compile_request`'s options are hashed; every other ``xla_dump_*`` switch is cleared too.
JAX's own persistent-cache key clears the same (``jax._src.cache_key._hash_serialized_compile_options``)."""


def compile_request(lowered: Any, options: Mapping[str, Any], *, for_key: bool = False) -> tuple[bytes, bytes]:
  """What ``lowered.compile(compiler_options=options)`` hands the compiler: ``(module, compile_options)``, the
  StableHLO module as MLIR bytecode and XLA's ``CompileOptions`` serialized, built as JAX builds them
  (``jax._src.interpreters.pxla._cached_compilation``): the executable build options from JAX's configuration, the
  debug options from ``XLA_FLAGS`` (as XLA parsed them at start-up), the device assignment, ``options`` as overrides.

  Args:
    lowered: a ``jax.stages.Lowered`` of a ``jax.jit`` over a mesh.
    options: the per-compile XLA options.
    for_key: the form to hash (:mod:`jaxckpt.step._stats_cache`): no module (``b""``; the caller hashes the text),
      no overrides (the caller hashes ``options`` sorted: a proto map serializes in no fixed order) and the debug
      options that change no program cleared (:data:`_KEY_FREE_DEBUG_OPTIONS`).

  Raises:
    RuntimeError: the installed JAX lacks a piece of it.
  """
  need = "compiling in a worker process and keying the compiled-stats cache"
  pxla = internal("interpreters.pxla", needed_by=need)
  computation = lowered._lowering  # noqa: SLF001 - a MeshComputation
  args, devices = computation.compile_args, computation._device_list  # noqa: SLF001
  ins = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["in_shardings"])
  outs = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["out_shardings"])
  to_inputs, to_outputs = pxla.get_prop_to_input_output(ins, outs, len(args["ordered_effects"]))
  overrides = {} if for_key else dict((*computation._compiler_options_kvs, *options.items()))  # noqa: SLF001
  hlo = computation._hlo  # noqa: SLF001
  compile_options = pxla.create_compile_options(hlo, args["tuple_args"], to_inputs, to_outputs, args["backend"],
                                                np.array(list(devices), dtype=object), overrides)
  if for_key:
    debug = compile_options.executable_build_options.debug_options
    for name in dir(debug):
      if name.startswith("xla_dump") and isinstance(getattr(debug, name), bool):
        setattr(debug, name, False)
    for name, value in _KEY_FREE_DEBUG_OPTIONS.items():
      if hasattr(debug, name):
        setattr(debug, name, value)
    return b"", compile_options.SerializeAsString()
  mlir = internal("interpreters.mlir", needed_by=need)
  return mlir.module_to_bytecode(hlo), compile_options.SerializeAsString()


def compile_serialized(module: bytes, compile_options: bytes, devices: Sequence[Any]) -> Any:
  """Compiles a :func:`compile_request` for ``devices`` (a topology's compile-only devices, in the request's device
  order), as JAX's ``jax._src.compiler.backend_compile_and_load`` does; returns XLA's executable (its
  ``get_compiled_memory_stats()``, ``cost_analysis()``, ``hlo_modules()``).

  Raises:
    Whatever the compiler raises (``JaxRuntimeError``: a program over the chip's memory...); RuntimeError: the
    installed JAX lacks a piece of it.
  """
  need = "compiling in a worker process"
  compiler = internal("compiler", needed_by=need)
  mlir = internal("interpreters.mlir", needed_by=need)
  client = internal("lib", "xla_client", needed_by=need)
  with mlir.make_ir_context():
    parsed = mlir.ir.Module.parse(module)
    return compiler.backend_compile_and_load(devices[0].client, parsed, client.DeviceList(tuple(devices)),
                                             client.CompileOptions.ParseFromString(compile_options), [])


def topology_fingerprint(devices: Sequence[Any]) -> str:
  """XLA's fingerprint of the topology ``devices`` span (its chips, their coordinates and links; what JAX's
  persistent-cache key hashes as the accelerator config), or, where the backend has none, their ids, kinds and
  coordinates as text."""
  client = internal("lib", "xla_client", needed_by="keying the compiled-stats cache")
  try:
    return str(client.get_topology_for_devices(list(devices)).fingerprint())
  except Exception:  # noqa: BLE001 - backends without a serializable topology (JaxRuntimeError)
    return ";".join(f"{d.id}:{d.device_kind}:{getattr(d, 'coords', '')}" for d in devices)


def distributed_client() -> Any:
  """The ``jax.distributed`` client of this process (its key-value store: ``key_value_set``, ``key_value_dir_get``),
  ``jax._src.distributed.global_state.client``.

  Raises:
    RuntimeError: the installed JAX lacks it, or ``jax.distributed.initialize`` has not run.
  """
  client = internal("distributed", "global_state", needed_by="watching the processes of a run").client
  if client is None:
    raise RuntimeError("jax.distributed.initialize has not run in this process")
  return client
