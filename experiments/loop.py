"""The training loop every experiment shares: steps, evaluation periods, checkpoints, NaNs and signals.

The loop is deterministic by step (the caller's ``batch_at(step)`` and the train step's ``fold_in(key, step)``), saves
orbax checkpoints through :class:`jaxckpt.TrainStateSaver` with the metric history beside them, resumes
bit-identically, handles non-finite losses by ``nan_policy``, and stops cleanly on SIGINT/SIGTERM
(:func:`stop_on_signals`): a save in flight completes first, and :class:`RunInterrupted` says where the run got to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
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
from jaxckpt.training import profile_trace
from experiments.options import RunOptions
from jaxckpt.errors import NonFiniteLossError

__all__ = ["LoopResult", "train_loop", "RunInterrupted", "SignalGuard", "stop_on_signals", "Saving", "NaNGuard",
           "Profiling", "StepReader"]

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


_FINALIZERS = ("__del__", "_xla_gc_callback")
"""Functions Python runs from the garbage collector, where a raised exception is printed and dropped."""


def _in_finalizer(frame: Any) -> bool:
  """Whether ``frame`` (where a signal interrupted the main thread) or a caller of it is a finalizer or a gc
  callback (``gc.callbacks``, e.g. JAX's ``_xla_gc_callback``)."""
  while frame is not None:
    if frame.f_code.co_name in _FINALIZERS or any(getattr(c, "__code__", None) is frame.f_code for c in gc.callbacks):
      return True
    frame = frame.f_back
  return False


class SignalGuard:
  """Turns SIGINT/SIGTERM into :class:`RunInterrupted`, held back while a save is in flight (:meth:`saving`).

  The handler raises where the main thread is; where that is a garbage-collector or ``__del__`` callback, Python
  prints and drops the exception, so the signal is also remembered and :meth:`check` (called every step) raises it.
  """

  def __init__(self):
    self._saving = False
    self._pending: int | None = None

  def handle(self, signum: int, frame: Any) -> None:
    """The signal handler: raise now, or after the save in flight; inside a garbage-collector callback or a
    ``__del__`` (where Python would print the exception with a traceback and drop it) the signal is only
    remembered, and :meth:`check` raises it at the next step."""
    self._pending = signum
    if not self._saving and not _in_finalizer(frame):
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


class Saving:
  """The saving hook: restores the train state and metric history at the start, saves every ``ckpt_every`` steps
  (and the last), holds signals back while a save is in flight (:class:`SignalGuard`).

  Args:
    options: the run flags (``ckpt_dir``: ``None`` turns this hook off; ``ckpt_every``, ``resume``,
      ``allow_config_change``).
    identity: the run-defining config stored with checkpoints.
    signals: the run's :class:`SignalGuard`, or ``None``.
  """

  def __init__(self, options: RunOptions, identity: Mapping[str, Any], signals: SignalGuard | None):
    self.every = options.ckpt_every
    self.signals = signals
    self.saver = None if options.ckpt_dir is None else jaxckpt.TrainStateSaver(
        options.ckpt_dir, config=identity, save_every=options.ckpt_every, resume=bool(options.resume),
        allow_config_change=options.allow_config_change)
    self.resume = options.resume

  def restore(self, state: Any, log) -> tuple[Any, dict[str, list[float]], list[float], list[str]]:
    """``(state, history, partial period's losses, warnings)``: the latest checkpoint's, or ``state`` unchanged."""
    if self.saver is None:
      return state, {"train_loss": []}, [], []
    state, meta = self.saver.restore(state)
    for message in self.saver.warnings:
      log(f"warning: {message}")
    history = {"train_loss": [], **{k: list(v) for k, v in meta.items() if k != "period_losses"}}
    if self.saver.latest_step is not None:
      log(f"resumed from step {self.saver.latest_step} in {self.saver.directory}")
    elif self.resume:
      log(f"no checkpoint in {self.saver.directory}: starting a new run")
    return state, history, list(meta.get("period_losses", [])), list(self.saver.warnings)

  def due(self, steps_done: int) -> bool:
    """Whether a save is due after ``steps_done`` steps."""
    return self.saver is not None and steps_done % self.every == 0

  def save(self, steps_done: int, state: Any, meta: Mapping[str, Any], *, final: bool) -> None:
    """Saves (when due, or ``final``); a signal that arrives meanwhile is raised after the save completes."""
    if self.saver is not None:
      with self.signals.saving() if self.signals is not None else contextlib.nullcontext():
        self.saver.maybe_save(steps_done, state, meta=meta, force=final)

  def kept(self) -> str:
    """What became of the run's checkpoints, for a message that stops the run."""
    if self.saver is None:
      return "no checkpoint was written (no --ckpt-dir)"
    latest = self.saver.latest_saved_step()
    return (f"the last good checkpoint (step {latest}) is kept in {self.saver.directory}" if latest is not None
            else f"no checkpoint had been saved yet in {self.saver.directory}")

  def fill_in(self, err: RunInterrupted) -> None:
    """Adds the checkpoint directory and its newest complete step to an interruption."""
    if self.saver is not None:
      err.ckpt_dir, err.checkpoint = self.saver.directory, self.saver.latest_saved_step()

  def close(self) -> None:
    if self.saver is not None:
      self.saver.close()


class NaNGuard:
  """The non-finite hook: a step whose loss, gradient or updated parameter is not finite stops the run
  (``nan_policy="stop"``) or has its update dropped (``"skip"``); a non-finite evaluation loss always stops it.

  Args:
    policy: ``"stop"`` or ``"skip"``.
    hints: likely causes for this experiment, for the message.
    saving: the :class:`Saving` hook (the message says which checkpoint is kept).
  """

  def __init__(self, policy: str, hints: str, saving: Saving):
    self.policy, self.hints, self.saving = policy, hints, saving
    self.skipped: list[int] = []

  def step(self, step: int, loss: float, finite: bool, say) -> bool:
    """Whether step ``step``'s update counts; raises :class:`NonFiniteLossError` under ``"stop"``."""
    if finite:
      return True
    if self.policy == "stop":
      raise NonFiniteLossError(f"non-finite loss, gradient or updated parameter at step {step} (loss {loss}); likely "
                               f"causes: {self.hints}; {self.saving.kept()}; --nan-policy skip drops such updates "
                               "instead", step=step)
    self.skipped.append(step)
    say(f"warning: non-finite loss, gradient or updated parameter at step {step}: update skipped")
    return False

  def scores(self, steps_done: int, scores: Mapping[str, float]) -> None:
    """Raises :class:`NonFiniteLossError` when an evaluation loss is not finite: the parameters themselves are
    broken (finite but huge), and skipping later updates cannot help."""
    broken = {k: float(v) for k, v in scores.items() if "loss" in k and not math.isfinite(float(v))}
    if broken:
      shown = ", ".join(f"{k} {v}" for k, v in broken.items())
      skipped = self.skipped
      skipped_text = f" (updates skipped at steps {skipped[:8]}{'…' if len(skipped) > 8 else ''})" if skipped else ""
      raise NonFiniteLossError(
          f"evaluation after step {steps_done} is non-finite ({shown}){skipped_text}: the parameters are finite but "
          f"no longer usable, and skipping updates cannot recover them; likely causes: {self.hints}; "
          f"{self.saving.kept()}", step=steps_done - 1)


class Profiling:
  """The profiling hook: with ``--profile DIR``, steps ``start+1 .. start+profile_steps`` (warm: compiled, inputs
  allocated) are traced into ``DIR/<slug>/`` (:func:`jaxckpt.training._profile.profile_trace`)."""

  def __init__(self, options: RunOptions, name: str, start: int, total_steps: int):
    self.dir, self.name = options.profile, name
    self.first = start + 1
    self.last = min(self.first + options.profile_steps, total_steps) - 1
    self.trace = contextlib.ExitStack()
    self.run_dir = None

  def starts(self, step: int) -> bool:
    """Whether the trace starts before step ``step`` (the step in flight must be read first)."""
    return self.dir is not None and step == self.first

  def start(self) -> None:
    self.run_dir = self.trace.enter_context(profile_trace(self.dir, name=self.name))

  def ends(self, step: int) -> bool:
    """Whether the trace ends after step ``step`` (which must be read inside it)."""
    return self.dir is not None and step == self.last and step >= self.first

  def stop(self, say) -> None:
    self.trace.close()
    say(f"profiled steps {self.first}-{self.last} into {self.run_dir} (xprof --logdir {self.dir})")

  def close(self) -> None:
    self.trace.close()


class StepReader:
  """Reads each step's metrics one step late, so the device never waits for Python: step s's metrics are read (a host
  sync) after step s+1 is dispatched, or at once where its state is needed (a period's end, a save, a trace edge).
  Times each step's own compute, feeds the :class:`NaNGuard` and the progress bar."""

  def __init__(self, result: LoopResult, guard: NaNGuard, bar: Any, say):
    self.result, self.guard, self.bar, self.say = result, guard, bar, say
    self.pending: tuple[int, Any, float] | None = None  # (step, metrics, dispatch time) not read yet
    self.period_losses: list[float] = []
    self.reached = result.start_step  # steps whose results have been read
    self.last_done = time.perf_counter()

  def dispatched(self, step: int, metrics: Any, began: float) -> None:
    """Step ``step`` was dispatched: read the one before it."""
    self.flush()
    self.pending = (step, metrics, began)

  def flush(self) -> None:
    """Reads the step in flight, if any."""
    if self.pending is None:
      return
    step, metrics, began = self.pending
    self.pending = None
    loss = float(metrics["loss"])  # waits for the step
    done = time.perf_counter()
    self.result.step_times.append(done - max(began, self.last_done))  # its own compute, not its wait
    self.last_done = done
    if self.guard.step(step, loss, bool(metrics["finite"]), self.say):
      self.period_losses.append(loss)
    self.reached = step + 1
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)


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

  The body runs steps; saving, the NaN guard, profiling and reading metrics are small hooks (:class:`Saving`,
  :class:`NaNGuard`, :class:`Profiling`, :class:`StepReader`), as Flax's examples run periodic actions as hooks.

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
    profile_name: the run's name in ``options.profile`` (the policy); traced steps' times include the tracer's
      overhead.

  Returns:
    :class:`LoopResult`.

  Raises:
    NonFiniteLossError: a NaN/Inf loss, gradient or updated parameter with ``nan_policy="stop"`` (checkpoints
      before it are kept). Also, under either policy, a non-finite evaluation loss (parameters finite but unusable,
      e.g. after a huge learning rate): the run stops there, before that period's checkpoint.
    CheckpointError: the checkpoint directory holds another run, would be overwritten, or cannot be read.
    RunInterrupted: SIGINT/SIGTERM (with ``signals``), filled in with the step reached and the last checkpoint.
  """
  saving = Saving(options, identity, signals)
  state, history, period_losses, notes = saving.restore(state, log)
  start = int(jax.device_get(state.step))
  result = LoopResult(state, history, [], [], notes, start)
  periods = -(-total_steps // eval_every)
  shown = options.progress and jax.process_index() == 0  # the CLI turns it off where no terminal shows a bar
  bar = tqdm(total=total_steps, initial=start, disable=not shown, unit="step", leave=False)
  say = bar.write if shown else log
  guard = NaNGuard(options.nan_policy, nan_hints, saving)
  reader = StepReader(result, guard, bar, say)
  reader.period_losses = period_losses
  profiling = Profiling(options, profile_name, start, total_steps)
  try:
    for step in range(start, total_steps):
      if signals is not None:
        signals.check()
      if profiling.starts(step):
        reader.flush()  # the warm-up step ends before the trace starts
        profiling.start()
      began = time.perf_counter()
      state, metrics = step_fn(state, batch_at(step))
      reader.dispatched(step, metrics, began)
      if profiling.ends(step):
        reader.flush()  # the traced steps end inside the trace
        profiling.stop(say)
      ends_period = (step + 1) % eval_every == 0 or step + 1 == total_steps
      if not ends_period and not saving.due(step + 1):
        continue
      reader.flush()  # the state after this step is needed, and a NaN at it must stop before it is saved
      if ends_period:
        scores = evaluate(state)
        guard.scores(step + 1, scores)
        losses = reader.period_losses
        history["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
        for key, value in scores.items():
          history.setdefault(key, []).append(float(value))
        reader.period_losses = []
        shown = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in scores.items())
        say(f"{period} {-(-(step + 1) // eval_every)}/{periods}: train loss {history['train_loss'][-1]:.4f}, {shown}")
      # The partial period's losses travel with the checkpoint, so a resumed run reports the same means.
      saving.save(step + 1, state, {**history, "period_losses": reader.period_losses}, final=step + 1 == total_steps)
  except RunInterrupted as err:
    err.step, err.total_steps = reader.reached, total_steps
    saving.fill_in(err)
    raise
  finally:
    profiling.close()
    bar.close()
    saving.close()
  result.state, result.skipped = state, guard.skipped
  if result.skipped:
    result.warnings.append(f"skipped the updates of {len(result.skipped)} step(s) with a non-finite loss, gradient "
                           "or updated parameter")
  return result
