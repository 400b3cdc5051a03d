"""The image classifiers jaxckpt ships, built from its remat-wrapped NNX blocks, with frozen configs.

- ``vit``: a small conv stem, then pre-LN Transformer layers (block types ``attn`` and ``mlp``), mean pool, head.
- ``mlp``: flattened pixels, a linear embedding, residual MLP blocks (block type ``mlp``), head.
- ``cnn``: a conv stem, residual conv blocks (block type ``conv``), global average pool, head.

Every model maps ``x: [B, H, W, C]`` float images to ``[B, num_classes]`` float32 logits with the call signature
``model(x, *, dropout_key=None, deterministic=True)``; ``model.features(x, ...)`` gives what its ``head`` reads
(``[B, D]`` float32). Their registry entries (presets, builders, batches, losses) are :mod:`jaxckpt.models._registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.models._configs import check_config
from jaxckpt.models._configs import compute_dtype as _dtype
from jaxckpt.errors import JaxckptError
from jaxckpt.nnx._layers import ConvBlock, MLPBlock, Stack, TransformerBlock

IMAGE_SHAPE: tuple[int, int, int] = (8, 8, 1)
"""``(H, W, C)`` of the shipped image models' inputs: scikit-learn's digits, as the classifier experiment uses."""
NUM_CLASSES = 10
"""Classes of the shipped image models (digits)."""
DEFAULT_BATCH_SIZE = 64
"""Examples per step of an image classifier: the classifier experiment's default. A language model's default is its
preset's ``batch_size``."""


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Vision Transformer with a conv stem (``vit``)."""

  num_layers: int = 4  # Transformer layers.
  dim: int = 64  # Model width D.
  num_heads: int = 4  # Attention heads H (divides D).
  mlp_dim: int = 128  # MLP hidden width F.
  stem_channels: int = 32  # Channels of the 3×3 stem conv.
  patch_size: int = 2  # Side of the square patch (pixels) each token covers after the stem; tokens = (H/p)·(W/p).
  dropout_rate: float = 0.1  # Dropout in every sublayer.
  scan: bool = True  # Scan over layers (True) or unroll them.
  structure: str = "block"  # Checkpoint structure of the layer stack: block, every:K, nested[:D] (jaxckpt.core._structure).
  compute_dtype: str = "float32"  # "float32" or "bfloat16".

  def __post_init__(self):
    check_config(self)


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Residual MLP on flattened pixels (``mlp``)."""

  num_layers: int = 4  # Residual MLP blocks.
  dim: int = 256  # Width D.
  hidden_dim: int = 512  # Hidden width F.
  dropout_rate: float = 0.1
  scan: bool = True
  structure: str = "block"
  compute_dtype: str = "float32"

  def __post_init__(self):
    check_config(self)


@dataclasses.dataclass(frozen=True)
class CNNConfig:
  """Residual CNN (``cnn``)."""

  num_layers: int = 4  # Residual conv blocks.
  channels: int = 64  # Channels C.
  kernel_size: int = 3  # Kernel side (pixels).
  dropout_rate: float = 0.1
  scan: bool = True
  structure: str = "block"
  compute_dtype: str = "float32"

  def __post_init__(self):
    check_config(self)


class ImageClassifier(nnx.Module):
  """Base of the image classifiers: ``embed_inputs`` → ``layers`` (a :class:`~jaxckpt.nnx._layers.Stack`) → ``norm`` →
  ``pool`` → ``head``. Subclasses set the submodules and define :meth:`embed_inputs` (and :meth:`pool`)."""

  dtype: jnp.dtype

  def embed_inputs(self, x: jax.Array) -> jax.Array:
    """The stack's input from images.

    Args:
      x: ``[B, H, W, C]`` in the compute dtype.

    Returns:
      The first block's input (``[B, T, D]`` tokens, ``[B, D]`` vectors or ``[B, h, w, C']`` maps).
    """
    raise NotImplementedError

  def pool(self, h: jax.Array) -> jax.Array:
    """The features the head reads from the normalised stack output (default: as they are).

    Args:
      h: the last block's output after ``norm``.

    Returns:
      ``[B, D]``.
    """
    return h

  def features(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """What ``head`` reads, for extra heads (:mod:`jaxckpt.models._multitask`).

    Args:
      x: ``[B, H, W, C]`` float images.
      dropout_key: PRNG key for dropout; required when ``deterministic=False`` and the dropout rate is > 0.
      deterministic: ``True`` turns dropout off (evaluation).

    Returns:
      ``[B, D]`` float32 features.
    """
    h = self.layers(self.embed_inputs(x.astype(self.dtype)), dropout_key=dropout_key, deterministic=deterministic)
    return self.pool(self.norm(h)).astype(jnp.float32)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Class logits.

    Args:
      x: ``[B, H, W, C]`` float images.
      dropout_key: as in :meth:`features`.
      deterministic: as in :meth:`features`.

    Returns:
      ``[B, K]`` float32 logits.
    """
    return self.head(self.features(x, dropout_key=dropout_key, deterministic=deterministic))


def _stack(config: Any, make_block: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> Stack:
  """The config's ``num_layers`` blocks, scanned or not, with its checkpoint structure."""
  return Stack(make_block, config.num_layers, scan=config.scan, structure=config.structure, rngs=rngs)


class ViT(ImageClassifier):
  """Conv-stem Vision Transformer: conv3×3 → gelu → patchify conv → + positions → L Transformer layers → mean → head.

  Args:
    config: :class:`ViTConfig`.
    image_shape: ``(H, W, C)`` of one image; ``patch_size`` must divide H and W.
    num_classes: K ≥ 2.
    policy: policy spec with block types ``attn`` and ``mlp``.
    rngs: initialisation keys (keyword-only).

  Raises:
    JaxckptError: ``patch_size`` does not divide the image, or a bad config value.
  """

  def __init__(self, config: ViTConfig, *, image_shape: tuple[int, int, int], num_classes: int, rngs: nnx.Rngs):
    height, width, channels = image_shape
    p = config.patch_size
    if p < 1 or height % p or width % p:
      raise JaxckptError(f"patch_size={p} must divide the image height {height} and width {width}")
    dtype = _dtype(config.compute_dtype)
    self.dtype = dtype
    self.stem = nnx.Conv(channels, config.stem_channels, (3, 3), padding="SAME", dtype=dtype, rngs=rngs)
    self.patch = nnx.Conv(config.stem_channels, config.dim, (p, p), strides=(p, p), dtype=dtype, rngs=rngs)
    tokens = (height // p) * (width // p)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (tokens, config.dim)))
    self.layers = _stack(config, lambda r: TransformerBlock(
        config.dim, config.num_heads, config.mlp_dim, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r), rngs)
    self.norm = nnx.LayerNorm(config.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.dim, num_classes, rngs=rngs)

  def embed_inputs(self, x: jax.Array) -> jax.Array:
    """``[B, H, W, C]`` -> tokens ``[B, T, D]`` (stem, patches, positions)."""
    h = self.patch(jax.nn.gelu(self.stem(x)))  # [B, H/p, W/p, D]
    return h.reshape(h.shape[0], -1, h.shape[-1]) + self.pos[...].astype(self.dtype)  # [B, T, D]

  def pool(self, h: jax.Array) -> jax.Array:
    """Mean over tokens: ``[B, T, D]`` -> ``[B, D]``."""
    return h.mean(axis=1)


class ResidualMLP(ImageClassifier):
  """Flatten → Linear(H·W·C, D) → L residual MLP blocks → LayerNorm → head.

  Args:
    config: :class:`MLPConfig`.
    image_shape: ``(H, W, C)``.
    num_classes: K ≥ 2.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, config: MLPConfig, *, image_shape: tuple[int, int, int], num_classes: int, rngs: nnx.Rngs):
    dtype = _dtype(config.compute_dtype)
    self.dtype = dtype
    features = image_shape[0] * image_shape[1] * image_shape[2]
    self.embed = nnx.Linear(features, config.dim, dtype=dtype, rngs=rngs)
    self.layers = _stack(config, lambda r: MLPBlock(
        config.dim, config.hidden_dim, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r), rngs)
    self.norm = nnx.LayerNorm(config.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.dim, num_classes, rngs=rngs)

  def embed_inputs(self, x: jax.Array) -> jax.Array:
    """``[B, H, W, C]`` -> ``[B, D]`` (flattened pixels through ``embed``)."""
    return self.embed(x.reshape(x.shape[0], -1))


class ResidualCNN(ImageClassifier):
  """Conv stem → L residual conv blocks → LayerNorm → global average pool → head.

  Args:
    config: :class:`CNNConfig`.
    image_shape: ``(H, W, C)``.
    num_classes: K ≥ 2.
    rngs: initialisation keys (keyword-only).
  """

  def __init__(self, config: CNNConfig, *, image_shape: tuple[int, int, int], num_classes: int, rngs: nnx.Rngs):
    dtype = _dtype(config.compute_dtype)
    self.dtype = dtype
    kernel = (config.kernel_size, config.kernel_size)
    self.stem = nnx.Conv(image_shape[2], config.channels, kernel, padding="SAME", dtype=dtype, rngs=rngs)
    self.layers = _stack(config, lambda r: ConvBlock(
        config.channels, kernel_size=config.kernel_size, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r), rngs)
    self.norm = nnx.LayerNorm(config.channels, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.channels, num_classes, rngs=rngs)

  def embed_inputs(self, x: jax.Array) -> jax.Array:
    """``[B, H, W, C]`` -> ``[B, H, W, C']`` (the stem conv)."""
    return jax.nn.gelu(self.stem(x))

  def pool(self, h: jax.Array) -> jax.Array:
    """Global average pool: ``[B, H, W, C']`` -> ``[B, C']``."""
    return h.mean(axis=(1, 2))


def classification_loss(
    model: nnx.Module, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None, deterministic: bool
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean softmax cross-entropy over the valid examples of a batch, and their accuracy.

  Args:
    model: maps ``x: [B, H, W, C]`` to logits ``[B, K]``.
    batch: ``{"x": [B, H, W, C] float, "y": [B] int32, "mask": [B] bool (optional; False = padding)}``.
    dropout_key: PRNG key for dropout (``None`` when deterministic).
    deterministic: turn dropout off.

  Returns:
    ``(loss, {"loss", "accuracy", "correct", "count"})``: loss and accuracy are means over valid examples;
    ``correct``/``count`` are sums (float32) so evaluation can add them over batches.
  """
  logits = model(batch["x"], dropout_key=dropout_key, deterministic=deterministic)
  mask = batch.get("mask", jnp.ones(batch["y"].shape, bool)).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  count = jnp.maximum(mask.sum(), 1.0)
  loss = (losses * mask).sum() / count
  correct = ((logits.argmax(-1) == batch["y"]) * mask).sum()
  return loss, {"loss": loss, "accuracy": correct / count, "correct": correct, "count": mask.sum()}
