"""What each policy saves for the backward pass, summarised for the report (built on :mod:`jaxckpt.analysis._residuals`).

The loss is differentiated w.r.t. the params only (what the train step differentiates); the batch and dropout key
are closed over. Layers stacked with ``scan`` would hide every checkpoint name behind "output of scan", so the
analysis runs on the unrolled twin of the model (same parameter tree, :attr:`PolicyStep.loss_of_params`).

Checkpoint structures (``every:K``, ``nested[:D]``). Each group of blocks sits under ``jax.checkpoint``, so the
forward pass keeps only the group inputs -- the same for every block policy. The block policies act when the
backward pass recomputes a group. So the analysis has one level per structure level: level 0 is what the forward
pass keeps, level l ≥ 1 is what one group (the largest) keeps while it is recomputed, with its own inputs left
out (level l−1 lists them). The row's ``bytes`` is their sum, the most saved values alive at once; rows whose
compiled temp differs by block policy then differ here too.

Literals. JAX lists a scalar literal the backward pass multiplies by (an attention scale, a dropout keep
probability, GeLU's constants) as a residual ``from a literal`` where the code runs inline, and not where it runs
under ``jax.jit`` (a constant of the backward pass there). Either way it is a constant of the compiled program, not
a buffer, so the report leaves literals out of every row; the analysis then gives the same rows whether a layer is
traced inline or once for all layers (:func:`jaxckpt.core._structure.shared_layer_traces`).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax

from jaxckpt.analysis._activations import parameter_only_bytes
from jaxckpt.analysis._jaxprs import outermost_remats, remat_body, remat_policy
from jaxckpt.core._structure import shared_layer_traces
from jaxckpt.nnx._layers import record_stack_inputs, shared_block_traces
from jaxckpt.analysis._residuals import Residual, group_residuals, recomputed_residuals, total_residual_bytes, traced_residuals
from jaxckpt.policies._spec import SAVE_TENSORS, PolicySpec
from jaxckpt.policies._model import LayeredPolicy
from jaxckpt.step._build import PolicyStep, dropout_key_struct

KERNEL_PRIMITIVES: tuple[str, ...] = ("pallas_call", "custom_call", "triton_kernel_call")
"""Primitives whose outputs a kernel makes inside itself (Pallas, custom calls): a residual among them without a
checkpoint name (the splash kernel names its own ``context``) is one no name policy can choose, and the dots
policies do not count it a matmul: kept whole when the kernel's region is not recomputed, dropped only by
recomputing the kernel."""

LITERAL = "from a literal"
"""JAX's description of a residual that is a literal (``jax._src.ad_checkpoint._saved_residuals``)."""


def _signature(eqn: Any) -> tuple:
  body = remat_body(eqn)
  body = getattr(body, "jaxpr", body)  # remat3 holds a closed jaxpr
  return tuple(str(v.aval) for v in body.invars), len(body.eqns), str(remat_policy(eqn))


def _group_sizes(stacks: list, depth: int) -> list[int | None]:
  """Blocks in the largest group at each level 1..depth, when one structured stack decides them (else ``None``)."""
  if len(stacks) != 1:
    return [None] * depth
  stack, sizes, n = stacks[0], [], stacks[0].num_layers
  for level in range(depth):
    n = max(size for _, size in stack.structure.groups(n, level))
    sizes.append(n)
  return sizes


def residual_levels(step: PolicyStep) -> list[tuple[str, list[Residual]]]:
  """The residuals of ``step``'s loss w.r.t. its params, one entry per checkpoint-structure level.

  Returns:
    ``[(description, residuals), ...]``: level 0 (the forward pass of the whole loss, arguments included), then,
    for a stack under ``every:K`` / ``nested[:D]``, one entry per group level: the largest group's
    :func:`jaxckpt.analysis._residuals.recomputed_residuals` without its arguments (the group inputs, listed by the level
    above). One entry for ``block`` structures and loss targets.
  """
  return _levels(step)[0]


def _levels(step: PolicyStep) -> tuple[list[tuple[str, list[Residual]]], int]:
  """:func:`residual_levels` and the bytes of level 0's parameter-only residuals (:mod:`jaxckpt.analysis._activations`)."""
  levels: list[tuple[str, list[Residual]]] = []
  param_only: list[int] = []

  def outer(batch, key):
    # batch and key are tracers of this outer trace: the inner vjp sees them as constants, not as inputs.
    loss = lambda params: step.loss_of_params(params, batch, key)  # noqa: E731
    with record_stack_inputs() as seen:
      traced = traced_residuals(loss, step.params)  # one vjp trace for both analyses
    top = [r for r in traced.residuals if r.description != LITERAL]  # constants, not buffers (module docstring)
    param_only.append(parameter_only_bytes(traced.jaxpr, traced.num_residuals))
    stacks = list({id(s): s for s, _ in seen}.values())
    depth = max((s.structure.levels - 1 for s in stacks), default=0)
    what = "loss w.r.t. params, layers unrolled"
    levels.append((what + (": the forward pass keeps the group inputs" if depth else ""), top))
    if not depth:
      return 0
    structured = [s for s in stacks if s.structure.levels > 1]
    jaxpr = jax.make_jaxpr(loss)(step.params)
    for level, size in enumerate(_group_sizes(structured, depth), start=1):
      candidates = list({_signature(e): e for e in outermost_remats(jaxpr)}.values())
      if not candidates:
        break
      analysed = [(eqn, [r for r in recomputed_residuals(eqn) if r.kind != "argument" and r.description != LITERAL])
                  for eqn in candidates]
      eqn, kept = max(analysed, key=lambda pair: total_residual_bytes(pair[1]))
      blocks = f" of {size} block(s)" if size is not None else ""
      levels.append((f"level {level}: one group{blocks} while the backward pass recomputes it", kept))
      jaxpr = remat_body(eqn)
    return 0

  # The unrolled layers' blocks traced once per (graph, policy), not once per layer, and the layers too (and their
  # parameter slices): one trace and linearization for the L layers.
  sharing = _layer_sharing(step.spec)
  layers = contextlib.nullcontext() if sharing is None else shared_layer_traces(layers=sharing)
  with shared_block_traces(), layers:
    jax.make_jaxpr(outer)(step.batch, dropout_key_struct())
  return levels, param_only[0]


def _layer_sharing(spec: Any) -> bool | None:
  """How the twin's unrolled layers share traces (:func:`jaxckpt.core._structure.shared_layer_traces`) under
  ``spec``: ``None`` not at all (a whole-loss plan), ``False`` the parameter slices only, ``True`` the layer calls
  too, where no block's policy tags values per module (a per-tensor plan's ``save_tensors``: each layer its own
  names), in a per-block spec or in every range of a layered one. Blocks without remat share too: a shared layer
  differs from inline code only in the literals, which the report leaves out (module docstring)."""
  specs = [s for _, s in spec.segments] if isinstance(spec, LayeredPolicy) else [spec]
  if not all(isinstance(s, PolicySpec) for s in specs):
    return None
  shared = lambda p: p.name != SAVE_TENSORS  # noqa: E731
  return all(shared(s.default) and all(shared(p) for _, p in s.blocks) for s in specs)


def residual_where(residual: Residual) -> str | None:
  """Where a residual was made, as the report names it: the line of your code (:attr:`Residual.site`), else JAX's
  source line; ``"file.py:line (function)"`` (the column left out: a row is a line)."""
  where = residual.site or residual.source
  return None if where is None else re.sub(r"^(.*?:\d+):\d+", r"\1", where)


def residual_groups(residuals: list[Residual]) -> list[dict[str, Any]]:
  """Groups residuals by checkpoint name, the unnamed ones by primitive and the line of your code that made them
  (:func:`residual_where`), else by kind; largest first. Each group's bytes are its own residuals' only.

  Returns:
    ``[{"key": "qkv" | "dot_general" | "argument" …, "by": "name" | "primitive" | "kind", "count", "bytes"}]``;
    a ``primitive`` group also has ``"site"``: ``"file.py:line (function)"`` or ``None``.
  """
  out = []
  for group in group_residuals(residuals, by="name"):
    if group.key is not None:
      out.append({"key": group.key, "by": "name", "count": group.count, "bytes": group.bytes})
      continue
    for sub in group_residuals(group.residuals, by="primitive"):
      if sub.key is None:
        for kind in group_residuals(sub.residuals, by="kind"):
          out.append({"key": kind.key, "by": "kind", "count": kind.count, "bytes": kind.bytes})
        continue
      sites: dict[str | None, list[Residual]] = {}
      for r in sub.residuals:
        sites.setdefault(residual_where(r), []).append(r)
      out.extend({"key": sub.key, "by": "primitive", "site": site, "count": len(rs),
                  "bytes": sum(r.bytes for r in rs)} for site, rs in sites.items())
  out.sort(key=lambda g: (-g["bytes"], g["key"] or "", g.get("site") or ""))
  return out


def analyse_residuals(step: PolicyStep) -> dict[str, Any]:
  """Lists and groups the residuals of ``step``'s loss w.r.t. its params, at every checkpoint-structure level.

  Args:
    step: from :func:`jaxckpt.step._build.policy_step`.

  Returns:
    ``{"count", "bytes", "in_kernel_bytes", "in_kernel_sources", "activation_bytes", "argument_bytes", "analysed",
    "levels", "groups", "by_source", "items"}``: ``in_kernel_bytes`` are the unnamed residuals a kernel makes inside
    itself (:data:`KERNEL_PRIMITIVES`), from ``in_kernel_sources``; ``bytes`` excludes arguments (the params are
    alive anyway; it is the row's ``residual_bytes``) and, under a structure, sums the levels (group inputs + what one group keeps while recomputed, see the module
    docstring); ``activation_bytes`` also excludes values that depend on the params only (per-layer parameter
    slices, :mod:`jaxckpt.analysis._activations`; the row's ``activation_residual_bytes``);
    ``argument_bytes`` is the arguments'; ``levels``: ``[{"level", "analysed", "count", "bytes"}]``, one per level
    (one for ``block``); ``groups`` from :func:`residual_groups`, over all levels; ``by_source``:
    ``[{"key": "file:line:col (fn)", "count", "bytes"}]``; ``items``: every residual ``{"level", "shape", "dtype",
    "bytes", "name", "kind", "primitive", "source", "site"}`` (``site``: the line of your code that made it). Bytes are an upper bound (XLA may fuse residuals away);
    compiled stats are the ground truth.
  """
  levels, param_only = _levels(step)
  tagged = [(level, r) for level, (_, residuals) in enumerate(levels) for r in residuals]
  residuals = [r for _, r in tagged]
  saved = [r for r in residuals if r.kind != "argument"]
  nbytes = total_residual_bytes(residuals, include_arguments=False)
  in_kernel = [r for r in saved if r.primitive in KERNEL_PRIMITIVES and r.name is None]
  return {
      "count": len(saved),
      "bytes": nbytes,
      "in_kernel_bytes": sum(r.bytes for r in in_kernel),
      "in_kernel_sources": sorted({r.source or "no source line" for r in in_kernel}),
      "activation_bytes": nbytes - param_only,
      "argument_bytes": sum(r.bytes for r in residuals if r.kind == "argument"),
      "analysed": levels[0][0] if len(levels) == 1 else "; ".join(text for text, _ in levels),
      "levels": [{"level": level, "analysed": text, "count": sum(r.kind != "argument" for r in rs),
                  "bytes": total_residual_bytes(rs, include_arguments=False)}
                 for level, (text, rs) in enumerate(levels)],
      "groups": residual_groups(residuals),
      "by_source": [{"key": g.key, "count": g.count, "bytes": g.bytes}
                    for g in group_residuals(saved, by="source")],
      "items": [{"level": level, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes, "name": r.name,
                 "kind": r.kind, "primitive": r.primitive, "source": r.source, "site": r.site}
                for level, r in tagged],
  }
