"""Overlap as the compiled schedule allows it: the program's instructions replayed in their scheduled order on the
core, with every asynchronous operation on a stream of its own.

A compiled TPU or GPU program is scheduled (``is_scheduled=true``): each computation lists its instructions in the
order they run. The core runs them one after another; an asynchronous operation (a collective's ``-start``, a TPU
async collective fusion, a copy to or from host memory, a prefetch into on-chip memory) is handed to its engine at
its start and waited for at its ``-done``. :func:`replay` follows exactly that:

- an instruction on the core advances the core's clock by its seconds (:mod:`._ops`); on a GPU, while a collective
  is in flight, at the speed the SMs NCCL leaves it (:func:`jaxckpt.timing._gpu.collective_contention`);
- an async start queues its transfer on its resource (one per term: the ICI links, NVLink, the network, each
  direction of the host link, the copy engine), which runs one transfer at a time: it begins when the core reaches
  the start and the resource is free, and takes its seconds;
- a ``-done`` (or a TPU async collective's done fusion) makes the core wait until its transfer has ended; the wait is
  that term's *exposed* seconds;
- a ``while`` runs its condition and body ``trip_count`` times (the condition once more), carrying the streams from
  one iteration to the next, so a transfer started in one iteration and waited for in the next (a pipelined
  collective) overlaps the work between; after three iterations the rest are taken at the third's duration;
- a ``call`` runs its computation; a ``conditional`` its longest branch;
- at the end the program waits for every transfer still running.

So the step's time is never less than the core's work, nor than any one resource's work (each resource runs its
transfers one at a time and the program waits for them all): overlap hides a term behind others, never below its
own length. Two other rules are kept for comparison (:data:`OVERLAP_RULES`): ``"serial"`` (nothing overlaps: the
sum of every term) and ``"full"`` (everything overlaps: the largest term, the roofline of jaxckpt's fit planner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxckpt.analysis.hlo import HloComputation, HloInstruction, HloModule
from jaxckpt.errors import JaxckptError
from jaxckpt.timing._ops import FREE, OpCost

OVERLAP_RULES: dict[str, str] = {
    "schedule": "the compiled schedule replayed: async operations overlap the core's work between their start and "
                "done; each resource runs one transfer at a time",
    "serial": "nothing overlaps: the sum of every term",
    "full": "everything overlaps: the largest term",
}
"""The overlap rules :func:`jaxckpt.timing.estimate_step_time` takes, with what each means."""

_EXPLICIT_ITERATIONS = 3


@dataclasses.dataclass
class _State:
  now: float = 0.0
  free: dict[str, float] = dataclasses.field(default_factory=dict)  # resource -> when it is free
  pending: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)  # start -> (end, term)
  exposed: dict[str, float] = dataclasses.field(default_factory=dict)  # term -> seconds the core waited
  contention: float = 1.0  # the core's slowdown while a collective is in flight (replay's contention)

  def copy(self) -> _State:
    return _State(self.now, dict(self.free), dict(self.pending), dict(self.exposed), self.contention)

  def work(self, seconds: float) -> None:
    """Advances the core by ``seconds`` of work, at ``1 / contention`` of its speed while collectives run."""
    if self.contention > 1.0:
      busy_until = max((end for end, term in self.pending.values() if term.startswith("collectives")), default=0.0)
      if busy_until > self.now:
        slowed = (busy_until - self.now) / self.contention  # work done before the last collective ends
        if seconds <= slowed:
          self.now += seconds * self.contention
          return
        self.now = busy_until
        seconds -= slowed
    self.now += seconds

  def shift(self, since: float, delta: float) -> None:
    """Moves every stream event after ``since`` later by ``delta`` (iterations not replayed one by one)."""
    self.now += delta
    self.free = {k: v + delta if v > since else v for k, v in self.free.items()}
    self.pending = {k: (end + delta if end > since else end, term) for k, (end, term) in self.pending.items()}


@dataclasses.dataclass(frozen=True)
class Replay:
  """The replayed step (:func:`replay`).

  Attributes:
    seconds: the step's seconds under the rule.
    exposed: per async term, seconds the core waited for it (``schedule``; ``serial``: its whole busy time).
  """

  seconds: float
  exposed: Mapping[str, float]


def async_pairs(module: HloModule, costs: Mapping[str, OpCost]) -> dict[str, str]:
  """``{done instruction: its start}``: every ``-done`` and its operand, and each TPU async collective's later
  fusions (``AsyncCollectiveDone``, the same ``channel_id``) and the fusion that started it."""
  out: dict[str, str] = {}
  started: dict[tuple[str, int], str] = {}
  for comp in module.computations.values():
    for ins in comp.instructions:
      if ins.opcode.endswith("-done") and ins.operands:
        out[ins.name] = ins.operands[0]
      elif ins.opcode == "fusion":
        channels = _channels(module, ins)
        for channel in channels:
          key = (comp.name, channel)
          if key in started and started[key] != ins.name:
            cost = costs.get(started[key])
            if cost is not None and cost.is_async and _finishes(module, ins):
              out[ins.name] = started[key]
          elif key not in started and costs.get(ins.name) is not None and costs[ins.name].is_async:
            started[key] = ins.name
  return out


def _channels(module: HloModule, fusion: HloInstruction) -> list[int]:
  called = module.computations.get(fusion.called) if fusion.called else None
  if called is None:
    return []
  return [i.channel_id for i in called.instructions if i.channel_id is not None]


def _finishes(module: HloModule, fusion: HloInstruction) -> bool:
  """A TPU async collective fusion that completes the collective (holds ``AsyncCollectiveDone``)."""
  called = module.computations.get(fusion.called) if fusion.called else None
  return called is not None and any(i.custom_call_target == "AsyncCollectiveDone" for i in called.instructions)


def with_trip_counts(module: HloModule, trip_counts: Mapping[str, int]) -> HloModule:
  """``module`` with the while loops named in ``trip_counts`` running that many iterations
  (:attr:`~jaxckpt.analysis.HloInstruction.trip_count`, source ``"given"``): a program compiled with fewer layers
  timed at its real depth.

  Raises:
    JaxckptError: a name that is no while loop of the module (the valid ones listed), or a count < 0.
  """
  loops = {w.name for w in module.while_loops}
  unknown = sorted(set(trip_counts) - loops)
  if unknown:
    raise JaxckptError(f"trip_counts names {', '.join(unknown)}, not a while loop of {module.name}; its loops: "
                       f"{', '.join(sorted(loops)) or 'none'}")
  bad = {k: v for k, v in trip_counts.items() if v < 0}
  if bad:
    raise JaxckptError(f"trip_counts={bad}: a loop runs 0 or more iterations")
  if not trip_counts:
    return module
  computations = {}
  for name, comp in module.computations.items():
    if any(i.name in trip_counts for i in comp.instructions):
      comp = HloComputation(name, tuple(dataclasses.replace(i, trip_count=int(trip_counts[i.name]),
                                                            trip_count_source="given")
                                        if i.name in trip_counts else i for i in comp.instructions), comp.is_entry)
    computations[name] = comp
  return dataclasses.replace(module, computations=computations)


def replay(module: HloModule, costs: Mapping[str, OpCost], *, rule: str = "schedule",
           contention: float = 1.0) -> Replay:
  """Replays ``module``'s schedule under an overlap rule (module docstring).

  Args:
    module: the program (its loops' :attr:`~jaxckpt.analysis.HloInstruction.trip_count`; an unknown count is 1).
    costs: :func:`jaxckpt.timing._ops.op_costs` of it.
    rule: a key of :data:`OVERLAP_RULES`.
    contention: how much longer the core's work takes while a collective is in flight (a GPU's NCCL kernels run on
      some of its SMs, :func:`jaxckpt.timing._gpu.collective_contention`); 1.0: none (a TPU's collectives run on
      their own engines).

  Returns:
    The :class:`Replay`.
  """
  if rule != "schedule":
    busy: dict[str, float] = {}
    for run in module.executions():
      cost = costs.get(run.instruction.name)
      if cost is None or cost.term == FREE:
        continue
      busy[cost.term] = busy.get(cost.term, 0.0) + cost.seconds * run.count
    if rule == "serial":
      return Replay(sum(busy.values()), {k: v for k, v in busy.items() if is_async_term(k)})
    return Replay(max(busy.values(), default=0.0), {})
  pairs = async_pairs(module, costs)
  state = _State(contention=contention)
  _run(module, module.computations[module.entry], costs, pairs, state)
  end = max([state.now, *(e for e, _ in state.pending.values())])
  for _, (e, term) in state.pending.items():
    state.exposed[term] = state.exposed.get(term, 0.0) + max(0.0, e - state.now)
  return Replay(end, state.exposed)


def is_async_term(term: str) -> bool:
  """Whether a term's work runs on a stream of its own (collectives, host transfers, copies)."""
  return term.startswith(("collectives", "host", "copies"))


def _run(module: HloModule, comp: HloComputation, costs: Mapping[str, OpCost], pairs: Mapping[str, str],
         state: _State) -> None:
  for ins in comp.instructions:
    if ins.opcode == "while":
      _loop(module, ins, costs, pairs, state)
      continue
    if ins.opcode == "call" and ins.called in module.computations:
      _run(module, module.computations[ins.called], costs, pairs, state)
      continue
    if ins.opcode == "conditional":
      branches = []
      for name in ins.calls:
        branch = state.copy()
        _run(module, module.computations[name], costs, pairs, branch)
        branches.append(branch)
      if branches:
        longest = max(branches, key=lambda s: s.now)
        state.now, state.free, state.pending, state.exposed = longest.now, longest.free, longest.pending, \
            longest.exposed
      continue
    start = pairs.get(ins.name)
    cost = costs.get(ins.name)
    if start is not None:
      if cost is not None and not cost.is_async and cost.term != FREE:
        state.work(cost.seconds)  # a done fusion that also computes
      if start in state.pending:
        end, term = state.pending.pop(start)
        wait = max(0.0, end - state.now)
        state.exposed[term] = state.exposed.get(term, 0.0) + wait
        state.now += wait
      continue
    if cost is None or cost.term == FREE:
      continue
    if cost.is_async:
      begin = max(state.now, state.free.get(cost.term, 0.0))
      end = begin + cost.seconds
      state.free[cost.term] = end
      state.pending[ins.name] = (end, cost.term)
    else:
      state.work(cost.seconds)


def _loop(module: HloModule, loop: HloInstruction, costs: Mapping[str, OpCost], pairs: Mapping[str, str],
          state: _State) -> None:
  condition = module.computations[loop.attributes["condition"].lstrip("%")]
  body = module.computations[loop.attributes["body"].lstrip("%")]
  n = loop.trip_count if loop.trip_count is not None else 1
  explicit = min(n, _EXPLICIT_ITERATIONS)
  began = state.now
  exposed_before = dict(state.exposed)
  for _ in range(explicit):
    began, exposed_before = state.now, dict(state.exposed)
    _run(module, condition, costs, pairs, state)
    _run(module, body, costs, pairs, state)
  rest = n - explicit
  if rest > 0:
    per_iteration = state.now - began
    waited = {k: v - exposed_before.get(k, 0.0) for k, v in state.exposed.items()}
    state.shift(began, rest * per_iteration)
    for term, seconds in waited.items():
      state.exposed[term] = state.exposed.get(term, 0.0) + rest * seconds
  _run(module, condition, costs, pairs, state)
