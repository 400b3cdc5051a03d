"""Attention kernels behind one seam: the decoder layer calls :func:`attention`, which runs XLA's dot-product attention
or the Pallas splash kernel; the layers above never know which.

- ``xla``: dot-product attention written with ``einsum`` here (grouped-query attention by grouping the query heads of
  each key/value head, causal and sliding-window masks, the logit soft cap ``tanh(x / c) · c``, softmax in float32).
  Its output is tagged ``context`` (:data:`jaxckpt.names.CONTEXT`), so a name policy can save it. Its matmuls
  are ``dot_general`` s, so the dots policies see them; the ``[B, K, G, S, S]`` float32 scores are what makes it
  quadratic in memory.
- ``splash``: the Pallas TPU splash kernel (:mod:`jaxckpt.models.llm._splash`, flash attention in blocks), whose
  residuals (its output and logsumexp) are named ``context`` by the kernel itself (``residual_checkpoint_name``).
- ``pallas`` and ``cudnn``: flash attention on an NVIDIA GPU (:mod:`jaxckpt.models.llm._gpu_kernels`): JAX's Pallas
  Triton kernel (no extra library; residuals named ``context``) and cuDNN's fused attention (needs cuDNN where XLA:GPU
  compiles; its workspace is not in the bytes compiled without a GPU).
- ``auto``: by the platform the trace is compiled for (:func:`jaxckpt.sharding._rules.traced_platform`), from 128
  tokens: ``splash`` on a TPU (MaxText's ``attention: autoselected``, AI-Hypercomputer/maxtext,
  ``layers/attention_op.py``), ``pallas`` on a GPU where the kernel runs the attention (no soft cap, no sliding window
  shorter than the sequence: :func:`~jaxckpt.models.llm._gpu_kernels.pallas_supports`), ``xla`` otherwise.

The seam is MaxText's ``AttentionOp`` (one place that picks dot-product, splash or cuDNN); grouped-query attention is
Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints"; the soft
cap is Gemma 2's (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxckpt import names
from jaxckpt.sharding._rules import traced_platform
from jaxckpt.errors import JaxckptError

from jaxckpt.models.llm._gpu_kernels import cudnn_attention, pallas_attention, pallas_supports
from jaxckpt.models.llm._splash import SplashBlockSizes, splash_attention

ATTENTION_KERNELS: tuple[str, ...] = ("auto", "xla", "splash", "pallas", "cudnn")
"""The ``attention=`` choices of the LLM family."""

SPLASH_MIN_SEQ_LEN = 128
"""``auto`` picks a flash kernel (splash on a TPU, Pallas on a GPU) from this many tokens per sequence (MaxText's
``autoselected``)."""

_MASKED = float(jnp.finfo(jnp.float32).min)
"""The score of a masked query-key pair: exp(min - max) is 0 in float32, and never NaN as -inf - -inf would be."""


def select_kernel(kernel: str, seq_len: int, *, sliding_window: int | None = None,
                  logit_soft_cap: float | None = None) -> str:
  """The kernel ``attention`` runs: ``kernel`` itself, or what ``auto`` means for this trace.

  Args:
    kernel: one of :data:`ATTENTION_KERNELS`.
    seq_len: tokens per sequence S.
    sliding_window, logit_soft_cap: the attention's (``auto`` on a GPU picks ``pallas`` only where it runs them).

  Returns:
    ``kernel``, or for ``auto`` from :data:`SPLASH_MIN_SEQ_LEN` tokens: ``splash`` when the trace is compiled for a
    TPU, ``pallas`` for a GPU where the kernel runs this attention; else ``xla``.

  Raises:
    JaxckptError: an unknown kernel, listing the valid ones; ``pallas`` for an attention it cannot run (saying
      why).
  """
  if kernel not in ATTENTION_KERNELS:
    raise JaxckptError(f"attention={kernel!r} is unknown; valid: {', '.join(ATTENTION_KERNELS)}")
  unsupported = pallas_supports(seq_len, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
  if kernel == "pallas" and unsupported:
    raise JaxckptError(f"attention='pallas' cannot run this attention: {unsupported}; use attention='xla'")
  if kernel != "auto":
    return kernel
  platform = traced_platform()
  if seq_len < SPLASH_MIN_SEQ_LEN:
    return "xla"
  if platform == "tpu":
    return "splash"
  return "pallas" if platform == "gpu" and unsupported is None else "xla"


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, sliding_window: int | None = None,
                  logit_soft_cap: float | None = None) -> jax.Array:
  """Dot-product attention with ``einsum``: grouped-query, masked, soft-capped, softmax in float32.

  Query head ``n`` attends with key/value head ``n // (N / K)`` (heads grouped as the query projection lays them
  out). The scores ``q · k`` are accumulated in float32; the weights are cast back to the dtype of ``v`` for the
  second matmul. The output is tagged ``context``.

  Args:
    q: ``[B, S, N, Dh]`` queries, already scaled (compute dtype, e.g. bfloat16).
    k: ``[B, S, K, Dh]`` keys, K dividing N.
    v: ``[B, S, K, Dv]`` values (Dv may differ from Dh: MLA).
    causal: position s attends to positions ≤ s only.
    sliding_window: attend to the last ``sliding_window`` positions only (s - t < window), or ``None``.
    logit_soft_cap: ``c``: scores become ``tanh(score / c) · c`` before the mask, or ``None``.

  Returns:
    ``[B, S, N, Dv]`` in the dtype of ``v``.
  """
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # [B, S, K, G, Dh]
  scores = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32)  # [B, K, G, S, S] f32
  if logit_soft_cap is not None:
    scores = jnp.tanh(scores / logit_soft_cap) * logit_soft_cap
  mask = _mask(seq, causal, sliding_window)
  if mask is not None:
    scores = jnp.where(mask, scores, _MASKED)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  context = jnp.einsum("bkgst,btkd->bskgd", weights, v).reshape(batch, seq, heads, v.shape[3])  # [B, S, N, Dv]
  return checkpoint_name(context, names.CONTEXT)


def _mask(seq: int, causal: bool, sliding_window: int | None) -> jax.Array | None:
  """``[S, S]`` bool, True where query s may attend to key t; ``None`` when every pair may."""
  s = jnp.arange(seq)[:, None]
  t = jnp.arange(seq)[None, :]
  mask = None
  if causal:
    mask = t <= s
  if sliding_window is not None:
    window = jnp.abs(s - t) < sliding_window
    mask = window if mask is None else mask & window
  return mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, kernel: str = "auto", causal: bool = True,
              sliding_window: int | None = None, logit_soft_cap: float | None = None,
              splash_blocks: SplashBlockSizes | None = None, splash_interpret: bool = False) -> jax.Array:
  """Self-attention by the kernel ``kernel`` picks (the seam every decoder layer calls).

  Args:
    q: ``[B, S, N, Dh]`` queries after RoPE and the query scale (compute dtype).
    k: ``[B, S, K, Dh]`` keys after RoPE; N must be a multiple of K.
    v: ``[B, S, K, Dv]`` values (MLA: Dv < Dh; a kernel other than xla gets them zero-padded to Dh, its output cut
      back to Dv).
    kernel: one of :data:`ATTENTION_KERNELS` (:func:`select_kernel`).
    causal: mask future positions (decoders).
    sliding_window: local attention over the last ``sliding_window`` positions, or ``None`` (global).
    logit_soft_cap: Gemma 2's attention soft cap ``c`` (``tanh(x / c) · c``), or ``None``.
    splash_blocks: the splash kernel's block sizes (default
      :class:`~jaxckpt.models.llm.SplashBlockSizes`: MaxText's 512 tokens).
    splash_interpret: run the splash or Pallas GPU kernel in Pallas' interpret mode (any platform; slow, for
      tests).

  Returns:
    ``[B, S, N, Dh]``, the dtype of ``v``.

  Raises:
    JaxckptError: an unknown kernel; N not a multiple of K; what the splash kernel raises (not a TPU without
      interpret mode, a sequence its blocks do not tile, a batch or heads the mesh does not divide).

  Example::

    >>> q = jnp.ones((2, 16, 4, 8)); kv = jnp.ones((2, 16, 2, 8))
    >>> attention(q, kv, kv, kernel="xla", sliding_window=4).shape
    (2, 16, 4, 8)
  """
  if q.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2] \
      or k.shape[3] != q.shape[3]:
    raise JaxckptError(f"attention takes q [B, S, N, Dh], k [B, S, K, Dh] and v [B, S, K, Dv]; got q {q.shape}, "
                       f"k {k.shape}, v {v.shape}")
  if q.shape[2] % k.shape[2]:
    raise JaxckptError(f"{q.shape[2]} query heads must be a multiple of the {k.shape[2]} key/value heads")
  chosen = select_kernel(kernel, q.shape[1], sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
  if chosen == "xla":
    return xla_attention(q, k, v, causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
  width = v.shape[3]
  if width != q.shape[3]:  # MLA's values are narrower than its queries; the kernels take one head width
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[3] - width))) if width < q.shape[3] else None
    if padded is None:
      raise JaxckptError(f"attention={chosen!r} takes values no wider than queries; got Dv={width} > Dh={q.shape[3]}")
    return attention(q, k, padded, kernel=chosen, causal=causal, sliding_window=sliding_window,
                     logit_soft_cap=logit_soft_cap, splash_blocks=splash_blocks,
                     splash_interpret=splash_interpret)[..., :width]
  if chosen == "pallas":
    return pallas_attention(q, k, v, causal=causal, interpret=splash_interpret)
  if chosen == "cudnn":
    if logit_soft_cap is not None:
      raise JaxckptError("attention='cudnn' has no logit soft cap; use attention='xla'")
    return cudnn_attention(q, k, v, causal=causal, sliding_window=sliding_window)
  return splash_attention(q, k, v, causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                          blocks=SplashBlockSizes() if splash_blocks is None else splash_blocks,
                          interpret=splash_interpret)
