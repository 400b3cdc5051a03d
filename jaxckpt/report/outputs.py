"""The report rendered: terminal table, JSON, CSV, Markdown, self-contained HTML, and a Pareto plot (PNG).

Records stay in bytes/FLOPs/seconds; only these renderings use binary units (:func:`jaxckpt.format_bytes`). Ratios
are against the ``none`` row; ``*`` marks the best (smallest) value of a column among successful rows.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxckpt.report.build import Report
from jaxckpt.report.keys import ROW_KEYS, STATUS_OK
from jaxckpt.units import format_bytes

__all__ = ["COLUMNS", "table_rows", "to_table", "to_markdown", "to_csv", "to_json", "to_html", "plot_pareto",
           "write_outputs"]

Column = tuple[str, str, Callable[[Any], str], bool]  # (header, row key, format, ratio vs none)


def _ms(seconds: float | None) -> str:
  return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _flops(n: int | None) -> str:
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
    ("FLOPs", "flops", _flops, True),
    ("XLA FLOPs (raw)", "flops_xla_raw", _flops, False),
    ("compile", "compile_s", _seconds, False),
    ("step time", "step_time_s", _ms, True),
    ("peak measured", "peak_bytes_measured", format_bytes, True),
)
"""The table's numeric columns: ``(header, row key, formatter, show ratio vs none)``."""


def _top_groups(row: Mapping[str, Any], n: int = 3) -> str:
  groups = (row.get("residuals") or {}).get("groups") or []
  groups = [g for g in groups if g["by"] != "kind" or g["key"] != "argument"][:n]
  return ", ".join(f"{g['key']} {format_bytes(g['bytes'])}" for g in groups)


def table_rows(report: Report, *, top_residuals: int = 3) -> tuple[list[str], list[list[str]]]:
  """The table as strings: headers and one list per row (ratios vs ``none``, ``*`` = best of the column).

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
    line = [r["policy"], r["status"] if r["status"] == STATUS_OK else f"error: {r['error']}"]
    for _, key, fmt, ratio in columns:
      value = r.get(key)
      mark = " *" if value is not None and value == best[key] and len(ok) > 1 else ""
      line.append(fmt(value) + mark)
      if ratio and base is not None:
        line.append("n/a" if value is None or not base.get(key) else f"{value / base[key]:.2f}")
    line.append(_top_groups(r, top_residuals))
    out.append(line)
  return headers, out


def _title(report: Report) -> str:
  d = report.data
  preset = f" ({d['preset']})" if d["preset"] else ""
  mesh = d.get("mesh")
  where = (f"mesh {','.join(f'{k}={v}' for k, v in mesh.items())}: memory per device" if mesh
           else "one device, unsharded")
  return (f"jaxckpt memory report: {d['model']}{preset}, {d['structure']} layers, backend {d['backend']} "
          f"× {d['device_count']} ({where})")


def _plan_lines(report: Report) -> list[str]:
  """One line per budget row: the plan it compiled to."""
  return [f"{r['policy']} = {r['plan']['policy']} ({r['plan']['compiles']} compiles, {r['plan']['seconds']:.1f} s)"
          for r in report.rows if r.get("plan")]


def to_table(report: Report) -> str:
  """An aligned plain-text table for the terminal, with the warnings under it."""
  headers, rows = table_rows(report)
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
  lines = [_title(report), fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)]
  lines.append("* = best of the column; ×none = ratio to the none row; FLOPs from the jaxpr (scan × length), "
               "XLA's raw count counts a loop body once")
  lines += _plan_lines(report)
  lines += [f"warning: {w}" for w in report.data["warnings"]]
  return "\n".join(lines)


def to_markdown(report: Report) -> str:
  """A GitHub-flavoured Markdown table with a title and the warnings."""
  headers, rows = table_rows(report)
  esc = lambda s: s.replace("|", "\\|")  # noqa: E731
  lines = [f"## {_title(report)}", "", "| " + " | ".join(map(esc, headers)) + " |",
           "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
  lines += ["", "`*` = best of the column; ×none = ratio to the `none` row."]
  lines += [f"- `{line.split(' = ', 1)[0]}` = `{line.split(' = ', 1)[1]}`" for line in _plan_lines(report)]
  lines += [f"- warning: {w}" for w in report.data["warnings"]]
  return "\n".join(lines) + "\n"


def _flat(row: Mapping[str, Any]) -> dict[str, Any]:
  out = {k: row[k] for k in ROW_KEYS if k not in ("residuals", "xla_dump")}
  out["residual_count"] = (row.get("residuals") or {}).get("count")
  out["xla_dump_dir"] = (row.get("xla_dump") or {}).get("dir")
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


def _pareto(points: Sequence[tuple[float, float]]) -> list[int]:
  """Indices of the points not dominated (smaller x and smaller y are better), sorted by x."""
  order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
  front, best_y = [], float("inf")
  for i in order:
    if points[i][1] < best_y:
      front.append(i)
      best_y = points[i][1]
  return front


def plot_pareto(report: Report, path: str | None = None) -> bytes:
  """Pareto charts (matplotlib, Agg): footprint and temp bytes vs FLOPs, and vs step time when measured.

  One labelled point per successful policy (budget plans as orange diamonds); the front (no other policy is
  better on both axes) is drawn.

  Args:
    report: the report.
    path: where to write the PNG; ``None`` = only return it.

  Returns:
    The PNG bytes.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  ok = [r for r in report.rows if r["status"] == STATUS_OK]
  x_axes = [("flops", "train-step FLOPs (jaxpr)", 1e9, "GFLOP")]
  if any(r["step_time_s"] is not None for r in ok):
    x_axes.append(("step_time_s", "measured step time", 1e-3, "ms"))
  y_axes = [("footprint_bytes", "compiled footprint"), ("temp_bytes", "compiled temp")]
  fig, axes = plt.subplots(len(y_axes), len(x_axes), figsize=(6.5 * len(x_axes), 4.2 * len(y_axes)), squeeze=False)
  for col, (xkey, xlabel, xscale, xunit) in enumerate(x_axes):
    for row_i, (ykey, ylabel) in enumerate(y_axes):
      ax = axes[row_i][col]
      pts = [(r[xkey] / xscale, r[ykey] / 2**20, r["policy"], r.get("plan") is not None) for r in ok
             if r.get(xkey) is not None and r.get(ykey) is not None]
      if pts:
        for budget, style in ((False, {"color": "tab:blue", "marker": "o", "label": "fixed policies"}),
                              (True, {"color": "tab:orange", "marker": "D", "label": "budget plans"})):
          chosen = [p for p in pts if p[3] == budget]
          if chosen:
            ax.scatter([p[0] for p in chosen], [p[1] for p in chosen], zorder=3, **style)
        for x, y, label, _ in pts:
          ax.annotate(label, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        front = [pts[i] for i in _pareto([(p[0], p[1]) for p in pts])]
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", lw=1.2, zorder=2,
                label="Pareto front", drawstyle="steps-post")
        ax.legend(fontsize=7, loc="upper right")
      ax.set_xlabel(f"{xlabel} ({xunit})")
      ax.set_ylabel(f"{ylabel} (MiB)")
      ax.grid(alpha=0.3)
  fig.suptitle(_title(report), fontsize=9)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=90)
  plt.close(fig)
  data = buffer.getvalue()
  if path is not None:
    with open(path, "wb") as f:
      f.write(data)
  return data


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
  body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
  return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _link(path: str | None, base: str | None, label: str) -> str:
  if not path:
    return ""
  href = os.path.relpath(path, base) if base else path
  return f'<a href="{html.escape(href)}">{html.escape(label)}</a>'


def to_html(report: Report, *, base_dir: str | None = None, plot: bool = True) -> str:
  """One self-contained HTML page: summary table, Pareto plot (base64 PNG), per-policy residuals and XLA buffers.

  Args:
    report: the report.
    base_dir: directory the HTML file will live in (links to XLA dump files are made relative to it).
    plot: embed the Pareto plot.
  """
  headers, rows = table_rows(report, top_residuals=3)
  esc_rows = [[html.escape(c) for c in r] for r in rows]
  d = report.data
  parts = [
      "<!DOCTYPE html><html><head><meta charset='utf-8'>",
      f"<title>{html.escape(_title(report))}</title>",
      "<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;"
      "font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
      "td:first-child,th:first-child{text-align:left}code{font-size:12px}details{margin:.4em 0}"
      ".warn{color:#a40}</style></head><body>",
      f"<h1>{html.escape(_title(report))}</h1>",
      f"<p>versions: {html.escape(', '.join(f'{k} {v}' for k, v in d['versions'].items()))}; compiler options: "
      f"<code>{html.escape(json.dumps(d['compiler_options']))}</code></p>",
      _html_table(headers, esc_rows),
      "<p><code>*</code> = best of the column; ×none = ratio to the <code>none</code> row. FLOPs are counted from "
      "the jaxpr (scan bodies × trip count); XLA's raw count counts a loop body once. Residual bytes exclude "
      "arguments and are an upper bound (XLA may fuse some away).</p>",
  ]
  if d["warnings"]:
    parts.append("<ul>" + "".join(f"<li class='warn'>{html.escape(w)}</li>" for w in d["warnings"]) + "</ul>")
  if plot and any(r["status"] == STATUS_OK for r in report.rows):
    png = base64.b64encode(plot_pareto(report)).decode("ascii")
    parts.append(f"<h2>Pareto front</h2><img alt='Pareto plot' src='data:image/png;base64,{png}'>")
  parts.append("<h2>Per policy</h2>")
  for r in report.rows:
    parts.append(f"<details><summary><b>{html.escape(r['policy'])}</b> — {html.escape(r['status'])}"
                 f"{': ' + html.escape(r['error']) if r['error'] else ''}</summary>")
    res = r.get("residuals")
    if res:
      parts.append(f"<p>residuals ({res['analysed']}): {res['count']} values, {html.escape(format_bytes(res['bytes']))}"
                   f" (+ arguments {html.escape(format_bytes(res['argument_bytes']))})</p>")
      parts.append(_html_table(["checkpoint name / primitive", "by", "count", "bytes"],
                               [[html.escape(str(g["key"])), g["by"], str(g["count"]),
                                 html.escape(format_bytes(g["bytes"]))] for g in res["groups"][:12]]))
      parts.append(_html_table(["source line", "count", "bytes"],
                               [[html.escape(str(g["key"])), str(g["count"]), html.escape(format_bytes(g["bytes"]))]
                                for g in res["by_source"][:12]]))
    dump = r.get("xla_dump")
    if dump:
      links = " · ".join(filter(None, (_link(p, base_dir, k) for k, p in dump["files"].items())))
      parts.append(f"<p>XLA's reports: {links}</p>")
      parts.append(_html_table(["buffer live at peak", "bytes", "HLO op", "shape", "JAX op_name", "source"],
                               [[html.escape(b["buffer"]), html.escape(format_bytes(b["bytes"])),
                                 html.escape(str(b["opcode"])), html.escape(str(b["shape"])),
                                 f"<code>{html.escape(str(b['op_name']))}</code>", html.escape(str(b["source"]))]
                                for b in dump["peak_buffers"]]))
    parts.append("</details>")
  parts.append("</body></html>")
  return "\n".join(parts)


def write_outputs(report: Report, *, json_path: str | None = None, csv_path: str | None = None,
                  markdown_path: str | None = None, html_path: str | None = None,
                  plot_path: str | None = None) -> list[str]:
  """Writes every requested file (parent directories created).

  Returns:
    The paths written, in argument order.
  """
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
  write(html_path, lambda: to_html(report, base_dir=os.path.dirname(os.path.abspath(html_path))))
  if plot_path is not None:
    os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
    plot_pareto(report, plot_path)
    written.append(plot_path)
  return written
