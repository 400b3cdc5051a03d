"""Flash attention on an NVIDIA GPU, behind the kernel seam (:func:`jaxckpt.models.llm._kernels.attention`): the
Pallas Triton kernel and cuDNN's fused attention, both compiled by XLA:GPU without a GPU.

- ``pallas``: JAX's Pallas Triton flash attention (``jax.experimental.pallas.ops.gpu.attention``, forward and backward
  Triton kernels, FlashAttention-2 in blocks of 128 queries and keys; Dao 2023). It compiles for a GPU with no
  library beyond JAX's CUDA plugin. Grouped-query attention is run by repeating each key/value head for its query
  heads (the kernel takes as many key/value heads as query heads), which the compiled bytes include. Its residuals,
  the output and the logsumexp, are named ``context`` here (:data:`jaxckpt.names.CONTEXT`), as the splash kernel
  names its own, so ``minimal_flash`` (MaxText's ``minimal_with_context``) saves them and the backward pass does not
  run the forward kernel again.
- ``cudnn``: cuDNN's fused flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")`` (grouped
  query heads and the causal mask native), what MaxText's GPU recipes run (``attention: cudnn_flash_te``, cuDNN
  through Transformer Engine). XLA:GPU needs cuDNN importable to lower it (``pip install nvidia-cudnn-cu12``); without
  a GPU it compiles cuDNN's workspace as 0 bytes (XLA sizes it in a pass that needs the device), so its bytes are a
  lower bound by that workspace. Its output is named ``context``; its logsumexp is not reachable (a policy that
  saves ``context`` saves the output only).

Measured deviceless (jax 0.10.2, one H100, 32 query / 8 key-value heads of 128, bfloat16, causal, the gradient of
q, k and v): temp per GPU at 1 × 4096 tokens — XLA's einsum attention 5,152 MiB, cuDNN 64.5 MiB (+ its workspace,
not compiled), Pallas 192 MiB; at 2 × 8192: 41,092, 258 and 768 MiB. A Llama-3.1-8B-shaped step (2 layers, 8 GPUs,
8192 tokens each): temp 26,180 MiB with XLA attention, 5,986 with cuDNN, 6,100 with Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import attention as _pallas

from jax.sharding import PartitionSpec

from jaxckpt import names
from jaxckpt.errors import JaxckptError
from jaxckpt.sharding._rules import kernel_split

PALLAS_BLOCK = 128
"""The Pallas kernel's query and key block (``BlockSizes.get_default()``); a sequence longer than it must be a
multiple of it."""


def pallas_supports(seq_len: int, *, sliding_window: int | None, logit_soft_cap: float | None) -> str | None:
  """Why the Pallas kernel cannot run this attention, or ``None`` when it can: it has no soft cap and no sliding
  window (a window as long as the sequence is none), and tiles the sequence in blocks of :data:`PALLAS_BLOCK`."""
  if logit_soft_cap is not None:
    return "it has no logit soft cap"
  if sliding_window is not None and sliding_window < seq_len:
    return "it has no sliding window"
  if seq_len > PALLAS_BLOCK and seq_len % PALLAS_BLOCK:
    return f"it tiles the sequence in blocks of {PALLAS_BLOCK} tokens (seq_len={seq_len})"
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, interpret: bool) -> jax.Array:
  return _pallas.mha(q, k, v, None, sm_scale=1.0, causal=causal, interpret=interpret)


def _flash_fwd(q, k, v, causal, interpret):
  (out, lse), _ = _pallas._mha_forward(q, k, v, None, 1.0, causal, _pallas.BlockSizes.get_default(),  # noqa: SLF001
                                       "triton", None, 2, None, interpret, False, True)
  out = checkpoint_name(out, names.CONTEXT)
  lse = checkpoint_name(lse, names.CONTEXT)
  return out, (q, k, v, out, lse)


def _flash_bwd(causal, interpret, residuals, g):
  q, k, v, out, lse = residuals
  dq, dk, dv, _ = _pallas._mha_backward(1.0, causal, _pallas.BlockSizes.get_default(), "triton", None, 2,  # noqa: SLF001
                                        None, interpret, False, False, (q, k, v, None, out, lse), g)
  return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                     interpret: bool = False) -> jax.Array:
  """Flash attention with the Pallas Triton kernel, its residuals named ``context``.

  Args:
    q: ``[B, S, N, Dh]`` queries, already scaled.
    k: ``[B, S, K, Dh]`` keys, K dividing N (repeated to N heads for the kernel).
    v: ``[B, S, K, Dh]`` values.
    causal: mask future positions.
    interpret: run in Pallas' interpret mode (any platform; slow, for tests).

  Returns:
    ``[B, S, N, Dh]``.
  """
  groups = q.shape[2] // k.shape[2]

  def per_device(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    if groups > 1:  # the kernel takes one key/value head per query head
      k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return _flash(q, k, v, causal, interpret)

  return _per_device(per_device, q, k, v, kernel="pallas")


def _per_device(fn, q: jax.Array, k: jax.Array, v: jax.Array, *, kernel: str) -> jax.Array:
  """``fn(q, k, v)`` on each device's share of the batch and heads (``jax.shard_map`` over the mesh in context,
  :func:`jaxckpt.sharding._rules.kernel_split`): the SPMD partitioner cannot split a kernel's custom call."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q, k, v)
  batch_axes, head_axis = kernel_split(mesh, q.shape[0], q.shape[2], k.shape[2], kernel=kernel)
  if not batch_axes and head_axis is None:
    return fn(q, k, v)
  spec = PartitionSpec(batch_axes or None, None, head_axis, None)  # [B, S, N, Dh]
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    sliding_window: int | None = None) -> jax.Array:
  """cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``), output named
  ``context``.

  Args:
    q: ``[B, S, N, Dh]`` queries, already scaled; k, v: ``[B, S, K, Dh]`` (grouped query heads native).
    causal: mask future positions.
    sliding_window: attend to the last ``sliding_window`` positions only, or ``None``.

  Returns:
    ``[B, S, N, Dh]``.

  Raises:
    JaxckptError: cuDNN is not importable (one line: what to install).
  """
  window = None if sliding_window is None else (sliding_window - 1, 0)

  def per_device(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=causal, local_window_size=window,
                                        implementation="cudnn")

  try:
    out = _per_device(per_device, q, k, v, kernel="cudnn")
  except RuntimeError as err:
    if "cudnn" not in str(err).lower():
      raise
    raise JaxckptError(f"attention='cudnn' needs cuDNN where XLA:GPU compiles ({str(err).strip().splitlines()[0]}): "
                       "pip install nvidia-cudnn-cu12 (about 1.1 GB), or attention='pallas' (no extra library)"
                       ) from None
  return checkpoint_name(out, names.CONTEXT)
