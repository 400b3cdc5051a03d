"""The chip table: one row per accelerator a plan can be made for (TPU chips and NVIDIA GPUs), with the facts the
memory verdict and the time model read (memory, peak FLOP/s, HBM bandwidth, interconnects, host memory).
"""

from __future__ import annotations

from typing import NamedTuple

_GiB = 2**30


class Chip(NamedTuple):
  """Facts of one accelerator chip (per chip: a TPU chip, a GPU).

  Attributes:
    name: how tables show it (``"TPU v5e"``).
    device_kinds: JAX's ``device.device_kind`` strings of this chip (``"TPU v5 lite"``); GPUs are also found by
      their key in the kind (``h100`` in ``"NVIDIA H100 80GB HBM3"``).
    memory_bytes: HBM per chip, bytes.
    peak_flops: dense bfloat16 FLOP/s per chip (the vendor's peak, not an achieved rate).
    bandwidth: HBM bytes/s per chip.
    torus: TPU: the dimensions of the topology name (2 for v5e/v6e, 3 for v4/v5p); 0: no topology (GPUs: JAX 0.10.2
      has no deviceless CUDA compile, "topology not implemented for cuda").
    chip_config: TPU: libtpu's chip config (``"megacore"``: both TensorCores of a chip are one device).
    cores: TPU: TensorCores per chip (Cloud's accelerator types count cores for v4 and v5p: ``v4-8`` is 4 chips).
    accelerator_type: TPU: the prefix of Cloud's accelerator type (``v5litepod`` in ``v5litepod-4``).
    ici_bandwidth: bytes/s per chip a collective (all-gather, reduce-scatter, all-reduce over the slice) moves:
      half the datasheet's bidirectional inter-chip bandwidth (TPU: equals the "all-reduce bandwidth per Pod"
      divided by its chips where Cloud states it: v6e 102.4 TB/s / 256, v5e 51.2 TB/s / 256); GPUs: NVLink's.
    host_bandwidth: bytes/s per direction between the chip and its host's memory (PCIe x16, nominal: Gen5 63 GB/s,
      Gen4 31.5 GB/s): what host offload moves residuals at.
    host_memory_bytes: the host's DRAM per chip (Cloud's "DRAM per host" or VM RAM over its chips; a DGX's over
      its GPUs): what host offload may fill.
  """

  name: str
  device_kinds: tuple[str, ...]
  memory_bytes: int
  peak_flops: float
  bandwidth: float
  torus: int = 0
  chip_config: str = "default"
  cores: int = 1
  accelerator_type: str | None = None
  ici_bandwidth: float = 0.0
  host_bandwidth: float = 0.0
  host_memory_bytes: int = 0


_GEN5, _GEN4 = 63e9, 31.5e9  # PCIe x16 per direction, nominal

CHIPS: dict[str, Chip] = {
    "h100": Chip("NVIDIA H100 SXM", ("NVIDIA H100 80GB HBM3",), 80 * _GiB, 989e12, 3.35e12,
                 ici_bandwidth=450e9, host_bandwidth=_GEN5, host_memory_bytes=256 * _GiB),
    "h200": Chip("NVIDIA H200", ("NVIDIA H200",), 141 * _GiB, 989e12, 4.8e12,
                 ici_bandwidth=450e9, host_bandwidth=_GEN5, host_memory_bytes=256 * _GiB),
    "a100": Chip("NVIDIA A100 80GB", ("NVIDIA A100-SXM4-80GB",), 80 * _GiB, 312e12, 2.039e12,
                 ici_bandwidth=300e9, host_bandwidth=_GEN4, host_memory_bytes=128 * _GiB),
    "v4": Chip("TPU v4", ("TPU v4",), 32 * _GiB, 275e12, 1.2e12, 3, "megacore", 2, "v4",
               ici_bandwidth=1.1e15 / 4096, host_bandwidth=_GEN4, host_memory_bytes=407 * 10**9 // 4),
    "v5e": Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 16 * _GiB, 197e12, 819e9, 2, "default", 1, "v5litepod",
                ici_bandwidth=200e9, host_bandwidth=_GEN4, host_memory_bytes=512 * _GiB // 8),
    "v5p": Chip("TPU v5p", ("TPU v5", "TPU v5p"), 95 * _GiB, 459e12, 2.765e12, 3, "megacore", 2, "v5p",
                ici_bandwidth=600e9, host_bandwidth=_GEN4, host_memory_bytes=448 * 10**9 // 4),
    "v6e": Chip("TPU v6e", ("TPU v6 lite", "TPU v6e"), 32 * _GiB, 918e12, 1.64e12, 2, "default", 1, "v6e",
                ici_bandwidth=400e9, host_bandwidth=_GEN5, host_memory_bytes=1536 * _GiB // 8),
}
"""Chip key -> :class:`Chip`: the one table of accelerator facts (the fit planner's time model and memory default,
the report's header). Vendor datasheets: NVIDIA H100/H200/A100 datasheets (dense BF16 Tensor Core FLOP/s without
sparsity, HBM bandwidth, NVLink 900/600 GB/s bidirectional; host memory: a DGX H100/H200's 2 TB, a DGX A100's 1 TB
over its 8 GPUs); Google Cloud TPU docs, "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" (BF16 peak compute, HBM capacity
and bandwidth per chip; bidirectional ICI bandwidth per chip: v5e 400 GB/s, v6e 800 GB/s, v5p 1200 GB/s; v4's
all-reduce bandwidth per Pod, 1.1 PB/s over 4096 chips; DRAM per host: v5e 512 GiB and v6e 1536 GiB over 8 chips,
the 4-chip VM's RAM for v5p (448 GB) and v4 (407 GB); v6e "connects to the host through a PCIe Gen5 interface", the
others assumed Gen4 x16). The TPU keys are the chip part of topology names (``v5e`` in ``v5e:2x2``)."""


def chip_for_kind(device_kind: str) -> Chip | None:
  """The :class:`Chip` of a JAX ``device_kind`` (``"TPU v5 lite"`` → v5e; ``"NVIDIA H100 80GB HBM3"`` → h100), or
  ``None`` when the table has no such chip."""
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  squeezed = device_kind.lower().replace(" ", "").replace("-", "")
  return next((chip for key, chip in CHIPS.items() if not chip.torus and key in squeezed), None)
