"""Tests for jaxckpt.analysis._residuals: what each remat policy saves, parsed from JAX's saved_residuals."""

from __future__ import annotations

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.analysis import _residuals as residuals_lib
from jaxckpt.analysis._residuals import (
    GROUP_BY,
    KINDS,
    Residual,
    ResidualGroup,
    group_residuals,
    parse_residual,
    saved_residuals,
    scale_residuals,
    total_residual_bytes,
)
from tests.numerics import assert_trees_close

# Run again under JAX's next remat (.ci/run's remat3 leg): what each policy saves.
pytestmark = pytest.mark.remat3

SDS = jax.ShapeDtypeStruct
F32 = jnp.float32
B, D, H, L = 4, 8, 16, 3
F32_BYTES = 4


def block(x, wqkv, w1, w2):
  """A tiny attention-free transformer-ish block. x: [B, D], wqkv: [D, 3D], w1: [D, H], w2: [H, D], all float32."""
  qkv = checkpoint_name(x @ wqkv, "qkv")  # [B, 3D]
  q, k, v = jnp.split(qkv, 3, axis=-1)
  x = x + jnp.tanh(q * k) * v
  h = checkpoint_name(x @ w1, "mlp_hidden")  # [B, H]
  return x + jnp.tanh(h) @ w2


ARGS = (SDS((B, D), F32), SDS((D, 3 * D), F32), SDS((D, H), F32), SDS((H, D), F32))
ARG_BYTES = F32_BYTES * (B * D + D * 3 * D + D * H + H * D)


def remat(policy):
  return jax.checkpoint(block, policy=policy)


def non_arguments(residuals):
  return [r for r in residuals if r.kind != "argument"]


def test_save_only_these_names_keeps_exactly_that_name():
  res = saved_residuals(remat(jax.checkpoint_policies.save_only_these_names("mlp_hidden")), *ARGS)
  assert sorted(r.argument for r in res if r.kind == "argument") == ["w1", "w2", "wqkv", "x"]
  (hidden,) = non_arguments(res)
  assert hidden.kind == "checkpoint_name"
  assert hidden.name == "mlp_hidden"
  assert hidden.primitive == "name"
  assert hidden.shape == (B, H)
  assert hidden.dtype == "float32"
  assert hidden.bytes == B * H * F32_BYTES
  assert hidden.source is not None and "test_residuals.py" in hidden.source and "(block)" in hidden.source
  assert total_residual_bytes(res) == ARG_BYTES + B * H * F32_BYTES
  assert total_residual_bytes(res, include_arguments=False) == B * H * F32_BYTES


def test_save_both_names():
  res = saved_residuals(remat(jax.checkpoint_policies.save_only_these_names("qkv", "mlp_hidden")), *ARGS)
  named = {r.name: r for r in non_arguments(res)}
  assert set(named) == {"qkv", "mlp_hidden"}
  assert named["qkv"].shape == (B, 3 * D)
  assert all(r.kind == "checkpoint_name" for r in named.values())


def test_nothing_saveable_keeps_only_arguments():
  res = saved_residuals(remat(jax.checkpoint_policies.nothing_saveable), *ARGS)
  assert {r.kind for r in res} == {"argument"}
  assert total_residual_bytes(res) == ARG_BYTES
  assert total_residual_bytes(res, include_arguments=False) == 0


def test_dots_saveable_keeps_dot_outputs_as_primitives():
  res = saved_residuals(remat(jax.checkpoint_policies.dots_saveable), *ARGS)
  saved = non_arguments(res)
  assert saved, "dots_saveable should save the matmul outputs"
  assert {r.kind for r in saved} == {"primitive"}
  assert {r.primitive for r in saved} == {"dot_general"}
  assert all(r.name is None for r in saved)
  # x @ wqkv [B, 3D] and x @ w1 [B, H]; the last matmul's output is not needed by the backward.
  assert sorted(r.shape for r in saved) == sorted([(B, 3 * D), (B, H)])


def test_no_remat_saves_more_than_any_policy():
  plain = saved_residuals(block, *ARGS)
  names = saved_residuals(remat(jax.checkpoint_policies.save_only_these_names("mlp_hidden")), *ARGS)
  nothing = saved_residuals(remat(jax.checkpoint_policies.nothing_saveable), *ARGS)
  assert total_residual_bytes(plain) > total_residual_bytes(names) > total_residual_bytes(nothing)
  assert {g.key for g in group_residuals(plain, by="kind")} >= {"argument", "primitive"}


def test_group_by_name_sums_bytes_and_sorts():
  res = saved_residuals(remat(jax.checkpoint_policies.save_only_these_names("qkv", "mlp_hidden")), *ARGS)
  groups = group_residuals(res, by="name")
  by_key = {g.key: g for g in groups}
  assert by_key["qkv"].bytes == B * 3 * D * F32_BYTES
  assert by_key["mlp_hidden"].bytes == B * H * F32_BYTES
  assert by_key[None].bytes == ARG_BYTES  # arguments are unnamed
  assert by_key[None].count == 4
  assert [g.bytes for g in groups] == sorted((g.bytes for g in groups), reverse=True)
  assert sum(g.bytes for g in groups) == total_residual_bytes(res)
  assert sum(g.count for g in groups) == len(res)
  assert all(isinstance(g, ResidualGroup) for g in groups)


@pytest.mark.parametrize("by", GROUP_BY)
def test_every_grouping_partitions_the_residuals(by):
  res = saved_residuals(remat(jax.checkpoint_policies.dots_saveable), *ARGS)
  groups = group_residuals(res, by=by)
  assert sum(g.bytes for g in groups) == total_residual_bytes(res)
  assert sorted(id(r) for g in groups for r in g.residuals) == sorted(id(r) for r in res)
  assert len({g.key for g in groups}) == len(groups)


def test_group_by_unknown_field_raises_with_valid_choices():
  with pytest.raises(ValueError, match=r"'nme'.*name, primitive, source, site, kind.*did you mean 'name'"):
    group_residuals([], by="nme")
  with pytest.raises(ValueError, match=r"'bytes'"):
    group_residuals([], by="bytes")


def scanned_stack(policy):
  def stack(x, ws):  # x: [B, D]; ws: ([L, D, 3D], [L, D, H], [L, H, D])
    step = jax.checkpoint(block, policy=policy)
    return lax.scan(lambda h, w: (step(h, *w), None), x, ws)[0]
  return stack


STACKED_WS = (SDS((L, D, 3 * D), F32), SDS((L, D, H), F32), SDS((L, H, D), F32))


def test_scanned_stack_hides_names_behind_scan_outputs():
  policy = jax.checkpoint_policies.save_only_these_names("mlp_hidden")
  scanned = saved_residuals(scanned_stack(policy), ARGS[0], STACKED_WS)
  outputs = [r for r in scanned if r.kind == "scan_output"]
  assert outputs
  assert all(r.primitive == "scan" and r.name is None for r in outputs)
  assert all(r.shape[0] == L for r in outputs)  # leading layer axis
  assert not [r for r in scanned if r.kind == "checkpoint_name"]  # the limitation
  # The per-layer hidden [L, B, H] is among the scan outputs, just unnamed.
  assert (L, B, H) in [r.shape for r in outputs]

  # Analysing the body (one layer) recovers the names; scaling by L gives the stack's total bytes.
  body = saved_residuals(remat(policy), *ARGS)
  assert [r.name for r in body if r.kind == "checkpoint_name"] == ["mlp_hidden"]
  stacked = scale_residuals(body, L)
  assert total_residual_bytes(stacked) == total_residual_bytes(scanned)
  hidden = next(r for r in stacked if r.name == "mlp_hidden")
  assert hidden.shape == (L, B, H)
  assert hidden.bytes == L * B * H * F32_BYTES
  assert hidden.description.endswith(f"(x{L} layers)")
  assert {g.key: g.bytes for g in group_residuals(stacked, by="name")}["mlp_hidden"] == L * B * H * F32_BYTES


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "3"])
def test_scale_residuals_rejects_bad_factor(bad):
  with pytest.raises(ValueError, match=r"factor must be an int >= 1.*got " + repr(bad).replace(".", r"\.")):
    scale_residuals([], bad)


def test_arrays_kwargs_and_pytrees_work():
  x = jnp.ones((B, D))
  params = {"wqkv": jnp.ones((D, 3 * D)), "w1": jnp.ones((D, H)), "w2": jnp.ones((H, D))}
  fn = jax.checkpoint(lambda p, x: block(x, **p), policy=jax.checkpoint_policies.save_only_these_names("qkv"))
  res = saved_residuals(fn, params, x=x)
  assert sorted(r.argument for r in res if r.kind == "argument") == ["p['w1']", "p['w2']", "p['wqkv']", "x"]
  assert [r.name for r in res if r.kind == "checkpoint_name"] == ["qkv"]


def test_bfloat16_bytes():
  x = SDS((B, D), jnp.bfloat16)
  w = SDS((D, H), jnp.bfloat16)
  fn = jax.checkpoint(lambda x, w: jnp.sum(jnp.sin(checkpoint_name(x @ w, "h"))),
                      policy=jax.checkpoint_policies.save_only_these_names("h"))
  (h,) = [r for r in saved_residuals(fn, x, w) if r.kind == "checkpoint_name"]
  assert h.dtype == "bfloat16"
  assert h.bytes == B * H * 2


@pytest.mark.parametrize(
    "description, kind, name, primitive, source, argument",
    [
        ("from the argument x", "argument", None, None, None, "x"),
        ("from the argument ws[0]", "argument", None, None, None, "ws[0]"),
        ("from the argument at flattened index {i}", "argument", None, None, None, None),
        ("named 'qkv' from model.py:12:8 (attn)", "checkpoint_name", "qkv", "name", "model.py:12:8 (attn)", None),
        ("output of dot_general from f.py:3 (g)", "primitive", None, "dot_general", "f.py:3 (g)", None),
        ("output of scan-like from f.py:3 (g)", "primitive", None, "scan-like", "f.py:3 (g)", None),
        ("output of scan from f.py:30:4 (stack)", "scan_output", None, "scan", "f.py:30:4 (stack)", None),
        ("output of jitted function 'block' from ", "primitive", None, "jit", None, None),
        ("from a literal", "other", None, None, None, None),
        ("from a constant", "other", None, None, None, None),
        ("something JAX may print one day", "other", None, None, None, None),
    ],
)
def test_parse_residual_descriptions(description, kind, name, primitive, source, argument):
  r = parse_residual(SDS((2, 3), F32), description)
  assert (r.kind, r.name, r.primitive, r.source, r.argument) == (kind, name, primitive, source, argument)
  assert r.kind in KINDS
  assert (r.shape, r.dtype, r.bytes, r.description) == ((2, 3), "float32", 24, description)


def test_parse_residual_accepts_jax_avals():
  aval = jax.core.ShapedArray((5,), np.dtype("int8")) if hasattr(jax.core, "ShapedArray") else SDS((5,), jnp.int8)
  assert parse_residual(aval, "output of iota from f.py:1 (f)").bytes == 5


def test_saved_residuals_rejects_non_callable():
  with pytest.raises(TypeError, match="callable.*got int"):
    saved_residuals(3, ARGS[0])


def test_residual_is_frozen():
  r = Residual((1,), "float32", 4, None, "other", None, None, "from a literal")
  with pytest.raises(AttributeError):
    r.bytes = 8  # type: ignore[misc]


def test_docstring_examples_run():
  result = doctest.testmod(residuals_lib, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 2
  assert result.failed == 0


# ---------------------------------------------------------------------------------------------------------------
# Nested remat (checkpoint structures): what one group keeps while it is recomputed.


def _group_of_blocks(inner_policy):
  """``L`` blocks, each under ``jax.checkpoint(inner_policy)``, all under one ``jax.checkpoint(nothing_saveable)``."""
  inner = jax.checkpoint(block, policy=inner_policy)

  def group(x, wqkv, w1, w2):
    for _ in range(L):
      x = inner(x, wqkv, w1, w2)
    return x

  outer = jax.checkpoint(group, policy=jax.checkpoint_policies.nothing_saveable)
  return lambda *args: jnp.sum(outer(*args))


NAME_SIZES = {"qkv": B * 3 * D, "mlp_hidden": B * H}  # elements per block of each name in ``block``


@pytest.mark.parametrize("saved", [(), ("mlp_hidden",), ("qkv", "mlp_hidden")])
def test_recomputed_residuals_apply_the_inner_policies(saved):
  """The forward keeps only the group input whatever the block policy; the recomputed group keeps, per block, what
  the block policy names, plus the inputs of blocks 2..L (each block remat saves its input)."""
  from jaxckpt.analysis._jaxprs import outermost_remats

  fn = _group_of_blocks(jax.checkpoint_policies.save_only_these_names(*saved))
  assert non_arguments(saved_residuals(fn, *ARGS)) == []
  (eqn,) = outermost_remats(jax.make_jaxpr(fn)(*ARGS))
  kept = non_arguments(residuals_lib.recomputed_residuals(eqn))
  per_block = sum(NAME_SIZES[n] for n in saved)
  assert total_residual_bytes(kept) == F32_BYTES * (L * per_block + (L - 1) * B * D)
  named = {g.key: g.bytes for g in group_residuals(kept, by="name") if g.key is not None}
  assert named == {n: F32_BYTES * L * NAME_SIZES[n] for n in saved}


def test_recomputed_residuals_rejects_other_equations():
  eqn = jax.make_jaxpr(lambda x: jnp.sin(x))(jnp.ones(3)).jaxpr.eqns[0]
  with pytest.raises(ValueError, match="jax.checkpoint equation.*'sin'"):
    residuals_lib.recomputed_residuals(eqn)


def _report_residuals(structure, policy, scan=False):
  from jaxckpt import parse_policy
  from jaxckpt.report._residuals import analyse_residuals
  from jaxckpt.step import default_optimizer, policy_step
  from jaxckpt.step import shipped_target

  target = shipped_target("mlp", "tiny", structure=structure, scan=scan)
  return analyse_residuals(policy_step(target, parse_policy(policy), default_optimizer()))


MLP_TINY_BATCH, MLP_TINY_DIM, MLP_TINY_HIDDEN, MLP_TINY_LAYERS = 64, 64, 128, 2


@pytest.mark.parametrize("scan", [False, True])
def test_report_residuals_under_a_structure_show_each_level(scan):
  """Issue repro: ``mlp tiny --structure every:2`` showed identical residuals for nothing_saveable and dots_saveable
  (only the group inputs), while their compiled temp differs. Level 1 now shows what one group keeps while it is
  recomputed: the dots policy keeps each block's fc1 output ``[B, hidden]`` more."""
  found = {p: _report_residuals("every:2", p, scan) for p in ("none", "nothing_saveable", "dots_saveable")}
  for res in found.values():
    assert [lv["level"] for lv in res["levels"]] == [0, 1]
    assert res["bytes"] == sum(lv["bytes"] for lv in res["levels"])
    assert res["count"] == sum(lv["count"] for lv in res["levels"])
    assert "one group of 2 block(s)" in res["levels"][1]["analysed"]
    assert {i["level"] for i in res["items"] if i["kind"] == "argument"} == {0}
  outer = {p: r["levels"][0]["bytes"] for p, r in found.items()}
  assert len(set(outer.values())) == 1  # the forward pass keeps the same group inputs under every block policy
  level1 = {p: r["levels"][1]["bytes"] for p, r in found.items()}
  assert level1["dots_saveable"] - level1["nothing_saveable"] == (
      MLP_TINY_LAYERS * MLP_TINY_BATCH * MLP_TINY_HIDDEN * F32_BYTES)
  assert level1["none"] > level1["dots_saveable"] > level1["nothing_saveable"]
  dots = [i for i in found["dots_saveable"]["items"] if i["level"] == 1 and i["primitive"] == "dot_general"]
  assert [i["shape"] for i in dots] == [[MLP_TINY_BATCH, MLP_TINY_HIDDEN]] * MLP_TINY_LAYERS


def test_report_residuals_named_value_inside_groups_equals_block_structure():
  """What the blocks' names policy keeps inside the recomputed group equals what it keeps without a structure."""
  name = "save_only_these_names:mlp_hidden"
  grouped, plain = _report_residuals("every:2", name), _report_residuals("block", name)
  assert [lv["level"] for lv in plain["levels"]] == [0]
  expected = MLP_TINY_LAYERS * MLP_TINY_BATCH * MLP_TINY_HIDDEN * F32_BYTES
  by_name = lambda res, level: sum(i["bytes"] for i in res["items"]  # noqa: E731
                                   if i["level"] == level and i["name"] == "mlp_hidden")
  assert by_name(grouped, 1) == by_name(plain, 0) == expected
  assert by_name(grouped, 0) == 0


@pytest.mark.slow
def test_report_residual_order_follows_compiled_temp_under_a_structure():
  """Rows that differ in compiled temp do not show identical residuals (the issue's exact report)."""
  from jaxckpt.report import build_report
  from jaxckpt.step import shipped_target

  report = build_report(shipped_target("mlp", "tiny", structure="every:2", scan=False),
                        ["nothing_saveable", "dots_saveable"], progress=False)
  nothing, dots = report.row("nothing_saveable"), report.row("dots_saveable")
  assert nothing["temp_bytes"] < dots["temp_bytes"]
  assert nothing["residual_bytes"] < dots["residual_bytes"]


@pytest.mark.parametrize("policy", ["dots_saveable", "save_only_these_names:qkv+mlp_out", "attn=full,mlp=none"])
def test_shared_block_traces_give_the_same_residuals_from_one_block_trace(policy, monkeypatch):
  """The report's residual analysis traces an unrolled stack with ``shared_block_traces``: identical residuals
  (and parameter-only bytes) from one Python trace per block type instead of one per layer."""
  from flax import nnx

  from jaxckpt.analysis._activations import parameter_only_bytes
  from jaxckpt.models._gpt import GPT_PRESETS, build_gpt, lm_batch_struct, lm_loss
  from jaxckpt.nnx._layers import AttentionBlock, MLPBlock, shared_block_traces

  config = GPT_PRESETS["tiny"]
  model = nnx.eval_shape(lambda: build_gpt(dataclasses.replace(config, num_layers=3, scan=False), policy=policy))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = lm_batch_struct(2, config.seq_len)
  calls = {"attn": 0, "mlp": 0}
  for cls, kind in ((AttentionBlock, "attn"), (MLPBlock, "mlp")):
    forward = cls.forward

    def counted(self, *args, _forward=forward, _kind=kind, **kwargs):
      calls[_kind] += 1
      return _forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)

  def analyse():
    found = []

    def outer(batch, key):
      loss = lambda p: lm_loss(nnx.merge(graphdef, p, rest, copy=True), batch, dropout_key=key,  # noqa: E731
                               deterministic=False)[0]
      traced = residuals_lib.traced_residuals(loss, params)
      found.append((traced.residuals, parameter_only_bytes(traced.jaxpr, traced.num_residuals)))
      return 0

    jax.make_jaxpr(outer)(batch, jax.eval_shape(lambda: jax.random.key(0)))
    return found[0]

  alone = analyse()
  per_layer = dict(calls)
  calls.update(attn=0, mlp=0)
  with shared_block_traces():
    shared = analyse()
  assert shared == alone and shared[1] > 0
  remat = {kind: jaxckpt.parse_policy(policy).for_block(kind).remat for kind in calls}
  assert per_layer == {"attn": 3, "mlp": 3}  # one trace of each block per layer
  assert calls == {kind: 1 if remat[kind] else 3 for kind in calls}  # remat'd blocks: one trace for the 3 layers


LAYERED = "0-1:nothing_saveable;2-2:dots_saveable"


@pytest.mark.parametrize("policy, shared", [
    ("none", True), ("save_only_these_names:qkv+mlp_out", True), ("attn=full,mlp=none", True), ("full", True),
    (LAYERED, True), ("budget:50%", None)])
def test_layer_calls_are_shared_for_every_per_block_policy(policy, shared):
  """Every per-block or layered policy shares one layer trace (layers without remat too: the literals JAX lists for
  inline code only are left out of the report); a whole-loss or unresolved policy shares nothing."""
  from jaxckpt import parse_model_policy
  from jaxckpt.report._residuals import _layer_sharing

  assert _layer_sharing(parse_model_policy(policy)) is shared


@pytest.mark.parametrize("policy", ["none", "attn=full,mlp=none", "dots_saveable", LAYERED])
def test_shared_layer_traces_give_the_same_residuals(policy, monkeypatch):
  """The report's residual analysis traces the unrolled twin's layers once (:func:`shared_layer_traces`: one jitted
  layer call, one jitted slice per layer, inlined again before JAX's analysis): every figure and item equals the
  analysis that traces each layer (the report at the compile floor)."""
  from jaxckpt.core import _structure as structure
  from jaxckpt import parse_model_policy
  from jaxckpt.report import _residuals as report_residuals
  from jaxckpt.step import default_optimizer, policy_step, shipped_target

  step = policy_step(shipped_target("gpt", "tiny", num_layers=3), parse_model_policy(policy), default_optimizer())
  traces = []
  make_shared = structure._shared_layer

  def counted(fn):
    return make_shared(lambda carry, layer: (traces.append(1), fn(carry, layer))[1])

  monkeypatch.setattr(structure, "_shared_layer", counted)
  together = report_residuals.analyse_residuals(step)
  assert len(traces) == (2 if policy == LAYERED else 1)  # one trace per loop (a layered policy: per range), not per layer
  monkeypatch.setattr(report_residuals, "_layer_sharing", lambda spec: None)
  assert report_residuals.analyse_residuals(step) == together and together["bytes"] > 0
  if policy == "none":  # inline, JAX lists the layers' scalar literals (6 a layer); the report leaves them out
    from jaxckpt.analysis._residuals import traced_residuals
    from jaxckpt.step._build import dropout_key_struct

    literals = []

    def outer(batch, key):
      residuals = traced_residuals(lambda p: step.loss_of_params(p, batch, key), step.params).residuals
      literals.extend(r for r in residuals if r.description == report_residuals.LITERAL)
      return 0

    jax.make_jaxpr(outer)(step.batch, dropout_key_struct())
    assert len(literals) == 18 and all(r.bytes == 4 for r in literals)
    assert len([i for i in together["items"] if i["kind"] != "argument"]) == together["count"]


def test_inline_calls_reads_a_shared_call_as_its_code():
  from jaxckpt.analysis._jaxprs import SHARED_CALLS, inline_calls

  def jaxckpt_shared_layer(x, w):
    return jnp.tanh(x @ w) * 2.0

  layer = jax.jit(jaxckpt_shared_layer)
  helper = jax.jit(lambda x: x + 1)

  def f(x, w):
    return helper(layer(layer(x, w), w))

  x, w = jnp.ones((2, 3)), jnp.full((3, 3), 0.1)
  closed = jax.make_jaxpr(f)(x, w)
  assert [e.params["name"] for e in closed.jaxpr.eqns] == [SHARED_CALLS[0]] * 2 + ["<lambda>"]
  inlined = inline_calls(closed.jaxpr)
  assert [e.primitive.name for e in inlined.eqns] == ["dot_general", "tanh", "mul"] * 2 + ["jit"]  # others kept
  assert len({v for e in inlined.eqns for v in e.outvars}) == len(inlined.eqns)  # each copy its own variables
  out = jax.core.eval_jaxpr(inlined, closed.consts, x, w)
  assert_trees_close(out[0], f(x, w), depth=2, what="inlined jaxpr, eager, vs the jitted calls")  # layer applied twice
  assert inline_calls(inlined) is inlined  # nothing left to inline
