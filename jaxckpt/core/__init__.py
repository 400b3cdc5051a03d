"""Framework-free remat: policies applied to functions and modules (:mod:`~jaxckpt.core.remat`), the block math
both front-ends share (:mod:`~jaxckpt.core.blocks`), checkpoint structures (:mod:`~jaxckpt.core.structure`),
checkpoint names (:mod:`~jaxckpt.core.names`, :mod:`~jaxckpt.core.autonames`) and value tagging
(:mod:`~jaxckpt.core.tagging`).

Nothing here imports Flax's NNX or Linen front-ends, the models, the step or the tools above them.
"""

from __future__ import annotations

from jaxckpt.core import arguments, autonames, blocks, diagnostics, matching, names, remat, structure, tagging

__all__ = [
    "arguments",
    "diagnostics",
    "matching",
    "autonames",
    "blocks",
    "names",
    "remat",
    "structure",
    "tagging",
]
