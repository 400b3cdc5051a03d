"""The fit plan: largest micro-batch per policy, and for a global batch the fastest (policy, micro-batch,
accumulation), verified by compiling it; optionally measured on this device."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.errors import JaxckptError
from jaxckpt.fit._model import fit_affine
from jaxckpt.fit._names import (CUSTOM_SEARCH, DEFAULT_CUSTOM_LISTS, FULL_REMAT_POLICIES, CustomPlan, CustomSearch,
                               custom_plans, name_costs, name_lists, offload_excess, predicted_footprint)
from jaxckpt.fit._search import (DEFAULT_POLICIES, BatchFit, batch_unit, compile_point, fit_policies, max_batch_size,
                                nothing_fits_error, resolve_memory, with_batch)
from jaxckpt.fit._speed import Accelerator, Candidate, Traffic, accelerator, candidates
from jaxckpt.planner._plan import resolve_policy
from jaxckpt.sharding import check_batch_size
from jaxckpt.sharding._rules import mesh_axes_of, param_logical_axes
from jaxckpt.sharding import Placement, Topology
from jaxckpt.step._job import compile_job
from jaxckpt.step._targets import ModelTarget, Target
from jaxckpt.step._compile import compile_policy
from jaxckpt.step._build import concrete_inputs, default_optimizer
from jaxckpt.timing import step_time_of
from jaxckpt._units import format_bytes


DEFAULT_RANK_COMPILED = 3
"""On a topology, the fastest candidates by the roofline that the fit compiles as they will run and ranks by their
compiled programs' estimated step times (:func:`plan_fit`'s ``rank_compiled``; the mesh search times each mesh's
winner only: :func:`jaxckpt.fit.search_meshes`)."""


@dataclasses.dataclass(frozen=True)
class GlobalChoice:
  """The fastest way to train a global batch that fits.

  Attributes:
    global_batch: examples per optimizer step G.
    winner: the chosen :class:`~jaxckpt.fit._speed.Candidate` (least estimated time: its compiled program's on a
      topology, the roofline's elsewhere; or best measured throughput with ``measure``).
    footprint_bytes: the winner's step compiled with its accumulation at G (``None`` for a loss target, which has no
      accumulation: its micro-step footprint is the candidate's).
    table: every fitting candidate, fastest estimate first (on a topology the ones timed from their compiled
      programs first, by that estimate; then the rest by the roofline).
    measured: candidates that were timed (``measure``), in estimate order.
    spearman: rank correlation of estimated and measured step times over :attr:`measured` (``None`` if < 3).
    ranked_by: ``"estimate"`` (the roofline), ``"compiled"`` (the compiled programs' step times) or
      ``"measured"``.
    compiles: compiles used to verify (and time) the winner.
    dropped: candidates the roofline put first that, compiled with their accumulation at G, did not fit: ``(policy,
      micro-batch, accumulation steps, compiled footprint bytes)`` each, in the order they were tried.
  """

  global_batch: int
  winner: Candidate
  footprint_bytes: int | None
  table: tuple[Candidate, ...]
  measured: tuple[Candidate, ...] = ()
  spearman: float | None = None
  ranked_by: str = "estimate"
  compiles: int = 0
  dropped: tuple[tuple[str, int, int, int], ...] = ()

  def flags(self) -> str:
    """The winner as the experiments' flags."""
    w = self.winner
    return f"--policy {w.policy} --batch-size {self.global_batch} --grad-accum-steps {w.accum}"

  def python(self) -> str:
    """The winner as Python: set the policy, the batch and the accumulation."""
    w = self.winner
    return (f"jaxckpt.set_policy(model, {w.policy!r})\n"
            f"step = jaxckpt.make_train_step(graphdef, tx, loss_fn, grad_accum_steps={w.accum})  "
            f"# batch of {self.global_batch} = {w.accum} × {w.micro_batch}")

  def as_json(self) -> dict[str, Any]:
    """The JSON form (``global_batch`` key of the plan)."""
    return {"global_batch_size": self.global_batch, "policy": self.winner.policy,
            "micro_batch_size": self.winner.micro_batch, "grad_accum_steps": self.winner.accum,
            "est_step_s": self.winner.est_step_s, "measured_step_s": self.winner.measured_step_s,
            "compiled_step": self.winner.compiled_step,
            "footprint_bytes": self.footprint_bytes, "ranked_by": self.ranked_by, "spearman": self.spearman,
            "flags": self.flags(), "table": [c.as_row() for c in self.table],
            "dropped_for_memory": [{"policy": p, "micro_batch_size": b, "grad_accum_steps": k, "footprint_bytes": f}
                                   for p, b, k, f in self.dropped]}


FIT_UNITS: dict[str, str] = {
    "limit_bytes": "bytes per device",
    "rows.max_batch_size": "examples, global over the mesh's batch axes (per device: max_batch_size // batch_unit)",
    "rows.footprint_bytes": "bytes per device", "rows.over_bytes_at_next": "bytes per device",
    "rows.model.intercept_bytes": "bytes per device",
    "rows.model.slope_bytes": "bytes per device per example of the global batch",
    "global_batch.global_batch": "examples per train step, global",
}
"""What the numbers of the fit's JSON count (``rows.<key>``: a key of each row)."""


@dataclasses.dataclass(frozen=True)
class FitPlan:
  """What fits and what is fastest.

  Attributes:
    fits: one :class:`~jaxckpt.fit._search.BatchFit` per policy.
    limit_bytes: memory per device fitted.
    memory_source: where it came from (``given``, or the device and margin for ``auto``).
    device: the :class:`~jaxckpt.fit._speed.Accelerator` of the time model (``None`` without a global batch).
    choice: the :class:`GlobalChoice` for the global batch, or ``None``.
    seconds: wall seconds.
    axis: what was searched: ``"batch"`` (micro-batch size) or ``"seq_len"`` (tokens per example at a batch).
    compiled_for: what compiled it (:func:`jaxckpt.sharding.compiled_for`: backend, device_kind,
      topology, device_count, mesh); ``None``: not recorded.
    custom: what ``custom:search`` read and chose (:class:`jaxckpt.fit.CustomSearch`), ``None`` without it.
  """

  fits: tuple[BatchFit, ...]
  limit_bytes: int
  memory_source: str
  device: Accelerator | None
  choice: GlobalChoice | None
  seconds: float
  axis: str = "batch"
  compiled_for: Mapping[str, Any] | None = None
  custom: CustomSearch | None = None

  @property
  def compiles(self) -> int:
    """Compiles in all (batch fits and verification of the choice)."""
    return sum(f.compiles for f in self.fits) + (self.choice.compiles if self.choice else 0)

  @property
  def refusals(self) -> int:
    """Compiles the compiler refused for memory (:attr:`FitPoint.refused`) or whose footprint was over the memory
    once compiled with its accumulation (:attr:`GlobalChoice.dropped`)."""
    return sum(p.refused for f in self.fits for p in f.points) + (len(self.choice.dropped) if self.choice else 0)

  def as_json(self) -> dict[str, Any]:
    """``{"backend", "device_kind", "compiler", "topology", "device_count", "mesh" (what compiled it), "rows": [one per policy],
    "global_batch": {...} | None, "limit_bytes", ...}``."""
    out: dict[str, Any] = {**(self.compiled_for or {}), "rows": [f.as_row() for f in self.fits],
                           "limit_bytes": self.limit_bytes, "memory_source": self.memory_source,
                           "compiles": self.compiles, "refusals": self.refusals, "seconds": round(self.seconds, 3),
                           "global_batch": None,
                           "axis": self.axis, "units": FIT_UNITS}
    if self.device is not None:
      out["device"] = dataclasses.asdict(self.device)
    if self.choice is not None:
      out["global_batch"] = self.choice.as_json()
    if self.custom is not None:
      out["custom_search"] = self.custom.as_json()
    return out


def spread(table: Sequence[Candidate], n: int) -> list[Candidate]:
  """``n`` candidates to time, spanning policies and micro-batches, not only the estimate's first ``n``.

  The time model ranks configurations of one policy consistently (FLOPs and bytes scale together) but can misjudge
  the trade between policies, and between a large micro-batch and more accumulation, on a device whose figures it
  only approximates (a CPU's caches). So: the best estimate first; then, one at a time, a pick for the policy with
  the fewest picks so far (ties: the policy with the better best estimate) — its best estimate not picked yet, at a
  micro-batch at least an octave (×2) from its picks when there is one. On GPT ``tiny`` on this CPU the measured best
  was within a few percent of each policy's best estimate or its neighbour micro-batch (benchmarks/fit_planner.py).

  Args:
    table: candidates, fastest estimate first.
    n: how many to pick (all when ``n`` ≥ ``len(table)``).

  Returns:
    The picks, in estimate order.
  """
  if n >= len(table):
    return list(table)
  if n <= 0:
    return []
  order = {id(c): i for i, c in enumerate(table)}
  picked: list[Candidate] = [table[0]]
  queues: dict[str, list[Candidate]] = {}
  for cand in table:
    queues.setdefault(cand.policy, [])
    if cand is not table[0]:
      queues[cand.policy].append(cand)
  rank = {policy: i for i, policy in enumerate(queues)}  # policies by their best estimate
  while len(picked) < n:
    open_ = [p for p in queues if queues[p]]
    policy = min(open_, key=lambda p: (sum(c.policy == p for c in picked), rank[p]))
    mine = [math.log2(c.micro_batch) for c in picked if c.policy == policy]
    if mine:  # the best estimate at least an octave from this policy's picks (else its next best)
      best = max(queues[policy], key=lambda c: (min(abs(math.log2(c.micro_batch) - m) for m in mine) >= 1,
                                                -order[id(c)]))
    else:
      best = queues[policy][0]
    queues[policy].remove(best)
    picked.append(best)
  return sorted(picked, key=lambda c: order[id(c)])


def measure_candidates(target: Target, table: Sequence[Candidate], global_batch: int, *, top: int = 4,
                       steps: int = 3, warmup: int = 1, rounds: int = 3, pick: str = "spread") -> list[Candidate]:
  """Times ``top`` candidates on this device: real steps of the step as it runs (accumulation included).

  Timing on a machine shared with other jobs is noisy, so each candidate's time is the least over ``rounds``
  interleaved rounds (every candidate runs ``steps`` steps per round, one after the other, so a burst of load
  slows all of them alike) of its steps' wall seconds: the least-disturbed run.

  Args:
    target: the model or loss target (a loss target runs ``accum`` micro-steps of ``micro_batch``).
    table: candidates, fastest estimate first.
    global_batch: examples per optimizer step G.
    top: how many to time.
    steps: timed steps per candidate per round (≥ 1); warmup: untimed steps before the first round (≥ 1).
    rounds: interleaved rounds (≥ 1).
    pick: ``"spread"`` (:func:`spread`: span policies and micro-batches) or ``"top"`` (the first ``top``).

  Returns:
    The timed candidates (estimate order) with ``measured_step_s`` set: seconds per step of G examples.

  Raises:
    JaxckptError: an unknown ``pick``, or ``steps``/``warmup``/``rounds`` < 1.
  """
  if pick not in ("spread", "top"):
    raise JaxckptError(f"pick={pick!r}: valid: spread, top")
  for name, value in (("steps", steps), ("warmup", warmup), ("rounds", rounds)):
    if value < 1:
      raise JaxckptError(f"{name}={value} must be ≥ 1")
  chosen = spread(table, top) if pick == "spread" else list(table[:top])
  tx = default_optimizer()
  runs = []
  for cand in chosen:
    model = isinstance(target, ModelTarget)
    sized = with_batch(target, global_batch, grad_accum_steps=cand.accum) if model \
        else with_batch(target, cand.micro_batch)
    parsed, _ = resolve_policy(sized, cand.policy, tx=tx)
    step = compile_policy(sized, parsed, tx=tx, stats_only=False).compiled
    runs.append((cand, step, concrete_inputs(sized, tx), 1 if model else cand.accum))
  best = [math.inf] * len(runs)
  for r in range(rounds):
    for i, (_, step, make_inputs, repeat) in enumerate(runs):
      state, batch = make_inputs()  # one candidate's state alive at a time
      for s in range((warmup if r == 0 else 0) + steps):
        started = time.perf_counter()
        for _ in range(repeat):
          state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        if s >= (warmup if r == 0 else 0):
          best[i] = min(best[i], time.perf_counter() - started)
      del state, batch
  return [dataclasses.replace(cand, measured_step_s=t) for (cand, *_), t in zip(runs, best)]


def traffic_of(target: Target) -> Traffic | None:
  """What ``target``'s model moves over the mesh axes beyond its parameters (:class:`jaxckpt.fit.Traffic`): its
  ``tensor_allreduce_bytes_per_example()`` and ``expert_alltoall_bytes_per_example()`` (e.g. :class:`jaxckpt.models.
  llm.LLM`'s), and the bytes of its parameters an ``expert`` axis splits (logical name ``exp``); read from the
  abstract model, nothing allocated. ``None`` for a loss target."""
  if not isinstance(target, ModelTarget):
    return None
  from flax import nnx

  model = nnx.eval_shape(target.make_model)
  tensor = getattr(model, "tensor_allreduce_bytes_per_example", None)
  expert = getattr(model, "expert_alltoall_bytes_per_example", None)
  split = 0
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes = param_logical_axes(leaf) or ()
    if any(a is not None and "expert" in mesh_axes_of(a) for a in axes):
      value = leaf.get_value()
      split += int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize
  return Traffic(float(tensor()) if callable(tensor) else 0.0, float(expert()) if callable(expert) else 0.0,
                 float(split))


def tensor_bytes_per_example(target: Target) -> float | None:
  """Activation bytes a ``tensor`` axis all-reduces per example per step for ``target``: its model's
  ``tensor_allreduce_bytes_per_example()`` (e.g. :meth:`jaxckpt.models.llm.LLM.tensor_allreduce_bytes_per_example`,
  read from the abstract model, nothing allocated), or ``None`` for a model without it or a loss target."""
  if not isinstance(target, ModelTarget):
    return None
  from flax import nnx

  method = getattr(nnx.eval_shape(target.make_model), "tensor_allreduce_bytes_per_example", None)
  return float(method()) if callable(method) else None


def _time_model_device(placement: Placement, device: Accelerator | None, *, timed: bool) -> Accelerator | None:
  """The time model's device of a fit: on a topology, for a timed fit without ``device``, its chip; else as
  given."""
  if timed and device is None and placement.topology is not None:
    return accelerator(device=placement.device)
  return device


def _check_global_batch(global_batch: int, device: Accelerator | None, mesh: Any, min_batch: int | None) -> None:
  """Raises JaxckptError for a global batch the fit cannot plan: no time model's device, < 1, one the mesh's batch
  axes do not divide, or one no micro-batch ≥ ``min_batch`` (a multiple of the mesh's batch unit) divides."""
  if device is None:
    raise JaxckptError("global_batch= needs device= (an Accelerator: jaxckpt.fit.accelerator())")
  if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
    raise JaxckptError(f"global_batch_size={global_batch!r} must be an int ≥ 1")
  if mesh is not None:
    check_batch_size(global_batch, mesh, flag="global_batch_size")
  unit = batch_unit(mesh)
  lo = min_batch or unit
  if lo % unit:
    raise JaxckptError(f"min_batch={lo} must be a multiple of {unit} (the mesh's batch axes)")
  if not any(global_batch % b == 0 for b in range(lo, global_batch + 1, unit)):
    raise JaxckptError(f"global_batch_size={global_batch}: no micro-batch ≥ min_batch={lo}"
                       + (f" and a multiple of {unit} (the mesh's batch axes)" if unit > 1 else "")
                       + f" divides it; use a multiple of {lo}")


def _without_search(policies: Sequence[Any], global_batch: int | None, custom_lists: Any) -> tuple[list[Any], bool]:
  """``(policies without the custom:search token, whether it was there)``; with it, a full-remat policy is added
  when none is given (the line the names are added to).

  Raises:
    JaxckptError: ``policies`` one string; custom:search without ``global_batch``, spelt in other letter cases;
      ``custom_lists`` not an int ≥ 1, or other than the default without custom:search.
  """
  if isinstance(policies, str):
    raise JaxckptError(f"policies={policies!r} is one string: give a list, e.g. ['nothing_saveable', "
                       f"'{CUSTOM_SEARCH}']")
  for p in policies:
    if isinstance(p, str) and p.strip() != CUSTOM_SEARCH and p.strip().lower() == CUSTOM_SEARCH:
      raise JaxckptError(f"policy {p!r}: the search's token is {CUSTOM_SEARCH!r}, in lower case")
  if isinstance(custom_lists, bool) or not isinstance(custom_lists, int) or custom_lists < 1:
    raise JaxckptError(f"custom_lists={custom_lists!r} must be an int ≥ 1")
  searched = any(isinstance(p, str) and p.strip() == CUSTOM_SEARCH for p in policies)
  if not searched and custom_lists != DEFAULT_CUSTOM_LISTS:
    raise JaxckptError(f"custom_lists={custom_lists} applies to '{CUSTOM_SEARCH}' only, which policies does not hold")
  policies = [p for p in policies if not (isinstance(p, str) and p.strip() == CUSTOM_SEARCH)]
  if searched:
    if global_batch is None:
      raise JaxckptError(f"{CUSTOM_SEARCH} chooses names by the step-time model of a global batch: give "
                         "global_batch")
    if not any(str(p).strip() in FULL_REMAT_POLICIES for p in policies):
      policies.append(FULL_REMAT_POLICIES[0])
  return policies, searched


def _at_least(table: Sequence[Candidate], smallest: int, global_batch: int) -> list[Candidate]:
  """The candidates whose micro-batch is ≥ ``smallest`` (``min_batch``: the fits' compiles may sit below it, the
  answer may not).

  Raises:
    JaxckptError: none is.
  """
  kept = [c for c in table if c.micro_batch >= smallest]
  if not kept:
    raise JaxckptError(f"global_batch_size={global_batch}: no micro-batch ≥ min_batch={smallest} that fits divides it")
  return kept


def _fit_custom_lists(target: Target, fits: list[BatchFit], costs: Sequence[Any], additivity: float, *, limit: int,
                      placement: Placement,
                      global_batch: int, device: Accelerator, custom_lists: int,
                      on_compile: Callable[[str, int], None] | None, started: float, **kwargs: Any) -> CustomSearch:
  """``custom:search``'s lists (:mod:`jaxckpt.fit._names`): the best predicted list is fitted (appended to ``fits``),
  what its compile teaches is learnt, and the next best is fitted, up to ``custom_lists``; returns the record
  (``started``: when the names' costing began, for its seconds)."""
  full = next(f for f in fits if f.policy.strip() in FULL_REMAT_POLICIES)
  mesh = placement.mesh
  shape = None if mesh is None else dict(mesh.shape)
  traffic = traffic_of(target) if shape else None
  hint = fit_affine([(p.batch, p.footprint_bytes) for p in full.points]).intercept \
      if len({p.batch for p in full.points}) > 1 else None
  fitted = [f.policy for f in fits]
  learnt: dict[str, float] = {}
  emitted = {c.name for c in costs}
  for f in fits:  # a name list given beside custom:search (a published one) already tells what offload costs
    lists = name_lists(f.policy)
    if lists is not None and set(lists[0] + lists[1]) <= emitted:
      learnt.update(offload_excess(CustomPlan(*lists, 0, 0, 0, 0, 0.0), costs, full, f, offload_device=learnt))
  chosen, compiled = [], []
  stopped = f"custom_lists={custom_lists} reached"
  margin = 0.0
  for _ in range(custom_lists):
    plans = custom_plans(costs, full, global_batch, device, mesh_shape=shape, traffic=traffic,
                         offload_device=learnt, exclude=fitted, min_batch=kwargs.get("min_batch") or 1,
                         margin_bytes=margin)
    if not plans:
      stopped = ("no list that fits is predicted faster than full remat" if full.max_batch_size is not None else
                 "no list is predicted to fit the memory with its host bytes within the host memory per device")
      stopped += " with what the compiles taught" if chosen else ""
      break
    plan = plans[0]
    fit = max_batch_size(target, plan.policy, limit, mesh=placement, on_compile=on_compile, intercept_hint=hint,
                         **kwargs)
    chosen.append(plan)
    fits.append(fit)
    fitted += [plan.policy, fit.policy]
    kept = [p for p in fit.points if not p.refused]
    if kept:  # at the batch it was planned for when compiled there, else the largest compiled
      top = fit.by_batch.get(plan.micro_batch) or max(kept, key=lambda p: p.batch)
      compiled.append((plan.policy, top.batch, predicted_footprint(plan, costs, full, top.batch,
                                                                   offload_device=learnt), top.footprint_bytes))
    more = offload_excess(plan, costs, full, fit, offload_device=learnt)
    missed = fit.max_batch_size is None or fit.max_batch_size < plan.micro_batch
    if not more and missed and kept:  # over at its batch, and no offload to blame: keep that much free next
      at = fit.by_batch.get(plan.micro_batch) or top
      margin = max(margin, at.footprint_bytes - predicted_footprint(plan, costs, full, at.batch,
                                                                    offload_device=learnt))
    elif not more:  # the compile held the prediction: the model stands
      stopped = "the last list compiled within its prediction"
      break
    learnt.update(more)
  return CustomSearch(costs, tuple(chosen), full.policy, time.perf_counter() - started, additivity, tuple(compiled),
                      learnt, stopped)


def _fits_and_lists(target: Target, policies: Sequence[Any], limit: int, *, searched: bool, placement: Placement,
                    global_batch: int | None, device: Accelerator | None, custom_lists: int,
                    guesses: Mapping[str, int] | None, on_compile: Callable[[str, int], None] | None,
                    **kwargs: Any) -> tuple[list[BatchFit], CustomSearch | None]:
  """The policies' fits and, with ``custom:search`` (``searched``), its lists, fitted after them, each compiled for
  ``placement`` (handed down whole: nothing below rebuilds it from its mesh).

  Raises:
    NothingFitsError: nothing fits the smallest batch — with the search, not even its lists (fixed policies that fit
      nothing do not stop it: offloading the layer input goes below full remat); the message says why it stopped.
    JaxckptError: a model that emits no checkpoint name (before any compile).
  """
  if searched:  # the names first: a model without any is one line before a compile
    costing = time.perf_counter()
    costs, additivity = name_costs(target, mesh=placement.mesh, options=kwargs.get("compiler_options"))
  fits = fit_policies(target, policies, limit, mesh=placement, on_compile=on_compile, require_fit=not searched,
                      guesses=guesses, **kwargs)
  if not searched:
    return fits, None
  custom = _fit_custom_lists(target, fits, costs, additivity, limit=limit, placement=placement, global_batch=global_batch,
                             device=device, custom_lists=custom_lists, on_compile=on_compile, started=costing,
                             **kwargs)
  if all(f.max_batch_size is None for f in fits):
    raise nothing_fits_error(fits, f"{CUSTOM_SEARCH} fitted {len(custom.plans)} list(s) and stopped: {custom.stopped}")
  return fits, custom


@dataclasses.dataclass
class _Verifier:
  """The fit's verification compiles of a global batch's candidates (:func:`plan_fit`): each step compiled as it will
  run, and on a topology timed from its program (:func:`jaxckpt.timing.step_time_of`)."""

  target: Target
  global_batch: int
  mesh: Any
  topology: Topology | None
  on_compile: Callable[[str, int], None] | None
  compiles: int = 0

  def __call__(self, cand: Candidate, *, time_it: bool = False) -> tuple[int, dict[str, Any] | None]:
    """The compiled footprint of the step as it will run (the micro-step, or the accumulated step at G: the
    accumulator adds a gradient-sized buffer), and with ``time_it`` its compiled program's estimated step time
    (:meth:`jaxckpt.timing.StepTime.as_dict`)."""
    if cand.accum == 1 or not isinstance(self.target, ModelTarget):
      if cand.compiled and not time_it:
        return cand.footprint_bytes, None
      batch, accum = cand.micro_batch, 1
    else:
      batch, accum = self.global_batch, cand.accum
    if self.on_compile is not None:
      self.on_compile(cand.policy, batch)
    self.compiles += 1
    point = compile_point(self.target, cand.policy, batch, mesh=self.mesh, grad_accum_steps=accum,
                          timing=self._timing if time_it else None)
    return point.footprint_bytes, point.step_time

  def _timing(self, compiled: Any) -> dict[str, Any]:
    return step_time_of(compiled, topology=self.topology, mesh=self.mesh).as_dict()


def _choose(target: Target, table: Sequence[Candidate], verify: _Verifier, *, limit: int, timed: int,
            measure: int) -> GlobalChoice:
  """The global batch's winner (:func:`plan_fit`): the roofline's order verified by compiles until one fits (with
  ``timed`` > 0: until ``timed`` fit, each timed from its compiled program, the fastest of them by that estimate),
  then with ``measure`` the fastest measured whose step fits."""
  global_batch = verify.global_batch
  fitting: list[tuple[Candidate, int]] = []
  over = set()
  dropped: list[tuple[str, int, int, int]] = []
  for cand in table:
    footprint, estimate = verify(cand, time_it=timed > 0)
    if footprint > limit:
      over.add((cand.policy, cand.micro_batch))
      dropped.append((cand.policy, cand.micro_batch, cand.accum, footprint))
      continue
    fitting.append((dataclasses.replace(cand, compiled_step=estimate), footprint))
    if len(fitting) >= max(1, timed):
      break
  if not fitting:
    tried = ", ".join(f"{p} {b} × {k} ({format_bytes(f)})" for p, b, k, f in dropped[:4])
    raise JaxckptError(f"global_batch_size={global_batch}: no candidate fits {format_bytes(limit)} once compiled "
                       f"with its accumulation (tried {tried})")
  ranked_by = "estimate"
  if timed:  # the timed candidates first, by their compiled programs' estimates; the rest by the roofline
    fitting.sort(key=lambda pair: pair[0].step_s)
    ranked_by = "compiled"
  winner, footprint = fitting[0]
  done = {(c.policy, c.micro_batch) for c, _ in fitting} | over
  table = [c for c, _ in fitting] + [c for c in table if (c.policy, c.micro_batch) not in done
                                     and c.est_step_s >= fitting[-1][0].est_step_s]
  measured: list[Candidate] = []
  rho = None
  if measure:
    measured = measure_candidates(target, table, global_batch, top=measure)
    if len(measured) >= 3:
      from scipy import stats  # here, not at import: scipy.stats costs ≈0.8 s of every CLI's start

      rho = float(stats.spearmanr([c.est_step_s for c in measured], [c.measured_step_s for c in measured])[0])
    ranked_by = "measured"
    for best in sorted(measured, key=lambda c: c.measured_step_s):  # the fastest measured whose step fits
      foot = footprint if (best.policy, best.micro_batch) == (winner.policy, winner.micro_batch) else verify(best)[0]
      if foot <= limit:
        winner, footprint = best, foot
        break
  return GlobalChoice(global_batch, winner, footprint, tuple(table), tuple(measured), rho, ranked_by, verify.compiles,
                      tuple(dropped))


def plan_fit(
    target: Target,
    policies: Sequence[Any] = DEFAULT_POLICIES,
    memory: int | str = "auto",
    *,
    global_batch: int | None = None,
    device: Accelerator | None = None,
    measure: int = 0,
    mesh: Any = None,
    on_compile: Callable[[str, int], None] | None = None,
    topology: "str | Topology | None" = None,
    custom_lists: int = DEFAULT_CUSTOM_LISTS,
    guesses: Mapping[str, int] | None = None,
    memory_fraction: float | None = None,
    rank_compiled: int = DEFAULT_RANK_COMPILED,
    **kwargs: Any,
) -> FitPlan:
  """Largest micro-batch per policy, and the fastest configuration for ``global_batch``, verified.

  Args:
    target: a model or loss target.
    policies: policy specs (default :data:`~jaxckpt.fit._search.DEFAULT_POLICIES`), and ``"custom:search"``
      (:data:`jaxckpt.fit.CUSTOM_SEARCH`, with ``global_batch``, a model whose layers emit checkpoint names):
      MaxText's ``custom`` lists — per name device, offload or recompute — chosen by the time model from a
      full-remat fit (``nothing_saveable`` is added when no full-remat policy is given) and fitted as policies
      (:mod:`jaxckpt.fit._names`).
    custom_lists: ``custom:search`` lists fitted at most (≥ 1; each about three compiles): the best predicted, then,
      after a compile over its prediction (offloaded values the compiler kept on the device), the best predicted
      with that learnt (:func:`jaxckpt.fit._names.offload_excess`), and so on; a list within its prediction ends it.
    guesses: per fixed policy text, a predicted largest micro-batch to compile first with its successor
      (:func:`~jaxckpt.fit._search.fit_policies`; :func:`jaxckpt.fit.search_meshes` passes another mesh's).
    memory: bytes per device: ``"auto"``, a size string or int (:func:`~jaxckpt.fit._search.resolve_memory`).
    global_batch: examples per optimizer step G, or ``None`` (no speed ranking).
    device: the accelerator of the time model (required with ``global_batch``; :func:`jaxckpt.fit._speed.accelerator`).
    measure: time ``measure`` candidates on this device, spanning policies and micro-batches (:func:`spread`), and
      rank them by measured throughput (0: no).
    rank_compiled: with a ``topology``: the ``rank_compiled`` fastest candidates by the roofline that fit once
      compiled as they will run (accumulation at G) are timed from their compiled programs
      (:func:`jaxckpt.timing.step_time_of`, docs/timing.md), and the fastest of them by that estimate wins
      (``ranked_by="compiled"``); each is one compile at G (the first is the verification compile the fit makes
      anyway). 0: the roofline alone. Ignored without a topology (nothing compiled for a chip to read).
    mesh: a device mesh (memory per device; batches multiples of its batch axes), or a
      :class:`~jaxckpt.sharding.Placement` (mesh, topology and memory fraction at once).
    on_compile: progress callback ``(policy, batch)``.
    topology: plan for a TPU slice or GPU cluster without its hardware (``"v5e:2x2"``, ``"h100:32x8"``,
      :mod:`jaxckpt.sharding`): ``mesh`` (a ``--mesh`` spec or ``None``: every chip on ``data``) laid over its chips,
      every compile by its compiler, ``memory="auto"`` the chip's memory (a GPU's × its memory fraction) less the
      margin; ``device`` defaults to the chip (:func:`jaxckpt.fit._speed.accelerator`). No ``measure`` (nothing to
      run on).
    memory_fraction: a GPU topology's share of memory XLA may use (:func:`jaxckpt.sharding.memory_fraction`).
    **kwargs: passed to :func:`~jaxckpt.fit._search.max_batch_size` (``max_batch``, ``min_batch``, ``probes``...).

  Returns:
    The :class:`FitPlan`.

  Raises:
    NothingFitsError: no policy fits the smallest batch (with ``custom:search``: nor any list it fitted; fixed
      policies that fit nothing do not stop the search, since offloading the layer input goes below full remat).
    JaxckptError: ``rank_compiled`` < 0; a ``global_batch`` no fitting micro-batch divides, or the mesh does not
      divide; an empty batch
      range; a footprint that does not grow with the batch; ``global_batch`` without ``device``; ``custom:search``
      without ``global_batch``, on a loss target or a model that emits no checkpoint name, ``custom_lists`` < 1.
    TopologyError: ``measure`` with a topology, a bad topology, its compiler missing (``measure`` with a mesh:
      JaxckptError, the candidates run on one device; :func:`jaxckpt.step.compile_job`).
  """
  started = time.perf_counter()
  if rank_compiled < 0:
    raise JaxckptError(f"rank_compiled={rank_compiled} must be ≥ 0 (0: rank by the roofline alone)")
  placement = compile_job(target, mesh=mesh, topology=topology, memory_fraction=memory_fraction,
                          runs=f"measure={measure}" if measure else None, check_batch=False).placement
  device = _time_model_device(placement, device, timed=global_batch is not None)
  mesh = placement.mesh
  limit, source = resolve_memory(memory, placement=placement)
  if global_batch is not None:
    _check_global_batch(global_batch, device, mesh, kwargs.get("min_batch"))
    kwargs["max_batch"] = min(kwargs.get("max_batch", global_batch), global_batch)  # no micro-batch beyond G
  policies, searched = _without_search(policies, global_batch, custom_lists)
  fits, custom = _fits_and_lists(target, policies, limit, searched=searched, placement=placement, global_batch=global_batch,
                                 device=device, custom_lists=custom_lists, guesses=guesses, on_compile=on_compile,
                                 **kwargs)
  choice = None
  if global_batch is not None:
    shape = None if mesh is None else dict(mesh.shape)
    table = candidates(fits, global_batch, device, mesh_shape=shape, traffic=traffic_of(target) if shape else None)
    table = _at_least(table, kwargs.get("min_batch") or 1, global_batch)
    verify = _Verifier(target, global_batch, mesh, placement.topology, on_compile)
    choice = _choose(target, table, verify, limit=limit, measure=measure,
                     timed=rank_compiled if placement.topology is not None else 0)
  return FitPlan(fits=tuple(fits), limit_bytes=limit, memory_source=source, device=device, choice=choice,
                 seconds=time.perf_counter() - started, compiled_for=placement.compiled_for(), custom=custom)
