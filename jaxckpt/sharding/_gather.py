"""FSDP's gather and its transpose: parameters all-gathered over ``fsdp`` where the model computes with them, and
their gradients **reduce-scattered** back to each device's shard.

A sharding constraint to the gathered spec (``jax.lax.with_sharding_constraint(w, P())``) makes XLA's SPMD
partitioner all-gather ``w``; but JAX transposes a sharding constraint into the same constraint on the cotangent, so
the gradient of ``w`` would be constrained to the gathered spec too, and the partitioner all-reduces it whole over
every device of the mesh before slicing each device's shard (measured in the compiled step of an FSDP mesh: per
layer, every weight gradient all-reduced whole over ``data × fsdp``, no reduce-scatter). :func:`gather_for_use` is
the gather with the transpose FSDP means (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch FSDP; MaxText's scanned
decoder, whose weights the partitioner gathers at their use): a ``jax.custom_vjp`` whose forward constrains the
value to its gathered spec (the all-gather) and whose backward constrains the cotangent to the parameter's spec at
rest (:func:`rest_spec`): the partial sums of the gradient are reduce-scattered over ``fsdp``, and only that shard is
all-reduced over the other batch axes (``data``). An all-reduce moves twice the bytes of a reduce-scatter per device
(a ring: ``2(n-1)/n`` against ``(n-1)/n`` of the array), and over ``data × fsdp`` the whole gradient would cross the
network.

Where the gathers stand:
- **Per block** (:func:`gather_block_state`): inside a remat'd block's ``jax.checkpoint`` (and, for the policy
  ``none``, inside a ``jax.checkpoint(nothing_saveable)`` of the gather alone), so a device holds one gathered layer at
  a time and the backward pass gathers again (FSDP re-gathers, as MaxText's scanned decoder does).
- **Once per step** (:func:`gather_params_in_loss`): parameters outside layer stacks (embeddings, final norms, heads)
  at the start of the loss; :func:`gathered_params` for a loss over plain parameter arrays.
- **Per use** (:func:`gather_param`): a parameter whose module declares ``gathered_in_use`` gathers itself where its
  code uses it (the LLM family's output projection per vocabulary chunk).

``tensor`` splits stay in every case: only ``fsdp`` is gathered (:func:`gather_spec`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxckpt.sharding._mesh import mesh_shape
from jaxckpt.sharding._rules import (BATCH, GATHERED_AXES, logical_spec, param_logical_axes, traced_mesh,
                                    traced_mesh_shape)
from jaxckpt.sharding._state import gathered_in_use_paths, param_partition, path_names, stacked_layer_paths


def _per_layer(names: Sequence[str | None] | None, shape: Sequence[int]) -> tuple[str | None, ...] | None:
  """``names`` of one layer's slice of a stacked parameter (without its leading ``layers``), ``None`` when the names do
  not describe ``shape``."""
  if names is None:
    return None
  names = tuple(names)
  if len(names) == len(shape) + 1 and names[0] == "layers":
    names = names[1:]
  return names if len(names) == len(shape) else None


def gather_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh_shape: Mapping[str, int]
                ) -> PartitionSpec:
  """The sharding a block computes with: its parameter's own sharding without the FSDP axis (gathered over ``fsdp``,
  still split over ``tensor``); a parameter without logical names is gathered whole (replicated).

  Args:
    names: the parameter's logical names (:func:`~jaxckpt.sharding.param_logical_axes`) or ``None``.
    shape: its shape (per layer: without a stack's ``layers`` axis).
    mesh_shape: ``{mesh axis: size}``.

  Returns:
    The ``PartitionSpec``.
  """
  names = _per_layer(names, shape)
  if names is None:
    return PartitionSpec()
  return logical_spec(names, mesh_shape, shape, drop=GATHERED_AXES)


def rest_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh_shape: Mapping[str, int]
              ) -> PartitionSpec:
  """The sharding of a parameter (or one layer's slice of a stacked one) at rest, as the train state holds it
  (:func:`~jaxckpt.sharding.param_partition`): what its gradient is reduce-scattered to.

  A stacked parameter's slice gets the spec of the stack without its layer axis: the FSDP rule never splits the layer
  axis, and picks the same dimension of the slice (the largest divisible by ``fsdp``, ties the last).

  Args:
    names: the parameter's logical names or ``None`` (the FSDP rule).
    shape: its shape (per layer: without a stack's ``layers`` axis).
    mesh_shape: ``{mesh axis: size}``.

  Returns:
    The ``PartitionSpec``.
  """
  return param_partition(tuple(shape), mesh_shape, logical=_per_layer(names, shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(value: jax.Array, use: NamedSharding, rest: NamedSharding) -> jax.Array:
  return jax.lax.with_sharding_constraint(value, use)


def _gathered_fwd(value: jax.Array, use: NamedSharding, rest: NamedSharding) -> tuple[jax.Array, None]:
  return jax.lax.with_sharding_constraint(value, use), None


def _gathered_bwd(use: NamedSharding, rest: Any, _: None, cotangent: jax.Array) -> tuple[jax.Array]:
  for sharding in (rest if isinstance(rest, tuple) else (rest,)):
    cotangent = jax.lax.with_sharding_constraint(cotangent, sharding)
  return (cotangent,)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gather_for_use(value: jax.Array, names: Sequence[str | None] | None, mesh: Mesh | AbstractMesh | None = None, *,
                   lookup: bool = False) -> jax.Array:
  """``value`` all-gathered over ``fsdp`` for use; its gradient reduce-scattered back to its shard (module docstring).

  Forward: ``value`` constrained to :func:`gather_spec` (``tensor`` splits kept). Backward: the cotangent constrained
  to :func:`rest_spec`, so XLA's SPMD partitioner reduce-scatters the gradient's partial sums over ``fsdp`` and
  all-reduces only the shard over ``data``, where a plain ``with_sharding_constraint`` would all-reduce the whole
  gradient over every device. Values and gradients are those of ``value`` itself (an identity).

  A lookup table (``lookup=True``: an embedding that ``jnp.take`` indexes) gets its gradient by a scatter-add of
  the batch's rows, which XLA's partitioner cannot turn into a reduce-scatter: constrained straight to the table's
  spec on a mesh with ``data`` and ``fsdp`` axes, it replicates the whole cotangent of the lookup ("Involuntary full
  rematerialization" in the compiler's log), and constrained to the gathered spec it all-reduces the whole table over
  every device. With ``lookup`` the cotangent is first constrained to the table's spec with its ``fsdp`` dimension
  split over every batch axis (an all-to-all of the lookup's cotangent, then the scatter into a shard of the table),
  then to its spec at rest (an all-gather over ``data`` of that shard).

  Args:
    value: a parameter's array, any shape and dtype (a stacked parameter's per-layer slice inside a scan body).
    names: its logical names (``("embed", "mlp")``, a stack's ``("layers", ...)`` included) or ``None``.
    mesh: the mesh (concrete or abstract); default the mesh the trace runs under (``jax.set_mesh``).
    lookup: ``value`` is a table that the model indexes (``jnp.take``, ``nnx.Embed``) rather than multiplies.

  Returns:
    ``value`` (same shape and dtype), or ``value`` itself when there is no mesh or no ``fsdp`` axis > 1.
  """
  mesh = traced_mesh() if mesh is None else mesh
  if mesh is None:
    return value
  shape = {str(k): int(v) for k, v in mesh.shape.items()}  # a concrete or an abstract mesh
  if shape.get("fsdp", 1) <= 1:
    return value
  use = NamedSharding(mesh, gather_spec(names, value.shape, shape))
  rest = NamedSharding(mesh, rest_spec(names, value.shape, shape))
  if use.spec == rest.spec:
    return value
  if lookup:
    spread = _spread_spec(rest.spec, value.shape, shape)
    if spread is not None:
      return _gathered(value, use, (NamedSharding(mesh, spread), rest))
  return _gathered(value, use, rest)


def _spread_spec(spec: PartitionSpec, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> PartitionSpec | None:
  """``spec`` with its ``fsdp`` dimension split over every batch axis of the mesh instead (``data``, ``fsdp``,
  ``expert``, the activations' batch order), or ``None`` where that is ``spec`` itself or the dimension does not
  divide: the spec a lookup table's gradient is first constrained to (:func:`gather_for_use`'s ``lookup``)."""
  batch = tuple(a for a in ("data", "fsdp", "expert") if mesh_shape.get(a, 1) > 1)
  parts = list(spec) + [None] * (len(shape) - len(spec))
  for i, p in enumerate(parts):
    axes = p if isinstance(p, tuple) else (p,)
    if "fsdp" in axes:
      new = batch if set(axes) == {"fsdp"} else None
      if new is None or len(new) == 1 or shape[i] % math.prod(mesh_shape[a] for a in new):
        return None
      parts[i] = new
      return PartitionSpec(*parts)
  return None


_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxckpt_batch_rows", default=None)


@contextlib.contextmanager
def batch_rows(rows: int | None):
  """Inside this block the loss runs on a batch of ``rows`` examples (a micro-batch under accumulation):
  :func:`constrain_batch` then knows which arrays are activations split over the batch axes. ``None``: no change."""
  token = _ROWS.set(rows) if rows is not None else None
  try:
    yield
  finally:
    if token is not None:
      _ROWS.reset(token)


def constrain_batch(tree: Any) -> Any:
  """Every array of ``tree`` whose leading dimension is the batch of the loss in context (:func:`batch_rows`)
  constrained to the batch axes of the mesh in context (``activation_batch``: ``data``, ``fsdp``, ``expert``); the
  rest, and everything without a mesh or a batch in context, as they are.

  Blocks call this on their inputs and outputs (:func:`jaxckpt.core.module_call`): with their parameters gathered per
  layer inside a scan, XLA's sharding propagation otherwise may give the scan's carry another sharding than the
  batch's (measured on an own ``nnx.scan`` decoder under ``fsdp=8``: every device ran the whole batch, 3.9× the
  temporaries), the constraint MaxText puts on every layer's input (its ``activation_batch``).

  Args:
    tree: a pytree of arrays (a block's arguments or output).

  Returns:
    The same tree, the batch arrays constrained.
  """
  rows, mesh = _ROWS.get(), traced_mesh()
  if rows is None or mesh is None:
    return tree
  shape = {str(k): int(v) for k, v in mesh.shape.items()}

  def constrain(x):
    if not isinstance(x, jax.Array) or not x.ndim or x.shape[0] != rows:
      return x
    spec = logical_spec((BATCH,) + (None,) * (x.ndim - 1), shape, x.shape)
    return x if spec[0] is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return jax.tree.map(constrain, tree)


def gathering() -> bool:
  """Whether blocks gather their parameters now: a mesh is in context and its ``fsdp`` axis has size > 1."""
  return traced_mesh_shape().get("fsdp", 1) > 1


def gather_param(value: jax.Array, names: Sequence[str | None] | None, *, lookup: bool = False) -> jax.Array:
  """One parameter gathered over ``fsdp`` where it is used (:func:`gather_for_use`): for a parameter whose module
  declares ``gathered_in_use`` (so the loss does not gather it at its start) and that its code uses inside a
  ``jax.checkpoint`` or a loop, e.g. the output projection of each vocabulary chunk, so a device holds the gathered
  weight during that chunk only. ``value`` itself without an ``fsdp`` axis in context.

  Args:
    value: the parameter's array (sharded at rest).
    names: its logical names (``("embed", "vocab")``), or ``None`` (gathered whole).
    lookup: ``value`` is a table the code indexes (an embedding), see :func:`gather_for_use`.
  """
  if not gathering():
    return value
  return gather_for_use(value, names, lookup=lookup)


def _gather_leaf(leaf: Any, mesh: Mesh | AbstractMesh | None, *, lookup: bool = False) -> Any:
  if not isinstance(leaf, nnx.Param):
    return leaf
  value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
  if not hasattr(value, "shape"):
    return leaf
  return leaf.replace(gather_for_use(value, param_logical_axes(leaf), mesh, lookup=lookup))


def lookup_paths(model: nnx.Module) -> frozenset[tuple[str, ...]]:
  """Paths (in the model's ``nnx.State``) of the tables of its ``nnx.Embed`` modules: parameters the model indexes,
  whose gradients :func:`gather_params_in_loss` transposes as lookups (:func:`gather_for_use`'s ``lookup``)."""
  return frozenset(tuple(str(p) for p in path) + ("embedding",) for path, module in nnx.iter_modules(model)
                   if isinstance(module, nnx.Embed))


def gather_block_state(state: Any) -> Any:
  """A block's ``nnx.State`` with every parameter gathered over ``fsdp`` (:func:`gather_for_use`): what the block
  computes with inside its ``jax.checkpoint``, so the all-gather runs per block and again in the backward pass, and
  each parameter's gradient is reduce-scattered to its shard.

  Non-parameter leaves are returned as they are; without an ``fsdp`` axis in context, ``state`` itself.

  Args:
    state: ``nnx.State`` of one block (a scan body's slice of a stack: no ``layers`` axis).

  Returns:
    The same tree, parameters gathered.
  """
  mesh = traced_mesh()
  if mesh is None or not gathering():
    return state
  return jax.tree.map(lambda leaf: _gather_leaf(leaf, mesh), state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def gathered_params(params: Any, mesh: Mesh) -> Any:
  """The parameters as the step computes with them: all-gathered over ``fsdp`` (:func:`gather_for_use`, each array by
  the FSDP rule), their gradients reduce-scattered back to the shards.

  Why: with only the inputs' shardings given, XLA's sharding propagation lets the FSDP-split weight dimension
  spread into the activations (a matmul of a batch-split ``x`` by an ``F``-split ``W`` must give up one of the two),
  and parts of the model then run on the whole batch on every device. Measured on the GPT ``small`` train step
  under ``fsdp=8``: temp 286.6 MiB per device without the constraint, 119.0 MiB with it (``data=8``: 100.7 MiB).
  Parameters and optimizer state stay split at rest (arguments 1/8); during the step each device holds the full
  parameters transiently: one FSDP unit wrapping the whole model (PyTorch FSDP without an auto-wrap policy). A no-op
  for a mesh without an ``fsdp`` axis, whose parameters are replicated anyway.

  Args:
    params: pytree of arrays (e.g. an ``nnx.State`` of parameters, or plain arrays), inside a jitted function.
    mesh: the device mesh.

  Returns:
    The same tree (same values).
  """
  def gather(leaf):
    if isinstance(leaf, nnx.Variable):
      return _gather_leaf(leaf, mesh)
    return gather_for_use(leaf, None, mesh) if hasattr(leaf, "shape") else leaf

  return jax.tree.map(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def gather_params_in_loss(loss_fn: Callable[..., Any], mesh: Mesh | None) -> Callable[..., Any]:
  """Wraps a :data:`jaxckpt.training.LossFn` so the model computes with its parameters gathered over ``fsdp``.

  Parameters outside layer stacks (embeddings, final norms, heads) are gathered once, at the start of the loss
  (:func:`gather_for_use`: the all-gather, and for the gradients the reduce-scatter). Parameters of a layer stack
  (:func:`~jaxckpt.sharding.stacked_layer_paths`: a :class:`jaxckpt.nnx.Stack`, or your own module that declares
  ``stacked_layers``) are not: each block gathers its own layer inside its ``jax.checkpoint``
  (:func:`gather_block_state`), one layer at a time, and again in the backward pass — FSDP per layer, as MaxText's
  scanned decoder does, so a device holds one gathered layer and not the stack. Splits over ``tensor`` stay (only
  ``fsdp`` is gathered).

  Args:
    loss_fn: ``loss_fn(model, batch, *, dropout_key, deterministic) -> (loss, metrics)``.
    mesh: the device mesh; ``None`` returns ``loss_fn`` itself.

  The loss runs with its batch size in context (:func:`batch_rows`), so blocks keep their activations split over the
  batch axes (:func:`constrain_batch`).

  Returns:
    The same loss (same value, same gradients); non-parameter state the loss updates is written back to ``model``.
  """
  if mesh is None:
    return loss_fn
  shape = mesh_shape(mesh)

  def loss(model, batch, **kwargs):
    stacked = stacked_layer_paths(model) | gathered_in_use_paths(model)
    tables = lookup_paths(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def gather(path, leaf):
      names = path_names(path)
      if shape.get("fsdp", 1) <= 1 or any(names[:len(p)] == p for p in stacked):
        return leaf
      return _gather_leaf(leaf, mesh, lookup=names in tables)

    params = jax.tree_util.tree_map_with_path(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    gathered = nnx.merge(graphdef, params, rest)
    rows = {a.shape[0] for a in jax.tree.leaves(batch) if getattr(a, "ndim", 0)}
    with batch_rows(rows.pop() if len(rows) == 1 else None):
      out = loss_fn(gathered, batch, **kwargs)
    nnx.update(model, nnx.state(gathered, nnx.Not(nnx.Param)))
    return out

  return loss
