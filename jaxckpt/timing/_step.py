"""The step's time read from the compiled program: per op where the compiler gives a cost, a roofline per op where it
does not, collectives over the links their replica groups cross, host transfers over the host link, overlap as the
schedule allows it (:mod:`._ops`, :mod:`._links`, :mod:`._schedule`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from jax.sharding import Mesh

from jaxckpt._units import format_seconds
from jaxckpt.analysis.hlo import HloModule, parse_hlo
from jaxckpt.errors import JaxckptError, closest
from jaxckpt.sharding import CHIPS, Chip, Topology, get_topology
from jaxckpt.timing._gpu import collective_contention, gpu_basis
from jaxckpt.timing._links import RING_EFFICIENCY, Links, links_for
from jaxckpt.timing._ops import ATTENTION, FREE, attention_call, op_costs
from jaxckpt.timing._schedule import OVERLAP_RULES, is_async_term, replay, with_trip_counts

RESOLUTION = 0.04
"""The smallest relative difference of two estimated step times of one model that the estimate orders, 4%: the
spread of its errors among one model's published configurations (docs/timing.md: Llama 3.1 8B's three Trillium rows
−0.2% to −4.1%, 3.9 points; Llama 3.1 70B's four +6.7% to +8.4%, 1.7 points). Two configurations closer than this
are a tie to the estimate; the fit says so (:func:`within_resolution`)."""


def within_resolution(seconds: float, best: float) -> float | None:
  """How much slower ``seconds`` is than ``best`` (a fraction, ≥ 0) when it is within :data:`RESOLUTION` of it, else
  ``None``: the fit's note on configurations the estimate cannot order.

  Args:
    seconds: an estimated step time (s), ≥ ``best``.
    best: the fastest estimate (s), > 0.
  """
  over = seconds / best - 1
  return over if over <= RESOLUTION else None


class OpTime(NamedTuple):
  """One executed instruction's share of the step (:attr:`StepTime.ops`)."""

  name: str  # the instruction ("fusion.12", "all-gather-start.3")
  opcode: str
  computation: str  # the computation it is in (the entry, a loop body, ...)
  count: int  # runs per step (loop bodies × trip counts)
  term: str  # compute, memory, collectives:<link>, host:to_host, host:to_device, copies, custom_calls
  source: str  # how its seconds were found: cycles, roofline, links, host_link, cost_estimate, bytes
  seconds: float  # per run
  flops: float  # per run
  bytes: float  # per run (read + written; a collective's or transfer's payload)
  op_name: str | None  # the jaxpr path of the op (``metadata op_name``), where the compiler kept it

  @property
  def total_seconds(self) -> float:
    """``seconds * count``: its busy seconds per step."""
    return self.seconds * self.count


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The estimated time of one step of a compiled program on one device (:func:`estimate_step_time`).

  Attributes:
    seconds: the step's seconds under :attr:`overlap`.
    terms: busy seconds per step per term: ``compute`` (kernels whose FLOPs take longer than their bytes),
      ``memory`` (kernels bound by HBM bytes), ``custom_calls`` (Pallas, cuDNN, ...), ``collectives:<link>`` (``ici``,
      ``nvlink``, ``network``), ``host:to_host`` / ``host:to_device`` (offload copies), ``copies`` (async copies
      inside the device); only terms with work are listed.
    exposed: per asynchronous term, the seconds the core waited for it (its part of :attr:`seconds` not hidden
      behind other work); under ``serial`` its whole busy time, under ``full`` nothing.
    overlap: the overlap rule (a key of :data:`jaxckpt.timing.OVERLAP_RULES`).
    bound: the term with the most busy seconds: what bounds the step.
    chip: the chip's name.
    sources: busy seconds per step by how they were found (``cycles``: the TPU compiler's estimate; ``roofline``;
      ``links``; ``host_link``; ``cost_estimate``; ``bytes``).
    flops: dot and convolution FLOPs per step (loops × trip counts), kernels' cost estimates included.
    ops: every executed instruction that takes time, the longest per step first.
    basis: what the estimate rests on, one line per kind of work (a GPU's kernel rates and link figures with their
      sources in :mod:`jaxckpt.timing._gpu` and :mod:`jaxckpt.timing._links`; a TPU's clock): the figures to hold
      against a measured step.
  """

  seconds: float
  terms: Mapping[str, float]
  exposed: Mapping[str, float]
  overlap: str
  bound: str
  chip: str
  sources: Mapping[str, float]
  flops: float
  ops: tuple[OpTime, ...] = ()
  basis: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def top(self, n: int = 10, *, term: str | None = None) -> list[OpTime]:
    """The ``n`` instructions with the most busy seconds per step (of one ``term``, or all)."""
    return [o for o in self.ops if term is None or o.term == term][:n]

  def as_dict(self, *, ops: int = 0) -> dict[str, Any]:
    """The JSON form (the ``ops`` longest instructions included)."""
    out = {k: v for k, v in dataclasses.asdict(self).items() if k != "ops"}
    out["ops"] = [{**o._asdict(), "total_seconds": o.total_seconds} for o in self.ops[:ops]]
    return out


def _chip(chip: Chip | str) -> Chip:
  if isinstance(chip, Chip):
    return chip
  key = str(chip).lower()
  if key not in CHIPS:
    hint = closest(key, CHIPS)
    raise JaxckptError(f"chip={chip!r} is not in the chip table; valid: {', '.join(CHIPS)}"
                       + (f" (did you mean {hint!r}?)" if hint else ""))
  return CHIPS[key]


def estimate_step_time(program: HloModule | str, chip: Chip | str, *, links: Links | None = None,
                       overlap: str = "schedule", trip_counts: Mapping[str, int] | None = None,
                       kernel_flops: Mapping[str, float] | None = None) -> StepTime:
  """Estimates one step of a compiled program on one device, read from the program itself.

  Per executed instruction (every loop body times its trip count): the TPU compiler's ``estimated_cycles`` over the
  chip's clock where it gives one; else a roofline of that instruction alone (its dot FLOPs at the chip's peak times
  the matmul's shape efficiency, its bytes at HBM bandwidth); a collective's bytes over the links its replica group
  crosses; a host transfer's bytes over the host link; a custom call's cost estimate. Then the schedule is replayed
  with the asynchronous work beside the core (:data:`OVERLAP_RULES`). Rules and sources: ``docs/timing.md``.

  Args:
    program: the compiled program: an :class:`~jaxckpt.analysis.HloModule` or its HLO text
      (``compiled.as_text()``).
    chip: the chip it runs on: a :class:`~jaxckpt.sharding.Chip` or its key in :data:`jaxckpt.sharding.CHIPS`
      (``"v6e"``, ``"h100"``).
    links: where the program's devices sit (:func:`links_for` of its topology and mesh); required when the program
      spans several devices, ``None`` for one device.
    overlap: ``"schedule"`` (default), ``"serial"`` or ``"full"`` (:data:`OVERLAP_RULES`).
    trip_counts: iterations per while loop by instruction name, overriding the program's (:func:`layer_trip_counts`:
      a program compiled with fewer layers, timed at its real depth).
    kernel_flops: FLOPs per run of custom-call kernels without a cost estimate, by instruction name.

  Returns:
    The :class:`StepTime`: seconds, busy seconds per term, exposed seconds, the bound, per-op detail.

  Raises:
    JaxckptError: an unknown chip or overlap rule, a program over several devices without ``links``, a
      ``trip_counts`` name that is no loop.
    HloParseError: ``program`` is text this reader cannot read.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda a, b: a @ b)
    >>> text = f.lower(jnp.ones((4096, 4096)), jnp.ones((4096, 4096))).compile().as_text()
    >>> estimate_step_time(text, "h100").terms["compute"]  # 2·4096³ FLOPs at 989 TFLOP/s, every tile in one wave
    0.000138...
  """
  if overlap not in OVERLAP_RULES:
    raise JaxckptError(f"overlap={overlap!r} is not a rule; valid: {', '.join(OVERLAP_RULES)}")
  chip = _chip(chip)
  module = parse_hlo(program) if isinstance(program, str) else program
  if links is None and module.num_devices > 1:
    raise JaxckptError(f"the program spans {module.num_devices} devices: give links=links_for(topology, mesh) (the "
                       "topology and mesh it was compiled for), so its collectives are timed over their links")
  module = with_trip_counts(module, trip_counts or {})
  costs = op_costs(module, chip, links, kernel_flops=kernel_flops)
  terms: dict[str, float] = {}
  sources: dict[str, float] = {}
  flops = 0.0
  ops: dict[str, OpTime] = {}
  for run in module.executions():
    ins = run.instruction
    cost = costs[ins.name]
    if cost.term == FREE:
      continue
    busy = cost.seconds * run.count
    terms[cost.term] = terms.get(cost.term, 0.0) + busy
    sources[cost.source] = sources.get(cost.source, 0.0) + busy
    flops += cost.flops * run.count
    if ins.name in ops:
      ops[ins.name] = ops[ins.name]._replace(count=ops[ins.name].count + run.count)
    else:
      ops[ins.name] = OpTime(ins.name, ins.opcode, ins.computation, run.count, cost.term, cost.source, cost.seconds,
                             cost.flops, cost.bytes, ins.op_name)
  result = replay(module, costs, rule=overlap, contention=collective_contention(chip) if chip.is_gpu else 1.0)
  bound = max(terms, key=terms.get) if terms else ""
  seconds = result.seconds
  if terms:  # overlap never makes a step shorter than any one term's work (a guard on the replay's arithmetic)
    core = sum(v for k, v in terms.items() if not is_async_term(k))
    seconds = max(seconds, core if overlap != "full" else 0.0, max(terms.values()))
  return StepTime(seconds=seconds, terms=dict(sorted(terms.items(), key=lambda kv: -kv[1])),
                  exposed={k: v for k, v in sorted(result.exposed.items(), key=lambda kv: -kv[1]) if v > 0},
                  overlap=overlap, bound=bound, chip=chip.name, sources=sources, flops=flops,
                  ops=tuple(sorted(ops.values(), key=lambda o: -o.total_seconds)),
                  basis=_basis(module, chip, links, ops))


def _basis(module: HloModule, chip: Chip, links: Links | None, ops: Mapping[str, OpTime]) -> dict[str, str]:
  """:attr:`StepTime.basis`: the figures the estimate used."""
  if not chip.is_gpu:
    out = {}
    if chip.clock_hz:
      out["kernels"] = f"the TPU compiler's estimated_cycles at {chip.clock_hz / 1e9:.2f} GHz"
    if chip.ici_link_bandwidth:
      out["ici"] = f"{chip.ici_link_bandwidth / 1e9:,.0f} GB/s per link per direction"
    return out
  attention: dict[tuple[str, str], int] = {}
  for op in ops.values():
    if op.term == ATTENTION:
      found = attention_call(module, module.instructions[op.name])
      if found is not None:
        attention[(found[0], found[1])] = found[2][1]
  nvlink = links.nvlink * RING_EFFICIENCY if links is not None else 0.0
  network = links.network * RING_EFFICIENCY if links is not None and links.torus and links.torus[0] > 1 else 0.0
  key = next((k for k, c in CHIPS.items() if c == chip), None)
  return gpu_basis(chip, key, nvlink=nvlink, network=network, attention=attention)


def layer_trip_counts(module: HloModule, compiled_layers: int, layers: int) -> dict[str, int]:
  """Trip counts that time a scanned stack compiled with ``compiled_layers`` layers at ``layers``.

  A scanned decoder compiles to while loops over its layers (the forward pass, the backward pass), each running
  ``compiled_layers`` times, or fewer where the compiler peeled an iteration out of the loop (the TPU compiler runs
  the first forward and last backward iteration outside it: a loop of ``compiled_layers − 1``). The loop body is the
  same at any depth, so the step at ``layers`` runs each such loop ``layers − compiled_layers`` more times. A loop
  counts as a layer loop when its trip count is ``compiled_layers``, ``compiled_layers − 1`` or ``compiled_layers −
  2``: compile with a depth no other loop of the step runs (the benchmark checks the result against a compile at
  another depth, docs/timing.md).

  Args:
    module: the program compiled with ``compiled_layers`` layers.
    compiled_layers: its layers (≥ 3, so a peeled loop is still a loop).
    layers: the real depth (≥ ``compiled_layers``).

  Returns:
    ``{while instruction: trip count}`` for :func:`estimate_step_time`'s ``trip_counts``.

  Raises:
    JaxckptError: ``compiled_layers`` < 3, ``layers`` < ``compiled_layers``, or no loop with a layer trip count.
  """
  if compiled_layers < 3 or layers < compiled_layers:
    raise JaxckptError(f"compiled_layers={compiled_layers}, layers={layers}: compile at least 3 layers (a peeled "
                       "loop keeps 1) and time at that depth or more")
  near = {compiled_layers, compiled_layers - 1, compiled_layers - 2}
  out = {w.name: w.trip_count + layers - compiled_layers for w in module.while_loops if w.trip_count in near}
  if not out:
    raise JaxckptError(f"no while loop of {module.name} runs {compiled_layers} (or a peeled {compiled_layers - 1}, "
                       f"{compiled_layers - 2}) times; its loops: "
                       f"{', '.join(f'{w.name}×{w.trip_count}' for w in module.while_loops) or 'none'}")
  return out


def describe_step_time(estimate: StepTime | Mapping[str, Any], *, terms: int = 3) -> str:
  """One line of an estimate: its seconds, the term that bounds it and its ``terms`` largest terms' busy seconds,
  exposed seconds in brackets, e.g. ``2.31 s, bound by compute (compute 2.05 s, collectives:ici 620 ms [120 ms
  exposed])``.

  Args:
    estimate: a :class:`StepTime` or its :meth:`StepTime.as_dict` (a report row's ``step_time_estimate``, a fit
      candidate's ``compiled_step``).
    terms: how many terms to name.
  """
  est = estimate.as_dict() if isinstance(estimate, StepTime) else estimate
  parts = []
  for name, busy in sorted(est["terms"].items(), key=lambda kv: -kv[1])[:terms]:
    exposed = est["exposed"].get(name)
    parts.append(f"{name} {format_seconds(busy)}" + (f" [{format_seconds(exposed)} exposed]" if exposed else ""))
  return f"{format_seconds(est['seconds'])}, bound by {est['bound']} ({', '.join(parts)})"


def step_time_of(compiled: Any, *, topology: Topology | str | None = None, mesh: Mesh | None = None,
                 chip: Chip | str | None = None, **kwargs: Any) -> StepTime:
  """:func:`estimate_step_time` of a compiled step: a :class:`jaxckpt.step.CompiledPolicy` (its program text, also
  when served from the compiled-stats cache, :meth:`~jaxckpt.step.CompiledPolicy.hlo_text`), a
  ``jax.stages.Compiled``, or its program already read (:class:`~jaxckpt.analysis.HloModule`).

  Args:
    compiled: the compiled step.
    topology: the TPU slice or GPU cluster it was compiled for (a name or :class:`~jaxckpt.sharding.Topology`); its
      chip is the chip, ``mesh`` gives the links.
    mesh: the ``jax.sharding.Mesh`` it was sharded over (with ``topology``), or ``None`` for one device.
    chip: the chip without a topology (one device), e.g. ``"h100"``.
    **kwargs: :func:`estimate_step_time`'s ``overlap``, ``trip_counts``, ``kernel_flops``.

  Raises:
    JaxckptError: neither ``topology`` nor ``chip``; a ``mesh`` without ``topology``; what
      :func:`estimate_step_time` raises.
  """
  if isinstance(compiled, HloModule):
    text = compiled
  else:
    text = compiled.hlo_text() if hasattr(compiled, "hlo_text") else compiled.as_text()
  links = None
  if topology is not None:
    topology = get_topology(topology)
    chip = topology.chip
    if mesh is not None:
      links = links_for(topology, mesh)
  elif mesh is not None:
    raise JaxckptError("mesh= needs topology= (the slice or cluster whose devices it is over)")
  if chip is None:
    raise JaxckptError("step_time_of needs topology= (a compiled topology step) or chip= (one device, e.g. 'h100')")
  return estimate_step_time(text, chip, links=links, **kwargs)
