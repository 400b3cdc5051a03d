"""Per-layer candidate policies of a budget plan, each with its saved bytes and recompute FLOPs, measured by JAX.

One layer of the model's :class:`~jaxckpt.Stack` (the scan body) is traced on its real input shape, under each
candidate spec:

- **saved bytes**: JAX's saved-residual analysis (:func:`jaxckpt.analysis._residuals.saved_residuals`) of the layer w.r.t. its
  parameters and input, arguments excluded (the scan keeps each layer's input anyway);
- **FLOPs**: :func:`jaxckpt.analysis._flops.count_live_flops` (dead code dropped) of the layer's forward + backward
  (``jax.vjp``: its output and its pullback), so the recomputation of a remat'd block is counted; *recompute FLOPs*
  are those minus the ``none`` candidate's.

The candidate space per block type is ``none``, ``full`` (``nothing_saveable``), ``dots_saveable``,
``dots_with_no_batch_dims_saveable`` and ``save_only_these_names:S`` for every non-empty subset S of the names that
block emits (pairs at most when it emits more than :data:`MAX_SUBSET_NAMES`), plus, when given, per-tensor options
``save_tensors:…``: the block's min-cut front over *all* its intermediates (:mod:`jaxckpt.planner._tensors`). A layer
candidate picks one option per block type. Measuring every combination would take one trace each, so it is done in two stages: each block
type's options are measured with the other block types at ``full`` and combined additively; then the uniform
(built-in) combinations and those on that estimate's Pareto front that leave a block without remat (``none``) are
traced as whole layers; the front's other combinations keep their sum (``exact=False``): blocks that are each remat'd
are independent given their inputs, and a test checks the sum equals the whole-layer trace. The same list is what the
solver and the tests' exhaustive search see.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.analysis._flops import count_live_flops
from jaxckpt.nnx._layers import Stack, remat_blocks
from jaxckpt.policies._spec import SAVE_TENSORS, Policy, PolicySpec
from jaxckpt.analysis._residuals import saved_residuals

MAX_SUBSET_NAMES = 5
"""Block types emitting at most this many checkpoint names get every subset as a candidate; more get singletons and
pairs only (the subset count grows as 2^n)."""

_FIXED_OPTIONS = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclasses.dataclass(frozen=True)
class LayerCandidate:
  """One layer's policy spec and what it costs.

  Attributes:
    spec: the per-block-type spec of the layer.
    saved_bytes: bytes one layer saves for the backward pass (residuals, arguments excluded).
    flops: FLOPs of one layer's forward + backward pass (recomputation included).
    recompute_flops: ``flops`` minus the ``none`` candidate's (≥ 0 up to counting noise).
    exact: measured as a whole layer (``True``) or the sum of per-block measurements (``False``; equal to the
      whole-layer figure when every block is remat'd, see the module docstring).
  """

  spec: PolicySpec
  saved_bytes: int
  flops: int
  recompute_flops: int
  exact: bool = True

  @property
  def saved_names(self) -> dict[str, tuple[str, ...]]:
    """Block type -> the checkpoint names its policy saves (``save_only_these_names``), for explaining a plan."""
    pairs = self.spec.blocks or (("*", self.spec.default),)
    return {block: policy.names for block, policy in pairs if policy.name == "save_only_these_names"}


def block_options(names: Sequence[str]) -> list[Policy]:
  """The candidate policies of one block type that emits ``names``.

  Returns:
    ``none``, ``nothing_saveable``, ``dots_saveable``, ``dots_with_no_batch_dims_saveable``, then
    ``save_only_these_names:S`` for each non-empty subset S (sizes ≤ 2 when ``len(names)`` >
    :data:`MAX_SUBSET_NAMES`), in a fixed order.
  """
  names = sorted(names)
  sizes = range(1, len(names) + 1) if len(names) <= MAX_SUBSET_NAMES else range(1, 3)
  subsets = [combo for k in sizes for combo in itertools.combinations(names, k)]
  return [Policy(name) for name in _FIXED_OPTIONS] + [Policy("save_only_these_names", s) for s in subsets]


def _spec(pairs: Sequence[tuple[str, Policy]]) -> PolicySpec:
  """A layer spec from (block type, policy) pairs; one policy for every block type is written as that policy."""
  policies = {p for _, p in pairs}
  return PolicySpec(default=policies.pop()) if len(policies) == 1 else PolicySpec(blocks=tuple(pairs))


def _uniform(policy: Policy, blocks: Sequence[str]) -> PolicySpec:
  return _spec([(b, policy) for b in blocks])


@dataclasses.dataclass
class LayerProbe:
  """Traces one layer of a stack under a spec and measures it (see the module docstring).

  Args:
    stack: the model's :class:`~jaxckpt.Stack` (abstract, from ``nnx.eval_shape``, is enough).
    x: the stack's input, a ``jax.ShapeDtypeStruct`` (e.g. ``[B, T, D] float32``).
    dropout: run the layer with dropout on (as the train step does), its key an argument.
  """

  stack: Stack
  x: jax.ShapeDtypeStruct
  dropout: bool = True

  def __post_init__(self):
    graphdef, params, other = nnx.split(self.stack.layers, nnx.Param, ...)
    one = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731 - drop the layer axis
    self._graphdef = graphdef
    self._params = jax.tree.map(one, params)
    self._other = jax.tree.map(one, other)
    self.traces = 0

  def measure(self, spec: PolicySpec) -> tuple[int, int]:
    """``(saved_bytes, flops)`` of one layer under ``spec`` (bytes, FLOPs of forward + backward)."""
    found: dict[str, int] = {}
    graphdef = self._graphdef

    def outer(other, key):
      # other and key are tracers of this trace: the inner analyses see them as constants, not inputs.
      def layer(params, x):
        block = nnx.merge(graphdef, params, other, copy=True)
        for sub in remat_blocks(block):
          sub.policy = spec
        return block(x, dropout_key=key if self.dropout else None, deterministic=not self.dropout)

      residuals = saved_residuals(layer, self._params, self.x)
      found["bytes"] = sum(r.bytes for r in residuals if r.kind != "argument")
      found["residuals"] = residuals
      def forward_backward(p, x, ct):
        out, pullback = jax.vjp(layer, p, x)
        return out, pullback(ct)  # the output too: in the step the next layer reads it, so its forward is live

      # dead code dropped, as XLA drops it: without the output, the forward ops that only feed it would be dead
      # in `none` but recomputed under remat, and remat'd candidates would look cheaper than in the step
      found["flops"] = count_live_flops(forward_backward, self._params, self.x, self.x).total
      return 0

    key = jax.eval_shape(lambda: jax.random.key(0))
    jax.make_jaxpr(outer)(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._other), key)
    self.traces += 1
    self.last_residuals = found["residuals"]
    return found["bytes"], found["flops"]


def pareto_front(candidates: Sequence[LayerCandidate]) -> list[LayerCandidate]:
  """The candidates no other beats on both saved bytes and recompute FLOPs, by increasing bytes.

  Ties on both keep the first given (so uniform built-ins, listed first, win).
  """
  front: list[LayerCandidate] = []
  for cand in sorted(candidates, key=lambda c: (c.saved_bytes, c.recompute_flops)):
    if not front or cand.recompute_flops < front[-1].recompute_flops:
      front.append(cand)
  return front


def _check_saved(probe: LayerProbe, policy: Policy, block: str) -> None:
  """A ``save_tensors`` option must save nothing but its values (JAX's saved-residual analysis of the layer).

  JAX may save fewer: a value the program counted as read by the backward pass that JAX's partial evaluation
  rebuilds without it (seen for the uniform-sampling constants of a dropout mask); the measured bytes are JAX's.
  """
  if policy.name != SAVE_TENSORS:
    return
  saved = {r.name for r in probe.last_residuals if r.kind == "checkpoint_name"}
  if not saved <= set(policy.names):
    raise JaxckptError(
        f"per-tensor option {policy} of block {block!r} saves {sorted(saved)} by JAX's analysis, not the chosen "
        f"{sorted(policy.names)}: the block traced differently from when it was planned")


def layer_candidates(probe: LayerProbe, block_types: Mapping[str, Sequence[str]],
                     tensor_options: Mapping[str, Sequence[Policy]] | None = None) -> list[LayerCandidate]:
  """Measures the layer candidates of a stack (two stages, see the module docstring).

  Args:
    probe: the :class:`LayerProbe` of the stack.
    block_types: block type -> checkpoint names it emits (:func:`jaxckpt.block_types` of the model).
    tensor_options: block type -> extra ``save_tensors`` policies (per-tensor min-cut choices,
      :mod:`jaxckpt.planner._tensors`); each is checked to save exactly its values.

  Raises:
    JaxckptError: a ``save_tensors`` option whose saved residuals differ from its chosen values.

  Returns:
    Exactly measured candidates: every uniform built-in (``none``, ``full``, the dots policies) and every
    combination on the estimated Pareto front, uniform ones first, no two with the same spec.
  """
  blocks = sorted(block_types)
  options = {b: block_options(block_types[b]) + list((tensor_options or {}).get(b, ())) for b in blocks}
  full = Policy("nothing_saveable")
  base_bytes, base_flops = probe.measure(_uniform(full, blocks))
  none_bytes, none_flops = probe.measure(_uniform(Policy("none"), blocks))
  # Stage 1: each block type's options, the others at full; combinations add their deltas.
  delta: dict[str, list[tuple[Policy, int, int]]] = {}
  for b in blocks:
    delta[b] = []
    for policy in options[b]:
      spec = _spec([(o, policy if o == b else full) for o in blocks])
      if policy == full:
        nbytes, flops = base_bytes, base_flops
      else:
        nbytes, flops = probe.measure(spec)
        _check_saved(probe, policy, b)
      delta[b].append((policy, nbytes - base_bytes, flops - base_flops))
  estimates = []
  for combo in itertools.product(*(delta[b] for b in blocks)):
    spec = _spec(list(zip(blocks, (c[0] for c in combo))))
    nbytes = base_bytes + sum(c[1] for c in combo)
    flops = base_flops + sum(c[2] for c in combo)
    estimates.append(LayerCandidate(spec, nbytes, flops, flops - none_flops, exact=False))
  # Stage 2: the uniform built-ins and the front's combinations with a `none` block are traced as whole layers; the
  # other combinations on the front keep their sum: blocks that are each remat'd are independent given their inputs
  # (tests/planner/test_budget_plans.py checks sum = whole-layer trace), and tracing them all took half the planning
  # time.
  uniform = [_uniform(Policy(name), blocks) for name in _FIXED_OPTIONS]
  front = [c for c in pareto_front(estimates) if c.spec not in uniform]
  measured = []
  for cand in [LayerCandidate(spec, 0, 0, 0) for spec in uniform] + front:
    spec = cand.spec
    if spec == uniform[0]:
      nbytes, flops = none_bytes, none_flops
    elif spec == _uniform(full, blocks):
      nbytes, flops = base_bytes, base_flops
    elif spec in uniform or any(p.name == "none" for _, p in (spec.blocks or (("*", spec.default),))):
      nbytes, flops = probe.measure(spec)
    else:
      measured.append(cand)  # the sum of its blocks' measurements, exact=False
      continue
    measured.append(LayerCandidate(spec, nbytes, flops, flops - none_flops))
  return measured


def candidate_table(candidates: Sequence[LayerCandidate], front: Sequence[LayerCandidate]) -> list[dict[str, Any]]:
  """Rows for ``--explain``: ``{"spec", "saved_bytes", "recompute_flops", "pareto"}`` per candidate, by bytes."""
  on_front = {str(c.spec) for c in front}
  return [{"spec": str(c.spec), "saved_bytes": c.saved_bytes, "recompute_flops": c.recompute_flops,
           "pareto": str(c.spec) in on_front}
          for c in sorted(candidates, key=lambda c: (c.saved_bytes, c.recompute_flops))]
