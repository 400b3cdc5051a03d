"""Sharded training with remat: a device mesh, the FSDP rule for parameters and optimizer state, batch sharding.

jaxckpt never writes a collective. It gives every array of the train step a ``NamedSharding`` over a
``jax.sharding.Mesh`` and compiles the step with ``jax.jit(in_shardings=..., out_shardings=...)``; XLA's SPMD
partitioner inserts the all-reduces (data parallel) and all-gathers / reduce-scatters (FSDP) itself (JAX's
"Distributed arrays and automatic parallelization" doc). Remat composes with it: ``jax.checkpoint`` is part of the
traced step, and the partitioner shards the recomputation like the forward pass. Because the loss is one global
mean over the *global* batch and the gradient is taken of that one function, there is no per-replica gradient to
synchronise by hand, so the failure mode of PyTorch DDP + gradient checkpointing + a multi-task loss (hooks firing
twice or never, replicas drifting apart) has nothing to act on here; :func:`replica_mismatches` checks it.

Mesh axes (:data:`MESH_AXES`):

- ``data``: the batch is split over it; parameters and optimizer state are replicated over it.
- ``fsdp``: the batch is split over it too, and parameters and optimizer state are split over it by the FSDP rule
  (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch FSDP): every device holds 1/fsdp of each large array and XLA
  gathers a layer's weights when it needs them.

The FSDP rule (:func:`fsdp_partition`): an array is split along its **largest dimension whose size is divisible by
the ``fsdp`` axis size** (ties: the last such dimension), **never the scanned layer axis** (axis 0 of the stacked
parameters of a :class:`jaxckpt.nnx._layers.Stack`: ``scan`` slices it one layer per iteration, so sharding it would
move whole layers between devices each step). Arrays with no such dimension (scalars, odd sizes) are replicated.
Adam's moments get the sharding of the parameter they belong to; every other leaf (step counter, PRNG key,
optimizer counters) is replicated. Inside the step the model computes with the parameters all-gathered over
``fsdp`` (:func:`gathered_params`, a sharding constraint): the batch stays split over every axis and XLA
reduce-scatters the gradients back to the parameters' sharding.

Memory: ``compiled.memory_analysis()`` of a step compiled under a mesh describes the SPMD-partitioned program, which
is what *each device* runs: its argument / output / temp bytes are per device (checked in
``tests/test_sharding.py``: argument bytes under ``fsdp=8`` are ~1/8 of one device's unsharded ones).

Multi-process (:func:`initialize_distributed`): ``jax.distributed.initialize`` with JAX's gloo CPU collectives on
CPU, so N processes on one machine (or N hosts of a GPU/TPU pod slice) form one mesh over all their devices; each
process feeds the rows of the global batch its devices hold (:func:`process_rows`, :func:`shard_batch`).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.core._logical import gather_spec, logical_spec, param_logical_axes
from jaxckpt.errors import MeshSpecError, closest, shorten

__all__ = [
    "MESH_AXES",
    "BATCH_AXES",
    "parse_mesh",
    "format_mesh",
    "make_mesh",
    "mesh_shape",
    "mesh_platform",
    "mesh_device_kind",
    "fsdp_partition",
    "param_partition",
    "stacked_layer_paths",
    "gathered_in_use_paths",
    "state_partition_specs",
    "state_shardings",
    "batch_sharding",
    "batch_shardings",
    "step_shardings",
    "gathered_params",
    "gather_params_in_loss",
    "check_batch_size",
    "shard_state",
    "process_rows",
    "shard_batch",
    "initialize_distributed",
    "replica_mismatches",
    "gather",
]

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
"""Valid mesh axis names: ``data`` (batch split, state replicated), ``fsdp`` (batch and state split), ``tensor``
(Megatron-style tensor parallelism: heads, the MLP hidden width and the vocabulary split, for models whose
parameters carry logical axis names, :mod:`jaxckpt.core._logical`; the batch is not split over it)."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp")
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
    text = str(spec)
    items = []
    for entry in text.split(","):
      match = _ENTRY.match(entry)
      if match is None or not match.group(1):
        raise MeshSpecError(f"bad mesh entry {shorten(entry.strip())!r} in mesh={shorten(text)!r}: write "
                            f"'name=size[,name=size]' with names from {', '.join(MESH_AXES)} (e.g. 'data=4,fsdp=2')")
      items.append((match.group(1), match.group(2)))
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


def fsdp_partition(shape: tuple[int, ...], fsdp_size: int, *, layer_axis: int | None = None) -> PartitionSpec:
  """The FSDP rule for one array: split its largest dimension divisible by ``fsdp_size`` over the ``fsdp`` axis.

  Args:
    shape: the array's shape.
    fsdp_size: size of the mesh's ``fsdp`` axis (1 or absent: everything replicated).
    layer_axis: the scanned layer axis (0 for a :class:`jaxckpt.nnx._layers.Stack`'s parameters), never split;
      ``None`` if the array has none.

  Returns:
    ``PartitionSpec`` with ``"fsdp"`` at the chosen dimension (ties: the last), ``None`` elsewhere; ``P()``
    (replicated) when no dimension qualifies.

  Example::

    >>> fsdp_partition((4, 256, 1024), 8, layer_axis=0)   # a stacked [L, D, F] kernel
    PartitionSpec(None, None, 'fsdp')
  """
  if fsdp_size <= 1:
    return PartitionSpec()
  candidates = [i for i, n in enumerate(shape) if i != layer_axis and n >= fsdp_size and n % fsdp_size == 0]
  if not candidates:
    return PartitionSpec()
  best = max(candidates, key=lambda i: (shape[i], i))
  return PartitionSpec(*("fsdp" if i == best else None for i in range(len(shape))))


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
  out = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        out.append(str(getattr(key, attr)))
        break
  return tuple(out)


def stacked_layer_paths(model: nnx.Module) -> frozenset[tuple[str, ...]]:
  """Path prefixes (in the model's ``nnx.State``) of parameters stacked on a leading layer axis.

  A module declares such parameters by a class attribute ``stacked_layers`` naming the attribute that holds them:
  every :class:`jaxckpt.nnx._layers.Stack` (scanned or unrolled) declares ``stacked_layers = "layers"``, its N blocks'
  parameters stacked on axis 0; that axis is the scanned layer axis the FSDP rule never splits. Found by what the
  module declares, not by its class, so sharding imports no layer (and your own stacks can declare it too).

  Args:
    model: an NNX model (abstract from ``nnx.eval_shape`` is fine).
  """
  return frozenset(tuple(str(p) for p in path) + (attr,) for path, module in nnx.iter_modules(model)
                   if isinstance(attr := getattr(type(module), "stacked_layers", None), str))


def param_partition(shape: tuple[int, ...], mesh: Mapping[str, int], *, logical: tuple[str | None, ...] | None = None,
                    layer_axis: int | None = None) -> PartitionSpec:
  """The sharding of one parameter (and of its optimizer moments) at rest.

  Args:
    shape: the parameter's shape.
    mesh: ``{mesh axis: size}``.
    logical: its logical axis names (:func:`jaxckpt.core._logical.param_logical_axes`), mapped through
      :data:`jaxckpt.core._logical.LOGICAL_RULES` (``embed`` over ``fsdp``, ``heads``/``mlp``/``vocab`` over
      ``tensor``); ``None``: the FSDP rule of :func:`fsdp_partition` (never split over ``tensor``).
    layer_axis: the scanned layer axis of a stacked parameter without names (never split).

  Returns:
    The ``PartitionSpec``.
  """
  if logical is not None and len(logical) == len(shape):
    return logical_spec(logical, mesh, shape)
  return fsdp_partition(shape, mesh.get("fsdp", 1), layer_axis=layer_axis)


def gathered_in_use_paths(model: nnx.Module) -> frozenset[tuple[str, ...]]:
  """Paths (in the model's ``nnx.State``) of parameters a module gathers itself where it uses them: a module declares
  ``gathered_in_use`` (a tuple of attribute names) and calls :func:`jaxckpt.core._logical.gather_param` on them, e.g.
  the LLM family's output weight, gathered per vocabulary chunk inside its ``jax.checkpoint``. The loss does not
  gather them at its start (:func:`gather_params_in_loss`).

  Args:
    model: an NNX model (abstract is fine).
  """
  return frozenset(tuple(str(p) for p in path) + (attr,) for path, module in nnx.iter_modules(model)
                   for attr in getattr(type(module), "gathered_in_use", ()) or ())


def _param_specs(params: Any, mesh: Mapping[str, int], stacked: frozenset[tuple[str, ...]]) -> Any:
  def spec(path, leaf):
    names = _names(path)
    layer_axis = 0 if any(names[:len(p)] == p for p in stacked) else None
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    partition = param_partition(tuple(value.shape), mesh, logical=param_logical_axes(leaf), layer_axis=layer_axis)
    return leaf.replace(partition) if isinstance(leaf, nnx.Variable) else partition

  return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_partition_specs(state: Any, mesh: Mesh | Mapping[str, int], *, params: Any = None,
                          stacked: frozenset[tuple[str, ...]] = frozenset()) -> Any:
  """``PartitionSpec`` of every leaf of a train state under the FSDP rule (module docstring).

  Args:
    state: a :class:`jaxckpt.TrainState` (arrays or ``jax.ShapeDtypeStruct``s), or any pytree with the same idea.
    mesh: the mesh or its ``{axis: size}``.
    params: the parameter subtree (default ``state.params``); every subtree of ``state`` with the same tree
      structure (the parameters themselves, Adam's ``mu`` and ``nu``) gets the parameters' specs.
    stacked: path prefixes of stacked layers (:func:`stacked_layer_paths`), relative to ``params``.

  Returns:
    A pytree of ``PartitionSpec`` shaped like ``state``; everything that is not parameter-shaped is ``P()``.
  """
  params = state.params if params is None else params
  structure = jax.tree.structure(params)
  specs = _param_specs(params, mesh_shape(mesh), stacked)
  is_params = lambda x: jax.tree.structure(x) == structure  # noqa: E731
  return jax.tree.map(lambda x: specs if is_params(x) else PartitionSpec(), state, is_leaf=is_params)


def state_shardings(state: Any, mesh: Mesh, *, model: nnx.Module | None = None, params: Any = None) -> Any:
  """``NamedSharding`` of every leaf of a train state: parameters and Adam moments by the FSDP rule, rest replicated.

  Args:
    state: a :class:`jaxckpt.TrainState` (arrays or ``jax.ShapeDtypeStruct``s).
    mesh: the device mesh (:func:`make_mesh`).
    model: the NNX model the state was split from (abstract is fine), to find the stacked layer axes; ``None``:
      no array has a layer axis.
    params: the parameter subtree, default ``state.params``.

  Returns:
    A pytree of ``NamedSharding`` shaped like ``state`` (use as ``in_shardings``/``out_shardings``).
  """
  stacked = stacked_layer_paths(model) if model is not None else frozenset()
  specs = state_partition_specs(state, mesh, params=params, stacked=stacked)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Sharding of one batch array of rank ``ndim``: axis 0 split over the mesh's :data:`BATCH_AXES`, rest whole."""
  axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
  return NamedSharding(mesh, PartitionSpec(axes if axes else None, *([None] * (ndim - 1))))


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
  """``NamedSharding`` of every array of a batch pytree (arrays or ``ShapeDtypeStruct``s), axis 0 = examples."""
  return jax.tree.map(lambda a: batch_sharding(mesh, len(a.shape)), batch)


def step_shardings(state: Any, batch: Any, mesh: Mesh, *, model: nnx.Module | None = None,
                   params: Any = None) -> dict[str, Any]:
  """``jax.jit`` keyword arguments that shard a train step ``step(state, batch) -> (state, metrics)`` over ``mesh``.

  Args:
    state: the train state (arrays or ``ShapeDtypeStruct``s).
    batch: one batch (arrays or ``ShapeDtypeStruct``s), axis 0 = examples.
    mesh: the device mesh.
    model: the model the state comes from (finds the scanned layer axes); see :func:`state_shardings`.
    params: the parameter subtree of ``state`` (default ``state.params``; e.g. ``state["params"]`` for a dict).

  Returns:
    ``{"in_shardings": (state, batch), "out_shardings": (state, metrics replicated)}``: the new state keeps the
    old one's sharding (so donation reuses its buffers); pass to :func:`jaxckpt.compile_step` or ``jax.jit``.

  Example::

    >>> compiled = jaxckpt.compile_train_step(step, state, batch, **step_shardings(state, batch, mesh, model=model))
  """
  states = state_shardings(state, mesh, model=model, params=params)
  return {"in_shardings": (states, batch_shardings(batch, mesh)),
          "out_shardings": (states, NamedSharding(mesh, PartitionSpec()))}


def gathered_params(params: Any, mesh: Mesh) -> Any:
  """The parameters as the step computes with them: all-gathered over ``fsdp`` (replicated), by a sharding
  constraint — XLA inserts the all-gather, and its transpose, a reduce-scatter of the gradients, itself.

  Why: with only the inputs' shardings given, XLA's sharding propagation lets the FSDP-split weight dimension
  spread into the activations (a matmul of a batch-split ``x`` by an ``F``-split ``W`` must give up one of the two),
  and parts of the model then run on the whole batch on every device. Measured on the GPT ``small`` train step
  under ``fsdp=8``: temp 286.6 MiB per device without the constraint, 119.0 MiB with it (``data=8``: 100.7 MiB).
  Parameters and optimizer state stay split at rest (arguments 1/8); during the step each device holds the full
  parameters and their gradients transiently: one FSDP unit wrapping the whole model (PyTorch FSDP without an
  auto-wrap policy). A no-op for a ``data``-only mesh, whose parameters are replicated anyway.

  Args:
    params: pytree of arrays (e.g. an ``nnx.State`` of parameters), inside a jitted function.
    mesh: the device mesh.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), params)


def gather_params_in_loss(loss_fn: Callable[..., Any], mesh: Mesh | None) -> Callable[..., Any]:
  """Wraps a :data:`jaxckpt.training._train.LossFn` so the model computes with its parameters gathered over ``fsdp``.

  Parameters outside layer stacks (embeddings, final norms, heads) are gathered once, at the start of the loss
  (a sharding constraint: XLA inserts the all-gather and, for the gradients, the reduce-scatter). Parameters of a
  layer stack (:func:`stacked_layer_paths`: a :class:`jaxckpt.nnx.Stack`, or your own module that declares
  ``stacked_layers``) are not: each block gathers its own layer inside its ``jax.checkpoint``
  (:func:`jaxckpt.core._logical.gather_block_state`), one layer at a time, and again in the backward pass — FSDP
  per layer, as MaxText's scanned decoder does, so a chip holds one gathered layer and not the stack. Splits over
  ``tensor`` stay (only ``fsdp`` is gathered).

  Args:
    loss_fn: ``loss_fn(model, batch, *, dropout_key, deterministic) -> (loss, metrics)``.
    mesh: the device mesh; ``None`` returns ``loss_fn`` itself.

  Returns:
    The same loss (same value, same gradients); non-parameter state the loss updates is written back to ``model``.
  """
  if mesh is None:
    return loss_fn
  shape = mesh_shape(mesh)

  def loss(model, batch, **kwargs):
    stacked = stacked_layer_paths(model) | gathered_in_use_paths(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def gather(path, leaf):
      names = _names(path)
      if shape.get("fsdp", 1) <= 1 or any(names[:len(p)] == p for p in stacked):
        return leaf
      value = leaf.get_value()
      spec = gather_spec(param_logical_axes(leaf), value.shape, shape)
      return leaf.replace(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec)))

    params = jax.tree_util.tree_map_with_path(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    gathered = nnx.merge(graphdef, params, rest)
    out = loss_fn(gathered, batch, **kwargs)
    nnx.update(model, nnx.state(gathered, nnx.Not(nnx.Param)))
    return out

  return loss


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


def _put(leaf: Any, sharding: NamedSharding) -> jax.Array:
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    data = _put(jax.random.key_data(leaf), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
  if sharding.is_fully_addressable:
    return jax.device_put(leaf, sharding)
  return jax.device_put(np.asarray(leaf), sharding)  # the same host value in every process; each keeps its shards


def shard_state(state: Any, shardings: Any) -> Any:
  """Places a train state (the same values in every process, e.g. initialised from the same seed) on the mesh.

  Args:
    state: pytree of arrays (typed PRNG keys included).
    shardings: pytree of ``NamedSharding`` shaped like ``state`` (:func:`state_shardings`).

  Returns:
    The state as global ``jax.Array``s; each device holds only its shards.
  """
  return jax.tree.map(_put, state, shardings)


def process_rows(global_batch_size: int, mesh: Mesh) -> slice:
  """The rows of the global batch this process's devices hold (what it must feed), as a slice of axis 0.

  Args:
    global_batch_size: examples per step over all processes.
    mesh: the mesh.

  Raises:
    MeshSpecError: the batch does not split over the mesh, or this process's rows are not contiguous (a mesh
      whose device order interleaves processes on the batch axes).
  """
  check_batch_size(global_batch_size, mesh)
  sharding = batch_sharding(mesh)
  spans = sorted({(i[0].start or 0, global_batch_size if i[0].stop is None else i[0].stop)
                  for i in sharding.addressable_devices_indices_map((global_batch_size,)).values()})
  start, stop = spans[0][0], spans[-1][1]
  if sum(b - a for a, b in spans) != stop - start:
    raise MeshSpecError(f"process {jax.process_index()}'s devices hold non-contiguous batch rows {spans} under "
                        f"mesh={format_mesh(mesh)!r}")
  return slice(start, stop)


def shard_batch(batch: Any, mesh: Mesh, *, global_batch_size: int, local: bool = False) -> Any:
  """Turns host batch arrays into global ``jax.Array``s split over the batch axes.

  Args:
    batch: pytree of host arrays ``[B, ...]`` (the global batch) or, with ``local=True``, ``[B_p, ...]`` = the
      rows :func:`process_rows` names for this process.
    mesh: the mesh.
    global_batch_size: B, examples per step over all processes.
    local: ``batch`` holds only this process's rows.

  Returns:
    The global batch; each process transferred only its own rows
    (``jax.make_array_from_process_local_data``).

  Raises:
    MeshSpecError: B does not split over the mesh.
  """
  rows = process_rows(global_batch_size, mesh)

  def put(a):
    a = np.asarray(a)
    local_rows = a if local else a[rows]
    return jax.make_array_from_process_local_data(batch_sharding(mesh, a.ndim), local_rows,
                                                  (global_batch_size, *a.shape[1:]))

  return jax.tree.map(put, batch)


INIT_TIMEOUT_S = 120
"""Seconds a process waits for the others (and for the coordinator) in :func:`initialize_distributed`."""


def initialize_distributed(coordinator: str, *, num_processes: int, process_id: int) -> None:
  """Joins a multi-process JAX run: ``jax.distributed.initialize`` (gloo collectives on CPU).

  Call it before anything touches a JAX device. On CPU it selects JAX's gloo collectives
  (``jax_cpu_collectives_implementation``) so processes on one machine can all-reduce; on GPU/TPU JAX picks NCCL /
  ICI itself. Calling it again with the same settings is a no-op.

  Args:
    coordinator: ``HOST:PORT`` of process 0 (it listens there; the others connect).
    num_processes: N ≥ 1.
    process_id: this process, 0..N−1.

  Raises:
    MeshSpecError: a malformed ``coordinator``, ``num_processes`` < 1, ``process_id`` out of range, a second
      call with other settings, or the processes not all joining within :data:`INIT_TIMEOUT_S` seconds.
  """
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise MeshSpecError(f"bad coordinator={shorten(coordinator)!r}: write 'HOST:PORT', e.g. 'localhost:12345'")
  if num_processes < 1:
    raise MeshSpecError(f"num_processes={num_processes} must be ≥ 1")
  if not 0 <= process_id < num_processes:
    raise MeshSpecError(f"process_id={process_id} is out of range for num_processes={num_processes}: "
                        f"valid ids are 0..{num_processes - 1}")
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
      raise MeshSpecError(f"this process already joined a run as process {jax.process_index()} of "
                          f"{jax.process_count()}; cannot rejoin as {process_id} of {num_processes}")
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  print(f"process {process_id} of {num_processes}: joining the run at {coordinator} (waits up to "
        f"{INIT_TIMEOUT_S} s for the other processes)", file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=INIT_TIMEOUT_S)
  except Exception as err:  # noqa: BLE001 - JAX raises runtime errors of several types on a failed join
    raise MeshSpecError(f"process {process_id} could not join the run at {coordinator} within {INIT_TIMEOUT_S} s "
                        f"(are all {num_processes} processes started with the same coordinator?): "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None


def replica_mismatches(tree: Any) -> list[str]:
  """Names the arrays whose replicas differ between this process's devices (all in sync: ``[]``).

  Every device holding the same slice of an array (a replica, e.g. each ``data`` rank's copy of a parameter) must
  hold the same bytes; this is the check a DDP gradient-synchronisation bug would fail.

  Args:
    tree: pytree of ``jax.Array`` (e.g. ``state.params``).

  Returns:
    One ``"path: slice"`` line per array slice whose copies are not bit-identical.
  """
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    copies: dict[str, np.ndarray] = {}
    for shard in leaf.addressable_shards:
      key = str(shard.index)
      data = np.asarray(shard.data)
      if key in copies and not np.array_equal(copies[key], data):
        bad.append(f"{'/'.join(_names(path))}: {key}")
      copies.setdefault(key, data)
  return bad


def gather(tree: Any) -> Any:
  """The full value of every array on the host (numpy), also when its shards live in other processes.

  Uses ``jax.experimental.multihost_utils.process_allgather`` for arrays not fully addressable here (every process
  must call it), ``jax.device_get`` for the rest.
  """
  from jax.experimental import multihost_utils

  def one(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return jax.device_get(leaf)

  return jax.tree.map(one, tree)
