"""The fit plan as text: the per-policy table, the global-batch candidates with the winner as flags and Python, and
the mesh search's table (what ``jaxckpt-fit`` prints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxckpt._units import format_bytes, format_seconds
from jaxckpt.rendering._tables import render_table
from jaxckpt.fit._meshes import MeshSearch
from jaxckpt.fit._names import custom_table
from jaxckpt.fit._plan import FitPlan, GlobalChoice
from jaxckpt.timing import RESOLUTION, describe_step_time, within_resolution


def to_table(plan: FitPlan, *, width: int | None = None, wide: bool = False) -> str:
  """The plan as text tables: per policy, and the global-batch candidates, with the winner as flags and Python.

  Args:
    plan: the :class:`~jaxckpt.fit.FitPlan`.
    width: characters per line (no line is longer); ``None`` = the terminal's
      (:func:`jaxckpt.rendering._tables.terminal_width`).
    wide: one line per row, whatever its length.

  Returns:
    The text, ending in a newline.
  """
  what = "sequence length" if plan.axis == "seq_len" else "micro-batch"
  device = device_word(plan.compiled_for)
  per = f"/{device}"
  cols = ["policy", "max batch\nglobal", f"footprint\n{per}", f"next batch\n{per}", "compiles", "method",
          f"bytes/example\n{per}"]
  if plan.axis == "seq_len":
    cols = ["policy", "max seq len", f"footprint\n{per}", f"next length\n{per}", "compiles", "method",
            f"bytes/token (line)\n{per}"]
  rows = []
  for f in plan.fits:
    nxt = "capped" if f.capped else format_bytes(f.verified_over) if f.verified_over else "-"
    largest = "none fits" if f.max_batch_size is None else _batch_cell(f.max_batch_size, f.unit, device)
    if f.capped and f.estimated_max_batch is not None and f.estimated_max_batch > (f.max_batch_size or 0):
      largest = f"{largest} (est. {f.estimated_max_batch})"
    one_size = len({p.batch for p in f.points}) < 2  # no line: its slope is unknown, not 0
    slope = f.model.slope * (f.unit if plan.axis == "batch" else 1)  # per example a device holds
    rows.append([f.policy, largest, format_bytes(f.footprint_bytes), nxt, str(f.compiles), f.method,
                 "-" if one_size else format_bytes(int(slope))])
  refused = f" ({plan.refusals} refused for memory)" if plan.refusals else ""
  notes = [f"max batch: global, over the mesh's batch axes (per {device} beside it); footprint, next batch: "
           f"bytes per {device}; bytes/example: what one more example on a {device} costs that {device}"
           if plan.axis == "batch" else f"footprint, next length, bytes/token: bytes per {device}"]
  if any(f.capped and (f.estimated_max_batch or 0) > (f.max_batch_size or 0) for f in plan.fits):
    notes.append("capped: the search stops at the global batch (or --max-batch); est. N: the largest batch within "
                 "the memory by the line through its two largest compiles, not compiled")
  compiles = f"{plan.compiles} compile{'s' * (plan.compiles != 1)}"
  parts = [render_table(cols, rows, title=f"largest {what} within {format_bytes(plan.limit_bytes)} per device "
                                          f"({plan.memory_source}), {compiles}{refused}, {plan.seconds:.0f} s",
                        notes=notes, width=width, wide=wide, right=range(1, len(cols)))]
  if plan.custom is not None:
    parts.append(custom_table(plan.custom, width=width, wide=wide))
  if plan.choice is not None:
    c = plan.choice
    measured = {(m.policy, m.micro_batch): m for m in c.measured}
    rows = []
    compiled = c.ranked_by == "compiled"
    for cand in list(c.table)[:12]:
      m = measured.get((cand.policy, cand.micro_batch))
      row = [("* " if cand == c.winner or (m and m == c.winner) else "") + cand.policy,
             f"{cand.micro_batch} × {cand.accum}", f"{cand.flops * cand.accum:.3g}"]
      if compiled:  # one step time per configuration: its compiled program's, else the roofline's (marked ≈)
        row += ([format_seconds(cand.compiled_step["seconds"]), cand.compiled_step["bound"]] if cand.compiled_step
                else [f"≈ {format_seconds(cand.est_step_s)}", cand.dominant])
      else:
        terms = [f"{cand.terms.get(key, 0.0) * 1e3:.2f}" for key in ("compute_s", "hbm_s", "host_s", "collectives_s")]
        row += [f"{cand.est_step_s * 1e3:.2f} ms", *terms, cand.dominant]
      if c.measured:  # the measured columns only where something was measured
        row += [f"{m.measured_step_s * 1e3:.1f} ms" if m else "", f"{c.global_batch / m.measured_step_s:.0f}" if m else ""]
      rows.append(row)
    notes = ["* = the winner"]
    if c.dropped:
      notes.append("over the memory once compiled with their accumulation at the global batch, so dropped: " + ", ".join(
          f"{p} {b} × {k} ({format_bytes(f)})" for p, b, k, f in c.dropped))
    if c.spearman is not None:
      notes.append(f"rank correlation (Spearman) of estimated and measured step times: {c.spearman:.2f}")
    if compiled:
      notes.append("est. step: the step time of each configuration's compiled program (jaxckpt.timing; the step as "
                   "it will run, its accumulation at the global batch); ≈: not compiled, the fit's roofline that "
                   "chose which to compile (docs/fit.md)")
      headers = ["policy", "b × k\nglobal", "FLOPs/step\nglobal", "est. step", "bound by"]
    else:
      notes.append("compute, HBM, host, collectives: ms per step of each ceiling of the time model (they overlap: the "
                   "step takes the largest, 'bound by', plus a fixed overhead per micro-step; docs/fit.md)")
      headers = ["policy", "b × k\nglobal", "FLOPs/step\nglobal", "est. step", "compute", "HBM", "host",
                 "collectives", "bound by"]
    headers += ["measured", "examples/s"] if c.measured else []
    if compiled:
      notes += compiled_lines(c)
    parts.append(render_table(headers, rows,
                              title=f"global batch {c.global_batch} on {plan.device.name}: fastest first (ranked by "
                                    f"{c.ranked_by})", notes=notes, width=width, wide=wide, right=range(1, len(headers))))
    foot = "" if c.footprint_bytes is None else f", compiled footprint {format_bytes(c.footprint_bytes)}"
    parts.append(f"winner{foot}:\n  {c.flags()}\n  {c.python().replace(chr(10), chr(10) + '  ')}")
  return "\n\n".join(parts) + "\n"


def device_word(compiled_for: Mapping[str, Any] | None) -> str:
  """What one device of a fit is: ``GPU`` (a GPU cluster), ``chip`` (a TPU topology), else ``device``."""
  compiled_for = compiled_for or {}
  if compiled_for.get("topology"):
    return "GPU" if compiled_for.get("backend") == "gpu" else "chip"
  return "device"


def _batch_cell(batch: int, unit: int, device: str) -> str:
  """A global batch with what one device of the batch axes holds of it: ``400 (50/GPU)``; the batch alone on one."""
  return str(batch) if unit <= 1 else f"{batch} ({batch // unit}/{device})"


def compiled_lines(choice: GlobalChoice) -> list[str]:
  """The notes of a choice ranked by its compiled programs: what the compiled estimate is, and the winner's terms
  (:func:`jaxckpt.timing.describe_step_time`; docs/timing.md)."""
  lines = ["a compiled step time: the step as it will run (accumulation at G) compiled for the topology and timed from "
           "its program (per-kernel cycles or rates, collectives over their links, the schedule's overlap; "
           "docs/timing.md); the winner is the fastest of those. Its terms are busy seconds per step, which overlap "
           "only as the compiled schedule lets them (bound by: the largest)"]
  if choice.winner.compiled_step:
    lines.append(f"winner's compiled step: {describe_step_time(choice.winner.compiled_step, terms=4)}")
    best = choice.winner.step_s
    close = [(c, within_resolution(c.step_s, best)) for c in choice.table
             if c is not choice.winner and c.compiled_step]
    close = [f"{c.policy} {c.micro_batch} × {c.accum} (+{over:.1%})" for c, over in close if over is not None]
    if close:
      lines.append(_tie_line(close))
  return lines


def _tie_line(close: list[str]) -> str:
  return (f"within {RESOLUTION:.0%} of the winner's estimate, a tie to the time model (the spread of its errors among "
          f"one model's published configurations, docs/timing.md): {', '.join(close)}")


def mesh_table(search: MeshSearch, *, width: int | None = None, wide: bool = False) -> str:
  """The meshes of a :class:`~jaxckpt.fit.MeshSearch` as a text table: per mesh its status, its fastest verified
  configuration and step-time terms, or why it was not compiled.

  Args:
    search: the search.
    width, wide: as :func:`to_table`.
  """
  rows, reasons = [], []
  for o in search.options:
    c = o.plan.choice.winner if o.plan is not None and o.plan.choice is not None else None
    if o.reason:
      reasons.append(f"{o.name}: {o.reason}")
    rows.append([("* " if o is search.winner else "") + o.name, o.status, format_bytes(o.state_bytes_per_device),
                 f"{o.bound_s * 1e3:.3g}", c.policy if c else "", f"{c.micro_batch} × {c.accum}" if c else "",
                 f"{c.step_s * 1e3:.2f} ms" if c else "", c.bound if c else "",
                 str(o.plan.compiles) if o.plan else "0"])
  headers = ["mesh", "status", "state/device", "bound ms", "policy", "b × k", "est. step", "bound by", "compiles"]
  notes = ["* = the winner (its step-time terms in the tables below); est. step: the winner's compiled program's "
           "estimate (docs/timing.md); bound: a lower bound of the step time "
           "(collectives at the least accumulation predicted from the first mesh's compiles), the order meshes are "
           "fitted in; too big: not compiled (the train state alone exceeds the memory, the global batch does not "
           "divide, or no example is predicted to fit); not fitted: ranked below --max-meshes by the bound, not "
           "compiled (it may fit: raise --max-meshes to try it)", *reasons,
           f"{search.compiles} compile{'s' * (search.compiles != 1)}, {search.seconds:.0f} s"]
  if search.close:
    notes.insert(-1, _tie_line([f"{o.name} (+{over:.1%})" for o, over in search.close]))
  return render_table(headers, rows, title=f"meshes within {format_bytes(search.limit_bytes)} per device",
                      notes=notes, width=width, wide=wide, right=(2, 3, 6, 8))
