"""The run's remat policy: from ``--policy`` and the Hugging Face-style switch, budgets planned for the run's model."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jaxckpt
from jaxckpt.errors import JaxckptError
from jaxckpt.planner import resolve_policy as resolve_planned
from jaxckpt.step import ModelTarget

__all__ = ["resolve_policy", "plan_budget", "policy_per_block"]


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
  spec = jaxckpt.parse_model_policy(policy if policy is not None else "none")
  if gradient_checkpointing is None:
    return spec
  switch = "--gradient-checkpointing" if gradient_checkpointing else "--no-gradient-checkpointing"
  wanted = jaxckpt.parse_policy("full" if gradient_checkpointing else "none")
  if policy is not None and spec != wanted:
    raise JaxckptError(f"{switch} means --policy {wanted}, which conflicts with --policy {policy}; give one of them")
  return wanted


def plan_budget(spec: jaxckpt.policies.ModelPolicy, target: ModelTarget, *, tx: Any, log) -> tuple[Any, dict | None]:
  """Turns the run's ``--policy`` into a concrete policy for this run's model, batch and optimizer: a budget into the
  least-recompute plan, ``min_saved`` into its per-tensor spec; a concrete policy is returned as it is.

  Args:
    spec: from :func:`resolve_policy`; anything but a model-level policy to plan (a budget) is returned
      unchanged (:func:`jaxckpt.planner.resolve_policy`, the one place budgets become plans).
    target: the run's model, loss and batch shapes (built abstractly by the planner, never allocated).
    tx: the run's optimizer (its state counts in the footprint).
    log: where the plan's explanation goes.

  Returns:
    ``(policy, plan_json)``: the policy to train with and :meth:`jaxckpt.planner.Plan.to_json` without the
    candidate table (``None`` when ``spec`` was not a budget).

  Raises:
    InfeasibleBudgetError: no plan fits (a :class:`~jaxckpt.errors.JaxckptError`: the CLI exits 2 with its message).
    JaxckptError: ``mincut:<cap>``, a whole-loss plan the experiments' step (which returns metrics) cannot take.
  """
  if spec.scope == "loss":  # mincut
    raise JaxckptError(f"--policy {spec} remats the whole loss of the plain train step (the report's and the planner's); "
                       "the experiments' step also returns the loss metrics and finite flag the loop reads, so it "
                       "cannot take a whole-loss plan: use min_saved or budget:<size> here, or compare mincut rows "
                       "with jaxckpt-report")
  policy, plan = resolve_planned(target, spec, tx=tx)
  if plan is None:
    return policy, None
  log(plan.explain())
  return policy, {k: v for k, v in plan.to_json().items() if k != "candidates"}


def policy_per_block(spec: Any, block_types: Collection[str]) -> dict[str, Any]:
  """``{block type: policy}`` of a per-block spec; for a layered policy ``{"first-last": {block type: policy}}``."""
  if spec.layered is not None:
    out, first = {}, 0
    for count, sub in spec.layered.segments:
      out[f"{first}-{first + count - 1}"] = {block: str(sub.for_block(block)) for block in block_types}
      first += count
    return out
  return {block: str(spec.for_block(block)) for block in block_types}
