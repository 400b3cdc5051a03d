"""Which policies a report compares: the user's specs, with ``all`` expanded for the target."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping

import jax

from jaxckpt.errors import TracingError
from jaxckpt.policies._spec import REGISTRY, Policy, PolicySpec
from jaxckpt.policies._model import ModelPolicy, parse_model_policy

ALL = "all"
"""The ``--policies`` word for every policy worth comparing on a target."""
OFFLOAD_POLICIES: frozenset[str] = frozenset(
    name for name in REGISTRY if "offload" in name
)
"""Policies that move residuals to host memory: useful on GPU/TPU only (on CPU host and device are one memory)."""


def all_policies(block_types: Mapping[str, Collection[str]], *, backend: str | None = None) -> list[PolicySpec]:
  """``none``, every zero-argument canonical policy (MaxText's presets where the target emits their names), and
  ``save_only_these_names:<name>`` per emitted name.

  Args:
    block_types: block type -> checkpoint names (:func:`jaxckpt.block_types`).
    backend: ``cpu``, ``gpu`` or ``tpu`` (default ``jax.default_backend()``); offload policies only off CPU.

  Returns:
    Parsed specs in registry order, then the per-name ones sorted by name.
  """
  backend = backend or jax.default_backend()
  names = sorted(set().union(*block_types.values())) if block_types else []
  specs = [PolicySpec(default=Policy(name)) for name, kind in REGISTRY.items()
           if kind.arity == "none" and (backend != "cpu" or name not in OFFLOAD_POLICIES)
           and (kind.preset is None or kind.preset.required <= set(names))]
  specs += [PolicySpec(default=Policy("save_only_these_names", (name,))) for name in names]
  return specs


def expand_policies(specs: Iterable[str | ModelPolicy], block_types: Mapping[str, Collection[str]], *,
                    backend: str | None = None, keep_all: bool = False) -> list[ModelPolicy | str]:
  """Parses every spec (``all`` expands in place) and drops repeats, keeping the first.

  Args:
    specs: spec strings in :func:`jaxckpt.policies.parse_model_policy`'s grammar (per-block specs, layered
      ``0-3:...;4-11:...`` policies, budgets ``budget:40%`` / ``auto``), ``"all"``, or parsed ones.
    block_types: the target's block types and names (for ``all``).
    backend: for ``all`` (see :func:`all_policies`).
    keep_all: leave ``all`` in place, to be expanded where the target's block types are known (a CLI parses its
      ``--policies`` at its door, before the target is built).

  Returns:
    The parsed specs (with ``keep_all``, ``"all"`` where it was). They are not validated against the target here:
    an invalid one becomes an error row.

  Raises:
    PolicySpecError: a spec that does not parse (unknown policy name, bad grammar).
  """
  out: list[ModelPolicy | str] = []
  seen: set[str] = set()
  for spec in specs:
    if spec == ALL and keep_all:
      parsed = [ALL]
    else:
      parsed = all_policies(block_types, backend=backend) if spec == ALL else [parse_model_policy(spec)]
    for item in parsed:
      if str(item) not in seen:
        seen.add(str(item))
        out.append(item)
  return out


def check_policy_names(specs: Iterable[ModelPolicy | str], block_types: Callable[[], Mapping[str, Collection[str]]]
                       ) -> None:
  """Refuses, before anything is compiled, a spec that names a checkpoint name or a block type the target does not
  have (a typo, like an unknown policy name): the one line of :class:`~jaxckpt.errors.PolicySpecError`.

  Args:
    specs: parsed specs (``"all"`` skipped).
    block_types: ``() -> {block type: checkpoint names}`` of the target, called only when a spec names a block type
      or a checkpoint name (it traces the model).

  Raises:
    PolicySpecError: the first such name, with the valid ones and the closest.
  """
  named = [s for s in specs if s != ALL and hasattr(s, "validate") and re.search(r"[:=]", str(s))
           and not str(s).startswith(("budget:", "auto"))]
  if named:
    try:
      types = block_types()
    except TracingError:  # the model raised while traced: every row says so (build_report), not this check
      return
    for spec in named:
      spec.validate(types)
