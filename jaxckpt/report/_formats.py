"""What every rendering of the report shares: number formats, the table's columns and cells, the title.

Records stay in bytes/FLOPs/seconds; only renderings use binary units (:func:`jaxckpt.format_bytes`). Ratios are
against the ``none`` row; ``*`` marks the best (smallest) value of a column among successful rows.
"""

from __future__ import annotations

import math
import re

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxckpt.report._build import Report
from jaxckpt.rendering._pages import Cell
from jaxckpt.report._keys import STATUS_OK, UNITS, device_word
from jaxckpt.sharding import BATCH_AXES, topology_header
from jaxckpt._units import format_bytes, format_seconds
from jaxckpt.timing import describe_step_time

Column = tuple[str, str, Callable[[Any], str], bool]  # (header, row key, format, ratio vs none)


def _ms(seconds: float | None) -> str:
  return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_flops(n: int | None) -> str:
  """``n`` FLOPs as text with a decimal (SI) unit, up to exa (``1.21 GFLOP``, ``664.03 PFLOP``); ``"n/a"`` for
  ``None``."""
  if n is None:
    return "n/a"
  for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} FLOP"


def _seconds(s: float | None) -> str:
  return "n/a" if s is None else f"{s:.1f} s"


COLUMNS: tuple[Column, ...] = (
    ("footprint", "footprint_bytes", format_bytes, True),
    ("host", "host_footprint_bytes", format_bytes, False),
    ("CPU footprint", "cpu.footprint_bytes", format_bytes, True),
    ("temp", "temp_bytes", format_bytes, True),
    ("CPU temp", "cpu.temp_bytes", format_bytes, True),
    ("residuals", "residual_bytes", format_bytes, True),
    ("FLOPs", "flops", format_flops, True),
    ("XLA FLOPs (raw)", "flops_xla_raw", format_flops, False),
    ("compile", "compile_s", _seconds, False),
    ("step time", "step_time_s", _ms, True),
    ("est. step", "step_time_estimate.seconds", format_seconds, True),
    ("recompute", "step_time_estimate.recompute_s", format_seconds, False),
    ("peak measured", "peak_bytes_measured", format_bytes, True),
)
"""The table's numeric columns: ``(header, row key, formatter, show ratio vs none)``; ``cpu.<key>`` is the key of the
row's XLA:CPU comparison (``--compare-cpu``), ``step_time_estimate.<key>`` of its compiled program's estimated step
time (a topology's compile: seconds, the term that bounds it, and the seconds beyond ``none``'s estimate). A column
``None`` in every row is left out, and so is ``host`` (host memory: what offload policies keep in ``pinned_host``)
where every row keeps nothing there. Every header but ``compile`` carries its unit (:func:`column_header`): one
device's numbers ``/chip`` (a TPU topology), ``/GPU`` (a GPU cluster) or ``/device``; ``global`` the whole batch's
over every device; ``/step`` seconds per step (every number is one train step's)."""


def shown_columns(rows: Sequence[Mapping[str, Any]]) -> list[Column]:
  """The :data:`COLUMNS` the rows fill: a column ``None`` in every row is left out, and so is ``host`` where no row
  keeps anything in host memory."""
  return [c for c in COLUMNS if any(row_value(r, c[1]) is not None for r in rows)
          and (c[1] != "host_footprint_bytes" or any(row_value(r, c[1]) for r in rows))]


def column_unit(report: Report, key: str) -> str:
  """The unit a column's header carries (:data:`jaxckpt.report._keys.UNITS`): ``/chip`` (a TPU topology), ``/GPU`` (a
  GPU cluster) or ``/device`` for one device's numbers, else the word of ``UNITS`` (``""``: none)."""
  unit = UNITS.get(key, "")
  return "/" + device_word(report.data, key) if unit == "device" else unit


def column_header(report: Report, header: str, key: str, *, lines: bool = False) -> str:
  """A column's header with its unit (:func:`column_unit`): ``footprint/GPU``, ``residuals (global)``, ``FLOPs
  (global)``, ``est. step (/step)``; ``lines``: the unit on a line of its own (the terminal's narrow columns:
  ``footprint`` over ``/GPU``)."""
  unit = column_unit(report, key)
  if not unit:
    return header
  if lines:
    return f"{header}\n{unit}"
  return header + unit if unit in ("/chip", "/GPU", "/device") else f"{header} ({unit})"


def row_value(row: Mapping[str, Any], key: str) -> Any:
  """``row[key]``, or for ``"<parent>.<key>"`` (``cpu.footprint_bytes``, ``step_time_estimate.seconds``) the key of
  the row's dict under ``parent`` (``None`` where missing)."""
  parent, dot, child = key.partition(".")
  if dot:
    return (row.get(parent) or {}).get(child)
  return row.get(key)


OP_WORDS = {"jit": "jitted call", "pjit": "jitted call", "dot_general": "matmul", "custom_jvp_call": "custom-JVP call",
             "custom_vjp_call": "custom-VJP call", "mul": "multiply", "sub": "subtract", "div": "divide",
             "ragged_dot_general": "grouped matmul", "pallas_call": "kept inside a kernel",
             "scan": "scan output", "sharding_constraint": "sharding constraint"}
"""Friendlier words for the JAX primitives the residual legend names (the primitive stays in brackets)."""


def short_source(source: str | None, *, function: bool = True) -> str:
  """``/long/path/jaxckpt/core/blocks.py:207:27 (_residual_pair)`` → ``blocks.py:207 (_residual_pair)``
  (``function=False``: ``blocks.py:207``)."""
  if not source:
    return "no source line"
  match = re.match(r"(?:.*/)?([^/:]+):(\d+)(?::\d+)?\s*(\(.*\))?", source)
  if not match:
    return source
  return f"{match.group(1)}:{match.group(2)}" + (f" {match.group(3)}" if match.group(3) and function else "")


def main_sources(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str | None, int]]:
  """Per unnamed primitive: the source line holding most of its residual bytes over ``rows``, and how many lines."""
  by_prim: dict[str, dict[str | None, int]] = {}
  for r in rows:
    for item in (r.get("residuals") or {}).get("items") or []:
      if item["name"] is None and item["primitive"] and item["kind"] != "argument":
        sources = by_prim.setdefault(item["primitive"], {})
        sources[item["source"]] = sources.get(item["source"], 0) + item["bytes"]
  return {prim: (max(sources, key=lambda k: (sources[k], k or "")), len(sources)) for prim, sources in by_prim.items()}


def residual_label(group: Mapping[str, Any], sources: Mapping[str, tuple[str | None, int]], *,
                    short: bool = False, brief: bool = False) -> str:
  """A legend entry a user can place: the checkpoint name, or the op and the line of your code that made it
  (the group's ``site``; a report written before groups had one: the source line making most of the op's bytes,
  from ``sources``) (``short``: without the count of other lines and the primitive's own name; ``brief``: also
  without the source line's function and the words "checkpoint name", for the terminal)."""
  if group["by"] == "name":
    return group["key"] if brief else f"{group['key']} (checkpoint name)"
  if group["by"] == "primitive":
    op = OP_WORDS.get(group["key"], group["key"])
    op = op if op == group["key"] or short else f"{op} ({group['key']})"
    if "site" in group:
      return f"{op} at {short_source(group['site'], function=not brief)}"
    source, lines = sources.get(group["key"], (None, 0))
    more = f" and {lines - 1} more line(s)" if lines > 1 and not short else ""
    return f"{op} at {short_source(source, function=not brief)}{more}"
  return f"{group['key']} values (made by no op: constants, scalars)" if group["key"] == "other" else \
      f"{group['key']} values"


def top_groups(row: Mapping[str, Any], n: int = 3, *, sep: str = ", ",
               sources: Mapping[str, tuple[str | None, int]] | None = None, brief: bool = False) -> str:
  """The row's ``n`` largest residual groups (arguments left out), ``"bytes label"`` joined by ``sep``; the label
  is :func:`residual_label`'s short one (``"26.00 MiB add at blocks.py:202 (attention)"``).

  Args:
    row: a report row (its ``residuals.groups``).
    n: how many groups.
    sep: the separator.
    sources: :func:`main_sources` of the report's rows (``None``: this row's own).
    brief: :func:`residual_label`'s ``brief`` labels (the terminal's).
  """
  sources = main_sources([row]) if sources is None else sources
  groups = (row.get("residuals") or {}).get("groups") or []
  groups = [g for g in groups if g["by"] != "kind" or g["key"] != "argument"][:n]
  return sep.join(f"{format_bytes(g['bytes'])} {residual_label(g, sources, short=True, brief=brief)}" for g in groups)




def table_cells(report: Report, *, top_residuals: int = 3) -> tuple[list[str], list[list[Cell]]]:
  """The summary table: headers and per row ``(text, sort value)`` cells (the value is the raw number: bytes, FLOPs,
  seconds, ratio; ``None`` where missing), ratios vs ``none``, ``*`` = best of the column.

  Columns that are ``None`` in every row (e.g. step time without ``--measure``) are left out.
  """
  rows = report.rows
  ok = [r for r in rows if r["status"] == STATUS_OK]
  base = next((r for r in ok if r["policy"] == "none"), None)
  columns = shown_columns(rows)
  best = {key: min((row_value(r, key) for r in ok if row_value(r, key) is not None), default=None)
          for _, key, _, _ in columns}
  headers = ["policy", "status"]
  for header, key, _, ratio in columns:
    headers += [column_header(report, header, key)] + (["×none"] if ratio and base is not None else [])
  headers.append("top residuals")
  sources = main_sources(ok)
  out = []
  for r in rows:
    status = r["status"] if r["status"] == STATUS_OK else f"error: {r['error']}"
    if r["status"] == STATUS_OK and r.get("warning"):
      status = f"ok, warning: {r['warning']}"
    line: list[Cell] = [(r["policy"], r["policy"]), (status, status)]
    for _, key, fmt, ratio in columns:
      value = row_value(r, key)
      mark = " *" if value is not None and value == best[key] and len(ok) > 1 else ""
      line.append((fmt(value) + mark, value))
      if ratio and base is not None:
        rel = None if value is None or not row_value(base, key) else value / row_value(base, key)
        line.append(("n/a" if rel is None else f"{rel:.2f}", rel))
    top = top_groups(r, top_residuals, sources=sources)
    line.append((top, top))
    out.append(line)
  return headers, out


def table_rows(report: Report, *, top_residuals: int = 3) -> tuple[list[str], list[list[str]]]:
  """The summary table as strings (:func:`table_cells` without the sort values)."""
  headers, rows = table_cells(report, top_residuals=top_residuals)
  return headers, [[text for text, _ in row] for row in rows]


def batch_words(data: Mapping[str, Any]) -> str:
  """The report's batch as its title says it: ``"batch 256"``, ``"batch 256 global, 32 per GPU"`` (over the mesh's
  batch axes), ``"..., as 4 micro-batches of 64"`` with gradient accumulation; ``""`` for a report without one."""
  batch, accum = data.get("batch_size"), data.get("grad_accum_steps") or 1
  if not batch:
    return ""
  split = math.prod((data.get("mesh") or {}).get(axis, 1) for axis in BATCH_AXES)
  words = f"batch {batch}" + (f" global, {batch // split} per {device_word(data)}" if split > 1 else "")
  return words + (f", as {accum} micro-batches of {batch // accum}" if accum > 1 else "")


def report_title(report: Report) -> str:
  """The report's one-line title: model, preset, structure, batch (:func:`batch_words`), backend (or the topology
  compiled for), devices, mesh."""
  d = report.data
  preset = f" ({d['preset']})" if d["preset"] else ""
  batch = f", {batch_words(d)}" if batch_words(d) else ""
  mesh = d.get("mesh")
  where = (f"mesh {','.join(f'{k}={v}' for k, v in mesh.items())}: memory per device" if mesh
           else "one device, unsharded")
  if d.get("topology"):
    placement = report.placement  # the loaded topology, not its name read again
    topology = placement.topology if placement is not None and placement.topology is not None else d["topology"]
    return (f"jaxckpt memory report: {d['model']}{preset}, {d['structure']} layers{batch}, "
            f"{topology_header(topology, mesh, mesh_given=bool(d.get('mesh_given')))}")
  return (f"jaxckpt memory report: {d['model']}{preset}, {d['structure']} layers{batch}, backend {d['backend']} "
          f"× {d['device_count']} ({where})")


def estimate_lines(report: Report) -> list[str]:
  """One line per row with an estimated step time (a topology's compile): the term that bounds it and the largest
  terms (:func:`jaxckpt.timing.describe_step_time`; docs/timing.md); then one line of what the estimates rest on
  (:attr:`jaxckpt.timing.StepTime.basis`: the kernel rates and link figures, to hold against a measured step)."""
  rows = [r for r in report.rows if r["status"] == STATUS_OK and r.get("step_time_estimate")]
  lines = [f"est. step {r['policy']}: {describe_step_time(r['step_time_estimate'])}" for r in rows]
  basis: dict[str, str] = {}
  for r in rows:
    for key, line in (r["step_time_estimate"].get("basis") or {}).items():
      basis.setdefault(key, line)
  if basis:
    lines.append("est. step rests on: " + "; ".join(f"{k} {v}" for k, v in basis.items()) + " (docs/timing.md)")
  return lines


def plan_lines(report: Report) -> list[str]:
  """One line per budget row: the plan it compiled to."""
  return [f"{r['policy']} = {r['plan']['policy']} ({r['plan']['compiles']} compiles, {r['plan']['seconds']:.1f} s)"
          for r in report.rows if r.get("plan")]


