"""Human-readable renderings of jaxckpt's records (bytes in binary units). Records themselves stay in bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxckpt._units import format_bytes

_ROWS = (
    ("argument", "argument_bytes", "host_argument_bytes"),
    ("output", "output_bytes", "host_output_bytes"),
    ("temp", "temp_bytes", "host_temp_bytes"),
    ("alias", "alias_bytes", "host_alias_bytes"),
    ("generated code", "generated_code_bytes", "host_generated_code_bytes"),
)


def memory_table(memory: Mapping[str, int | None], *, title: str = "compiled train step memory (XLA)") -> str:
  """Renders a memory record (:mod:`jaxckpt.schema` keys, bytes) as an aligned device/host table.

  Missing values (``None``) render as ``n/a``.
  """
  lines = [f"{title}:", f"  {'':<16}{'device':>12}  {'host':>12}"]
  for label, device, host in _ROWS:
    lines.append(f"  {label:<16}{format_bytes(memory.get(device)):>12}  {format_bytes(memory.get(host)):>12}")
  lines.append(f"  {'footprint':<16}{format_bytes(memory.get('footprint_bytes')):>12}  (argument + output + temp - alias)")
  return "\n".join(lines)


def policy_summary(spec: Any, block_types: Mapping[str, object]) -> str:
  """Renders the policy each block type of a model gets, e.g. ``'attn -> dots_saveable, mlp -> nothing_saveable'``;
  for a layered policy one such list per layer range (``'layers 0-3: ...; layers 4-5: ...'``).

  ``spec`` is a concrete policy (a :class:`~jaxckpt.PolicySpec` or :class:`~jaxckpt.policies.LayeredPolicy`).
  """
  if spec.layered is not None:
    parts, first = [], 0
    for count, sub in spec.layered.segments:
      parts.append(f"layers {first}-{first + count - 1}: {policy_summary(sub, block_types)}")
      first += count
    return "; ".join(parts)
  return ", ".join(f"{block} -> {spec.for_block(block)}" for block in block_types) or str(spec)
