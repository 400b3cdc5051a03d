"""A Mixture of Experts of your own (:mod:`own_moe`, written as public Flax code writes one: no checkpoint names, a
dropless dispatch by ``jax.lax.ragged_dot``) through the tools: its FLOPs are the arithmetic's, its gradients equal
across policies, ``dots_saveable`` shows the expert matmuls it recomputes, its expert matmuls get automatic names,
and a broken model is one line (a router returning NaN under ``--measure``, a model raising under
``--list-blocks``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxckpt
from tests.models import own_moe
from jaxckpt.cli._report import main as report_main
from jaxckpt.report import build_report
from jaxckpt.step import lower_policy, target_block_types
from tests.numerics import assert_trees_close

WIDE = dict(dim=256, hidden=512, seq=64)
"""Wide enough that the matmuls are nearly all of the step's FLOPs (elementwise ops and the optimizer ~2%)."""


@pytest.mark.parametrize("dispatch", ["dropless", "dense"])
def test_flops_are_the_arithmetics(dispatch):
  target = own_moe.target(dispatch=dispatch, **WIDE)
  count = lower_policy(target, jaxckpt.parse_policy("none"), tx=optax.adamw(1e-3)).flop_count
  matmuls = count.by_primitive.get("dot_general", 0) + count.by_primitive.get("ragged_dot_general", 0)
  want = own_moe.matmul_flops(dispatch=dispatch, **WIDE)
  assert matmuls == pytest.approx(want, rel=0.01)  # the expert matmuls counted: ragged_dot was 0 FLOPs before
  assert count.total == pytest.approx(want, rel=0.03)
  if dispatch == "dropless":  # the experts' forward, input- and weight-gradient matmuls: 3 × 3 per layer
    experts = own_moe.BATCH * WIDE["seq"] * own_moe.TOP_K * 3 * 2 * WIDE["dim"] * WIDE["hidden"] * own_moe.LAYERS
    assert count.by_primitive["ragged_dot_general"] == 3 * experts
    assert count.uncounted_primitives == ()  # top_k has its rule too


def test_gradients_equal_across_policies():
  target = own_moe.target()
  batch = jax.random.randint(jax.random.key(1), (own_moe.BATCH, own_moe.SEQ + 1), 0, own_moe.VOCAB)

  def grads(policy: str):
    model = target.make_model()
    jaxckpt.nnx.checkpoint_names(model, batch[:, :-1])  # the parts (moe.0 …) are found by a trace
    jaxckpt.set_policy(model, policy)
    return nnx.grad(lambda m: target.loss_fn(m, batch, dropout_key=None, deterministic=True)[0])(model)

  want = grads("none")
  for policy in ("full", "dots_saveable", "save_only_these_names:moe.0+moe.2", "save_only_these_names:moe"):
    assert_trees_close(grads(policy), want, depth=own_moe.LAYERS, what=f"gradients, {policy} vs none")


def test_untagged_expert_matmuls_get_automatic_names():
  assert target_block_types(own_moe.target()) == {"layer": frozenset({
      "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "moe", "moe.router",
      "moe.0", "moe.1", "moe.2"})}  # the gate, up and down ragged_dots of the experts, in call order


def test_dots_saveables_recompute_of_the_expert_matmuls_is_shown():
  report = build_report(own_moe.target(**WIDE), ["none", "dots_saveable", "full"], residuals=False, progress=False)
  flops = {r["policy"]: r["flops"] for r in report.rows}
  assert all(r["status"] == "ok" for r in report.rows)
  experts = own_moe.BATCH * WIDE["seq"] * own_moe.TOP_K * 3 * 2 * WIDE["dim"] * WIDE["hidden"] * own_moe.LAYERS
  # dots_saveable saves the dot_general outputs (attention, router, head) and recomputes the three ragged_dots
  assert flops["dots_saveable"] - flops["none"] >= experts
  assert flops["none"] < flops["dots_saveable"] < flops["nothing_saveable"]
  warned = [w for w in report.data["warnings"] if w.startswith("policy 'dots_saveable'")]
  assert len(warned) == 1 and "ragged_dot_general" in warned[0] and "recomputes them" in warned[0]


def test_a_nan_router_is_an_error_row_under_measure():
  target = own_moe.target(router_nan=True)
  report = build_report(target, ["none"], measure=True, steps=1, warmup=1, residuals=False, progress=False)
  row = report.rows[0]
  assert row["status"] == "error" and "loss is nan" in row["error"] and "\n" not in row["error"]


def test_list_blocks_of_a_target_that_raises_is_one_line(capsys):
  assert report_main(["--target", "tests.models.test_own_moe:raising_target", "--list-blocks"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert "ValueError: router width 7 is not 8" in err[0] and "test_own_moe.py" in err[0]


class _Raising(own_moe.Mixtral):
  def __call__(self, tokens):
    raise ValueError("router width 7 is not 8")


def raising_target():
  """``--target tests.models.test_own_moe:raising_target``: a model that raises while traced."""
  return jaxckpt.nnx_model_target(lambda: _Raising(rngs=nnx.Rngs(0)),
                                  jax.ShapeDtypeStruct((own_moe.BATCH, own_moe.SEQ + 1), jnp.int32),
                                  loss="next_token", blocks={"layer": own_moe.DecoderLayer})
