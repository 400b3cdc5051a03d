"""The fit plan as one HTML page: the per-policy table, the global-batch candidates, the winner and the
footprint-vs-batch plot (inline SVG).

Rendered from the Jinja2 template ``jaxckpt/fit/templates/fit.html.j2`` (autoescaped) with the shared table macros
and sorting script (:func:`jaxckpt.rendering._pages.template_env`, :func:`~jaxckpt.rendering._pages.table_data`);
this module only gathers the cells.
"""

from __future__ import annotations

from typing import Any

from jaxckpt.fit._names import custom_table
from jaxckpt.fit._plan import FitPlan
from jaxckpt.fit._plot import fit_svg
from jaxckpt.rendering._pages import SORT_JS, table_data, template_env
from jaxckpt._units import format_bytes

_ENV = template_env("jaxckpt.fit")


def _fits_table(plan: FitPlan) -> dict[str, Any]:
  what = "max seq len" if plan.axis == "seq_len" else "max batch"
  rows = []
  for f in plan.fits:
    nxt = ("capped", None) if f.capped else (format_bytes(f.verified_over), f.verified_over) if f.verified_over \
        else ("-", None)
    largest = "none fits" if f.max_batch_size is None else str(f.max_batch_size)
    if f.capped and (f.estimated_max_batch or 0) > (f.max_batch_size or 0):
      largest += f" (est. {f.estimated_max_batch})"
    rows.append([(f.policy, f.policy), (largest, f.max_batch_size),
                 (format_bytes(f.footprint_bytes), f.footprint_bytes), nxt, (str(f.compiles), f.compiles),
                 (f.method, f.method), (format_bytes(int(f.model.slope)), f.model.slope)])
  return table_data(["policy", what, "footprint", "next", "compiles", "method", "bytes per unit (line)"], rows,
                    text_columns=(0, 5))


def _choice_table(plan: FitPlan) -> dict[str, Any]:
  c = plan.choice
  measured = {(m.policy, m.micro_batch): m for m in c.measured}
  rows = []
  for cand in c.table:
    m = measured.get((cand.policy, cand.micro_batch))
    won = (cand.policy, cand.micro_batch) == (c.winner.policy, c.winner.micro_batch)
    rows.append([(("* " if won else "") + cand.policy, cand.policy),
                 (f"{cand.micro_batch} × {cand.accum}", cand.micro_batch),
                 (f"{cand.flops * cand.accum:.3g}", cand.flops * cand.accum),
                 (f"{cand.est_step_s * 1e3:.2f} ms", cand.est_step_s),
                 (f"{m.measured_step_s * 1e3:.1f} ms", m.measured_step_s) if m else ("", None),
                 (f"{c.global_batch / m.measured_step_s:.0f}", c.global_batch / m.measured_step_s) if m else ("", None)])
  return table_data(["policy", "b × k", "FLOPs/step", "est. step", "measured", "examples/s"], rows)


def to_html(plan: FitPlan, *, plot: bool = True) -> str:
  """One self-contained HTML page of ``plan``.

  Args:
    plan: the :class:`~jaxckpt.fit._plan.FitPlan`.
    plot: include the footprint-vs-batch plot (inline SVG, matplotlib).

  Returns:
    The page (str).
  """
  c = plan.choice
  choice = None
  if c is not None:
    choice = {"title": f"global batch {c.global_batch} on {plan.device.name}: fastest first (ranked by {c.ranked_by})",
              "table": _choice_table(plan), "flags": c.flags(), "python": c.python(),
              "footprint": None if c.footprint_bytes is None else format_bytes(c.footprint_bytes),
              "spearman": None if c.spearman is None else f"{c.spearman:.2f}"}
  what = "sequence length" if plan.axis == "seq_len" else "micro-batch"
  return _ENV.get_template("fit.html.j2").render(
      title=f"largest {what} within {format_bytes(plan.limit_bytes)} per device ({plan.memory_source})",
      compiles=plan.compiles, seconds=f"{plan.seconds:.0f}", fits=_fits_table(plan), choice=choice,
      svg=fit_svg(plan) if plot else None, sort_js=SORT_JS,
      custom=None if plan.custom is None else custom_table(plan.custom, wide=True))
