"""The suite's closeness rule (tests/numerics.py): it accepts honest remat on every CPU and reports real remat bugs.

The bugs are written as hand-made remats (``jax.custom_vjp`` whose forward keeps only the block's inputs and whose
backward recomputes the block), each wrong in one way a real remat can be: the recomputation draws another dropout
mask (a key not reused, jax-ml/jax#19577), a residual loses one example's row, or a residual is kept in bfloat16. The
same hand-made remat without the bug, and ``jax.checkpoint`` under each policy, must pass: so a failure here is the
rule being too loose (a bug accepted) or too tight (honest rounding rejected, as on an AVX2 machine).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import C, FLOOR, assert_trees_close, mismatches

LAYERS, B, D, H, KEEP = 7, 4, 8, 16, 0.7  # blocks; batch, width, hidden width; dropout keep probability


def block(w1, w2, x, key):
  """A residual MLP block with dropout: x + dropout(tanh(x @ w1)) @ w2; x: [B, D], w1: [D, H], w2: [H, D] float32."""
  h = jnp.tanh(x @ w1)
  h = jnp.where(jax.random.bernoulli(key, KEEP, h.shape), h / KEEP, 0.0)
  return x + h @ w2


def hand_remat(*, recompute_key=lambda key: key, keep_input=lambda x: x):
  """``block`` remat'd by hand: the forward keeps the inputs only (``keep_input(x)`` for x), the backward recomputes
  the block from them with ``recompute_key(key)``. With the defaults it is an honest remat."""

  @jax.custom_vjp
  def remat_block(w1, w2, x, key):
    return block(w1, w2, x, key)

  def forward(w1, w2, x, key):
    return block(w1, w2, x, key), (w1, w2, keep_input(x), key)

  def backward(residuals, g):
    w1, w2, x, key = residuals
    _, vjp = jax.vjp(lambda a, b, c: block(a, b, c, recompute_key(key)), w1, w2, x.astype(jnp.float32))
    return (*vjp(g), None)

  remat_block.defvjp(forward, backward)
  return remat_block


def loss_and_grads(block_fn):
  """Loss and gradients (parameters and input) of a ``LAYERS``-block stack of ``block_fn``, fixed seeds, jitted."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (LAYERS, D, H)) / 3, "w2": jax.random.normal(k2, (LAYERS, H, D)) / 4}
  x = jax.random.normal(k3, (B, D))

  def loss(params, x):
    keys = jax.random.split(jax.random.key(1), LAYERS)
    for i in range(LAYERS):
      x = block_fn(params["w1"][i], params["w2"][i], x, keys[i])
    return jnp.sum(jnp.tanh(x) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


@pytest.fixture(scope="module")
def reference():
  return loss_and_grads(block)


HONEST = {
    "jax.checkpoint nothing_saveable": jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable),
    "jax.checkpoint dots_saveable": jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable),
    "hand-made remat": hand_remat(),
}
BUGS = {
    "recomputation draws another dropout mask": hand_remat(recompute_key=lambda key: jax.random.fold_in(key, 1)),
    "a residual loses one example's row": hand_remat(keep_input=lambda x: x.at[-1].set(0.0)),
    "a residual kept in bfloat16": hand_remat(keep_input=lambda x: x.astype(jnp.bfloat16)),
}


@pytest.mark.parametrize("name", HONEST)
def test_honest_remat_is_accepted(reference, name):
  loss, grads = loss_and_grads(HONEST[name])
  assert_trees_close((loss, grads), reference, depth=LAYERS, what=name)


@pytest.fixture
def no_calibration_log(monkeypatch):
  """Deliberate mismatches are no calibration data: ``JAXCKPT_TESTS_NUMERICS_LOG`` off for the test."""
  monkeypatch.delenv("JAXCKPT_TESTS_NUMERICS_LOG", raising=False)


@pytest.mark.parametrize("name", BUGS)
def test_remat_bug_is_reported(reference, name, no_calibration_log):
  """The bug changes the gradients (the loss, a forward value, is right: only the recomputation is wrong), and the
  rule says so, naming the leaves; by a wide margin, so the rule is not borderline on them."""
  loss, grads = loss_and_grads(BUGS[name])
  assert_trees_close(loss, reference[0], depth=LAYERS, what=f"{name}: the loss")
  with pytest.raises(AssertionError, match=r"gradients.*leaf\(s\) differ by more than float rounding") as err:
    assert_trees_close(grads, reference[1], depth=LAYERS, what=f"{name}: gradients")
  assert "[0]['w1']" in str(err.value) and "allowed" in str(err.value)
  # how many times the allowed difference the bug moves the worst element of its worst leaf by
  tree = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(reference[1]))
  margins = [float(np.max(np.abs(g - w))) / (C * 2.0**-24 * LAYERS * max(float(np.max(np.abs(w))), FLOOR * tree))
             for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(reference[1]))]
  assert max(margins) > 10, margins


def test_issue_38_element_passes_norm_wise_and_fails_element_wise(no_calibration_log):
  """Issue 38's numbers: -0.0223945286 vs -0.0223962273 in a 7-block stack's fc2 bias gradient whose largest entry is
  3.13. Element-wise (atol=1e-6, rtol=1e-5) it fails; norm-wise it is 11 u of the leaf's scale: float rounding."""
  want = np.array([3.13, -0.0223962273], np.float32)
  got = np.array([3.13, -0.0223945286], np.float32)
  assert not np.allclose(got, want, rtol=1e-5, atol=1e-6)
  assert_trees_close(got, want, depth=7, what="an AVX2 machine's rounding")


def test_message_structure_dtypes_and_depth(no_calibration_log):
  want = {"a": np.array([1.0, -2.0], np.float32), "n": np.arange(3)}
  bad = list(mismatches({"a": np.array([1.0, -2.1], np.float32), "n": np.array([0, 1, 3])}, want, depth=2))
  assert len(bad) == 2 and bad[0].startswith("['a']: max |got - want| = 0.1") and "at (1,)" in bad[0]
  assert bad[1] == "['n']: int64 values differ at 1 of 3 places (compared exactly)"
  assert "tree structures differ" in next(mismatches({"a": want["a"]}, want, depth=1))
  assert "shape (1,) != (2,)" in next(mismatches({"a": np.ones(1, np.float32), "n": want["n"]}, want, depth=1))
  nan = np.array([np.nan, 1.0], np.float32)
  assert not list(mismatches(nan, nan.copy(), depth=1))  # the same NaN in the same place
  assert "non-finite" in next(mismatches(np.ones(2, np.float32), nan, depth=1))
  zero = np.zeros(3, np.float32)
  assert not list(mismatches(zero, zero, depth=1)) and list(mismatches(zero + 1e-30, zero, depth=1))
  # the floor: a bias before a BatchNorm (gradient 0 in exact arithmetic, rounding noise here) beside gradients of 20
  noise = {"bias": np.float32([-1.11e-6, 1.43e-6]), "kernel": np.float32([20.0, -3.0])}
  other_noise = {"bias": np.float32([-1.587e-6, 1.43e-6]), "kernel": np.float32([20.0, -3.0])}
  assert not list(mismatches(other_noise, noise, depth=3))
  assert list(mismatches(other_noise["bias"], noise["bias"], depth=3))  # alone, its own scale is the noise's
  # a Python float copy of a float32 result keeps float32's u; a bfloat16 leaf has bfloat16's
  assert not list(mismatches(1.0 + 2e-7, 1.0, depth=1)) and list(mismatches(1.0 + 2e-5, 1.0, depth=1))
  assert not list(mismatches(jnp.bfloat16(1.0078125), jnp.bfloat16(1.0), depth=1))
  with pytest.raises(ValueError, match="depth=0 must be an int ≥ 1"):
    next(mismatches(zero, zero, depth=0))
