"""Saving and resuming train state with orbax, refusing to overwrite or mix runs.

Each checkpoint step holds the :class:`~jaxckpt.train.TrainState` (orbax ``StandardSave``; restores bit-identically)
and the run's config as JSON. Saves are synchronous: the train step donates its state, so the arrays must be written
before the next step reuses their buffers. orbax writes each step to a temporary directory and renames it when
complete, so a half-written step is never listed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxckpt.errors import CheckpointError

__all__ = ["Checkpointer"]


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

  Raises:
    CheckpointError: ``save_every`` < 1; the directory holds checkpoints and ``resume`` is false; or its stored config
      differs from ``config``; or the path exists and is not a directory.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      config: Mapping[str, Any],
      save_every: int,
      resume: bool,
      max_to_keep: int = 3,
  ):
    if save_every < 1:
      raise CheckpointError(f"checkpoint interval {save_every} must be ≥ 1 step")
    self.directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory")
    self.config = dict(config)
    self.save_every = save_every
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False),
    )
    latest = self._manager.latest_step()
    if latest is not None and not resume:
      raise CheckpointError(
          f"checkpoint directory {self.directory} already holds a run (latest step {latest}); pass --resume to "
          "continue it, or choose another --ckpt-dir"
      )
    self.latest_step = latest

  def restore(self, state: Any) -> tuple[Any, dict[str, Any]]:
    """Returns the latest checkpoint's ``(state, meta)``, or ``(state, {})`` if there is none.

    Args:
      state: a template :class:`~jaxckpt.train.TrainState` (arrays or ``jax.ShapeDtypeStruct``s).

    Returns:
      The restored state, structured like ``state``, and the JSON ``meta`` saved with it (e.g. metric history).

    Raises:
      CheckpointError: the stored config differs from this run's, or the checkpoint cannot be read.
    """
    if self.latest_step is None:
      return state, {}
    step = self.latest_step
    try:
      json_items = self._manager.restore(
          step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
      )
      stored, meta = json_items.config, json_items.meta
    except Exception as err:  # noqa: BLE001 - orbax raises many types; name the directory and step instead
      raise CheckpointError(f"cannot read the config of checkpoint step {step} in {self.directory}: {err}") from err
    differing = sorted(k for k in set(stored) | set(self.config) if stored.get(k) != self.config.get(k))
    if differing:
      details = ", ".join(f"{k}: saved {stored.get(k)!r} vs now {self.config.get(k)!r}" for k in differing)
      raise CheckpointError(f"checkpoint directory {self.directory} is from a different run ({details})")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    except Exception as err:  # noqa: BLE001
      raise CheckpointError(f"cannot restore checkpoint step {step} in {self.directory}: {err}") from err
    return restored.state, dict(meta)

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

  def close(self) -> None:
    """Waits for pending writes and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
