"""The report rendered: terminal table, JSON, CSV, Markdown, and (from :mod:`jaxckpt.report._html` and
:mod:`jaxckpt.report._plot`) the interactive HTML page and the static Pareto chart; :func:`write_outputs` writes them.

Records stay in bytes/FLOPs/seconds; only these renderings use binary units (:func:`jaxckpt.format_bytes`). Ratios
are against the ``none`` row; ``*`` marks the best (smallest) value of a column among successful rows.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt._paths import write_atomically
from jaxckpt.errors import JaxckptError, shorten
from jaxckpt.report._build import Report
from jaxckpt.report._formats import (column_header, estimate_lines, main_sources, plan_lines, report_title, row_value,
                                     shown_columns, table_rows, top_groups)
from jaxckpt.report._html import PLOTLYJS_MODES, to_html
from jaxckpt.report._keys import ROW_KEYS, STATUS_OK
from jaxckpt.report._plot import plot_format, plot_pareto
from jaxckpt.rendering._tables import fit_widths, longest_word, render_table, short_labels, terminal_width


WIDE_ONLY = ("XLA FLOPs (raw)",)
"""Columns only ``--wide`` (and JSON/CSV/Markdown/HTML) show: the terminal table leaves them out to fit."""

LEGEND_CHARS = 400
"""Characters of a policy the terminal table's legend shows (``[1] = <policy>``); the rest is cut with ``...`` (the
whole policy is in JSON, CSV and HTML), as errors cut a long spec."""

_NOTE = ("* = best of the column; ×none = ratio to the none row; FLOPs from the jaxpr (scan × length), XLA's raw "
         "count counts a loop body once")


def _policy_cell(policy: str, labels: Mapping[str, str], piece: int = 22) -> str:
  """The policy as the narrow table shows it: whole when it fits ``piece`` characters, else broken after ``:`` and
  ``,`` into at most 3 lines when each piece fits, else ``None`` (it gets a short label)."""
  if len(policy) <= piece:
    return policy
  pieces = re.findall(r"[^:,]+[:,]?", policy)
  if all(len(p) <= piece for p in pieces):
    lines = [""]
    for p in pieces:
      if len(lines[-1]) + len(p) > piece:
        lines.append("")
      lines[-1] += p
    if len(lines) <= 3:
      return "\n".join(lines)
  return labels[policy]


def _unshown_warnings(report: Report) -> list[str]:
  """The report's warnings less those that repeat an error row's message (the row already says it)."""
  errors = [r["error"] for r in report.rows if r["status"] != STATUS_OK and r.get("error")]
  return [w for w in report.data["warnings"] if not any(e in w for e in errors)]


def to_table(report: Report, *, width: int | None = None, wide: bool = False) -> str:
  """The terminal table, with the budget plans, the errors and the warnings under it.

  By default it fits ``width`` characters (``None``: the terminal's,
  :func:`jaxckpt.rendering._tables.terminal_width`): each value has its ratio to ``none`` under it, a long policy string is broken after ``:``/``,`` or becomes a short
  label with a legend (the full strings are in JSON/CSV/HTML), an error row's message is printed once, wrapped,
  under the table, and :data:`WIDE_ONLY` columns are left out. ``wide`` prints every row on one line, every column
  included (the layout of :func:`to_markdown`).

  Args:
    report: the report.
    width: characters per line (no line is longer); ``None`` = the terminal's.
    wide: one line per row, whatever its length.

  Returns:
    The text, no final newline.
  """
  errors = {r["policy"]: r["error"] for r in report.rows if r["status"] != STATUS_OK and r.get("error")}
  warnings = _unshown_warnings(report)
  if wide:
    headers, rows = table_rows(report)
    notes = [_NOTE, *plan_lines(report), *estimate_lines(report), *[f"warning: {w}" for w in warnings]]
    return render_table(headers, rows, title=report_title(report), notes=notes, wide=True)
  rows = report.rows
  ok = [r for r in rows if r["status"] == STATUS_OK]
  sources = main_sources(ok)
  base = next((r for r in ok if r["policy"] == "none"), None)
  columns = [c for c in shown_columns(rows) if c[0] not in WIDE_ONLY]
  best = {key: min((row_value(r, key) for r in ok if row_value(r, key) is not None), default=None)
          for _, key, _, _ in columns}
  long = [r["policy"] for r in rows if "\n" not in _policy_cell(r["policy"], {r["policy"]: ""})
          and len(r["policy"]) > 22]
  labels, legend = short_labels(long, max_len=0, keep=12)
  legend = [shorten(line, LEGEND_CHARS) for line in legend]  # a 20,000-character spec: whole in JSON/CSV/HTML only
  headers = ["policy", *(column_header(report, h, key, lines=True)  # "footprint" over "/chip": narrow columns
                         + ("\n×none" if ratio and base is not None else "") for h, key, _, ratio in columns),
             "top residuals"]
  table = []
  for r in rows:
    cells = [_policy_cell(r["policy"], labels) + ("\n(warning below)" if r.get("warning") else "")]
    for _, key, fmt, ratio in columns:
      value = row_value(r, key)
      if r["status"] != STATUS_OK:
        cells.append("")
        continue
      mark = " *" if value is not None and value == best[key] and len(ok) > 1 else ""
      if ratio and base is not None:
        rel = None if value is None or not row_value(base, key) else value / row_value(base, key)
        cells.append(f"{fmt(value)}\n{'n/a' if rel is None else f'{rel:.2f}'}{mark}")
      else:
        cells.append(fmt(value) + mark)
    cells.append(top_groups(r, sep="\n", sources=sources, brief=True) if r["status"] == STATUS_OK else "error (below)")
    table.append(cells)
  plans = [f"{labels.get(r['policy'], r['policy'])} = {r['plan']['policy']} ({r['plan']['compiles']} compiles, "
           f"{r['plan']['seconds']:.1f} s)" for r in rows if r.get("plan")]
  notes = [_NOTE + "; --wide: XLA's raw FLOPs, one line per row", *legend, *plans, *estimate_lines(report),
           *[f"error: {labels.get(p, p)}: {e}" for p, e in errors.items()],
           *[f"warning: {w}" for w in warnings]]
  # Numbers keep their width; the policy and then the residual groups wrap.
  natural = [max(len(part) for cell in [headers[i], *(row[i] for row in table)] for part in cell.split("\n"))
             for i in range(len(headers))]
  numbers = range(1, len(headers) - 1)
  words = {i: longest_word([headers[i], *(row[i] for row in table)]) for i in range(len(headers))}  # file:line
  widths = fit_widths(natural, width or terminal_width(), keep=numbers, least=12, floors=words)
  return render_table(headers, table, title=report_title(report), notes=notes, width=width, right=numbers,
                      widths=widths)


def to_markdown(report: Report) -> str:
  """A GitHub-flavoured Markdown table with a title and the warnings."""
  headers, rows = table_rows(report)
  esc = lambda s: s.replace("|", "\\|")  # noqa: E731
  lines = [f"## {report_title(report)}", "", "| " + " | ".join(map(esc, headers)) + " |",
           "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
  lines += ["", "`*` = best of the column; ×none = ratio to the `none` row."]
  lines += [f"- `{line.split(' = ', 1)[0]}` = `{line.split(' = ', 1)[1]}`" for line in plan_lines(report)]
  lines += [f"- {line}" for line in estimate_lines(report)]
  lines += [f"- warning: {w}" for w in _unshown_warnings(report)]
  return "\n".join(lines) + "\n"


def _flat(row: Mapping[str, Any]) -> dict[str, Any]:
  out = {k: row[k] for k in ROW_KEYS if k not in ("residuals", "xla_dump", "profile")}
  out["residual_count"] = (row.get("residuals") or {}).get("count")
  out["xla_dump_dir"] = (row.get("xla_dump") or {}).get("dir")
  out["profile_dir"] = (row.get("profile") or {}).get("dir")
  for key, value in out.items():  # nested values (stages_s, plan) as JSON text, never a Python repr
    if isinstance(value, (dict, list, tuple)):
      out[key] = json.dumps(value, sort_keys=False)
  return out


def to_csv(report: Report) -> str:
  """One CSV line per row: every scalar key of :data:`ROW_KEYS` (bytes, FLOPs, seconds as plain numbers); nested
  values (``stages_s``, ``plan``) as JSON text (``{"build": 0.1, ...}``), read back with ``json.loads``."""
  buffer = io.StringIO()
  flat = [_flat(r) for r in report.rows]
  writer = csv.DictWriter(buffer, fieldnames=list(flat[0]) if flat else list(ROW_KEYS), lineterminator="\n")
  writer.writeheader()
  writer.writerows(flat)
  return buffer.getvalue()


def to_json(report: Report) -> str:
  """The report as JSON (keys :data:`jaxckpt.report._keys.REPORT_KEYS`), indented."""
  return json.dumps(report.data, indent=2)


def write_outputs(report: Report, *, json_path: str | None = None, csv_path: str | None = None,
                  markdown_path: str | None = None, html_path: str | None = None,
                  plot_path: str | None = None, plotlyjs: str = "inline") -> list[str]:
  """Writes every requested file (parent directories created), each atomically
  (:func:`jaxckpt._paths.write_atomically`: a temporary file beside it, renamed into place).

  Args:
    report: the report.
    json_path, csv_path, markdown_path, html_path: files to write (``None`` = not that one).
    plot_path: the static Pareto chart; its suffix picks the format (:data:`jaxckpt.report._plot.PLOT_SUFFIXES`).
    plotlyjs: how the HTML page gets plotly.js: ``"inline"`` (works offline) or ``"cdn"``.

  Returns:
    The paths written, in argument order.

  Raises:
    JaxckptError: an unknown suffix of ``plot_path`` or ``plotlyjs`` value, before anything is written.
    OutputWriteError: a file could not be written (a full disk): its previous content is kept.
  """
  if plot_path is not None:
    plot_format(plot_path, flag="plot_path")
  if plotlyjs not in PLOTLYJS_MODES:
    raise JaxckptError(f"plotlyjs={plotlyjs!r} is not one of {', '.join(PLOTLYJS_MODES)}")
  written = []

  def write(path: str | None, text: Callable[[], str]) -> None:
    if path is None:
      return
    write_atomically(path, lambda f: f.write(text()))  # whole or not at all: the previous file is kept
    written.append(path)

  write(json_path, lambda: to_json(report))
  write(csv_path, lambda: to_csv(report))
  write(markdown_path, lambda: to_markdown(report))
  write(html_path, lambda: to_html(report, base_dir=os.path.dirname(os.path.abspath(html_path)), plotlyjs=plotlyjs))
  if plot_path is not None:
    plot_pareto(report, plot_path)
    written.append(plot_path)
  return written
