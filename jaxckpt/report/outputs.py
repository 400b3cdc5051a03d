"""The report rendered: terminal table, JSON, CSV, Markdown, and (from :mod:`jaxckpt.report.html` and
:mod:`jaxckpt.report.plot`) the interactive HTML page and the static Pareto chart; :func:`write_outputs` writes them.

Records stay in bytes/FLOPs/seconds; only these renderings use binary units (:func:`jaxckpt.format_bytes`). Ratios
are against the ``none`` row; ``*`` marks the best (smallest) value of a column among successful rows.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt.errors import JaxckptError
from jaxckpt.report.build import Report
from jaxckpt.report.formats import COLUMNS, plan_lines, report_title, table_rows
from jaxckpt.report.html import PLOTLYJS_MODES, to_html
from jaxckpt.report.keys import ROW_KEYS
from jaxckpt.report.plot import plot_format, plot_pareto

__all__ = ["COLUMNS", "table_rows", "to_table", "to_markdown", "to_csv", "to_json", "to_html", "plot_pareto",
           "write_outputs"]


def to_table(report: Report) -> str:
  """An aligned plain-text table for the terminal, with the warnings under it."""
  headers, rows = table_rows(report)
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
  lines = [report_title(report), fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)]
  lines.append("* = best of the column; ×none = ratio to the none row; FLOPs from the jaxpr (scan × length), "
               "XLA's raw count counts a loop body once")
  lines += plan_lines(report)
  lines += [f"warning: {w}" for w in report.data["warnings"]]
  return "\n".join(lines)


def to_markdown(report: Report) -> str:
  """A GitHub-flavoured Markdown table with a title and the warnings."""
  headers, rows = table_rows(report)
  esc = lambda s: s.replace("|", "\\|")  # noqa: E731
  lines = [f"## {report_title(report)}", "", "| " + " | ".join(map(esc, headers)) + " |",
           "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
  lines += ["", "`*` = best of the column; ×none = ratio to the `none` row."]
  lines += [f"- `{line.split(' = ', 1)[0]}` = `{line.split(' = ', 1)[1]}`" for line in plan_lines(report)]
  lines += [f"- warning: {w}" for w in report.data["warnings"]]
  return "\n".join(lines) + "\n"


def _flat(row: Mapping[str, Any]) -> dict[str, Any]:
  out = {k: row[k] for k in ROW_KEYS if k not in ("residuals", "xla_dump", "profile")}
  out["residual_count"] = (row.get("residuals") or {}).get("count")
  out["xla_dump_dir"] = (row.get("xla_dump") or {}).get("dir")
  out["profile_dir"] = (row.get("profile") or {}).get("dir")
  return out


def to_csv(report: Report) -> str:
  """One CSV line per row: every scalar key of :data:`ROW_KEYS` (bytes, FLOPs, seconds as plain numbers)."""
  buffer = io.StringIO()
  flat = [_flat(r) for r in report.rows]
  writer = csv.DictWriter(buffer, fieldnames=list(flat[0]) if flat else list(ROW_KEYS), lineterminator="\n")
  writer.writeheader()
  writer.writerows(flat)
  return buffer.getvalue()


def to_json(report: Report) -> str:
  """The report as JSON (keys :data:`jaxckpt.report.keys.REPORT_KEYS`), indented."""
  return json.dumps(report.data, indent=2)


def write_outputs(report: Report, *, json_path: str | None = None, csv_path: str | None = None,
                  markdown_path: str | None = None, html_path: str | None = None,
                  plot_path: str | None = None, plotlyjs: str = "inline") -> list[str]:
  """Writes every requested file (parent directories created).

  Args:
    report: the report.
    json_path, csv_path, markdown_path, html_path: files to write (``None`` = not that one).
    plot_path: the static Pareto chart; its suffix picks the format (:data:`jaxckpt.report.plot.PLOT_SUFFIXES`).
    plotlyjs: how the HTML page gets plotly.js: ``"inline"`` (works offline) or ``"cdn"``.

  Returns:
    The paths written, in argument order.

  Raises:
    JaxckptError: an unknown suffix of ``plot_path`` or ``plotlyjs`` value, before anything is written.
  """
  if plot_path is not None:
    plot_format(plot_path, flag="plot_path")
  if plotlyjs not in PLOTLYJS_MODES:
    raise JaxckptError(f"plotlyjs={plotlyjs!r} is not one of {', '.join(PLOTLYJS_MODES)}")
  written = []

  def write(path: str | None, text: Callable[[], str]) -> None:
    if path is None:
      return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      f.write(text())
    written.append(path)

  write(json_path, lambda: to_json(report))
  write(csv_path, lambda: to_csv(report))
  write(markdown_path, lambda: to_markdown(report))
  write(html_path, lambda: to_html(report, base_dir=os.path.dirname(os.path.abspath(html_path)), plotlyjs=plotlyjs))
  if plot_path is not None:
    plot_pareto(report, plot_path)
    written.append(plot_path)
  return written
