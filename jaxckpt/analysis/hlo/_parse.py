"""HLO text read into typed records: a compiled program's computations, their instructions with shapes and
attributes, replica groups as device ids, and the source tables (file, function and line of each stack frame).

The grammar is XLA's HLO text printer (``xla/hlo/ir/hlo_instruction.cc``, ``ToString``) and parser
(``xla/hlo/parser/hlo_parser.cc``), as ``compiled.as_text()`` and XLA's dumps (``*after_optimizations.txt``) write
it for XLA:CPU, the TPU compiler and the GPU compiler (``docs/hlo-reading.md``). Memory spaces: ``S(5)`` in a layout
is host memory (TPU and GPU); TPU also places small arrays in ``S(1)`` (on-chip VMEM).

What a program does with the records (runs per step, FLOPs, bytes, collectives, host transfers) is read by
:mod:`jaxckpt.analysis.hlo._module` and its neighbours; this module only reads the text.
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

from jaxckpt.errors import JaxckptError, shorten

HOST_MEMORY_SPACE = 5
"""The memory space XLA gives host memory (``S(5)`` in a layout; ``Layout::kHostMemorySpace``): a buffer there lives in
the host's (pinned) memory, not the device's."""


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


def leaves(shape: HloShape) -> Iterator[ArrayShape]:
  """The arrays of a (possibly nested tuple) shape, in order."""
  if isinstance(shape, ArrayShape):
    yield shape
  else:
    for element in shape:
      yield from leaves(element)


def shape_bytes(shape: HloShape) -> int:
  """Bytes of a (possibly nested tuple) shape: every array's summed."""
  return sum(a.nbytes for a in leaves(shape))


def first_array(shape: HloShape) -> ArrayShape | None:
  """The first array of a shape (``None`` for an empty tuple)."""
  return next(leaves(shape), None)


def format_shape(shape: HloShape, index: tuple[int, ...] = ()) -> str:
  """A shape as the text writes it, without layouts: ``f32[8,16]``, ``(f32[8], s32[])``.

  Args:
    shape: an instruction's result.
    index: the element of a tuple result to write (a buffer's ``{1}`` is ``(1,)``, ``{1,0}`` is ``(1, 0)``); ``()``
      for the whole result, and the whole result too where the index does not fit its shape.
  """
  element = shape
  for i in index:
    if isinstance(element, ArrayShape) or not 0 <= i < len(element):
      return format_shape(shape)
    element = element[i]
  shape = element
  if isinstance(shape, ArrayShape):
    return f"{shape.dtype}[{','.join(map(str, shape.dims))}]"
  return "(" + ", ".join(format_shape(s) for s in shape) + ")"


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
  source: str | None = None  # metadata source_file:source_line ("model.py:42"), the JAX line that made it, if written
  stack_frame_id: int | None = None  # metadata stack_frame_id: its frame in the module's tables (HloText.frames)
  channel_id: int | None = None  # channel_id of a collective (an async pair and its fused copies share it)
  trip_count: int | None = None  # while: iterations per run, from trip_count_source; None if unknown
  trip_count_source: str | None = None  # while: "backend_config" (CPU, GPU) or "derived" (from the loop), else None

  @property
  def output_bytes(self) -> int:
    """Bytes of the result, every array of a tuple summed."""
    return shape_bytes(self.shape)

  @property
  def arrays(self) -> tuple[ArrayShape, ...]:
    """The arrays of the result in order (one for an array result; a tuple's flattened)."""
    return tuple(leaves(self.shape))

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
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)" source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_COMPUTATION_HEAD = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")


_COMMA = re.compile(r'\\.|["(){}\[\],]')
"""A comma, or a bracket or quote that opens or closes a nested part (:func:`_split_top` of a plain list)."""
_BRACKET = re.compile(r'\\.|["(){}\[\]]')


def _outside_strings(pattern: re.Pattern[str], text: str, start: int = 0) -> Iterator[re.Match[str]]:
  """The matches of ``pattern`` (which matches escapes, ``"`` and what the caller wants) in ``text`` from ``start``
  that lie outside string literals; escapes and the quotes themselves are not yielded."""
  in_string = False
  for m in pattern.finditer(text, start):
    token = m.group()
    if token[0] == "\\":
      continue
    if token == '"':
      in_string = not in_string
    elif not in_string:
      yield m


def _split_top(text: str, *, attributes: bool) -> list[str]:
  """``text`` split at top-level separators (outside brackets and strings): at ``, key=`` (attributes) or commas."""
  parts, depth, start = [], 0, 0
  for m in _outside_strings(_TOKEN if attributes else _COMMA, text):
    token = m.group()
    if token in "({[":
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
  depth = 0
  for m in _outside_strings(_BRACKET, text, start):
    if m.group() in "({[":
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
  metadata = attributes.get("metadata", "")
  op_name, source, frame = _OP_NAME.search(metadata), _SOURCE.search(metadata), _FRAME.search(metadata)
  channel = attributes.get("channel_id")
  return HloInstruction(
      name=head.group(2).lstrip("%"), opcode=opcode, shape=shape, operands=operands, computation=computation,
      is_root=bool(head.group(1)), calls=calls, attributes=attributes, literal=literal,
      fusion_kind=attributes.get("kind") if "fusion" in opcode else None,
      custom_call_target=json.loads(target) if target and target.startswith('"') else target,
      backend_config=_backend_config(attributes.get("backend_config")),
      op_name=op_name.group(1) if op_name else None, channel_id=int(channel) if channel else None,
      source=f"{source.group(1)}:{source.group(2)}" if source else None,
      stack_frame_id=int(frame.group(1)) if frame else None)


_COMPUTATION_END = re.compile(r"\}(\s*,\s*\w+=.*)?$")
"""A computation's closing line: ``}``, or ``}, execution_thread="sparsecore"`` (the TPU compiler's computations on
another execution thread, e.g. an MoE step's SparseCore work)."""


def _opened(line: str) -> int:
  """Brackets a line opens and does not close (``{`` and ``(``): > 0 where an instruction goes on to the next line
  (the TPU compiler prints a Pallas kernel's ``frontend_attributes={kernel_metadata={`` with newlines inside)."""
  return line.count("{") - line.count("}") + line.count("(") - line.count(")")


class HloText(NamedTuple):
  """What an HLO text holds before any reading of what it does (:func:`parse_text`)."""

  name: str  # the module's name ("jit_train_step")
  header: Mapping[str, str]  # the HloModule line's "key=value" fields, raw
  computations: tuple[HloComputation, ...]  # in text order
  frames: Mapping[int, str]  # stack frame id -> "file:line (function)" of the JAX source (the text's tables)


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
"""The source tables XLA prints after the module line (``StackFrameIndex``): each a title line, then ``<id> <value>``
lines."""
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


def _field(value: str | None, name: str) -> int | None:
  m = re.search(rf"\b{name}=(\d+)", value or "")
  return int(m.group(1)) if m else None


def _frames(tables: Mapping[str, Mapping[int, str]]) -> dict[int, str]:
  """Stack frame id -> ``file:line (function)`` of its location (frames whose location the tables lack left out)."""
  out = {}
  for frame_id, frame in tables["StackFrames"].items():
    location = tables["FileLocations"].get(_field(frame, "file_location_id"))
    if location is None:
      continue
    file = tables["FileNames"].get(_field(location, "file_name_id"), "?").strip('"')
    function = tables["FunctionNames"].get(_field(location, "function_name_id"), "?").strip('"')
    out[frame_id] = f"{file}:{_field(location, 'line')} ({function})"
  return out


def parse_text(text: str) -> HloText:
  """The module name, header, computations and source tables of an HLO text.

  Raises:
    HloParseError: no ``HloModule`` line, a computation without its closing ``}``, or a line it cannot read.
  """
  name, header, computations = None, {}, []
  tables: dict[str, dict[int, str]] = {t: {} for t in _TABLES}
  section = None  # the source table being read
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
      continue
    stripped = line.strip()
    if stripped in tables:
      section = stripped
      continue
    if section and (row := _TABLE_ROW.match(stripped)):
      tables[section][int(row.group(1))] = row.group(2)
      continue
    section = None
    if line.startswith("HloModule "):
      first, _, rest = line[len("HloModule "):].partition(",")
      name, header = first.strip(), _attributes(rest)
    elif line and not line[0].isspace() and (m := _COMPUTATION_HEAD.match(line)):
      current = (m.group(2), bool(m.group(1)), [])
  if name is None:
    raise HloParseError(f"no 'HloModule' line in the text (starts {shorten(text.strip(), 80)!r}): pass "
                        "compiled.as_text() of a jax.stages.Compiled")
  if current is not None:
    raise HloParseError(f"computation {current[0]!r} has no closing '}}': the HLO text is cut short")
  return HloText(name, header, tuple(computations), _frames(tables))


# --- replica groups -----------------------------------------------------------------------------------------------

_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH = re.compile(r"@?mesh\s*[\[<](?P<axes>[^\]>]*)[\]>]\s*(?:,\s*device_ids=\((?P<ids>.*)\))?\s*\{(?P<over>[^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?\s*=\s*(\d+)")
_OVER_AXIS = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


def ints(text: str) -> list[int]:
  """Every integer in a piece of text, in order."""
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
    reshape = ints(iota.group(1))
    devices = _iota([math.prod(reshape)], reshape, ints(iota.group(2)) if iota.group(2) else None)
  else:
    devices = np.array(ints(ids_text))
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
    return tuple(tuple(ints(g)) for g in groups)
  if (m := _IOTA.fullmatch(text)):
    table = _iota(ints(m.group(1)), ints(m.group(2)), ints(m.group(3)) if m.group(3) else None)
    return tuple(tuple(int(d) for d in row) for row in table)
  if (m := _MESH.fullmatch(text)):
    return tuple(tuple(int(d) for d in row) for row in _mesh_groups(m))
  raise HloParseError(f"unknown replica group form {shorten(text)!r}: known forms are {{{{0,1}},{{2,3}}}}, "
                      "[2,4]<=[8] (iota, optionally T(perm)) and mesh['a'=2,'b'=4] {'b'}")


# --- what an instruction runs -------------------------------------------------------------------------------------


def int_literal(text: str | None) -> int | None:
  """An integer written in the text (a constant's value, a parameter's number), or None."""
  try:
    return int(text) if text is not None else None
  except ValueError:
    return None


RUNS_BODY = frozenset({"fusion", "fusion-start", "async-start"})
"""Instructions whose called computation is part of their own run (not an execution of its own)."""


def called_instructions(computations: Mapping[str, HloComputation], ins: HloInstruction) -> Iterator[HloInstruction]:
  """The instructions of the computation a fusion / async start runs, nested fusions' too."""
  called = computations.get(ins.called) if ins.called else None
  if called is None:
    return
  for inner in called.instructions:
    yield inner
    if inner.opcode == "fusion":
      yield from called_instructions(computations, inner)


def async_output(ins: HloInstruction) -> HloShape:
  """What an async ``-start`` writes: its result's element 1 (XLA's ``((operands), output, context)``), element 0 for
  copy-start (``(destination, source, context)``), the whole result where it is not a tuple (all-reduce-start)."""
  if isinstance(ins.shape, ArrayShape) or len(ins.shape) < 2:
    return ins.shape
  return ins.shape[0] if ins.opcode == "copy-start" else ins.shape[1]
