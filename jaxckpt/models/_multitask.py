"""Multi-task classification: a second head on the same features, loss = main + weight × auxiliary.

This mirrors the multi-task case of the PyTorch DDP bug report (gradient checkpointing plus a loss summed over two
heads broke gradient synchronisation between GPUs). Here both heads read one remat'd backbone, the loss is one
scalar function of all parameters, and ``jax.grad`` of it is exact whatever the policy or the mesh
(``tests/sharding/test_sharded_training.py`` checks gradients against the single-device, no-remat ones).

Auxiliary tasks (:data:`AUX_TASKS`) derive their labels from the main labels, so no extra data is needed:

- ``parity``: ``y mod 2`` (for the digits: is the digit odd), 2 classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.errors import JaxckptError


@dataclasses.dataclass(frozen=True)
class AuxTask:
  """An auxiliary classification task computed from the main labels.

  Attributes:
    name: its ``--aux-task`` name.
    num_classes: classes of the auxiliary head.
    labels: ``y: [B] int32 -> [B] int32`` in ``0..num_classes-1``.
    description: one line for ``--help``.
  """

  name: str
  num_classes: int
  labels: Callable[[jax.Array], jax.Array]
  description: str


AUX_TASKS: dict[str, AuxTask] = {
    "parity": AuxTask("parity", 2, lambda y: y % 2, "label mod 2 (odd digit?)"),
}
"""``--aux-task`` name -> :class:`AuxTask`."""


def aux_task(name: str) -> AuxTask:
  """The :class:`AuxTask` called ``name``.

  Raises:
    JaxckptError: an unknown name, listing the valid ones.
  """
  if name not in AUX_TASKS:
    raise JaxckptError(f"unknown auxiliary task {name!r}; valid: {', '.join(AUX_TASKS)}")
  return AUX_TASKS[name]


class MultiTaskClassifier(nnx.Module):
  """A classifier from :mod:`jaxckpt.models` plus a linear auxiliary head on its features.

  ``model(x)`` returns the main logits (so single-task code, e.g. :func:`jaxckpt.models.classification_loss`, still works);
  :meth:`both` returns main and auxiliary logits from one forward pass.

  Args:
    backbone: a model with ``features(x, *, dropout_key, deterministic) -> [B, D]`` and a ``head`` (``nnx.Linear``).
    task: the :class:`AuxTask` (or its name).
    rngs: initialisation keys of the auxiliary head (keyword-only).

  Raises:
    JaxckptError: an unknown task name, or a backbone without ``features``/``head``.
  """

  def __init__(self, backbone: nnx.Module, task: "AuxTask | str", *, rngs: nnx.Rngs):
    task = aux_task(task) if isinstance(task, str) else task
    if not callable(getattr(backbone, "features", None)) or not isinstance(getattr(backbone, "head", None), nnx.Linear):
      raise JaxckptError(f"{type(backbone).__name__} has no features()/head to put an auxiliary head on")
    self.backbone = backbone
    self.task_name = task.name
    self.aux_head = nnx.Linear(backbone.head.in_features, task.num_classes, rngs=rngs)

  def both(self, x: jax.Array, *, dropout_key: jax.Array | None = None,
           deterministic: bool = True) -> tuple[jax.Array, jax.Array]:
    """``x: [B, H, W, C]`` -> ``(main logits [B, K], auxiliary logits [B, K_aux])``, float32."""
    features = self.backbone.features(x, dropout_key=dropout_key, deterministic=deterministic)  # [B, D]
    return self.backbone.head(features), self.aux_head(features)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> main logits ``[B, K]`` float32."""
    return self.both(x, dropout_key=dropout_key, deterministic=deterministic)[0]


def multitask_loss(task: "AuxTask | str", weight: float = 0.5):
  """The loss of a :class:`MultiTaskClassifier`: mean cross-entropy of the main head + ``weight`` × the auxiliary's.

  Args:
    task: the auxiliary task (or its name).
    weight: λ ≥ 0 in ``loss = CE_main + λ · CE_aux``.

  Returns:
    ``loss_fn(model, batch, *, dropout_key, deterministic) -> (loss, metrics)`` (a :data:`jaxckpt.training._train.LossFn`)
    over ``batch = {"x": [B, H, W, C] float, "y": [B] int32, "mask": [B] bool (optional)}``; metrics: ``loss``
    (the total), ``main_loss``, ``aux_loss``, ``accuracy``, ``aux_accuracy`` (means over valid examples) and the
    sums ``correct``, ``aux_correct``, ``count`` (float32).

  Raises:
    JaxckptError: an unknown task or a negative weight.
  """
  task = aux_task(task) if isinstance(task, str) else task
  if not weight >= 0:
    raise JaxckptError(f"aux_weight={weight} (the auxiliary loss's weight) must be ≥ 0")

  def loss_fn(model, batch, *, dropout_key, deterministic):
    logits, aux_logits = model.both(batch["x"], dropout_key=dropout_key, deterministic=deterministic)
    y, y_aux = batch["y"], task.labels(batch["y"])
    mask = batch.get("mask", jnp.ones(y.shape, bool)).astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    mean = lambda v: (v * mask).sum() / count  # noqa: E731
    main = mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    aux = mean(optax.softmax_cross_entropy_with_integer_labels(aux_logits, y_aux))
    loss = main + weight * aux
    correct = ((logits.argmax(-1) == y) * mask).sum()
    aux_correct = ((aux_logits.argmax(-1) == y_aux) * mask).sum()
    return loss, {"loss": loss, "main_loss": main, "aux_loss": aux, "accuracy": correct / count,
                  "aux_accuracy": aux_correct / count, "correct": correct, "aux_correct": aux_correct,
                  "count": mask.sum()}

  return loss_fn
