"""Compiling for a TPU topology without a TPU: the report, the budget planner and the fit planner with the
TPU compiler of libtpu, and their error paths.

Tests that compile need the ``libtpu`` package (``pip install -e ".[tpu]"``): without it they are skipped, unless
``JAXCKPT_REQUIRE_TPU=1`` (CI installs the extra and sets it), where a missing libtpu fails them, so they can never
be skipped silently. The error paths that need no libtpu run everywhere, in-process through each CLI's ``main``.

TPU compiles take seconds each on 2 CPU cores (GPT ``tiny``: ~4 s): the compiled results are shared in
module-scoped fixtures and the expensive ones are ``slow``.
"""

from __future__ import annotations

import json
from importlib import metadata

import jax
import pytest

import jaxckpt
from jaxckpt.errors import MeshSpecError, TopologyError
from jaxckpt.cli._fit import main as fit_main
from jaxckpt.cli._plan import main as plan_main
from jaxckpt.report import build_report
from jaxckpt.step import shipped_target
from jaxckpt.report._build import compiler_disagreements
from jaxckpt.cli._report import main as report_main
from jaxckpt.step import compile_policy, step_compiler_options
from jaxckpt.fit import with_batch
from jaxckpt.sharding import _topology as topology
from jaxckpt.sharding import (CHIPS, chip_for_kind, get_topology, parse_topology, resolve_placement, topology_header,
                                      topology_mesh)
from tests.extras import needs_libtpu

TOPOLOGY = "v5e:2x2"
POLICIES = ("none", "nothing_saveable", "dots_saveable")


def _one_line(capsys) -> str:
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  return err


# --- everywhere: names, the chip table, options, error paths (no libtpu needed) ---


def test_topology_names_parse_and_bad_ones_list_the_forms():
  assert parse_topology("v5e:2x2") == ("v5e", (2, 2))
  assert parse_topology(" v4:2x2x1 ") == ("v4", (2, 2, 1))
  with pytest.raises(TopologyError, match=r"unknown chip 'v5'.*valid: TPU chips v4, v5e, v5p, v6e; GPUs a100-40gb, "
                                         r"a100-80gb, h100, h200, b200, a3-high, a3-mega; did you mean"):
    parse_topology("v5:2x2")
  with pytest.raises(TopologyError, match=r"bad topology 'v5e-4': write <chip>:<torus> for a TPU slice, e\.g\. v5e:2x2"):
    parse_topology("v5e-4")
  with pytest.raises(TopologyError, match=r"a v4 slice is a 3-D torus, write 3 sizes ≥ 1 \(e\.g\. v4:2x2x1\)"):
    parse_topology("v4:2x2")
  with pytest.raises(TopologyError, match="2 sizes ≥ 1"):
    parse_topology("v5e:0x2")


def test_the_chip_table_is_the_fit_planners_table():
  assert {k: c.memory_bytes // 2**30 for k, c in CHIPS.items() if c.torus} == {"v4": 32, "v5e": 16, "v5p": 95,
                                                                                "v6e": 32}
  assert chip_for_kind("TPU v5 lite") is CHIPS["v5e"] and chip_for_kind("TPU v4") is CHIPS["v4"]
  assert chip_for_kind("NVIDIA H100 80GB HBM3") is CHIPS["h100"] and chip_for_kind("cpu") is None
  v5e = jaxckpt.fit.accelerator("v5e")
  assert (v5e.peak_flops, v5e.bandwidth, v5e.memory_bytes) == (197e12, 819e9, 16 * 2**30)


def test_compiler_options_follow_the_platform_compiled_for():
  """The XLA:CPU options never reach the TPU compiler, which refuses the remat fix ("HLO opt-barrier is not
  implemented on TPU")."""
  assert step_compiler_options(backend="tpu") == {}
  assert step_compiler_options({"xla_dump_to": "d"}, backend="tpu") == {"xla_dump_to": "d"}
  cpu = step_compiler_options(backend="cpu")
  assert cpu["xla_disable_hlo_passes"] == "cse_barrier_expander" and cpu["xla_backend_optimization_level"] == 0


@pytest.mark.parametrize("main, argv", [
    (report_main, ["--model", "gpt", "--preset", "tiny", "--topology", "v7:2x2"]),
    (plan_main, ["--model", "gpt", "--preset", "tiny", "--topology", "v7:2x2", "--budget", "50%"]),
    (fit_main, ["--model", "gpt", "--preset", "tiny", "--topology", "v7:2x2", "--memory", "1GiB"]),
], ids=["report", "plan", "fit"])
def test_unknown_topology_is_one_line(main, argv, capsys):
  assert main(argv) == 2
  err = _one_line(capsys)
  assert "unknown chip 'v7'" in err and "v5e:2x2" in err and "v4:2x2x1" in err and "h100:8" in err


@pytest.mark.parametrize("version, expected", [
    (None, "which is not installed: pip install -e \".[tpu]\""),
    ("0.0.99", "libtpu 0.0.99 does not fit jaxlib"),
], ids=["missing", "wrong-release"])
def test_topology_without_a_fitting_libtpu_is_one_line(version, expected, monkeypatch, capsys):
  monkeypatch.setattr(topology, "libtpu_version", lambda: version)
  assert report_main(["--model", "gpt", "--preset", "tiny", "--topology", TOPOLOGY]) == 2
  err = _one_line(capsys)
  assert expected in err and metadata.version("jaxlib") in err and "libtpu==" in err
  with pytest.raises(TopologyError, match="libtpu"):
    get_topology(TOPOLOGY)


@pytest.mark.parametrize("main, argv", [
    (report_main, ["--measure"]),
    (report_main, ["--profile", "prof"]),
    (fit_main, ["--measure", "--global-batch-size", "8", "--memory", "1GiB"]),
], ids=["report-measure", "report-profile", "fit-measure"])
def test_topology_with_a_run_is_one_line(main, argv, monkeypatch, capsys):
  monkeypatch.setattr(topology, "libtpu_version", lambda: None)  # refused before libtpu is looked for
  assert main(["--model", "gpt", "--preset", "tiny", "--topology", TOPOLOGY, *argv]) == 2
  err = _one_line(capsys)
  assert f"--topology {TOPOLOGY} compiles for hardware that is not here" in err and f"--{argv[0][2:]}" in err


def test_a_compile_refused_for_memory_is_a_point_over_the_limit():
  """The TPU compiler refuses a program over the chip at compile time; the fit reads the bytes it says it needs."""
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (18.35G) "
             "exceeds available HBM (15.75G).")
  assert jaxckpt.fit.exhausted_bytes(RuntimeError(message)) == int(18.35 * 2**30)
  assert jaxckpt.fit.exhausted_bytes(RuntimeError("INTERNAL: something else")) is None


def test_where_the_compilers_disagree_is_one_warning():
  def row(policy, tpu, cpu):
    return {"policy": policy, "status": "ok", "backend": "tpu", "footprint_bytes": tpu,
            "cpu": {"footprint_bytes": cpu}}

  agree = [row("none", 30, 300), row("full", 10, 100), row("dots", 20, 200)]
  assert compiler_disagreements(agree) == []  # the same order, whatever the sizes
  flipped = [row("none", 30, 300), row("full", 20, 100), row("dots", 10, 200)]
  assert compiler_disagreements(flipped) == [
      "the tpu compiler and XLA:CPU order the policies differently by footprint per device: tpu dots < full < none; "
      "cpu full < dots < none"]
  assert compiler_disagreements([row("none", 30, 300), {**row("full", 1, 1), "status": "error"}]) == []


def test_topology_header_says_chips_mesh_and_that_no_tpu_compiled_it():
  compiler = f"XLA:TPU (libtpu {topology.libtpu_version()})"
  assert topology_header("v5e:2x2", {"data": 4}) == (
      f"TPU v5e 2x2 (4 chips), compiled without a TPU by {compiler}; mesh data=4 (every chip on the data axis; --mesh "
      "to shape it): memory per chip")
  assert topology_header("v5e:2x2", {"data": 4}, mesh_given=True) == (  # --mesh data=4 given: no advice to give it
      f"TPU v5e 2x2 (4 chips), compiled without a TPU by {compiler}; mesh data=4: memory per chip")
  assert topology_header("v4:2x2x1", {"data": 2, "fsdp": 2}).startswith(
      f"TPU v4 2x2x1 (4 chips), compiled without a TPU by {compiler}; mesh data=2,fsdp=2: memory per chip")


def test_compare_cpu_needs_a_topology(capsys):
  assert report_main(["--model", "gpt", "--preset", "tiny", "--compare-cpu"]) == 2
  assert "--compare-cpu puts XLA:CPU's figures beside a topology's: give --topology" in _one_line(capsys)


# --- with libtpu: compiled by the TPU compiler, no TPU ---


@pytest.fixture(scope="module")
def topology_report(tmp_path_factory):
  """GPT tiny on v5e:2x2 (every chip on data, batch 8 = 2 per chip), three policies, XLA:CPU beside: through the CLI,
  in-process; its JSON."""
  path = tmp_path_factory.mktemp("topology") / "r.json"
  code = report_main(["--model", "gpt", "--preset", "tiny", "--topology", TOPOLOGY, "--policies", *POLICIES,
                      "--compare-cpu", "--no-residuals", "--no-progress", "--json", str(path)])
  assert code == 0
  return json.loads(path.read_text())


@needs_libtpu
def test_libtpu_is_installed_and_fits_jaxlib():
  assert topology.check_libtpu() == topology.libtpu_version()


@needs_libtpu
def test_topologies_are_one_device_per_chip():
  v5e, v4 = get_topology(TOPOLOGY), get_topology("v4:2x2x1")
  assert (v5e.chips, v5e.device_kind, v5e.platform) == (4, "TPU v5 lite", "tpu")
  assert (v4.chips, v4.device_kind) == (4, "TPU v4")  # megacore: without it libtpu gives 8 devices (cores)
  assert get_topology("v5e:1x1").chips == 1
  assert v5e.describe() == f"TPU v5e 2x2 (4 chips), compiled without a TPU by XLA:TPU (libtpu {topology.libtpu_version()})"
  assert jaxckpt.sharding.mesh_shape(v5e.mesh()) == {"data": 4}
  assert jaxckpt.sharding.mesh_shape(v5e.mesh("data=2,fsdp=2")) == {"data": 2, "fsdp": 2}
  with pytest.raises(MeshSpecError, match=r"mesh='data=8' covers 8 device\(s\) but topology v5e:2x2 has 4 chips"):
    topology_mesh(TOPOLOGY, "data=8")
  with pytest.raises(TopologyError, match="the TPU compiler refuses topology 'v5e:3x3'"):
    get_topology("v5e:3x3")


@needs_libtpu
@pytest.mark.parametrize("argv, expected", [
    (["--mesh", "data=8"], "covers 8 device(s) but topology v5e:2x2 has 4 chips"),
    (["--mesh", "data=2,fsdp=2", "--compare-cpu"], "also shards parameters and optimizer state over fsdp"),
], ids=["mesh-size", "compare-cpu-fsdp"])
def test_a_mesh_the_topology_cannot_take_is_one_line(argv, expected, capsys):
  assert report_main(["--model", "gpt", "--preset", "tiny", "--topology", TOPOLOGY, *argv]) == 2
  assert expected in _one_line(capsys)


@needs_libtpu
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_topology_report_rows_are_tpu_compiles_per_chip(topology_report):
  data = topology_report
  assert (data["backend"], data["device_kind"], data["topology"], data["device_count"], data["mesh"]) == \
      ("tpu", "TPU v5 lite", TOPOLOGY, 4, {"data": 4})
  assert data["mesh_given"] is False  # the topology's default mesh: the title says so, with --mesh to shape it
  assert data["compiler_options"] == {}  # no XLA:CPU option reaches the TPU compiler
  rows = {r["policy"]: r for r in data["rows"]}
  assert list(rows) == list(POLICIES) and all(r["status"] == "ok" and r["backend"] == "tpu" for r in rows.values())
  for row in rows.values():
    assert row["peak_memory_bytes"] is not None  # a TPU compile reports a peak (XLA:CPU does not)
    assert row["cpu"]["backend"] == "cpu" and row["cpu"]["batch_size"] == 2 and row["cpu"]["peak_memory_bytes"] is None
    assert row["temp_bytes"] != row["cpu"]["temp_bytes"]  # the TPU compiler's buffer assignment, not XLA:CPU's
    assert row["footprint_bytes"] == (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
                                      - row["alias_bytes"])
    assert row["footprint_bytes"] == row["peak_memory_bytes"]  # TPU: the temps the compiler's peak holds


@needs_libtpu
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_the_cpu_comparison_is_xla_cpu_at_the_per_chip_batch(topology_report):
  """``--compare-cpu``'s numbers are exactly the one-device XLA:CPU report of the per-chip batch (2 of 8)."""
  row = next(r for r in topology_report["rows"] if r["policy"] == "nothing_saveable")
  alone = compile_policy(shipped_target("gpt", "tiny", batch_size=2), jaxckpt.parse_policy("nothing_saveable")).memory
  assert {k: row["cpu"][k] for k in ("temp_bytes", "footprint_bytes")} == \
      {k: alone[k] for k in ("temp_bytes", "footprint_bytes")}


@needs_libtpu
def test_compile_step_compiles_remat_for_a_topology():
  """``compile_step(topology=...)``: a remat'd step compiled by the TPU compiler (the XLA:CPU remat fix would make it
  fail: "HLO opt-barrier is not implemented on TPU"), arguments replicated: the stats are one chip's."""
  def loss(w, x):
    return jax.numpy.sum(jax.checkpoint(lambda w, x: jax.numpy.tanh(x @ w))(w, x))

  w = jax.ShapeDtypeStruct((256, 256), jax.numpy.float32)
  x = jax.ShapeDtypeStruct((512, 256), jax.numpy.float32)
  stats = jaxckpt.memory_stats(jaxckpt.compile_step(jax.grad(loss), w, x, topology=TOPOLOGY))
  assert stats["argument_bytes"] == (256 + 512) * 256 * 4 and stats["output_bytes"] == 256 * 256 * 4
  assert stats["footprint_bytes"] == stats["peak_memory_bytes"] > stats["argument_bytes"] + stats["output_bytes"]


@needs_libtpu
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_offloading_the_layer_input_lowers_the_device_footprint_below_full_remat():
  """A scanned stack whose layer input ``x`` is offloaded to host memory: the device footprint is below full remat's
  (which keeps every layer's input on the device, as saving ``x`` there does) by most of those inputs, and the host holds exactly
  the layers' inputs. Before jaxckpt took the host bytes out of the TPU peak (:func:`jaxckpt.memory_stats`) the
  offload row's footprint was argument + output + host bytes, above full remat's."""
  from jax.ad_checkpoint import checkpoint_name
  from jaxckpt.step import HOST_OFFLOAD_OPTIONS

  layers, rows, width = 8, 4096, 512
  policies = {"full": jax.checkpoint_policies.nothing_saveable,
              "save": jax.checkpoint_policies.save_only_these_names("x"),
              "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
                  names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device",
                  offload_dst="pinned_host")}

  def stats(policy):
    def layer(w, x):
      x = checkpoint_name(x, "x")
      return x + jax.numpy.tanh(jax.numpy.tanh(x @ w) @ w.T)

    def loss(ws, x):
      x, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(layer, policy=policies[policy])(w, x), None), x, ws)
      return jax.numpy.sum(x.astype(jax.numpy.float32))

    ws = jax.ShapeDtypeStruct((layers, width, 4 * width), jax.numpy.bfloat16)
    x = jax.ShapeDtypeStruct((rows, width), jax.numpy.bfloat16)
    return jaxckpt.memory_stats(jaxckpt.compile_step(jax.grad(loss), ws, x, topology=TOPOLOGY,
                                                     compiler_options=HOST_OFFLOAD_OPTIONS))

  full, save, offload = (stats(p) for p in policies)
  inputs = layers * rows * width * 2
  assert offload["host_footprint_bytes"] == inputs and not full["host_footprint_bytes"]
  # full remat in a scan keeps each layer's input on the device as saving x does; offloading moves it to the host
  assert full["footprint_bytes"] == save["footprint_bytes"]
  assert offload["footprint_bytes"] <= full["footprint_bytes"] - inputs // 2, (offload, full)
  # The compiler's peak is the larger of the HBM's bytes and host + resident bytes (docs/tpu.md): here the HBM's, so
  # it is the device footprint, the host bytes beside it.
  assert offload["peak_memory_bytes"] > offload["host_footprint_bytes"] + offload["argument_bytes"]
  assert offload["footprint_bytes"] == offload["peak_memory_bytes"]


@pytest.fixture(scope="module")
def fit_on_topology(tmp_path_factory):
  """``jaxckpt-fit`` (in-process): the largest GPT tiny batch under nothing_saveable within 8 MiB per chip of v5e:2x2
  (batches in multiples of 4); its JSON."""
  path = tmp_path_factory.mktemp("fit") / "f.json"
  assert fit_main(["--model", "gpt", "--preset", "tiny", "--topology", TOPOLOGY, "--policies", "nothing_saveable",
                   "--memory", "8MiB", "--no-progress", "--json", str(path)]) == 0
  return json.loads(path.read_text())


@needs_libtpu
@pytest.mark.slow
def test_fit_on_a_topology_answers_a_batch_that_fits_next_to_one_that_does_not(fit_on_topology):
  data = fit_on_topology
  assert (data["backend"], data["device_kind"], data["topology"], data["mesh"]) == \
      ("tpu", "TPU v5 lite", TOPOLOGY, {"data": 4})
  row = data["rows"][0]
  b, limit = row["max_batch_size"], 8 * 2**20
  points = {p["batch"]: p["footprint_bytes"] for p in row["points"]}
  assert b is not None and b % 4 == 0 and not row["capped"] and points[b] <= limit < points[b + 4]
  mesh = topology_mesh(TOPOLOGY)
  target = shipped_target("gpt", "tiny")
  for batch in (b, b + 4):  # the report's compile on the topology at b and b + 4 agrees with the fit's
    report = build_report(with_batch(target, batch), ["nothing_saveable"], topology=TOPOLOGY, mesh=mesh,
                          residuals=False, progress=False)
    assert report.rows[0]["footprint_bytes"] == points[batch] and report.data["backend"] == "tpu"


@needs_libtpu
@pytest.mark.slow
def test_budget_plan_on_a_topology_fits_with_the_tpu_compiler(tmp_path, capsys):
  """``jaxckpt-plan --topology`` (in-process) on GPT tiny at 8 sequences per chip: the verified plan fits 40% of
  none's temp as the TPU compiler assigns it; a budget below full remat's footprint is one line that points to the
  fit planner's per-name offload (custom:search), which can go below it, for a model whose layer input is tagged."""
  path = tmp_path / "p.json"
  assert plan_main(["--model", "gpt", "--preset", "tiny", "--batch-size", "32", "--topology", TOPOLOGY,
                    "--budget", "40%", "--max-rounds", "1", "--json", str(path)]) == 0
  compiler = f"XLA:TPU (libtpu {topology.libtpu_version()})"
  assert capsys.readouterr().out.startswith(f"TPU v5e 2x2 (4 chips), compiled without a TPU by {compiler}; mesh data=4")
  plan = json.loads(path.read_text())
  assert (plan["backend"], plan["topology"], plan["device_count"]) == ("tpu", TOPOLOGY, 4)
  compiled = plan["compiled"]
  assert plan["key"] == "temp_bytes" and compiled["temp_bytes"] <= plan["limit_bytes"] and plan["policy"] != "none"
  assert compiled["footprint_bytes"] == compiled["peak_memory_bytes"]  # a TPU compile's
  # a budget below full remat's footprint: on a chip with host memory the error points to per-name offload
  assert plan_main(["--model", "llm", "--preset", "llama-tiny", "--batch-size", "16", "--topology", TOPOLOGY,
                    "--budget", "1MiB", "--max-rounds", "1"]) == 2
  err = capsys.readouterr().err
  assert "no plan fits budget:1.00MiB" in err and "offload decoder_layer_input to host memory" in err, err
  assert "custom:search with the batch pinned at 16" in err and len(err.strip().splitlines()) == 1, err
  assert plan_main(["--model", "gpt", "--preset", "tiny", "--batch-size", "32", "--topology", TOPOLOGY,
                    "--budget", "1MiB", "--max-rounds", "1"]) == 2  # GPT's names tag no layer input: nothing to offload
  err = capsys.readouterr().err
  assert "no plan fits budget:1.00MiB" in err and "custom:search" not in err, err


@needs_libtpu
def test_a_placement_knows_whether_its_mesh_was_given():
  """The default mesh of a topology (every chip on data) is said as such in the header; a given one, or one the fit's
  mesh search chose, is not — even when it is every chip on data."""
  default = resolve_placement(None, TOPOLOGY)
  assert not default.mesh_given and "(every chip on the data axis; --mesh to shape it)" in default.header()
  given = resolve_placement("data=4", TOPOLOGY)
  assert given.mesh_given and "--mesh to shape it" not in given.header()
  chosen = default.with_mesh({"data": 4})
  assert chosen.mesh_given and "--mesh to shape it" not in chosen.header()
