"""The collectives of a compiled program: each collective instruction's kind, payload and replica groups (device ids),
and what a step sends over which mesh axes.

What the compilers write (measured with jax 0.10.2, libtpu 0.0.42.1, jax-cuda12-plugin 0.10.2; ``docs/hlo-reading.md``):
GPU writes ``all-gather-start``/``-done`` pairs (``collective_backend_config.is_sync``); TPU writes plain
``all-gather``, or puts a collective in fusions (async collective fusions: the same ``channel_id`` in a start fusion,
a fusion overlapping it with compute, and a done fusion; a reduce-scatter as an ``all-reduce`` followed by a
``dynamic-slice`` in one fusion). An all-reduce whose results are only sliced afterwards is a reduction to each
device's shard that the compiler runs as an all-reduce (XLA:CPU, which has no reduce-scatter; the TPU compiler for
small shards): its bytes are marked ``sliced``. Each collective is counted once per run of the computation it is in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxckpt._units import format_bytes
from jaxckpt.analysis.hlo._parse import (RUNS_BODY, HloComputation, HloInstruction, HloParseError,
                                         called_instructions, replica_groups)

COLLECTIVE_KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                                     "collective-broadcast", "ragged-all-to-all")
"""The collective opcodes (each also as an async ``-start``/``-done`` pair), the values of :attr:`Collective.kind`."""


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


def _sliced_bytes(computations: Mapping[str, HloComputation], comp: HloComputation, ins: HloInstruction) -> int:
  """Bytes per run of an all-reduce's results that are only sliced afterwards (:func:`_only_sliced`): a reduction to
  each device's shard that the compiler runs as an all-reduce (XLA:CPU, which has no reduce-scatter; the TPU
  compiler for small shards, the slice fused into the gradient's update). A tuple all-reduce counts per element."""
  done = next((u for u in comp.users.get(ins.name, ()) if u.opcode.endswith("-done")), None)
  result = done if done is not None else ins
  if not isinstance(result.shape, tuple):
    return result.output_bytes if _only_sliced(computations, comp, result) else 0
  total = 0
  for user in comp.users.get(result.name, ()):
    if user.opcode == "get-tuple-element" and _only_sliced(computations, comp, user):
      total += user.output_bytes
  return total


def _is_sync(ins: HloInstruction) -> bool:
  config = (ins.backend_config or {}).get("collective_backend_config")
  return isinstance(config, Mapping) and bool(config.get("is_sync"))


def collective_of(computations: Mapping[str, HloComputation], num_devices: int, ins: HloInstruction, *,
                  unit: HloInstruction, count: int, fused_async: bool) -> Collective:
  """The :class:`Collective` of one collective instruction of a program of ``num_devices`` devices (``unit``, the
  executed instruction holding it, runs it ``count`` times per step; ``fused_async``: in a TPU async collective
  fusion)."""
  comp = computations[ins.computation]
  kind = _collective_kind(ins.opcode)
  if kind == "all-reduce" and _scatters(comp, ins):
    kind = "reduce-scatter"
  operands = [comp.by_name[op].output_bytes for op in ins.operands if op in comp.by_name]
  if kind == "collective-permute":
    groups = replica_groups(ins.attributes.get("source_target_pairs", "{}"), num_devices=num_devices)
    size = 2
  else:
    groups = replica_groups(ins.attributes.get("replica_groups", "{}"), num_devices=num_devices)
    size = len(groups[0]) if groups else 1
  if kind in ("collective-permute", "ragged-all-to-all"):
    payload = operands[0] if operands else 0
  elif kind == "all-gather":
    payload = sum(operands) * size
  else:
    payload = sum(operands)
  is_async = (ins.opcode.endswith("-start") and not _is_sync(ins)) or fused_async
  sliced = _sliced_bytes(computations, comp, ins) if kind == "all-reduce" else 0
  return Collective(kind, ins, unit.name, payload, groups, size, is_async, count, sliced_bytes=min(sliced, payload))


def unit_collectives(computations: Mapping[str, HloComputation],
                     ins: HloInstruction) -> Iterator[tuple[HloInstruction, bool]]:
  """``(collective instruction, in an async collective fusion)`` run by one executed instruction."""
  if _collective_kind(ins.opcode) is not None:
    yield ins, False
  elif ins.opcode in RUNS_BODY:
    inner = list(called_instructions(computations, ins))
    fused_async = ins.opcode == "async-start" or any((i.custom_call_target or "").startswith("AsyncCollective")
                                                    for i in inner)
    yield from ((i, fused_async) for i in inner if _collective_kind(i.opcode) is not None)


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


def uses_by_axis(collectives: Sequence[Collective], num_devices: int,
                 mesh: Mapping[str, int]) -> tuple[CollectiveUse, ...]:
  """:func:`jaxckpt.analysis.collectives_by_axis` of a program's collectives (``num_devices`` devices)."""
  if math.prod(int(n) for n in mesh.values()) != num_devices:
    raise HloParseError(f"the program spans {num_devices} devices, the mesh {dict(mesh)} "
                        f"{math.prod(int(n) for n in mesh.values())}: read it with the mesh it was compiled for")
  rows: dict[tuple[str, tuple[str, ...], bool], list[Collective]] = {}
  for c in collectives:
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
