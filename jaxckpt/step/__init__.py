"""The step core: what every tool compiles. Below the report, the planner and the experiments; above layers and
policies.

- Targets (:mod:`jaxckpt.step.targets`): :class:`ModelTarget` (an NNX model, its loss, an example batch),
  :class:`LossTarget` (a pure loss that applies policies itself), :func:`shipped_target`, :func:`load_target`,
  :func:`with_batch` (the same target at another batch size).
- The train step under a policy (:mod:`jaxckpt.step.build`): :func:`policy_step` -> :class:`PolicyStep`, from
  shapes only; :func:`concrete_inputs` allocates real ones.
- One compile path (:mod:`jaxckpt.step.compile`): :func:`compile_policy` (and its two stages :func:`lower_policy`,
  :meth:`LoweredPolicy.compile`) with :func:`step_compiler_options`.
"""

from jaxckpt.step.build import (
    PolicyStep,
    StepBuilder,
    concrete_inputs,
    default_optimizer,
    dropout_key_struct,
    policy_step,
    target_block_types,
    target_structure,
)
from jaxckpt.step.compile import (
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
from jaxckpt.step.targets import (
    DEFAULT_BATCH_SIZE,
    SHIPPED_MODELS,
    LossTarget,
    ModelTarget,
    Target,
    batch_size_of,
    linen_model_target,
    linen_target,
    load_target,
    rebuild_target,
    shipped_target,
    with_batch,
)

__all__ = [
    "PolicyStep",
    "StepBuilder",
    "concrete_inputs",
    "default_optimizer",
    "dropout_key_struct",
    "policy_step",
    "target_block_types",
    "target_structure",
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
    "linen_model_target",
    "load_target",
    "rebuild_target",
    "shipped_target",
    "batch_size_of",
    "with_batch",
]
