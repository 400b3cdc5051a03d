"""MaxText's ``custom`` remat chosen per checkpoint name: keep each named value on the device, offload it to host
memory, or recompute it, by the fit planner's time model — then verified by compiles like any other policy.

MaxText's ``remat_policy: custom`` lets a user say, per checkpoint name (``decoder_layer_input``, ``query_proj``,
``context``, ``mlpwi_0``…), ``device``, ``offload`` or ``remat``; its published configurations are such lists, hand
written. MaxText's memory estimator (PRs #2504/#2891) automates one direction: it promotes tensors remat → offload →
device one at a time, one ahead-of-time compile per step, and stops at the first that fits. Here the choice is
made from a model instead, and only the chosen lists are compiled:

- **what a name costs**, read from the target's own jaxprs without compiling (:func:`name_costs`): its bytes per
  example (the ``checkpoint_name`` values of the forward pass, every layer, in their dtype) and the FLOPs its
  keeping saves per example (the step's jaxpr FLOPs under full remat less those under ``save_only_these_names`` of
  that name alone: JAX's own partial evaluation decides what is then not recomputed). The search assumes those
  savings add up; one more lowering, every name kept at once, checks it (:attr:`CustomSearch.additivity_error`,
  shown with the table): on the LLM family they add up exactly (``llama-tiny`` on CPU, tests/fit/test_names.py;
  ``llama3.1-8b`` with splash on v6e-256, where keeping ``context``, the splash kernel's residuals, saves no FLOPs
  alone or with ``out_proj``: the kernel's forward pass still runs in the backward).
  A name whose value is the input of the remat region itself (``decoder_layer_input`` under per-layer remat) is a
  *boundary*: it is saved anyway, so only offloading it changes anything (it leaves the device);
- **the footprint of an assignment** at micro-batch b: the compiled full-remat line of the same fit (``a + s·b``)
  plus the bytes of every name kept on the device, less the boundary names offloaded; its **host bytes** the
  offloaded names'; its **FLOPs** full remat's less what every kept name saves;
- **its step time**: the fit planner's roofline (:func:`jaxckpt.fit.estimate_step`): compute, HBM, host transfers
  (offloaded bytes out and back over the host link) and collectives, per micro-step × accumulation.

Every assignment of every name (3 options each; 2 for a boundary; a name whose keeping saves no FLOPs is always
recomputed) is scored at every micro-batch dividing the global batch (beyond full remat's largest batch too: an
offloaded boundary frees device memory, so such a list may fit more than full remat does); the fastest
lists that fit the device (and the host's memory) become ``save_and_offload_only_these_names:SAVE/OFFLOAD``
policies, which the fit planner then fits and verifies by compiles as it does every policy
(:func:`jaxckpt.fit.plan_fit`, ``policies=[..., "custom:search"]``).

The model ranks; compiles decide. Per-device bytes are the global bytes ÷ the devices the batch is split over
(a ``tensor`` axis is not credited: an overestimate, so the lists keep less than they could).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxckpt._units import format_bytes
from jaxckpt.rendering._tables import render_table
from jaxckpt.errors import JaxckptError
from jaxckpt.fit._model import line_through
from jaxckpt.fit._search import BatchFit, batch_unit, with_batch
from jaxckpt.fit._speed import Accelerator, Traffic, traffic_seconds, estimate_step
from jaxckpt.policies._model import parse_model_policy
from jaxckpt.step._compile import boundary_names, checkpoint_name_bytes, forward_jaxpr, lower_policy, step_builder
from jaxckpt.step._targets import ModelTarget, Target

CUSTOM_SEARCH = "custom:search"
"""The fit planner's policy token for MaxText's ``custom`` lists chosen by the time model (module docstring)."""

FULL_REMAT_POLICIES = ("nothing_saveable", "full")
"""Policies whose fit is the full-remat line the search adds names to (one must be fitted beside ``custom:search``;
the planner adds ``nothing_saveable`` when none is)."""

DEFAULT_CUSTOM_LISTS = 2
"""Lists fitted per ``custom:search`` at most: after each, a compile over its prediction teaches the model how much
of each offloaded name stayed on the device (:func:`offload_excess`) and the next best list is fitted."""

MAX_SEARCHED_NAMES = 12
"""Names searched exhaustively (3^12 ≈ 531k assignments per micro-batch at most); more names: one line."""


@dataclasses.dataclass(frozen=True)
class NameCost:
  """What keeping one checkpoint name costs and saves, per example of the step (all layers).

  Attributes:
    name: the checkpoint name (``jax.ad_checkpoint.checkpoint_name``).
    bytes_per_example: bytes of its values in the forward pass per example, summed over every layer (global: not
      divided over a mesh), in their dtype.
    flops_per_example: FLOPs per example the step no longer recomputes when this name alone is kept (saved or
      offloaded): full remat's jaxpr FLOPs less ``save_only_these_names:<name>``'s; 0 when keeping it saves nothing.
    boundary: the value is the remat region's own input (through layout-only operations): saved under full remat
      anyway, so keeping it on the device changes nothing and offloading it frees its bytes on the device.
  """

  name: str
  bytes_per_example: float
  flops_per_example: float
  boundary: bool


@dataclasses.dataclass(frozen=True)
class CustomPlan:
  """One assignment of names, scored at its best micro-batch.

  Attributes:
    save: names kept on the device; offload: names moved to host memory (the rest are recomputed).
    micro_batch: examples per micro-step b (its best); accum: micro-steps per step.
    footprint_bytes: predicted device footprint per device at b; host_bytes: predicted host bytes per device.
    est_step_s: predicted seconds per step (:func:`jaxckpt.fit.estimate_step`).
  """

  save: tuple[str, ...]
  offload: tuple[str, ...]
  micro_batch: int
  accum: int
  footprint_bytes: int
  host_bytes: int
  est_step_s: float

  @property
  def policy(self) -> str:
    """The policy spec: ``save_and_offload_only_these_names:SAVE/OFFLOAD``."""
    return custom_policy(self.save, self.offload)


def custom_policy(save: Sequence[str], offload: Sequence[str]) -> str:
  """``save_and_offload_only_these_names:a+b/c+d`` (MaxText's ``custom``: ``save`` on the device, ``offload`` to
  host memory, every other name recomputed).

  Raises:
    JaxckptError: a name in both lists; both lists empty; a list given as one string.
  """
  for what, names in (("save", save), ("offload", offload)):
    if isinstance(names, str):
      raise JaxckptError(f"{what}={names!r} is one string: give a list of checkpoint names")
  if not save and not offload:
    raise JaxckptError("save=[] and offload=[]: nothing kept is full remat (nothing_saveable), not a name list")
  both = sorted(set(save) & set(offload))
  if both:
    raise JaxckptError(f"checkpoint name(s) {', '.join(both)} both saved and offloaded: give each name one place")
  return f"save_and_offload_only_these_names:{'+'.join(save)}/{'+'.join(offload)}"


def name_costs(target: Target, *, mesh: Any = None, tx: Any = None, options: Mapping[str, Any] | None = None,
               names: Sequence[str] | None = None) -> tuple[tuple[NameCost, ...], float]:
  """Each checkpoint name's bytes and saved FLOPs per example (module docstring), from jaxprs: no compile (one
  lowering per name, two more).

  Args:
    target: a model target whose layers emit checkpoint names (the LLM family: MaxText's names).
    mesh: the mesh the fit compiles on (the step is traced for it: a TPU topology's kernels need it).
    tx: the optimizer (default ``optax.adamw(1e-3)``).
    options: XLA options of the lowering.
    names: the names to cost (default: every name the model emits).

  Returns:
    ``(costs, additivity_error)``: one :class:`NameCost` per name, in the model's order of first emission; and how
    far the FLOPs saved by keeping every name at once are from the sum of each name's, ``(Σ each − all) / all``
    (0: additive, as the search assumes; > 0: the names overlap, so lists of several are scored as saving more
    than they do; 0 when keeping every name saves nothing).

  Raises:
    JaxckptError: a loss target; a model that emits no checkpoint name; a name it does not emit; ``names`` empty or
      one string.
  """
  if not isinstance(target, ModelTarget):
    raise JaxckptError("custom:search chooses per checkpoint name of a model's layers: give a model target "
                       "(a ModelTarget)")
  unit = batch_unit(mesh)
  sized = with_batch(target, unit)
  builder = step_builder(sized, tx=tx, mesh=mesh)
  forward = forward_jaxpr(builder)
  by_name = checkpoint_name_bytes(forward)
  if not by_name:
    raise JaxckptError("custom:search chooses per checkpoint name, but this model emits none "
                       "(jax.ad_checkpoint.checkpoint_name): give fixed policies")
  if isinstance(names, str):
    raise JaxckptError(f"names={names!r} is one string: give a list of checkpoint names")
  chosen = list(by_name) if names is None else list(dict.fromkeys(names))
  if not chosen:
    raise JaxckptError(f"names=[] is empty: give checkpoint names this model emits ({', '.join(by_name)}), or None "
                       "for all")
  unknown = [n for n in chosen if n not in by_name]
  if unknown:
    raise JaxckptError(f"checkpoint name(s) {', '.join(unknown)} are not emitted by this model; it emits "
                       f"{', '.join(by_name)}")
  if len(chosen) > MAX_SEARCHED_NAMES:
    raise JaxckptError(f"custom:search tries every assignment of up to {MAX_SEARCHED_NAMES} checkpoint names; this "
                       f"model emits {len(chosen)} ({', '.join(chosen)})")

  def lowered(policy: str) -> Any:
    return lower_policy(sized, parse_model_policy(policy), tx=tx, mesh=mesh, options=options, builder=builder)

  full = lowered("nothing_saveable")
  boundary = boundary_names(forward)  # the forward pass's remat regions (remat2 and remat3 alike)
  out = []
  for name in chosen:
    saved = full.flops - lowered(f"save_only_these_names:{name}").flops
    out.append(NameCost(name, by_name[name] / unit, max(0.0, saved / unit), name in boundary))
  together = (full.flops - lowered(f"save_only_these_names:{'+'.join(chosen)}").flops) / unit
  each = sum(c.flops_per_example for c in out)
  return tuple(out), ((each - together) / together if together > 0 else 0.0)


def _options(cost: NameCost, offload: bool) -> tuple[str, ...]:
  """Where a name may go: a boundary is on the device anyway (or offloaded); a name whose keeping saves nothing is
  recomputed (keeping it would cost bytes for nothing); ``offload`` only where the device has a host link."""
  if cost.boundary:
    return ("device", "offload") if offload else ("device",)
  if cost.flops_per_example <= 0:
    return ("recompute",)
  return ("recompute", "device", "offload") if offload else ("recompute", "device")


def custom_plans(costs: Sequence[NameCost], full: BatchFit, global_batch: int, device: Accelerator, *,
                 mesh_shape: Mapping[str, int] | None = None, tensor_bytes_per_example: float | None = None,
                 traffic: Traffic | None = None, top: int = 1, offload_device: Mapping[str, float] | None = None,
                 exclude: Sequence[str] = (), min_batch: int = 1, margin_bytes: float = 0.0) -> list[CustomPlan]:
  """The fastest name assignments that fit, each at its best micro-batch (module docstring).

  Args:
    costs: :func:`name_costs` of the target, on the fit's mesh.
    full: the fit of a full-remat policy (:data:`FULL_REMAT_POLICIES`) on that mesh: its compiled footprint line,
      FLOPs and bytes per micro-batch.
    global_batch: examples per optimizer step G.
    device: the time model's accelerator (its host bandwidth prices offload, and without one — a CPU, whose host
      and device memory are the same RAM — nothing is offloaded; its ``host_memory_bytes`` bounds it).
    mesh_shape: ``{axis: size}`` of the mesh (collectives), ``None`` for one device.
    tensor_bytes_per_example, traffic: as :func:`jaxckpt.fit.candidates`.
    top: how many distinct assignments to return.
    offload_device: per name, the share of its bytes that stays on the device when it is offloaded (0 when not
      given: the values leave the device), learnt from a compile (:func:`offload_excess`).
    exclude: policies not to return (lists already fitted).
    min_batch: the smallest micro-batch considered (the fit's ``min_batch``).
    margin_bytes: bytes per device a list must leave free beside its prediction (what an earlier list's compile
      exceeded its prediction by, beyond what offloading explains).

  Returns:
    Up to ``top`` plans, fastest first, each keeping at least one name and predicted faster than full remat at its
    fastest micro-batch (full remat itself is ``full``'s row); empty when none fits or none is faster.

  Raises:
    JaxckptError: ``global_batch`` or ``top`` < 1; no micro-batch divides ``global_batch``; an ``offload_device``
      share outside [0, 1] or of a name not in ``costs``.
  """
  if global_batch < 1 or top < 1:
    raise JaxckptError(f"global_batch={global_batch} and top={top} must be ≥ 1")
  emitted = {c.name for c in costs}
  for name, value in (offload_device or {}).items():
    if name not in emitted or not 0.0 <= value <= 1.0:
      raise JaxckptError(f"offload_device[{name!r}]={value}: a share in [0, 1] of a costed name "
                         f"({', '.join(sorted(emitted))})")
  unit = full.unit
  sizes = [b for b in range(max(unit, min_batch), global_batch + 1, unit) if global_batch % b == 0]
  if not sizes:
    raise JaxckptError(f"global_batch={global_batch}: no micro-batch ≥ {max(unit, min_batch)} and a multiple of "
                       f"{unit} divides it")
  if not costs:
    return []
  pts = full.points
  flops_line = line_through([(p.batch, p.flops) for p in pts])
  known = [p for p in pts if p.bytes_accessed is not None]
  # one batch size (a pinned batch): through the origin, exact at that batch, the only one scored
  bytes_line = line_through([(p.batch, int(p.bytes_accessed)) for p in known]) if known else None
  foot_line = full.compiled_line()
  params = max((p.param_bytes for p in pts), default=0)
  tensor = dict(mesh_shape or {}).get("tensor", 1)
  share = unit * tensor
  choices = [_options(c, device.host_bandwidth > 0) for c in costs]
  traffic = traffic or Traffic(tensor_bytes_per_example=tensor_bytes_per_example or 0.0)
  best: dict[str, CustomPlan] = {}
  baseline = math.inf
  for b in sizes:
    k = global_batch // b
    per_device = b / unit  # examples per device of the batch split
    per_micro, per_step = traffic_seconds(device, params, mesh_shape, **traffic.per_device(per_device))
    base_foot = foot_line(b)
    base_flops = flops_line(b)
    accessed = bytes_line(b) if bytes_line else None
    for assignment in itertools.product(*choices):
      foot, host, saved = base_foot, 0.0, 0.0
      for cost, where in zip(costs, assignment):
        size = cost.bytes_per_example * per_device
        if where == "device" and not cost.boundary:
          foot += size
        elif where == "offload":
          host += size
          foot += size * (offload_device or {}).get(cost.name, 0.0) - (size if cost.boundary else 0.0)
        if where != "recompute":
          saved += cost.flops_per_example * b
      if foot + margin_bytes > full.limit_bytes or (device.host_memory_bytes is not None and host > device.host_memory_bytes):
        continue
      save = tuple(c.name for c, w in zip(costs, assignment) if w == "device" and not c.boundary)
      offload = tuple(c.name for c, w in zip(costs, assignment) if w == "offload")
      _, est = estimate_step(device, flops=(base_flops - saved) / share,
                             bytes_accessed=None if accessed is None else accessed / share, working_set=foot,
                             host_bytes=host, per_micro_s=per_micro, per_step_s=per_step, accum=k)
      if not save and not offload:
        baseline = min(baseline, est)  # full remat on this model: what a list must beat
        continue
      plan = CustomPlan(save, offload, b, k, int(foot), int(host), est)
      key = plan.policy
      if key in exclude:
        continue
      if key not in best or est < best[key].est_step_s:
        best[key] = plan
  ranked = sorted((p for p in best.values() if p.est_step_s < baseline * (1 - 1e-6)),
                  key=lambda p: (p.est_step_s, p.host_bytes, len(p.save) + len(p.offload)))
  return ranked[:top]


def predicted_footprint(plan: CustomPlan, costs: Sequence[NameCost], full: BatchFit, batch: int, *,
                        offload_device: Mapping[str, float] | None = None) -> float:
  """The footprint per device :func:`custom_plans` predicts for ``plan``'s lists at ``batch`` (bytes)."""
  foot = full.compiled_line()(batch)
  for cost in costs:
    size = cost.bytes_per_example * batch / full.unit
    if cost.name in plan.save and not cost.boundary:
      foot += size
    elif cost.name in plan.offload:
      foot += size * (offload_device or {}).get(cost.name, 0.0) - (size if cost.boundary else 0.0)
  return foot


def offload_excess(plan: CustomPlan, costs: Sequence[NameCost], full: BatchFit, fit: BatchFit, *,
                   offload_device: Mapping[str, float] | None = None) -> dict[str, float]:
  """What a compile of ``plan``'s lists says about offloading: the compiled footprint over the prediction, at the
  largest compiled batch that was not refused, shared over its offloaded names other than the boundary in
  proportion to their bytes — the share of those names' bytes that stayed on the device (in [0, 1]; added to the
  shares already known). Empty when the compile is within 5% of the prediction (or nothing else is offloaded).

  The TPU compiler does not always move an offloaded value off the device: on Llama 3.1 8B (v6e-256, splash) a list
  offloading ``mlpwi_0``/``mlpwi_1`` compiled to 16.18 GiB per chip at one sequence per chip where 8.8 GiB was
  predicted, while MaxText's T1 list (the layer input and q/k/v/out_proj offloaded) is within 15%.
  """
  offloaded = [c for c in costs if c.name in plan.offload and not c.boundary]
  points = sorted((p for p in fit.points if not p.refused), key=lambda p: p.batch)
  if not offloaded or not points:
    return {}
  point = points[-1]
  predicted = predicted_footprint(plan, costs, full, point.batch, offload_device=offload_device)
  excess = point.footprint_bytes - predicted
  missed = fit.max_batch_size is None or (plan.micro_batch > 0 and fit.max_batch_size < plan.micro_batch)
  if excess <= 0 or (excess <= 0.05 * predicted and not missed):
    return {}
  known = dict(offload_device or {})
  unknown = [c for c in offloaded if c.name not in known]
  blamed = unknown or offloaded  # names already learnt are blamed only when every offloaded one is
  moved = sum(c.bytes_per_example for c in blamed) * point.batch / full.unit
  share = excess / moved
  return {c.name: min(1.0, known.get(c.name, 0.0) + share) for c in blamed}


def name_lists(policy: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
  """``(save, offload)`` of a ``save_and_offload_only_these_names:SAVE/OFFLOAD`` policy text, else ``None``."""
  head, _, body = policy.strip().partition(":")
  if head != "save_and_offload_only_these_names" or "/" not in body:
    return None
  save, offload = body.split("/", 1)
  return tuple(n for n in save.split("+") if n), tuple(n for n in offload.split("+") if n)


@dataclasses.dataclass(frozen=True)
class CustomSearch:
  """What ``custom:search`` read, chose and compiled on one mesh.

  Attributes:
    costs: every name's :class:`NameCost`.
    plans: the fitted assignments, in the order fitted (each round's best given what the earlier compiles taught).
    full_policy: the full-remat fit the assignments were built on.
    seconds: wall seconds of the search: jaxprs traced, assignments scored, and the lists' compiles.
    additivity_error: :func:`name_costs`' check of its FLOPs model (0: additive).
    compiled: per fitted list ``(policy, batch, predicted bytes, compiled bytes)`` at its largest compiled batch
      that was not refused: the model against the compiler.
    offload_device: the shares learnt by :func:`offload_excess` (name → share of its offloaded bytes left on the
      device).
    stopped: why the search fitted no further list (none predicted faster than full remat, a list within its
      prediction, ``custom_lists`` reached).
  """

  costs: tuple[NameCost, ...]
  plans: tuple[CustomPlan, ...]
  full_policy: str
  seconds: float
  additivity_error: float = 0.0
  compiled: tuple[tuple[str, int, float, int], ...] = ()
  offload_device: Mapping[str, float] = dataclasses.field(default_factory=dict)
  stopped: str = ""

  def as_json(self) -> dict[str, Any]:
    """``{"names": [...], "plans": [...], "full_policy", "seconds"}``."""
    return {"names": [dataclasses.asdict(c) for c in self.costs],
            "plans": [{**dataclasses.asdict(p), "policy": p.policy} for p in self.plans],
            "full_policy": self.full_policy, "seconds": round(self.seconds, 3),
            "additivity_error": self.additivity_error,
            "compiled": [{"policy": p, "batch": b, "predicted_bytes": round(pr), "compiled_bytes": c}
                         for p, b, pr, c in self.compiled],
            "offload_device": dict(self.offload_device), "stopped": self.stopped}


def custom_table(custom: CustomSearch, *, width: int | None = None, wide: bool = False) -> str:
  """What ``custom:search`` read per checkpoint name and where its best list puts each (:mod:`jaxckpt.fit._names`).

  Args:
    custom: the :class:`~jaxckpt.fit.CustomSearch`.
    width, wide: characters per line (``None``: the terminal's), or one line per row (:func:`jaxckpt.fit.to_table`).
  """
  best = custom.plans[-1] if custom.plans else None
  rows = []
  for c in custom.costs:
    place = "" if best is None else ("offload" if c.name in best.offload else "device"
                                     if c.name in best.save or c.boundary else "recompute")
    rows.append([c.name, format_bytes(int(c.bytes_per_example)), f"{c.flops_per_example:.3g}",
                 "yes" if c.boundary else "", place])
  notes = [f"bytes and FLOPs per example (all layers, before a mesh splits the batch); FLOPs saved: "
           f"{custom.full_policy}'s less those with the name kept; boundary: the remat region's input, saved anyway "
           "(only offloading it frees device memory)"]
  if abs(custom.additivity_error) > 0.01:
    notes.append(f"the names' FLOPs do not add up: every name kept at once saves {custom.additivity_error:+.1%} "
                 "less than their sum (lists of several are scored as saving more than they do; the compiles decide)")
  if custom.stopped:
    notes.append(f"lists fitted: {len(custom.plans)}; stopped: {custom.stopped}")
  compiled = {policy: (batch, predicted, actual) for policy, batch, predicted, actual in custom.compiled}
  for i, p in enumerate(custom.plans, 1):
    line = (f"list {i}: {p.policy}: predicted {format_bytes(p.footprint_bytes)} device + "
            f"{format_bytes(p.host_bytes)} host at {p.micro_batch} × {p.accum}, est. {p.est_step_s * 1e3:.2f} ms")
    if p.policy in compiled:
      batch, predicted, actual = compiled[p.policy]
      line += f"; compiled at {batch}: {format_bytes(actual)} (predicted {format_bytes(int(predicted))})"
    notes.append(line)
  if custom.offload_device:
    notes.append("learnt from the compiles, share of an offloaded name's bytes left on the device: " + ", ".join(
        f"{name} {share:.0%}" for name, share in custom.offload_device.items()))
  return render_table(["name", "bytes/example", "FLOPs saved/example", "boundary", "last list"], rows,
                      title=f"{CUSTOM_SEARCH}: per checkpoint name, {custom.seconds:.0f} s", notes=notes,
                      width=width, wide=wide, right=(1, 2))
