"""What every experiment shares: compile-and-describe the train step, the training loop, metrics and CLI plumbing.

The loop is deterministic by step (the caller's ``batch_at(step)`` and the train step's ``fold_in(key, step)``), saves
orbax checkpoints through :class:`jaxckpt.Checkpointer` with the metric history beside them, resumes bit-identically,
and handles non-finite losses by ``nan_policy``. Experiments (``classifier``, ``lm``) add their data, model and
evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

import jaxckpt
from jaxckpt import sharding
from jaxckpt.cli import CLIParser, check_output_dir
from jaxckpt.errors import JaxckptError, MeshSpecError, NonFiniteLossError
from jaxckpt.planner import resolve_policy
from jaxckpt.render import memory_table, policy_summary
from jaxckpt.step import ModelTarget

__all__ = [
    "NAN_POLICIES",
    "RunOptions",
    "CompiledStep",
    "LoopResult",
    "compile_and_describe",
    "train_loop",
    "run_metrics",
    "write_metrics",
    "params_digest",
    "CLIParser",
    "add_run_flags",
    "add_policy_flags",
    "resolve_policy",
    "plan_budget",
    "policy_per_block",
    "check_seeds",
    "run_cli",
    "Placement",
    "setup_placement",
]

NAN_POLICIES = ("stop", "skip")
"""What to do on a NaN/Inf loss or gradient: stop (keep the last good checkpoint) or skip that update."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """Flags every experiment has, beyond its model and data."""

  out: str | None = None  # Directory for metrics.json.
  ckpt_dir: str | None = None  # orbax checkpoint directory; None = no checkpoints.
  ckpt_every: int = 100  # Save every this many steps (and at the end).
  resume: bool = False  # Continue from the latest checkpoint in ckpt_dir.
  allow_config_change: bool = False  # Resume even if the checkpoint's run config differs (warns).
  nan_policy: str = "stop"  # "stop" or "skip" (see NAN_POLICIES).
  progress: bool = True  # Show a progress bar.
  mesh: str | None = None  # Device mesh "data=4,fsdp=2" (jaxckpt.sharding); None = one device, unsharded.
  coordinator: str | None = None  # HOST:PORT of process 0 for jax.distributed; None = one process.
  num_processes: int = 1  # Processes of a multi-process run (with --coordinator).
  process_id: int = 0  # This process, 0..num_processes-1.

  @classmethod
  def of(cls, config: Any) -> "RunOptions":
    """The run flags of an experiment config that has the same field names (flat, for ``dataclasses.replace``)."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

  def check(self) -> None:
    """Raises :class:`JaxckptError` for values out of range or an unwritable ``--out``, naming the flag."""
    check_output_dir("--out", self.out)
    if self.ckpt_every < 1:
      raise JaxckptError(f"--ckpt-every must be ≥ 1, got {self.ckpt_every}")
    if self.nan_policy not in NAN_POLICIES:
      raise JaxckptError(f"unknown NaN policy {self.nan_policy!r}; valid: {', '.join(NAN_POLICIES)}")
    if self.resume and self.ckpt_dir is None:
      raise JaxckptError("--resume needs --ckpt-dir")
    if self.coordinator is None and (self.num_processes != 1 or self.process_id != 0):
      raise MeshSpecError("--num-processes and --process-id need --coordinator HOST:PORT (of process 0)")
    if self.coordinator is not None and self.mesh is None:
      raise MeshSpecError("--coordinator needs --mesh: say how the devices of all processes are used "
                          "(e.g. --mesh data=8)")


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a run's arrays live: one device (``mesh`` is ``None``), or sharded over a mesh (:mod:`jaxckpt.sharding`).

  Attributes:
    mesh: the device mesh, or ``None``.
  """

  mesh: Any = None

  def state(self, state: Any, model: Any) -> Any:
    """The train state placed on the mesh (parameters and Adam moments by the FSDP rule); unchanged without one."""
    if self.mesh is None:
      return state
    return sharding.shard_state(state, sharding.state_shardings(state, self.mesh, model=model))

  def batch(self, batch: Any) -> Any:
    """A global host batch as global arrays; each process transfers only the rows its devices hold."""
    if self.mesh is None:
      return batch
    size = jax.tree.leaves(batch)[0].shape[0]
    return sharding.shard_batch(batch, self.mesh, global_batch_size=size)

  def loss(self, loss_fn: Callable) -> Callable:
    """``loss_fn`` computing with the parameters all-gathered over ``fsdp`` (:func:`jaxckpt.sharding.gathered_params`);
    itself without a mesh."""
    return sharding.gather_params_in_loss(loss_fn, self.mesh)

  def step_kwargs(self, state: Any, batch: Any, model: Any) -> dict[str, Any]:
    """``in_shardings``/``out_shardings`` of the train step (none without a mesh)."""
    return {} if self.mesh is None else sharding.step_shardings(state, batch, self.mesh, model=model)

  def batches(self, batch_at: Callable[[int], Any], state: Any, model: Any
              ) -> tuple[Callable[[int], Any], Any, dict[str, Any]]:
    """``(batch_at, example, step_kwargs)``: ``batch_at`` placing each host batch on the mesh, the batch of step
    0 (placed) and the train step's shardings; the host ``batch_at``, its batch and ``{}`` without a mesh."""
    placed = batch_at if self.mesh is None else (lambda step: self.batch(batch_at(step)))
    example = placed(0)
    return placed, example, self.step_kwargs(state, example, model)

  def check_policy(self, spec: Any) -> None:
    """Raises :class:`JaxckptError` for a budget with a mesh: plans are made for one device."""
    if self.mesh is not None and isinstance(spec, jaxckpt.policies.Budget):
      raise JaxckptError(f"--policy {spec} plans for one device; with --mesh give a per-block or layered policy "
                         "(plan it with jaxckpt-plan first)")

  def check_batch_size(self, batch_size: int, flag: str = "--batch-size") -> None:
    """Raises :class:`MeshSpecError` when the batch does not split over the mesh."""
    if self.mesh is not None:
      sharding.check_batch_size(batch_size, self.mesh, flag=flag)

  def describe(self) -> dict[str, Any]:
    """``{"mesh": {axis: size} | None, "device_count", "process_count"}`` for metrics.json."""
    return {"mesh": None if self.mesh is None else sharding.mesh_shape(self.mesh),
            "device_count": jax.device_count() if self.mesh is not None else 1,
            "process_count": jax.process_count()}


def setup_placement(options: RunOptions) -> Placement:
  """Joins the multi-process run (``--coordinator``) and builds the ``--mesh``; call before any JAX computation.

  Raises:
    MeshSpecError: bad ``--mesh``/``--coordinator``/``--num-processes``/``--process-id``.
  """
  if options.coordinator is not None:
    sharding.initialize_distributed(options.coordinator, num_processes=options.num_processes,
                                    process_id=options.process_id)
  return Placement(None if options.mesh is None else sharding.make_mesh(options.mesh))


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A compiled train step and what was learnt compiling it (memory in bytes, seconds, warnings)."""

  fn: jax.stages.Compiled
  memory: dict[str, int | None]
  compile_s: float
  warnings: list[str]
  block_types: dict[str, frozenset[str]]


def compile_and_describe(
    step: Callable, state: Any, example: Any, *, graphdef: Any, spec: jaxckpt.PolicySpec, headline: str, log,
    shardings: Mapping[str, Any] | None = None
) -> CompiledStep:
  """Compiles the train step once (state donated, CPU remat fix) and logs the policy and compiled memory stats.

  Args:
    step: from :func:`jaxckpt.make_train_step`.
    state: the train state (its shapes fix the compiled signature).
    example: one batch (shapes only matter).
    graphdef: the model's graphdef (to list its block types).
    spec: the policy spec in use.
    headline: first line to log (model, data).
    log: where lines go.
    shardings: ``in_shardings``/``out_shardings`` (:meth:`Placement.step_kwargs`); memory stats are then per device.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    started = time.perf_counter()
    fn = jaxckpt.compile_train_step(step, state, example, **dict(shardings or {}))
    compile_s = time.perf_counter() - started
  messages = [str(w.message) for w in caught]
  offload = jaxckpt.xla.offload_warning(spec)
  if offload is not None:
    messages.append(offload)
  from flax import nnx

  types = jaxckpt.block_types(nnx.merge(graphdef, state.params, state.other))
  memory = jaxckpt.memory_stats(fn)
  log(headline)
  for message in messages:
    log(f"warning: {message}")
  log(f"policy {spec}: {policy_summary(spec, types)}")
  if shardings:
    mesh = next(s.mesh for s in jax.tree.leaves(shardings["in_shardings"]))
    log(f"mesh {sharding.format_mesh(mesh)} over {jax.device_count()} devices in {jax.process_count()} "
        "process(es): memory below is per device")
  log(memory_table(memory))
  log(f"compiled in {compile_s:.1f} s on {jax.default_backend()} "
      f"(compiler options {jaxckpt.remat_compiler_options() or 'none'})")
  return CompiledStep(fn, memory, compile_s, messages, types)


@dataclasses.dataclass
class LoopResult:
  """The state after training and what the loop recorded.

  Attributes:
    state: final train state.
    history: ``{"train_loss": [...], <eval metric>: [...]}``, one entry per evaluation period.
    step_times: seconds per step run in this process (each waits for its step to finish).
    skipped: steps whose update was dropped (``nan_policy="skip"``).
    warnings: lines the user should hear about (checkpoint clean-ups, skipped steps…).
  """

  state: Any
  history: dict[str, list[float]]
  step_times: list[float]
  skipped: list[int]
  warnings: list[str]

  @property
  def median_step_time(self) -> float | None:
    """Median seconds per step, excluding the first step of this process (warm-up)."""
    timed = self.step_times[1:] or self.step_times
    return float(np.median(timed)) if timed else None


def _nonfinite_message(step: int, loss: float, hints: str, checkpointer) -> str:
  kept = "no checkpoint was written (no --ckpt-dir)"
  if checkpointer is not None:
    latest = checkpointer.latest_saved_step()
    kept = (f"the last good checkpoint (step {latest}) is kept in {checkpointer.directory}" if latest is not None
            else f"no checkpoint had been saved yet in {checkpointer.directory}")
  return (f"non-finite loss or gradient at step {step} (loss {loss}); likely causes: {hints}; {kept}; "
          "--nan-policy skip drops such updates instead")


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

  Returns:
    :class:`LoopResult`.

  Raises:
    NonFiniteLossError: a NaN/Inf loss or gradient with ``nan_policy="stop"`` (checkpoints before it are kept).
    CheckpointError: the checkpoint directory holds another run, would be overwritten, or cannot be read.
  """
  history: dict[str, list[float]] = {"train_loss": []}
  notes: list[str] = []
  period_losses: list[float] = []
  checkpointer = None
  if options.ckpt_dir is not None:
    checkpointer = jaxckpt.Checkpointer(options.ckpt_dir, config=identity, save_every=options.ckpt_every,
                                        resume=options.resume, allow_config_change=options.allow_config_change)
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
  result = LoopResult(state, history, [], [], notes)
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
    nonlocal last_done
    loss = float(metrics["loss"])  # waits for the step
    done = time.perf_counter()
    result.step_times.append(done - max(began, last_done))  # its own compute, not its wait behind the step before
    last_done = done
    if not bool(metrics["finite"]):
      if options.nan_policy == "stop":
        raise NonFiniteLossError(_nonfinite_message(step, loss, nan_hints, checkpointer), step=step)
      result.skipped.append(step)
      say(f"warning: non-finite loss or gradient at step {step}: update skipped")
    else:
      period_losses.append(loss)
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

  try:
    for step in range(start, total_steps):
      batch = batch_at(step)
      began = time.perf_counter()
      state, metrics = step_fn(state, batch)
      if pending is not None:
        finish(*pending)
      pending = (step, metrics, began)
      ends_period = (step + 1) % eval_every == 0 or step + 1 == total_steps
      if not ends_period and (checkpointer is None or (step + 1) % options.ckpt_every):
        continue
      finish(*pending)
      pending = None
      if ends_period:
        scores = evaluate(state)
        history["train_loss"].append(float(np.mean(period_losses)) if period_losses else float("nan"))
        for key, value in scores.items():
          history.setdefault(key, []).append(float(value))
        period_losses = []
        shown = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in scores.items())
        say(f"{period} {-(-(step + 1) // eval_every)}/{periods}: train loss {history['train_loss'][-1]:.4f}, {shown}")
      if checkpointer is not None:
        # The partial period's losses travel with the checkpoint, so a resumed run reports the same means.
        checkpointer.maybe_save(step + 1, state, meta={**history, "period_losses": period_losses},
                                force=step + 1 == total_steps)
  finally:
    bar.close()
    if checkpointer is not None:
      checkpointer.close()
  result.state = state
  if result.skipped:
    result.warnings.append(f"skipped the updates of {len(result.skipped)} step(s) with a non-finite loss or gradient")
  return result


def params_digest(params: Any) -> str:
  """SHA-256 of every parameter's bytes, in tree order: equal digests = bit-identical parameters (gathered from all
  processes when sharded; every process must call it)."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(sharding.gather(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


def run_metrics(
    *, spec: jaxckpt.PolicySpec, compiled: CompiledStep, loop: LoopResult, total_steps: int, **extra: Any
) -> dict[str, Any]:
  """The metrics.json record: the shared keys of :data:`jaxckpt.schema.METRICS_KEYS` plus ``extra``."""
  return {
      "schema_version": jaxckpt.SCHEMA_VERSION,
      "policy": str(spec),
      "policy_per_block": policy_per_block(spec, compiled.block_types),
      **extra,
      "train_loss": loop.history["train_loss"],
      "step_time_s": loop.median_step_time,
      "compile_s": compiled.compile_s,
      "steps": total_steps,
      "memory": compiled.memory,
      "backend": jax.default_backend(),
      "compiler_options": jaxckpt.remat_compiler_options(),
      "versions": jaxckpt.versions(),
      "warnings": compiled.warnings + loop.warnings,
      "skipped_steps": loop.skipped,
      "params_sha256": params_digest(loop.state.params),
  }


def write_metrics(out: str | None, metrics: Mapping[str, Any], log=print) -> None:
  """Writes ``out/metrics.json`` (no-op without ``out``; in a multi-process run only process 0 writes)."""
  if out is None or jax.process_index() != 0:
    return
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "metrics.json")
  with open(path, "w") as f:
    json.dump(metrics, f, indent=2)
  log(f"wrote {path}")


def check_seeds(config: Any) -> None:
  """``--seed`` and ``--split-seed`` are unsigned 32-bit (numpy, scikit-learn and JAX all take them).

  Raises:
    JaxckptError: a seed outside 0..2**32 - 1, naming the flag.
  """
  for flag, value in (("--seed", config.seed), ("--split-seed", config.split_seed)):
    if not 0 <= value < 2**32:
      raise JaxckptError(f"{flag} must be in 0..{2**32 - 1}, got {value}")


def resolve_policy(policy: str | None, gradient_checkpointing: bool | None) -> jaxckpt.policies.ModelPolicy:
  """The run's policy from ``--policy`` and the Hugging Face-style ``--(no-)gradient-checkpointing`` switch.

  ``gradient_checkpointing=True`` means ``--policy full`` and ``False`` means ``--policy none``, as
  ``TrainingArguments(gradient_checkpointing=True)`` recomputes every block. Neither given: ``none``.

  Returns:
    A per-block spec, a layered policy (``0-3:dots_saveable;4-5:full``) or a budget (``budget:40%``, ``auto``;
    plan it with :func:`plan_budget` once the model and optimizer exist).

  Raises:
    JaxckptError: the switch and an explicit ``--policy`` that disagree with each other.
    PolicySpecError: a malformed ``--policy``.
  """
  spec = jaxckpt.policies.parse_model_policy(policy if policy is not None else "none")
  if gradient_checkpointing is None:
    return spec
  switch = "--gradient-checkpointing" if gradient_checkpointing else "--no-gradient-checkpointing"
  wanted = jaxckpt.parse_policy("full" if gradient_checkpointing else "none")
  if policy is not None and spec != wanted:
    raise JaxckptError(f"{switch} means --policy {wanted}, which conflicts with --policy {policy}; give one of them")
  return wanted


def plan_budget(spec: jaxckpt.policies.ModelPolicy, *, make_model: Callable[[], Any], batch: Any, loss_fn: Callable,
                tx: Any, grad_accum_steps: int, name: str, preset: str | None, log) -> tuple[Any, dict | None]:
  """Turns a budget ``--policy`` into the least-recompute plan for this run's model, batch and optimizer.

  Args:
    spec: from :func:`resolve_policy`; anything but a budget is returned unchanged.
    make_model: ``() -> nnx.Module``, the run's model (built abstractly here, never allocated).
    batch: one batch (arrays or ``jax.ShapeDtypeStruct``; only shapes are used).
    loss_fn: the run's loss (:data:`jaxckpt.train.LossFn`).
    tx: the run's optimizer (its state counts in the footprint).
    grad_accum_steps: micro-batches per step.
    name, preset: shown in the plan.
    log: where the plan's explanation goes.

  Returns:
    ``(policy, plan_json)``: the policy to train with and :meth:`jaxckpt.planner.Plan.to_json` without the
    candidate table (``None`` when ``spec`` was not a budget).

  Raises:
    InfeasibleBudgetError: no plan fits (a :class:`~jaxckpt.JaxckptError`: the CLI exits 2 with its message).
  """
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), batch)
  target = ModelTarget(make_model=make_model, batch=abstract, loss_fn=loss_fn, name=name, preset=preset,
                       grad_accum_steps=grad_accum_steps)
  policy, plan = resolve_policy(target, spec, tx=tx)
  if plan is None:
    return policy, None
  log(plan.explain())
  return policy, {k: v for k, v in plan.to_json().items() if k != "candidates"}


def policy_per_block(spec: Any, block_types: Collection[str]) -> dict[str, Any]:
  """``{block type: policy}`` of a per-block spec; for a layered policy ``{"first-last": {block type: policy}}``."""
  if isinstance(spec, jaxckpt.policies.LayeredPolicy):
    out, first = {}, 0
    for count, sub in spec.segments:
      out[f"{first}-{first + count - 1}"] = {block: str(sub.for_block(block)) for block in block_types}
      first += count
    return out
  return {block: str(spec.for_block(block)) for block in block_types}


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--policy`` and the Hugging Face-style ``--gradient-checkpointing/--no-gradient-checkpointing``."""
  parser.add_argument("--policy", default=None,
                      help="remat policy spec (grammar below; default none), a layered policy 0-3:SPEC;4-5:SPEC, or a "
                           "memory budget planned for this run: budget:1GiB (footprint), budget:40%% (of no-remat "
                           "temp), auto")
  parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                      help="Hugging Face-style switch: on = --policy full, off = --policy none (not with another "
                           "--policy)")


def add_run_flags(parser: argparse.ArgumentParser, defaults: RunOptions) -> None:
  """Adds the flags of :class:`RunOptions` to an experiment's parser."""
  parser.add_argument("--out", default=None, help="directory for metrics.json")
  parser.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory")
  parser.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help="save every N steps")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
  parser.add_argument("--allow-config-change", action="store_true",
                      help="resume even if the checkpoint's run config differs (the differences are printed)")
  parser.add_argument("--nan-policy", choices=NAN_POLICIES, default=defaults.nan_policy,
                      help="on a NaN/Inf loss: stop (default; the last good checkpoint is kept) or skip the update")
  parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
  parser.add_argument("--mesh", default=None, metavar="NAME=SIZE[,NAME=SIZE]",
                      help=f"shard over a device mesh, axes {', '.join(sharding.MESH_AXES)}, product = device count "
                           "(data: batch split, state replicated; fsdp: batch, parameters and optimizer state split), "
                           "e.g. data=4,fsdp=2")
  parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="multi-process run: address of process 0 (jax.distributed; gloo on CPU); needs --mesh")
  parser.add_argument("--num-processes", type=int, default=defaults.num_processes,
                      help="processes of the multi-process run")
  parser.add_argument("--process-id", type=int, default=defaults.process_id, help="this process, 0..N-1")


def run_cli(parser: CLIParser, make_config: Callable[[argparse.Namespace], Any],
            train: Callable[[Any], Any], argv: Sequence[str] | None) -> int:
  """Parses flags, trains, and maps errors to exit codes: 2 bad input (one line), 1 non-finite loss, 0 success."""
  args = parser.parse_args(argv)
  try:
    train(make_config(args))
  except NonFiniteLossError as err:  # a failed run, not bad input
    return parser.fail(err, status=1)
  except JaxckptError as err:
    return parser.fail(err)
  return 0
