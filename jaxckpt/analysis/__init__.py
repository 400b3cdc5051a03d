"""Reading traced and compiled steps: jaxpr walks (:mod:`~jaxckpt.analysis.jaxprs`), FLOPs
(:mod:`~jaxckpt.analysis.flops`), saved residuals (:mod:`~jaxckpt.analysis.residuals`,
:mod:`~jaxckpt.analysis.activations`), policy diagnostics (:mod:`~jaxckpt.analysis.diagnostics`) and text renderings
(:mod:`~jaxckpt.analysis.render`).
"""

from __future__ import annotations

from jaxckpt.analysis import activations, diagnostics, flops, jaxprs, render, residuals

__all__ = [
    "activations",
    "diagnostics",
    "flops",
    "jaxprs",
    "render",
    "residuals",
]
