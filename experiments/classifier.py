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
from collections.abc import Sequence
from typing import Any

import jax
import optax
from flax import nnx

import jaxckpt
from experiments.data import eval_batches, load_dataset, train_batch
from experiments.loop import (
    CLIParser,
    RunOptions,
    add_policy_flags,
    add_run_flags,
    check_seeds,
    compile_and_describe,
    plan_budget,
    resolve_policy,
    run_cli,
    run_metrics,
    setup_placement,
    train_loop,
    write_metrics,
)
from jaxckpt.errors import DataError, JaxckptError
from jaxckpt.models import COMPUTE_DTYPES, MODELS, build_model
from jaxckpt.multitask import AUX_TASKS, MultiTaskClassifier, aux_task, multitask_loss
from jaxckpt.structure import parse_structure

__all__ = ["ClassifierConfig", "ClassifierResult", "train", "main", "build_parser"]


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
  """One classifier run. Model fields not set here come from the preset."""

  model: str = "vit"  # A key of jaxckpt.models.MODELS: vit, mlp, cnn.
  preset: str = "small"  # A preset of that model: tiny (seconds, for tests) or small.
  policy: str | None = None  # Policy spec (jaxckpt.parse_policy grammar).
  gradient_checkpointing: bool | None = None  # Hugging Face-style switch: True = policy full, False = none.
  scan: bool | None = None  # Scan over layers (True) or unroll (False); None keeps the preset's (scan).
  structure: str = "block"  # Checkpoint structure of the layer stack: block, every:K, nested, nested:D.
  num_layers: int | None = None  # Overrides the preset's depth.
  compute_dtype: str = "float32"  # float32 or bfloat16 (parameters stay float32).
  epochs: int = 30
  batch_size: int = 64  # Examples per step; the last partial training batch of an epoch is dropped.
  grad_accum_steps: int = 1  # Micro-batches per step (gradients averaged, one update); must divide batch_size.
  learning_rate: float = 2e-3  # Peak AdamW learning rate (warmup then cosine decay).
  weight_decay: float = 1e-4
  warmup_epochs: float = 2.0
  seed: int = 0  # Initialisation, data order and dropout.
  split_seed: int = 0  # The fixed train/test split.
  data: str | None = None  # .npz file with x and y; None = scikit-learn's digits.
  aux_task: str | None = None  # Auxiliary head (jaxckpt.multitask.AUX_TASKS, e.g. "parity"); None = single task.
  aux_weight: float | None = None  # λ in loss = CE_main + λ · CE_aux; None = DEFAULT_AUX_WEIGHT (needs aux_task).
  out: str | None = None  # Directory for metrics.json.
  ckpt_dir: str | None = None  # orbax checkpoint directory; None = no checkpoints.
  ckpt_every: int = 100  # Save every this many steps (and at the end).
  resume: bool = False  # Continue from the latest checkpoint in ckpt_dir.
  allow_config_change: bool = False  # Resume even if the checkpoint's run config differs (warns).
  nan_policy: str = "stop"  # On a NaN/Inf loss or gradient: "stop" (keep the last good checkpoint) or "skip" the update.
  progress: bool = True  # Show a progress bar.
  mesh: str | None = None  # Device mesh "data=4,fsdp=2" (jaxckpt.sharding); None = one device.
  coordinator: str | None = None  # HOST:PORT of process 0 (multi-process, jax.distributed); None = one process.
  num_processes: int = 1  # Processes of a multi-process run.
  process_id: int = 0  # This process, 0..num_processes-1.


@dataclasses.dataclass(frozen=True)
class ClassifierResult:
  """What :func:`train` returns: the metrics (as written to metrics.json) and the final train state."""

  metrics: dict[str, Any]
  state: jaxckpt.TrainState


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


def _run_identity(config: ClassifierConfig, model_cfg: Any, source: str) -> dict[str, Any]:
  """The config fields a resumed run must share with the saved one (the policy may change: remat keeps numbers)."""
  identity = {k: v for k, v in dataclasses.asdict(config).items()
              if k not in ("policy", "gradient_checkpointing", "scan", "structure", "out", "ckpt_dir", "ckpt_every",
                           "resume", "progress", "data", "allow_config_change", "nan_policy", "mesh",
                           "coordinator", "num_processes", "process_id")}
  identity["model_config"] = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in ("scan", "structure")}
  identity["data"] = source
  return identity


def _evaluate(eval_step, state, *, data, batch_size: int, place=lambda b: b) -> dict[str, float]:
  correct = count = loss_sum = aux_correct = 0.0
  for batch in eval_batches(data.x_test, data.y_test, batch_size=batch_size):
    metrics = eval_step(state, place(batch))
    correct += float(metrics["correct"])
    count += float(metrics["count"])
    loss_sum += float(metrics["loss"]) * float(metrics["count"])
    aux_correct += float(metrics.get("aux_correct", 0.0))
  scores = {"test_loss": loss_sum / count, "test_accuracy": correct / count}
  if "aux_correct" in metrics:
    scores["test_aux_accuracy"] = aux_correct / count
  return scores


def train(config: ClassifierConfig, *, log=print) -> ClassifierResult:
  """Trains and evaluates one classifier run.

  Args:
    config: the run.
    log: where progress lines go (``print`` on the CLI).

  Returns:
    :class:`ClassifierResult` with ``metrics`` = the contents of metrics.json: ``schema_version``, ``policy``
    (canonical spec), ``model``, ``preset``, ``test_accuracy`` (0–1), ``train_loss`` (one mean per epoch),
    ``step_time_s`` (median seconds per step over this process's steps after the first), ``memory`` (bytes, see
    :mod:`jaxckpt.schema`), ``backend``, ``versions``, ``warnings``, ``params_sha256``, …

  Raises:
    JaxckptError: bad config values; PolicySpecError for a bad policy; DataError for a bad ``--data`` file;
      CheckpointError for a checkpoint directory that holds another run or would be overwritten;
      NonFiniteLossError for a NaN/Inf loss with ``nan_policy="stop"``.
  """
  _check(config)
  check_seeds(config)
  options = RunOptions.of(config)
  options.check()
  placement = setup_placement(options)  # before anything touches a device
  placement.check_batch_size(config.batch_size)
  spec = resolve_policy(config.policy, config.gradient_checkpointing)
  data = load_dataset(config.data, split_seed=config.split_seed)
  model_cfg = model_config(config)
  steps_per_epoch = len(data.y_train) // config.batch_size
  if steps_per_epoch < 1:
    raise JaxckptError(f"--batch-size {config.batch_size} is larger than the {len(data.y_train)} training examples")
  total_steps = steps_per_epoch * config.epochs
  patch = getattr(model_cfg, "patch_size", 1)
  if data.image_shape[0] % patch or data.image_shape[1] % patch:
    raise DataError(f"images of {data.source} are {data.image_shape[0]}×{data.image_shape[1]}, but the vit's "
                    f"{patch}×{patch} patches need both sides divisible by {patch}: use --model mlp or cnn, or pad them")
  budget = isinstance(spec, jaxckpt.policies.Budget)
  placement.check_policy(spec)
  loss_fn = jaxckpt.classification_loss
  if config.aux_task is not None:
    loss_fn = multitask_loss(config.aux_task, _aux_weight(config))

  def make_model(policy=None):
    model = build_model(config.model, model_cfg, image_shape=data.image_shape, num_classes=data.num_classes,
                        policy=policy, seed=config.seed)
    if config.aux_task is not None:
      model = MultiTaskClassifier(model, config.aux_task, rngs=nnx.Rngs(config.seed + 1))
    return model

  model = make_model(None if budget else spec)
  warmup = min(int(config.warmup_epochs * steps_per_epoch), total_steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, total_steps + 1)
  tx = optax.adamw(schedule, weight_decay=config.weight_decay)
  batch_at = functools.partial(_train_batch, data, batch_size=config.batch_size, seed=config.seed)
  spec, plan = plan_budget(spec, make_model=make_model, batch=batch_at(0), loss_fn=loss_fn, tx=tx,
                           grad_accum_steps=config.grad_accum_steps, name=config.model, preset=config.preset, log=log)
  jaxckpt.set_policy(model, spec)
  graphdef, state = jaxckpt.create_train_state(model, tx, seed=config.seed)
  state = placement.state(state, model)

  batch_at, example, shardings = placement.batches(batch_at, state, model)
  del model
  compiled = compile_and_describe(
      jaxckpt.make_train_step(graphdef, tx, placement.loss(loss_fn), skip_nonfinite=config.nan_policy == "skip",
                              grad_accum_steps=config.grad_accum_steps),
      state, example, shardings=shardings,
      graphdef=graphdef, spec=spec, log=log,
      headline=(f"model {config.model} ({config.preset}, {'scanned' if model_cfg.scan else 'unrolled'} layers, "
                f"structure {model_cfg.structure}, "
                f"{model_cfg.compute_dtype}); data {data.source}: {len(data.y_train)} train / {len(data.y_test)} "
                f"test, {data.num_classes} classes"),
  )
  eval_step = jax.jit(jaxckpt.make_eval_step(graphdef, loss_fn))
  evaluate = functools.partial(_evaluate, eval_step, data=data, batch_size=config.batch_size, place=placement.batch)
  loop = train_loop(
      compiled.fn, state, batch_at=batch_at, total_steps=total_steps, eval_every=steps_per_epoch,
      evaluate=evaluate, identity=_run_identity(config, model_cfg, data.source), options=options, log=log,
      nan_hints=(f"a learning rate too high (--learning-rate {config.learning_rate}), bfloat16 overflow "
                 f"(--compute-dtype {config.compute_dtype}; try float32), or extreme values in the data"),
  )
  final = evaluate(loop.state)
  accuracy = final["test_accuracy"]
  metrics = run_metrics(
      spec=spec, compiled=compiled, loop=loop, total_steps=total_steps,
      model=config.model, preset=config.preset, scan=model_cfg.scan, structure=model_cfg.structure,
      compute_dtype=model_cfg.compute_dtype,
      test_accuracy=accuracy, test_accuracy_per_epoch=loop.history.get("test_accuracy", []),
      aux_task=config.aux_task, aux_weight=_aux_weight(config) if config.aux_task else None,
      test_aux_accuracy=final.get("test_aux_accuracy"),
      **placement.describe(),
      data=data.source, config=dataclasses.asdict(config), plan=plan,
  )
  step_time = metrics["step_time_s"]
  if config.aux_task is not None:
    log(f"auxiliary task {config.aux_task}: test accuracy {final['test_aux_accuracy']:.4f}")
  log(f"test accuracy {accuracy:.4f}; median step time "
      f"{'n/a' if step_time is None else f'{step_time * 1e3:.1f} ms'} over {max(len(loop.step_times) - 1, 1)} steps")
  write_metrics(config.out, metrics, log)
  return ClassifierResult(metrics, loop.state)


def _train_batch(data, step: int, *, batch_size: int, seed: int):
  return train_batch(data, step, batch_size=batch_size, seed=seed)  # looked up at call time (tests patch it)


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser (flags map one-to-one onto :class:`ClassifierConfig` fields)."""
  defaults = ClassifierConfig()
  blocks = "; ".join(f"{name}: {', '.join(entry.block_types)}" for name, entry in MODELS.items())
  parser = CLIParser(
      prog="python -m experiments.classifier",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=(
          "policy grammar:\n"
          "  spec      := block_map | policy\n"
          "  block_map := block \"=\" policy (\",\" block \"=\" policy)*   # attn=dots_saveable,mlp=full,default=none\n"
          "  policy    := name [\":\" args]\n"
          "  args      := names | names \"/\" names                     # save_only_these_names:qkv+attn_out\n"
          "  names     := [name (\"+\" name)*]\n"
          f"policies: {', '.join(jaxckpt.POLICY_NAMES)}\n"
          f"block types per model: {blocks}\n"
          f"checkpoint names: {', '.join(jaxckpt.names.ALL_NAMES)}\n"
          "examples:\n"
          "  python -m experiments.classifier --policy dots_saveable\n"
          "  python -m experiments.classifier --policy attn=save_only_these_names:qkv,mlp=full --no-scan\n"
          "  python -m experiments.classifier --aux-task parity --mesh data=4,fsdp=2   # 8 devices\n"
          "  python -m experiments.classifier --mesh data=8 --coordinator host0:12345 --num-processes 2 --process-id 0"
      ),
  )
  parser.add_argument("--model", choices=list(MODELS), default=defaults.model, help="model (default %(default)s)")
  parser.add_argument("--preset", default=defaults.preset, help="model preset: tiny or small (default %(default)s)")
  add_policy_flags(parser)
  parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                      help="scan over layers (default) or --no-scan to unroll them")
  parser.add_argument("--structure", default=defaults.structure,
                      help="checkpoint structure of the layer stack: block (default), every:K, nested, nested:D")
  parser.add_argument("--layers", type=int, dest="num_layers", default=None, help="override the preset's depth")
  parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default=defaults.compute_dtype)
  parser.add_argument("--epochs", type=int, default=defaults.epochs)
  parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
  parser.add_argument("--grad-accum-steps", type=int, default=defaults.grad_accum_steps,
                      help="split each batch into N micro-batches, one update (must divide --batch-size)")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--split-seed", type=int, default=defaults.split_seed, help="seed of the train/test split")
  parser.add_argument("--data", default=None, help="FILE.npz with x: [N,H,W(,C)] float, y: [N] int (default digits)")
  parser.add_argument("--aux-task", choices=list(AUX_TASKS), default=None,
                      help="multi-task: a second linear head on the same features; "
                           + "; ".join(f"{t.name}: {t.description}" for t in AUX_TASKS.values()))
  parser.add_argument("--aux-weight", type=float, default=defaults.aux_weight,
                      help=f"λ in loss = CE_main + λ·CE_aux, with --aux-task (default {DEFAULT_AUX_WEIGHT})")
  add_run_flags(parser, RunOptions.of(defaults))
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 bad input, 1 non-finite loss, each with a one-line message)."""
  return run_cli(build_parser(), lambda args: ClassifierConfig(**vars(args)), train, argv)


if __name__ == "__main__":
  raise SystemExit(main())
