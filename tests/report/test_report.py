"""The memory report (jaxckpt.report): rows for every policy, real memory/FLOP orderings, residual names under scan,
error rows, XLA dumps, user targets, the output files and the CLI's exit codes."""

import json
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.report import REPORT_KEYS, ROW_KEYS, all_policies, build_report, write_outputs
from jaxckpt.step import LossTarget, ModelTarget, compile_job, shipped_target
from jaxckpt.cli._report import main
from jaxckpt.report._compile import compile_rows
from jaxckpt.step._build import target_block_types
from jaxckpt.schema import MEMORY_KEYS, SCHEMA_VERSION

BATCH = 8


def check_report_schema(data):
  """A JSON-schema-like check of the report JSON, with plain asserts."""
  assert tuple(data) == REPORT_KEYS
  assert data["schema_version"] == SCHEMA_VERSION
  assert isinstance(data["model"], str) and (data["preset"] is None or isinstance(data["preset"], str))
  assert data["backend"] in ("cpu", "gpu", "tpu") and isinstance(data["device_count"], int)
  assert data["mesh"] is None and data["structure"].split(", ")[0] in ("scan", "unrolled")
  assert data["grad_accum_steps"] >= 1 and data["batch_size"] >= data["grad_accum_steps"]
  assert data["units"]["footprint_bytes"] == "bytes per device" and data["units"]["residual_bytes"].startswith(
      "bytes global") and data["units"]["flops"] == "FLOPs per step global (the whole batch, every device)"
  assert isinstance(data["versions"], dict) and "jax" in data["versions"]
  assert isinstance(data["compiler_options"], dict)
  assert all(isinstance(w, str) for w in data["warnings"])
  assert data["rows"]
  for row in data["rows"]:
    assert tuple(row) == ROW_KEYS
    assert isinstance(row["policy"], str) and row["status"] in ("ok", "error")
    assert (row["error"] is None) == (row["status"] == "ok")
    for key in MEMORY_KEYS:
      assert row[key] is None or (isinstance(row[key], int) and not isinstance(row[key], bool)), key
    if row["status"] == "ok":
      parts = [row[k] for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")]
      if None not in parts:
        assert row["footprint_bytes"] == parts[0] + parts[1] + parts[2] - parts[3]
      assert isinstance(row["flops"], int) and row["flops"] > 0
      assert row["flops_xla_raw"] is None or isinstance(row["flops_xla_raw"], int)
      assert isinstance(row["compile_s"], float) and row["compile_s"] > 0
    for key in ("step_time_s",):
      assert row[key] is None or isinstance(row[key], float)
    assert row["peak_bytes_measured"] is None or isinstance(row["peak_bytes_measured"], int)
    if row["residuals"] is not None:
      res = row["residuals"]
      assert set(res) == {"count", "bytes", "activation_bytes", "argument_bytes", "analysed", "levels", "groups",
                          "by_source", "items", "in_kernel_bytes", "in_kernel_sources"}
      assert res["bytes"] == sum(level["bytes"] for level in res["levels"])
      assert row["residual_bytes"] == res["bytes"] == sum(i["bytes"] for i in res["items"] if i["kind"] != "argument")
      assert row["activation_residual_bytes"] == res["activation_bytes"] <= res["bytes"]
      assert sum(g["bytes"] for g in res["groups"]) == res["bytes"] + res["argument_bytes"]
  json.loads(json.dumps(data))  # serialisable as is


@pytest.fixture(scope="module")
def vit_all():
  return build_report(shipped_target("vit", "tiny", batch_size=BATCH), ["all"], progress=False)


def test_all_rows_present_and_valid(vit_all):
  target = shipped_target("vit", "tiny", batch_size=BATCH)
  expected = [str(s) for s in all_policies(target_block_types(target), backend="cpu")]
  assert [r["policy"] for r in vit_all.rows] == expected
  emitted = set().union(*target_block_types(target).values())
  assert emitted == {"qkv", "attn_weights", "attn_context", "attn_out", "mlp_hidden", "mlp_out"}
  assert len(expected) == 1 + 4 + len(emitted)  # none, 4 zero-arg policies, one save_only_these_names per name
  assert "offload_dot_with_no_batch_dims" not in expected  # offloading saves nothing on CPU
  assert all(r["status"] == "ok" for r in vit_all.rows)
  check_report_schema(vit_all.data)
  assert vit_all.data["structure"] == "scan" and vit_all.data["model"] == "vit"


def test_every_column_says_what_it_counts_and_the_title_the_batch(vit_all):
  """One device's memory, the whole batch's residuals, the whole step's FLOPs; the batch in the title (global and,
  under a mesh, per device; with accumulation, its micro-batches)."""
  from jaxckpt.report import to_table
  from jaxckpt.report._formats import batch_words, table_rows

  headers = table_rows(vit_all)[0]
  assert {"footprint/device", "temp/device", "residuals (global)", "FLOPs (global)", "compile"} <= set(headers)
  text = to_table(vit_all, width=100)
  assert text.splitlines()[0].startswith(f"jaxckpt memory report: vit (tiny), scan layers, batch {BATCH}, backend")
  assert [line.split() for line in text.splitlines()[2:3]] == [["/device", "/device", "global", "global"]]
  data = {"batch_size": 1024, "grad_accum_steps": 4, "mesh": {"data": 2, "fsdp": 4, "tensor": 2},
          "topology": "h100:2x8", "backend": "gpu"}
  assert batch_words(data) == "batch 1024 global, 128 per GPU, as 4 micro-batches of 256"


def test_vit_memory_and_flops_order(vit_all):
  temp = {r["policy"]: r["temp_bytes"] for r in vit_all.rows}
  flops = {r["policy"]: r["flops"] for r in vit_all.rows}
  assert temp["nothing_saveable"] < temp["dots_saveable"] < temp["none"]
  assert flops["nothing_saveable"] > flops["none"]
  # XLA counts the scanned layers' loop body once; the jaxpr count multiplies it by the depth.
  assert all(r["flops_xla_raw"] < r["flops"] for r in vit_all.rows)


def test_policy_saving_nothing_is_warned(vit_all):
  none_temp = vit_all.row("none")["temp_bytes"]
  no_saving = [r["policy"] for r in vit_all.rows if r["policy"] != "none" and r["temp_bytes"] >= none_temp]
  assert "everything_saveable" in no_saving
  for policy in no_saving:
    assert any(f"policy {policy!r} saves no memory" in w for w in vit_all.data["warnings"])


def test_residual_names_survive_scan(vit_all):
  config = jaxckpt.models.MODELS["vit"].presets["tiny"]
  assert config.scan
  groups = {g["key"]: g for g in vit_all.row("save_only_these_names:qkv")["residuals"]["groups"] if g["by"] == "name"}
  tokens, dim = (8 // config.patch_size) ** 2, config.dim
  assert groups["qkv"]["count"] == config.num_layers  # one [B, T, 3, H, K] per layer
  assert groups["qkv"]["bytes"] == config.num_layers * BATCH * tokens * 3 * dim * 4
  assert "qkv" not in {g["key"] for g in vit_all.row("none")["residuals"]["groups"]}
  assert not any(g["by"] == "name" for g in vit_all.row("nothing_saveable")["residuals"]["groups"])
  residual = {r["policy"]: r["residual_bytes"] for r in vit_all.rows}
  assert residual["nothing_saveable"] < residual["save_only_these_names:qkv"] < residual["none"]


def test_invalid_policy_is_an_error_row_and_others_complete(tmp_path):
  report = build_report(shipped_target("mlp", "tiny", batch_size=BATCH),
                        ["none", "attn=full", "save_only_these_names:qkv", "full"], progress=False, residuals=False)
  status = {r["policy"]: (r["status"], r["error"]) for r in report.rows}
  assert status["none"] == ("ok", None) and status["nothing_saveable"] == ("ok", None)
  assert status["attn=nothing_saveable"][0] == "error" and "unknown block type 'attn'" in status["attn=nothing_saveable"][1]
  assert status["save_only_these_names:qkv"][0] == "error" and "'qkv'" in status["save_only_these_names:qkv"][1]
  assert sum("is invalid for mlp" in w for w in report.data["warnings"]) == 2
  assert report.ok
  check_report_schema(report.data)
  paths = write_outputs(report, json_path=str(tmp_path / "r.json"), csv_path=str(tmp_path / "r.csv"),
                        markdown_path=str(tmp_path / "r.md"), html_path=str(tmp_path / "r.html"),
                        plot_path=str(tmp_path / "r.png"))
  assert all(os.path.getsize(p) > 0 for p in paths) and len(paths) == 5
  assert "unknown block type" in (tmp_path / "r.md").read_text()


def test_stats_only_compile_gives_identical_memory_stats():
  target = shipped_target("mlp", "tiny", batch_size=BATCH)
  specs = [jaxckpt.parse_policy("dots_saveable")]
  fast, _ = compile_rows(compile_job(target), specs, residuals=False, progress=False, stats_only=True)
  full, _ = compile_rows(compile_job(target), specs, residuals=False, progress=False, stats_only=False)
  assert {k: fast[0][k] for k in MEMORY_KEYS} == {k: full[0][k] for k in MEMORY_KEYS}
  assert fast[0]["temp_bytes"] > 0


def test_xla_dump_peak_buffers_and_links(tmp_path):
  report = build_report(shipped_target("mlp", "tiny", batch_size=BATCH), ["none"], progress=False, residuals=False,
                        xla_dump=str(tmp_path / "dump"))
  dump = report.row("none")["xla_dump"]
  for key in ("memory_usage_report", "buffer_assignment", "live_range", "hlo"):
    assert dump["files"][key] is not None and os.path.isfile(dump["files"][key])
  assert not [f for f in os.listdir(dump["dir"]) if f.endswith((".ll", ".o"))]
  peak = dump["peak_buffers"]
  assert peak and [b["bytes"] for b in peak] == sorted((b["bytes"] for b in peak), reverse=True)
  assert 0 < sum(b["bytes"] for b in peak) <= report.row("none")["footprint_bytes"]
  assert any(b["op_name"] and b["op_name"].startswith("jit(step)") for b in peak)
  assert any(b["source"] and ".py:" in b["source"] for b in peak)
  page = jaxckpt.report.to_html(report, base_dir=str(tmp_path))
  assert 'href="dump/00-none/' in page and "memory-usage-report" in page


# --- user targets (also the --target protocol: this module is importable as tests.report.test_report) -----------

LOSS_TARGET = "tests.report.test_report:loss_target"


def loss_target():
  """A LossTarget: 3 unrolled tanh layers, each remat'd as block type 'mlp', emitting 'hidden'."""

  def loss(params, batch, *, policy):
    def layer(w, h):
      return jnp.tanh(checkpoint_name(h @ w, "hidden")) * 2.0

    block = jaxckpt.checkpoint(layer, policy, block_type="mlp")
    h = batch["x"]  # [B, D] float32
    for w in params["w"]:  # L × [D, D] float32
      h = block(w, h)
    return jnp.mean(h ** 2)

  d = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  return LossTarget(loss, params={"w": [d] * 3}, batch={"x": jax.ShapeDtypeStruct((256, 128), jnp.float32)},
                    block_types={"mlp": {"hidden"}}, name="tanh-mlp")


class _Plain(nnx.Module):
  def __init__(self, *, rngs):
    self.proj = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):  # x: [B, 8] float32
    return jnp.tanh(self.proj(x))


def unapplied_target():
  """A model with no remat'd blocks: every remat policy's row is an error row (the policy was not applied)."""
  return ModelTarget(make_model=lambda: _Plain(rngs=nnx.Rngs(0)), batch=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                     loss_fn=lambda model, x: jnp.mean(model(x) ** 2), name="plain")


def sized_target(*, batch_size: int = 16, num_layers: int = 2, width: int = 32):
  """A target function with keyword arguments: the tools pass --batch-size, --layers and --target-arg width=."""

  def loss(params, batch, *, policy):
    block = jaxckpt.checkpoint(lambda w, h: jnp.tanh(h @ w), policy, block_type="mlp")
    h = batch["x"]  # [B, D] float32
    for w in params["w"]:  # L × [D, D] float32
      h = block(w, h)
    return jnp.mean(h ** 2)

  d = jax.ShapeDtypeStruct((width, width), jnp.float32)
  return LossTarget(loss, params={"w": [d] * num_layers},
                    batch={"x": jax.ShapeDtypeStruct((batch_size, width), jnp.float32)}, name="sized")


def test_target_function_takes_the_cli_sizes(tmp_path):
  """Issue 40: a --target function with keyword arguments gets --batch-size, --layers and --target-arg values, and
  the rows are those of the shapes asked for (arguments grow with width² × layers)."""
  out = {}
  for layers, width in ((2, 32), (3, 64)):
    path = tmp_path / f"{layers}-{width}.json"
    assert _exit_status(["--target", "tests.report.test_report:sized_target", "--batch-size", "8", "--layers",
                         str(layers), "--target-arg", f"width={width}", "--policies", "none", "--no-progress",
                         "--json", str(path)]) == 0
    out[layers, width] = json.loads(path.read_text())["rows"][0]
  small, big = out[2, 32], out[3, 64]
  assert big["argument_bytes"] - small["argument_bytes"] >= 3 * 64 * 64 * 4 * 3 - 2 * 32 * 32 * 4 * 3  # w, mu, nu
  target = jaxckpt.step.load_target("tests.report.test_report:sized_target", {"batch_size": 8, "num_layers": 3})
  assert target.ref == {"target": "tests.report.test_report:sized_target", "kwargs": {"batch_size": 8, "num_layers": 3}}
  assert jaxckpt.step.rebuild_target(target.ref).batch["x"].shape == (8, 32)  # --measure rebuilds it with them


def model_target():
  """A ModelTarget: the user's own NNX model built from jaxckpt blocks, scanned."""

  class Net(nnx.Module):
    def __init__(self, *, rngs):
      self.layers = jaxckpt.nnx.Stack(lambda r: jaxckpt.nnx.MLPBlock(32, 64, rngs=r), 3, scan=True, rngs=rngs)
      self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x, *, dropout_key=None, deterministic=True):
      return self.head(self.layers(x, dropout_key=dropout_key, deterministic=deterministic))

  batch = {"x": jax.ShapeDtypeStruct((16, 32), jnp.float32), "y": jax.ShapeDtypeStruct((16,), jnp.int32)}
  return ModelTarget(lambda: Net(rngs=nnx.Rngs(0)), batch, name="net")


def test_loss_target_all_policies():
  report = build_report(loss_target(), ["all"], progress=False)
  rows = {r["policy"]: r for r in report.rows}
  assert set(rows) == {"none", "nothing_saveable", "everything_saveable", "dots_saveable",
                       "dots_with_no_batch_dims_saveable", "save_only_these_names:hidden"}
  assert all(r["status"] == "ok" for r in rows.values())
  assert rows["nothing_saveable"]["temp_bytes"] < rows["none"]["temp_bytes"]
  assert rows["nothing_saveable"]["flops"] > rows["none"]["flops"]
  named = [g for g in rows["save_only_these_names:hidden"]["residuals"]["groups"] if g["key"] == "hidden"]
  assert named[0]["count"] == 3 and named[0]["bytes"] == 3 * 256 * 128 * 4
  assert report.data["structure"] == "unrolled" and report.data["preset"] is None
  check_report_schema(report.data)


def test_model_target_residual_names_under_scan():
  report = build_report(model_target(), ["none", "save_only_these_names:mlp_hidden"], progress=False)
  assert report.data["structure"] == "scan"
  groups = report.row("save_only_these_names:mlp_hidden")["residuals"]["groups"]
  hidden = next(g for g in groups if g["key"] == "mlp_hidden")
  assert hidden["count"] == 3 and hidden["bytes"] == 3 * 16 * 64 * 4


# --- CLI ------------------------------------------------------------------------------------------------------------


def _exit_status(argv):
  """``main(argv)``'s status, also when argparse exits (SystemExit)."""
  try:
    return main(argv)
  except SystemExit as exit_info:
    return exit_info.code


@pytest.mark.parametrize("argv, expected", [
    (["--model", "gpt2"], "unknown model 'gpt2'; valid models: vit, mlp, cnn"),
    (["--model", "vit", "--preset", "huge"], "unknown preset 'huge' for model vit; valid presets: tiny, small"),
    (["--policies", "none", "dots_savable"], "unknown policy 'dots_savable'"),
    (["--seq-len", "128"], "--seq-len applies to sequence models only"),
    (["--target", "no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
    (["--target", LOSS_TARGET, "--batch-size", "4"], "takes no keyword argument --batch-size 4"),
    (["--target", LOSS_TARGET, "--target-arg", "scan=true"], "takes no keyword argument 'scan=True'; its keyword"),
    (["--target", "os:getcwd"], "it must return a jaxckpt.step.ModelTarget or jaxckpt.step.LossTarget"),
    (["--target", LOSS_TARGET, "--grad-accum-steps", "2"], "a LossTarget's step has no gradient accumulation"),
    (["--target", LOSS_TARGET, "--structure", "nested"], "--structure apply to --model only"),
    (["--target", LOSS_TARGET, "--target-arg", "depth"], "bad --target-arg 'depth': write KEY=VALUE"),
    (["--model", "mlp", "--target-arg", "depth=3"], "--target-arg applies to --target only"),
    (["--steps", "0"], "--steps must be ≥ 1"),
    (["--compute-dtype", "float16"], "invalid choice: 'float16'"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, expected, capsys):
  assert _exit_status(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err


def test_cli_bad_policy_names_closest_match(capsys):
  assert _exit_status(["--policies", "dots_savable"]) == 2
  assert "did you mean 'dots_saveable'?" in capsys.readouterr().err


def test_cli_end_to_end_writes_every_output(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "100")  # the table fits the terminal; CI's may be narrower
  out = {ext: str(tmp_path / f"report.{ext}") for ext in ("json", "csv", "md", "html", "png")}
  status = main(["--model", "mlp", "--preset", "tiny", "--batch-size", "8", "--policies", "none", "full",
                 "--no-progress", "--json", out["json"], "--csv", out["csv"], "--markdown", out["md"],
                 "--html", out["html"], "--plot", out["png"]])
  assert status == 0
  table = capsys.readouterr().out
  assert "nothing_saveable" in table and "×none" in table
  data = json.loads(open(out["json"]).read())
  check_report_schema(data)
  assert [r["policy"] for r in data["rows"]] == ["none", "nothing_saveable"]
  assert len(open(out["csv"]).read().strip().splitlines()) == 3
  assert open(out["md"]).read().count("\n| ") >= 3
  page = open(out["html"]).read()
  assert "Plotly.newPlot" in page and '<table class="sortable">' in page
  assert open(out["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_exit_1_when_no_policy_succeeds(tmp_path, capsys):
  """Every row an error (no policy applied: the model has no remat'd blocks): exit 1, the JSON written. A block type or checkpoint name
  the model does not have is a typo instead: exit 2 before anything is compiled."""
  path = tmp_path / "r.json"
  assert main(["--target", "tests.report.test_report:unapplied_target", "--policies", "full", "dots_saveable",
               "--no-progress", "--json", str(path)]) == 1
  data = json.loads(path.read_text())
  assert [r["status"] for r in data["rows"]] == ["error", "error"] and data["warnings"]
  assert main(["--model", "mlp", "--batch-size", "4", "--policies", "attn=full", "--no-progress"]) == 2
  assert "unknown block type 'attn'" in capsys.readouterr().err


def test_cli_user_target(tmp_path):
  path = tmp_path / "r.json"
  assert main(["--target", LOSS_TARGET, "--policies", "none", "full", "--no-progress",
               "--json", str(path)]) == 0
  data = json.loads(path.read_text())
  assert data["model"] == "tanh-mlp" and [r["status"] for r in data["rows"]] == ["ok", "ok"]


# --- measured ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_measured_peak_matches_compiled_footprint():
  # MLP small at batch 4096: none's compiled footprint is ~323 MiB, the remat'd ones 94–135 MiB (XLA:CPU).
  report = build_report(shipped_target("mlp", "small", batch_size=4096),
                        ["none", "nothing_saveable", "dots_saveable"], measure=True, steps=2, warmup=1,
                        progress=False, residuals=False)
  rows = report.rows
  assert all(r["status"] == "ok" for r in rows)
  assert all(r["step_time_s"] > 0 for r in rows)
  big = [r for r in rows if r["footprint_bytes"] >= 300 * 2**20]
  small = [r for r in rows if r["footprint_bytes"] < 300 * 2**20]
  assert [r["policy"] for r in big] == ["none"]
  for r in big:
    assert abs(r["peak_bytes_measured"] - r["footprint_bytes"]) <= 0.2 * r["footprint_bytes"], r
  by_compiled = sorted(small, key=lambda r: r["footprint_bytes"])
  by_measured = sorted(small, key=lambda r: r["peak_bytes_measured"])
  assert [r["policy"] for r in by_compiled] == [r["policy"] for r in by_measured]
  assert max(r["peak_bytes_measured"] for r in small) < big[0]["peak_bytes_measured"]
  check_report_schema(report.data)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_policy_killed_while_measuring_is_an_error_row(tmp_path, monkeypatch):
  """A measuring child killed by SIGKILL, as the kernel's OOM killer does, is an error row with the reason; the other
  policy is measured and every file is still written."""
  import subprocess

  from jaxckpt.report import _measure as measure

  real_run = subprocess.run

  def oom_killed_for_none(cmd, *args, input=None, **kwargs):  # noqa: A002 - subprocess.run's own keyword
    if input is not None and json.loads(input)["policy"] == "none":
      cmd = ["bash", "-c", "kill -9 $$"]
    return real_run(cmd, *args, input=input, **kwargs)

  monkeypatch.setattr(measure.subprocess, "run", oom_killed_for_none)
  report = build_report(shipped_target("mlp", "tiny", batch_size=BATCH), ["none", "full"], measure=True, steps=1,
                        warmup=1, progress=False, residuals=False)
  none, full = report.row("none"), report.row("nothing_saveable")
  assert none["status"] == "error" and "killed by signal 9 (out of memory?)" in none["error"], none["error"]
  assert full["status"] == "ok" and full["peak_bytes_measured"] > 0
  paths = write_outputs(report, json_path=str(tmp_path / "r.json"), html_path=str(tmp_path / "r.html"),
                        csv_path=str(tmp_path / "r.csv"), markdown_path=str(tmp_path / "r.md"),
                        plot_path=str(tmp_path / "r.png"))
  assert len(paths) == 5 and all(os.path.getsize(p) > 0 for p in paths)
  assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["status"] == "error"


@pytest.mark.slow  # compiles every structure and accumulation target (~15 s)
def test_structure_and_grad_accumulation_targets():
  """"B=64 with remat" vs "4×16 accumulated": both lower temp than B=64 without remat; structure is reported."""
  plain = build_report(shipped_target("vit", "small", batch_size=64), ["none", "full"], progress=False,
                       residuals=False)
  accumulated = build_report(shipped_target("vit", "small", batch_size=64, grad_accum_steps=4), ["none"],
                             progress=False, residuals=False)
  nested = build_report(shipped_target("mlp", "small", batch_size=64, structure="nested"), ["full"],
                        progress=False, residuals=False)
  temp = lambda r, p: r.row(p)["temp_bytes"]  # noqa: E731
  assert temp(accumulated, "none") < temp(plain, "none") and temp(plain, "nothing_saveable") < temp(plain, "none")
  assert accumulated.data["grad_accum_steps"] == 4 and plain.data["grad_accum_steps"] == 1
  assert nested.data["structure"] == "scan, nested:2" and nested.row("nothing_saveable")["status"] == "ok"
  with pytest.raises(jaxckpt.errors.JaxckptError, match="must be ≥ 1 and divide the batch size 64"):
    shipped_target("mlp", "small", batch_size=64, grad_accum_steps=3)


def test_cli_unwritable_output_is_refused_before_compiling(tmp_path, capsys):
  assert main(["--model", "mlp", "--policies", "none", "--json", str(tmp_path)]) == 2
  assert "is a directory" in capsys.readouterr().err


def test_a_target_function_that_takes_arguments_is_one_line(capsys):
  """``--target json:dumps`` (a function that needs an argument) was a TypeError traceback."""
  from jaxckpt.cli._report import main  # noqa: PLC0415

  assert main(["--target", "json:dumps", "--policies", "none", "--no-progress"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "bad --target 'json:dumps': dumps(" in err and "needs obj without a default" in err


def test_plot_error_names_the_plot_flag(capsys):
  from jaxckpt.cli._report import main  # noqa: PLC0415

  assert main(["--model", "mlp", "--preset", "tiny", "--policies", "none", "--plot", "x.txt", "--no-progress"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--plot x.txt: unknown image format ('.txt')" in err, err



def test_flops_units_reach_exa():
  """A 8B model's step on 256 chips is ~6.6e17 FLOPs: shown as PFLOP, not as thousands of TFLOP."""
  from jaxckpt.report._formats import format_flops
  assert [format_flops(n) for n in (None, 12, 1.21e9, 6.64e17, 2.5e18)] == [
      "n/a", "12 FLOP", "1.21 GFLOP", "664.00 PFLOP", "2.50 EFLOP"]
