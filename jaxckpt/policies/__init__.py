"""Remat policies in two layers, one module each.

- :mod:`jaxckpt.policies._spec`: per-block specs. One grammar, one parser (:func:`parse_policy`), one registry of
  every ``jax.checkpoint_policies`` member; a :class:`PolicySpec` gives each block type a :class:`Policy`.
- :mod:`jaxckpt.policies._model`: model-level policies. A :class:`LayeredPolicy` (a spec per range of layers) and a
  :class:`Budget` (resolved into a plan by :func:`jaxckpt.planner.resolve_policy`), parsed by
  :func:`parse_model_policy`.
- :mod:`jaxckpt.policies._meaning`: does each JAX policy save what its name says, in the installed JAX (checked on a
  small graph; the parser refuses those that do not), and ``check_policy``, which refuses under remat3 what JAX would
  run as full remat.

The parser and the policy types users write (``parse_policy``, ``parse_model_policy``, ``Policy``, ``PolicySpec``,
``LayeredPolicy``, ``Budget``) are on the top-level face (``jaxckpt.parse_policy``); the rest is here.
"""

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.policies._model import (
    AUTO,
    BUDGET,
    DEFAULT_MARGIN,
    ConcretePolicy,
    LossPolicy,
    MIN_SAVED,
    MINCUT,
    MinCut,
    MinSaved,
    ModelPolicy,
    POLICY_FORMS,
)
from jaxckpt.policies._spec import (
    ALIASES,
    CANONICAL_POLICIES,
    DEFAULT_BLOCK,
    NO_REMAT,
    OFFLOAD_DST,
    OFFLOAD_SRC,
    POLICY_NAMES,
    REGISTRY,
    SAVE_TENSORS,
    MAXTEXT_OTHER_ARCHITECTURES,
    MAXTEXT_PRESETS,
    MaxTextPreset,
    PolicyKind,
)

__all__ = [
    "AUTO",
    "BUDGET",
    "DEFAULT_MARGIN",
    "ConcretePolicy",
    "LossPolicy",
    "MIN_SAVED",
    "MINCUT",
    "MinCut",
    "MinSaved",
    "ModelPolicy",
    "POLICY_FORMS",
    "ALIASES",
    "CANONICAL_POLICIES",
    "DEFAULT_BLOCK",
    "NO_REMAT",
    "OFFLOAD_DST",
    "OFFLOAD_SRC",
    "POLICY_NAMES",
    "REGISTRY",
    "SAVE_TENSORS",
    "MAXTEXT_OTHER_ARCHITECTURES",
    "MAXTEXT_PRESETS",
    "MaxTextPreset",
    "PolicyKind",
]

__getattr__ = _forward_names(__name__, {
    "Budget": ("jaxckpt.policies._model", "Budget"),
    "LayeredPolicy": ("jaxckpt.policies._model", "LayeredPolicy"),
    "Policy": ("jaxckpt.policies._spec", "Policy"),
    "PolicySpec": ("jaxckpt.policies._spec", "PolicySpec"),
    "parse_policy": ("jaxckpt.policies._spec", "parse_policy"),
    "parse_model_policy": ("jaxckpt.policies._model", "parse_model_policy"),
})
