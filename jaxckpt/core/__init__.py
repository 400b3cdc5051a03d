"""Framework-free remat: policies applied to functions and modules (``jaxckpt.remat``, ``jaxckpt.checkpoint``), the
block math both front-ends share, checkpoint structures (:func:`apply_layers`: scan or unrolled, ``every:K``,
``nested``), checkpoint names (constants in :mod:`jaxckpt.names`; automatic names from layer paths,
:func:`auto_named`), value tagging for per-tensor policies, and the verbs both front-ends answer
(``jaxckpt.apply_remat`` / ``set_policy`` / ``with_policy`` / ``block_types``, :mod:`jaxckpt.core._frontends`).

Nothing here imports Flax's NNX or Linen front-ends, the models, the step or the tools above them. Implementation
modules are private (``_remat``, ``_blocks``, ``_structure``, ...).
"""

from __future__ import annotations

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.core._autonames import auto_named
from jaxckpt.core._structure import STRUCTURE_KINDS, Structure, apply_layers, parse_structure

__all__ = [
    "apply_layers",
    "Structure",
    "parse_structure",
    "STRUCTURE_KINDS",
    "auto_named",
]

__getattr__ = _forward_names(__name__, {
    "warn_policy": ("jaxckpt.core._diagnostics", "warn_policy"),
})
