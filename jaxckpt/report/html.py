"""The report as one self-contained, interactive HTML page (plotly charts, sortable tables).

The page holds, in order: the summary table; the Pareto charts (compiled temp and footprint bytes against the FLOPs
ratio to ``none``, and against measured step time when measured); a stacked bar per policy of argument / output /
temp bytes; the residuals each policy keeps, stacked by checkpoint name (unnamed ones by primitive); for budget rows
the plan per layer range; then per policy the residuals by name and source line, XLA's buffers at peak and the
XProf run. Charts answer hover with the policy and exact bytes / FLOPs and carry no text labels on the data (so none
overlap); every table sorts by a click on its header (a few lines of inline JavaScript, numbers by their raw value).

plotly.js is inlined once (``plotlyjs="inline"``, ~4.8 MB, the page then works offline) or loaded from plotly's CDN
(``plotlyjs="cdn"``, a page of ~100 KB that needs the network to draw its charts).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxckpt.errors import JaxckptError
from jaxckpt.report.build import Report
from jaxckpt.report.formats import Cell, format_flops, plan_lines, report_title, table_cells
from jaxckpt.report.keys import STATUS_OK
from jaxckpt.report.plot import pareto_indices
from jaxckpt.units import format_bytes

__all__ = ["PLOTLYJS_MODES", "to_html", "chart_figures"]

PLOTLYJS_MODES = ("inline", "cdn")
"""How the page gets plotly.js: ``inline`` (offline, ~4.8 MB) or ``cdn`` (small, needs the network)."""

_MIB = 2**20
_TOP_RESIDUAL_KEYS = 12

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
td:first-child,th:first-child,td.text,th.text{text-align:left}td.text{white-space:normal;min-width:12em}
th{background:#f3f3f3;cursor:pointer;user-select:none;white-space:nowrap}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
code{font-size:12px}details{margin:.4em 0}.warn{color:#a40}.note{color:#555;font-size:13px}
.chart{margin:.5em 0 1em 0}
"""

# Click a header: sort its table's rows by the cells' data-sort (raw numbers) or text; missing values stay last.
_SORT_JS = """
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var col = Array.prototype.indexOf.call(th.parentNode.children, th);
    var asc = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    function key(row) {
      var cell = row.cells[col], v = cell.getAttribute("data-sort");
      if (v === null) v = cell.textContent;
      var n = Number(v);
      return v === "" ? null : (isNaN(n) ? v.toLowerCase() : n);
    }
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      if (x === null || y === null) return x === y ? 0 : (x === null ? 1 : -1);
      var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
      return asc ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""


def _sort_attr(value: Any) -> str:
  if value is None:
    return ' data-sort=""'
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return f' data-sort="{value!r}"'
  return ""


def _table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], *, text_columns: Sequence[int] = (0,),
           escape: bool = True) -> str:
  """A sortable table; cells are ``(text, sort value)`` (numbers sort by value; ``None`` = missing, sorts last)."""
  def cls(i: int) -> str:
    return ' class="text"' if i in text_columns else ""

  head = "".join(f"<th{cls(i)}>{html.escape(h)}</th>" for i, h in enumerate(headers))
  body = "".join(
      "<tr>" + "".join(f"<td{cls(i)}{_sort_attr(v)}>{html.escape(t) if escape else t}</td>"
                       for i, (t, v) in enumerate(row)) + "</tr>" for row in rows)
  return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _bytes_cell(n: int | None) -> Cell:
  return (format_bytes(n), n)


def _link(path: str | None, base: str | None, label: str) -> str:
  if not path:
    return ""
  href = os.path.relpath(path, base) if base else path
  return f'<a href="{html.escape(href)}">{html.escape(label)}</a>'


def _ok(report: Report) -> list[dict[str, Any]]:
  return [r for r in report.rows if r["status"] == STATUS_OK]


def _colors() -> list[str]:
  import plotly.colors  # pylint: disable=g-import-not-at-top

  return list(plotly.colors.qualitative.Dark24)


def _pareto_figure(report: Report):
  import plotly.graph_objects as go  # pylint: disable=g-import-not-at-top
  from plotly.subplots import make_subplots  # pylint: disable=g-import-not-at-top

  ok = [r for r in _ok(report) if r.get("flops") is not None]
  if not ok:
    return None
  base = next((r for r in ok if r["policy"] == "none"), None)
  x_axes = []
  if base is not None and base["flops"]:
    x_axes.append(("flops", lambda r: r["flops"] / base["flops"], "FLOPs ÷ none's (recompute overhead)"))
  else:
    x_axes.append(("flops", lambda r: r["flops"] / 1e9, "train-step FLOPs (GFLOP)"))
  if any(r.get("step_time_s") is not None for r in ok):
    x_axes.append(("step_time_s", lambda r: r["step_time_s"] * 1e3, "measured step time (ms)"))
  y_axes = [("temp_bytes", "compiled temp"), ("footprint_bytes", "compiled footprint")]
  panels = [(x, y) for x in x_axes for y in y_axes]
  fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.08,
                      subplot_titles=[f"{ylabel} vs {xlabel.split(' (')[0]}" for (_, _, xlabel), (_, ylabel) in panels])
  colors = _colors()
  for col, ((xkey, xval, xlabel), (ykey, ylabel)) in enumerate(panels, start=1):
    pts = [r for r in ok if r.get(xkey) is not None and r.get(ykey) is not None]
    for i, r in enumerate(ok):
      if r not in pts:
        continue
      budget = r.get("plan") is not None
      fig.add_trace(go.Scatter(
          x=[xval(r)], y=[r[ykey] / _MIB], mode="markers", name=r["policy"], legendgroup=r["policy"],
          showlegend=col == 1,
          marker={"size": 11, "color": colors[i % len(colors)], "symbol": "diamond" if budget else "circle",
                  "line": {"width": 1, "color": "#333"}},
          customdata=[[r["policy"], r[ykey], r["flops"], xval(r), r.get("step_time_s") or 0.0]],
          hovertemplate=(f"<b>%{{customdata[0]}}</b><br>{ylabel}: %{{customdata[1]:,}} bytes (%{{y:.2f}} MiB)"
                         "<br>FLOPs: %{customdata[2]:,}"
                         + ("<br>× none: %{customdata[3]:.4f}" if xkey == "flops" and base is not None else "")
                         + ("<br>step time: %{x:.2f} ms" if xkey == "step_time_s" else "")
                         + "<extra></extra>")),
          row=1, col=col)
    front = [pts[j] for j in pareto_indices([(xval(r), r[ykey]) for r in pts])]
    if front:
      fig.add_trace(go.Scatter(
          x=[xval(r) for r in front], y=[r[ykey] / _MIB for r in front], mode="lines", line_shape="hv",
          line={"color": "#d62728", "width": 1.5}, name="Pareto front", legendgroup="Pareto front",
          showlegend=col == 1, hoverinfo="skip"), row=1, col=col)
    fig.update_xaxes(title_text=xlabel, row=1, col=col)
    fig.update_yaxes(title_text=f"{ylabel} (MiB)", row=1, col=col, rangemode="tozero")
  fig.update_layout(height=430, margin={"t": 40, "b": 40, "l": 60, "r": 10}, legend={"font": {"size": 11}},
                    hovermode="closest", template="plotly_white")
  return fig


def _memory_figure(report: Report):
  import plotly.graph_objects as go  # pylint: disable=g-import-not-at-top

  ok = [r for r in _ok(report) if r.get("temp_bytes") is not None]
  if not ok:
    return None
  fig = go.Figure()
  policies = [r["policy"] for r in ok]
  for key, label, color in (("argument_bytes", "arguments (params, optimizer state, batch)", "#9ecae1"),
                            ("output_bytes", "outputs", "#6baed6"), ("temp_bytes", "temp", "#e6550d")):
    values = [r.get(key) for r in ok]
    fig.add_trace(go.Bar(
        x=policies, y=[(v or 0) / _MIB for v in values], name=label, marker_color=color,
        customdata=[[v, r.get("alias_bytes"), r.get("footprint_bytes")] for v, r in zip(values, ok)],
        hovertemplate=(f"<b>%{{x}}</b><br>{label}: %{{customdata[0]:,}} bytes (%{{y:.2f}} MiB)"
                       "<br>aliased (donated): %{customdata[1]:,} bytes<br>footprint: %{customdata[2]:,} bytes"
                       "<extra></extra>")))
  fig.update_layout(barmode="stack", height=380, template="plotly_white", yaxis_title="MiB (compiled)",
                    margin={"t": 20, "b": 40, "l": 60, "r": 10}, xaxis={"tickangle": -30, "automargin": True})
  return fig


def _residual_label(group: Mapping[str, Any]) -> str:
  return str(group["key"]) if group["by"] == "name" else f"{group['key']} ({group['by']}, unnamed)"


def _residuals_figure(report: Report):
  import plotly.graph_objects as go  # pylint: disable=g-import-not-at-top

  ok = [r for r in _ok(report) if r.get("residuals")]
  if not ok:
    return None
  per_row = []
  for r in ok:
    groups = [g for g in r["residuals"]["groups"] if not (g["by"] == "kind" and g["key"] == "argument")]
    per_row.append({_residual_label(g): g for g in groups})
  largest: dict[str, int] = {}
  for groups in per_row:
    for label, g in groups.items():
      largest[label] = max(largest.get(label, 0), g["bytes"])
  keys = sorted(largest, key=lambda k: (-largest[k], k))
  shown, rest = keys[:_TOP_RESIDUAL_KEYS], keys[_TOP_RESIDUAL_KEYS:]
  colors = _colors()
  fig = go.Figure()
  policies = [r["policy"] for r in ok]
  for i, label in enumerate([*shown, *(["other"] if rest else [])]):
    cells = []
    for groups in per_row:
      chosen = [groups[k] for k in (rest if label == "other" else [label]) if k in groups]
      cells.append((sum(g["bytes"] for g in chosen), sum(g["count"] for g in chosen)))
    fig.add_trace(go.Bar(
        x=policies, y=[b / _MIB for b, _ in cells], name=label, marker_color=colors[i % len(colors)],
        customdata=[[label, b, n] for b, n in cells],
        hovertemplate=("<b>%{x}</b><br>%{customdata[0]}: %{customdata[2]} values, %{customdata[1]:,} bytes "
                       "(%{y:.2f} MiB)<extra></extra>")))
  fig.update_layout(barmode="stack", height=400, template="plotly_white", yaxis_title="MiB saved for backward",
                    margin={"t": 20, "b": 40, "l": 60, "r": 10}, xaxis={"tickangle": -30, "automargin": True},
                    legend={"font": {"size": 11}, "title": {"text": "checkpoint name / primitive"}})
  return fig


def _plan_figure(report: Report):
  import plotly.graph_objects as go  # pylint: disable=g-import-not-at-top

  planned = [r for r in report.rows if r.get("plan") and r["plan"].get("ranges")]
  if not planned:
    return None
  colors = _colors()
  specs: dict[str, str] = {}
  fig = go.Figure()
  for r in planned:
    for rng in r["plan"]["ranges"]:
      spec = rng["spec"]
      first = spec not in specs
      color = specs.setdefault(spec, colors[len(specs) % len(colors)])
      n = rng["last"] - rng["first"] + 1
      fig.add_trace(go.Bar(
          y=[r["policy"]], x=[n], base=[rng["first"]], orientation="h", name=spec, legendgroup=spec,
          showlegend=first, marker={"color": color, "line": {"width": 1, "color": "white"}},
          customdata=[[rng["first"], rng["last"], spec]],
          hovertemplate="<b>%{y}</b><br>layers %{customdata[0]}–%{customdata[1]}: %{customdata[2]}<extra></extra>"))
  fig.update_layout(barmode="overlay", height=140 + 45 * len(planned), template="plotly_white",
                    xaxis_title="layer", yaxis={"automargin": True}, margin={"t": 20, "b": 40, "l": 60, "r": 10},
                    legend={"font": {"size": 11}, "title": {"text": "policy of the layers"}})
  return fig


def chart_figures(report: Report) -> dict[str, Any]:
  """The page's plotly figures by id (``pareto``, ``memory``, ``residuals``, ``plan``), those with data only.

  Returns:
    ``{id: plotly.graph_objects.Figure}``; y values in MiB, exact bytes in each point's ``customdata``.
  """
  figures = {"pareto": _pareto_figure(report), "memory": _memory_figure(report),
             "residuals": _residuals_figure(report), "plan": _plan_figure(report)}
  return {k: f for k, f in figures.items() if f is not None}


_CHART_TEXT = {
    "pareto": ("Pareto front: memory vs recompute",
               "Each point is a policy (diamonds: budget plans); hover for exact bytes and FLOPs, click a legend "
               "entry to hide it. The red step line joins the policies no other beats on both axes."),
    "memory": ("Compiled memory per policy", "XLA's compiled statistics of the whole train step: arguments "
               "(parameters, optimizer state, batch), outputs and temp; footprint = their sum − aliased (donated)."),
    "residuals": ("What each policy keeps for the backward pass",
                  "Residual bytes by checkpoint name (unnamed residuals by primitive), from JAX's saved-residual "
                  "analysis of the unrolled model; an upper bound, XLA may fuse some away. Tables per policy below."),
    "plan": ("Budget plans per layer range", "The per-layer policy each budget row compiled to (jaxckpt.planner)."),
}


def _residual_source_rows(row: Mapping[str, Any]) -> list[list[Cell]]:
  """Residuals grouped by (checkpoint name or primitive, source line): count, bytes, shapes."""
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for item in row["residuals"]["items"]:
    if item["kind"] == "argument":
      continue
    label = item["name"] or f"{item['primitive'] or item['kind']} (unnamed)"
    g = groups.setdefault((label, item["source"] or "?"), {"count": 0, "bytes": 0, "shapes": {}})
    g["count"] += 1
    g["bytes"] += item["bytes"]
    shape = f"{item['dtype']}{list(item['shape'])}"
    g["shapes"][shape] = g["shapes"].get(shape, 0) + 1
  out = []
  for (label, source), g in sorted(groups.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])):
    shapes = ", ".join(f"{s}×{n}" if n > 1 else s for s, n in list(g["shapes"].items())[:3])
    out.append([(label, label), (source, source), (str(g["count"]), g["count"]), _bytes_cell(g["bytes"]),
                (shapes, shapes)])
  return out


def _plan_table(report: Report) -> str:
  planned = [r for r in report.rows if r.get("plan")]
  if not planned:
    return ""
  rows = []
  for r in planned:
    p = r["plan"]
    ratio = p["flops"] / p["flops_none"] if p.get("flops") and p.get("flops_none") else None
    ranges = "; ".join(f"{g['first']}–{g['last']}: {g['spec']}" for g in p.get("ranges") or [])
    rows.append([(r["policy"], r["policy"]), _bytes_cell(p.get("limit_bytes")),
                 _bytes_cell(p.get("predicted_temp_bytes")), _bytes_cell((p.get("compiled") or {}).get("temp_bytes")),
                 ("n/a" if ratio is None else f"{ratio:.3f}", ratio), (str(p["compiles"]), p["compiles"]),
                 (f"{p['seconds']:.1f} s", p["seconds"]), (ranges, ranges)])
  return _table(["budget", "limit", "predicted temp", "compiled temp", "FLOPs ×none", "compiles", "planning",
                 "layer ranges"], rows, text_columns=(0, 7))


def to_html(report: Report, *, base_dir: str | None = None, plot: bool = True, plotlyjs: str = "inline") -> str:
  """One self-contained HTML page: sortable tables, interactive charts, per-policy residuals and XLA buffers.

  Args:
    report: the report.
    base_dir: directory the HTML file will live in (links to XLA dumps and XProf traces are made relative to it).
    plot: include the charts (``False``: tables only, no plotly.js).
    plotlyjs: ``"inline"`` (default; the page works offline) or ``"cdn"`` (loads plotly.js from cdn.plot.ly).

  Returns:
    The page (str).

  Raises:
    JaxckptError: an unknown ``plotlyjs``.
  """
  if plotlyjs not in PLOTLYJS_MODES:
    raise JaxckptError(f"plotlyjs={plotlyjs!r} is not one of {', '.join(PLOTLYJS_MODES)}")
  d = report.data
  title = report_title(report)
  headers, cells = table_cells(report, top_residuals=3)
  for line in cells:  # long errors: the first words here, the whole message in the warnings and per policy below
    text, value = line[1]
    line[1] = (text if len(text) <= 60 else text[:57] + "...", value)
  parts = [
      "<!DOCTYPE html><html><head><meta charset='utf-8'>",
      f"<title>{html.escape(title)}</title>",
      f"<style>{_STYLE}</style></head><body>",
      f"<h1>{html.escape(title)}</h1>",
      f"<p class='note'>versions: {html.escape(', '.join(f'{k} {v}' for k, v in d['versions'].items()))}; "
      f"compiler options: <code>{html.escape(json.dumps(d['compiler_options']))}</code></p>",
      _table(headers, cells, text_columns=(0, 1, len(headers) - 1)),
      "<p class='note'><code>*</code> = best of the column; ×none = ratio to the <code>none</code> row; click a "
      "header to sort. FLOPs are counted from the jaxpr (scan bodies × trip count); XLA's raw count counts a loop "
      "body once. Residual bytes exclude arguments and are an upper bound (XLA may fuse some away).</p>",
  ]
  if d["warnings"]:
    parts.append("<ul>" + "".join(f"<li class='warn'>{html.escape(w)}</li>" for w in d["warnings"]) + "</ul>")
  if plot:
    include: bool | str = True if plotlyjs == "inline" else "cdn"
    for chart_id, fig in chart_figures(report).items():
      heading, note = _CHART_TEXT[chart_id]
      parts.append(f"<h2>{html.escape(heading)}</h2><p class='note'>{html.escape(note)}</p>")
      parts.append(f"<div class='chart' id='chart-{chart_id}'>" + fig.to_html(
          include_plotlyjs=include, full_html=False, div_id=f"plot-{chart_id}",
          config={"displaylogo": False, "responsive": True}) + "</div>")
      include = False
  plan = _plan_table(report)
  if plan:
    parts += ["<h2>Budget plans</h2>", plan,
              "<p class='note'>" + "<br>".join(html.escape(line) for line in plan_lines(report)) + "</p>"]
  profiled = [r for r in report.rows if r.get("profile")]
  if profiled:
    logdir = os.path.dirname(profiled[0]["profile"]["dir"])
    parts.append(f"<h2>XProf profiles</h2><p>One run per policy: <code>xprof --logdir {html.escape(logdir)}</code> "
                 "(or TensorBoard with the profile plugin), then pick the runs side by side.</p>")
    parts.append(_table(["policy", "run directory", "trace files"],
                        [[(html.escape(r["policy"]), r["policy"]),
                          (_link(r["profile"]["dir"], base_dir, r["profile"]["dir"]), r["profile"]["dir"]),
                          (" ".join(_link(f, base_dir, os.path.basename(f)) for f in r["profile"]["files"]),
                           len(r["profile"]["files"]))] for r in profiled], text_columns=(0, 1, 2), escape=False))
  parts.append("<h2>Per policy</h2>")
  for r in report.rows:
    parts.append(f"<details><summary><b>{html.escape(r['policy'])}</b> — {html.escape(r['status'])}"
                 f"{': ' + html.escape(r['error']) if r['error'] else ''}</summary>")
    res = r.get("residuals")
    if res:
      parts.append(f"<p>residuals ({html.escape(res['analysed'])}): {res['count']} values, "
                   f"{html.escape(format_bytes(res['bytes']))} (+ arguments "
                   f"{html.escape(format_bytes(res['argument_bytes']))})</p>")
      parts.append(_table(["checkpoint name / primitive", "source line", "count", "bytes", "shapes"],
                          _residual_source_rows(r), text_columns=(0, 1, 4)))
    if r.get("flops") is not None:
      parts.append(f"<p class='note'>FLOPs {html.escape(format_flops(r['flops']))} ({r['flops']:,})</p>")
    dump = r.get("xla_dump")
    if dump:
      links = " · ".join(filter(None, (_link(p, base_dir, k) for k, p in dump["files"].items())))
      parts.append(f"<p>XLA's reports: {links}</p>")
      parts.append(_table(
          ["buffer live at peak", "bytes", "HLO op", "shape", "JAX op_name", "source"],
          [[(html.escape(b["buffer"]), b["buffer"]), (html.escape(format_bytes(b["bytes"])), b["bytes"]),
            (html.escape(str(b["opcode"])), str(b["opcode"])), (html.escape(str(b["shape"])), str(b["shape"])),
            (f"<code>{html.escape(str(b['op_name']))}</code>", str(b["op_name"])),
            (html.escape(str(b["source"])), str(b["source"]))] for b in dump["peak_buffers"]],
          text_columns=(0, 2, 3, 4, 5), escape=False))
    parts.append("</details>")
  parts.append(f"<script>{_SORT_JS}</script></body></html>")
  return "\n".join(parts)
