"""The LLM family: Llama 2, Llama 3.1, Mistral, Gemma, Gemma 2 and the Mixtures of Experts Mixtral, Qwen3-MoE and
DeepSeek-V3 at their real sizes (Flax NNX), for remat plans that read as MaxText configs.

- :class:`LLMConfig` and :data:`LLM_PRESETS` (``_config.py``): one frozen config, a preset per released model with
  MaxText's dimensions, the parameter count derived (``LLM_PRESETS["llama3.1-8b"].num_params``).
- The layers (``_layers.py``): :class:`RMSNorm`, RoPE (:func:`apply_rope`), grouped-query :class:`Attention`,
  :class:`GatedMLP`, :class:`DecoderLayer` and :class:`DecoderBlock` (block type ``decoder``, MaxText's checkpoint
  names), every parameter with logical axis names.
- The attention kernels behind one seam (``_kernels.py``): :func:`attention` runs XLA's einsum attention, the Pallas
  splash kernel on a TPU (``_splash.py``: :func:`splash_attention`, :class:`SplashBlockSizes`), or flash attention
  on a GPU (``_gpu_kernels.py``: :func:`pallas_attention`, Pallas Triton; :func:`cudnn_attention`, cuDNN); ``auto``
  picks by the platform compiled for.
- Mixtures of Experts (``_moe.py``): :class:`MoE` (the router :func:`route`, the dispatches ``dropping``,
  ``ragged`` and ``gmm``: :func:`dropping_moe`, :func:`sorted_moe`, :func:`grouped_matmul`), MaxText's MoE
  checkpoint names; DeepSeek's multi-head latent attention :class:`LatentAttention` (``_layers.py``).
- :class:`LLM` and :func:`build_llm` (``_model.py``); :func:`llm_loss` (``_loss.py``) with a float32-logsumexp
  cross-entropy and MaxText's vocabulary tiling.

The registry knows the family as ``llm`` (``jaxckpt-report --model llm --preset llama3.1-8b``); docs/llm.md.

Example::

    >>> import jax.numpy as jnp
    >>> from jaxckpt.models.llm import build_llm, llm_loss
    >>> model = build_llm("llama-tiny", policy="save_only_these_names:query_proj+key_proj+value_proj")
    >>> loss, metrics = llm_loss(model, {"tokens": jnp.zeros((2, 65), jnp.int32)})
"""

from __future__ import annotations

from jaxckpt.models.llm._config import (
    LLMConfig,
    MoEConfig,
    MLAConfig,
    KernelConfig,
    LLM_PRESETS,
    MLP_ACTIVATIONS,
    LAYER_KINDS,
    ROPE_SCALINGS,
    LLAMA31_ROPE_SCALING,
)
from jaxckpt.models.llm._kernels import (
    ATTENTION_KERNELS,
    SPLASH_MIN_SEQ_LEN,
    attention,
    select_kernel,
    xla_attention,
)
from jaxckpt.models.llm._moe import (
    MOE_DISPATCHES,
    ROUTERS,
    MoE,
    MoEDispatch,
    dropping_moe,
    expert_capacity,
    grouped_matmul,
    route,
    select_dispatch,
    sorted_moe,
)
from jaxckpt.models.llm._gpu_kernels import cudnn_attention, pallas_attention
from jaxckpt.models.llm._splash import SplashBlockSizes, splash_attention
from jaxckpt.models.llm._layers import (
    RMSNorm,
    rope_frequencies,
    apply_rope,
    Attention,
    LatentAttention,
    GatedMLP,
    DecoderLayer,
    DecoderBlock,
)
from jaxckpt.models.llm._model import LLM, LLM_BLOCK_TYPES, build_llm, project_logits
from jaxckpt.models.llm._loss import cross_entropy, tiled_loss, llm_loss

__all__ = [
    "LLMConfig",
    "MoEConfig",
    "MLAConfig",
    "KernelConfig",
    "MoEDispatch",
    "LLM_PRESETS",
    "MLP_ACTIVATIONS",
    "LAYER_KINDS",
    "ROPE_SCALINGS",
    "LLAMA31_ROPE_SCALING",
    "ATTENTION_KERNELS",
    "SPLASH_MIN_SEQ_LEN",
    "SplashBlockSizes",
    "splash_attention",
    "pallas_attention",
    "cudnn_attention",
    "attention",
    "select_kernel",
    "xla_attention",
    "RMSNorm",
    "rope_frequencies",
    "apply_rope",
    "Attention",
    "LatentAttention",
    "GatedMLP",
    "MoE",
    "MOE_DISPATCHES",
    "ROUTERS",
    "route",
    "select_dispatch",
    "expert_capacity",
    "dropping_moe",
    "sorted_moe",
    "grouped_matmul",
    "DecoderLayer",
    "DecoderBlock",
    "LLM",
    "LLM_BLOCK_TYPES",
    "build_llm",
    "project_logits",
    "cross_entropy",
    "tiled_loss",
    "llm_loss",
]
