"""The LLM family's parameters: every one made by :func:`param`, with its logical axis names (Flax's
``nnx.with_partitioning``; :mod:`jaxckpt.sharding._rules` maps them to mesh axes)."""

from __future__ import annotations

from flax import nnx


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype) -> nnx.Param:
  """A parameter of ``shape`` and ``dtype`` whose axes carry the logical names ``axes`` (not sharded when made).

  Args:
    rngs: initialisation keys (its ``params`` stream).
    init: an ``nnx.initializers`` function ``(key, shape, dtype) -> array``.
    shape: the parameter's shape.
    axes: one logical name (or ``None``) per axis, e.g. ``("exp", "embed", "mlp")``.
    dtype: the parameter dtype (the config's ``weight_dtype``).
  """
  return nnx.Param(nnx.with_partitioning(init, axes, eager_sharding=False)(rngs.params(), shape, dtype))
