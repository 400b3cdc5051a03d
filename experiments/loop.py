"""The training loop every experiment shares: steps, evaluation periods, checkpoints, NaNs and signals.

The loop is deterministic by step (the caller's ``batch_at(step)`` and the train step's ``fold_in(key, step)``), saves
orbax checkpoints through :class:`jaxckpt.TrainStateSaver` with the metric history beside them, resumes
bit-identically, handles non-finite losses by ``nan_policy``, and stops cleanly on SIGINT/SIGTERM
(:func:`stop_on_signals`): a save in flight completes first, and :class:`RunInterrupted` says where the run got to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

import jaxckpt
from jaxckpt.profile import profile_trace
from experiments.options import RunOptions
from jaxckpt.errors import NonFiniteLossError

__all__ = ["LoopResult", "train_loop", "RunInterrupted", "SignalGuard", "stop_on_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run cleanly (Ctrl-C; ``kill``, schedulers, container stops)."""


class RunInterrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM stopped the run; a ``KeyboardInterrupt``, so ``except Exception`` does not swallow it.

  Attributes:
    signum: the signal received.
    step: steps completed when it stopped (the state's step count), or ``None`` before training began.
    checkpoint: the newest complete checkpoint step on disk, or ``None``.
    ckpt_dir: the checkpoint directory, or ``None`` without ``--ckpt-dir``.
    total_steps: the run's length, or ``None`` when not known yet.
  """

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.step: int | None = None
    self.checkpoint: int | None = None
    self.ckpt_dir: str | None = None
    self.total_steps: int | None = None

  @property
  def exit_code(self) -> int:
    """The shell's convention: 128 + signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + self.signum


class SignalGuard:
  """Turns SIGINT/SIGTERM into :class:`RunInterrupted`, held back while a save is in flight (:meth:`saving`).

  The handler raises where the main thread is; where that is a garbage-collector or ``__del__`` callback, Python
  prints and drops the exception, so the signal is also remembered and :meth:`check` (called every step) raises it.
  """

  def __init__(self):
    self._saving = False
    self._pending: int | None = None

  def handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
    """The signal handler: raise now, or after the save in flight."""
    self._pending = signum
    if not self._saving:
      raise RunInterrupted(signum)

  def check(self) -> None:
    """Raises :class:`RunInterrupted` for a signal received and not raised yet (or raised and dropped)."""
    if self._pending is not None and not self._saving:
      raise RunInterrupted(self._pending)

  @contextlib.contextmanager
  def saving(self) -> Iterator[None]:
    """Holds signals back while the body (an orbax save) runs; one that arrived is raised after it completes."""
    self._saving = True
    try:
      yield
    finally:
      self._saving = False
    self.check()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[SignalGuard | None]:
  """Installs :class:`SignalGuard`'s handler for SIGINT and SIGTERM for the body, restoring the old ones after.

  Yields:
    The guard, or ``None`` off the main thread (Python delivers signals to the main thread only).
  """
  if threading.current_thread() is not threading.main_thread():
    yield None
    return
  guard = SignalGuard()
  previous = {sig: signal.signal(sig, guard.handle) for sig in SIGNALS}
  try:
    yield guard
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


@dataclasses.dataclass
class LoopResult:
  """The state after training and what the loop recorded.

  Attributes:
    state: final train state.
    history: ``{"train_loss": [...], <eval metric>: [...]}``, one entry per evaluation period.
    step_times: seconds per step run in this process (each waits for its step to finish).
    skipped: steps whose update was dropped (``nan_policy="skip"``).
    warnings: lines the user should hear about (checkpoint clean-ups, skipped steps…).
    start_step: the step training started from (0, or the checkpoint resumed).
  """

  state: Any
  history: dict[str, list[float]]
  step_times: list[float]
  skipped: list[int]
  warnings: list[str]
  start_step: int = 0

  @property
  def median_step_time(self) -> float | None:
    """Median seconds per step, excluding the first step of this process (warm-up)."""
    timed = self.step_times[1:] or self.step_times
    return float(np.median(timed)) if timed else None


def _kept(checkpointer) -> str:
  """What became of the run's checkpoints, for a message that stops the run."""
  if checkpointer is None:
    return "no checkpoint was written (no --ckpt-dir)"
  latest = checkpointer.latest_saved_step()
  return (f"the last good checkpoint (step {latest}) is kept in {checkpointer.directory}" if latest is not None
          else f"no checkpoint had been saved yet in {checkpointer.directory}")


def _nonfinite_message(step: int, loss: float, hints: str, checkpointer) -> str:
  return (f"non-finite loss, gradient or updated parameter at step {step} (loss {loss}); likely causes: {hints}; "
          f"{_kept(checkpointer)}; --nan-policy skip drops such updates instead")


def _broken_model_message(steps: int, broken: Mapping[str, float], skipped: list[int], hints: str,
                          checkpointer) -> str:
  shown = ", ".join(f"{k} {v}" for k, v in broken.items())
  skipped_text = f" (updates skipped at steps {skipped[:8]}{'…' if len(skipped) > 8 else ''})" if skipped else ""
  return (f"evaluation after step {steps} is non-finite ({shown}){skipped_text}: the parameters are finite but no "
          f"longer usable, and skipping updates cannot recover them; likely causes: {hints}; {_kept(checkpointer)}")


def train_loop(
    step_fn: Callable,
    state: Any,
    *,
    batch_at: Callable[[int], Any],
    total_steps: int,
    eval_every: int,
    evaluate: Callable[[Any], Mapping[str, float]],
    identity: Mapping[str, Any],
    options: RunOptions,
    nan_hints: str,
    period: str = "epoch",
    log=print,
    signals: SignalGuard | None = None,
    profile_name: str = "run",
) -> LoopResult:
  """Runs steps ``state.step .. total_steps - 1``, evaluating every ``eval_every`` steps and checkpointing.

  Args:
    step_fn: compiled ``(state, batch) -> (state, metrics)``; metrics hold ``loss`` and ``finite``.
    state: the fresh train state (replaced by the latest checkpoint when resuming).
    batch_at: ``step -> batch``, a pure function of the step (bit-identical resumes depend on it).
    total_steps: steps of the whole run.
    eval_every: steps per evaluation period (an epoch for the classifier).
    evaluate: ``state -> {metric: float}``, appended to the history each period.
    identity: the run-defining config stored with checkpoints; a resume with another identity is refused.
    options: the shared run flags.
    nan_hints: likely causes of a NaN for this experiment, for the error message.
    period: name of an evaluation period in log lines.
    log: where lines go.
    signals: from :func:`stop_on_signals`: saves complete before a signal stops the run.
    profile_name: the run's name in ``options.profile`` (the policy): with ``--profile DIR``, steps
      ``start+1 .. start+profile_steps`` (warm: compiled, inputs allocated) are traced into ``DIR/<slug>/``
      (:func:`jaxckpt.profile.profile_trace`); their step times include the tracer's overhead.

  Returns:
    :class:`LoopResult`.

  Raises:
    NonFiniteLossError: a NaN/Inf loss, gradient or updated parameter with ``nan_policy="stop"`` (checkpoints
      before it are kept).
      Also, under either policy, a non-finite evaluation loss (parameters finite but unusable, e.g. after a huge
      learning rate): the run stops there, before that period's checkpoint.
    CheckpointError: the checkpoint directory holds another run, would be overwritten, or cannot be read.
    RunInterrupted: SIGINT/SIGTERM (with ``signals``), filled in with the step reached and the last checkpoint.
  """
  history: dict[str, list[float]] = {"train_loss": []}
  notes: list[str] = []
  period_losses: list[float] = []
  checkpointer = None
  if options.ckpt_dir is not None:
    checkpointer = jaxckpt.TrainStateSaver(options.ckpt_dir, config=identity, save_every=options.ckpt_every,
                                           resume=bool(options.resume), allow_config_change=options.allow_config_change)
    state, meta = checkpointer.restore(state)
    for message in checkpointer.warnings:
      log(f"warning: {message}")
      notes.append(message)
    history.update({k: list(v) for k, v in meta.items() if k != "period_losses"})
    period_losses = list(meta.get("period_losses", []))
    if checkpointer.latest_step is not None:
      log(f"resumed from step {checkpointer.latest_step} in {checkpointer.directory}")
    elif options.resume:
      log(f"no checkpoint in {checkpointer.directory}: starting a new run")

  start = int(jax.device_get(state.step))
  result = LoopResult(state, history, [], [], notes, start)
  reached = start  # steps whose results have been read
  periods = -(-total_steps // eval_every)
  bar = tqdm(total=total_steps, initial=start, disable=not options.progress or jax.process_index() != 0, unit="step",
             leave=False)
  say = bar.write if options.progress else log
  # One step stays in flight: step s's metrics are read (a host sync) only after step s+1 has been dispatched, so the
  # device never waits for Python (batch, progress bar). Where step s ends a period or is due for a checkpoint, its
  # metrics are read before anything else: the state after it is needed, and a NaN at s must stop before s is saved.
  pending: tuple[int, Any, float] | None = None  # (step, metrics, dispatch time) not read yet
  last_done = time.perf_counter()

  def finish(step: int, metrics: Any, began: float) -> None:
    nonlocal last_done, reached
    loss = float(metrics["loss"])  # waits for the step
    done = time.perf_counter()
    result.step_times.append(done - max(began, last_done))  # its own compute, not its wait behind the step before
    last_done = done
    if not bool(metrics["finite"]):
      if options.nan_policy == "stop":
        raise NonFiniteLossError(_nonfinite_message(step, loss, nan_hints, checkpointer), step=step)
      result.skipped.append(step)
      say(f"warning: non-finite loss, gradient or updated parameter at step {step}: update skipped")
    else:
      period_losses.append(loss)
    reached = step + 1
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

  tracing = contextlib.ExitStack()
  first_traced = start + 1
  last_traced = min(first_traced + options.profile_steps, total_steps) - 1
  try:
    for step in range(start, total_steps):
      if signals is not None:
        signals.check()
      if options.profile is not None and step == first_traced:
        if pending is not None:  # the warm-up step ends before the trace starts
          finish(*pending)
          pending = None
        run_dir = tracing.enter_context(profile_trace(options.profile, name=profile_name))
      batch = batch_at(step)
      began = time.perf_counter()
      state, metrics = step_fn(state, batch)
      if pending is not None:
        finish(*pending)
      pending = (step, metrics, began)
      if options.profile is not None and step == last_traced and step >= first_traced:
        finish(*pending)  # the traced steps end inside the trace
        pending = None
        tracing.close()
        say(f"profiled steps {first_traced}-{last_traced} into {run_dir} (xprof --logdir {options.profile})")
      ends_period = (step + 1) % eval_every == 0 or step + 1 == total_steps
      if not ends_period and (checkpointer is None or (step + 1) % options.ckpt_every):
        continue
      if pending is not None:
        finish(*pending)
        pending = None
      if ends_period:
        scores = evaluate(state)
        broken = {k: float(v) for k, v in scores.items() if "loss" in k and not math.isfinite(float(v))}
        if broken:  # the parameters themselves are broken (finite but huge): skipping later updates cannot help
          raise NonFiniteLossError(_broken_model_message(step + 1, broken, result.skipped, nan_hints, checkpointer),
                                   step=step)
        history["train_loss"].append(float(np.mean(period_losses)) if period_losses else float("nan"))
        for key, value in scores.items():
          history.setdefault(key, []).append(float(value))
        period_losses = []
        shown = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in scores.items())
        say(f"{period} {-(-(step + 1) // eval_every)}/{periods}: train loss {history['train_loss'][-1]:.4f}, {shown}")
      if checkpointer is not None:
        # The partial period's losses travel with the checkpoint, so a resumed run reports the same means.
        with signals.saving() if signals is not None else contextlib.nullcontext():
          checkpointer.maybe_save(step + 1, state, meta={**history, "period_losses": period_losses},
                                  force=step + 1 == total_steps)
  except RunInterrupted as err:
    err.step, err.total_steps = reached, total_steps
    if checkpointer is not None:
      err.ckpt_dir, err.checkpoint = checkpointer.directory, checkpointer.latest_saved_step()
    raise
  finally:
    tracing.close()
    bar.close()
    if checkpointer is not None:
      checkpointer.close()
  result.state = state
  if result.skipped:
    result.warnings.append(f"skipped the updates of {len(result.skipped)} step(s) with a non-finite loss, gradient "
                           "or updated parameter")
  return result
