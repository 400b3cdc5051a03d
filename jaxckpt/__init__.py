"""jaxckpt: gradient checkpointing (remat) for JAX/Flax as a choice you can see and measure.

- Policies by name, per block: :func:`parse_policy` (grammar in :mod:`jaxckpt.policies`).
- Your own model, unedited: :func:`apply_remat` (NNX; :mod:`jaxckpt.linen.apply` for Linen) and the names of its
  layers, :func:`checkpoint_names`.
- Remat wrappers and layers: :func:`remat`, :class:`Remat`, :func:`checkpoint`; NNX blocks in :mod:`jaxckpt.nnx.layers`
  with checkpoint names from :mod:`jaxckpt.core.names`; models in :mod:`jaxckpt.models`.
- Compiling so that remat works on CPU too, and compiled memory stats: :func:`jit`, :func:`compile_step`,
  :func:`memory_stats`.
- Train steps and saving the train state (orbax): :mod:`jaxckpt.training.train`, :class:`TrainStateSaver`
  (``Checkpointer`` is its old name, kept as an alias).
- Sharded and multi-process training (data parallel, FSDP, ``jax.distributed``): :mod:`jaxckpt.training.sharding`;
  multi-task heads: :mod:`jaxckpt.models.multitask`.
- Compiling for a TPU without a TPU (``topology="v5e:2x2"`` on every tool): :func:`get_topology`,
  :func:`topology_mesh`, the chip table :data:`CHIPS` (:mod:`jaxckpt.training.topology`).

The folders, bottom up (imports run one way; ``tests/test_architecture.py`` checks it): ground modules
(:mod:`~jaxckpt.errors`, :mod:`~jaxckpt.units`, :mod:`~jaxckpt.schema`, :mod:`~jaxckpt.cli`) → :mod:`jaxckpt.analysis`
(jaxprs, FLOPs, residuals) → :mod:`jaxckpt.policies` → :mod:`jaxckpt.core` (framework-free remat) → the two
front-ends :mod:`jaxckpt.nnx` and :mod:`jaxckpt.linen` → :mod:`jaxckpt.training` → :mod:`jaxckpt.models` →
:mod:`jaxckpt.step` (the train step every tool compiles) → :mod:`jaxckpt.planner` → :mod:`jaxckpt.report`.

Modules that moved in the layout change (``jaxckpt.layers`` → :mod:`jaxckpt.nnx.layers`, ``jaxckpt.train`` →
:mod:`jaxckpt.training.train`, …) still import from their old paths; using a name through an old path warns
(``DeprecationWarning``) with the new one. The table is :data:`MOVED_MODULES`.
"""

import importlib
import sys
import types
import warnings

from jaxckpt.errors import EnvSettingError as _EnvSettingError
from jaxckpt.remat_impl import check_env as _check_env

if (_problem := _check_env()) is not None:  # before JAX reads JAX_REMAT3 on import (a ValueError traceback there)
  raise _EnvSettingError(_problem)  # a library raises; the CLIs turn it into one line and exit 2 (jaxckpt.cli)

from jaxckpt import linen
from jaxckpt.core import names
from jaxckpt.training import sharding
from jaxckpt.nnx.apply import apply_remat, checkpoint_names
from jaxckpt.core.diagnostics import RematPolicyWarning, policy_warnings, warn_policy
from jaxckpt.training.saving import Checkpointer, DirectoryLock, TrainStateSaver
from jaxckpt.models.gpt import GPT, GPT_PRESETS, GPTConfig, build_gpt, lm_loss
from jaxckpt.errors import (
    CheckpointError,
    DataError,
    DirectoryInUseError,
    JaxckptError,
    MeshSpecError,
    NonFiniteLossError,
    TopologyError,
    PolicySpecError,
    StaticArgumentError,
)
from jaxckpt.models.multitask import AUX_TASKS, MultiTaskClassifier, multitask_loss
from jaxckpt.nnx.layers import (
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
from jaxckpt.core.remat import Remat, checkpoint, remat
from jaxckpt.step.targets import linen_model_target
from jaxckpt.schema import SCHEMA_VERSION, versions
from jaxckpt.training.sharding import (
    MESH_AXES,
    make_mesh,
    parse_mesh,
    replica_mismatches,
    shard_batch,
    shard_state,
    state_shardings,
)
from jaxckpt.training.topology import CHIPS, Chip, Topology, get_topology, topology_mesh
from jaxckpt.training.train import (
    TrainState,
    abstract_train_state,
    classification_loss,
    compile_train_step,
    create_train_state,
    make_eval_step,
    make_train_step,
    plain_loss_fn,
)
from jaxckpt.units import format_bytes, parse_bytes
from jaxckpt.training.xla import (
    CPU_REMAT_FIX,
    RematIneffectiveWarning,
    compile_step,
    jit,
    memory_stats,
    remat_compiler_options,
)

__version__ = "0.1.0"

MOVED_MODULES: dict[str, str] = {
    "jaxckpt.remat": "jaxckpt.core.remat",
    "jaxckpt.blocks": "jaxckpt.core.blocks",
    "jaxckpt.structure": "jaxckpt.core.structure",
    "jaxckpt.autonames": "jaxckpt.core.autonames",
    "jaxckpt.tagging": "jaxckpt.core.tagging",
    "jaxckpt.jaxprs": "jaxckpt.analysis.jaxprs",
    "jaxckpt.flops": "jaxckpt.analysis.flops",
    "jaxckpt.residuals": "jaxckpt.analysis.residuals",
    "jaxckpt.activations": "jaxckpt.analysis.activations",
    "jaxckpt.diagnostics": "jaxckpt.core.diagnostics",
    "jaxckpt.render": "jaxckpt.analysis.render",
    "jaxckpt.layers": "jaxckpt.nnx.layers",
    "jaxckpt.apply": "jaxckpt.nnx.apply",
    "jaxckpt.linen_apply": "jaxckpt.linen.apply",
    "jaxckpt.gpt": "jaxckpt.models.gpt",
    "jaxckpt.configs": "jaxckpt.models.configs",
    "jaxckpt.multitask": "jaxckpt.models.multitask",
    "jaxckpt.train": "jaxckpt.training.train",
    "jaxckpt.xla": "jaxckpt.training.xla",
    "jaxckpt.saving": "jaxckpt.training.saving",
    "jaxckpt.profile": "jaxckpt.training.profile",
}
"""Old module path -> where it lives now. ``jaxckpt.names`` and ``jaxckpt.sharding`` stay public names of the package
face (no warning); ``jaxckpt.linen`` and ``jaxckpt.models`` are packages now, with the same names as before."""


class MovedModule(types.ModuleType):
  """An old module path kept importable: each name read through it warns once where it went and is forwarded.

  ``from jaxckpt.layers import Stack`` gives :class:`jaxckpt.nnx.layers.Stack` and a ``DeprecationWarning`` saying
  ``jaxckpt.layers moved to jaxckpt.nnx.layers``. The idea is optax's ``_deprecations`` table served by a module
  ``__getattr__`` (PEP 562).

  Raises:
    AttributeError: for a name the new module does not have (as a plain module would).
  """

  def __init__(self, old: str, new: str):
    super().__init__(old, f"Moved to :mod:`{new}`; this alias warns on use.")
    self.__moved_to__ = new

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    new = self.__moved_to__
    warnings.warn(f"{self.__name__} moved to {new}: import {name} from {new}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(new), name)


for _old, _new in MOVED_MODULES.items():
  sys.modules.setdefault(_old, MovedModule(_old, _new))
sys.modules.setdefault("jaxckpt.names", names)
sys.modules.setdefault("jaxckpt.sharding", sharding)
del _old, _new


def __getattr__(name: str):
  """``jaxckpt.layers`` and the other old module paths of :data:`MOVED_MODULES` as attributes of the package."""
  if f"jaxckpt.{name}" in MOVED_MODULES:
    return sys.modules[f"jaxckpt.{name}"]
  raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")


__all__ = [
    "linen",
    "names",
    "sharding",
    "apply_remat",
    "linen_model_target",
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
    "TopologyError",
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
    "CHIPS",
    "Chip",
    "Topology",
    "get_topology",
    "topology_mesh",
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
    "plain_loss_fn",
    "format_bytes",
    "parse_bytes",
    "CPU_REMAT_FIX",
    "RematIneffectiveWarning",
    "compile_step",
    "jit",
    "memory_stats",
    "remat_compiler_options",
]
