"""Checkpoint structure: *where* a stack of N blocks keeps its checkpoints, orthogonal to the per-block policy.

A policy decides what each block saves; a structure groups blocks and rematerializes whole groups, so only group
boundaries are kept across the forward pass (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
Flax Linen's ``nn.remat_scan(lengths=...)``; PyTorch's ``checkpoint_sequential(segments)``):

- ``block`` (default): no grouping; each block is remat'd by its own policy (``none`` = no remat at all).
- ``every:K``: groups of K consecutive blocks, each group under ``jax.checkpoint(nothing_saveable)``: the forward
  keeps N/K group inputs, the backward recomputes one group at a time (with the blocks' own policies inside).
  Memory ~ N/K + K block activations, minimal at K ≈ √N; a last, shorter group takes the remainder.
- ``nested`` = ``nested:2``, ``nested:D``: D levels of grouping, each level splitting its range into about
  n^(1/levels-left) near-equal groups (an outer scan over groups with remat on the group, inner scans over
  sub-groups, down to blocks): memory ~ D·N^(1/D) block activations for about D−1 extra forward passes. Depths that do
  not divide evenly get groups whose sizes differ by at most one.

Grammar: ``structure := "block" | "every:" K | "nested" [":" D]`` with integers K ≥ 1, D ≥ 2.
"""

from __future__ import annotations

import dataclasses
import math

from jaxckpt.errors import JaxckptError, closest

__all__ = ["Structure", "parse_structure", "STRUCTURE_KINDS"]

STRUCTURE_KINDS = ("block", "every", "nested")
"""Structure names; ``every`` takes ``:K``, ``nested`` an optional ``:D``."""


@dataclasses.dataclass(frozen=True)
class Structure:
  """A parsed structure.

  Attributes:
    kind: ``"block"``, ``"every"`` or ``"nested"``.
    size: K for ``every`` (blocks per group), D for ``nested`` (levels, ≥ 2), 0 for ``block``.
  """

  kind: str = "block"
  size: int = 0

  @property
  def levels(self) -> int:
    """Levels of nesting including the block level: 1 for ``block``, 2 for ``every``, D for ``nested:D``."""
    return {"block": 1, "every": 2}.get(self.kind, self.size)

  def groups(self, n: int, level: int) -> list[tuple[int, int]]:
    """How a range of ``n`` blocks at nesting ``level`` (0 = outermost) is split.

    Returns:
      ``[(count, size), ...]``: ``count`` consecutive groups of ``size`` blocks each, in order, sizes summing to
      ``n``. Each run of equal-size groups becomes one scan.
    """
    if self.kind == "every":
      k = min(self.size, n)
      plan = [(n // k, k)]
      return plan + [(1, n % k)] if n % k else plan
    g = max(1, min(n, math.ceil(n ** (1.0 / (self.levels - level)) - 1e-9)))
    q, r = divmod(n, g)
    return [(c, s) for c, s in ((r, q + 1), (g - r, q)) if c]

  def __str__(self) -> str:
    if self.kind == "block":
      return "block"
    return f"{self.kind}:{self.size}"


def parse_structure(text: "str | Structure | None") -> Structure:
  """Parses ``block``, ``every:K`` or ``nested[:D]`` (see the module docstring).

  Raises:
    JaxckptError: an unknown name (with the closest valid one), a missing or non-integer K/D, K < 1 or D < 2.
  """
  if text is None:
    return Structure()
  if isinstance(text, Structure):
    return text
  name, sep, arg = str(text).strip().partition(":")
  name, arg = name.strip(), arg.strip()
  if name not in STRUCTURE_KINDS:
    hint = closest(name, STRUCTURE_KINDS)
    raise JaxckptError(
        f"unknown structure {text!r}; valid: block, every:K, nested, nested:D"
        + (f"; did you mean {hint!r}?" if hint else "")
    )
  if name == "block":
    if sep:
      raise JaxckptError(f"structure 'block' takes no argument, got {text!r}")
    return Structure()
  if name == "nested" and not sep:
    return Structure("nested", 2)
  if not arg.isdigit():
    example = "every:4" if name == "every" else "nested:3"
    raise JaxckptError(f"structure {text!r} needs a whole number after ':' (e.g. {example})")
  value = int(arg)
  if name == "every" and value < 1:
    raise JaxckptError(f"structure {text!r}: K must be ≥ 1")
  if name == "nested" and value < 2:
    raise JaxckptError(f"structure {text!r}: nested needs D ≥ 2 levels")
  return Structure(name, value)
