"""One compile path: a target's train step under one policy, traced, lowered and compiled with jaxckpt's options.

Every tool compiles through here: the report (:mod:`jaxckpt.report`), the planner (:mod:`jaxckpt.planner`),
``--measure`` and the experiments. The step is built from ``jax.ShapeDtypeStruct`` s (nothing is allocated), its
state (argument 0) donated, and compiled with :func:`step_compiler_options` of the platform it is compiled *for*
(the platform of ``mesh``'s devices, else the default backend): on XLA:CPU the remat fix
(:data:`jaxckpt.CPU_REMAT_FIX`, see :func:`jaxckpt.remat_compiler_options`) and, for stats-only compiles,
:data:`STATS_ONLY_OPTIONS`; for a TPU topology's mesh (:mod:`jaxckpt.sharding`) neither.

Two stages, so a caller can overlap them (the report traces the next policy while XLA compiles this one)::

    lowered = lower_policy(target, spec, tx=tx)      # trace + lower, in this thread (holds the GIL)
    compiled = lowered.compile()                     # XLA, releases the GIL

:func:`compile_policy` does both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import optax

from flax import nnx

from jaxckpt.sharding._rules import mesh_axes_of, param_logical_axes
from jaxckpt.sharding._state import path_names
from jaxckpt.errors import JaxckptError, MeshSpecError
from jaxckpt.step._isolated import compile_lowered
from jaxckpt.step._stats_cache import CachedStats, compile_key, read_program, stats_cache
from jaxckpt import sharding
from jaxckpt.analysis._flops import FlopCount, jaxpr_flops
from jaxckpt.analysis._jaxprs import LAYOUT_ONLY, checkpoint_name_of, iter_eqns, outermost_remats, remat_body
from jaxckpt.analysis._internals import compilation_cache_switch
from jaxckpt.policies._model import ConcretePolicy, parse_model_policy
from jaxckpt.step._build import PolicyStep, StepBuilder, default_optimizer, dropout_key_struct
from jaxckpt.step._targets import ModelTarget, Target
from jaxckpt.sharding import compiles_only
from jaxckpt.training._xla import compiler_log, memory_stats, remat_compiler_options, remat_fix_applied, xla_flags

STATS_ONLY_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""Options of the stats-only compiles on XLA:CPU (executables that are never run): LLVM's optimisation level does not
touch HLO buffer assignment, so every memory stat is identical (checked in tests/report/test_report.py) and XLA:CPU
compiles ~3× faster. Compiles whose executable runs (``--measure``, the experiments) use full optimisation. Not given
to other compilers: the TPU compiler accepts the option but compiles no faster with it (measured with libtpu 0.0.42.1:
the same stats, the same seconds)."""


HOST_OFFLOAD_OPTIONS: dict[str, Any] = {
    "xla_tpu_enable_all_experimental_scheduler_features": True,
    "xla_tpu_enable_scheduler_memory_pressure_tracking": True,
    "xla_tpu_host_transfer_overlap_limit": 24,
    "xla_tpu_aggressive_opt_barrier_removal": "ENABLED",
    "xla_lhs_prioritize_async_depth_over_stall": "ENABLED",
    "xla_tpu_enable_ag_backward_pipelining": True,
    "xla_should_allow_loop_variant_parameter_in_chain": "ENABLED",
    "xla_should_add_loop_invariant_op_in_chain": "ENABLED",
    "xla_max_concurrent_host_send_recv": 100,
    "xla_tpu_scheduler_percent_shared_memory_limit": 100,
    "xla_latency_hiding_scheduler_rerun": 2,
}
"""The TPU compiler options of a step whose policy offloads residuals to host memory: MaxText's ``HOST_OFFLOAD_FLAGS``
(``benchmarks/xla_flags_library.py``, the flags its host-offload configurations run with, e.g. Llama 3.1 8B on
v6e-256), given per compile as ``compiler_options`` (they are ``LIBTPU_INIT_ARGS`` there). Applied on TPU only; the
caller's options win. Measured deviceless (libtpu 0.0.42.1, a scanned 8-layer offload toy on v5e:2x2): accepted,
the same memory stats."""


GPU_RECIPE_OPTIONS: dict[str, Any] = {
    # The latency-hiding scheduler: collectives overlap the compute the schedule can put beside them.
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # cuBLAS / cuBLASLt GEMMs instead of Triton's (XLA:GPU's Triton GEMM rewriter cannot tile some shapes: attention
    # with head dim 72 followed by a projection fails to compile, "Couldn't find output tile sizes").
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_highest_priority_async_stream": True,
    # Collectives combined up to these sizes (bytes): fewer, larger transfers.
    "xla_gpu_all_reduce_combine_threshold_bytes": 1_073_741_824,
    "xla_gpu_all_gather_combine_threshold_bytes": 134_217_728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134_217_728,
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    # FSDP: the next layer's all-gather and the last layer's reduce-scatter pipelined across the scan's iterations,
    # the scan's body doubled so they overlap.
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
}
"""XLA:GPU options of every GPU compile: the flags the published GPU training recipes run with, so a step is compiled
as the measured runs were. Source: MaxText's A3 recipes (AI-Hypercomputer/maxtext ``MaxText/configs/a3/llama_2_7b/
{1,2,4,8,16,32}vm.sh``, the published runs MT-1…MT-4 of ``benchmarks/step_time_gpu.py``; their ``XLA_FLAGS``),
NVIDIA's JAX-Toolbox (``rosetta/docs/GPU_performance.md``: the latency-hiding scheduler, asynchronous collectives, the
FSDP pipelining and loop double buffering) and NVIDIA's dgxc-benchmarking MaxText configuration (the DX rows). Those
recipes also set ``--xla_gpu_enable_triton_softmax_fusion=false``, ``--xla_gpu_all_reduce_contiguous=true`` and
``--xla_gpu_graph_level=0``, which XLA has since removed (jax-cuda12-plugin 0.10.2: "No such compile option"), and
``--xla_disable_hlo_passes=rematerialization`` (:data:`jaxckpt.training.GPU_XLA_REMAT_PASS`, which
:func:`jaxckpt.remat_compiler_options` adds). Given per compile (:func:`step_compiler_options`); an option the
user's ``XLA_FLAGS`` sets is left to it, and the caller's ``options`` win over both."""

GPU_OPTIONS = GPU_RECIPE_OPTIONS
"""The name of :data:`GPU_RECIPE_OPTIONS` before it held the recipes' whole list (kept for API users)."""


COMPILER_FAILURE_HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Couldn't find output tile sizes"),
     "XLA:GPU's Triton GEMM rewriter cannot tile this matmul (seen with attention head dim 72 before a projection); "
     "compile with xla_gpu_enable_triton_gemm=false (cuBLAS GEMMs), as jaxckpt does on GPU unless XLA_FLAGS sets "
     "it, and as every published GPU recipe does"),
    (re.compile(r"cuDNN not found"),
     "cuDNN attention (--attention cudnn) needs nvidia-cudnn-cu12 installed; --attention pallas needs nothing more"),
)
"""Compiler failures with a known way around: (a pattern of the compiler's message, the hint) — the report's and the
fit's error rows keep the compiler's own message and add the hint (:func:`compiler_hint`)."""


def compiler_hint(err: BaseException | str) -> str | None:
  """The hint for a compiler failure whose message matches :data:`COMPILER_FAILURE_HINTS`, else ``None``."""
  text = str(err)
  return next((hint for pattern, hint in COMPILER_FAILURE_HINTS if pattern.search(text)), None)


def step_compiler_options(extra: Mapping[str, Any] | None = None, *, stats_only: bool = True,
                          backend: str | None = None, offloads: bool = False) -> dict[str, Any]:
  """The XLA options jaxckpt compiles a train step with, for the platform it is compiled for.

  Args:
    extra: the caller's options (they win over jaxckpt's; a ``xla_disable_hlo_passes`` of theirs is the passes
      they want disabled, see :func:`jaxckpt.remat_compiler_options`).
    stats_only: add :data:`STATS_ONLY_OPTIONS` on CPU (for compiles that are never run).
    backend: the platform the step is compiled *for* (``"cpu"``, ``"tpu"`` or ``"gpu"`` for a topology's mesh:
      :func:`jaxckpt.sharding.mesh_platform`); default ``jax.default_backend()``.
    offloads: the step's policy offloads residuals to host memory (on TPU: :data:`HOST_OFFLOAD_OPTIONS`).

  Returns:
    ``{option: value}``: on CPU the remat fix and the stats-only options, then ``extra``; on TPU the host-offload
    options when ``offloads``, then ``extra``; on GPU :data:`GPU_RECIPE_OPTIONS` (less those ``XLA_FLAGS`` sets) with
    XLA:GPU's rematerialization pass off, then ``extra``.
  """
  backend = backend or jax.default_backend()
  stats = STATS_ONLY_OPTIONS if stats_only and backend == "cpu" else {}
  if offloads and backend == "tpu":
    stats = {**HOST_OFFLOAD_OPTIONS, **stats}
  if backend == "gpu":
    flags = xla_flags()
    stats = {k: v for k, v in GPU_RECIPE_OPTIONS.items() if k not in flags}
  return remat_compiler_options(backend, extra={**stats, **(extra or {})})


_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory|exceeds available HBM")


def is_memory_refusal(err: BaseException) -> bool:
  """Whether a compile failed because the program exceeds the device's memory (the TPU compiler refuses such a
  program at compile time: ``RESOURCE_EXHAUSTED: Ran out of memory on HBM…``)."""
  return bool(_REFUSAL.search(str(err)))


class CachedRefusal(JaxckptError):
  """A compile the compiler refused for memory before (kept by :mod:`jaxckpt.step._stats_cache`): the message is
  the compiler's, as it was then."""


def xla_cost(compiled: jax.stages.Compiled) -> dict[str, float]:
  """XLA's ``cost_analysis()`` of an executable as ``{name: number}`` (``"flops"``, ``"bytes accessed"``…; a loop
  body counted once), ``{}`` where the backend has none."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - backends without cost analysis raise various errors
    return {}
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not isinstance(analysis, Mapping):
    return {}
  return {str(k): float(v) for k, v in analysis.items() if isinstance(v, (int, float))}


def xla_raw_flops(compiled: Any) -> int | None:
  """XLA's ``cost_analysis()["flops"]`` of a compiled step (a loop body counted once: see
  :mod:`jaxckpt.analysis._flops`), or ``None`` where the backend has no cost analysis.

  Args:
    compiled: a :class:`CompiledPolicy` (its :attr:`~CompiledPolicy.cost`, also when served from the
      compiled-stats cache) or a ``jax.stages.Compiled``.
  """
  cost = compiled.cost if isinstance(getattr(compiled, "cost", None), Mapping) else xla_cost(compiled)
  flops = cost.get("flops")
  return int(flops) if flops is not None and flops >= 0 else None


@dataclasses.dataclass(frozen=True)
class CompiledPolicy:
  """A target's train step compiled under one policy.

  Attributes:
    step: the :class:`~jaxckpt.step.PolicyStep` (abstract state and batch, the step function).
    traced: ``jax.stages.Traced`` (its ``jaxpr`` gives FLOPs and remat regions).
    compiled: the ``jax.stages.Compiled`` executable: ``compiled(state, batch) -> (state, metrics)``.
    memory: compiled memory stats (keys :data:`jaxckpt.schema.MEMORY_KEYS`, int bytes, ``None`` where missing).
    flops: FLOPs of the whole step counted from the jaxpr (scan bodies × trip count).
    lower_s: seconds to build, trace and lower the step.
    compile_s: seconds XLA took to compile it.
    fingerprint: hash of the lowered StableHLO text; equal fingerprints compile to the same program.
    stages: seconds per stage, ``{"build", "trace", "lower", "compile"}``.
    cost: XLA's ``cost_analysis()`` of the executable (``"flops"``, ``"bytes accessed"``…; a loop body counted
      once), ``{}`` where the backend has none.
    cached: the statistics came from the compiled-stats cache (:mod:`jaxckpt.step._stats_cache`: a TPU topology
      compile made before, by this run or an earlier one); ``compiled`` is then ``None`` and ``compile_s`` the
      seconds the compile took when it ran.
    compiler_log: the warnings and errors the compiler logged while compiling (XLA:GPU's C++ log, e.g. its
      rematerialization pass failing to reach its memory estimate; :func:`jaxckpt.training._xla.compiler_log`);
      ``()`` elsewhere.
    program_path: where the cache keeps the compiled program's text (gzip), when it was served from the cache
      with it; ``None`` otherwise (:meth:`hlo_text` reads the executable's own text then).
  """

  step: PolicyStep
  traced: Any
  compiled: Any
  memory: Mapping[str, int | None]
  flops: int
  lower_s: float
  compile_s: float
  fingerprint: str
  stages: Mapping[str, float] = dataclasses.field(default_factory=dict)
  cost: Mapping[str, float] = dataclasses.field(default_factory=dict)
  cached: bool = False
  compiler_log: tuple[str, ...] = ()
  program_path: str | None = None

  @property
  def seconds(self) -> float:
    """Trace + lower + compile seconds."""
    return self.lower_s + self.compile_s

  def hlo_text(self) -> str:
    """The compiled program's HLO text (``compiled.as_text()``): the executable's, or the text the compiled-stats
    cache kept of it (what :func:`jaxckpt.timing.step_time_of` reads).

    Raises:
      JaxckptError: served from the cache by an entry written before the cache kept program texts: compile again
        with ``LoweredPolicy.compile(program_text=True)`` (or ``JAXCKPT_STATS_CACHE=off``).
    """
    if self.compiled is not None:
      return self.compiled.as_text()
    text = read_program(self.program_path) if self.program_path else None
    if text is None:
      raise JaxckptError("this compiled step was served from the compiled-stats cache by an entry without its program "
                         "text (written before the cache kept it): compile again with "
                         "lower_policy(...).compile(program_text=True), or with JAXCKPT_STATS_CACHE=off")
    return text


@dataclasses.dataclass(frozen=True)
class LoweredPolicy:
  """A target's train step under one policy, traced and lowered, not yet compiled.

  Attributes:
    step: the :class:`~jaxckpt.step.PolicyStep`.
    traced: ``jax.stages.Traced``.
    lowered: ``jax.stages.Lowered``.
    options: the XLA options :meth:`compile` uses (:func:`step_compiler_options`).
    lower_s: seconds to build, trace and lower.
    stages: those seconds split: ``{"build", "trace", "lower"}``.
    cacheable: whether JAX's persistent compilation cache may serve the compile (not for a TPU topology's
      compile-only devices, :func:`jaxckpt.sharding.compiles_only`: their statistics are kept by the compiled-stats
      cache instead, :mod:`jaxckpt.step._stats_cache`).
    mesh: the mesh the step is sharded over, or ``None``.
  """

  step: PolicyStep
  traced: Any
  lowered: Any
  options: Mapping[str, Any]
  lower_s: float
  stages: Mapping[str, float] = dataclasses.field(default_factory=dict)
  cacheable: bool = True
  mesh: Any = None

  @functools.cached_property
  def fingerprint(self) -> str:
    """Hash of the lowered module's text (identical programs, e.g. name policies that save nothing the model
    emits, share it)."""
    return hashlib.sha256(self.lowered.as_text().encode()).hexdigest()[:16]

  @functools.cached_property
  def flop_count(self) -> FlopCount:
    """The step's :class:`~jaxckpt.analysis.FlopCount` from its jaxpr (:func:`jaxckpt.analysis._flops.jaxpr_flops`):
    the total, FLOPs per primitive, and the primitives no rule counts (``uncounted_primitives``)."""
    return jaxpr_flops(self.traced.jaxpr)

  @property
  def flops(self) -> int:
    """FLOPs of the step from its jaxpr (:attr:`flop_count`'s total)."""
    return self.flop_count.total

  def compile(self, extra_options: Mapping[str, Any] | None = None, *, program_text: bool = False) -> CompiledPolicy:
    """Compiles with :attr:`options` (plus ``extra_options``, e.g. XLA dump flags).

    JAX's persistent compilation cache (``jax_compilation_cache_dir``), when the user enabled it, serves repeated
    compiles; a compile with ``xla_dump_*`` options bypasses it, since its key ignores dump options and a cache hit
    would write no dump, and so does a compile for a TPU topology (not :attr:`cacheable`).

    Args:
      extra_options: XLA options added to :attr:`options`.
      program_text: the caller needs the compiled program's text (:meth:`CompiledPolicy.hlo_text`, the step-time
        model): a compiled-stats cache entry without it is not served; the compile runs and keeps it.

    Returns:
      The :class:`CompiledPolicy`.

    Raises:
      Whatever XLA raises (e.g. out of memory): callers turn it into an error row.
    """
    options = {**self.options, **(extra_options or {})}
    dumps = any(key.startswith("xla_dump") for key in options)
    bypass = dumps or not self.cacheable
    cache = stats_cache() if not self.cacheable and not dumps else None
    key = None
    if cache is not None:  # a topology compile: its statistics may be kept from an earlier compile
      key = compile_key(self.lowered, options, self.mesh, **self.target_device)
      hit = cache.get(key)
      if hit is not None and hit.error is not None:
        raise CachedRefusal(hit.error)
      if hit is not None and (hit.has_program or not program_text):
        return CompiledPolicy(self.step, self.traced, None, dict(hit.memory), self.flops, self.lower_s,
                              hit.compile_s, self.fingerprint, {**self.stages, "compile": 0.0}, dict(hit.cost),
                              cached=True, program_path=cache.program_path(key) if hit.has_program else None)
    started = time.perf_counter()
    try:
      with compilation_cache_switch(False) if bypass else contextlib.nullcontext(), \
          compiler_log(self.target_device["platform"] == "gpu") as log:
        compiled = compile_lowered(self.lowered, options, self.mesh)  # in a worker inside isolated_compiles()
    except Exception as err:
      if cache is not None and is_memory_refusal(err):  # deterministic: the same program is refused again
        cache.put(key, CachedStats(None, {}, time.perf_counter() - started, str(err)))
      raise
    compile_s = time.perf_counter() - started
    memory, cost = memory_stats(compiled), xla_cost(compiled)
    if cache is not None:
      cache.put(key, CachedStats(memory, cost, compile_s), program_text=compiled.as_text())
    return CompiledPolicy(self.step, self.traced, compiled, memory, self.flops, self.lower_s,
                          compile_s, self.fingerprint, {**self.stages, "compile": compile_s}, cost,
                          compiler_log=tuple(log) or tuple(getattr(compiled, "compiler_log", ())))

  @property
  def target_device(self) -> dict[str, Any]:
    """``{"platform", "device_kind", "device_count"}`` of what the step is compiled for (its shardings' devices)."""
    mesh = self.mesh
    if mesh is not None:
      device = next(iter(mesh.devices.flat))
      return {"platform": device.platform, "device_kind": device.device_kind, "device_count": int(mesh.devices.size)}
    return {"platform": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "device_count": 1}


def sharded_target(target: Target, mesh: jax.sharding.Mesh) -> Target:
  """``target`` whose loss computes with parameters all-gathered over ``fsdp`` (:func:`jaxckpt.sharding.gathered_params`)."""
  if isinstance(target, ModelTarget):
    return dataclasses.replace(target, loss_fn=sharding.gather_params_in_loss(target.loss_fn, mesh))
  loss = target.loss
  return dataclasses.replace(
      target, loss=lambda params, batch, *, policy: loss(sharding.gathered_params(params, mesh), batch, policy=policy))


def model_logical_names(model: Any) -> dict[str, str]:
  """Logical axis name -> the path of the first parameter of ``model`` that carries it (an abstract model is fine).

  Raises:
    LogicalAxisError: a name the rule table does not know (:data:`jaxckpt.sharding.LOGICAL_RULES`): one line naming
      the parameter, the name, the closest valid one and the valid ones.
  """
  found: dict[str, str] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                                        is_leaf=lambda x: isinstance(x, nnx.Variable)):
    where = "/".join(path_names(path))
    for name in param_logical_axes(leaf) or ():
      if name is not None:
        mesh_axes_of(name, what=f"parameter {where}")  # an unknown name: one line, here, before any compile
        found.setdefault(name, where)
  return found


def _expert_dims(model: Any) -> set[int]:
  """The sizes of the dimensions of ``model``'s parameters whose logical name splits over ``expert`` (its experts)."""
  sizes = set()
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes, shape = param_logical_axes(leaf) or (), leaf.get_value().shape
    if len(axes) == len(shape):
      sizes |= {int(n) for a, n in zip(axes, shape) if a is not None and "expert" in mesh_axes_of(a)}
  return sizes


def mesh_use_notes(builder: StepBuilder, mesh: jax.sharding.Mesh | None) -> list[str]:
  """What a mesh does less for the target than its axes suggest, one line each (the report's warnings): an
  ``expert`` axis over Mixture-of-Experts layers whose dispatch gathers the experts' weights instead of splitting
  their work (modules that declare ``splits_experts = False``, the LLM family's dropless dispatches)."""
  size = 0 if mesh is None else sharding.mesh_shape(mesh).get("expert", 1)
  if size <= 1 or not builder.is_model:
    return []
  gathered = {type(m).__name__ for _, m in nnx.iter_modules(builder.abstract_model)
              if getattr(m, "splits_experts", None) is False}
  if not gathered:
    return []
  return [f"mesh axis expert={size}: the dropless dispatch of {', '.join(sorted(gathered))} gathers the experts' "
          "weights over it per layer (each device computes every expert for its own tokens; the weights are split at "
          "rest only): moe_dispatch='dropping' (--moe-dispatch dropping) splits the experts' work over it, with "
          "all-to-alls"]


def check_mesh_use(builder: StepBuilder, mesh: jax.sharding.Mesh | None) -> None:
  """Refuses a mesh axis the target cannot use, and a parameter's logical axis name the rule table does not know.

  A ``tensor`` axis of size > 1 needs parameters that carry logical axis names splitting over it
  (:mod:`jaxckpt.sharding._rules`: the LLM family's heads, MLP width and vocabulary, or the names a model target's
  tensor plan writes, :class:`jaxckpt.sharding.TensorPlan`); without them every tensor rank would run the whole model
  on the same batch. A ``tensor`` size that does not divide a dimension the plan splits is refused too
  (:func:`jaxckpt.sharding.check_tensor_splits`). An ``expert`` axis of size > 1 needs experts, parameters with the
  logical name ``exp`` (or ``expert``), and a size dividing their number.

  Raises:
    MeshSpecError: one line naming the axis, the target and what would use it (for a model target: a tensor plan).
    LogicalAxisError: a parameter's unknown logical axis name (one line naming the parameter).
  """
  shape = {} if mesh is None else sharding.mesh_shape(mesh)
  from_names = model_logical_names(builder.abstract_model) if builder.is_model else {}
  experts = shape.get("expert", 1)
  if experts > 1:
    sizes = _expert_dims(builder.abstract_model) if builder.is_model else set()
    if not sizes:
      instead = sharding.format_mesh({"data": shape.get("data", 1) * experts,
                                      **{a: n for a, n in shape.items() if a not in ("data", "expert")}})
      raise MeshSpecError(f"mesh axis expert={experts} splits a Mixture of Experts' experts (parameters with the "
                          f"logical axis name 'exp'), but no parameter of {builder.target.name} carries one: use "
                          f"{instead} to split the batch, or name your experts' axis 'exp' "
                          "(nnx.with_partitioning(init, ('exp', 'embed', 'mlp')))")
    bad = sorted(n for n in sizes if n % experts)
    if bad:
      raise MeshSpecError(f"mesh axis expert={experts} must divide the number of experts of {builder.target.name} "
                          f"({', '.join(map(str, sorted(sizes)))}): use an expert size dividing it")
  size = shape.get("tensor", 1)
  if size <= 1:
    return
  if builder.is_model:
    model = builder.abstract_model
    if any("tensor" in mesh_axes_of(name) for name in from_names):
      sharding.check_tensor_splits(model, sharding.mesh_shape(mesh))
      return
    raise MeshSpecError(f"mesh axis tensor={size} splits parameters by their logical axis names, but no parameter "
                        f"of {builder.target.name} carries one: give the target a tensor plan naming the layers to "
                        "split, nnx_model_target(..., tensor_plan={'layers/*/attn/q_proj': 'colwise', ..., "
                        "'layers/*/attn/o_proj': 'rowwise'}) or tensor_plan='auto' (docs/sharding.md), or use "
                        "data/fsdp axes only")
  raise MeshSpecError(f"mesh axis tensor={size} splits parameters by their logical axis names, and the loss target "
                      f"{builder.target.name} has none (its parameters are plain arrays): use data/fsdp axes for it, "
                      "or make it an NNX model target with a tensor plan (nnx_model_target(..., tensor_plan=...))")


def step_builder(target: Target, *, tx: optax.GradientTransformation | None = None,
                 mesh: jax.sharding.Mesh | None = None) -> StepBuilder:
  """The :class:`~jaxckpt.step.StepBuilder` :func:`lower_policy` uses for ``target`` (sharded over ``mesh``).

  Args:
    target: a model or loss target.
    tx: the optimizer (default :func:`~jaxckpt.step.default_optimizer`).
    mesh: the device mesh the step is sharded over, or ``None``.

  Returns:
    One builder to pass to every :func:`lower_policy` / :func:`compile_policy` call of this target.
  """
  return StepBuilder(target if mesh is None else sharded_target(target, mesh), tx or default_optimizer())


def forward_jaxpr(builder: StepBuilder) -> jax.core.ClosedJaxpr:
  """The jaxpr of the step's forward pass (its loss of the parameters) under full remat (``nothing_saveable``), as
  :func:`step_builder` builds it: where its ``checkpoint_name`` values and remat regions are read from."""
  step = builder.step(parse_model_policy("nothing_saveable"))
  return jax.make_jaxpr(step.loss_of_params)(step.params, step.batch, dropout_key_struct())


def checkpoint_name_bytes(jaxpr: jax.core.ClosedJaxpr) -> dict[str, int]:
  """Bytes of the values each ``jax.ad_checkpoint.checkpoint_name`` tags in ``jaxpr`` (every layer of a scan, by
  its trip count: :func:`~jaxckpt.analysis._jaxprs.iter_eqns`), by name in order of first emission; empty for a model
  that tags none."""
  by_name: dict[str, int] = {}
  for eqn in iter_eqns(jaxpr, rules=True):
    name = checkpoint_name_of(eqn)
    if name is not None:
      by_name[name] = by_name.get(name, 0) + sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.outvars)
  return by_name


def boundary_names(jaxpr: Any) -> set[str]:
  """The checkpoint names whose value is an input of its remat region (through layout-only equations): under
  per-layer remat the layer input (MaxText's ``decoder_layer_input``), saved anyway, so only offloading it frees
  device memory (:mod:`jaxckpt.fit._names`)."""
  found: set[str] = set()
  for eqn in outermost_remats(jaxpr):
    body = remat_body(eqn)
    body = getattr(body, "jaxpr", body)
    inputs = set(map(id, body.invars))
    producer = {id(v): e for e in body.eqns for v in e.outvars}
    for e in body.eqns:
      name = checkpoint_name_of(e)
      if name is None:
        continue
      v = e.invars[0]
      while id(v) in producer and producer[id(v)].primitive.name in LAYOUT_ONLY and producer[id(v)].invars:
        v = producer[id(v)].invars[0]
      if id(v) in inputs:
        found.add(name)
  return found


def concrete_policy(spec: "str | ConcretePolicy") -> "ConcretePolicy":
  """``spec`` as a policy the step applies as it is: a policy string parsed (:func:`jaxckpt.parse_model_policy`),
  a concrete policy returned as it is.

  Raises:
    PolicySpecError: a string that does not parse.
    JaxckptError: a budget, ``min_saved`` or ``mincut:<cap>``, which are planned for a target first
      (:func:`jaxckpt.planner.resolve_policy`).
  """
  parsed = parse_model_policy(spec) if isinstance(spec, str) else spec
  if not isinstance(parsed, ConcretePolicy) or not parsed.resolved:
    raise JaxckptError(f"policy={str(parsed)!r} is planned for a target before it is compiled: resolve it with "
                       "jaxckpt.planner.resolve_policy(target, policy) (or give a fixed policy such as "
                       "'nothing_saveable')")
  return parsed


def lower_policy(
    target: Target,
    spec: "str | ConcretePolicy",
    *,
    tx: optax.GradientTransformation | None = None,
    mesh: jax.sharding.Mesh | None = None,
    options: Mapping[str, Any] | None = None,
    stats_only: bool = True,
    builder: StepBuilder | None = None,
) -> LoweredPolicy:
  """Builds and lowers the train step of ``target`` under ``spec`` from shapes only.

  Args:
    target: a :class:`~jaxckpt.step.ModelTarget` or :class:`~jaxckpt.step.LossTarget`.
    spec: a concrete policy (:class:`~jaxckpt.policies.ConcretePolicy`: a per-block :class:`~jaxckpt.PolicySpec`, a
      per-layer-range :class:`~jaxckpt.policies.LayeredPolicy`, a whole-loss plan) or its string (parsed once
      here, :func:`concrete_policy`; budgets are resolved first: :func:`jaxckpt.planner.resolve_policy`).
    tx: the optimizer (default :func:`~jaxckpt.step.default_optimizer`, ``optax.adamw(1e-3)``).
    mesh: shard the step over this mesh (batch over ``data``/``fsdp``, parameters and optimizer state over ``fsdp``
      by the FSDP rule of :mod:`jaxckpt.sharding`, computed with parameters all-gathered); the compiled stats are
      then per device. A mesh over a TPU topology's chips (:meth:`jaxckpt.sharding.Topology.mesh`) compiles
      with the TPU compiler, without a TPU. ``None``: one device.
    options: extra XLA options, merged over :func:`step_compiler_options`.
    stats_only: compile with :data:`STATS_ONLY_OPTIONS` (for executables that are never run).
    builder: a :func:`step_builder` of this target, optimizer and mesh, to share the policy-independent parts
      (abstract model, state) between policies; ``None`` makes one.

  Returns:
    The :class:`LoweredPolicy`.

  Raises:
    PolicySpecError: ``spec`` names a block type or checkpoint name the target does not have, or does not parse.
    JaxckptError: ``spec`` is a budget or another policy planned per target (:func:`concrete_policy`).
  """
  t0 = time.perf_counter()
  spec = concrete_policy(spec)
  builder = builder or step_builder(target, tx=tx, mesh=mesh)
  check_mesh_use(builder, mesh)
  step = builder.step(spec)
  kwargs: dict[str, Any] = {}
  if mesh is not None:
    model = builder.abstract_model if isinstance(target, ModelTarget) else None
    kwargs = sharding.step_shardings(step.state, step.batch, mesh, model=model, params=step.params)
  t1 = time.perf_counter()
  # Traced with the mesh in context (jax.set_mesh): activation constraints by logical axis names, FSDP per block
  # (jaxckpt.sharding._rules) and your own kernels (a Pallas call under shard_map) see the mesh the step is sharded over.
  with remat_fix_applied(), (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
    traced = jax.jit(step.step, donate_argnums=0, **kwargs).trace(step.state, step.batch)
  builder.note_trace(traced.jaxpr)
  t2 = time.perf_counter()
  lowered = traced.lower()
  t3 = time.perf_counter()
  options = step_compiler_options(options, stats_only=stats_only, backend=sharding.mesh_platform(mesh),
                                  offloads=bool(getattr(spec, "offloads", False)))
  return LoweredPolicy(step, traced, lowered, options, t3 - t0,
                       {"build": t1 - t0, "trace": t2 - t1, "lower": t3 - t2}, cacheable=not compiles_only(mesh),
                       mesh=mesh)


def compile_policy(
    target: Target,
    spec: "str | ConcretePolicy",
    *,
    tx: optax.GradientTransformation | None = None,
    mesh: jax.sharding.Mesh | None = None,
    options: Mapping[str, Any] | None = None,
    stats_only: bool = True,
    builder: StepBuilder | None = None,
) -> CompiledPolicy:
  """Compiles the train step of ``target`` under ``spec`` (:func:`lower_policy`, then XLA) without allocating.

  Args and Raises: as :func:`lower_policy` (plus whatever XLA raises while compiling).

  Returns:
    The :class:`CompiledPolicy`: memory stats (bytes), FLOPs, the executable and timings.

  Example::

    >>> from jaxckpt.step import compile_policy, shipped_target
    >>> compiled = compile_policy(shipped_target("mlp", "tiny"), jaxckpt.parse_policy("full"))
    >>> compiled.memory["temp_bytes"]   # int bytes
  """
  return lower_policy(target, spec, tx=tx, mesh=mesh, options=options, stats_only=stats_only,
                      builder=builder).compile()
