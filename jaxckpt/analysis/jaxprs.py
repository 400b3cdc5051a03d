"""Walking jaxprs: every equation of a traced step, sub-jaxprs included (scan, cond, pjit, remat, custom rules).

Custom derivatives. ``jax.custom_vjp`` and ``jax.custom_jvp`` calls hold the primal function as a jaxpr
(``call_jaxpr``), but their rules only as thunks: ``fwd_jaxpr_thunk`` (the custom_vjp forward rule) and
``jvp_jaxpr_fun`` (the custom_jvp rule), traced when the call is differentiated. Under ``jax.grad`` the rule runs
instead of the primal function, so what a remat policy sees (checkpoint names, dots) is in the rule. With
``rules=True`` the walkers trace those thunks too; because their calling convention is JAX-internal,
:func:`emitted_checkpoint_names` also traces ``jax.vjp`` of the function (public API) whenever a custom call is
present, so names inside rules are found even if the thunks cannot be expanded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex_core

__all__ = ["CUSTOM_CALLS", "iter_eqns", "sub_jaxprs", "rule_jaxprs", "uses_remat", "outermost_remats",
           "emitted_checkpoint_names"]

_REMAT_PRIMITIVES = ("remat2", "checkpoint", "remat")  # jax.checkpoint's primitive is "remat2" in current JAX

CUSTOM_CALLS: tuple[str, ...] = ("custom_vjp_call", "custom_jvp_call")
"""Primitives of ``jax.custom_vjp`` / ``jax.custom_jvp`` calls, whose differentiation rules are thunks."""


def _is_jaxpr(value: Any) -> bool:
  return isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr))


def rule_jaxprs(eqn: Any) -> list[Any]:
  """The jaxprs of a custom call's differentiation rules: the custom_vjp forward rule or the custom_jvp rule.

  Traced from the equation's thunks (``fwd_jaxpr_thunk`` called with every input differentiated,
  ``jvp_jaxpr_fun`` with no symbolic-zero tangents). Empty for other equations, and when the thunk cannot be traced
  here (a rule closing over values of a finished trace, or a JAX version whose thunk convention differs) --
  :func:`emitted_checkpoint_names` then falls back to tracing ``jax.vjp``.

  Args:
    eqn: a jaxpr equation.

  Returns:
    A list of zero or one (open) jaxpr.
  """
  name = eqn.primitive.name
  if name not in CUSTOM_CALLS:
    return []
  call = eqn.params.get("call_jaxpr")
  count = len(call.in_avals) - int(eqn.params.get("num_consts", 0)) if call is not None else 0
  try:
    if name == "custom_vjp_call":
      traced = eqn.params["fwd_jaxpr_thunk"].call_wrapped(*([True] * count))
    else:
      traced = eqn.params["jvp_jaxpr_fun"].call_wrapped(*([False] * count))
  except Exception:  # noqa: BLE001 - JAX-internal convention; the jax.vjp trace covers what is missed here
    return []
  jaxpr = traced[0] if isinstance(traced, tuple) else traced
  return [jaxpr] if _is_jaxpr(jaxpr) else []


def sub_jaxprs(eqn: Any, *, rules: bool = False) -> Iterator[Any]:
  """Yields the (closed) jaxprs held in an equation's params (scan/while bodies, cond branches, remat, pjit…).

  Args:
    eqn: a jaxpr equation.
    rules: also yield the custom_vjp forward rule / custom_jvp rule of custom calls (:func:`rule_jaxprs`). Off by
      default: FLOP counting walks the primal function only, so a rule must not be counted a second time.
  """
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if _is_jaxpr(sub):
        yield sub
  if rules:
    yield from rule_jaxprs(eqn)


def iter_eqns(jaxpr: Any, *, rules: bool = False) -> Iterator[Any]:
  """Yields every equation of a (closed) jaxpr and, depth first, of every sub-jaxpr in its equations' params.

  Args:
    jaxpr: a jaxpr or closed jaxpr.
    rules: also walk custom_vjp forward rules and custom_jvp rules (see :func:`sub_jaxprs`).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in sub_jaxprs(eqn, rules=rules):
      yield from iter_eqns(sub, rules=rules)


def uses_remat(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr contains a ``jax.checkpoint`` (primitive ``remat2``) anywhere."""
  return any(eqn.primitive.name in _REMAT_PRIMITIVES for eqn in iter_eqns(jaxpr))


def outermost_remats(jaxpr: Any) -> list[Any]:
  """The ``jax.checkpoint`` equations of a (closed) jaxpr that are not inside another one, in program order.

  Sub-jaxprs of other equations (``pjit``, ``cond``, ``scan`` bodies…) are searched; a remat's own body is not.
  Under a checkpoint structure (``every:K``, ``nested``) these are the outermost groups; their bodies
  (``eqn.params["jaxpr"]``) hold the next level.
  """
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if eqn.primitive.name in _REMAT_PRIMITIVES:
      found.append(eqn)
      continue
    for sub in sub_jaxprs(eqn):
      found.extend(outermost_remats(sub))
  return found


def _names(jaxpr: Any) -> set[str]:
  return {eqn.params["name"] for eqn in iter_eqns(jaxpr, rules=True) if eqn.primitive.name == "name"}


def emitted_checkpoint_names(fn: Callable, *args, **kwargs) -> frozenset[str]:
  """The checkpoint names (``jax.ad_checkpoint.checkpoint_name``) that ``fn(*args, **kwargs)`` emits.

  Names are found at any depth (inside scans, remat, jit…) and inside the differentiation rules of custom
  derivatives: a ``jax.custom_vjp`` whose forward rule tags a residual, or a ``jax.custom_jvp`` rule. Those run only
  when ``fn`` is differentiated, which is when a remat policy sees them; when ``fn`` has a custom call, ``jax.vjp``
  of ``fn`` is traced as well.

  Args:
    fn: any traceable function.
    *args: arrays or ``jax.ShapeDtypeStruct``s (nothing is computed, only traced).
    **kwargs: keyword arguments, traced like ``args``.

  Returns:
    The set of names.
  """
  jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
  names = _names(jaxpr)
  if any(eqn.primitive.name in CUSTOM_CALLS for eqn in iter_eqns(jaxpr)):
    bound = functools.partial(fn, **kwargs)
    names |= _names(jax.make_jaxpr(lambda *a: jax.vjp(bound, *a)[0])(*args))
  return frozenset(names)


def count_remat_regions(jaxpr: Any) -> int:
  """How many ``jax.checkpoint`` (remat) equations a jaxpr holds at any depth (a scan body counted once).

  The report checks with it that a policy was applied: ``none`` must give 0, every other policy more.

  Args:
    jaxpr: a ``jax.core.Jaxpr`` or ``ClosedJaxpr`` (e.g. ``jax.jit(step).trace(...).jaxpr``).

  Returns:
    The number of remat equations (≥ 0).
  """
  return sum(1 for eqn in iter_eqns(jaxpr) if eqn.primitive.name in _REMAT_PRIMITIVES)
