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

from jaxckpt import sharding
from jaxckpt.errors import JaxckptError, TracingError
from jaxckpt._units import format_bytes
from jaxckpt.planner._effect import annotate_rows
from jaxckpt.policies._model import ModelPolicy
from jaxckpt.training._profile import check_profile_dir, profile_slug
from jaxckpt.report._compile import compile_rows, one_line, report_compiler_options
from jaxckpt.report._keys import REPORT_KEYS, STATUS_ERROR, STATUS_OK, empty_row, unit_descriptions
from jaxckpt.report._measure import measure_policy
from jaxckpt.report._policies import expand_policies
from jaxckpt.step._targets import ModelTarget, Target, batch_size_of, with_batch
from jaxckpt.step._build import target_structure
from jaxckpt.step._compile import check_mesh_use, mesh_use_notes, step_builder
from jaxckpt.sharding import Placement, Topology
from jaxckpt.step._job import compile_job
from jaxckpt.schema import SCHEMA_VERSION, versions


@dataclasses.dataclass(frozen=True)
class Report:
  """A finished report.

  Attributes:
    data: exactly what ``--json`` writes (keys :data:`jaxckpt.report._keys.REPORT_KEYS`).
    placement: where it was compiled (:class:`~jaxckpt.sharding.Placement`), ``None`` for a report read back from
      its JSON (the title then reads the topology's name there).
  """

  data: dict[str, Any]
  placement: Placement | None = dataclasses.field(default=None, compare=False, repr=False)

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


def compiler_disagreements(rows: Sequence[Mapping[str, Any]], key: str = "footprint_bytes") -> list[str]:
  """Where XLA:CPU would have misled: one line when the rows' ``cpu`` comparison (``--compare-cpu``) orders the
  policies by ``key`` otherwise than the compiler of the report, naming both orders.

  Args:
    rows: report rows; those ok and with both figures count.
    key: a memory key (bytes).

  Returns:
    ``[]`` when both compilers order the policies alike (ties as ties), else one line.
  """
  both = [r for r in rows if r["status"] == STATUS_OK and r.get(key) is not None
          and (r.get("cpu") or {}).get(key) is not None]

  def order(value) -> str:
    ranked = sorted(both, key=lambda r: (value(r), r["policy"]))
    text = ranked[0]["policy"] if ranked else ""
    for a, b in zip(ranked, ranked[1:]):
      text += f" {'=' if value(a) == value(b) else '<'} {b['policy']}"
    return text

  def rank(value) -> list[int]:
    return [sum(value(o) < value(r) for o in both) for r in both]

  here, cpu = (lambda r: r[key]), (lambda r: r["cpu"][key])
  if len(both) < 2 or rank(here) == rank(cpu):
    return []
  backend = both[0].get("backend") or "the report's compiler"
  return [f"the {backend} compiler and XLA:CPU order the policies differently by {key.replace('_bytes', '')} "
          f"per device: {backend} {order(here)}; cpu {order(cpu)}"]



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


def _per_chip(target: Target, mesh: jax.sharding.Mesh) -> Target:
  """``target`` at the batch one device of ``mesh`` holds (the global batch over the batch axes), for the XLA:CPU
  comparison of a data-parallel mesh.

  Raises:
    JaxckptError: a mesh with an ``fsdp`` axis > 1 (its per-device program shards parameters: not one CPU device's).
  """
  shape = sharding.mesh_shape(mesh)
  if shape.get("fsdp", 1) > 1:
    raise JaxckptError(f"compare_cpu=True compiles the per-chip step on one CPU device: the data-parallel program; "
                       f"mesh={sharding.format_mesh(shape)!r} also shards parameters and optimizer state over fsdp, "
                       "which one CPU device does not: compare a data-only mesh (mesh='data=N')")
  split = 1
  for axis in sharding.BATCH_AXES:
    split *= shape.get(axis, 1)
  accum = target.grad_accum_steps if isinstance(target, ModelTarget) else 1
  return with_batch(target, batch_size_of(target) // split, grad_accum_steps=accum)


def memory_verdicts(rows: list[dict[str, Any]], placement: Placement) -> list[str]:
  """On a GPU, the rows whose compiled footprint exceeds the memory XLA may use there become errors that keep their
  bytes (XLA:GPU compiles any program; the TPU compiler refuses such a program itself, and a CPU's RAM is no verdict).

  Args:
    rows: report rows (changed in place).
    placement: where they were compiled.

  Returns:
    One warning per row turned into an error.
  """
  if placement.platform != "gpu":
    return []
  limit, source = placement.memory()
  out = []
  for row in rows:
    if row["status"] == STATUS_OK and row["footprint_bytes"] is not None and row["footprint_bytes"] > limit:
      row.update(status=STATUS_ERROR, error=f"does not fit: footprint {format_bytes(row['footprint_bytes'])} per "
                 f"GPU > {format_bytes(limit)} XLA may use ({source}); XLA:GPU compiles it, a GPU could not run it")
      out.append(f"policy {row['policy']!r} {row['error']}")
  return out


GPU_UNROLLED_NOTE = ("unrolled layers on XLA:GPU: the compiler schedules each layer's recomputation early, so remat "
                     "saves little (full remat about -30%); scan the layers (nnx.scan, --scan) for remat to act "
                     "(docs/gpu.md#published-gpu-configurations)")
"""The note of a GPU report on an unrolled model (measured on llama2-7b, docs/gpu.md: 8 unrolled layers, full remat
23.88 -> 23.23 GiB; scanned 39.82 -> 8.81 GiB)."""


def gpu_unrolled_note(structure: str, platform: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """:data:`GPU_UNROLLED_NOTE` for a GPU compile of unrolled layers with a remat row, else nothing."""
  remat = any(r["policy"] != "none" for r in rows)
  return [GPU_UNROLLED_NOTE] if platform == "gpu" and structure.startswith("unrolled") and remat else []


def _run_rows(target: Target, rows: list[dict[str, Any]], warnings: list[str], *, steps: int, warmup: int,
              compiler_options: Mapping[str, Any] | None, measure: bool, profile: str | None, profile_steps: int,
              progress: bool) -> None:
  """``--measure`` / ``--profile``: runs each ok row's policy (:func:`jaxckpt.report._measure.measure_policy`) and
  fills in its measured columns; a policy that fails to run becomes an error row."""
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
    mesh: "str | Mapping[str, int] | jax.sharding.Mesh | Placement | None" = None,
    profile: str | None = None,
    profile_steps: int = 3,
    topology: "str | Topology | None" = None,
    compare_cpu: bool = False,
    memory_fraction: float | None = None,
) -> Report:
  """Compiles ``target``'s train step under every policy and reports memory, FLOPs, residuals (and measurements).

  Args:
    target: :func:`~jaxckpt.report.shipped_target`, :func:`~jaxckpt.report.load_target` or your own
      :class:`~jaxckpt.step.ModelTarget` / :class:`~jaxckpt.step.LossTarget`.
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
      ``jax.sharding.Mesh``; :mod:`jaxckpt.sharding`): every memory statistic is then **per device** (XLA's
      ``memory_analysis()`` of the SPMD-partitioned program each device runs), FLOPs and residuals stay those of
      the whole step. ``data["mesh"]`` records it (``None`` = one device, unsharded). A
      :class:`~jaxckpt.sharding.Placement` (:func:`jaxckpt.sharding.resolve_placement`) gives the mesh, the topology
      and a GPU's memory fraction at once.
    profile: an XProf log directory: each successful policy also runs ``profile_steps`` warm steps (real inputs,
      after the warm-up) under :func:`jaxckpt.training._profile.profile_trace` into ``profile/<policy slug>/``, in the same
      fresh process as ``measure`` (:mod:`jaxckpt.report._measure`); the row's ``profile`` gives the run directory
      and its ``*.xplane.pb`` files. ``None`` = no traces.
    profile_steps: traced steps per policy (≥ 1).
    topology: compile for a TPU slice or a GPU cluster without its hardware (``"v5e:2x2"``, ``"h100:8"`` or a
      :class:`~jaxckpt.sharding.Topology`): its compiler (the TPU compiler of libtpu, XLA:GPU of JAX's CUDA plugin)
      compiles each step sharded over ``mesh`` laid over the chips (default: every chip on the ``data`` axis); every
      memory statistic is per chip, ``data["backend"]`` is ``tpu`` or ``gpu``, ``data["topology"]`` the name and
      ``data["compiler"]`` the compiler. On a GPU a row whose footprint exceeds the memory XLA may use there
      (:meth:`jaxckpt.sharding.Placement.memory`) is an error row that keeps its bytes (XLA:GPU compiles any
      program). Nothing runs (no ``measure``, no ``profile``).
    compare_cpu: with ``topology``: also compile each row's policy on XLA:CPU, one device, at the per-chip batch
      (the global batch over the mesh's batch axes; ``data``-only meshes), into the row's ``cpu``; a warning names
      where the two compilers order the policies differently by footprint.
    memory_fraction: a GPU topology's share of device memory XLA may use (``XLA_PYTHON_CLIENT_MEM_FRACTION``;
      :func:`jaxckpt.sharding.memory_fraction`; default the environment's, else JAX's 0.75).

  Returns:
    The :class:`Report`. Policies invalid for the target, failing to compile or to run are error rows (with a
    warning for invalid ones); the others complete.

  Raises:
    PolicySpecError: a spec that does not parse.
    MeshSpecError: a bad mesh, or a batch size it cannot split.
    JaxckptError: ``measure`` or ``profile`` with a mesh (they run one device per policy); an unwritable
      ``profile`` directory; ``compare_cpu`` without a topology or with an ``fsdp`` axis.
    TopologyError: ``measure`` or ``profile`` with a topology (nothing to run on), a bad topology name, its
      compiler missing or of the wrong release (:func:`jaxckpt.sharding.get_topology`).
  """
  runs = "measure=True" if measure else None if profile is None else f"profile={os.fspath(profile)!r}"
  job = compile_job(target, mesh=mesh, topology=topology, memory_fraction=memory_fraction, tx=tx,
                    compiler_options=compiler_options, runs=runs)
  if compare_cpu and job.topology is None:
    raise JaxckptError("compare_cpu=True puts XLA:CPU's figures beside a topology's: give topology= too")
  placement, tx, mesh = job.placement, job.tx, job.mesh
  profile = None if profile is None else check_profile_dir(profile, flag="profile")
  platform = sharding.mesh_platform(mesh)
  cpu_target = _per_chip(target, mesh) if compare_cpu else None
  builder = step_builder(target, tx=tx, mesh=mesh)  # the abstract model and state, built once for every row
  check_mesh_use(builder, mesh)  # a mesh axis the model cannot use: one line, before any row
  try:
    block_types = builder.block_types
  except TracingError as err:  # your model raised while traced: every row is an error row naming your file:line
    if any(p == "all" for p in policies):
      raise
    specs, block_types = expand_policies(policies, {}, backend=platform), None
    rows = [dict(empty_row(str(spec)), status=STATUS_ERROR, error=str(err)) for spec in specs]
    warnings = [str(err)]
  if block_types is not None:
    specs = expand_policies(policies, block_types, backend=platform)
    rows, warnings = compile_rows(job, specs, builder=builder, jobs=jobs, xla_dump_dir=xla_dump, residuals=residuals,
                                  progress=progress, cpu_target=cpu_target)
  warnings += mesh_use_notes(builder, mesh)
  warnings += memory_verdicts(rows, placement)
  warnings += saving_warnings(rows)
  warnings += annotate_rows(rows, backend=platform, compiler_options=report_compiler_options(
      compiler_options, backend=platform), offloads={str(s): bool(getattr(s, "offloads", False)) for s in specs})
  if compare_cpu:
    warnings += compiler_disagreements(rows)
  if measure or profile is not None:
    _run_rows(target, rows, warnings, steps=steps, warmup=warmup, compiler_options=compiler_options, measure=measure,
              profile=profile, profile_steps=profile_steps, progress=progress)
  try:
    structure = target_structure(target, model=builder.abstract_model if builder.is_model else None,
                                 scanned=builder.scanned)
  except TracingError:  # already every row's error
    structure = "unrolled" if builder.scanned is None else "scan" if builder.scanned else "unrolled"
  warnings += gpu_unrolled_note(structure, platform, rows)
  where = placement.compiled_for()
  if mesh is None:
    where["device_count"] = jax.device_count()  # as before: the devices this process has
  data = {
      "schema_version": SCHEMA_VERSION,
      "model": target.name,
      "preset": target.preset,
      **where,
      "mesh_given": placement.mesh is not None and placement.mesh_given,
      "structure": structure,
      "batch_size": batch_size_of(target),
      "grad_accum_steps": getattr(target, "grad_accum_steps", 1),
      "versions": versions(),
      "compiler_options": report_compiler_options(compiler_options, backend=platform),
      "warnings": warnings,
      "units": unit_descriptions(where),
      "rows": rows,
  }
  assert tuple(data) == REPORT_KEYS  # internal invariant, not user input
  return Report(data, placement)
