"""The mesh in the fit search: which ``data`` × ``fsdp`` × ``expert`` × ``tensor`` factorization of a slice's chips,
with which policy, micro-batch and accumulation, trains a global batch fastest.

A mesh changes two things the fit planner measures: the bytes per device (FSDP and tensor parallelism divide the
parameters and optimizer state, ``data`` replicates them, ``expert`` divides a Mixture of Experts' experts; ``tensor``
divides each example's activations, the batch axes divide the batch) and the collectives per step
(:func:`jaxckpt.fit._speed.collective_bytes`). Compiles are what cost, so the search spends them where they decide:

1. **Enumerate** every factorization ``data × fsdp × expert × tensor`` of the chips with ``tensor`` ≤ ``max_tensor``
   (8 by default: tensor parallelism all-reduces activations every layer, so it stays within the fastest links, as
   Megatron-LM keeps it within a node and MaxText's recipes use ``tensor`` ≤ 8) and ``tensor`` dividing the
   model's attention heads when it says how many it has (``num_heads``) (a model without ``tensor`` axis names gets
   ``tensor=1``), and ``expert`` dividing its number of experts (a model without experts, parameters named ``exp``,
   gets ``expert=1``).
2. **Drop without compiling** the meshes whose train state alone — parameters, gradients and optimizer state,
   divided by ``fsdp × tensor`` — exceeds the memory per device: no batch can fit.
3. **Calibrate on one mesh**: the mesh with the least state per device (``fsdp`` = all chips) is fitted first; each
   policy's line (bytes = fixed + slope × batch) gives its activation bytes per example of a ``data × fsdp`` group
   and its fixed bytes beside the train state. For every other mesh that predicts, without a compile, the largest
   micro-batch (activations ÷ ``tensor``, an upper bound), hence the least accumulation k, and a **lower bound of
   its step time**: the collectives of k micro-steps (FSDP gathers repeat per micro-step) plus the tensor and data
   traffic of the step (:func:`jaxckpt.fit._speed.collective_bytes`, the ICI bandwidth of the chip); compute is the
   same on every mesh of the same chips and left out. A mesh where not one example fits beside its state is dropped.
4. **Fit the best** until ``max_meshes`` (default 3, the calibration included) are fitted with
   :func:`jaxckpt.fit.plan_fit` — per policy the largest micro-batch, verified by a compile that fits beside one that
   does not — and answer the fastest verified configuration over them.

Every compile of the search runs in a worker process (:func:`jaxckpt.step.isolated_compiles`): a native crash of the
compiler on one mesh (libtpu's SparseCore code generation overflowed its stack on a Mixtral 8x7B mesh) makes that
mesh's row ``compiler crashed``, naming the crash, and the search fits the next mesh in its place.

This is a search heuristic, not an optimum: a mesh ranked below ``max_meshes`` by the lower bound is not compiled
(the result lists it, with its bound, so a user can ask for it with ``--mesh``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxckpt.sharding._rules import mesh_axes_of, param_logical_axes
from jaxckpt.sharding._tensor_plan import tensor_split_sizes
from jaxckpt.errors import JaxckptError, MeshSpecError
from jaxckpt.fit._plan import FitPlan, plan_fit, traffic_of
from jaxckpt.fit._search import DEFAULT_POLICIES, NothingFitsError, resolve_memory
from jaxckpt.fit._speed import Accelerator, Traffic, accelerator, traffic_seconds
from jaxckpt.step._isolated import CompilerCrashError, isolated_compiles
from jaxckpt.step._targets import ModelTarget, Target
from jaxckpt.timing import within_resolution
from jaxckpt.sharding import format_mesh
from jaxckpt.sharding import MemoryFraction, Topology
from jaxckpt.step._job import compile_job
from jaxckpt._units import format_bytes

DEFAULT_MAX_MESHES = 3
"""Meshes fitted (compiled) by default, the best by the lower bound of their step time."""

CRASHED = "compiler crashed"
"""The status of a mesh whose compile crashed the compiler (:class:`jaxckpt.step.CompilerCrashError`): the search
went on without it, and fitted the next mesh in its place."""

DEFAULT_MAX_TENSOR = 8
"""Largest ``tensor`` axis enumerated (module docstring)."""

STATE_COPIES = 4
"""Train-state bytes per parameter byte: parameters, gradients and Adam's two moments in the weight dtype (the
default optimizer, :func:`jaxckpt.step.default_optimizer`; a step's own optimizer may keep less or more)."""


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(chips: int, *, max_tensor: int = DEFAULT_MAX_TENSOR, tensor_divides: int | None = None,
                tensor: bool = True, experts: int = 0) -> list[dict[str, int]]:
  """Every ``{"data": d, "fsdp": f, "expert": e, "tensor": t}`` with d·f·e·t = ``chips`` (axes of size 1 left out).

  Args:
    chips: devices of the slice (≥ 1).
    max_tensor: the largest ``tensor`` size enumerated.
    tensor_divides: a count the ``tensor`` size must divide (the model's attention heads), or ``None``.
    tensor: whether the model can use a ``tensor`` axis at all (parameters with logical axis names).
    experts: the model's number of experts (an ``expert`` size must divide it); 0: no ``expert`` axis.

  Returns:
    The shapes, ``tensor`` ascending, then ``expert``, then ``data`` ascending (``{"fsdp": chips}`` first).

  Raises:
    JaxckptError: ``chips`` < 1 or ``max_tensor`` < 1.
  """
  if chips < 1 or max_tensor < 1:
    raise JaxckptError(f"chips={chips} and max_tensor={max_tensor} must be ≥ 1")
  out = []
  for t in _divisors(chips):
    if t > 1 and (not tensor or t > max_tensor or (tensor_divides is not None and tensor_divides % t)):
      continue
    for e in _divisors(chips // t):
      if e > 1 and (not experts or experts % e):
        continue
      for d in _divisors(chips // t // e):
        f = chips // t // e // d
        out.append({k: v for k, v in (("data", d), ("fsdp", f), ("expert", e), ("tensor", t)) if v > 1}
                   or {"fsdp": 1})
  return out


def state_bytes(target: Target) -> tuple[int, int, int | None, bool]:
  """``(parameter bytes, train-state bytes, a count every tensor size must divide or None, uses tensor)`` of a model
  target, from its abstract model (``nnx.eval_shape``, nothing allocated): state = :data:`STATE_COPIES` × parameter
  bytes; the count is the greatest common divisor of the model's attention heads (``num_heads``) and the dimensions
  its tensor plan splits (:func:`jaxckpt.sharding.tensor_split_sizes`), ``None`` when it has neither.

  Raises:
    JaxckptError: a loss target (it has no model to read).
  """
  if not isinstance(target, ModelTarget):
    raise JaxckptError(f"mesh search needs a model target; {target.name!r} is a loss target: give its mesh")
  model = nnx.eval_shape(target.make_model)
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
  params = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves)
  names = {n for v in leaves for n in (param_logical_axes(v) or ()) if n is not None}
  uses_tensor = any("tensor" in mesh_axes_of(n, what=f"a parameter of {target.name}") for n in names)
  heads = getattr(model, "num_heads", None)
  divides = math.gcd(*([heads] if heads else []), *(n for _, n in tensor_split_sizes(model)))
  return params, STATE_COPIES * params, divides or None, uses_tensor


def expert_count(target: Target) -> int:
  """The number of experts of a model target (the size of its parameters' dimensions named ``exp``; their greatest
  common divisor if they differ), 0 without experts (a dense model, a loss target)."""
  if not isinstance(target, ModelTarget):
    return 0
  model = nnx.eval_shape(target.make_model)
  sizes = set()
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes, shape = param_logical_axes(leaf) or (), leaf.get_value().shape
    if len(axes) == len(shape):
      sizes |= {int(n) for a, n in zip(axes, shape) if a is not None and "expert" in mesh_axes_of(a)}
  return math.gcd(*sizes) if sizes else 0


@dataclasses.dataclass(frozen=True)
class MeshOption:
  """One mesh of the search.

  Attributes:
    shape: ``{axis: size}``.
    state_bytes_per_device: train state ÷ (fsdp × tensor), bytes.
    bound_s: the lower bound of its step time (collectives of the least accumulation predicted to fit), seconds.
    status: ``"fitted"`` (compiled: :attr:`plan`), ``"too big"`` (state over the memory, a global batch it cannot
      split, or no example predicted to fit: not compiled),
      ``"unmappable"`` (its axes cannot be laid over the torus even splitting a physical dimension,
      :meth:`jaxckpt.sharding.Topology.mesh`), ``"not fitted"`` (ranked below ``max_meshes``: not compiled), ``"nothing fits"`` or ``"refused"`` (compiled,
      :attr:`reason` says why), ``"compiler crashed"`` (:data:`CRASHED`: a compile of it crashed the compiler, in
      its worker process; :attr:`reason` names the signal and the compiler's last log line); ``"fitting"`` only in
      the progress callback, while its compiles run.
    plan: its :class:`~jaxckpt.fit.FitPlan` when fitted.
    reason: why it has no plan.
  """

  shape: Mapping[str, int]
  state_bytes_per_device: int
  bound_s: float
  status: str
  plan: FitPlan | None = None
  reason: str = ""

  @property
  def name(self) -> str:
    """``"data=2,fsdp=64,tensor=2"``."""
    return format_mesh(self.shape)

  def as_row(self) -> dict[str, Any]:
    """The JSON form (the plan's own JSON under ``plan``)."""
    return {"mesh": dict(self.shape), "status": self.status, "state_bytes_per_device": self.state_bytes_per_device,
            "bound_s": self.bound_s, "reason": self.reason, "plan": self.plan.as_json() if self.plan else None}


@dataclasses.dataclass(frozen=True)
class MeshSearch:
  """The answer of :func:`search_meshes`.

  Attributes:
    options: every mesh enumerated, best bound first.
    winner: the fitted mesh whose verified choice has the least estimated step time.
    limit_bytes: memory per device.
    seconds: wall seconds of the search.
  """

  options: tuple[MeshOption, ...]
  winner: MeshOption
  limit_bytes: int
  seconds: float

  @property
  def compiles(self) -> int:
    """Compiles in all (every fitted mesh's)."""
    return sum(o.plan.compiles for o in self.options if o.plan is not None)

  @property
  def close(self) -> list[tuple[MeshOption, float]]:
    """The other fitted meshes whose answer's estimated step is within :data:`jaxckpt.timing.RESOLUTION` of the
    winner's, each with how much slower it is (a fraction): a tie to the time model, fastest first."""
    best = self.winner.plan.choice.winner.step_s
    out = []
    for o in self.options:
      if o is not self.winner and o.plan is not None and o.plan.choice is not None:
        over = within_resolution(o.plan.choice.winner.step_s, best)
        if over is not None:
          out.append((o, over))
    return sorted(out, key=lambda pair: pair[1])

  def as_json(self) -> dict[str, Any]:
    """``{"mesh_search": {"winner": mesh, "meshes": [...], "close": [{"mesh", "over"}], "compiles", "seconds"}}``
    plus the winner's plan."""
    return {**self.winner.plan.as_json(), "mesh_search": {
        "winner": dict(self.winner.shape), "compiles": self.compiles, "seconds": round(self.seconds, 3),
        "limit_bytes": self.limit_bytes, "meshes": [o.as_row() for o in self.options],
        "close": [{"mesh": dict(o.shape), "over": round(over, 4)} for o, over in self.close]}}


def search_meshes(
    target: Target,
    policies: Sequence[Any] = DEFAULT_POLICIES,
    memory: int | str = "auto",
    *,
    topology: "str | Topology",
    global_batch: int,
    device: Accelerator | None = None,
    max_meshes: int = DEFAULT_MAX_MESHES,
    max_tensor: int = DEFAULT_MAX_TENSOR,
    on_compile: Callable[[str, int], None] | None = None,
    on_mesh: Callable[[MeshOption], None] | None = None,
    memory_fraction: "float | MemoryFraction | None" = None,
    **kwargs: Any,
) -> MeshSearch:
  """The fastest (mesh, policy, micro-batch, accumulation) for ``global_batch`` on a TPU slice (module docstring).

  Args:
    target: a model target (its parameters and logical axis names decide the meshes).
    policies: policy specs, as :func:`jaxckpt.fit.plan_fit`.
    memory: bytes per device (``"auto"``: the chip's HBM less the margin).
    topology: the slice (``"v6e:16x16"``), compiled for without a TPU.
    global_batch: examples per optimizer step G (a multiple of every fitted mesh's ``data × fsdp``; a mesh it is
      not is dropped with the reason).
    device: the time model's accelerator (default: the topology's chip).
    max_meshes: meshes fitted (compiled), ≥ 1.
    max_tensor: largest ``tensor`` size enumerated.
    on_compile: progress callback ``(policy, batch)``; on_mesh: called with each mesh fitted as its compiles start
      (status ``"fitting"``) and as it is settled.
    memory_fraction: a GPU topology's share of memory XLA may use (:func:`jaxckpt.sharding.memory_fraction`).
    **kwargs: passed to :func:`jaxckpt.fit.plan_fit` (``min_batch``, ``jobs``, ``rank_compiled``...);
      ``rank_compiled`` defaults to 1 here: each mesh's winner is timed from the program its verification compile
      made, and the meshes are ranked by those estimates (more: that many compiles more per mesh).

  Returns:
    The :class:`MeshSearch`.

  Raises:
    NothingFitsError: no fitted mesh fits any policy (each mesh's reason in the message).
    JaxckptError: ``max_meshes`` < 1, ``global_batch`` < 1, a ``min_batch`` above it, a loss target.
    TopologyError: a bad topology, libtpu missing.
  """
  started = time.perf_counter()
  kwargs.setdefault("rank_compiled", 1)
  if max_meshes < 1:
    raise JaxckptError(f"max_meshes={max_meshes} must be ≥ 1")
  if global_batch < 1:
    raise JaxckptError(f"global_batch_size={global_batch} must be ≥ 1")
  if (kwargs.get("min_batch") or 1) > global_batch:  # bad input, not a reason of every mesh
    raise JaxckptError(f"min_batch={kwargs['min_batch']} > global_batch_size={global_batch}: no micro-batch between")
  with isolated_compiles():  # its worker starts now (imports JAX meanwhile); a compiler crash ends one mesh only
    placement = compile_job(target, topology=topology, memory_fraction=memory_fraction, check_batch=False).placement
    topo = placement.topology
    limit, _ = resolve_memory(memory, placement=placement)
    device = device or accelerator(device=topo.devices[0])
    bounds = _Bounds(target, global_batch, device)
    options = bounds.options(topo.chips, limit, max_tensor)
    for i, option in enumerate(options):  # a mesh that cannot be laid over the torus is not a candidate
      try:
        topo.mesh(dict(option.shape))
      except MeshSpecError as err:
        options[i] = dataclasses.replace(option, status="unmappable", reason=str(err))

    def fit(i: int, guesses: Mapping[str, int] | None = None) -> None:
      option = options[i]
      if on_mesh is not None:  # before its compiles: a compiler that crashes the process has named the mesh
        on_mesh(dataclasses.replace(option, status="fitting"))
      try:
        plan = plan_fit(target, policies, memory, global_batch=global_batch, device=device,
                        mesh=placement.with_mesh(dict(option.shape)), on_compile=on_compile, guesses=guesses,
                        **kwargs)
        options[i] = dataclasses.replace(option, status="fitted", plan=plan)
      except NothingFitsError as err:
        options[i] = dataclasses.replace(option, status="nothing fits", reason=str(err))
      except CompilerCrashError as err:  # a native crash in one compile (in its worker): this mesh only
        options[i] = dataclasses.replace(option, status=CRASHED, reason=str(err))
      except (MeshSpecError, JaxckptError) as err:
        options[i] = dataclasses.replace(option, status="refused", reason=str(err))
      if on_mesh is not None:
        on_mesh(options[i])

    open_ = [i for i, o in enumerate(options) if o.status == "not fitted"]
    if open_:  # calibrate on the least state per device (no tensor axis when one ties), then bound the others
      first = min(open_, key=lambda i: (options[i].state_bytes_per_device, options[i].shape.get("tensor", 1),
                                        options[i].bound_s))
      fit(first)
      calibration = options[first]
      options = bounds.calibrated(options, first, limit)
    options.sort(key=lambda o: (o.status in ("too big", "unmappable", "not fitted"), o.status == "unmappable",
                                o.bound_s, o.state_bytes_per_device))
    fitted = sum(o.status not in ("too big", "unmappable", "not fitted", CRASHED) for o in options)
    for i, option in enumerate(options):
      if option.status == "not fitted" and fitted < max_meshes:
        fit(i, bounds.guesses(calibration, option, limit))  # each policy's first compiles where its line says
        fitted += options[i].status != CRASHED  # a crashed mesh leaves its place to the next
  done = [o for o in options if o.plan is not None and o.plan.choice is not None]
  if not done:
    tried = "; ".join(f"{o.name}: {o.status}" + (f" ({o.reason})" if o.reason else "") for o in options
                      if o.status != "not fitted")
    raise NothingFitsError(f"no mesh of {topo.name}'s {topo.chips} chips fits global_batch_size={global_batch} "
                           f"within {format_bytes(limit)} per device: {tried}")
  winner = min(done, key=lambda o: o.plan.choice.winner.step_s)
  return MeshSearch(tuple(options), winner, limit, time.perf_counter() - started)


class _Bounds:
  """The search's compile-free figures for one target and global batch: meshes, state per device, step-time bounds.

  Args:
    target: the model target; global_batch: examples per step; device: the time model's accelerator.
  """

  def __init__(self, target: Target, global_batch: int, device: Accelerator):
    self.params, self.state, self.heads, self.uses_tensor = state_bytes(target)
    self.traffic = traffic_of(target) or Traffic()
    self.experts = expert_count(target)
    self.global_batch = global_batch
    self.device = device

  def state_per_device(self, shape: Mapping[str, int]) -> int:
    """Train-state bytes per device: ÷ (fsdp × tensor), the experts' share ÷ expert too."""
    split = shape.get("fsdp", 1) * shape.get("tensor", 1)
    experts = STATE_COPIES * self.traffic.expert_param_bytes
    return int((self.state - experts) // split + experts // (split * shape.get("expert", 1)))

  def bound(self, shape: Mapping[str, int], accum: int = 1) -> float:
    """Collectives of a step of ``accum`` micro-steps at the global batch, seconds (a lower bound: no compute),
    each axis over its link (:func:`jaxckpt.fit._speed.traffic_seconds`)."""
    units = shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)
    fsdp_micro, per_step = traffic_seconds(self.device, self.params, shape,
                                           expert_param_bytes=self.traffic.expert_param_bytes)
    traffic = dataclasses.replace(self.traffic, expert_param_bytes=0.0)  # the activations' terms of the whole step
    activations = traffic_seconds(self.device, 0.0, shape, **traffic.per_device(self.global_batch / units))[0]
    return accum * fsdp_micro + activations + per_step

  def options(self, chips: int, limit: int, max_tensor: int) -> list[MeshOption]:
    """Every mesh of ``chips`` with its state per device and bound; ``too big`` where the state exceeds ``limit``
    bytes or ``data × fsdp`` does not divide the global batch."""
    out = []
    for shape in mesh_shapes(chips, max_tensor=max_tensor, tensor_divides=self.heads, tensor=self.uses_tensor,
                             experts=self.experts):
      per_device = self.state_per_device(shape)
      units = shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)
      if per_device > limit:
        reason = f"train state {format_bytes(per_device)} per device > {format_bytes(limit)}"
      elif self.global_batch % units:
        reason = f"global batch {self.global_batch} is not a multiple of data × fsdp × expert = {units}"
      else:
        reason = ""
      out.append(MeshOption(shape, per_device, self.bound(shape), "too big" if reason else "not fitted",
                            reason=reason))
    return out

  def guesses(self, calibration: MeshOption, option: MeshOption, limit: int) -> dict[str, int]:
    """Per fixed policy of ``calibration``'s plan, the largest micro-batch of ``option`` its line predicts (fixed
    bytes beside the train state, bytes per example of a data × fsdp group ÷ tensor; the line through its compiles
    the compiler did not refuse, else its first two), at most the global batch; none where not one example fits.
    The fit compiles that batch and its successor first (:func:`jaxckpt.fit.max_batch_size`'s ``guess``)."""
    units = option.shape.get("data", 1) * option.shape.get("fsdp", 1) * option.shape.get("expert", 1)
    out: dict[str, int] = {}
    for f in calibration.plan.fits if calibration.plan is not None else ():
      line = f.compiled_line()
      if line.slope <= 0:
        continue
      per_group = ((limit - (line.intercept - calibration.state_bytes_per_device) - option.state_bytes_per_device)
                   / (line.slope * f.unit / option.shape.get("tensor", 1)))
      if per_group >= 1:
        out[f.policy] = min(self.global_batch, math.floor(per_group) * units)
    return out

  def calibrated(self, options: list[MeshOption], first: int, limit: int) -> list[MeshOption]:
    """``options`` with each unfitted mesh's bound at its least accumulation, predicted from ``options[first]``'s
    fits (per policy: fixed bytes beside the train state, bytes per example of a data × fsdp group; activations ÷
    tensor, an upper bound of the batch, so the accumulation and the bound stay lower bounds); a mesh where not one
    example fits is ``too big``."""
    calibration = options[first]
    fitted = [(f, f.compiled_line()) for f in (calibration.plan.fits if calibration.plan is not None else ())]
    lines = [(line.intercept - calibration.state_bytes_per_device, line.slope * f.unit) for f, line in fitted
             if line.slope > 0]
    if not lines:
      return options
    out = list(options)
    for i, o in enumerate(options):
      if o.status != "not fitted":
        continue
      units = o.shape.get("data", 1) * o.shape.get("fsdp", 1) * o.shape.get("expert", 1)
      per_group = max((limit - fixed - o.state_bytes_per_device) / (slope / o.shape.get("tensor", 1))
                      for fixed, slope in lines)
      if per_group < 1:
        out[i] = dataclasses.replace(o, status="too big", reason=(
            f"predicted from {calibration.name}'s compiles: not one example per data × fsdp group fits beside "
            f"{format_bytes(o.state_bytes_per_device)} of train state"))
      else:
        out[i] = dataclasses.replace(o, bound_s=self.bound(o.shape, math.ceil(
            self.global_batch / (units * math.floor(per_group)))))
    return out
