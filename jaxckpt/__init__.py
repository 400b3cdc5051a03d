"""jaxckpt: gradient checkpointing (remat) for JAX/Flax as a choice you can see and measure.

The public names are on this face and on the faces of its namespaces, each name on exactly one (the modules behind
them are private, ``_name.py``, as optax keeps ``optax._src``):

- Policies by name, per block and per layer range: :func:`parse_policy`, :func:`parse_model_policy`, :class:`Policy`,
  :class:`PolicySpec`, :class:`LayeredPolicy`, :class:`Budget`; the grammar and the rest in :mod:`jaxckpt.policies`.
- Remat of functions and modules: :func:`remat`, :func:`checkpoint`, :class:`Remat`.
- Your own model, NNX or Linen, with the same verbs (:mod:`jaxckpt.core._frontends`): :func:`apply_remat`,
  :func:`set_policy` (in place; NNX), :func:`with_policy` (a copy; both), :func:`block_types`; targets for the tools: :func:`nnx_model_target`, :func:`linen_model_target`. The
  front-ends themselves: :mod:`jaxckpt.nnx` (blocks, ``Stack``), :mod:`jaxckpt.linen`.
- Train steps over ``nnx.split`` state: :class:`TrainState`, :func:`create_train_state`, :func:`make_train_step`,
  :func:`make_eval_step`, :func:`plain_loss_fn`; compiling so remat works on CPU too, and compiled memory stats:
  :func:`jit`, :func:`compile_step`, :func:`memory_stats`, :func:`remat_compiler_options`; saving the train state
  with orbax: :class:`TrainStateSaver`, :class:`DirectoryLock`. More in :mod:`jaxckpt.training`.
- Warnings: :class:`RematPolicyWarning`, :class:`RematIneffectiveWarning`, :func:`policy_warnings`. Errors:
  :mod:`jaxckpt.errors` (every one a :class:`jaxckpt.errors.JaxckptError`). Byte sizes: :func:`format_bytes`,
  :func:`parse_bytes`.
- Namespaces: :mod:`jaxckpt.models` (the shipped models), :mod:`jaxckpt.step` (targets, the train step every tool
  compiles), :mod:`jaxckpt.planner` (budget plans), :mod:`jaxckpt.report`, :mod:`jaxckpt.fit`,
  :mod:`jaxckpt.sharding` (meshes, logical axis rules, state shardings, and the TPU slices and GPU clusters to
  compile for without the hardware: ``--topology v5e:2x2``), :mod:`jaxckpt.names` (checkpoint name constants),
  :mod:`jaxckpt.analysis` (reading traced and compiled steps; :mod:`jaxckpt.analysis.hlo`, the HLO reader),
  :mod:`jaxckpt.rendering` (what the tools print and draw), :mod:`jaxckpt.schema`.

The folders, bottom up (imports run one way; ``tests/house/test_architecture.py`` checks it): ground modules →
analysis → policies → sharding → timing → core → the front-ends nnx and linen → training → models → step →
rendering → planner → report and fit → cli.

Old paths still work and warn (``DeprecationWarning``) with the public path: module paths of earlier layouts
(``jaxckpt.layers``, ``jaxckpt.report.compile``: table :data:`jaxckpt._deprecations.MOVED_MODULES`) and names that
left this face (``jaxckpt.Stack`` is ``jaxckpt.nnx.Stack``).
"""

from jaxckpt._console import running_console_script as _running_console_script, stop_while_starting as _stop_early

if _running_console_script():  # jaxckpt-report/-plan/-fit: Ctrl-C while JAX imports is one line and exit 130
  _stop_early()

from jaxckpt.errors import EnvSettingError as _EnvSettingError
from jaxckpt._remat_impl import check_env as _check_env

if (_problem := _check_env()) is not None:  # before JAX reads JAX_REMAT3 on import (a ValueError traceback there)
  if _running_console_script():  # jaxckpt-report/-plan/-fit: a program's bad input is one line and exit 2
    import sys as _sys

    _sys.stderr.write(f"jaxckpt: {_problem}\n")
    raise SystemExit(2)
  raise _EnvSettingError(_problem)  # a library raises

from jaxckpt.analysis._internals import quiet_cuda_plugin_without_gpu as _quiet_cuda
_quiet_cuda()  # before JAX's backends start: no CUDA traceback on a machine without a GPU (docs/gpu.md)
from jaxckpt import _deprecations
from jaxckpt import errors, schema
from jaxckpt import names, sharding
from jaxckpt import nnx, linen  # the two front-ends (each registers itself for the verbs below)
from jaxckpt import analysis, core, policies, training
from jaxckpt import models, step, rendering, planner, report, fit
from jaxckpt import cli
from jaxckpt.core._diagnostics import RematPolicyWarning, policy_warnings
from jaxckpt.core._frontends import apply_remat, block_types, set_policy, with_policy
from jaxckpt.core._remat import Remat, checkpoint, remat
from jaxckpt.policies._model import Budget, LayeredPolicy, parse_model_policy
from jaxckpt.policies._spec import Policy, PolicySpec, parse_policy
from jaxckpt.step._targets import linen_model_target, nnx_model_target
from jaxckpt.training._saving import DirectoryLock, TrainStateSaver
from jaxckpt.training._train import TrainState, create_train_state, make_eval_step, make_train_step, plain_loss_fn
from jaxckpt.training._xla import RematIneffectiveWarning, compile_step, jit, memory_stats, remat_compiler_options
from jaxckpt._units import format_bytes, parse_bytes

__version__ = "0.2.0"

MOVED_MODULES = _deprecations.MOVED_MODULES
"""Old module path -> the private module behind it (:mod:`jaxckpt._deprecations`)."""

__all__ = [
    # namespaces
    "errors", "nnx", "linen", "models", "policies", "step", "planner", "report", "fit", "sharding", "names", "cli",
    # policies
    "parse_policy", "parse_model_policy", "Policy", "PolicySpec", "LayeredPolicy", "Budget",
    # remat
    "remat", "checkpoint", "Remat",
    # your own model (NNX or Linen)
    "apply_remat", "set_policy", "with_policy", "block_types", "nnx_model_target",
    "linen_model_target",
    # train steps, compiling, saving
    "TrainState", "create_train_state", "make_train_step", "make_eval_step", "plain_loss_fn", "jit", "compile_step",
    "memory_stats", "remat_compiler_options", "TrainStateSaver", "DirectoryLock",
    # warnings, sizes
    "RematPolicyWarning", "RematIneffectiveWarning", "policy_warnings", "format_bytes", "parse_bytes",
]

_MOVED_NAMES: dict[str, tuple[str, str]] = {
    **{n: ("jaxckpt.models", n) for n in (
        "GPT", "GPT_PRESETS", "GPTConfig", "build_gpt", "lm_loss", "MODELS", "MODEL_REGISTRY", "build_model",
        "AUX_TASKS", "MultiTaskClassifier", "multitask_loss", "classification_loss")},
    **{n: ("jaxckpt.nnx", n) for n in (
        "AttentionBlock", "ConvBlock", "MLPBlock", "RematBlock", "Stack", "TransformerBlock")},
    **{n: ("jaxckpt.errors", n) for n in (
        "CheckpointError", "DataError", "DirectoryInUseError", "JaxckptError", "MeshSpecError", "NonFiniteLossError",
        "PolicySpecError", "StaticArgumentError")},
    **{n: ("jaxckpt.policies", n) for n in ("CANONICAL_POLICIES", "POLICY_NAMES")},
    **{n: ("jaxckpt.sharding", n) for n in (
        "MESH_AXES", "make_mesh", "parse_mesh", "replica_mismatches", "shard_batch", "shard_state", "state_shardings")},
    **{n: ("jaxckpt.schema", n) for n in ("SCHEMA_VERSION", "versions")},
    **{n: ("jaxckpt.training", n) for n in ("abstract_train_state", "compile_train_step", "CPU_REMAT_FIX")},
    "Checkpointer": ("jaxckpt.training._saving", "TrainStateSaver"),
    "warn_policy": ("jaxckpt.core._diagnostics", "warn_policy"),
    "checkpoint_names": ("jaxckpt.nnx", "checkpoint_names"),
}
"""Names this face offered in jaxckpt 0.0 -> where they are now."""

__getattr__ = _deprecations.forward_names(__name__, _MOVED_NAMES)

_deprecations.install_moved_modules()
