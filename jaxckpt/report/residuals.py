"""What each policy saves for the backward pass, summarised for the report (built on :mod:`jaxckpt.residuals`).

The loss is differentiated w.r.t. the params only (what the train step differentiates); the batch and dropout key
are closed over. Layers stacked with ``scan`` would hide every checkpoint name behind "output of scan", so the
analysis runs on the unrolled twin of the model (same parameter tree, :attr:`PolicyStep.loss_of_params`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxckpt.activations import parameter_only_residual_bytes
from jaxckpt.step.build import PolicyStep, dropout_key_struct
from jaxckpt.residuals import Residual, group_residuals, saved_residuals, total_residual_bytes

__all__ = ["analyse_residuals", "residual_groups"]


def _traced_residuals(step: PolicyStep) -> tuple[list[Residual], int]:
  found: list[Residual] = []
  param_only = []

  def outer(batch, key):
    # batch and key are tracers of this outer trace: the inner vjp sees them as constants, not as inputs.
    loss = lambda params: step.loss_of_params(params, batch, key)  # noqa: E731
    found.extend(saved_residuals(loss, step.params))
    param_only.append(parameter_only_residual_bytes(loss, step.params))
    return 0

  jax.make_jaxpr(outer)(step.batch, dropout_key_struct())
  return found, param_only[0]


def residual_groups(residuals: list[Residual]) -> list[dict[str, Any]]:
  """Groups residuals by checkpoint name, and the unnamed ones by primitive (or kind), largest first.

  Returns:
    ``[{"key": "qkv" | "dot_general" | "argument" …, "by": "name" | "primitive" | "kind", "count", "bytes"}]``.
  """
  out = []
  for group in group_residuals(residuals, by="name"):
    if group.key is not None:
      out.append({"key": group.key, "by": "name", "count": group.count, "bytes": group.bytes})
      continue
    for sub in group_residuals(group.residuals, by="primitive"):
      if sub.key is not None:
        out.append({"key": sub.key, "by": "primitive", "count": sub.count, "bytes": sub.bytes})
      else:
        for kind in group_residuals(sub.residuals, by="kind"):
          out.append({"key": kind.key, "by": "kind", "count": kind.count, "bytes": kind.bytes})
  out.sort(key=lambda g: (-g["bytes"], g["key"] or ""))
  return out


def analyse_residuals(step: PolicyStep) -> dict[str, Any]:
  """Lists and groups the residuals of ``step``'s loss w.r.t. its params.

  Args:
    step: from :func:`jaxckpt.step.build.policy_step`.

  Returns:
    ``{"count", "bytes", "activation_bytes", "argument_bytes", "analysed", "groups", "by_source", "items"}``:
    ``bytes`` excludes arguments (the params are alive anyway; it is the row's ``residual_bytes``),
    ``activation_bytes`` also excludes values that depend on the params only (per-layer parameter slices,
    :mod:`jaxckpt.activations`; the row's ``activation_residual_bytes``), ``argument_bytes`` is the arguments';
    ``groups`` from :func:`residual_groups`; ``by_source``: ``[{"key": "file:line:col (fn)", "count", "bytes"}]``;
    ``items``: every residual ``{"shape", "dtype", "bytes", "name", "kind", "primitive", "source"}``. Bytes are an
    upper bound (XLA may fuse residuals away); compiled stats are the ground truth.
  """
  residuals, param_only = _traced_residuals(step)
  saved = [r for r in residuals if r.kind != "argument"]
  nbytes = total_residual_bytes(residuals, include_arguments=False)
  return {
      "count": len(saved),
      "bytes": nbytes,
      "activation_bytes": nbytes - param_only,
      "argument_bytes": sum(r.bytes for r in residuals if r.kind == "argument"),
      "analysed": "loss w.r.t. params, layers unrolled",
      "groups": residual_groups(residuals),
      "by_source": [{"key": g.key, "count": g.count, "bytes": g.bytes}
                    for g in group_residuals(saved, by="source")],
      "items": [{"shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes, "name": r.name, "kind": r.kind,
                 "primitive": r.primitive, "source": r.source} for r in residuals],
  }
