"""Reading a compiled XLA program: the post-optimisation HLO text of ``compiled.as_text()`` as typed records that a
time model can sum over.

XLA's own ``cost_analysis()`` walks the program once, so a ``while`` body (every ``jax.lax.scan`` over layers) counts
one iteration (NOTES.md §3). :meth:`HloModule.executions` lists every instruction the step runs, with how many times
it runs: loop bodies multiplied by their trip count, nested loops multiplied again; a fusion is one unit (its body is
not executed separately). Per executed instruction it gives the FLOPs of the dots and convolutions in it, the bytes
it reads and writes at the fusion boundary and, on TPU, the compiler's ``estimated_cycles``; per step,
:meth:`HloModule.collectives` (kind, bytes per device, replica groups as device ids), :meth:`HloModule.host_transfers`
(bytes each way between device and host memory) and :meth:`HloModule.totals`.

What the three compilers write (measured with jax 0.10.2, libtpu 0.0.42.1, jax-cuda12-plugin 0.10.2; details and
excerpts in ``docs/hlo-reading.md``):

* Trip counts: XLA:CPU and XLA:GPU put them in the ``while``'s backend config, ``{"known_trip_count":{"n":"4"},
  ...}``. The TPU compiler's ``while`` has no backend config: the count is derived from the loop (the condition's
  ``compare`` of a tuple element with a constant, that element's start value in the ``while``'s operand and its step
  in the body's root), else it is ``None`` and the body is counted once.
* ``estimated_cycles``: TPU only, in ``backend_config.window_config.estimated_cycles`` of the scheduled instructions
  that run a kernel (fusions, copies, converts, broadcasts, ...), never of collectives, async starts, loops or
  instructions inside a fused computation.
* Replica groups: explicit ``{{0,1},{2,3}}``; iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``; and the mesh form
  ``mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`` that TPU and GPU print for jax's
  SPMD programs (:func:`replica_groups`).
* Memory spaces: ``S(5)`` in a layout is host memory (TPU and GPU); TPU also places small arrays in ``S(1)``
  (on-chip VMEM). A host offload is a ``dynamic-update-slice`` into an ``S(5)`` buffer (device to host) and a
  ``dynamic-slice`` out of one (host to device): TPU writes them as ``dynamic-update-slice-start`` /
  ``dynamic-slice-start`` instructions, GPU as ``fusion-start`` of a computation holding the slice.
* Collectives: GPU writes ``all-gather-start``/``-done`` pairs (``collective_backend_config.is_sync``); TPU writes
  plain ``all-gather``, or puts a collective in fusions (async collective fusions: the same ``channel_id`` in a start
  fusion, a fusion overlapping it with compute, and a done fusion; a reduce-scatter as an ``all-reduce`` followed by a
  ``dynamic-slice`` in one fusion). Each collective is counted once per run of the computation it is in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Union

import numpy as np

from jaxckpt._units import format_bytes
from jaxckpt.errors import JaxckptError, shorten

HOST_MEMORY_SPACE = 5
"""The memory space XLA gives host memory (``S(5)`` in a layout; ``Layout::kHostMemorySpace``): a buffer there lives in
the host's (pinned) memory, not the device's."""

COLLECTIVE_KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                                     "collective-broadcast", "ragged-all-to-all")
"""The collective opcodes (each also as an async ``-start``/``-done`` pair), the values of :attr:`Collective.kind`."""


class HloParseError(JaxckptError):
  """The text is not HLO this reader understands: no ``HloModule`` line, no ``ENTRY`` computation, an instruction line
  it cannot split, or replica groups in an unknown form. The message quotes the bad line or value."""


# --- records ------------------------------------------------------------------------------------------------------


class ArrayShape(NamedTuple):
  """One array of an instruction's result (a tuple result is a tuple of these, possibly nested)."""

  dtype: str  # XLA's element type name: "f32", "bf16", "s32", "pred", "token", ...
  dims: tuple[int, ...]  # dimension sizes (a bounded dynamic dimension "<=8" as its bound)
  minor_to_major: tuple[int, ...] | None  # the layout's dimension order; None where the text gives no layout
  memory_space: int  # S(n) of the layout; 0 (device memory) when absent, HOST_MEMORY_SPACE (5) for host memory

  @property
  def elements(self) -> int:
    """Number of elements (1 for a scalar)."""
    return math.prod(self.dims)

  @property
  def nbytes(self) -> int:
    """Bytes of the array (sub-byte types packed, rounded up); tokens are 0."""
    return -(-self.elements * _DTYPE_BITS.get(self.dtype, 0) // 8)

  @property
  def on_host(self) -> bool:
    """Whether it lives in host memory (memory space :data:`HOST_MEMORY_SPACE`)."""
    return self.memory_space == HOST_MEMORY_SPACE


HloShape = Union[ArrayShape, tuple]
"""An instruction's result: an :class:`ArrayShape` or a tuple of ``HloShape``."""

_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4,
    "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8, "token": 0, "opaque": 0,
}


def _leaves(shape: HloShape) -> Iterator[ArrayShape]:
  """The arrays of a (possibly nested tuple) shape, in order."""
  if isinstance(shape, ArrayShape):
    yield shape
  else:
    for element in shape:
      yield from _leaves(element)


def _shape_bytes(shape: HloShape) -> int:
  return sum(a.nbytes for a in _leaves(shape))


@dataclasses.dataclass(frozen=True)
class HloInstruction:
  """One HLO instruction as the text writes it."""

  name: str  # its name, without "%" ("fusion.12")
  opcode: str  # "fusion", "dot", "all-gather-start", "while", ...
  shape: HloShape  # result: an ArrayShape or a (nested) tuple of them
  operands: tuple[str, ...]  # operand instruction names, in order (in the same computation)
  computation: str  # the computation it is in
  is_root: bool  # the computation's ROOT
  calls: tuple[str, ...]  # computations it refers to: fusion calls=, while condition= and body=, to_apply=, branches
  attributes: Mapping[str, str]  # every "key=value" after the operands, values as raw text
  literal: str | None = None  # a constant's value or a parameter's number, as written
  fusion_kind: str | None = None  # "kLoop", "kInput", "kOutput", "kCustom" for a fusion, else None
  custom_call_target: str | None = None  # custom_call_target of a custom-call ("AllocateBuffer", "__cublas$gemm")
  backend_config: Mapping[str, Any] | None = None  # backend_config parsed as JSON; None if absent or not JSON
  op_name: str | None = None  # metadata op_name ("jit(loss)/jvp()/while/body/dot_general"), the jaxpr's path
  channel_id: int | None = None  # channel_id of a collective (an async pair and its fused copies share it)
  trip_count: int | None = None  # while: iterations per run, from trip_count_source; None if unknown
  trip_count_source: str | None = None  # while: "backend_config" (CPU, GPU) or "derived" (from the loop), else None

  @property
  def output_bytes(self) -> int:
    """Bytes of the result, every array of a tuple summed."""
    return _shape_bytes(self.shape)

  @property
  def arrays(self) -> tuple[ArrayShape, ...]:
    """The arrays of the result in order (one for an array result; a tuple's flattened)."""
    return tuple(_leaves(self.shape))

  @property
  def called(self) -> str | None:
    """The computation a fusion, async start, call or custom call runs (its first ``calls=``/``to_apply=``), or None."""
    for key in ("calls", "to_apply", "called_computations"):
      if key in self.attributes:
        names = _computation_names(self.attributes[key])
        return names[0] if names else None
    return None

  @property
  def estimated_cycles(self) -> int | None:
    """TPU: the compiler's cycle estimate for one run (``backend_config.window_config.estimated_cycles``); else None."""
    window = (self.backend_config or {}).get("window_config")
    cycles = window.get("estimated_cycles") if isinstance(window, Mapping) else None
    return int(cycles) if cycles is not None else None


@dataclasses.dataclass(frozen=True)
class HloComputation:
  """A named HLO computation: the entry, a while body or condition, a fused computation, a reducer, ..."""

  name: str  # its name, without "%"
  instructions: tuple[HloInstruction, ...]  # in text order (the schedule, for a scheduled module)
  is_entry: bool  # the ENTRY computation

  @functools.cached_property
  def by_name(self) -> Mapping[str, HloInstruction]:
    """Its instructions by name."""
    return {i.name: i for i in self.instructions}

  @functools.cached_property
  def root(self) -> HloInstruction:
    """Its ROOT instruction (the last one where none is marked)."""
    return next((i for i in self.instructions if i.is_root), self.instructions[-1])

  @functools.cached_property
  def users(self) -> Mapping[str, tuple[HloInstruction, ...]]:
    """Instruction name -> the instructions of this computation that take it as an operand."""
    out: dict[str, list[HloInstruction]] = {}
    for ins in self.instructions:
      for op in dict.fromkeys(ins.operands):
        out.setdefault(op, []).append(ins)
    return {k: tuple(v) for k, v in out.items()}


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


class Collective(NamedTuple):
  """One collective of the step (an async ``-start``/``-done`` pair, or a TPU async collective fusion: once)."""

  kind: str  # a COLLECTIVE_KINDS entry ("reduce-scatter" also for TPU's all-reduce + dynamic-slice fusion)
  instruction: HloInstruction  # the collective instruction (the -start; inside a fusion body where TPU fuses it)
  unit: str  # the executed instruction that runs it: itself, or the fusion that holds it
  payload_bytes: int  # bytes per device per run: all-gather output, reduce-scatter input, all-reduce buffer, else input
  groups: tuple[tuple[int, ...], ...]  # replica groups as device ids (partition ids of an SPMD program); permute: pairs
  group_size: int  # devices per group (2 for collective-permute's source/target pairs)
  is_async: bool  # run asynchronously: a -start not marked is_sync, an async-start, or a TPU async collective fusion
  count: int  # runs per step
  in_loop: bool = False  # inside a while loop's body (a scanned layer stack's per-layer collectives)
  sliced_bytes: int = 0  # an all-reduce's payload bytes per run whose results are only sliced afterwards: a reduction
  # to each device's shard that the compiler runs as an all-reduce (XLA:CPU; TPU for small shards)

  @property
  def total_bytes(self) -> int:
    """``payload_bytes * count``: bytes per device per step."""
    return self.payload_bytes * self.count


class CollectiveUse(NamedTuple):
  """The collectives of one kind over one set of mesh axes in a step (:func:`collectives_by_axis`): what the step
  sends, and over which axes."""

  kind: str  # a COLLECTIVE_KINDS entry ("reduce-scatter" also for an all-reduce whose results are only sliced)
  axes: tuple[str, ...]  # the mesh axes its replica groups span, in mesh order: ("fsdp",), ("data", "fsdp")
  in_loop: bool  # inside a while loop's body: a scanned layer stack's per-layer collectives (else once per step)
  group_size: int  # devices per group (the largest, where groups differ; 2 for a collective-permute's pairs)
  instructions: int  # distinct collective instructions in the program
  runs: int  # runs per step (each loop body's collectives times its trip count)
  bytes: int  # payload bytes per device per step (Collective.payload_bytes × runs, summed)
  largest_bytes: int  # the largest payload of one run, bytes per device (a whole gradient, or one device's shard)
  sliced_bytes: int  # all-reduces: of `bytes`, those whose results are only sliced afterwards (a reduction to the
  # shards that the compiler runs as an all-reduce: XLA:CPU always, the TPU compiler for small shards)
  largest_kept_bytes: int  # all-reduces: the largest payload of one run that devices keep whole (not sliced)

  def as_dict(self) -> dict[str, Any]:
    """The record as JSON-ready values (the report's ``collectives`` rows)."""
    return {**self._asdict(), "axes": list(self.axes)}


class HostTransfer(NamedTuple):
  """A copy between device memory and host memory (:data:`HOST_MEMORY_SPACE`), once per async pair."""

  direction: str  # "to_host" (device -> host: an offload) or "to_device" (host -> device: a reload)
  bytes: int  # bytes moved per run
  instruction: HloInstruction  # the moving instruction (dynamic-update-slice, dynamic-slice, copy, ...)
  unit: str  # the executed instruction that runs it: itself, or the fusion / fusion-start that holds it
  count: int  # runs per step

  @property
  def total_bytes(self) -> int:
    """``bytes * count``: bytes per device per step."""
    return self.bytes * self.count


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


# --- the text -----------------------------------------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
_TOKEN = re.compile(r'\\.|["(){}\[\]]|, (?=[A-Za-z_][\w.\-]*=)')
"""A top-level attribute separator: ``, key=`` (keys may hold hyphens: ``control-predecessors={...}``, which XLA:GPU
prints on scheduled instructions), or a bracket or quote that opens or closes a nested part."""
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_HEAD = re.compile(r"\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_MEMORY_SPACE = re.compile(r"(?<![A-Z])S\((\d+)\)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_COMPUTATION_HEAD = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")


def _split_top(text: str, *, attributes: bool) -> list[str]:
  """``text`` split at top-level separators (outside brackets and strings): at ``, key=`` (attributes) or commas."""
  parts, depth, in_string, start = [], 0, False, 0
  pattern = _TOKEN if attributes else re.compile(r'\\.|["(){}\[\],]')
  for m in pattern.finditer(text):
    token = m.group()
    if token[0] == "\\":
      continue
    if token == '"':
      in_string = not in_string
    elif in_string:
      continue
    elif token in "({[":
      depth += 1
    elif token in ")}]":
      depth -= 1
    elif depth == 0:
      parts.append(text[start:m.start()])
      start = m.end()
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _attributes(text: str) -> dict[str, str]:
  """``key=value, key=value`` -> dict; the mesh form's ``, device_ids=...`` stays part of its replica groups."""
  out: dict[str, str] = {}
  last = None
  for part in _split_top(text, attributes=True):
    key, _, value = part.partition("=")
    if key == "device_ids" and last == "replica_groups":
      out[last] += f", {part}"
      continue
    out[key] = value
    last = key
  return out


def _closing(text: str, start: int) -> int:
  """Index of the bracket closing the one at ``start`` (strings skipped)."""
  depth, in_string = 0, False
  for m in re.compile(r'\\.|["(){}\[\]]').finditer(text, start):
    token = m.group()
    if token[0] == "\\":
      continue
    if token == '"':
      in_string = not in_string
    elif in_string:
      continue
    elif token in "({[":
      depth += 1
    else:
      depth -= 1
      if depth == 0:
        return m.start()
  raise HloParseError(f"unbalanced brackets in HLO line {shorten(text, 120)!r}")


def _parse_shape(text: str, pos: int) -> tuple[HloShape, int]:
  """The shape written at ``text[pos:]`` and the position after it."""
  if text.startswith("(", pos):
    elements, pos = [], pos + 1
    while True:
      while text[pos] in " ,":
        pos += 1
      if text[pos] == ")":
        return tuple(elements), pos + 1
      element, pos = _parse_shape(text, pos)
      elements.append(element)
  m = _ARRAY.match(text, pos)
  if m is None:
    raise HloParseError(f"no shape at {shorten(text[pos:], 60)!r} in HLO line {shorten(text, 120)!r}")
  dims = tuple(int(d.strip().lstrip("<=")) if d.strip() not in ("", "?") else 0 for d in m.group(2).split(",")
               if d.strip())
  layout, order, space = m.group(3), None, 0
  if layout:
    major, _, rest = layout[1:-1].partition(":")
    order = tuple(int(d) for d in major.split(",") if d.strip())
    found = _MEMORY_SPACE.search(rest)
    space = int(found.group(1)) if found else 0
  return ArrayShape(m.group(1), dims, order, space), m.end()


def _computation_names(value: str) -> tuple[str, ...]:
  """``%a`` or ``{%a, %b}`` -> ``("a", "b")``."""
  return tuple(n.strip().lstrip("%") for n in value.strip("{} ").split(",") if n.strip())


_CALL_KEYS = ("calls", "condition", "body", "to_apply", "branch_computations", "true_computation",
              "false_computation", "called_computations")


def _backend_config(value: str | None) -> Mapping[str, Any] | None:
  if not value:
    return None
  if value.startswith('"'):
    try:
      value = json.loads(value)
    except ValueError:
      return None
  try:
    parsed = json.loads(value)
  except ValueError:
    return None
  return parsed if isinstance(parsed, dict) else None


def _parse_instruction(line: str, computation: str) -> HloInstruction:
  """One instruction line of a computation."""
  if "/*" in line:
    line = _COMMENT.sub("", line)
  head = _HEAD.match(line)
  if head is None:
    raise HloParseError(f"cannot read HLO instruction line {shorten(line.strip(), 120)!r}")
  shape, pos = _parse_shape(line, head.end())
  op = _OPCODE.match(line, pos)
  if op is None:
    raise HloParseError(f"no opcode in HLO instruction line {shorten(line.strip(), 120)!r}")
  opcode, open_at = op.group(1), op.end() - 1
  close_at = _closing(line, open_at)
  inner = line[open_at + 1:close_at]
  rest = line[close_at + 1:].lstrip()
  attributes = _attributes(rest[1:]) if rest.startswith(",") else {}
  literal, operands = None, ()
  if opcode in ("constant", "parameter"):
    literal = inner.strip()
  else:
    operands = tuple(p.split()[-1].lstrip("%") for p in _split_top(inner, attributes=False))
  calls = tuple(n for key in _CALL_KEYS if key in attributes for n in _computation_names(attributes[key]))
  target = attributes.get("custom_call_target")
  op_name = _OP_NAME.search(attributes.get("metadata", ""))
  channel = attributes.get("channel_id")
  return HloInstruction(
      name=head.group(2).lstrip("%"), opcode=opcode, shape=shape, operands=operands, computation=computation,
      is_root=bool(head.group(1)), calls=calls, attributes=attributes, literal=literal,
      fusion_kind=attributes.get("kind") if "fusion" in opcode else None,
      custom_call_target=json.loads(target) if target and target.startswith('"') else target,
      backend_config=_backend_config(attributes.get("backend_config")),
      op_name=op_name.group(1) if op_name else None, channel_id=int(channel) if channel else None)


_COMPUTATION_END = re.compile(r"\}(\s*,\s*\w+=.*)?$")
"""A computation's closing line: ``}``, or ``}, execution_thread="sparsecore"`` (the TPU compiler's computations on
another execution thread, e.g. an MoE step's SparseCore work)."""


def _opened(line: str) -> int:
  """Brackets a line opens and does not close (``{`` and ``(``): > 0 where an instruction goes on to the next line
  (the TPU compiler prints a Pallas kernel's ``frontend_attributes={kernel_metadata={`` with newlines inside)."""
  return line.count("{") - line.count("}") + line.count("(") - line.count(")")


def _parse_text(text: str) -> tuple[str, dict[str, str], list[HloComputation]]:
  """Module name, header attributes and computations of an HLO text."""
  name, header, computations = None, {}, []
  current: tuple[str, bool, list[HloInstruction]] | None = None
  held = ""  # an instruction whose attributes go on over more lines (a Pallas call's kernel_metadata holds newlines)
  for line in text.splitlines():
    if current is not None:
      if held:
        held += "\n" + line
        if _opened(held) <= 0:
          current[2].append(_parse_instruction(held, current[0]))
          held = ""
      elif _COMPUTATION_END.match(line.strip()):
        computations.append(HloComputation(current[0], tuple(current[2]), current[1]))
        current = None
      elif line.strip():
        if _opened(line) > 0:
          held = line
        else:
          current[2].append(_parse_instruction(line, current[0]))
    elif line.startswith("HloModule "):
      first, _, rest = line[len("HloModule "):].partition(",")
      name, header = first.strip(), _attributes(rest)
    elif line and not line[0].isspace() and (m := _COMPUTATION_HEAD.match(line)):
      current = (m.group(2), bool(m.group(1)), [])
  if name is None:
    raise HloParseError(f"no 'HloModule' line in the text (starts {shorten(text.strip(), 80)!r}): pass "
                        "compiled.as_text() of a jax.stages.Compiled")
  if current is not None:
    raise HloParseError(f"computation {current[0]!r} has no closing '}}': the HLO text is cut short")
  return name, header, computations


# --- replica groups -----------------------------------------------------------------------------------------------

_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH = re.compile(r"@?mesh\s*[\[<](?P<axes>[^\]>]*)[\]>]\s*(?:,\s*device_ids=\((?P<ids>.*)\))?\s*\{(?P<over>[^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?\s*=\s*(\d+)")
_OVER_AXIS = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


def _ints(text: str) -> list[int]:
  return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
  """XLA's iota tile assignment: ``arange`` reshaped to ``reshape``, transposed by ``perm``, reshaped to ``dims``."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  if perm:
    ids = ids.transpose(perm)
  return ids.reshape(dims)


def _mesh_groups(m: re.Match) -> np.ndarray:
  """The mesh form: devices laid out as the mesh; one group per position of the other axes, over the named axes."""
  axes = [(n, int(s)) for n, s in _MESH_AXIS.findall(m.group("axes"))]
  sizes = [s for _, s in axes]
  ids_text = (m.group("ids") or "").strip()
  if not ids_text:
    devices = np.arange(math.prod(sizes))
  elif (iota := re.fullmatch(r"\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", ids_text)):
    reshape = _ints(iota.group(1))
    devices = _iota([math.prod(reshape)], reshape, _ints(iota.group(2)) if iota.group(2) else None)
  else:
    devices = np.array(_ints(ids_text))
  index = {n: i for i, (n, _) in enumerate(axes)}
  over = [(a, int(p) if p else None, int(s) if s else None) for a, p, s in _OVER_AXIS.findall(m.group("over"))]
  if not over or any(a not in index for a, _, _ in over):
    raise HloParseError(f"replica groups {m.group()!r} name an axis the mesh does not have")
  # split each axis at the sub-axis boundaries ("a:(pre)size" is the part of size `size` after `pre` major ones)
  cuts: dict[int, set[int]] = {i: {1, s} for i, s in enumerate(sizes)}
  for a, pre, size in over:
    if pre is not None:
      cuts[index[a]] |= {pre, pre * size}
  dims, where = [], {}  # where[(axis, cumulative product)] = position among the split dims
  for i, size in enumerate(sizes):
    bounds = sorted(cuts[i])
    for lo, hi in zip(bounds, bounds[1:]):
      where[(i, lo)] = len(dims)
      dims.append(hi // lo)
  grid = devices.reshape(dims)
  grouped: list[int] = []
  for a, pre, size in over:
    i = index[a]
    lo, hi = (1, sizes[i]) if pre is None else (pre, pre * size)
    grouped.extend(p for (axis, start), p in sorted(where.items(), key=lambda kv: kv[1])
                   if axis == i and lo <= start < hi)
  rest = [p for p in range(len(dims)) if p not in grouped]
  group_size = math.prod(dims[p] for p in grouped)
  return grid.transpose(rest + grouped).reshape(-1, group_size)


def replica_groups(text: str, *, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
  """Replica groups of a collective, as written in HLO text, resolved to explicit lists of device ids.

  Forms (XLA's ``CollectiveDeviceList`` printers, ``xla/hlo/ir/collective_device_list.h``):

  * explicit: ``{{0,1},{2,3}}``; ``{}`` is one group of all ``num_devices`` devices.
  * iota: ``[G,S]<=[dims]`` or ``[G,S]<=[dims]T(perm)``: ``arange(prod(dims))`` reshaped to ``dims``, transposed by
    ``perm``, reshaped to ``G`` groups of ``S``. ``[4,2]<=[2,4]T(1,0)`` is ``{0,4},{1,5},{2,6},{3,7}``.
  * mesh: ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`` (also printed ``@mesh<a=4,b=2> {a}``): the device ids
    (``arange``, or ``device_ids=(...)`` as a list or an iota ``[4,2]T(1,0)``) laid out row-major as the mesh;
    one group for each position of the axes not named, holding the devices along the named ones (the first named
    axis major). A sub-axis ``'a':(pre)size`` is the part of axis ``a`` of size ``size`` with ``pre`` major to it.
    Checked against jax meshes compiled for 8 GPUs: ``data=2,fsdp=4`` prints
    ``mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`` for the fsdp collectives, which
    resolves to ``{0,1,2,3},{4,5,6,7}``: the rows of ``mesh.devices``.

  Ids are what XLA numbers devices in the program: for jax's SPMD programs (``use_global_device_ids``), partition ids,
  i.e. positions in the mesh's ``devices.flat`` order, not ``device.id``.

  Args:
    text: the attribute's value (``replica_groups=`` or ``source_target_pairs=``).
    num_devices: devices of the program (``num_partitions * replica_count``), needed for ``{}`` only.

  Returns:
    The groups, each a tuple of device ids.

  Raises:
    HloParseError: a form not listed, or ``{}`` without ``num_devices``.

  Example:
    >>> replica_groups("[2,4]<=[4,2]T(1,0)")
    ((0, 2, 4, 6), (1, 3, 5, 7))
  """
  text = text.strip()
  if text in ("{}", "{{}}"):
    if num_devices is None:
      raise HloParseError("replica_groups={} means every device: pass num_devices=")
    return (tuple(range(num_devices)),)
  if text.startswith("{"):
    groups = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
    if not groups or "{" not in text[1:]:
      raise HloParseError(f"cannot read replica groups {shorten(text)!r}: write {{{{0,1}},{{2,3}}}}")
    return tuple(tuple(_ints(g)) for g in groups)
  if (m := _IOTA.fullmatch(text)):
    table = _iota(_ints(m.group(1)), _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    return tuple(tuple(int(d) for d in row) for row in table)
  if (m := _MESH.fullmatch(text)):
    return tuple(tuple(int(d) for d in row) for row in _mesh_groups(m))
  raise HloParseError(f"unknown replica group form {shorten(text)!r}: known forms are {{{{0,1}},{{2,3}}}}, "
                      "[2,4]<=[8] (iota, optionally T(perm)) and mesh['a'=2,'b'=4] {'b'}")


# --- trip counts --------------------------------------------------------------------------------------------------


class _Value(NamedTuple):
  """A scalar integer as ``tuple[index] + offset`` (the loop state's element ``index``) or ``offset`` (a constant)."""

  index: int | None
  offset: int


def _int_literal(text: str | None) -> int | None:
  try:
    return int(text) if text is not None else None
  except ValueError:
    return None


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
    value = _int_literal(ins.literal)
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
        n = _int_literal(known.get("n")) if isinstance(known, Mapping) else None
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
_GEMM_TARGETS = GEMM_TARGETS

_NO_FLOPS_TARGETS = frozenset({"AllocateBuffer", "AsyncCollectiveStart", "AsyncCollectiveDone", "MoveToHost",
                               "MoveToDevice", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                               "PinToDevice", "annotate_device_placement"})
"""Custom calls that compute nothing (buffers, async bookkeeping, sharding and placement annotations)."""


def _dim_list(attributes: Mapping[str, str], key: str) -> list[int]:
  m = _DIMS.fullmatch(attributes.get(key, "{}").strip())
  return _ints(m.group(1)) if m else []


def _first_array(shape: HloShape) -> ArrayShape | None:
  return next(_leaves(shape), None)


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
  out = _first_array(ins.shape)
  if out is None or not ins.operands:
    return 0
  operand_shape = lambda i: _first_array(comp.by_name[ins.operands[i]].shape)  # noqa: E731
  if ins.opcode == "dot":
    lhs = operand_shape(0)
    return _matmul_flops(out.elements, math.prod(lhs.dims[d] for d in _dim_list(ins.attributes,
                                                                                  "lhs_contracting_dims")))
  if ins.opcode == "convolution":
    return _convolution_flops(ins, out, operand_shape(0), operand_shape(1))
  if ins.opcode == "custom-call" and ins.custom_call_target in _GEMM_TARGETS:
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


def _called_instructions(computations: Mapping[str, HloComputation], ins: HloInstruction) -> Iterator[HloInstruction]:
  """The instructions of the computation a fusion / async start runs, nested fusions' too."""
  called = computations.get(ins.called) if ins.called else None
  if called is None:
    return
  for inner in called.instructions:
    yield inner
    if inner.opcode == "fusion":
      yield from _called_instructions(computations, inner)


_RUNS_BODY = frozenset({"fusion", "fusion-start", "async-start"})
"""Instructions whose called computation is part of their own run (not an execution of its own)."""

_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
                   "replica-id", "while", "conditional", "call", "opt-barrier", "add-dependency", "domain"})
"""Instructions that move no data themselves (a loop's or call's body is counted as its own executions)."""


def _unit_flops(computations: Mapping[str, HloComputation], ins: HloInstruction) -> int:
  if ins.opcode in _RUNS_BODY:
    return sum(_dot_flops(i, computations[i.computation]) for i in _called_instructions(computations, ins))
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
  param = next((i for i in called.instructions if i.opcode == "parameter" and _int_literal(i.literal) == number), None)
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


def _async_output(ins: HloInstruction) -> HloShape:
  """What an async ``-start`` writes: its result's element 1 (XLA's ``((operands), output, context)``), element 0 for
  copy-start (``(destination, source, context)``), the whole result where it is not a tuple (all-reduce-start)."""
  if isinstance(ins.shape, ArrayShape) or len(ins.shape) < 2:
    return ins.shape
  return ins.shape[0] if ins.opcode == "copy-start" else ins.shape[1]


def _unit_bytes(computations: Mapping[str, HloComputation], ins: HloInstruction) -> tuple[int, int]:
  """``(bytes read, bytes written)`` of one run of an executed instruction."""
  if ins.opcode in _FREE or ins.opcode.endswith(("-done", "-update")):
    return 0, 0
  comp = computations[ins.computation]
  operand_bytes = [comp.by_name[op].output_bytes if op in comp.by_name else 0 for op in ins.operands]
  if ins.opcode in _RUNS_BODY and ins.called in computations:
    called = computations[ins.called]
    read = sum(_parameter_read_bytes(called, i, b) for i, b in enumerate(operand_bytes))
    written = _written_bytes(called, called.root)
    return read, (written if ins.opcode == "fusion" else min(written, _shape_bytes(_async_output(ins))))
  if ins.opcode in ("dynamic-slice", "dynamic-slice-start"):
    out = _shape_bytes(_async_output(ins))
    return out + sum(operand_bytes[1:]), out
  if ins.opcode in ("dynamic-update-slice", "dynamic-update-slice-start"):
    update = operand_bytes[1] if len(operand_bytes) > 1 else 0
    return update + sum(operand_bytes[2:]), update
  if ins.opcode.endswith("-start"):
    return sum(operand_bytes), _shape_bytes(_async_output(ins))
  return sum(operand_bytes), ins.output_bytes


# --- collectives and host transfers -------------------------------------------------------------------------------


def _collective_kind(opcode: str) -> str | None:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in COLLECTIVE_KINDS else None


def _scatters(comp: HloComputation, ins: HloInstruction) -> bool:
  """Whether an all-reduce's result is only dynamic-sliced inside its fusion (TPU's reduce-scatter fusion,
  ``all-reduce-scatter``: all-reduce + slice, which runs as a reduce-scatter). An all-reduce whose result is sliced
  by later instructions (XLA:CPU, which has no reduce-scatter; the TPU compiler's choice for small arrays) moves the
  whole array on the wire and stays an all-reduce."""
  users = comp.users.get(ins.name, ())
  return bool(users) and all(u.opcode == "dynamic-slice" or (u.opcode == "bitcast" and _scatters(comp, u))
                             for u in users)


_TO_SLICE = frozenset({"bitcast", "get-tuple-element", "all-reduce-done", "async-done", "copy"})
"""Instructions a collective's result goes through unchanged on its way to a slice (:func:`_only_sliced`)."""


def _parameter_sliced(computations: Mapping[str, HloComputation], fusion: HloInstruction, value: str) -> bool:
  """Whether a fusion uses its operand ``value`` only through dynamic slices inside its fused computation."""
  called = computations.get(fusion.called or "")
  if called is None:
    return False
  numbers = {i for i, op in enumerate(fusion.operands) if op == value}
  params = [i for i in called.instructions if i.opcode == "parameter" and i.literal is not None
            and int(i.literal) in numbers]
  return bool(params) and all(_only_sliced(computations, called, p) for p in params)


def _only_sliced(computations: Mapping[str, HloComputation], comp: HloComputation, ins: HloInstruction) -> bool:
  """Whether every use of ``ins`` reaches a dynamic slice (through bitcasts, tuple elements, async done, copies, and
  into fusions that only slice it): each device keeps a part of it."""
  users = comp.users.get(ins.name, ())
  if not users:
    return False
  for user in users:
    if user.opcode == "dynamic-slice" and user.operands and user.operands[0] == ins.name:
      continue
    if user.opcode in _TO_SLICE and _only_sliced(computations, comp, user):
      continue
    if user.opcode == "fusion" and _parameter_sliced(computations, user, ins.name):
      continue
    return False
  return True


def _sliced_bytes(module: HloModule, comp: HloComputation, ins: HloInstruction) -> int:
  """Bytes per run of an all-reduce's results that are only sliced afterwards (:func:`_only_sliced`): a reduction to
  each device's shard that the compiler runs as an all-reduce (XLA:CPU, which has no reduce-scatter; the TPU
  compiler for small shards, the slice fused into the gradient's update). A tuple all-reduce counts per element."""
  done = next((u for u in comp.users.get(ins.name, ()) if u.opcode.endswith("-done")), None)
  result = done if done is not None else ins
  if not isinstance(result.shape, tuple):
    return result.output_bytes if _only_sliced(module.computations, comp, result) else 0
  total = 0
  for user in comp.users.get(result.name, ()):
    if user.opcode == "get-tuple-element" and _only_sliced(module.computations, comp, user):
      total += user.output_bytes
  return total


def _is_sync(ins: HloInstruction) -> bool:
  config = (ins.backend_config or {}).get("collective_backend_config")
  return isinstance(config, Mapping) and bool(config.get("is_sync"))


def _collective(module: HloModule, ins: HloInstruction, unit: HloInstruction, count: int,
                fused_async: bool) -> Collective:
  """The :class:`Collective` of one collective instruction (``unit`` runs it ``count`` times per step)."""
  comp = module.computations[ins.computation]
  kind = _collective_kind(ins.opcode)
  if kind == "all-reduce" and _scatters(comp, ins):
    kind = "reduce-scatter"
  operands = [comp.by_name[op].output_bytes for op in ins.operands if op in comp.by_name]
  if kind == "collective-permute":
    groups = replica_groups(ins.attributes.get("source_target_pairs", "{}"), num_devices=module.num_devices)
    size = 2
  else:
    groups = replica_groups(ins.attributes.get("replica_groups", "{}"), num_devices=module.num_devices)
    size = len(groups[0]) if groups else 1
  if kind in ("collective-permute", "ragged-all-to-all"):
    payload = operands[0] if operands else 0
  elif kind == "all-gather":
    payload = sum(operands) * size
  else:
    payload = sum(operands)
  is_async = (ins.opcode.endswith("-start") and not _is_sync(ins)) or fused_async
  sliced = _sliced_bytes(module, comp, ins) if kind == "all-reduce" else 0
  return Collective(kind, ins, unit.name, payload, groups, size, is_async, count, sliced_bytes=min(sliced, payload))


def _unit_collectives(module: HloModule, run: HloExecution) -> Iterator[tuple[HloInstruction, bool]]:
  """``(collective instruction, in an async collective fusion)`` run by one executed instruction."""
  ins = run.instruction
  if _collective_kind(ins.opcode) is not None:
    yield ins, False
  elif ins.opcode in _RUNS_BODY:
    inner = list(_called_instructions(module.computations, ins))
    fused_async = ins.opcode == "async-start" or any((i.custom_call_target or "").startswith("AsyncCollective")
                                                    for i in inner)
    yield from ((i, fused_async) for i in inner if _collective_kind(i.opcode) is not None)


def _moves(comp: HloComputation, ins: HloInstruction) -> tuple[str, int] | None:
  """``(direction, bytes)`` if an instruction copies between device and host memory, else None."""
  operand = lambda i: comp.by_name.get(ins.operands[i]) if len(ins.operands) > i else None  # noqa: E731
  on_host = lambda shape: any(a.on_host for a in _leaves(shape))  # noqa: E731
  source, target = operand(0), None
  if ins.opcode in ("dynamic-update-slice", "dynamic-update-slice-start"):
    update = operand(1)
    if source is None or update is None or on_host(source.shape) == on_host(update.shape):
      return None
    return ("to_host" if on_host(source.shape) else "to_device"), update.output_bytes
  if ins.opcode in ("dynamic-slice", "dynamic-slice-start", "copy", "copy-start"):
    target = _async_output(ins)
  elif ins.opcode == "custom-call" and ins.custom_call_target in ("MoveToHost", "MoveToDevice"):
    return ("to_host" if ins.custom_call_target == "MoveToHost" else "to_device"), _shape_bytes(ins.shape)
  elif ins.opcode in ("send", "recv") and ins.attributes.get("is_host_transfer") == "true":
    shape = source.shape if ins.opcode == "send" and source is not None else _first_array(ins.shape)
    return ("to_host" if ins.opcode == "send" else "to_device"), _shape_bytes(shape)
  if source is None or target is None or on_host(source.shape) == on_host(target):
    return None
  return ("to_device" if on_host(source.shape) else "to_host"), _shape_bytes(target)


def _unit_transfers(module: HloModule, ins: HloInstruction) -> Iterator[tuple[HloInstruction, str, int]]:
  """``(moving instruction, direction, bytes)`` run by one executed instruction."""
  inner = list(_called_instructions(module.computations, ins)) if ins.opcode in _RUNS_BODY else [ins]
  for i in inner:
    moved = _moves(module.computations[i.computation], i)
    if moved is not None:
      yield i, *moved


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
    return list(_called_instructions(self.computations, ins))

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
      for ins, fused_async in _unit_collectives(self, run):
        key = (run.instruction.computation, ins.channel_id if ins.channel_id is not None else ins.name)
        if key in found:  # the same collective's async pieces (TPU: start, overlapped and done fusions)
          found[key] = found[key]._replace(is_async=found[key].is_async or fused_async)
        else:
          found[key] = _collective(self, ins, run.instruction, run.count, fused_async)._replace(in_loop=bool(run.loops))
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
                 for run in self._executions for ins, direction, n in _unit_transfers(self, run.instruction))

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
            for i in (_called_instructions(self.computations, r.instruction) if r.instruction.opcode in _RUNS_BODY
                      else (r.instruction,))
            if i.opcode == "custom-call" and i.custom_call_target not in _GEMM_TARGETS | _NO_FLOPS_TARGETS})))


def group_axes(groups: tuple[tuple[int, ...], ...], mesh: Mapping[str, int]) -> tuple[str, ...]:
  """The mesh axes a collective's replica groups span: the axes along which the devices of some group differ.

  Device ids are partition ids, positions in the mesh's devices laid out row-major over its axes (what jax's SPMD
  programs number, :func:`replica_groups`).

  Args:
    groups: the replica groups (or a collective-permute's source/target pairs), device ids.
    mesh: ``{axis: size}`` in the mesh's axis order (:func:`jaxckpt.sharding.mesh_shape`).

  Returns:
    The spanned axes in mesh order (``()`` where every group is one device).

  Raises:
    HloParseError: a device id outside the mesh.
  """
  names, sizes = list(mesh), [int(n) for n in mesh.values()]
  total = math.prod(sizes)
  spanned: set[int] = set()
  for group in groups:
    if any(not 0 <= d < total for d in group):
      raise HloParseError(f"replica group {group} names a device outside the mesh {dict(mesh)} ({total} devices)")
    coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), sizes)).reshape(len(sizes), -1)
    spanned.update(i for i in range(len(sizes)) if len(set(coords[i].tolist())) > 1)
  return tuple(names[i] for i in sorted(spanned))


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
  if math.prod(int(n) for n in mesh.values()) != module.num_devices:
    raise HloParseError(f"the program spans {module.num_devices} devices, the mesh {dict(mesh)} "
                        f"{math.prod(int(n) for n in mesh.values())}: read it with the mesh it was compiled for")
  rows: dict[tuple[str, tuple[str, ...], bool], list[Collective]] = {}
  for c in module.collectives():
    rows.setdefault((c.kind, group_axes(c.groups, mesh), c.in_loop), []).append(c)
  out = [CollectiveUse(kind, axes, in_loop, max(c.group_size for c in cs), len(cs), sum(c.count for c in cs),
                       sum(c.total_bytes for c in cs), max(c.payload_bytes for c in cs),
                       sum(c.sliced_bytes * c.count for c in cs), max(c.payload_bytes - c.sliced_bytes for c in cs))
         for (kind, axes, in_loop), cs in rows.items()]
  return tuple(sorted(out, key=lambda u: (-u.bytes, u.kind, u.axes)))


def describe_collectives(uses: "tuple[CollectiveUse, ...] | list[Mapping[str, Any]]", *, top: int = 4) -> str:
  """One line of what a step sends: its ``top`` collectives by bytes, each as kind, mesh axes, bytes per device per
  step and where (``reduce-scatter over fsdp 12.0 MiB in the layer loop``), an all-reduce whose results are only
  sliced said so.

  Args:
    uses: :func:`collectives_by_axis`'s records, or their :meth:`CollectiveUse.as_dict` (a report row's
      ``collectives``).
    top: how many to name.
  """
  rows = [u.as_dict() if isinstance(u, CollectiveUse) else u for u in uses]
  if not rows:
    return "no collectives"
  parts = []
  for u in sorted(rows, key=lambda r: -r["bytes"])[:top]:
    over = "×".join(u["axes"]) or "one device"
    kind = u["kind"] + (" (sliced: a reduce-scatter run as an all-reduce)" if u.get("sliced_bytes") else "")
    parts.append(f"{kind} over {over} {format_bytes(u['bytes'])}" + (" in the layer loop" if u["in_loop"] else ""))
  more = len(rows) - top
  return "; ".join(parts) + (f"; {more} more" if more > 0 else "")


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
  name, header, computations = _parse_text(text)
  entries = [c.name for c in computations if c.is_entry]
  if len(entries) != 1:
    raise HloParseError(f"HLO module {name!r} has {len(entries)} ENTRY computations; a compiled program has one")
  by_name = _with_trip_counts({c.name: c for c in computations})
  return HloModule(name=name, attributes=header, computations=by_name, entry=entries[0],
                   num_partitions=_int_literal(header.get("num_partitions")) or 1,
                   replica_count=_int_literal(header.get("replica_count")) or 1)


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
