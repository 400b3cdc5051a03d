"""The ``expert`` mesh axis: experts (logical name ``exp``) split over it, composing with ``data``, ``fsdp`` and
``tensor``; its all-to-alls in the time model; a bad axis or name is one line.

The multi-device checks run ``tests/sharding/expert_helper.py`` once, in a subprocess with 8 fake CPU devices, and
assert on its JSON: the sharded steps' gradients equal one device's (``tests/numerics.py``), each expert parameter's
bytes per device are its bytes ÷ (expert × fsdp) (÷ tensor too for the hidden width), and the dropping dispatch's
compiled step holds all-to-alls over the expert axis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt import sharding
from jaxckpt.errors import MeshSpecError
from jaxckpt.fit import Traffic, collective_bytes, traffic_of
from jaxckpt.fit._meshes import _Bounds, expert_count, mesh_shapes
from jaxckpt.fit._speed import accelerator
from jaxckpt.errors import LogicalAxisError
from jaxckpt.step import shipped_target
from tests.extras import needs_libtpu
from tests.models import own_moe

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# --- one device ---

def test_the_expert_axis_is_a_batch_axis_and_splits_exp():
  assert sharding.parse_mesh("fsdp=64,expert=4", device_count=256) == {"fsdp": 64, "expert": 4}
  assert "expert" in sharding.BATCH_AXES
  assert sharding.logical_spec(("exp", "embed", "mlp"), {"fsdp": 64, "expert": 4}, (8, 6144, 16384)) == \
      jax.sharding.PartitionSpec("expert", "fsdp", None)
  assert sharding.logical_spec(("activation_exp", "activation_batch_no_exp", None, "activation_embed"),
                               {"fsdp": 2, "expert": 4}, (8, 16, 5, 64)) == \
      jax.sharding.PartitionSpec("expert", "fsdp", None, None)
  with pytest.raises(MeshSpecError, match="did you mean 'expert'"):
    sharding.parse_mesh("experts=4", device_count=4)


def test_an_unknown_logical_name_is_one_line_naming_the_parameter():
  with pytest.raises(LogicalAxisError) as err:
    sharding.logical_spec(("exps", "embed"), {"expert": 4})
  assert "\n" not in str(err.value) and "did you mean 'exp'" in str(err.value)

  class Renamed(own_moe.Mixtral):
    def __init__(self, **kwargs):
      super().__init__(exp_axis=True, **kwargs)
      for layer in self.layers:
        for name in ("gate", "up", "down"):
          param = getattr(layer.moe, name)
          axes = param.get_metadata()["out_sharding"]
          param.set_metadata(out_sharding=("exps", *axes[1:]))

  target = jaxckpt.nnx_model_target(lambda: Renamed(rngs=nnx.Rngs(0)),
                                    jax.ShapeDtypeStruct((8, own_moe.SEQ + 1), jnp.int32), loss="next_token",
                                    blocks={"layer": own_moe.DecoderLayer})
  from jaxckpt.report import build_report

  with pytest.raises(LogicalAxisError) as err:  # before any compile, on one device as on a mesh
    build_report(target, ["full"], residuals=False, progress=False)
  message = str(err.value)
  assert "\n" not in message and "'exps'" in message and "parameter layers/0/moe/" in message
  assert "did you mean 'exp'" in message


@needs_libtpu  # compiles for v5e:2x2
def test_an_expert_axis_on_a_model_without_experts_is_refused_in_one_line():
  from jaxckpt.report import build_report

  with pytest.raises(MeshSpecError) as err:  # before any row is compiled
    build_report(shipped_target("llm", "tiny", batch_size=4), ["full"], topology="v5e:2x2", mesh="expert=4",
                 residuals=False, progress=False)
  assert "expert=4" in str(err.value) and "'exp'" in str(err.value) and "use data=4 to split" in str(err.value)
  assert "\n" not in str(err.value)
  with pytest.raises(MeshSpecError, match="use data=4 to split the batch"):  # the data axis it joins
    build_report(shipped_target("llm", "tiny", batch_size=4), ["full"], topology="v5e:2x2", mesh="data=2,expert=2",
                 residuals=False, progress=False)


def test_the_mesh_search_enumerates_expert_sizes_dividing_the_experts():
  shapes = mesh_shapes(8, experts=4, tensor=False)
  assert {"expert": 4, "fsdp": 2} in shapes and {"expert": 8} not in shapes and {"expert": 2, "data": 4} in shapes
  assert all("expert" not in s for s in mesh_shapes(8, experts=0))
  target = shipped_target("llm", "mixtral-8x7b", batch_size=256, num_layers=2, moe_dispatch="dropping")
  assert expert_count(target) == 8
  bounds = _Bounds(target, 256, accelerator("v6e"))
  per_device = bounds.state_per_device({"fsdp": 64, "expert": 4})
  experts = 4 * bounds.traffic.expert_param_bytes
  assert per_device == (bounds.state - experts) // 64 + experts // 256


def test_the_time_model_prices_the_expert_all_to_alls():
  """Per micro-step: FSDP moves a device's gathered share, the experts 1/e of theirs; the all-to-alls (e − 1)/e of
  the dispatched bytes (Thakur et al. 2005). Per step: the non-expert gradients all-reduced over the expert axis."""
  params, experts, alltoall = 1000.0, 800.0, 64.0
  micro, step = collective_bytes(params, {"fsdp": 4, "expert": 4}, expert_bytes=alltoall, expert_param_bytes=experts)
  local = 200.0 + 800.0 / 4
  assert micro == pytest.approx(3 * 3 / 4 * local + 3 / 4 * alltoall)
  assert step == pytest.approx(2 * 3 / 4 * 200.0 / 4)
  assert collective_bytes(params, {"fsdp": 16}) == (pytest.approx(3 * 15 / 16 * params), 0.0)  # unchanged without
  mixtral = shipped_target("llm", "mixtral-8x22b", batch_size=256, moe_dispatch="dropping")
  traffic = traffic_of(mixtral)
  capacity = 1280  # int(ceil(4096 · 2 / 8) · 1.25)
  assert traffic.expert_bytes_per_example == 4 * 56 * 8 * capacity * 6144 * 2  # bf16, 4 all-to-alls per layer
  assert traffic.expert_param_bytes == 56 * 8 * 3 * 6144 * 16384 * 4  # float32 experts
  assert traffic_of(shipped_target("llm", "mixtral-8x22b", batch_size=256)).expert_bytes_per_example == 0  # dropless
  assert Traffic(tensor_bytes_per_example=2.0).per_device(3) == {"tensor_bytes": 6.0, "expert_bytes": 0.0,
                                                                  "expert_param_bytes": 0.0}


@needs_libtpu  # compiles for v5e:2x2
def test_a_bad_expert_size_is_one_line():
  from jaxckpt.report import build_report

  with pytest.raises(MeshSpecError) as err:
    build_report(shipped_target("llm", "mixtral-tiny", batch_size=8), ["full"], topology="v5e:2x4", mesh="expert=8",
                 residuals=False, progress=False)
  assert "must divide the number of experts of llm (4)" in str(err.value) and "\n" not in str(err.value)


# --- eight fake devices ---

@pytest.fixture(scope="module")
def sharded():
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  done = subprocess.run([sys.executable, os.path.join(HERE, "expert_helper.py")], env=env, capture_output=True,
                        text=True, timeout=1200, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # one 8-device subprocess (~45 s on 2 cores) for the three
def test_sharded_gradients_equal_one_device(sharded):
  assert sharded["device_count"] == 8
  assert [(r["model"], r["mesh"]) for r in sharded["results"]] == [
      ("llm/dropping", "expert=4,fsdp=2"), ("llm/dropping", "expert=2,fsdp=2,tensor=2"),
      ("llm/ragged", "expert=4,fsdp=2"), ("llm/ragged", "expert=2,fsdp=2,tensor=2"),
      ("own", "tensor=4"), ("own", "fsdp=2,tensor=2"), ("own", "expert=4,fsdp=2")]
  for run in sharded["results"]:
    assert run["mismatches"] == [], (run["model"], run["mesh"], run["mismatches"])


@pytest.mark.slow  # one 8-device subprocess (~45 s on 2 cores) for the three
def test_each_device_holds_its_share_of_the_experts(sharded):
  def ways(mesh: str, *axes: str) -> int:
    shape = dict((k, int(v)) for k, v in (item.split("=") for item in mesh.split(",")))
    out = 1
    for axis in axes:
      out *= shape.get(axis, 1)
    return out

  for run in sharded["results"]:
    weights = ("wi_0", "wi_1", "wo") if run["model"].startswith("llm") else ("gate", "up", "down")  # llm's gate: router
    experts = {p: b for p, b in run["per_device"].items() if p.split("/")[-2] in weights}
    assert experts, run
    for path, got in experts.items():
      # [X, E, F] / [X, F, E]: X over expert, E over fsdp, F over tensor (named "mlp")
      split = ways(run["mesh"], "expert", "fsdp", "tensor")
      assert got["per_device"] == got["bytes"] // split, (run["model"], run["mesh"], path, got)


@pytest.mark.slow  # one 8-device subprocess (~45 s on 2 cores) for the three
def test_the_dropping_dispatch_moves_tokens_by_all_to_all_over_the_expert_axis(sharded):
  for run in sharded["results"]:
    # in the layer loop: outside it, the embedding's gradient is an all-to-all of the lookup's cotangent
    # (jaxckpt.sharding.gather_for_use's lookup), whatever the dispatch
    kinds = {c["kind"] for c in run["collectives"] if c["in_loop"]}
    if run["model"] == "llm/dropping":
      assert "all-to-all" in kinds, (run["mesh"], kinds)
    if run["model"] == "llm/ragged":  # dropless: each device sorts its own tokens, the experts gathered
      assert "all-to-all" not in kinds, (run["mesh"], kinds)


@needs_libtpu  # compiles for v5e:2x2
def test_a_dropless_dispatch_under_an_expert_axis_says_it_gathers_the_experts():
  from jaxckpt.sharding import get_topology
  from jaxckpt.step._compile import mesh_use_notes, step_builder

  mesh = get_topology("v5e:2x2").mesh({"fsdp": 2, "expert": 2})
  for dispatch, expected in (("auto", 1), ("ragged", 1), ("dropping", 0)):
    target = shipped_target("llm", "mixtral-tiny", batch_size=8, moe_dispatch=dispatch)
    notes = mesh_use_notes(step_builder(target, mesh=mesh), mesh)
    assert len(notes) == expected, (dispatch, notes)
    assert all("expert=2" in n and "--moe-dispatch dropping" in n and "\n" not in n for n in notes)
  assert mesh_use_notes(step_builder(shipped_target("llm", "mixtral-tiny", batch_size=8)), None) == []
