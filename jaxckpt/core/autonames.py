"""Automatic checkpoint names for models that never call ``checkpoint_name``.

Inside a block matched by :func:`jaxckpt.apply_remat` (NNX) or :func:`jaxckpt.linen.apply_remat` (Linen), the
output of every standard Flax layer (:data:`NNX_LAYERS`, :data:`LINEN_LAYERS`) is tagged with
``jax.ad_checkpoint.checkpoint_name`` under the layer's attribute path relative to the block, joined by ``.``: in a
decoder layer with ``self.attn.q_einsum`` and ``self.mlp.up_proj`` the names are ``attn.q_einsum`` and
``mlp.up_proj``, so ``save_only_these_names:attn.q_einsum+mlp.up_proj`` works on the model as it was written. Names
the model tags itself are kept (the automatic tag wraps the layer's output only).

A layer that lies inside a nested matched block is named by that inner block (relative to it), not by the outer one.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
from flax import nnx

__all__ = ["NNX_LAYERS", "LINEN_LAYERS", "path_name"]

NNX_LAYERS: tuple[type, ...] = tuple(
    cls for cls in (
        getattr(nnx, "Linear", None), getattr(nnx, "LinearGeneral", None), getattr(nnx, "Einsum", None),
        getattr(nnx, "Conv", None), getattr(nnx, "ConvTranspose", None), getattr(nnx, "MultiHeadAttention", None),
    ) if cls is not None)
"""NNX layers whose outputs get an automatic checkpoint name inside a matched block."""

LINEN_LAYERS: tuple[type, ...] = tuple(
    cls for cls in (
        getattr(nn, "Dense", None), getattr(nn, "DenseGeneral", None), getattr(nn, "Einsum", None),
        getattr(nn, "Conv", None), getattr(nn, "ConvTranspose", None),
        getattr(nn, "MultiHeadDotProductAttention", None),
    ) if cls is not None)
"""Linen layers whose outputs get an automatic checkpoint name inside a matched block."""


def path_name(path: Sequence[object]) -> str:
  """The checkpoint name of a layer at ``path`` (attribute names / list indices) relative to its block.

  Args:
    path: e.g. ``("attn", "q_einsum")`` or ``("mlps", 0)``.

  Returns:
    ``"attn.q_einsum"``, ``"mlps.0"``; characters outside ``[A-Za-z0-9_.-]`` become ``_``.
  """
  text = ".".join(str(p) for p in path)
  return "".join(c if c.isalnum() or c in "_.-" else "_" for c in text)
