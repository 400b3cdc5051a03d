"""Policies that silently save nothing they were meant to: find them before a run, warn about them.

A remat policy is a predicate over primitives and checkpoint names (:mod:`jaxckpt.policies`), so it can match
nothing in a given function and still run without error: the function is then fully recomputed (or, for
``everything_saveable``, nothing is saved *less* than without remat). The common ways this happens, each reported in
public bug trackers:

- A dots policy (``dots_saveable``, ``dots_with_no_batch_dims_saveable``, ``offload_dot_with_no_batch_dims``) on a
  function whose matmuls are not ``dot_general`` to JAX -- a kernel or callback behind a ``jax.custom_vjp``, a
  ``scaled_dot_general`` before jax-ml/jax#30717, TransformerEngine GEMMs (NVIDIA/TransformerEngine#2003). Those
  matmuls are recomputed in the backward pass. The fix is to tag their outputs with
  ``jax.ad_checkpoint.checkpoint_name`` and save them by name (``save_only_these_names:...``).
- ``dots_with_no_batch_dims_saveable`` on a function whose every ``dot_general`` has batch dimensions.
- A names policy whose names the function never emits (a typo, or a layer that does not tag that value), or emits
  but never needs in the backward pass.
- ``everything_saveable``: it saves every intermediate, as much as no remat at all.

:func:`policy_warnings` traces ``jax.vjp`` of ``jax.checkpoint(fn, policy=...)`` with
:func:`jaxckpt.analysis._residuals.saved_residuals` (nothing is compiled or executed) and returns one line per such problem;
:func:`warn_policy` issues them as :class:`RematPolicyWarning`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from jaxckpt.analysis._jaxprs import CUSTOM_CALLS, emitted_checkpoint_names, sub_jaxprs
from jaxckpt.policies._spec import DEFAULT_BLOCK, Policy, PolicySpec, parse_policy
from jaxckpt.analysis._residuals import Residual, saved_residuals, total_residual_bytes

DOTS_POLICIES: tuple[str, ...] = (
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "offload_dot_with_no_batch_dims",
)
"""Canonical names of the policies that save ``dot_general`` outputs."""

_NO_BATCH_DIMS = ("dots_with_no_batch_dims_saveable", "offload_dot_with_no_batch_dims")
_CUSTOM_CALLS = CUSTOM_CALLS
# Offloading policies move what they save with device_put; saved_residuals then reports "output of device_put".
_OFFLOADED = "device_put"


class RematPolicyWarning(UserWarning):
  """A remat policy saves nothing of what it is meant to save for a function (see :func:`policy_warnings`)."""


def _as_function(fn: Callable[..., Any] | nnx.Module, args: tuple, kwargs: dict) -> tuple[Callable[..., Any], tuple]:
  """Closes over ``kwargs`` (static flags stay Python values) and turns an NNX module into a function of its state."""
  if isinstance(fn, nnx.Module):
    graphdef, state = nnx.split(fn)

    def call(state, *a):
      return nnx.merge(graphdef, state)(*a, **kwargs)

    return call, (state, *args)
  if not callable(fn):
    raise TypeError(f"policy_warnings expects a function or an flax.nnx.Module, got {type(fn).__name__}: {fn!r}")
  return functools.partial(fn, **kwargs), args


def _walk(jaxpr: Any, inside: tuple[str, ...] = ()) -> Iterator[tuple[Any, tuple[str, ...]]]:
  """Yields ``(eqn, names of the enclosing custom_vjp/custom_jvp calls)`` for every equation, at any depth."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn, inside
    here = inside
    if eqn.primitive.name in _CUSTOM_CALLS:
      here = (*inside, _call_name(eqn))
    for sub in sub_jaxprs(eqn):
      yield from _walk(sub, here)


def _call_name(eqn: Any) -> str:
  """The name of the function a custom_vjp/custom_jvp call wraps (as JAX's jaxpr printer finds it), or ``"?"``."""
  call = eqn.params.get("call_jaxpr")
  debug = getattr(getattr(call, "jaxpr", call), "debug_info", None)
  return str(eqn.params.get("name") or getattr(debug, "func_name", None) or "?")


def _has_batch_dims(eqn: Any) -> bool:
  (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
  return bool(lhs_batch)


def _dots_message(policy: Policy, saved: list[Residual], jaxpr: Any) -> str | None:
  kinds = ("dot_general", _OFFLOADED) if policy.name == "offload_dot_with_no_batch_dims" else ("dot_general",)
  if any(r.primitive in kinds for r in saved):
    return None
  eqns = list(_walk(jaxpr))
  dots = [eqn for eqn, inside in eqns if eqn.primitive.name == "dot_general" and not inside]
  def called(primitives: tuple[str, ...]) -> list[str]:
    return sorted({_call_name(eqn) for eqn, _ in eqns if eqn.primitive.name in primitives})

  custom_vjp, custom = called(("custom_vjp_call",)), called(_CUSTOM_CALLS)
  head = f"policy {policy.name} saves no dot_general output of this function"
  fix = ("tag the values to keep with jax.ad_checkpoint.checkpoint_name(y, 'name') and use "
         "save_only_these_names:name")
  if custom_vjp and not dots:
    return (f"{head}: its matmuls sit inside custom_vjp function(s) {', '.join(custom_vjp)} whose forward rule does "
            f"not expose a dot_general to the policy (a kernel, callback or custom primitive), so they are "
            f"recomputed in the backward pass; {fix}")
  if not dots:
    where = f" (custom_jvp calls: {', '.join(custom)})" if custom else ""
    return (f"{head}: it has no dot_general at all{where}; matmuls written as convolutions, multiply-and-sum or "
            f"kernels are not seen by dots policies, so it saves nothing here (like nothing_saveable); {fix}")
  if policy.name in _NO_BATCH_DIMS and all(_has_batch_dims(eqn) for eqn in dots):
    return (f"{head}: every one of its {len(dots)} dot_general(s) has batch dimensions (e.g. attention einsums), "
            f"which {policy.name} never saves; use dots_saveable, or {fix}")
  return (f"{head}: the backward pass needs none of its {len(dots)} dot_general output(s) (they feed only linear "
          f"operations), so the policy saves nothing here (like nothing_saveable)")


def _names_messages(policy: Policy, saved: list[Residual], emitted: frozenset[str]) -> list[str]:
  saved_names = {r.name for r in saved if r.kind == "checkpoint_name"}
  out = []
  if policy.name in ("save_anything_except_these_names", "save_any_names_but_these"):
    unused = sorted(set(policy.names) - emitted)
    like = ("everything, like everything_saveable" if policy.name == "save_anything_except_these_names"
            else "every checkpoint-named value")
    if unused and not set(policy.names) & emitted:
      out.append(f"policy {policy} excludes checkpoint name(s) {', '.join(unused)} that this function never emits "
                 f"(emitted: {', '.join(sorted(emitted)) or 'none'}): it saves {like}")
    return out
  for name in sorted(set(policy.names) | set(policy.offload_names)):
    if name not in emitted:
      out.append(f"policy {policy} names checkpoint {name!r}, which this function never emits (emitted: "
                 f"{', '.join(sorted(emitted)) or 'none'}); it saves nothing for it -- check the spelling, or tag the "
                 f"value with jax.ad_checkpoint.checkpoint_name")
    elif name in policy.names and name not in saved_names:
      out.append(f"policy {policy} names checkpoint {name!r}, which this function emits but its backward pass never "
                 f"reads, so nothing is saved for it; name a value the backward pass needs (e.g. the input of a "
                 f"nonlinearity)")
  # Offloaded names are reported by saved_residuals as device_put outputs, without their names: only their
  # emission is checked above.
  return out


def policy_warnings(
    fn: Callable[..., Any] | nnx.Module,
    *args: Any,
    policy: "str | Policy | PolicySpec",
    block_type: str = DEFAULT_BLOCK,
    **kwargs: Any,
) -> list[str]:
  """Checks what ``policy`` saves for ``fn`` and describes every way it saves nothing it was meant to save.

  Traces the backward pass of ``jax.checkpoint(fn, policy=...)`` (no compilation, nothing executed) and checks:

  - dots policies (:data:`DOTS_POLICIES`): at least one ``dot_general`` output is saved (for
    ``offload_dot_with_no_batch_dims``: offloaded). If not, says why: the matmuls are inside a ``custom_vjp`` whose
    forward rule hides them (kernels, callbacks), there is no ``dot_general``, every dot has batch dimensions, or the
    backward pass needs none.
  - ``save_only_these_names`` / ``save_and_offload_only_these_names``: every name is emitted by ``fn`` (names
    tagged inside a ``custom_vjp`` forward rule or a ``custom_jvp`` rule count, see
    :func:`jaxckpt.analysis._jaxprs.emitted_checkpoint_names`), and every
    name to be kept on device is among the saved residuals (offloaded values lose their names in JAX's report, so
    only their emission is checked).
  - ``save_anything_except_these_names``: at least one excluded name is emitted (else it is ``everything_saveable``).
  - ``everything_saveable``: always reported, with its residual bytes next to those of no remat.

  ``none`` and ``nothing_saveable`` give no warnings.

  Args:
    fn: the function a block computes, *without* remat (the policy is applied here), e.g.
      ``lambda params, x: block_fn(params, x)``; or an NNX module, called as ``fn(*args, **kwargs)`` with its whole
      state as the differentiated input (a jaxckpt block should have policy ``none``, else its own policy applies).
      Its output must be float arrays.
    *args: positional arguments of ``fn``: arrays or ``jax.ShapeDtypeStruct`` pytrees (only traced). They are the
      inputs the gradient is taken with respect to.
    policy: the policy: a spec string such as ``"dots_saveable"``, a :class:`~jaxckpt.Policy` or a
      :class:`~jaxckpt.PolicySpec` (keyword-only).
    block_type: for a block map, whose policy to check (default: the map's ``default``).
    **kwargs: keyword arguments of ``fn``, closed over as Python values (static flags such as
      ``deterministic=True``), never traced. ``fn`` cannot take keywords named ``policy`` or ``block_type``.

  Returns:
    One line per problem, in a stable order; empty when the policy saves what it is meant to.

  Raises:
    PolicySpecError: a malformed policy spec.
    TypeError: ``fn`` is neither callable nor an NNX module.
    Any exception raised by tracing ``jax.vjp`` of ``fn`` with these arguments.

  Example::

    >>> @jax.custom_vjp
    ... def matmul(x, w): ...  # forward rule calls a kernel, not dot_general
    >>> policy_warnings(lambda w, x: jnp.tanh(matmul(x, w)).sum(), w, x, policy="dots_saveable")
    ['policy dots_saveable saves no dot_general output of this function: its matmuls sit inside custom_vjp ...']
  """
  chosen = parse_policy(policy).for_block(block_type)
  if not chosen.remat or chosen.name == "nothing_saveable":
    return []
  f, args = _as_function(fn, args, kwargs)
  saved = saved_residuals(jax.checkpoint(f, policy=chosen.to_jax()), *args)
  if chosen.name == "everything_saveable":
    kept = total_residual_bytes(saved, include_arguments=False)
    baseline = total_residual_bytes(saved_residuals(f, *args), include_arguments=False)
    return [f"policy everything_saveable saves every intermediate ({kept} bytes of residuals; {baseline} without "
            f"remat): it uses as much memory as no remat and adds jax.checkpoint's cost; use none, or a policy that "
            f"saves less (dots_saveable, save_only_these_names:...)"]
  if chosen.name in DOTS_POLICIES:
    message = _dots_message(chosen, saved, jax.make_jaxpr(f)(*args))
    return [message] if message else []
  if chosen.names or chosen.offload_names:
    # Names tagged inside custom_vjp forward rules / custom_jvp rules count: they run under differentiation.
    return _names_messages(chosen, saved, emitted_checkpoint_names(f, *args))
  return []


def warn_policy(
    fn: Callable[..., Any] | nnx.Module,
    *args: Any,
    policy: "str | Policy | PolicySpec",
    block_type: str = DEFAULT_BLOCK,
    stacklevel: int = 2,
    **kwargs: Any,
) -> list[str]:
  """Runs :func:`policy_warnings` and issues each line with ``warnings.warn(..., RematPolicyWarning)``.

  Args:
    fn, *args, policy, block_type, **kwargs: as for :func:`policy_warnings`.
    stacklevel: passed to ``warnings.warn`` (default: the caller of this function).

  Returns:
    The warning lines (empty if none).

  Raises:
    As :func:`policy_warnings`.
  """
  messages = policy_warnings(fn, *args, policy=policy, block_type=block_type, **kwargs)
  for message in messages:
    warnings.warn(message, RematPolicyWarning, stacklevel=stacklevel)
  return messages
