"""jaxckpt: gradient checkpointing (remat) for JAX/Flax as a choice you can see and measure.

- Policies by name, per block: :func:`parse_policy` (grammar in :mod:`jaxckpt.policies`).
- Your own model, unedited: :func:`apply_remat` (NNX; :mod:`jaxckpt.linen_apply` for Linen) and the names of its
  layers, :func:`checkpoint_names`.
- Remat wrappers and layers: :func:`remat`, :class:`Remat`, :func:`checkpoint`; NNX blocks in :mod:`jaxckpt.layers`
  with checkpoint names from :mod:`jaxckpt.names`; models in :mod:`jaxckpt.models`.
- Compiling so that remat works on CPU too, and compiled memory stats: :func:`jit`, :func:`compile_step`,
  :func:`memory_stats`.
- Train steps and saving the train state (orbax): :mod:`jaxckpt.train`, :class:`TrainStateSaver`
  (``Checkpointer`` is its old name, kept as an alias).
- Sharded and multi-process training (data parallel, FSDP, ``jax.distributed``): :mod:`jaxckpt.sharding`;
  multi-task heads: :mod:`jaxckpt.multitask`.
"""

import sys as _sys

from jaxckpt.remat_impl import check_env as _check_env

if (_problem := _check_env()) is not None:  # before JAX reads JAX_REMAT3 on import (a ValueError traceback there)
  _sys.stderr.write(f"jaxckpt: {_problem}\n")
  raise SystemExit(2)

from jaxckpt import linen, names, sharding
from jaxckpt.apply import apply_remat, checkpoint_names
from jaxckpt.diagnostics import RematPolicyWarning, policy_warnings, warn_policy
from jaxckpt.saving import Checkpointer, DirectoryLock, TrainStateSaver
from jaxckpt.gpt import GPT, GPT_PRESETS, GPTConfig, build_gpt, lm_loss
from jaxckpt.errors import (
    CheckpointError,
    DataError,
    DirectoryInUseError,
    JaxckptError,
    MeshSpecError,
    NonFiniteLossError,
    PolicySpecError,
    StaticArgumentError,
)
from jaxckpt.multitask import AUX_TASKS, MultiTaskClassifier, multitask_loss
from jaxckpt.layers import (
    AttentionBlock,
    ConvBlock,
    MLPBlock,
    RematBlock,
    Stack,
    TransformerBlock,
    block_types,
    set_policy,
)
from jaxckpt.models import MODEL_REGISTRY, MODELS, build_model
from jaxckpt.policies import (
    CANONICAL_POLICIES,
    POLICY_NAMES,
    Budget,
    LayeredPolicy,
    Policy,
    PolicySpec,
    parse_model_policy,
    parse_policy,
)
from jaxckpt.remat import Remat, checkpoint, remat
from jaxckpt.schema import SCHEMA_VERSION, versions
from jaxckpt.sharding import (
    MESH_AXES,
    make_mesh,
    parse_mesh,
    replica_mismatches,
    shard_batch,
    shard_state,
    state_shardings,
)
from jaxckpt.train import (
    TrainState,
    abstract_train_state,
    classification_loss,
    compile_train_step,
    create_train_state,
    make_eval_step,
    make_train_step,
)
from jaxckpt.units import format_bytes, parse_bytes
from jaxckpt.xla import (
    CPU_REMAT_FIX,
    RematIneffectiveWarning,
    compile_step,
    jit,
    memory_stats,
    remat_compiler_options,
)

__version__ = "0.1.0"

__all__ = [
    "linen",
    "names",
    "sharding",
    "apply_remat",
    "checkpoint_names",
    "GPT",
    "GPT_PRESETS",
    "GPTConfig",
    "build_gpt",
    "lm_loss",
    "RematPolicyWarning",
    "policy_warnings",
    "warn_policy",
    "TrainStateSaver",
    "Checkpointer",
    "DirectoryLock",
    "CheckpointError",
    "DirectoryInUseError",
    "DataError",
    "JaxckptError",
    "MeshSpecError",
    "NonFiniteLossError",
    "PolicySpecError",
    "StaticArgumentError",
    "AttentionBlock",
    "ConvBlock",
    "MLPBlock",
    "RematBlock",
    "Stack",
    "TransformerBlock",
    "block_types",
    "set_policy",
    "MODELS",
    "MODEL_REGISTRY",
    "build_model",
    "CANONICAL_POLICIES",
    "POLICY_NAMES",
    "Policy",
    "PolicySpec",
    "LayeredPolicy",
    "Budget",
    "parse_policy",
    "parse_model_policy",
    "Remat",
    "checkpoint",
    "remat",
    "AUX_TASKS",
    "MultiTaskClassifier",
    "multitask_loss",
    "MESH_AXES",
    "make_mesh",
    "parse_mesh",
    "replica_mismatches",
    "shard_batch",
    "shard_state",
    "state_shardings",
    "SCHEMA_VERSION",
    "versions",
    "TrainState",
    "abstract_train_state",
    "classification_loss",
    "compile_train_step",
    "create_train_state",
    "make_eval_step",
    "make_train_step",
    "format_bytes",
    "parse_bytes",
    "CPU_REMAT_FIX",
    "RematIneffectiveWarning",
    "compile_step",
    "jit",
    "memory_stats",
    "remat_compiler_options",
]
