"""What jaxckpt compiles (the report, the planner, --measure): a shipped model with a preset, or the user's own NNX model or loss function.

A *target* is one of two frozen dataclasses, all shapes given as ``jax.ShapeDtypeStruct`` (nothing is allocated):

- :class:`ModelTarget`: an NNX model built from jaxckpt blocks (:mod:`jaxckpt.nnx._layers`) or your own model prepared
  with :func:`jaxckpt.apply_remat`, a loss (jaxckpt's form ``loss_fn(model, batch, *, dropout_key, deterministic) ->
  (scalar loss, metrics)``, default :func:`jaxckpt.models.classification_loss`, or a plain ``loss_fn(model, batch) ->
  scalar`` whose dropout comes from the model's own ``nnx.Rngs``) and an example batch. The report sets each policy
  on the model with :func:`jaxckpt.set_policy`.
- :class:`LossTarget`: a pure loss ``loss(params, batch, *, policy) -> scalar`` that wraps its own blocks with
  :func:`jaxckpt.checkpoint` (``policy`` is a parsed :class:`jaxckpt.PolicySpec`), example params and batch.

The ``--target package.module:function`` protocol: ``function(**sizes)`` (called with the keywords it takes of the
tools' sizes and ``--target-arg``; one without parameters is called with none) returns a
:class:`ModelTarget` or a :class:`LossTarget`. Example (``mypkg/report_target.py``)::

    import jax, jax.numpy as jnp
    from jaxckpt.step import LossTarget
    import jaxckpt

    def target():
      def loss(params, batch, *, policy):
        block = jaxckpt.checkpoint(lambda w, x: jnp.tanh(x @ w), policy, block_type="mlp")
        h = batch["x"]                                   # [B, D] float32
        for w in params["w"]:                            # L × [D, D] float32
          h = block(w, h)
        return jnp.mean(h ** 2)
      d = jax.ShapeDtypeStruct((512, 512), jnp.float32)
      return LossTarget(loss, params={"w": [d] * 4}, batch={"x": jax.ShapeDtypeStruct((64, 512), jnp.float32)},
                        block_types={"mlp": set()}, name="my-mlp")

then ``jaxckpt-report --target mypkg.report_target:target --policies none full``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
import flax.linen as nn
from flax import nnx

from jaxckpt.errors import JaxckptError, closest, raised_at
from jaxckpt.linen._apply import apply_remat as linen_apply_remat
from jaxckpt.linen._apply import RematModule, group_layers, traced_block_paths, traced_block_types
from jaxckpt.nnx._apply import apply_remat as nnx_apply_remat
from jaxckpt.models._registry import MODEL_REGISTRY, model_entry
from jaxckpt.policies._spec import PolicySpec
from jaxckpt.core._structure import parse_structure
from jaxckpt.models._classifiers import classification_loss
from jaxckpt.training._train import LossFn, plain_loss_fn
from jaxckpt.sharding._tensor_plan import TensorPlan, parse_tensor_plan
from jaxckpt.step._auto_plan import auto_tensor_plan

SHIPPED_MODELS: dict[str, tuple[str, ...]] = {name: tuple(e.presets) for name, e in MODEL_REGISTRY.items()}
"""Every ``--model`` of the tools -> its presets: the entries of :data:`jaxckpt.models.MODEL_REGISTRY`."""


@dataclasses.dataclass(frozen=True)
class ModelTarget:
  """An NNX model, its loss and an example batch.

  Attributes:
    make_model: ``() -> nnx.Module`` built from jaxckpt blocks, or your own model prepared with
      :func:`jaxckpt.apply_remat` (``blocks=`` names its block classes; any policy, the report sets each one);
      run under ``nnx.eval_shape`` (never allocated) for compiled stats, and under ``jax.jit`` for ``--measure``.
    batch: pytree of ``jax.ShapeDtypeStruct``, e.g. ``{"x": [B, H, W, C] float32, "y": [B] int32}``.
    loss_fn: ``loss_fn(model, batch, *, dropout_key, deterministic) -> (scalar float32 loss, {metric: scalar})``,
      or a plain ``loss_fn(model, batch) -> scalar`` (dropout from the model's own Rngs), converted once here by
      :func:`plain_loss_fn`.
    name: shown as the report's ``model``.
    preset: shown as the report's ``preset`` (``None`` for user targets).
    ref: how a fresh process rebuilds this target (for ``--measure``): ``{"model": ..., "preset": ..., ...}`` or
      ``{"target": "package.module:function"}``; ``None`` = not rebuildable (measured in this process instead).
    grad_accum_steps: micro-batches per train step (:func:`jaxckpt.make_train_step`); must divide the batch size.
    skip_nonfinite: the step keeps parameters and optimizer state when the loss or a gradient is NaN/Inf
      (:func:`jaxckpt.make_train_step`; the experiments' ``--nan-policy skip``).
    metrics: the step also returns the loss function's metrics and the ``finite`` flag (a training loop reads
      them: the experiments set it). ``False`` (default): the plain step a user writes — ``jax.value_and_grad`` of
      the loss and one optimizer update — which the report and the planner compile.
    tensor_plan: which layers a ``tensor`` mesh axis splits, for a model whose parameters carry no logical axis
      names (:class:`jaxckpt.sharding.TensorPlan`; text in :data:`jaxckpt.sharding.TENSOR_PLAN_GRAMMAR`,
      ``{pattern: style}``, or ``"auto"``: Megatron pairs found in each block by :func:`auto_tensor_plan`, which
      traces the loss once here and prints the plan it chose). Parsed here, once: afterwards the attribute is a
      ``TensorPlan`` with rules, and ``make_model`` builds the model with the plan's logical names on its
      parameters (:meth:`TensorPlan.apply`), so every tool that builds it shards by them. ``None``: no plan.

  Raises:
    JaxckptError: ``loss_fn`` not callable.
    TensorPlanError: a malformed ``tensor_plan``; for ``"auto"``, a model without Megatron pairs in its blocks.
  """

  make_model: Callable[[], nnx.Module]
  batch: Any
  loss_fn: LossFn = classification_loss
  name: str = "custom"
  preset: str | None = None
  ref: Mapping[str, Any] | None = None
  grad_accum_steps: int = 1
  skip_nonfinite: bool = False
  metrics: bool = False
  tensor_plan: "TensorPlan | str | Mapping[str, str] | None" = None

  def __post_init__(self):
    if not callable(self.loss_fn):
      raise JaxckptError(f"ModelTarget(loss_fn={self.loss_fn!r}) must be callable: loss_fn(model, batch) -> scalar")
    object.__setattr__(self, "loss_fn", plain_loss_fn(self.loss_fn))
    plan = parse_tensor_plan(self.tensor_plan)
    build = self.make_model.build if isinstance(self.make_model, PlannedBuild) else self.make_model
    if plan is not None and plan.auto:
      plan = auto_tensor_plan(build, self.loss_fn, self.batch, name=self.name)
    object.__setattr__(self, "tensor_plan", plan)
    object.__setattr__(self, "make_model", build if plan is None else PlannedBuild(build, plan))


@dataclasses.dataclass(frozen=True)
class PlannedBuild:
  """``() -> nnx.Module``: ``build()``'s model with ``plan``'s logical names written onto its parameters
  (:meth:`jaxckpt.sharding.TensorPlan.apply`); what :class:`ModelTarget` keeps as ``make_model`` when it has a tensor
  plan (a ``dataclasses.replace`` unwraps it, so a plan is never applied twice)."""

  build: Callable[[], nnx.Module]
  plan: TensorPlan

  def __call__(self) -> nnx.Module:
    graphdef, state = nnx.split(self.build())  # fresh Variables (the arrays shared): never the caller's objects, and
    return self.plan.apply(nnx.merge(graphdef, state, copy=True))  # ones this trace may write metadata to


@dataclasses.dataclass(frozen=True)
class LossTarget:
  """A pure loss function of parameters and a batch that applies a remat policy itself.

  Attributes:
    loss: ``loss(params, batch, *, policy: PolicySpec) -> scalar float32``; wrap blocks with
      ``jaxckpt.checkpoint(fn, policy, block_type=...)``.
    params: pytree of float ``jax.ShapeDtypeStruct`` (what is differentiated and updated by AdamW).
    batch: pytree of ``jax.ShapeDtypeStruct``.
    block_types: block type -> checkpoint names it emits, to validate specs and expand ``all``; ``None`` = one
      block type ``default`` emitting every checkpoint name found in the traced loss.
    unrolled_loss: the same loss with layers unrolled (same params), used for the residual analysis when ``loss``
      scans over layers (a scan hides checkpoint names); ``None`` = use ``loss``.
    name, preset, ref: as in :class:`ModelTarget`.
    num_layers: layers of a per-layer plan: ``loss`` also takes a :class:`~jaxckpt.policies.LayeredPolicy` covering
      this many layers (:func:`linen_target` sets it from the model's layers); 1 = one spec for every block (budget
      plans then choose one spec).
    model: the Linen :class:`jaxckpt.linen._apply.RematModule` the loss applies (:func:`linen_target` sets it), for
      exported code and messages; ``None`` for other losses.
  """

  loss: Callable[..., jax.Array]
  params: Any
  batch: Any
  block_types: Mapping[str, Collection[str]] | None = None
  unrolled_loss: Callable[..., jax.Array] | None = None
  name: str = "custom"
  preset: str | None = None
  ref: Mapping[str, Any] | None = None
  num_layers: int = 1
  model: Any = None

  def __post_init__(self):
    if not isinstance(self.num_layers, int) or self.num_layers < 1:
      raise JaxckptError(f"LossTarget(num_layers={self.num_layers!r}) must be an int ≥ 1")


Target = ModelTarget | LossTarget


def linen_target(
    model: Any,
    *,
    batch: Any,
    loss_fn: Callable[..., jax.Array],
    params: Any = None,
    init_args: tuple = (),
    dropout_rng: str = "dropout",
    name: str | None = None,
) -> LossTarget:
  """Your own Linen model as a report/planner target: a :class:`LossTarget` that sets each policy on it.

  For the common cases (next-token LM, classifier) :func:`linen_model_target` needs no ``loss_fn``.

  Args:
    model: the :class:`jaxckpt.linen._apply.RematModule` from :func:`jaxckpt.linen.apply_remat` (any policy;
      the tools set each one).
    batch: pytree of ``jax.ShapeDtypeStruct`` (e.g. ``{"tokens": [B, T+1] int32}``).
    loss_fn: ``loss_fn(apply_fn, params, batch) -> scalar float32`` where ``apply_fn(params, *args, **kwargs)`` is
      ``model.apply({"params": params}, *args, rngs={dropout_rng: key}, **kwargs)`` under the policy being compiled
      (pass ``deterministic=False`` / ``train=True`` yourself; the key is an input of the step, fresh per step).
    params: the ``"params"`` collection as a pytree of ``jax.ShapeDtypeStruct``; ``None``: from
      ``model.init(key, *init_args)`` by ``jax.eval_shape``.
    init_args: example inputs of ``model.init`` after the key (arrays or ``jax.ShapeDtypeStruct``), used when
      ``params`` is ``None``.
    dropout_rng: the name of the RNG stream the model's ``nn.Dropout`` uses.
    name: shown as the report's ``model``; ``None``: the module's class name.

  Returns:
    A :class:`LossTarget` whose block types are the model's (traced names, :func:`jaxckpt.linen._apply.block_types`)
    and whose ``num_layers`` are the model's layers (:func:`jaxckpt.linen._apply.group_layers`; 1 when its blocks
    are not in separate layers): budget plans, ``min_saved`` and layered policies work on it.
    Its batch is ``{"batch": batch, "dropout_seed": uint32 scalar}``.

  Raises:
    JaxckptError: ``model`` is not a RematModule, or neither ``params`` nor ``init_args`` is given.

  Example::

    >>> model = jaxckpt.linen.apply_remat(MyLM(), "none", blocks={"layer": DecoderBlock})
    >>> def loss_fn(apply_fn, params, batch):
    ...   logits = apply_fn(params, batch["tokens"][:, :-1], deterministic=False)
    ...   return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    >>> target = linen_target(model, batch={"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)}, loss_fn=loss_fn,
    ...                       init_args=(jax.ShapeDtypeStruct((8, 64), jnp.int32),))
  """
  if not isinstance(model, RematModule):
    raise JaxckptError(f"linen_target(model=...) needs the RematModule from jaxckpt.linen.apply_remat(module, "
                       f"policy, blocks=...), got {type(model).__name__}")
  if params is None:
    if not init_args:
      raise JaxckptError("linen_target needs params= (a pytree of jax.ShapeDtypeStruct) or init_args= (example "
                         "inputs of model.init after the key)")
    params = jax.eval_shape(lambda key, *a: model.init(key, *a), jax.random.key(0), *init_args)["params"]
  wrapped_batch = {"batch": batch, "dropout_seed": jax.ShapeDtypeStruct((), jnp.uint32)}

  def loss(params, wrapped, *, policy):
    applied = model.with_policy(policy)  # model: the one with its layers known (below)
    key = jax.random.key(wrapped["dropout_seed"])

    def apply_fn(p, *args, **kwargs):
      return applied.apply({"params": p}, *args, rngs={dropout_rng: key}, **kwargs)

    return loss_fn(apply_fn, params, wrapped["batch"])

  types = traced_block_types(lambda p, b: loss(p, b, policy=PolicySpec()), params, wrapped_batch,
                             block_type_names=model.block_type_names)
  layers = group_layers(traced_block_paths(lambda p, b: loss(p, b, policy=PolicySpec()), params, wrapped_batch))
  model = dataclasses.replace(model, layers=layers)
  return LossTarget(loss, params=params, batch=wrapped_batch, block_types=types, num_layers=len(layers) or 1,
                    name=name or type(model.module).__name__, model=model)


LOSSES = ("next_token", "classification")
"""The losses :func:`linen_model_target` knows by name."""


def _next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _loss_of_outputs(fn: str, module_name: str, batch: Any, loss: Any, inputs: Callable[[Any], tuple] | None
                     ) -> tuple[Callable[[Any], tuple], Callable[[Any, Any], jax.Array]]:
  """``(inputs, loss_of)`` of a model target: the model's positional inputs from a batch, and ``loss_of(outputs,
  batch) -> scalar`` for a named loss (:data:`LOSSES`) or the user's function; the refusals name ``fn``'s arguments.

  Raises:
    JaxckptError: an unknown loss name, a batch without the keys the named loss reads, no ``inputs=`` for a batch
      without ``"inputs"``, outputs of the wrong shape (when traced).
  """
  if isinstance(loss, str):
    if loss not in LOSSES:
      raise JaxckptError(f"{fn}(loss={loss!r}): valid names are {', '.join(LOSSES)}, or a function "
                         "loss(outputs, batch) -> scalar")
    keys = {"next_token": None, "classification": ("inputs", "labels")}[loss]
    if keys and not (isinstance(batch, Mapping) and all(k in batch for k in keys)):
      raise JaxckptError(f"{fn}(loss={loss!r}) needs batch={{'inputs': [B, ...], 'labels': [B] int32}}, "
                         f"got {jax.tree.map(lambda a: f'{a.dtype}{list(a.shape)}', batch)}")
  tokens_of = (lambda b: b["tokens"] if isinstance(b, Mapping) else b)  # noqa: E731
  shapes = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", batch)
  if loss == "next_token" and isinstance(batch, Mapping) and "tokens" not in batch:
    raise JaxckptError(f"{fn}(loss='next_token') needs batch= token ids [B, T+1] int32 or "
                       f"{{'tokens': [B, T+1] int32}}, got {shapes}")
  if inputs is None and loss != "next_token" and not (isinstance(batch, Mapping) and "inputs" in batch):
    raise JaxckptError(f"{fn} calls {module_name} on batch['inputs'] unless inputs= says what to call "
                       f"it on, and the batch {shapes} has no 'inputs': pass inputs=lambda batch: (...,) (the "
                       "model's positional inputs)")
  if inputs is None:
    inputs = ((lambda b: (tokens_of(b)[:, :-1],)) if loss == "next_token"  # noqa: E731
              else (lambda b: (b["inputs"],)))
  if loss == "next_token":
    def loss_of(out, b):
      tokens = tokens_of(b)
      if getattr(out, "ndim", 0) != 3 or out.shape[:2] != (tokens.shape[0], tokens.shape[1] - 1):
        raise JaxckptError(f"loss='next_token' needs {module_name} to return logits [B, T, V] = "
                           f"[{tokens.shape[0]}, {tokens.shape[1] - 1}, V] for tokens [B, T+1] = {list(tokens.shape)}, "
                           f"got {jax.tree.map(lambda a: list(a.shape), out)}")
      return _next_token_loss(out, tokens)
  elif loss == "classification":
    def loss_of(out, b):
      labels = b["labels"]
      if getattr(out, "ndim", 0) != 2 or out.shape[0] != labels.shape[0]:
        raise JaxckptError(f"loss='classification' needs {module_name} to return logits [B, C] with B = "
                           f"{labels.shape[0]}, got {jax.tree.map(lambda a: list(a.shape), out)}")
      return optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
  else:
    if not callable(loss):
      raise JaxckptError(f"{fn}(loss={loss!r}) must be one of {', '.join(LOSSES)} or a function "
                         "loss(outputs, batch) -> scalar")
    loss_of = loss

  return inputs, loss_of


def linen_model_target(
    model: Any,
    batch: Any,
    *,
    loss: "str | Callable[[Any, Any], jax.Array]",
    blocks: Mapping[str, Any] | None = None,
    inputs: Callable[[Any], tuple] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    dropout_rng: str = "dropout",
    name: str | None = None,
) -> LossTarget:
  """Your own Linen model as a report/planner target without glue: the module, an example batch and a loss.

  The model is called ``model.apply({"params": params}, *inputs(batch), rngs={dropout_rng: key}, **call_kwargs)``
  under each policy the tools compile (the key is fresh per step) and ``loss`` turns its output into the scalar.

  Args:
    model: the :class:`jaxckpt.linen._apply.RematModule` from :func:`jaxckpt.linen.apply_remat`, or your plain Linen
      module with ``blocks=``.
    batch: example batch, pytree of ``jax.ShapeDtypeStruct`` (or arrays): for ``loss="next_token"`` token ids
      ``[B, T+1] int32`` (or ``{"tokens": [B, T+1] int32}``); for ``loss="classification"``
      ``{"inputs": [B, ...], "labels": [B] int32}``; anything ``inputs`` and your ``loss`` read otherwise.
    loss: ``"next_token"`` (cross-entropy of logits ``[B, T, V]`` from tokens ``[:, :-1]`` against tokens
      ``[:, 1:]``, mean), ``"classification"`` (cross-entropy of logits ``[B, C]`` against ``labels``, mean), or
      ``loss(outputs, batch) -> scalar float32``.
    blocks: block type -> block class (or predicate), as :func:`jaxckpt.linen.apply_remat` takes it, when ``model``
      is a plain module.
    inputs: ``batch -> tuple`` of the model's positional inputs; default: ``(tokens[:, :-1],)`` for next_token,
      ``(batch["inputs"],)`` otherwise
      (a batch without that key is then an error naming ``inputs=``).
    call_kwargs: static keyword arguments of the model's call in training, e.g. ``{"deterministic": False}`` or
      ``{"train": True}`` (default none: the model's own defaults).
    dropout_rng: the RNG stream name of the model's ``nn.Dropout``.
    name: shown as the report's ``model``; ``None``: the module's class name.

  Returns:
    The :class:`LossTarget` of :func:`linen_target` (block types, layers for per-layer plans).

  Raises:
    JaxckptError: ``model`` is not a Linen module (an NNX one: :class:`ModelTarget`), a plain module without
      ``blocks=``, an unknown ``loss`` name, a batch without the keys the named loss reads, no ``inputs=`` with a
      ``loss`` function and a batch that is not a dict with an ``"inputs"`` key, or model outputs of the wrong shape
      for the named loss (the message names your module and the shapes).

  Example::

    >>> model = jaxckpt.linen.apply_remat(GPT2(cfg), "none", blocks={"block": GPT2Block})
    >>> target = linen_model_target(model, jax.ShapeDtypeStruct((8, 129), jnp.int32), loss="next_token",
    ...                             call_kwargs={"deterministic": False})
  """
  if isinstance(model, nnx.Module):
    raise JaxckptError(f"linen_model_target got an NNX module ({type(model).__name__}); for NNX use "
                       "ModelTarget(make_model=..., batch=..., loss_fn=...) with jaxckpt.apply_remat")
  if not isinstance(model, RematModule):
    if blocks is None:
      raise JaxckptError(f"linen_model_target({type(model).__name__}(...)) needs blocks= (block type -> your block "
                         "class), or the model from jaxckpt.linen.apply_remat(module, policy, blocks=...)")
    model = linen_apply_remat(model, "none", blocks=blocks)
  elif blocks is not None:
    model = linen_apply_remat(model, model.spec if model.spec.layered is None else "none", blocks=blocks,
                              names=model.name_rule)
  module_name = type(model.module).__name__
  kwargs = dict(call_kwargs or {})
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  inputs, loss_of = _loss_of_outputs("linen_model_target", module_name, batch, loss, inputs)

  def loss_fn(apply_fn, params, b):
    return loss_of(apply_fn(params, *inputs(b), **kwargs), b)

  init_args = tuple(jax.eval_shape(inputs, batch))
  params = jax.eval_shape(lambda key, *a: model.init({"params": key, dropout_rng: key}, *a, **kwargs),
                          jax.random.key(0), *init_args)["params"]
  return linen_target(model, batch=batch, loss_fn=loss_fn, params=params, dropout_rng=dropout_rng,
                      name=name or module_name)


def nnx_model_target(
    model: "nnx.Module | Callable[[], nnx.Module]",
    batch: Any,
    *,
    loss: "str | Callable[[Any, Any], jax.Array]",
    blocks: Mapping[str, Any] | None = None,
    inputs: Callable[[Any], tuple] | None = None,
    name: str | None = None,
    tensor_plan: "TensorPlan | str | Mapping[str, str] | None" = None,
) -> ModelTarget:
  """Your own NNX model as a report/planner/fit target without glue: the model, an example batch and a loss.

  The twin of :func:`linen_model_target`: the same ``loss`` names and ``inputs=`` rule. The model is called
  ``model(*inputs(batch))`` in training mode; dropout comes from the model's own ``nnx.Rngs`` (its state is part of
  the train state). Nothing is allocated: the tools build the model under ``nnx.eval_shape``.

  Args:
    model: a function ``() -> nnx.Module`` that builds your model (preferred: nothing is allocated), or a built
      ``nnx.Module`` (its arrays are read, not copied). With ``blocks=``, :func:`jaxckpt.nnx.apply_remat` is
      applied to it; without, it must hold jaxckpt blocks or blocks applied already.
    batch: example batch, pytree of ``jax.ShapeDtypeStruct`` (or arrays): for ``loss="next_token"`` token ids
      ``[B, T+1] int32`` (or ``{"tokens": [B, T+1] int32}``); for ``loss="classification"``
      ``{"inputs": [B, ...], "labels": [B] int32}``.
    loss: ``"next_token"``, ``"classification"`` (as :func:`linen_model_target`), or ``loss(outputs, batch) ->
      scalar float32``.
    blocks: block type -> your block class (or predicate), as :func:`jaxckpt.nnx.apply_remat` takes it.
    inputs: ``batch -> tuple`` of the model's positional inputs (defaults as :func:`linen_model_target`).
    name: shown as the report's ``model``; ``None``: the model's class name.
    tensor_plan: for a ``tensor`` mesh axis on a model whose parameters carry no logical axis names: which layers
      it splits, ``colwise`` or ``rowwise`` (PyTorch's ``parallelize_module`` plans, Megatron-LM's pairs):
      ``{"layers/*/attn/q_proj": "colwise", ..., "layers/*/attn/o_proj": "rowwise"}``, the same as text
      (:data:`jaxckpt.sharding.TENSOR_PLAN_GRAMMAR`, e.g. from a target function's keyword argument), a
      :class:`jaxckpt.sharding.TensorPlan`, or ``"auto"`` (the attention and MLP pairs of each block of
      ``blocks=``, found by tracing the loss: :func:`jaxckpt.step.auto_tensor_plan`, which prints its plan).
      Checked against the model here. ``None``: no plan (a ``tensor`` axis is then refused at compile time).

  Returns:
    The :class:`ModelTarget`.

  Raises:
    JaxckptError: ``model`` is a Linen module (use :func:`linen_model_target`) or neither a module nor a function
      returning one; the errors of the named losses (as :func:`linen_model_target`); what
      :func:`jaxckpt.nnx.apply_remat` raises for ``blocks=``.
    TensorPlanError: a malformed ``tensor_plan``, a pattern that matches no layer of the model (its layers listed),
      a matched parameter no style splits; for ``"auto"``, blocks that are not Megatron pairs.

  Example::

    >>> target = nnx_model_target(lambda: MyLM(cfg, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((8, 129), jnp.int32),
    ...                           loss="next_token", blocks={"layer": DecoderLayer},
    ...                           tensor_plan="layers/*/attn/q_proj=colwise,layers/*/attn/o_proj=rowwise")
  """
  if isinstance(model, (nn.Module, RematModule)):
    raise JaxckptError(f"nnx_model_target got a Flax Linen module ({type(model).__name__}); for Linen use "
                       "jaxckpt.linen_model_target(module, batch, loss=..., blocks=...)")
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    build = lambda: nnx.merge(graphdef, state, copy=True)  # noqa: E731
    module_name = type(model).__name__
  elif callable(model):
    build, module_name = model, getattr(model, "__name__", "model")
  else:
    raise JaxckptError(f"nnx_model_target(model={model!r}) must be an nnx.Module or a function () -> nnx.Module")
  if blocks is not None:
    make = lambda: nnx_apply_remat(build(), "none", blocks=blocks)  # noqa: E731
    nnx.eval_shape(make)  # a blocks= that matches nothing is refused here, not at the first compile
  else:
    make = build
  if module_name in ("<lambda>", "model"):
    module_name = type(nnx.eval_shape(make)).__name__
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  inputs, loss_of = _loss_of_outputs("nnx_model_target", module_name, batch, loss, inputs)

  def loss_fn(m: nnx.Module, b: Any) -> jax.Array:
    return loss_of(m(*inputs(b)), b)

  target = ModelTarget(make, batch, loss_fn, name=name or module_name, tensor_plan=tensor_plan)
  if target.tensor_plan is not None:
    nnx.eval_shape(target.make_model)  # a pattern that matches nothing is refused here, not at the first compile
  return target


def shipped_target(
    model: str,
    preset: str = "tiny",
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    num_layers: int | None = None,
    compute_dtype: str | None = None,
    scan: bool | None = None,
    structure: str | None = None,
    grad_accum_steps: int = 1,
    weight_dtype: str | None = None,
    attention: str | None = None,
    vocab_tiles: int | None = None,
    moe_dispatch: str | None = None,
    capacity_factor: float | None = None,
) -> ModelTarget:
  """A shipped model of :data:`jaxckpt.models.MODEL_REGISTRY` with a preset and overrides: the entry builds it, gives
  its example batch (image classifiers: the digits' image shape) and its loss (e.g. :func:`jaxckpt.models._gpt.lm_loss`).

  Args:
    model: a registry key: ``vit``, ``mlp``, ``cnn``, ``gpt`` or ``llm``.
    preset: a preset of that model (``tiny``, ``small``; ``gpt`` also ``gpt2-small``; ``llm`` the released models,
      ``llama3.1-8b``…, and ``tiny``, ``llama-tiny``, ``gemma2-tiny``).
    batch_size: examples per step B ≥ 1 (the entry's ``batch``: images ``{"x": [B, 8, 8, 1] float32, "y": [B]
      int32}``, tokens ``{"tokens": [B, T+1] int32}``). ``None``: the entry's default (64 for images, the preset's
      for gpt).
    seq_len: tokens per example T, for sequence models only (their config has a ``seq_len`` field).
    num_layers: overrides the preset's depth (≥ 1).
    compute_dtype: ``float32`` or ``bfloat16`` (parameters stay float32 except ``llm``'s ``weight_dtype``); ``None``
      keeps the preset's.
    scan: scan over layers or unroll them; ``None`` keeps the preset's.
    structure: checkpoint structure of the layer stack (``block``, ``every:K``, ``nested[:D]``); ``None`` keeps the
      preset's (``block``).
    grad_accum_steps: micro-batches per step, gradients averaged (must divide ``batch_size``).
    weight_dtype: ``float32`` or ``bfloat16``, the parameters' (and so AdamW's moments') dtype; ``llm`` only.
    attention: the attention implementation: ``xla`` or ``dot_product_attention`` (``gpt``); ``auto``, ``xla`` or
      ``splash`` (``llm``).
    vocab_tiles: sequence chunks the loss computes logits for one at a time (``llm`` only; divides ``seq_len``).
    moe_dispatch: an ``llm`` Mixture of Experts' dispatch: ``auto``, ``dropping``, ``ragged`` or ``gmm``
      (:data:`jaxckpt.models.llm.MOE_DISPATCHES`).
    capacity_factor: the dropping dispatch's capacity factor (> 0).

  Returns:
    The :class:`ModelTarget` (rebuildable in a fresh process through its ``ref``).

  Raises:
    JaxckptError: unknown model or preset; a bad override (named as its argument, ``seq_len=0 must be ...``, by the
      registry's ``override``), e.g. ``seq_len`` for an image model; ``grad_accum_steps`` not dividing the batch.

  Example::

    >>> target = shipped_target("vit", "tiny", batch_size=8, scan=False)
  """
  entry = model_entry(model)
  config = entry.override(preset, seq_len=seq_len, num_layers=num_layers, compute_dtype=compute_dtype, scan=scan,
                          structure=None if structure is None else str(parse_structure(structure)),
                          weight_dtype=weight_dtype, attention=attention, vocab_tiles=vocab_tiles,
                          moe_dispatch=moe_dispatch, capacity_factor=capacity_factor)
  if batch_size is None:
    batch_size = entry.default_batch_size(config)
  batch = entry.batch(batch_size, config)
  if "batch_size" in {f.name for f in dataclasses.fields(config)}:
    config = entry.override(config, batch_size=batch_size)
  if grad_accum_steps < 1 or batch_size % grad_accum_steps:
    raise JaxckptError(f"grad_accum_steps={grad_accum_steps} must be ≥ 1 and divide the batch size {batch_size}")
  ref = {"model": model, "preset": preset, "batch_size": batch_size, "seq_len": seq_len, "num_layers": num_layers,
         "compute_dtype": compute_dtype, "scan": scan, "structure": structure, "grad_accum_steps": grad_accum_steps,
         "weight_dtype": weight_dtype, "attention": attention, "vocab_tiles": vocab_tiles,
         "moe_dispatch": moe_dispatch, "capacity_factor": capacity_factor}
  return ModelTarget(make_model=lambda: entry.build(config), batch=batch, loss_fn=entry.loss_fn, name=model,
                     preset=preset, ref=ref, grad_accum_steps=grad_accum_steps)


def load_target(spec: str, kwargs: Mapping[str, Any] | None = None) -> Target:
  """Imports ``package.module:function`` and calls ``function(**kwargs)`` to get a target (protocol in the module
  docstring).

  A target function may take keyword arguments with defaults (``def target(*, seq_len=4096, batch_size=8,
  num_layers=32, compute_dtype="bfloat16")``): the tools pass their sizes and dtypes (``--seq-len``,
  ``--batch-size``, ``--layers``, ``--compute-dtype``, ``--weight-dtype``) and ``--target-arg key=value`` as
  ``kwargs``, so one function plans your model across shapes.

  Args:
    spec: ``"package.module:function"``; the module must be importable: installed, on ``PYTHONPATH``, or in the
      current directory (appended to ``sys.path`` if missing, as ``python -m`` does, so the ``jaxckpt-report``
      script finds it too).
    kwargs: keyword arguments for ``function``; ``None`` or ``{}`` calls it without arguments.

  Returns:
    The :class:`ModelTarget` or :class:`LossTarget` it returned, with ``ref`` set so ``--measure`` can rebuild it
    (``{"target": spec, "kwargs": kwargs}``).

  Raises:
    JaxckptError: malformed spec, module not importable or raising while imported, no such function, a keyword
      argument the function does not take (its keyword arguments listed) or a parameter without default that
      ``kwargs`` does not give, the function raising (its exception's type, message and file:line, one line) or
      returning something else.
  """
  kwargs = dict(kwargs or {})
  module_name, sep, function_name = spec.partition(":")
  if not sep or not module_name or not function_name.isidentifier():
    raise JaxckptError(f"bad target={spec!r}: write package.module:function (e.g. mypkg.targets:vit_target)")
  if os.getcwd() not in sys.path and "" not in sys.path:  # console scripts leave the current directory off the path
    sys.path.append(os.getcwd())  # after installed packages: a local module never shadows one
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as err:
    if err.name is not None and module_name.startswith(err.name):  # the target's own module (or package) is missing
      raise JaxckptError(f"bad target={spec!r}: cannot import module {module_name!r} ({err})") from None
    raise JaxckptError(f"target={spec!r}: importing {module_name} failed: {raised_at(err)}") from err
  except Exception as err:  # the user's module raised while it was imported: one line, where and what
    raise JaxckptError(f"target={spec!r}: importing {module_name} failed: {raised_at(err)}") from err
  function = getattr(module, function_name, None)
  if not callable(function):
    found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
    raise JaxckptError(f"bad target={spec!r}: module {module_name} has no function {function_name!r}; "
                       f"its functions: {', '.join(found[:20]) or '(none)'}{', ...' if len(found) > 20 else ''}")
  _check_target_kwargs(spec, function, function_name, kwargs)
  try:
    target = function(**kwargs)
  except JaxckptError:
    raise
  except Exception as err:  # the user's function raised: one line, where and what
    raise JaxckptError(f"target={spec!r}: {function_name}() failed: {raised_at(err)}") from err
  if not isinstance(target, (ModelTarget, LossTarget)):
    raise JaxckptError(f"bad target={spec!r}: {function_name}() returned {type(target).__name__}; it must return a "
                       "jaxckpt.step.ModelTarget or jaxckpt.step.LossTarget (or jaxckpt.nnx_model_target(...), "
                       "jaxckpt.linen_model_target(...))")
  return dataclasses.replace(target, ref={"target": spec, **({"kwargs": kwargs} if kwargs else {})})


_TOOL_SIZES = ("batch_size", "seq_len", "num_layers", "compute_dtype", "weight_dtype")
"""The keyword arguments the tools fill from their own size and dtype flags (``--batch-size`` ...)."""


def _check_target_kwargs(spec: str, function: Callable, name: str, kwargs: Mapping[str, Any]) -> None:
  """Refuses, in one line, keyword arguments ``function`` does not take and parameters it needs but is not given."""
  try:
    signature = inspect.signature(function)
  except ValueError:  # no signature (a builtin): call it and let the type check speak
    return
  params = signature.parameters
  takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  keywords = [p.name for p in params.values()
              if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
  for key in kwargs:
    if not takes_any and key not in keywords:
      hint = closest(key, keywords)
      # The tools' sizes stay key=value (a CLI writes its flag, --batch-size 8); any other keyword is echoed quoted,
      # as given (a CLI's --target-arg scan=True is no --scan flag).
      given = f"{key}={kwargs[key]!r}" if key in _TOOL_SIZES else f"'{key}={kwargs[key]!r}'"
      raise JaxckptError(f"target={spec!r}: {name}{signature} takes no keyword argument {given}; its "
                         f"keyword arguments: {', '.join(keywords) or '(none)'}"
                         + (f"; did you mean {hint!r}?" if hint else ""))
  missing = [p.name for p in params.values() if p.default is inspect.Parameter.empty and p.name not in kwargs
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
  if missing:
    raise JaxckptError(f"bad target={spec!r}: {name}{signature} needs {', '.join(missing)} without a default; a "
                       "target function takes no arguments, or keyword arguments with defaults that the tools' sizes "
                       "and dtypes fill in (seq_len, batch_size, num_layers, compute_dtype, weight_dtype, or "
                       "target_args key=value)")


def with_grad_accum(target: Target, grad_accum_steps: int) -> Target:
  """``target`` (your own, from ``--target``) with its batch split into ``grad_accum_steps`` micro-batches per step,
  as the fit compiles a choice (:func:`jaxckpt.make_train_step`'s ``grad_accum_steps``); its ``ref`` keeps the
  number, so a fresh process (``--measure``) rebuilds it so.

  Raises:
    JaxckptError: ``grad_accum_steps`` < 1 or not dividing the batch size, or a :class:`LossTarget` (its step has no
      accumulation).
  """
  if grad_accum_steps == getattr(target, "grad_accum_steps", 1):
    return target
  batch = batch_size_of(target)
  if grad_accum_steps < 1 or batch % grad_accum_steps:
    raise JaxckptError(f"grad_accum_steps={grad_accum_steps} must be ≥ 1 and divide the target's batch size {batch}")
  if not isinstance(target, ModelTarget):
    raise JaxckptError(f"grad_accum_steps={grad_accum_steps}: a LossTarget's step has no gradient accumulation")
  ref = None if target.ref is None else {**target.ref, "grad_accum_steps": grad_accum_steps}
  return dataclasses.replace(target, grad_accum_steps=grad_accum_steps, ref=ref)


def rebuild_target(ref: Mapping[str, Any]) -> Target:
  """Rebuilds a target from its ``ref`` (in a fresh process, for ``--measure``).

  Raises:
    JaxckptError: a ref of neither form.
  """
  if "target" in ref:
    return with_grad_accum(load_target(ref["target"], ref.get("kwargs")), ref.get("grad_accum_steps", 1))
  if "model" in ref:
    return shipped_target(**ref)
  raise JaxckptError(f"cannot rebuild a target from {dict(ref)!r}: need a 'model' or 'target' key")


def batch_size_of(target: Target) -> int:
  """The batch size of ``target``: the leading dimension of its batch arrays (scalars such as a dropout seed are
  skipped).

  Raises:
    JaxckptError: a batch with no array of rank ≥ 1.
  """
  dims = [leaf.shape[0] for leaf in jax.tree.leaves(target.batch) if len(getattr(leaf, "shape", ()))]
  if not dims:
    raise JaxckptError(f"target {target.name!r} has no batch axis: its batch has no array of rank ≥ 1")
  return max(set(dims), key=dims.count)


def with_batch(target: Target, batch_size: int, *, grad_accum_steps: int = 1) -> Target:
  """``target`` at another batch size (and gradient accumulation).

  A shipped model is rebuilt by :func:`~jaxckpt.step.shipped_target` (its ``ref``); a user's target has the
  leading dimension of every batch array of the original batch size replaced.

  Args:
    target: a model or loss target.
    batch_size: examples per step B ≥ 1.
    grad_accum_steps: micro-batches per step (model targets only; must divide ``batch_size``).

  Returns:
    The target at that batch size (a user's target loses its ``ref``: it is measured in this process).

  Raises:
    JaxckptError: ``batch_size`` < 1, ``grad_accum_steps`` not dividing it, or accumulation on a loss target.
  """
  if batch_size < 1:
    raise JaxckptError(f"batch_size={batch_size} must be ≥ 1")
  if grad_accum_steps < 1 or batch_size % grad_accum_steps:
    raise JaxckptError(f"grad_accum_steps={grad_accum_steps} must be ≥ 1 and divide batch_size={batch_size}")
  ref = target.ref or {}
  if isinstance(target, ModelTarget) and "model" in ref:
    return shipped_target(**{**ref, "batch_size": batch_size, "grad_accum_steps": grad_accum_steps})
  if grad_accum_steps != 1 and isinstance(target, LossTarget):
    raise JaxckptError(f"grad_accum_steps={grad_accum_steps}: a LossTarget's step has no gradient accumulation")
  old = batch_size_of(target)

  def resize(leaf):
    shape = getattr(leaf, "shape", ())
    if len(shape) and shape[0] == old:
      return jax.ShapeDtypeStruct((batch_size, *shape[1:]), leaf.dtype, sharding=getattr(leaf, "sharding", None))
    return leaf

  changes: dict[str, Any] = {"batch": jax.tree.map(resize, target.batch), "ref": None}
  if isinstance(target, ModelTarget):
    changes["grad_accum_steps"] = grad_accum_steps
  return dataclasses.replace(target, **changes)
