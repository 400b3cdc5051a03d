"""A policy with no compiled effect is never an ordinary ``ok`` row (jaxckpt.planner._effect); the planner skips it."""

import csv
import io
import json

import jax
import jax.numpy as jnp
import pytest

from jaxckpt.planner._plan import CompiledPoint, _no_effect
from jaxckpt import PolicySpec
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.report._build import Report
from jaxckpt.planner._effect import RESIDUAL_RATIO, TEMP_RATIO, annotate_rows, row_warning
from jaxckpt.report._html import to_html
from jaxckpt.report._keys import REPORT_KEYS, empty_row
from jaxckpt.report._outputs import to_csv, to_json, to_markdown, to_table
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.training._xla import CPU_REMAT_FIX

# Run again under JAX's next remat (.ci/run's remat3 leg): whether a policy has a compiled effect.
pytestmark = pytest.mark.remat3

L, D, H, B = 4, 64, 256, 256  # layers, width, hidden width, batch: an unrolled residual MLP (XLA:CPU undoes its remat
# without the cse_barrier_expander option: jaxckpt.training._xla), small


def _loss(policy):
  def block(p, x):
    w1, w2 = p
    return x + jnp.sin(jnp.tanh(x @ w1)) * 2 @ w2

  step = block if policy is None else jax.checkpoint(block, policy=policy)

  def loss(ps, x):
    for i in range(L):  # unrolled: XLA:CPU undoes remat here without the option
      x = step((ps[0][i], ps[1][i]), x)
    return jnp.sum(x ** 2)

  return loss


ARGS = ((jax.ShapeDtypeStruct((L, D, H), jnp.float32), jax.ShapeDtypeStruct((L, H, D), jnp.float32)),
        jax.ShapeDtypeStruct((B, D), jnp.float32))


def _row(policy_text, policy, options):
  loss = _loss(policy)
  compiled = jax.jit(jax.grad(loss)).lower(*ARGS).compile(compiler_options=options)
  row = empty_row(policy_text)
  row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
  row["residual_bytes"] = sum(r.bytes for r in saved_residuals(loss, *ARGS) if r.kind != "argument")
  return row


@pytest.fixture(scope="module")
def rows():
  if jax.default_backend() != "cpu":
    pytest.skip("the no-effect case is XLA:CPU's")
  full = jax.checkpoint_policies.nothing_saveable
  return {"none": _row("none", None, {}), "plain": _row("nothing_saveable", full, {}),
          "fixed": _row("nothing_saveable", full, CPU_REMAT_FIX)}


def test_unrolled_remat_without_the_cpu_option_is_flagged(rows):
  none, plain, fixed = rows["none"], rows["plain"], rows["fixed"]
  assert plain["residual_bytes"] <= RESIDUAL_RATIO * none["residual_bytes"]  # the analysis: it saves a lot
  assert plain["temp_bytes"] >= TEMP_RATIO * none["temp_bytes"]  # XLA:CPU: it does not
  warning = row_warning(plain, none, backend="cpu", compiler_options={})
  assert warning.startswith("no compiled effect") and "cse_barrier_expander" in warning
  if remat_implementation() == "remat2":  # remat3 keeps no barrier XLA:CPU honours (README, "remat3")
    assert fixed["temp_bytes"] < TEMP_RATIO * none["temp_bytes"]
    assert row_warning(fixed, none, backend="cpu", compiler_options=CPU_REMAT_FIX) is None


def test_the_warning_is_in_every_output(rows):
  table = [dict(rows["none"]), dict(rows["plain"])]
  warnings = annotate_rows(table, backend="cpu", compiler_options={})
  assert table[0]["warning"] is None and table[1]["warning"].startswith("no compiled effect")
  data = dict.fromkeys(REPORT_KEYS)
  data.update(schema_version=1, model="unrolled-mlp", backend="cpu", device_count=1, structure="unrolled",
              grad_accum_steps=1, versions={}, compiler_options={}, warnings=warnings, rows=table)
  report = Report(data)
  table = to_table(report, width=100)  # the row is marked, the warning is under the table
  assert "(warning below)" in table and "no compiled effect" in table
  assert "ok, warning: no compiled effect" in to_markdown(report)
  assert json.loads(to_json(report))["rows"][1]["warning"].startswith("no compiled effect")
  assert next(csv.DictReader(io.StringIO(to_csv(report))), None) is not None
  assert list(csv.DictReader(io.StringIO(to_csv(report))))[1]["warning"].startswith("no compiled effect")
  assert "no compiled effect" in to_html(report, plot=False)


def test_same_program_as_none_and_offload_without_host_bytes():
  none = empty_row("none")
  twin = empty_row("save_only_these_names:x")
  twin["same_program_as"] = "none"
  assert "same program as none" in row_warning(twin, none, backend="cpu")
  offload = empty_row("offload_dot_with_no_batch_dims")
  offload.update(host_temp_bytes=0, host_output_bytes=0, host_argument_bytes=0)
  assert "host bytes are 0" in row_warning(offload, none, backend="gpu", offloads=True)
  assert row_warning(offload, none, backend="cpu", offloads=True) is None  # CPU: the report says so elsewhere
  assert row_warning(empty_row("everything_saveable") | {"same_program_as": "none"}, none, backend="cpu") is None


def test_planner_skips_a_candidate_with_no_compiled_effect():
  memory = lambda temp: {"temp_bytes": temp, "footprint_bytes": temp}  # noqa: E731
  none = CompiledPoint(PolicySpec(), 1000, memory(1000), 10, 0.0)
  undone = CompiledPoint(PolicySpec(), 300, memory(950), 12, 0.0)  # saves 30% by analysis, 95% temp compiled
  honest = CompiledPoint(PolicySpec(), 300, memory(500), 12, 0.0)
  assert _no_effect(undone, none) and not _no_effect(honest, none)
