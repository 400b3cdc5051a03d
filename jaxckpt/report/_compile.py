"""Compiled per-policy statistics for the report, without allocating: memory, FLOPs, residuals, remat regions,
compile time, XLA dumps.

Per policy the full train step is traced and lowered from ``jax.ShapeDtypeStruct``s by the step core
(:func:`jaxckpt.step.lower_policy`, in this thread: tracing holds the GIL), then compiled by XLA in a thread pool
(compilation releases the GIL) with :func:`jaxckpt.step.step_compiler_options`. While XLA compiles, this thread
counts FLOPs and analyses residuals. A policy whose lowered program is identical to one already compiled (e.g. a
name policy that saves nothing the model emits, next to ``nothing_saveable``) is not compiled again: its row reuses
the stats and says so in ``same_program_as``. A policy that fails anywhere becomes an error row; the others complete.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxckpt.errors import JaxckptError, raised_at
from jaxckpt.analysis.hlo import collectives_by_axis, offload_device_bytes, parse_hlo, read_memory_spaces
from jaxckpt.analysis._jaxprs import count_remat_regions
from jaxckpt.policies._meaning import GROUPED_MATMULS, grouped_matmul_gap
from jaxckpt.planner._cache import PlanCache
from jaxckpt.planner._plan import resolve_policy
from jaxckpt.policies._model import ModelPolicy
from jaxckpt.policies._spec import Policy
from jaxckpt.report import _xla_dump as xla_dump
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.report._keys import STATUS_ERROR, STATUS_OK, empty_row
from jaxckpt.schema import MEMORY_KEYS, footprint_bytes
from jaxckpt._units import format_bytes
from jaxckpt.report._residuals import analyse_residuals
from jaxckpt.sharding import Topology, make_mesh, mesh_platform, mesh_shape
from jaxckpt.step._job import CompileJob
from jaxckpt.sharding._rules import tracing_for
from jaxckpt.training._xla import offload_warning
from jaxckpt.step._compile import (compiler_hint, lower_policy, step_builder, step_compiler_options,
                                   xla_raw_flops)
from jaxckpt.step._build import StepBuilder
from jaxckpt.step._targets import Target, batch_size_of
from jaxckpt.timing import step_time_of


def report_compiler_options(extra: Mapping[str, Any] | None = None, *, stats_only: bool = True,
                            backend: str | None = None) -> dict[str, Any]:
  """The options the report compiles with for ``backend`` (default: the default backend):
  :func:`jaxckpt.step.step_compiler_options` (on CPU the remat fix and, if ``stats_only``,
  :data:`~jaxckpt.step.STATS_ONLY_OPTIONS`), then the caller's ``extra`` (which win)."""
  return step_compiler_options(extra, stats_only=stats_only, backend=backend)


def one_line(err: BaseException) -> str:
  """An exception as one line: a JaxckptError's first line; any other ``'Type: first line of the message
  (file.py:line)'``, the line in your code where it was raised (:func:`jaxckpt.errors.raised_at`: an error in your
  model while its step is traced); a compiler failure with a known way around gets its hint after it
  (:func:`jaxckpt.step.compiler_hint`)."""
  text = str(err).strip().splitlines()[0] if str(err).strip() else ""
  line = text if isinstance(err, JaxckptError) else raised_at(err)
  hint = compiler_hint(err)
  return line if hint is None else f"{line}; hint: {hint}"


def uncounted_warning(primitives: Sequence[str]) -> str:
  """The report's line for primitives the FLOP count has no rule for (:func:`jaxckpt.analysis.jaxpr_flops`): counted
  as 0, so every FLOPs figure is a lower bound."""
  return (f"FLOPs do not count {', '.join(primitives)} (no rule in jaxckpt's FLOP count: each counted as 0, so the "
          "FLOPs column is a lower bound); docs/flops.md lists the rules")


def spec_policies(spec: Any) -> list[Policy]:
  """Every :class:`~jaxckpt.policies.Policy` a concrete model policy applies: its block specs' (each layer range's
  for a layered policy); none for a whole-loss plan or ``None``."""
  if spec is None or getattr(spec, "scope", "blocks") != "blocks":
    return []
  layered = getattr(spec, "layered", None)
  specs = [s for _, s in layered.segments] if layered is not None else [spec.base_spec]
  return [p for s in specs for p in (s.default, *(q for _, q in s.blocks))]


def _slug(index: int, policy: str) -> str:
  return f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]+', '_', policy)[:80]}"


def _resolve_budgets(job: CompileJob, specs: Sequence[ModelPolicy], rows: list[dict[str, Any]],
                     warnings: list[str]) -> list[Any]:
  """Each spec as a concrete policy (:func:`jaxckpt.planner.resolve_policy`; budgets share compiled anchors and are
  planned for the job's placement: its mesh, and the memory its device may use for ``auto``); ``None`` where a
  budget could not be planned: an error row and a warning."""
  cache = PlanCache()
  candidates = None
  resolved: list[Any] = []
  for i, spec in enumerate(specs):
    try:
      policy, plan = resolve_policy(job.target, spec, tx=job.tx, compiler_options=job.compiler_options,
                                    mesh=job.placement, cache=cache, candidates=candidates)
    except Exception as err:  # noqa: BLE001 - an infeasible budget or a target that cannot be planned: an error row
      rows[i].update(status=STATUS_ERROR, error=one_line(err))
      warnings.append(f"policy {rows[i]['policy']!r}: {one_line(err)}")
      resolved.append(None)
      continue
    if plan is not None:
      candidates = plan.candidates
      rows[i]["plan"] = {k: v for k, v in plan.to_json().items() if k != "candidates"}
    resolved.append(policy)
  return resolved


def _check_applied(row: dict[str, Any], spec: Any) -> None:
  """Turns a row whose traced step has remat regions that contradict its policy into an error row."""
  regions, remat = row["remat_regions"], spec.remat
  if remat and regions == 0:
    row.update(status=STATUS_ERROR, error=(
        f"policy {row['policy']} was not applied: the traced train step has no remat region (jax.checkpoint); the "
        "model's blocks are not remat-wrapped (jaxckpt.apply_remat(model, policy, blocks=...) wraps your own)"))
  elif not remat and regions:
    row.update(status=STATUS_ERROR, error=(
        f"policy {row['policy']} asks for no remat, but the traced train step has {regions} remat region(s): the "
        "model applies jax.checkpoint itself, so every row would show that policy's figures"))


def compile_rows(
    job: CompileJob,
    specs: Sequence[ModelPolicy],
    *,
    builder: StepBuilder | None = None,
    jobs: int = 1,
    xla_dump_dir: str | None = None,
    residuals: bool = True,
    stats_only: bool = True,
    progress: bool = True,
    cpu_target: Target | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
  """Compiles the train step of a job's target under each spec and collects its statistics.

  Args:
    job: what to compile and where (:func:`jaxckpt.step.compile_job`, made once by the caller): its target, its
      optimizer, its extra XLA options (merged with jaxckpt's remat fix), and its placement: the mesh shards the step
      (:mod:`jaxckpt.sharding`: batch over ``data``/``fsdp``, parameters and optimizer state over ``fsdp`` by the
      FSDP rule), the memory stats then those of one device (XLA reports the SPMD-partitioned, per-device program);
      a topology's mesh compiles with its compiler (TPU, GPU) and each row's ``step_time_estimate`` is its compiled
      program's step time (:func:`step_time_estimate`); budgets are planned for it, ``auto`` at the memory its
      device may use (:meth:`~jaxckpt.sharding.Placement.memory`, a GPU's memory fraction included).
    specs: parsed policies (validated against the target here); a :class:`~jaxckpt.policies.Budget` is first
      resolved into a plan (:func:`jaxckpt.planner.resolve_policy`, sharing compiled anchors between budgets), its
      row keeping the budget as ``policy`` and the plan under ``plan``; an infeasible budget is an error row.
    builder: the target's :func:`jaxckpt.step.step_builder` (for the job's ``tx`` and mesh), if the caller has one.
    jobs: XLA compilations running at once (threads), ≥ 1.
    xla_dump_dir: if set, XLA's dumps of policy ``i`` go to ``xla_dump_dir/<ii>-<policy>/`` (text files only).
    residuals: run the residual analysis (``residual_bytes``, ``activation_residual_bytes``, ``residuals``).
    stats_only: compile with :data:`STATS_ONLY_OPTIONS` (same memory stats, faster).
    progress: show a tqdm bar on stderr.
    cpu_target: also compile each row's concrete policy for this target on XLA:CPU, one device, unsharded (the report
      passes ``target`` at the per-chip batch: ``--compare-cpu``), in the same thread pool; the row's ``cpu`` holds
      its memory stats (bytes), ``flops_xla_raw``, ``compile_s`` and ``batch_size``. ``None``: no comparison.

  Returns:
    ``(rows, warnings)``: one row per spec in order (keys :data:`jaxckpt.report._keys.ROW_KEYS`, memory in bytes,
    ``compile_s`` = trace + lower + XLA compile seconds, trace + lower only for a row that reused an identical
    program), and one
    warning line per spec invalid for the target. A row whose traced step has remat regions that contradict its
    policy (none for a remat policy, some for ``none``) is an error row: the policy was not applied.
  """
  target, placement, tx, compiler_options = job.target, job.placement, job.tx, job.compiler_options
  mesh, topology = placement.mesh, placement.topology
  rows = [empty_row(str(spec)) for spec in specs]
  impl, backend = remat_implementation(), mesh_platform(mesh)
  for row in rows:
    row["remat_impl"], row["backend"] = impl, backend
  warnings: list[str] = []
  resolved = _resolve_budgets(job, specs, rows, warnings)
  warnings += [w for w in (offload_warning(p, backend) for p in resolved if p is not None) if w is not None]
  builder = builder or step_builder(target, tx=tx, mesh=mesh)  # the abstract model and state, built once
  # On a machine whose default backend is not the CPU, a one-CPU-device mesh puts the comparison on XLA:CPU.
  cpu_mesh = None if jax.default_backend() == "cpu" else make_mesh({"data": 1}, devices=jax.devices("cpu")[:1])
  cpu_builder = step_builder(cpu_target, tx=tx, mesh=cpu_mesh) if cpu_target is not None else None
  bar = tqdm(total=len(specs), desc="compiling policies", unit="policy", disable=not progress, leave=False)
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    work = _RowCompiles(target, rows, warnings, bar, pool, tx=tx, mesh=mesh, topology=topology, options=compiler_options,
                        stats_only=stats_only, builder=builder, xla_dump_dir=xla_dump_dir, cpu=(cpu_target, cpu_mesh,
                                                                                                 cpu_builder))
    for i, spec in enumerate(resolved):
      lowered = work.lower(i, spec) if spec is not None else None
      if lowered is None:  # an unplanned budget, an invalid spec, a policy not applied: already an error row
        bar.update(1)
        continue
      work.submit(i, spec, lowered)
      work.analyse(i, lowered, residuals, spec)  # while XLA compiles
      work.collect(done_only=True)
    work.collect(done_only=False)
  for first, later in work.twins.items():
    for i in later:
      rows[i].update({k: rows[first][k] for k in ("status", "error", *MEMORY_KEYS, "flops_xla_raw", "cpu",
                                                  "step_time_estimate")})
  _recompute_seconds(rows)
  bar.close()
  return rows, warnings


def _exact_offload_bytes(row: dict[str, Any], dump_dir: str) -> None:
  """A TPU row that offloads to host memory, compiled with a dump: its device footprint from the buffer assignment's
  HBM total (:func:`jaxckpt.analysis.offload_device_bytes`, exact), where the compiler's statistics give only an upper
  estimate (their peak is the host space's figure; docs/tpu.md)."""
  if row.get("backend") != "tpu" or not row.get("host_footprint_bytes"):
    return
  try:
    spaces = read_memory_spaces(dump_dir)
  except JaxckptError:  # no memory-usage report in the dump: the statistics stand
    return
  device, _ = offload_device_bytes(row, spaces)
  resident = (row.get("argument_bytes") or 0) + (row.get("output_bytes") or 0) - (row.get("alias_bytes") or 0)
  row["temp_bytes"] = max(device - resident, 0)
  row["footprint_bytes"] = footprint_bytes(row)


def step_time_estimate(compiled: Any, topology: Topology, mesh: Any) -> dict[str, Any]:
  """A row's ``step_time_estimate``: the step time of its compiled program on the topology's chips
  (:func:`jaxckpt.timing.step_time_of`; docs/timing.md).

  Args:
    compiled: the row's :class:`~jaxckpt.step.CompiledPolicy` (its program text: the executable's or the
      compiled-stats cache's), or its program read (:class:`~jaxckpt.analysis.HloModule`).
    topology: the slice or cluster it was compiled for.
    mesh: the mesh it was sharded over.

  Returns:
    :meth:`jaxckpt.timing.StepTime.as_dict` (the fit's ``compiled_step`` form): ``seconds`` of one step on one
    device, ``bound`` (the term with the most busy seconds: ``compute``, ``memory``, ``collectives:ici``, ...),
    ``terms`` (busy seconds per term), ``exposed`` (seconds the core waited for each asynchronous term), ``overlap``,
    ``chip``, ``sources``, ``flops`` (per step); and ``recompute_s``, filled beside a ``none`` row: the seconds this
    policy's step takes beyond ``none``'s, what its recomputation costs (``None`` otherwise).

  Raises:
    JaxckptError: a program the time model cannot read (:func:`jaxckpt.timing.estimate_step_time`).
  """
  return {**step_time_of(compiled, topology=topology, mesh=mesh).as_dict(), "recompute_s": None}


def _recompute_seconds(rows: list[dict[str, Any]]) -> None:
  """Fills each estimate's ``recompute_s`` against the ``none`` row's estimate (where there is one)."""
  base = next((r["step_time_estimate"] for r in rows if r["policy"] == "none" and r["status"] == STATUS_OK
               and r.get("step_time_estimate")), None)
  if base is None:
    return
  for row in rows:
    if row["status"] == STATUS_OK and row.get("step_time_estimate"):
      row["step_time_estimate"] = {**row["step_time_estimate"],
                                   "recompute_s": row["step_time_estimate"]["seconds"] - base["seconds"]}


class _RowCompiles:
  """The report's compiles in flight (:func:`compile_rows`): each row's step lowered here, compiled in the pool
  (identical programs once), analysed while XLA compiles, and its statistics collected when done.

  Attributes:
    rows, warnings: the report's rows and warnings (filled in place).
    pending, comparing: compiles in flight, and XLA:CPU comparisons, by future.
    programs: fingerprint of a lowered program -> the first row that compiles it; twins: that row -> later rows.
  """

  def __init__(self, target: Target, rows: list[dict[str, Any]], warnings: list[str], bar: Any,
               pool: concurrent.futures.Executor, *, tx: Any, mesh: Any, topology: Topology | None, options: Any,
               stats_only: bool,
               builder: StepBuilder, xla_dump_dir: str | None, cpu: tuple[Any, Any, Any]):
    self.target, self.rows, self.warnings, self.bar, self.pool = target, rows, warnings, bar, pool
    self.tx, self.mesh, self.options, self.stats_only, self.builder = tx, mesh, options, stats_only, builder
    self.topology = topology
    self.xla_dump_dir = xla_dump_dir
    self.cpu_target, self.cpu_mesh, self.cpu_builder = cpu
    self.pending: dict[concurrent.futures.Future, tuple[int, str | None]] = {}
    self.comparing: dict[concurrent.futures.Future, int] = {}
    self.programs: dict[str, int] = {}
    self.twins: dict[int, list[int]] = {}

  def fail(self, i: int, err: BaseException) -> None:
    self.rows[i].update(status=STATUS_ERROR, error=one_line(err))

  def lower(self, i: int, spec: Any) -> Any:
    """Row ``i``'s step traced and lowered, or ``None`` (the row an error: invalid for the target, not applied)."""
    row = self.rows[i]
    try:
      lowered = lower_policy(self.target, spec, tx=self.tx, mesh=self.mesh, options=self.options,
                             stats_only=self.stats_only, builder=self.builder)
    except Exception as err:  # noqa: BLE001 - invalid spec for this target, or a tracing error: an error row
      self.fail(i, err)
      if isinstance(err, JaxckptError):
        self.warnings.append(f"policy {row['policy']!r} is invalid for {self.target.name}: {one_line(err)}")
      return None
    row["remat_regions"] = count_remat_regions(lowered.traced.jaxpr)
    _check_applied(row, spec)
    if row["status"] == STATUS_ERROR:
      return None
    row["stages_s"] = dict(lowered.stages)
    return lowered

  def submit(self, i: int, spec: Any, lowered: Any) -> None:
    """Compiles row ``i``'s program in the pool (once per identical program; a later twin takes the first's
    statistics), and its XLA:CPU comparison."""
    row = self.rows[i]
    if self.xla_dump_dir is None and lowered.fingerprint in self.programs:  # the same program: its stats are ours
      first = self.programs[lowered.fingerprint]
      row["same_program_as"] = self.rows[first]["policy"]
      row["compile_s"] = lowered.lower_s  # traced and lowered, not compiled
      self.twins.setdefault(first, []).append(i)
      self.bar.update(1)
      return
    self.programs[lowered.fingerprint] = i
    dump_dir, extra = None, {}
    if self.xla_dump_dir is not None:
      dump_dir = os.path.join(self.xla_dump_dir, _slug(i, row["policy"]))
      os.makedirs(dump_dir, exist_ok=True)
      extra = xla_dump.dump_options(dump_dir)
    compile_it = functools.partial(lowered.compile, extra, program_text=self.topology is not None)
    self.pending[self.pool.submit(compile_it)] = (i, dump_dir)  # before the analysis: XLA never waits
    if self.cpu_builder is not None:
      try:
        on_cpu = lower_policy(self.cpu_target, spec, tx=self.tx, mesh=self.cpu_mesh, options=self.options,
                              stats_only=self.stats_only, builder=self.cpu_builder)
        self.comparing[self.pool.submit(on_cpu.compile)] = i
      except Exception as err:  # noqa: BLE001 - as _finish_cpu: a warning, the row stands
        self.warnings.append(f"policy {row['policy']!r}: the XLA:CPU comparison failed: {one_line(err)}")

  def analyse(self, i: int, lowered: Any, residuals: bool, spec: Any = None) -> None:
    """FLOPs from the jaxpr (scan bodies × trip count) and the residual analysis of row ``i``; a warning for
    primitives the FLOP count has no rule for, and one for a policy that recomputes grouped matmuls its name promises
    to keep (:func:`jaxckpt.policies._meaning.grouped_matmul_gap`)."""
    row, stages = self.rows[i], self.rows[i]["stages_s"]
    try:
      t0 = time.perf_counter()
      count = lowered.flop_count
      row["flops"] = count.total
      t1 = time.perf_counter()
      stages["flops"] = t1 - t0
      if count.uncounted_primitives:
        note = uncounted_warning(count.uncounted_primitives)
        if note not in self.warnings:
          self.warnings.append(note)
      if any(p in count.by_primitive for p in GROUPED_MATMULS):
        for gap in sorted({g for p in spec_policies(spec) if (g := grouped_matmul_gap(p.name)) is not None}):
          self.warnings.append(f"policy {row['policy']!r}: {gap} (in its FLOPs)")
      if residuals:
        with tracing_for(mesh_platform(self.mesh)):  # the kernels the compiled step runs (auto attention)
          summary = analyse_residuals(lowered.step)
        row["residual_bytes"], row["activation_residual_bytes"] = summary["bytes"], summary["activation_bytes"]
        row["residuals"] = summary
        if summary["in_kernel_bytes"]:
          self.warnings.append(
              f"policy {row['policy']!r}: {format_bytes(summary['in_kernel_bytes'])} of residuals are kept inside "
              f"kernels ({', '.join(summary['in_kernel_sources'][:3])}), unnamed: no name policy saves or offloads "
              "them; only a policy that recomputes the kernel's region drops them")
        stages["residuals"] = time.perf_counter() - t1
    except Exception as err:  # noqa: BLE001 - analysis failures leave the compiled stats standing
      self.warnings.append(f"policy {row['policy']!r}: FLOP/residual analysis failed: {one_line(err)}")

  def collect(self, *, done_only: bool) -> None:
    """Fills in the rows of finished compiles (``done_only``), or waits for every one."""
    if done_only:
      for future in [f for f in self.pending if f.done()]:
        self._finish(future)
      for future in [f for f in self.comparing if f.done()]:
        self._finish_cpu(future)
      return
    for future in concurrent.futures.as_completed(list(self.pending)):
      self._finish(future)
    for future in concurrent.futures.as_completed(list(self.comparing)):
      self._finish_cpu(future)

  def _finish(self, future: concurrent.futures.Future) -> None:
    i, dump_dir = self.pending.pop(future)
    row = self.rows[i]
    try:
      compiled = future.result()
      row["stages_s"]["compile"] = compiled.compile_s
      row.update(compiled.memory)
      row["flops_xla_raw"] = xla_raw_flops(compiled)
      row["compile_s"] = compiled.seconds
      if self.topology is not None:
        try:
          module = parse_hlo(compiled.hlo_text())
          row["step_time_estimate"] = step_time_estimate(module, self.topology, self.mesh)
          if self.mesh is not None:
            row["collectives"] = [u.as_dict() for u in collectives_by_axis(module, mesh_shape(self.mesh))]
        except Exception as err:  # noqa: BLE001 - the estimate failing leaves the compiled stats standing
          self.warnings.append(f"policy {row['policy']!r}: no step-time estimate: {one_line(err)}")
      self.warnings.extend(f"policy {row['policy']!r}: the compiler logged: {line}" for line in compiled.compiler_log)
      if dump_dir is not None:
        _exact_offload_bytes(row, dump_dir)
        xla_dump.prune_dump(dump_dir)
        row["xla_dump"] = {"dir": dump_dir, "files": xla_dump.dump_files(dump_dir),
                           "peak_buffers": xla_dump.peak_buffers(dump_dir)}
    except Exception as err:  # noqa: BLE001 - a policy that fails to compile (e.g. out of memory) is an error row
      self.fail(i, err)
    self.bar.update(1)

  def _finish_cpu(self, future: concurrent.futures.Future) -> None:
    i = self.comparing.pop(future)
    try:
      compiled = future.result()
      self.rows[i]["cpu"] = {"backend": "cpu", "batch_size": batch_size_of(self.cpu_target), **compiled.memory,
                             "flops_xla_raw": xla_raw_flops(compiled), "compile_s": compiled.seconds}
    except Exception as err:  # noqa: BLE001 - the comparison failing leaves the row standing, with a warning
      self.warnings.append(f"policy {self.rows[i]['policy']!r}: the XLA:CPU comparison failed: {one_line(err)}")
