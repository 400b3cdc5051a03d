"""Bounds on shapes that JAX or XLA cannot represent, checked before any compile.

Two kinds of absurd sizes got through before: a dimension past 2³¹ − 1, which JAX truncates where it indexes with
int32 (``--batch-size 1099511627776`` gave an "ok" row of 1.8 million TiB from a program whose indices wrapped), and
an array larger than any device holds, which XLA's buffer assignment cannot place (``--seq-len 110000000``: the
attention scores, 1.5 EiB, aborted the process inside XLA's heap simulator). :data:`INT32_MAX` bounds the first (the
CLIs check every flag that becomes a dimension, :data:`jaxckpt.cli._parser.DIMENSION_FLAGS`); :func:`check_array_sizes`
bounds the second on the traced forward pass, naming the size that made the array.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxckpt._units import format_bytes
from jaxckpt.analysis._jaxprs import iter_eqns
from jaxckpt.errors import JaxckptError
from jaxckpt.policies._spec import PolicySpec
from jaxckpt.sharding import CHIPS
from jaxckpt.step._targets import ModelTarget, Target

INT32_MAX = 2**31 - 1
"""The largest array dimension JAX indexes safely: its index arithmetic (iota, gather and scatter indices, dynamic
slices) is int32 unless 64-bit mode is on."""


def largest_device_bytes() -> int:
  """The memory of the largest device anything here may compile for: the chip table's largest HBM
  (:data:`jaxckpt.sharding.CHIPS`) or this host's RAM (XLA:CPU), bytes."""
  try:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    host = 0
  return max([host, *(chip.memory_bytes for chip in CHIPS.values())])


def _sizes(target: Target) -> dict[str, int]:
  """The size parameters the target's batch shows: ``batch_size`` (the leading dimension) and, for token arrays
  ``[B, T]``, ``seq_len``."""
  leaves = [x for x in jax.tree.leaves(getattr(target, "batch", None)) if getattr(x, "shape", None)]
  out = {}
  if leaves:
    out["batch_size"] = int(leaves[0].shape[0])
  tokens = [x for x in leaves if len(x.shape) == 2 and np.issubdtype(x.dtype, np.integer)]
  if tokens:
    out["seq_len"] = int(tokens[0].shape[1])
  return out


def _forward(target: Target) -> Any:
  """The jaxpr of the target's loss without remat, from shapes only."""
  if isinstance(target, ModelTarget):
    graphdef, params, rest = nnx.split(nnx.eval_shape(target.make_model), nnx.Param, ...)

    def loss(p, batch):
      model = nnx.merge(graphdef, p, rest)
      return target.loss_fn(model, batch, dropout_key=jax.random.key(0), deterministic=True)[0]

    return jax.make_jaxpr(loss)(params, target.batch)
  return jax.make_jaxpr(lambda p, b: target.loss(p, b, policy=PolicySpec()))(target.params, target.batch)


def check_array_sizes(target: Target, *, devices: int = 1, sizes: Mapping[str, int] | None = None) -> None:
  """Raises when the target's forward pass makes an array larger than any device holds, even split over
  ``devices``: XLA cannot place it (its buffer assignment aborts the process) and no device could run it.

  Args:
    target: the model or loss target (its batch's shapes).
    devices: the devices the step is compiled for (the mesh's or topology's), ≥ 1.
    sizes: the size parameters given (the CLI's flags), named where their value is a dimension of the array; else
      ``batch_size`` and ``seq_len`` read from the batch.

  Raises:
    JaxckptError: one line naming the size parameter(s) whose value is a dimension of the array
      (``seq_len=110000000 makes an array of 1.33 EiB ...``), its shape, and the bound. A model that raises while
      traced is left to the tools (their own one-line error names your file and line).
  """
  limit = largest_device_bytes() * max(1, devices)
  try:
    jaxpr = _forward(target)
  except JaxckptError:
    raise
  except Exception:  # noqa: BLE001 - a model that raises while traced: the tools say where (TracingError)
    return
  worst, worst_bytes = None, 0
  for eqn in iter_eqns(jaxpr):
    for var in eqn.outvars:
      aval = getattr(var, "aval", None)
      shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
      if shape is None or dtype is None:
        continue
      nbytes = math.prod(shape) * getattr(dtype, "itemsize", 1)
      if nbytes > worst_bytes:
        worst, worst_bytes = aval, nbytes
  if worst is None or worst_bytes <= limit:
    return
  named = {k: v for k, v in (sizes or {}).items() if v in worst.shape} or {
      k: v for k, v in _sizes(target).items() if v in worst.shape}
  which = ", ".join(f"{k}={v}" for k, v in named.items()) or "the batch's shapes"
  raise JaxckptError(f"{which} makes an array of {format_bytes(worst_bytes)} ({worst.str_short()}) in the forward "
                     f"pass, more than any device holds even split over {devices} device(s) "
                     f"({format_bytes(limit)}): XLA cannot place it; give a smaller "
                     + (" or ".join(k for k in named) if named else "batch"))
