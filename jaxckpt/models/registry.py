"""The shipped models and their registry: image classifiers built from jaxckpt's remat-wrapped blocks here, and the
GPT decoder of :mod:`jaxckpt.models.gpt`, each with frozen configs and named presets.

- ``vit``: a small conv stem, then pre-LN Transformer layers (block types ``attn`` and ``mlp``), mean pool, head.
- ``mlp``: flattened pixels, a linear embedding, residual MLP blocks (block type ``mlp``), head.
- ``cnn``: a conv stem, residual conv blocks (block type ``conv``), global average pool, head.

Every model maps ``x: [B, H, W, C]`` float images to ``[B, num_classes]`` float32 logits and has the call signature
``model(x, *, dropout_key=None, deterministic=True)``; ``model.features(x, ...)`` gives what its ``head`` reads
(``[B, D]`` float32), for extra heads (:mod:`jaxckpt.models.multitask`). Presets (``tiny`` for tests, ``small`` for the default
experiment) are frozen dataclasses with explicit numbers, checked once when made (:func:`jaxckpt.models.configs.check_config`);
override fields with :func:`jaxckpt.models.configs.override` (or ``dataclasses.replace``).

:data:`MODEL_REGISTRY` is the one registry of shipped models: every entry (``vit``, ``mlp``, ``cnn``, ``gpt``) gives its
presets, config class, block types, ``build(config, policy=..., seed=...)``, the example batch
``batch(batch_size, config)`` (a pytree of ``jax.ShapeDtypeStruct``), its ``loss_fn`` and ``override(config,
**overrides)``. Tools (the report, the planner, benchmarks) go through it instead of branching on the model name.
:data:`MODELS` is its image classifiers (the models :func:`build_model` builds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.models import gpt
from jaxckpt.models.configs import COMPUTE_DTYPES, check_config, override
from jaxckpt.models.configs import compute_dtype as _dtype
from jaxckpt.errors import JaxckptError
from jaxckpt.nnx.layers import ConvBlock, MLPBlock, Stack, TransformerBlock, set_policy
from jaxckpt.policies import Policy, PolicySpec
from jaxckpt.training.train import LossFn, classification_loss

__all__ = [
    "ViTConfig",
    "MLPConfig",
    "CNNConfig",
    "ViT",
    "ResidualMLP",
    "ResidualCNN",
    "ImageClassifier",
    "MODELS",
    "ModelEntry",
    "ClassifierEntry",
    "LanguageModelEntry",
    "MODEL_REGISTRY",
    "model_entry",
    "build_model",
    "COMPUTE_DTYPES",
    "IMAGE_SHAPE",
    "NUM_CLASSES",
    "DEFAULT_BATCH_SIZE",
]

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
  structure: str = "block"  # Checkpoint structure of the layer stack: block, every:K, nested[:D] (jaxckpt.core.structure).
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
  """Base of the image classifiers: ``embed_inputs`` → ``layers`` (a :class:`~jaxckpt.nnx.layers.Stack`) → ``norm`` →
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
    """What ``head`` reads, for extra heads (:mod:`jaxckpt.models.multitask`).

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


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A shipped model in :data:`MODEL_REGISTRY`: what every tool needs to build, feed and train it.

  Attributes:
    cls: the ``nnx.Module`` class.
    config_cls: its frozen config dataclass.
    presets: preset name -> config (``tiny`` for tests, ``small`` for the default experiment...).
    block_types: block types a policy spec may name (``attn``, ``mlp``, ``conv``).
    loss_fn: ``loss_fn(model, batch, *, dropout_key, deterministic) -> (scalar loss, metrics)``
      (:data:`jaxckpt.training.train.LossFn`).
    kind: what it is, for messages (``"image classifier"``, ``"sequence model"``).
    name: its key in :data:`MODEL_REGISTRY` (``vit``, ``gpt``...).
  """

  cls: Callable[..., nnx.Module]
  config_cls: type
  presets: Mapping[str, Any]
  block_types: tuple[str, ...]
  loss_fn: LossFn = classification_loss
  kind: str = "model"
  name: str = "custom"

  def config(self, config: Any = None) -> Any:
    """A config of this model: a preset by name, a config instance (checked to be of :attr:`config_cls`), or ``None``
    for the ``small`` preset.

    Args:
      config: ``None``, a preset name, or a config instance.

    Returns:
      The config.

    Raises:
      JaxckptError: an unknown preset name (listing the valid ones), or a config of another class.
    """
    if config is None:
      return self.presets["small"]
    if isinstance(config, str):
      if config not in self.presets:
        raise JaxckptError(f"unknown preset {config!r} for model {self.name}; valid presets: {', '.join(self.presets)}")
      return self.presets[config]
    if not isinstance(config, self.config_cls):
      raise JaxckptError(f"model {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}")
    return config

  def override(self, config: Any = None, **overrides: Any) -> Any:
    """The config with ``overrides`` applied and checked once (:func:`jaxckpt.models.configs.override`).

    Args:
      config: as in :meth:`config` (a preset name, a config, or ``None`` for ``small``).
      **overrides: field name -> value; ``None`` keeps the config's value.

    Returns:
      The new config.

    Raises:
      JaxckptError: a field this model's config lacks (saying which shipped models take it), or a bad value named as
        its Python argument (``seq_len=0 must be a whole number ≥ 1``).
    """
    config = self.config(config)
    fields = {f.name for f in dataclasses.fields(self.config_cls)}
    for name, value in overrides.items():
      if value is not None and name not in fields:
        takers = {n: e for n, e in MODEL_REGISTRY.items() if name in {f.name for f in dataclasses.fields(e.config_cls)}}
        if takers:
          kinds = " and ".join(sorted({e.kind + "s" for e in takers.values()}))
          raise JaxckptError(f"{name} applies to {kinds} only ({', '.join(takers)}), got {name}={value!r}; "
                             f"{self.config_cls.__name__} ({self.kind}) has no {name}: leave it out")
    return override(config, **overrides)

  def build(self, config: Any = None, *, policy: "str | Policy | PolicySpec | None" = None, seed: int = 0,
            **inputs: Any) -> nnx.Module:
    """Builds the model with a policy spec validated against its block types.

    Args:
      config: as in :meth:`config`.
      policy: policy spec (see :func:`jaxckpt.parse_policy`).
      seed: parameter initialisation seed.
      **inputs: the input description of this kind of model (image classifiers: ``image_shape``, ``num_classes``).

    Returns:
      The model; wrap in ``nnx.eval_shape(lambda: entry.build(...))`` for shapes without allocating.

    Raises:
      JaxckptError: a bad config or input description. PolicySpecError: a policy invalid for this model.
    """
    model = self.cls(self.config(config), rngs=nnx.Rngs(seed), **inputs)
    set_policy(model, policy)
    return model

  def batch(self, batch_size: int, config: Any = None, **inputs: Any) -> Any:
    """The example batch of ``batch_size`` examples :attr:`loss_fn` takes, as ``jax.ShapeDtypeStruct`` s.

    Args:
      batch_size: examples per step B ≥ 1.
      config: as in :meth:`config`.
      **inputs: as in :meth:`build`.

    Returns:
      A pytree of ``jax.ShapeDtypeStruct`` (nothing allocated).

    Raises:
      JaxckptError: ``batch_size`` < 1.
    """
    raise NotImplementedError

  def default_batch_size(self, config: Any = None) -> int:
    """Examples per step when none is given.

    Args:
      config: as in :meth:`config`.

    Returns:
      B ≥ 1.
    """
    raise NotImplementedError


def _check_batch_size(batch_size: int) -> None:
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise JaxckptError(f"batch_size={batch_size!r} must be a whole number ≥ 1")


@dataclasses.dataclass(frozen=True)
class ClassifierEntry(ModelEntry):
  """An image classifier: ``[B, H, W, C]`` float32 images -> ``[B, K]`` logits, :func:`jaxckpt.classification_loss`.

  Its :meth:`build` and :meth:`batch` take ``image_shape=(H, W, C)`` (default :data:`IMAGE_SHAPE`) and
  ``num_classes=K`` (default :data:`NUM_CLASSES`).
  """

  kind: str = "image classifier"

  def build(self, config: Any = None, *, policy: "str | Policy | PolicySpec | None" = None, seed: int = 0,
            image_shape: tuple[int, int, int] = IMAGE_SHAPE, num_classes: int = NUM_CLASSES) -> nnx.Module:
    """Builds the classifier (see :meth:`ModelEntry.build`); ``image_shape`` ``(H, W, C)``, ``num_classes`` K ≥ 2.

    Args:
      config: as in :meth:`ModelEntry.config`.
      policy: policy spec.
      seed: parameter initialisation seed.
      image_shape: ``(H, W, C)`` of one image.
      num_classes: K ≥ 2.

    Returns:
      The model.

    Raises:
      JaxckptError: a bad config, image shape or ``num_classes``. PolicySpecError: a policy invalid for this model.
    """
    if num_classes < 2:
      raise JaxckptError(f"num_classes={num_classes} must be ≥ 2")
    return super().build(config, policy=policy, seed=seed, image_shape=tuple(image_shape), num_classes=num_classes)

  def batch(self, batch_size: int, config: Any = None, *, image_shape: tuple[int, int, int] = IMAGE_SHAPE,
            num_classes: int = NUM_CLASSES) -> dict[str, jax.ShapeDtypeStruct]:
    """``{"x": [B, H, W, C] float32, "y": [B] int32}`` (see :meth:`ModelEntry.batch`).

    Args:
      batch_size: B ≥ 1.
      config: unused (images do not depend on the config); accepted for the registry's signature.
      image_shape: ``(H, W, C)``.
      num_classes: unused (labels are int32 whatever K).

    Returns:
      The abstract batch.

    Raises:
      JaxckptError: ``batch_size`` < 1.
    """
    _check_batch_size(batch_size)
    return {"x": jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

  def default_batch_size(self, config: Any = None) -> int:
    """:data:`DEFAULT_BATCH_SIZE` (the classifier experiment's).

    Args:
      config: unused.

    Returns:
      64.
    """
    return DEFAULT_BATCH_SIZE


@dataclasses.dataclass(frozen=True)
class LanguageModelEntry(ModelEntry):
  """A language model: ``[B, T]`` int32 tokens -> ``[B, T, V]`` next-token logits, :func:`jaxckpt.models.gpt.lm_loss`."""

  loss_fn: LossFn = gpt.lm_loss
  kind: str = "sequence model"

  def batch(self, batch_size: int, config: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
    """``{"tokens": [B, T+1] int32}`` with T the config's ``seq_len`` (see :meth:`ModelEntry.batch`).

    Args:
      batch_size: B ≥ 1.
      config: as in :meth:`ModelEntry.config`.

    Returns:
      The abstract batch.

    Raises:
      JaxckptError: ``batch_size`` < 1.
    """
    _check_batch_size(batch_size)
    return gpt.lm_batch_struct(batch_size, self.config(config).seq_len)

  def default_batch_size(self, config: Any = None) -> int:
    """The config's ``batch_size`` (the LM experiment's).

    Args:
      config: as in :meth:`ModelEntry.config`.

    Returns:
      B ≥ 1.
    """
    return self.config(config).batch_size


MODEL_REGISTRY: dict[str, ModelEntry] = {entry.name: entry for entry in (
    ClassifierEntry(
        ViT,
        ViTConfig,
        {
            "tiny": ViTConfig(num_layers=2, dim=32, num_heads=2, mlp_dim=64, stem_channels=16, patch_size=2),
            "small": ViTConfig(),
        },
        ("attn", "mlp"),
        name="vit",
    ),
    ClassifierEntry(
        ResidualMLP,
        MLPConfig,
        {"tiny": MLPConfig(num_layers=2, dim=64, hidden_dim=128), "small": MLPConfig()},
        ("mlp",),
        name="mlp",
    ),
    ClassifierEntry(
        ResidualCNN,
        CNNConfig,
        # Unrolled: on XLA:CPU a conv inside a scan body runs ~60× slower (measured: 7.8 s vs 0.12 s per step of
        # the small preset's train step), and remat of unrolled layers works with jaxckpt's CPU compiler option.
        {"tiny": CNNConfig(num_layers=2, channels=16, scan=False), "small": CNNConfig(scan=False)},
        ("conv",),
        name="cnn",
    ),
    LanguageModelEntry(gpt.GPT, gpt.GPTConfig, gpt.GPT_PRESETS, gpt.GPT_BLOCK_TYPES, name="gpt"),
)}
"""Model name -> :class:`ModelEntry`: every shipped model. Presets: ``tiny`` (tests, seconds), ``small`` (the default
experiment); ``gpt`` also ``gpt2-small`` (GPT-2's 124M shapes)."""

MODELS: dict[str, ModelEntry] = {name: e for name, e in MODEL_REGISTRY.items() if isinstance(e, ClassifierEntry)}
"""The image classifiers of :data:`MODEL_REGISTRY` (``vit``, ``mlp``, ``cnn``): what :func:`build_model` builds and
the classifier experiment trains."""


def model_entry(name: str) -> ModelEntry:
  """The registry entry of a shipped model.

  Args:
    name: a key of :data:`MODEL_REGISTRY`.

  Returns:
    Its :class:`ModelEntry`.

  Raises:
    JaxckptError: an unknown name, listing the valid ones.
  """
  if name not in MODEL_REGISTRY:
    raise JaxckptError(f"unknown model {name!r}; valid models: {', '.join(MODEL_REGISTRY)}")
  return MODEL_REGISTRY[name]


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
  return MODELS[name].build(config, policy=policy, seed=seed, image_shape=image_shape, num_classes=num_classes)
