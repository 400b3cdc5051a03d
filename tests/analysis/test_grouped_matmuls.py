"""Grouped matmuls and kernels in the analyses: ``ragged_dot_general`` counted in every mode, whether each JAX policy
keeps its outputs (checked on the installed JAX), an uncounted primitive named, and residuals a kernel keeps inside
itself shown as such."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import jaxckpt
from jaxckpt.analysis._flops import count_flops
from jaxckpt.policies._meaning import MATMUL_PROMISES, grouped_matmul_gap, grouped_probe
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt.report import LossTarget, build_report
from jaxckpt.report._compile import uncounted_warning

M, K, N, G = 12, 4, 5, 3
SIZES = jnp.array([4, 4, 4], jnp.int32)


def test_ragged_dot_is_counted_in_every_mode():
  x, w = jnp.ones((M, K)), jnp.ones((G, K, N))
  f = lambda x, w: jax.lax.ragged_dot(x, w, SIZES).sum()  # noqa: E731
  assert count_flops(f, x, w).by_primitive["ragged_dot_general"] == 2 * M * K * N
  # the backward pass: the input gradient [M, N] x [G, N, K] (ragged rows) and the weight gradient [M, K] x [M, N]
  # -> [G, K, N] (ragged contraction): 2·M·K·N each
  grads = count_flops(jax.grad(f, argnums=(0, 1)), x, w)
  assert grads.by_primitive["ragged_dot_general"] == 3 * 2 * M * K * N
  assert grads.uncounted_primitives == ()


def test_grouped_matmul_gap_says_what_the_installed_jax_does():
  args = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4, 4), jnp.float32))
  for name in MATMUL_PROMISES:
    policy = {"offload_dot_with_no_batch_dims": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")}.get(name, lambda: getattr(jax.checkpoint_policies, name))()
    kept = any(r.primitive in ("ragged_dot_general", "device_put")
               for r in saved_residuals(jax.checkpoint(grouped_probe, policy=policy), *args) if r.kind != "argument")
    gap = grouped_matmul_gap(name)
    assert (gap is None) == kept, (name, gap)
    if gap is not None:
      assert f"jax {jax.__version__}'s {name}" in gap and "ragged_dot_general" in gap and "\n" not in gap
  assert grouped_matmul_gap("nothing_saveable") is None  # promises nothing about matmuls


def test_an_uncounted_primitive_is_named():
  assert "FLOPs do not count random_bits" in uncounted_warning(("random_bits",))
  count = count_flops(lambda k: jax.random.normal(k, (8,)), jax.random.key(0))
  assert "random_bits" in count.uncounted_primitives


def _sine(x_ref, o_ref, slope_ref):
  o_ref[...] = jnp.sin(x_ref[...])
  slope_ref[...] = jnp.cos(x_ref[...])  # what the backward pass needs, made inside the kernel


def _run(x):
  """A Pallas kernel (interpret mode, any platform): ``sin(x)`` and its slope ``cos(x)``."""
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return pl.pallas_call(_sine, out_shape=(shape, shape), interpret=True)(x)


@jax.custom_vjp
def kernel(x):
  return _run(x)[0]


def _kernel_fwd(x):
  out, slope = _run(x)
  return out, slope  # the residual: made by the kernel, unnamed


kernel.defvjp(_kernel_fwd, lambda slope, g: (g * slope,))


def _target():
  def loss(params, batch, *, policy):
    block = jaxckpt.checkpoint(lambda w, x: kernel(x @ w), policy, block_type="mlp")
    return jnp.mean(block(params["w"], batch["x"]))

  return LossTarget(loss, params={"w": jax.ShapeDtypeStruct((32, 32), jnp.float32)},
                    batch={"x": jax.ShapeDtypeStruct((8, 32), jnp.float32)}, block_types={"mlp": set()},
                    name="kernel-mlp")


def test_residuals_kept_inside_a_kernel_are_shown_as_such():
  report = build_report(_target(), ["none", "full"], progress=False)
  kept = report.row("none")["residuals"]
  assert kept["in_kernel_bytes"] == 8 * 32 * 4  # the slope the kernel made: [8, 32] float32
  assert any("test_grouped_matmuls.py" in s for s in kept["in_kernel_sources"])
  assert report.row("nothing_saveable")["residuals"]["in_kernel_bytes"] == 0  # recomputed with its region
  warned = [w for w in report.data["warnings"] if "kept inside kernels" in w]
  assert len(warned) == 1 and warned[0].startswith("policy 'none'") and "no name policy" in warned[0]
