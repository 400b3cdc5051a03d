"""XLA's own memory reports of a compiled step: dump them per compile and read the buffers live at peak.

The dump is requested per compile with ``compiler_options`` (:func:`dump_options`) — ``XLA_FLAGS`` of the user's
process is never touched. XLA:CPU then writes, per module, ``*-memory-usage-report.txt`` (allocations by size),
``*-buffer-assignment.txt`` (every allocation and the HLO values in it), ``*-live-range.txt`` (the schedule, live
ranges and the section "Live ranges at N (peak)") and the optimised HLO text (``*after_optimizations.txt``, whose
instructions carry ``metadata={op_name=... stack_frame_id=...}`` and whose ``FileNames``/``FunctionNames``/
``FileLocations``/``StackFrames`` tables give the JAX source line). LLVM IR and object files are pruned.

The texts are read by the one HLO reader, :mod:`jaxckpt.analysis.hlo` (the program by :func:`~jaxckpt.analysis.hlo.
parse_hlo`, the peak's values by :func:`~jaxckpt.analysis.hlo.live_at_peak`); this module finds the files and joins
them.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from jaxckpt.analysis.hlo import format_shape, live_at_peak, parse_hlo
from jaxckpt.analysis.hlo._parse import ints

KEEP_SUFFIXES: tuple[str, ...] = (".txt", ".debug_options")
"""Dump files kept; XLA:CPU also writes LLVM IR (``.ll``) and object files (``.o``), megabytes per step."""

_FILES = {
    "memory_usage_report": "*memory-usage-report.txt",
    "buffer_assignment": "*after_optimizations-buffer-assignment.txt",
    "live_range": "*after_optimizations-live-range.txt",
    "hlo": "*after_optimizations.txt",
    "hlo_before_optimizations": "*before_optimizations.txt",
}


def dump_options(directory: str) -> dict[str, Any]:
  """``compiler_options`` that make XLA write its text dumps (HLO, buffer assignment, memory report) to ``directory``."""
  return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}


def prune_dump(directory: str) -> None:
  """Deletes the dump files that are not text reports (:data:`KEEP_SUFFIXES`)."""
  for path in glob.glob(os.path.join(directory, "*")):
    if os.path.isfile(path) and not path.endswith(KEEP_SUFFIXES):
      os.remove(path)


def dump_files(directory: str) -> dict[str, str | None]:
  """The report files of the (last) train-step module in a dump directory.

  Returns:
    ``{"memory_usage_report", "buffer_assignment", "live_range", "hlo", "hlo_before_optimizations"}`` -> path, or
    ``None`` where the backend wrote no such file.
  """
  out: dict[str, str | None] = {}
  for key, pattern in _FILES.items():
    paths = [p for p in glob.glob(os.path.join(directory, pattern))
             if key not in ("hlo",) or not re.search(r"-(buffer-assignment|live-range|memory-usage-report)", p)]
    paths = [p for p in paths if "buffer-assignment-values" not in p]
    out[key] = sorted(paths)[-1] if paths else None
  return out


def peak_buffers(directory: str, *, top: int = 10) -> list[dict[str, Any]]:
  """The largest buffers live at the step's memory peak, with the HLO op and the JAX op/source that made them.

  Args:
    directory: a dump directory of one compiled step (see :func:`dump_options`).
    top: how many buffers, largest first.

  Returns:
    ``[{"buffer", "bytes", "opcode", "shape", "op_name", "source"}]`` (``buffer`` is the HLO value name, e.g.
    ``fusion.12{}``; ``source`` is ``file:line (function)`` of the innermost JAX frame, or ``None``). Empty when
    the backend wrote no live-range report.

  Raises:
    jaxckpt.analysis.HloParseError: the dump's program text is not HLO the reader understands.
  """
  files = dump_files(directory)
  if files["live_range"] is None:
    return []
  with open(files["live_range"], encoding="utf-8") as f:
    live = sorted(live_at_peak(f.read()), key=lambda b: -b.bytes)
  module = None
  if files["hlo"] is not None:
    with open(files["hlo"], encoding="utf-8") as f:
      module = parse_hlo(f.read())
  out = []
  for buffer in live[:top]:
    ins = module.instructions.get(buffer.instruction) if module is not None else None
    out.append({"buffer": f"{buffer.instruction}{buffer.index}", "bytes": buffer.bytes,
                "opcode": ins.opcode if ins else None,
                "shape": format_shape(ins.shape, tuple(ints(buffer.index))) if ins else None,
                "op_name": ins.op_name if ins else None, "source": module.source(ins) if ins else None})
  return out
