"""A per-tensor plan over the whole loss: one remat region around ``loss(params, batch, key)``, layers unrolled.

Per-block plans (:mod:`jaxckpt.planner._tensors`) keep every block's input (the region's arguments) and leave the
final LayerNorm, head and loss un-remat'd. PyTorch's AOTAutograd min-cut partitioner instead cuts the whole
forward/backward graph: it keeps no block inputs (the residual stream is rebuilt from saved sublayer outputs) and
little outside the layers. This module does the same in JAX: trace the whole loss to one jaxpr, build its
:class:`~jaxckpt.planner._tensors.BlockGraph` with the same code as a block's (parameter inputs marked, so
parameter-only values such as per-layer weight slices barely count), choose the saved set with the same exact 0-1
program (:func:`~jaxckpt.planner._tensors.solve_block`, scipy's ``milp``/HiGHS) under a byte or FLOPs cap, and apply
it as plain JAX: :func:`jaxckpt.core._tagging.tag_values` on the whole loss under
``jax.checkpoint(policy=save_only_these_names(*chosen))``. JAX's saved-residual analysis then lists exactly the
chosen values (plus the batch and dropout key, which every plan keeps).

This module holds the whole-loss trace and the one-region plan; cutting the loss into regions is
:mod:`jaxckpt.planner._segments`, and the segmented 0-1 program and the ``mincut:<cap>`` policy are
:mod:`jaxckpt.planner._segmented`.

One region does not lower compiled memory on XLA:CPU (JAX emits the whole region's recomputation ahead of its
backward pass, and the recomputed values live together), so the loss can also be **segmented**
(:func:`segment_loss`): cut at its narrowest points (the residual stream between blocks), each region traced on its
own, all regions' programs solved as one under a shared cap with each region input kept only when read
(:func:`segmented_plan`), and each region run under its own ``jax.checkpoint`` (:func:`remat_segments`): the policy
``mincut:<cap>`` (:func:`mincut_policy`, a :class:`~jaxckpt.policies.LossPolicy` the report and the planner compile).
On GPT ``small`` its plans equal the one-region plans' bytes and FLOPs at every torch point and compile to 200–338
MiB temp instead of 515–519 MiB.

References: Jain et al. 2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization" (the
integer program); Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (segments); PyTorch's AOTAutograd min-cut rematerialization partitioner (``torch._functorch.partitioners``,
``activation_memory_budget``), the plan this one is compared with (``benchmarks/pertensor_front.py``).

On GPT ``small`` (6 layers, 851 equations, 1181 values) the program has 2100 binaries × 1549 covering rows; HiGHS
solves most caps in 0.3–13 s on one CPU core and needs minutes to prove some optimal, hence a time limit per solve
(:data:`TIME_LIMIT`; the proven gap is kept).

Example::

    >>> from jaxckpt.step import shipped_target
    >>> from jaxckpt.planner._whole import target_whole_loss, whole_plan
    >>> plan = whole_plan(target_whole_loss(shipped_target("gpt", "tiny")), max_bytes=2 * 2**20)
    >>> loss, grads = jax.value_and_grad(plan.loss_fn)(params, batch, key)  # layers unrolled, one remat region
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxckpt.analysis._activations import parameter_only_bytes
from jaxckpt.analysis._flops import count_flops, count_live_flops
from jaxckpt.analysis._residuals import total_residual_bytes, traced_residuals
from jaxckpt.core._tagging import tag_values, walk_values
from jaxckpt.errors import JaxckptError
from jaxckpt.planner._tensors import (BlockGraph, TensorChoice, block_graph, solve_block)
from jaxckpt.policies._model import parse_model_policy
from jaxckpt.step._build import default_optimizer, policy_step
from jaxckpt.step._build import dropout_key_struct

WHOLE = "whole"
"""The ``block_type`` of the whole loss's graph and choices."""

TIME_LIMIT = 20.0
"""Seconds HiGHS may spend on each of a whole-loss plan's two solves by default (then the best set found is taken,
its proven gap in ``choice.mip_gap``). On GPT ``small`` most caps solve to optimality in 0.5–20 s, some take minutes
to prove (six identical layers: many symmetric optima)."""


@dataclasses.dataclass(frozen=True)
class WholeLoss:
  """A loss as one function of flat leaves, with its abstract arguments and traced jaxpr.

  Attributes:
    fn: ``(params, batch, key) -> scalar float32`` as given.
    params: pytree of ``jax.ShapeDtypeStruct`` (float leaves; differentiated).
    batch: pytree of ``jax.ShapeDtypeStruct`` (closed over by the backward pass, e.g. ``{"tokens": [B, T+1]
      int32}``).
    key: ``jax.ShapeDtypeStruct`` of a typed PRNG key (dropout), or ``None`` when ``fn`` takes none.
    closed: ``jax.make_jaxpr`` of :meth:`flat` over ``(*param_leaves, *batch_leaves, key)``.
    num_parameters: how many leading inputs of ``closed`` are parameter leaves.
  """

  fn: Callable[..., jax.Array]
  params: Any
  batch: Any
  key: Any
  closed: Any
  num_parameters: int

  def flat(self, *leaves: Any) -> jax.Array:
    """``fn`` of ``(*param_leaves, *batch_leaves[, key])``, the signature of :attr:`closed`."""
    p_tree = jax.tree.structure(self.params)
    b_tree = jax.tree.structure(self.batch)
    n, m = self.num_parameters, b_tree.num_leaves
    params = jax.tree.unflatten(p_tree, leaves[:n])
    batch = jax.tree.unflatten(b_tree, leaves[n:n + m])
    return self.fn(params, batch, leaves[n + m]) if self.key is not None else self.fn(params, batch)


def whole_loss(fn: Callable[..., jax.Array], params: Any, batch: Any, key: Any = None) -> WholeLoss:
  """Traces ``fn(params, batch[, key])`` once (abstract values only) for a whole-loss plan.

  Args:
    fn: the loss, ``(params, batch, key) -> scalar float32`` (or ``(params, batch)`` when ``key`` is ``None``),
      with layers unrolled (a ``scan`` over layers is one opaque equation to the plan).
    params: pytree of arrays or ``jax.ShapeDtypeStruct``, float leaves only.
    batch: pytree of arrays or ``jax.ShapeDtypeStruct`` (integer token ids, labels, ...).
    key: a typed PRNG key (or its ``ShapeDtypeStruct``), or ``None``.

  Returns:
    The :class:`WholeLoss`.

  Raises:
    JaxckptError: no parameter leaf, a non-float parameter leaf (the plan differentiates every parameter leaf), or
      ``fn`` does not return a float scalar.
  """
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  params, batch = jax.tree.map(shape, params), jax.tree.map(shape, batch)
  key = None if key is None else shape(key)
  bad = [(jax.tree_util.keystr(path), str(leaf.dtype)) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
         if not jnp.issubdtype(leaf.dtype, jnp.floating)]
  if bad:
    raise JaxckptError(f"params must have float leaves only (they are differentiated); got {bad[:3]}: pass integer "
                       "inputs in batch")
  if not jax.tree.leaves(params):
    raise JaxckptError(f"params has no array leaves (got {params!r}): a whole-loss plan differentiates w.r.t. them")
  loss = WholeLoss(fn, params, batch, key, None, len(jax.tree.leaves(params)))
  leaves = [*jax.tree.leaves(params), *jax.tree.leaves(batch)] + ([] if key is None else [key])
  closed = jax.make_jaxpr(loss.flat)(*leaves)
  outs = closed.out_avals
  if len(outs) != 1 or outs[0].shape != () or not jnp.issubdtype(outs[0].dtype, jnp.floating):
    got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs)
    raise JaxckptError(f"the loss must return one float scalar; got {got or 'nothing'}")
  return dataclasses.replace(loss, closed=closed)


def target_whole_loss(target: Any) -> WholeLoss:
  """The :class:`WholeLoss` of a target's train step: its loss w.r.t. the params, layers unrolled, no remat
  (:attr:`jaxckpt.step.PolicyStep.loss_of_params` under ``none``), dropout on.

  Args:
    target: a :class:`jaxckpt.step.ModelTarget` or :class:`jaxckpt.step.LossTarget`.

  Returns:
    The :class:`WholeLoss` of ``(params, batch, dropout_key) -> loss``.
  """
  step = policy_step(target, parse_model_policy("none"), default_optimizer())
  return whole_loss(step.loss_of_params, step.params, step.batch, dropout_key_struct())


def whole_graph(loss: WholeLoss) -> BlockGraph:
  """The min-cut graph of the whole loss (:func:`jaxckpt.planner._tensors.block_graph`, parameters marked).

  Args:
    loss: from :func:`whole_loss` or :func:`target_whole_loss`.

  Returns:
    A :class:`~jaxckpt.planner._tensors.BlockGraph` with ``block_type="whole"``; its ``parameter_only`` values are
    computed from the params alone, its ``fixed_bytes`` are the batch's and key's bytes (kept by every plan).
  """
  return block_graph(WHOLE, loss.closed, num_parameters=loss.num_parameters)


@dataclasses.dataclass(frozen=True)
class WholePlan:
  """A whole-loss per-tensor plan.

  Attributes:
    loss: the traced loss.
    graph: its graph.
    choice: the chosen saved set (``choice.names`` are automatic names, ``choice.activation_bytes`` the predicted
      saved activation bytes, ``choice.flops`` the predicted recomputed forward FLOPs).
  """

  loss: WholeLoss
  graph: BlockGraph
  choice: TensorChoice

  @property
  def loss_fn(self) -> Callable[..., jax.Array]:
    """``(params, batch[, key]) -> loss`` under one ``jax.checkpoint`` saving exactly ``choice.names``."""
    return remat_whole_loss(self.loss, self.choice.names)


def whole_plan(loss: WholeLoss, *, max_bytes: float | None = None, max_flops: float | None = None,
               minimise: str = "cost", graph: BlockGraph | None = None,
               time_limit: float | None = TIME_LIMIT) -> WholePlan:
  """The optimal saved set of the whole loss under a cap on saved activation bytes or on recomputed FLOPs.

  Args:
    loss: from :func:`whole_loss` or :func:`target_whole_loss`.
    max_bytes: cap on saved activation bytes (the chosen values that are not parameter-only, plus the batch and
      key); ``None``: no cap.
    max_flops: cap on recomputed forward FLOPs (transcendentals excluded); ``None``: no cap.
    minimise: ``"cost"`` (recompute cost, then bytes) or ``"bytes"`` (saved bytes, then cost; with ``max_flops``
      this is the least-memory plan at a given recompute).
    graph: :func:`whole_graph` of ``loss`` when already built (sweeps of caps reuse it).
    time_limit: seconds per HiGHS solve (:data:`TIME_LIMIT`; ``None``: until proven optimal).

  Returns:
    The :class:`WholePlan`.

  Raises:
    JaxckptError: a cap that is not a number or is NaN; ``max_bytes`` below what every plan keeps (the batch and
      key) or negative ``max_flops``; both caps given and no set meets both (the message gives the least bytes at
      that ``max_flops``); ``time_limit`` not ``None`` or > 0; an unknown ``minimise``; a ``graph`` that is not
      ``loss``'s.
  """
  check_caps(max_bytes=max_bytes, max_flops=max_flops, time_limit=time_limit)
  graph = whole_graph(loss) if graph is None else graph
  check_graph(loss, graph)
  if max_bytes is not None and max_bytes < graph.fixed_bytes:
    raise JaxckptError(f"max_bytes={max_bytes:g} is below the {graph.fixed_bytes} bytes every whole-loss plan keeps "
                       f"(its batch and key); give max_bytes ≥ {graph.fixed_bytes}")
  if max_flops is not None and max_flops < 0:
    raise JaxckptError(f"max_flops={max_flops:g} must be ≥ 0 (0: recompute nothing)")
  choice = solve_block(graph, max_bytes=max_bytes, max_flops=max_flops, minimise=minimise, time_limit=time_limit)
  if choice is None:  # both caps (saving nothing / everything meets either alone), or no set found in time_limit
    if max_bytes is None or max_flops is None:
      raise JaxckptError(f"HiGHS found no whole-loss plan within time_limit={time_limit} s (max_bytes={max_bytes}, "
                         f"max_flops={max_flops}): give a longer time_limit, or None")
    least = solve_block(graph, max_flops=max_flops, minimise="bytes", time_limit=time_limit)
    hint = "" if least is None else f"; the least saved bytes at max_flops={max_flops:g} is {least.activation_bytes}"
    raise JaxckptError(f"no whole-loss plan meets both max_bytes={max_bytes:g} and max_flops={max_flops:g}{hint}: "
                       "raise one cap or give one only")
  return WholePlan(loss, graph, choice)


def check_caps(**caps: Any) -> None:
  """Raises :class:`JaxckptError` for a cap that is not a number (or ``None``), is NaN, or a ``time_limit`` ≤ 0."""
  for name, cap in caps.items():
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real) or math.isnan(cap)):
      raise JaxckptError(f"{name}={cap!r} must be a number (or None: no limit)")
  if caps.get("time_limit") is not None and caps["time_limit"] <= 0:
    raise JaxckptError(f"time_limit={caps['time_limit']:g} must be > 0 seconds (None: solve until proven optimal)")


def check_graph(loss: WholeLoss, graph: BlockGraph) -> None:
  """Raises :class:`JaxckptError` when ``graph`` is not ``loss``'s (another loss's graph gives names that tag
  nothing in this one: a silent no-op plan)."""
  ours = [(v.name, v.shape) for v in walk_values(loss.closed)]
  if graph.block_type != WHOLE or [(v.name, v.shape) for v in graph.values] != ours:
    raise JaxckptError(f"graph is not this loss's (block_type {graph.block_type!r}, {len(graph.values)} values; the "
                       f"loss has {len(ours)}): pass whole_graph(loss) or omit graph")


def remat_whole_loss(loss: WholeLoss, names: Sequence[str]) -> Callable[..., jax.Array]:
  """``loss.fn`` under one ``jax.checkpoint`` that saves exactly the values named (automatic names).

  Args:
    loss: from :func:`whole_loss`.
    names: automatic names (:func:`jaxckpt.core._tagging.value_name`), e.g. a :class:`WholePlan`'s ``choice.names``.

  Returns:
    ``(params, batch[, key]) -> scalar``: plain JAX (``tag_values`` + ``save_only_these_names``); gradients equal
    ``loss.fn``'s.

  Raises:
    JaxckptError: ``names`` is a string, or a name that is not the automatic name of one of the loss's values (it
      would tag nothing and save nothing: the message lists a few valid names).
  """
  if isinstance(names, str):
    raise JaxckptError(f"names must be a sequence of automatic names, not the string {names!r}")
  valid = {v.name for v in walk_values(loss.closed)}
  unknown = [n for n in names if n not in valid]
  if unknown:
    some = ", ".join(v.name for v in walk_values(loss.closed)[:4])
    raise JaxckptError(f"{unknown[:5]} name no value of this loss ({len(valid)} values; valid names look like "
                       f"{some}, …: use a WholePlan's choice.names or whole_graph(loss).values)")
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  inner = jax.checkpoint(tag_values(loss.flat, names), policy=policy)

  def remat_loss(params, batch, *key):
    return inner(*jax.tree.leaves(params), *jax.tree.leaves(batch), *key)

  return remat_loss


@dataclasses.dataclass(frozen=True)
class WholeMeasure:
  """What a loss (remat'd or not) saves and computes, measured from traces (nothing compiled or run).

  Attributes:
    activation_residual_bytes: JAX's saved residuals w.r.t. the params, arguments and parameter-only values
      excluded (as the report's ``activation_residual_bytes``), bytes.
    residual_bytes: the same with parameter-only values, bytes.
    flops: FLOPs of ``jax.value_and_grad`` of the loss w.r.t. the params (forward + backward, all ops,
      :func:`jaxckpt.count_flops`; transcendentals excluded).
    saved_names: the checkpoint names among the residuals.
    live_flops: the same after dead-code elimination (:func:`jaxckpt.count_live_flops`: what XLA runs; without
      remat the backward's jaxpr has dead code that a remat'd one does not).
  """

  activation_residual_bytes: int
  residual_bytes: int
  flops: int
  saved_names: frozenset[str]
  live_flops: int


def measure_whole(loss: WholeLoss, fn: Callable[..., jax.Array] | None = None) -> WholeMeasure:
  """Measures ``fn`` (default ``loss.fn``, no remat), a function with ``loss.fn``'s signature.

  Args:
    loss: gives the abstract arguments.
    fn: e.g. :attr:`WholePlan.loss_fn`.

  Returns:
    The :class:`WholeMeasure`.
  """
  fn = loss.fn if fn is None else fn
  key = () if loss.key is None else (loss.key,)
  found = {}

  def outer(batch, *k):  # batch and key closed over by the vjp, as in the train step's residual analysis
    traced = traced_residuals(lambda p: fn(p, batch, *k), loss.params)
    found["bytes"] = total_residual_bytes(traced.residuals, include_arguments=False)
    found["param_only"] = parameter_only_bytes(traced.jaxpr, traced.num_residuals)
    found["names"] = frozenset(r.name for r in traced.residuals if r.kind == "checkpoint_name")
    return 0

  jax.make_jaxpr(outer)(loss.batch, *key)
  grad = lambda p, b, *k: jax.value_and_grad(fn)(p, b, *k)  # noqa: E731
  flops = count_flops(grad, loss.params, loss.batch, *key).total
  live = count_live_flops(grad, loss.params, loss.batch, *key).total
  return WholeMeasure(found["bytes"] - found["param_only"], found["bytes"], flops, found["names"], live)


# --- Segmented plans: the whole-loss program, applied one region at a time ---------------------------------------
