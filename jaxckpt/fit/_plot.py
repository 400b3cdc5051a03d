"""The fit plan's figure: compiled footprint vs batch per policy, the affine model, the device line and each
policy's largest batch (matplotlib; ``jaxckpt-fit --plot`` writes it, ``--html`` inlines it as SVG)."""

from __future__ import annotations

import io
import os
from typing import Any

from jaxckpt._paths import write_atomically
from jaxckpt.fit._plan import FitPlan
from jaxckpt._units import format_bytes


def fit_figure(plan: FitPlan) -> Any:
  """The matplotlib figure (Agg backend): per policy its compiled points and line, where it crosses the memory.

  Returns:
    A ``matplotlib.figure.Figure`` (close it with ``matplotlib.pyplot.close``).
  """
  import matplotlib  # noqa: PLC0415 - only the plot needs it (a second of import)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  what = "sequence length (tokens per example)" if plan.axis == "seq_len" else "batch size (examples per micro-step)"
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for f in plan.fits:
    pts = sorted(f.points, key=lambda p: p.batch)
    top = max(p.batch for p in pts)
    line = ax.plot([0, top], [f.model(0) / 2**30, f.model(top) / 2**30], alpha=0.4)[0]
    ax.scatter([p.batch for p in pts], [p.footprint_bytes / 2**30 for p in pts], color=line.get_color(), s=14,
               label=f"{f.policy}: {f.max_batch_size}")
    if f.max_batch_size:
      ax.axvline(f.max_batch_size, color=line.get_color(), ls=":", lw=0.8)
  ax.axhline(plan.limit_bytes / 2**30, color="k", lw=1, label=f"memory {format_bytes(plan.limit_bytes)}")
  ax.set_xlabel(what)
  ax.set_ylabel("compiled footprint (GiB)")
  ax.set_title("footprint vs batch: compiled points, affine model, largest batch that fits")
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def plot_fit(plan: FitPlan, path: str) -> None:
  """Writes :func:`fit_figure` to ``path`` (.png, .svg or .pdf, by its extension)."""
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig = fit_figure(plan)
  try:  # whole or not at all: the previous file is kept
    write_atomically(path, lambda f: fig.savefig(f, format=os.path.splitext(path)[1][1:].lower() or "png"),
                     binary=True)
  finally:
    plt.close(fig)


def fit_svg(plan: FitPlan) -> str:
  """:func:`fit_figure` as an inline ``<svg>`` element (the XML prolog dropped)."""
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig = fit_figure(plan)
  buf = io.StringIO()
  fig.savefig(buf, format="svg")
  plt.close(fig)
  text = buf.getvalue()
  return text[text.index("<svg"):]
