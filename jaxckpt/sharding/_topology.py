"""Compiling for a TPU without a TPU: topologies by name, meshes over their chips, and the chips' facts.

JAX compiles for a TPU slice that is not attached (ahead-of-time, "deviceless" compilation):
``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`` describes the slice's chips
as compile-only devices, and a train step whose ``jax.ShapeDtypeStruct`` arguments carry ``NamedSharding`` s on a mesh
over them is compiled by the TPU compiler of the ``libtpu`` package, here, on a CPU. Its ``memory_analysis()`` is the
per-chip buffer assignment a TPU would run, ``cost_analysis()`` its FLOPs and bytes. Nothing is allocated and
nothing can run (the devices have no memory here). MaxText's ``train_compile.py`` does the same to tell before a run
whether a config fits a slice.

Every tool takes the mesh of :meth:`Topology.mesh` through its ``mesh=`` path (the step core shards the step over
it, :mod:`jaxckpt.sharding`), and decides its compiler options by the mesh's platform: the XLA:CPU options
(:data:`jaxckpt.training._xla.CPU_REMAT_FIX`, the stats-only level) are never given to the TPU compiler, which refuses
the first (``HLO opt-barrier is not implemented on TPU``, measured with libtpu 0.0.42.1).

Names (:data:`TOPOLOGY_FORMS`): ``<chip>:<torus>`` as JAX and Cloud TPU write them, ``v5e:2x2`` or ``v6e:4x4`` (the
2-D torus of v5e and v6e chips), ``v4:2x2x1`` or ``v5p:2x2x2`` (3-D). One device per chip: v4 and v5p are compiled as
megacore chips (both TensorCores one device, chip config ``megacore``, as MaxText does); without it libtpu would
describe a v4 chip as two devices.

``libtpu`` must be the release jax's own ``tpu`` extra pins (jax 0.10.2: ``libtpu==0.0.42.*``); jaxckpt's ``tpu``
extra installs it (``pip install -e ".[tpu]"``). :func:`check_libtpu` says in one line what to install, or which
versions clash.

Start-up: loading libtpu on a machine without a TPU prints warnings about the environment variables
``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES``; :func:`get_topology` sets both, where unset, before libtpu
starts (the topology's Cloud accelerator type and ``localhost``), which silences them. The compiled program does not
depend on them (measured: the same stats under another accelerator type). libtpu also takes a lock
(``/tmp/libtpu_lockfile``) so that one process at a time owns the TPU: a second process loading it, e.g. the other
pytest worker or a second ``--topology`` CLI, would fail ("Internal error when accessing libtpu multi-process
lockfile"); compiling owns no TPU, so :func:`get_topology` also sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` where
unset. With libtpu installed, every JAX process also probes for a TPU when its backend starts (measured on 2 CPU
cores: +0.1 s and the same warnings per process); on a machine without one, ``JAX_PLATFORMS=cpu`` skips the probe,
and topologies still load (libtpu is loaded on demand).

Memory: the TPU compiler's ``temp_size_in_bytes`` leaves out temporaries its peak holds, so on TPU jaxckpt's
``temp_bytes`` and footprint come from the peak (:data:`jaxckpt.training._xla.PEAK_TEMP_BACKENDS`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import jax
from jax.experimental import mesh_utils, topologies
from jax.sharding import Mesh
from packaging.requirements import Requirement

from jaxckpt.errors import MeshSpecError, TopologyError, closest, shorten
from jaxckpt.sharding import _mesh as sharding
from jaxckpt.sharding._chips import CHIPS, Chip

TOPOLOGY_FORMS = ("<chip>:<torus>, e.g. v5e:2x2, v5e:4x4, v6e:2x2 (2-D: v5e, v6e) or v4:2x2x1, v5p:2x2x1 (3-D: v4, "
                  "v5p)")
"""The accepted topology names, in one line (the error of a bad name quotes it)."""

_NAME = re.compile(r"\s*([A-Za-z0-9]+)\s*:\s*([0-9]+(?:\s*x\s*[0-9]+)*)\s*\Z")
_HOST_BOUNDS = (2, 2, 1)
"""libtpu's default chips per host (a 2x2 board); a smaller topology (``v5e:1x1``) needs its own bounds."""


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
  """Parses a topology name: ``"v5e:2x2"`` → ``("v5e", (2, 2))``.

  Args:
    name: ``<chip>:<torus>`` (:data:`TOPOLOGY_FORMS`): a TPU chip key of :data:`CHIPS` and one size ≥ 1 per torus
      dimension (2 for v5e/v6e, 3 for v4/v5p).

  Returns:
    ``(chip key, sizes)``.

  Raises:
    TopologyError: one line naming the bad part and the accepted forms (and the closest chip name).
  """
  tpus = [key for key, chip in CHIPS.items() if chip.torus]
  match = _NAME.match(str(name))
  if match is None:
    raise TopologyError(f"bad topology {shorten(str(name))!r}: write {TOPOLOGY_FORMS}")
  key, sizes = match.group(1).lower(), tuple(int(s) for s in re.split(r"\s*x\s*", match.group(2)))
  if key not in tpus:
    hint = closest(key, tpus)
    raise TopologyError(f"unknown TPU chip {key!r} in topology {shorten(str(name))!r}; valid chips: {', '.join(tpus)}"
                        + (f"; did you mean {hint!r}?" if hint else "") + f" (write {TOPOLOGY_FORMS})")
  torus = CHIPS[key].torus
  if len(sizes) != torus or min(sizes) < 1:
    example = "x".join(["2"] * 2 + ["1"] * (torus - 2))
    raise TopologyError(f"bad topology {shorten(str(name))!r}: a {key} slice is a {torus}-D torus, write {torus} "
                        f"sizes ≥ 1 (e.g. {key}:{example})")
  return key, sizes


def libtpu_version() -> str | None:
  """The installed ``libtpu`` package's version, or ``None`` when it is not installed."""
  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None


def required_libtpu() -> str | None:
  """The ``libtpu`` requirement of the installed jax's ``tpu`` extra (jax 0.10.2: ``"libtpu==0.0.42.*"``), the
  release whose TPU compiler fits the installed jaxlib; ``None`` if jax's metadata names none."""
  try:
    requirements = metadata.requires("jax") or []
  except metadata.PackageNotFoundError:
    return None
  for text in requirements:
    requirement = Requirement(text)
    if requirement.name == "libtpu":
      return f"libtpu{requirement.specifier}"
  return None


def check_libtpu() -> str:
  """Checks that a ``libtpu`` fitting the installed jaxlib is installed; returns its version.

  Raises:
    TopologyError: libtpu is not installed (the line says what to install), or its version is not the one the
      installed jax's ``tpu`` extra pins (the line names both versions).
  """
  found, wanted = libtpu_version(), required_libtpu()
  jaxlib = metadata.version("jaxlib")
  if found is None:
    raise TopologyError(f"compiling for a TPU topology needs the TPU compiler of the libtpu package, which is not "
                        f"installed: pip install -e \".[tpu]\" (or pip install '{wanted or 'libtpu'}', the release "
                        f"that fits jaxlib {jaxlib})")
  if wanted is not None and not Requirement(wanted).specifier.contains(found, prereleases=True):
    raise TopologyError(f"libtpu {found} does not fit jaxlib {jaxlib}, whose TPU compiler is {wanted}: "
                        f"pip install '{wanted}' (or the jax release that pins libtpu {found})")
  return found


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice to compile for, without a TPU: its chips as compile-only JAX devices.

  Attributes:
    name: the canonical name (``"v5e:2x2"``).
    chip_key: its chip's key in :data:`CHIPS` (``"v5e"``).
    shape: chips per torus dimension (``(2, 2)``).
    devices: the compile-only devices, one per chip (``device_kind`` e.g. ``"TPU v5 lite"``, platform ``tpu``).
  """

  name: str
  chip_key: str
  shape: tuple[int, ...]
  devices: tuple[Any, ...]

  @property
  def chip(self) -> Chip:
    """The chip's facts (:data:`CHIPS`)."""
    return CHIPS[self.chip_key]

  @property
  def platform(self) -> str:
    """``"tpu"``."""
    return self.devices[0].platform

  @property
  def device_kind(self) -> str:
    """JAX's ``device_kind`` of the chips (``"TPU v5 lite"``)."""
    return self.devices[0].device_kind

  @property
  def chips(self) -> int:
    """How many chips (devices) the slice has."""
    return len(self.devices)

  def describe(self) -> str:
    """``"TPU v5e 2x2 (4 chips), compiled without a TPU"``: what the tools' headers say."""
    chips = f"{self.chips} chip" + ("s" if self.chips != 1 else "")
    return f"{self.chip.name} {'x'.join(map(str, self.shape))} ({chips}), compiled without a TPU"

  def as_json(self) -> dict[str, Any]:
    """``{"topology", "backend", "device_kind", "chips"}``: what every JSON record of a topology compile says."""
    return {"topology": self.name, "backend": self.platform, "device_kind": self.device_kind, "chips": self.chips}

  def mesh(self, spec: str | Mapping[str, int] | Mesh | None = None) -> Mesh:
    """A mesh over this slice's chips: ``spec`` (``--mesh``, e.g. ``"data=2,fsdp=2"``) laid over them, or all chips
    as the ``data`` axis when ``None``.

    Args:
      spec: a ``--mesh`` spec (:func:`jaxckpt.sharding.parse_mesh`), ``None``, or a mesh already over these
        chips (returned as it is).

    Returns:
      The ``jax.sharding.Mesh`` (``jax.make_mesh`` orders the chips by the torus).

    Raises:
      MeshSpecError: a bad spec, a mesh whose sizes do not multiply to the chip count (one line naming both), a
        ``Mesh`` over other devices, or axis sizes that cannot be laid over the torus even splitting its dimensions
        (an axis of 8 on 16x16 is laid by splitting one, as MaxText's ``allow_split_physical_axes``).
    """
    if isinstance(spec, Mesh):
      if set(spec.devices.flat) != set(self.devices):
        raise MeshSpecError(f"mesh {sharding.format_mesh(spec)!r} is not over the chips of topology {self.name}; "
                            f"give its shape as a string (mesh='data={self.chips}')")
      return spec
    shape = {"data": self.chips} if spec is None else sharding.parse_mesh(spec, device_count=0)
    text = sharding.format_mesh(shape)
    if math.prod(shape.values()) != self.chips:
      raise MeshSpecError(f"mesh={text!r} covers {math.prod(shape.values())} device(s) but topology {self.name} has "
                          f"{self.chips} chips: the product of the sizes must be {self.chips} "
                          f"(mesh='data={self.chips}' fits)")
    try:
      return sharding.make_mesh(shape, devices=self.devices)
    except NotImplementedError:  # an axis that is no product of whole torus dimensions (8 on 16x16)
      pass
    # as MaxText's allow_split_physical_axes: lay the axes over the torus splitting a physical dimension (per-chip
    # memory does not depend on the layout; a split axis's collectives run on part of a ring)
    try:
      grid = mesh_utils.create_device_mesh(tuple(shape.values()), devices=list(self.devices),
                                           allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError) as err:
      raise MeshSpecError(f"mesh={text!r} cannot be laid over topology {self.name}'s torus "
                          f"{'x'.join(map(str, self.shape))}, even splitting its dimensions "
                          f"({str(err).split('.')[0]})") from None
    return Mesh(grid, tuple(shape), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


_COMPILE_ONLY: set[Any] = set()
"""Every compile-only device of the topologies loaded in this process (:func:`compiles_only`)."""


def compiles_only(devices: Mesh | Iterable[Any] | None) -> bool:
  """Whether a mesh (or devices) is over a topology's compile-only devices (:func:`get_topology`): nothing can run
  on them, and JAX's persistent compilation cache writes their executables but cannot load them back ("PjRtCompiler
  must be constructed with a Client to call DeserializeLoadedExecutable", jax 0.10.2), so compiles for them bypass
  it."""
  if devices is None:
    return False
  return any(d in _COMPILE_ONLY for d in (devices.devices.flat if isinstance(devices, Mesh) else devices))


def _accelerator_type(chip: Chip, chips: int) -> str:
  return f"{chip.accelerator_type}-{chips * chip.cores}"


@functools.lru_cache(maxsize=None)
def _load(key: str, sizes: tuple[int, ...]) -> Topology:
  chip = CHIPS[key]
  name = f"{key}:{'x'.join(map(str, sizes))}"
  full = (*sizes, *([1] * (3 - len(sizes))))
  bounds = tuple(min(s, h) for s, h in zip(full, _HOST_BOUNDS))
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(chip, math.prod(sizes)))
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no TPU to own, so no libtpu lockfile
  try:
    described = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name=chip.chip_config,
                                             chips_per_host_bounds=bounds)
  except Exception as err:  # noqa: BLE001 - libtpu raises JaxRuntimeError / RuntimeError with its reason
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise TopologyError(f"the TPU compiler refuses topology {name!r}: {reason} (write {TOPOLOGY_FORMS})") from None
  _COMPILE_ONLY.update(described.devices)
  return Topology(name, key, sizes, tuple(described.devices))


def get_topology(topology: str | Topology) -> Topology:
  """The :class:`Topology` of a name (loaded once per process), or ``topology`` itself.

  Args:
    topology: ``"v5e:2x2"`` (:data:`TOPOLOGY_FORMS`) or a :class:`Topology`.

  Returns:
    The topology, its chips as compile-only devices.

  Raises:
    TopologyError: a bad name (:func:`parse_topology`), libtpu missing or of the wrong release (:func:`check_libtpu`),
      or a topology the TPU compiler refuses (its reason, one line).

  Example::

    >>> topo = get_topology("v5e:2x2")
    >>> topo.device_kind, topo.chips, topo.chip.memory_bytes
    ('TPU v5 lite', 4, 17179869184)
  """
  if isinstance(topology, Topology):
    return topology
  key, sizes = parse_topology(topology)
  check_libtpu()
  return _load(key, sizes)


def topology_mesh(topology: str | Topology, mesh: str | Mapping[str, int] | Mesh | None = None) -> Mesh:
  """The mesh of ``mesh`` laid over ``topology``'s chips (all chips as ``data`` when ``None``):
  ``get_topology(topology).mesh(mesh)``.

  Raises:
    TopologyError: as :func:`get_topology`. MeshSpecError: as :meth:`Topology.mesh`.
  """
  return get_topology(topology).mesh(mesh)


def topology_header(topology: str, mesh: Mapping[str, int]) -> str:
  """What a tool prints about a topology compile, from names only (a report's JSON suffices):
  ``"TPU v5e 2x2 (4 chips), compiled without a TPU; mesh data=4 (every chip on the data axis; --mesh to shape it):
  memory per chip"``.

  Args:
    topology: the topology's name (:data:`TOPOLOGY_FORMS`).
    mesh: ``{axis: size}`` of the mesh over its chips.

  Raises:
    TopologyError: a bad name.
  """
  key, sizes = parse_topology(topology)
  count = math.prod(sizes)
  chips = f"{count} chip" + ("s" if count != 1 else "")
  default = " (every chip on the data axis; --mesh to shape it)" if dict(mesh) == {"data": count} else ""
  return (f"{CHIPS[key].name} {'x'.join(map(str, sizes))} ({chips}), compiled without a TPU; mesh "
          f"{sharding.format_mesh(mesh)}{default}: memory per chip")


def compiled_for(mesh: Mesh | None, topology: Topology | None = None) -> dict[str, Any]:
  """What compiled a tool's numbers, for its JSON: ``{"backend", "device_kind", "topology", "device_count",
  "mesh"}`` (``backend`` ``tpu`` and ``topology`` ``"v5e:2x2"`` for a topology; ``mesh`` ``None`` unsharded).

  Args:
    mesh: the mesh the step was sharded over, or ``None`` (one device of the default backend).
    topology: the topology the mesh is over, if any.
  """
  return {"backend": sharding.mesh_platform(mesh), "device_kind": sharding.mesh_device_kind(mesh),
          "topology": None if topology is None else topology.name,
          "device_count": 1 if mesh is None else int(mesh.devices.size),
          "mesh": None if mesh is None else sharding.mesh_shape(mesh)}
