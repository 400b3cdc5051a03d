"""Which saved residuals are activations: residuals minus the values that depend on the parameters only.

JAX's saved-residual analysis of a loss w.r.t. its parameters lists every value the backward pass keeps. Some of
them are functions of the parameters alone, e.g. the per-layer slices of stacked parameters in an unrolled model
(``params["w"][3]``), a transposed or cast weight: they scale with the model, not with the batch, and are not what
a min-cut partitioner counts as saved activations (PyTorch's AOTAutograd excludes parameters). This module traces
the same ``jax.vjp`` JAX's analysis traces and finds, by dependence through the jaxpr, the residuals that depend on
no closed-over input (batch, dropout key): those are parameter-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core


def _nbytes(aval: Any) -> int:
  try:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
  except TypeError:
    return 0


def parameter_only_residual_bytes(fn: Callable[..., Any], *args: Any) -> int:
  """Bytes of the residuals of ``jax.vjp(fn, *args)`` that depend on ``args`` only.

  Call it inside a trace where the batch (and dropout key) are closed-over tracers, as
  :mod:`jaxckpt.report._residuals` does: values that depend on them are activations; values computed from ``args``
  alone (and constants) are parameter-only. Arguments themselves are not counted (JAX's analysis lists them as
  arguments, which ``residual_bytes`` already excludes). Traces the vjp; with a trace already at hand
  (:func:`jaxckpt.analysis._residuals.traced_residuals`) use :func:`parameter_only_bytes`.

  Args:
    fn: the function differentiated, e.g. ``params -> loss``.
    *args: its differentiated arguments (pytrees of arrays or ``jax.ShapeDtypeStruct``).

  Returns:
    The bytes (int) of the parameter-only residuals, each value once.
  """
  leaves, tree = jax.tree.flatten(args)
  closed, shapes = jax.make_jaxpr(lambda *xs: jax.vjp(lambda *a: fn(*jax.tree.unflatten(tree, a)), *xs),
                                  return_shape=True)(*leaves)
  return parameter_only_bytes(closed.jaxpr, len(jax.tree.leaves(shapes[1])))


def parameter_only_bytes(jaxpr: Any, num_residuals: int) -> int:
  """:func:`parameter_only_residual_bytes` of a ``jax.vjp`` trace already made.

  Args:
    jaxpr: the ``jax.extend.core.Jaxpr`` of ``jax.vjp`` over the flattened differentiated arguments (its invars),
      the batch and dropout key closed over (its constvars), e.g. :attr:`jaxckpt.analysis._residuals.TracedResiduals.jaxpr`.
    num_residuals: how many of its last outvars are residuals.

  Returns:
    The bytes (int) of the residuals computed from the invars alone (and constants), each value once; invars
    themselves are not counted.
  """
  outvars = jaxpr.outvars[len(jaxpr.outvars) - num_residuals:]
  data = set(jaxpr.constvars)  # closed-over tracers (batch, key) and constants
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jex_core.Literal) and v in data for v in eqn.invars):
      data.update(eqn.outvars)
  subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}
  invars = set(jaxpr.invars)
  seen, total = set(), 0
  for var in outvars:
    if isinstance(var, jex_core.Literal):
      continue
    var = subst.get(var, var)
    if var in seen or var in invars or var in data:
      continue
    seen.add(var)
    total += _nbytes(var.aval)
  return total
