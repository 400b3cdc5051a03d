"""Compiling for accelerators that are not attached: TPU slices and NVIDIA GPU clusters by name, meshes over their
devices.

JAX compiles for hardware that is not here (ahead-of-time, "deviceless" compilation):
``jax.experimental.topologies.get_topology_desc`` describes the devices as compile-only JAX devices, and a train
step whose ``jax.ShapeDtypeStruct`` arguments carry ``NamedSharding`` s on a mesh over them is compiled by that
hardware's compiler, here, on a CPU. Its ``memory_analysis()`` is the per-device buffer assignment the hardware would
run. Nothing is allocated and nothing can run. MaxText's ``train_compile.py`` does the same to tell before a run
whether a config fits.

Names (:data:`TOPOLOGY_FORMS`):

- **TPU slices**, ``<chip>:<torus>`` as JAX and Cloud TPU write them: ``v5e:2x2`` or ``v6e:16x16`` (the 2-D torus of
  v5e and v6e chips), ``v4:2x2x1`` or ``v5p:2x2x2`` (3-D), compiled by the TPU compiler of ``libtpu`` (the
  ``[tpu]`` extra, :func:`check_libtpu`). One device per chip: v4 and v5p are compiled as megacore chips (both
  TensorCores one device, chip config ``megacore``, as MaxText does).
- **NVIDIA GPU clusters**, ``<gpu>:<gpus>`` for one node or ``<gpu>:<nodes>x<gpus per node>``: ``h100:8``,
  ``h200:32x8`` (32 nodes of 8, 256 GPUs), for the GPUs of :data:`jaxckpt.sharding.GPU_CHIPS`, compiled by XLA:GPU
  of the CUDA plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``, the ``[gpu]`` extra, :func:`check_cuda_plugin`)
  for the GPU's target config (XLA's ``GpuTargetConfigProto``, shipped in ``jaxckpt/sharding/gpu_specs/``). The GPUs
  of one node share NVLink; nodes share the slower network (:meth:`Topology.axis_links`). XLA:GPU compiles
  deviceless only when JAX's backends run on the CPU: :func:`get_topology` sets ``jax_platforms`` to ``"cpu"`` when
  nothing has started JAX's backends yet (as JAX's own deviceless test does), registers the plugin when they started
  on the CPU alone (:func:`jaxckpt.analysis._internals.cuda_compile_only`), and says how to start otherwise.

Every tool takes the mesh of :meth:`Topology.mesh` through its ``mesh=`` path (the step core shards the step over
it) and decides its compiler options by the mesh's platform (:func:`jaxckpt.step.step_compiler_options`): the
XLA:CPU options are never given to the TPU compiler, which refuses the first (``HLO opt-barrier is not implemented on
TPU``, measured with libtpu 0.0.42.1).

TPU start-up: loading libtpu on a machine without a TPU prints warnings about the environment variables
``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES``; :func:`get_topology` sets both, where unset, before libtpu
starts (the topology's Cloud accelerator type and ``localhost``), which silences them. The compiled program does not
depend on them (measured: the same stats under another accelerator type). libtpu also takes a lock
(``/tmp/libtpu_lockfile``) so that one process at a time owns the TPU; compiling owns no TPU, so :func:`get_topology`
also sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` where unset. With libtpu installed, every JAX process also probes for a TPU
when its backend starts; on a machine without one, ``JAX_PLATFORMS=cpu`` skips the probe, and topologies still load:
:func:`get_topology` sets it when nothing has started JAX's backends yet (which also keeps JAX's CUDA plugin, where
the ``[gpu]`` extra is installed, from logging a traceback as the backends start without a GPU).

Memory: the TPU compiler's ``temp_size_in_bytes`` leaves out temporaries its peak holds, so on TPU jaxckpt's
``temp_bytes`` and footprint come from the peak (:data:`jaxckpt.training._xla.PEAK_TEMP_BACKENDS`). The TPU compiler
refuses a program over the chip's HBM; XLA:GPU never refuses one (it logs a line), so on a GPU the verdict is
jaxckpt's (:class:`jaxckpt.sharding.Placement`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
from importlib import metadata, resources
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import mesh_utils, topologies
from jax.sharding import Mesh
from packaging.requirements import Requirement

from jaxckpt.analysis._internals import cpu_backends_first, cuda_compile_only
from jaxckpt.errors import MeshSpecError, TopologyError, closest, shorten
from jaxckpt.sharding import _mesh as sharding
from jaxckpt.sharding._chips import CHIPS, GPU_CHIPS, TPU_CHIPS, Chip

TOPOLOGY_FORMS = ("<chip>:<torus> for a TPU slice, e.g. v5e:2x2, v6e:16x16 (2-D: v5e, v6e) or v4:2x2x1, v5p:2x2x1 "
                  "(3-D: v4, v5p); <gpu>:<gpus> for one node or <gpu>:<nodes>x<gpus per node> for a GPU cluster, "
                  f"e.g. h100:8, h200:32x8 (GPUs: {', '.join(GPU_CHIPS)})")
"""The accepted topology names, in one line (the error of a bad name quotes it)."""

_NAME = re.compile(r"\s*([A-Za-z0-9-]+)\s*:\s*([0-9]+(?:\s*x\s*[0-9]+)*)\s*\Z")
_HOST_BOUNDS = (2, 2, 1)
"""libtpu's default chips per host (a 2x2 board); a smaller topology (``v5e:1x1``) needs its own bounds."""

CUDA_PLUGIN = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
"""The distributions of JAX's CUDA plugin that hold XLA:GPU (the ``[gpu]`` extra); each must be jaxlib's release."""


class TopologyName(NamedTuple):
  """A topology name read once (:func:`parse_topology`): a tool's door reads ``--topology`` into one, and
  :func:`get_topology`, :func:`check_topology_name` and :func:`topology_header` take it as it is, never reading the
  text again. A tuple, so ``key, sizes = parse_topology(name)`` unpacks it."""

  key: str  # the chip's key in CHIPS ("v5e", "h100")
  sizes: tuple[int, ...]  # a TPU's chips per torus dimension; a GPU cluster's (nodes, gpus per node)

  @property
  def is_gpu(self) -> bool:
    """Whether the chips are GPUs (compiled by XLA:GPU of JAX's CUDA plugin, not libtpu)."""
    return CHIPS[self.key].is_gpu

  @property
  def chips(self) -> int:
    """Chips (TPU) or GPUs of the topology."""
    return math.prod(self.sizes)

  @property
  def name(self) -> str:
    """The canonical name (``"v5e:2x2"``, ``"h100:8"``, ``"h100:32x8"``)."""
    nodes_one = self.is_gpu and self.sizes[0] == 1
    return f"{self.key}:{self.sizes[1]}" if nodes_one else f"{self.key}:{'x'.join(map(str, self.sizes))}"


def parse_topology(name: str | TopologyName) -> TopologyName:
  """Parses a topology name: ``"v5e:2x2"`` → ``("v5e", (2, 2))``; ``"h100:32x8"`` → ``("h100", (32, 8))``;
  ``"h100:8"`` → ``("h100", (1, 8))``.

  Args:
    name: :data:`TOPOLOGY_FORMS`: a TPU chip key of :data:`~jaxckpt.sharding.CHIPS` and one size ≥ 1 per torus
      dimension (2 for v5e/v6e, 3 for v4/v5p), or a GPU key and ``<gpus>`` (one node) or ``<nodes>x<gpus per
      node>``, at most the GPU's :attr:`~jaxckpt.sharding.Chip.gpus_per_node` per node; or a :class:`TopologyName`
      (returned as it is).

  Returns:
    The :class:`TopologyName` ``(chip key, sizes)``: a TPU's torus; a GPU cluster's ``(nodes, gpus per node)``.

  Raises:
    TopologyError: one line naming the bad part and the accepted forms (and the closest chip name).
  """
  if isinstance(name, TopologyName):
    return name
  return _parse_text(str(name))


def _parse_text(name: str) -> TopologyName:
  """The one reader of topology text (:func:`parse_topology`)."""
  match = _NAME.match(name)
  if match is None:
    raise TopologyError(f"bad topology {shorten(name)!r}: write {TOPOLOGY_FORMS}")
  key, sizes = match.group(1).lower(), tuple(int(s) for s in re.split(r"\s*x\s*", match.group(2)))
  if key not in CHIPS:
    hint = closest(key, list(CHIPS))
    raise TopologyError(f"unknown chip {key!r} in topology {shorten(name)!r}; valid: TPU chips "
                        f"{', '.join(TPU_CHIPS)}; GPUs {', '.join(GPU_CHIPS)}"
                        + (f"; did you mean {hint!r}?" if hint else "") + f" (write {TOPOLOGY_FORMS})")
  chip = CHIPS[key]
  if chip.is_gpu:
    return TopologyName(key, _gpu_sizes(name, key, chip, sizes))
  torus = chip.torus
  if len(sizes) != torus or min(sizes) < 1:
    example = "x".join(["2"] * 2 + ["1"] * (torus - 2))
    raise TopologyError(f"bad topology {shorten(name)!r}: a {key} slice is a {torus}-D torus, write {torus} "
                        f"sizes ≥ 1 (e.g. {key}:{example})")
  return TopologyName(key, sizes)


def _gpu_sizes(name: str, key: str, chip: Chip, sizes: tuple[int, ...]) -> tuple[int, int]:
  """``(nodes, gpus per node)`` of a GPU cluster's sizes, checked."""
  per_node = chip.gpus_per_node
  if len(sizes) == 1:
    sizes = (1, sizes[0])
  if len(sizes) != 2 or min(sizes) < 1:
    raise TopologyError(f"bad topology {shorten(str(name))!r}: a {key} cluster is {key}:<gpus> (one node) or "
                        f"{key}:<nodes>x<gpus per node>, sizes ≥ 1 (e.g. {key}:{per_node}, {key}:32x{per_node})")
  nodes, gpus = sizes
  if gpus > per_node:
    example = f"{key}:{math.ceil(gpus / per_node)}x{per_node}" if nodes == 1 and gpus % per_node == 0 else \
        f"{key}:<nodes>x{per_node}"
    raise TopologyError(f"topology {shorten(str(name))!r} puts {gpus} GPUs in a node, but a node of {chip.name} "
                        f"GPUs holds at most {per_node} (HGX/DGX; one NVLink domain): write nodes × GPUs per node, "
                        f"e.g. {example}")
  return nodes, gpus


def libtpu_version() -> str | None:
  """The installed ``libtpu`` package's version, or ``None`` when it is not installed."""
  return _version("libtpu")


def _version(distribution: str) -> str | None:
  try:
    return metadata.version(distribution)
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


def check_cuda_plugin() -> str:
  """Checks that JAX's CUDA plugin (XLA:GPU) of the installed jaxlib's release is installed; returns its version.

  Compiling for a GPU without one needs only the plugin (about 460 MB): no CUDA runtime, cuDNN or driver.

  Raises:
    TopologyError: a plugin distribution (:data:`CUDA_PLUGIN`) missing, or of another release than jaxlib (the line
      says what to install).
  """
  jaxlib = metadata.version("jaxlib")
  found = {d: _version(d) for d in CUDA_PLUGIN}
  wanted = " ".join(f"'{d}=={jaxlib}'" for d in CUDA_PLUGIN)
  missing = [d for d, v in found.items() if v is None]
  if missing:
    raise TopologyError(f"compiling for a GPU topology needs XLA:GPU from JAX's CUDA plugin ({', '.join(missing)} "
                        f"not installed): pip install -e \".[gpu]\" (or pip install {wanted}); no GPU, CUDA or "
                        "driver is needed")
  wrong = [f"{d} {v}" for d, v in found.items() if v != jaxlib]
  if wrong:
    raise TopologyError(f"{', '.join(wrong)} does not fit jaxlib {jaxlib}: pip install {wanted}")
  return found[CUDA_PLUGIN[0]]


def compiler_name(platform: str) -> str:
  """The compiler of a platform, as the tools' headers and JSON name it: ``"XLA:TPU (libtpu 0.0.42.1)"``,
  ``"XLA:GPU (jax-cuda12-plugin 0.10.2)"``, ``"XLA:CPU (jaxlib 0.10.2)"``."""
  if platform == "tpu":
    return f"XLA:TPU (libtpu {libtpu_version()})"
  if platform == "gpu":
    return f"XLA:GPU ({CUDA_PLUGIN[0]} {_version(CUDA_PLUGIN[0])})"
  return f"XLA:{platform.upper()} (jaxlib {_version('jaxlib')})"


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice or a GPU cluster to compile for, without its hardware: its chips as compile-only JAX devices.

  Attributes:
    name: the canonical name (``"v5e:2x2"``, ``"h100:32x8"``).
    chip_key: its chip's key in :data:`~jaxckpt.sharding.CHIPS` (``"v5e"``, ``"h100"``).
    shape: a TPU's chips per torus dimension (``(2, 2)``); a GPU cluster's ``(nodes, gpus per node)``.
    devices: the compile-only devices, one per chip (``device_kind`` e.g. ``"TPU v5 lite"``, ``"NVIDIA H100 80GB
      HBM3"``; a GPU cluster's in node order: the GPUs of node 0, then node 1, ...).
  """

  name: str
  chip_key: str
  shape: tuple[int, ...]
  devices: tuple[Any, ...]

  @property
  def chip(self) -> Chip:
    """The chip's facts (:data:`~jaxckpt.sharding.CHIPS`)."""
    return CHIPS[self.chip_key]

  @property
  def platform(self) -> str:
    """``"tpu"`` or ``"gpu"``."""
    return self.devices[0].platform

  @property
  def device_kind(self) -> str:
    """JAX's ``device_kind`` of the chips (``"TPU v5 lite"``)."""
    return self.devices[0].device_kind

  @property
  def chips(self) -> int:
    """How many chips (devices) the slice or cluster has."""
    return len(self.devices)

  @property
  def nodes(self) -> int:
    """A GPU cluster's nodes (1 for a TPU slice: one ICI domain)."""
    return self.shape[0] if self.chip.is_gpu else 1

  @property
  def compiler(self) -> str:
    """What compiles for it (:func:`compiler_name`), e.g. ``"XLA:GPU (jax-cuda12-plugin 0.10.2)"``."""
    return compiler_name(self.platform)

  def describe(self) -> str:
    """``"TPU v5e 2x2 (4 chips), compiled without a TPU"``, ``"NVIDIA H100 SXM, 32 nodes × 8 GPUs (256 GPUs),
    compiled without a GPU by XLA:GPU (jax-cuda12-plugin 0.10.2)"``: what the tools' headers say."""
    if self.chip.is_gpu:
      nodes, per_node = self.shape
      where = f"1 node of {per_node}" if nodes == 1 else f"{nodes} nodes × {per_node}"
      return (f"{self.chip.name}, {where} GPUs ({self.chips} GPU{'s' * (self.chips != 1)}), compiled without a GPU "
              f"by {self.compiler}")
    chips = f"{self.chips} chip" + ("s" if self.chips != 1 else "")
    return f"{self.chip.name} {'x'.join(map(str, self.shape))} ({chips}), compiled without a TPU by {self.compiler}"

  def as_json(self) -> dict[str, Any]:
    """``{"topology", "backend", "device_kind", "chips"}``: what every JSON record of a topology compile says."""
    return {"topology": self.name, "backend": self.platform, "device_kind": self.device_kind, "chips": self.chips}

  def axis_links(self, mesh: Mesh | Mapping[str, int]) -> dict[str, str]:
    """Which links each mesh axis's collectives cross: ``"ici"`` (a TPU slice's torus), ``"nvlink"`` (the GPUs of
    one node), ``"network"`` (a GPU axis whose groups span nodes).

    A mesh over a GPU cluster lays its axes row-major over the GPUs in node order (:meth:`mesh`): the last axes fill
    a node first, so an axis is inside a node when the product of the sizes from it to the last axis is at most the
    GPUs per node.

    Args:
      mesh: the mesh or its ``{axis: size}`` (over this topology's devices).

    Returns:
      ``{axis: link}`` for every axis of size > 1.
    """
    shape = sharding.mesh_shape(mesh)
    if not self.chip.is_gpu:
      return {a: "ici" for a, n in shape.items() if n > 1}
    return gpu_axis_links(shape, self.shape[1])

  def mesh(self, spec: str | Mapping[str, int] | Mesh | None = None) -> Mesh:
    """A mesh over this topology's chips: ``spec`` (``--mesh``, e.g. ``"data=2,fsdp=2"``) laid over them, or all
    chips as the ``data`` axis when ``None``.

    A TPU slice's axes are laid over the torus by ``jax.make_mesh``; a GPU cluster's row-major over the GPUs in node
    order, so the last axes are inside a node (NVLink) and the first ones span nodes (write ``tensor`` and ``fsdp``
    last to keep them inside a node: ``data=32,fsdp=8``).

    Args:
      spec: a ``--mesh`` spec (:func:`jaxckpt.sharding.parse_mesh`), ``None``, or a mesh already over these
        chips (returned as it is).

    Returns:
      The ``jax.sharding.Mesh``.

    Raises:
      MeshSpecError: a bad spec, a mesh whose sizes do not multiply to the chip count (one line naming both), a
        ``Mesh`` over other devices, or axis sizes that cannot be laid over a TPU torus even splitting its
        dimensions (an axis of 8 on 16x16 is laid by splitting one, as MaxText's ``allow_split_physical_axes``).
    """
    if isinstance(spec, Mesh):
      if set(spec.devices.flat) != set(self.devices):
        raise MeshSpecError(f"mesh {sharding.format_mesh(spec)!r} is not over the chips of topology {self.name}; "
                            f"give its shape as a string (mesh='data={self.chips}')")
      return spec
    shape = {"data": self.chips} if spec is None else sharding.parse_mesh(spec, device_count=0)
    text = sharding.format_mesh(shape)
    unit = "GPUs" if self.chip.is_gpu else "chips"
    if math.prod(shape.values()) != self.chips:
      raise MeshSpecError(f"mesh={text!r} covers {math.prod(shape.values())} device(s) but topology {self.name} has "
                          f"{self.chips} {unit}: the product of the sizes must be {self.chips} "
                          f"(mesh='data={self.chips}' fits)")
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    if self.chip.is_gpu:  # node order: node 0's GPUs, then node 1's (the devices' order), row-major
      grid = np.empty(self.chips, dtype=object)
      grid[:] = self.devices
      return Mesh(grid.reshape(tuple(shape.values())), tuple(shape), axis_types=auto)
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
    return Mesh(grid, tuple(shape), axis_types=auto)


def gpu_axis_links(mesh: Mapping[str, int], gpus_per_node: int) -> dict[str, str]:
  """``{axis: "nvlink" | "network"}`` for the axes of size > 1 of a mesh laid row-major over GPUs in node order
  (:meth:`Topology.mesh`): an axis is inside a node when the product of its size and the later axes' is at most
  ``gpus_per_node``.

  Example::

    >>> gpu_axis_links({"data": 32, "fsdp": 8}, 8)
    {'data': 'network', 'fsdp': 'nvlink'}
  """
  out, inner = {}, 1
  for axis, size in reversed(list(dict(mesh).items())):
    inner *= size
    if size > 1:
      out[axis] = "nvlink" if inner <= gpus_per_node else "network"
  return dict(reversed(list(out.items())))


_COMPILE_ONLY: dict[Any, str] = {}
"""Every compile-only device of the topologies loaded in this process, with its topology's name (:func:`compiles_only`,
:func:`topology_of`)."""


def compiles_only(devices: Mesh | Iterable[Any] | None) -> bool:
  """Whether a mesh (or devices) is over a topology's compile-only devices (:func:`get_topology`): nothing can run
  on them, and JAX's persistent compilation cache writes their executables but cannot load them back ("PjRtCompiler
  must be constructed with a Client to call DeserializeLoadedExecutable", jax 0.10.2), so compiles for them bypass
  it."""
  if devices is None:
    return False
  return any(d in _COMPILE_ONLY for d in (devices.devices.flat if isinstance(devices, Mesh) else devices))


def topology_of(devices: Mesh | Iterable[Any] | None) -> str | None:
  """The name of the loaded topology whose compile-only devices ``devices`` (a mesh) are (``"v5e:2x2"``), or ``None``
  for real devices (what a worker process loads to compile for the same devices, :mod:`jaxckpt.step._isolated`)."""
  if devices is None:
    return None
  names = {_COMPILE_ONLY.get(d) for d in (devices.devices.flat if isinstance(devices, Mesh) else devices)}
  return names.pop() if len(names) == 1 else None


def _accelerator_type(chip: Chip, chips: int) -> str:
  return f"{chip.accelerator_type}-{chips * chip.cores}"


def _reason(err: BaseException) -> str:
  return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@functools.lru_cache(maxsize=None)
def _load_tpu(key: str, sizes: tuple[int, ...]) -> Topology:
  chip = CHIPS[key]
  name = f"{key}:{'x'.join(map(str, sizes))}"
  full = (*sizes, *([1] * (3 - len(sizes))))
  bounds = tuple(min(s, h) for s, h in zip(full, _HOST_BOUNDS))
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(chip, math.prod(sizes)))
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no TPU to own, so no libtpu lockfile
  cpu_backends_first()
  try:
    described = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name=chip.chip_config,
                                             chips_per_host_bounds=bounds)
  except Exception as err:  # noqa: BLE001 - libtpu raises JaxRuntimeError / RuntimeError with its reason
    raise TopologyError(f"the TPU compiler refuses topology {name!r}: {_reason(err)} (write "
                        f"{TOPOLOGY_FORMS})") from None
  _COMPILE_ONLY.update(dict.fromkeys(described.devices, name))
  return Topology(name, key, sizes, tuple(described.devices))


def target_config(key: str) -> str:
  """The XLA target config (``GpuTargetConfigProto`` as text) of GPU ``key``, shipped as package data.

  Raises:
    TopologyError: ``key`` is not a GPU of the chip table.
  """
  chip = CHIPS.get(key)
  if chip is None or not chip.is_gpu:
    raise TopologyError(f"no GPU target config for {key!r}; GPUs: {', '.join(GPU_CHIPS)}")
  return resources.files("jaxckpt.sharding").joinpath("gpu_specs", chip.target_config).read_text()


@functools.lru_cache(maxsize=None)
def _load_gpu(key: str, sizes: tuple[int, int]) -> Topology:
  name = f"{key}:{sizes[1]}" if sizes[0] == 1 else f"{key}:{sizes[0]}x{sizes[1]}"
  problem = cuda_compile_only()
  if problem is not None:
    raise TopologyError(f"XLA:GPU cannot compile for topology {name!r} here: {problem}; set JAX_PLATFORMS=cpu in "
                        "the environment (XLA:GPU then compiles without a GPU)")
  try:
    described = topologies.get_topology_desc(platform="cuda", target_config=target_config(key),
                                             topology=f"{sizes[0]}x1x{sizes[1]}")
  except NotImplementedError:
    raise TopologyError(f"XLA:GPU cannot compile for topology {name!r} here: JAX's CUDA plugin did not register for "
                        f"compiling without a GPU (jax_platforms={jax.config.jax_platforms!r}); set "
                        "JAX_PLATFORMS=cpu in the environment") from None
  except Exception as err:  # noqa: BLE001 - the plugin raises JaxRuntimeError with its reason
    raise TopologyError(f"XLA:GPU refuses topology {name!r}: {_reason(err)} (write {TOPOLOGY_FORMS})") from None
  devices = sorted(described.devices, key=lambda d: (d.process_index, d.id))
  _COMPILE_ONLY.update(dict.fromkeys(devices, name))
  return Topology(name, key, sizes, tuple(devices))


def get_topology(topology: str | TopologyName | Topology) -> Topology:
  """The :class:`Topology` of a name (loaded once per process), or ``topology`` itself.

  Args:
    topology: ``"v5e:2x2"``, ``"h100:32x8"`` (:data:`TOPOLOGY_FORMS`), a name already read (:class:`TopologyName`),
      or a :class:`Topology`.

  Returns:
    The topology, its chips as compile-only devices.

  Raises:
    TopologyError: a bad name (:func:`parse_topology`); libtpu (TPU) or the CUDA plugin (GPU) missing or of the
      wrong release (:func:`check_libtpu`, :func:`check_cuda_plugin`); JAX started with other than CPU backends
      (GPU); a topology the compiler refuses (its reason, one line).

  Example::

    >>> topo = get_topology("v5e:2x2")
    >>> topo.device_kind, topo.chips, topo.chip.memory_bytes
    ('TPU v5 lite', 4, 17179869184)
    >>> get_topology("h100:2x8").describe()
    'NVIDIA H100 SXM, 2 nodes × 8 GPUs (16 GPUs), compiled without a GPU by XLA:GPU (jax-cuda12-plugin 0.10.2)'
  """
  if isinstance(topology, Topology):
    return topology
  key, sizes = parse_topology(topology)
  if CHIPS[key].is_gpu:
    check_cuda_plugin()
    return _load_gpu(key, sizes)
  check_libtpu()
  return _load_tpu(key, sizes)


def check_topology_name(topology: str | TopologyName | Topology) -> None:
  """Checks a topology name and that its compiler is installed, without loading it (what the CLIs check before
  anything else: a bad flag is one line whatever is installed).

  Raises:
    TopologyError: as :func:`parse_topology`, :func:`check_libtpu`, :func:`check_cuda_plugin`.
  """
  if isinstance(topology, Topology):
    return
  key, _ = parse_topology(topology)
  check_cuda_plugin() if CHIPS[key].is_gpu else check_libtpu()


def topology_mesh(topology: str | Topology, mesh: str | Mapping[str, int] | Mesh | None = None) -> Mesh:
  """The mesh of ``mesh`` laid over ``topology``'s chips (all chips as ``data`` when ``None``):
  ``get_topology(topology).mesh(mesh)``.

  Raises:
    TopologyError: as :func:`get_topology`. MeshSpecError: as :meth:`Topology.mesh`.
  """
  return get_topology(topology).mesh(mesh)


def topology_header(topology: str | TopologyName | Topology, mesh: Mapping[str, int], *,
                    mesh_given: bool = False) -> str:
  """What a tool prints about a topology compile, from names only (a report's JSON suffices):
  ``"TPU v5e 2x2 (4 chips), compiled without a TPU; mesh data=4 (every chip on the data axis; --mesh to shape it):
  memory per chip"``; a GPU cluster's says which axes cross nodes.

  Args:
    topology: the topology's name (:data:`TOPOLOGY_FORMS`), read (:class:`TopologyName`) or loaded
      (:class:`Topology`).
    mesh: ``{axis: size}`` of the mesh over its chips.
    mesh_given: whether the user gave that mesh; ``False``: the default (every chip on ``data``), said as such.

  Raises:
    TopologyError: a bad name.
  """
  key, sizes = (topology.chip_key, topology.shape) if isinstance(topology, Topology) else parse_topology(topology)
  chip = CHIPS[key]
  count = math.prod(sizes)
  is_default = not mesh_given and dict(mesh) == {"data": count}
  default = " (every chip on the data axis; --mesh to shape it)" if is_default else ""
  if chip.is_gpu:
    nodes, per_node = sizes
    where = f"1 node of {per_node}" if nodes == 1 else f"{nodes} nodes × {per_node}"
    words = {"nvlink": "NVLink", "network": "the network"}
    crossing = "; ".join(f"{a} over {words[link]}" for a, link in gpu_axis_links(mesh, per_node).items())
    return (f"{chip.name} ({chip.device_kinds[0]}), {where} GPUs ({count} GPU{'s' * (count != 1)}), compiled "
            f"without a GPU by "
            f"{compiler_name('gpu')}; mesh {sharding.format_mesh(mesh)}{default}"
            + (f" ({crossing})" if crossing and not default else "") + ": memory per GPU")
  chips = f"{count} chip" + ("s" if count != 1 else "")
  return (f"{chip.name} {'x'.join(map(str, sizes))} ({chips}), compiled without a TPU by {compiler_name('tpu')}; mesh "
          f"{sharding.format_mesh(mesh)}{default}: memory per chip")


def compiled_for(mesh: Mesh | None, topology: Topology | None = None) -> dict[str, Any]:
  """What compiled a tool's numbers, for its JSON: ``{"backend", "device_kind", "compiler", "topology",
  "device_count", "mesh"}`` (``backend`` ``tpu`` and ``topology`` ``"v5e:2x2"`` for a topology; ``mesh`` ``None``
  unsharded; ``compiler`` :func:`compiler_name`).

  Args:
    mesh: the mesh the step was sharded over, or ``None`` (one device of the default backend).
    topology: the topology the mesh is over, if any.
  """
  platform = sharding.mesh_platform(mesh)
  return {"backend": platform, "device_kind": sharding.mesh_device_kind(mesh), "compiler": compiler_name(platform),
          "topology": None if topology is None else topology.name,
          "device_count": 1 if mesh is None else int(mesh.devices.size),
          "mesh": None if mesh is None else sharding.mesh_shape(mesh)}
