"""The footprint model of the fit planner: a step's compiled bytes as an affine function of the batch size.

A train step's buffers are parameters, optimizer state and gradients (independent of the batch) plus activations,
inputs and logits (proportional to it), so its compiled footprint (argument + output + temp − alias bytes,
:data:`jaxckpt.schema.FOOTPRINT`) is close to ``a + b·batch``. XLA's buffer assignment and fusion choices make it
only *close*: the fit predicts, a compile decides (:mod:`jaxckpt.fit._search`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxckpt.errors import JaxckptError


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


def line_through(points: Sequence[tuple[int, int]]) -> AffineModel:
  """:func:`fit_affine` over two or more distinct batch sizes; through the origin for one (a value proportional to
  the batch, as FLOPs are: a global batch of 1 compiles one batch size only).

  Raises:
    JaxckptError: no point, or one at batch 0.
  """
  if len({b for b, _ in points}) > 1:
    return fit_affine(points)
  if not points or points[0][0] <= 0:
    raise JaxckptError(f"a line needs a point at a batch size ≥ 1, got {list(points)}")
  batch, value = points[0]
  return AffineModel(0.0, value / batch, tuple(points))


def tangent_at_crossing(points: Sequence[tuple[int, int]], limit: float, lo: int, hi: int | None) -> AffineModel | None:
  """Where a curved footprint crosses ``limit``: a parabola through the three points nearest the limit, returned as
  the line through its crossing (so :meth:`AffineModel.largest_within` gives the parabola's answer).

  Args:
    points: ``(size, bytes)`` compiles so far.
    limit: the bytes to fit.
    lo: the largest size known to fit; hi: the smallest known not to (or ``None``).

  Returns:
    A line through the parabola's crossing inside ``(lo, hi)``, or ``None`` with fewer than three distinct sizes, a
    crossing outside the bracket, or a parabola that is (nearly) a line (then the chord is as good).
  """
  near = sorted(points, key=lambda p: abs(p[1] - limit))[:3]
  if len({b for b, _ in near}) < 3:
    return None
  xs = np.array([b for b, _ in near], dtype=float)
  ys = np.array([v for _, v in near], dtype=float)
  a, b, c = np.polyfit(xs, ys, 2)
  if abs(a) * (xs.max() - xs.min()) ** 2 < 1e-3 * abs(ys).max():
    return None
  roots = [r.real for r in np.roots([a, b, c - limit]) if abs(r.imag) < 1e-9]
  inside = [r for r in roots if r > lo and (hi is None or r < hi)]
  if not inside:
    return None
  x = min(inside)
  slope = 2 * a * x + b
  if slope <= 0:
    return None
  return AffineModel(limit - slope * x, slope, tuple(near))
