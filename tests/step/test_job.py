"""The compile job (jaxckpt.step.compile_job): an entry point's keywords resolved once into a frozen record, the
batch checked against the mesh, and the one refusal of a run of steps beside a mesh or a topology. Nothing here
compiles."""

from __future__ import annotations

import dataclasses

import pytest

from jaxckpt.errors import JaxckptError, MeshSpecError, TopologyError
from jaxckpt.sharding import resolve_placement
from jaxckpt.step import CompileJob, compile_job, runs_beside_refusal, shipped_target


def test_a_job_is_resolved_once_and_frozen():
  target = shipped_target("mlp", "tiny")
  job = compile_job(target, mesh="data=1", compiler_options={"xla_cpu_enable_fast_math": False})
  assert isinstance(job, CompileJob) and job.target is target and job.topology is None
  assert dict(job.mesh.shape) == {"data": 1} and job.placement.mesh is job.mesh
  assert job.compiler_options == {"xla_cpu_enable_fast_math": False} and job.tx is not None
  with pytest.raises(dataclasses.FrozenInstanceError):
    job.tx = None  # type: ignore[misc]
  placement = resolve_placement("data=1")
  assert compile_job(target, mesh=placement).placement is placement  # a Placement is taken as it is


def test_a_run_beside_a_mesh_or_a_topology_is_refused_in_one_wording():
  target = shipped_target("mlp", "tiny")
  with pytest.raises(JaxckptError, match=r"^measure=True runs each policy on one device; it does not take "
                                         r"mesh='data=1' \(drop one of them\)$"):
    compile_job(target, mesh="data=1", runs="measure=True")
  with pytest.raises(TopologyError, match=r"^measure=True runs steps on this machine, but topology='v5e:2x2' "
                                          "compiles for hardware that is not here"):
    compile_job(target, topology="v5e:2x2", runs="measure=True")  # refused before the topology is loaded
  flags = runs_beside_refusal("--profile", topology="--topology h100:8")
  assert isinstance(flags, TopologyError) and str(flags).startswith("--profile runs steps on this machine, but "
                                                                    "--topology h100:8 compiles for")


def test_the_batch_is_checked_against_the_mesh_unless_the_caller_chooses_it(monkeypatch):
  from jaxckpt.sharding import _mesh

  target = shipped_target("mlp", "tiny", batch_size=3)
  monkeypatch.setattr(_mesh, "check_batch_size", _refuse)
  with pytest.raises(MeshSpecError, match="batch_size=3"):
    compile_job(target, mesh="data=1")
  assert compile_job(target, mesh="data=1", check_batch=False).mesh is not None


def _refuse(batch_size, mesh, *, flag="batch_size"):
  raise MeshSpecError(f"{flag}={batch_size} does not split over the mesh")
