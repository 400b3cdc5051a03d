"""jaxckpt under both of JAX's remat implementations (remat2, remat3 = ``JAX_REMAT3=1``): region detection,
gradients, callable policies, and the environment checks. ``.ci/run`` runs this file under both."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.analysis._jaxprs import count_remat_regions, emitted_checkpoint_names, outermost_remats, remat_body, uses_remat
from jaxckpt._remat_impl import check_env, remat_implementation
from jaxckpt.analysis._residuals import recomputed_residuals, saved_residuals
from tests.numerics import assert_trees_close

# This file is about both remat implementations: .ci/run's remat3 leg runs all of it again under JAX_REMAT3=1.
pytestmark = pytest.mark.remat3

IMPL = remat_implementation()


def block(w, x):  # w: [8, 8] float32, x: [4, 8] float32 -> [4, 8]
  h = checkpoint_name(jnp.tanh(x @ w), "h")
  return jnp.sin(h @ w)


W = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32) * 0.3
X = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)


LAYERS = 3  # blocks of stack_loss


def stack_loss(policy, *, scan):
  step = jaxckpt.checkpoint(block, policy)

  def loss(w, x):
    if scan:
      x, _ = jax.lax.scan(lambda c, _: (step(w, c), None), x, None, length=LAYERS)
    else:
      for _ in range(LAYERS):
        x = step(w, x)
    return jnp.sum(x ** 2)

  return loss


def test_impl_matches_jax_flag():
  assert IMPL == ("remat3" if jax.config.jax_remat3 else "remat2")


@pytest.mark.parametrize("scan", [False, True])
def test_regions_counted_before_and_after_differentiation(scan):
  loss = stack_loss("save_only_these_names:h", scan=scan)
  regions = 1 if scan else 3  # a scan body counted once
  assert count_remat_regions(jax.make_jaxpr(loss)(W, X)) == regions
  assert count_remat_regions(jax.jit(jax.grad(loss)).trace(W, X).jaxpr) == regions
  assert uses_remat(jax.make_jaxpr(jax.grad(loss))(W, X))
  assert count_remat_regions(jax.make_jaxpr(jax.grad(stack_loss("none", scan=scan)))(W, X)) == 0


def test_a_users_own_barrier_is_not_a_region():
  def loss(w, x):
    return jnp.sum(jax.lax.optimization_barrier(jnp.tanh(x @ w)))
  assert count_remat_regions(jax.make_jaxpr(jax.grad(loss))(W, X)) == 0


@pytest.mark.parametrize("policy,scan", [("nothing_saveable", True), ("dots_saveable", False),
                                         ("save_only_these_names:h", True), ("save_any_names_but_these:h", False),
                                         ("everything_saveable", False)])
def test_gradients_equal_no_remat(policy, scan):
  ref = jax.grad(stack_loss("none", scan=scan))(W, X)
  got = jaxckpt.jit(jax.grad(stack_loss(policy, scan=scan)))(W, X)
  assert_trees_close(got, ref, depth=LAYERS, what=f"{IMPL} {policy} {'scan' if scan else 'unrolled'} vs no remat")


def test_names_bodies_and_residuals():
  outer = jax.make_jaxpr(stack_loss("save_only_these_names:h", scan=False))(W, X)
  assert emitted_checkpoint_names(stack_loss("none", scan=False), W, X) == {"h"}
  (first, *_) = outermost_remats(outer)
  assert remat_body(first) is not None
  saved = [r for r in saved_residuals(stack_loss("save_only_these_names:h", scan=False), W, X) if r.kind != "argument"]
  named = [r for r in saved if r.name is not None]  # the others: each block's input, output of the block before
  assert [r.name for r in named] == ["h"] * 3 and all(r.bytes == 4 * 8 * 4 for r in named)
  inner = [r for r in recomputed_residuals(first) if r.kind != "argument"]
  assert "h" in [r.name for r in inner]  # the body without its remat: as no remat keeps


def test_callable_policy_through_the_python_api():
  predicate = lambda prim, *_, **__: prim.name == "tanh"  # noqa: E731 - a hand-written JAX predicate
  if IMPL == "remat3":
    with pytest.raises(PolicySpecError, match=r"callable policy.*JAX_REMAT3") as err:
      jaxckpt.checkpoint(block, predicate)
    assert "\n" not in str(err.value)
  else:
    f = jaxckpt.checkpoint(block, predicate)
    assert_trees_close(jax.grad(lambda w: f(w, X).sum())(W), jax.grad(lambda w: block(w, X).sum())(W), depth=1,
                       what="gradients under a callable policy vs no remat")
  # JAX's policy objects are data: honoured by both implementations.
  f = jaxckpt.checkpoint(block, jax.checkpoint_policies.save_only_these_names("h"))
  assert [r.name for r in saved_residuals(f, W, X) if r.kind != "argument"] == ["h"]


def test_offload_policies_refused_under_remat3_only():
  policy = jaxckpt.parse_policy("offload_dot_with_no_batch_dims").default
  if IMPL == "remat3":
    with pytest.raises(PolicySpecError, match="offload_dot_with_no_batch_dims.*ignores"):
      policy.to_jax()
  else:
    assert callable(policy.to_jax())


def test_env_value_checked_before_jax_reads_it():
  assert check_env({}) is None and check_env({"JAX_REMAT3": "1"}) is None and check_env({"JAX_REMAT3": "off"}) is None
  assert "JAX_REMAT3='maybe'" in check_env({"JAX_REMAT3": "maybe"})
  env = {**os.environ, "JAX_REMAT3": "maybe"}
  # The library raises (an exception a caller can catch), it does not exit; JAX is not imported yet when it does.
  probe = ("import sys\ntry:\n  import jaxckpt\nexcept ValueError as e:\n"
           "  print(type(e).__name__, 'jax' in sys.modules, e)\n")
  done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("EnvSettingError False JAX_REMAT3='maybe' is not a value JAX accepts: use one of y")
  # The console scripts (jaxckpt-plan, ...) print it as one line and exit 2.
  script = shutil.which("jaxckpt-plan") or os.path.join(os.path.dirname(sys.executable), "jaxckpt-plan")
  done = subprocess.run([script, "--help"], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
  assert "JAX_REMAT3='maybe' is not a value JAX accepts" in done.stderr


def test_a_jax_without_the_flag():
  class OldConfig:  # a JAX before 0.10: no jax_remat3
    pass
  assert remat_implementation(config=OldConfig(), environ={}) == "remat2"
  with pytest.raises(JaxckptError, match="has no jax_remat3 flag"):
    remat_implementation(config=OldConfig(), environ={"JAX_REMAT3": "1"})
