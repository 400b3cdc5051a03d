"""The report's static Pareto chart (matplotlib) for READMEs and papers: numbered points, a key of policies beside.

Each successful policy gets a number (its order in the report); the points show only the number, and the key to the
right of the charts lists ``number  policy``, so long policy names never overlap the data. Points that coincide
(each within 4% of every other's position on both axes, :func:`label_groups`) share one label (``2,5``); the labels
are then moved apart by ``adjustText`` (with a thin line back to their point where moved), so none overlaps
another. The file format follows the path's suffix (:data:`PLOT_SUFFIXES`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from jaxckpt._paths import write_atomically
from jaxckpt.errors import JaxckptError
from jaxckpt.report._build import Report
from jaxckpt.report._formats import report_title
from jaxckpt.report._keys import STATUS_OK

PLOT_SUFFIXES: dict[str, str] = {".png": "png", ".jpg": "jpg", ".jpeg": "jpg", ".svg": "svg", ".pdf": "pdf"}
"""File suffix (lower case) → matplotlib format of :func:`plot_pareto`."""


def plot_format(path: str, *, flag: str = "path") -> str:
  """The image format ``path``'s suffix names (``out.JPG`` → ``"jpg"``).

  Args:
    path: the output file.
    flag: how errors name it (``"--plot"`` on the CLI).

  Returns:
    One of ``"png"``, ``"jpg"``, ``"svg"``, ``"pdf"``.

  Raises:
    JaxckptError: an unknown or missing suffix, naming it and the valid ones.
  """
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in PLOT_SUFFIXES:
    shown = repr(suffix) if suffix else "no suffix"
    raise JaxckptError(f"{flag}={path}: unknown image format ({shown}); valid suffixes: "
                       f"{', '.join(PLOT_SUFFIXES)}")
  return PLOT_SUFFIXES[suffix]


GROUP_WITHIN = 0.04
"""Points whose positions differ by at most this share of both axes' spans (each pair) share one label."""


def label_groups(points: Sequence[tuple[float, float]], *, within: float = GROUP_WITHIN) -> list[list[int]]:
  """Indices of points that share one label: every pair in a group is within ``within`` of both axes' spans.

  Complete linkage (a point joins a group only when it is near *every* member), so two points of one group are never
  further apart than the rule says (a chain of near neighbours is split).

  Args:
    points: ``(x, y)`` per point.
    within: share of each axis's span (max - min; 1 when all equal).

  Returns:
    Groups of indices in first-seen order.
  """
  if not points:
    return []
  x_span = (max(p[0] for p in points) - min(p[0] for p in points)) or 1.0
  y_span = (max(p[1] for p in points) - min(p[1] for p in points)) or 1.0
  groups: list[list[int]] = []
  for i, (x, y) in enumerate(points):
    near = next((g for g in groups if all(abs(points[j][0] - x) <= within * x_span
                                          and abs(points[j][1] - y) <= within * y_span for j in g)), None)
    if near is None:
      groups.append([i])
    else:
      near.append(i)
  return groups


def pareto_indices(points: Sequence[tuple[float, float]]) -> list[int]:
  """Indices of the points not dominated (smaller x and smaller y are better), sorted by x."""
  order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
  front, best_y = [], float("inf")
  for i in order:
    if points[i][1] < best_y:
      front.append(i)
      best_y = points[i][1]
  return front


def plot_pareto(report: Report, path: str | None = None, *, image_format: str | None = None) -> bytes:
  """Draws compiled footprint and temp bytes against FLOPs (and measured step time, if any) per successful policy.

  Fixed policies are circles, budget plans diamonds; the red step line is the Pareto front (no other policy is
  better on both axes). Points carry numbers; the key beside the charts maps numbers to policies
  (:func:`pareto_figure`).

  Args:
    report: the report.
    path: where to write the image; ``None`` = only return it.
    image_format: ``"png"``, ``"jpg"``, ``"svg"`` or ``"pdf"``; default: from ``path``'s suffix
      (:func:`plot_format`), PNG without a path.

  Returns:
    The image bytes.

  Raises:
    JaxckptError: an unknown suffix of ``path`` or an unknown ``image_format``.
  """
  if image_format is None:
    image_format = plot_format(path) if path is not None else "png"
  elif image_format not in set(PLOT_SUFFIXES.values()):
    raise JaxckptError(f"image_format={image_format!r} is not one of {', '.join(sorted(set(PLOT_SUFFIXES.values())))}")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig = pareto_figure(report)
  buffer = io.BytesIO()
  fig.savefig(buffer, format=image_format, dpi=100, bbox_inches="tight")
  plt.close(fig)
  data = buffer.getvalue()
  if path is not None:
    write_atomically(path, lambda f: f.write(data), binary=True)
  return data


def pareto_figure(report: Report):
  """The matplotlib figure :func:`plot_pareto` saves (close it with ``plt.close(fig)`` when done).

  Each axes' point labels are ``matplotlib.text.Text`` artists with ``gid="point-label"``; ``adjustText``
  (https://github.com/Phlya/adjustText) has moved them off each other and off the points.

  Returns:
    ``matplotlib.figure.Figure``.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from adjustText import adjust_text  # pylint: disable=g-import-not-at-top
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.lines import Line2D  # pylint: disable=g-import-not-at-top

  ok = [r for r in report.rows if r["status"] == STATUS_OK]
  number = {id(r): i + 1 for i, r in enumerate(ok)}
  most = max((r["flops"] for r in ok if r.get("flops") is not None), default=0)
  scale, unit = next(((s, u) for s, u in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")) if most >= s), (1, "FLOP"))
  x_axes = [("flops", "train-step FLOPs (jaxpr)", scale, unit)]
  if any(r["step_time_s"] is not None for r in ok):
    x_axes.append(("step_time_s", "measured step time", 1e-3, "ms"))
  y_axes = [("footprint_bytes", "compiled footprint"), ("temp_bytes", "compiled temp")]
  fig, axes = plt.subplots(len(y_axes), len(x_axes), figsize=(5.6 * len(x_axes), 3.6 * len(y_axes)), squeeze=False)
  styles = {False: {"color": "tab:blue", "marker": "o"}, True: {"color": "tab:orange", "marker": "D"}}
  labelled = []
  for col, (xkey, xlabel, xscale, xunit) in enumerate(x_axes):
    for row_i, (ykey, ylabel) in enumerate(y_axes):
      ax = axes[row_i][col]
      pts = [(r[xkey] / xscale, r[ykey] / 2**20, number[id(r)], r.get("plan") is not None) for r in ok
             if r.get(xkey) is not None and r.get(ykey) is not None]
      ax.set_xlabel(f"{xlabel} ({xunit})", fontsize=8)
      ax.set_ylabel(f"{ylabel} (MiB)", fontsize=8)
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3)
      if not pts:
        continue
      for budget, style in styles.items():
        chosen = [p for p in pts if p[3] == budget]
        if chosen:
          ax.scatter([p[0] for p in chosen], [p[1] for p in chosen], s=22, zorder=3, **style)
      front = [pts[i] for i in pareto_indices([(p[0], p[1]) for p in pts])]
      ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", lw=1.2, zorder=2, drawstyle="steps-post")
      texts = []
      for group in label_groups([(p[0], p[1]) for p in pts]):
        x, y = pts[group[0]][0], pts[group[0]][1]
        texts.append(ax.text(x, y, ",".join(str(pts[j][2]) for j in group), fontsize=7, gid="point-label",
                             zorder=4))
      ax.margins(0.08)
      labelled.append((ax, texts, pts))
  kinds = {r.get("plan") is not None for r in ok}
  handles = [Line2D([], [], ls="", **styles[budget], label="budget plan" if budget else "fixed policy")
             for budget in (False, True) if budget in kinds]
  handles.append(Line2D([], [], color="tab:red", lw=1.2, label="Pareto front"))
  handles += [Line2D([], [], ls="", marker=f"${number[id(r)]}$", markersize=7 + 2 * len(str(number[id(r)])),
                     color="black", label=r["policy"] if len(r["policy"]) <= 48 else r["policy"][:45] + "...")
              for r in ok]
  fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
             handletextpad=0.6, borderaxespad=0.2)
  fig.suptitle(report_title(report), fontsize=8)
  fig.tight_layout()
  for ax, texts, pts in labelled:  # after the layout: adjustText works in display coordinates
    adjust_text(texts, x=[p[0] for p in pts], y=[p[1] for p in pts], ax=ax, expand=(1.3, 1.5),
                arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5})
  return fig
