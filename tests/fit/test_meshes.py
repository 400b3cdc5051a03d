"""The mesh in the fit search: factorizations of a slice's chips into data × fsdp × tensor, meshes whose
train state cannot fit dropped without a compile, the rest ranked by a lower bound and fitted, the fastest verified
configuration answered; the tensor all-reduce term of the time model, and its collectives priced by the timing room's
link model."""

from __future__ import annotations

import json
import math

import pytest

import jaxckpt
from jaxckpt.fit import (Accelerator, AffineModel, BatchFit, FitPoint, accelerator, candidates, mesh_shapes,
                         traffic_seconds)
from jaxckpt.cli._fit import main
from jaxckpt.fit._meshes import STATE_COPIES, state_bytes
from jaxckpt.fit._plan import tensor_bytes_per_example
from jaxckpt.fit._speed import collective_bytes
from jaxckpt.step import shipped_target
from jaxckpt.timing import RESOLUTION
from tests.extras import needs_libtpu
from tests.sharding.test_topology import TOPOLOGY


def test_mesh_shapes_are_every_factorization_with_tensor_bounded():
  """8 chips, heads divisible by 4: every data·fsdp·tensor = 8 with tensor ∈ {1, 2, 4}; a model that cannot use
  tensor gets only data × fsdp; tensor never above max_tensor nor a size that does not divide the heads."""
  shapes = mesh_shapes(8, tensor_divides=4)
  assert all(math.prod(s.values()) == 8 for s in shapes)
  assert {s.get("tensor", 1) for s in shapes} == {1, 2, 4}
  assert len(shapes) == 4 + 3 + 2 == len({tuple(sorted(s.items())) for s in shapes})
  assert shapes[0] == {"fsdp": 8}
  assert {s.get("tensor", 1) for s in mesh_shapes(8, tensor=False)} == {1}
  assert {s.get("tensor", 1) for s in mesh_shapes(256, tensor_divides=64, max_tensor=8)} == {1, 2, 4, 8}
  assert {s.get("tensor", 1) for s in mesh_shapes(12, tensor_divides=6)} == {1, 2, 3, 6}
  with pytest.raises(Exception, match="chips=0"):
    mesh_shapes(0)


def test_the_llm_states_its_bytes_and_tensor_all_reduces():
  """Llama 3.1 8B from its abstract model: 8.03B float32 parameters (32.1 GB), the train state 4× that; its tensor
  all-reduces are 4 × L × S × E bfloat16 values per sequence (Megatron: two per layer forward, two backward)."""
  target = shipped_target("llm", "llama3.1-8b")
  params, state, heads, uses_tensor = state_bytes(target)
  assert params == pytest.approx(4 * 8.03e9, rel=2e-3) and state == STATE_COPIES * params
  assert heads == 32 and uses_tensor
  assert tensor_bytes_per_example(target) == 4 * 32 * 8192 * 4096 * 2
  assert not state_bytes(shipped_target("gpt", "tiny"))[3]  # no logical axis names: no tensor axis


def test_tensor_divides_the_fsdp_traffic_and_adds_its_all_reduces():
  """With tensor t each device gathers 1/t of the parameters over fsdp and all-reduces 2 (t − 1)/t of its
  activation bytes; the compute of a candidate is split over data × fsdp × tensor devices."""
  params, acts = 32e9, 8e9
  assert collective_bytes(params, {"fsdp": 128, "tensor": 2}, tensor_bytes=acts) == pytest.approx(
      (3 * 127 / 128 * params / 2 + 2 * 1 / 2 * acts, 0.0))
  assert collective_bytes(params, {"data": 2, "fsdp": 64, "tensor": 2})[1] == pytest.approx(
      2 * 1 / 2 * params / 128)
  v6e, unit = accelerator("v6e"), 128
  points = tuple(FitPoint(b, 10 * 2**30 + b * 2**20, int(1e15 * b / unit), 1e12 * b / unit, 1.0,
                          param_bytes=int(params)) for b in (unit, 2 * unit))
  fit = BatchFit(policy="full", max_batch_size=2 * unit, footprint_bytes=points[-1].footprint_bytes,
                 limit_bytes=32 * 2**30, compiles=2, model=AffineModel(2**20, 10 * 2**30),
                 points=points, method="affine", capped=False, verified_over=None, unit=unit, seconds=0.0)
  (cand,) = [c for c in candidates([fit], 2 * unit, v6e, mesh_shape={"fsdp": 128, "tensor": 2},
                                   tensor_bytes_per_example=acts) if c.accum == 1]
  assert cand.terms["compute_s"] == pytest.approx(2e15 / (unit * 2) / v6e.peak_flops)
  # Priced by the timing room's link model (jaxckpt.timing.mesh_links), not at the chip's 400 GB/s for every axis: the
  # mesh laid over v6e's 16x16 torus puts each tensor pair on 2 chips of a row of 16 (one link, 100 GB/s one way), and
  # each fsdp group on 8 of a row's 16 chips (one link) and a whole column that wraps around (two): 300 GB/s.
  fsdp_s = 3 * 127 / 128 * params / 2 / 300e9
  tensor_s = 2 * 1 / 2 * (acts * 2 * unit / unit) / 100e9  # 2 sequences per tensor pair
  assert cand.terms["collectives_s"] == pytest.approx(fsdp_s + tensor_s)
  assert cand.mesh == {"fsdp": 128, "tensor": 2}


def test_the_roofline_prices_its_collectives_with_the_timing_rooms_links():
  """One link model for the fit's roofline and the compiled programs' times (jaxckpt.timing): H100 nodes of 8 GPUs,
  NCCL's rings at 92% of a link. FSDP inside a node moves 3 × 7/8 of the parameters over NVLink; a data axis of one
  GPU per node all-reduces the gradient shards over that GPU's NIC; an fsdp axis over two whole nodes runs 8 rings, one
  per NIC (min(NVLink, 8 NICs) per GPU, where the fit's own model had one NIC); a whole v6e 16x16 slice is the chip's
  400 GB/s. The roofline's function is traffic_seconds; jaxckpt.timing.collective_seconds is the link model's."""
  params, nvlink, nic = 32e9, 450e9 * 0.92, 50e9 * 0.92
  h100, v6e = accelerator("h100"), accelerator("v6e")
  micro, step = traffic_seconds(h100, params, {"data": 4, "fsdp": 8})
  assert micro == pytest.approx(3 * 7 / 8 * params / nvlink)
  assert step == pytest.approx(2 * 3 / 4 * (params / 8) / nic)
  assert traffic_seconds(h100, params, {"fsdp": 16})[0] == pytest.approx(3 * 15 / 16 * params / min(450e9, 8 * 50e9)
                                                                            / 0.92)
  assert traffic_seconds(v6e, params, {"fsdp": 256})[0] == pytest.approx(3 * 255 / 256 * params / v6e.ici_bandwidth)
  assert traffic_seconds(accelerator("v6e", peak_flops=1e15), params, {"fsdp": 256}) == traffic_seconds(
      v6e, params, {"fsdp": 256})  # given figures keep the chip's links
  assert traffic_seconds(Accelerator("hand-made", 1e12, 1e12), params, {"fsdp": 8}) == (0.0, 0.0)  # no chip, no links
  with pytest.warns(DeprecationWarning, match="jaxckpt.fit.collective_seconds moved: use jaxckpt.fit.traffic_seconds"):
    assert jaxckpt.fit.collective_seconds is traffic_seconds


@pytest.mark.parametrize("argv, expected", [
    (["--mesh", "auto", "--global-batch-size", "16"], "--mesh auto searches the mesh of a --topology"),
    (["--mesh", "auto", "--topology", TOPOLOGY], "--mesh auto searches the mesh of a --topology"),
    (["--mesh", "fsdp=4", "--topology", TOPOLOGY, "--global-batch-size", "16", "--max-meshes", "0"],
     "--max-meshes 0 must be ≥ 1"),
    (["--mesh", "auto", "--topology", TOPOLOGY, "--global-batch-size", "16", "--min-batch", "32"],
     "--min-batch 32 > --global-batch-size 16: no micro-batch between"),
])
def test_mesh_auto_bad_flags_are_one_line(argv, expected, capsys, monkeypatch):
  """A bad flag is one line before the compiler is looked for: the same line with libtpu missing."""
  monkeypatch.setattr("jaxckpt.sharding._topology.libtpu_version", lambda: None)
  assert main(["--model", "llm", "--preset", "tiny", *argv]) == 2
  err = capsys.readouterr().err
  assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@needs_libtpu
@pytest.mark.slow
def test_mesh_auto_on_a_topology_answers_the_fastest_verified_mesh(tmp_path, capsys):
  """llama tiny on v5e:2x2 (4 chips), 64 MiB per chip: the mesh with the least state per chip is fitted first (the
  calibration), then the best by the bound up to two; the winner is the fastest verified choice among them by its
  compiled program's step time, and its footprint fits. At 1 MiB the state-heavy meshes are dropped without a compile and the error names each."""
  path = tmp_path / "m.json"
  assert main(["--model", "llm", "--preset", "tiny", "--topology", TOPOLOGY, "--seq-len", "64", "--global-batch-size",
               "16", "--mesh", "auto", "--max-meshes", "2", "--memory", "1MiB", "--policies", "nothing_saveable",
               "--no-progress", "--json", str(path)]) == 2  # 1 MiB: no mesh's batch fits, each says why
  err = capsys.readouterr().err
  assert "no mesh of v5e:2x2's 4 chips fits" in err and "too big (train state" in err, err
  assert main(["--model", "llm", "--preset", "tiny", "--topology", TOPOLOGY, "--seq-len", "64", "--global-batch-size",
               "16", "--mesh", "auto", "--max-meshes", "2", "--memory", "64MiB", "--policies", "nothing_saveable",
               "--json", str(path)]) == 0
  out, err = capsys.readouterr()
  # progress names each mesh before its compiles (a compiler that crashes the process has said where) and after
  progress = [line for line in err.splitlines() if line.startswith("jaxckpt-fit: mesh fsdp=4: ")]
  assert [line.split(": ")[2].split(" (")[0] for line in progress] == ["fitting", "fitted"], err
  data = json.loads(path.read_text())
  search = data["mesh_search"]
  rows = search["meshes"]
  assert len(rows) == len(mesh_shapes(4, tensor_divides=4))
  fitted = [r for r in rows if r["status"] == "fitted"]
  assert len(fitted) == 2 and sum(r["plan"]["compiles"] for r in fitted) == search["compiles"]
  least_state = min(r["state_bytes_per_device"] for r in rows)
  assert rows[0]["status"] == "fitted" and rows[0]["state_bytes_per_device"] == least_state  # the calibration
  assert rows[0]["mesh"] == {"fsdp": 4}  # least state, no tensor axis
  others = [r["bound_s"] for r in rows[1:] if r["status"] == "fitted"]
  assert all(r["bound_s"] >= max(others) for r in rows if r["status"] == "not fitted")  # fitted by the bound
  # Each mesh's winner is timed from its compiled program (the mesh search's rank_compiled=1), and the meshes are
  # ranked by those estimates.
  choices = [r["plan"]["global_batch"] for r in fitted]
  assert all(c["ranked_by"] == "compiled" and c["compiled_step"]["seconds"] > 0 for c in choices)
  best = min(fitted, key=lambda r: r["plan"]["global_batch"]["compiled_step"]["seconds"])
  assert search["winner"] == best["mesh"] and data["global_batch"] == best["plan"]["global_batch"]
  assert data["global_batch"]["footprint_bytes"] <= search["limit_bytes"]
  assert "meshes within 64.00 MiB per device" in out and "the winner's mesh" in out
  # A fitted mesh within the time model's resolution of the winner is named as a tie, with how much slower it is.
  fastest = best["plan"]["global_batch"]["compiled_step"]["seconds"]
  overs = {str(r["mesh"]): r["plan"]["global_batch"]["compiled_step"]["seconds"] / fastest - 1 for r in fitted
           if r is not best}
  assert {str(c["mesh"]): c["over"] for c in search["close"]} == pytest.approx(
      {m: o for m, o in overs.items() if o <= RESOLUTION}, abs=1e-4)
  assert ("a tie to the time model" in out) == bool(search["close"])


def test_a_candidate_over_the_host_memory_does_not_fit():
  """The chip table's host memory per chip bounds offload: a candidate whose host bytes exceed it is left out, and
  when every one does the error names the host memory and the flag; v6e's table figure is 1536 GiB ÷ 8 chips."""
  assert accelerator("v6e").host_memory_bytes == 192 * 2**30
  unit = 4
  points = tuple(FitPoint(b, 2**30 + b * 2**20, int(1e12 * b), 1e9 * b, 1.0, host_bytes=b * 2**30 // unit,
                          param_bytes=2**20) for b in (unit, 4 * unit))
  fit = BatchFit(policy="offload", max_batch_size=4 * unit, footprint_bytes=points[-1].footprint_bytes,
                 limit_bytes=32 * 2**30, compiles=2, model=AffineModel(2**20, 2**30),
                 points=points, method="affine", capped=False, verified_over=None, unit=unit, seconds=0.0)
  small_host = accelerator("v6e", host_memory_bytes=2 * 2**30)  # 1 GiB per example on the host: b ≤ 2 per device
  table = candidates([fit], 4 * unit, small_host, mesh_shape={"fsdp": unit})
  assert {c.micro_batch for c in table} == {unit, 2 * unit} and all(c.host_bytes <= 2 * 2**30 for c in table)
  with pytest.raises(Exception, match=r"offloads more than the host memory per device \(512\.00 MiB on TPU v6e.*"
                                      r"host_memory_bytes"):
    candidates([fit], 4 * unit, accelerator("v6e", host_memory_bytes=2**29), mesh_shape={"fsdp": unit})
  with pytest.raises(Exception, match="host_memory_bytes=0 must be > 0"):
    accelerator("v6e", host_memory_bytes=0)


def test_the_plan_counts_the_compiles_the_compiler_refused():
  """A refused compile (the TPU compiler's out-of-memory at compile time) is a point over the limit: the plan counts
  it and its table's title says so, beside the compiles and the seconds."""
  from jaxckpt.fit import FitPlan
  from jaxckpt.fit import to_table

  points = (FitPoint(4, 2**20, 10, None, 1.0), FitPoint(8, 2**30, 20, None, 0.5, refused=True))
  fit = BatchFit(policy="full", max_batch_size=4, footprint_bytes=2**20, limit_bytes=2**24, compiles=2,
                 model=AffineModel(2**18, 0), points=points, method="affine", capped=False, verified_over=2**30, unit=1,
                 seconds=0.0)
  plan = FitPlan((fit,), 2**24, "given", None, None, 12.0)
  assert plan.refusals == 1 and plan.as_json()["refusals"] == 1
  assert "2 compiles (1 refused for memory), 12 s" in to_table(plan, wide=True)


@needs_libtpu
def test_an_axis_that_splits_a_torus_dimension_is_laid_as_maxtext_allows():
  """An axis of 8 on v6e's 16x16 torus is no product of whole torus dimensions: ``jax.make_mesh`` refuses it (the
  8B mesh search raised a traceback there); the topology lays it by splitting a physical dimension, as MaxText's
  ``allow_split_physical_axes`` does, so every factorization of the chips is a mesh the search can compile."""
  from jaxckpt.sharding import get_topology

  topo = get_topology("v6e:16x16")
  for spec in ("data=32,fsdp=8", "fsdp=128,tensor=2", "data=2,fsdp=16,tensor=8"):
    mesh = topo.mesh(spec)
    assert ",".join(f"{k}={v}" for k, v in mesh.shape.items()) == spec
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in topo.devices)


def test_later_meshes_start_where_the_calibration_line_predicts(monkeypatch):
  """After the calibration mesh, each fixed policy's first compiles on another mesh are the batch its line predicts
  there and the successor (the pair that verifies an answer): a right guess answers in those two compiles, a wrong
  one costs compiles, never the answer; a guess at the cap (the global batch) that fits is the answer in one
  compile, one that is over goes on searching. The guess on the calibration mesh itself is its own answer; a tensor
  axis of 2 with the same state per device doubles the examples per data × fsdp group."""
  import types

  from jaxckpt.fit import _search
  from jaxckpt.fit._meshes import MeshOption, _Bounds

  limit = 2**30
  monkeypatch.setattr(_search, "_lowered_point", lambda target, policy, batch, **kw: (batch, None, None, 0.0))
  monkeypatch.setattr(_search, "_compiled_point",  # fits up to 32
                      lambda batch, lowered, mesh, started: FitPoint(batch, 2**29 + batch * 2**24, batch, None, 1.0))
  target = shipped_target("llm", "llama-tiny")
  right = _search.max_batch_size(target, "nothing_saveable", limit, max_batch=1024, jobs=1, guess=32)
  assert (right.max_batch_size, right.compiles, [p.batch for p in right.points]) == (32, 2, [32, 33])
  wrong = _search.max_batch_size(target, "nothing_saveable", limit, max_batch=1024, jobs=1, guess=8)
  assert wrong.max_batch_size == 32 and wrong.compiles == 4 and wrong.verified_over is not None

  state = 2**28
  fit = BatchFit(policy="nothing_saveable", max_batch_size=32, footprint_bytes=right.footprint_bytes,
                 limit_bytes=limit, compiles=2, model=AffineModel(2**29, 2**24), points=right.points, method="affine",
                 capped=False, verified_over=None, unit=4, seconds=0.0)
  calibration = MeshOption({"fsdp": 4}, state, 0.0, "fitted", plan=types.SimpleNamespace(fits=(fit,)))
  bounds = _Bounds(target, 1024, accelerator("v5e"))
  assert bounds.guesses(calibration, calibration, limit) == {"nothing_saveable": 32}
  tensor = MeshOption({"fsdp": 2, "tensor": 2}, state, 0.0, "not fitted")
  assert bounds.guesses(calibration, tensor, limit) == {"nothing_saveable": 2 * 32 // 4 * 2}
  assert bounds.guesses(calibration, MeshOption({"fsdp": 4}, limit, 0.0, "not fitted"), limit) == {}
  capped = _search.max_batch_size(target, "nothing_saveable", limit, max_batch=16, jobs=1, guess=64)
  assert (capped.max_batch_size, capped.compiles, capped.capped, capped.estimated_max_batch) == (16, 1, True, None)
  over = _search.max_batch_size(target, "nothing_saveable", limit, max_batch=64, jobs=1, guess=64)
  assert over.max_batch_size == 32 and over.points[0].batch == 64  # a guess at the cap that is over: the search goes on


def test_a_footprint_that_shrinks_between_two_compiles_is_no_error_when_the_cap_fits(monkeypatch):
  """Two compiles of nearly the same bytes can come out in either order (Llama 3.1 8B's offload list on v6e-256's
  data=32,fsdp=8: 0.72 GB less at 4 per chip than at 1, which once made the whole mesh 'refused'): when the cap fits,
  that is the answer; a footprint that truly does not grow and leaves the answer open is still one line."""
  from jaxckpt.errors import JaxckptError
  from jaxckpt.fit import _search

  monkeypatch.setattr(_search, "_lowered_point", lambda target, policy, batch, **kw: (batch, None, None, 0.0))
  monkeypatch.setattr(_search, "_compiled_point",
                      lambda batch, lowered, mesh, started: FitPoint(batch, 2**30 - batch * 2**10, batch, None, 1.0))
  target = shipped_target("llm", "llama-tiny")
  fit = _search.max_batch_size(target, "nothing_saveable", 2**30, max_batch=64, jobs=1)  # probes 16 and the cap
  assert fit.max_batch_size == 64 and fit.capped and fit.compiles == 2
  with pytest.raises(JaxckptError, match="does not grow with the batch"):  # both under, the cap not compiled
    _search.max_batch_size(target, "nothing_saveable", 2**30, max_batch=1024, jobs=1)


def test_a_fit_of_one_compile_still_prices_the_hbm_of_smaller_micro_batches():
  """A fit answered by one compile (a pinned batch, a guess at the cap) has no line of its own: the smaller
  micro-batches with accumulation still move the step's bytes (in proportion to the batch), so accumulation is not
  credited with an HBM term of 0 (found by a helper: data=4 won on a tiny model for that reason alone)."""
  unit = 4
  point = FitPoint(16, 2**30, int(1e12 * 16), 1e9 * 16, 1.0, host_bytes=0, param_bytes=2**20)
  fit = BatchFit(policy="nothing_saveable", max_batch_size=16, footprint_bytes=2**30, limit_bytes=32 * 2**30,
                 compiles=1, model=AffineModel(2**30, 0.0), points=(point,), method="affine", capped=True,
                 verified_over=None, unit=unit, seconds=0.0)
  table = candidates([fit], 16, accelerator("v6e"), mesh_shape={"fsdp": unit})
  assert {c.micro_batch for c in table} == {4, 8, 16}
  hbm = {c.micro_batch: c.terms["hbm_s"] for c in table}
  assert all(v > 0 for v in hbm.values()) and hbm[4] == pytest.approx(hbm[16], rel=1e-6), hbm


@needs_libtpu
def test_a_min_batch_the_mesh_cannot_split_is_named_as_such():
  """``min_batch=6`` on fsdp=4: the error says it must be a multiple of 4 (micro-batches 8 and 16 divide 16, so "no
  micro-batch divides it; use a multiple of 6" was wrong advice)."""
  from jaxckpt.errors import JaxckptError
  from jaxckpt.fit._plan import _check_global_batch
  from jaxckpt.sharding import topology_mesh

  mesh = topology_mesh(TOPOLOGY, "fsdp=4")
  with pytest.raises(JaxckptError, match=r"^min_batch=6 must be a multiple of 4 \(the mesh's batch axes\)$"):
    _check_global_batch(16, accelerator("v5e"), mesh, 6)
  _check_global_batch(16, accelerator("v5e"), mesh, 8)  # 8 and 16 divide it


def test_max_batch_caps_the_micro_batch_beside_a_global_batch(tmp_path):
  """``--max-batch 4`` with ``--global-batch-size 16`` (found ignored by a helper): the search stops at 4 and the
  answer accumulates (4 × 4), where without it 16 × 1 fits the same memory."""
  path = tmp_path / "f.json"
  argv = ["--model", "gpt", "--preset", "tiny", "--memory", "64MiB", "--global-batch-size", "16", "--policies",
          "nothing_saveable", "--device", "h100", "--no-progress", "--json", str(path)]
  assert main([*argv, "--max-batch", "4"]) == 0
  data = json.loads(path.read_text())
  assert (data["global_batch"]["micro_batch_size"], data["global_batch"]["grad_accum_steps"]) == (4, 4)
  assert data["rows"][0]["max_batch_size"] == 4 and data["rows"][0]["capped"]
  assert main(argv) == 0
  assert json.loads(path.read_text())["global_batch"]["micro_batch_size"] == 16


@needs_libtpu
@pytest.mark.slow  # the mesh search of llama tiny on v5e:2x2 in worker processes (~35 s)
def test_a_compiler_crash_on_one_mesh_is_its_row_and_the_search_answers_from_the_others(tmp_path, capsys,
                                                                                         monkeypatch):
  """libtpu's SparseCore code generation crashed (a stack overflow) on one mesh of the Mixtral 8x7B search and took the
  whole process with it. Compiles of the search run in worker processes: a worker that aborts on the calibration mesh
  (fault injection: JAXCKPT_CRASH_COMPILE_ON_MESH) makes that mesh's row "compiler crashed", naming the signal, and the
  search fits the next meshes in its place and answers from them."""
  from jaxckpt.step._isolated import CRASH_ENV

  monkeypatch.setenv(CRASH_ENV, "fsdp=4")
  path = tmp_path / "m.json"
  assert main(["--model", "llm", "--preset", "tiny", "--topology", TOPOLOGY, "--seq-len", "64", "--global-batch-size",
               "16", "--mesh", "auto", "--max-meshes", "2", "--memory", "64MiB", "--policies", "nothing_saveable",
               "--json", str(path)]) == 0
  out, err = capsys.readouterr()
  rows = {str(r["mesh"]): r for r in json.loads(path.read_text())["mesh_search"]["meshes"]}
  crashed = rows[str({"fsdp": 4})]
  assert crashed["status"] == "compiler crashed" and crashed["reason"].startswith(
      "compiler crashed (SIGABRT) compiling over mesh fsdp=4"), crashed
  fitted = [r for r in rows.values() if r["status"] == "fitted"]
  assert len(fitted) == 2 and {"fsdp": 4} not in [r["mesh"] for r in fitted]  # two others fitted in its place
  assert "compiler crashed" in out and "fsdp=4: compiler crashed (SIGABRT)" in out
  assert "jaxckpt-fit: mesh fsdp=4: compiler crashed" in err
