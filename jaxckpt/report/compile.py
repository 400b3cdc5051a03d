"""Compiled per-policy statistics, without allocating: memory, FLOPs, residuals, compile time, XLA dumps.

Per policy the full train step is traced and lowered from ``jax.ShapeDtypeStruct``s in this thread (tracing holds
the GIL), then compiled by XLA in a thread pool (compilation releases the GIL), with the state donated and
:func:`jaxckpt.remat_compiler_options` (the XLA:CPU remat fix). While XLA compiles, this thread counts FLOPs and
analyses residuals. A policy that fails anywhere becomes an error row; the others complete.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from tqdm.auto import tqdm

from jaxckpt.errors import JaxckptError
from jaxckpt.flops import jaxpr_flops
from jaxckpt.policies import Budget, ModelPolicy
from jaxckpt.report.keys import STATUS_ERROR, empty_row
from jaxckpt.report.residuals import analyse_residuals
from jaxckpt.report.steps import policy_step
from jaxckpt.report.targets import ModelTarget, Target
from jaxckpt import sharding
from jaxckpt.report import xla_dump
from jaxckpt.xla import memory_stats, remat_compiler_options

__all__ = ["compile_rows", "xla_raw_flops", "one_line", "STATS_ONLY_OPTIONS", "report_compiler_options"]

STATS_ONLY_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""Options of the stats-only compiles (the executables are never run): LLVM's optimisation level does not touch
HLO buffer assignment, so every memory stat is identical (checked in tests/test_report.py) and XLA:CPU compiles
~3× faster. The measuring child compiles with full optimisation."""


def report_compiler_options(extra: Mapping[str, Any] | None = None, *, stats_only: bool = True) -> dict[str, Any]:
  """The options the report compiles with: the CPU remat fix, :data:`STATS_ONLY_OPTIONS` (if ``stats_only``), and
  the caller's ``extra`` (which win)."""
  return remat_compiler_options(extra={**(STATS_ONLY_OPTIONS if stats_only else {}), **(extra or {})})


def one_line(err: BaseException) -> str:
  """An exception as one line: ``'Type: first line of the message'`` (JaxckptErrors without the type)."""
  text = str(err).strip().splitlines()[0] if str(err).strip() else ""
  return text if isinstance(err, JaxckptError) else f"{type(err).__name__}: {text}"


def xla_raw_flops(compiled: jax.stages.Compiled) -> int | None:
  """XLA's ``cost_analysis()["flops"]`` of a compiled step (a loop body counted once), or ``None``."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - backends without cost analysis raise various errors
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  flops = analysis.get("flops") if isinstance(analysis, Mapping) else None
  return int(flops) if flops is not None and flops >= 0 else None


def _slug(index: int, policy: str) -> str:
  return f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.+-]+', '_', policy)[:80]}"


def _compile(lowered, options: dict[str, Any]) -> tuple[jax.stages.Compiled, float]:
  started = time.perf_counter()
  compiled = lowered.compile(compiler_options=options or None)
  return compiled, time.perf_counter() - started


def _plan_budgets(target: Target, specs: Sequence[ModelPolicy], rows: list[dict[str, Any]], warnings: list[str], *,
                  tx: optax.GradientTransformation, compiler_options: Mapping[str, Any] | None,
                  mesh: Any = None) -> list[Any]:
  """Replaces each budget by its plan's policy (``None`` where planning failed: an error row and a warning).
  Plans are made for one device: under a mesh a budget is an error row."""
  from jaxckpt.planner import plan_policy  # noqa: PLC0415 - the planner builds on this package

  cache: dict[str, Any] = {}
  candidates = None
  resolved: list[Any] = []
  for i, spec in enumerate(specs):
    if not isinstance(spec, Budget):
      resolved.append(spec)
      continue
    try:
      if mesh is not None:
        raise JaxckptError(f"budget plans are made for one device; drop --mesh for {spec}, or give the plan's "
                           "layered policy (from jaxckpt-plan) instead")
      plan = plan_policy(target, spec, tx=tx, compiler_options=compiler_options, cache=cache, candidates=candidates)
    except Exception as err:  # noqa: BLE001 - an infeasible budget or a target that cannot be planned: an error row
      rows[i].update(status=STATUS_ERROR, error=one_line(err))
      warnings.append(f"policy {rows[i]['policy']!r}: {one_line(err)}")
      resolved.append(None)
      continue
    candidates = plan.candidates
    rows[i]["plan"] = {k: v for k, v in plan.to_json().items() if k != "candidates"}
    resolved.append(plan.policy)
  return resolved


def compile_rows(
    target: Target,
    specs: Sequence[ModelPolicy],
    *,
    tx: optax.GradientTransformation,
    jobs: int = 1,
    xla_dump_dir: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    residuals: bool = True,
    stats_only: bool = True,
    progress: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
  """Compiles the train step of ``target`` under each spec and collects its statistics.

  Args:
    target: what to compile.
    specs: parsed policies (validated against the target here); a :class:`~jaxckpt.policies.Budget` is first
      planned (:func:`jaxckpt.planner.plan_policy`, sharing compiled anchors between budgets), its row keeping
      the budget as ``policy`` and the plan under ``plan``; an infeasible budget is an error row.
    tx: the optimizer of the step.
    jobs: XLA compilations running at once (threads), ≥ 1.
    xla_dump_dir: if set, XLA's dumps of policy ``i`` go to ``xla_dump_dir/<ii>-<policy>/`` (text files only).
    compiler_options: extra XLA options, merged with jaxckpt's remat fix.
    residuals: run the residual analysis (``residual_bytes``, ``residuals``).
    stats_only: compile with :data:`STATS_ONLY_OPTIONS` (same memory stats, faster).
    progress: show a tqdm bar on stderr.
    mesh: compile the step sharded over this mesh (:mod:`jaxckpt.sharding`: batch over ``data``/``fsdp``,
      parameters and optimizer state over ``fsdp`` by the FSDP rule); the memory stats are then those of one device
      (XLA reports the SPMD-partitioned, per-device program). ``None``: one device, unsharded.

  Returns:
    ``(rows, warnings)``: one row per spec in order (keys :data:`jaxckpt.report.keys.ROW_KEYS`, memory in bytes,
    ``compile_s`` = trace + lower + XLA compile seconds), and one warning line per spec invalid for the target.
  """
  rows = [empty_row(str(spec)) for spec in specs]
  warnings: list[str] = []
  base_options = report_compiler_options(compiler_options, stats_only=stats_only)
  pending: dict[concurrent.futures.Future, tuple[int, float, str | None]] = {}
  bar = tqdm(total=len(specs), desc="compiling policies", unit="policy", disable=not progress, leave=False)

  def fail(i: int, err: BaseException) -> None:
    rows[i].update(status=STATUS_ERROR, error=one_line(err))

  def finish(future: concurrent.futures.Future) -> None:
    i, lower_s, dump_dir = pending.pop(future)
    try:
      compiled, compile_s = future.result()
      rows[i].update(memory_stats(compiled))
      rows[i]["flops_xla_raw"] = xla_raw_flops(compiled)
      rows[i]["compile_s"] = lower_s + compile_s
      if dump_dir is not None:
        xla_dump.prune_dump(dump_dir)
        rows[i]["xla_dump"] = {"dir": dump_dir, "files": xla_dump.dump_files(dump_dir),
                               "peak_buffers": xla_dump.peak_buffers(dump_dir)}
    except Exception as err:  # noqa: BLE001 - a policy that fails to compile (e.g. out of memory) is an error row
      fail(i, err)
    bar.update(1)

  resolved = _plan_budgets(target, specs, rows, warnings, tx=tx, compiler_options=compiler_options, mesh=mesh)
  model = None
  if mesh is not None:  # the step computes with the parameters all-gathered over fsdp (sharding.gathered_params)
    if isinstance(target, ModelTarget):
      from flax import nnx

      model = nnx.eval_shape(target.make_model)  # where the scanned layer axes are (never split by FSDP)
      target = dataclasses.replace(target, loss_fn=sharding.gather_params_in_loss(target.loss_fn, mesh))
    else:
      loss = target.loss
      target = dataclasses.replace(
          target, loss=lambda params, batch, *, policy: loss(sharding.gathered_params(params, mesh), batch,
                                                             policy=policy))
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    for i, spec in enumerate(resolved):
      if spec is None:  # a budget that could not be planned: already an error row
        bar.update(1)
        continue
      started = time.perf_counter()
      try:
        step = policy_step(target, spec, tx)
        shardings = {}
        if mesh is not None:
          shardings = sharding.step_shardings(step.state, step.batch, mesh, model=model,
                                              params=step.params)
        traced = jax.jit(step.step, donate_argnums=0, **shardings).trace(step.state, step.batch)
        lowered = traced.lower()
      except Exception as err:  # noqa: BLE001 - invalid spec for this target, or a tracing error: an error row
        fail(i, err)
        if isinstance(err, JaxckptError):
          warnings.append(f"policy {rows[i]['policy']!r} is invalid for {target.name}: {one_line(err)}")
        bar.update(1)
        continue
      lower_s = time.perf_counter() - started
      options = dict(base_options)
      dump_dir = None
      if xla_dump_dir is not None:
        dump_dir = os.path.join(xla_dump_dir, _slug(i, rows[i]["policy"]))
        os.makedirs(dump_dir, exist_ok=True)
        options.update(xla_dump.dump_options(dump_dir))
      pending[pool.submit(_compile, lowered, options)] = (i, lower_s, dump_dir)
      # While XLA compiles: FLOPs from the jaxpr (scan bodies × trip count) and the residual analysis.
      try:
        rows[i]["flops"] = jaxpr_flops(traced.jaxpr).total
        if residuals:
          summary = analyse_residuals(step)
          rows[i]["residual_bytes"] = summary["bytes"]
          rows[i]["residuals"] = summary
      except Exception as err:  # noqa: BLE001 - analysis failures leave the compiled stats standing
        warnings.append(f"policy {rows[i]['policy']!r}: FLOP/residual analysis failed: {one_line(err)}")
      for future in [f for f in pending if f.done()]:
        finish(future)
    for future in concurrent.futures.as_completed(list(pending)):
      finish(future)
  bar.close()
  return rows, warnings
