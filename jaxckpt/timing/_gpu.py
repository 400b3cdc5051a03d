"""What NVIDIA GPU kernels reach: the rates the time model gives each kind of kernel of an XLA:GPU program, each a
public measurement with its source; nothing here is fitted to the step times the estimate is checked against
(docs/timing.md).

| kernel | rate | source |
|---|---|---|
| cuBLAS / cuBLASLt GEMM (``__cublas$lt$matmul``, ``__cublas$gemm``), a fusion holding dots | the chip's bf16 peak × the fraction of it cuBLAS sustains (:data:`MATMUL_FRACTION`) × the matmul's tile and wave efficiency for its shape (:func:`jaxckpt.timing.matmul_efficiency`) | S. Bekman, "Machine Learning Engineering" (``compute/accelerator/README.md``, ``benchmarks/mamf-finder.py``, torch + cuBLAS): the maximum *sustainable* matmul FLOPS (MSMF: the best shape run until the GPU sits at its power limit, "the one to use for training, which is one long saturated run") — H200 SXM 755 of 989 TFLOP/s (76.3%), B200 1,429 of 2,250 (63.5%); where no MSMF is published, the maximum *achievable* one (MAMF: a burst at boost clock) — A100 SXM 267.9 of 312 (85.9%) |
| flash attention (cuDNN's fused attention ``__cudnn$fmha…``; the Pallas Triton kernel ``__gpu$xla.gpu.triton`` ``mha_forward`` / ``mha_backward``) | its FLOPs (causal: the half of the score matrix at or below the diagonal) at the kernel's measured rate for the sequence length, forward and backward apart | FlashAttention-3 (J. Shah et al., 2024, arXiv:2407.08608), Figures 5 and 6: H100 80GB SXM5, BF16, head dim 128, causal forward; backward: cuDNN 9 and FlashAttention-2 (the Triton kernel's algorithm, which the Pallas Triton kernel follows; its forward is the figure's "Triton") |
| a memory-bound kernel (any other fusion, copy, reduce, ...) | its bytes / (HBM bandwidth × :data:`HBM_EFFICIENCY`) | the datasheet bandwidth (:data:`jaxckpt.sharding.CHIPS`); the achievable fraction: see :data:`HBM_EFFICIENCY` |
| each kernel launch | :data:`LAUNCH_S` | XLA:GPU's own performance model, ``GpuPerformanceModelBase::kKernelLaunchOverhead`` (1 µs; NCCL's ``kNcclKernelLaunchOverhead`` 5 µs) |
| a kernel while a collective runs | slower by the SMs NCCL takes (:func:`collective_contention`) | NCCL runs one CUDA block per channel (NCCL's environment documentation); 16 channels as XLA:GPU's collective model |

Other GPU generations than the H100 run attention at the H100's fraction of peak (FlashAttention-3 measured the H100
only): a stated assumption, not a measurement.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from jaxckpt.sharding import CHIPS, Chip

MATMUL_FRACTION: dict[str, float] = {
    "a100-40gb": 267.9 / 312, "a100-80gb": 267.9 / 312, "h100": 755.0 / 989, "h200": 755.0 / 989,
    "b200": 1429.0 / 2250,
}
"""Chip key -> the fraction of its bf16 peak that cuBLAS sustains on the best-shaped large GEMM (module docstring):
MSMF for H200 (and the H100, the same GH100 die at the same 700 W limit: its published MAMF, 792.1, sits with the
H200's 794.5–834) and B200; MAMF for A100, whose MSMF is not published. A matmul of another shape runs at this × its
tile and wave efficiency."""

MATMUL_SOURCE: dict[str, str] = {"a100-40gb": "MAMF", "a100-80gb": "MAMF", "h100": "MSMF of the H200",
                                 "h200": "MSMF", "b200": "MSMF"}
"""Chip key -> which measurement :data:`MATMUL_FRACTION` is (what the report's basis line names)."""

HBM_EFFICIENCY = 0.90
"""The fraction of the datasheet HBM bandwidth a streaming kernel reaches (a copy or triad over gigabytes: about
0.9 on A100 and H100 in STREAM-style measurements). An assumption in the middle of the published copy benchmarks,
stated here, not fitted to any step time."""

LAUNCH_S = 1e-6
"""Seconds of each kernel launch on the GPU's stream (XLA:GPU's ``kKernelLaunchOverhead``, 1 µs): a train step
runs thousands of kernels per layer pass, so they add up where kernels are small."""

NCCL_LAUNCH_S = 5e-6
"""Seconds of each NCCL collective's launch (XLA:GPU's ``kNcclKernelLaunchOverhead``, 5 µs): the latency a small
collective cannot hide behind its bytes."""

NCCL_CHANNELS = 16
"""CUDA blocks an NCCL collective runs on, one per channel, each on an SM of its own (NCCL's documentation of
``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``: "each channel uses one CUDA block"); 16 as XLA:GPU's collective
model takes it (``kMaxNumChannelsRing``)."""


def collective_contention(chip: Chip) -> float:
  """How much longer a kernel takes while an NCCL collective runs beside it: the GPU's SMs over those NCCL leaves
  (:data:`NCCL_CHANNELS` of them busy), e.g. 132 / 116 = 1.14 on an H100; 1.0 for a chip without SMs."""
  if not chip.sm_count or chip.sm_count <= NCCL_CHANNELS:
    return 1.0
  return chip.sm_count / (chip.sm_count - NCCL_CHANNELS)


_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TFLOPS: dict[str, dict[str, tuple[float, ...]]] = {
    # FlashAttention-3 (Shah et al. 2024), H100 SXM5, BF16, head dim 128: causal forward (Fig. 5), backward (Fig. 6)
    "cudnn": {"forward": (315, 410, 484, 518, 529, 539), "backward": (305, 408, 465, 499, 518, 516)},
    "pallas": {"forward": (146, 273, 323, 353, 369, 378), "backward": (214, 260, 291, 310, 318, 322)},
}
"""Attention kernel -> direction -> TFLOP/s on an H100 SXM5 at the sequence lengths 512 … 16384 (module docstring):
``cudnn`` is cuDNN's fused attention (what the published GPU recipes run), ``pallas`` the Triton flash attention
(FlashAttention-2's algorithm: the figure's Triton forward, FlashAttention-2's backward)."""

_H100_PEAK = 989e12


def _kernel_key(chip_key: str | None) -> str:
  """The key whose kernel measurements apply to chip ``chip_key``: a cloud machine type's GPU (``a3-high`` → ``h100``,
  :attr:`jaxckpt.sharding.Chip.gpu`), else the key itself."""
  chip = CHIPS.get(chip_key or "")
  return (chip.gpu if chip is not None and chip.gpu else chip_key) or ""


def gemm_fraction(chip_key: str) -> float:
  """The sustained matmul fraction of a GPU (:data:`MATMUL_FRACTION`; a cloud machine type: its GPU's); 1.0 for a
  chip without one (a TPU: its compiler's cycles)."""
  return MATMUL_FRACTION.get(_kernel_key(chip_key), 1.0)


def attention_rate(kernel: str, direction: str, seq_len: int, chip: Chip) -> float:
  """FLOP/s of a flash attention kernel at ``seq_len`` on ``chip``: :data:`ATTENTION_TFLOPS` interpolated in the
  sequence length (log scale; held at the table's ends), at the chip's peak over the H100's.

  Args:
    kernel: ``"cudnn"`` or ``"pallas"``.
    direction: ``"forward"`` or ``"backward"``.
    seq_len: the key sequence length.
    chip: the GPU.
  """
  table = ATTENTION_TFLOPS[kernel][direction]
  if seq_len <= _SEQ[0]:
    tflops = table[0]
  elif seq_len >= _SEQ[-1]:
    tflops = table[-1]
  else:
    i = bisect.bisect_right(_SEQ, seq_len) - 1
    t = (math.log2(seq_len) - math.log2(_SEQ[i])) / (math.log2(_SEQ[i + 1]) - math.log2(_SEQ[i]))
    tflops = table[i] + t * (table[i + 1] - table[i])
  return tflops * 1e12 * chip.peak_flops / _H100_PEAK


def flash_attention_flops(q_shape: tuple[int, ...], direction: str, *, causal: bool = True) -> float:
  """FLOPs of a flash attention call on ``q_shape`` ``[B, S, H, D]`` (keys of the same length): forward 2 matmuls
  (QKᵀ, PV), backward 5 (QKᵀ recomputed, dV, dP, dQ, dK), each ``2·B·H·S²·D``, halved for a causal mask (the count
  FlashAttention's papers use).

  Args:
    q_shape: the query's shape ``[B, S, H, D]``.
    direction: ``"forward"`` or ``"backward"``.
    causal: the mask is causal.
  """
  b, s, h, d = q_shape
  matmuls = 2 if direction == "forward" else 5
  return matmuls * 2.0 * b * h * s * s * d * (0.5 if causal else 1.0)


ATTENTION_CALLS: Mapping[str, tuple[str, str]] = {
    "mha_forward": ("pallas", "forward"),
    "mha_backward": ("pallas", "backward"),
}
"""A Pallas Triton call's jaxpr name (in its ``op_name``) -> (kernel, direction) (jaxckpt's GPU flash attention,
``jax.experimental.pallas.ops.gpu.attention``). cuDNN's calls are known by their custom-call target
(``__cudnn$fmha…``; ``…Backward`` for the backward)."""


def gpu_basis(chip: Chip, chip_key: str | None, *, nvlink: float = 0.0, network: float = 0.0,
              attention: Mapping[tuple[str, str], int] | None = None) -> dict[str, str]:
  """What a GPU estimate rests on, one line per kind of work (the report prints it beside the estimate, so a user
  with a measured step can see which figure is off).

  Args:
    chip: the GPU.
    chip_key: its key in :data:`jaxckpt.sharding.CHIPS` (``"h100"``).
    nvlink: the NVLink bytes/s per direction the collectives inside a node run at (ring efficiency included).
    network: one NIC's bytes/s per direction (ring efficiency included), ``0.0`` inside one node.
    attention: ``{(kernel, direction): sequence length}`` of the attention calls the program runs.

  Returns:
    ``{"matmuls", "memory", "launch", "attention", "nvlink", "network"}`` (those that apply), each a line.
  """
  kernels = _kernel_key(chip_key)
  fraction = MATMUL_FRACTION.get(kernels)
  out = {"matmuls": (f"cuBLAS at {fraction:.1%} of {chip.peak_flops / 1e12:,.0f} TFLOP/s "
                     f"({MATMUL_SOURCE[kernels]}) × each GEMM's tile and wave efficiency" if fraction
                     else f"{chip.peak_flops / 1e12:,.0f} TFLOP/s × shape"),
         "memory": f"{chip.bandwidth * HBM_EFFICIENCY / 1e12:.2f} TB/s ({HBM_EFFICIENCY:.0%} of "
                   f"{chip.bandwidth / 1e12:.2f})",
         "launch": f"{LAUNCH_S * 1e6:.0f} µs per kernel, {NCCL_LAUNCH_S * 1e6:.0f} µs per NCCL call"}
  if collective_contention(chip) > 1.0:
    out["contention"] = (f"kernels {collective_contention(chip):.2f}× longer while NCCL runs ({NCCL_CHANNELS} of "
                         f"{chip.sm_count} SMs)")
  if attention:
    out["attention"] = ", ".join(f"{kernel} {direction} {attention_rate(kernel, direction, seq, chip) / 1e12:,.0f} "
                                 f"TFLOP/s at {seq} tokens" for (kernel, direction), seq in sorted(attention.items()))
  if nvlink:
    out["nvlink"] = f"{nvlink / 1e9:,.0f} GB/s per direction (ring), NVLS all-reduce where the NVSwitch reduces"
  if network:
    out["network"] = f"{network / 1e9:,.1f} GB/s per NIC per direction (ring) × the group's GPUs per node, ≤ NVLink"
  return out
