"""The data flow between linear layers (:mod:`jaxckpt.analysis._dataflow`): what each matmul of a weight reads as
data, and what only modulates it (adaLN's broadcast scale and shift)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxckpt.analysis._dataflow import MatmulRead, matmul_reads

B, N, D = 2, 4, 8


def _reads(fn, *shapes):
  weights = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  jaxpr = jax.make_jaxpr(fn)(*weights, jax.ShapeDtypeStruct((B, N, D), jnp.float32),
                             jax.ShapeDtypeStruct((B, D), jnp.float32))
  return matmul_reads(jaxpr, range(len(shapes)))


def test_adalns_broadcast_shift_and_scale_modulate_and_the_stream_is_data():
  def block(w_mod, w_in, w_out, x, c):  # x: [B, N, D] tokens, c: [B, D] conditioning
    shift, scale = jnp.split(c @ w_mod, 2, axis=1)                     # [B, D] each
    h = jax.nn.gelu((x * (1 + scale[:, None]) + shift[:, None]) @ w_in)
    return x + h @ w_out

  assert _reads(block, (D, 2 * D), (D, D), (D, D)) == [
      MatmulRead(0, frozenset(), frozenset()), MatmulRead(1, frozenset(), frozenset({0})),
      MatmulRead(2, frozenset({1}), frozenset({0}))]


def test_a_softmax_and_a_repeat_of_grouped_keys_are_data():
  def attention(wq, wk, wo, x, c):
    del c
    q = (x @ wq).reshape(B, N, 2, D // 2)
    k = jnp.repeat((x @ wk).reshape(B, N, 1, D // 2), 2, axis=2)     # grouped query attention's repeat
    probs = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, k).reshape(B, N, D) @ wo

  assert _reads(attention, (D, D), (D, D // 2), (D, D))[-1] == MatmulRead(2, frozenset({0, 1}), frozenset())
