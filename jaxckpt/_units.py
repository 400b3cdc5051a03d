"""Byte sizes in binary units (B, KiB, MiB, GiB, TiB): rendering and parsing.

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
