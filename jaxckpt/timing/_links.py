"""Where a program's devices sit, and what a collective's replica groups cross: a TPU slice's ICI torus, NVLink inside
a GPU node, the network between nodes.

A compiled SPMD program names its devices by partition id, their position in the mesh's ``devices.flat``
(``docs/hlo-reading.md``, "Replica groups"). :func:`links_for` maps each partition id to where that device sits: a
TPU chip's torus coordinates (``device.coords``), a GPU's node. A collective over a group then moves its bytes over:

- **ICI** (TPU): every torus dimension along which the group's chips differ carries part of it, over two links per
  chip (both directions of a ring) where the group spans the whole dimension and the dimension wraps around, one
  where it does not: the bandwidth of a group is the sum over the dimensions it spans ("How to Scale Your Model",
  Austin et al. 2025, "Sharding": an AllGather over several torus axes has the bandwidth of all of them; a v5e or
  v6e dimension wraps around only at its full 16 chips, a v4 or v5p slice of whole 4×4×4 cubes on every dimension;
  without the wraparound a ring's data crosses one link per chip, "typically doubles the time").
- **NVLink** (GPU): a group inside one node, at the GPU's NVLink bandwidth per direction × NCCL's ring efficiency
  (:data:`RING_EFFICIENCY`). An all-reduce inside a node of Hopper or later GPUs runs NCCL's NVLink SHARP algorithm
  (NVLS: the NVSwitch reduces), so each GPU sends and receives the array once instead of a ring's 2(n − 1)/n.
- **the network** (GPU), as NCCL lays its rings over nodes of 8 GPUs with one NIC per GPU, rail-aligned: a ring
  through the group's GPUs crosses the network once per node, and NCCL runs as many rings (channels) as the group
  has GPUs in a node, each on its own NIC. A group with ``g`` GPUs in each node therefore moves its network share over
  ``g`` NICs at once: per GPU the collective runs at min(NVLink, ``g`` × one NIC) (a group of one GPU per node — a
  ``data`` axis over nodes — at one NIC; ``fsdp`` over whole nodes at eight). Link figures × :data:`RING_EFFICIENCY`.

A mesh given by its axis sizes only (the fit's roofline, before anything is compiled) is laid as jaxckpt lays one
(:func:`mesh_links`): over a GPU cluster row-major in node order (:meth:`jaxckpt.sharding.Topology.mesh`), over a TPU
slice of the most nearly square (v5e, v6e) or cubic (v4, v5p) torus of that many chips (:func:`slice_torus`),
row-major over the chips as libtpu numbers them; the devices along one mesh axis are :func:`axis_group`.

The seconds of one collective on one device (:func:`collective_seconds`) are the bytes it moves over that
bandwidth: all-gather and reduce-scatter (n − 1)/n of the full array, all-reduce twice that (a reduce-scatter then an
all-gather, Patarasuk & Yuan 2009; once with NVLS), all-to-all (n − 1)/n of its input, a collective-permute its input
over one link (nccl-tests' "bus bandwidth" definitions, NVIDIA/nccl-tests ``doc/PERFORMANCE.md``). Latency (about 1 µs
per ICI hop, the scaling book) is not counted on TPU; on GPU each NCCL call costs its launch (:mod:`._gpu`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh

from jaxckpt.errors import JaxckptError
from jaxckpt.sharding import Chip, Topology

_ICI, _NVLINK, _NETWORK, _LOCAL = "ici", "nvlink", "network", "local"

RING_EFFICIENCY = 0.92
"""The fraction of a link's bandwidth NCCL's ring algorithm reaches (XLA:GPU's own collective model,
``gpu_collective_performance_model``: ``kRingAlgorithmDiscountFactor = 0.92``)."""

NVLS_CAPABLE = frozenset({"NVIDIA H100 SXM", "NVIDIA H200 SXM", "NVIDIA B200"})
"""GPUs whose NVSwitch reduces (NVLink SHARP, NCCL's NVLS algorithm for an all-reduce inside a node: Hopper and
later; NCCL 2.17 release notes)."""


@dataclasses.dataclass(frozen=True)
class Links:
  """The devices of a program (by partition id) and the links between them.

  Attributes:
    platform: ``"tpu"`` (one ICI torus), ``"gpu"`` (NVLink inside a node, the network between nodes) or ``"cpu"``
      (one device: no collectives to time).
    positions: per partition id, where its device sits: a TPU chip's torus coordinates (one per dimension), a GPU's
      ``(node, gpu in node)``.
    torus: a TPU slice's chips per dimension (``(16, 16)``); a GPU cluster's ``(nodes, gpus per node)``.
    wraps: a TPU: per torus dimension, whether it wraps around (a ring); empty for a GPU.
    ici_link: a TPU: bytes/s one way over one ICI link (:attr:`jaxckpt.sharding.Chip.ici_link_bandwidth`).
    nvlink: a GPU: bytes/s per direction over NVLink (:attr:`jaxckpt.sharding.Chip.ici_bandwidth`).
    network: a GPU: bytes/s per direction per GPU between nodes (:attr:`jaxckpt.sharding.Chip.network_bandwidth`).
    nvls: a GPU: an all-reduce inside a node runs NVLink SHARP (:data:`NVLS_CAPABLE`).
  """

  platform: str
  positions: tuple[tuple[int, ...], ...]
  torus: tuple[int, ...] = ()
  wraps: tuple[bool, ...] = ()
  ici_link: float = 0.0
  nvlink: float = 0.0
  network: float = 0.0
  nvls: bool = False

  @classmethod
  def tpu(cls, chip: Chip, torus: Sequence[int], coords: Sequence[Sequence[int]] | None = None) -> Links:
    """A TPU slice of ``torus`` chips (``(16, 16)``), devices at ``coords`` per partition id (default: row-major
    over the torus, the first dimension fastest, as libtpu numbers chips)."""
    torus = tuple(int(n) for n in torus)
    if coords is None:
      coords = [tuple((i // math.prod(torus[:d])) % torus[d] for d in range(len(torus)))
                for i in range(math.prod(torus))]
    return cls("tpu", tuple(tuple(int(c) for c in p[:len(torus)]) for p in coords), torus, tpu_wraps(chip, torus),
               ici_link=chip.ici_link_bandwidth)

  @classmethod
  def gpu(cls, chip: Chip, nodes: int, gpus_per_node: int) -> Links:
    """A GPU cluster of ``nodes`` × ``gpus_per_node`` GPUs, partition ids in node order (node 0's GPUs first, as
    :meth:`jaxckpt.sharding.Topology.mesh` lays a mesh)."""
    return cls("gpu", tuple((i // gpus_per_node, i % gpus_per_node) for i in range(nodes * gpus_per_node)),
               (nodes, gpus_per_node), nvlink=chip.ici_bandwidth, network=chip.network_bandwidth,
               nvls=chip.name in NVLS_CAPABLE)

  def route(self, group: Sequence[int]) -> tuple[str, float]:
    """``(link, bytes/s)`` of a collective over ``group`` (partition ids): ``"ici"`` with the bandwidth of the torus
    dimensions it spans, ``"nvlink"``, ``"network"``, or ``("local", inf)`` for a group of one device.

    Raises:
      JaxckptError: a partition id outside :attr:`positions` (the program was compiled for more devices).
    """
    if len(set(group)) <= 1:
      return _LOCAL, math.inf
    try:
      where = [self.positions[i] for i in group]
    except IndexError:
      raise JaxckptError(f"replica group {tuple(group)} names partition {max(group)}, but the links describe "
                         f"{len(self.positions)} devices: give links= of the mesh the program was compiled for") from None
    if self.platform == "gpu":
      nodes = {p[0] for p in where}
      if len(nodes) == 1:
        return _NVLINK, self.nvlink * RING_EFFICIENCY
      per_node = min(len(set(group)) // len(nodes), self.torus[1] if len(self.torus) > 1 else 1) or 1
      return _NETWORK, min(self.nvlink, per_node * self.network) * RING_EFFICIENCY
    bandwidth = 0.0
    for d, size in enumerate(self.torus):
      along = {p[d] for p in where}
      if len(along) > 1:
        ring = self.wraps[d] and len(along) == size
        bandwidth += self.ici_link * (2 if ring else 1)
    return _ICI, bandwidth


def tpu_wraps(chip: Chip, torus: Sequence[int]) -> tuple[bool, ...]:
  """Which dimensions of a TPU slice wrap around: on v5e and v6e (2-D pods of 16 × 16) a dimension of 16 chips; on v4
  and v5p (3-D, cubes of 4 × 4 × 4 joined by optical switches) every dimension when all are multiples of 4, none
  otherwise (the scaling book, "How to Think About TPUs")."""
  if chip.torus == 3:
    whole = all(n % 4 == 0 for n in torus)
    return tuple(whole for _ in torus)
  return tuple(n == 16 for n in torus)


def links_for(topology: Topology, mesh: Mesh) -> Links:
  """The :class:`Links` of a program compiled on ``topology`` over ``mesh`` (partition id i is
  ``mesh.devices.flat[i]``).

  Args:
    topology: a :class:`jaxckpt.sharding.Topology` (``get_topology("v6e:16x16")``).
    mesh: the ``jax.sharding.Mesh`` over its devices the step was sharded over (:meth:`Topology.mesh`).

  Returns:
    TPU: each device's torus coordinates (``device.coords``); GPU: each device's node (its place in the topology's
    devices, node order).
  """
  devices = list(mesh.devices.flat)
  chip = topology.chip
  if chip.is_gpu:
    order = {d: i for i, d in enumerate(topology.devices)}
    per_node = topology.shape[1]
    base = Links.gpu(chip, topology.shape[0], per_node)
    return dataclasses.replace(base, positions=tuple((order[d] // per_node, order[d] % per_node) for d in devices))
  return Links.tpu(chip, topology.shape, [tuple(d.coords) for d in devices])


def collective_seconds(kind: str, payload_bytes: float, group: Sequence[int], links: Links) -> tuple[str, float]:
  """``(link, seconds)`` one device spends in one run of a collective (module docstring).

  Args:
    kind: a :data:`jaxckpt.analysis.COLLECTIVE_KINDS` entry.
    payload_bytes: :attr:`jaxckpt.analysis.Collective.payload_bytes` (all-gather: its output; reduce-scatter: its
      input; all-reduce: its buffer; else its input).
    group: one replica group (partition ids); a collective-permute's source-target pair.
    links: the program's :class:`Links`.
  """
  link, bandwidth = links.route(group)
  n = len(set(group))
  if link == _LOCAL or payload_bytes <= 0:
    return link, 0.0
  if not bandwidth:
    return link, 0.0
  if kind == "collective-permute":
    one_link = links.ici_link if link == _ICI else bandwidth
    return link, payload_bytes / one_link
  share = (n - 1) / n
  factor = 2 * share if kind == "all-reduce" else share
  if kind == "all-reduce" and link == _NVLINK and links.nvls:  # NVLink SHARP: the switch reduces
    factor = 1.0
  return link, factor * payload_bytes / bandwidth


def slice_torus(chip: Chip, chips: int) -> tuple[int, ...]:
  """The torus of a TPU slice of ``chips`` chips when only the count is known: the most nearly square (a 2-D chip:
  v5e, v6e) or cubic (3-D: v4, v5p) factorization, smallest dimension first (the slices Cloud TPU offers: v5e 2x2,
  4x4, 8x16, 16x16; v5p 2x2x4, 4x4x4, 4x8x8).

  Raises:
    JaxckptError: ``chips`` < 1, or a GPU (a cluster is nodes × GPUs per node: :meth:`Links.gpu`).
  """
  if chip.is_gpu or chips < 1:
    raise JaxckptError(f"slice_torus({chip.name!r}, {chips}): a TPU chip and a chip count ≥ 1")
  def pairs(n: int, least: int) -> list[tuple[int, int]]:  # (a, n / a), least ≤ a ≤ n / a
    return [(a, n // a) for a in range(least, math.isqrt(n) + 1) if n % a == 0]

  shapes: list[tuple[int, ...]] = list(pairs(chips, 1))
  if chip.torus == 3:
    shapes = [(a, *rest) for a, n in pairs(chips, 1) for rest in pairs(n, a)]
  return min(shapes, key=lambda shape: (shape[-1] - shape[0], -shape[0]))


def mesh_links(chip: Chip, mesh: Mapping[str, int]) -> Links:
  """The :class:`Links` of a mesh of ``mesh``'s sizes laid over chips of ``chip`` without a topology's devices: a GPU
  cluster of nodes of :attr:`~jaxckpt.sharding.Chip.gpus_per_node` GPUs (fewer in one node), a TPU slice of
  :func:`slice_torus`; partition ids are the mesh's positions, row-major.

  Args:
    chip: the chip (:data:`jaxckpt.sharding.CHIPS`).
    mesh: ``{axis: size}`` in the mesh's axis order.
  """
  devices = math.prod(int(n) for n in mesh.values()) if mesh else 1
  if chip.is_gpu:
    per_node = min(devices, chip.gpus_per_node or devices)
    return Links.gpu(chip, -(-devices // per_node), per_node)
  return Links.tpu(chip, slice_torus(chip, devices))


def axis_group(mesh: Mapping[str, int], axis: str) -> tuple[int, ...]:
  """The partition ids of the devices along mesh axis ``axis`` that hold device 0, the mesh laid row-major (the
  replica group of a collective over that axis).

  Example::

    >>> axis_group({"data": 2, "fsdp": 4}, "data")
    (0, 4)

  Raises:
    JaxckptError: an axis the mesh does not have.
  """
  names = list(mesh)
  if axis not in names:
    raise JaxckptError(f"axis {axis!r} is not an axis of the mesh {dict(mesh)}")
  stride = math.prod(int(mesh[a]) for a in names[names.index(axis) + 1:])
  return tuple(k * stride for k in range(int(mesh[axis])))
