"""The registry of shipped models: the image classifiers of :mod:`jaxckpt.models._classifiers`, the GPT decoder of
:mod:`jaxckpt.models._gpt` and the LLM family of :mod:`jaxckpt.models.llm` (Llama, Mistral, Gemma at their real
sizes), each with frozen configs and named presets.

- ``vit``: a small conv stem, then pre-LN Transformer layers (block types ``attn`` and ``mlp``), mean pool, head.
- ``mlp``: flattened pixels, a linear embedding, residual MLP blocks (block type ``mlp``), head.
- ``cnn``: a conv stem, residual conv blocks (block type ``conv``), global average pool, head.

Every model maps ``x: [B, H, W, C]`` float images to ``[B, num_classes]`` float32 logits and has the call signature
``model(x, *, dropout_key=None, deterministic=True)``; ``model.features(x, ...)`` gives what its ``head`` reads
(``[B, D]`` float32), for extra heads (:mod:`jaxckpt.models._multitask`). Presets (``tiny`` for tests, ``small`` for the default
experiment) are frozen dataclasses with explicit numbers, checked once when made (:func:`jaxckpt.models._configs.check_config`);
override fields with :func:`jaxckpt.models._configs.override` (or ``dataclasses.replace``).

:data:`MODEL_REGISTRY` is the one registry of shipped models: every entry (``vit``, ``mlp``, ``cnn``, ``gpt``,
``llm``) gives its
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

from jaxckpt.models import _gpt as gpt
from jaxckpt.models._configs import field_names, override, unknown_preset
from jaxckpt.errors import JaxckptError
from jaxckpt.nnx._layers import set_policy
from jaxckpt.policies._spec import Policy, PolicySpec
from jaxckpt.models.llm._config import LLM_PRESETS, LLMConfig
from jaxckpt.models.llm._loss import llm_loss
from jaxckpt.models.llm._model import LLM, LLM_BLOCK_TYPES
from jaxckpt.models._classifiers import (CNNConfig, DEFAULT_BATCH_SIZE, IMAGE_SHAPE, MLPConfig, NUM_CLASSES, ResidualCNN,
                                         ResidualMLP, ViT, ViTConfig, classification_loss)

@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A shipped model in :data:`MODEL_REGISTRY`: what every tool needs to build, feed and train it.

  Attributes:
    cls: the ``nnx.Module`` class.
    config_cls: its frozen config dataclass.
    presets: preset name -> config (``tiny`` for tests, ``small`` for the default experiment...).
    block_types: block types a policy spec may name (``attn``, ``mlp``, ``conv``).
    loss_fn: ``loss_fn(model, batch, *, dropout_key, deterministic) -> (scalar loss, metrics)``
      (:data:`jaxckpt.training.LossFn`).
    kind: what it is, for messages (``"image classifier"``, ``"sequence model"``).
    name: its key in :data:`MODEL_REGISTRY` (``vit``, ``gpt``...).
    default_preset: the preset :meth:`config` gives for ``None`` (``small``; ``tiny`` for ``llm``).
  """

  cls: Callable[..., nnx.Module]
  config_cls: type
  presets: Mapping[str, Any]
  block_types: tuple[str, ...]
  loss_fn: Callable[..., Any] = classification_loss
  kind: str = "model"
  name: str = "custom"
  default_preset: str = "small"

  def config(self, config: Any = None) -> Any:
    """A config of this model: a preset by name, a config instance (checked to be of :attr:`config_cls`), or ``None``
    for the :attr:`default_preset`.

    Args:
      config: ``None``, a preset name, or a config instance.

    Returns:
      The config.

    Raises:
      JaxckptError: an unknown preset name (listing the valid ones and the closest), or a config of another class.
    """
    if config is None:
      return self.presets[self.default_preset]
    if isinstance(config, str):
      if config not in self.presets:
        raise unknown_preset(self.name, config, self.presets)
      return self.presets[config]
    if not isinstance(config, self.config_cls):
      raise JaxckptError(f"model {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}")
    return config

  def override(self, config: Any = None, **overrides: Any) -> Any:
    """The config with ``overrides`` applied and checked once (:func:`jaxckpt.models._configs.override`).

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
    fields = set(field_names(self.config_cls))
    for name, value in overrides.items():
      if value is not None and name not in fields:
        takers = {n: e for n, e in MODEL_REGISTRY.items() if name in field_names(e.config_cls)}
        if takers:
          kinds = {e.kind for e in takers.values()}
          who = (f"{', '.join(takers)} only" if self.kind in kinds  # another model of the same kind takes it
                 else f"{' and '.join(sorted(k + 's' for k in kinds))} only ({', '.join(takers)})")
          raise JaxckptError(f"{name} applies to {who}, got {name}={value!r}; "
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
  """An image classifier: ``[B, H, W, C]`` float32 images -> ``[B, K]`` logits, :func:`jaxckpt.models.classification_loss`.

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
  """A language model: ``[B, T]`` int32 tokens -> ``[B, T, V]`` next-token logits, its loss over ``{"tokens": [B, T+1]
  int32}`` (:func:`jaxckpt.models._gpt.lm_loss` for ``gpt``, :func:`jaxckpt.models.llm.llm_loss` for ``llm``)."""

  loss_fn: Callable[..., Any] = gpt.lm_loss
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
    LanguageModelEntry(LLM, LLMConfig, LLM_PRESETS, LLM_BLOCK_TYPES, loss_fn=llm_loss, name="llm",
                       default_preset="tiny"),
)}
"""Model name -> :class:`ModelEntry`: every shipped model. Presets: ``tiny`` (tests, seconds), ``small`` (the default
experiment); ``gpt`` also ``gpt2-small`` (GPT-2's 124M shapes); ``llm`` the released models (``llama3.1-8b``,
``gemma2-27b``…, :data:`jaxckpt.models.llm.LLM_PRESETS`) and ``llama-tiny``, ``gemma2-tiny``."""

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
