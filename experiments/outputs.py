"""What a run leaves behind: the metrics.json record, the parameters' digest and the closing summary line."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import jaxckpt
from experiments.policy import policy_per_block
from jaxckpt import sharding

if TYPE_CHECKING:
  from experiments.loop import LoopResult
  from experiments.compiling import CompiledStep

__all__ = ["run_metrics", "write_metrics", "params_digest", "closing_line"]


def params_digest(params: Any) -> str:
  """SHA-256 of every parameter's bytes, in tree order: equal digests = bit-identical parameters (gathered from all
  processes when sharded; every process must call it)."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(sharding.gather(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


def run_metrics(
    *, spec: jaxckpt.PolicySpec, compiled: "CompiledStep", loop: "LoopResult", total_steps: int, **extra: Any
) -> dict[str, Any]:
  """The metrics.json record: the shared keys of :data:`jaxckpt.schema.METRICS_KEYS` plus ``extra``."""
  return {
      "schema_version": jaxckpt.schema.SCHEMA_VERSION,
      "policy": str(spec),
      "policy_per_block": policy_per_block(spec, compiled.block_types),
      **extra,
      "train_loss": loop.history["train_loss"],
      "step_time_s": loop.median_step_time,
      "compile_s": compiled.compile_s,
      "steps": total_steps,
      "memory": compiled.memory,
      "collectives": compiled.collectives,
      "backend": jax.default_backend(),
      "compiler_options": jaxckpt.remat_compiler_options(),
      "versions": jaxckpt.schema.versions(),
      "warnings": compiled.warnings + loop.warnings,
      "skipped_steps": loop.skipped,
      "params_sha256": params_digest(loop.state.params),
  }


def write_metrics(out: str | None, metrics: Mapping[str, Any], log=print) -> None:
  """Writes ``out/metrics.json`` atomically (no-op without ``out``; in a multi-process run only process 0 writes)."""
  if out is None or jax.process_index() != 0:
    return
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "metrics.json")
  with open(path + ".tmp", "w") as f:  # then renamed: an interrupted write never leaves half a file
    json.dump(metrics, f, indent=2)
  os.replace(path + ".tmp", path)
  log(f"wrote {path}")




def closing_line(result: str, loop: "LoopResult", *, total_steps: int, ckpt_dir: str | None) -> str:
  """The run's last line: ``result`` (e.g. ``test accuracy 0.95``) and the median step time over the steps run, or
  that there was nothing left to train (a ``--resume`` of a finished run)."""
  if loop.start_step >= total_steps:
    return (f"{result} (of the checkpoint at step {loop.start_step}); nothing left to train: the run in {ckpt_dir} "
            f"already reached step {loop.start_step} of {total_steps}")
  step_time = loop.median_step_time
  return (f"{result}; median step time {'n/a' if step_time is None else f'{step_time * 1e3:.1f} ms'} over "
          f"{max(len(loop.step_times) - 1, 1)} steps")
