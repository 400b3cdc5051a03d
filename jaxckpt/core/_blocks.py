"""The block math of jaxckpt's layers, written once for both front-ends (:mod:`jaxckpt.nnx._layers` for NNX and
:mod:`jaxckpt.linen` for Linen).

Each block type has one forward function of its sublayers, its input, a dropout key and static flags. The sublayers
are passed as functions (``norm``, ``qkv``, ``out``, ``fc1``... each ``h -> h``: a Flax layer with its weights bound,
``nnx.Linear`` in NNX, ``nn.Dense`` in Linen), so the parameter trees stay those of Flax's own layers in both
front-ends and the arithmetic is the same code in both. The front-ends add only what differs: how parameters are
created and how the call is rematerialized (``nnx.remat``-style :func:`jaxckpt.remat.module_call` or ``nn.remat``).
The mixins :class:`AttentionMath`, :class:`MLPMath` and :class:`ConvMath` give both front-ends' block classes the one
``forward`` that calls these functions with the block's sublayers and fields.

Every function tags its important intermediates with the checkpoint names of :mod:`jaxckpt.names`, so name-based
policies (``save_only_these_names:qkv``) pick the same values in NNX and Linen.

Dropout takes an explicit key: the same key gives the same mask, so the recomputation in the backward pass draws the
mask of the forward pass, and an NNX block and its Linen twin given one key drop the same units.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxckpt import names
from jaxckpt.errors import JaxckptError

Layer = Callable[[jax.Array], jax.Array]
"""A sublayer applied as a function, its weights bound (e.g. an ``nnx.Linear`` or a bound ``nn.Dense``)."""
Sublayer = Callable[..., jax.Array]
"""A remat'd block call ``(x, *, dropout_key, deterministic) -> y``, as :func:`transformer` chains them."""

ATTENTION_IMPLEMENTATIONS = ("xla", "dot_product_attention")
"""Attention choices (``attention=...``): einsum + softmax, or ``jax.nn.dot_product_attention``."""

_ATTENTION_NAMES = {
    "xla": (names.QKV, names.ATTN_WEIGHTS, names.ATTN_CONTEXT, names.ATTN_OUT),
    "dot_product_attention": (names.QKV, names.ATTN_CONTEXT, names.ATTN_OUT),
}


def attention_checkpoint_names(implementation: str = "xla") -> tuple[str, ...]:
  """The checkpoint names :func:`attention` emits with this implementation.

  Args:
    implementation: one of :data:`ATTENTION_IMPLEMENTATIONS`.

  Returns:
    ``(qkv, attn_weights, attn_context, attn_out)`` for ``"xla"``; no ``attn_weights`` for
    ``"dot_product_attention"``.

  Raises:
    JaxckptError: an unknown implementation.
  """
  check_attention(8, 1, implementation)
  return _ATTENTION_NAMES[implementation]


def check_attention(dim: int, num_heads: int, implementation: str) -> None:
  """Checks the arguments of an attention block once, for both front-ends.

  Args:
    dim: model width D.
    num_heads: heads H.
    implementation: the ``attention=`` argument.

  Raises:
    JaxckptError: ``num_heads`` is not a positive divisor of ``dim``, or ``implementation`` is not one of
      :data:`ATTENTION_IMPLEMENTATIONS`.
  """
  if num_heads <= 0 or dim % num_heads:
    raise JaxckptError(f"num_heads={num_heads} must be a positive divisor of dim={dim}")
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise JaxckptError(f"attention={implementation!r} is unknown; valid: {', '.join(ATTENTION_IMPLEMENTATIONS)}")


def check_dropout_rate(rate: float) -> None:
  """Checks a block's dropout rate.

  Args:
    rate: the ``dropout_rate=`` argument.

  Raises:
    JaxckptError: ``rate`` outside [0, 1).
  """
  if not 0.0 <= rate < 1.0:
    raise JaxckptError(f"dropout_rate={rate} must be in [0, 1)")


def dropout(x: jax.Array, rate: float, key: jax.Array | None, deterministic: bool) -> jax.Array:
  """Inverted dropout with an explicit key (same key, same mask: what the recomputation needs).

  Args:
    x: any array.
    rate: share of units dropped, in [0, 1).
    key: PRNG key; may be ``None`` only when dropout is off.
    deterministic: Python bool; ``True`` returns ``x`` unchanged.

  Returns:
    ``x`` with dropped units zeroed and the kept ones scaled by ``1 / (1 - rate)``, same shape and dtype.

  Raises:
    JaxckptError: dropout is on but ``key`` is ``None``.
  """
  if deterministic or rate == 0.0:
    return x
  if key is None:
    raise JaxckptError("dropout is on (deterministic=False, rate > 0) but no dropout_key was given")
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def split_key(key: jax.Array | None, n: int) -> list[jax.Array | None]:
  """``n`` keys from ``key`` (``jax.random.split``), or ``n`` times ``None`` when there is no key.

  Args:
    key: PRNG key or ``None``.
    n: number of keys.

  Returns:
    A list of ``n`` keys (or ``None`` s).
  """
  return [None] * n if key is None else list(jax.random.split(key, n))


def attention(
    x: jax.Array,
    *,
    norm: Layer,
    qkv: Layer,
    out: Layer,
    num_heads: int,
    dropout_rate: float,
    dropout_key: jax.Array | None,
    deterministic: bool,
    causal: bool = False,
    implementation: str = "xla",
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
  """Pre-LN multi-head self-attention with a residual: ``x + Dropout(Wo · softmax(QKᵀ/√K) V)`` (Vaswani et al. 2017).

  Emits ``qkv`` ``[B, T, 3, H, K]``, ``attn_weights`` ``[B, H, T, T]`` (``"xla"`` only), ``attn_context``
  ``[B, T, H, K]`` and ``attn_out`` ``[B, T, D]``.

  Args:
    x: ``[B, T, D]`` float32 or bfloat16.
    norm: the LayerNorm, ``[..., D] -> [..., D]``.
    qkv: the fused projection, ``[..., D] -> [..., 3·D]``.
    out: the output projection, ``[..., D] -> [..., D]``.
    num_heads: heads H (divides D).
    dropout_rate: dropout on the attention weights (``"xla"`` only) and on the output, in [0, 1).
    dropout_key: PRNG key, split into one for the weights and one for the output; ``None`` when dropout is off.
    deterministic: Python bool; ``True`` turns dropout off.
    causal: mask future tokens (decoders).
    implementation: ``"xla"`` (``einsum`` + softmax: dots policies see its matmuls) or ``"dot_product_attention"``
      (``jax.nn.dot_product_attention``; cuDNN flash attention on GPU in bf16/fp16, a custom call dots policies do
      not save: save it by name, ``attn_context``).
    dtype: compute dtype of the attention weights.

  Returns:
    ``[B, T, D]``, the dtype of ``x``.

  Raises:
    JaxckptError: dropout on without a key.
  """
  batch, tokens, dim = x.shape
  head_dim = dim // num_heads
  key_w, key_o = split_key(dropout_key, 2)
  h = checkpoint_name(qkv(norm(x)).reshape(batch, tokens, 3, num_heads, head_dim), names.QKV)
  q, k, v = h[:, :, 0], h[:, :, 1], h[:, :, 2]  # [B, T, H, K]
  if implementation == "dot_product_attention":
    context = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  else:
    logits = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    if causal:
      logits = jnp.where(jnp.tril(jnp.ones((tokens, tokens), bool)), logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)  # [B, H, T, T]
    weights = checkpoint_name(dropout(weights, dropout_rate, key_w, deterministic), names.ATTN_WEIGHTS)
    context = jnp.einsum("bhts,bshk->bthk", weights, v)
  context = checkpoint_name(context, names.ATTN_CONTEXT)  # [B, T, H, K]
  y = checkpoint_name(out(context.reshape(batch, tokens, dim)), names.ATTN_OUT)
  return x + dropout(y, dropout_rate, key_o, deterministic).astype(x.dtype)


def _residual_pair(x, first, second, hidden_name, out_name, dropout_rate, dropout_key, deterministic, norm):
  """``x + Dropout(second(gelu(first(norm(x)))))`` with the hidden and output tagged: the MLP and conv blocks."""
  hidden = checkpoint_name(jax.nn.gelu(first(norm(x))), hidden_name)
  y = checkpoint_name(second(hidden), out_name)
  return x + dropout(y, dropout_rate, dropout_key, deterministic).astype(x.dtype)


def mlp(
    x: jax.Array,
    *,
    norm: Layer,
    fc1: Layer,
    fc2: Layer,
    dropout_rate: float,
    dropout_key: jax.Array | None,
    deterministic: bool,
) -> jax.Array:
  """Pre-LN residual MLP: ``x + Dropout(W2 · gelu(W1 · LN(x)))``.

  Emits ``mlp_hidden`` ``[..., F]`` and ``mlp_out`` ``[..., D]``.

  Args:
    x: ``[..., D]`` float32 or bfloat16.
    norm: the LayerNorm over D.
    fc1: ``[..., D] -> [..., F]``.
    fc2: ``[..., F] -> [..., D]``.
    dropout_rate: dropout on the output, in [0, 1).
    dropout_key: PRNG key (``None`` when dropout is off).
    deterministic: Python bool; ``True`` turns dropout off.

  Returns:
    ``[..., D]``, the dtype of ``x``.

  Raises:
    JaxckptError: dropout on without a key.
  """
  return _residual_pair(x, fc1, fc2, names.MLP_HIDDEN, names.MLP_OUT, dropout_rate, dropout_key, deterministic, norm)


def conv(
    x: jax.Array,
    *,
    norm: Layer,
    conv1: Layer,
    conv2: Layer,
    dropout_rate: float,
    dropout_key: jax.Array | None,
    deterministic: bool,
) -> jax.Array:
  """Pre-norm residual conv block: ``x + Dropout(conv2(gelu(conv1(LN(x)))))`` (LayerNorm over channels).

  Emits ``conv_hidden`` and ``conv_out``, both ``[B, h, w, C]``.

  Args:
    x: ``[B, h, w, C]`` float32 or bfloat16.
    norm: the LayerNorm over C.
    conv1: ``[B, h, w, C] -> [B, h, w, C]`` ('SAME' padding, stride 1).
    conv2: the same.
    dropout_rate: dropout on the output, in [0, 1).
    dropout_key: PRNG key (``None`` when dropout is off).
    deterministic: Python bool; ``True`` turns dropout off.

  Returns:
    ``[B, h, w, C]``, the dtype of ``x``.

  Raises:
    JaxckptError: dropout on without a key.
  """
  return _residual_pair(x, conv1, conv2, names.CONV_HIDDEN, names.CONV_OUT, dropout_rate, dropout_key, deterministic,
                        norm)


def transformer(
    x: jax.Array, *, attn: Sublayer, mlp_block: Sublayer, dropout_key: jax.Array | None, deterministic: bool
) -> jax.Array:
  """A pre-LN Transformer layer: the attention sublayer then the MLP sublayer, each its own remat'd block.

  Args:
    x: ``[B, T, D]``.
    attn: the attention block call ``(x, *, dropout_key, deterministic) -> [B, T, D]``.
    mlp_block: the MLP block call, same signature.
    dropout_key: PRNG key, split in two (attention first); ``None`` when dropout is off.
    deterministic: Python bool; ``True`` turns dropout off.

  Returns:
    ``[B, T, D]``.
  """
  key_attn, key_mlp = split_key(dropout_key, 2)
  x = attn(x, dropout_key=key_attn, deterministic=deterministic)
  return mlp_block(x, dropout_key=key_mlp, deterministic=deterministic)


class BlockMath:
  """Mixin of both front-ends' blocks (NNX and Linen): ``forward``, the block's math without remat.

  The front-end's ``__call__`` runs ``forward`` under its remat with the policy of the block type. Subclasses read
  their sublayers and settings from attributes of the same names in NNX and Linen (``norm``, ``qkv``, ``out``,
  ``num_heads``, ``dropout_rate``...).
  """

  def forward(self, x: jax.Array, dropout_key: jax.Array | None, deterministic: bool) -> jax.Array:
    """The block's math, without remat.

    Args:
      x: input activations (shape per block type), float32 or bfloat16.
      dropout_key: PRNG key, or ``None`` when dropout is off.
      deterministic: Python bool; ``True`` turns dropout off.

    Returns:
      Output of the same shape and dtype as ``x``.
    """
    raise NotImplementedError


class AttentionMath(BlockMath):
  """``forward`` = :func:`attention` with sublayers ``norm``, ``qkv``, ``out`` and fields ``num_heads``,
  ``dropout_rate``, ``causal``, ``attention`` (the implementation) and ``dtype``."""

  def forward(self, x, dropout_key, deterministic):
    """``x: [B, T, D]`` -> ``[B, T, D]``; see :func:`attention`."""
    return attention(
        x, norm=self.norm, qkv=self.qkv, out=self.out, num_heads=self.num_heads, dropout_rate=self.dropout_rate,
        dropout_key=dropout_key, deterministic=deterministic, causal=self.causal, implementation=self.attention,
        dtype=self.dtype,
    )


class MLPMath(BlockMath):
  """``forward`` = :func:`mlp` with sublayers ``norm``, ``fc1``, ``fc2`` and field ``dropout_rate``."""

  def forward(self, x, dropout_key, deterministic):
    """``x: [..., D]`` -> ``[..., D]``; see :func:`mlp`."""
    return mlp(x, norm=self.norm, fc1=self.fc1, fc2=self.fc2, dropout_rate=self.dropout_rate,
               dropout_key=dropout_key, deterministic=deterministic)


class ConvMath(BlockMath):
  """``forward`` = :func:`conv` with sublayers ``norm``, ``conv1``, ``conv2`` and field ``dropout_rate``."""

  def forward(self, x, dropout_key, deterministic):
    """``x: [B, h, w, C]`` -> ``[B, h, w, C]``; see :func:`conv`."""
    return conv(x, norm=self.norm, conv1=self.conv1, conv2=self.conv2, dropout_rate=self.dropout_rate,
                dropout_key=dropout_key, deterministic=deterministic)
