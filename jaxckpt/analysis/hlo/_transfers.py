"""Copies between device memory and host memory in a compiled program: residuals offloaded to the host and reloaded.

A host offload is a ``dynamic-update-slice`` into an ``S(5)`` buffer (device to host, :data:`HOST_MEMORY_SPACE`) and
a ``dynamic-slice`` out of one (host to device): TPU writes them as ``dynamic-update-slice-start`` /
``dynamic-slice-start`` instructions, GPU as ``fusion-start`` of a computation holding the slice; a copy between the
two memory spaces, a ``MoveToHost``/``MoveToDevice`` custom call and a host send/recv move bytes too
(``docs/hlo-reading.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from jaxckpt.analysis.hlo._parse import (RUNS_BODY, HloComputation, HloInstruction, async_output, called_instructions,
                                         first_array, leaves, shape_bytes)


class HostTransfer(NamedTuple):
  """A copy between device memory and host memory (:data:`~jaxckpt.analysis.hlo.HOST_MEMORY_SPACE`), once per async pair
  (:meth:`HloModule.host_transfers`)."""

  direction: str  # "to_host" (device -> host: an offload) or "to_device" (host -> device: a reload)
  bytes: int  # bytes moved per run
  instruction: HloInstruction  # the moving instruction (dynamic-update-slice, dynamic-slice, copy, ...)
  unit: str  # the executed instruction that runs it: itself, or the fusion / fusion-start that holds it
  count: int  # runs per step

  @property
  def total_bytes(self) -> int:
    """``bytes * count``: bytes per device per step."""
    return self.bytes * self.count


def _moves(comp: HloComputation, ins: HloInstruction) -> tuple[str, int] | None:
  """``(direction, bytes)`` if an instruction copies between device and host memory, else None."""
  operand = lambda i: comp.by_name.get(ins.operands[i]) if len(ins.operands) > i else None  # noqa: E731
  on_host = lambda shape: any(a.on_host for a in leaves(shape))  # noqa: E731
  source, target = operand(0), None
  if ins.opcode in ("dynamic-update-slice", "dynamic-update-slice-start"):
    update = operand(1)
    if source is None or update is None or on_host(source.shape) == on_host(update.shape):
      return None
    return ("to_host" if on_host(source.shape) else "to_device"), update.output_bytes
  if ins.opcode in ("dynamic-slice", "dynamic-slice-start", "copy", "copy-start"):
    target = async_output(ins)
  elif ins.opcode == "custom-call" and ins.custom_call_target in ("MoveToHost", "MoveToDevice"):
    return ("to_host" if ins.custom_call_target == "MoveToHost" else "to_device"), shape_bytes(ins.shape)
  elif ins.opcode in ("send", "recv") and ins.attributes.get("is_host_transfer") == "true":
    shape = source.shape if ins.opcode == "send" and source is not None else first_array(ins.shape)
    return ("to_host" if ins.opcode == "send" else "to_device"), shape_bytes(shape)
  if source is None or target is None or on_host(source.shape) == on_host(target):
    return None
  return ("to_device" if on_host(source.shape) else "to_host"), shape_bytes(target)


def unit_transfers(computations: Mapping[str, HloComputation],
                   ins: HloInstruction) -> Iterator[tuple[HloInstruction, str, int]]:
  """``(moving instruction, direction, bytes)`` of each host transfer one executed instruction runs (inside a fusion
  or async start too)."""
  inner = list(called_instructions(computations, ins)) if ins.opcode in RUNS_BODY else [ins]
  for i in inner:
    moved = _moves(computations[i.computation], i)
    if moved is not None:
      yield i, *moved
