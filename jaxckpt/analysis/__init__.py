"""Reading traced and compiled steps, and nothing else: FLOPs from the jaxpr (:func:`count_flops`,
:func:`jaxpr_flops`, :func:`count_live_flops`), the saved residuals of a policy (:func:`saved_residuals`, grouped by
checkpoint name, primitive or source line), remat regions in every form the installed JAX has (:data:`REMAT_FORMS`),
which values reach which (the dataflow), every ``jax._src`` import jaxckpt makes (``_internals``), and compiled
programs through the one HLO reader, :mod:`jaxckpt.analysis.hlo` (:func:`parse_hlo`, :func:`read_compiled`: every
instruction with its runs per step, dot FLOPs, bytes, collectives and host transfers; :func:`collectives_by_axis`:
what a step sends over which mesh axes; :func:`read_memory_spaces`: the bytes a compile's buffer assignment puts in
the device's HBM and the host's memory).

The floor below the policies: nothing here imports :mod:`jaxckpt.policies`, :mod:`jaxckpt.core` or anything above,
so the policy parser can check what a policy saves. What a policy's name means lives in :mod:`jaxckpt.policies`,
whether a policy had a compiled effect in :mod:`jaxckpt.planner`, and the renderings (terminal tables, HTML pages,
:func:`jaxckpt.rendering.memory_table`) in :mod:`jaxckpt.rendering`. Implementation modules are private (``_flops``,
``_residuals``, ``_jaxprs``, ...).
"""

from __future__ import annotations

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.analysis._flops import FlopCount, count_flops, count_live_flops, jaxpr_flops
from jaxckpt.analysis.hlo import (COLLECTIVE_KINDS, DEVICE_MEMORY_SPACE, GEMM_TARGETS, HOST_MEMORY_SPACE, ArrayShape,
                                  Collective, CollectiveUse, HloComputation, HloExecution, HloInstruction, HloModule,
                                  HloParseError, HloTotals, HostTransfer, LiveBuffer, MemorySpace, MemorySpaces,
                                  collectives_by_axis, describe_collectives, format_shape, group_axes, instruction_flops,
                                  live_at_peak, offload_device_bytes, parse_hlo, read_compiled, read_memory_spaces,
                                  replica_groups)
from jaxckpt.analysis._jaxprs import REMAT_FORMS
from jaxckpt.analysis._residuals import Residual, ResidualGroup, group_residuals, saved_residuals

__all__ = [
    "FlopCount",
    "count_flops",
    "count_live_flops",
    "jaxpr_flops",
    "REMAT_FORMS",
    "Residual",
    "ResidualGroup",
    "saved_residuals",
    "group_residuals",
    "parse_hlo",
    "read_compiled",
    "replica_groups",
    "instruction_flops",
    "HloModule",
    "HloComputation",
    "HloInstruction",
    "HloExecution",
    "ArrayShape",
    "Collective",
    "CollectiveUse",
    "collectives_by_axis",
    "describe_collectives",
    "group_axes",
    "HostTransfer",
    "HloTotals",
    "HloParseError",
    "HOST_MEMORY_SPACE",
    "DEVICE_MEMORY_SPACE",
    "MemorySpace",
    "MemorySpaces",
    "read_memory_spaces",
    "offload_device_bytes",
    "COLLECTIVE_KINDS",
    "GEMM_TARGETS",
    "LiveBuffer",
    "live_at_peak",
    "format_shape",
]

# old module paths (e.g. jaxckpt.analysis.<module>) as attributes, and the renderings that moved to jaxckpt.rendering,
# with a warning
__getattr__ = _forward_names(__name__, {name: ("jaxckpt.rendering", name)
                                        for name in ("memory_table", "policy_summary")})
