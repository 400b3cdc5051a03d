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
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import jaxckpt
from experiments.data import eval_batches, load_dataset, train_batch
from jaxckpt.errors import JaxckptError, NonFiniteLossError
from jaxckpt.models import COMPUTE_DTYPES, MODELS, build_model
from jaxckpt.render import memory_table, policy_summary

__all__ = ["ClassifierConfig", "ClassifierResult", "train", "main", "build_parser", "NAN_POLICIES"]

NAN_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
  """One classifier run. Model fields not set here come from the preset."""

  model: str = "vit"  # A key of jaxckpt.models.MODELS: vit, mlp, cnn.
  preset: str = "small"  # A preset of that model: tiny (seconds, for tests) or small.
  policy: str = "none"  # Policy spec (jaxckpt.parse_policy grammar).
  scan: bool | None = None  # Scan over layers (True) or unroll (False); None keeps the preset's (scan).
  num_layers: int | None = None  # Overrides the preset's depth.
  compute_dtype: str = "float32"  # float32 or bfloat16 (parameters stay float32).
  epochs: int = 30
  batch_size: int = 64  # Examples per step; the last partial training batch of an epoch is dropped.
  learning_rate: float = 2e-3  # Peak AdamW learning rate (warmup then cosine decay).
  weight_decay: float = 1e-4
  warmup_epochs: float = 2.0
  seed: int = 0  # Initialisation, data order and dropout.
  split_seed: int = 0  # The fixed train/test split.
  data: str | None = None  # .npz file with x and y; None = scikit-learn's digits.
  out: str | None = None  # Directory for metrics.json.
  ckpt_dir: str | None = None  # orbax checkpoint directory; None = no checkpoints.
  ckpt_every: int = 100  # Save every this many steps (and at the end).
  resume: bool = False  # Continue from the latest checkpoint in ckpt_dir.
  allow_config_change: bool = False  # Resume even if the checkpoint's run config differs (warns).
  nan_policy: str = "stop"  # On a NaN/Inf loss or gradient: "stop" (keep the last good checkpoint) or "skip" the update.
  progress: bool = True  # Show a progress bar.


@dataclasses.dataclass(frozen=True)
class ClassifierResult:
  """What :func:`train` returns: the metrics (as written to metrics.json) and the final train state."""

  metrics: dict[str, Any]
  state: jaxckpt.TrainState


def _check(config: ClassifierConfig) -> None:
  if config.model not in MODELS:
    raise JaxckptError(f"unknown model {config.model!r}; valid models: {', '.join(MODELS)}")
  if config.preset not in MODELS[config.model].presets:
    raise JaxckptError(
        f"unknown preset {config.preset!r} for model {config.model}; valid: {', '.join(MODELS[config.model].presets)}"
    )
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise JaxckptError(f"unknown compute dtype {config.compute_dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}")
  for name in ("epochs", "batch_size", "ckpt_every"):
    if getattr(config, name) < 1:
      raise JaxckptError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(config, name)}")
  if config.num_layers is not None and config.num_layers < 1:
    raise JaxckptError(f"--layers must be ≥ 1, got {config.num_layers}")
  if not config.learning_rate > 0:
    raise JaxckptError(f"--learning-rate must be > 0, got {config.learning_rate}")
  if config.nan_policy not in NAN_POLICIES:
    raise JaxckptError(f"unknown NaN policy {config.nan_policy!r}; valid: {', '.join(NAN_POLICIES)}")
  if config.resume and config.ckpt_dir is None:
    raise JaxckptError("--resume needs --ckpt-dir")


def model_config(config: ClassifierConfig) -> Any:
  """The model config: the preset with this run's overrides (depth, scan, compute dtype)."""
  overrides: dict[str, Any] = {"compute_dtype": config.compute_dtype}
  if config.scan is not None:
    overrides["scan"] = config.scan
  if config.num_layers is not None:
    overrides["num_layers"] = config.num_layers
  return dataclasses.replace(MODELS[config.model].presets[config.preset], **overrides)


def _run_identity(config: ClassifierConfig, model_cfg: Any, source: str) -> dict[str, Any]:
  """The config fields a resumed run must share with the saved one (the policy may change: remat keeps numbers)."""
  identity = {k: v for k, v in dataclasses.asdict(config).items()
              if k not in ("policy", "scan", "out", "ckpt_dir", "ckpt_every", "resume", "progress", "data",
                            "allow_config_change", "nan_policy")}
  identity["model_config"] = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k != "scan"}
  identity["data"] = source
  return identity


def _evaluate(eval_step, state, data, batch_size: int) -> tuple[float, float]:
  correct = count = loss_sum = 0.0
  for batch in eval_batches(data.x_test, data.y_test, batch_size=batch_size):
    metrics = jax.device_get(eval_step(state, batch))
    correct += float(metrics["correct"])
    count += float(metrics["count"])
    loss_sum += float(metrics["loss"]) * float(metrics["count"])
  return correct / count, loss_sum / count


def train(config: ClassifierConfig, *, log=print) -> ClassifierResult:
  """Trains and evaluates one classifier run.

  Args:
    config: the run.
    log: where progress lines go (``print`` on the CLI).

  Returns:
    :class:`ClassifierResult` with ``metrics`` = the contents of metrics.json: ``schema_version``, ``policy``
    (canonical spec), ``model``, ``preset``, ``test_accuracy`` (0–1), ``train_loss`` (one mean per epoch),
    ``step_time_s`` (median seconds per step over this process's steps after the first), ``memory`` (bytes, see
    :mod:`jaxckpt.schema`), ``backend``, ``versions``, ``warnings``, …

  Raises:
    JaxckptError: bad config values; PolicySpecError for a bad policy; DataError for a bad ``--data`` file;
      CheckpointError for a checkpoint directory that holds another run or would be overwritten.
  """
  _check(config)
  spec = jaxckpt.parse_policy(config.policy)
  data = load_dataset(config.data, split_seed=config.split_seed)
  model_cfg = model_config(config)
  steps_per_epoch = len(data.y_train) // config.batch_size
  if steps_per_epoch < 1:
    raise JaxckptError(f"--batch-size {config.batch_size} is larger than the {len(data.y_train)} training examples")
  total_steps = steps_per_epoch * config.epochs
  model = build_model(config.model, model_cfg, image_shape=data.image_shape, num_classes=data.num_classes,
                      policy=spec, seed=config.seed)
  warmup = min(int(config.warmup_epochs * steps_per_epoch), total_steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, total_steps + 1)
  tx = optax.adamw(schedule, weight_decay=config.weight_decay)
  graphdef, state = jaxckpt.create_train_state(model, tx, seed=config.seed)
  del model

  example = train_batch(data, 0, batch_size=config.batch_size, seed=config.seed)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    started = time.perf_counter()
    step_fn = jaxckpt.compile_train_step(
        jaxckpt.make_train_step(graphdef, tx, skip_nonfinite=config.nan_policy == "skip"), state, example
    )
    compile_s = time.perf_counter() - started
  run_warnings = [str(w.message) for w in caught]
  for message in run_warnings:
    log(f"warning: {message}")
  memory = jaxckpt.memory_stats(step_fn)
  types = jaxckpt.block_types(nnx.merge(graphdef, state.params, state.other))
  log(f"model {config.model} ({config.preset}, {'scanned' if model_cfg.scan else 'unrolled'} layers, "
      f"{model_cfg.compute_dtype}); data {data.source}: {len(data.y_train)} train / {len(data.y_test)} test, "
      f"{data.num_classes} classes")
  log(f"policy {spec}: {policy_summary(spec, types)}")
  log(memory_table(memory))
  log(f"compiled in {compile_s:.1f} s on {jax.default_backend()} "
      f"(compiler options {jaxckpt.remat_compiler_options() or 'none'})")
  eval_step = jax.jit(jaxckpt.make_eval_step(graphdef))

  history: dict[str, list[float]] = {"train_loss": [], "test_accuracy": []}
  checkpointer = None
  epoch_losses_restored: list[float] = []
  if config.ckpt_dir is not None:
    checkpointer = jaxckpt.Checkpointer(config.ckpt_dir, config=_run_identity(config, model_cfg, data.source),
                                        save_every=config.ckpt_every, resume=config.resume,
                                        allow_config_change=config.allow_config_change)
    state, meta = checkpointer.restore(state)
    for message in checkpointer.warnings:
      log(f"warning: {message}")
      run_warnings.append(message)
    history.update({k: list(meta[k]) for k in history if k in meta})
    epoch_losses_restored = list(meta.get("epoch_losses", []))
    if checkpointer.latest_step is not None:
      log(f"resumed from step {checkpointer.latest_step} in {checkpointer.directory}")
    elif config.resume:
      log(f"no checkpoint in {checkpointer.directory}: starting a new run")

  start = int(jax.device_get(state.step))
  step_times: list[float] = []
  skipped: list[int] = []
  epoch_losses: list[float] = epoch_losses_restored
  bar = tqdm(total=total_steps, initial=start, disable=not config.progress, unit="step", leave=False)
  try:
    for step in range(start, total_steps):
      batch = train_batch(data, step, batch_size=config.batch_size, seed=config.seed)
      began = time.perf_counter()
      state, metrics = step_fn(state, batch)
      loss = float(metrics["loss"])  # waits for the step: the timing covers its compute
      step_times.append(time.perf_counter() - began)
      if not bool(metrics["finite"]):
        if config.nan_policy == "stop":
          raise NonFiniteLossError(_nonfinite_message(config, step, loss, checkpointer), step=step)
        skipped.append(step)
        (bar.write if config.progress else log)(f"warning: non-finite loss or gradient at step {step}: update skipped")
      epoch_losses.append(loss)
      bar.update(1)
      bar.set_postfix(loss=f"{loss:.4f}")
      if (step + 1) % steps_per_epoch == 0:
        epoch = (step + 1) // steps_per_epoch
        accuracy, test_loss = _evaluate(eval_step, state, data, config.batch_size)
        history["train_loss"].append(float(np.mean(epoch_losses)))
        history["test_accuracy"].append(accuracy)
        epoch_losses = []
        line = (f"epoch {epoch}/{config.epochs}: train loss {history['train_loss'][-1]:.4f}, "
                f"test loss {test_loss:.4f}, test accuracy {accuracy:.4f}")
        (bar.write if config.progress else log)(line)
      if checkpointer is not None:
        # The partial epoch's losses travel with the checkpoint, so a resumed run reports the same epoch means.
        checkpointer.maybe_save(step + 1, state, meta={**history, "epoch_losses": epoch_losses},
                                force=step + 1 == total_steps)
  finally:
    bar.close()
    if checkpointer is not None:
      checkpointer.close()

  accuracy, _ = _evaluate(eval_step, state, data, config.batch_size)
  timed = step_times[1:] or step_times
  step_time = float(np.median(timed)) if timed else None
  metrics_out = {
      "schema_version": jaxckpt.SCHEMA_VERSION,
      "policy": str(spec),
      "policy_per_block": {block: str(spec.for_block(block)) for block in types},
      "model": config.model,
      "preset": config.preset,
      "scan": model_cfg.scan,
      "compute_dtype": model_cfg.compute_dtype,
      "test_accuracy": accuracy,
      "train_loss": history["train_loss"],
      "test_accuracy_per_epoch": history["test_accuracy"],
      "step_time_s": step_time,
      "compile_s": compile_s,
      "steps": total_steps,
      "memory": memory,
      "backend": jax.default_backend(),
      "compiler_options": jaxckpt.remat_compiler_options(),
      "versions": jaxckpt.versions(),
      "warnings": run_warnings,
      "skipped_steps": skipped,
      "params_sha256": params_digest(state.params),
      "data": data.source,
      "config": dataclasses.asdict(config),
  }
  log(f"test accuracy {accuracy:.4f}; median step time "
      f"{'n/a' if step_time is None else f'{step_time * 1e3:.1f} ms'} over {len(timed)} steps")
  if config.out is not None:
    os.makedirs(config.out, exist_ok=True)
    path = os.path.join(config.out, "metrics.json")
    with open(path, "w") as f:
      json.dump(metrics_out, f, indent=2)
    log(f"wrote {path}")
  return ClassifierResult(metrics_out, state)


def params_digest(params: Any) -> str:
  """SHA-256 of every parameter's bytes, in tree order: equal digests = bit-identical parameters."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


def _nonfinite_message(config: ClassifierConfig, step: int, loss: float, checkpointer) -> str:
  kept = "no checkpoint was written (no --ckpt-dir)"
  if checkpointer is not None:
    latest = checkpointer.latest_saved_step()
    kept = (f"the last good checkpoint (step {latest}) is kept in {checkpointer.directory}" if latest is not None
            else f"no checkpoint had been saved yet in {checkpointer.directory}")
  return (f"non-finite loss or gradient at step {step} (loss {loss}); likely causes: a learning rate too high "
          f"(--learning-rate {config.learning_rate}), bfloat16 overflow (--compute-dtype {config.compute_dtype}; "
          f"try float32), or extreme values in the data; {kept}; --nan-policy skip drops such updates instead")


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors (exit 2, no usage dump)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser (flags map one-to-one onto :class:`ClassifierConfig` fields)."""
  defaults = ClassifierConfig()
  blocks = "; ".join(f"{name}: {', '.join(entry.block_types)}" for name, entry in MODELS.items())
  parser = _Parser(
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
          "  python -m experiments.classifier --policy attn=save_only_these_names:qkv,mlp=full --no-scan"
      ),
  )
  parser.add_argument("--model", choices=list(MODELS), default=defaults.model, help="model (default %(default)s)")
  parser.add_argument("--preset", default=defaults.preset, help="model preset: tiny or small (default %(default)s)")
  parser.add_argument("--policy", default=defaults.policy, help="remat policy spec (grammar below; default none)")
  parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                      help="scan over layers (default) or --no-scan to unroll them")
  parser.add_argument("--layers", type=int, dest="num_layers", default=None, help="override the preset's depth")
  parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default=defaults.compute_dtype)
  parser.add_argument("--epochs", type=int, default=defaults.epochs)
  parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--split-seed", type=int, default=defaults.split_seed, help="seed of the train/test split")
  parser.add_argument("--data", default=None, help="FILE.npz with x: [N,H,W(,C)] float, y: [N] int (default digits)")
  parser.add_argument("--out", default=None, help="directory for metrics.json")
  parser.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory")
  parser.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help="save every N steps")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
  parser.add_argument("--allow-config-change", action="store_true",
                      help="resume even if the checkpoint's run config differs (the differences are printed)")
  parser.add_argument("--nan-policy", choices=NAN_POLICIES, default=defaults.nan_policy,
                      help="on a NaN/Inf loss: stop (default; the last good checkpoint is kept) or skip the update")
  parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; returns the exit status (2 for bad input, with a one-line message)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  config = ClassifierConfig(**vars(args))
  try:
    train(config)
  except NonFiniteLossError as err:  # a failed run, not bad input
    print(f"{parser.prog}: error: {err}", file=sys.stderr)
    return 1
  except JaxckptError as err:
    print(f"{parser.prog}: error: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
