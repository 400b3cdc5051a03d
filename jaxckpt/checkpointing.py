"""Saving and resuming train state with orbax, refusing to overwrite or mix runs.

Each checkpoint step holds the :class:`~jaxckpt.train.TrainState` (orbax ``StandardSave``; restores bit-identically)
and the run's config as JSON. Saves are synchronous: the train step donates its state, so the arrays must be written
before the next step reuses their buffers. orbax writes each step to a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it when complete, so a half-written step is never listed; the
temporary directories a killed save leaves behind are deleted when the directory is opened again. A step that is
listed but cannot be read (corrupted on disk) is skipped with a warning in favour of the previous good one.

Multi-process runs (``jax.distributed``, :mod:`jaxckpt.sharding`): every process creates the same
:class:`Checkpointer` on a directory they all see and calls the same methods in the same order; orbax writes each
array's shards from the process that holds them and the metadata and JSON items from process 0, and a restore places
every array on the template's sharding (so a state saved under one mesh restores onto the current one). Only process
0 deletes unfinished saves.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxckpt.errors import CheckpointError

__all__ = ["Checkpointer", "TMP_MARKER"]

TMP_MARKER = ".orbax-checkpoint-tmp"
"""Part of the name of orbax's temporary directories (an unfinished save)."""
_STEP_RE = re.compile(r"\d+\Z")
_TMP_RE = re.compile(r"\d+" + re.escape(TMP_MARKER))


class Checkpointer:
  """A run's checkpoint directory: save every ``save_every`` steps, resume from the latest complete step.

  Args:
    directory: checkpoint directory (created if missing).
    config: the run-defining config (JSON-serialisable; e.g. model, data, seed, batch size, optimizer). Resuming
      from a directory whose stored config differs is refused, naming the differing keys.
    save_every: save when ``step % save_every == 0`` (steps ≥ 1).
    resume: continue from the latest checkpoint if there is one. Without it, a directory that already holds
      checkpoints is refused, so an existing run is never overwritten.
    max_to_keep: complete checkpoints kept (older ones are deleted after a newer one is complete).
    allow_config_change: resume even if the stored config differs (the differences become :attr:`warnings`).

  Attributes:
    warnings: things the user should hear about (cleaned-up temporary directories, skipped corrupt steps, config
      differences allowed), one line each.

  Raises:
    CheckpointError: ``save_every`` < 1; the directory holds checkpoints and ``resume`` is false; the directory is
      not empty but holds no checkpoints (it is not a checkpoint directory); its stored config differs from
      ``config``; or the path exists and is not a directory.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      config: Mapping[str, Any],
      save_every: int,
      resume: bool,
      max_to_keep: int = 3,
      allow_config_change: bool = False,
  ):
    if save_every < 1:
      raise CheckpointError(f"checkpoint interval {save_every} must be ≥ 1 step")
    self.directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory")
    self.config = dict(config)
    self.save_every = save_every
    self.allow_config_change = allow_config_change
    self.warnings: list[str] = []
    entries = os.listdir(self.directory) if os.path.isdir(self.directory) else []
    unfinished = sorted(e for e in entries if _TMP_RE.match(e))
    foreign = sorted(e for e in entries if not _STEP_RE.match(e) and TMP_MARKER not in e)
    if foreign and not any(_STEP_RE.match(e) for e in entries):
      shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
      raise CheckpointError(
          f"checkpoint directory {self.directory} is not empty and holds no checkpoints (found {shown}); "
          "choose a new or empty --ckpt-dir"
      )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
        ),
    )
    for name in unfinished if jax.process_index() == 0 else ():  # orbax's own cleanup runs in a thread that may
      shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)  # not finish; one process deletes
    if unfinished:
      self.warnings.append(
          f"deleted {len(unfinished)} unfinished save(s) left by an interrupted run in {self.directory}: "
          + ", ".join(unfinished)
      )
    latest = self._manager.latest_step()
    if latest is not None and not resume:
      raise CheckpointError(
          f"checkpoint directory {self.directory} already holds a run (latest step {latest}); pass --resume to "
          "continue it, or choose another --ckpt-dir"
      )
    self.latest_step = latest

  def restore(self, state: Any) -> tuple[Any, dict[str, Any]]:
    """Returns the latest readable checkpoint's ``(state, meta)``, or ``(state, {})`` if there is none.

    Steps are tried newest first; a step that cannot be read is skipped with a line in :attr:`warnings`.

    Args:
      state: a template :class:`~jaxckpt.train.TrainState` (arrays or ``jax.ShapeDtypeStruct``s); sharded arrays
        are restored with the same shardings (each process reads its own shards).

    Returns:
      The restored state, structured like ``state``, and the JSON ``meta`` saved with it (e.g. metric history).
      :attr:`latest_step` is set to the step restored.

    Raises:
      CheckpointError: the stored config differs from this run's (unless ``allow_config_change``), or no listed step
        can be read.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return state, {}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    errors = []
    for step in steps:
      try:
        items = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        )
        self._check_config(dict(items.config))
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
      except CheckpointError:
        raise
      except Exception as err:  # noqa: BLE001 - orbax raises many types; name the directory and step instead
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        errors.append(f"step {step}: {reason}")
        self.warnings.append(f"checkpoint step {step} in {self.directory} cannot be read ({reason}); trying older")
        continue
      self.latest_step = step
      return restored.state, dict(items.meta)
    raise CheckpointError(f"no checkpoint in {self.directory} can be read: {'; '.join(errors)}")

  def _check_config(self, stored: dict[str, Any]) -> None:
    differing = sorted(k for k in set(stored) | set(self.config) if stored.get(k) != self.config.get(k))
    if not differing:
      return
    details = ", ".join(f"{k}: saved {stored.get(k)!r} vs now {self.config.get(k)!r}" for k in differing)
    if not self.allow_config_change:
      raise CheckpointError(
          f"checkpoint directory {self.directory} is from a different run ({details}); use another --ckpt-dir, or "
          "--allow-config-change to resume it anyway"
      )
    self.warnings.append(f"resuming {self.directory} with a changed config ({details})")

  def maybe_save(self, step: int, state: Any, *, meta: Mapping[str, Any] | None = None, force: bool = False) -> bool:
    """Saves ``state`` (and JSON ``meta``) as checkpoint ``step`` if ``step`` is a multiple of ``save_every``.

    Args:
      step: the state's step count.
      state: the pytree to save.
      meta: JSON-serialisable run metadata to save beside it (e.g. per-epoch losses).
      force: save whatever the step (e.g. at the end of training).

    Returns:
      Whether a checkpoint was written.
    """
    if not force and step % self.save_every:
      return False
    if self._manager.latest_step() == step:
      return False
    self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            config=ocp.args.JsonSave(self.config),
            meta=ocp.args.JsonSave(dict(meta or {})),
        ),
        force=True,
    )
    self._manager.wait_until_finished()
    return True

  def latest_saved_step(self) -> int | None:
    """The newest complete checkpoint step on disk, or ``None``."""
    return self._manager.latest_step()

  def close(self) -> None:
    """Waits for pending writes and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
