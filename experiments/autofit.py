"""``--batch-size auto`` and ``--global-batch-size G`` (with ``--policy auto``): the experiments ask the fit planner
(:mod:`jaxckpt.fit`) before training, print what it chose and why, and record the choice in metrics.json
(``config.fit``).

- ``--batch-size auto``: the largest batch that fits ``--memory`` (default ``auto``: this device less 10%) with the
  given policy; with ``--policy auto``, the policy whose largest batch trains the most examples per second by the
  time model (:mod:`jaxckpt.fit._speed`).
- ``--global-batch-size G``: batch G in k = G / b micro-batches of b, the (policy, b) with the least estimated step
  time (``--policy auto``: among :data:`jaxckpt.fit.DEFAULT_POLICIES`; else the given policy), verified by compiling
  the accumulated step.

``--policy auto`` without either keeps its budget meaning (the least-recompute plan at the given batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from experiments.options import configure
from experiments.policy import resolve_policy
from jaxckpt.errors import JaxckptError
from jaxckpt.fit import DEFAULT_POLICIES, accelerator, fit_policies, plan_fit
from jaxckpt.fit import to_table
from jaxckpt.fit import FitPlan
from jaxckpt.fit import resolve_memory
from jaxckpt.policies import AUTO
from jaxckpt import Budget
from jaxckpt.step import ModelTarget

__all__ = ["AUTO_BATCH", "batch_size_flag", "wants_fit", "autofit"]

AUTO_BATCH = "auto"
"""The ``--batch-size`` word for the largest batch that fits."""


def batch_size_flag(text: str) -> int | str:
  """``--batch-size``'s type: a whole number or ``auto``."""
  if text == AUTO_BATCH:
    return AUTO_BATCH
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--batch-size {text!r}: a whole number or auto") from None


batch_size_flag.__name__ = "batch size (a whole number or auto)"


def wants_fit(config: Any) -> bool:
  """Whether the run asks the fit planner (``--batch-size auto`` or ``--global-batch-size``)."""
  return config.batch_size == AUTO_BATCH or config.run.global_batch_size is not None


def _policies(config: Any) -> list[str]:
  options = config.run
  if options.policy is not None and options.policy.strip() == AUTO:
    return list(DEFAULT_POLICIES)
  spec = resolve_policy(options.policy, options.gradient_checkpointing)
  if isinstance(spec, Budget):
    raise JaxckptError(f"--policy {spec} is a memory budget for one batch size; with --batch-size auto or "
                       "--global-batch-size give a fixed policy, or auto (the fastest that fits)")
  return [str(spec)]


def autofit(config: Any, target_at: Callable[[int], ModelTarget], *, log=print) -> Any:
  """Resolves ``--batch-size auto`` / ``--global-batch-size`` into batch size, accumulation and policy.

  Args:
    config: an experiment config (``batch_size``, ``grad_accum_steps`` fields and ``run: RunOptions``).
    target_at: ``B -> ModelTarget`` of the run's model, loss and a batch of B examples (shapes only).
    log: where the choice is printed.

  Returns:
    The config with ``batch_size``, ``grad_accum_steps`` and ``run.policy`` chosen and ``run.fit`` the record;
    unchanged when neither flag was given.

  Raises:
    JaxckptError: both flags, ``--global-batch-size`` with ``--batch-size`` or ``--grad-accum-steps``, a budget
      policy, or what :func:`jaxckpt.fit.plan_fit` raises (nothing fits, no micro-batch divides G, ...).
  """
  if not wants_fit(config):
    return config
  options = config.run
  g = options.global_batch_size
  default_batch = type(config)().batch_size
  if g is not None and (config.batch_size not in (None, default_batch) or config.grad_accum_steps != 1):
    given = "--batch-size" if config.batch_size not in (None, default_batch) else "--grad-accum-steps"
    raise JaxckptError(f"--global-batch-size {g} chooses the batch size and accumulation; drop {given}")
  if g is not None and g < 1:
    raise JaxckptError(f"--global-batch-size must be ≥ 1, got {g}")
  if config.grad_accum_steps != 1:
    raise JaxckptError("--batch-size auto chooses one micro-batch per step; drop --grad-accum-steps (or give "
                       "--global-batch-size)")
  if options.mesh is not None:
    raise JaxckptError("--batch-size auto and --global-batch-size plan one device; drop --mesh")
  policies = _policies(config)
  limit, source = resolve_memory(options.memory)
  target = target_at(1)
  device = accelerator()
  record: dict[str, Any] = {"memory_bytes": limit, "memory_source": source, "policies": policies,
                            "device": device.name}
  if g is not None:
    plan = plan_fit(target, policies, limit, global_batch=g, device=device, max_batch=g)
    w = plan.choice.winner
    batch, accum, policy = g, w.accum, w.policy
    record.update(mode="global_batch_size", global_batch_size=g, micro_batch_size=w.micro_batch,
                  est_step_s=w.est_step_s, footprint_bytes=plan.choice.footprint_bytes)
    why = f"least estimated step time on {device.name} among {len(plan.choice.table)} fitting configurations"
  else:
    fits = fit_policies(target, policies, limit)
    plan = FitPlan(tuple(fits), limit, source, None, None, 0.0)

    def per_example(fit) -> float:
      point = fit.by_batch[fit.max_batch_size]
      return device.micro_step_s(point.flops, point.bytes_accessed) / fit.max_batch_size

    best = min((f for f in fits if f.max_batch_size is not None), key=per_example)
    batch, accum, policy = best.max_batch_size, 1, best.policy
    record.update(mode="batch_size_auto", micro_batch_size=batch, footprint_bytes=best.footprint_bytes,
                  est_s_per_example=per_example(best))
    why = ("the largest batch that fits" if len(fits) == 1
           else f"the most examples/s by the time model on {device.name} at each policy's largest batch")
  record.update(policy=policy, batch_size=batch, grad_accum_steps=accum, compiles=plan.compiles,
                rows=[{k: r[k] for k in ("policy", "max_batch_size", "footprint_bytes", "compiles")}
                      for r in (f.as_row() for f in plan.fits)])
  log(to_table(plan).rstrip())
  log(f"fit: policy {policy}, batch size {batch}, grad accum steps {accum} ({why}; {plan.compiles} compiles)")
  return configure(config, batch_size=batch, grad_accum_steps=accum, policy=policy, fit=record)
