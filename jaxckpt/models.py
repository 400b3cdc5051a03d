"""Image classifiers built from jaxckpt's remat-wrapped blocks, with frozen configs and named presets.

- ``vit``: a small conv stem, then pre-LN Transformer layers (block types ``attn`` and ``mlp``), mean pool, head.
- ``mlp``: flattened pixels, a linear embedding, residual MLP blocks (block type ``mlp``), head.
- ``cnn``: a conv stem, residual conv blocks (block type ``conv``), global average pool, head.

Every model maps ``x: [B, H, W, C]`` float images to ``[B, num_classes]`` float32 logits and has the call signature
``model(x, *, dropout_key=None, deterministic=True)``; ``model.features(x, ...)`` gives what its ``head`` reads
(``[B, D]`` float32), for extra heads (:mod:`jaxckpt.multitask`). Presets (``tiny`` for tests, ``small`` for the default
experiment) are frozen dataclasses with explicit numbers; override fields with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.layers import ConvBlock, MLPBlock, Stack, TransformerBlock, set_policy
from jaxckpt.policies import Policy, PolicySpec

__all__ = [
    "ViTConfig",
    "MLPConfig",
    "CNNConfig",
    "ViT",
    "ResidualMLP",
    "ResidualCNN",
    "MODELS",
    "ModelEntry",
    "build_model",
    "COMPUTE_DTYPES",
]

COMPUTE_DTYPES: dict[str, jnp.dtype] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""Compute dtype name -> dtype. Parameters are always float32."""


def _dtype(name: str) -> jnp.dtype:
  if name not in COMPUTE_DTYPES:
    raise JaxckptError(f"unknown compute dtype {name!r}; valid: {', '.join(COMPUTE_DTYPES)}")
  return COMPUTE_DTYPES[name]


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
  structure: str = "block"  # Checkpoint structure of the layer stack: block, every:K, nested[:D] (jaxckpt.structure).
  compute_dtype: str = "float32"  # "float32" or "bfloat16".


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


class ViT(nnx.Module):
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
    self.layers = Stack(
        lambda r: TransformerBlock(
            config.dim, config.num_heads, config.mlp_dim, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r
        ),
        config.num_layers,
        scan=config.scan,
        structure=config.structure,
        rngs=rngs,
    )
    self.norm = nnx.LayerNorm(config.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.dim, num_classes, rngs=rngs)

  def features(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> pooled features ``[B, D]`` float32 (what ``head`` reads)."""
    h = self.patch(jax.nn.gelu(self.stem(x.astype(self.dtype))))  # [B, H/p, W/p, D]
    h = h.reshape(h.shape[0], -1, h.shape[-1]) + self.pos[...].astype(self.dtype)  # [B, T, D]
    h = self.layers(h, dropout_key=dropout_key, deterministic=deterministic)
    return self.norm(h).mean(axis=1).astype(jnp.float32)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> logits ``[B, K]`` float32."""
    return self.head(self.features(x, dropout_key=dropout_key, deterministic=deterministic))


class ResidualMLP(nnx.Module):
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
    self.layers = Stack(
        lambda r: MLPBlock(config.dim, config.hidden_dim, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r),
        config.num_layers,
        scan=config.scan,
        structure=config.structure,
        rngs=rngs,
    )
    self.norm = nnx.LayerNorm(config.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.dim, num_classes, rngs=rngs)

  def features(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> features ``[B, D]`` float32 (what ``head`` reads)."""
    h = self.embed(x.reshape(x.shape[0], -1).astype(self.dtype))  # [B, D]
    h = self.layers(h, dropout_key=dropout_key, deterministic=deterministic)
    return self.norm(h).astype(jnp.float32)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> logits ``[B, K]`` float32."""
    return self.head(self.features(x, dropout_key=dropout_key, deterministic=deterministic))


class ResidualCNN(nnx.Module):
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
    self.layers = Stack(
        lambda r: ConvBlock(
            config.channels, kernel_size=config.kernel_size, dropout_rate=config.dropout_rate, dtype=dtype, rngs=r
        ),
        config.num_layers,
        scan=config.scan,
        structure=config.structure,
        rngs=rngs,
    )
    self.norm = nnx.LayerNorm(config.channels, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.channels, num_classes, rngs=rngs)

  def features(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> pooled features ``[B, C']`` float32 (what ``head`` reads)."""
    h = jax.nn.gelu(self.stem(x.astype(self.dtype)))  # [B, H, W, C']
    h = self.layers(h, dropout_key=dropout_key, deterministic=deterministic)
    return self.norm(h).mean(axis=(1, 2)).astype(jnp.float32)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """``x: [B, H, W, C]`` -> logits ``[B, K]`` float32."""
    return self.head(self.features(x, dropout_key=dropout_key, deterministic=deterministic))


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A shipped model: its class, config class, presets and block types (for ``--help``)."""

  cls: Callable[..., nnx.Module]
  config_cls: type
  presets: Mapping[str, object]
  block_types: tuple[str, ...]


MODELS: dict[str, ModelEntry] = {
    "vit": ModelEntry(
        ViT,
        ViTConfig,
        {
            "tiny": ViTConfig(num_layers=2, dim=32, num_heads=2, mlp_dim=64, stem_channels=16, patch_size=2),
            "small": ViTConfig(),
        },
        ("attn", "mlp"),
    ),
    "mlp": ModelEntry(
        ResidualMLP,
        MLPConfig,
        {"tiny": MLPConfig(num_layers=2, dim=64, hidden_dim=128), "small": MLPConfig()},
        ("mlp",),
    ),
    "cnn": ModelEntry(
        ResidualCNN,
        CNNConfig,
        # Unrolled: on XLA:CPU a conv inside a scan body runs ~60× slower (measured: 7.8 s vs 0.12 s per step of
        # the small preset's train step), and remat of unrolled layers works with jaxckpt's CPU compiler option.
        {"tiny": CNNConfig(num_layers=2, channels=16, scan=False), "small": CNNConfig(scan=False)},
        ("conv",),
    ),
}
"""Model name -> :class:`ModelEntry`. Presets: ``tiny`` (tests, seconds) and ``small`` (the default experiment)."""


def build_model(
    name: str,
    config: object | None = None,
    *,
    image_shape: tuple[int, int, int],
    num_classes: int,
    policy: "str | Policy | PolicySpec | None" = None,
    seed: int = 0,
) -> nnx.Module:
  """Builds a shipped model with a policy spec validated against its block types.

  Args:
    name: a key of :data:`MODELS` (``vit``, ``mlp``, ``cnn``).
    config: its config dataclass; default the ``small`` preset.
    image_shape: ``(H, W, C)`` of one image.
    num_classes: K ≥ 2.
    policy: policy spec (see :func:`jaxckpt.parse_policy`).
    seed: parameter initialisation seed.

  Returns:
    The model. Wrap in ``nnx.eval_shape(lambda: build_model(...))`` to get shapes without allocating.

  Raises:
    JaxckptError: unknown model name, a config of the wrong class, or bad config values.
    PolicySpecError: a policy spec invalid for this model.
  """
  if name not in MODELS:
    raise JaxckptError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
  entry = MODELS[name]
  config = entry.presets["small"] if config is None else config
  if not isinstance(config, entry.config_cls):
    raise JaxckptError(f"model {name!r} takes a {entry.config_cls.__name__}, got {type(config).__name__}")
  if num_classes < 2:
    raise JaxckptError(f"num_classes={num_classes} must be ≥ 2")
  model = entry.cls(config, image_shape=tuple(image_shape), num_classes=num_classes, rngs=nnx.Rngs(seed))
  set_policy(model, policy)
  return model
