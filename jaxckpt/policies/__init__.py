"""Remat policies in two layers, one module each.

- :mod:`jaxckpt.policies.spec`: per-block specs. One grammar, one parser (:func:`parse_policy`), one registry of
  every ``jax.checkpoint_policies`` member; a :class:`PolicySpec` gives each block type a :class:`Policy`.
- :mod:`jaxckpt.policies.model`: model-level policies. A :class:`LayeredPolicy` (a spec per range of layers) and a
  :class:`Budget` (resolved into a plan by :func:`jaxckpt.planner.resolve_policy`), parsed by
  :func:`parse_model_policy`.

Everything is re-exported here: ``from jaxckpt.policies import parse_policy, Budget``.
"""

from jaxckpt.policies.model import (
    AUTO,
    BUDGET,
    DEFAULT_MARGIN,
    Budget,
    ConcretePolicy,
    LayeredPolicy,
    LossPolicy,
    MIN_SAVED,
    MINCUT,
    MinCut,
    MinSaved,
    ModelPolicy,
    POLICY_FORMS,
    parse_model_policy,
)
from jaxckpt.policies.spec import (
    ALIASES,
    CANONICAL_POLICIES,
    DEFAULT_BLOCK,
    NO_REMAT,
    OFFLOAD_DST,
    OFFLOAD_SRC,
    POLICY_NAMES,
    REGISTRY,
    SAVE_TENSORS,
    Policy,
    PolicyKind,
    PolicySpec,
    parse_policy,
)

__all__ = [
    "AUTO",
    "BUDGET",
    "DEFAULT_MARGIN",
    "Budget",
    "ConcretePolicy",
    "LayeredPolicy",
    "LossPolicy",
    "MIN_SAVED",
    "MINCUT",
    "MinCut",
    "MinSaved",
    "ModelPolicy",
    "POLICY_FORMS",
    "parse_model_policy",
    "ALIASES",
    "CANONICAL_POLICIES",
    "DEFAULT_BLOCK",
    "NO_REMAT",
    "OFFLOAD_DST",
    "OFFLOAD_SRC",
    "POLICY_NAMES",
    "REGISTRY",
    "SAVE_TENSORS",
    "Policy",
    "PolicyKind",
    "PolicySpec",
    "parse_policy",
]
