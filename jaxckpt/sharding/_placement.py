"""Where a train step is compiled, resolved once: the mesh, the topology it is laid over (a TPU slice, a GPU cluster,
or this machine), and the memory a device may use there.

A tool's door turns its ``--topology`` / ``--mesh`` / ``--memory-fraction`` flags (or an API call's ``topology=``,
``mesh=``) into one :class:`Placement` with :func:`resolve_placement`; below the door the compile path, the memory
verdict, the time model and the headers read it, and nothing parses a mesh spec again.

Memory a device may use (:meth:`Placement.memory`, :func:`device_memory`):

- **TPU** (a topology's chip): its HBM from the chip table; the TPU compiler itself refuses a program over it.
- **GPU**: the pool XLA's runtime allocates from, ``device memory × memory fraction`` (XLA's ``CreateBFCAllocator``,
  openxla ``xla/pjrt/gpu/gpu_helpers.cc``: the BFC allocator's limit is the device's total memory times the client's
  fraction). The fraction is JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (or ``XLA_CLIENT_MEM_FRACTION``), **0.75** by
  default (JAX docs, "GPU memory allocation"); published GPU recipes run at 0.9–0.975, so the tools take
  ``--memory-fraction``. The CUDA context, cuBLAS/cuDNN handles and NCCL's buffers live *outside* that pool, in the
  rest of the device's memory (a JAX maintainer, jax-ml/jax#17426; 28.6 GiB outside the pool on a GB200 with 704
  processes, marin-community/marin#8490), which is why a fraction near 1 fails at start-up. XLA:GPU compiles any
  program, also one over the pool (it logs a line), so on a GPU the verdict is jaxckpt's: a footprint over
  :meth:`Placement.memory` does not fit.
- **CPU**: the RAM available now (``psutil``).
- A device that reports ``memory_stats()["bytes_limit"]`` (a real GPU or TPU attached): that figure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import psutil
from jax.sharding import Mesh

from jaxckpt._units import format_bytes
from jaxckpt.errors import JaxckptError
from jaxckpt.sharding import _mesh
from jaxckpt.sharding._chips import CHIPS, chip_for_kind
from jaxckpt.sharding._topology import (Topology, compiled_for, compiler_name, compiles_only, get_topology,
                                        topology_header)

DEFAULT_MEMORY_FRACTION = 0.75
"""JAX's default share of a GPU's memory for XLA's allocator (``XLA_PYTHON_CLIENT_MEM_FRACTION`` unset; JAX docs,
"GPU memory allocation"; 0.9 before jax 0.4.14, jax-ml/jax#16724)."""

MEMORY_FRACTION_ENV: tuple[str, ...] = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
"""The environment variables JAX reads the fraction from, the first set wins (``jaxlib/xla_client.py``,
``generate_pjrt_gpu_plugin_options``: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is the older name)."""


class MemoryFraction(NamedTuple):
  """A GPU's share of memory for XLA's allocator and where it came from (:func:`memory_fraction`)."""

  value: float  # in (0, 1]
  source: str  # "given", "JAX's default", or the environment variable it was read from


def memory_fraction(value: float | MemoryFraction | None = None, *,
                    environ: Mapping[str, str] | None = None) -> MemoryFraction:
  """The share of a GPU's memory XLA may allocate, and where it came from.

  Args:
    value: the fraction given (``--memory-fraction``), in (0, 1]; ``None``: the environment's
      (:data:`MEMORY_FRACTION_ENV`), else JAX's default :data:`DEFAULT_MEMORY_FRACTION`; a :class:`MemoryFraction`
      already read is returned as it is.
    environ: the environment (default ``os.environ``).

  Returns:
    The :class:`MemoryFraction`, e.g. ``MemoryFraction(0.75, "JAX's default")``.

  Raises:
    JaxckptError: a fraction outside (0, 1], or an environment value that is not a number (naming the variable).
  """
  if isinstance(value, MemoryFraction):
    return value
  return _read_fraction(value, os.environ if environ is None else environ)


def _read_fraction(value: float | None, env: Mapping[str, str]) -> MemoryFraction:
  """The one reader of a memory fraction (:func:`memory_fraction`): the value given, else the environment's."""
  if value is not None:
    source = "given"
  else:
    name = next((n for n in MEMORY_FRACTION_ENV if env.get(n)), None)
    if name is None:
      return MemoryFraction(DEFAULT_MEMORY_FRACTION, "JAX's default")
    try:
      value = float(env[name])
    except ValueError:
      raise JaxckptError(f"{name}={env[name]!r} is not a number: give the share of GPU memory XLA may use, in "
                         f"(0, 1], e.g. 0.9") from None
    source = name
  if isinstance(value, bool) or not 0 < value <= 1:
    given = f"memory_fraction={value!r}" if source == "given" else f"{source}={value!r} (in the environment)"
    raise JaxckptError(f"{given} must be in (0, 1]: the share of GPU memory XLA may use (JAX's "
                       f"default {DEFAULT_MEMORY_FRACTION}; published GPU recipes 0.9–0.975)")
  return MemoryFraction(float(value), source)


def device_memory(device: Any = None, *, fraction: float | MemoryFraction | None = None) -> tuple[int, str]:
  """The memory a device may use, in bytes, and where the figure comes from (module docstring).

  Args:
    device: a JAX device (a topology's compile-only chip or GPU, or an attached one); default ``jax.devices()[0]``.
    fraction: a GPU's memory fraction (a number, or :func:`memory_fraction`'s record; ``None``: the
      environment's or JAX's default).

  Returns:
    ``(bytes, source)``: a device's ``bytes_limit`` where it reports one; a TPU chip's HBM; a GPU's memory ×
    fraction (``"NVIDIA H100 SXM memory 79.14 GiB × 0.75 (JAX's default)"``); a CPU's available RAM.

  Raises:
    JaxckptError: a device that reports no memory and whose chip the table does not know; a bad fraction.
  """
  device = jax.devices()[0] if device is None else device
  if device.platform == "cpu":
    return int(psutil.virtual_memory().available), "available RAM"
  try:
    stats = device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - compile-only devices raise ("only supported for addressable PjRt devices")
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind} bytes_limit"
  chip = chip_for_kind(device.device_kind)
  if chip is None:
    raise JaxckptError(f"device {device.device_kind!r} reports no memory and is not in the chip table "
                       f"({', '.join(CHIPS)}): give the memory as a size")
  if not chip.is_gpu:
    return chip.memory_bytes, f"{chip.name} HBM"
  share = fraction if isinstance(fraction, MemoryFraction) else memory_fraction(fraction)
  return int(chip.memory_bytes * share.value), (f"{chip.name} memory {format_bytes(chip.memory_bytes)} × "
                                                f"{share.value:g} memory fraction ({share.source})")


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a train step is compiled: a mesh (or one device), the topology it is laid over, and a GPU's memory
  fraction; the tools resolve it once (:func:`resolve_placement`).

  Attributes:
    mesh: the ``jax.sharding.Mesh`` the step is sharded over; ``None``: one device of this machine, unsharded.
    topology: the TPU slice or GPU cluster the mesh is over (compiled for without its hardware), or ``None``.
    fraction: a GPU's memory fraction (:func:`memory_fraction`); ``None`` where the platform has none.
    mesh_given: whether the caller gave the mesh (``False``: a topology's default, every chip on ``data``, which the
      header says with the flag that shapes it).
  """

  mesh: Mesh | None = None
  topology: Topology | None = None
  fraction: MemoryFraction | None = None
  mesh_given: bool = True

  @property
  def device(self) -> Any:
    """The first device compiled for (every device of a mesh is alike): the mesh's, else the topology's, else this
    machine's first."""
    if self.mesh is not None:
      return next(iter(self.mesh.devices.flat))
    return self.topology.devices[0] if self.topology is not None else jax.devices()[0]

  @property
  def platform(self) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform compiled for."""
    return self.device.platform

  @property
  def device_kind(self) -> str:
    """JAX's ``device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    return self.device.device_kind

  @property
  def device_count(self) -> int:
    """Devices compiled for: the mesh's, 1 without one."""
    return 1 if self.mesh is None else int(self.mesh.devices.size)

  def header(self) -> str | None:
    """What a tool prints above its tables about a topology compile (:func:`jaxckpt.sharding.topology_header`),
    the memory a device may use included on a GPU; ``None`` on this machine."""
    if self.topology is None or self.mesh is None:
      return None
    line = topology_header(self.topology, self.shape, mesh_given=self.mesh_given)
    if self.platform == "gpu":
      limit, source = self.memory()
      line += f"; XLA may use {format_bytes(limit)} per GPU ({source})"
    return line

  @property
  def shape(self) -> dict[str, int]:
    """``{axis: size}`` of the mesh (:func:`jaxckpt.sharding.mesh_shape`), ``{}`` without one."""
    return {} if self.mesh is None else _mesh.mesh_shape(self.mesh)

  @property
  def compiler(self) -> str:
    """The compiler (:func:`jaxckpt.sharding.compiler_name`), e.g. ``"XLA:GPU (jax-cuda12-plugin 0.10.2)"``."""
    return compiler_name(self.platform)

  @property
  def compiles_only(self) -> bool:
    """Whether nothing can run here (a topology's compile-only devices)."""
    return compiles_only(self.mesh)

  @property
  def chip(self):
    """The chip table's row of the devices (:class:`~jaxckpt.sharding.Chip`), or ``None`` (a CPU)."""
    return self.topology.chip if self.topology is not None else chip_for_kind(self.device_kind)

  def memory(self) -> tuple[int, str]:
    """The bytes a device may use here, and their source (:func:`device_memory`)."""
    return device_memory(self.device, fraction=self.fraction)

  def links(self) -> dict[str, str]:
    """``{axis: "ici" | "nvlink" | "network"}``: the links each mesh axis's collectives cross (a topology's
    :meth:`~jaxckpt.sharding.Topology.axis_links`); ``{}`` on this machine."""
    return {} if self.topology is None or self.mesh is None else self.topology.axis_links(self.mesh)

  def with_mesh(self, mesh: str | Mapping[str, int] | Mesh) -> Placement:
    """The same topology and fraction under another mesh (the fit's mesh search), a chosen one (``mesh_given``)."""
    laid = self.topology.mesh(mesh) if self.topology is not None else _concrete_mesh(mesh)
    return dataclasses.replace(self, mesh=laid, mesh_given=True)

  def check_batch_size(self, batch_size: int, *, flag: str = "batch_size") -> None:
    """Raises :class:`~jaxckpt.errors.MeshSpecError` unless ``batch_size`` splits over the mesh's batch axes."""
    if self.mesh is not None:
      _mesh.check_batch_size(batch_size, self.mesh, flag=flag)

  def compiled_for(self) -> dict[str, Any]:
    """What compiled the numbers, for a tool's JSON (:func:`jaxckpt.sharding.compiled_for`)."""
    return compiled_for(self.mesh, self.topology)


def _concrete_mesh(mesh: str | Mapping[str, int] | Mesh) -> Mesh:
  return mesh if isinstance(mesh, Mesh) else _mesh.make_mesh(mesh)


_memory_fraction = memory_fraction  # resolve_placement's parameter of that name hides the function


def resolve_placement(mesh: str | Mapping[str, int] | Mesh | Placement | None = None,
                      topology: str | Topology | None = None, *,
                      memory_fraction: float | MemoryFraction | None = None) -> Placement:
  """A tool's placement, resolved once from what its caller gave.

  Args:
    mesh: a ``--mesh`` spec (``"data=4,fsdp=2"``), ``{axis: size}``, a ``jax.sharding.Mesh``, ``None`` (a topology:
      every chip on ``data``; else one device, unsharded), or a :class:`Placement` (returned as it is).
    topology: a TPU slice or GPU cluster (``"v5e:2x2"``, ``"h100:32x8"``) to compile for without its hardware, or
      ``None`` (this machine's devices).
    memory_fraction: a GPU's share of memory XLA may use (a number, or :func:`memory_fraction`'s record).

  Returns:
    The :class:`Placement`.

  Raises:
    TopologyError: a bad topology, its compiler missing (:func:`jaxckpt.sharding.get_topology`).
    MeshSpecError: a bad mesh, or one that does not cover the devices.
    JaxckptError: a bad memory fraction, or one given where no GPU is compiled for.
  """
  if isinstance(mesh, Placement):
    return mesh
  topo = None if topology is None else get_topology(topology)
  laid = topo.mesh(mesh) if topo is not None else None if mesh is None else _concrete_mesh(mesh)
  placement = Placement(laid, topo, mesh_given=mesh is not None)
  fraction = memory_fraction if isinstance(memory_fraction, MemoryFraction) else None
  if placement.platform == "gpu":
    return dataclasses.replace(placement, fraction=fraction or _memory_fraction(memory_fraction))
  if memory_fraction is not None:
    fraction or _memory_fraction(memory_fraction)  # a bad value is named as such first
    raise JaxckptError(f"memory_fraction={memory_fraction!r} is a GPU's share of memory for XLA, but the step is "
                       f"compiled for {placement.device_kind!r}: give a GPU topology (e.g. topology='h100:8') or drop "
                       "it")
  return placement

