"""The memory report: compile a model's full train step under many remat policies and compare what each costs.

Per policy, without allocating anything: XLA's compiled memory stats (device and host, keys of
:mod:`jaxckpt.schema`), FLOPs counted from the jaxpr (right under ``scan``) beside XLA's raw count, the residuals
saved for the backward pass grouped by checkpoint name / primitive and source line, compile time, and optionally
XLA's own buffer reports; with ``measure=True`` also the median step time and the measured peak memory, each policy
in a fresh process. Rendered as a terminal table, JSON, CSV, Markdown, one self-contained HTML page and a Pareto plot.

- Targets are in :mod:`jaxckpt.step` (``shipped_target``, ``load_target``, ``ModelTarget``, ``LossTarget``) and on
  the top-level face (``jaxckpt.nnx_model_target``, ``jaxckpt.linen_model_target``).
- Running it: :func:`build_report` -> :class:`Report` (``report.data`` is the JSON).
- Outputs (:mod:`jaxckpt.report._outputs`): :func:`to_table`, :func:`to_json`, :func:`to_csv`, :func:`to_markdown`,
  :func:`write_outputs`; the interactive page :func:`to_html` (:mod:`jaxckpt.report._html`, plotly) and the static
  chart :func:`plot_pareto` (:mod:`jaxckpt.report._plot`, matplotlib: PNG/JPEG/SVG/PDF).
- XProf traces per policy: ``build_report(..., profile="DIR")`` (:mod:`jaxckpt.training._profile`).
- CLI: ``jaxckpt-report`` (:func:`jaxckpt.cli.report`), also ``python -m jaxckpt.report``.
"""

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.report._build import Report, build_report, saving_warnings
from jaxckpt.report._keys import REPORT_KEYS, ROW_KEYS
from jaxckpt.report._outputs import plot_pareto, to_csv, to_html, to_json, to_markdown, to_table, write_outputs
from jaxckpt.report._policies import all_policies, expand_policies
from jaxckpt.report._residuals import analyse_residuals

__all__ = [
    "analyse_residuals",
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
]

__getattr__ = _forward_names(__name__, {
    "LossTarget": ("jaxckpt.step._targets", "LossTarget"),
    "ModelTarget": ("jaxckpt.step._targets", "ModelTarget"),
    "Target": ("jaxckpt.step._targets", "Target"),
    "linen_model_target": ("jaxckpt.step._targets", "linen_model_target"),
    "linen_target": ("jaxckpt.step._targets", "linen_target"),
    "load_target": ("jaxckpt.step._targets", "load_target"),
    "shipped_target": ("jaxckpt.step._targets", "shipped_target"),
})
