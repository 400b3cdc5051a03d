"""One run of an experiment, whatever it trains: the shared skeleton the classifier and the LM fill in.

:func:`run` takes an experiment's config and two functions of its own: ``check(config)`` (its flags' values) and
``setup(config, log) -> Setup`` (its data, model, loss, optimizer, evaluation and result lines). Everything else is
here, in this order: check the run options, join the devices, hold ``--out``/``--ckpt-dir`` exclusively, resolve the
policy (planning a budget for this model), build and place the train state, compile the train step once through
the step core (:func:`jaxckpt.step.compile_policy`, as the report and the planner do) and print its memory, train
(:func:`experiments.loop.train_loop`), evaluate, and write metrics.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

import jaxckpt
from experiments.compiling import CompiledStep, compile_and_describe
from experiments.loop import RunInterrupted, stop_on_signals, train_loop
from experiments.options import check_seeds, flat_config
from experiments.outputs import closing_line, run_metrics, write_metrics
from experiments.placement import Placement, setup_placement
from experiments.policy import plan_budget, resolve_policy
from jaxckpt.errors import CheckpointError
from jaxckpt import DirectoryLock
from jaxckpt.training import check_checkpoint_directory
from jaxckpt.step import ModelTarget

__all__ = ["Setup", "RunResult", "CompiledStep", "compile_and_describe", "run", "hold_directories"]


@dataclasses.dataclass(frozen=True)
class Setup:
  """What one experiment supplies to :func:`run`: everything that differs between experiments.

  Attributes:
    model: model name (for the headline and a budget plan), e.g. ``"vit"``, ``"gpt"``.
    preset: the model preset's name.
    make_model: ``(policy or None) -> nnx.Module``, the run's model with that remat policy (the same seed each call).
    loss_fn: the train and eval loss (:data:`jaxckpt.training._train.LossFn`).
    tx: the optimizer (optax).
    batch_at: ``step -> host batch``, a pure function of the step (bit-identical resumes depend on it).
    batch_size: examples per step (checked against the mesh as ``--batch-size``).
    total_steps: steps of the whole run.
    eval_every: steps per evaluation period.
    eval_batches: the fixed host batches an evaluation runs over.
    score: ``[eval step metrics per batch] -> {metric: float}``.
    identity: the config a resumed run must share (:func:`experiments.options.run_identity`).
    headline: first line of the log (model and data).
    nan_hints: likely causes of a NaN beyond a high learning rate and bfloat16 overflow (named for every run).
    report: ``(final scores, history) -> (extra metrics.json entries, result lines)``; the last line gets the
      median step time appended.
    period: an evaluation period's name in log lines.
  """

  model: str
  preset: str
  make_model: Callable[..., Any]
  loss_fn: Callable
  tx: Any
  batch_at: Callable[[int], Any]
  batch_size: int
  total_steps: int
  eval_every: int
  eval_batches: Sequence[Any]
  score: Callable[[list[Mapping[str, Any]]], dict[str, float]]
  identity: Mapping[str, Any]
  headline: str
  report: Callable[[Mapping[str, float], Mapping[str, list[float]]], tuple[dict[str, Any], list[str]]]
  period: str = "epoch"
  nan_hints: str = ""


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What :func:`run` returns: the metrics (as written to metrics.json) and the final train state."""

  metrics: dict[str, Any]
  state: jaxckpt.TrainState


@contextlib.contextmanager
def hold_directories(directories: Mapping[str, str | None]):
  """Holds each directory (``{flag: path}``; ``None`` skipped) with :class:`jaxckpt.DirectoryLock` for the body.

  Only process 0 of a multi-process run takes the locks (all processes share the directories).

  Yields:
    Lines about stale locks taken over from runs that died holding them.

  Raises:
    DirectoryInUseError: another live run holds one of them (naming its pid, host and start time).
  """
  locks, seen = [], set()
  try:
    for flag, path in directories.items():
      if path is None or jax.process_index() != 0 or os.path.realpath(path) in seen:
        continue
      seen.add(os.path.realpath(path))
      locks.append(DirectoryLock(path, flag=flag).acquire())
    yield [f"{lock.flag} {lock.directory}: took over the lock of a run that ended without releasing it "
           f"({lock.stale})" for lock in locks if lock.stale]
  finally:
    for lock in reversed(locks):
      lock.release()


def run(config: Any, *, check: Callable[[Any], None], setup: Callable[..., Setup], log=print) -> RunResult:
  """Trains and evaluates one run of an experiment.

  Args:
    config: the experiment's config: a frozen dataclass with ``seed``, ``split_seed``, ``grad_accum_steps``,
      ``learning_rate``, ``compute_dtype`` and ``run`` (:class:`experiments.options.RunOptions`).
    check: ``config -> None``, raises :class:`JaxckptError` for bad values of the experiment's own flags.
    setup: ``(config, log) -> Setup``, loads the data and describes the model (no device work before it).
    log: where progress lines go (``print`` on the CLI).

  Returns:
    :class:`RunResult`; ``metrics`` holds the shared keys (:func:`experiments.outputs.run_metrics`), the
    experiment's (``Setup.report``), the placement's, ``config`` (flat) and ``plan``.

  Raises:
    JaxckptError: bad config values; PolicySpecError for a bad policy; DataError for bad data; CheckpointError for
      a checkpoint directory that holds another run or would be overwritten; DirectoryInUseError when another run
      holds ``--out`` or ``--ckpt-dir``; NonFiniteLossError for a NaN/Inf loss with ``nan_policy="stop"``.
    RunInterrupted: SIGINT or SIGTERM (the save in flight completes first); says the step reached and the last
      checkpoint.
  """
  options = config.run
  check(config)
  check_seeds(config)
  options.check()
  if options.ckpt_dir is not None:
    check_checkpoint_directory(options.ckpt_dir)  # before the lock writes into it
    if options.resume is True and not _saved_steps(options.ckpt_dir):
      raise CheckpointError(
          f"--resume: nothing saved in --ckpt-dir {options.ckpt_dir} (no checkpoint there); check the path, or pass "
          "--resume auto to start a new run when there is none")
  with stop_on_signals() as signals:
    try:
      placement = setup_placement(options)  # before anything touches a device
      with hold_directories({"--out": options.out, "--ckpt-dir": options.ckpt_dir}) as stale:
        for line in stale:
          log(f"note: {line}")
        return _train(config, setup, placement, signals, log)
    except RunInterrupted as err:
      if err.ckpt_dir is None and options.ckpt_dir is not None:
        err.ckpt_dir = os.path.abspath(options.ckpt_dir)
        err.checkpoint = max(_saved_steps(err.ckpt_dir), default=None)
      raise


def _saved_steps(directory: str) -> list[int]:
  """Steps with a checkpoint directory (``DIR/<step>``) in ``directory``; ``[]`` when it does not exist."""
  return [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []


def _train(config: Any, setup_fn: Callable[..., Setup], placement: Placement, signals, log) -> RunResult:
  options = config.run
  spec = resolve_policy(options.policy, options.gradient_checkpointing)
  setup = setup_fn(config, log)
  placement.check_batch_size(setup.batch_size)
  placement.check_policy(spec)
  example = setup.batch_at(0)
  target = ModelTarget(  # what the planner plans and the step core compiles: this run's model, loss and shapes
      make_model=setup.make_model, batch=jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), example),
      loss_fn=setup.loss_fn, name=setup.model, preset=setup.preset, grad_accum_steps=config.grad_accum_steps,
      skip_nonfinite=options.nan_policy == "skip", metrics=True)  # the loop reads loss, accuracy and finite
  # The boundary: the --policy text becomes a concrete policy once (budgets and min_saved planned for this model),
  # before the model is built; everything below sees a concrete policy.
  spec, plan = plan_budget(spec, target, tx=setup.tx, log=log)
  model = setup.make_model(spec)  # validates the policy against the model's blocks
  block_types = jaxckpt.block_types(model)
  graphdef, state = jaxckpt.create_train_state(model, setup.tx, seed=config.seed)
  state = placement.state(state, model)
  batch_at = placement.batches(setup.batch_at)
  del model
  compiled = compile_and_describe(target, spec, tx=setup.tx, mesh=placement.mesh, block_types=block_types,
                                  log=log, headline=setup.headline)
  eval_step = jax.jit(jaxckpt.make_eval_step(graphdef, setup.loss_fn))
  eval_batches = [placement.batch(b) for b in setup.eval_batches]

  def evaluate(state: Any) -> dict[str, float]:
    return setup.score([eval_step(state, batch) for batch in eval_batches])

  if signals is not None:
    signals.check()  # one that came during the compile and was dropped
  loop = train_loop(
      compiled.fn, state, batch_at=batch_at, total_steps=setup.total_steps, eval_every=setup.eval_every,
      evaluate=evaluate, identity=setup.identity, options=options, log=log, period=setup.period,
      signals=signals,
      profile_name=str(spec) + (f"-process{jax.process_index()}" if jax.process_count() > 1 else ""),
      nan_hints=(f"a learning rate too high (--learning-rate {config.learning_rate}), bfloat16 overflow "
                 f"(--compute-dtype {config.compute_dtype}; try float32)"
                 + (f", or {setup.nan_hints}" if setup.nan_hints else "")),
  )
  try:
    final = evaluate(loop.state)
    extra, lines = setup.report(final, loop.history)
    metrics = run_metrics(spec=spec, compiled=compiled, loop=loop, total_steps=setup.total_steps, **extra,
                          **placement.describe(), config=flat_config(config), plan=plan)
    lines = [*lines[:-1], closing_line(lines[-1], loop, total_steps=setup.total_steps, ckpt_dir=options.ckpt_dir)]
    for line in lines:
      log(line)
    write_metrics(options.out, metrics, log)
  except RunInterrupted as err:  # after training: every step is done (and saved, with --ckpt-dir)
    err.step = err.total_steps = setup.total_steps
    raise
  return RunResult(metrics, loop.state)
