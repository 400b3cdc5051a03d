"""The report as one self-contained, interactive HTML page (plotly charts, sortable tables).

The page holds, in order: the summary table; the Pareto charts (compiled temp and footprint bytes against the FLOPs
ratio to ``none``, and against measured step time when measured); a stacked bar per policy of argument / output /
temp bytes; the residuals each policy keeps, stacked by checkpoint name (unnamed ones by primitive); for budget rows
the plan per layer range; then per policy the residuals by name and source line, XLA's buffers at peak and the
XProf run. Charts answer hover with the policy and exact bytes / FLOPs and carry no text labels on the data (so none
overlap); every table sorts by a click on its header (a few lines of inline JavaScript, numbers by their raw value).

plotly.js is inlined once (``plotlyjs="inline"``, ~4.8 MB, the page then works offline) or loaded from plotly's CDN
(``plotlyjs="cdn"``, a page of ~100 KB that needs the network to draw its charts).

The page is the Jinja2 template ``templates/report.html.j2`` (autoescaped); this module only gathers what it shows
(text, raw sort values, links) and the plotly figures. Points of the Pareto charts closer than
:data:`SPREAD_WITHIN` of both axes' spans are spread sideways (hover gives their exact values).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any


from jaxckpt.errors import JaxckptError
from jaxckpt.report._build import Report
from jaxckpt.report._formats import (OP_WORDS, Cell, format_flops, main_sources, plan_lines, report_title, residual_label,
                                    short_source, table_cells)
from jaxckpt.report._keys import STATUS_OK
from jaxckpt.rendering._pages import SORT_JS, cell as _cell, table as _table, template_env
from jaxckpt.report._plot import pareto_indices
from jaxckpt._units import format_bytes

PLOTLYJS_MODES = ("inline", "cdn")
"""How the page gets plotly.js: ``inline`` (offline, ~4.8 MB) or ``cdn`` (small, needs the network)."""

_MIB = 2**20
_TOP_RESIDUAL_KEYS = 12

SPREAD_WITHIN = 0.015
"""Pareto points closer than this share of both axes' spans are spread sideways on the page (they would overlap)."""
SPREAD_STEP = 0.025
"""How far apart spread points are drawn, as a share of the x axis's span (≈ 10 px on a 400 px panel)."""

_ENV = template_env("jaxckpt.report")


def _bytes_cell(n: int | None) -> Cell:
  return (format_bytes(n), n)


def _link(path: str | None, base: str | None, label: str) -> dict[str, str] | None:
  if not path:
    return None
  return {"href": os.path.relpath(path, base) if base else path, "label": label}


def _ok(report: Report) -> list[dict[str, Any]]:
  return [r for r in report.rows if r["status"] == STATUS_OK]


def _colors() -> list[str]:
  import plotly.colors  # pylint: disable=g-import-not-at-top

  return list(plotly.colors.qualitative.Dark24)


def spread_points(points: Sequence[tuple[float, float]], *, within: float = SPREAD_WITHIN,
                  step: float = SPREAD_STEP) -> list[float]:
  """x positions to draw points at so that none hides another: points closer than ``within`` of both axes' spans
  are spread sideways around their mean x, ``step`` of the x span apart (the y values and the data are unchanged).

  Args:
    points: ``(x, y)`` per point.
    within: share of each axis's span below which two points count as overlapping.
    step: distance between spread points, as a share of the x span.

  Returns:
    The x to draw each point at, in order (equal to its x where it overlaps nothing).
  """
  if not points:
    return []
  xs, ys = [p[0] for p in points], [p[1] for p in points]
  x_span = (max(xs) - min(xs)) or abs(max(xs)) or 1.0
  y_span = (max(ys) - min(ys)) or abs(max(ys)) or 1.0
  clusters: list[list[int]] = []
  for i, (x, y) in enumerate(points):
    near = next((c for c in clusters if any(abs(points[j][0] - x) <= within * x_span
                                            and abs(points[j][1] - y) <= within * y_span for j in c)), None)
    if near is None:
      clusters.append([i])
    else:
      near.append(i)
  out = list(xs)
  for cluster in clusters:
    if len(cluster) > 1:
      middle = sum(xs[j] for j in cluster) / len(cluster)
      for k, j in enumerate(cluster):
        out[j] = middle + (k - (len(cluster) - 1) / 2) * step * x_span
  return out


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
    shown_x = dict(zip(map(id, pts), spread_points([(xval(r), r[ykey]) for r in pts])))
    for i, r in enumerate(ok):
      if r not in pts:
        continue
      budget = r.get("plan") is not None
      fig.add_trace(go.Scatter(
          x=[shown_x[id(r)]], y=[r[ykey] / _MIB], mode="markers", name=r["policy"], legendgroup=r["policy"],
          showlegend=col == 1,
          marker={"size": 11, "color": colors[i % len(colors)], "symbol": "diamond" if budget else "circle",
                  "line": {"width": 1, "color": "#333"}},
          customdata=[[r["policy"], r[ykey], r["flops"], xval(r), r.get("step_time_s") or 0.0]],
          hovertemplate=(f"<b>%{{customdata[0]}}</b><br>{ylabel}: %{{customdata[1]:,}} bytes (%{{y:.2f}} MiB)"
                         "<br>FLOPs: %{customdata[2]:,}"
                         + ("<br>× none: %{customdata[3]:.4f}" if xkey == "flops" and base is not None else "")
                         + ("<br>step time: %{customdata[3]:.2f} ms" if xkey == "step_time_s" else "")
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


def _residuals_figure(report: Report):
  import plotly.graph_objects as go  # pylint: disable=g-import-not-at-top

  ok = [r for r in _ok(report) if r.get("residuals")]
  if not ok:
    return None
  per_row = []
  sources = main_sources(ok)
  for r in ok:
    by_label: dict[str, dict[str, int]] = {}  # two lines may read alike (_layers.py:12 of two packages): summed
    for g in r["residuals"]["groups"]:
      if not (g["by"] == "kind" and g["key"] == "argument"):
        summed = by_label.setdefault(residual_label(g, sources), {"bytes": 0, "count": 0})
        summed["bytes"] += g["bytes"]
        summed["count"] += g["count"]
    per_row.append(by_label)
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
                    legend={"font": {"size": 11}, "title": {"text": "checkpoint name, or op and source line"}})
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
               "entry to hide it. The red step line joins the policies no other beats on both axes. Policies at the "
               "same place (often one program) are drawn side by side; hover gives their exact values."),
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
    label = (f"{item['name']} (checkpoint name)" if item["name"] else
             OP_WORDS.get(item["primitive"], item["primitive"]) if item["primitive"] else f"{item['kind']} values")
    where = item.get("site") or item["source"]  # the line of your code; JAX's line in reports written before
    g = groups.setdefault((label, short_source(where)), {"count": 0, "bytes": 0, "shapes": {}})
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


def _plan_table(report: Report) -> dict[str, Any] | None:
  planned = [r for r in report.rows if r.get("plan")]
  if not planned:
    return None
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


def _summary(report: Report) -> dict[str, Any]:
  """The summary table: value cells with their ratio to ``none`` under them, residual groups one per line, an
  error folded into a ``details`` cell (its whole message; the warnings then leave it out)."""
  headers, cells = table_cells(report, top_residuals=3)
  sources = main_sources([r for r in report.rows if r["status"] == STATUS_OK])
  keep = [i for i, h in enumerate(headers) if not h.startswith(("×none", "XLA FLOPs (raw)", "compile"))]
  out_rows = []
  for row, line in zip(report.rows, cells):
    out = []
    for i in keep:
      text, value = line[i]
      if i == 1 and row["status"] != STATUS_OK:
        out.append(_cell("error", row["error"], text_col=True, details=row["error"]))
      elif headers[i] == "top residuals":
        groups = [g for g in (row.get("residuals") or {}).get("groups") or []
                  if g["by"] != "kind" or g["key"] != "argument"][:3]
        out.append(_cell(text, text, text_col=True,
                         lines=[f"{format_bytes(g['bytes'])} {residual_label(g, sources, short=True)}"
                                for g in groups]))
      else:
        ratio = line[i + 1][0] if i + 1 < len(headers) and headers[i + 1] == "×none" else None
        out.append(_cell(text, value, sub=None if ratio is None else f"×{ratio}"))
    out_rows.append(out)
  shown = [headers[i] for i in keep]
  return _table(shown, out_rows, text_columns=(0, 1, len(shown) - 1),
                titles={h: "second line: ratio to the none row" for h in shown[2:-1]})


def to_html(report: Report, *, base_dir: str | None = None, plot: bool = True, plotlyjs: str = "inline") -> str:
  """One self-contained HTML page: sortable tables, interactive charts, per-policy residuals and XLA buffers.

  Rendered from the Jinja2 template ``jaxckpt/report/templates/report.html.j2`` (autoescaped).

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
  errors = [r["error"] for r in report.rows if r["status"] != STATUS_OK and r.get("error")]
  charts = []
  if plot:
    include: bool | str = True if plotlyjs == "inline" else "cdn"
    for chart_id, fig in chart_figures(report).items():
      heading, note = _CHART_TEXT[chart_id]
      charts.append({"id": chart_id, "heading": heading, "note": note, "html": fig.to_html(
          include_plotlyjs=include, full_html=False, div_id=f"plot-{chart_id}",
          config={"displaylogo": False, "responsive": True})})
      include = False
  profiled = [r for r in report.rows if r.get("profile")]
  profiles = None
  if profiled:
    profiles = {"logdir": os.path.dirname(profiled[0]["profile"]["dir"]), "table": _table(
        ["policy", "run directory", "trace files"],
        [[_cell(r["policy"], r["policy"]),
          _cell(r["profile"]["dir"], r["profile"]["dir"], links=[_link(r["profile"]["dir"], base_dir,
                                                                        r["profile"]["dir"])]),
          _cell("", len(r["profile"]["files"]),
                links=[_link(f, base_dir, os.path.basename(f)) for f in r["profile"]["files"]])]
         for r in profiled], text_columns=(0, 1, 2))}
  policies = []
  for r in report.rows:
    res, dump = r.get("residuals"), r.get("xla_dump")
    policies.append({
        "policy": r["policy"], "status": r["status"], "error": r["error"],
        "residuals": res and {
            "analysed": res["analysed"], "count": res["count"], "bytes": format_bytes(res["bytes"]),
            "argument_bytes": format_bytes(res["argument_bytes"]),
            "table": _table(["checkpoint name / op", "source line", "count", "bytes", "shapes"],
                            _residual_source_rows(r), text_columns=(0, 1, 4))},
        "flops": r.get("flops") is not None and f"{format_flops(r['flops'])} ({r['flops']:,})",
        "flops_xla_raw": format_flops(r.get("flops_xla_raw")),
        "compile": "n/a" if r.get("compile_s") is None else f"{r['compile_s']:.1f} s",
        "dump": dump and {
            "links": [link for k, p in dump["files"].items() if (link := _link(p, base_dir, k))],
            "table": _table(
                ["buffer live at peak", "bytes", "HLO op", "shape", "JAX op_name", "source"],
                [[_cell(b["buffer"], b["buffer"]), _cell(format_bytes(b["bytes"]), b["bytes"]),
                  _cell(str(b["opcode"]), str(b["opcode"])), _cell(str(b["shape"]), str(b["shape"])),
                  _cell(str(b["op_name"]), str(b["op_name"]), code=True), _cell(str(b["source"]), str(b["source"]))]
                 for b in dump["peak_buffers"]], text_columns=(0, 2, 3, 4, 5))},
    })
  return _ENV.get_template("report.html.j2").render(
      title=report_title(report),
      versions=", ".join(f"{k} {v}" for k, v in d["versions"].items()),
      compiler_options=json.dumps(d["compiler_options"]),
      summary=_summary(report),
      warnings=[w for w in d["warnings"] if not any(e in w for e in errors)],
      charts=charts, plans=_plan_table(report), plan_lines=plan_lines(report), profiles=profiles,
      policies=policies, sort_js=SORT_JS)
