"""MaxText's Mixtral rows in ``benchmarks/published_configs.py`` (T11, T12): built as MaxText's ``*_dropped``
configurations say, abstractly (no compile: each is a 256-chip TPU program, minutes on 2 cores); a later run of some
rows merges into an earlier run's JSON."""

from __future__ import annotations

from flax import nnx

import jaxckpt
from benchmarks import published_configs as pc
from jaxckpt.models.llm._layers import decoder_checkpoint_names
from tests.extras import needs_libtpu


@needs_libtpu  # lays the rows' meshes over their v6e topologies
def test_the_mixtral_rows_are_maxtexts_dropped_configurations():
  rows = {r.key: r for r in pc.ROWS}
  t11, t12 = rows["T11"], rows["T12"]
  assert (t11.preset, t11.per_device, t11.seq_len, t11.weight_dtype) == ("mixtral-8x7b", 12, 4096, "float32")
  assert (t12.preset, t12.per_device, t12.seq_len, t12.weight_dtype) == ("mixtral-8x22b", 8, 4096, "bfloat16")
  assert pc.mesh_of(t11) == {"fsdp": 256} and pc.mesh_of(t12) == {"fsdp": 64, "expert": 4}
  for row in (t11, t12):
    assert (row.moe_dispatch, row.capacity_factor, row.vmem_kib) == ("dropping", 1.25, 81920)
    target, chips = pc.target(row, num_layers=2)
    model = nnx.eval_shape(target.make_model)
    assert model.decoder.layers.sublayers[0].mlp.dispatch == "dropping"
    assert target.batch["tokens"].shape == (row.per_device * chips, row.seq_len + 1)
    config = pc.model_entry("llm").config(row.preset)
    jaxckpt.parse_policy(row.policy).validate({"decoder": set(decoder_checkpoint_names(config, experts=True))})


def test_a_later_run_merges_into_the_earlier_runs_json():
  done = {"date_utc": "a", "machine": {}, "wall_s": 1.0, "rows": [{"key": "T1"}, {"key": "T11", "old": True}]}
  later = {"date_utc": "b", "machine": {"cpu_count": 2}, "wall_s": 2.0, "cpu_s": 3.0,
           "rows": [{"key": "T11"}, {"key": "T12"}]}
  merged = pc.merge(done, later)
  assert [r["key"] for r in merged["rows"]] == ["T1", "T11", "T12"] and "old" not in merged["rows"][1]
  assert merged["date_utc"] == "a" and merged["later_runs"] == [
      {"date_utc": "b", "machine": {"cpu_count": 2}, "wall_s": 2.0, "cpu_s": 3.0, "rows": ["T11", "T12"]}]
