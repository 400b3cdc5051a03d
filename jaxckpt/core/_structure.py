"""Checkpoint structure: *where* a stack of N blocks keeps its checkpoints, orthogonal to the per-block policy.

A policy decides what each block saves; a structure groups blocks and rematerializes whole groups, so only group
boundaries are kept across the forward pass (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
Flax Linen's ``nn.remat_scan(lengths=...)``; PyTorch's ``checkpoint_sequential(segments)``):

- ``block`` (default): no grouping; each block is remat'd by its own policy (``none`` = no remat at all).
- ``every:K``: groups of K consecutive blocks, each group under ``jax.checkpoint(nothing_saveable)``: the forward
  keeps N/K group inputs, the backward recomputes one group at a time (with the blocks' own policies inside).
  Memory ~ N/K + K block activations, minimal at K ≈ √N; a last, shorter group takes the remainder.
- ``nested`` = ``nested:2``, ``nested:D``: D levels of grouping, each level splitting its range into about
  n^(1/levels-left) near-equal groups (an outer scan over groups with remat on the group, inner scans over
  sub-groups, down to blocks): memory ~ D·N^(1/D) block activations for about D−1 extra forward passes. Depths that do
  not divide evenly get groups whose sizes differ by at most one.

Grammar: ``structure := "block" | "every:" K | "nested" [":" D]`` with integers K ≥ 1, D ≥ 2.

:func:`apply_layers` runs a stack of N layers with a structure, scanned or unrolled; :func:`apply_segments` runs
consecutive layer ranges each with its own layer function (the per-range policies of a
:class:`~jaxckpt.policies.LayeredPolicy`). Both front-ends' stacks (:class:`jaxckpt.nnx._layers.Stack` for NNX,
:class:`jaxckpt.linen.Stack` for Linen) call them with their own "apply layer i" function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxckpt.errors import JaxckptError, closest

LayerFn = Callable[[Any, Any], tuple[Any, Any]]
"""``(carry, layer_i) -> (carry, out_i)``: applies one layer, ``layer_i`` its slice of the stacked inputs (parameters,
dropout key...), ``out_i`` a pytree to stack over layers (e.g. new non-parameter state) or ``None``."""

STRUCTURE_KINDS = ("block", "every", "nested")
"""Structure names; ``every`` takes ``:K``, ``nested`` an optional ``:D``."""


@dataclasses.dataclass(frozen=True)
class Structure:
  """A parsed structure.

  Attributes:
    kind: ``"block"``, ``"every"`` or ``"nested"``.
    size: K for ``every`` (blocks per group), D for ``nested`` (levels, ≥ 2), 0 for ``block``.
  """

  kind: str = "block"
  size: int = 0

  @property
  def levels(self) -> int:
    """Levels of nesting including the block level: 1 for ``block``, 2 for ``every``, D for ``nested:D``."""
    return {"block": 1, "every": 2}.get(self.kind, self.size)

  def groups(self, n: int, level: int) -> list[tuple[int, int]]:
    """How a range of ``n`` blocks at nesting ``level`` (0 = outermost) is split.

    Args:
      n: blocks in the range, ≥ 1.
      level: nesting level of the range, 0 .. ``levels - 2``.

    Returns:
      ``[(count, size), ...]``: ``count`` consecutive groups of ``size`` blocks each, in order, sizes summing to
      ``n``. Each run of equal-size groups becomes one scan.
    """
    if self.kind == "every":
      k = min(self.size, n)
      plan = [(n // k, k)]
      return plan + [(1, n % k)] if n % k else plan
    g = max(1, min(n, math.ceil(n ** (1.0 / (self.levels - level)) - 1e-9)))
    q, r = divmod(n, g)
    return [(c, s) for c, s in ((r, q + 1), (g - r, q)) if c]

  def __str__(self) -> str:
    if self.kind == "block":
      return "block"
    return f"{self.kind}:{self.size}"


def parse_structure(text: "str | Structure | None") -> Structure:
  """Parses ``block``, ``every:K`` or ``nested[:D]`` (see the module docstring).

  Args:
    text: the structure text, a parsed :class:`Structure` (returned as is), or ``None`` (``block``).

  Returns:
    The :class:`Structure`.

  Raises:
    JaxckptError: an unknown name (with the closest valid one), a missing or non-integer K/D, K < 1 or D < 2.
  """
  if text is None:
    return Structure()
  if isinstance(text, Structure):
    return text
  name, sep, arg = str(text).strip().partition(":")
  name, arg = name.strip(), arg.strip()
  if name not in STRUCTURE_KINDS:
    hint = closest(name, STRUCTURE_KINDS)
    raise JaxckptError(
        f"unknown structure {text!r}; valid: block, every:K, nested, nested:D"
        + (f"; did you mean {hint!r}?" if hint else "")
    )
  if name == "block":
    if sep:
      raise JaxckptError(f"structure 'block' takes no argument, got {text!r}")
    return Structure()
  if name == "nested" and not sep:
    return Structure("nested", 2)
  if not arg.isdigit():
    example = "every:4" if name == "every" else "nested:3"
    raise JaxckptError(f"structure {text!r} needs a whole number after ':' (e.g. {example})")
  value = int(arg)
  if name == "every" and value < 1:
    raise JaxckptError(f"structure {text!r}: K must be ≥ 1")
  if name == "nested" and value < 2:
    raise JaxckptError(f"structure {text!r}: nested needs D ≥ 2 levels")
  return Structure(name, value)


_SHARED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("jaxckpt_shared_layer_traces", default=None)
"""``None`` outside :func:`shared_layer_traces`; inside, whether layer calls are shared too (slices always are)."""


@contextlib.contextmanager
def shared_layer_traces(*, layers: bool) -> Iterator[None]:
  """Within this context an unrolled :func:`loop` traces what its layers have in common once, for analyses that trace
  a model only for its jaxpr (the report's residual analysis of the unrolled twin, :mod:`jaxckpt.report._residuals`).

  Each layer's slice of the stacked inputs is taken by one ``jax.jit`` call per layer index (named
  ``jaxckpt_layer_slices``; its trace and differentiation are cached across calls, e.g. one policy after another),
  and with ``layers=True`` every layer runs through one ``jax.jit`` of the layer function (``jaxckpt_shared_layer``),
  so JAX traces and differentiates a layer once and reuses it for the other L - 1 (the jit trace cache; its
  linearization is cached per jaxpr). The jaxpr then holds these calls where the unrolled trace has their
  equations: :func:`jaxckpt.analysis._jaxprs.inline_calls` puts them back, with the same source lines, and JAX's
  saved-residual analysis of the result lists the same values (checked: tests/analysis/test_residuals.py).

  Differentiating a jitted call treats a literal it saves as a constant of the backward pass, while inline code
  lists it as a residual (``from a literal``): with ``layers=True``, layers without remat lose those entries, which
  the report leaves out anyway (:mod:`jaxckpt.report._residuals`). Only ``block`` structures share (a group under
  ``jax.checkpoint`` keeps its layers as they are).

  Args:
    layers: share the layer calls as well as the slices.
  """
  token = _SHARED.set(bool(layers))
  try:
    yield
  finally:
    _SHARED.reset(token)


def jaxckpt_layer_slices(layers: Any, index: int) -> Any:
  """Layer ``index``'s slice of every leaf of ``layers`` (leading layer axis dropped): what an unrolled loop feeds
  layer ``index``. Under :func:`shared_layer_traces` it is called jitted (:data:`_SHARED_SLICES`)."""
  return jax.tree.map(lambda a: a[index], layers)


_SHARED_SLICES = jax.jit(jaxckpt_layer_slices, static_argnums=1)
"""One traced call per (layers' shapes, index), cached across loops (one policy after another)."""


def _shared_layer(fn: LayerFn) -> LayerFn:
  """``fn`` as one ``jax.jit`` call named ``jaxckpt_shared_layer`` (:data:`~jaxckpt.analysis._jaxprs.SHARED_CALLS`)."""
  def jaxckpt_shared_layer(carry, layer):
    return fn(carry, layer)

  return jax.jit(jaxckpt_shared_layer)


def loop(fn: LayerFn, carry: Any, layers: Any, n: int, *, scan: bool, share: bool = False) -> tuple[Any, Any]:
  """``fn`` over the leading axis of ``layers``: ``jax.lax.scan`` or a Python loop over the same slices.

  Args:
    fn: ``(carry, layer_i) -> (carry, out_i)``.
    carry: the initial carry, e.g. activations ``[B, T, D]``.
    layers: pytree whose leaves have a leading axis of length ``n`` (``None`` leaves allowed).
    n: number of iterations.
    scan: ``True`` for ``jax.lax.scan`` (one compiled body), ``False`` for an unrolled Python loop.
    share: unrolled, inside :func:`shared_layer_traces`: trace the slices (and layer calls) once, as it says.

  Returns:
    ``(carry, outs)``: the final carry and the ``out_i`` stacked on a new leading axis (``None`` if they are).

  Each call sits under ``jax.named_scope`` (metadata only: XProf traces and HLO op names read by layer, as equinox
  names its layers): ``layer_{i}`` unrolled, ``layer_0..{n-1}`` around the one scanned body.
  """
  if scan:
    with jax.named_scope(f"layer_0..{n - 1}"):
      return jax.lax.scan(fn, carry, layers)
  shared = _SHARED.get() if share else None
  call = _shared_layer(fn) if shared else fn
  outs = []
  for i in range(n):
    with jax.named_scope(f"layer_{i}"):
      layer = (jaxckpt_layer_slices if shared is None else _SHARED_SLICES)(layers, i)
      carry, out = call(carry, layer)
    outs.append(out)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _concat(parts: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def apply_layers(
    apply_layer: LayerFn, carry: Any, layers: Any, num_layers: int, *, structure: "str | Structure", scan: bool
) -> tuple[Any, Any]:
  """Applies ``num_layers`` layers in order, grouped by ``structure``, scanned or unrolled.

  With ``block`` the layers are looped one by one. With ``every:K`` or ``nested[:D]`` they are split into groups
  (:meth:`Structure.groups`), each group's run under ``jax.checkpoint(nothing_saveable)`` so only group inputs are
  kept across the forward pass; each run of equal-size groups is one loop (Chen et al. 2016).

  Args:
    apply_layer: ``(carry, layer_i) -> (carry, out_i)``; its own remat (the block's policy) goes inside.
    carry: input of the first layer, e.g. ``[B, T, D]`` float32.
    layers: pytree with a leading layer axis of length ``num_layers`` on every leaf (parameters, keys...).
    num_layers: N ≥ 1.
    structure: ``"block"``, ``"every:K"``, ``"nested[:D]"`` or a :class:`Structure`.
    scan: ``jax.lax.scan`` over layers and groups (``True``) or Python loops (``False``).

  Returns:
    ``(carry, outs)``: the last layer's output and the ``out_i`` stacked over the N layers in order.

  Raises:
    JaxckptError: a malformed ``structure``.
  """
  structure = parse_structure(structure)

  def apply_range(carry, layers, n: int, level: int):
    """Applies ``n`` layers (leaves of ``layers`` have a leading axis n) at nesting ``level``."""
    if level == structure.levels - 1:
      return loop(apply_layer, carry, layers, n, scan=scan, share=structure.levels == 1)
    outs, offset = [], 0
    for count, size in structure.groups(n, level):
      part = jax.tree.map(lambda a: a[offset:offset + count * size].reshape(count, size, *a.shape[1:]), layers)
      group = jax.checkpoint(
          functools.partial(apply_range, n=size, level=level + 1), policy=jax.checkpoint_policies.nothing_saveable
      )
      carry, out = loop(group, carry, part, count, scan=scan)
      outs.append(jax.tree.map(lambda a: a.reshape(count * size, *a.shape[2:]), out))
      offset += count * size
    return carry, _concat(outs)

  return apply_range(carry, layers, num_layers, 0)


def apply_segments(
    apply_for: Callable[[Any], LayerFn], carry: Any, layers: Any, segments: Sequence[tuple[int, Any]], *, scan: bool
) -> tuple[Any, Any]:
  """Applies consecutive layer ranges, each with its own layer function (e.g. its own policy), one loop per range.

  Args:
    apply_for: ``setting -> apply_layer`` (see :func:`apply_layers`).
    carry: input of the first layer.
    layers: pytree with a leading layer axis of length ``sum(count)`` on every leaf.
    segments: ``[(count, setting), ...]`` in layer order, e.g. the ``segments`` of a
      :class:`~jaxckpt.policies.LayeredPolicy`.
    scan: ``jax.lax.scan`` per range (``True``) or Python loops (``False``).

  Returns:
    ``(carry, outs)`` as in :func:`apply_layers`.
  """
  outs, offset = [], 0
  for count, setting in segments:
    part = jax.tree.map(lambda a: a[offset:offset + count], layers)
    carry, out = loop(apply_for(setting), carry, part, count, scan=scan, share=True)
    outs.append(out)
    offset += count
  return carry, _concat(outs)
