"""Automatic remat policies under a memory budget: ``budget:1.5GiB``, ``budget:40%``, ``auto``.

Give the memory you have; get the per-layer policy with the least recomputation that fits, verified by compiling
the train step, and see why (:meth:`Plan.explain`), or take it away as plain JAX code (:func:`export_code`).
Candidates include per-tensor choices (:mod:`jaxckpt.planner._tensors`: a min-cut over each block's intermediates,
applied as ``save_tensors`` policies); ``min_saved`` (:func:`min_saved_policy`) is the least saved set at almost no
extra FLOPs. Whole-loss plans (:mod:`jaxckpt.planner._whole`, :func:`whole_plan`) put one remat region around the
whole loss, layers unrolled, and choose its saved set with the same program; segmented ones
(:mod:`~jaxckpt.planner._segments`, :func:`segment_loss`; :mod:`~jaxckpt.planner._segmented`,
:func:`segmented_plan`) cut that loss into regions at its narrowest points and solve all
regions together: the policy ``mincut:<cap>`` (:func:`mincut_policy`).

Example::

    >>> from jaxckpt.step import shipped_target
    >>> from jaxckpt.planner import plan_policy
    >>> plan = plan_policy(shipped_target("gpt", "small"), "budget:50%")
    >>> print(plan.explain())
    >>> model = ...; jaxckpt.set_policy(model, plan.policy)
"""

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.planner._cache import PlanCache
from jaxckpt.planner._candidates import LayerCandidate, block_options, layer_candidates, pareto_front
from jaxckpt.planner._export import export_code
from jaxckpt.planner._plan import (
    MAX_ROUNDS,
    CompiledPoint,
    InfeasibleBudgetError,
    Plan,
    min_saved_policy,
    plan_policy,
    resolve_policy,
)
from jaxckpt.planner._solve import Assignment, exhaustive, pareto_totals, solve
from jaxckpt.planner._segmented import SegmentedPlan, mincut_policy, remat_segments, segmented_plan
from jaxckpt.planner._segments import Segments, narrow_cuts, segment_loss
from jaxckpt.planner._whole import (WholeLoss, WholePlan, measure_whole, remat_whole_loss, target_whole_loss, whole_graph,
                                   whole_loss, whole_plan)
from jaxckpt.planner._plan import layer_probe
from jaxckpt.planner._tensors import block_program, record_block_graphs, tensor_options

__all__ = [
    "layer_probe",
    "block_program",
    "record_block_graphs",
    "tensor_options",
    "PlanCache",
    "Assignment",
    "CompiledPoint",
    "InfeasibleBudgetError",
    "LayerCandidate",
    "MAX_ROUNDS",
    "Plan",
    "block_options",
    "exhaustive",
    "min_saved_policy",
    "export_code",
    "layer_candidates",
    "pareto_front",
    "pareto_totals",
    "plan_policy",
    "resolve_policy",
    "solve",
    "WholeLoss",
    "WholePlan",
    "measure_whole",
    "target_whole_loss",
    "whole_loss",
    "whole_plan",
    "SegmentedPlan",
    "Segments",
    "mincut_policy",
    "segment_loss",
    "segmented_plan",
    "narrow_cuts",
    "remat_segments",
    "remat_whole_loss",
    "whole_graph",
]

# old module paths (e.g. jaxckpt.planner.<module>) and names that moved, as attributes, with a warning
__getattr__ = _forward_names(__name__, {"device_memory_bytes": ("jaxckpt.sharding._placement", "device_memory")})
