"""The memory report: compile a model's full train step under many remat policies and compare what each costs.

Per policy, without allocating anything: XLA's compiled memory stats (device and host, keys of
:mod:`jaxckpt.schema`), FLOPs counted from the jaxpr (right under ``scan``) beside XLA's raw count, the residuals
saved for the backward pass grouped by checkpoint name / primitive and source line, compile time, and optionally
XLA's own buffer reports; with ``measure=True`` also the median step time and the measured peak memory, each policy
in a fresh process. Rendered as a terminal table, JSON, CSV, Markdown, one self-contained HTML page and a Pareto plot.

- Targets (:mod:`jaxckpt.step.targets`): :func:`shipped_target`, :func:`load_target`, :class:`ModelTarget`,
  :class:`LossTarget`.
- Running it: :func:`build_report` -> :class:`Report` (``report.data`` is the JSON).
- Outputs (:mod:`jaxckpt.report.outputs`): :func:`to_table`, :func:`to_json`, :func:`to_csv`, :func:`to_markdown`,
  :func:`write_outputs`; the interactive page :func:`to_html` (:mod:`jaxckpt.report.html`, plotly) and the static
  chart :func:`plot_pareto` (:mod:`jaxckpt.report.plot`, matplotlib: PNG/JPEG/SVG/PDF).
- XProf traces per policy: ``build_report(..., profile="DIR")`` (:mod:`jaxckpt.training.profile`).
- CLI: ``python -m jaxckpt.report`` (:mod:`jaxckpt.report.cli`).
"""

from jaxckpt.report.build import Report, build_report, saving_warnings
from jaxckpt.report.keys import REPORT_KEYS, ROW_KEYS
from jaxckpt.report.outputs import plot_pareto, to_csv, to_html, to_json, to_markdown, to_table, write_outputs
from jaxckpt.report.policies import all_policies, expand_policies
from jaxckpt.step.targets import LossTarget, ModelTarget, Target, linen_model_target, linen_target, load_target, shipped_target

__all__ = [
    "Report",
    "build_report",
    "saving_warnings",
    "REPORT_KEYS",
    "ROW_KEYS",
    "plot_pareto",
    "to_csv",
    "to_html",
    "to_json",
    "to_markdown",
    "to_table",
    "write_outputs",
    "all_policies",
    "expand_policies",
    "LossTarget",
    "ModelTarget",
    "Target",
    "linen_target",
    "linen_model_target",
    "load_target",
    "shipped_target",
]
