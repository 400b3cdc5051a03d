"""Does a JAX policy save what its name says, in the JAX that is installed? A check on a small graph.

A policy's name is a promise (``dots_saveable``: the outputs of matmuls are saved, nothing else); its body in
``jax/_src/ad_checkpoint.py`` is what runs, and bodies change between JAX releases (in jax 0.10.2
``save_anything_except_these_names`` returns True for every value: it saves exactly what ``everything_saveable``
saves). :func:`check_policy_meaning` runs one policy on :func:`probe` -- a function with a named matmul output, a
named non-matmul value, a batched matmul and unnamed elementwise values -- lists what JAX saves
(:func:`jaxckpt.analysis._residuals.saved_residuals`) and compares it with :data:`PROMISES`. :func:`broken_policies` gives the
registry's policies whose meaning the installed JAX does not deliver; the parser refuses those with one line.

Grouped matmuls (``jax.lax.ragged_dot``, a dropless MoE's expert matmuls) are matmuls too, and the dots policies'
names promise to save matmul outputs: :func:`grouped_matmul_gap` checks, on :func:`grouped_probe`, whether the
installed JAX's dots policy saves them (jax 0.10.2's ``DotsSaveable`` saves ``dot_general`` and convolutions only,
so it recomputes every expert matmul), and the report says so on the rows it concerns.

Also here: :func:`check_policy`, which refuses under remat3 a policy JAX would silently run as full remat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.analysis._internals import internal
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.errors import PolicySpecError
from jaxckpt._remat_impl import ENV_VAR, REMAT3, remat_implementation

JaxPolicy = Optional[Callable[..., object]]
"""A ``jax.checkpoint`` policy: a predicate over primitives (or one of JAX's policy objects), or None (full remat)."""

KINDS = ("named_a", "named_b", "dot", "batch_dot", "other", "offloaded")
"""What :func:`probe` can save: ``named_a``/``named_b`` (the checkpoint-named values), ``dot`` (an unnamed matmul
output without batch dimensions), ``batch_dot`` (a matmul output with a batch dimension), ``other`` (an unnamed
non-matmul value), ``offloaded`` (a value moved to host memory, JAX's ``device_put`` residual)."""


def probe(w: jax.Array, x: jax.Array) -> jax.Array:
  """The check's graph. ``w: [8, 8] float32``, ``x: [2, 4, 8] float32``; returns a scalar float32.

  ``a = name(x @ w, "a")`` (a matmul without batch dimensions, named), ``b = name(a * a, "b")`` (named, not a
  matmul), ``d = tanh(b @ w)`` (an unnamed matmul, then unnamed elementwise values), ``e = d @ d^T`` per batch
  element (a matmul with a batch dimension), then ``sum(cos(e))``. Without remat the backward pass needs ``a``,
  ``b``, ``tanh``'s output and ``sin(e)``.
  """
  a = checkpoint_name(jnp.einsum("btd,de->bte", x, w), "a")
  b = checkpoint_name(a * a, "b")
  d = jnp.tanh(jnp.einsum("btd,de->bte", b, w))
  e = jnp.einsum("btd,bsd->bts", d, d)
  return jnp.sum(jnp.cos(e))


NO_REMAT = "none"
PROMISES: dict[str, frozenset[str] | str] = {
    "nothing_saveable": frozenset(),
    "everything_saveable": NO_REMAT,  # what no remat keeps
    "dots_saveable": frozenset({"dot", "batch_dot"}),
    "dots_with_no_batch_dims_saveable": frozenset({"dot"}),
    "save_only_these_names": frozenset({"named_a"}),  # with names ("a",)
    "save_any_names_but_these": frozenset({"named_b"}),  # with names ("a",): the other named values only
    "save_anything_except_these_names": frozenset({"named_b", "other"}),  # ("a",): no remat's, less a
    "save_and_offload_only_these_names": frozenset({"named_a", "offloaded"}),  # save a, offload b
    "offload_dot_with_no_batch_dims": frozenset({"offloaded"}),
}
"""Policy -> the kinds of :data:`KINDS` its name promises to keep on :func:`probe` (``"none"``: what no remat
keeps), with the checkpoint name ``a`` as the argument of name-based policies (``b`` offloaded)."""

_ARGS = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((2, 4, 8), jnp.float32))


def _jax_policy(name: str) -> Callable[..., object] | None:
  cp = jax.checkpoint_policies
  build = {
      "save_only_these_names": lambda: cp.save_only_these_names("a"),
      "save_any_names_but_these": lambda: cp.save_any_names_but_these("a"),
      "save_anything_except_these_names": lambda: cp.save_anything_except_these_names("a"),
      "save_and_offload_only_these_names": lambda: cp.save_and_offload_only_these_names(
          names_which_can_be_saved=["a"], names_which_can_be_offloaded=["b"], offload_src="device",
          offload_dst="pinned_host"),
      "offload_dot_with_no_batch_dims": lambda: cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
  }.get(name)
  return build() if build is not None else getattr(cp, name)


def saved_kinds(policy: "Callable[..., object] | str | None") -> frozenset[str]:
  """The :data:`KINDS` that ``jax.checkpoint(probe, policy=policy)`` saves (``policy="none"``: :func:`probe`
  without remat), from JAX's saved-residual analysis (a trace; nothing compiled or run).

  The checkpoint name, the producing primitive and the shape (the batched matmul's output is ``[2, 4, 4]``, the
  others ``[2, 4, 8]``) tell the kinds apart.
  """
  kinds = set()
  fn = probe if policy == NO_REMAT else jax.checkpoint(probe, policy=policy)
  for r in saved_residuals(fn, *_ARGS):
    if r.kind == "argument":
      continue
    if r.primitive == "device_put":
      kinds.add("offloaded")
    elif r.name in ("a", "b"):
      kinds.add(f"named_{r.name}")
    elif r.primitive == "dot_general":
      kinds.add("batch_dot" if r.shape == (2, 4, 4) else "dot")
    else:
      kinds.add("other")
  return frozenset(kinds)


@functools.cache
def check_policy_meaning(name: str) -> str | None:
  """Compares what a ``jax.checkpoint_policies`` member saves on :func:`probe` with what its name promises.

  Args:
    name: a key of :data:`PROMISES` (JAX's canonical policy names, and ``save_any_names_but_these``).

  Returns:
    None when the saved kinds match the promise, else one line saying what JAX saves instead. Cached per process
    (a few traces, no compile).

  Raises:
    KeyError: ``name`` is not in :data:`PROMISES`.
  """
  promised = PROMISES[name]
  if promised == NO_REMAT:
    promised = saved_kinds(NO_REMAT)
  got = saved_kinds(_jax_policy(name))
  if got == promised:
    return None
  return (f"jax {jax.__version__}'s {name} saves {sorted(got) or 'nothing'} on a graph where its name promises "
          f"{sorted(promised) or 'nothing'}")


GROUPED_MATMULS: tuple[str, ...] = ("ragged_dot_general",)
"""Primitives that are grouped matmuls (``jax.lax.ragged_dot`` / ``ragged_dot_general``)."""

MATMUL_PROMISES: dict[str, str] = {"dots_saveable": "save", "dots_with_no_batch_dims_saveable": "save",
                                   "offload_dot_with_no_batch_dims": "offload"}
"""Policies whose names promise to keep matmul outputs -> what they promise to do with them. A grouped matmul has no
batch dimension, so the ``no_batch_dims`` policies promise it too."""


def grouped_probe(x: jax.Array, w: jax.Array) -> jax.Array:
  """The grouped-matmul check's graph: ``x: [8, 4] float32``, ``w: [2, 4, 4] float32`` (two groups of four rows);
  ``sum(sin(ragged_dot(x, w)))``, whose backward pass needs the ``ragged_dot`` output."""
  return jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, jnp.array([4, 4], jnp.int32))))


@functools.cache
def grouped_matmul_gap(name: str) -> str | None:
  """Whether JAX's policy ``name`` keeps grouped-matmul outputs as its name promises (:data:`MATMUL_PROMISES`), on
  :func:`grouped_probe` (a trace; nothing compiled).

  Args:
    name: a canonical policy name; a policy that promises nothing about matmuls gives ``None``.

  Returns:
    ``None`` when it keeps them (or promises nothing), else one line: what the installed JAX does instead.
  """
  verb = MATMUL_PROMISES.get(name)
  if verb is None:
    return None
  args = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4, 4), jnp.float32))
  kept = [r for r in saved_residuals(jax.checkpoint(grouped_probe, policy=_jax_policy(name)), *args)
          if r.kind != "argument" and r.primitive in (*GROUPED_MATMULS, "device_put")]
  if kept:
    return None
  return (f"jax {jax.__version__}'s {name} does not {verb} the outputs of ragged_dot_general (grouped matmuls: a "
          f"dropless MoE's experts), only dot_general's: it recomputes them")


def broken_policies() -> dict[str, str]:
  """Policy -> the one-line mismatch, for every member of :data:`PROMISES` the installed JAX does not deliver.

  The offload policies are checked only under the default remat (remat3 refuses them: they are callables).
  """
  skip = {"offload_dot_with_no_batch_dims", "save_and_offload_only_these_names", "save_anything_except_these_names",
          "everything_saveable"} if remat_implementation() == REMAT3 else set()
  found = {}
  for name in PROMISES:
    if name not in skip and (problem := check_policy_meaning(name)) is not None:
      found[name] = problem
  return found


def _data_policy_types() -> tuple[type, ...]:
  ac = internal("ad_checkpoint", needed_by="jaxckpt's remat3 policy check")
  names = ("DotsSaveable", "SaveOnlyTheseNames", "SaveAnyNamesButThese")
  return tuple(t for n in names if (t := getattr(ac, n, None)) is not None)


def is_data_policy(policy: JaxPolicy) -> bool:
  """Whether remat3 honours ``policy``: None, ``nothing_saveable``, ``everything_saveable`` or one of JAX's policy
  classes (``DotsSaveable``, ``SaveOnlyTheseNames``, ``SaveAnyNamesButThese``)."""
  cp = jax.checkpoint_policies
  if policy is None or policy is cp.nothing_saveable or policy is cp.everything_saveable:
    return True
  return isinstance(policy, _data_policy_types())


def check_policy(policy: JaxPolicy, *, what: str = "policy") -> JaxPolicy:
  """Returns ``policy`` unchanged, or raises when the remat implementation in use would silently ignore it.

  Args:
    policy: a ``jax.checkpoint`` policy (a predicate, a JAX policy object, or None).
    what: how to call it in the message (e.g. ``"policy 'offload_dot_with_no_batch_dims'"``).

  Raises:
    PolicySpecError: under remat3, a policy that is not data (:func:`is_data_policy`): remat3 would run it as full
      remat without a word.
  """
  if policy is None or remat_implementation() != REMAT3 or is_data_policy(policy):
    return policy
  shown = getattr(policy, "__qualname__", None) or type(policy).__name__
  raise PolicySpecError(
      f"{what} ({shown}) is a callable policy, which JAX's next remat ({ENV_VAR}=1, remat3) ignores (it runs full "
      f"remat); use a policy by name (dots_saveable, save_only_these_names:…, save_any_names_but_these:…, "
      f"save_tensors:…) or unset {ENV_VAR}", spec=str(shown), bad=str(shown))
