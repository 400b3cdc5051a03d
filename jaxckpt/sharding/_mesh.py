"""Device meshes by name: the ``--mesh`` grammar (``data=4,fsdp=2``), its axes, and the one helper that gives a
mesh's shape as ``{axis: size}``.

Mesh axes (:data:`MESH_AXES`):

- ``data``: the batch is split over it; parameters and optimizer state are replicated over it.
- ``fsdp``: the batch is split over it too, and parameters and optimizer state are split over it by the FSDP rule
  (:mod:`jaxckpt.sharding._state`).
- ``tensor``: Megatron-style tensor parallelism (Shoeybi et al. 2019): heads, the MLP hidden width and the vocabulary
  split by the logical-axis rules (:mod:`jaxckpt.sharding._rules`); the batch is not split over it.
- ``expert``: expert parallelism (GShard, Lepikhin et al. 2020): a Mixture of Experts' experts (logical name ``exp``)
  split over it, and the batch too (outside the experts it is data parallel, as MaxText's ``expert`` axis).

``jax.make_mesh`` lays the axes over the devices in the hardware's order (ICI on TPU, NVLink inside a GPU node), so
the last axis lands on the fastest links.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import jax
from jax.sharding import Mesh

from jaxckpt.errors import MeshSpecError, closest, shorten

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
"""Valid mesh axis names: ``data`` (batch split, state replicated), ``fsdp`` (batch and state split), ``expert``
(batch split, a Mixture of Experts' experts split), ``tensor`` (Megatron-style tensor parallelism: heads, the MLP
hidden width and the vocabulary split, for models whose parameters carry logical axis names,
:mod:`jaxckpt.sharding._rules`; the batch is not split over it)."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
"""Mesh axes the batch dimension (axis 0 of every batch array) is split over, in this order."""

_ENTRY = re.compile(r"\s*([^=\s]*)\s*=\s*([^=\s]*)\s*\Z")


def parse_mesh(spec: str | Mapping[str, int], *, device_count: int | None = None) -> dict[str, int]:
  """Parses ``--mesh``: ``name=size[,name=size]`` with names from :data:`MESH_AXES`, e.g. ``"data=4,fsdp=2"``.

  Args:
    spec: the spec string, or an already parsed ``{name: size}`` mapping (validated the same way).
    device_count: the number of devices the mesh must cover (the product of the sizes must equal it); default
      ``jax.device_count()`` (all processes' devices). Pass ``0`` to skip that check.

  Returns:
    ``{axis name: size}`` in the order given (an insertion-ordered dict).

  Raises:
    MeshSpecError: a malformed entry, an unknown or repeated axis name, a size that is not an integer ≥ 1, or a
      product of sizes different from ``device_count`` — one line naming the bad value and the valid ones.

  Example::

    >>> parse_mesh("data=4,fsdp=2", device_count=8)
    {'data': 4, 'fsdp': 2}
  """
  if isinstance(spec, Mapping):
    items = [(str(k), str(v)) for k, v in spec.items()]
    text = ",".join(f"{k}={v}" for k, v in items)
  else:
    text, items = str(spec), _parse_text(str(spec))
  mesh: dict[str, int] = {}
  for name, size in items:
    if name not in MESH_AXES:
      hint = closest(name, MESH_AXES)
      raise MeshSpecError(f"unknown mesh axis {shorten(name)!r} in mesh={shorten(text)!r}; valid axes: "
                          f"{', '.join(MESH_AXES)}" + (f"; did you mean {hint!r}?" if hint else ""))
    if name in mesh:
      raise MeshSpecError(f"mesh axis {name!r} appears twice in mesh={shorten(text)!r}; give each axis once")
    if not re.fullmatch(r"[0-9]+", size) or int(size) < 1:
      raise MeshSpecError(f"bad size {shorten(size)!r} of mesh axis {name!r} in mesh={shorten(text)!r}: "
                          "need an integer ≥ 1")
    mesh[name] = int(size)
  if not mesh:
    raise MeshSpecError(f"empty mesh={text!r}: write 'name=size[,name=size]' with names from {', '.join(MESH_AXES)}")
  count = jax.device_count() if device_count is None else device_count
  product = math.prod(mesh.values())
  if count and product != count:
    raise MeshSpecError(
        f"mesh={text!r} covers {product} device(s) but there are {count}: the product of the sizes must equal the "
        f"device count (mesh='data={count}' fits); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={product} "
        "gives that many devices")
  return mesh


def _parse_text(text: str) -> list[tuple[str, str]]:
  """``"data=4,fsdp=2"`` → ``[("data", "4"), ("fsdp", "2")]``: the one place a ``--mesh`` string is read (a tool
  parses its ``--mesh`` here once, at its door; tests count the calls).

  Raises:
    MeshSpecError: a malformed entry.
  """
  items = []
  for entry in text.split(","):
    match = _ENTRY.match(entry)
    if match is None or not match.group(1):
      raise MeshSpecError(f"bad mesh entry {shorten(entry.strip())!r} in mesh={shorten(text)!r}: write "
                          f"'name=size[,name=size]' with names from {', '.join(MESH_AXES)} (e.g. 'data=4,fsdp=2')")
    items.append((match.group(1), match.group(2)))
  return items


def format_mesh(mesh: Mesh | Mapping[str, int]) -> str:
  """``{"data": 4, "fsdp": 2}`` (or a ``Mesh``) as the ``--mesh`` string ``"data=4,fsdp=2"``."""
  return ",".join(f"{k}={v}" for k, v in mesh_shape(mesh).items())


def mesh_shape(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
  """``{axis name: size}`` of a mesh (for the report's and metrics.json's ``"mesh"``)."""
  if isinstance(mesh, Mesh):
    return {str(name): int(size) for name, size in mesh.shape.items()}
  return {str(k): int(v) for k, v in mesh.items()}


def mesh_platform(mesh: Mesh | None) -> str:
  """The platform a step sharded over ``mesh`` is compiled for (``"tpu"`` for a topology's mesh); without a mesh,
  ``jax.default_backend()``."""
  return jax.default_backend() if mesh is None else next(iter(mesh.devices.flat)).platform


def mesh_device_kind(mesh: Mesh | None) -> str:
  """JAX's ``device_kind`` of ``mesh``'s devices (of ``jax.devices()[0]`` without a mesh): ``"TPU v5 lite"``,
  ``"cpu"``."""
  return (jax.devices()[0] if mesh is None else next(iter(mesh.devices.flat))).device_kind


def make_mesh(spec: str | Mapping[str, int], *, devices: Iterable[jax.Device] | None = None) -> Mesh:
  """Builds the ``jax.sharding.Mesh`` of a ``--mesh`` spec over all devices (of every process).

  Args:
    spec: ``"data=4,fsdp=2"`` or ``{"data": 4, "fsdp": 2}``.
    devices: the devices, default ``jax.devices()``. ``jax.make_mesh`` orders them for the hardware topology
      (ICI on TPU, NVLink on GPU), so on a pod slice ``fsdp`` lands on the fastest links when it is the last axis.

  Returns:
    A mesh whose axis names and sizes are the spec's (auto-sharded axes: XLA's SPMD partitioner decides the rest).

  Raises:
    MeshSpecError: see :func:`parse_mesh`.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = parse_mesh(spec, device_count=len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(shape)
  return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=auto, devices=devices)


def check_batch_size(batch_size: int, mesh: Mesh | Mapping[str, int], *, flag: str = "batch_size") -> None:
  """Raises :class:`MeshSpecError` unless ``batch_size`` divides evenly over the mesh's batch axes.

  Args:
    batch_size: global examples per step.
    mesh: the mesh or its ``{axis: size}``.
    flag: the argument to name in the error (``batch_size``; the CLIs translate it to their flag).
  """
  shape = mesh_shape(mesh)
  split = math.prod(shape.get(a, 1) for a in BATCH_AXES)
  if batch_size % split:
    raise MeshSpecError(f"{flag}={batch_size} cannot be split over mesh={format_mesh(shape)!r}: the batch is split "
                        f"over {'×'.join(a for a in BATCH_AXES if a in shape)} = {split} devices; use a multiple of "
                        f"{split}")
