"""XLA's buffer assignment of a compiled program, read from its dump: the bytes in each memory space (the device's HBM
and the host's memory), the values live at the memory peak, and the device footprint of a host-offload program from
its memory stats.

XLA's buffer assignment puts every buffer of a program in an allocation of one memory space ("color"): 0 the
device's main memory (HBM), 5 the host's pinned memory (``S(5)`` in a layout, :data:`HOST_MEMORY_SPACE`), and on a
TPU 1 the on-chip vector memory (VMEM), 2 the scalar memory, 4 and 6 small host and flag buffers. With
``compiler_options={"xla_dump_to": DIR, "xla_dump_hlo_as_text": True}`` the compiler writes
``*-memory-usage-report.txt``, which opens each space with ``Memory Space: <name> (color=<n>)`` and ``Total bytes:
<n>``: the bytes of that space's allocations, parameters and outputs included (an output aliased to a donated
parameter is one allocation). :func:`read_memory_spaces` reads it. ``*-live-range.txt`` lists the schedule and, under
``Live ranges at <n> (peak):``, every HLO value live at the peak with its bytes (``  fusion.12{}: 4096 bytes``):
:func:`live_at_peak` reads it.

The device footprint of a program that offloads residuals (``docs/tpu.md``, "Host offload"): the TPU compiler's
``CompiledMemoryStats`` do not give it directly. Measured with libtpu 0.0.42.1 (deviceless):

- ``peak_memory_in_bytes`` is the larger of the HBM total and the host space's total plus the device arguments and
  outputs (less aliases): a scanned 16-layer stack on v5e:2x2 whose layer input is offloaded (512 MiB on the host)
  has an HBM total of 616.5 MiB and a peak of 800 MiB = 512 + 160 + 128; Llama 2 70B at 4096 tokens per chip on
  v5e:16x16 under ``qkv_proj_offloaded`` (6.25 GiB on the host) an HBM total of 13.49 GiB and a peak of 13.49 GiB
  (7.6 MiB less).
- ``temp_size_in_bytes`` is neither the HBM temporaries nor HBM plus host: 361 MiB against the stack's 328.5 MiB of
  HBM temporaries, 14.95 GiB against the 70B step's 10.47 GiB (whose arguments, 3.03 GiB, and temporaries fill 13.49
  GiB of the chip's 15.75 GiB available: the compiler accepted it).

So the device bytes are exact where the peak is the HBM total, and otherwise need the buffer assignment
(:func:`offload_device_bytes`).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from jaxckpt.analysis.hlo._parse import HOST_MEMORY_SPACE
from jaxckpt.errors import JaxckptError

DEVICE_MEMORY_SPACE = 0
"""The memory space (color) of the device's main memory (HBM)."""

_SPACE = re.compile(r"^Memory Space: (?P<name>.*?) \(color=(?P<color>\d+)\)\s*\nTotal bytes: (?P<bytes>\d+)", re.M)


class MemorySpace(NamedTuple):
  """One memory space of a compiled program's buffer assignment."""

  color: int  # XLA's memory space number: 0 device memory, 5 host memory, TPU 1 VMEM, 2 SMEM, ...
  name: str  # as the report names it ("default", "vmem", "smem", "host", "cmem", "color_6")
  bytes: int  # its allocations' bytes


class MemorySpaces(NamedTuple):
  """The bytes a compiled program's buffer assignment puts in each memory space (:func:`read_memory_spaces`)."""

  spaces: Mapping[int, MemorySpace]  # by color

  @property
  def device_bytes(self) -> int:
    """Bytes in the device's main memory (color 0): arguments, outputs and temporaries, as allocated."""
    space = self.spaces.get(DEVICE_MEMORY_SPACE)
    return space.bytes if space else 0

  @property
  def host_bytes(self) -> int:
    """Bytes in host memory (color :data:`HOST_MEMORY_SPACE`): offloaded residuals and their buffers."""
    space = self.spaces.get(HOST_MEMORY_SPACE)
    return space.bytes if space else 0


def _report_path(path: str) -> str:
  if os.path.isfile(path):
    return path
  found = sorted(glob.glob(os.path.join(path, "**", "*memory-usage-report.txt"), recursive=True))
  if not found:
    raise JaxckptError(f"no *memory-usage-report.txt under {path!r}: compile with compiler_options="
                       "{'xla_dump_to': DIR, 'xla_dump_hlo_as_text': True} and pass DIR")
  return found[-1]


def read_memory_spaces(path: str) -> MemorySpaces:
  """The bytes per memory space of a compiled program, from XLA's memory-usage report.

  Args:
    path: the ``*memory-usage-report.txt`` file, or a dump directory holding one (the last by name, the train
      step's when one step was compiled into it).

  Returns:
    The :class:`MemorySpaces`: :attr:`~MemorySpaces.device_bytes` (HBM), :attr:`~MemorySpaces.host_bytes`, every
    space by color.

  Raises:
    JaxckptError: no report there, or a report without a ``Memory Space`` section.
  """
  report = _report_path(path)
  with open(report, encoding="utf-8") as f:
    text = f.read()
  spaces = {int(m["color"]): MemorySpace(int(m["color"]), m["name"], int(m["bytes"])) for m in _SPACE.finditer(text)}
  if not spaces:
    raise JaxckptError(f"{report!r} has no 'Memory Space: ... (color=N)' section: not an XLA memory-usage report")
  return MemorySpaces(spaces)


def offload_device_bytes(stats: Mapping[str, int | None], spaces: MemorySpaces | None = None,
                         *, tolerance: int = 1 << 20) -> tuple[int | None, bool]:
  """The device bytes of a compiled TPU step that may offload to host memory: ``(bytes, exact)``.

  Args:
    stats: :func:`jaxckpt.training.memory_stats` of the compile (keys ``peak_memory_bytes``, ``argument_bytes``,
      ``output_bytes``, ``alias_bytes``, ``host_*_bytes``).
    spaces: its buffer assignment (:func:`read_memory_spaces`), when the compile was dumped.
    tolerance: bytes by which the peak must exceed the host space's figure to be taken as the device's.

  Returns:
    The buffer assignment's HBM total where ``spaces`` is given (exact); else the compiler's peak where it is above
    the host bytes plus the resident arguments and outputs (exact to a few MiB: the peak is the HBM total then);
    else ``(peak, False)``: an upper bound (the peak is the host space's figure, the HBM total is at most that).
    ``(None, False)`` without a peak.
  """
  if spaces is not None:
    return spaces.device_bytes, True
  peak = stats.get("peak_memory_bytes")
  if peak is None:
    return None, False
  host = sum(stats.get(k) or 0 for k in ("host_argument_bytes", "host_output_bytes", "host_temp_bytes")) - (
      stats.get("host_alias_bytes") or 0)
  resident = (stats.get("argument_bytes") or 0) + (stats.get("output_bytes") or 0) - (stats.get("alias_bytes") or 0)
  if host <= 0 or peak > host + resident + tolerance:
    return peak, True
  return peak, False


class LiveBuffer(NamedTuple):
  """An HLO value live at a compiled program's memory peak (:func:`live_at_peak`)."""

  instruction: str  # the instruction that defines it ("fusion.12")
  index: str  # its place in the instruction's (tuple) result, as written: "{}" for the whole result, "{1}", ...
  bytes: int  # its size


_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_LIVE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?: (\d+) bytes")


def live_at_peak(text: str) -> tuple[LiveBuffer, ...]:
  """The values live at the memory peak, from the text of XLA's ``*-live-range.txt`` dump, in the order written.

  Args:
    text: the live-range report (its ``Live ranges at <n> (peak):`` section, one ``  <value>{<index>}: <n> bytes``
      line per value).

  Returns:
    The :class:`LiveBuffer` records; ``()`` where the text has no peak section.
  """
  out: list[LiveBuffer] = []
  in_peak = False
  for line in text.splitlines():
    if _PEAK.match(line):
      in_peak = True
      continue
    if in_peak:
      match = _LIVE.match(line)
      if not match:
        break
      out.append(LiveBuffer(match.group(1), match.group(2) or "{}", int(match.group(3))))
  return tuple(out)
