"""``custom:search``: MaxText's ``custom`` lists — per checkpoint name device, offload or recompute —
chosen by the fit planner's time model from each name's bytes and saved FLOPs, then fitted and verified by compiles."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from jaxckpt.fit import (AffineModel, BatchFit, FitPoint, NameCost, accelerator, custom_plans, custom_policy,
                         name_costs, plan_fit)
from jaxckpt.cli._fit import main
from jaxckpt.fit._names import name_lists
from jaxckpt.models.llm import LLM_PRESETS
from jaxckpt.step import shipped_target
from tests.extras import needs_libtpu

SEQ = 256


def test_name_costs_are_the_named_values_bytes_and_the_flops_their_keeping_saves():
  """llama-tiny (2 layers, float32) at 256 tokens: each name's bytes are its values' (L × S × channels × 4 bytes per
  example); the layer input is the remat boundary and saves no FLOPs; mlpwo saves none either (the backward reads no
  output of the last matmul); q/k/v/out_proj and the MLP inputs save their matmuls' 2·S·E·channels FLOPs per layer
  and the attention context its kernel's; the FLOPs add up exactly (the check every search makes)."""
  c = LLM_PRESETS["llama-tiny"]
  costs, additivity = name_costs(shipped_target("llm", "llama-tiny", seq_len=SEQ))
  by = {x.name: x for x in costs}
  assert list(by) == ["decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0",
                      "mlpwi_1", "mlpwo"]
  per_token = {"decoder_layer_input": c.dim, "query_proj": c.num_heads * c.head_dim, "key_proj": c.num_kv_heads *
               c.head_dim, "value_proj": c.num_kv_heads * c.head_dim, "context": c.num_heads * c.head_dim,
               "out_proj": c.dim, "mlpwi_0": c.mlp_dim, "mlpwi_1": c.mlp_dim, "mlpwo": c.dim}
  for name, channels in per_token.items():
    assert by[name].bytes_per_example == c.num_layers * SEQ * channels * 4, name
  assert [n for n, x in by.items() if x.boundary] == ["decoder_layer_input"]
  assert by["decoder_layer_input"].flops_per_example == by["mlpwo"].flops_per_example == 0
  matmul = 2 * SEQ * c.num_layers * c.dim
  assert by["value_proj"].flops_per_example == matmul * c.num_kv_heads * c.head_dim
  assert by["out_proj"].flops_per_example == matmul * c.num_heads * c.head_dim
  assert by["mlpwi_0"].flops_per_example == by["mlpwi_1"].flops_per_example == matmul * c.mlp_dim
  assert by["query_proj"].flops_per_example > matmul * c.num_heads * c.head_dim  # the matmul and RoPE
  assert by["context"].flops_per_example > 2 * by["out_proj"].flops_per_example  # scores and their weighted sum
  assert additivity == 0.0


def _full_fit(unit: int = 4, limit: int = 2**30) -> BatchFit:
  """A full-remat fit on ``unit`` devices: 256 MiB fixed + 8 MiB per example on a device, 1 TFLOP and 1 GB per
  example, fitting 64 per device (256 examples)."""
  points = tuple(FitPoint(b, 2**28 + b // unit * 2**23, int(1e12 * b), 1e9 * b, 1.0, param_bytes=2**30)
                 for b in (16 * unit, 64 * unit))
  return BatchFit(policy="nothing_saveable", max_batch_size=96 * unit, footprint_bytes=points[-1].footprint_bytes,
                  limit_bytes=limit, compiles=2, model=AffineModel(2**28, 2**21),
                  points=points, method="affine", capped=False, verified_over=None, unit=unit, seconds=0.0)


COSTS = (NameCost("layer_in", 2**22, 0.0, True), NameCost("proj", 2**22, 2e11, False),
         NameCost("big", 2**24, 3e11, False), NameCost("useless", 2**22, 0.0, False))


def test_the_search_keeps_what_saves_most_per_byte_and_offloads_only_with_a_host_link():
  """With memory for one name: on a TPU chip (a host link) the plan offloads what the device cannot hold while the
  host transfers stay under the compute; on a device without a host link nothing is offloaded; a name whose
  keeping saves no FLOPs is never kept; the prediction is the full-remat line plus the names on the device."""
  unit, g = 4, 64 * 4
  full = _full_fit(unit, limit=2**28 + 64 * (2**23 + 2**22) + 2**20)  # at 64 per device: full + 4 MiB per example
  v6e = accelerator("v6e")
  plans = custom_plans(COSTS, full, g, v6e, mesh_shape={"fsdp": unit}, top=3)
  assert plans and all("useless" not in p.save + p.offload for p in plans)
  best = plans[0]
  assert best.est_step_s <= min(p.est_step_s for p in plans)
  kept = {n: 2**22 if n != "big" else 2**24 for n in best.save}
  per_device = best.micro_batch // unit
  assert best.footprint_bytes == pytest.approx(2**28 + per_device * (2**23 + sum(kept.values()))
                                               - (per_device * 2**22 if "layer_in" in best.offload else 0), abs=2)
  assert best.footprint_bytes <= full.limit_bytes
  no_link = dataclasses.replace(v6e, host_bandwidth=0.0)
  local = custom_plans(COSTS, full, g, no_link, mesh_shape={"fsdp": unit}, top=5)
  assert local and all(not p.offload for p in local)
  assert custom_policy(("proj",), ("layer_in",)) == "save_and_offload_only_these_names:proj/layer_in"
  with pytest.raises(Exception, match="proj both saved and offloaded"):
    custom_policy(("proj",), ("proj",))


def test_the_host_memory_bounds_what_the_search_offloads():
  """A host of 1 MiB per device holds none of the names at any micro-batch: no plan offloads."""
  full = _full_fit()
  small = accelerator("v6e", host_memory_bytes=2**20)
  assert all(not p.offload for p in custom_plans(COSTS, full, 256, small, mesh_shape={"fsdp": 4}, top=10))


@pytest.mark.slow
def test_custom_search_on_cpu_fits_and_verifies_its_list():
  """docs/fit.md's example: llama-tiny on this CPU in 12 MiB (full remat fits 2 sequences), a compute-bound device:
  each list is fitted like any policy (its largest batch compiled beside one over the memory), its predicted
  footprint within 10% of the compile, nothing offloaded (a CPU has no host link); a list that missed its planned
  batch is followed by one that leaves the excess free, which fits where it was planned; the JSON says it all."""
  target = shipped_target("llm", "llama-tiny", seq_len=SEQ)
  plan = plan_fit(target, ["nothing_saveable", "custom:search"], "12MiB", global_batch=16,
                  device=accelerator("h100", bandwidth=1e15))  # compute-bound, as docs/fit.md's example
  assert plan.custom is not None and plan.custom.plans
  best = plan.custom.plans[0]
  assert not best.offload and best.save
  fits = {f.policy: f for f in plan.fits}
  fit = fits[best.policy]
  assert fit.max_batch_size is not None and fit.footprint_bytes <= plan.limit_bytes
  compiled = fit.by_batch.get(best.micro_batch)
  if compiled is not None:
    assert compiled.footprint_bytes == pytest.approx(best.footprint_bytes, rel=0.1)
  last = plan.custom.plans[-1]
  assert fits[last.policy].max_batch_size >= last.micro_batch, plan.custom
  data = plan.as_json()["custom_search"]
  assert [n["name"] for n in data["names"]][0] == "decoder_layer_input" and data["plans"][0]["policy"] == best.policy


@pytest.mark.parametrize("argv, expected", [
    (["--model", "llm", "--policies", "custom:search"], "--global-batch-size"),
    (["--model", "llm", "--policies", "custom:search", "--global-batch-size", "8", "--custom-lists", "0"],
     "--custom-lists 0 must be ≥ 1"),
    (["--model", "llm", "--policies", "nothing_saveable", "--global-batch-size", "8", "--custom-lists", "3"],
     "--custom-lists 3 goes with --policies custom:search"),
    (["--model", "llm", "--policies", "custom:search", "--max-seq-len", "512", "--batch-size", "1"],
     "it does not go with --max-seq-len"),
    (["--model", "llm", "--policies", "custom:serch", "--global-batch-size", "8"], "did you mean custom:search"),
])
def test_custom_search_bad_input_is_one_line(argv, expected, capsys):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_custom_search_needs_a_model_with_checkpoint_names():
  """A loss target (no model to read names from) is one line; a name the model does not emit is named with the
  ones it does."""
  import jax
  import jax.numpy as jnp
  from jaxckpt.step import LossTarget

  loss = LossTarget(lambda p, b, *, policy: jnp.sum(p["w"] * b["x"]), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)},
                    {"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
  with pytest.raises(Exception, match="give a model target"):
    name_costs(loss)
  with pytest.raises(Exception, match="qkv_proj are not emitted by this model; it emits decoder_layer_input"):
    name_costs(shipped_target("llm", "llama-tiny", seq_len=SEQ), names=["qkv_proj"])


def test_a_capped_fit_states_the_largest_batch_its_line_predicts():
  """The fit planner stops at the global batch; a capped row then gives the largest batch within the memory by the
  line through its two largest compiles (not a refused one), shown as ``est.`` in the table and in the JSON."""
  from jaxckpt.fit import FitPlan
  from jaxckpt.fit import to_table
  from jaxckpt.fit._search import _beyond

  gib = 2**30
  points = {256: FitPoint(256, int(6.29 * gib), 1, None, 1.0), 1024: FitPoint(1024, int(17.74 * gib), 4, None, 1.0),
            2048: FitPoint(2048, 40 * gib, 8, None, 1.0, refused=True)}
  slope = (17.74 - 6.29) * gib / 768
  expected = int((28.8 * gib - (17.74 * gib - slope * 1024)) / slope) // 256 * 256
  assert _beyond(points, int(28.8 * gib), 256) == expected == 1536
  fit = BatchFit(policy="nothing_saveable", max_batch_size=1024, footprint_bytes=int(17.74 * gib),
                 limit_bytes=int(28.8 * gib), compiles=2, model=AffineModel(0, slope),
                 points=tuple(points.values())[:2], method="affine", capped=True, verified_over=None, unit=256,
                 seconds=0.0, estimated_max_batch=expected)
  text = to_table(FitPlan((fit,), int(28.8 * gib), "given", None, None, 1.0), wide=True)
  assert "1024 (4/device) (est. 1536)" in text and "est. N: the largest batch within the memory" in text
  assert "max batch: global, over the mesh's batch axes (per device beside it)" in text
  assert fit.as_row()["estimated_max_batch"] == 1536 and fit.as_row()["batch_unit"] == 256
  units = FitPlan((fit,), int(28.8 * gib), "given", None, None, 1.0).as_json()["units"]
  assert units["rows.max_batch_size"].startswith("examples, global") and units["limit_bytes"] == "bytes per device"


def test_a_compile_over_the_prediction_teaches_what_offload_left_on_the_device():
  """A list whose compile exceeds its prediction by half of what it offloads: that half is the share of the
  offloaded names' bytes the compiler kept on the device (boundary excluded); with it learnt the search no longer
  predicts the same list to fit, and a compile within 5% of its prediction teaches nothing."""
  from jaxckpt.fit import CustomPlan
  from jaxckpt.fit._names import offload_excess, predicted_footprint

  unit = 4
  full = _full_fit(unit)
  plan = CustomPlan((), ("layer_in", "big"), 64, 4, 0, 0, 1.0)
  predicted = predicted_footprint(plan, COSTS, full, 64)
  assert predicted == 2**28 + 16 * 2**23 - 16 * 2**22  # full remat's line, the boundary off the device
  moved = 16 * 2**24  # "big" at 16 examples per device
  over = FitPoint(64, int(predicted + moved / 2), 1, None, 1.0)
  fit = BatchFit(policy=plan.policy, max_batch_size=64, footprint_bytes=over.footprint_bytes,
                 limit_bytes=full.limit_bytes, compiles=1, model=AffineModel(0, 1), points=(over,), method="affine",
                 capped=False, verified_over=None, unit=unit, seconds=0.0)
  learnt = offload_excess(plan, COSTS, full, fit)
  assert learnt == {"big": pytest.approx(0.5)}
  assert predicted_footprint(plan, COSTS, full, 64, offload_device=learnt) == pytest.approx(over.footprint_bytes)
  both = CustomPlan((), ("proj", "big"), 64, 4, 0, 0, 1.0)  # "big" known: the excess is put on "proj" alone
  assert set(offload_excess(both, COSTS, full, fit, offload_device={"big": 0.1})) == {"proj"}
  close = dataclasses.replace(fit, points=(FitPoint(64, int(predicted * 1.04), 1, None, 1.0),))
  assert offload_excess(plan, COSTS, full, close) == {}
  v6e = accelerator("v6e")
  tight = _full_fit(unit, limit=2**28 + 64 * 2**23 + 2**24)
  before = custom_plans(COSTS, tight, 256, v6e, mesh_shape={"fsdp": unit}, top=50)
  after = custom_plans(COSTS, tight, 256, v6e, mesh_shape={"fsdp": unit}, top=50, offload_device={"big": 1.0},
                       exclude=[before[0].policy])
  assert before[0].policy not in {p.policy for p in after}
  assert all(p.footprint_bytes <= tight.limit_bytes for p in after)
  assert all(p.micro_batch < 256 or "big" not in p.offload for p in after)


def test_custom_search_api_bad_input_names_the_value():
  """The API's bad arguments: one JaxckptError naming the value (no internal spec error, no silent empty answer)."""
  full = _full_fit()
  v6e = accelerator("v6e")
  cases = [
      (lambda: custom_policy([], []), "nothing kept is full remat"),
      (lambda: custom_policy("abc", ()), "one string"),
      (lambda: custom_plans(COSTS, full, 0, v6e), "global_batch=0 and top=1 must be ≥ 1"),
      (lambda: custom_plans(COSTS, full, 256, v6e, top=0), "top=0 must be ≥ 1"),
      (lambda: custom_plans(COSTS, full, 7, v6e), "global_batch=7: no micro-batch ≥ 4 and a multiple of 4"),
      (lambda: custom_plans(COSTS, full, 256, v6e, offload_device={"bigg": 0.5}), r"offload_device\['bigg'\]"),
      (lambda: custom_plans(COSTS, full, 256, v6e, offload_device={"big": 2.0}), r"a share in \[0, 1\]"),
  ]
  for call, message in cases:
    with pytest.raises(Exception, match=message):
      call()
  target = shipped_target("llm", "llama-tiny", seq_len=SEQ)
  with pytest.raises(Exception, match=r"names=\[\] is empty"):
    name_costs(target, names=[])
  with pytest.raises(Exception, match="one string"):
    name_costs(target, names="query_proj")
  h100 = accelerator("h100")
  plans = [  # plan_fit's (found by a helper): each refused before any compile
      (dict(policies="custom:search"), "is one string: give a list"),
      (dict(policies=["nothing_saveable", "Custom:Search"]), "the search's token is 'custom:search', in lower case"),
      (dict(policies=["nothing_saveable"], custom_lists=0), r"custom_lists=0 must be an int ≥ 1"),
      (dict(policies=["nothing_saveable", "custom:search"], custom_lists=True), r"custom_lists=True must be an int"),
      (dict(policies=["nothing_saveable"], custom_lists=3), "applies to 'custom:search' only"),
      (dict(policies=["nothing_saveable"], global_batch=16.0), r"global_batch_size=16\.0 must be an int ≥ 1"),
  ]
  for extra, message in plans:
    kwargs = {"global_batch": 16, "device": h100, **extra}
    with pytest.raises(Exception, match=message):
      plan_fit(target, kwargs.pop("policies"), "64MiB", **kwargs)


def test_no_list_is_fitted_when_none_is_predicted_faster_than_full_remat():
  """Names whose keeping saves no FLOPs (and a device without a host link): every list is at best full remat's
  time, so none is returned (a compile would buy nothing)."""
  idle = (NameCost("layer_in", 2**22, 0.0, True), NameCost("useless", 2**22, 0.0, False))
  no_link = dataclasses.replace(accelerator("v6e"), host_bandwidth=0.0)
  assert custom_plans(idle, _full_fit(), 256, no_link, mesh_shape={"fsdp": 4}, top=5) == []
  assert custom_plans(COSTS, _full_fit(), 256, no_link, mesh_shape={"fsdp": 4}, top=1)  # "proj" and "big" do save


def test_a_global_batch_of_one_is_planned():
  """One compiled batch size (G = 1): FLOPs scale through the origin instead of an affine fit that needs two."""
  from jaxckpt.fit import candidates

  point = FitPoint(1, 2**20, 10**9, None, 1.0)
  fit = BatchFit(policy="nothing_saveable", max_batch_size=1, footprint_bytes=2**20, limit_bytes=2**30, compiles=1,
                 model=AffineModel(2**20, 0.0), points=(point,), method="affine", capped=True, verified_over=None,
                 unit=1,
                 seconds=0.0)
  (only,) = candidates([fit], 1, accelerator("h100"))
  assert (only.micro_batch, only.accum, only.flops) == (1, 1, 10**9)


def test_probes_the_compiler_refused_are_bisected_below_not_a_bad_line(monkeypatch):
  """A TPU compile over the chip is refused with the bytes its message names; when every probe is refused those
  bytes need not grow with the batch (v6e-256's data=32,fsdp=8 mesh for Llama 3.1 8B: 'slope −941042 bytes per
  example'), so the search bisects below the smallest probe instead of calling the footprint flat."""
  from jaxckpt.fit import _search

  limit = 2**30
  monkeypatch.setattr(_search, "_lowered_point", lambda target, policy, batch, **kw: (batch, None, None, 0.0))

  def compiled(batch, lowered, mesh, started):
    foot = 2**29 + batch * 2**24  # fits up to 32
    if foot > limit:  # refused: the message names bytes that shrink with the batch here
      return FitPoint(batch, 2 * limit - batch * 2**20, 0, None, 1.0, refused=True)
    return FitPoint(batch, foot, batch, None, 1.0)

  monkeypatch.setattr(_search, "_compiled_point", compiled)
  fit = _search.max_batch_size(shipped_target("llm", "llama-tiny"), "nothing_saveable", limit, probes=(64, 256),
                               max_batch=1024, jobs=1)
  assert fit.max_batch_size == 32 and fit.method == "search" and fit.verified_over == 2 * limit - 33 * 2**20


OFFLOAD_BELOW_FIXED = ("--model llm --preset llama-tiny --layers 8 --seq-len 1024 --topology v5e:2x2 --mesh fsdp=4 "
                       "--global-batch-size 16 --min-batch 16 --max-batch 16 --memory 88MiB --policies none "
                       "nothing_saveable dots_saveable dots_with_no_batch_dims_saveable custom:search")
"""docs/fit.md's "When no fixed policy fits the batch" command (tests/house/test_readme.py skips it: run here)."""


@needs_libtpu
@pytest.mark.slow
def test_an_offload_list_fits_below_every_fixed_policy_on_a_topology(tmp_path, capsys):
  """llama-tiny (8 layers, 1024 tokens) on v5e:2x2 at fsdp=4 and a fixed batch of 16 (4 per chip) in 88 MiB: no
  fixed policy fits (full remat compiles to ≈ 92 MiB: the layer inputs stay on the device), so the fit planner does
  not stop there; custom:search offloads the layer input and its list, compiled, fits below every fixed policy's
  footprint at that batch, with host bytes within the chip table's host memory per chip (the done-when of the custom-list work)."""
  path = tmp_path / "fit.json"
  assert main([*OFFLOAD_BELOW_FIXED.split(), "--no-progress", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  data = json.loads(path.read_text())
  rows = {r["policy"]: r for r in data["rows"]}
  fixed = ["none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"]
  assert all(rows[p]["max_batch_size"] is None for p in fixed), [rows[p] for p in fixed]
  winner = data["global_batch"]["policy"]
  assert "decoder_layer_input" in name_lists(winner)[1], winner
  point = next(q for q in rows[winner]["points"] if q["batch"] == 16)
  assert point["footprint_bytes"] <= 88 * 2**20 == data["limit_bytes"]
  assert point["footprint_bytes"] < min(q["footprint_bytes"] for p in fixed for q in rows[p]["points"])
  assert 0 < point["host_bytes"] <= data["device"]["host_memory_bytes"]
  assert "none fits" in out and "custom:search: per checkpoint name" in out


def test_the_offload_below_fixed_command_is_the_documented_one():
  """The slow test above runs docs/fit.md's command (tests/house/test_readme.py skips it for that reason): the two stay
  one."""
  text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "fit.md").read_text()
  assert f"jaxckpt-fit {OFFLOAD_BELOW_FIXED}" in " ".join(text.replace("\\\n", " ").split())
