"""The Pallas TPU splash attention kernel behind the LLM family's attention seam: causal or sliding-window masks,
Gemma 2's logit soft cap, grouped-query heads, MaxText's block sizes, and residuals named ``context``.

:func:`splash_attention` takes the layers' layout (``[B, S, N, Dh]`` queries, ``[B, S, K, Dh]`` keys and values),
builds the kernel for the mask (``make_splash_mha`` over a ``MultiHeadMask``), calls it once on every sequence with
the batch folded into the heads and, under a mesh in context, inside ``jax.shard_map`` over that mesh: a Mosaic
kernel cannot be partitioned by XLA, so each chip runs it on its own sequences (split over the batch axes of
:data:`jaxckpt.sharding._rules.LOGICAL_RULES`) and its own heads (split over ``tensor``); every sequence stays whole.
MaxText ``vmap`` s the kernel over the batch instead; folding gives the kernel the same grid (a leading axis of
B·N heads instead of B × N) and works under ``JAX_REMAT3=1``, where jax 0.10.2 cannot ``vmap`` the kernel's
``checkpoint_name`` ("for vmap support, subclass CheckpointName must implement `batch`").

- **Grouped-query attention.** The installed kernel's multi-head form takes ``k, v: [K, S, Dh]`` with K dividing N and
  reads key/value head ``h // (N / K)`` for query head ``h`` (its ``q_heads_per_kv_head``), which is how the query
  projection groups heads (:func:`jaxckpt.models.llm._kernels.xla_attention` groups the same way) and what MaxText's
  ``tpu_flash_attention`` passes. So K/V go in unrepeated: no ``N / K``-fold copy of K and V per layer, one kernel
  call, and the dK/dV kernel sums each group itself. The alternatives were a ``make_splash_mqa`` call
  per KV head (K calls, a ``vmap`` over K) or ``jnp.repeat`` of K/V to N heads (the copy, and a sum in the backward
  pass); neither buys anything here.
- **Checkpoint names.** The kernel tags its forward output and logsumexp with ``residual_checkpoint_name`` =
  :data:`jaxckpt.names.CONTEXT`, so ``save_only_these_names:context`` keeps them (the backward kernels then
  need no forward recompute) and an offload policy can move them to the host, as MaxText's ``context`` does. The
  names sit inside the kernel's ``jax.jit`` (and the ``shard_map``): ``saved_residuals`` lists the two as outputs of
  ``_splash_attention`` (or of ``shard_map``), not as "named 'context'". Under ``JAX_REMAT3=1`` (jax 0.10.2) the
  policy does not see these names (nothing is saved) and ``jax.shard_map`` inside ``jax.checkpoint`` fails
  (``'RematTrace' object has no attribute 'process_shard_map'``): JAX's, measured, not worked around here.
- **Blocks.** :class:`SplashBlockSizes` is MaxText's ``sa_block_*`` (512 tokens each by default) and
  ``sa_use_fused_bwd_kernel``; :meth:`SplashBlockSizes.for_length` caps every block at the sequence length, as
  MaxText does, and checks the kernel's tiling rules in one line each.

Sources: the splash kernel in JAX (``jax.experimental.pallas.ops.tpu.splash_attention``: ``make_splash_mha``,
``BlockSizes``, ``CausalMask``, ``LocalMask``); MaxText's ``AttentionOp.tpu_flash_attention``
(AI-Hypercomputer/maxtext, ``src/maxtext/layers/attention_op.py``: ``sa_block_*`` capped at the sequence length, a
``LocalMask`` of ``(window - 1, …)`` for sliding-window layers, ``jax.shard_map`` with a ``vmap`` over the batch inside).
Shapes: B = batch, S = tokens, N = query heads, K = key/value heads, Dh = head width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from jaxckpt import names
from jaxckpt.sharding._rules import kernel_split, traced_platform
from jaxckpt.errors import JaxckptError

LANES = 128
"""A TPU vreg's lane count: the kernels tile key/value blocks (``kv``, ``kv_compute``, ``kv_dkv``,
``kv_dkv_compute``, ``kv_dq``) in multiples of it (the kernel checks ``bkv % NUM_LANES``, also in interpret mode)."""

_KV_FIELDS = ("kv", "kv_compute", "kv_dkv", "kv_dkv_compute", "kv_dq")
_DQ_FIELDS = ("q_dq", "kv_dq")
_FORWARD_OF = {"kv_compute": "kv", "q_dkv": "q", "kv_dkv": "kv", "kv_dkv_compute": "kv_compute", "q_dq": "q",
               "kv_dq": "kv"}
"""Block field -> the field whose value it takes when ``None`` (a backward block takes its forward twin's)."""


@dataclasses.dataclass(frozen=True)
class SplashBlockSizes:
  """Block sizes of the splash kernel, in tokens: MaxText's ``sa_block_*`` (default 512 each) and
  ``sa_use_fused_bwd_kernel``. A ``None`` block takes its forward twin's value (``kv_compute`` and ``kv_dkv`` the
  resolved ``kv``, ``q_dkv`` and ``q_dq`` the ``q``, ``kv_dkv_compute`` the resolved ``kv_compute``, ``kv_dq`` the
  ``kv``). Blocks change speed and VMEM use, not the numbers (up to float rounding).

  Example::

    >>> SplashBlockSizes().for_length(256).q
    256
    >>> SplashBlockSizes(q=1024, kv=2048).to_kernel().block_kv_dkv
    2048
  """

  q: int = 512  # Query tokens per block of the forward kernel (sa_block_q).
  kv: int = 512  # Key/value tokens per block of the forward kernel (sa_block_kv); a multiple of 128.
  kv_compute: int | None = None  # Key/value tokens per inner step of the forward kernel; divides kv.
  q_dkv: int | None = None  # Query tokens per block of the dK/dV backward kernel.
  kv_dkv: int | None = None  # Key/value tokens per block of the dK/dV backward kernel; a multiple of 128.
  kv_dkv_compute: int | None = None  # Key/value tokens per inner step of the dK/dV kernel; divides kv_dkv.
  q_dq: int | None = None  # Query tokens per block of the dQ backward kernel (unused with fused_bwd).
  kv_dq: int | None = None  # Key/value tokens per block of the dQ backward kernel (unused with fused_bwd).
  fused_bwd: bool = False  # One fused dQ/dK/dV backward kernel (sa_use_fused_bwd_kernel).

  def _resolved(self) -> dict[str, int | None]:
    """``{field: tokens}`` with every ``None`` block replaced by its forward twin's; the dQ blocks ``None`` with
    ``fused_bwd``."""
    out: dict[str, int | None] = {}
    for field in dataclasses.fields(self):
      if field.name == "fused_bwd":
        continue
      value = getattr(self, field.name)
      out[field.name] = out[_FORWARD_OF[field.name]] if value is None else value
    if self.fused_bwd:
      out.update(dict.fromkeys(_DQ_FIELDS))
    return out

  def for_length(self, seq_len: int) -> "SplashBlockSizes":
    """These blocks for sequences of ``seq_len`` tokens: each block ``min(block, seq_len)`` (MaxText caps them so),
    every ``None`` resolved (the dQ blocks stay ``None`` with ``fused_bwd``).

    Args:
      seq_len: tokens per sequence S.

    Returns:
      A :class:`SplashBlockSizes` without ``None`` blocks (but the unused dQ ones) that tiles S.

    Raises:
      JaxckptError: one line: a block below 1; ``seq_len`` not a multiple of a (capped) block
        (``seq_len=1000 is not a multiple of the splash block q=512``); a key/value block that is not a multiple of
        128 (:data:`LANES`, also for blocks capped at a short sequence); ``kv_compute`` not dividing ``kv`` or
        ``kv_dkv_compute`` not dividing ``kv_dkv``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise JaxckptError(f"seq_len={seq_len!r} must be a whole number of tokens ≥ 1")
    given = self._resolved()
    for name, value in given.items():
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise JaxckptError(f"the splash block {_named(self, name, value)} must be a whole number of tokens ≥ 1")
    capped = {name: None if value is None else min(value, seq_len) for name, value in given.items()}
    fix = "choose a seq_len that is, or SplashBlockSizes with blocks dividing it"
    for name, value in capped.items():
      if value is not None and seq_len % value:
        raise JaxckptError(f"seq_len={seq_len} is not a multiple of the splash block {_named(self, name, value)}: "
                           f"{fix}")
    for name in _KV_FIELDS:
      value = capped[name]
      if value is not None and value % LANES:
        capped_at = f" (capped at seq_len={seq_len})" if value == seq_len < given[name] else ""
        raise JaxckptError(f"the splash block {_named(self, name, value)}{capped_at} is not a multiple of {LANES}, "
                           f"the TPU lane width the kernel tiles keys and values by: use key/value blocks and a "
                           f"seq_len that are multiples of {LANES}, or attention='xla'")
    for block, step in (("kv", "kv_compute"), ("kv_dkv", "kv_dkv_compute")):
      if capped[block] % capped[step]:
        raise JaxckptError(f"the splash block {_named(self, step, capped[step])} must divide "
                           f"{_named(self, block, capped[block])}")
    return dataclasses.replace(self, **capped)

  def to_kernel(self) -> splash.BlockSizes:
    """The kernel's ``BlockSizes`` of these blocks (``None`` resolved; no dQ blocks with ``fused_bwd``). Call it on
    :meth:`for_length`'s result: this does not cap or check against a sequence."""
    r = self._resolved()
    return splash.BlockSizes(
        block_q=r["q"], block_kv=r["kv"], block_kv_compute=r["kv_compute"], block_q_dkv=r["q_dkv"],
        block_kv_dkv=r["kv_dkv"], block_kv_dkv_compute=r["kv_dkv_compute"], block_q_dq=r["q_dq"],
        block_kv_dq=r["kv_dq"], use_fused_bwd_kernel=self.fused_bwd)


def _named(blocks: SplashBlockSizes, name: str, value: Any) -> str:
  """``q=512``, or ``q_dkv=512 (None: the q block)`` for a block that took its twin's value."""
  inherited = getattr(blocks, name) is None
  return f"{name}={value}" + (f" (None: the {_FORWARD_OF[name]} block)" if inherited else "")


def _mask(seq_len: int, causal: bool, sliding_window: int | None) -> Any:
  """One head's ``[S, S]`` splash mask (True where query s may attend to key t).

  Causal: t ≤ s. A sliding window of W: s - W < t (the query and the W - 1 tokens before it), MaxText's
  ``LocalMask(window_size=(W - 1, …))``; without ``causal`` the window is two-sided, |s - t| < W. Neither: every
  pair. The window and causality are one ``LocalMask`` (computed inside the kernel, no dense mask is stored).
  """
  shape = (seq_len, seq_len)
  if sliding_window is not None:
    return splash.LocalMask(shape, window_size=(sliding_window - 1, 0 if causal else sliding_window - 1), offset=0)
  return splash.CausalMask(shape) if causal else splash.FullMask(shape)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                     sliding_window: int | None = None, logit_soft_cap: float | None = None,
                     blocks: SplashBlockSizes = SplashBlockSizes(), interpret: bool = False) -> jax.Array:
  """Self-attention by the Pallas TPU splash kernel, split over the mesh in context.

  Query head ``n`` attends with key/value head ``n // (N / K)``. Softmax statistics are kept in float32 inside the
  kernel; its residuals (output and logsumexp) are named ``context``. Under a mesh in context
  (``jax.sharding.get_abstract_mesh()``, set by ``jax.set_mesh``) the call runs in ``jax.shard_map`` over it: the
  batch split over the mesh axes of ``LOGICAL_RULES["activation_batch"]`` of size > 1, heads over ``tensor`` when it
  has size > 1, each sequence whole on its chip. Without a mesh (or with every such axis of size 1) it is called
  directly.

  Args:
    q: ``[B, S, N, Dh]`` queries, already scaled, bfloat16 or float32.
    k: ``[B, S, K, Dh]`` keys, K dividing N (cast to ``q``'s dtype).
    v: ``[B, S, K, Dh]`` values (cast to ``q``'s dtype).
    causal: query s attends to keys t ≤ s only.
    sliding_window: W: attend to the query and the W - 1 tokens before it (s - W < t; two-sided |s - t| < W without
      ``causal``), MaxText's ``LocalMask``; ``None``: no window.
    logit_soft_cap: ``c``: scores become ``tanh(score / c) · c`` before the mask (Gemma 2), or ``None``.
    blocks: block sizes, capped at S and checked by :meth:`SplashBlockSizes.for_length`.
    interpret: run the kernel in Pallas' interpret mode (no platform check): any platform, XLA:CPU included; slow,
      for tests.

  Returns:
    ``[B, S, N, Dh]`` in ``q``'s dtype.

  Raises:
    JaxckptError: one line each: the trace is not compiled for a TPU and ``interpret`` is off; shapes that are not
      ``[B, S, N, Dh]`` / ``[B, S, K, Dh]`` or N not a multiple of K; a bad ``sliding_window`` or ``logit_soft_cap``;
      blocks that do not tile S (:meth:`SplashBlockSizes.for_length`); a batch the mesh's batch axes do not divide;
      N or K not multiples of the mesh's ``tensor`` size.

  Example::

    >>> q = jnp.ones((2, 256, 4, 64)); kv = jnp.ones((2, 256, 2, 64))
    >>> splash_attention(q, kv, kv, blocks=SplashBlockSizes(q=128, kv=128), interpret=True).shape
    (2, 256, 4, 64)
  """
  if not interpret and (platform := traced_platform()) != "tpu":
    raise JaxckptError(f"attention='splash' runs the Pallas TPU kernel, but this step is compiled for {platform}: use "
                       "attention='xla', or splash_interpret=True (Pallas interpret mode: slow, for tests)")
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3] \
      or q.shape[2] % k.shape[2]:
    raise JaxckptError(f"splash_attention takes q [B, S, N, Dh] and k, v [B, S, K, Dh] with N a multiple of K; got "
                       f"q {q.shape}, k {k.shape}, v {v.shape}")
  if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                     or sliding_window < 1):
    raise JaxckptError(f"sliding_window={sliding_window!r} must be a whole number of tokens ≥ 1, or None")
  if logit_soft_cap is not None and not logit_soft_cap > 0:
    raise JaxckptError(f"logit_soft_cap={logit_soft_cap!r} must be > 0, or None")
  batch, seq_len, heads, _ = q.shape
  kv_heads = k.shape[2]
  kernel_blocks = blocks.for_length(seq_len).to_kernel()
  mask = _mask(seq_len, causal, sliding_window)

  def per_chip(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``[b, n, S, Dh]``, ``[b, k, S, Dh]`` ×2 -> ``[b, n, S, Dh]``: one chip's sequences and heads, the batch folded
    into the heads (query head ``i·n + j`` reads key/value head ``(i·n + j) // (n / k) = i·k + j // (n / k)``:
    sequence i's own group), so one kernel call covers every sequence without a ``vmap``."""
    b, n, _, head_dim = q.shape
    kernel = splash.make_splash_mha(
        mask=splash.MultiHeadMask((mask,) * (b * n)), block_sizes=kernel_blocks, head_shards=1, q_seq_shards=1,
        attn_logits_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
        residual_checkpoint_name=names.CONTEXT, interpret=interpret)
    out = kernel(q.reshape(b * n, seq_len, head_dim), k.reshape(-1, seq_len, head_dim),
                 v.reshape(-1, seq_len, head_dim))  # [b·n, S, Dh]
    return out.reshape(b, n, seq_len, head_dim)

  q_t = q.transpose(0, 2, 1, 3)  # [B, N, S, Dh]
  k_t = k.astype(q.dtype).transpose(0, 2, 1, 3)  # [B, K, S, Dh]
  v_t = v.astype(q.dtype).transpose(0, 2, 1, 3)
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes, head_axis = ((), None) if mesh.empty else kernel_split(mesh, batch, heads, kv_heads, kernel="splash")
  if not batch_axes and head_axis is None:
    out = per_chip(q_t, k_t, v_t)
  else:
    spec = PartitionSpec(batch_axes or None, head_axis, None, None)
    out = jax.shard_map(per_chip, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(
        q_t, k_t, v_t)
  return out.transpose(0, 2, 1, 3)  # [B, S, N, Dh]
