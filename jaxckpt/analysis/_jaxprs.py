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

from jaxckpt.analysis._internals import internal

SHARED_CALLS: tuple[str, ...] = ("jaxckpt_shared_layer", "jaxckpt_layer_slices")
"""Names of the ``jax.jit`` calls an analysis trace makes only to share traces between identical unrolled layers
(:func:`jaxckpt.core._structure.shared_layer_traces`); :func:`inline_calls` replaces them by their bodies, so the
jaxpr reads as the unrolled trace it stands for."""


def _remat_forms() -> tuple[tuple[str, ...], tuple[type, ...]]:
  """Every form a ``jax.checkpoint`` region takes in a jaxpr of the installed JAX, looked up in one place.

  - JAX's remat ("remat2", the default in 0.10): an equation of the primitive ``jax._src.ad_checkpoint.remat_p``
    (named ``remat2``; ``checkpoint``/``remat`` in older JAX) whose body is ``params["jaxpr"]``.
  - JAX's next remat ("remat3", ``jax_remat3=True``): a ``call_hi_primitive`` equation whose ``params["_prim"]`` is
    a ``RematTraced`` (``jax.checkpoint``) or ``CustomRemat`` (``jax.custom_remat``) object holding the body.
  Names are read from JAX itself, so a JAX that renames them is still recognised; classes missing from the
  installed JAX are left out.
  """
  _ac = internal("ad_checkpoint", needed_by="jaxckpt.analysis._jaxprs (remat regions)")
  names = {"remat2", "checkpoint", "remat"}
  prim = getattr(_ac, "remat_p", None)
  if prim is not None:
    names.add(prim.name)
  classes = tuple(c for c in (getattr(_ac, "RematTraced", None), getattr(_ac, "CustomRemat", None)) if c is not None)
  return tuple(sorted(names)), classes


_REMAT_PRIMITIVES, _REMAT3_CLASSES = _remat_forms()
REMAT_FORMS: tuple[str, ...] = _REMAT_PRIMITIVES + tuple(f"call_hi_primitive[{c.__name__}]" for c in _REMAT3_CLASSES)
"""Every remat form this module recognises in the installed JAX (primitive names; remat3's hi-primitive classes)."""


def _hi_prim(eqn: Any) -> Any:
  """The hi-primitive object of a ``call_hi_primitive`` equation (remat3's remat and checkpoint names), else None."""
  return eqn.params.get("_prim") if eqn.primitive.name == "call_hi_primitive" else None


def is_remat(eqn: Any) -> bool:
  """Whether a jaxpr equation is a ``jax.checkpoint`` region, in either remat implementation (:data:`REMAT_FORMS`)."""
  if eqn.primitive.name in _REMAT_PRIMITIVES:
    return True
  return bool(_REMAT3_CLASSES) and isinstance(_hi_prim(eqn), _REMAT3_CLASSES)


_REMAT3_FUNCTIONS = frozenset({"_remat3", "RematTraced.vjp_bwd", "RematTraced.linearized", "vjp_bwd", "linearized"})


def is_differentiated_remat3(eqn: Any) -> bool:
  """Whether an equation is what a remat3 region leaves in a *differentiated* jaxpr.

  Under remat3, ``jax.grad`` of a ``jax.checkpoint`` region expands it at trace time: the forward ops are inlined,
  and the backward pass recomputes behind one ``optimization_barrier`` over the region's saved inputs (JAX's
  ``RematTraced.vjp_bwd``). That barrier is recognised by its traceback, which passes through JAX's remat3 entry
  point (``jax._src.ad_checkpoint._remat3``); a barrier written by the user is not counted.
  """
  if eqn.primitive.name != "optimization_barrier":
    return False
  traceback = getattr(eqn.source_info, "traceback", None)
  if traceback is None:
    return False
  return any(frame.file_name == _AD_CHECKPOINT_FILE and frame.function_name in _REMAT3_FUNCTIONS
             for frame in traceback.frames)


def _ad_checkpoint_file() -> str:
  return internal("ad_checkpoint", needed_by="jaxckpt.analysis._jaxprs (remat3 barriers)").__file__


_AD_CHECKPOINT_FILE = _ad_checkpoint_file()


def remat_body(eqn: Any) -> Any:
  """The body (checkpointed function) of a remat equation as a jaxpr or closed jaxpr; None for other equations."""
  if eqn.primitive.name in _REMAT_PRIMITIVES:
    return eqn.params.get("jaxpr")
  prim = _hi_prim(eqn)
  if _REMAT3_CLASSES and isinstance(prim, _REMAT3_CLASSES):
    return prim.params.get("jaxpr")
  return None


def remat_policy(eqn: Any) -> Any:
  """The policy object of a remat equation (None: save nothing, or not a remat equation)."""
  if eqn.primitive.name in _REMAT_PRIMITIVES:
    return eqn.params.get("policy")
  prim = _hi_prim(eqn)
  return prim.params.get("policy") if prim is not None and hasattr(prim, "params") else None


def checkpoint_name_of(eqn: Any) -> str | None:
  """The name of a ``checkpoint_name`` equation (remat2: primitive ``name``; remat3: a ``CheckpointName``
  hi-primitive), else None."""
  if eqn.primitive.name == "name":
    return eqn.params.get("name")
  prim = _hi_prim(eqn)
  if prim is not None and type(prim).__name__ == "CheckpointName":
    return prim.params.get("name")
  return None

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
  params = dict(eqn.params)
  prim = _hi_prim(eqn)
  if prim is not None:  # remat3 and other hi-primitives hold their jaxprs in the primitive object's params
    params.update(getattr(prim, "params", None) or {})
  for value in params.values():
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


LAYOUT_ONLY = frozenset({"sharding_constraint", "pjit", "jit", "mesh_cast", "reshard"})
"""Primitives that move or lay out values without computing: a remat region of nothing else recomputes no FLOPs."""


def is_gather_only(eqn: Any) -> bool:
  """Whether a remat equation's body only lays out values (:data:`LAYOUT_ONLY`: sharding constraints and the calls
  around them): the ``jax.checkpoint`` in which a block without remat gathers its FSDP-sharded parameters, so the
  backward pass gathers again (:func:`jaxckpt.core._remat._gathered_call`). It recomputes no activation, so it is
  not a remat region of the policy's."""
  body = remat_body(eqn)
  return body is not None and all(e.primitive.name in LAYOUT_ONLY for e in iter_eqns(body))


def _policy_remat(eqn: Any) -> bool:
  return (is_remat(eqn) and not is_gather_only(eqn)) or is_differentiated_remat3(eqn)


def uses_remat(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr contains a ``jax.checkpoint`` (either remat implementation, :func:`is_remat`, or a
  differentiated remat3 region, :func:`is_differentiated_remat3`); a region that only gathers FSDP-sharded
  parameters (:func:`is_gather_only`) is not counted."""
  return any(_policy_remat(eqn) for eqn in iter_eqns(jaxpr))


def outermost_remats(jaxpr: Any) -> list[Any]:
  """The ``jax.checkpoint`` equations of a (closed) jaxpr that are not inside another one, in program order.

  Sub-jaxprs of other equations (``pjit``, ``cond``, ``scan`` bodies…) are searched; a remat's own body is not.
  Under a checkpoint structure (``every:K``, ``nested``) these are the outermost groups; their bodies
  (:func:`remat_body`) hold the next level.
  """
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if is_remat(eqn):
      found.append(eqn)
      continue
    for sub in sub_jaxprs(eqn):
      found.extend(outermost_remats(sub))
  return found


def _names(jaxpr: Any) -> set[str]:
  return {name for eqn in iter_eqns(jaxpr, rules=True) if (name := checkpoint_name_of(eqn)) is not None}


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
  """How many ``jax.checkpoint`` (remat) equations a jaxpr holds at any depth (a scan body counted once), in either
  remat implementation (:func:`is_remat`; in a differentiated jaxpr under remat3, the barrier each region leaves,
  :func:`is_differentiated_remat3`).

  The report checks with it that a policy was applied: ``none`` must give 0, every other policy more. A region that
  only gathers FSDP-sharded parameters (:func:`is_gather_only`, policy ``none`` under a mesh) is not counted.

  Args:
    jaxpr: a ``jax.core.Jaxpr`` or ``ClosedJaxpr`` (e.g. ``jax.jit(step).trace(...).jaxpr``).

  Returns:
    The number of remat equations (≥ 0).
  """
  return sum(1 for eqn in iter_eqns(jaxpr) if _policy_remat(eqn))


def inline_calls(jaxpr: Any, names: tuple[str, ...] = SHARED_CALLS, *, call_sites: dict[int, Any] | None = None
                 ) -> Any:
  """``jaxpr`` with every ``jit`` call named in ``names`` replaced by its body's equations (recursively).

  The body of a call made several times (the same traced function, one jaxpr) is inlined once per call with fresh
  variables, so each copy's values are distinct, as in a trace that ran the function's code each time. Equations
  keep their source lines, so JAX's saved-residual analysis describes an inlined value as it describes the value of
  that trace (``output of dot_general from file.py:12``, not ``output of jitted function``). Constants of an
  inlined body become constvars of the result (what a trace closing over them has).

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr`` (e.g. the ``jaxpr`` of ``jax.make_jaxpr(fn)(...)``).
    names: the ``name`` parameters of the calls to inline (default :data:`SHARED_CALLS`).
    call_sites: filled, when given, with ``id(equation) -> source info`` of the outermost inlined call each inlined
      equation came from (a shared trace's equations carry the lines of the trace that made it, inside the call:
      where it was called is the call's).

  Returns:
    A new jaxpr with the same invars and the same outputs; ``jaxpr`` itself when it holds no such call.
  """
  if not any(_inlined(eqn, names) for eqn in jaxpr.eqns):
    return jaxpr
  eqns: list[Any] = []
  constvars = list(jaxpr.constvars)

  def read(env: dict, atom: Any) -> Any:
    return atom if isinstance(atom, jex_core.Literal) else env.get(atom, atom)

  def walk(body: Any, env: dict, site: Any) -> list[Any]:
    for eqn in body.eqns:
      ins = [read(env, a) for a in eqn.invars]
      if _inlined(eqn, names):
        closed = eqn.params["jaxpr"]
        sub_env = dict(zip(closed.jaxpr.invars, ins))
        for var in closed.jaxpr.constvars:  # a constant the body closed over: a constvar of the result
          sub_env[var] = new = jex_core.Var(var.aval)
          constvars.append(new)
        outs = walk(closed.jaxpr, sub_env, eqn.source_info if site is None else site)
      else:
        outs = [type(v)(v.aval) if site is not None else v for v in eqn.outvars]  # Var or DropVar
        eqns.append(eqn.replace(invars=ins, outvars=outs))
        if site is not None and call_sites is not None:
          call_sites[id(eqns[-1])] = site
      env.update((v, out) for v, out in zip(eqn.outvars, outs) if not isinstance(v, jex_core.DropVar))
    return [read(env, a) for a in body.outvars]

  outvars = walk(jaxpr, {}, None)
  return jaxpr.replace(eqns=eqns, outvars=outvars, constvars=constvars)


def _inlined(eqn: Any, names: tuple[str, ...]) -> bool:
  return eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in names and "jaxpr" in eqn.params
