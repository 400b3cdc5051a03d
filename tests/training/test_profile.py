"""XProf traces: jaxckpt.training._profile (slugs, errors, trace files) and ``jaxckpt-report --profile`` (one run per policy)."""

import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from jaxckpt.errors import JaxckptError
from jaxckpt.training._profile import check_profile_dir, profile_slug, profile_trace, trace_files
from jaxckpt.cli._report import main


def _step_events(path: str, name: str = "train_step") -> int:
  """How many events called ``name`` the trace file at ``path`` holds (it must load as an XSpace)."""
  data = jax.profiler.ProfileData.from_file(path)
  return sum(1 for plane in data.planes for line in plane.lines for event in line.events if event.name == name)


@pytest.mark.parametrize("name, slug", [
    ("none", "none"),
    ("attn=dots_saveable,mlp=full", "attn-dots_saveable_mlp-full"),
    ("save_only_these_names:qkv+mlp_hidden", "save_only_these_names-qkv+mlp_hidden"),
    ("budget:40%", "budget-40"),
    ("layers 0-3: full", "layers_0-3-_full"),
])
def test_profile_slug(name, slug):
  assert profile_slug(name) == slug
  assert profile_slug(slug) == slug  # idempotent


@pytest.mark.parametrize("name", ["", "%%", "/"])
def test_profile_slug_refuses_names_without_usable_characters(name):
  with pytest.raises(JaxckptError, match="no character usable in a directory name"):
    profile_slug(name)


def test_profile_trace_writes_a_loadable_trace_with_its_steps(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()  # warm: the trace shows the steps, not compilation
  with profile_trace(tmp_path, name="attn=full") as run_dir:
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
        f(x).block_until_ready()
  assert run_dir == os.path.join(str(tmp_path), "attn-full")
  files = trace_files(run_dir)
  assert len(files) == 1 and files[0].endswith(".xplane.pb")
  assert _step_events(files[0]) == 3
  with profile_trace(tmp_path, name="attn=full"):  # a second session adds a file, the first one stays
    f(x).block_until_ready()
  assert len(trace_files(run_dir)) == 2 and files[0] in trace_files(run_dir)


def test_profile_trace_unwritable_logdir_names_the_path(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(JaxckptError, match=f"cannot create the profile directory {blocker}/none"):
    with profile_trace(blocker, name="none"):
      pass
  with pytest.raises(JaxckptError, match="exists and is not a directory"):
    check_profile_dir(blocker)
  with pytest.raises(JaxckptError, match=f"{blocker}/sub: cannot write into it"):
    check_profile_dir(blocker / "sub")
  assert trace_files(tmp_path / "nothing_here") == []


@pytest.mark.slow  # runs and traces every policy (~10 s)
def test_report_profile_writes_one_loadable_trace_per_policy(tmp_path, capsys):
  """--profile: per policy one run DIR/<slug>/ with one XProf trace holding exactly the traced warm steps."""
  logdir, out = tmp_path / "profiles", tmp_path / "r.json"
  assert main(["--model", "mlp", "--preset", "tiny", "--batch-size", "8", "--policies", "none", "full",
               "--no-residuals", "--no-progress", "--warmup", "1", "--profile", str(logdir), "--profile-steps", "2",
               "--json", str(out)]) == 0
  assert f"wrote 2 XProf run(s) under {logdir}: xprof --logdir {logdir}" in capsys.readouterr().out
  rows = json.loads(out.read_text())["rows"]
  assert [r["status"] for r in rows] == ["ok"] * 2
  assert sorted(os.listdir(logdir)) == ["none", "nothing_saveable"]
  for row in rows:
    assert row["profile"]["dir"] == str(logdir / profile_slug(row["policy"]))
    assert row["profile"]["files"] == trace_files(row["profile"]["dir"]) and len(row["profile"]["files"]) == 1
    assert _step_events(row["profile"]["files"][0]) == 2
    assert row["step_time_s"] is None and row["peak_bytes_measured"] is None  # profiled, not measured


def _exit_status(argv):
  try:
    return main(argv)
  except SystemExit as exit_info:
    return exit_info.code


@pytest.mark.parametrize("argv, expected", [
    (["--profile", "{file}"], "--profile {file} exists and is not a directory"),
    (["--profile", "{file}/sub"], "--profile {file}/sub: cannot write into it (not a directory)"),
    (["--profile", "{dir}", "--profile-steps", "0"], "--profile-steps must be ≥ 1, got 0"),
    (["--profile", "{dir}", "--mesh", "data=1"], "--profile runs each policy on one device"),
])
def test_cli_profile_bad_arguments_exit_2_before_compiling(tmp_path, capsys, argv, expected):
  blocker = tmp_path / "f"
  blocker.write_text("")
  fill = lambda s: s.format(file=blocker, dir=tmp_path / "p")  # noqa: E731
  assert _exit_status(["--model", "mlp", "--policies", "none", *map(fill, argv)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and fill(expected) in err, err
  assert not (tmp_path / "p").exists()


def _gpt_tiny_grad():
  """GPT tiny (NNX, scanned stack, policy full): its jitted gradient, state and tokens ``[2, 64]`` int32."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jaxckpt.models._gpt import GPT_PRESETS, build_gpt  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(build_gpt(GPT_PRESETS["tiny"], policy="full"))
  tokens = (jnp.arange(2 * 64, dtype=jnp.int32) % 256).reshape(2, 64)
  grad = jax.jit(lambda s, t: jax.grad(lambda s: nnx.merge(graphdef, s)(t).astype(jnp.float32).mean())(s))
  return grad, state, tokens


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_blocks_are_named_in_the_hlo_and_the_profile_of_gpt_tiny(tmp_path, monkeypatch):
  """``jax.named_scope`` per layer and block: the compiled HLO's op names and the XProf trace file of GPT tiny hold
  ``layer_0..1`` (the scanned stack) and the block types ``attn``/``mlp``; the names are metadata only (gradients
  and temp bytes equal with the scopes switched off)."""
  grad, state, tokens = _gpt_tiny_grad()
  compiled = grad.lower(state, tokens).compile()
  hlo = compiled.as_text()
  for block_type in ("attn", "mlp"):  # e.g. op_name="jit(<lambda>)/jvp(layer_0..1)/while/body/closed_call/attn/exp"
    assert re.search(rf'op_name="[^"]*layer_0\.\.1[^"]*/{block_type}/', hlo), block_type
  g = grad(state, tokens)
  with profile_trace(tmp_path, name="full") as run_dir:
    jax.block_until_ready(grad(state, tokens))
  trace = open(trace_files(run_dir)[0], "rb").read()  # the trace carries the HLO with its op metadata
  assert b"layer_0..1" in trace and b"/attn/" in trace and b"/mlp/" in trace
  import contextlib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "named_scope", lambda name: contextlib.nullcontext())
  jax.clear_caches()  # traced block jaxprs are cached with their names
  plain_grad, _, _ = _gpt_tiny_grad()
  lowered = plain_grad.lower(state, tokens)
  assert "layer_0..1" not in lowered.as_text(debug_info=True) and "/attn/" not in lowered.as_text(debug_info=True)
  plain = lowered.compile()
  assert plain.memory_analysis().temp_size_in_bytes == compiled.memory_analysis().temp_size_in_bytes
  # exact: names are metadata; the same HLO compiled again runs the same arithmetic
  jax.tree.map(lambda a, b: None if jnp.array_equal(a, b) else pytest.fail("gradient changed"), g,
               plain_grad(state, tokens))


def test_unrolled_stacks_name_each_layer_nnx_and_linen():
  """Unrolled (``scan=False``): ``layer_{i}`` around layer i, the block type inside, on both front-ends."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jaxckpt.linen import _layers as linen_layers  # pylint: disable=g-import-not-at-top
  from jaxckpt.nnx._layers import MLPBlock, Stack  # pylint: disable=g-import-not-at-top
  x = jnp.ones((2, 4, 8))
  nnx_stack = Stack(lambda rngs: MLPBlock(8, 16, rngs=rngs), num_layers=3, scan=False, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(nnx_stack)
  nnx_hlo = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(x).sum())).lower(state).as_text(debug_info=True)
  stack = linen_layers.Stack(block=linen_layers.MLPBlock(dim=8, hidden_dim=16), num_layers=3, scan=False)
  params = stack.init(jax.random.key(0), x)
  linen_hlo = jax.jit(jax.grad(lambda p: stack.apply(p, x).sum())).lower(params).as_text(debug_info=True)
  for hlo in (nnx_hlo, linen_hlo):
    assert all(re.search(rf"layer_{i}\b", hlo) for i in range(3)) and not re.search(r"layer_3\b", hlo)
    assert re.search(r'"[^"]*layer_2\)?/[^"]*mlp/[^"]*"', hlo)
