"""Splitting a call's arguments into what ``jax.checkpoint`` traces and what it closes over, for both front-ends.

``jax.checkpoint`` (like ``jax.jit``) traces its function's arguments: arrays become tracers, while Python values
(flags such as ``deterministic=True``, strings, ``None``, modules) must stay static or they fail or retrace. When a
block's call is wrapped without asking the user which arguments are static (:func:`jaxckpt.nnx._apply.apply_remat`,
:func:`jaxckpt.linen.apply_remat`), the arrays among the call's leaves are passed through and every other leaf is
closed over, the way ``jax.checkpoint``'s ``static_argnums`` would mark them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def is_array(leaf: Any) -> bool:
  """Whether a pytree leaf is traced (a JAX or NumPy array or NumPy scalar); everything else is static."""
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class SplitArguments:
  """A call's ``(args, kwargs)`` split into its array leaves and the rest.

  Attributes:
    arrays: the array leaves, in tree order: pass these through ``jax.checkpoint``.
    leaves: every leaf, in tree order (static ones are closed over as they are).
    traced: per leaf, whether it is one of ``arrays``.
    treedef: the tree of ``(args, kwargs)``.
  """

  arrays: list[Any]
  leaves: list[Any]
  traced: list[bool]
  treedef: Any

  def merge(self, arrays: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the array leaves replaced by ``arrays`` (e.g. the tracers inside the checkpoint)."""
    it = iter(arrays)
    return self.treedef.unflatten([next(it) if t else leaf for leaf, t in zip(self.leaves, self.traced)])


def split_arguments(args: tuple, kwargs: dict, *, is_leaf: Callable[[Any], bool] | None = None) -> SplitArguments:
  """Splits ``(args, kwargs)`` into array leaves and static leaves (:class:`SplitArguments`).

  Args:
    args: positional arguments of the call.
    kwargs: keyword arguments of the call.
    is_leaf: as ``jax.tree.flatten``'s (e.g. keep ``nnx.Module`` arguments whole).

  Returns:
    The :class:`SplitArguments`; ``merge(split.arrays)`` gives ``(args, kwargs)`` back.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_leaf)
  traced = [is_array(leaf) for leaf in leaves]
  return SplitArguments([leaf for leaf, t in zip(leaves, traced) if t], leaves, traced, treedef)
