"""The footprint model of the fit planner: a step's compiled bytes as an affine function of the batch size.

A train step's buffers are parameters, optimizer state and gradients (independent of the batch) plus activations,
inputs and logits (proportional to it), so its compiled footprint (argument + output + temp − alias bytes,
:data:`jaxckpt.schema.FOOTPRINT`) is close to ``a + b·batch``. XLA's buffer assignment and fusion choices make it
only *close*: the fit predicts, a compile decides (:mod:`jaxckpt.fit.search`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxckpt.errors import JaxckptError

__all__ = ["AffineModel", "fit_affine"]


@dataclasses.dataclass(frozen=True)
class AffineModel:
  """``value(batch) = intercept + slope · batch``, fitted to compiled points.

  Attributes:
    intercept: bytes (or FLOPs) at batch 0: what does not scale with the batch (parameters, optimizer state).
    slope: bytes (or FLOPs) per example.
    points: the ``(batch, value)`` pairs it was fitted to.
  """

  intercept: float
  slope: float
  points: tuple[tuple[int, int], ...] = ()

  def __call__(self, batch: float) -> float:
    """The predicted value at ``batch`` examples."""
    return self.intercept + self.slope * batch

  def largest_within(self, limit: float, *, step: int = 1) -> int:
    """The largest multiple of ``step`` whose predicted value is ≤ ``limit`` (0 when even ``step`` is over it).

    Raises:
      JaxckptError: a slope ≤ 0 (the value does not grow with the batch: no largest batch).
    """
    if self.slope <= 0:
      raise JaxckptError(f"the footprint does not grow with the batch size (slope {self.slope:.0f} bytes per example "
                         f"from compiles at batch sizes {[b for b, _ in self.points]}): no largest batch to find")
    return max(0, math.floor((limit - self.intercept) / self.slope / step) * step)

  def residual(self, batch: int, value: int) -> float:
    """``value`` minus the prediction at ``batch``, as a share of ``value`` (how far from affine a point is)."""
    return (value - self(batch)) / value if value else 0.0


def fit_affine(points: Sequence[tuple[int, int]]) -> AffineModel:
  """Least-squares line through ``(batch, value)`` points (at least two distinct batch sizes).

  Args:
    points: ``(batch size, bytes)`` pairs, e.g. compiled footprints.

  Returns:
    The :class:`AffineModel`.

  Raises:
    JaxckptError: fewer than two distinct batch sizes.
  """
  xs = sorted({b for b, _ in points})
  if len(xs) < 2:
    raise JaxckptError(f"an affine fit needs two distinct batch sizes, got {xs}")
  n = len(points)
  mx = sum(b for b, _ in points) / n
  my = sum(v for _, v in points) / n
  sxx = sum((b - mx) ** 2 for b, _ in points)
  sxy = sum((b - mx) * (v - my) for b, v in points)
  slope = sxy / sxx
  return AffineModel(my - slope * mx, slope, tuple(points))
