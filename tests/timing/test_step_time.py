"""jaxckpt.timing: the step time read from a compiled program, with real values.

On XLA:CPU (always): a matmul's compute term is its FLOPs over the chip's peak times its shape efficiency; a scanned
stack's time scales with its trip count; overlap never makes a step shorter than its largest term. On the TPU
compiler (deviceless, needs libtpu): a matmul's time is the compiler's cycles over the chip's clock. On the GPU
compiler (deviceless, needs jax-cuda12-plugin): a collective of known bytes over NVLink and over the network takes
bytes over each bandwidth. Literal HLO texts pin the schedule replay (an async collective hidden by the compute between
its start and done, exposed where there is none).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import sharding as topology
from jaxckpt.analysis import parse_hlo
from jaxckpt.errors import JaxckptError
from jaxckpt.sharding import CHIPS
from jaxckpt.timing import (OVERLAP_RULES, Links, causal_block_fraction, collective_seconds, estimate_step_time,
                            layer_trip_counts, links_for, matmul_efficiency, tpu_wraps)
from tests.extras import needs_cuda_plugin, needs_libtpu

H100, V6E = CHIPS["h100"], CHIPS["v6e"]


def _matmul_text(m: int, k: int, n: int, dtype=jnp.float32) -> str:
  f = jax.jit(lambda a, b: a @ b)
  return f.lower(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)).compile().as_text()


def _scan_text(layers: int, b: int = 256, d: int = 512) -> str:
  def loss(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h ** 2)
  args = jax.ShapeDtypeStruct((layers, d, d), jnp.float32), jax.ShapeDtypeStruct((b, d), jnp.float32)
  return jax.jit(jax.grad(loss)).lower(*args).compile().as_text()


def test_a_matmul_on_a_gpu_takes_its_flops_at_what_cublas_reaches_over_its_wave_quantization():
  """4096 × 4096 × 4096 on an H100: 512 output tiles of 256 × 128 in 4 waves of 132 SMs (efficiency 512 / 528) at
  the 76.3% of the 989 TFLOP/s peak cuBLAS sustains (MSMF, jaxckpt.timing._gpu), plus the kernel's 1 µs launch;
  on v6e (MXU 256 divides 4096) FLOPs / peak exactly."""
  text = _matmul_text(4096, 4096, 4096)
  flops = 2 * 4096 ** 3
  step = estimate_step_time(text, "h100")
  assert step.flops == flops
  assert matmul_efficiency((4096, 4096, 4096), H100) == pytest.approx(512 / 528)
  assert step.terms["compute"] == pytest.approx(flops / (755e12 * 512 / 528) + 1e-6, rel=1e-9)
  assert "76.3% of 989 TFLOP/s (MSMF of the H200)" in step.basis["matmuls"]
  assert step.bound == "compute" and step.seconds >= step.terms["compute"]
  assert estimate_step_time(text, "v6e").terms["compute"] == pytest.approx(flops / 918e12, rel=1e-9)


def test_a_skinny_matmul_is_derated_by_its_padding_or_bound_by_memory():
  """M = 100 pads to 256 on v6e's MXU (efficiency 100/256); a 1 × 4096 × 4096 product is bound by its bytes: the
  program's bytes read and written (the 64 MiB matrix and the vectors) at v6e's 1.64 TB/s."""
  assert matmul_efficiency((100, 256, 256), V6E) == pytest.approx(100 / 256)
  module = parse_hlo(_matmul_text(1, 4096, 4096))
  step = estimate_step_time(module, "v6e")
  totals = module.totals()
  assert step.bound == "memory" and totals.bytes_read >= 4096 * 4096 * 4
  assert step.terms["memory"] == pytest.approx((totals.bytes_read + totals.bytes_written) / V6E.bandwidth, rel=1e-9)


def test_a_scanned_stack_scales_with_its_trip_count():
  """The same 4-layer program timed at 8 and 16 iterations per loop: its loop work doubles; and an 8-layer compile
  timed as compiled is within 5% of the 4-layer one timed at 8 layers (:func:`layer_trip_counts`): the work outside
  the loops on the stacked ``[L, D, D]`` arrays (the gradient's zero fill and copy-out) stays at the compiled depth,
  3.4% of this small step (in an LLM step, the optimizer's update: docs/timing.md)."""
  four, eight = parse_hlo(_scan_text(4)), parse_hlo(_scan_text(8))
  at4 = estimate_step_time(four, "h100")
  trips = layer_trip_counts(four, 4, 8)
  assert sorted(trips.values()) == [8, 8]
  at8 = estimate_step_time(four, "h100", trip_counts=trips)
  at16 = estimate_step_time(four, "h100", trip_counts=layer_trip_counts(four, 4, 16))
  assert at8.flops == 2 * at4.flops and at16.flops == 4 * at4.flops
  assert at16.seconds - at8.seconds == pytest.approx(2 * (at8.seconds - at4.seconds), rel=1e-6)  # 8 layers vs 4
  compiled8 = estimate_step_time(eight, "h100").seconds
  assert at8.seconds <= compiled8 and at8.seconds == pytest.approx(compiled8, rel=0.05)
  with pytest.raises(JaxckptError, match="no while loop"):
    layer_trip_counts(four, 9, 12)


@pytest.mark.parametrize("rule", sorted(OVERLAP_RULES))
def test_overlap_never_makes_a_step_shorter_than_its_largest_term(rule):
  step = estimate_step_time(_scan_text(4), "v5e", overlap=rule)
  assert step.seconds >= max(step.terms.values()) * (1 - 1e-12)
  serial = estimate_step_time(_scan_text(4), "v5e", overlap="serial").seconds
  assert step.seconds <= serial * (1 + 1e-12)
  assert step.overlap == rule


# --- links ------------------------------------------------------------------------------------------------------


def test_a_collective_over_nvlink_and_over_the_network_takes_bytes_over_each_bandwidth():
  """2 nodes × 8 H100s, NCCL's rings at 92% of a link: an all-gather of 64 MiB inside a node moves 7/8 of it over
  NVLink's 450 GB/s; an all-reduce inside the node runs NVLink SHARP (each GPU sends and receives it once). Across the
  nodes a group of one GPU per node moves 1/2 of it over that GPU's NIC (50 GB/s); a group of all 16 GPUs runs 8
  rings, one per NIC, each crossing the network once per node: min(NVLink, 8 × 50 GB/s) per GPU."""
  links = Links.gpu(H100, 2, 8)
  payload = 64 * 2**20
  nvlink, nic = 450e9 * 0.92, 50e9 * 0.92
  assert collective_seconds("all-gather", payload, range(8), links) == ("nvlink", pytest.approx(7 / 8 * payload / nvlink))
  assert collective_seconds("all-gather", payload, (0, 8), links) == ("network", pytest.approx(1 / 2 * payload / nic))
  assert collective_seconds("all-gather", payload, range(16), links) == (
      "network", pytest.approx(15 / 16 * payload / (8 * nic)))
  assert collective_seconds("all-reduce", payload, range(8), links)[1] == pytest.approx(payload / nvlink)
  assert collective_seconds("all-reduce", payload, (0, 8), links)[1] == pytest.approx(2 * 1 / 2 * payload / nic)
  assert collective_seconds("all-gather", payload, (3,), links) == ("local", 0.0)


def test_ici_bandwidth_is_the_links_of_the_torus_dimensions_a_group_spans():
  """v6e: 100 GB/s one way per link, two links per chip on a dimension that wraps (16 chips), one otherwise: a group
  over all of 16x16 has 400 GB/s, over 8x16 300 GB/s, over 8x8 200 GB/s, over one row of 16 200 GB/s."""
  assert tpu_wraps(V6E, (16, 16)) == (True, True) and tpu_wraps(V6E, (8, 16)) == (False, True)
  assert tpu_wraps(CHIPS["v5p"], (4, 4, 8)) == (True, True, True) and tpu_wraps(CHIPS["v5p"], (2, 2, 4)) == (False,) * 3
  assert Links.tpu(V6E, (16, 16)).route(range(256)) == ("ici", 400e9)
  assert Links.tpu(V6E, (8, 16)).route(range(128)) == ("ici", 300e9)
  assert Links.tpu(V6E, (8, 8)).route(range(64)) == ("ici", 200e9)
  assert Links.tpu(V6E, (16, 16)).route(range(16)) == ("ici", 200e9)  # one row: the first dimension, whole
  assert Links.tpu(V6E, (16, 16)).route(range(0, 256, 16)) == ("ici", 200e9)  # one column
  links = Links.tpu(V6E, (8, 8))
  assert collective_seconds("collective-permute", 1e9, (0, 1), links) == ("ici", pytest.approx(1e9 / 100e9))


# --- the schedule replay, on literal programs --------------------------------------------------------------------

_ASYNC = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1024,1024], q: f32[4096,4096]) -> (f32[8192,1024], f32[4096,4096]) {
  %p = f32[1024,1024]{1,0} parameter(0)
  %q = f32[4096,4096]{1,0} parameter(1)
  %ag = (f32[1024,1024]{1,0}, f32[8192,1024]{1,0}) all-gather-start(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %work = f32[4096,4096]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %done = f32[8192,1024]{1,0} all-gather-done(%ag)
  ROOT %t = (f32[8192,1024]{1,0}, f32[4096,4096]{1,0}) tuple(%done, %work)
}
"""


def test_an_async_collective_is_hidden_by_the_work_between_its_start_and_done():
  """A 32 MiB all-gather over 8 GPUs of one node (7/8 × 32 MiB at 92% of NVLink's 450 GB/s, plus NCCL's 5 µs launch:
  76 µs) beside a 4096³ matmul (179 µs on an H100 at cuBLAS's 76.3%): the step is the matmul, slowed while NCCL's 16
  channels hold 16 of the 132 SMs (132/116), nothing exposed. Over 8 nodes of 1 GPU (one NIC at 92% of 50 GB/s:
  643 µs) the all-gather outlasts it: the step is the all-gather, and what the slowed matmul leaves of it is exposed."""
  payload = 8192 * 1024 * 4
  slow = 132 / 116
  inside = estimate_step_time(_ASYNC, "h100", links=Links.gpu(H100, 1, 8))
  gather = 7 / 8 * payload / (450e9 * 0.92) + 5e-6
  assert inside.terms["collectives:nvlink"] == pytest.approx(gather)
  compute = inside.terms["compute"]
  assert inside.seconds == pytest.approx(gather + (compute - gather / slow)) and not inside.exposed
  across = estimate_step_time(_ASYNC, "h100", links=Links.gpu(H100, 8, 1))
  network = 7 / 8 * payload / (50e9 * 0.92) + 5e-6
  assert across.terms["collectives:network"] == pytest.approx(network)
  assert across.seconds == pytest.approx(network) and across.bound == "collectives:network"
  assert across.exposed["collectives:network"] == pytest.approx(network - compute * slow)
  serial = estimate_step_time(_ASYNC, "h100", links=Links.gpu(H100, 8, 1), overlap="serial")
  assert serial.seconds == pytest.approx(network + compute)


def test_a_program_over_several_devices_needs_its_links():
  with pytest.raises(JaxckptError, match="links="):
    estimate_step_time(_ASYNC, "h100")
  with pytest.raises(JaxckptError, match="did you mean 'v6e'"):
    estimate_step_time(_ASYNC, "v6", links=Links.gpu(H100, 1, 8))
  with pytest.raises(JaxckptError, match="overlap="):
    estimate_step_time(_ASYNC, "h100", links=Links.gpu(H100, 1, 8), overlap="some")


# --- the compilers ------------------------------------------------------------------------------------------------


@needs_libtpu
def test_on_tpu_a_matmul_takes_the_compilers_cycles_over_the_clock():
  """2048 × 8192 × 8192 bf16 on v6e:1x1: the compiler's estimated_cycles (606,880 with libtpu 0.0.42.1) over v6e's
  1.75 GHz, 347 µs: 86% of the peak's 299 µs, never faster than the peak."""
  topo = topology.get_topology("v6e:1x1")
  mesh = topo.mesh({"data": 1})
  s = NamedSharding(mesh, P())
  args = (jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=s),
          jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=s))
  text = jax.jit(lambda a, b: a @ b).lower(*args).compile().as_text()
  module = parse_hlo(text)
  cycles = module.totals().estimated_cycles
  step = estimate_step_time(module, "v6e", links=links_for(topo, mesh))
  flops = 2 * 2048 * 8192 * 8192
  assert step.flops == flops and step.sources["cycles"] == pytest.approx(cycles / V6E.clock_hz)
  assert step.terms["compute"] == pytest.approx(cycles / V6E.clock_hz)
  assert 0.7 < (flops / V6E.peak_flops) / step.terms["compute"] <= 1.0


@needs_libtpu
def test_on_tpu_a_gathered_scan_times_its_collectives_over_ici():
  """A scanned stack with FSDP-sharded weights on v5e:2x2 (2x2 does not wrap: 1 link per dimension, 2 dimensions,
  100 GB/s): every all-gather's seconds are 3/4 of its bytes at 100 GB/s."""
  topo = topology.get_topology("v5e:2x2")
  mesh = topo.mesh({"fsdp": 4})
  def loss(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    return jnp.sum(h.astype(jnp.float32) ** 2)
  w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
  module = parse_hlo(jax.jit(jax.grad(loss)).lower(w, x).compile().as_text())
  links = links_for(topo, mesh)
  step = estimate_step_time(module, "v5e", links=links)
  gathers = [c for c in module.collectives() if c.kind == "all-gather"]
  assert gathers and links.route(gathers[0].groups[0]) == ("ici", 100e9)
  ici = sum(collective_seconds(c.kind, c.payload_bytes, c.groups[0], links)[1] * c.count for c in module.collectives())
  assert step.terms["collectives:ici"] == pytest.approx(ici)
  assert math.isclose(step.seconds, max(step.seconds, *step.terms.values()))


@needs_cuda_plugin
def test_on_gpu_an_all_gather_over_the_network_and_over_nvlink():
  """h100:2x8 with mesh data=2 (across the nodes), fsdp=8 (inside them): gathering an array sharded over fsdp runs
  over NVLink, over data over the network, each at bytes × (n − 1)/n over its bandwidth; on Google Cloud's A3 High
  (four 200 Gb/s NICs per 8 H100s) the network share per GPU is a quarter of a DGX's, NVLink the same."""
  for name, network in (("h100:2x8", 50e9), ("a3-high:2x8", 12.5e9)):
    topo = topology.get_topology(name)
    mesh = topo.mesh({"data": 2, "fsdp": 8})
    links = links_for(topo, mesh)
    for axis, link, n in (("fsdp", "nvlink", 8), ("data", "network", 2)):
      x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=NamedSharding(mesh, P(axis, None)))
      f = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
      step = estimate_step_time(f.lower(x).compile().as_text(), topo.chip_key, links=links)
      bandwidth = (450e9 if link == "nvlink" else network) * 0.92  # NCCL's ring at 92% of the link (one NIC per GPU)
      expected = (n - 1) / n * 4096 * 4096 * 4 / bandwidth + 5e-6  # and NCCL's launch
      assert step.terms[f"collectives:{link}"] == pytest.approx(expected, rel=0.01), name


def test_a_causal_blocked_kernel_computes_the_blocks_on_and_below_the_diagonal():
  """Splash at 8192 tokens with 2048 × 512 blocks: 4 query blocks see 4, 8, 12, 16 of the 16 key blocks (40 of 64);
  square blocks: n(n + 1)/2 of n²."""
  assert causal_block_fraction(8192, 8192, 2048, 512) == 40 / 64
  assert causal_block_fraction(8192, 8192, 512, 512) == (16 * 17 / 2) / 256
  assert causal_block_fraction(4096, 4096, 4096, 4096) == 1.0


_SPLASH = """HloModule jit_a, num_partitions=1

ENTRY %main (q: bf16[64,8192,128], k: bf16[16,8192,128]) -> bf16[64,8192,128] {
  %q = bf16[64,8192,128]{2,1,0} parameter(0)
  %k = bf16[16,8192,128]{2,1,0} parameter(1)
  ROOT %splash_mha_fwd_residuals.1 = bf16[64,8192,128]{2,1,0} custom-call(%q, %k, %k), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 2048, \\"block_kv\\": 512}"
}}, backend_config={"custom_call_config":{"body":"TUzvUg"}}
}
"""


def test_the_splash_kernel_is_timed_by_its_causal_flops_derated_by_its_shape():
  """A splash forward over 64 query heads of 8192 × 128 with 2048 × 512 blocks: 2 matmuls of 2·64·8192²·128 FLOPs
  over the 40/64 of block pairs a causal mask leaves; each has the head dimension (128) as a side, half of v6e's
  256-wide matrix unit, so they run at half its peak; on v5e (128 wide) at its peak."""
  flops = 2 * 2 * 64 * 8192 * 8192 * 128 * 40 / 64
  step = estimate_step_time(_SPLASH, "v6e")
  assert step.flops == pytest.approx(flops)
  assert step.terms["custom_calls"] == pytest.approx(flops / (V6E.peak_flops / 2))
  assert estimate_step_time(_SPLASH, "v5e").terms["custom_calls"] == pytest.approx(flops / CHIPS["v5e"].peak_flops)
