"""Tests for jaxckpt.analysis._flops: jaxpr FLOP counts vs hand formulas and vs XLA's cost analysis."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxckpt.analysis import _flops as flops_lib
from jaxckpt.analysis._flops import FlopCount, count_flops, jaxpr_flops

SDS = jax.ShapeDtypeStruct
F32 = jnp.float32


def xla_cost(fn, *args, compiler_options=None):
  """XLA's cost_analysis() of the compiled fn: (flops, transcendentals), 0 when a key is missing."""
  compiled = jax.jit(fn).lower(*args).compile(compiler_options=compiler_options)
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX returned one dict per device
    cost = cost[0]
  return cost.get("flops", 0.0), cost.get("transcendentals", 0.0)


# --- leaf primitives --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dims, expected",
    [
        # plain matmul [M, K] x [K, N]: 2 * M * N * K
        ((5, 7), (7, 3), (((1,), (0,)), ((), ())), 2 * 5 * 3 * 7),
        # batched [B, M, K] x [B, K, N]: 2 * B * M * N * K
        ((4, 5, 7), (4, 7, 3), (((2,), (1,)), ((0,), (0,))), 2 * 4 * 5 * 3 * 7),
        # two contracting dims [M, K1, K2] x [K2, K1, N], rhs contracting order swapped
        ((6, 2, 3), (3, 2, 5), (((1, 2), (1, 0)), ((), ())), 2 * 6 * 5 * (2 * 3)),
        # batch dim not leading on the rhs, outer product (no contraction) [B, M] x [N, B]: one multiply per output
        ((4, 5), (3, 4), (((), ()), ((0,), (1,))), 4 * 5 * 3),
    ],
)
def test_dot_general_matches_formula_and_xla(lhs_shape, rhs_shape, dims, expected):
  fn = lambda a, b: lax.dot_general(a, b, dims)
  args = (SDS(lhs_shape, F32), SDS(rhs_shape, F32))
  count = count_flops(fn, *args)
  assert count.total == expected
  assert count.by_primitive == {"dot_general": expected}
  assert xla_cost(fn, *args)[0] == expected


@pytest.mark.parametrize("padding, strides, groups", [("VALID", (1, 1), 1), ("VALID", (2, 1), 2), ("SAME", (1, 1), 1)])
def test_conv_matches_formula(padding, strides, groups):
  n, h, w, c_in, c_out, kh, kw = 2, 9, 8, 4, 6, 3, 2
  lhs = SDS((n, h, w, c_in), F32)  # NHWC
  rhs = SDS((kh, kw, c_in // groups, c_out), F32)  # HWIO, I = in-features per group
  fn = lambda x, k: lax.conv_general_dilated(x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                             feature_group_count=groups)
  out = jax.eval_shape(fn, lhs, rhs)
  expected = 2 * int(np.prod(out.shape)) * (kh * kw) * (c_in // groups)
  count = count_flops(fn, lhs, rhs)
  assert count.by_primitive["conv_general_dilated"] == expected
  xla_flops = xla_cost(fn, lhs, rhs)[0]
  if padding == "VALID":
    assert xla_flops == expected
  else:  # XLA skips taps that fall in the padding; the formula is an upper bound.
    assert xla_flops < expected


@pytest.mark.parametrize(
    "name, fn",
    [
        ("arith", lambda x, y: (x * y + x) / (y - 2.0)),
        ("transcendental", lambda x, y: jnp.exp(x) + jnp.tanh(y) * jnp.sin(x) + jnp.sqrt(jnp.abs(y))),
        ("logistic_erf_rsqrt", lambda x, y: jax.nn.sigmoid(x) + lax.erf(y) + lax.rsqrt(x * x + 1.0)),
        ("integer_pow", lambda x, y: x**3 + y**5 + 1.0),  # no shared powers for XLA to CSE
        ("compare_select", lambda x, y: jnp.where(x > y, x, y) + jnp.maximum(x, 0.0)),
        ("reduce", lambda x, y: jnp.sum(x, axis=1) + jnp.max(y, axis=1)),
        ("convert", lambda x, y: (x.astype(jnp.bfloat16) * 2).astype(F32) + y),
    ],
)
def test_elementwise_and_reductions_match_xla(name, fn):
  args = (SDS((32, 16), F32), SDS((32, 16), F32))
  count = count_flops(fn, *args)
  xla_flops, xla_trans = xla_cost(fn, *args)
  assert count.total == pytest.approx(xla_flops, rel=0.02, abs=2), name
  assert count.transcendentals == xla_trans, name


def test_transcendentals_are_kept_out_of_flops():
  count = count_flops(jnp.tanh, SDS((10, 10), F32))
  assert count.total == 0
  assert count.transcendentals == 100
  assert count.by_primitive == {}


def test_integer_pow_counts_square_and_multiply():
  x = SDS((10,), F32)
  assert count_flops(lambda x: x**2, x).total == 10  # x*x
  assert count_flops(lambda x: x**3, x).total == 20  # x*x, *x
  assert count_flops(lambda x: x**8, x).total == 30  # three squarings
  assert count_flops(lambda x: x**-2, x).total == 20  # x*x, then 1/.


def test_shape_dtype_structs_and_arrays_give_the_same_count():
  fn = lambda a, b: jnp.tanh(a @ b).sum()
  real = count_flops(fn, jnp.ones((4, 8)), jnp.ones((8, 3)))
  abstract = count_flops(fn, SDS((4, 8), F32), SDS((8, 3), F32))
  assert real == abstract
  assert real.total == 2 * 4 * 3 * 8 + (4 * 3 - 1)


def test_kwargs_and_jit_wrapped_functions():
  fn = jax.jit(lambda a, *, b: a @ b)
  count = count_flops(fn, SDS((4, 8), F32), b=SDS((8, 3), F32))
  assert count.total == 2 * 4 * 3 * 8


# --- scanned layers: the reason this module exists -------------------------------------------------------------

L, B, D, H = 6, 16, 32, 64


def _mlp_block(x, w1, w2):  # x: [B, D], w1: [D, H], w2: [H, D]
  return x + jnp.tanh(x @ w1) @ w2


def _mlp_block_tanh_out(x, w1, w2):  # the backward needs every block output -> remat recomputes the whole block
  return x + jnp.tanh(jnp.tanh(x @ w1) @ w2)


def _maybe_remat(block, remat):
  return jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable) if remat else block


def scanned_loss(block, remat):
  def loss(w1, w2, x):  # w1: [L, D, H], w2: [L, H, D], x: [B, D]
    step = _maybe_remat(block, remat)
    y, _ = lax.scan(lambda h, w: (step(h, *w), None), x, (w1, w2))
    return jnp.mean(y**2)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def unrolled_loss(block, remat):
  # Per-layer weights as lists: indexing a stacked [L, ...] array would add L pad+add gradient accumulations
  # that the scanned version does not have.
  def loss(w1s, w2s, x):
    step = _maybe_remat(block, remat)
    for w1, w2 in zip(w1s, w2s):
      x = step(x, w1, w2)
    return jnp.mean(x**2)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


STACKED = (SDS((L, D, H), F32), SDS((L, H, D), F32), SDS((B, D), F32))
PER_LAYER = ([SDS((D, H), F32)] * L, [SDS((H, D), F32)] * L, SDS((B, D), F32))


def test_scanned_jaxpr_flops_match_unrolled_xla_flops():
  scanned = scanned_loss(_mlp_block, remat=False)
  unrolled = unrolled_loss(_mlp_block, remat=False)
  jaxpr_scanned = count_flops(scanned, *STACKED)
  xla_unrolled, _ = xla_cost(unrolled, *PER_LAYER)
  xla_scanned, _ = xla_cost(scanned, *STACKED)

  # Forward 2 matmuls/layer, backward 4 (dx and dw of each): 6 * 2*B*D*H per layer.
  assert jaxpr_scanned.by_primitive["dot_general"] == L * 6 * 2 * B * D * H
  assert jaxpr_scanned.unbounded_loops == 0
  # The jaxpr count of the scanned step is what XLA counts once the loop is unrolled...
  assert jaxpr_scanned.total == pytest.approx(xla_unrolled, rel=0.02)
  assert count_flops(unrolled, *PER_LAYER).total == jaxpr_scanned.total
  # ... while XLA's own count of the scanned compile sees each loop body once: about 1/L of the work.
  assert 0.5 / L < xla_scanned / jaxpr_scanned.total < 1.5 / L


@pytest.mark.parametrize(
    "block, recomputed_dots_per_layer",
    [
        # tanh(h) @ w2 feeds only an add: its output is not needed by the backward, so remat recomputes just x @ w1.
        (_mlp_block, 1),
        # tanh'(out) needs the second matmul's output too: remat recomputes the whole forward of the block.
        (_mlp_block_tanh_out, 2),
    ],
)
def test_remat_adds_recomputation_flops(block, recomputed_dots_per_layer):
  plain = count_flops(scanned_loss(block, remat=False), *STACKED)
  remat = count_flops(scanned_loss(block, remat=True), *STACKED)
  extra = remat.total - plain.total
  assert extra > 0
  assert extra == L * recomputed_dots_per_layer * 2 * B * D * H
  assert remat.transcendentals > plain.transcendentals  # tanh recomputed too

  if recomputed_dots_per_layer == 2:
    # About one forward pass of the blocks (the forward also has the residual adds and the loss).
    fwd = count_flops(lambda w1, w2, x: lax.scan(lambda h, w: (block(h, *w), None), x, (w1, w2))[0], *STACKED)
    assert extra == pytest.approx(fwd.total, rel=0.02)
    assert extra == fwd.by_primitive["dot_general"]


def test_remat_recomputation_matches_xla_when_cse_is_off():
  # Unrolled + remat on XLA:CPU: with the cse_barrier_expander pass disabled, XLA keeps the recomputation and its
  # flops match the jaxpr count. (With default options XLA:CPU merges it back into the forward: jaxckpt.training._xla.)
  fn = unrolled_loss(_mlp_block_tanh_out, remat=True)
  xla_flops, _ = xla_cost(fn, *PER_LAYER, compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"})
  assert count_flops(fn, *PER_LAYER).total == pytest.approx(xla_flops, rel=0.02)


# --- control flow -----------------------------------------------------------------------------------------------


def test_cond_counts_the_most_expensive_branch():
  x, w = SDS((4, 8), F32), SDS((8, 8), F32)
  matmul_flops = 2 * 4 * 8 * 8
  for branches in [(lambda x, w: x * 2.0, lambda x, w: x @ w), (lambda x, w: x @ w, lambda x, w: x * 2.0)]:
    count = count_flops(lambda p, x, w, br=branches: lax.cond(p, *br, x, w), SDS((), jnp.bool_), x, w)
    assert count.by_primitive["dot_general"] == matmul_flops
    assert "mul" not in count.by_primitive
  three = (lambda x, w: x, lambda x, w: jnp.tanh(x @ w) @ w, lambda x, w: x @ w)
  count = count_flops(lambda i, x, w: lax.switch(i, three, x, w), SDS((), jnp.int32), x, w)
  assert count.by_primitive["dot_general"] == 2 * matmul_flops
  assert count.transcendentals == 4 * 8


def test_while_loop_with_unknown_trip_count_is_flagged():
  x = SDS((16,), F32)
  fn = lambda x: lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c * 2.0 + 1.0, x)
  count = count_flops(fn, x)
  assert count.unbounded_loops == 1
  assert count.by_primitive["mul"] == 16  # body counted once
  assert count.by_primitive["add"] == 16
  assert count.by_primitive["reduce_sum"] == 15  # cond counted once

  # A fori_loop whose upper bound is traced cannot be resolved either.
  dyn = lambda x, n: lax.fori_loop(0, n, lambda i, c: c * 2.0, x)
  assert count_flops(dyn, x, SDS((), jnp.int32)).unbounded_loops == 1


def test_fori_loop_with_static_bounds_is_multiplied():
  x = SDS((16,), F32)
  # Python-int bounds: JAX already emits a scan of length 5.
  as_scan = count_flops(lambda x: lax.fori_loop(0, 5, lambda i, c: c * 2.0, x), x)
  # An array bound gives a `while`; its start, bound and `i + 1` step are literals, so the trip count is static.
  as_while = count_flops(lambda x: lax.fori_loop(2, jnp.int32(7), lambda i, c: c * 2.0, x), x)
  assert as_scan.by_primitive["mul"] == 5 * 16
  assert as_while.by_primitive["mul"] == 5 * 16
  assert as_while.unbounded_loops == 0
  # Hand-written while with literal bounds.
  hand = count_flops(lambda x: lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1], x)
  assert hand.by_primitive["mul"] == 10 * 16
  assert hand.unbounded_loops == 0


@jax.custom_vjp
def _custom_matmul(a, b):
  return jnp.sin(a @ b)


def _custom_matmul_fwd(a, b):
  y = a @ b
  return jnp.sin(y), (a, b, y)


def _custom_matmul_bwd(res, g):
  a, b, y = res
  g = g * jnp.cos(y)
  return g @ b.T, a.T @ g


_custom_matmul.defvjp(_custom_matmul_fwd, _custom_matmul_bwd)


def test_custom_vjp_is_counted_forward_and_backward():
  a, b = SDS((4, 8), F32), SDS((8, 3), F32)
  mm = 2 * 4 * 3 * 8
  fwd = count_flops(_custom_matmul, a, b)
  assert fwd.by_primitive == {"dot_general": mm}
  assert fwd.transcendentals == 4 * 3
  grad = count_flops(jax.grad(lambda a, b: _custom_matmul(a, b).sum(), argnums=(0, 1)), a, b)
  assert grad.by_primitive["dot_general"] == 3 * mm  # forward + the bwd rule's two matmuls
  assert grad.transcendentals == 2 * 4 * 3  # sin + cos


def test_custom_jvp_and_nested_jit_are_counted():
  x, w = SDS((4, 8), F32), SDS((8, 8), F32)
  inner = jax.jit(lambda x, w: jax.nn.relu(x @ w))
  count = count_flops(lambda x, w: inner(inner(x, w), w), x, w)
  assert count.by_primitive["dot_general"] == 2 * (2 * 4 * 8 * 8)
  assert count.by_primitive["max"] == 2 * 4 * 8  # relu is a custom_jvp around max


def test_scan_inside_scan_multiplies():
  x, w = SDS((4, 8), F32), SDS((3, 5, 8, 8), F32)

  def fn(x, w):
    def outer(h, w_outer):
      h, _ = lax.scan(lambda h, wi: (h @ wi, None), h, w_outer)
      return h, None
    return lax.scan(outer, x, w)[0]

  assert count_flops(fn, x, w).total == 3 * 5 * (2 * 4 * 8 * 8)


def test_primitives_without_a_rule_are_reported():
  fn = lambda x: x + jax.random.uniform(jax.random.key(0), x.shape)
  count = count_flops(fn, SDS((8,), F32))
  assert "random_bits" in count.uncounted_primitives
  assert "random_bits" not in count.by_primitive
  assert count.total > 0  # the arithmetic around the bits is still counted


# --- API errors and docs ----------------------------------------------------------------------------------------


def test_jaxpr_flops_accepts_jaxpr_and_closed_jaxpr():
  closed = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4)))
  assert jaxpr_flops(closed) == jaxpr_flops(closed.jaxpr)
  assert isinstance(jaxpr_flops(closed), FlopCount)
  assert jaxpr_flops(closed).total == 48


def test_bad_inputs_raise_type_errors_that_say_what_to_do():
  with pytest.raises(TypeError, match=r"got function.*count_flops"):
    jaxpr_flops(lambda x: x)
  with pytest.raises(TypeError, match=r"callable.*got int.*jaxpr_flops"):
    count_flops(3, SDS((2,), F32))


def test_docstring_examples_run():
  result = doctest.testmod(flops_lib, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 2
  assert result.failed == 0


def test_pallas_kernel_counts_its_body_per_grid_step_or_its_cost_estimate():
  """A Pallas call is its body once per grid step (a kernel's FLOPs were once counted as one step's), or the
  kernel's own ``pl.CostEstimate`` when it states one."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] @ w_ref[...]

  def call(x, w, estimate=None):
    return pl.pallas_call(kernel, grid=(4,), in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0)),
                                                      pl.BlockSpec((8, 8), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((32, 8), jnp.float32), interpret=True,
                          cost_estimate=estimate)(x, w)

  x, w = jnp.ones((32, 8)), jnp.ones((8, 8))
  assert count_flops(call, x, w).total == 4 * 2 * 8 * 8 * 8
  stated = pl.CostEstimate(flops=12345, transcendentals=7, bytes_accessed=0)
  count = count_flops(lambda x, w: call(x, w, stated), x, w)
  assert count.total == 12345 and count.transcendentals == 7
  np.testing.assert_array_equal(call(x, w), x @ w)  # the kernel is the matmul it claims
