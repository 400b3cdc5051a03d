"""Train an image classifier with a remat policy and see what it costs: ``python -m experiments.classifier``.

Trains on scikit-learn's handwritten digits (or ``--data FILE.npz``) with a jaxckpt model (``--model vit|mlp|cnn``)
whose blocks are remat'd by ``--policy``. Before training it prints the compiled memory stats of the train step;
during training a progress bar; after each epoch the train loss and test accuracy; at the end the test accuracy and
median step time. ``--out DIR`` writes ``DIR/metrics.json`` (keys from :mod:`jaxckpt.schema`).

The CLI only parses flags into a :class:`ClassifierConfig` and calls :func:`train`, which tests call directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import optax
from flax import nnx

import jaxckpt
from experiments.autofit import autofit, batch_size_flag
from experiments.data import eval_batches, load_dataset, train_batch
from experiments.flags import CLIParser, add_policy_flags, add_run_flags, command, exit_with
from jaxckpt.cli import reference_epilog
from experiments.options import RunOptions, run_identity
from experiments.runner import RunResult, Setup, run
from jaxckpt.errors import DataError, JaxckptError
from jaxckpt.models import COMPUTE_DTYPES, MODELS, build_model
from jaxckpt.models import AUX_TASKS, MultiTaskClassifier, aux_task, multitask_loss
from jaxckpt.core import parse_structure
from jaxckpt.step import ModelTarget

__all__ = ["ClassifierConfig", "ClassifierResult", "train", "main", "build_parser"]


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
  """One classifier run. Model fields not set here come from the preset; how it runs is in ``run``."""

  model: str = "vit"  # A key of jaxckpt.models.MODELS: vit, mlp, cnn.
  preset: str = "small"  # A preset of that model: tiny (seconds, for tests) or small.
  scan: bool | None = None  # Scan over layers (True) or unroll (False); None keeps the preset's (scan).
  structure: str = "block"  # Checkpoint structure of the layer stack: block, every:K, nested, nested:D.
  num_layers: int | None = None  # Overrides the preset's depth.
  compute_dtype: str = "float32"  # float32 or bfloat16 (parameters stay float32).
  epochs: int = 30
  batch_size: int | str = 64  # Examples per step (the last partial batch of an epoch is dropped); "auto": fit.
  grad_accum_steps: int = 1  # Micro-batches per step (gradients averaged, one update); must divide batch_size.
  learning_rate: float = 2e-3  # Peak AdamW learning rate (warmup then cosine decay).
  weight_decay: float = 1e-4
  warmup_epochs: float = 2.0
  seed: int = 0  # Initialisation, data order and dropout.
  split_seed: int = 0  # The fixed train/test split.
  data: str | None = None  # .npz file with x and y; None = scikit-learn's digits.
  num_classes: int | None = None  # Classes K of --data (labels in 0..K-1, empty classes allowed); None = inferred.
  aux_task: str | None = None  # Auxiliary head (jaxckpt.models._multitask.AUX_TASKS, e.g. "parity"); None = single task.
  aux_weight: float | None = None  # λ in loss = CE_main + λ · CE_aux; None = DEFAULT_AUX_WEIGHT (needs aux_task).
  run: RunOptions = RunOptions()  # Policy, outputs, checkpoints, faults, devices (experiments.options).


ClassifierResult = RunResult
"""What :func:`train` returns: ``metrics`` (as written to metrics.json) and the final train ``state``."""

DEFAULT_AUX_WEIGHT = 0.5
"""λ of ``--aux-task`` when ``--aux-weight`` is not given."""


def _aux_weight(config: ClassifierConfig) -> float:
  return DEFAULT_AUX_WEIGHT if config.aux_weight is None else config.aux_weight


def _check(config: ClassifierConfig) -> None:
  if config.model not in MODELS:
    raise JaxckptError(f"unknown model {config.model!r}; valid models: {', '.join(MODELS)}")
  if config.preset not in MODELS[config.model].presets:
    raise JaxckptError(
        f"unknown preset {config.preset!r} for model {config.model}; valid: {', '.join(MODELS[config.model].presets)}"
    )
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise JaxckptError(f"unknown compute dtype {config.compute_dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}")
  for name in ("epochs", "batch_size", "grad_accum_steps"):
    if getattr(config, name) < 1:
      raise JaxckptError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(config, name)}")
  if config.batch_size % config.grad_accum_steps:
    raise JaxckptError(f"--grad-accum-steps {config.grad_accum_steps} must divide --batch-size {config.batch_size}")
  if config.num_layers is not None and config.num_layers < 1:
    raise JaxckptError(f"--layers must be ≥ 1, got {config.num_layers}")
  if not config.learning_rate > 0:
    raise JaxckptError(f"--learning-rate must be > 0, got {config.learning_rate}")
  if config.num_classes is not None and config.num_classes < 2:
    raise JaxckptError(f"--num-classes must be ≥ 2, got {config.num_classes}")
  if config.aux_task is not None:
    aux_task(config.aux_task)
  if config.aux_weight is not None:
    if config.aux_task is None:
      raise JaxckptError(f"--aux-weight {config.aux_weight} needs --aux-task (one of: {', '.join(AUX_TASKS)})")
    if not 0 <= config.aux_weight < float("inf"):
      raise JaxckptError(f"--aux-weight must be finite and ≥ 0, got {config.aux_weight}")


def model_config(config: ClassifierConfig) -> Any:
  """The model config: the preset with this run's overrides (depth, scan, compute dtype)."""
  overrides: dict[str, Any] = {"compute_dtype": config.compute_dtype,
                               "structure": str(parse_structure(config.structure))}
  if config.scan is not None:
    overrides["scan"] = config.scan
  if config.num_layers is not None:
    overrides["num_layers"] = config.num_layers
  return dataclasses.replace(MODELS[config.model].presets[config.preset], **overrides)


def _score(results: list[Mapping[str, Any]]) -> dict[str, float]:
  """Test loss and accuracy over the padded, masked test batches (and the auxiliary head's accuracy)."""
  count = sum(float(r["count"]) for r in results)
  scores = {"test_loss": sum(float(r["loss"]) * float(r["count"]) for r in results) / count,
            "test_accuracy": sum(float(r["correct"]) for r in results) / count}
  if "aux_correct" in results[-1]:
    scores["test_aux_accuracy"] = sum(float(r["aux_correct"]) for r in results) / count
  return scores


def _setup(config: ClassifierConfig, log) -> Setup:  # noqa: ARG001 - the runner's setup signature
  """The classifier's part of a run: data, model, loss, optimizer, evaluation and result lines."""
  data = load_dataset(config.data, split_seed=config.split_seed, num_classes=config.num_classes)
  model_cfg = model_config(config)
  steps_per_epoch = len(data.y_train) // config.batch_size
  if steps_per_epoch < 1:
    raise JaxckptError(f"--batch-size {config.batch_size} is larger than the {len(data.y_train)} training examples")
  total_steps = steps_per_epoch * config.epochs
  patch = getattr(model_cfg, "patch_size", 1)
  if data.image_shape[0] % patch or data.image_shape[1] % patch:
    raise DataError(f"images of {data.source} are {data.image_shape[0]}×{data.image_shape[1]}, but the vit's "
                    f"{patch}×{patch} patches need both sides divisible by {patch}: use --model mlp or cnn, or pad them")
  loss_fn = jaxckpt.models.classification_loss
  if config.aux_task is not None:
    loss_fn = multitask_loss(config.aux_task, _aux_weight(config))

  def make_model(policy=None):
    model = build_model(config.model, model_cfg, image_shape=data.image_shape, num_classes=data.num_classes,
                        policy=policy, seed=config.seed)
    if config.aux_task is not None:
      model = MultiTaskClassifier(model, config.aux_task, rngs=nnx.Rngs(config.seed + 1))
    return model

  warmup = min(int(config.warmup_epochs * steps_per_epoch), total_steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, total_steps + 1)

  def report(final: Mapping[str, float], history: Mapping[str, list[float]]) -> tuple[dict[str, Any], list[str]]:
    extra = dict(model=config.model, preset=config.preset, scan=model_cfg.scan, structure=model_cfg.structure,
                 compute_dtype=model_cfg.compute_dtype, test_accuracy=final["test_accuracy"],
                 test_accuracy_per_epoch=history.get("test_accuracy", []), aux_task=config.aux_task,
                 aux_weight=_aux_weight(config) if config.aux_task else None,
                 test_aux_accuracy=final.get("test_aux_accuracy"), data=data.source)
    lines = [f"test accuracy {final['test_accuracy']:.4f}"]
    if config.aux_task is not None:
      lines.insert(0, f"auxiliary task {config.aux_task}: test accuracy {final['test_aux_accuracy']:.4f}")
    return extra, lines

  ignore = ("data",) + (("num_classes",) if config.num_classes is None else ())
  return Setup(
      model=config.model, preset=config.preset, make_model=make_model, loss_fn=loss_fn,
      tx=optax.adamw(schedule, weight_decay=config.weight_decay),
      batch_at=functools.partial(_train_batch, data, batch_size=config.batch_size, seed=config.seed),
      batch_size=config.batch_size, total_steps=total_steps, eval_every=steps_per_epoch,
      eval_batches=list(eval_batches(data.x_test, data.y_test, batch_size=config.batch_size)), score=_score,
      identity=run_identity(config, model_cfg, ignore=ignore, data=data.source),
      headline=(f"model {config.model} ({config.preset}, {'scanned' if model_cfg.scan else 'unrolled'} layers, "
                f"structure {model_cfg.structure}, "
                f"{model_cfg.compute_dtype}); data {data.source}: {len(data.y_train)} train / {len(data.y_test)} "
                f"test, {data.num_classes} classes"),
      nan_hints="extreme values in the data",
      report=report,
  )


def train(config: ClassifierConfig, *, log=print) -> ClassifierResult:
  """Trains and evaluates one classifier run: :func:`experiments.runner.run` with the classifier's parts.

  Args:
    config: the run.
    log: where progress lines go (``print`` on the CLI).

  Returns:
    :class:`ClassifierResult` with ``metrics`` = the contents of metrics.json: the shared keys of
    :func:`experiments.outputs.run_metrics` and ``model``, ``preset``, ``test_accuracy`` (0–1),
    ``test_accuracy_per_epoch``, ``aux_task``, ``aux_weight``, ``test_aux_accuracy``, ``data``, …

  Raises:
    DataError: a bad ``--data`` file (labels leaving inferred classes empty included); the others of
      :func:`experiments.runner.run`.
  """
  return run(autofit(config, functools.partial(fit_target, config), log=log), check=_check, setup=_setup, log=log)


def fit_target(config: ClassifierConfig, batch_size: int) -> ModelTarget:
  """The run's model, loss and a batch of ``batch_size`` examples ``{"x": [B, H, W, C] float32, "y": [B] int32}``,
  as shapes (for the fit planner, :mod:`experiments.autofit`)."""
  data = load_dataset(config.data, split_seed=config.split_seed, num_classes=config.num_classes)
  model_cfg = model_config(config)
  loss_fn = jaxckpt.models.classification_loss if config.aux_task is None else multitask_loss(config.aux_task,
                                                                                       _aux_weight(config))

  def make_model():
    model = build_model(config.model, model_cfg, image_shape=data.image_shape, num_classes=data.num_classes,
                        seed=config.seed)
    if config.aux_task is not None:
      model = MultiTaskClassifier(model, config.aux_task, rngs=nnx.Rngs(config.seed + 1))
    return model

  batch = MODELS[config.model].batch(batch_size, model_cfg, image_shape=data.image_shape,
                                     num_classes=data.num_classes)
  return ModelTarget(make_model=make_model, batch=batch, loss_fn=loss_fn, name=config.model, preset=config.preset)


def _train_batch(data, step: int, *, batch_size: int, seed: int):
  return train_batch(data, step, batch_size=batch_size, seed=seed)  # looked up at call time (tests patch it)


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser (flags map one-to-one onto :class:`ClassifierConfig` fields)."""
  defaults = ClassifierConfig()
  parser = CLIParser(
      prog="python -m experiments.classifier",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=reference_epilog(models=tuple(MODELS), examples=[
          "python -m experiments.classifier --policy dots_saveable",
          "python -m experiments.classifier --policy attn=save_only_these_names:qkv,mlp=full --no-scan",
          "python -m experiments.classifier --aux-task parity --mesh data=4,fsdp=2   # 8 devices",
          "python -m experiments.classifier --mesh data=8 --coordinator host0:12345 --num-processes 2 --process-id 0"]),
  )
  parser.add_argument("--model", choices=list(MODELS), default=defaults.model, help="model (default %(default)s)")
  parser.add_argument("--preset", default=defaults.preset, help="model preset: tiny or small (default %(default)s)")
  add_policy_flags(parser)
  parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                      help="scan over layers (default) or --no-scan to unroll them")
  parser.add_argument("--structure", default=defaults.structure,
                      help="checkpoint structure of the layer stack: block (default), every:K, nested, nested:D")
  parser.add_argument("--layers", type=int, dest="num_layers", default=None, help="override the preset's depth")
  parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default=defaults.compute_dtype,
                      help="dtype of activations and matmuls (parameters stay float32; default %(default)s)")
  parser.add_argument("--epochs", type=int, default=defaults.epochs,
                      help="passes over the training set (default %(default)s)")
  parser.add_argument("--batch-size", type=batch_size_flag, default=defaults.batch_size,
                      help="examples per step (default %(default)s), or auto: the largest that fits --memory")
  parser.add_argument("--grad-accum-steps", type=int, default=defaults.grad_accum_steps,
                      help="split each batch into N micro-batches, one update (must divide --batch-size)")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                      help="AdamW's peak learning rate: warm-up, then cosine decay (default %(default)s)")
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                      help="AdamW's decoupled weight decay (default %(default)s)")
  parser.add_argument("--seed", type=int, default=defaults.seed,
                      help="seed of the parameters, dropout and batch order (default %(default)s)")
  parser.add_argument("--split-seed", type=int, default=defaults.split_seed, help="seed of the train/test split")
  parser.add_argument("--data", default=None, help="FILE.npz with x: [N,H,W(,C)] float, y: [N] int (default digits)")
  parser.add_argument("--num-classes", type=int, default=None, metavar="K",
                      help="classes of --data: labels in 0..K-1, classes without examples allowed (default: inferred "
                           "as max label + 1, and every class must have an example)")
  parser.add_argument("--aux-task", choices=list(AUX_TASKS), default=None,
                      help="multi-task: a second linear head on the same features; "
                           + "; ".join(f"{t.name}: {t.description}" for t in AUX_TASKS.values()))
  parser.add_argument("--aux-weight", type=float, default=defaults.aux_weight,
                      help=f"λ in loss = CE_main + λ·CE_aux, with --aux-task (default {DEFAULT_AUX_WEIGHT})")
  add_run_flags(parser)
  return parser


main = command(build_parser, ClassifierConfig, train)
"""CLI entry point ``main(argv=None) -> exit status`` (:func:`experiments.flags.command`)."""


if __name__ == "__main__":
  exit_with(main())
