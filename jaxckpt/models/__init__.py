"""The shipped models: image classifiers (:mod:`~jaxckpt.models._classifiers`) and the registry of every model
(:mod:`~jaxckpt.models._registry`), the GPT decoder
(:mod:`~jaxckpt.models._gpt`), multi-task heads (:mod:`~jaxckpt.models._multitask`) and config checks
(:mod:`~jaxckpt.models._configs`). The LLM family at real size (Llama, Mistral, Gemma) has its own face,
:mod:`jaxckpt.models.llm`.
"""

from __future__ import annotations

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.models._classifiers import (DEFAULT_BATCH_SIZE, IMAGE_SHAPE, NUM_CLASSES, ImageClassifier,
                                         classification_loss)
from jaxckpt.models._configs import COMPUTE_DTYPES

from jaxckpt.models._registry import (
    ViTConfig,
    MLPConfig,
    CNNConfig,
    ViT,
    ResidualMLP,
    ResidualCNN,
    MODELS,
    ModelEntry,
    ClassifierEntry,
    LanguageModelEntry,
    MODEL_REGISTRY,
    model_entry,
    build_model,
)
from jaxckpt.models._gpt import (
    GPTConfig,
    GPT_PRESETS,
    GPT,
    GPT_BLOCK_TYPES,
    build_gpt,
    lm_loss,
    lm_batch_struct,
)
from jaxckpt.models._multitask import (
    AuxTask,
    AUX_TASKS,
    aux_task,
    MultiTaskClassifier,
    multitask_loss,
)
from jaxckpt.models._configs import (
    compute_dtype,
    check_config,
    config_record,
    field_names,
    override,
)

__all__ = [
    "classification_loss",
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
    "config_record",
    "field_names",
]

__getattr__ = _forward_names(__name__, {})  # old module paths (jaxckpt.models.gpt, ...) as attributes
