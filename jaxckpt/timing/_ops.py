"""What one run of one instruction of a compiled program costs, by rule: a table from the kind of instruction to how
its seconds are found.

| kind | seconds | term |
|---|---|---|
| a kernel with a TPU ``estimated_cycles`` | cycles / the chip's clock | ``compute`` or ``memory``, by its roofline |
| a kernel without one (XLA:GPU, XLA:CPU, a TPU op the compiler gave none) | max(FLOPs / (peak × the matmul's shape efficiency), bytes / HBM bandwidth) | ``compute`` or ``memory`` |
| a collective (an async ``-start``, a TPU async collective fusion, a plain one) | its bytes over the links its replica group crosses | ``collectives:<link>`` |
| a copy to or from host memory (``S(5)``) | its bytes over the host link, per direction | ``host:to_host`` / ``host:to_device`` |
| an async copy or slice inside the device (TPU's prefetches into on-chip memory) | its bytes / HBM bandwidth | ``copies`` |
| a custom call (a Pallas kernel, cuDNN) | its cost estimate (``cost_estimate`` in its backend config) as a roofline; a known kernel's FLOPs (:mod:`._kernels`: splash attention, its matmuls derated by their shapes) and its bytes as a roofline; else its bytes / HBM bandwidth | ``custom_calls`` |
| loop, call, tuple, bitcast, parameter, ``-done`` | 0 (a loop's body is timed as its own instructions; a ``-done`` waits, :mod:`._schedule`) | ``free`` |

A matmul's shape efficiency (the roofline's compute term where there is no cycle estimate): a TPU pads each of
its dimensions to the matrix unit's side (128; 256 on v6e: "How to Scale Your Model", "How to Think About TPUs"); a
GPU computes its output in tiles of 256 × 128 run in waves of one tile per SM, so the last wave of a matmul whose
tiles do not divide by the SMs runs partly empty (NVIDIA, "Matrix Multiplication Background User's Guide", tile and
wave quantization).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from jaxckpt.analysis.hlo import GEMM_TARGETS, Collective, HloInstruction, HloModule, HostTransfer, instruction_flops
from jaxckpt.sharding import CHIPS, Chip
from jaxckpt.timing._gpu import (ATTENTION_CALLS, HBM_EFFICIENCY, LAUNCH_S, NCCL_LAUNCH_S, attention_rate,
                                 flash_attention_flops, gemm_fraction)
from jaxckpt.timing._kernels import kernel_matmuls
from jaxckpt.timing._links import Links, collective_seconds

COMPUTE, MEMORY, COPIES, CUSTOM, FREE = "compute", "memory", "copies", "custom_calls", "free"
ATTENTION = "attention"
"""The term of a flash attention kernel on a GPU (:mod:`._gpu`)."""

_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
                   "replica-id", "while", "conditional", "call", "opt-barrier", "add-dependency", "domain"})
"""Instructions that take no time themselves (a loop's or call's body is timed as its own instructions)."""

ASYNC_DONE = ("-done",)
"""The suffix of the instruction that waits for an async ``-start`` (its operand)."""

_NO_COST_TARGETS = frozenset({"AllocateBuffer", "AsyncCollectiveStart", "AsyncCollectiveDone", "Sharding",
                              "SPMDFullToShardShape", "SPMDShardToFullShape", "PinToDevice",
                              "annotate_device_placement", "ConcatBitcast", "MoveToHost", "MoveToDevice"})
"""Custom calls that run no kernel (buffers, bookkeeping, annotations; host moves are timed as host transfers)."""

_GPU_TILE = (256, 128)
"""A GPU matmul's output tile (M × N) per SM for the wave-quantization rule (NVIDIA's guide's A100 example tile)."""


class OpCost(NamedTuple):
  """What one run of one executed instruction costs (:func:`op_costs`)."""

  term: str  # compute, memory, collectives:<link>, host:to_host, host:to_device, copies, custom_calls, free
  seconds: float  # per run
  source: str  # "cycles", "roofline", "links", "host_link", "cost_estimate", "bytes", "free"
  is_async: bool  # an async start: runs beside the core until its -done (:mod:`._schedule`)
  flops: float  # FLOPs per run (dots; a custom call's cost estimate)
  bytes: float  # bytes per run: read + written (a collective's or transfer's payload)


def matmul_efficiency(dims: tuple[int, int, int], chip: Chip) -> float:
  """The fraction of the chip's peak a ``(M, N, K)`` matmul can reach by its shape (module docstring): a TPU's
  padding to the matrix unit's side; a GPU's tile and wave quantization; 1 where the chip says neither.

  Example:
    >>> from jaxckpt.sharding import CHIPS
    >>> round(matmul_efficiency((100, 256, 256), CHIPS["v6e"]), 3)  # M padded to 256
    0.391
  """
  m, n, k = (max(1, int(d)) for d in dims)
  if chip.mxu_dim:
    pad = lambda d: -(-d // chip.mxu_dim) * chip.mxu_dim  # noqa: E731
    return (m * n * k) / (pad(m) * pad(n) * pad(k))
  if chip.sm_count:
    tm, tn = _GPU_TILE
    tiles = -(-m // tm) * -(-n // tn)
    waves = -(-tiles // chip.sm_count)
    return (m * n) / (tiles * tm * tn) * tiles / (waves * chip.sm_count)
  return 1.0


def _is_matmul(i: HloInstruction) -> bool:
  return i.opcode in ("dot", "convolution") or (i.opcode == "custom-call" and i.custom_call_target in GEMM_TARGETS)


def _dot_shapes(module: HloModule, ins: HloInstruction) -> list[tuple[float, tuple[int, int, int]]]:
  """``(FLOPs, (M, N, K))`` of the matmuls an executed instruction runs (dots, convolutions, cuBLAS GEMM calls; a
  fusion's inside it): N the result's last dimension, M the rest of it, K the contracted size its FLOPs imply."""
  out = []
  inner = [ins]
  if ins.opcode in ("fusion", "fusion-start", "async-start") and ins.called in module.computations:
    inner = module.called_instructions(ins)
  for i in inner:
    if not _is_matmul(i) or not i.arrays:
      continue
    flops = float(instruction_flops(module, i))
    result = i.arrays[0]
    if not flops or not result.elements:
      continue
    n = result.dims[-1] if result.dims else 1
    out.append((flops, (max(1, result.elements // max(1, n)), n, max(1, round(flops / (2 * result.elements))))))
  return out


def _cost_estimate(module: HloModule, ins: HloInstruction) -> Mapping[str, Any] | None:
  """A custom call's ``cost_estimate`` (Pallas writes ``{"flops", "transcendentals", "bytes_accessed"}`` into the
  Mosaic call's backend config when the kernel gives one), looked for in the call and in a fusion holding it."""
  candidates = [ins, *(module.called_instructions(ins) if ins.opcode in ("fusion", "async-start") else ())]
  for i in candidates:
    config = i.backend_config or {}
    for holder in (config, config.get("custom_call_config") or {}):
      estimate = holder.get("cost_estimate") if isinstance(holder, Mapping) else None
      if isinstance(estimate, Mapping):
        return estimate
  return None


def _chip_key(chip: Chip) -> str | None:
  return next((key for key, c in CHIPS.items() if c is chip or c == chip), None)


def _roofline(flops: float, nbytes: float, efficiency: float, chip: Chip) -> tuple[str, float]:
  """A roofline: FLOPs at the peak × ``efficiency`` against bytes at the HBM bandwidth. On a GPU the peak is what
  cuBLAS sustains (:data:`jaxckpt.timing._gpu.MATMUL_FRACTION`) and the bandwidth the achievable one
  (:data:`~jaxckpt.timing._gpu.HBM_EFFICIENCY`), and every kernel adds its launch (:mod:`._gpu`)."""
  launch = 0.0
  bandwidth = chip.bandwidth
  if chip.is_gpu:
    efficiency *= gemm_fraction(_chip_key(chip) or "")
    bandwidth *= HBM_EFFICIENCY
    launch = LAUNCH_S
  compute = flops / (chip.peak_flops * max(efficiency, 1e-9)) if flops else 0.0
  memory = nbytes / bandwidth if nbytes else 0.0
  return (COMPUTE, compute + launch) if compute >= memory else (MEMORY, memory + launch)


def attention_call(module: HloModule, ins: HloInstruction) -> tuple[str, str, tuple[int, ...]] | None:
  """``(kernel, direction, query shape [B, S, H, D])`` of a GPU flash attention call run by ``ins`` (the call, or a
  fusion or async start holding it), else ``None`` (:mod:`._gpu`)."""
  inner = [ins] if ins.opcode == "custom-call" else (
      module.called_instructions(ins) if ins.opcode in ("fusion", "async-start") else [])
  for i in inner:
    if i.opcode != "custom-call":
      continue
    target = i.custom_call_target or ""
    if target.startswith("__cudnn$fmha"):
      found = ("cudnn", "backward" if "Backward" in target else "forward")
    elif target == "__gpu$xla.gpu.triton":
      name = i.op_name or ""
      found = next((v for k, v in ATTENTION_CALLS.items() if f"/{k}/" in name or name.endswith(f"/{k}")), None)
      if found is None:
        continue
    else:
      continue
    comp = module.computations[i.computation]
    q = comp.by_name.get(i.operands[0]) if i.operands else None
    if q is None or not q.arrays or len(q.arrays[0].dims) != 4:
      continue
    return (*found, q.arrays[0].dims)
  return None


def _is_custom(module: HloModule, ins: HloInstruction) -> str | None:
  """The custom-call target an executed instruction runs as a kernel, else None."""
  inner = [ins] if ins.opcode == "custom-call" else (
      module.called_instructions(ins) if ins.opcode in ("fusion", "async-start") else [])
  for i in inner:
    if i.opcode == "custom-call" and i.custom_call_target not in _NO_COST_TARGETS:
      return i.custom_call_target or "custom-call"
  return None


def op_costs(module: HloModule, chip: Chip, links: Links | None, *,
             kernel_flops: Mapping[str, float] | None = None) -> dict[str, OpCost]:
  """The cost of one run of every executed instruction of ``module``, by instruction name (module docstring).

  Args:
    module: the program (:func:`jaxckpt.analysis.parse_hlo`).
    chip: the chip it runs on (:data:`jaxckpt.sharding.CHIPS`).
    links: where its devices sit (:func:`jaxckpt.timing.links_for`); ``None``: collectives take 0 s.
    kernel_flops: FLOPs per run of custom-call kernels that carry no cost estimate, by instruction name, over
      those :func:`jaxckpt.timing._kernels.kernel_flops` finds (the splash attention kernels, causal); their seconds
      are a roofline of those FLOPs and their bytes.

  Returns:
    ``{instruction name: OpCost}`` for every instruction :meth:`HloModule.executions` lists.
  """
  collectives: dict[str, list[Collective]] = {}
  for c in module.collectives():
    collectives.setdefault(c.unit, []).append(c)
  transfers: dict[str, list[HostTransfer]] = {}
  for t in module.host_transfers():
    transfers.setdefault(t.unit, []).append(t)
  known = kernel_matmuls(module)
  kernel_flops = {**{k: sum(f for f, _ in v) for k, v in known.items()}, **(kernel_flops or {})}
  out: dict[str, OpCost] = {}
  for run in module.executions():
    ins = run.instruction
    if ins.name in out:
      continue
    nbytes = float(run.bytes_read + run.bytes_written)
    out[ins.name] = _cost(module, ins, run, nbytes, chip, links, collectives.get(ins.name),
                          transfers.get(ins.name), kernel_flops.get(ins.name), known.get(ins.name))
  return out


def _cost(module: HloModule, ins: HloInstruction, run: Any, nbytes: float, chip: Chip, links: Links | None,
          collectives: list[Collective] | None, transfers: list[HostTransfer] | None,
          kernel_flops: float | None, kernel_shapes: list[tuple[float, tuple[int, int, int]]] | None) -> OpCost:
  opcode = ins.opcode
  is_start = opcode.endswith("-start")
  if opcode in _FREE or opcode.endswith(ASYNC_DONE) or opcode.endswith("-update"):
    return OpCost(FREE, 0.0, "free", False, 0.0, 0.0)
  if collectives:
    seconds, link, payload = 0.0, "local", 0.0
    for c in collectives:
      group = c.groups[0] if c.groups else ()
      link, s = collective_seconds(c.kind, c.payload_bytes, group, links) if links is not None else ("local", 0.0)
      seconds += s + (NCCL_LAUNCH_S if chip.is_gpu and link != "local" else 0.0)
      payload += c.payload_bytes
    is_async = any(c.is_async for c in collectives) or is_start
    compute = run.estimated_cycles / chip.clock_hz if run.estimated_cycles and chip.clock_hz else 0.0
    if compute > seconds and not is_async:  # a fused collective whose fusion also computes: the longer of the two
      return OpCost(COMPUTE, compute, "cycles", False, float(run.dot_flops), nbytes)
    return OpCost(f"collectives:{link}", seconds, "links", is_async, 0.0, payload)
  if transfers:
    seconds = 0.0
    direction = transfers[0].direction
    for t in transfers:
      seconds += t.bytes / chip.host_bandwidth if chip.host_bandwidth else 0.0
    return OpCost(f"host:{direction}", seconds, "host_link", is_start, 0.0, float(sum(t.bytes for t in transfers)))
  if run.estimated_cycles is not None and chip.clock_hz:
    seconds = run.estimated_cycles / chip.clock_hz
    term, _ = _roofline(float(run.dot_flops), nbytes, 1.0, chip)
    return OpCost(term, seconds, "cycles", is_start, float(run.dot_flops), nbytes)
  attention = attention_call(module, ins) if chip.is_gpu else None
  if attention is not None:
    kernel, direction, q_shape = attention
    flops = flash_attention_flops(q_shape, direction)
    seconds = flops / attention_rate(kernel, direction, q_shape[1], chip) + LAUNCH_S
    return OpCost(ATTENTION, seconds, "kernel_rate", is_start, flops, nbytes)
  target = _is_custom(module, ins)
  if target in GEMM_TARGETS:  # a cuBLAS GEMM: its FLOPs at what cuBLAS reaches for its shape
    dots = _dot_shapes(module, ins)
    flops = float(run.dot_flops)
    efficiency = flops / sum(f / matmul_efficiency(d, chip) for f, d in dots) if dots and flops else 1.0
    term, seconds = _roofline(flops, nbytes, efficiency, chip)
    return OpCost(term, seconds, "roofline", is_start, flops, nbytes)
  if target is not None:
    estimate = _cost_estimate(module, ins)
    if estimate is not None:
      flops = float(estimate.get("flops") or 0)
      accessed = float(estimate.get("bytes_accessed") or nbytes)
      _, seconds = _roofline(flops, accessed, 1.0, chip)
      return OpCost(CUSTOM, seconds, "cost_estimate", is_start, flops, accessed)
    flops = float(kernel_flops or 0.0)
    efficiency = 1.0
    if kernel_shapes and flops:
      efficiency = sum(f for f, _ in kernel_shapes) / sum(f / matmul_efficiency(d, chip) for f, d in kernel_shapes)
    _, seconds = _roofline(flops, nbytes, efficiency, chip)
    return OpCost(CUSTOM, seconds, "roofline" if flops else "bytes", is_start, flops, nbytes)
  if is_start or opcode in ("copy-start", "slice-start"):  # an async copy inside the device (TPU prefetch)
    return OpCost(COPIES, nbytes / chip.bandwidth, "bytes", True, 0.0, nbytes)
  dots = _dot_shapes(module, ins)
  flops = float(run.dot_flops)
  efficiency = 1.0
  if dots and flops:
    efficiency = flops / sum(f / matmul_efficiency(d, chip) for f, d in dots)
  term, seconds = _roofline(flops, nbytes, efficiency, chip)
  return OpCost(term, seconds, "roofline", False, flops, nbytes)
