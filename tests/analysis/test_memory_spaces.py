"""The bytes a compile puts in each memory space, read from XLA's buffer assignment, and the device footprint of a
host-offload program on TPU (docs/tpu.md, "Host offload"): pinned on a scanned stack whose layer input is offloaded,
compiled deviceless for v5e and v6e (needs libtpu)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import memory_stats
from jaxckpt import sharding
from jaxckpt.analysis import offload_device_bytes, read_memory_spaces
from jaxckpt.errors import JaxckptError
from jaxckpt.step import HOST_OFFLOAD_OPTIONS
from tests.extras import needs_libtpu

ROWS, D = 16384, 1024  # per chip: the layer input x is [ROWS, D] bfloat16, 32 MiB
OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device", offload_dst="pinned_host")


def _compile(topology: str, layers: int, hidden: int, dump: str):
  topo = sharding.get_topology(topology)
  mesh = topo.mesh({"fsdp": topo.chips})

  def layer(x, w):
    x = checkpoint_name(x, "x")
    return x + jnp.tanh(jnp.tanh(x @ w) @ w.T), None

  def loss(w, x):
    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=OFFLOAD), x, w)
    return jnp.sum(h.astype(jnp.float32) ** 2)

  w = jax.ShapeDtypeStruct((layers, D, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((ROWS * topo.chips, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
  options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True, **HOST_OFFLOAD_OPTIONS}
  return jax.jit(jax.grad(loss)).lower(w, x).compile(compiler_options=options), topo


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", pytest.param("v6e:2x2", marks=pytest.mark.slow)])
def test_the_host_holds_every_layers_input_and_the_device_figure_is_the_buffer_assignments(topology, tmp_path):
  """16 layers, hidden 4096: the host space holds the 16 offloaded layer inputs exactly (512 MiB per chip); the
  compiler's peak is then the host's figure (host + arguments + output), so the stats alone give no exact device
  bytes (an upper bound), and the buffer assignment's HBM total is below that peak and below the chip."""
  compiled, topo = _compile(topology, 16, 4096, str(tmp_path))
  spaces = read_memory_spaces(str(tmp_path))
  stats = memory_stats(compiled)
  assert spaces.host_bytes == stats["host_footprint_bytes"] == 16 * ROWS * D * 2
  resident = stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"]
  assert stats["peak_memory_bytes"] == pytest.approx(spaces.host_bytes + resident, abs=1 << 16)  # + constants
  assert offload_device_bytes(stats) == (stats["peak_memory_bytes"], False)
  assert offload_device_bytes(stats, spaces) == (spaces.device_bytes, True)
  assert resident < spaces.device_bytes < stats["peak_memory_bytes"] < topo.chip.memory_bytes
  assert stats["footprint_bytes"] >= spaces.device_bytes  # XLA's temp_size: an upper estimate there


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", pytest.param("v6e:2x2", marks=pytest.mark.slow)])
def test_where_the_device_dominates_the_peak_is_the_devices(topology, tmp_path):
  """4 layers, hidden 16384: the device's temporaries outweigh the 128 MiB on the host; the peak is then the HBM's
  (within 3% of the buffer assignment's total: allocation versus live bytes) and jaxckpt's footprint is that peak."""
  compiled, _ = _compile(topology, 4, 16384, str(tmp_path))
  spaces = read_memory_spaces(str(tmp_path))
  stats = memory_stats(compiled)
  assert spaces.host_bytes == stats["host_footprint_bytes"] == 4 * ROWS * D * 2
  device, exact = offload_device_bytes(stats)
  assert exact and device == stats["peak_memory_bytes"] == stats["footprint_bytes"]
  assert device == pytest.approx(spaces.device_bytes, rel=0.03)


def test_a_directory_without_a_report_says_how_to_make_one(tmp_path):
  with pytest.raises(JaxckptError, match="xla_dump_to"):
    read_memory_spaces(str(tmp_path))
  report = tmp_path / "m.after_optimizations-memory-usage-report.txt"
  report.write_text("Memory Space: default (color=0)\nTotal bytes: 1024 (1.0KiB)\n\nMemory Space: cmem (color=5)\n"
                    "Total bytes: 512 (512B)\n")
  spaces = read_memory_spaces(str(tmp_path))
  assert (spaces.device_bytes, spaces.host_bytes, spaces.spaces[5].name) == (1024, 512, "cmem")
