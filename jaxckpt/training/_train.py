"""Functional train and eval steps over ``nnx.split`` state, compiled with jaxckpt's remat compiler options.

``nnx.jit`` takes no ``compiler_options``, so the steps are pure functions of a :class:`TrainState` pytree (the
model's graphdef is closed over) and are compiled with :func:`jaxckpt.compile_step` (which disables XLA:CPU's
``cse_barrier_expander`` so remat of unrolled layers saves memory). The state is donated: the step updates it in place.

Determinism: the dropout key of step ``s`` is ``fold_in(state.key, s)``, so a run resumed from a checkpoint draws the
same masks as an uninterrupted one.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxckpt.errors import JaxckptError
from jaxckpt.sharding._mesh import BATCH_AXES
from jaxckpt.training._xla import compile_step, watch_remat

Batch = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
"""``loss_fn(model, batch, *, dropout_key, deterministic) -> (scalar loss float32, {metric: scalar})``."""


@struct.dataclass
class TrainState:
  """Everything a train step reads and writes; a pytree (orbax saves and restores it whole).

  Attributes:
    step: int32 scalar, optimizer steps taken.
    params: the model's ``nnx.Param`` state (float32).
    other: the model's non-parameter state (e.g. batch statistics); empty for jaxckpt's models.
    opt_state: the optax optimizer state.
    key: base PRNG key (typed); step ``s`` uses ``jax.random.fold_in(key, s)`` for dropout.
  """

  step: jax.Array
  params: nnx.State
  other: nnx.State
  opt_state: optax.OptState
  key: jax.Array


def create_train_state(model: nnx.Module, tx: optax.GradientTransformation, *, seed: int) -> tuple[nnx.GraphDef, TrainState]:
  """Splits a model into its graphdef and a fresh :class:`TrainState`.

  Args:
    model: the NNX model (may be abstract, from ``nnx.eval_shape``, under ``jax.eval_shape``).
    tx: the optax optimizer.
    seed: seed of the dropout key.

  Returns:
    ``(graphdef, state)``; rebuild the model with ``nnx.merge(graphdef, state.params, state.other)``.
  """
  graphdef, params, other = nnx.split(model, nnx.Param, ...)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, other=other, opt_state=tx.init(params), key=jax.random.key(seed)
  )
  return graphdef, state


def abstract_train_state(
    make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, *, seed: int = 0
) -> tuple[nnx.GraphDef, TrainState]:
  """Like :func:`create_train_state` but without allocating: the state's leaves are ``jax.ShapeDtypeStruct``s.

  Args:
    make_model: ``() -> model``, run under ``nnx.eval_shape``.
    tx: the optax optimizer.
    seed: seed of the dropout key.

  Returns:
    ``(graphdef, abstract_state)``, ready for :func:`compile_train_step` (compiled stats without allocation).
  """
  return abstract_state_of(nnx.eval_shape(make_model), tx, seed=seed)


def abstract_state_of(model: nnx.Module, tx: optax.GradientTransformation, *, seed: int = 0
                      ) -> tuple[nnx.GraphDef, TrainState]:
  """:func:`abstract_train_state` of a model that exists already (abstract from ``nnx.eval_shape``, or real).

  Args:
    model: the NNX model; only its graph and shapes are read.
    tx: the optax optimizer.
    seed: seed of the dropout key.

  Returns:
    ``(graphdef, abstract_state)``: leaves are ``jax.ShapeDtypeStruct`` s.
  """
  graphdef, params, other = nnx.split(model, nnx.Param, ...)
  state = jax.eval_shape(
      lambda p, o: TrainState(
          step=jnp.zeros((), jnp.int32), params=p, other=o, opt_state=tx.init(p), key=jax.random.key(seed)
      ),
      params,
      other,
  )
  return graphdef, state


def _takes_jaxckpt_keywords(loss_fn: Callable) -> bool:
  try:
    params = inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):  # builtins / C callables: assume jaxckpt's form
    return True
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return True
  return "dropout_key" in params and "deterministic" in params


def plain_loss_fn(loss_fn: Callable[..., Any]) -> LossFn:
  """Turns a plain ``loss_fn(model, batch) -> scalar`` (or ``-> (scalar, {metric: scalar})``) into jaxckpt's
  :data:`~jaxckpt.training._train.LossFn` form; a loss already in that form (taking ``dropout_key`` and ``deterministic``
  keywords) is returned unchanged.

  The plain loss draws dropout from the model's own ``nnx.Rngs`` (whose state is part of the train state, so every
  step draws new masks); ``dropout_key`` and ``deterministic`` are ignored.

  Args:
    loss_fn: the user's loss.

  Returns:
    ``loss(model, batch, *, dropout_key, deterministic) -> (loss, {"loss": loss, ...metrics})``.
  """
  if _takes_jaxckpt_keywords(loss_fn):
    return loss_fn

  def loss(model, batch, *, dropout_key=None, deterministic=False):
    del dropout_key, deterministic  # the model's own Rngs and flags decide
    out = loss_fn(model, batch)
    value, metrics = out if isinstance(out, tuple) else (out, {})
    return value, {"loss": value, **dict(metrics)}

  loss.plain = loss_fn  # type: ignore[attr-defined]
  loss.__name__ = getattr(loss_fn, "__name__", "loss")
  return loss



def micro_batches(batch: jax.Array, steps: int) -> jax.Array:
  """``batch`` ``[B, ...]`` as ``steps`` micro-batches ``[steps, B / steps, ...]``, micro-batch ``i`` being rows
  ``i, i + steps, i + 2·steps, ...``: every device's shard of a batch split over a mesh's batch axes gives each
  micro-batch the same share, so each micro-batch spans every device as the step it replaces does (MaxText's
  ``reshape_to_microbatch_accumulations``). A plain ``reshape(steps, B / steps)`` would put micro-batch ``i`` on the
  ``i``-th ``1/steps`` of the devices, and XLA would run each micro-step on those alone: ``steps`` × the activations
  per device. Under a mesh in context (``jax.set_mesh``, the step core's), the micro-batches are constrained to the
  batch axes.

  Args:
    batch: ``[B, ...]``, ``B`` divisible by ``steps`` (and ``B / steps`` by the batch axes' devices).
    steps: micro-batches, ≥ 1.

  Returns:
    ``[steps, B / steps, ...]``, same dtype.
  """
  rows = batch.shape[0] // steps
  micro = jnp.swapaxes(batch.reshape(rows, steps, *batch.shape[1:]), 0, 1)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return micro
  shape = {str(k): int(v) for k, v in mesh.shape.items()}
  axes = tuple(a for a in BATCH_AXES if shape.get(a, 1) > 1)
  if not axes or rows % math.prod(shape[a] for a in axes):
    return micro
  spec = jax.sharding.PartitionSpec(None, axes if len(axes) > 1 else axes[0])
  return jax.lax.with_sharding_constraint(micro, jax.sharding.NamedSharding(mesh, spec))


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    skip_nonfinite: bool = False,
    grad_accum_steps: int = 1,
    metrics: bool = True,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """Builds ``step(state, batch) -> (new_state, metrics)``: value_and_grad of ``loss_fn`` and one optimizer update.

  Args:
    graphdef: the model's graphdef (static; it carries the policy spec).
    tx: the optax optimizer.
    loss_fn: see :data:`LossFn`; or a plain ``loss_fn(model, batch) -> scalar`` (or ``(scalar, metrics)``), the form
      :class:`jaxckpt.step.ModelTarget` takes, adapted by :func:`plain_loss_fn` (dropout then comes from the model's
      own ``nnx.Rngs``, which the train state carries).
    skip_nonfinite: when the loss, a gradient or an updated parameter is NaN/Inf, keep the parameters and optimizer
      state unchanged (the step counter still advances, so the next step sees the next batch). ``metrics["finite"]``
      (bool) tells.
    grad_accum_steps: split each batch into this many micro-batches along axis 0 (:func:`micro_batches`: rows
      ``i, i + k, ...``, so each spans every device of a sharded batch) and ``lax.scan`` over them, averaging
      gradients before one optimizer update: the step's activations are those of one micro-batch (the other memory
      lever besides remat). Micro-batch i uses dropout key ``fold_in(step_key, i)``; metrics are means over
      micro-batches. The batch size must be divisible by it.
    metrics: return the loss function's metrics and ``finite`` (bool: the loss, every gradient element and every
      updated parameter are finite; a training loop reads it). ``False`` returns ``{"loss": loss}`` only (and
      ``finite`` when ``skip_nonfinite``): the plain step, the same program as ``jax.value_and_grad`` + ``optax``
      written by hand. The memory report compiles that one: the gradient half of the ``finite`` check alone (one
      reduction per gradient leaf) cost XLA:CPU ≈0.3 s of compile CPU per GPT-2-small program.

  Returns:
    A pure function, to be compiled with :func:`compile_train_step` (or :func:`jaxckpt.jit`, donating the state).
    Traced under ``nnx.jit`` or a plain ``jax.jit`` on CPU, a remat'd model's step warns once
    (:class:`jaxckpt.RematIneffectiveWarning`): remat of unrolled layers saves nothing there without jaxckpt's
    compiler option.

  Raises:
    JaxckptError: ``grad_accum_steps`` not an int ≥ 1, ``skip_nonfinite`` or ``metrics`` not a bool (a string such
      as ``"false"`` would be truthy), or (when traced) a batch size ``grad_accum_steps`` does not divide.
  """
  for name, flag in (("skip_nonfinite", skip_nonfinite), ("metrics", metrics)):
    if not isinstance(flag, (bool, np.bool_)):
      raise JaxckptError(f"{name}={flag!r} must be True or False")
  if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, numbers.Integral) or grad_accum_steps < 1:
    raise JaxckptError(f"grad_accum_steps must be an int ≥ 1, got {grad_accum_steps!r}")
  loss_fn = plain_loss_fn(loss_fn)

  def grad_fn(params, other, batch, dropout_key):
    def loss(params):
      model = nnx.merge(graphdef, params, other, copy=True)  # copies: the step updates non-param state
      value, metrics = loss_fn(model, batch, dropout_key=dropout_key, deterministic=False)
      return value, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

    (value, (metrics, other)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, metrics, other, grads

  def accumulated(params, other, batch, dropout_key):
    sizes = {a.shape[0] for a in jax.tree.leaves(batch)}
    if any(size % grad_accum_steps for size in sizes):
      raise JaxckptError(f"batch size {sorted(sizes)} is not divisible by grad_accum_steps={grad_accum_steps}")
    micro = jax.tree.map(lambda a: micro_batches(a, grad_accum_steps), batch)

    def body(carry, xs):
      other, total = carry
      i, micro_batch = xs
      value, metrics, other, grads = grad_fn(params, other, micro_batch, jax.random.fold_in(dropout_key, i))
      total = jax.tree.map(jnp.add, total, (value, metrics, grads))
      return (other, total), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, other, jax.tree.map(lambda a: a[0], micro),
                                                         dropout_key))
    (other, total), _ = jax.lax.scan(body, (other, (zeros[0], zeros[1], zeros[3])),
                                     (jnp.arange(grad_accum_steps), micro))
    value, metrics, grads = jax.tree.map(lambda t: t / grad_accum_steps, total)
    return value, metrics, other, grads

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    dropout_key = jax.random.fold_in(state.key, state.step)
    compute = grad_fn if grad_accum_steps == 1 else accumulated
    with watch_remat():  # warns once when jitted on CPU without jaxckpt's remat option (nnx.jit, plain jax.jit)
      value, step_metrics, other, grads = compute(state.params, state.other, batch, dropout_key)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    out = {**step_metrics} if metrics else {"loss": value}
    if metrics or skip_nonfinite:
      # The updated parameters too: finite gradients can still overflow a parameter (a huge learning rate), and every
      # later step would then be non-finite while the broken update stayed applied.
      checked = [value, *jax.tree.leaves(grads), *jax.tree.leaves(params)]
      finite = jnp.all(jnp.array([jnp.isfinite(a).all() for a in checked]))
      out["finite"] = finite
    if skip_nonfinite:
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
      params, opt_state, other = keep(params, state.params), keep(opt_state, state.opt_state), keep(other, state.other)
    new_state = state.replace(step=state.step + 1, params=params, other=other, opt_state=opt_state)
    return new_state, out

  return step


def make_eval_step(
    graphdef: nnx.GraphDef, loss_fn: LossFn
) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
  """Builds ``eval_step(state, batch) -> metrics`` with dropout off (pad the last batch and mask it); ``loss_fn`` as
  :func:`make_train_step` takes it (a plain ``loss_fn(model, batch)`` too)."""
  loss_fn = plain_loss_fn(loss_fn)

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, state.params, state.other)
    return loss_fn(model, batch, dropout_key=None, deterministic=True)[1]

  return eval_step


def compile_train_step(step: Callable, state: Any, batch: Any, **kwargs) -> jax.stages.Compiled:
  """Compiles a train step with the state donated and jaxckpt's remat compiler options.

  Args:
    step: from :func:`make_train_step`.
    state: a :class:`TrainState` or its ``jax.ShapeDtypeStruct`` tree (nothing is allocated).
    batch: a batch or its ``jax.ShapeDtypeStruct`` tree; the compiled step only takes this shape.
    **kwargs: passed to :func:`jaxckpt.compile_step`.

  Returns:
    The compiled step; ``compiled(state, batch)`` runs it (``state`` is donated: do not reuse it).
  """
  return compile_step(step, state, batch, donate_argnums=0, **kwargs)
