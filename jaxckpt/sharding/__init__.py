"""Sharding: where a train step's arrays live and what it is compiled for.

- **Meshes** (:mod:`~jaxckpt.sharding._mesh`): the ``--mesh`` grammar (``data=4,fsdp=2,tensor=2``), its axes
  :data:`MESH_AXES`, :func:`make_mesh`, and :func:`mesh_shape`, the one helper that gives a mesh's ``{axis: size}``.
- **Logical axis rules** (:mod:`~jaxckpt.sharding._rules`): a model names its axes (``embed``, ``heads``, ``mlp``…)
  and one table, :data:`LOGICAL_RULES`, maps names to mesh axes (MaxText's ``logical_axis_rules``).
- **Tensor plans** (:mod:`~jaxckpt.sharding._tensor_plan`): a ``tensor`` axis for your own model without logical
  names: :class:`TensorPlan` names layers by path, ``colwise`` or ``rowwise`` (PyTorch's ``parallelize_module``
  plans; Megatron-LM's pairs), and writes the rule table's names onto their parameters when the model is built.
- **State and batch shardings** (:mod:`~jaxckpt.sharding._state`): the FSDP rule, state shardings by logical names,
  parameters gathered where the model computes with them (:mod:`~jaxckpt.sharding._gather`: the all-gather, and the
  gradients' reduce-scatter).
- **Multi-process runs** (:mod:`~jaxckpt.sharding._distributed`): ``jax.distributed``, the rows each process feeds,
  replica checks.
- **Chips and topologies** (:mod:`~jaxckpt.sharding._chips`, :mod:`~jaxckpt.sharding._topology`): one table of
  accelerators (TPU chips and NVIDIA GPUs, with each GPU's XLA target config as package data) and the slices or
  clusters of them a step is compiled for without the hardware (``--topology v5e:2x2``, ``--topology h100:32x8``).
- **Placement** (:mod:`~jaxckpt.sharding._placement`): the mesh, the topology and the memory a device may use there
  (a GPU's memory fraction), resolved once at a tool's door (:func:`resolve_placement`).

Implementation modules are private; this face is the public door (``jaxckpt.topology``, the old path of the topology
names, still imports with a ``DeprecationWarning``).
"""

from __future__ import annotations

from jaxckpt.sharding._chips import CHIPS, GPU_CHIPS, TPU_CHIPS, Chip, chip_for_kind
from jaxckpt.sharding._distributed import (PeerWatch, gather, initialize_distributed, process_rows, replica_mismatches,
                                           shard_batch)
from jaxckpt.sharding._mesh import (BATCH_AXES, MESH_AXES, check_batch_size, format_mesh, make_mesh, mesh_device_kind,
                                    mesh_platform, mesh_shape, parse_mesh)
from jaxckpt.sharding._placement import (DEFAULT_MEMORY_FRACTION, MEMORY_FRACTION_ENV, MemoryFraction, Placement,
                                         device_memory, memory_fraction, resolve_placement)
from jaxckpt.sharding._rules import LOGICAL_NAMES, LOGICAL_RULES, constrain, logical_spec, param_logical_axes
from jaxckpt.sharding._tensor_plan import (TENSOR_PLAN_GRAMMAR, TENSOR_STYLES, PlannedParam, TensorPlan,
                                           check_tensor_splits, parse_tensor_plan, planned_params,
                                           tensor_split_sizes)
from jaxckpt.sharding._gather import gather_for_use, gather_params_in_loss, gathered_params
from jaxckpt.sharding._state import (batch_sharding, batch_shardings, fsdp_partition, gathered_in_use_paths,
                                     param_partition, shard_state,
                                     stacked_layer_paths, state_partition_specs, state_shardings, step_shardings)
from jaxckpt.sharding._topology import (CUDA_PLUGIN, TOPOLOGY_FORMS, Topology, TopologyName, check_cuda_plugin,
                                        check_libtpu,
                                        check_topology_name, compiled_for, compiler_name, compiles_only, get_topology,
                                        gpu_axis_links, libtpu_version, parse_topology, required_libtpu,
                                        target_config, topology_header, topology_mesh)

__all__ = [
    # meshes
    "MESH_AXES", "BATCH_AXES", "parse_mesh", "format_mesh", "make_mesh", "mesh_shape", "mesh_platform",
    "mesh_device_kind", "check_batch_size",
    # logical axis rules
    "LOGICAL_RULES", "LOGICAL_NAMES", "logical_spec", "constrain", "param_logical_axes",
    # tensor plans: a tensor axis for a model without logical names
    "TensorPlan", "PlannedParam", "parse_tensor_plan", "TENSOR_PLAN_GRAMMAR", "TENSOR_STYLES", "planned_params",
    "tensor_split_sizes", "check_tensor_splits",
    # state and batch shardings
    "fsdp_partition", "param_partition", "stacked_layer_paths", "gathered_in_use_paths", "state_partition_specs",
    "state_shardings", "batch_sharding", "batch_shardings", "step_shardings", "gathered_params",
    "gather_params_in_loss", "gather_for_use", "shard_state",
    # multi-process
    "process_rows", "shard_batch", "initialize_distributed", "replica_mismatches", "gather", "PeerWatch",
    # chips and topologies
    "Chip", "CHIPS", "GPU_CHIPS", "TPU_CHIPS", "chip_for_kind", "TOPOLOGY_FORMS", "parse_topology", "TopologyName",
    "libtpu_version",
    "required_libtpu", "check_libtpu", "CUDA_PLUGIN", "check_cuda_plugin", "check_topology_name", "compiler_name",
    "target_config", "Topology", "get_topology", "topology_mesh", "topology_header", "gpu_axis_links", "compiled_for",
    "compiles_only",
    # placement: where a step is compiled, the memory a device may use there
    "Placement", "resolve_placement", "memory_fraction", "MemoryFraction", "device_memory", "DEFAULT_MEMORY_FRACTION",
    "MEMORY_FRACTION_ENV",
]
