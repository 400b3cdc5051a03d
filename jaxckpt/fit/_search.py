"""The largest micro-batch that fits a device, per policy, from a handful of compiles, verified.

Method (per policy):

1. compile the train step at two batch sizes (``probes``, default 16 and 64 mesh batch units) and fit the
   footprint ``a + b·batch`` (:mod:`jaxckpt.fit._model`); for the second and later policies of a target
   (:func:`fit_policies`), the batch-independent bytes ``a`` (parameters, gradients, optimizer state) of the previous
   policy stand in for the small probe, so the second compile is already at the predicted crossing;
2. predict the largest batch whose footprint is ≤ the device memory;
3. **verify** by compiling at the predicted batch and its successor: the first must fit, the second must not.
   When either check fails, refit the line through the compiled points nearest the crossing (a secant step) and
   verify again; after ``max_rounds`` such rounds, bisect between the largest batch that fit and the smallest that
   did not (the footprint is not affine there: :attr:`BatchFit.method` says ``"search"``).

The answer is therefore always a batch that compiled within the memory next to one that compiled over it, never
an extrapolation. Compiles are stats-only (nothing is allocated), so a laptop plans for an 80 GiB accelerator.

Prior art: Hugging Face Accelerate's ``find_executable_batch_size`` halves the batch on every out-of-memory run;
MaxText's memory estimator binary-searches ahead-of-time compiles (~log₂(range) compiles per policy). Here the
affine model replaces the search; on the benchmarked models it needs about four compiles per policy
(``benchmarks/fit_planner.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from jaxckpt.errors import JaxckptError
from jaxckpt.fit._model import AffineModel, fit_affine, tangent_at_crossing
from jaxckpt.planner._plan import resolve_policy
from jaxckpt.policies._model import Budget, parse_model_policy
from jaxckpt.policies._model import DEFAULT_MARGIN
from jaxckpt.sharding import BATCH_AXES, mesh_platform, mesh_shape
from jaxckpt.sharding import Placement, Topology, compiles_only
from jaxckpt.step._job import CompileJob, compile_job
from jaxckpt.step._targets import ModelTarget, Target, batch_size_of, shipped_target, with_batch
from jaxckpt.step._compile import lower_policy
from jaxckpt._units import format_bytes, parse_bytes

DEFAULT_POLICIES: tuple[str, ...] = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
"""The policies the fit planner compares by default: the built-in ones that apply to any model without arguments —
no remat, full remat and the two matmul-saving ones (about 3–4 compiles each). Left out, with the reason:
``everything_saveable`` (the memory of ``none``); ``save_only_these_names`` and the other per-name ones (they need
names: give them as specs); the offload ones (they need a host memory space the CPU backend lacks); ``budget:…`` and
``auto`` (a plan chosen *for* one batch: at the largest batch it is its least-memory plan, the ``nothing_saveable``
row; refused); ``min_saved`` and ``mincut:<cap>`` (opt-in: each compile also solves a 0-1 program, ~1.5× a compile
on GPT ``tiny``, and the plan wraps the whole loss, so the experiments' ``--policy`` cannot run it; add them with
``policies=``)."""

DEFAULT_MAX_BATCH = 4096
"""The largest batch size searched by default."""


class NothingFitsError(JaxckptError):
  """Not even the smallest batch fits the memory under any policy."""


@dataclasses.dataclass(frozen=True)
class FitPoint:
  """One compile of the train step at one batch size.

  Attributes:
    batch: examples per step (global, over the mesh's batch axes).
    footprint_bytes: compiled argument + output + temp − alias bytes (per device under a mesh).
    flops: FLOPs of the step counted from its jaxpr (scan bodies × trip count, recompute included).
    bytes_accessed: XLA's ``cost_analysis()["bytes accessed"]`` scaled by ``flops / xla_flops`` (XLA counts a loop
      body once), or ``None`` where the backend has no cost analysis.
    compile_s: seconds to trace, lower and compile.
    host_bytes: the compiled host footprint per device (what an offload policy keeps in ``pinned_host`` memory;
      0 without offload), ``None`` where unknown (a refused compile).
    param_bytes: bytes of the model's parameters (all of them, over the whole mesh; the time model's collectives).
    refused: the compiler refused the program for the device's memory (``footprint_bytes`` is the memory its
      message names, :func:`exhausted_bytes`): a point over any limit, usually seconds rather than a whole compile.
    step_time: what :func:`compile_point`'s ``timing`` made of the compiled step (its estimated step time), else
      ``None``.
  """

  batch: int
  footprint_bytes: int
  flops: int
  bytes_accessed: float | None
  compile_s: float
  host_bytes: int | None = None
  param_bytes: int = 0
  refused: bool = False
  step_time: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchFit:
  """The largest batch size of one policy that fits a memory, verified by compiles.

  Attributes:
    policy: the policy's text.
    max_batch_size: the largest batch (a multiple of :attr:`unit`) whose compiled footprint ≤ :attr:`limit_bytes`,
      or ``None`` when even ``min_batch`` does not fit.
    footprint_bytes: compiled footprint at :attr:`max_batch_size` (at ``min_batch`` when ``None``).
    limit_bytes: the memory it had to fit (per device).
    compiles: compiles used for this policy (probes, predictions and verification).
    model: the affine footprint model fitted to the first two compiles (slope, intercept in bytes).
    points: every compile, in order.
    method: ``"affine"`` (the prediction, or a secant correction, was verified) or ``"search"`` (bisection, after
      ``max_rounds`` misses: the footprint is not affine over that range).
    capped: the largest batch searched (``max_batch``) fit; the true largest may be larger
      (:attr:`estimated_max_batch`).
    verified_over: footprint at the successor batch (over the limit), ``None`` when capped or nothing fits.
    unit: the batch step (the mesh's batch-axis size, 1 on one device).
    seconds: wall seconds.
    estimated_max_batch: when :attr:`capped` (a batch search; a sequence length's footprint is not affine), the
      largest batch within the limit by the line through the two
      compiled (not refused) points of the largest batches, uncapped, not compiled (the fit planner caps the search
      at the global batch, so beyond it the answer is a prediction: compile it with ``max_batch``); else ``None``.
  """

  policy: str
  max_batch_size: int | None
  footprint_bytes: int
  limit_bytes: int
  compiles: int
  model: AffineModel
  points: tuple[FitPoint, ...]
  method: str
  capped: bool
  verified_over: int | None
  unit: int
  seconds: float
  estimated_max_batch: int | None = None

  def compiled_line(self) -> AffineModel:
    """Footprint per device against the batch: the line through the compiles the compiler did not refuse (a refusal
    names the temporaries of another schedule, not a footprint), else :attr:`model` with fewer than two batches."""
    kept = [(p.batch, p.footprint_bytes) for p in self.points if not p.refused]
    return fit_affine(kept) if len({b for b, _ in kept}) > 1 else self.model

  @property
  def by_batch(self) -> dict[int, FitPoint]:
    """The compiled points by batch size."""
    return {p.batch: p for p in self.points}

  def as_row(self) -> dict[str, Any]:
    """The JSON row: policy, max_batch_size (global) and batch_unit (the mesh's batch-axis size: per device
    ``max_batch_size // batch_unit``), footprint_bytes, compiles, the model and the compiled points."""
    return {"policy": self.policy, "max_batch_size": self.max_batch_size, "batch_unit": self.unit,
            "footprint_bytes": self.footprint_bytes,
            "limit_bytes": self.limit_bytes, "compiles": self.compiles, "method": self.method, "capped": self.capped,
            "estimated_max_batch": self.estimated_max_batch, "over_bytes_at_next": self.verified_over,
            "model": {"intercept_bytes": round(self.model.intercept), "slope_bytes": round(self.model.slope)},
            "points": [dataclasses.asdict(p) for p in self.points], "seconds": round(self.seconds, 3)}


def with_seq_len(target: Target, seq_len: int) -> Target:
  """A shipped sequence model at another sequence length (tokens per example).

  Raises:
    JaxckptError: ``target`` is not a shipped model (its ``ref``), or not a sequence model (the registry says so).
  """
  ref = target.ref or {}
  if not (isinstance(target, ModelTarget) and "model" in ref):
    raise JaxckptError("seq_len search needs a shipped sequence model (model='gpt'); a user's target sets its own "
                       "shapes")
  return shipped_target(**{**ref, "seq_len": seq_len})


def batch_unit(mesh: Any) -> int:
  """The batch step of a mesh: the product of its batch axes (``data`` × ``fsdp``), 1 for ``None``."""
  if mesh is None:
    return 1
  shape = mesh_shape(mesh)
  return math.prod(shape.get(a, 1) for a in BATCH_AXES)


def resolve_memory(memory: int | str, *, margin: float = DEFAULT_MARGIN,
                   placement: Placement | None = None) -> tuple[int, str]:
  """The memory to fit, in bytes per device, and where it came from.

  Args:
    memory: ``"auto"`` (the device's memory less ``margin``, as the policy ``auto`` plans for:
      :meth:`jaxckpt.sharding.Placement.memory`; a TPU chip's HBM, a GPU's memory × its memory fraction), a size
      string in binary units (``"80GiB"``), or int bytes.
    margin: share of the device's memory ``auto`` leaves free, in [0, 1).
    placement: where the step is compiled (its first device is fitted); default this machine's first device.

  Returns:
    ``(bytes, source)``.

  Raises:
    JaxckptError: a size that does not parse, or ≤ 0.
  """
  if isinstance(memory, str) and memory.strip() == "auto":
    available, source = (placement or Placement()).memory()
    return int(available * (1 - margin)), f"{source} {format_bytes(available)} − {margin * 100:g}% margin"
  if isinstance(memory, str):
    try:
      value = parse_bytes(memory)
    except ValueError as err:
      raise JaxckptError(f"memory={memory!r}: {err}; or auto (this device's memory less {DEFAULT_MARGIN:.0%})") from err
  else:
    value = int(memory)
  if value <= 0:
    raise JaxckptError(f"memory={memory!r} must be > 0 bytes")
  return value, "given"


def _concrete(target: Target, policy: Any, tx, mesh, options) -> Any:
  """A policy the step compiles: named/layered as they are; ``min_saved``/``mincut`` resolved for this target
  (:func:`jaxckpt.planner.resolve_policy` returns a concrete policy unchanged; budgets were refused at the entry)."""
  return resolve_policy(target, policy, tx=tx, compiler_options=options, mesh=mesh)[0]


_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED.*?required[^(]*\(([0-9.]+)([KMGT]?)i?B?\) exceeds available", re.S)


def exhausted_bytes(err: BaseException) -> int | None:
  """The bytes a program requires according to a compiler that refused it for the device's memory, or ``None`` for
  any other error.

  The TPU compiler refuses, at compile time, a program whose peak exceeds the chip: ``RESOURCE_EXHAUSTED: Ran out of
  memory on HBM, the total memory required for HLO temporaries (18.35G) exceeds available HBM (15.75G)`` (libtpu
  0.0.42.1; binary units, as XLA prints sizes: v5e's 16 GiB less 256 MiB is its 15.75G).
  """
  match = _EXHAUSTED.search(str(err))
  if match is None:
    return None
  return int(float(match.group(1)) * 1024 ** "_KMGT".index(match.group(2) or "_"))


def compile_point(target: Target, policy: Any, batch: int, *, tx=None, mesh=None, options=None,
                  grad_accum_steps: int = 1, seq_len: int | None = None,
                  timing: Callable[[Any], Any] | None = None) -> FitPoint:
  """Compiles the step of ``target`` at ``batch`` (and ``seq_len``) under ``policy``; returns its :class:`FitPoint`.

  ``timing``, given the :class:`~jaxckpt.step.CompiledPolicy` (its program text kept), fills the point's
  ``step_time`` (the fit's compiled ranking: ``lambda c: step_time_of(c, topology=..., mesh=...).as_dict()``).

  A compile the compiler refuses because the program exceeds the device's memory (the TPU compiler checks a
  topology's chip at compile time: :func:`exhausted_bytes`) is a point over any limit, its footprint the memory the
  compiler says the program requires.

  Raises:
    JaxckptError: the backend reports no memory stats; whatever :func:`~jaxckpt.step.compile_policy` raises.
  """
  return _compiled_point(*_lowered_point(target, policy, batch, tx=tx, mesh=mesh, options=options,
                                         grad_accum_steps=grad_accum_steps, seq_len=seq_len), timing=timing)


def _lowered_point(target: Target, policy: Any, batch: int, *, tx=None, mesh=None, options=None,
                   grad_accum_steps: int = 1, seq_len: int | None = None) -> tuple[int, Any, Any, float]:
  """The first half of :func:`compile_point` (in the caller's thread: tracing holds the GIL): ``(batch, lowered
  step, mesh, start time)``."""
  started = time.perf_counter()
  policy = parse_model_policy(policy)
  sized = with_batch(target if seq_len is None else with_seq_len(target, seq_len), batch,
                     grad_accum_steps=grad_accum_steps)
  lowered = lower_policy(sized, _concrete(sized, policy, tx, mesh, options), tx=tx, mesh=mesh, options=options)
  return batch, lowered, mesh, started


def _compiled_point(batch: int, lowered: Any, mesh: Any, started: float, *,
                    timing: Callable[[Any], Any] | None = None) -> FitPoint:
  """The second half of :func:`compile_point`: XLA's compile (it releases the GIL, so two can run at once)."""
  try:
    compiled = lowered.compile(program_text=timing is not None)
  except Exception as err:  # noqa: BLE001 - a compiler that refuses a program over the chip's memory: "over"
    required = exhausted_bytes(err)
    if required is None:
      raise
    return FitPoint(batch, required, int(lowered.flops), None, time.perf_counter() - started,
                    param_bytes=_param_bytes(lowered), refused=True)
  footprint = compiled.memory.get("footprint_bytes")
  if footprint is None:
    raise JaxckptError(f"the backend ({mesh_platform(mesh)}) reports no compiled memory stats; the fit planner "
                       "needs them")
  xla_flops, xla_bytes = compiled.cost.get("flops"), compiled.cost.get("bytes accessed")
  accessed = None
  if xla_bytes is not None:
    accessed = float(xla_bytes) * (compiled.flops / xla_flops if xla_flops else 1.0)
  return FitPoint(batch, int(footprint), int(compiled.flops), accessed, time.perf_counter() - started,
                  host_bytes=compiled.memory.get("host_footprint_bytes") or 0, param_bytes=_param_bytes(lowered),
                  step_time=None if timing is None else timing(compiled))


def _param_bytes(lowered: Any) -> int:
  """Bytes of the step's parameters (abstract leaves: shape × itemsize), 0 where the step has none to read."""
  params = getattr(getattr(lowered, "step", None), "params", None)
  return sum(math.prod(leaf.shape) * getattr(leaf.dtype, "itemsize", 0) for leaf in jax.tree.leaves(params)
             if hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _beyond(points: Mapping[int, FitPoint], limit: int, unit: int) -> int | None:
  """The largest batch within ``limit`` by the line through the two largest compiled batches (not refused), or
  ``None`` with fewer than two or a line that does not grow."""
  top = sorted((p for p in points.values() if not p.refused), key=lambda p: p.batch)[-2:]
  if len(top) < 2 or top[1].footprint_bytes <= top[0].footprint_bytes:
    return None
  return fit_affine([(p.batch, p.footprint_bytes) for p in top]).largest_within(limit, step=unit)


def max_batch_size(
    target: Target,
    policy: Any,
    memory: int | str = "auto",
    *,
    mesh: Any = None,
    tx: optax.GradientTransformation | None = None,
    min_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    probes: Sequence[int] = (16, 64),
    max_rounds: int = 3,
    compiler_options: Mapping[str, Any] | None = None,
    on_compile: Callable[[str, int], None] | None = None,
    axis: str = "batch",
    intercept_hint: float | None = None,
    topology: "str | Topology | None" = None,
    jobs: int | None = None,
    guess: int | None = None,
    memory_fraction: float | None = None,
) -> BatchFit:
  """The largest batch size of ``target`` under ``policy`` whose compiled footprint fits ``memory`` (module docstring).

  Args:
    target: a :class:`~jaxckpt.step.ModelTarget` or :class:`~jaxckpt.step.LossTarget` (its batch size is ignored).
    policy: a policy spec string or parsed policy: named, per block, layered, ``min_saved`` or ``mincut:<cap>``
      (resolved at each batch size). Budgets (``budget:…``, ``auto``) are refused: a budget is a policy chosen *for*
      a batch.
    memory: bytes per device to fit: ``"auto"``, a size (``"16GiB"``) or int (:func:`resolve_memory`).
    mesh: a ``jax.sharding.Mesh``: compile sharded, memory per device; batch sizes are multiples of its batch axes.
    tx: the optimizer (default ``optax.adamw(1e-3)``; its state counts in the footprint).
    min_batch: the smallest batch considered (default one mesh batch unit); must be a multiple of that unit.
    max_batch: the largest batch considered (≥ ``min_batch``).
    probes: the two (or more) batch sizes of the affine fit, in mesh batch units (clipped to the range); the
      line interpolates where the answer lies between them, and small batches (where XLA's choices differ most from
      affine) are compiled only when the answer is there.
    max_rounds: secant corrections before falling back to bisection (≥ 1).
    compiler_options: extra XLA options.
    on_compile: called ``(policy, batch)`` before each compile (a progress bar).
    axis: ``"batch"``, or ``"seq_len"``: search the sequence length at the target's batch size instead (shipped
      sequence models; use :func:`max_seq_len`).
    intercept_hint: bytes at batch 0 from another policy of the same target (parameters, gradients and optimizer
      state do not depend on the policy; :func:`fit_policies` passes the previous policy's). With it, only the
      largest probe is compiled and the second point of the line is the batch that the hint and that probe predict:
      a compile next to the crossing, so the verification often needs one more compile instead of two (three in
      all). A wrong hint costs compiles, never exactness. Not used when the probes meet at ``max_batch`` (a
      global batch below them): that batch and ``min_batch`` are compiled together instead.
    topology: fit a TPU slice or GPU cluster without its hardware (``"v5e:2x2"``, ``"h100:8"``,
      :mod:`jaxckpt.sharding`): ``mesh`` (a ``--mesh`` spec, or ``None``: every chip on ``data``) laid over its chips,
      compiled by its compiler; ``memory="auto"`` is the chip's memory (a GPU's × its memory fraction) less the
      margin. ``mesh`` may also be a :class:`~jaxckpt.sharding.Placement` (mesh, topology and fraction at once).
    jobs: compiles at once. With 2 or more, a predicted batch and its successor, the pair that verifies an answer,
      are compiled together (the successor speculatively: when the prediction does not fit, it was one compile too
      many, still a point of the search). ``None``: 2 for a topology (TPU compiles take seconds to minutes, growing
      with the batch), else 1.
    guess: a predicted largest batch (another mesh's line, :func:`jaxckpt.fit.search_meshes`): it and its
      successor, the pair that verifies an answer, are compiled first (together with ``jobs`` ≥ 2) and make the
      first line, instead of the probes and ``intercept_hint``; clipped to the range. A guess at ``max_batch``
      that fits is the answer in one compile (no line: :attr:`BatchFit.model` is flat there and no
      ``estimated_max_batch``). A wrong guess costs compiles, never exactness.
    memory_fraction: a GPU topology's share of memory XLA may use (:func:`jaxckpt.sharding.memory_fraction`).

  Returns:
    The :class:`BatchFit`: ``max_batch_size`` (or ``None`` when ``min_batch`` does not fit), the footprint there,
    the compiles used, the affine model and every compiled point.

  Raises:
    JaxckptError: an empty batch range, a ``min_batch`` the mesh does not divide, a budget policy, a footprint that
      does not grow with the batch, ``max_rounds`` < 1, ``jobs`` < 1; PolicySpecError: a spec that does not parse;
      TopologyError: a bad topology or libtpu missing.

  Example::

    >>> fit = max_batch_size(shipped_target("gpt", "small"), "nothing_saveable", "4GiB")
    >>> fit.max_batch_size, fit.compiles
  """
  job = compile_job(target, mesh=mesh, topology=topology, memory_fraction=memory_fraction, tx=tx,
                    compiler_options=compiler_options, check_batch=False)  # the batch is what the search chooses
  search = _Search.start(job, policy, memory, min_batch=min_batch, max_batch=max_batch, max_rounds=max_rounds,
                         jobs=jobs, axis=axis, on_compile=on_compile)
  model, at_cap = _probe(search, probes, guess, intercept_hint)
  if len(search.points) > 1 and model.slope <= 0 and not any(p.refused for p in list(search.points.values())[:2]) \
      and not search.settled():
    model.largest_within(search.limit)  # raises: the footprint does not grow with the batch
  # a probe refused by the compiler names the bytes of a differently scheduled program, and compiles of nearly the
  # same bytes may come out in either order (Llama 3.1 8B on v6e-256's data=32,fsdp=8: 0.72 GB less at 4 per chip
  # than at 1): a line that does not grow is then no error; the answer is settled already, or bisected
  if search.settled() or at_cap:  # the first compiles answer already (a guess or a pinned batch verified)
    return search.answer("affine", model)
  answer = _predict_and_verify(search, model, max_rounds)
  return answer if answer is not None else _bisect(search, model)


@dataclasses.dataclass
class _Search:
  """One batch search of :func:`max_batch_size`: its range and memory, the compiles made, and how to make more.

  Attributes:
    target, parsed, text: what is compiled, under which policy (parsed, and its text).
    limit: bytes per device to fit.
    unit: the batch step (the mesh's batch axes' product; 1 for a sequence length).
    lo, hi: the smallest and largest batch considered (multiples of ``unit``).
    jobs: compiles at once.
    axis: ``"batch"`` or ``"seq_len"``.
    lower: ``batch -> (batch, lowered, mesh, started)``, the tracing half of a compile.
    started: ``time.perf_counter()`` at the start.
    points: batch -> its compiled :class:`FitPoint`, in compile order.
  """

  target: Target
  parsed: Any
  text: str
  limit: int
  unit: int
  lo: int
  hi: int
  jobs: int
  axis: str
  lower: Callable[[int], tuple[int, Any, Any, float]]
  started: float
  points: dict[int, FitPoint] = dataclasses.field(default_factory=dict)

  @classmethod
  def start(cls, job: CompileJob, policy: Any, memory: int | str, *, min_batch: int | None, max_batch: int,
            max_rounds: int, jobs: int | None, axis: str, on_compile: Any) -> "_Search":
    """The search's record for ``job`` (:func:`jaxckpt.step.compile_job`), its arguments checked
    (:func:`max_batch_size`'s errors)."""
    started = time.perf_counter()
    target, placement, mesh, tx, compiler_options = job.target, job.placement, job.mesh, job.tx, job.compiler_options
    parsed = parse_model_policy(policy)
    if isinstance(parsed, Budget):
      raise JaxckptError(f"policy={str(parsed)!r} is a memory budget, a plan chosen for one batch size: its largest "
                         "batch is that of the least-memory plan it can choose (the nothing_saveable row); give fixed "
                         "policies (none, nothing_saveable, dots_saveable, min_saved, mincut:<cap>, ...)")
    if max_rounds < 1:
      raise JaxckptError(f"max_rounds={max_rounds} must be ≥ 1")
    jobs = (2 if compiles_only(mesh) else 1) if jobs is None else jobs
    if jobs < 1:
      raise JaxckptError(f"jobs={jobs} must be ≥ 1")
    if axis not in ("batch", "seq_len"):
      raise JaxckptError(f"axis={axis!r}: valid axes are batch, seq_len")
    if axis == "seq_len":
      with_seq_len(target, 1)  # raises for targets without a sequence length
    unit = batch_unit(mesh) if axis == "batch" else 1
    lo = unit if min_batch is None else min_batch
    if lo < 1 or lo % unit:
      raise JaxckptError(f"min_batch={lo} must be ≥ 1 and a multiple of the mesh's batch axes ({unit} devices)")
    hi = max_batch - max_batch % unit
    if hi < lo:
      raise JaxckptError(f"the batch range is empty: min_batch={lo} > max_batch={max_batch}"
                         + (f" (in multiples of {unit})" if unit > 1 else ""))
    limit, _ = resolve_memory(memory, placement=placement)
    text = str(parsed)

    def lower(batch: int) -> tuple[int, Any, Any, float]:
      if on_compile is not None:
        on_compile(text, batch)
      if axis == "seq_len":
        return _lowered_point(target, parsed, batch_size_of(target), tx=tx, mesh=mesh, options=compiler_options,
                              seq_len=batch)
      return _lowered_point(target, parsed, batch, tx=tx, mesh=mesh, options=compiler_options)

    return cls(target, parsed, text, limit, unit, lo, hi, jobs, axis, lower, started)

  def at(self, *batches: int) -> FitPoint:
    """Compiles each batch not compiled yet, :attr:`jobs` at once (traced here, compiled in threads); returns the
    first's point."""
    todo = [b for b in dict.fromkeys(batches) if b not in self.points and self.lo <= b <= self.hi]
    if len(todo) > 1 and self.jobs > 1:
      with concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs) as pool:
        futures = [pool.submit(_compiled_point, *self.lower(b)) for b in todo]
        for b, future in zip(todo, futures):
          self.points[b] = future.result()
    else:
      for b in todo:
        self.points[b] = _compiled_point(*self.lower(b))
    for b in todo:
      self.points[b] = dataclasses.replace(self.points[b], batch=b)
    return self.points[batches[0]]

  def with_next(self, batch: int) -> tuple[int, ...]:
    """``batch``, and with :attr:`jobs` > 1 its successor too (the verification pair, compiled together)."""
    return (batch, batch + self.unit) if self.jobs > 1 and batch not in self.points else (batch,)

  def bracket(self) -> tuple[int, int | None]:
    """(largest batch that fit, or ``lo`` − unit when none did; smallest batch over the limit, or None)."""
    fit = [b for b, p in self.points.items() if p.footprint_bytes <= self.limit]
    over = [b for b, p in self.points.items() if p.footprint_bytes > self.limit]
    return max(fit, default=self.lo - self.unit), min(over, default=None)

  def settled(self) -> bool:
    """Whether the answer is compiled: the cap fits, or a fitting batch sits next to one over the limit."""
    lo, hi = self.bracket()
    return lo == self.hi or (hi is not None and hi == lo + self.unit)

  def answer(self, method: str, model: AffineModel) -> BatchFit:
    """The :class:`BatchFit` of the largest batch that fit (compiling ``lo`` first when none did)."""
    best, _ = self.bracket()
    if best < self.lo:
      self.at(self.lo)  # the footprint nothing fits at (already compiled when settled)
    best = best if best >= self.lo else None
    points, unit = self.points, self.unit
    over = points[best + unit].footprint_bytes if best is not None and best + unit in points else None
    foot = points[best if best is not None else self.lo].footprint_bytes
    beyond = _beyond(points, self.limit, unit) if best == self.hi and self.axis == "batch" else None
    return BatchFit(policy=self.text, max_batch_size=best, footprint_bytes=foot, limit_bytes=self.limit,
                    compiles=len(points), model=model, points=tuple(points.values()), method=method,
                    capped=best == self.hi, verified_over=over, unit=unit, seconds=time.perf_counter() - self.started,
                    estimated_max_batch=beyond)


def _probe(search: _Search, probes: Sequence[int], guess: int | None, intercept_hint: float | None
           ) -> tuple[AffineModel, bool]:
  """The first compiles and the line through them (:func:`max_batch_size`'s ``probes``, ``guess`` and
  ``intercept_hint``): ``(model, at_cap)``, ``at_cap`` when a guess at the cap fit (the answer in one compile)."""
  lo, hi, unit = search.lo, search.hi, search.unit
  probe_batches = sorted({min(hi, max(lo, p * unit)) for p in probes})
  at_cap = False
  if guess is not None:  # the verification pair, whatever the jobs: on a right guess, the whole search
    guessed = min(hi, max(lo, guess - guess % unit))
    if guessed < hi:
      search.at(guessed, guessed + unit)
    else:
      at_cap = search.at(guessed).footprint_bytes <= search.limit
  elif len(probe_batches) == 1 and lo < probe_batches[0]:  # the probes meet at the cap (a global batch below them):
    search.at(probe_batches[0], lo)  # the cap and the smallest batch make the line, compiled together
  elif intercept_hint is not None and len(probe_batches) > 1:
    far = search.at(probe_batches[-1])
    hinted = AffineModel(float(intercept_hint), (far.footprint_bytes - intercept_hint) / far.batch,
                         ((0, int(intercept_hint)), (far.batch, far.footprint_bytes)))
    if hinted.slope > 0:  # the second point: the hint's prediction (next to the crossing), else the other probe
      predicted = min(max(hinted.largest_within(search.limit, step=unit), lo), hi)
      if predicted != far.batch:
        search.at(*search.with_next(predicted))
      else:
        search.at(probe_batches[0])
  if guess is None:  # the probes a line still needs
    todo = [b for b in probe_batches if b not in search.points][:max(0, 2 - len(search.points))]
    if todo:
      search.at(*todo)
  if len(search.points) < 2 and not at_cap:  # a range of one batch, probes that coincide, a guess over at the cap
    search.at(lo if lo not in search.points else hi)
  first = list(search.points.values())[:2]  # the line through the first two compiles (a speculative third left out)
  if len(search.points) > 1:
    return fit_affine([(p.batch, p.footprint_bytes) for p in first]), at_cap
  return AffineModel(float(first[0].footprint_bytes), 0.0, ((first[0].batch, first[0].footprint_bytes),)), at_cap


def _predict_and_verify(search: _Search, model: AffineModel, max_rounds: int) -> BatchFit | None:
  """Up to ``max_rounds`` rounds of: predict the largest batch by the current line, compile it and its neighbour,
  correct the line by a secant (or a curve's local tangent); the answer once a fitting batch sits next to one over,
  else ``None`` (left to :func:`_bisect`)."""
  current, unit = model, search.unit
  for _ in range(0 if model.slope <= 0 else max_rounds):
    if search.settled():
      return search.answer("affine", model)
    lo, hi = search.bracket()
    top = search.hi if hi is None else hi - unit
    pred = min(max(current.largest_within(search.limit, step=unit), search.lo, lo), top)
    search.at(*search.with_next(pred))
    if search.points[pred].footprint_bytes <= search.limit and pred + unit <= search.hi:
      search.at(pred + unit)
    elif search.points[pred].footprint_bytes > search.limit and pred - unit >= search.lo:
      search.at(pred - unit)
    if search.settled():
      return search.answer("affine", model)
    # secant: between the largest fitting and the smallest over batch when both are known, else the two nearest;
    # a curved footprint (attention's T² in a sequence length) gets the local tangent of a parabola through the
    # three compiles nearest the limit instead, so the chord of a convex curve does not creep up one side
    lo, hi = search.bracket()
    pair = [search.points[b] for b in (lo, hi) if b is not None and b in search.points]
    if len(pair) < 2:
      pair = sorted(search.points.values(), key=lambda p: abs(p.footprint_bytes - search.limit))[:2]
    if pair[0].footprint_bytes == pair[1].footprint_bytes:
      return None
    current = fit_affine([(p.batch, p.footprint_bytes) for p in pair])
    if current.slope <= 0:
      return None
    local = tangent_at_crossing([(p.batch, p.footprint_bytes) for p in search.points.values()], search.limit, lo, hi)
    if local is not None:
      current = local
  return None


def _bisect(search: _Search, model: AffineModel) -> BatchFit:
  """Where the line did not settle it: grow towards the cap while everything fits, then bisect between the largest
  batch that fit and the smallest over the limit."""
  lo, hi = search.bracket()
  if hi is None:  # everything so far fit: grow towards max_batch
    b = max(lo, search.lo)
    while b < search.hi and search.points[b].footprint_bytes <= search.limit:
      b = min(search.hi, 2 * b)
      search.at(b)
    lo, hi = search.bracket()
  while hi is not None and hi - lo > search.unit:
    search.at(max(search.lo, (lo + hi) // 2 // search.unit * search.unit))
    lo, hi = search.bracket()
  return search.answer("search", model)


def max_seq_len(target: Target, policy: Any, memory: int | str = "auto", *, min_seq_len: int = 1,
                max_seq_len: int = 8192, probes: Sequence[int] = (256, 1024), **kwargs: Any) -> BatchFit:
  """The largest sequence length (tokens per example) of a shipped sequence model at its batch size that fits.

  The same predict-then-verify search as :func:`max_batch_size` over the sequence length; attention's
  ``[B, H, T, T]`` values make the footprint quadratic in T under policies that save them (``none``), where the
  secant corrections (or the bisection fallback) take over from the line. The answer is verified the same way.

  Args:
    target: a shipped sequence model (``shipped_target("gpt", ..., batch_size=B)``).
    policy, memory, **kwargs: as :func:`max_batch_size`.
    min_seq_len, max_seq_len: the range searched (tokens).
    probes: the two sequence lengths of the first fit.

  Returns:
    A :class:`BatchFit` whose ``max_batch_size`` is the sequence length (and ``points`` keyed by it).

  Raises:
    JaxckptError: a target that is not a shipped sequence model; as :func:`max_batch_size`.
  """
  return max_batch_size(target, policy, memory, min_batch=min_seq_len, max_batch=max_seq_len, probes=probes,
                        axis="seq_len", **kwargs)


def fit_policies(
    target: Target,
    policies: Sequence[Any] = DEFAULT_POLICIES,
    memory: int | str = "auto",
    *,
    require_fit: bool = True,
    guesses: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> list[BatchFit]:
  """:func:`max_batch_size` for each policy; raises when no policy fits even the smallest batch.

  Args:
    target, memory: as :func:`max_batch_size`.
    policies: policy specs (default :data:`DEFAULT_POLICIES`).
    require_fit: raise when no policy fits (``False``: return the fits, every ``max_batch_size`` ``None``; the fit
      planner's ``custom:search`` may still offload below them, then raises :func:`nothing_fits_error` itself).
    guesses: per policy text (as the fit names it: ``str(parse_model_policy(spec))``), a predicted largest batch
      (:func:`max_batch_size`'s ``guess``; a policy without one starts from the probes).
    **kwargs: passed to :func:`max_batch_size`.

  The first policy's line comes from two probes; each later one starts from the previous policy's intercept
  (``intercept_hint``): one probe, then a compile at the hinted prediction.

  Returns:
    One :class:`BatchFit` per policy, in order.

  Raises:
    NothingFitsError: no policy fits the smallest batch (with ``require_fit``); the message names the least
      footprint and its policy.
    JaxckptError: as :func:`max_batch_size`; an empty ``policies``.
  """
  if not policies:
    raise JaxckptError("policies=[] is empty: give at least one policy")
  fits: list[BatchFit] = []
  hint = None
  for p in policies:
    guess = (guesses or {}).get(str(parse_model_policy(p)))
    fits.append(max_batch_size(target, p, memory, intercept_hint=None if guess else hint, guess=guess, **kwargs))
    pts = [(q.batch, q.footprint_bytes) for q in fits[-1].points]
    if len({b for b, _ in pts}) > 1:
      hint = fit_affine(pts).intercept  # batch-independent bytes: the next policy's first point of its line
  if require_fit and all(f.max_batch_size is None for f in fits):
    raise nothing_fits_error(fits)
  return fits


def nothing_fits_error(fits: Sequence[BatchFit], note: str = "") -> NothingFitsError:
  """The error of fits none of which fits its smallest batch: the least footprint and its policy (and ``note``,
  e.g. why ``custom:search`` stopped)."""
  least = min(fits, key=lambda f: f.footprint_bytes)
  smallest = min(p.batch for f in fits for p in f.points)
  return NothingFitsError(
      f"memory={format_bytes(least.limit_bytes)} fits no policy even at batch size {smallest}: the least footprint "
      f"is {format_bytes(least.footprint_bytes)} with policy {least.policy}" + (f" ({note})" if note else "")
      + "; give more memory, a smaller model or a sharded mesh")
