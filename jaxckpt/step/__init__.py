"""The step core: what every tool compiles. Below the report, the planner and the experiments; above layers and
policies.

- Targets (:mod:`jaxckpt.step._targets`): :class:`ModelTarget` (an NNX model, its loss, an example batch, and
  optionally a tensor plan; ``"auto"`` resolved by :func:`auto_tensor_plan`),
  :class:`LossTarget` (a pure loss that applies policies itself), :func:`shipped_target`, :func:`load_target`.
- The train step under a policy (:mod:`jaxckpt.step._build`): :func:`policy_step` -> :class:`PolicyStep`, from
  shapes only; :func:`concrete_inputs` allocates real ones.
- One compile path (:mod:`jaxckpt.step._compile`): :func:`compile_policy` (and its two stages :func:`lower_policy`,
  :meth:`LoweredPolicy.compile`) with :func:`step_compiler_options`.
- The compile job (:mod:`jaxckpt.step._job`): :func:`compile_job` resolves an entry point's keywords (mesh,
  topology, memory fraction, optimizer, compiler options) once into a frozen :class:`CompileJob` handed down;
  :func:`runs_beside_refusal` is the one refusal of a run of steps beside a mesh or topology.
- Faults (:mod:`jaxckpt.step._isolated`, :mod:`jaxckpt.step._stats_cache`): :func:`isolated_compiles` (topology
  compiles in worker processes: a compiler crash is a :class:`CompilerCrashError`), :func:`end_workers`;
  :class:`StatsCacheWarning` (a damaged or unwritable compiled-stats cache, once per run).
"""

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.step._build import (
    PolicyStep,
    StepBuilder,
    concrete_inputs,
    default_optimizer,
    dropout_key_struct,
    policy_step,
    target_block_types,
    target_structure,
)
from jaxckpt.step._compile import (
    GPU_OPTIONS,
    GPU_RECIPE_OPTIONS,
    COMPILER_FAILURE_HINTS,
    compiler_hint,
    HOST_OFFLOAD_OPTIONS,
    STATS_ONLY_OPTIONS,
    CompiledPolicy,
    LoweredPolicy,
    compile_policy,
    lower_policy,
    sharded_target,
    step_builder,
    step_compiler_options,
    xla_raw_flops,
)
from jaxckpt.step._auto_plan import auto_tensor_plan
from jaxckpt.step._job import CompileJob, compile_job, runs_beside_refusal
from jaxckpt.step._isolated import CompilerCrashError, end_workers, isolated_compiles
from jaxckpt.step._stats_cache import StatsCacheWarning
from jaxckpt.models._classifiers import DEFAULT_BATCH_SIZE
from jaxckpt.step._targets import (
    SHIPPED_MODELS,
    LossTarget,
    ModelTarget,
    Target,
    linen_target,
    load_target,
    rebuild_target,
    shipped_target,
)

__all__ = [
    "auto_tensor_plan",
    "CompileJob",
    "compile_job",
    "runs_beside_refusal",
    "CompilerCrashError",
    "end_workers",
    "isolated_compiles",
    "StatsCacheWarning",
    "PolicyStep",
    "StepBuilder",
    "concrete_inputs",
    "default_optimizer",
    "dropout_key_struct",
    "policy_step",
    "target_block_types",
    "target_structure",
    "GPU_OPTIONS",
    "GPU_RECIPE_OPTIONS",
    "COMPILER_FAILURE_HINTS",
    "compiler_hint",
    "HOST_OFFLOAD_OPTIONS",
    "STATS_ONLY_OPTIONS",
    "CompiledPolicy",
    "LoweredPolicy",
    "compile_policy",
    "lower_policy",
    "sharded_target",
    "step_builder",
    "step_compiler_options",
    "xla_raw_flops",
    "DEFAULT_BATCH_SIZE",
    "SHIPPED_MODELS",
    "LossTarget",
    "ModelTarget",
    "Target",
    "linen_target",
    "load_target",
    "rebuild_target",
    "shipped_target",
]

__getattr__ = _forward_names(__name__, {"linen_model_target": ("jaxckpt.step._targets", "linen_model_target")})
