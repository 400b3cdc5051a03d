"""NVIDIA GPU clusters compiled for without a GPU: names, the chip table's target configs, the placement's memory
verdict, the GPU compiler's options, and the tools on tiny presets (XLA:GPU compiles them in seconds).

The compiles need JAX's CUDA plugin (``pip install -e ".[gpu]"``); without it they are skipped, except under
``JAXCKPT_REQUIRE_GPU=1`` (CI installs the extra and sets it), where a missing plugin fails them. The error paths
that need no plugin run everywhere.
"""

from __future__ import annotations

import json
import os
from importlib import metadata

import pytest

import jaxckpt
from jaxckpt.cli import fit as fit_main, report as report_main
from jaxckpt.errors import JaxckptError, TopologyError
from jaxckpt.sharding import (CHIPS, GPU_CHIPS, chip_for_kind, device_memory, get_topology, gpu_axis_links,
                              memory_fraction, parse_topology, resolve_placement, target_config)
from jaxckpt.sharding import _topology as topology
from jaxckpt.step import GPU_RECIPE_OPTIONS, shipped_target, step_compiler_options
from tests.extras import needs_cuda_plugin
from tests.parse_counts import parses, placement_reads  # noqa: F401 - the fixture

NODE = "h100:8"


def _one_line(capsys) -> str:
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err


# --- everywhere: names, the chip table, the memory fraction, options (no plugin needed) ---


def test_gpu_names_parse_as_nodes_of_gpus_and_bad_ones_name_the_valid_choices():
  assert parse_topology("h100:8") == ("h100", (1, 8))
  assert parse_topology(" h200:32x8 ") == ("h200", (32, 8))
  assert parse_topology("a100-40gb:4") == ("a100-40gb", (1, 4))
  assert parse_topology("a3-high:2x8") == ("a3-high", (2, 8))
  with pytest.raises(TopologyError, match=r"puts 16 GPUs in a node, but a node of NVIDIA H100 SXM GPUs holds at "
                                          r"most 8 .*e\.g\. h100:2x8"):
    parse_topology("h100:16")
  with pytest.raises(TopologyError, match=r"unknown chip 'h10'.*GPUs a100-40gb, a100-80gb, h100, h200, b200, "
                                          r"a3-high, a3-mega; did you mean 'h100'"):
    parse_topology("h10:8")
  with pytest.raises(TopologyError, match=r"a h100 cluster is h100:<gpus> \(one node\) or h100:<nodes>x<gpus per"):
    parse_topology("h100:0x8")


def test_every_gpu_has_a_target_config_that_names_its_device_and_memory():
  assert GPU_CHIPS == ("a100-40gb", "a100-80gb", "h100", "h200", "b200", "a3-high", "a3-mega")
  for key in GPU_CHIPS:
    chip, text = CHIPS[key], target_config(key)
    assert f'device_description_str: "{chip.device_kinds[0]}"' in text, key
    assert f"device_memory_size: {chip.memory_bytes}" in text, key  # one figure for the verdict and the compiler
    assert chip_for_kind(chip.device_kinds[0]) is CHIPS[chip.gpu or key]  # a machine type's device: its GPU's row
    assert chip.gpus_per_node == 8 and chip.network_bandwidth > 0 and chip.ici_bandwidth > chip.network_bandwidth
  assert chip_for_kind("NVIDIA H100 SXM5 80GB") is CHIPS["h100"]  # a kind the table does not list word for word
  # Google Cloud's H100 machine types: the H100 with less network per GPU (4 or 8 NICs of 200 Gb/s per 8 GPUs)
  assert [CHIPS[k].network_bandwidth for k in ("h100", "a3-mega", "a3-high")] == [50e9, 25e9, 12.5e9]
  assert CHIPS["a3-high"]._replace(network_bandwidth=50e9, host_memory_bytes=CHIPS["h100"].host_memory_bytes,
                                   gpu="") == CHIPS["h100"]


def test_the_memory_fraction_is_jaxs_default_the_environments_or_given():
  assert memory_fraction(environ={}) == (0.75, "JAX's default")
  assert memory_fraction(environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == (0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION")
  assert memory_fraction(environ={"XLA_CLIENT_MEM_FRACTION": "0.95", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}).value \
      == 0.95
  assert memory_fraction(0.975, environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == (0.975, "given")
  for bad in (0, 1.5, -0.1, True):
    with pytest.raises(JaxckptError, match=r"must be in \(0, 1\]"):
      memory_fraction(bad)
  with pytest.raises(JaxckptError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='lots' is not a number"):
    memory_fraction(environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})


def test_gpu_compiles_disable_xlas_remat_pass_and_keep_the_users_xla_flags(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  options = step_compiler_options(backend="gpu")
  assert options == {**GPU_RECIPE_OPTIONS, "xla_disable_hlo_passes": "rematerialization"}
  assert options["xla_gpu_enable_triton_gemm"] is False and options["xla_gpu_enable_latency_hiding_scheduler"]
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false --xla_disable_hlo_passes=foo "
                     "--xla_gpu_enable_triton_gemm=true")
  # the user's XLA_FLAGS choose the disabled passes, the scheduler and the GEMMs: jaxckpt adds none over them
  mine = step_compiler_options(backend="gpu")
  assert mine == {k: v for k, v in GPU_RECIPE_OPTIONS.items() if k not in (
      "xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_triton_gemm")}
  monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=foo")
  assert jaxckpt.remat_compiler_options("cpu") == {"xla_disable_hlo_passes": "foo,cse_barrier_expander"}
  # the caller's own choice of passes keeps XLA:GPU's pass on
  assert "xla_disable_hlo_passes" not in step_compiler_options({"xla_disable_hlo_passes": ""}, backend="gpu") or \
      step_compiler_options({"xla_disable_hlo_passes": ""}, backend="gpu")["xla_disable_hlo_passes"] == ""


def test_axes_inside_a_node_are_nvlink_and_the_rest_the_network():
  assert gpu_axis_links({"data": 32, "fsdp": 8}, 8) == {"data": "network", "fsdp": "nvlink"}
  assert gpu_axis_links({"data": 2, "fsdp": 16, "tensor": 8}, 8) == {"data": "network", "fsdp": "network",
                                                                     "tensor": "nvlink"}
  assert gpu_axis_links({"fsdp": 4, "tensor": 2}, 8) == {"fsdp": "nvlink", "tensor": "nvlink"}


@pytest.mark.parametrize("argv, expected", [
    (["--topology", "v5e:2x2", "--memory-fraction", "0.9"], "--memory-fraction applies to a GPU --topology"),
    (["--memory-fraction", "0.9"], "--memory-fraction applies to a GPU --topology"),
    (["--topology", "h100:8", "--memory-fraction", "1.5"], "--memory-fraction 1.5 must be in (0, 1]"),
    (["--topology", "h100:16"], "puts 16 GPUs in a node"),
    (["--topology", "h100:8", "--measure"], "--measure runs steps on this machine, but --topology h100:8 compiles for "
                                            "hardware that is not here"),
], ids=["tpu", "no-topology", "fraction", "node", "measure"])
def test_bad_gpu_flags_are_one_line(argv, expected, capsys):
  assert report_main(["--model", "llm", "--preset", "llama-tiny", *argv]) == 2
  assert expected in _one_line(capsys)


def test_a_missing_plugin_is_one_line_naming_the_extra(monkeypatch, capsys):
  monkeypatch.setattr(topology, "_version", lambda d: None if d.startswith("jax-cuda12") else "0.10.2")
  assert report_main(["--model", "llm", "--preset", "llama-tiny", "--topology", NODE]) == 2
  err = _one_line(capsys)
  assert "needs XLA:GPU from JAX's CUDA plugin" in err and "pip install -e \".[gpu]\"" in err
  jaxlib = metadata.version("jaxlib")
  monkeypatch.setattr(topology, "_version", lambda d: "0.0.1" if d.startswith("jax-cuda12") else jaxlib)
  with pytest.raises(TopologyError, match=rf"jax-cuda12-plugin 0.0.1.* does not fit jaxlib {jaxlib}"):
    get_topology(NODE)


# --- with the plugin: compiled by XLA:GPU, no GPU ---


@needs_cuda_plugin
def test_a_cluster_is_nodes_of_gpus_in_node_order():
  topo = get_topology("h100:2x8")
  assert (topo.chips, topo.platform, topo.device_kind, topo.nodes) == (16, "gpu", "NVIDIA H100 80GB HBM3", 2)
  assert [d.process_index for d in topo.devices] == [0] * 8 + [1] * 8
  mesh = topo.mesh("data=2,fsdp=8")
  assert [d.process_index for d in mesh.devices[0]] == [0] * 8  # the last axis fills a node
  assert topo.axis_links(mesh) == {"data": "network", "fsdp": "nvlink"}
  assert topo.describe().startswith("NVIDIA H100 SXM, 2 nodes × 8 GPUs (16 GPUs), compiled without a GPU by XLA:GPU")


@needs_cuda_plugin
def test_the_memory_a_gpu_may_use_is_its_memory_times_the_fraction():
  placement = resolve_placement(None, NODE, memory_fraction=0.9)
  limit, source = placement.memory()
  assert limit == int(CHIPS["h100"].memory_bytes * 0.9) and "× 0.9 memory fraction (given)" in source
  assert device_memory(get_topology(NODE).devices[0], fraction=0.5)[0] == CHIPS["h100"].memory_bytes // 2
  with pytest.raises(JaxckptError, match="is a GPU's share of memory for XLA, but the step is compiled for 'cpu'"):
    resolve_placement(None, None, memory_fraction=0.9)


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
  """``jaxckpt-report`` on llama-tiny over one H100 node (fsdp=8), the JSON read back."""
  path = tmp_path_factory.mktemp("gpu") / "r.json"
  argv = ["--model", "llm", "--preset", "llama-tiny", "--topology", NODE, "--mesh", "fsdp=8", "--batch-size", "16",
          "--seq-len", "128", "--policies", "full", "minimal_flash", "--json", str(path), "--no-residuals"]
  assert report_main(argv) == 0
  return json.loads(path.read_text())


@needs_cuda_plugin
def test_the_report_on_a_gpu_node_names_the_gpu_and_its_compiler(gpu_report):
  data = gpu_report
  assert (data["backend"], data["device_kind"], data["topology"], data["device_count"]) == (
      "gpu", "NVIDIA H100 80GB HBM3", NODE, 8)
  assert data["mesh_given"] is True  # --mesh fsdp=8
  assert data["compiler"] == f"XLA:GPU (jax-cuda12-plugin {metadata.version('jax-cuda12-plugin')})"
  assert data["compiler_options"]["xla_disable_hlo_passes"] == "rematerialization"
  rows = {r["policy"]: r for r in data["rows"]}
  assert [r["status"] for r in rows.values()] == ["ok", "ok"]
  # full remat keeps less than MaxText's minimal_flash, which saves the projections and the attention's residuals
  assert rows["nothing_saveable"]["footprint_bytes"] < rows["minimal_with_context"]["footprint_bytes"]


@needs_cuda_plugin
def test_a_step_over_the_gpus_memory_is_reported_as_not_fitting_with_its_bytes(capsys, parses):
  argv = ["--model", "llm", "--preset", "llama-tiny", "--topology", NODE, "--mesh", "fsdp=8", "--batch-size", "16",
          "--seq-len", "128", "--policies", "none", "--memory-fraction", "1e-6", "--no-residuals"]
  assert report_main(argv) == 1  # no row fits
  # the report reads each placement flag once, at its door (tests/cli/test_resolve_once.py: policies and the mesh)
  assert placement_reads(parses) == {f"topology:{NODE}": 1, "mesh:fsdp=8": 1, "fraction:1e-06": 1}
  out = capsys.readouterr().out
  assert "none: does not fit: footprint" in out and "per GPU >" in out and "XLA may use" in out
  assert "× 1e-06 memory fraction (given)" in out


@needs_cuda_plugin
def test_the_memory_fraction_reaches_the_auto_budget_of_the_report_and_the_fit(monkeypatch, tmp_path):
  """``--memory-fraction`` is the budget of every plan on a GPU topology: the report's ``auto`` plan and the fit's
  ``memory="auto"`` are the H100's memory × the fraction, less ``auto``'s 10% margin, at 0.5 and at 0.9. The fraction
  is not in a compile's key (XLA:GPU compiles for a topology without reading it), so the second fraction reuses the
  first one's compiled statistics (jaxckpt.step's stats cache, in a directory of this test)."""
  from jaxckpt.fit import plan_fit
  from jaxckpt.policies import DEFAULT_MARGIN
  from jaxckpt.report import build_report

  monkeypatch.setenv("JAXCKPT_STATS_CACHE", str(tmp_path))
  target = shipped_target("mlp", "tiny")
  limits = {}
  for fraction in (0.5, 0.9):
    expected = int(int(CHIPS["h100"].memory_bytes * fraction) * (1 - DEFAULT_MARGIN))
    row = build_report(target, ["auto"], topology=NODE, memory_fraction=fraction, residuals=False,
                       progress=False).rows[0]
    assert row["status"] == "ok", row["error"]
    assert row["plan"]["limit_bytes"] == expected, (fraction, row["plan"])
    assert f"× {fraction:g} memory fraction (given)" in row["plan"]["memory_source"]
    fit = plan_fit(target, ["none"], topology=NODE, memory_fraction=fraction, max_batch=8)
    assert (fit.limit_bytes, f"× {fraction:g} memory fraction (given)" in fit.memory_source) == (expected, True)
    limits[fraction] = expected
  assert limits[0.5] < limits[0.9]


@needs_cuda_plugin
def test_auto_attention_on_a_gpu_is_the_pallas_flash_kernel_in_shard_map():
  from jaxckpt.analysis import read_compiled
  from jaxckpt.step import compile_policy

  placement = resolve_placement("fsdp=8", NODE)
  target = shipped_target("llm", "llama-tiny", batch_size=16, seq_len=128, attention="auto")
  compiled = compile_policy(target, "full", mesh=placement.mesh)
  targets = {op.custom_call_target for op in read_compiled(compiled.compiled).instructions.values()
             if op.custom_call_target}
  assert any("triton" in t for t in targets), targets  # the Pallas Triton kernels, not XLA's einsum attention


@needs_cuda_plugin
def test_the_fit_searches_meshes_on_a_cluster_unless_one_is_named(tmp_path, capsys, parses):
  path = tmp_path / "fit.json"
  argv = ["--model", "llm", "--preset", "llama-tiny", "--topology", "h100:2x8", "--seq-len", "128",
          "--global-batch-size", "32", "--policies", "full", "--max-meshes", "1", "--memory-fraction", "0.9",
          "--json", str(path)]
  assert fit_main(argv) == 0
  # the fit reads each placement flag once, its mesh search included (its compile workers are other processes)
  assert placement_reads(parses) == {"topology:h100:2x8": 1, "fraction:0.9": 1}
  data = json.loads(path.read_text())
  assert data["backend"] == "gpu" and data["mesh_search"]["winner"]  # --mesh auto without asking
  out = capsys.readouterr().out
  assert "2 nodes × 8 GPUs" in out and "XLA may use" in out


def test_the_compilers_log_lines_are_caught_kept_and_written_back(capfd):
  """XLA:GPU logs from C++ to file descriptor 2 (its rematerialization pass's "Can't reduce memory use below …"):
  the compile that wrote a line gets it, and stderr still shows it."""
  from jaxckpt.training._xla import compiler_log

  line = ("W1205 05:48:45.885842    1124 hlo_rematerialization.cc:3231] Can't reduce memory use below 60.25GiB "
          "(64694889171 bytes) by rematerialization")
  with compiler_log() as messages:
    os.write(2, f"I1205 05:48:45.1 1 other.cc:1] noise\n{line}\n".encode())
  assert messages == ["Can't reduce memory use below 60.25GiB (64694889171 bytes) by rematerialization"]
  assert line in capfd.readouterr().err  # written back: nothing swallowed
  with compiler_log(enabled=False) as messages:
    os.write(2, f"{line}\n".encode())
  assert messages == []


def _dit_head_dim_72():
  """An own DiT (tests/own_models.py) at tiny widths with DiT-XL/2's head dim 72 (hidden 144, 2 heads), 256 tokens
  per image and 8 images per GPU: the shape where XLA:GPU's Triton GEMM rewriter cannot tile the attention's output
  projection (``bf16[2048,144]``); DiT-XL/2 itself (hidden 1152) fails the same way."""
  from flax import nnx

  from jaxckpt.step import ModelTarget
  from tests.own_models import DiT, DiTBlock, DiTConfig, dit_batch, dit_loss, jaxckpt_blocks

  cfg = DiTConfig(hidden_size=144, num_heads=2, input_size=32, depth=2, dtype="bfloat16")
  return ModelTarget(make_model=lambda: jaxckpt_blocks(DiT(cfg, rngs=nnx.Rngs(0)), {"block": DiTBlock}),
                     batch=dit_batch(cfg, 64), loss_fn=dit_loss, name="own-dit")


@needs_cuda_plugin
def test_an_own_dit_with_head_dim_72_compiles_for_a_gpu_as_the_published_recipes_compile(monkeypatch):
  """XLA:GPU compiles as the published GPU recipes do (jaxckpt.step.GPU_RECIPE_OPTIONS: cuBLAS GEMMs, the
  latency-hiding scheduler, ...), so the DiT compiles with no XLA_FLAGS; with Triton GEMM back on, the row keeps
  XLA's message (the instruction it names) and gives the hint."""
  from jaxckpt.report import build_report

  monkeypatch.delenv("XLA_FLAGS", raising=False)
  target = _dit_head_dim_72()
  report = build_report(target, ["none", "full"], topology=NODE, residuals=False, progress=False)
  rows = {r["policy"]: r for r in report.rows}
  assert [r["status"] for r in rows.values()] == ["ok"] * 2, [r["error"] for r in rows.values()]
  assert rows["nothing_saveable"]["footprint_bytes"] < rows["none"]["footprint_bytes"]
  assert report.data["compiler_options"]["xla_gpu_enable_triton_gemm"] is False
  triton = build_report(target, ["none"], topology=NODE, residuals=False, progress=False,
                        compiler_options={"xla_gpu_enable_triton_gemm": True}).rows[0]
  assert triton["status"] == "error"
  assert "Couldn't find output tile sizes that satisfy hlo: %dot" in triton["error"], triton["error"]
  assert "hint: XLA:GPU's Triton GEMM rewriter cannot tile" in triton["error"], triton["error"]
