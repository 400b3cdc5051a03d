"""FSDP as the field compiles it, read in the compiled program: each layer's weight gradients are reduce-scattered over
``fsdp`` (only the shard all-reduced over ``data``), never all-reduced whole over every device
(:mod:`jaxckpt.sharding._gather`; the collectives by kind and mesh axis: :func:`jaxckpt.analysis.collectives_by_axis`).

Deviceless compiles of tiny steps for a GPU node and a TPU slice, the LLM family and an own NNX model with an
``nnx.scan`` stack. A reduce-scatter counts in the forms the compilers write (an instruction on XLA:GPU; an
all-reduce + dynamic slice in one fusion on TPU); an all-reduce whose results every device only slices is the same
reduction to shards run as an all-reduce (the TPU compiler's choice for small shards: ``sliced_bytes``), and the
check is then that no all-reduce keeps a weight gradient whole.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.models import model_entry
from jaxckpt.models.llm import LLM_PRESETS
from jaxckpt.report import build_report
from jaxckpt.sharding import param_logical_axes, stacked_layer_paths
from jaxckpt.sharding._gather import rest_spec
from jaxckpt.sharding._state import path_names
from jaxckpt.step import ModelTarget
from jaxckpt.step._targets import with_batch
from tests.extras import needs_cuda_plugin, needs_libtpu
from tests.own_models import DecoderLayer, ScannedDecoder, decoder_loss


def _layer_bytes(model: nnx.Module, mesh: dict[str, int]) -> tuple[int, int, int]:
  """Float32 bytes of one layer's gradients: of the parameters replicated at rest (all of them), of the smallest
  FSDP-split weight, and of all split weights. An all-reduce in the layer loop over ``fsdp`` may carry the first (norm
  scales), never a split weight's whole gradient; one over ``data`` carries at most a device's shards of them all."""
  stacked = stacked_layer_paths(model)
  replicated, split = 0, []
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                                        is_leaf=lambda x: isinstance(x, nnx.Variable)):
    names = path_names(path)
    if not any(names[:len(p)] == p for p in stacked):
      continue
    shape = tuple(leaf.get_value().shape[1:])
    spec = rest_spec(param_logical_axes(leaf), shape, mesh)
    if any(p == "fsdp" or (isinstance(p, tuple) and "fsdp" in p) for p in spec):
      split.append(4 * math.prod(shape))
    else:
      replicated += 4 * math.prod(shape)
  assert split, "no FSDP-split layer weight: the check would hold for any program"
  return replicated, min(split), sum(split)


def _check(row: dict, model: nnx.Module, mesh: str) -> None:
  shape = jaxckpt.sharding.parse_mesh(mesh, device_count=0)
  replicated, smallest, split = _layer_bytes(model, shape)
  assert replicated < smallest
  uses = row["collectives"]
  # the layer gradients reduced to shards over fsdp: reduce-scatters, or all-reduces each device slices (TPU)
  assert any(u["axes"] == ["fsdp"] and u["in_loop"] and (u["kind"] == "reduce-scatter" or u["sliced_bytes"])
             for u in uses), uses
  for u in uses:
    if u["kind"] != "all-reduce" or not u["in_loop"]:
      continue
    if "fsdp" in u["axes"]:  # kept whole: never a split weight's gradient (replicated parameters' may be)
      assert u["largest_kept_bytes"] < smallest, u
    else:  # over data alone: at most a device's shards (and the replicated parameters' gradients)
      assert u["axes"] == ["data"] and u["largest_bytes"] <= split // shape["fsdp"] + replicated, u


def _llm(dim: int) -> ModelTarget:
  """The LLM family's Llama at 3 layers and width ``dim`` (heads of 64), float32, 16 sequences of 64 tokens: wide
  enough that the TPU compiler writes its reduce-scatters as such (at llama-tiny's width 64 it all-reduces the
  33 KB gradients and slices them, its choice for small arrays)."""
  entry = model_entry("llm")
  config = dataclasses.replace(LLM_PRESETS["llama-tiny"], num_layers=3, dim=dim, num_heads=dim // 64, num_kv_heads=2,
                               head_dim=64, mlp_dim=2 * dim, seq_len=64)
  return ModelTarget(make_model=lambda: entry.build(config), batch=entry.batch(16, config), loss_fn=entry.loss_fn,
                     name="llm")


def _case(target: ModelTarget, topology: str, mesh: str) -> dict:
  report = build_report(target, ["full"], topology=topology, mesh=mesh, residuals=False, progress=False)
  row = report.rows[0]
  assert row["status"] == "ok", row["error"]
  _check(row, nnx.eval_shape(target.make_model), mesh)
  return row


@needs_cuda_plugin
def test_the_llm_step_on_a_gpu_node_reduce_scatters_its_layer_gradients():
  _case(_llm(128), "h100:8", "data=2,fsdp=4")  # fsdp=8: tests/sharding/test_gpu.py's report


@needs_libtpu
@pytest.mark.parametrize("mesh", [pytest.param("fsdp=8", marks=pytest.mark.slow), "data=2,fsdp=4"])
def test_the_llm_step_on_a_tpu_slice_reduce_scatters_its_layer_gradients(mesh):
  _case(_llm(512), "v5e:2x4", mesh)


def _own_scanned(policy: str = "full", batch: int = 16, dim: int = 512, seq: int = 16) -> ModelTarget:
  """The own ``nnx.scan`` decoder (tests/own_models.py) at 3 layers, its layer class named as the block."""

  def make_model():
    return jaxckpt.apply_remat(ScannedDecoder(dim=dim, hidden=2 * dim, heads=8, layers=3, rngs=nnx.Rngs(0)), policy,
                               blocks={"layer": DecoderLayer})

  return ModelTarget(make_model=make_model, batch={"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)},
                     loss_fn=decoder_loss, name="own-scanned")


@pytest.mark.parametrize("topology", [pytest.param("h100:8", marks=(needs_cuda_plugin, pytest.mark.slow)),
                                      pytest.param("v5e:2x4", marks=needs_libtpu)])
def test_an_own_scanned_model_gathers_per_layer_and_reduce_scatters(topology):
  target = _own_scanned()
  assert stacked_layer_paths(nnx.eval_shape(target.make_model)) == {("layers",)}  # apply_remat found the stack
  row = _case(target, topology, "data=2,fsdp=4")
  gathers = [u for u in row["collectives"] if u["kind"] == "all-gather" and u["axes"] == ["fsdp"]]
  assert sum(u["runs"] for u in gathers if u["in_loop"]) >= 3  # per layer, inside the scan: not the stack at once


@pytest.mark.parametrize("topology", [pytest.param("h100:8", marks=(needs_cuda_plugin, pytest.mark.slow)),
                                      pytest.param("v5e:2x4", marks=(needs_libtpu, pytest.mark.slow))])
def test_accumulation_on_a_sharded_batch_costs_the_accumulator_not_k_steps(topology):
  """k × B/k accumulated under fsdp=8, compiled for the topology: the B/k step's footprint plus the accumulator (one
  float32 copy of the parameters per device) and 5% of the step (each micro-batch spans every device,
  :func:`jaxckpt.training.micro_batches`), where a plain reshape of the batch gave ≈ k × the activations."""
  target = _own_scanned("none", dim=256, seq=128)  # activations, not parameters, make the step (as at real sizes)
  footprints = {}
  for rows, k in ((32, 1), (128, 4)):
    report = build_report(with_batch(target, rows, grad_accum_steps=k), ["none"], topology=topology, mesh="fsdp=8",
                          residuals=False, progress=False)
    assert report.rows[0]["status"] == "ok", report.rows[0]["error"]
    footprints[k] = report.rows[0]["footprint_bytes"]
  params = nnx.state(nnx.eval_shape(target.make_model), nnx.Param)
  accumulator = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(params)) // 8
  assert footprints[1] <= footprints[4] <= footprints[1] + accumulator + 0.05 * footprints[1], (footprints, accumulator)
