"""The key names of every memory record jaxckpt writes, in one place.

The classifier's ``metrics.json`` and the report's rows use these keys, so their files can be compared and joined.
All byte counts are ints (bytes); a statistic the backend does not give is ``None`` (JSON ``null``), never 0.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SCHEMA_VERSION", "MEMORY_FIELDS", "MEMORY_KEYS", "FOOTPRINT", "HOST_FOOTPRINT", "footprint_bytes",
           "host_footprint_bytes", "METRICS_KEYS",
           "PLACEMENT_KEYS", "AUX_TASK_KEYS"]

SCHEMA_VERSION = 1
"""Version of the key set below; bumped when a key changes meaning or is removed."""

MEMORY_FIELDS: dict[str, str] = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "peak_memory_bytes": "peak_memory_in_bytes",
    "host_argument_bytes": "host_argument_size_in_bytes",
    "host_output_bytes": "host_output_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
    "host_alias_bytes": "host_alias_size_in_bytes",
    "host_generated_code_bytes": "host_generated_code_size_in_bytes",
}
"""Schema key -> attribute of XLA's ``CompiledMemoryStats`` (``compiled.memory_analysis()``). ``peak_memory_bytes``
is ``None`` on backends whose field is not a peak (CPU; see :data:`jaxckpt.training._xla.PEAK_BACKENDS`)."""

FOOTPRINT = "footprint_bytes"
"""argument + output + temp − alias bytes: the one definition of a compiled step's device footprint."""

HOST_FOOTPRINT = "host_footprint_bytes"
"""host argument + output + temp − alias bytes: what a step keeps in host memory (``pinned_host``), e.g. the residuals
an offload policy moves there; per device under a mesh."""

MEMORY_KEYS: tuple[str, ...] = (*MEMORY_FIELDS, FOOTPRINT, HOST_FOOTPRINT)
"""Every key of a memory record, in display order."""


def footprint_bytes(memory: Mapping[str, int | None]) -> int | None:
  """Returns argument + output + temp − alias bytes of a memory record, or ``None`` if any of them is missing.

  Args:
    memory: a record with the keys of :data:`MEMORY_FIELDS` (bytes, ints or ``None``).
  """
  parts = [memory.get(k) for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")]
  if any(p is None for p in parts):
    return None
  argument, output, temp, alias = parts
  return argument + output + temp - alias


def host_footprint_bytes(memory: Mapping[str, int | None]) -> int | None:
  """Returns host argument + output + temp − alias bytes of a memory record, or ``None`` if any of them is missing.

  Args:
    memory: a record with the keys of :data:`MEMORY_FIELDS` (bytes, ints or ``None``).
  """
  parts = [memory.get(f"host_{k}") for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")]
  if any(p is None for p in parts):
    return None
  argument, output, temp, alias = parts
  return argument + output + temp - alias


METRICS_KEYS: tuple[str, ...] = (
    "schema_version",
    "policy",
    "model",
    "preset",
    "scan",
    "compute_dtype",
    "test_accuracy",
    "train_loss",
    "step_time_s",
    "memory",
    "backend",
    "compiler_options",
    "versions",
    "warnings",
)
"""Keys every experiment's ``metrics.json`` has (experiments add their own after these)."""

PLACEMENT_KEYS: tuple[str, ...] = ("mesh", "device_count", "process_count", "collectives")
"""Where a run ran (every experiment's ``metrics.json``): ``mesh`` = ``{axis: size}`` or ``null`` (one device,
unsharded), ``device_count`` = devices used, ``process_count`` = JAX processes, ``collectives`` = what the compiled
step sends per device, by kind and mesh axes (``jaxckpt.analysis.CollectiveUse.as_dict()`` records; ``null`` on one
device). Under a mesh, ``memory`` is per device."""

AUX_TASK_KEYS: tuple[str, ...] = ("aux_task", "aux_weight", "test_aux_accuracy")
"""The classifier's multi-task keys: the auxiliary task's name, its loss weight λ and its test accuracy (0–1); all
``null`` for a single-task run. With an auxiliary task ``train_loss``/``test_loss`` are the total loss
``CE_main + λ·CE_aux`` and ``test_accuracy`` is the main head's."""


def versions() -> dict[str, str]:
  """Versions of the packages that decide compiled memory: jax, jaxlib, flax, optax, orbax-checkpoint, python."""
  import platform
  from importlib import metadata

  found = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
    try:
      found[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
      found[package] = None
  return found
