"""The shipped models: image classifiers (:mod:`~jaxckpt.models.classifiers`) and the registry of every model
(:mod:`~jaxckpt.models.registry`), the GPT decoder
(:mod:`~jaxckpt.models.gpt`), multi-task heads (:mod:`~jaxckpt.models.multitask`) and config checks
(:mod:`~jaxckpt.models.configs`).
"""

from __future__ import annotations

from jaxckpt.models import classifiers, configs, gpt, multitask, registry
from jaxckpt.models.registry import (
    ViTConfig,
    MLPConfig,
    CNNConfig,
    ViT,
    ResidualMLP,
    ResidualCNN,
    ImageClassifier,
    MODELS,
    ModelEntry,
    ClassifierEntry,
    LanguageModelEntry,
    MODEL_REGISTRY,
    model_entry,
    build_model,
    COMPUTE_DTYPES,
    IMAGE_SHAPE,
    NUM_CLASSES,
    DEFAULT_BATCH_SIZE,
)
from jaxckpt.models.gpt import (
    GPTConfig,
    GPT_PRESETS,
    GPT,
    GPT_BLOCK_TYPES,
    build_gpt,
    lm_loss,
    lm_batch_struct,
)
from jaxckpt.models.multitask import (
    AuxTask,
    AUX_TASKS,
    aux_task,
    MultiTaskClassifier,
    multitask_loss,
)
from jaxckpt.models.configs import (
    compute_dtype,
    check_config,
    override,
)

__all__ = [
    "classifiers",
    "configs",
    "gpt",
    "multitask",
    "registry",
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
    "GPTConfig",
    "GPT_PRESETS",
    "GPT",
    "GPT_BLOCK_TYPES",
    "build_gpt",
    "lm_loss",
    "lm_batch_struct",
    "AuxTask",
    "AUX_TASKS",
    "aux_task",
    "MultiTaskClassifier",
    "multitask_loss",
    "compute_dtype",
    "check_config",
    "override",
]
