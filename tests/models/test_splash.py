"""The Pallas splash kernel behind the LLM family's attention seam (:mod:`jaxckpt.models.llm._splash`).

On XLA:CPU the kernel runs in Pallas' interpret mode (``interpret=True``): its forward and its gradients (q, k, v)
must equal a plain einsum attention written here, for causal, sliding-window, soft-capped and grouped-query
attention; its residuals must carry the checkpoint name ``context``. With libtpu (the ``tpu`` extra) the gradient is
compiled by the TPU compiler for a v5e:2x2 topology under its mesh (``jax.set_mesh``), as the step core traces it:
skipped without libtpu (the ``[tpu]`` extra), unless ``JAXCKPT_REQUIRE_TPU=1`` (``tests/extras.py``). Bad inputs are
one line.

Shapes are tiny (B=2, S=256 in two blocks of 128, N=4, K=2, Dh=64, float32): each interpreted case runs in a few
seconds on 2 cores. Key/value blocks cannot be smaller than 128 tokens (the kernel tiles them by the TPU's 128 lanes,
in interpret mode too), so S=256 is the shortest sequence with more than one block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxckpt import sharding as topology
from jaxckpt import names
from jaxckpt.errors import JaxckptError
from jaxckpt.models.llm._splash import LANES, SplashBlockSizes, splash_attention
from tests.extras import needs_libtpu
from tests.numerics import C, assert_trees_close, unit_roundoff


BATCH, SEQ, HEAD_DIM = 2, 256, 64
BLOCKS = SplashBlockSizes(q=128, kv=128)
"""Two blocks per sequence: the kernel's online softmax crosses a block boundary, and the causal mask skips a block."""

DEPTH = 2
"""The suite's float-closeness rule (tests/numerics.py) with depth 2: attention is two matmuls deep (q·kᵀ, then p·v).
Both sides compute in float32; the kernel sums the softmax online over key blocks (rescaling by exp(m_old - m_new))
and its backward kernels recompute the probabilities from the saved logsumexp, so the two differ by summation order
only: measured ≤ 10 u of the largest magnitude (u = 2⁻²⁴) on every case here, natively and under
``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` or ``SSE4_2``, against the rule's 32 u. A wrong mask or cap is far outside: a
window one token shorter moves the values by ≥ 0.17, no cap by ≥ 0.9 of the largest magnitude (the window and cap
cases check that their near misses fail the rule by 10×)."""

TOLERANCE = C * unit_roundoff(np.float32) * DEPTH
"""The rule's limit as a fraction of the largest magnitude (3.8e-6), for the near-miss checks."""


def reference_attention(q, k, v, *, causal=True, sliding_window=None, logit_soft_cap=None):
  """Plain attention with ``einsum``: K/V repeated to the N query heads (head n reads KV head n // (N/K)), scores in
  float32 at the highest precision, ``tanh(s/c)·c``, the mask from token positions, softmax over keys.

  q: [B, S, N, Dh]; k, v: [B, S, K, Dh] -> [B, S, N, Dh]."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)  # [B, S, N, Dh]
  scores = jnp.einsum("bsnd,btnd->bnst", q, k, precision=jax.lax.Precision.HIGHEST)  # [B, N, S, S]
  if logit_soft_cap is not None:
    scores = jnp.tanh(scores / logit_soft_cap) * logit_soft_cap
  s = np.arange(q.shape[1])[:, None]  # query position
  t = np.arange(q.shape[1])[None, :]  # key position
  allowed = np.ones((q.shape[1],) * 2, bool)
  if causal:
    allowed &= t <= s
  if sliding_window is not None:
    allowed &= (s - t < sliding_window) if causal else (np.abs(s - t) < sliding_window)
  weights = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
  return jnp.einsum("bnst,btnd->bsnd", weights, v, precision=jax.lax.Precision.HIGHEST)


def _inputs(heads, kv_heads, *, batch=BATCH, seq=SEQ, head_dim=HEAD_DIM, seed=0):
  """q [B, S, N, Dh] scaled by Dh^-1/2 as the layers scale it, k and v [B, S, K, Dh], a cotangent like q; float32."""
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32) * head_dim ** -0.5
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)
  return q, k, v, jax.random.normal(kc, q.shape, jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(attend, q, k, v, cotangent):
  """``(out, dq, dk, dv)`` of ``attend(q, k, v)`` pulled back along ``cotangent``."""
  out, pullback = jax.vjp(attend, q, k, v)
  return (out, *pullback(cotangent))


def _assert_close(actual, expected, what):
  assert_trees_close(dict(zip(("output", "dq", "dk", "dv"), actual)),
                     dict(zip(("output", "dq", "dk", "dv"), expected)), depth=DEPTH, what=f"splash vs einsum, {what}")


def _error(actual, expected) -> float:
  return max(float(jnp.max(jnp.abs(a - e)) / jnp.max(jnp.abs(e))) for a, e in zip(actual, expected))


CASES = {
    "causal-gqa": dict(heads=4, kv_heads=2, causal=True),
    "sliding-window": dict(heads=4, kv_heads=2, causal=True, sliding_window=100),
    "soft-cap": dict(heads=4, kv_heads=2, causal=True, logit_soft_cap=1.0),
    "mqa-two-sided-window-soft-cap": dict(heads=4, kv_heads=1, causal=False, sliding_window=70, logit_soft_cap=2.0),
}
"""Every case has K < N (grouped-query; the last K = 1) and B = 2 (a batch mixed up with the heads would show).
Windows of 100 and 70 tokens cut across the 128-token blocks."""


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_equal_einsum_attention(case):
  kwargs = dict(CASES[case])
  q, k, v, cotangent = _inputs(kwargs.pop("heads"), kwargs.pop("kv_heads"))
  kernel = _value_and_grads(functools.partial(splash_attention, blocks=BLOCKS, interpret=True, **kwargs),
                            q, k, v, cotangent)
  expected = _value_and_grads(functools.partial(reference_attention, **kwargs), q, k, v, cotangent)
  assert kernel[0].shape == q.shape and kernel[0].dtype == q.dtype
  _assert_close(kernel, expected, case)
  if "sliding_window" in kwargs:  # the tolerance tells the window from one a token shorter
    shorter = dict(kwargs, sliding_window=kwargs["sliding_window"] - 1)
    near_miss = _value_and_grads(functools.partial(reference_attention, **shorter), q, k, v, cotangent)
    assert _error(kernel, near_miss) > 10 * TOLERANCE
  if "logit_soft_cap" in kwargs:  # and the cap from no cap
    uncapped = dict(kwargs, logit_soft_cap=None)
    assert _error(kernel, _value_and_grads(functools.partial(reference_attention, **uncapped), q, k, v,
                                           cotangent)) > 10 * TOLERANCE


def _residual_sizes(fn, policy, *args):
  """Sorted (size, dtype) of what ``jax.checkpoint(fn, policy=policy)`` saves for the backward pass."""
  return sorted((r[0].size, str(r[0].dtype)) for r in saved_residuals(jax.checkpoint(fn, policy=policy), *args))


def test_the_kernels_residuals_are_named_context_and_saving_them_keeps_the_gradients():
  q, k, v, cotangent = _inputs(4, 2)
  attend = functools.partial(splash_attention, blocks=BLOCKS, interpret=True)

  def loss(q, k, v):
    return jnp.sum(attend(q, k, v))

  policies = jax.checkpoint_policies
  nothing = _residual_sizes(loss, policies.nothing_saveable, q, k, v)
  context = _residual_sizes(loss, policies.save_only_these_names(names.CONTEXT), q, k, v)
  other = _residual_sizes(loss, policies.save_only_these_names(names.QUERY_PROJ), q, k, v)
  extra = list(context)
  for item in nothing:
    extra.remove(item)
  tokens = BATCH * 4 * SEQ  # one row per sequence, query head and position
  assert sorted(extra) == [(tokens, "float32"), (tokens * HEAD_DIM, "float32")]  # logsumexp [.., S], output [.., S, Dh]
  assert other == nothing  # another name does not catch them

  saved = jax.checkpoint(attend, policy=policies.save_only_these_names(names.CONTEXT))
  _assert_close(_value_and_grads(saved, q, k, v, cotangent),
                _value_and_grads(reference_attention, q, k, v, cotangent), "save_only_these_names:context")


def test_block_sizes_resolve_cap_and_map_to_the_kernel():
  assert SplashBlockSizes().for_length(256) == SplashBlockSizes(256, 256, 256, 256, 256, 256, 256, 256)
  assert SplashBlockSizes().for_length(4096) == SplashBlockSizes(512, 512, 512, 512, 512, 512, 512, 512)
  blocks = SplashBlockSizes(q=1024, kv=2048, kv_compute=512, q_dkv=2048, fused_bwd=True).for_length(8192)
  assert blocks == SplashBlockSizes(1024, 2048, 512, 2048, 2048, 512, None, None, True)  # kv_dkv_compute: kv_compute's
  kernel = blocks.to_kernel()
  assert (kernel.block_q, kernel.block_kv, kernel.block_kv_compute, kernel.block_q_dkv, kernel.block_kv_dkv,
          kernel.block_kv_dkv_compute, kernel.block_q_dq, kernel.block_kv_dq, kernel.use_fused_bwd_kernel) == \
      (1024, 2048, 512, 2048, 2048, 512, None, None, True)
  assert SplashBlockSizes().to_kernel().block_kv_dq == 512 and not SplashBlockSizes().to_kernel().use_fused_bwd_kernel


# --- bad inputs: one line each ---


def _one_line(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("blocks, seq_len, expected", [
    (SplashBlockSizes(), 1000, "seq_len=1000 is not a multiple of the splash block q=512: choose a seq_len that is"),
    (SplashBlockSizes(q=128, kv=128, q_dkv=96), 256, "seq_len=256 is not a multiple of the splash block q_dkv=96"),
    (SplashBlockSizes(q=256, kv=128), 384, "seq_len=384 is not a multiple of the splash block q=256"),
    (SplashBlockSizes(), 192, "the splash block kv=192 (capped at seq_len=192) is not a multiple of 128"),
    (SplashBlockSizes(q=64, kv=64), 256, "the splash block kv=64 is not a multiple of 128"),
    (SplashBlockSizes(kv=256, kv_compute=512), 1024, "the splash block kv_compute=512 must divide kv=256"),
    (SplashBlockSizes(q=0), 256, "the splash block q=0 must be a whole number of tokens ≥ 1"),
], ids=["seq-1000", "backward-block", "seq-384", "short-seq", "small-kv", "kv-compute", "zero"])
def test_blocks_that_do_not_tile_the_sequence_are_one_line(blocks, seq_len, expected):
  with pytest.raises(JaxckptError) as excinfo:
    blocks.for_length(seq_len)
  assert expected in _one_line(excinfo)
  assert LANES == 128


def test_a_sequence_the_blocks_do_not_divide_is_one_line_from_the_kernel_call():
  q, k, v, _ = _inputs(4, 2, seq=384)
  with pytest.raises(JaxckptError) as excinfo:
    jax.eval_shape(functools.partial(splash_attention, blocks=SplashBlockSizes(q=256, kv=128), interpret=True),
                   q, k, v)
  assert "seq_len=384 is not a multiple of the splash block q=256" in _one_line(excinfo)


def test_off_tpu_without_interpret_mode_is_one_line():
  q, k, v, _ = _inputs(4, 2)
  with pytest.raises(JaxckptError) as excinfo:
    jax.eval_shape(functools.partial(splash_attention, blocks=BLOCKS), q, k, v)
  assert _one_line(excinfo) == (
      f"attention='splash' runs the Pallas TPU kernel, but this step is compiled for {jax.default_backend()}: use "
      "attention='xla', or splash_interpret=True (Pallas interpret mode: slow, for tests)")


@pytest.mark.parametrize("axes, heads, kv_heads, expected", [
    ({"fsdp": 2, "tensor": 4}, 4, 2, "N=4 query heads and K=2 key/value heads are not both multiples of tensor=4"),
    ({"tensor": 2}, 4, 1, "N=4 query heads and K=1 key/value heads are not both multiples of tensor=2"),
    ({"data": 2, "fsdp": 2}, 4, 2, "splits the batch over data×fsdp=4 of the mesh {'data': 2, 'fsdp': 2}, but "
                                   "batch=2 is not a multiple of it"),
], ids=["heads-over-tensor-4", "mqa-over-tensor", "batch"])
def test_a_mesh_that_cannot_split_the_call_is_one_line(axes, heads, kv_heads, expected):
  q, k, v, _ = _inputs(heads, kv_heads)
  mesh = AbstractMesh(tuple(axes.values()), tuple(axes))
  with pytest.raises(JaxckptError) as excinfo, jax.sharding.use_abstract_mesh(mesh):
    jax.eval_shape(functools.partial(splash_attention, blocks=BLOCKS, interpret=True), q, k, v)
  assert expected in _one_line(excinfo)


def test_bad_shapes_windows_and_caps_are_one_line():
  q, k, v, _ = _inputs(4, 2)
  for call, expected in [
      (lambda: splash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), interpret=True),
       "with N a multiple of K; got q (2, 256, 4, 64), k (2, 256, 3, 64)"),
      (lambda: splash_attention(q, k, v, sliding_window=0, interpret=True), "sliding_window=0 must be"),
      (lambda: splash_attention(q, k, v, logit_soft_cap=-1.0, interpret=True), "logit_soft_cap=-1.0 must be > 0"),
  ]:
    with pytest.raises(JaxckptError) as excinfo:
      jax.eval_shape(call)
    assert expected in _one_line(excinfo)


# --- with libtpu: the TPU compiler, no TPU ---


@needs_libtpu
@pytest.mark.parametrize("mesh_spec, spec", [
    ("fsdp=4", PartitionSpec("fsdp")),
    ("fsdp=2,tensor=2", PartitionSpec("fsdp", None, "tensor")),
], ids=["fsdp", "fsdp-tensor"])
def test_the_gradient_compiles_for_a_tpu_topology_under_its_mesh(mesh_spec, spec):
  """The Mosaic kernels (forward, dQ, dK/dV) inside ``jax.shard_map`` over a v5e:2x2 mesh, under
  ``save_only_these_names:context``: the backward pass reuses the saved forward (3 kernels, 4 when nothing is
  saved), and each chip holds a quarter of q, k and v (its sequences, and its heads over ``tensor``)."""
  mesh = topology.get_topology("v5e:2x2").mesh(mesh_spec)
  batch, heads, kv_heads, head_dim = 4, 4, 2, 128
  args = [jax.ShapeDtypeStruct((batch, SEQ, n, head_dim), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
          for n in (heads, kv_heads, kv_heads)]

  def grad(policy):
    def loss(q, k, v):
      attend = jax.checkpoint(functools.partial(splash_attention, blocks=BLOCKS), policy=policy)
      return jnp.sum(attend(q, k, v).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # the loss needs the forward kernel's output

  with jax.set_mesh(mesh):
    lowered = grad(jax.checkpoint_policies.save_only_these_names(names.CONTEXT)).lower(*args)
    recomputed = grad(jax.checkpoint_policies.nothing_saveable).lower(*args)
  assert lowered.as_text().count("@tpu_custom_call") == 3 and recomputed.as_text().count("@tpu_custom_call") == 4
  stats = lowered.compile().memory_analysis()
  total = batch * SEQ * (heads + 2 * kv_heads) * head_dim * 2  # bytes of q, k and v in bfloat16
  assert stats.argument_size_in_bytes == total // 4
  assert total // 4 < stats.output_size_in_bytes < total // 2  # the gradients split as q, k, v are, and the loss
