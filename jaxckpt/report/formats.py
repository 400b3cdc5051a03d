"""What every rendering of the report shares: number formats, the table's columns and cells, the title.

Records stay in bytes/FLOPs/seconds; only renderings use binary units (:func:`jaxckpt.format_bytes`). Ratios are
against the ``none`` row; ``*`` marks the best (smallest) value of a column among successful rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt.report.build import Report
from jaxckpt.report.keys import STATUS_OK
from jaxckpt.units import format_bytes

__all__ = ["COLUMNS", "Column", "format_flops", "table_cells", "table_rows", "report_title", "plan_lines", "top_groups"]

Column = tuple[str, str, Callable[[Any], str], bool]  # (header, row key, format, ratio vs none)


def _ms(seconds: float | None) -> str:
  return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_flops(n: int | None) -> str:
  """``n`` FLOPs as text with a decimal unit (``1.21 GFLOP``); ``"n/a"`` for ``None``."""
  if n is None:
    return "n/a"
  for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} FLOP"


def _seconds(s: float | None) -> str:
  return "n/a" if s is None else f"{s:.1f} s"


COLUMNS: tuple[Column, ...] = (
    ("footprint", "footprint_bytes", format_bytes, True),
    ("temp", "temp_bytes", format_bytes, True),
    ("residuals", "residual_bytes", format_bytes, True),
    ("FLOPs", "flops", format_flops, True),
    ("XLA FLOPs (raw)", "flops_xla_raw", format_flops, False),
    ("compile", "compile_s", _seconds, False),
    ("step time", "step_time_s", _ms, True),
    ("peak measured", "peak_bytes_measured", format_bytes, True),
)
"""The table's numeric columns: ``(header, row key, formatter, show ratio vs none)``."""


def top_groups(row: Mapping[str, Any], n: int = 3, *, sep: str = ", ") -> str:
  """The row's ``n`` largest residual groups (arguments left out), ``"key bytes"`` joined by ``sep``."""
  groups = (row.get("residuals") or {}).get("groups") or []
  groups = [g for g in groups if g["by"] != "kind" or g["key"] != "argument"][:n]
  return sep.join(f"{g['key']} {format_bytes(g['bytes'])}" for g in groups)


Cell = tuple[str, "float | str | None"]  # (text, sort value: the raw number, or the text)


def table_cells(report: Report, *, top_residuals: int = 3) -> tuple[list[str], list[list[Cell]]]:
  """The summary table: headers and per row ``(text, sort value)`` cells (the value is the raw number: bytes, FLOPs,
  seconds, ratio; ``None`` where missing), ratios vs ``none``, ``*`` = best of the column.

  Columns that are ``None`` in every row (e.g. step time without ``--measure``) are left out.
  """
  rows = report.rows
  ok = [r for r in rows if r["status"] == STATUS_OK]
  base = next((r for r in ok if r["policy"] == "none"), None)
  columns = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
  best = {key: min((r[key] for r in ok if r.get(key) is not None), default=None) for _, key, _, _ in columns}
  headers = ["policy", "status"]
  for header, _, _, ratio in columns:
    headers += [header] + (["×none"] if ratio and base is not None else [])
  headers.append("top residuals")
  out = []
  for r in rows:
    status = r["status"] if r["status"] == STATUS_OK else f"error: {r['error']}"
    if r["status"] == STATUS_OK and r.get("warning"):
      status = f"ok, warning: {r['warning']}"
    line: list[Cell] = [(r["policy"], r["policy"]), (status, status)]
    for _, key, fmt, ratio in columns:
      value = r.get(key)
      mark = " *" if value is not None and value == best[key] and len(ok) > 1 else ""
      line.append((fmt(value) + mark, value))
      if ratio and base is not None:
        rel = None if value is None or not base.get(key) else value / base[key]
        line.append(("n/a" if rel is None else f"{rel:.2f}", rel))
    top = top_groups(r, top_residuals)
    line.append((top, top))
    out.append(line)
  return headers, out


def table_rows(report: Report, *, top_residuals: int = 3) -> tuple[list[str], list[list[str]]]:
  """The summary table as strings (:func:`table_cells` without the sort values)."""
  headers, rows = table_cells(report, top_residuals=top_residuals)
  return headers, [[text for text, _ in row] for row in rows]


def report_title(report: Report) -> str:
  """The report's one-line title: model, preset, structure, backend, devices, mesh."""
  d = report.data
  preset = f" ({d['preset']})" if d["preset"] else ""
  mesh = d.get("mesh")
  where = (f"mesh {','.join(f'{k}={v}' for k, v in mesh.items())}: memory per device" if mesh
           else "one device, unsharded")
  return (f"jaxckpt memory report: {d['model']}{preset}, {d['structure']} layers, backend {d['backend']} "
          f"× {d['device_count']} ({where})")


def plan_lines(report: Report) -> list[str]:
  """One line per budget row: the plan it compiled to."""
  return [f"{r['policy']} = {r['plan']['policy']} ({r['plan']['compiles']} compiles, {r['plan']['seconds']:.1f} s)"
          for r in report.rows if r.get("plan")]


