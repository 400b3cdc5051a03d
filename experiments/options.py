"""The options every experiment run has beyond its model and data: one frozen dataclass, nested in each config.

An experiment's config (``ClassifierConfig``, ``LMConfig``) holds its own fields and ``run: RunOptions``. Flags map
onto both flat (``--ckpt-dir`` is ``config.run.ckpt_dir``); :func:`configure` builds a config from flat field names
and :func:`flat_config` gives the flat record metrics.json stores under ``config``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from jaxckpt.cli import check_output_dir
from jaxckpt.errors import JaxckptError, MeshSpecError
from jaxckpt.models import config_record
from jaxckpt.training import check_profile_dir

__all__ = ["NAN_POLICIES", "RESUME_AUTO", "REMAT_FIELDS", "RunOptions", "configure", "flat_config", "run_identity", "check_seeds"]

RESUME_AUTO = "auto"
"""``--resume auto``: resume when the checkpoint directory holds a run, else start one."""
NAN_POLICIES = ("stop", "skip")
"""What to do on a NaN/Inf loss, gradient or updated parameter: stop (keep the last good checkpoint) or skip that
update."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How a run is carried out: policy, outputs, checkpoints, faults, devices. None of it changes the numbers."""

  policy: str | None = None  # Policy spec (jaxckpt.parse_policy grammar), layered policy or budget; None = "none".
  gradient_checkpointing: bool | None = None  # Hugging Face-style switch: True = policy full, False = none.
  out: str | None = None  # Directory for metrics.json.
  ckpt_dir: str | None = None  # orbax checkpoint directory; None = no checkpoints.
  ckpt_every: int = 100  # Save every this many steps (and at the end).
  # True: continue from the latest checkpoint in ckpt_dir (an error when there is none); "auto": continue when
  # there is one, else start a new run; False: start a new run (refused if ckpt_dir holds one).
  resume: bool | str = False
  allow_config_change: bool = False  # Resume even if the checkpoint's run config differs (warns).
  # On a NaN/Inf loss, gradient or updated parameter: "stop" (keep the last good checkpoint) or "skip" that update.
  nan_policy: str = "stop"
  progress: bool = True  # Show a progress bar (the CLIs: only where stdout and stderr are a terminal).
  mesh: str | None = None  # Device mesh "data=4,fsdp=2" (jaxckpt.sharding); None = one device, unsharded.
  coordinator: str | None = None  # HOST:PORT of process 0 for jax.distributed; None = one process.
  num_processes: int = 1  # Processes of a multi-process run (with --coordinator).
  process_id: int = 0  # This process, 0..num_processes-1.
  profile: str | None = None  # XProf log directory: a trace of profile_steps warm steps into profile/<policy>/.
  profile_steps: int = 3  # Steps inside the trace (from the run's second step on: the first one is warm-up).
  global_batch_size: int | None = None  # Examples per update G: micro-batch, accumulation (and policy) planned.
  memory: str = "auto"  # Device memory --batch-size auto / --global-batch-size plan for: a size (16GiB) or auto.
  fit: Any = None  # What the fit planner chose (experiments.autofit), recorded in metrics.json; not a flag.

  def check(self) -> None:
    """Raises :class:`JaxckptError` for values out of range or an unwritable ``--out``/``--ckpt-dir``/``--profile``
    (tried: :func:`jaxckpt._cli.check_output_dir`), naming the flag."""
    check_output_dir("--out", self.out)
    check_output_dir("--ckpt-dir", self.ckpt_dir)
    if self.profile is not None:
      check_profile_dir(self.profile, flag="--profile")
    if self.profile_steps < 1:
      raise JaxckptError(f"--profile-steps must be ≥ 1, got {self.profile_steps}")
    if self.ckpt_every < 1:
      raise JaxckptError(f"--ckpt-every must be ≥ 1, got {self.ckpt_every}")
    if self.nan_policy not in NAN_POLICIES:
      raise JaxckptError(f"unknown NaN policy {self.nan_policy!r}; valid: {', '.join(NAN_POLICIES)}")
    if self.resume not in (False, True, RESUME_AUTO):
      raise JaxckptError(f"resume={self.resume!r} must be True, False or {RESUME_AUTO!r}")
    if self.resume and self.ckpt_dir is None:
      raise JaxckptError("--resume needs --ckpt-dir")
    if self.coordinator is None and (self.num_processes != 1 or self.process_id != 0):
      raise MeshSpecError("--num-processes and --process-id need --coordinator HOST:PORT (of process 0)")
    if self.coordinator is not None and self.mesh is None:
      raise MeshSpecError("--coordinator needs --mesh: say how the devices of all processes are used "
                          "(e.g. --mesh data=8)")


_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunOptions))


def configure(config: Any, **changes: Any) -> Any:
  """``config`` with fields changed by flat name: run options (``ckpt_dir=…``) go to ``config.run``.

  Args:
    config: an experiment config (a frozen dataclass with a ``run: RunOptions`` field).
    **changes: field names of the config or of :class:`RunOptions`, or ``run=RunOptions(...)`` itself.

  Returns:
    A new config.

  Raises:
    TypeError: a name that is neither (as ``dataclasses.replace`` does).

  Example::

    configure(ClassifierConfig(preset="tiny"), epochs=1, ckpt_dir="runs/a/ckpt", resume=True)
  """
  run = {k: changes.pop(k) for k in list(changes) if k in _RUN_FIELDS}
  base = changes.pop("run", config.run)
  return dataclasses.replace(config, **changes, run=dataclasses.replace(base, **run))


def flat_config(config: Any) -> dict[str, Any]:
  """The config as one flat ``{field: value}`` record, run options included (metrics.json's ``config``)."""
  record = dataclasses.asdict(config)
  return {**record, **record.pop("run")}


REMAT_FIELDS = ("scan", "structure")
"""Config fields that change how the layers are remat'd, not the numbers: they may change on resume."""


def run_identity(config: Any, model_config: Any, *, ignore: Collection[str] = (), **extra: Any) -> dict[str, Any]:
  """The config fields a resumed run must share with the saved one, for :class:`jaxckpt.TrainStateSaver`.

  Run options never count (remat policy, outputs and devices do not change the numbers), nor do
  :data:`REMAT_FIELDS`.

  Args:
    config: an experiment config.
    model_config: the resolved model config (a dataclass), stored as ``model_config``.
    ignore: more of the config's own fields that may change on resume (e.g. where the data is read from).
    **extra: entries to add (the data's identity).
  """
  record = dataclasses.asdict(config)
  model = {k: v for k, v in config_record(model_config).items() if k not in REMAT_FIELDS}
  return {**{k: v for k, v in record.items() if k not in ("run", *REMAT_FIELDS, *ignore)}, "model_config": model,
          **extra}


def check_seeds(config: Any) -> None:
  """``--seed`` and ``--split-seed`` are unsigned 32-bit (numpy, scikit-learn and JAX all take them).

  Raises:
    JaxckptError: a seed outside 0..2**32 - 1, naming the flag.
  """
  for flag, value in (("--seed", config.seed), ("--split-seed", config.split_seed)):
    if not 0 <= value < 2**32:
      raise JaxckptError(f"{flag} must be in 0..{2**32 - 1}, got {value}")
