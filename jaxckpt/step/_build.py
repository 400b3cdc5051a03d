"""The train step of a target under one policy: abstract inputs for compiling, concrete ones for measuring.

The step is the training step a user writes: ``jax.value_and_grad`` of the loss w.r.t. the params and one
``optax.adamw`` update, with the state donated (:func:`jaxckpt.make_train_step` for model targets; with the loss
function's metrics and the ``finite`` flag when the target asks, as the experiments do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.nnx._apply import applied_blocks, learn_names, loss_block_types
from jaxckpt.analysis._jaxprs import count_remat_regions, emitted_checkpoint_names, iter_eqns
from jaxckpt.nnx._layers import block_types, set_policy, stacks
from jaxckpt.errors import JaxckptError, TracingError, raised_at
from jaxckpt.policies._model import LayeredPolicy, LossPolicy
from jaxckpt.policies._spec import PolicySpec
from jaxckpt.sharding._tensor_plan import leading_layer_axes
from jaxckpt.step._targets import LossTarget, ModelTarget, Target
from jaxckpt.training._train import abstract_state_of, create_train_state, make_train_step


def default_optimizer() -> optax.GradientTransformation:
  """``optax.adamw(1e-3)``: the optimizer of the report's train step (its state is part of the footprint)."""
  return optax.adamw(1e-3)


@dataclasses.dataclass(frozen=True)
class PolicyStep:
  """One target's train step under one policy.

  Attributes:
    spec: the validated policy: a :class:`~jaxckpt.PolicySpec`, a :class:`~jaxckpt.policies.LayeredPolicy`, or a
      :class:`~jaxckpt.policies.LossPolicy` (a whole-loss plan, whose ``loss_fn`` the step differentiates).
    step: ``step(state, batch) -> (state, metrics)``; compile with the state (argument 0) donated.
    state: the state as a pytree of ``jax.ShapeDtypeStruct``.
    batch: the batch as a pytree of ``jax.ShapeDtypeStruct``.
    loss_of_params: ``(params, batch, dropout_key) -> scalar loss`` with layers unrolled (same params): what the
      residual analysis differentiates w.r.t. ``params``.
    params: ``state``'s params (abstract).
  """

  spec: PolicySpec | LayeredPolicy | LossPolicy
  step: Callable[..., Any]
  state: Any
  batch: Any
  loss_of_params: Callable[..., jax.Array]
  params: Any


def _stand_in(leaf: Any) -> Any:
  """A value of an abstract leaf's shape and dtype (zeros; ``key(0)`` for PRNG keys); concrete leaves as they are."""
  if not isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return jax.random.split(jax.random.key(0), leaf.shape) if leaf.shape else jax.random.key(0)
  return jnp.zeros(leaf.shape, leaf.dtype)


def target_block_types(target: Target) -> dict[str, frozenset[str]]:
  """Block type -> checkpoint names its blocks emit (for validating specs and expanding ``all``).

  Raises:
    TracingError: building the model or tracing its loss raised (one line naming your file and line,
      :func:`jaxckpt.errors.raised_at`).
  """
  try:
    if isinstance(target, ModelTarget):
      own = loss_block_types(target.make_model, target.loss_fn, target.batch)  # your own blocks: traced names too
      return {**block_types(nnx.eval_shape(target.make_model)), **own}
    if target.block_types is not None:
      return {k: frozenset(v) for k, v in target.block_types.items()}
    loss = lambda p, b: target.loss(p, b, policy=PolicySpec())  # noqa: E731
    return {"default": emitted_checkpoint_names(loss, target.params, target.batch)}
  except JaxckptError:
    raise
  except Exception as err:  # noqa: BLE001 - your model raised while traced: one line, not a traceback
    raise TracingError(f"tracing the loss of {target.name} failed: {raised_at(err)}") from err


def stacked_blocks(model: nnx.Module) -> bool:
  """Whether a block of your own model (one :func:`jaxckpt.apply_remat` matched) holds its parameters stacked on a
  leading layer axis, as ``nnx.vmap`` makes a stack that ``nnx.scan`` runs: an ``nnx.Linear`` kernel ``[L, in, out]``
  (:func:`jaxckpt.sharding._tensor_plan.leading_layer_axes`)."""
  for _, block in applied_blocks(model):
    for _, module in nnx.iter_modules(block):
      for name in ("kernel", "embedding"):
        var = getattr(module, name, None)
        if isinstance(var, nnx.Param) and leading_layer_axes(module, name, var):
          return True
  return False


def target_structure(target: Target, *, model: nnx.Module | None = None, scanned: bool | None = None) -> str:
  """``"scan"`` if the target stacks layers with ``scan``, else ``"unrolled"``, then the stacks' checkpoint structure
  when it is not ``block`` (e.g. ``"scan, nested:2"``).

  Args:
    target: a model or loss target.
    model: the model target's model if already built (abstract is fine); ``None`` builds it under
      ``nnx.eval_shape``.
    scanned: whether a traced step of the target loops over its remat'd blocks (:attr:`StepBuilder.scanned`): for
      your own model, whose layers are scanned by ``nnx.scan``/``jax.lax.scan`` rather than a jaxckpt ``Stack``.
      ``None``: not traced with remat regions (a ``none`` row, error rows): then :func:`stacked_blocks` decides.
  """
  if isinstance(target, ModelTarget):
    model = model if model is not None else nnx.eval_shape(target.make_model)
    found = stacks(model)
    if scanned is None and not found:  # not traced with remat regions (only none, error rows): the blocks say it
      scanned = stacked_blocks(model)
    loop = "scan" if any(s.scan for s in found) or (not found and scanned) else "unrolled"
    structures = sorted({str(s.structure) for s in found} - {"block"})
    return ", ".join([loop, *structures])
  jaxpr = jax.make_jaxpr(lambda p, b: target.loss(p, b, policy=PolicySpec()))(target.params, target.batch)
  return "scan" if any(e.primitive.name == "scan" for e in iter_eqns(jaxpr)) else "unrolled"


def _loss_step(target: LossTarget, spec: PolicySpec, tx: optax.GradientTransformation):
  def step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: target.loss(p, batch, policy=spec))(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    return new, {"loss": loss}

  return step


def _loss_state(params: Any, tx: optax.GradientTransformation) -> dict[str, Any]:
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


class StepBuilder:
  """Builds a target's train step under one policy after another, sharing what does not depend on the policy.

  The abstract model (``nnx.eval_shape`` of ``target.make_model``, built once), its block types, the abstract train
  state (params, optimizer state: the same for every policy) and the unrolled twin for the residual analysis are
  made once; each :meth:`step` only sets the policy on the abstract model
  (:func:`jaxckpt.set_policy`) and splits off its graph definitions. The report and the planner compile many
  policies of one target through one builder.

  Args:
    target: a :class:`~jaxckpt.step.ModelTarget` or :class:`~jaxckpt.step.LossTarget`.
    tx: the optimizer of the step.

  Example::

    >>> builder = StepBuilder(shipped_target("mlp", "tiny"), default_optimizer())
    >>> steps = [builder.step(parse_policy(p)) for p in ("none", "full")]
  """

  def __init__(self, target: Target, tx: optax.GradientTransformation):
    self.target, self.tx = target, tx
    self._block_types: dict[str, frozenset[str]] | None = None
    self._model: nnx.Module | None = None
    self._twin: nnx.Module | None = None
    self._state: Any = None
    self.scanned: bool | None = None
    """Whether a step traced by this builder loops over remat'd blocks (a ``scan`` whose body holds
    ``jax.checkpoint``): set by :func:`jaxckpt.step.lower_policy` (:meth:`note_trace`), ``None`` before."""

  def note_trace(self, jaxpr: Any) -> None:
    """Records from a traced step whether its blocks are scanned (:attr:`scanned`); a step without remat regions
    (policy ``none``) says nothing and leaves it as it was."""
    scans = [e for e in iter_eqns(jaxpr) if e.primitive.name == "scan"]
    if any(count_remat_regions(scan.params["jaxpr"]) for scan in scans):
      self.scanned = True
    elif self.scanned is None and count_remat_regions(jaxpr):
      self.scanned = False

  @property
  def block_types(self) -> dict[str, frozenset[str]]:
    """Block type -> checkpoint names (:func:`target_block_types`), computed once."""
    if self._block_types is None:
      self._block_types = target_block_types(self.target)  # your model raised while traced: a TracingError
    return self._block_types

  @property
  def is_model(self) -> bool:
    """Whether the target is a :class:`~jaxckpt.step.ModelTarget` (else a loss target: no model)."""
    return isinstance(self.target, ModelTarget)

  @property
  def abstract_model(self) -> nnx.Module:
    """The target's model built once under ``nnx.eval_shape`` (model targets only); :meth:`step` sets policies on
    it."""
    if self._model is None:
      try:
        self._model = nnx.eval_shape(self.target.make_model)
      except JaxckptError:
        raise
      except Exception as err:  # noqa: BLE001 - your model's constructor raised: one line, your file:line
        raise TracingError(f"building {self.target.name} failed: {raised_at(err)}") from err
      learn_names(self._model, self.block_types)  # names found by tracing (own tags, parts): set_policy takes them
    return self._model

  def _twin_graph(self, spec: PolicySpec | LayeredPolicy) -> tuple[Any, Any]:
    """The unrolled twin's ``(graphdef, non-param state)`` under ``spec``: same parameter tree, every Stack
    unrolled, so checkpoint names survive the residual analysis."""
    if self._twin is None:
      self._twin = nnx.eval_shape(self.target.make_model)
      learn_names(self._twin, self.block_types)
      for stack in stacks(self._twin):
        stack.scan = False
    set_policy(self._twin, spec)
    twin_def, _, twin_other = nnx.split(self._twin, nnx.Param, ...)
    return twin_def, twin_other

  def step(self, spec: PolicySpec | LayeredPolicy) -> PolicyStep:
    """The train step under ``spec``, from shapes only (nothing is allocated).

    Args:
      spec: a concrete policy (per block, or per layer range for a model with a Stack).

    Returns:
      The :class:`PolicyStep`.

    Raises:
      PolicySpecError: the spec names a block type or checkpoint name the target does not have.
    """
    target, tx = self.target, self.tx
    if spec.whole_loss is not None:
      return self._loss_policy_step(spec)
    spec.validate(self.block_types)
    if isinstance(target, LossTarget):
      if spec.layered is not None:
        if target.num_layers == 1:
          raise JaxckptError(f"layered policy {str(spec)!r} needs separate layers; the loss of {target.name} has one "
                             "(its blocks are not in a list or loop of layers, or its loss takes one spec): give one "
                             "spec")
        spec.segments_for(target.num_layers)
      if self._state is None:
        self._state = jax.eval_shape(lambda p: _loss_state(p, tx), target.params)
      unrolled = target.unrolled_loss or target.loss
      return PolicyStep(spec, _loss_step(target, spec, tx), self._state, target.batch,
                        lambda params, batch, _key: unrolled(params, batch, policy=spec), self._state["params"])
    model = self.abstract_model
    set_policy(model, spec)
    if self._state is None:
      graphdef, self._state = abstract_state_of(model, tx)
    else:
      graphdef = nnx.graphdef(model)
    state = self._state
    step = make_train_step(graphdef, tx, target.loss_fn, grad_accum_steps=target.grad_accum_steps,
                           skip_nonfinite=target.skip_nonfinite, metrics=target.metrics)

    twin_def, twin_other = self._twin_graph(spec)  # here, not inside the residual analysis' trace

    def loss_of_params(params, batch, dropout_key):
      # Non-param state (e.g. a model's own Rngs) is abstract here: stand-in values of its shapes, inside the trace.
      model = nnx.merge(twin_def, params, jax.tree.map(_stand_in, twin_other), copy=True)
      return target.loss_fn(model, batch, dropout_key=dropout_key, deterministic=False)[0]

    return PolicyStep(spec, step, state, target.batch, loss_of_params, state.params)


  def _loss_policy_step(self, policy: LossPolicy) -> PolicyStep:
    """The plain step differentiating a whole-loss plan (:class:`~jaxckpt.policies.LossPolicy`) instead of the
    model's loss: the same state, dropout key ``fold_in(state.key, state.step)`` and optimizer update."""
    target, tx = self.target, self.tx
    loss_fn = policy.loss_fn
    if isinstance(target, LossTarget):
      if self._state is None:
        self._state = jax.eval_shape(lambda p: _loss_state(p, tx), target.params)

      def loss_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, jax.random.key(0))  # key unused
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
               "opt_state": opt_state}
        return new, {"loss": loss}

      return PolicyStep(policy, loss_step, self._state, target.batch, loss_fn, self._state["params"])
    check_plain_step(target, policy)
    if self._state is None:
      _, self._state = abstract_state_of(self.abstract_model, tx)

    def step(state, batch):
      dropout_key = jax.random.fold_in(state.key, state.step)
      value, grads = jax.value_and_grad(loss_fn)(state.params, batch, dropout_key)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      return state.replace(step=state.step + 1, params=params, opt_state=opt_state), {"loss": value}

    return PolicyStep(policy, step, self._state, target.batch, loss_fn, self._state.params)


def check_plain_step(target: Target, policy: Any) -> None:
  """Refuses a target whose step is more than the plain one (``value_and_grad`` + one optimizer update), for a
  policy that builds only the plain step (a :class:`~jaxckpt.policies.LossPolicy`, ``mincut:<cap>``).

  Raises:
    JaxckptError: the target asks for metrics, skip_nonfinite or gradient accumulation (named in the message).
  """
  flags = {"metrics": getattr(target, "metrics", False), "skip_nonfinite": getattr(target, "skip_nonfinite", False),
           "grad_accum_steps": getattr(target, "grad_accum_steps", 1) != 1}
  if any(flags.values()):
    raise JaxckptError(f"policy {policy} builds the plain train step (value_and_grad + one update); this target "
                       f"asks for {', '.join(k for k, v in flags.items() if v)}, which it does not support")


def policy_step(target: Target, spec: PolicySpec | LayeredPolicy, tx: optax.GradientTransformation) -> PolicyStep:
  """Builds the train step of ``target`` under ``spec`` from shapes only (nothing is allocated).

  One policy; for many policies of one target, :class:`StepBuilder` shares the policy-independent parts.

  Args:
    target: a :class:`ModelTarget` or :class:`LossTarget`.
    spec: a concrete policy (a :class:`~jaxckpt.PolicySpec`, or a :class:`~jaxckpt.policies.LayeredPolicy`).
    tx: the optimizer.

  Returns:
    The :class:`PolicyStep`.

  Raises:
    PolicySpecError: the spec names a block type or checkpoint name the target does not have.
  """
  return StepBuilder(target, tx).step(spec)


def concrete_inputs(target: Target, tx: optax.GradientTransformation, *, seed: int = 0) -> Callable[[], tuple[Any, Any]]:
  """A jitted ``() -> (state, batch)`` that allocates real inputs for the step (for ``--measure``).

  Call it once to compile it, again for fresh buffers (the step donates the state). Params are the model's
  initialisation (model targets) or ``0.02 · normal`` (loss targets); the batch is zeros (memory and time do not
  depend on its values).
  """
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
  if isinstance(target, ModelTarget):
    def init_state():
      return create_train_state(target.make_model(), tx, seed=seed)[1]
  else:
    def init_state():
      leaves, treedef = jax.tree.flatten(target.params)
      keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
      params = treedef.unflatten([0.02 * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)])
      return _loss_state(params, tx)

  return jax.jit(lambda: (init_state(), zeros(target.batch)))


def dropout_key_struct() -> jax.ShapeDtypeStruct:
  """The abstract typed PRNG key the train step derives its dropout key from."""
  return jax.eval_shape(lambda: jax.random.key(0))
