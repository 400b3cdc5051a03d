"""Reading traced and compiled steps: jaxpr walks (:mod:`~jaxckpt.analysis.jaxprs`), FLOPs
(:mod:`~jaxckpt.analysis.flops`), saved residuals (:mod:`~jaxckpt.analysis.residuals`,
:mod:`~jaxckpt.analysis.activations`) and text renderings (:mod:`~jaxckpt.analysis.render`).

The floor below the policies: nothing here imports :mod:`jaxckpt.policies`, :mod:`jaxckpt.core` or anything above,
so the policy parser can check what a policy saves.
"""

from __future__ import annotations

from jaxckpt.analysis import activations, flops, internals, jaxprs, render, residuals, tables

__all__ = [
    "activations",
    "flops",
    "internals",
    "jaxprs",
    "render",
    "residuals",
    "tables",
]
