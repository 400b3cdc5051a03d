"""State and batch shardings: the FSDP rule for parameters and optimizer state, logical-axis shardings, the batch
split, and parameters gathered where the model computes with them.

jaxckpt never writes a collective. It gives every array of the train step a ``NamedSharding`` over a
``jax.sharding.Mesh`` and compiles the step with ``jax.jit(in_shardings=..., out_shardings=...)``; XLA's SPMD
partitioner inserts the all-reduces (data parallel) and all-gathers / reduce-scatters (FSDP) itself (JAX's
"Distributed arrays and automatic parallelization" doc). Remat composes with it: ``jax.checkpoint`` is part of the
traced step, and the partitioner shards the recomputation like the forward pass.

The FSDP rule (:func:`fsdp_partition`; ZeRO stage 3, Rajbhandari et al. 2020; PyTorch FSDP): an array is split along
its **largest dimension whose size is divisible by the ``fsdp`` axis size** (ties: the last such dimension), **never
the scanned layer axis** (axis 0 of the stacked parameters of a :class:`jaxckpt.nnx.Stack`: ``scan`` slices it one
layer per iteration, so sharding it would move whole layers between devices each step). Arrays with no such
dimension (scalars, odd sizes) are replicated. Parameters with logical axis names (:mod:`jaxckpt.sharding._rules`)
are split by the rule table instead. Adam's moments get the sharding of the parameter they belong to; every other
leaf (step counter, PRNG key, optimizer counters) is replicated. Inside the step the model computes with the
parameters all-gathered over ``fsdp`` (:mod:`jaxckpt.sharding._gather`, a sharding constraint): the batch stays split over
every axis and XLA reduce-scatters the gradients back to the parameters' sharding (:mod:`jaxckpt.sharding._gather`).

Memory: ``compiled.memory_analysis()`` of a step compiled under a mesh describes the SPMD-partitioned program, which
is what *each device* runs: its argument / output / temp bytes are per device (checked in the sharding tests:
argument bytes under ``fsdp=8`` are ~1/8 of one device's unsharded ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.sharding._mesh import BATCH_AXES, mesh_shape
from jaxckpt.sharding._rules import logical_spec, param_logical_axes


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


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A pytree key path as strings: ``(DictKey('layers'), SequenceKey(0), GetAttrKey('kernel'))`` →
  ``("layers", "0", "kernel")`` (the parameter path users see, e.g. in ``--tensor-plan`` patterns)."""
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
  module declares, not by its class, so sharding imports no layer (and your own stacks can declare it too). A module
  whose own parameters are stacked declares ``stacked_layers = True`` on the instance: :func:`jaxckpt.apply_remat`
  does so for each block of your model it finds stacked (an ``nnx.vmap`` stack called in ``nnx.scan``).

  Args:
    model: an NNX model (abstract from ``nnx.eval_shape`` is fine).
  """
  out = set()
  for path, module in nnx.iter_modules(model):
    prefix = tuple(str(p) for p in path)
    if isinstance(attr := getattr(type(module), "stacked_layers", None), str):
      out.add(prefix + (attr,))
    elif vars(module).get("stacked_layers") is True:
      out.add(prefix)
  return frozenset(out)


def param_partition(shape: tuple[int, ...], mesh: Mapping[str, int], *, logical: tuple[str | None, ...] | None = None,
                    layer_axis: int | None = None) -> PartitionSpec:
  """The sharding of one parameter (and of its optimizer moments) at rest.

  Args:
    shape: the parameter's shape.
    mesh: ``{mesh axis: size}``.
    logical: its logical axis names (:func:`jaxckpt.sharding._rules.param_logical_axes`), mapped through
      :data:`jaxckpt.sharding._rules.LOGICAL_RULES` (``embed`` over ``fsdp``, ``heads``/``mlp``/``vocab`` over
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
  ``gathered_in_use`` (a tuple of attribute names) and calls :func:`jaxckpt.sharding._gather.gather_param` on them, e.g.
  the LLM family's output weight, gathered per vocabulary chunk inside its ``jax.checkpoint``. The loss does not
  gather them at its start (:func:`jaxckpt.sharding._gather.gather_params_in_loss`).

  Args:
    model: an NNX model (abstract is fine).
  """
  return frozenset(tuple(str(p) for p in path) + (attr,) for path, module in nnx.iter_modules(model)
                   for attr in getattr(type(module), "gathered_in_use", ()) or ())


def _param_specs(params: Any, mesh: Mapping[str, int], stacked: frozenset[tuple[str, ...]]) -> Any:
  def spec(path, leaf):
    names = path_names(path)
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
