"""The one HLO reader: a compiled XLA program read from its text, and XLA's buffer assignment read from its dump.

- :mod:`._parse`: the text into records (computations, instructions with shapes and attributes, replica groups as
  device ids, the source tables of stack frames);
- :mod:`._module`: :class:`HloModule` (:func:`parse_hlo`, :func:`read_compiled`): every instruction the step runs with
  its runs per step (loop trip counts), dot FLOPs, bytes and, on TPU, the compiler's cycle estimates; per-device totals;
- :mod:`._collectives`: each collective's kind, payload and replica groups; :func:`collectives_by_axis`, what a step
  sends over which mesh axes; :func:`describe_collectives`; all-reduces whose results are only sliced;
- :mod:`._transfers`: copies between device and host memory (offloaded residuals);
- :mod:`._buffers`: the buffer assignment's memory spaces (:func:`read_memory_spaces`, :func:`offload_device_bytes`)
  and the values live at the memory peak (:func:`live_at_peak`).

What the compilers write, and how each record is defined: ``docs/hlo-reading.md``. Every name here is public as
``jaxckpt.analysis.<name>`` too (the face of :mod:`jaxckpt.analysis`); the step's time model (:mod:`jaxckpt.timing`),
the report's XLA dumps and its offload bytes read programs through this package only.
"""

from __future__ import annotations

from jaxckpt.analysis.hlo._buffers import (DEVICE_MEMORY_SPACE, LiveBuffer, MemorySpace, MemorySpaces, live_at_peak,
                                           offload_device_bytes, read_memory_spaces)
from jaxckpt.analysis.hlo._collectives import (COLLECTIVE_KINDS, Collective, CollectiveUse, describe_collectives,
                                               group_axes)
from jaxckpt.analysis.hlo._module import (GEMM_TARGETS, HloExecution, HloModule, HloTotals, collectives_by_axis,
                                          instruction_flops, parse_hlo, read_compiled)
from jaxckpt.analysis.hlo._parse import (HOST_MEMORY_SPACE, ArrayShape, HloComputation, HloInstruction, HloParseError,
                                         format_shape, replica_groups)
from jaxckpt.analysis.hlo._transfers import HostTransfer

__all__ = [
    "parse_hlo",
    "read_compiled",
    "replica_groups",
    "instruction_flops",
    "format_shape",
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
    "LiveBuffer",
    "live_at_peak",
    "COLLECTIVE_KINDS",
    "GEMM_TARGETS",
]
