"""Logical axis names: what a model calls each axis of its arrays, and the one table that maps names to mesh axes.

A model never names a mesh axis. It names the axes of its parameters and activations logically (``embed``, ``heads``,
``mlp``, ``activation_batch``…) and one table, :data:`LOGICAL_RULES`, says which mesh axes (``data``, ``fsdp``,
``tensor``) each name is split over; changing the mesh changes the table's effect, not the layers. The idea is
MaxText's ``logical_axis_rules`` (AI-Hypercomputer/maxtext, ``configs/base.yml``) and Flax's
``nnx.with_partitioning`` / ``flax.linen.logical_to_mesh_sharding``.

- **Parameters** carry their names as Flax metadata: ``nnx.with_partitioning(init, ("embed", "mlp"),
  eager_sharding=False)`` (the ``out_sharding`` metadata of the ``nnx.Param``); a :class:`jaxckpt.nnx.Stack` adds
  ``layers`` in front of its stacked parameters. :func:`param_logical_axes` reads them; the state shardings of
  :mod:`jaxckpt.sharding` map them through the table. Parameters without names keep the FSDP rule there.
- **Activations** are constrained where the model says so: :func:`constrain` is ``jax.lax.with_sharding_constraint``
  by logical names under the mesh the step is traced with (``jax.set_mesh``, set by the step core), and the identity
  when no mesh is in context (a step on one device), so models call it unconditionally.
- **FSDP per layer**: inside a remat'd block the block's parameters are gathered over ``fsdp`` only, and their
  gradients reduce-scattered (:mod:`jaxckpt.sharding._gather`).

A dimension that the mapped mesh axes do not divide is left whole (replicated) for that array; the models check the
splits a user would expect to hold (heads over ``tensor``) and say so in one line.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jaxckpt.errors import JaxckptError, LogicalAxisError, closest

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # Activations. The residual stream [B, T, D] is split over the batch only (Megatron-style tensor parallelism keeps
    # it whole on every tensor rank); heads, the MLP hidden width and the vocabulary are split over ``tensor``. The
    # batch is split over ``expert`` too (MaxText's activation_batch): outside its experts an expert axis is data
    # parallel; inside them (the dropping dispatch) the experts are split over it and the batch over the rest, so
    # XLA moves the tokens there and back with all-to-alls (GShard, Lepikhin et al. 2020).
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_batch_no_exp": ("data", "fsdp"),
    "activation_exp": ("expert",),
    "activation_length": (),
    "activation_embed": (),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_head_dim": (),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
    # Parameters. FSDP splits the model width; tensor parallelism the heads, the MLP hidden width and the vocabulary;
    # expert parallelism the experts (MaxText's "exp"; "expert" is taken as the same name).
    "layers": (),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "exp": ("expert",),
    "expert": ("expert",),
    "q_lora": ("fsdp",),
    "kv_lora": ("fsdp",),
    "norm": (),
}
"""Logical axis name -> the mesh axes it is split over, in order (empty: never split). Mesh axes the mesh lacks, or of
size 1, are skipped; a mesh axis already used by an earlier dimension of the same array is not used again."""

LOGICAL_NAMES: tuple[str, ...] = tuple(LOGICAL_RULES)
"""Every logical axis name the table knows."""

BATCH = "activation_batch"
"""The logical name of an activation's batch axis (split over ``data`` and ``fsdp``)."""

GATHERED_AXES: tuple[str, ...] = ("fsdp",)
"""Mesh axes a block's parameters are gathered over inside the block (FSDP); ``tensor`` splits stay."""


def unknown_logical_name(name: str, what: str) -> LogicalAxisError:
  """The one-line error for logical axis name ``name`` found in ``what`` (a parameter's path, ``constrain``…)."""
  hint = closest(name, LOGICAL_NAMES)
  suggestion = f" (did you mean {hint!r}?)" if hint else ""
  return LogicalAxisError(f"unknown logical axis name {name!r} in {what}{suggestion}; valid names: "
                          f"{', '.join(LOGICAL_NAMES)}")


def _check_names(names: Sequence[str | None], what: str) -> None:
  for name in names:
    if name is not None and name not in LOGICAL_RULES:
      raise unknown_logical_name(name, what)


def mesh_axes_of(name: str, *, what: str = "a parameter") -> tuple[str, ...]:
  """The mesh axes logical axis ``name`` is split over (:data:`LOGICAL_RULES`).

  Raises:
    LogicalAxisError: an unknown name, naming ``what`` carried it (one line).
  """
  if name not in LOGICAL_RULES:
    raise unknown_logical_name(name, what)
  return LOGICAL_RULES[name]


def logical_spec(names: Sequence[str | None], mesh_shape: Mapping[str, int], shape: Sequence[int] | None = None, *,
                 drop: Sequence[str] = ()) -> PartitionSpec:
  """The ``PartitionSpec`` of an array whose axes have logical ``names``, on a mesh of ``mesh_shape``.

  Args:
    names: one logical name (a key of :data:`LOGICAL_RULES`) or ``None`` per axis.
    mesh_shape: ``{mesh axis: size}``.
    shape: the array's shape; a dimension the mapped axes' product does not divide is left whole (axes are dropped
      from the end of its list until it divides). ``None``: no divisibility check.
    drop: mesh axes never to use (e.g. ``("fsdp",)`` for a gathered parameter).

  Returns:
    ``PartitionSpec`` with, per axis, ``None``, one mesh axis name or a tuple of them.

  Raises:
    ValueError: an unknown logical name, or ``shape`` of another rank than ``names``.

  Example::

    >>> logical_spec(("embed", "mlp"), {"fsdp": 4, "tensor": 2})
    PartitionSpec('fsdp', 'tensor')
  """
  _check_names(names, "logical_spec")
  if shape is not None and len(shape) != len(names):
    raise ValueError(f"logical names {tuple(names)} name {len(names)} axes of an array of shape {tuple(shape)}")
  used: set[str] = set()
  out: list[Any] = []
  for i, name in enumerate(names):
    axes = [] if name is None else [a for a in LOGICAL_RULES[name]
                                    if mesh_shape.get(a, 1) > 1 and a not in used and a not in drop]
    if shape is not None:
      while axes and shape[i] % math.prod(mesh_shape[a] for a in axes):
        axes.pop()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*out)


def traced_mesh() -> Any:
  """The mesh the current trace runs under (``jax.set_mesh``; an abstract mesh), or ``None`` without one."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def traced_mesh_shape() -> dict[str, int]:
  """``{mesh axis: size}`` of the mesh the current trace runs under (``jax.set_mesh``); ``{}`` without one."""
  mesh = traced_mesh()
  return {} if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}


_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxckpt_traced_platform", default=None)


@contextlib.contextmanager
def tracing_for(platform: str | None):
  """Traces inside this block are for ``platform`` (``"tpu"``, ``"gpu"``) where no mesh in context says otherwise:
  an analysis that traces a step apart from its compile (the saved residuals of a policy) sees the kernels the
  compiled step runs. ``None``: no change."""
  token = _PLATFORM.set(platform) if platform is not None else None
  try:
    yield
  finally:
    if token is not None:
      _PLATFORM.reset(token)


def traced_platform() -> str:
  """The platform the current trace is compiled for: the mesh in context's (``"tpu"`` for a TPU topology's mesh),
  else the one :func:`tracing_for` set, else ``jax.default_backend()``. A kernel that exists on one platform only
  (Pallas TPU or GPU kernels) asks here."""
  mesh = traced_mesh()
  device = None if mesh is None else mesh.abstract_device
  if device is not None:
    return device.platform
  return _PLATFORM.get() or jax.default_backend()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the sharding its logical axis ``names`` map to on the mesh in context; ``x`` itself when no
  mesh is in context or no axis is split (one device, a ``data``-only mesh and a name that maps to nothing).

  Args:
    x: an activation, e.g. ``[B, T, D]``.
    names: one logical name or ``None`` per axis of ``x``, e.g. ``("activation_batch", "activation_length",
      "activation_embed")``.

  Returns:
    ``jax.lax.with_sharding_constraint(x, spec)`` or ``x``.

  Raises:
    ValueError: an unknown name, or as many names as ``x`` has axes not given.
  """
  mesh = traced_mesh()
  if mesh is None:
    _check_names(names, "constrain")
    return x
  spec = logical_spec(names, {str(k): int(v) for k, v in mesh.shape.items()}, x.shape)
  if all(s is None for s in spec):
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def kernel_split(mesh: Mesh | AbstractMesh, batch: int, heads: int, kv_heads: int, *, kernel: str
                 ) -> tuple[tuple[str, ...], str | None]:
  """The mesh axes a per-device attention kernel's call is split over, for ``jax.shard_map``: (the batch's axes, the
  heads' axis or ``None``), by the rules' ``activation_batch`` and ``activation_heads``. A Pallas kernel is a custom
  call the SPMD partitioner cannot split: left unsplit it would run every device on the whole batch.

  Args:
    mesh: the mesh in context (``jax.sharding.get_abstract_mesh()``).
    batch, heads, kv_heads: B, N and K of the call.
    kernel: the kernel's name, for messages.

  Raises:
    JaxckptError: the batch not a multiple of its axes' product; N or K not a multiple of the ``tensor`` size.
  """
  shape = {str(k): int(v) for k, v in mesh.shape.items()}
  batch_axes = tuple(a for a in LOGICAL_RULES["activation_batch"] if shape.get(a, 1) > 1)
  ways = math.prod(shape[a] for a in batch_axes)
  if batch % ways:
    raise JaxckptError(f"the {kernel} kernel splits the batch over {'×'.join(batch_axes)}={ways} of the mesh "
                       f"{shape}, but batch={batch} is not a multiple of it: use a batch size that is, or "
                       "attention='xla'")
  tensor = shape.get("tensor", 1)
  if tensor == 1:
    return batch_axes, None
  if heads % tensor or kv_heads % tensor:
    raise JaxckptError(f"the {kernel} kernel splits heads over the tensor axis, but N={heads} query heads and "
                       f"K={kv_heads} key/value heads are not both multiples of tensor={tensor} (mesh {shape}): use "
                       "a tensor size dividing both, or attention='xla'")
  return batch_axes, "tensor"


def moe_split(mesh: Mesh | AbstractMesh, batch: int, hidden: int) -> tuple[tuple[str, ...], str | None]:
  """The mesh axes a dropless MoE dispatch's ``jax.shard_map`` splits over (:mod:`jaxckpt.models.llm._moe`): (the
  batch's axes, the experts' hidden width's axis or ``None``), by the rules' ``activation_batch`` and ``mlp``. Its
  sort of the tokens by expert must see each device's own tokens only: left to the SPMD partitioner, a sort over the
  batch would gather it.

  Args:
    mesh: the mesh in context.
    batch: B of the call; hidden: the experts' hidden width F.

  Raises:
    JaxckptError: the batch not a multiple of its axes' product; F not a multiple of the ``tensor`` size.
  """
  shape = {str(k): int(v) for k, v in mesh.shape.items()}
  batch_axes = tuple(a for a in LOGICAL_RULES["activation_batch"] if shape.get(a, 1) > 1)
  ways = math.prod(shape[a] for a in batch_axes)
  if batch % ways:
    raise JaxckptError(f"the dropless MoE dispatch splits the batch over {'×'.join(batch_axes)}={ways} of the mesh "
                       f"{shape}, but batch={batch} is not a multiple of it: use a batch size that is")
  tensor = shape.get("tensor", 1)
  if tensor > 1 and hidden % tensor:
    raise JaxckptError(f"the dropless MoE dispatch splits the experts' hidden width over tensor={tensor}, but "
                       f"moe_mlp_dim={hidden} is not a multiple of it (mesh {shape}): use a tensor size dividing it")
  return batch_axes, ("tensor" if tensor > 1 else None)


def param_logical_axes(variable: Any) -> tuple[str | None, ...] | None:
  """The logical axis names a parameter was annotated with (Flax's ``out_sharding`` metadata, as
  ``nnx.with_partitioning`` sets it), or ``None`` for a parameter without names.

  Args:
    variable: an ``nnx.Variable`` (e.g. a leaf of ``nnx.state(model, nnx.Param)`` taken with ``is_leaf``).
  """
  if not isinstance(variable, nnx.Variable):
    return None
  meta = variable.get_metadata()
  names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
  if names is None or isinstance(names, jax.sharding.Sharding):
    return None
  names = tuple(names)
  return names if all(n is None or isinstance(n, str) for n in names) else None
