"""Byte sizes in binary units (B, KiB, MiB, GiB, TiB): rendering and parsing; seconds rendered in s, ms, µs.

Internally every size is an int number of bytes; these helpers are used only at the edges (tables, CLI flags).
"""

from __future__ import annotations

import re

UNITS: dict[str, int] = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
"""Binary unit -> bytes."""

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*\Z")


def format_bytes(n: int | None) -> str:
  """Renders a byte count in the largest binary unit that keeps it ≥ 1, e.g. ``1536 -> '1.50 KiB'``; ``None -> 'n/a'``."""
  if n is None:
    return "n/a"
  sign, n = ("-" if n < 0 else ""), abs(n)
  for unit in ("TiB", "GiB", "MiB", "KiB"):
    if n >= UNITS[unit]:
      return f"{sign}{n / UNITS[unit]:.2f} {unit}"
  return f"{sign}{n} B"


def format_seconds(s: float | None) -> str:
  """Renders seconds with three significant digits in the largest unit that keeps them ≥ 1 (s, ms, µs), e.g.
  ``0.0253 -> '25.3 ms'``, ``-2.1e-06 -> '-2.10 µs'``, ``1234.5 -> '1,234 s'``; ``None -> 'n/a'``."""
  if s is None:
    return "n/a"
  if s == 0:
    return "0 s"
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
    value = float(f"{s / scale:.3g}")  # rounded first: 0.99996 s is 1.00 s, not 1.00e+03 ms
    if abs(value) >= 1000:
      return f"{s / scale:,.0f} {unit}"
    if abs(value) >= 1 or unit == "µs":
      return f"{value:#.3g} {unit}".replace(". ", " ")
  raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
  """Parses a size such as ``'1.5GiB'``, ``'800 MiB'`` or ``'4096B'`` into bytes (rounded down).

  Raises:
    ValueError: no number, a negative number, or a unit not in :data:`UNITS` (decimal units such as ``GB`` are
      refused rather than guessed).
  """
  match = _SIZE_RE.match(text)
  if not match or match.group(2) not in UNITS:
    raise ValueError(f"bad size {text!r}: write a number and a binary unit, one of {', '.join(UNITS)} (e.g. 1.5GiB)")
  return int(float(match.group(1)) * UNITS[match.group(2)])
