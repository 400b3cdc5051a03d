"""Budget plans for your own model (blocks named with :func:`jaxckpt.apply_remat`, NNX or Linen), next to the Stack
planner.

One code path for both front-ends: :func:`plan_layers` says how many layers a plan has (the *layers interface* of a
target) and :class:`OwnModelProbe` measures candidates through the :class:`~jaxckpt.step.StepBuilder`, whatever the
target's kind: an NNX :class:`~jaxckpt.step.ModelTarget` with applied blocks, or a
:class:`~jaxckpt.step.LossTarget` such as :func:`jaxckpt.linen_model_target` makes (its ``num_layers``: the Linen
model's layers grouped by scope path, :func:`jaxckpt.linen._apply.group_layers`).

A model whose blocks are separate instances in a Python list (``layers[i]``) gets *per-layer* plans: layer i is the
applied blocks under ``…/i/…`` (:func:`jaxckpt.nnx._apply.applied_layers`), and a
:class:`~jaxckpt.policies.LayeredPolicy` gives each layer's instances its range's spec. A model whose blocks are
not in a list (one scanned ``nnx.vmap``/``nnx.scan`` stack, a single block) gets *per-block-type* plans: one spec for
every block, as one "layer".

Candidates are measured on the whole model's unrolled loss (the model's own layers have no common signature to call
one alone): under a uniform spec S, the saved-residual bytes and forward + backward FLOPs of the loss w.r.t. the
parameters, divided by the number of layers. Parts outside the blocks add the same bytes and FLOPs under every spec,
so the differences between candidates (all the solver and the predictor use) are per-layer exact for identical
layers; every plan is still verified by compiling it.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from jaxckpt.core._autonames import layer_axes
from jaxckpt.nnx._apply import applied_block_types, applied_layers
from jaxckpt.analysis._flops import count_flops
from jaxckpt.nnx._layers import stacks
from jaxckpt.policies._spec import PolicySpec
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.step._targets import LossTarget, Target
from jaxckpt.step._build import StepBuilder, dropout_key_struct


def own_model_layers(model: nnx.Module) -> int | None:
  """The number of layers a plan has for a model whose blocks :func:`jaxckpt.apply_remat` applied: its separate
  layer instances (blocks in a list), else the layers of a scanned stack (blocks made with ``nnx.vmap`` and called in
  ``nnx.scan``: the leading axis of their stacked parameters, :func:`scanned_layers`), else 1; ``None`` for a model
  with a jaxckpt Stack or without applied blocks (the Stack planner's case)."""
  if stacks(model) or not applied_block_types(model):
    return None
  layers, _ = applied_layers(model)
  return len(layers) or scanned_layers(model) or 1


def scanned_layers(model: nnx.Module) -> int | None:
  """The layers of a model whose applied blocks are one scanned stack (no list of layer instances, the blocks'
  parameters stacked on a leading layer axis, :func:`jaxckpt.core._autonames.layer_axes`): that axis's size; ``None``
  otherwise. A scan body has one policy, so a plan gives every such layer the same one."""
  layers, outside = applied_layers(model)
  if layers or not outside:
    return None
  sizes = set()
  for block in outside:
    leaves = jax.tree.leaves(nnx.state(block))
    if not layer_axes(leaves):
      return None
    sizes.add(int(leaves[0].shape[0]))
  return sizes.pop() if len(sizes) == 1 else None


def plan_layers(target: Target, builder: StepBuilder | None = None) -> int | None:
  """The layers interface of a target: how many layers a per-layer plan of its own blocks has (per-layer plans apply
  when > 1; 1 = one spec for every block), or ``None`` for a model with a jaxckpt Stack (the Stack planner's case)
  or without blocks.

  Args:
    target: a :class:`~jaxckpt.step.LossTarget` (its ``num_layers``) or a :class:`~jaxckpt.step.ModelTarget`
      (:func:`own_model_layers` of its abstract model).
    builder: the planning's builder, whose abstract model is reused.
  """
  if isinstance(target, LossTarget):
    return target.num_layers
  return own_model_layers(builder.abstract_model if builder is not None else nnx.eval_shape(target.make_model))


@dataclasses.dataclass
class OwnModelProbe:
  """Measures a layer candidate of your own model: ``measure(spec) -> (saved_bytes, flops)`` per layer, as
  :class:`jaxckpt.planner._candidates.LayerProbe` does for a Stack (module docstring).

  Args:
    target: the :class:`~jaxckpt.step.ModelTarget` or :class:`~jaxckpt.step.LossTarget`.
    num_layers: from :func:`plan_layers`.
    tx: the optimizer of the step (the probe traces the loss only; the step is built the same way).
    builder: the planning's :class:`~jaxckpt.step.StepBuilder` (shares the abstract model); ``None`` makes one.
  """

  target: Target
  num_layers: int
  tx: optax.GradientTransformation
  builder: StepBuilder | None = None

  def __post_init__(self):
    self.traces = 0
    if self.builder is None:
      self.builder = StepBuilder(self.target, self.tx)

  def measure(self, spec: PolicySpec) -> tuple[int, int]:
    """``(saved_bytes, flops)`` of one layer under ``spec`` (bytes; FLOPs of forward + backward)."""
    step = self.builder.step(spec)
    found: dict[str, int] = {}

    def outer(batch, key):
      loss = lambda params: step.loss_of_params(params, batch, key)  # noqa: E731
      found["bytes"] = sum(r.bytes for r in saved_residuals(loss, step.params) if r.kind != "argument")
      found["flops"] = count_flops(lambda p: jax.grad(loss)(p), step.params).total
      return 0

    jax.make_jaxpr(outer)(step.batch, dropout_key_struct())
    self.traces += 1
    return found["bytes"] // self.num_layers, found["flops"] // self.num_layers
