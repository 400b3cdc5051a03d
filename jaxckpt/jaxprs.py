"""Walking jaxprs: every equation of a traced step, sub-jaxprs included (scan, cond, pjit, remat, custom rules)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex_core

__all__ = ["iter_eqns", "sub_jaxprs", "uses_remat", "emitted_checkpoint_names"]

_REMAT_PRIMITIVES = ("remat2", "checkpoint", "remat")  # jax.checkpoint's primitive is "remat2" in current JAX


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
  """Yields the (closed) jaxprs held in an equation's params (scan/while bodies, cond branches, remat, pjit…)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        yield sub


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
  """Yields every equation of a (closed) jaxpr and, depth first, of every sub-jaxpr in its equations' params."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in sub_jaxprs(eqn):
      yield from iter_eqns(sub)


def uses_remat(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr contains a ``jax.checkpoint`` (primitive ``remat2``) anywhere."""
  return any(eqn.primitive.name in _REMAT_PRIMITIVES for eqn in iter_eqns(jaxpr))


def emitted_checkpoint_names(fn: Callable, *args, **kwargs) -> frozenset[str]:
  """The checkpoint names (``jax.ad_checkpoint.checkpoint_name``) that ``fn(*args, **kwargs)`` emits.

  Args:
    fn: any traceable function.
    *args: arrays or ``jax.ShapeDtypeStruct``s (nothing is computed, only traced).

  Returns:
    The set of names, found at any depth (inside scans, remat, jit…).
  """
  jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
  return frozenset(eqn.params["name"] for eqn in iter_eqns(jaxpr) if eqn.primitive.name == "name")


def count_remat_regions(jaxpr: Any) -> int:
  """How many ``jax.checkpoint`` (remat) equations a jaxpr holds at any depth (a scan body counted once).

  The report checks with it that a policy was applied: ``none`` must give 0, every other policy more.

  Args:
    jaxpr: a ``jax.core.Jaxpr`` or ``ClosedJaxpr`` (e.g. ``jax.jit(step).trace(...).jaxpr``).

  Returns:
    The number of remat equations (≥ 0).
  """
  return sum(1 for eqn in iter_eqns(jaxpr) if eqn.primitive.name in _REMAT_PRIMITIVES)
