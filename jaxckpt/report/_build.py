"""The memory report as a Python API: compile (and optionally run) a target under many policies, collect one row each.

Example::

    >>> from jaxckpt.report import build_report, shipped_target, write_outputs
    >>> report = build_report(shipped_target("vit", "tiny", batch_size=8), ["none", "dots_saveable", "full"])
    >>> [row["temp_bytes"] for row in report.rows]  # bytes, compiled, nothing allocated
    >>> write_outputs(report, html="report.html")
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from tqdm.auto import tqdm

from jaxckpt.training import _sharding as sharding
from jaxckpt.errors import JaxckptError
from jaxckpt._units import format_bytes
from jaxckpt.analysis._effect import annotate_rows
from jaxckpt.errors import PolicySpecError
from jaxckpt.policies._model import ModelPolicy, parse_model_policy
from jaxckpt.training._profile import check_profile_dir, profile_slug
from jaxckpt.report._compile import compile_rows, one_line, report_compiler_options
from jaxckpt.report._keys import REPORT_KEYS, STATUS_ERROR, STATUS_OK
from jaxckpt.report._measure import measure_policy
from jaxckpt.report._policies import expand_policies
from jaxckpt.step._targets import Target
from jaxckpt.step._build import default_optimizer, target_structure
from jaxckpt.step._compile import step_builder
from jaxckpt.schema import SCHEMA_VERSION, versions

__all__ = ["Report", "build_report", "saving_warnings"]


@dataclasses.dataclass(frozen=True)
class Report:
  """A finished report: ``data`` is exactly what ``--json`` writes (keys :data:`jaxckpt.report._keys.REPORT_KEYS`)."""

  data: dict[str, Any]

  @property
  def rows(self) -> list[dict[str, Any]]:
    """One dict per policy (keys :data:`jaxckpt.report._keys.ROW_KEYS`)."""
    return self.data["rows"]

  def row(self, policy: str) -> dict[str, Any]:
    """The row of a canonical policy string.

    Raises:
      KeyError: no such row; the message lists the rows.
    """
    for row in self.rows:
      if row["policy"] == policy:
        return row
    raise KeyError(f"no row for policy {policy!r}; rows: {', '.join(r['policy'] for r in self.rows)}")

  @property
  def ok(self) -> bool:
    """Whether any row succeeded (the CLI exits 0 then, else 1)."""
    return any(r["status"] == STATUS_OK for r in self.rows)


def saving_warnings(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """One warning per remat policy whose compiled ``temp_bytes`` is not below ``none``'s (it saves nothing)."""
  base = next((r for r in rows if r["policy"] == "none" and r["status"] == STATUS_OK), None)
  if base is None or base["temp_bytes"] is None:
    return []
  out = []
  for row in rows:
    if row["policy"] != "none" and row["status"] == STATUS_OK and row["temp_bytes"] is not None \
        and row["temp_bytes"] >= base["temp_bytes"]:
      out.append(f"policy {row['policy']!r} saves no memory: temp {format_bytes(row['temp_bytes'])} ≥ none's "
                 f"{format_bytes(base['temp_bytes'])}")
  return out


def _offloads(policy: str) -> bool:
  """Whether a row's policy text offloads saved values (False for budgets and texts that do not parse)."""
  try:
    return bool(getattr(parse_model_policy(policy), "offloads", False))
  except PolicySpecError:
    return False


def _unique_slugs(policies: Sequence[str]) -> list[str]:
  """:func:`jaxckpt.training._profile.profile_slug` of each policy, ``-2``, ``-3``… appended to repeats (one run each)."""
  out: list[str] = []
  for policy in policies:
    slug = base = profile_slug(policy)
    n = 1
    while slug in out:
      n += 1
      slug = f"{base}-{n}"
    out.append(slug)
  return out


def build_report(
    target: Target,
    policies: Sequence[str | ModelPolicy] = ("all",),
    *,
    measure: bool = False,
    steps: int = 5,
    warmup: int = 2,
    xla_dump: str | None = None,
    jobs: int = 1,
    residuals: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    tx: optax.GradientTransformation | None = None,
    progress: bool = True,
    mesh: "str | Mapping[str, int] | jax.sharding.Mesh | None" = None,
    profile: str | None = None,
    profile_steps: int = 3,
) -> Report:
  """Compiles ``target``'s train step under every policy and reports memory, FLOPs, residuals (and measurements).

  Args:
    target: :func:`~jaxckpt.report.shipped_target`, :func:`~jaxckpt.report.load_target` or your own
      :class:`~jaxckpt.report.ModelTarget` / :class:`~jaxckpt.report.LossTarget`.
    policies: spec strings in :func:`jaxckpt.policies.parse_model_policy`'s grammar or parsed ones; ``"all"``
      expands to ``none``, every zero-argument canonical policy and ``save_only_these_names:<name>`` per emitted
      name (offload policies on GPU/TPU only). Budgets (``budget:40%``, ``budget:1GiB``, ``auto``) are planned
      (:mod:`jaxckpt.planner`) and their rows carry the plan. Repeats are dropped.
    measure: also run each policy: median step time and measured peak memory (:mod:`jaxckpt.report._measure`).
    steps: timed steps per policy when measuring (≥ 1).
    warmup: untimed steps before them (≥ 1).
    xla_dump: directory for XLA's memory reports, one subdirectory per policy; ``None`` = none.
    jobs: XLA compilations at once (threads).
    residuals: run the residual analysis.
    compiler_options: extra XLA options for every compile (merged with the CPU remat fix).
    tx: the optimizer (default ``optax.adamw(1e-3)``).
    progress: tqdm bars on stderr.
    mesh: compile each step sharded over a device mesh (``"data=4,fsdp=2"``, ``{"data": 8}`` or a
      ``jax.sharding.Mesh``; :mod:`jaxckpt.training._sharding`): every memory statistic is then **per device** (XLA's
      ``memory_analysis()`` of the SPMD-partitioned program each device runs), FLOPs and residuals stay those of
      the whole step. ``data["mesh"]`` records it (``None`` = one device, unsharded).
    profile: an XProf log directory: each successful policy also runs ``profile_steps`` warm steps (real inputs,
      after the warm-up) under :func:`jaxckpt.training._profile.profile_trace` into ``profile/<policy slug>/``, in the same
      fresh process as ``measure`` (:mod:`jaxckpt.report._measure`); the row's ``profile`` gives the run directory
      and its ``*.xplane.pb`` files. ``None`` = no traces.
    profile_steps: traced steps per policy (≥ 1).

  Returns:
    The :class:`Report`. Policies invalid for the target, failing to compile or to run are error rows (with a
    warning for invalid ones); the others complete.

  Raises:
    PolicySpecError: a spec that does not parse.
    MeshSpecError: a bad mesh, or a batch size it cannot split.
    JaxckptError: ``measure`` or ``profile`` with a mesh (they run one device per policy); an unwritable
      ``profile`` directory.
  """
  tx = tx or default_optimizer()
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    mesh = sharding.make_mesh(mesh)
  if mesh is not None:
    sizes = {a.shape[0] for a in jax.tree.leaves(target.batch) if len(a.shape)}
    for size in sorted(sizes):
      sharding.check_batch_size(size, mesh)
    if measure or profile is not None:
      what = "measure=True" if measure else f"profile={os.fspath(profile)!r}"
      raise JaxckptError(f"{what} runs each policy on one device; it does not take mesh={sharding.format_mesh(mesh)!r} "
                         "(drop one of them)")
  if profile is not None:
    profile = check_profile_dir(profile, flag="profile")
  builder = step_builder(target, tx=tx, mesh=mesh)  # the abstract model and state, built once for every row
  specs = expand_policies(policies, builder.block_types)
  rows, warnings = compile_rows(target, specs, tx=tx, builder=builder, jobs=jobs, xla_dump_dir=xla_dump,
                                compiler_options=compiler_options, residuals=residuals, progress=progress,
                                mesh=mesh)
  warnings += saving_warnings(rows)
  warnings += annotate_rows(rows, backend=jax.default_backend(), compiler_options=report_compiler_options(
      compiler_options), offloads={r["policy"]: _offloads(r["policy"]) for r in rows})
  if measure or profile is not None:
    todo = [r for r in rows if r["status"] == STATUS_OK]
    if target.ref is None and todo:
      done = "measured" if measure else "profiled"
      warnings.append(f"target has no ref (a Python object): {done} in this process, less exactly than in a "
                      "fresh one per policy")
    names = _unique_slugs([r["policy"] for r in todo])
    desc = "measuring policies" if measure else "profiling policies"
    for row, name in tqdm(list(zip(todo, names)), desc=desc, unit="policy", disable=not progress, leave=False):
      try:
        policy = row["plan"]["policy"] if row["plan"] is not None else row["policy"]
        result = measure_policy(target, policy, steps=steps, warmup=warmup, compiler_options=compiler_options,
                                measure=measure, profile_dir=profile, profile_name=name, profile_steps=profile_steps)
        if measure:
          row["step_time_s"] = result["step_time_s"]
          row["peak_bytes_measured"] = result["peak_bytes_measured"]
        row["profile"] = result["profile"]
      except Exception as err:  # noqa: BLE001 - a policy that fails to run (e.g. out of memory) is an error row
        row.update(status=STATUS_ERROR, error=one_line(err))
  data = {
      "schema_version": SCHEMA_VERSION,
      "model": target.name,
      "preset": target.preset,
      "backend": jax.default_backend(),
      "device_count": jax.device_count(),
      "mesh": None if mesh is None else sharding.mesh_shape(mesh),
      "structure": target_structure(target, model=builder.abstract_model if builder.is_model else None),
      "grad_accum_steps": getattr(target, "grad_accum_steps", 1),
      "versions": versions(),
      "compiler_options": report_compiler_options(compiler_options),
      "warnings": warnings,
      "rows": rows,
  }
  assert tuple(data) == REPORT_KEYS  # internal invariant, not user input
  return Report(data)
