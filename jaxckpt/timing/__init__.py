"""How long a compiled train step takes, read from the compiled program (``docs/timing.md``).

:func:`estimate_step_time` walks a compiled XLA program (:func:`jaxckpt.analysis.parse_hlo`) and times every
instruction it runs, loop bodies times their trip counts: the TPU compiler's own cycle estimate per kernel where it
writes one, a roofline of the single instruction where it does not (its FLOPs at the chip's peak, derated by the
matmul's shape; its bytes at HBM bandwidth), each collective's bytes over the links its replica groups cross (the
ICI torus, NVLink inside a node, the network between nodes), each host-offload copy over the host link, custom-call
kernels by their cost estimates; then it replays the compiled schedule so asynchronous work overlaps the core only
where the schedule lets it. Every chip figure comes from :data:`jaxckpt.sharding.CHIPS`, each with its source.

    >>> from jaxckpt.timing import estimate_step_time, links_for, layer_trip_counts
    >>> step = estimate_step_time(compiled.as_text(), "v6e", links=links_for(topology, mesh))
    >>> step.seconds, step.bound, step.terms, step.exposed

For a :class:`jaxckpt.step.CompiledPolicy` (also one served from the compiled-stats cache): :func:`step_time_of`.

This package reads compiled programs only: it imports :mod:`jaxckpt.analysis` and :mod:`jaxckpt.sharding`, and the
tools above (the step core, the report, the fit) call it.
"""

from __future__ import annotations

from jaxckpt.timing._kernels import causal_block_fraction, kernel_flops, kernel_matmuls
from jaxckpt.timing._links import (Links, axis_group, collective_seconds, links_for, mesh_links, slice_torus,
                                   tpu_wraps)
from jaxckpt.timing._ops import OpCost, matmul_efficiency, op_costs
from jaxckpt.timing._schedule import OVERLAP_RULES, with_trip_counts
from jaxckpt.timing._step import (RESOLUTION, OpTime, StepTime, describe_step_time, estimate_step_time,
                                  layer_trip_counts, step_time_of, within_resolution)

__all__ = [
    "estimate_step_time",
    "step_time_of",
    "describe_step_time",
    "RESOLUTION",
    "within_resolution",
    "StepTime",
    "OpTime",
    "OVERLAP_RULES",
    "Links",
    "links_for",
    "tpu_wraps",
    "mesh_links",
    "slice_torus",
    "axis_group",
    "collective_seconds",
    "layer_trip_counts",
    "with_trip_counts",
    "matmul_efficiency",
    "kernel_flops",
    "kernel_matmuls",
    "causal_block_fraction",
    "op_costs",
    "OpCost",
]
