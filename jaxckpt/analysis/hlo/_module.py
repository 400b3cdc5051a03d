"""A compiled XLA program as records a time model can sum over: every instruction the step runs with its runs per
step, and per run its dot FLOPs, the bytes it reads and writes and, on TPU, the compiler's ``estimated_cycles``.

XLA's own ``cost_analysis()`` walks the program once, so a ``while`` body (every ``jax.lax.scan`` over layers) counts
one iteration: for a scanned 8-layer stack its ``flops`` are those of one layer's forward and backward pass.
:meth:`HloModule.executions` lists every instruction the step runs, with how many times it runs: loop bodies
multiplied by their trip count, nested loops multiplied again; a fusion is one unit (its body is not executed
separately). Per step, :meth:`HloModule.collectives` (:mod:`._collectives`), :meth:`HloModule.host_transfers`
(:mod:`._transfers`) and :meth:`HloModule.totals`.

What the three compilers write (measured with jax 0.10.2, libtpu 0.0.42.1, jax-cuda12-plugin 0.10.2; details and
excerpts in ``docs/hlo-reading.md``):

* Trip counts: XLA:CPU and XLA:GPU put them in the ``while``'s backend config, ``{"known_trip_count":{"n":"4"},
  ...}``. The TPU compiler's ``while`` has no backend config: the count is derived from the loop (the condition's
  ``compare`` of a tuple element with a constant, that element's start value in the ``while``'s operand and its step
  in the body's root), else it is ``None`` and the body is counted once.
* ``estimated_cycles``: TPU only, in ``backend_config.window_config.estimated_cycles`` of the scheduled instructions
  that run a kernel (fusions, copies, converts, broadcasts, ...), never of collectives, async starts, loops or
  instructions inside a fused computation.
* Replica groups (:func:`jaxckpt.analysis.hlo._parse.replica_groups`): explicit ``{{0,1},{2,3}}``; iota
  ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``; and the mesh form ``mesh['axis_0'=4,'axis_1'=1,'axis_2'=2],
  device_ids=([2,4]T(1,0)) {'axis_0'}`` that TPU and GPU print for jax's SPMD programs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from jaxckpt.analysis.hlo._collectives import (Collective, CollectiveUse, collective_of, unit_collectives,
                                               uses_by_axis)
from jaxckpt.analysis.hlo._parse import (RUNS_BODY, ArrayShape, HloComputation, HloInstruction, HloParseError,
                                         async_output, called_instructions, first_array, int_literal, ints, parse_text,
                                         shape_bytes)
from jaxckpt.analysis.hlo._transfers import HostTransfer, unit_transfers

class HloExecution(NamedTuple):
  """One instruction of the step and how often it runs (:meth:`HloModule.executions`); costs are per run."""

  instruction: HloInstruction  # the instruction (a fusion is one unit; its body's instructions are not listed)
  count: int  # runs per step: the product of the trip counts of the loops around it (a condition: trips + 1)
  loops: tuple[str, ...]  # names of the while instructions around it, outermost first
  in_conditional: bool  # inside a conditional's branch: it may not run (every branch is listed with the count)
  dot_flops: int  # FLOPs of the dots and convolutions it runs (inside a fusion: all of them), per run
  bytes_read: int  # bytes of its operands read, per run (a slice's bytes where only a slice is read)
  bytes_written: int  # bytes of its result written, per run (an in-place update's bytes for dynamic-update-slice)
  estimated_cycles: int | None  # TPU's cycle estimate per run, None where the compiler gives none






@dataclasses.dataclass(frozen=True)
class HloTotals:
  """Per-device sums over one step (:meth:`HloModule.totals`), every loop body times its trip count."""

  dot_flops: int  # FLOPs of every dot and convolution
  bytes_read: int  # operand bytes read by every executed instruction
  bytes_written: int  # result bytes written by every executed instruction
  estimated_cycles: int | None  # TPU: the sum of estimated_cycles (kernels only, not collectives); None elsewhere
  collective_bytes: Mapping[str, int]  # kind -> payload bytes per step
  collective_bytes_by_group_size: Mapping[int, int]  # group size -> payload bytes per step
  collective_runs: Mapping[str, int]  # kind -> collectives run per step (a latency term counts these)
  to_host_bytes: int  # bytes copied device -> host
  to_device_bytes: int  # bytes copied host -> device
  unknown_trip_counts: tuple[str, ...]  # while loops whose trip count is unknown (their body counted once)
  uncounted_custom_calls: tuple[str, ...]  # targets of custom calls run whose FLOPs are not counted (kernels: cuDNN,
  # Pallas's "tpu_custom_call", ...); cuBLAS GEMMs are counted, buffer and async bookkeeping calls need none


# --- trip counts --------------------------------------------------------------------------------------------------


class _Value(NamedTuple):
  """A scalar integer as ``tuple[index] + offset`` (the loop state's element ``index``) or ``offset`` (a constant)."""

  index: int | None
  offset: int


_PASS_THROUGH = frozenset({"copy", "bitcast", "convert", "reshape"})


def _scalar(computations: Mapping[str, HloComputation], comp: HloComputation, name: str,
            outer: tuple[HloComputation, HloInstruction] | None = None, depth: int = 0) -> _Value | None:
  """What an integer scalar is, followed through copies, fusions (their parameters to the fusion's operands), adds
  and subtracts of constants, down to a constant or an element of the computation's tuple parameter."""
  ins = comp.by_name.get(name)
  if ins is None or depth > 32:
    return None
  again = functools.partial(_scalar, computations, depth=depth + 1)
  if ins.opcode == "constant":
    value = int_literal(ins.literal)
    return None if value is None else _Value(None, value)
  if ins.opcode in _PASS_THROUGH:
    return again(comp, ins.operands[0], outer)
  if ins.opcode == "get-tuple-element":
    source = comp.by_name.get(ins.operands[0])
    if source is not None and source.opcode == "parameter" and outer is None:
      return _Value(int(ins.attributes["index"]), 0)
    return None
  if ins.opcode == "parameter" and outer is not None:
    outer_comp, fusion = outer
    return again(outer_comp, fusion.operands[int(ins.literal or 0)], None)
  if ins.opcode == "fusion" and ins.called in computations:
    called = computations[ins.called]
    return again(called, called.root.name, (comp, ins))
  if ins.opcode in ("add", "subtract"):
    a, b = (again(comp, op, outer) for op in ins.operands[:2])
    if a is None or b is None or (a.index is not None and b.index is not None):
      return None
    if ins.opcode == "subtract":
      return None if b.index is not None else _Value(a.index, a.offset - b.offset)
    return _Value(a.index if a.index is not None else b.index, a.offset + b.offset)
  return None


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def _count_iterations(direction: str, start: int, step: int, bound: int) -> int | None:
  """Iterations of ``for (i = start; i <direction> bound; i += step)``, or None if it never ends or cannot be told."""
  if direction == "LE":
    direction, bound = "LT", bound + 1
  elif direction == "GE":
    direction, bound = "GT", bound - 1
  if direction == "LT" and step > 0:
    return max(0, -(-(bound - start) // step))
  if direction == "GT" and step < 0:
    return max(0, -(-(start - bound) // -step))
  if direction == "NE" and step != 0 and (bound - start) % step == 0 and (bound - start) // step >= 0:
    return (bound - start) // step
  return None


def _derived_trip_count(computations: Mapping[str, HloComputation], caller: HloComputation,
                        loop: HloInstruction) -> int | None:
  """A while loop's trip count from its code: the condition compares element k of the loop state with a constant,
  the body adds a constant step to element k, the operand starts it at a constant. None for anything else."""
  condition = computations.get(loop.attributes.get("condition", "").lstrip("%"))
  body = computations.get(loop.attributes.get("body", "").lstrip("%"))
  if condition is None or body is None:
    return None
  compare, outer = condition.root, None
  if compare.opcode == "fusion" and compare.called in computations:
    compare, outer = computations[compare.called].root, (condition, compare)
  if compare.opcode != "compare" or len(compare.operands) != 2:
    return None
  home = computations[compare.computation]
  a, b = (_scalar(computations, home, op, outer) for op in compare.operands)
  direction = compare.attributes.get("direction", "")
  if a is None or b is None or direction not in _FLIP:
    return None
  if a.index is None:
    a, b, direction = b, a, _FLIP[direction]
  if a.index is None or b.index is not None or body.root.opcode != "tuple":
    return None
  counter = a.index
  state = caller.by_name.get(loop.operands[0]) if loop.operands else None
  if state is None or state.opcode != "tuple" or counter >= len(state.operands):
    return None
  start = _scalar(computations, caller, state.operands[counter])
  step = _scalar(computations, body, body.root.operands[counter])
  if start is None or start.index is not None or step is None or step.index != counter:
    return None
  return _count_iterations(direction, start.offset, step.offset, b.offset - a.offset)


def _with_trip_counts(computations: dict[str, HloComputation]) -> dict[str, HloComputation]:
  """Every while instruction with :attr:`HloInstruction.trip_count` filled in."""
  out = {}
  for name, comp in computations.items():
    instructions = []
    for ins in comp.instructions:
      if ins.opcode == "while":
        known = (ins.backend_config or {}).get("known_trip_count")
        n = int_literal(known.get("n")) if isinstance(known, Mapping) else None
        source = "backend_config" if n is not None else None
        if n is None:
          n = _derived_trip_count(computations, comp, ins)
          source = "derived" if n is not None else None
        ins = dataclasses.replace(ins, trip_count=n, trip_count_source=source)
      instructions.append(ins)
    out[name] = HloComputation(name, tuple(instructions), comp.is_entry)
  return out


# --- costs of one instruction -------------------------------------------------------------------------------------

_DIMS = re.compile(r"\{([\d,\s]*)\}")
GEMM_TARGETS = frozenset({"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8"})
"""cuBLAS GEMM custom calls (XLA:GPU's ``GemmBackendConfig`` holds their dimension numbers): what XLA:GPU emits for a
matmul with Triton GEMM off (the published recipes' ``--xla_gpu_enable_triton_gemm=false``, jaxckpt's default on
GPU); with it on, Triton GEMM fusions (``__triton_nested_gemm_fusion``), whose ``dot`` is counted."""

_NO_FLOPS_TARGETS = frozenset({"AllocateBuffer", "AsyncCollectiveStart", "AsyncCollectiveDone", "MoveToHost",
                               "MoveToDevice", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                               "PinToDevice", "annotate_device_placement"})
"""Custom calls that compute nothing (buffers, async bookkeeping, sharding and placement annotations)."""


def _dim_list(attributes: Mapping[str, str], key: str) -> list[int]:
  m = _DIMS.fullmatch(attributes.get(key, "{}").strip())
  return ints(m.group(1)) if m else []


def _matmul_flops(out_elements: int, contracted: int) -> int:
  """``2 * out * K`` (a multiply and an add per term); an outer product (``K == 1``) ``out`` multiplies, as
  :mod:`jaxckpt.analysis._flops` and XLA count it."""
  return out_elements if contracted == 1 else 2 * out_elements * contracted


_WINDOW_FIELD = re.compile(r"(\w+)=([\d_x-]+)")


def _window(text: str) -> dict[str, list[list[int]] | list[int]]:
  """``window={size=1x32 pad=0_0x31_31 stride=1x1 lhs_dilate=... rhs_dilate=...}`` -> lists per spatial dimension
  (``pad`` as ``[low, high]`` pairs)."""
  out: dict[str, list] = {}
  for key, value in _WINDOW_FIELD.findall(text or ""):
    dims = value.split("x")
    out[key] = [[int(v) for v in d.split("_")] for d in dims] if key == "pad" else [int(d) for d in dims]
  return out


def _taps(size: int, kernel: int, out: int, low: int, stride: int, lhs_dilate: int, rhs_dilate: int) -> int:
  """(output position, kernel position) pairs of one spatial dimension whose input position is a real element, not
  padding or a dilation hole: what a convolution multiplies along it."""
  o = np.arange(out)[:, None]
  k = np.arange(kernel)[None, :]
  position = o * stride + k * rhs_dilate - low  # in the lhs-dilated input
  real = (position >= 0) & (position <= (size - 1) * lhs_dilate) & (position % lhs_dilate == 0)
  return int(real.sum())


def _convolution_flops(ins: HloInstruction, out: ArrayShape, lhs: ArrayShape | None, rhs: ArrayShape | None) -> int:
  """FLOPs of a convolution: 2 × (output elements / output spatial positions) × input features per group × the
  kernel taps that land on real input along each spatial dimension (:func:`_taps`; padding and dilation holes
  excluded). The TPU compiler writes some matmuls as convolutions over padded windows: a projection to 32 heads as
  ``dim_labels=0bf1_i1o0->0b1f, window={size=1x32 pad=0_0x31_31 rhs_reversal=0x1}`` over an input of spatial size 1,
  where 31 of each output's 32 kernel taps are padding."""
  labels = ins.attributes.get("dim_labels", "")
  operands, _, out_labels = labels.partition("->")
  lhs_labels, _, rhs_labels = operands.partition("_")
  if lhs is None or rhs is None or len(rhs_labels) != len(rhs.dims) or len(lhs_labels) != len(lhs.dims) \
      or len(out_labels) != len(out.dims):
    return 0
  window = _window(ins.attributes.get("window", ""))
  features = math.prod(rhs.dims[i] for i, c in enumerate(rhs_labels) if c == "i")
  spatial = sorted({c for c in rhs_labels if c.isdigit()}, key=int)
  taps, positions = 1, 1
  for j, label in enumerate(spatial):
    size = lhs.dims[lhs_labels.index(label)]
    kernel = rhs.dims[rhs_labels.index(label)]
    count = out.dims[out_labels.index(label)]
    pick = lambda key, default: window.get(key, [default] * len(spatial))[j]  # noqa: E731
    low = pick("pad", [0, 0])[0]
    taps *= _taps(size, kernel, count, low, pick("stride", 1), pick("lhs_dilate", 1), pick("rhs_dilate", 1))
    positions *= count
  if not positions:
    return 0
  macs = out.elements // positions * taps * features
  return _matmul_flops(out.elements, macs // out.elements) if macs == out.elements else 2 * macs


def _dot_flops(ins: HloInstruction, comp: HloComputation) -> int:
  """FLOPs of a ``dot``, ``convolution`` or cuBLAS GEMM custom call, from shapes and dimension numbers; else 0."""
  out = first_array(ins.shape)
  if out is None or not ins.operands:
    return 0
  operand_shape = lambda i: first_array(comp.by_name[ins.operands[i]].shape)  # noqa: E731
  if ins.opcode == "dot":
    lhs = operand_shape(0)
    return _matmul_flops(out.elements, math.prod(lhs.dims[d] for d in _dim_list(ins.attributes,
                                                                                  "lhs_contracting_dims")))
  if ins.opcode == "convolution":
    return _convolution_flops(ins, out, operand_shape(0), operand_shape(1))
  if ins.opcode == "custom-call" and ins.custom_call_target in GEMM_TARGETS:
    numbers = ((ins.backend_config or {}).get("gemm_backend_config") or {}).get("dot_dimension_numbers") or {}
    lhs = operand_shape(0)
    contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    return _matmul_flops(out.elements, math.prod(lhs.dims[d] for d in contracting))
  return 0


def instruction_flops(module: HloModule, instruction: HloInstruction) -> int:
  """FLOPs of one run of a single ``dot``, ``convolution`` or cuBLAS GEMM custom call of ``module`` (0 for anything
  else; a fusion's are :attr:`HloExecution.dot_flops`): the rule of :meth:`HloModule.executions`, for callers that
  need them per matmul (e.g. its shape)."""
  return _dot_flops(instruction, module.computations[instruction.computation])


_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
                   "replica-id", "while", "conditional", "call", "opt-barrier", "add-dependency", "domain"})
"""Instructions that move no data themselves (a loop's or call's body is counted as its own executions)."""


def _unit_flops(computations: Mapping[str, HloComputation], ins: HloInstruction) -> int:
  if ins.opcode in RUNS_BODY:
    return sum(_dot_flops(i, computations[i.computation]) for i in called_instructions(computations, ins))
  return _dot_flops(ins, computations[ins.computation])


_RELAYOUT = frozenset({"bitcast", "transpose", "reshape", "copy"})
"""Fused instructions that only move a value's elements (same bytes): a read through them is still a read of the
elements a later slice takes."""


def _sliced_read(called: HloComputation, ins: HloInstruction) -> int | None:
  """Bytes read of ``ins`` (a fused computation's parameter) when every use of it reaches a dynamic slice or a
  static slice (the slices' bytes) or is the buffer a dynamic-update-slice writes in place (nothing read), through
  re-layouts (:data:`_RELAYOUT`); ``None`` where some use reads it whole."""
  users = called.users.get(ins.name, ())
  if not users:
    return None
  total = 0
  for u in users:
    if u.opcode in ("dynamic-slice", "slice") and u.operands[0] == ins.name:
      total += u.output_bytes
    elif u.opcode == "dynamic-update-slice" and u.operands[0] == ins.name and ins.name not in u.operands[1:]:
      continue
    elif u.opcode in _RELAYOUT and (inner := _sliced_read(called, u)) is not None:
      total += inner
    else:
      return None
  return total


def _parameter_read_bytes(called: HloComputation, number: int, full: int) -> int:
  """Bytes a fused computation reads of its parameter ``number``: the slices where it only slices it (dynamically or
  not), nothing where it only updates it in place, through re-layouts (XLA:GPU's ``loop_dynamic_slice_fusion`` and
  ``loop_dynamic_update_slice_fusion`` of a scan's stacked buffers bitcast them first); else all of it."""
  param = next((i for i in called.instructions if i.opcode == "parameter" and int_literal(i.literal) == number), None)
  read = _sliced_read(called, param) if param is not None else None
  return full if read is None else min(read, full)


def _written_bytes(comp: HloComputation, ins: HloInstruction) -> int:
  """Bytes an instruction (or a fused root) writes: a dynamic-update-slice only its update."""
  if ins.opcode == "dynamic-update-slice":
    return comp.by_name[ins.operands[1]].output_bytes
  if ins.opcode == "bitcast":
    return _written_bytes(comp, comp.by_name[ins.operands[0]])
  if ins.opcode == "tuple":
    return sum(_written_bytes(comp, comp.by_name[op]) for op in ins.operands)
  return ins.output_bytes


def _unit_bytes(computations: Mapping[str, HloComputation], ins: HloInstruction) -> tuple[int, int]:
  """``(bytes read, bytes written)`` of one run of an executed instruction."""
  if ins.opcode in _FREE or ins.opcode.endswith(("-done", "-update")):
    return 0, 0
  comp = computations[ins.computation]
  operand_bytes = [comp.by_name[op].output_bytes if op in comp.by_name else 0 for op in ins.operands]
  if ins.opcode in RUNS_BODY and ins.called in computations:
    called = computations[ins.called]
    read = sum(_parameter_read_bytes(called, i, b) for i, b in enumerate(operand_bytes))
    written = _written_bytes(called, called.root)
    return read, (written if ins.opcode == "fusion" else min(written, shape_bytes(async_output(ins))))
  if ins.opcode in ("dynamic-slice", "dynamic-slice-start"):
    out = shape_bytes(async_output(ins))
    return out + sum(operand_bytes[1:]), out
  if ins.opcode in ("dynamic-update-slice", "dynamic-update-slice-start"):
    update = operand_bytes[1] if len(operand_bytes) > 1 else 0
    return update + sum(operand_bytes[2:]), update
  if ins.opcode.endswith("-start"):
    return sum(operand_bytes), shape_bytes(async_output(ins))
  return sum(operand_bytes), ins.output_bytes


# --- the module ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HloModule:
  """A compiled XLA program read from its HLO text (:func:`parse_hlo`, :func:`read_compiled`)."""

  name: str  # the module's name ("jit_train_step")
  attributes: Mapping[str, str]  # the HloModule line's "key=value" fields, raw (entry_computation_layout, ...)
  computations: Mapping[str, HloComputation]  # every computation by name
  entry: str  # the ENTRY computation's name
  num_partitions: int  # SPMD partitions (devices of a jax mesh); 1 when the text gives none
  replica_count: int  # replicas; 1 when the text gives none
  frames: Mapping[int, str] = dataclasses.field(default_factory=dict)  # stack frame id -> "file:line (function)"

  def source(self, ins: HloInstruction) -> str | None:
    """The JAX source line that made an instruction: its metadata's ``source_file:source_line``, else its stack
    frame's location in the module's tables (``file:line (function)``), else None."""
    if ins.source:
      return ins.source
    return self.frames.get(ins.stack_frame_id) if ins.stack_frame_id is not None else None

  @property
  def num_devices(self) -> int:
    """``num_partitions * replica_count``."""
    return self.num_partitions * self.replica_count

  @functools.cached_property
  def instructions(self) -> Mapping[str, HloInstruction]:
    """Every instruction of every computation by name (XLA keeps names unique in a module)."""
    return {i.name: i for comp in self.computations.values() for i in comp.instructions}

  def called_instructions(self, ins: HloInstruction) -> list[HloInstruction]:
    """The instructions of the computation a fusion or async start runs, nested fusions' too (``[]`` for an
    instruction that calls none)."""
    return list(called_instructions(self.computations, ins))

  @functools.cached_property
  def while_loops(self) -> tuple[HloInstruction, ...]:
    """Every while instruction (:attr:`HloInstruction.trip_count` tells its iterations, ``None`` if unknown)."""
    return tuple(i for i in self.instructions.values() if i.opcode == "while")

  def executions(self) -> tuple[HloExecution, ...]:
    """Every instruction the step runs, with how many times it runs and its costs per run.

    The entry computation's instructions run once; a while's body runs ``trip_count`` times and its condition
    ``trip_count + 1`` times per run of the while (an unknown trip count counts 1: see :attr:`HloTotals.
    unknown_trip_counts`); a call's computation once per call; every branch of a conditional once
    (``in_conditional``). A fusion (and an async ``fusion-start`` / ``async-start``) is one unit: the instructions of
    its fused computation are not listed, their dots are in its ``dot_flops``. Reducers (``to_apply``) are not listed.

    Returns:
      The :class:`HloExecution` records, in schedule order within each computation, a loop's body after the loop.
    """
    return self._executions

  @functools.cached_property
  def _executions(self) -> tuple[HloExecution, ...]:
    out: list[HloExecution] = []
    self._walk(self.computations[self.entry], 1, (), False, out)
    return tuple(out)

  def _walk(self, comp: HloComputation, count: int, loops: tuple[str, ...], branch: bool,
            out: list[HloExecution]) -> None:
    for ins in comp.instructions:
      read, written = _unit_bytes(self.computations, ins)
      cycles = ins.estimated_cycles
      out.append(HloExecution(ins, count, loops, branch, _unit_flops(self.computations, ins), read, written, cycles))
      if ins.opcode == "while":
        trips = ins.trip_count if ins.trip_count is not None else 1
        condition, body = (self.computations[ins.attributes[k].lstrip("%")] for k in ("condition", "body"))
        self._walk(condition, count * (trips + 1), loops + (ins.name,), branch, out)
        self._walk(body, count * trips, loops + (ins.name,), branch, out)
      elif ins.opcode == "call" and ins.called in self.computations:
        self._walk(self.computations[ins.called], count, loops, branch, out)
      elif ins.opcode == "conditional":
        for name in ins.calls:
          self._walk(self.computations[name], count, loops, True, out)

  @functools.cached_property
  def _collectives(self) -> tuple[Collective, ...]:
    found: dict[tuple[str, Any], Collective] = {}
    for run in self._executions:
      for ins, fused_async in unit_collectives(self.computations, run.instruction):
        key = (run.instruction.computation, ins.channel_id if ins.channel_id is not None else ins.name)
        if key in found:  # the same collective's async pieces (TPU: start, overlapped and done fusions)
          found[key] = found[key]._replace(is_async=found[key].is_async or fused_async)
        else:
          found[key] = collective_of(self.computations, self.num_devices, ins, unit=run.instruction, count=run.count,
                                     fused_async=fused_async)._replace(in_loop=bool(run.loops))
    return tuple(found.values())

  def collectives(self) -> tuple[Collective, ...]:
    """Every collective the step runs, once each (an async pair at its ``-start``; a TPU async collective fusion's
    start, overlapped and done fusions, which share a ``channel_id``, once), with its runs per step."""
    return self._collectives

  def host_transfers(self) -> tuple[HostTransfer, ...]:
    """Every copy between device and host memory (:data:`HOST_MEMORY_SPACE`) the step runs, with its runs per step:
    a dynamic-update-slice of a device array into a host buffer (an offload), a dynamic-slice out of one (a reload),
    a copy between the two memory spaces, a ``MoveToHost``/``MoveToDevice`` custom call, a host send/recv; at the
    ``-start`` of an async pair, inside fusions too."""
    return tuple(HostTransfer(direction, n, ins, run.instruction.name, run.count)
                 for run in self._executions
                 for ins, direction, n in unit_transfers(self.computations, run.instruction))

  def totals(self) -> HloTotals:
    """Per-device sums over the step (:class:`HloTotals`): every execution's costs times its runs."""
    runs = self._executions
    cycles = [r.estimated_cycles * r.count for r in runs if r.estimated_cycles is not None]
    by_kind: dict[str, int] = {}
    by_size: dict[int, int] = {}
    runs_by_kind: dict[str, int] = {}
    for c in self._collectives:
      by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
      by_size[c.group_size] = by_size.get(c.group_size, 0) + c.total_bytes
      runs_by_kind[c.kind] = runs_by_kind.get(c.kind, 0) + c.count
    transfers = self.host_transfers()
    return HloTotals(
        dot_flops=sum(r.dot_flops * r.count for r in runs),
        bytes_read=sum(r.bytes_read * r.count for r in runs),
        bytes_written=sum(r.bytes_written * r.count for r in runs),
        estimated_cycles=sum(cycles) if cycles else None,
        collective_bytes=by_kind, collective_bytes_by_group_size=by_size, collective_runs=runs_by_kind,
        to_host_bytes=sum(t.total_bytes for t in transfers if t.direction == "to_host"),
        to_device_bytes=sum(t.total_bytes for t in transfers if t.direction == "to_device"),
        unknown_trip_counts=tuple(w.name for w in self.while_loops if w.trip_count is None),
        uncounted_custom_calls=tuple(sorted({
            i.custom_call_target or "" for r in runs
            for i in (called_instructions(self.computations, r.instruction) if r.instruction.opcode in RUNS_BODY
                      else (r.instruction,))
            if i.opcode == "custom-call" and i.custom_call_target not in GEMM_TARGETS | _NO_FLOPS_TARGETS})))


def collectives_by_axis(module: HloModule, mesh: Mapping[str, int]) -> tuple[CollectiveUse, ...]:
  """A compiled step's collectives by kind and by the mesh axes they span: how many, how often, how many bytes.

  This is how to read what an FSDP step sends: its layer gradients reduce-scattered over ``fsdp`` (and only the shard
  all-reduced over ``data``), not all-reduced whole over every device (docs/sharding.md).

  Args:
    module: the program (:func:`parse_hlo`), compiled for a mesh of ``mesh``'s devices.
    mesh: ``{axis: size}`` in the mesh's axis order.

  Returns:
    One :class:`CollectiveUse` per (kind, axes, in a loop or not), the most bytes first.

  Raises:
    HloParseError: a replica group outside the mesh (a program compiled for another mesh).

  Example::

    >>> uses = collectives_by_axis(read_compiled(compiled), {"data": 2, "fsdp": 4})
    >>> [(u.kind, u.axes) for u in uses]
    [('all-gather', ('fsdp',)), ('reduce-scatter', ('fsdp',)), ('all-reduce', ('data',))]
  """
  return uses_by_axis(module.collectives(), module.num_devices, mesh)


def parse_hlo(text: str) -> HloModule:
  """Reads the post-optimisation HLO text of a compiled XLA program into an :class:`HloModule`.

  Takes what ``jax.jit(f).lower(*args).compile().as_text()`` returns for XLA:CPU, the TPU compiler (also deviceless,
  for a topology's compile-only devices) and the GPU compiler (also deviceless); the module docstring lists what
  each writes. Source of the grammar: XLA's HLO text printer (``xla/hlo/ir/hlo_instruction.cc``, ``ToString``) and
  parser (``xla/hlo/parser/hlo_parser.cc``).

  Args:
    text: the HLO text: an ``HloModule`` line, optional stack-frame tables, then computations (``ENTRY`` one).

  Returns:
    The :class:`HloModule`: computations and instructions as typed records, while loops with trip counts.

  Raises:
    HloParseError: no ``HloModule`` line or ``ENTRY`` computation, or a line it cannot read (quoted).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile()
    >>> parse_hlo(compiled.as_text()).totals().dot_flops  # 2 * M * N * K
    1024
  """
  if not isinstance(text, str):
    raise TypeError(f"parse_hlo expects the HLO text (a str), got {type(text).__name__}; for a compiled executable "
                    "call read_compiled(compiled)")
  name, header, computations, frames = parse_text(text)
  entries = [c.name for c in computations if c.is_entry]
  if len(entries) != 1:
    raise HloParseError(f"HLO module {name!r} has {len(entries)} ENTRY computations; a compiled program has one")
  by_name = _with_trip_counts({c.name: c for c in computations})
  return HloModule(name=name, attributes=header, computations=by_name, entry=entries[0],
                   num_partitions=int_literal(header.get("num_partitions")) or 1,
                   replica_count=int_literal(header.get("replica_count")) or 1, frames=frames)


def read_compiled(compiled: Any) -> HloModule:
  """:func:`parse_hlo` of a compiled program's text.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``), or anything with its ``compiled``
      attribute set to one (jaxckpt's ``CompiledPolicy``).

  Returns:
    The :class:`HloModule` of ``compiled.as_text()``.

  Raises:
    TypeError: ``compiled`` has no program text (a ``CompiledPolicy`` served from the compiled-stats cache keeps
      statistics only: compile again with ``JAXCKPT_STATS_CACHE=off``).
  """
  program = compiled if hasattr(compiled, "as_text") else getattr(compiled, "compiled", None)
  if program is None or not hasattr(program, "as_text"):
    raise TypeError(f"read_compiled expects a jax.stages.Compiled (or a CompiledPolicy holding one), got "
                    f"{type(compiled).__name__} without program text; a CompiledPolicy from the compiled-stats cache "
                    "has none: compile again with JAXCKPT_STATS_CACHE=off")
  text = program.as_text()
  if not isinstance(text, str):
    raise TypeError(f"{type(program).__name__}.as_text() returned {type(text).__name__}, not HLO text")
  return parse_hlo(text)
