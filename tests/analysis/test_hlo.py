"""Tests for jaxckpt.analysis.hlo: compiled programs read from their HLO text, on XLA:CPU (always), the TPU compiler
(deviceless, needs libtpu) and the GPU compiler (deviceless, needs jax-cuda12-plugin).

The program is one small scanned MLP grad step: ``L`` layers ``h = tanh(h @ w[l])`` under ``jax.lax.scan``, loss
``sum(h**2)``, gradient of the stacked weights ``w: [L, D, D]`` for a batch ``x: [B, D]``. Forward and backward hold
three ``[B, D] x [D, D]`` matmuls per layer (forward, d/dx, d/dw): ``2*B*D*D*L*3`` FLOPs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import parse_policy, sharding
from jaxckpt.analysis import (HloParseError, count_flops, format_shape, instruction_flops, jaxpr_flops, live_at_peak,
                              parse_hlo, read_compiled, replica_groups)
from jaxckpt.step import compile_policy, shipped_target
from tests.extras import needs_cuda_plugin, needs_libtpu

L, B, D = 4, 64, 256
MATMUL_FLOPS = 2 * B * D * D  # one [B, D] x [D, D] matmul
OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device", offload_dst="pinned_host")


H100 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: 3352320000000
  l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
platform_name: "CUDA" runtime_version { major: 12 minor: 9 } dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
"""An H100 SXM as XLA's GPU target config (the format of ``xla/tools/hlo_opt/gpu_specs/*.txtpb``)."""


def mlp_grad_step(policy=None):
  """``grad(loss)(w: [L, D, D], x: [B, D])`` of the scanned MLP; ``policy`` on the scan body, if given."""
  def layer(h, w):
    h = checkpoint_name(h, "x")  # [B, D]: the layer input, the residual OFFLOAD sends to host memory
    return jnp.tanh(h @ w), None

  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy)

  def loss(w, x):
    return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

  return jax.grad(loss)


def _args(dtype=jnp.float32, w_sharding=None, x_sharding=None):
  return (jax.ShapeDtypeStruct((L, D, D), dtype, sharding=w_sharding),
          jax.ShapeDtypeStruct((B, D), dtype, sharding=x_sharding))


# --- XLA:CPU ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_step():
  step, args = mlp_grad_step(), _args()
  compiled = jax.jit(step).lower(*args).compile()
  return compiled, read_compiled(compiled), jaxpr_flops(jax.make_jaxpr(step)(*args))


def test_cpu_scan_loops_have_the_scan_length_as_trip_count(cpu_step):
  _, module, _ = cpu_step
  assert [(w.trip_count, w.trip_count_source) for w in module.while_loops] == [(L, "backend_config")] * 2


def test_a_trip_count_is_derived_from_the_loop_where_the_backend_config_lacks_it(cpu_step):
  compiled, _, _ = cpu_step
  text = re.sub(r'"known_trip_count":\{"n":"\d+"\}', '"removed":0', compiled.as_text())
  assert "known_trip_count" not in text
  assert [(w.trip_count, w.trip_count_source) for w in parse_hlo(text).while_loops] == [(L, "derived")] * 2


def test_cpu_dot_flops_count_every_layer_and_agree_with_the_jaxpr(cpu_step):
  compiled, module, counted = cpu_step
  totals = module.totals()
  assert totals.dot_flops == MATMUL_FLOPS * L * 3
  assert totals.dot_flops == pytest.approx(counted.by_primitive["dot_general"], rel=0.01)
  assert compiled.cost_analysis()["flops"] < totals.dot_flops / 2  # XLA's own count: one iteration of each loop
  runs = [r for r in module.executions() if r.dot_flops]
  assert {(r.dot_flops, r.count, len(r.loops)) for r in runs} == {(MATMUL_FLOPS, L, 1)}
  assert len(runs) == 3
  assert totals.unknown_trip_counts == () and totals.estimated_cycles is None
  assert module.collectives() == () and module.host_transfers() == ()


def test_a_loop_condition_runs_once_more_than_its_body(cpu_step):
  _, module, _ = cpu_step
  loop = module.while_loops[0]
  counts = {r.instruction.computation: r.count for r in module.executions() if r.loops == (loop.name,)}
  assert counts == {loop.attributes["condition"].lstrip("%"): L + 1, loop.attributes["body"].lstrip("%"): L}


def test_nested_loops_multiply():
  def f(w, x):  # w: [3, 2, 32, 32]: 3 outer iterations of 2 inner layers
    def outer(h, wo):
      return jax.lax.scan(lambda h2, wi: (jnp.tanh(h2 @ wi), None), h, wo)[0], None
    return jax.lax.scan(outer, x, w)[0]

  args = (jax.ShapeDtypeStruct((3, 2, 32, 32), jnp.float32), jax.ShapeDtypeStruct((8, 32), jnp.float32))
  module = read_compiled(jax.jit(f).lower(*args).compile())
  assert sorted(w.trip_count for w in module.while_loops) == [2, 3]
  (run,) = [r for r in module.executions() if r.dot_flops]
  assert run.count == 6 and len(run.loops) == 2
  assert module.totals().dot_flops == count_flops(f, *args).by_primitive["dot_general"] == 6 * 2 * 8 * 32 * 32


def test_a_loop_with_a_run_time_bound_has_no_trip_count_and_runs_once():
  def f(n, x):
    return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ h), x)

  module = read_compiled(jax.jit(f).lower(jax.ShapeDtypeStruct((), jnp.int32),
                                          jax.ShapeDtypeStruct((32, 32), jnp.float32)).compile())
  (loop,) = module.while_loops
  assert loop.trip_count is None and module.totals().unknown_trip_counts == (loop.name,)
  assert module.totals().dot_flops == 2 * 32 * 32 * 32


def test_a_shipped_models_train_step_has_the_jaxprs_matmul_flops():
  compiled = compile_policy(shipped_target("gpt", "tiny"), parse_policy("nothing_saveable"))
  module = read_compiled(compiled)  # a CompiledPolicy: its executable's text
  assert module.totals().unknown_trip_counts == () and len(module.while_loops) > 2
  assert module.totals().dot_flops == jaxpr_flops(compiled.traced.jaxpr).by_primitive["dot_general"]


def test_bytes_read_and_written_match_xla_on_a_step_without_loops():
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x * x)

  args = ([jax.ShapeDtypeStruct((D, D), jnp.float32)] * L, jax.ShapeDtypeStruct((B, D), jnp.float32))
  compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
  totals = read_compiled(compiled).totals()
  assert totals.bytes_read + totals.bytes_written == pytest.approx(compiled.cost_analysis()["bytes accessed"], rel=1e-3)


# --- text given literally -----------------------------------------------------------------------------------------

SNIPPET = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}, \
num_partitions=4

FileNames
1 "f.py"

%fused_dot (p0: f32[8,16], p1: f32[16,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_name="jit(f)/dot_general" stack_frame_id=1}
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[8,16]{1,0:T(8,128)S(1)} constant({...})
  %ag = f32[16,16]{1,0} all-gather(%w), channel_id=1, \
replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}, dimensions={0}, \
use_global_device_ids=true, backend_config={"collective_backend_config":{"is_sync":true}}
  %fusion = f32[8,16]{1,0} fusion(%x, %ag), kind=kOutput, calls=%fused_dot, \
backend_config={"window_config":{"estimated_cycles":"120"}}
  %cs = (f32[8,16]{1,0:S(5)}, f32[8,16]{1,0}, u32[]{:S(2)}) copy-start(%fusion)
  %cd = f32[8,16]{1,0:S(5)} copy-done(%cs)
  %gemm = (f32[8,16]{1,0}, s8[1024]{0}) custom-call(%x, %ag), custom_call_target="__cublas$gemm", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = f32[8,16]{1,0} get-tuple-element(%gemm), index=0
  ROOT %t = (f32[8,16]{1,0}, /*index=1*/f32[8,16]{1,0:S(5)}) tuple(%out, %cd)
}
"""


def test_a_literal_module_reads_into_typed_records():
  module = parse_hlo(SNIPPET)
  assert (module.name, module.entry, module.num_partitions, module.num_devices) == ("jit_f", "main", 4, 4)
  fusion, w, root = module.instructions["fusion"], module.instructions["w"], module.instructions["t"]
  assert (fusion.opcode, fusion.fusion_kind, fusion.calls, fusion.operands) == ("fusion", "kOutput", ("fused_dot",),
                                                                              ("x", "ag"))
  assert fusion.estimated_cycles == 120 and module.instructions["dot.1"].op_name == "jit(f)/dot_general"
  assert (w.shape.dtype, w.shape.dims, w.shape.minor_to_major, w.shape.memory_space, w.literal) == (
      "f32", (8, 16), (1, 0), 1, "{...}")
  assert root.is_root and [a.on_host for a in root.arrays] == [False, True]
  assert module.instructions["gemm"].custom_call_target == "__cublas$gemm"
  totals = module.totals()
  assert totals.dot_flops == 2 * 2 * 8 * 16 * 16  # the fused dot and the cuBLAS GEMM
  assert totals.estimated_cycles == 120 and totals.to_host_bytes == 8 * 16 * 4 and totals.to_device_bytes == 0
  (gather,) = module.collectives()
  assert (gather.kind, gather.groups, gather.group_size, gather.payload_bytes, gather.is_async) == (
      "all-gather", ((0, 1), (2, 3)), 2, 16 * 16 * 4, False)


SOURCED = """HloModule jit_h, entry_computation_layout={(f32[4]{0})->(f32[4]{0}, s32[])}

FileNames
1 "/src/model.py"

FunctionNames
1 "layer"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=3 end_column=9}

StackFrames
1 {file_location_id=1}

ENTRY %main (x: f32[4]) -> (f32[4], s32[]) {
  %x = f32[4]{0} parameter(0)
  %tanh = f32[4]{0} tanh(%x), metadata={op_name="jit(h)/tanh" stack_frame_id=1}
  %sin = f32[4]{0} sine(%x), metadata={op_name="jit(h)/sin" source_file="/src/other.py" source_line=7}
  %c = s32[] constant(1)
  ROOT %t = (f32[4]{0}, s32[]) tuple(%tanh, %c)
}
"""
"""A module with XLA's source tables (what ``xla_dump_hlo_as_text`` writes): one frame, and one instruction that names
its source line itself."""


def test_source_lines_come_from_the_metadata_or_the_stack_frame_tables_and_tuple_elements_have_shapes():
  module = parse_hlo(SOURCED)
  assert module.frames == {1: "/src/model.py:42 (layer)"}
  assert module.source(module.instructions["tanh"]) == "/src/model.py:42 (layer)"
  assert module.source(module.instructions["sin"]) == "/src/other.py:7"
  assert module.source(module.instructions["c"]) is None
  root = module.instructions["t"]
  assert [format_shape(root.shape, i) for i in ((), (0,), (1,), (5,))] == [
      "(f32[4], s32[])", "f32[4]", "s32[]", "(f32[4], s32[])"]
  live = live_at_peak("BufferLiveRange:\n  t{0}:0-3\nLive ranges at 2 (peak):\n  tanh: 16 bytes\n  t{1}: 4 bytes\n"
                      "Next section\n  x: 16 bytes\n")
  assert [(b.instruction, b.index, b.bytes) for b in live] == [("tanh", "{}", 16), ("t", "{1}", 4)]
  assert live_at_peak("no peak here\n") == ()


PALLAS = """HloModule jit_g, num_partitions=1

ENTRY %main (q: bf16[8,128]) -> bf16[8,128] {
  %q = bf16[8,128]{1,0} parameter(0)
  %kernel = bf16[8,128]{1,0} custom-call(%q), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 2048, \\"use_fused_bwd_kernel\\": false}"
}}, metadata={op_name="jit(g)/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzvUg"}}
  ROOT %out = bf16[8,128]{1,0} copy(%kernel), frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}
}
"""


def test_an_instruction_whose_attributes_span_lines_is_one_instruction():
  """The TPU compiler prints a Pallas kernel's ``frontend_attributes={kernel_metadata={`` with newlines inside (the
  splash attention kernel of an LLM step): the lines up to the closing brackets are one instruction."""
  module = parse_hlo(PALLAS)
  kernel = module.instructions["kernel"]
  assert (kernel.custom_call_target, kernel.op_name, kernel.operands) == ("tpu_custom_call", "jit(g)/pallas_call", ("q",))
  assert kernel.backend_config["custom_call_config"]["body"] == "TUzvUg"
  assert module.instructions["out"].is_root and len(module.computations["main"].instructions) == 3


SPARSECORE = """HloModule jit_moe, num_partitions=4

%sc_body (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %neg = f32[16]{0} negate(%p)
}, execution_thread="sparsecore"

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  ROOT %y = f32[16]{0} add(%x, %x)
}
"""


def test_a_computation_on_another_execution_thread_closes_with_its_thread():
  """The TPU compiler closes a computation it runs on another execution thread with ``}, execution_thread=...``
  (an MoE step's SparseCore work, Mixtral 8x22B on v6e): it ends there, as ``}`` does."""
  module = parse_hlo(SPARSECORE)
  assert list(module.computations) == ["sc_body", "main"]
  assert [i.name for i in module.computations["sc_body"].instructions] == ["p", "neg"]
  assert module.instructions["y"].is_root


PADDED_CONV = """HloModule jit_p, num_partitions=1

ENTRY %main (x: bf16[2,16,64,1], w: bf16[64,4,8,1]) -> bf16[2,16,4,8] {
  %x = bf16[2,16,64,1]{3,2,1,0} parameter(0)
  %w = bf16[64,4,8,1]{3,2,1,0} parameter(1)
  ROOT %heads = bf16[2,16,4,8]{3,2,1,0} convolution(%x, %w), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}
"""


def test_a_matmul_written_as_a_convolution_over_a_padded_window_counts_its_real_taps():
  """The TPU compiler writes a projection to heads (``bse,enh->bsnh``) as a convolution whose head dimension is a
  window of 4 over an input of spatial size 1 padded by 3 on each side: 3 of each output's 4 taps are padding, so
  the FLOPs are the matmul's, 2 × (2·16) × 64 × (4·8), not 4 times that."""
  assert parse_hlo(PADDED_CONV).totals().dot_flops == 2 * (2 * 16) * 64 * (4 * 8)


@pytest.mark.parametrize("text, expected", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{{0,2,4,6},{1,3,5,7}}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[2,4]<=[2,2,2]T(1,0,2)", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['axis_0'=4,'axis_1'=1] {'axis_0'}", ((0, 1, 2, 3),)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    # measured: the fsdp all-gathers of a data=2,fsdp=4 GPU mesh (rows of mesh.devices) and its data all-reduces
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=8,'axis_1'=1], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}", ((0, 2, 1, 3, 4, 6, 5, 7),)),
    # XLA's own tests (xla/hlo/ir/replica_group_test.cc): sub-axes, explicit device ids, the @mesh<...> printing
    ("mesh['a'=6,'b'=6] {'a':(3)2}", tuple((i, i + 6) for r in (0, 12, 24) for i in range(r, r + 6))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", replica_groups("[2,4]<=[2,2,2]T(1,0,2)")),
    ("@mesh<x=2,y=2> {x}", ((0, 2), (1, 3))),
    ("@mesh<ooo=10>, device_ids=(8,3,7,5,4,2,6,0,1,9) {ooo:(5)2}", ((8, 3), (7, 5), (4, 2), (6, 0), (1, 9))),
])
def test_replica_groups_resolve_every_form_to_device_ids(text, expected):
  assert replica_groups(text) == expected


def test_empty_replica_groups_are_every_device_and_bad_forms_are_named():
  assert replica_groups("{}", num_devices=4) == ((0, 1, 2, 3),)
  with pytest.raises(HloParseError, match="num_devices"):
    replica_groups("{}")
  with pytest.raises(HloParseError, match=r"unknown replica group form '\[2,4\]<-\[8\]'"):
    replica_groups("[2,4]<-[8]")
  with pytest.raises(HloParseError, match="name an axis the mesh does not have"):
    replica_groups("mesh['a'=2] {'b'}")


def test_text_that_is_not_hlo_is_refused_with_what_to_pass():
  with pytest.raises(HloParseError, match="no 'HloModule' line .* compiled.as_text()"):
    parse_hlo("module @jit_f {\n}")
  with pytest.raises(HloParseError, match="cannot read HLO instruction line 'garbage here'"):
    parse_hlo("HloModule m\n\nENTRY %main () -> f32[] {\n  garbage here\n}\n")
  with pytest.raises(TypeError, match="read_compiled"):
    parse_hlo(b"HloModule m")
  with pytest.raises(TypeError, match="JAXCKPT_STATS_CACHE=off"):
    read_compiled(object())


# --- TPU (deviceless) ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_steps():
  """The MLP step in bf16 on v5e:2x2, weights FSDP-sharded over fsdp=4: without remat, and offloading ``x``."""
  mesh = sharding.get_topology("v5e:2x2").mesh("fsdp=4")
  w_sharding, x_sharding = NamedSharding(mesh, P(None, "fsdp", None)), NamedSharding(mesh, P("fsdp", None))
  args = _args(jnp.bfloat16, w_sharding, x_sharding)
  return {name: read_compiled(jax.jit(mlp_grad_step(policy), out_shardings=w_sharding).lower(*args).compile())
          for name, policy in (("none", None), ("offload", OFFLOAD))}


@needs_libtpu
def test_tpu_fsdp_step_gathers_each_layers_weights_over_4_chips(tpu_steps):
  module = tpu_steps["none"]
  gathers = [c for c in module.collectives() if c.kind == "all-gather"]
  assert gathers and {(c.group_size, c.groups, c.payload_bytes) for c in gathers} == {(4, ((0, 1, 2, 3),), D * D * 2)}
  assert sum(c.count for c in gathers) == 2 * L  # once per layer forward, once backward
  scatters = [c for c in module.collectives() if c.kind == "reduce-scatter"]
  assert scatters and sum(c.count for c in scatters) == L and {c.group_size for c in scatters} == {4}
  assert all(w.trip_count is not None for w in module.while_loops)  # TPU gives none: derived from the loops
  totals = module.totals()
  assert totals.dot_flops == pytest.approx(MATMUL_FLOPS // 4 * L * 3, rel=0.01)  # per chip: a quarter of the batch
  assert totals.estimated_cycles and totals.estimated_cycles > 0
  assert totals.collective_bytes_by_group_size.keys() == {4}


@needs_libtpu
def test_tpu_offload_step_moves_the_named_residual_of_every_layer_each_way(tpu_steps):
  totals = tpu_steps["offload"].totals()
  residual = B // 4 * D * 2  # x: [B/4, D] bf16 per chip
  assert totals.to_host_bytes == totals.to_device_bytes == residual * L
  assert tpu_steps["none"].totals().to_host_bytes == 0


# --- GPU (deviceless) ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_steps():
  """The MLP step in f32 on 8 H100s, mesh data=2 x fsdp=4, weights FSDP-sharded, the batch over both axes."""
  from jax.experimental import topologies
  try:
    devices = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x8").devices
  except NotImplementedError as err:  # the plugin started a CUDA backend: JAX_PLATFORMS must be cpu
    pytest.skip(f"no deviceless GPU topology ({err}); run with JAX_PLATFORMS=cpu")
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w_sharding = NamedSharding(mesh, P(None, "fsdp", None))
  args = _args(jnp.float32, w_sharding, NamedSharding(mesh, P(("data", "fsdp"), None)))
  return {name: read_compiled(jax.jit(mlp_grad_step(policy), out_shardings=w_sharding).lower(*args).compile())
          for name, policy in (("none", None), ("offload", OFFLOAD))}


@needs_cuda_plugin
def test_gpu_mesh_collectives_resolve_to_the_mesh_rows_and_columns(gpu_steps):
  module = gpu_steps["none"]
  assert [(w.trip_count, w.trip_count_source) for w in module.while_loops] == [(L, "backend_config")] * 2
  by_kind = {}
  for c in module.collectives():
    by_kind.setdefault(c.kind, set()).add((c.groups, c.payload_bytes))
  fsdp_groups, data_groups = ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))
  assert by_kind["all-gather"] == {(fsdp_groups, D * D * 4)}  # a layer's f32 weights, gathered
  assert by_kind["reduce-scatter"] == {(fsdp_groups, D * D * 4)}  # its gradient, scattered
  assert by_kind["all-reduce"] == {(data_groups, D // 4 * D * 4)}  # the gradient shard, summed over data
  assert module.totals().dot_flops == MATMUL_FLOPS // 8 * L * 3
  assert {c.is_async for c in module.collectives()} == {True, False}  # collective_backend_config.is_sync


@needs_cuda_plugin
def test_gpu_offload_step_moves_the_named_residual_of_every_layer_each_way(gpu_steps):
  transfers = gpu_steps["offload"].host_transfers()
  residual = B // 8 * D * 4  # x: [B/8, D] f32 per GPU
  assert {(t.direction, t.bytes, t.count) for t in transfers} == {("to_host", residual, L), ("to_device", residual, L)}
  assert {t.unit.split(".")[0] for t in transfers} == {"dynamic-update-slice-start", "dynamic-slice-start"}
  assert gpu_steps["offload"].totals().to_host_bytes == residual * L


def test_an_attribute_whose_key_holds_a_hyphen_ends_the_one_before():
  """XLA:GPU prints ``control-predecessors={...}`` on scheduled instructions (seen after a cuBLAS call of an unrolled
  DiT): the key's hyphen must not let the custom call's target swallow the rest of the line."""
  text = """HloModule m

ENTRY %main (a: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} add(%a, %a)
  ROOT %g = f32[64,64]{1,0} custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", control-predecessors={%b}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}
"""
  gemm = parse_hlo(text).instructions["g"]
  assert gemm.custom_call_target == "__cublas$lt$matmul"
  assert gemm.attributes["control-predecessors"] == "{%b}"
  assert instruction_flops(parse_hlo(text), gemm) == 2 * 64 ** 3
