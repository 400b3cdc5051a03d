"""XLA's own memory reports of a compiled step: dump them per compile and read the buffers live at peak.

The dump is requested per compile with ``compiler_options`` (:func:`dump_options`) — ``XLA_FLAGS`` of the user's
process is never touched. XLA:CPU then writes, per module, ``*-memory-usage-report.txt`` (allocations by size),
``*-buffer-assignment.txt`` (every allocation and the HLO values in it), ``*-live-range.txt`` (the schedule, live
ranges and the section "Live ranges at N (peak)") and the optimised HLO text (``*after_optimizations.txt``, whose
instructions carry ``metadata={op_name=... stack_frame_id=...}`` and whose ``FileNames``/``FunctionNames``/
``FileLocations``/``StackFrames`` tables give the JAX source line). LLVM IR and object files are pruned.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

KEEP_SUFFIXES: tuple[str, ...] = (".txt", ".debug_options")
"""Dump files kept; XLA:CPU also writes LLVM IR (``.ll``) and object files (``.o``), megabytes per step."""

_FILES = {
    "memory_usage_report": "*memory-usage-report.txt",
    "buffer_assignment": "*after_optimizations-buffer-assignment.txt",
    "live_range": "*after_optimizations-live-range.txt",
    "hlo": "*after_optimizations.txt",
    "hlo_before_optimizations": "*before_optimizations.txt",
}
_PEAK_RE = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_LIVE_RE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?: (\d+) bytes")
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\S+?)(?:\{[^}]*\})? (\S+?)\(")
_META_RE = re.compile(r'metadata=\{([^}]*)\}')
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')
_FRAME_RE = re.compile(r"stack_frame_id=(\d+)")
_SRC_RE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


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


def _hlo_tables(text: str) -> tuple[dict[str, dict[str, Any]], dict[int, str]]:
  """Instruction name -> {opcode, shape, op_name, frame}; stack frame id -> 'file:line (function)'."""
  instructions: dict[str, dict[str, Any]] = {}
  section = None
  tables: dict[str, dict[int, str]] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
  for line in text.splitlines():
    stripped = line.strip()
    if stripped in tables:
      section = stripped
      continue
    if section and re.match(r"^\d+ ", stripped):
      index, _, value = stripped.partition(" ")
      tables[section][int(index)] = value
      continue
    section = None
    match = _INSTR_RE.match(line)
    if match:
      meta = _META_RE.search(line)
      meta_text = meta.group(1) if meta else ""
      op_name = _OPNAME_RE.search(meta_text)
      frame = _FRAME_RE.search(meta_text)
      src = _SRC_RE.search(meta_text)
      instructions.setdefault(match.group(1), {
          "opcode": match.group(3), "shape": match.group(2), "op_name": op_name.group(1) if op_name else None,
          "frame": int(frame.group(1)) if frame else None,
          "source": f"{src.group(1)}:{src.group(2)}" if src else None,
      })

  def field(value: str, name: str) -> int | None:
    m = re.search(rf"{name}=(\d+)", value)
    return int(m.group(1)) if m else None

  def location(frame_id: int) -> str | None:
    frame = tables["StackFrames"].get(frame_id)
    loc_id = field(frame, "file_location_id") if frame else None
    loc = tables["FileLocations"].get(loc_id) if loc_id is not None else None
    if loc is None:
      return None
    file = tables["FileNames"].get(field(loc, "file_name_id"), "?").strip('"')
    fn = tables["FunctionNames"].get(field(loc, "function_name_id"), "?").strip('"')
    return f"{file}:{field(loc, 'line')} ({fn})"

  frames = {i: location(i) for i in tables["StackFrames"]}
  return instructions, {k: v for k, v in frames.items() if v is not None}


def peak_buffers(directory: str, *, top: int = 10) -> list[dict[str, Any]]:
  """The largest buffers live at the step's memory peak, with the HLO op and the JAX op/source that made them.

  Args:
    directory: a dump directory of one compiled step (see :func:`dump_options`).
    top: how many buffers, largest first.

  Returns:
    ``[{"buffer", "bytes", "opcode", "shape", "op_name", "source"}]`` (``buffer`` is the HLO value name, e.g.
    ``fusion.12{}``; ``source`` is ``file:line (function)`` of the innermost JAX frame, or ``None``). Empty when
    the backend wrote no live-range report.
  """
  files = dump_files(directory)
  if files["live_range"] is None:
    return []
  with open(files["live_range"]) as f:
    lines = f.read().splitlines()
  live: list[tuple[str, str, int]] = []
  in_peak = False
  for line in lines:
    if _PEAK_RE.match(line):
      in_peak = True
      continue
    if in_peak:
      match = _LIVE_RE.match(line)
      if not match:
        break
      live.append((match.group(1), match.group(2) or "{}", int(match.group(3))))
  instructions, frames = {}, {}
  if files["hlo"] is not None:
    with open(files["hlo"]) as f:
      instructions, frames = _hlo_tables(f.read())
  live.sort(key=lambda item: -item[2])
  out = []
  for name, index, size in live[:top]:
    info = instructions.get(name, {})
    source = info.get("source") or (frames.get(info["frame"]) if info.get("frame") is not None else None)
    out.append({"buffer": f"{name}{index}", "bytes": size, "opcode": info.get("opcode"), "shape": info.get("shape"),
                "op_name": info.get("op_name"), "source": source})
  return out
