"""The LLM family's config and its presets: one frozen dataclass with three parts (the Mixture of Experts, multi-head
latent attention, the attention kernel), one line of dimensions per released model.

The dimensions are those of MaxText's model configs (AI-Hypercomputer/maxtext, ``configs/models/*.yml``), which
follow the model cards: Llama 2 (Touvron et al. 2023), Llama 3 / 3.1 (Grattafiori et al. 2024, "The Llama 3 Herd of
Models"), Mistral 7B (Jiang et al. 2023), Gemma (Gemma Team 2024), Gemma 2 (Gemma Team 2024), and the Mixtures of
Experts Mixtral 8x7B / 8x22B (Jiang et al. 2024, "Mixtral of Experts"), Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical
Report") and DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"). The parameter count is derived from the
config (:attr:`LLMConfig.num_params`, and :attr:`LLMConfig.active_params` for an MoE), never typed, and tested
against the built model. Presets are a table, as Flax's NNX Gemma example keeps ``TransformerConfig`` presets named
as the released models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxckpt.errors import JaxckptError
from jaxckpt.models._configs import check_fields, dtype_named
from jaxckpt.models.llm._kernels import ATTENTION_KERNELS
from jaxckpt.models.llm._moe import ROUTERS, MoEDispatch
from jaxckpt.models.llm._splash import SplashBlockSizes

MLP_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu")
"""Gated-MLP activations: ``silu`` (SwiGLU: Llama, Mistral) and ``gelu`` (GeGLU with tanh-approximate GELU: Gemma);
Shazeer 2020, "GLU Variants Improve Transformer"."""

LAYER_KINDS: tuple[str, ...] = ("global", "local")
"""Kinds of decoder layer in a ``layer_pattern``: ``global`` attends to every earlier position, ``local`` to the last
``sliding_window`` positions."""

ROPE_SCALINGS: tuple[str, ...] = ("llama3.1",)
"""RoPE frequency scalings besides none: Llama 3.1's (:data:`LLAMA31_ROPE_SCALING`)."""

LLAMA31_ROPE_SCALING: dict[str, float] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position": 8192}
"""Llama 3.1's RoPE scaling: wavelengths above ``original_max_position / low_freq_factor`` tokens are stretched by
``factor``, below ``original_max_position / high_freq_factor`` kept, smoothly in between (the released
``rope_scaling`` of Llama 3.1)."""


def _whole(part: object, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(part, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise JaxckptError(f"{name}={value!r} must be a whole number ≥ 0")


def _flags(part: object, names: tuple[str, ...]) -> None:
  for name in names:
    if not isinstance(getattr(part, name), bool):
      raise JaxckptError(f"{name}={getattr(part, name)!r} must be True or False")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """The Mixture of Experts of an :class:`LLMConfig` (``config.moe``; ``num_experts = 0``: a dense gated MLP in every
  layer). Each field is also an :class:`LLMConfig` argument and attribute of the same name
  (``LLMConfig(num_experts=8)``, ``config.num_experts``).

  Checked when made: counts whole numbers ≥ 0 (``experts_per_token`` ≥ 1), the dispatch and router known, factors
  > 0, flags bools; what needs the whole model (``experts_per_token`` ≤ ``num_experts``, the dense layers against
  ``num_layers``) is checked by :class:`LLMConfig`.

  Raises:
    JaxckptError: a bad field, named as its Python argument.
  """

  num_experts: int = 0  # Routed experts X per MoE layer; 0: no MoE.
  experts_per_token: int = 2  # Experts k each token is routed to (top-k of the router's scores), 1 ≤ k ≤ X.
  moe_mlp_dim: int = 0  # Hidden width F of each expert (MaxText's moe_mlp_dim); 0: mlp_dim.
  shared_experts: int = 0  # Experts every token passes besides its k routed ones (DeepSeek: 1), width F each.
  first_dense_layers: int = 0  # Leading layers with a dense gated MLP of mlp_dim (DeepSeek-V3: 3); a multiple of
  # the pattern's length.
  moe_dispatch: MoEDispatch = MoEDispatch.AUTO  # DROPPING (capacity_factor, one-hot dispatch einsums: MaxText's
  # dense_matmul), RAGGED (dropless: tokens sorted by expert, jax.lax.ragged_dot), GMM (dropless, the megablox Pallas
  # grouped matmul, TPU), AUTO: gmm on a TPU, else ragged (MaxText's defaults megablox and sparse_matmul); the text
  # ("dropping", ...) is read into the member.
  capacity_factor: float = 1.25  # "dropping": each expert takes ceil(S·k / X · factor) tokens per sequence.
  router: str = "softmax"  # "softmax": weights = softmax of the top-k logits (Mixtral; Qwen3 with norm_topk_prob);
  # "sigmoid": sigmoid scores, top-k by score + a bias, weights the chosen scores normalised (DeepSeek-V3).
  routed_scale: float = 1.0  # Factor of the routed experts' output (DeepSeek-V3: 2.5, routed_scaling_factor).
  gmm_interpret: bool = False  # Run the megablox kernel in Pallas' interpret mode (any platform; slow, for tests).

  def __post_init__(self):
    _whole(self, ("num_experts", "moe_mlp_dim", "shared_experts", "first_dense_layers"))
    object.__setattr__(self, "moe_dispatch", MoEDispatch.parse(self.moe_dispatch))
    if self.router not in ROUTERS:
      raise JaxckptError(f"router={self.router!r} is unknown; valid: {', '.join(ROUTERS)}")
    for name in ("capacity_factor", "routed_scale"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise JaxckptError(f"{name}={value!r} must be a number > 0")
    _flags(self, ("gmm_interpret",))
    k = self.experts_per_token
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise JaxckptError(f"experts_per_token={k!r} must be a whole number ≥ 1")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention of an :class:`LLMConfig` (``config.mla``; DeepSeek-AI 2024, "DeepSeek-V2";
  ``kv_lora_rank = 0``: grouped-query attention). Each field is also an :class:`LLMConfig` argument and attribute of
  the same name.

  Raises:
    JaxckptError: a field that is not a whole number ≥ 0, the other fields without ``kv_lora_rank``, an odd or
      missing ``qk_rope_head_dim`` or no ``v_head_dim`` with it.
  """

  q_lora_rank: int = 0  # Rank of the query's low-rank projection (DeepSeek-V3: 1536); 0: a full-rank query.
  kv_lora_rank: int = 0  # Rank of the compressed key/value latent (DeepSeek-V3: 512); > 0 makes attention MLA.
  qk_rope_head_dim: int = 0  # MLA: channels per head that carry RoPE (DeepSeek-V3: 64), besides head_dim's.
  v_head_dim: int = 0  # MLA: channels per value head (DeepSeek-V3: 128).

  def __post_init__(self):
    _whole(self, ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"))
    if not self.kv_lora_rank:
      if self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
        raise JaxckptError("q_lora_rank, qk_rope_head_dim and v_head_dim are multi-head latent attention's: give "
                           "kv_lora_rank > 0 too (DeepSeek-V3: 512), or leave them 0")
      return
    if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
      raise JaxckptError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and ≥ 2 with kv_lora_rank > 0 "
                         "(RoPE rotates pairs of channels; DeepSeek-V3: 64)")
    if self.v_head_dim < 1:
      raise JaxckptError(f"v_head_dim={self.v_head_dim} must be ≥ 1 with kv_lora_rank > 0 (DeepSeek-V3: 128)")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """The attention kernel of an :class:`LLMConfig` (``config.kernel``): which implementation computes attention, and
  the splash kernel's settings. Each field is also an :class:`LLMConfig` argument and attribute of the same name
  (``LLMConfig(attention="splash")``, ``config.attention``).

  Raises:
    JaxckptError: an unknown kernel, blocks that are not a :class:`~jaxckpt.models.llm.SplashBlockSizes`, a flag that
      is not a bool.
  """

  attention: str = "xla"  # Kernel: "auto" (from 128 tokens: splash on a TPU, pallas on a GPU; else xla), "xla",
  # "splash" (TPU), "pallas" or "cudnn" (GPU): jaxckpt.models.llm._kernels.
  splash_blocks: SplashBlockSizes = dataclasses.field(default_factory=SplashBlockSizes)  # Splash kernel blocks.
  splash_interpret: bool = False  # Run the splash kernel in Pallas' interpret mode (any platform; slow, for tests).

  def __post_init__(self):
    if self.attention not in ATTENTION_KERNELS:
      raise JaxckptError(f"attention={self.attention!r} is unknown; valid: {', '.join(ATTENTION_KERNELS)}")
    if not isinstance(self.splash_blocks, SplashBlockSizes):
      raise JaxckptError(f"splash_blocks={self.splash_blocks!r} must be a SplashBlockSizes")
    _flags(self, ("splash_interpret",))


PARTS: dict[str, type] = {"moe": MoEConfig, "mla": MLAConfig, "kernel": KernelConfig}
""":class:`LLMConfig`'s parts: field name -> record."""

FLAT_FIELDS: dict[str, str] = {f.name: part for part, record in PARTS.items() for f in dataclasses.fields(record)}
"""Each part's fields by the name :class:`LLMConfig` takes and reads them by (``num_experts`` -> ``"moe"``)."""


@dataclasses.dataclass(frozen=True, init=False)
class LLMConfig:
  """A decoder-only language model of the Llama / Mistral / Gemma family (``llm``); presets in :data:`LLM_PRESETS`.

  Shapes use B = batch, S = tokens per sequence, E = ``dim``, N = ``num_heads``, K = ``num_kv_heads``,
  Dh = ``head_dim``, M = ``mlp_dim``, V = ``vocab_size``, L = ``num_layers``; for a Mixture of Experts X =
  ``num_experts``, k = ``experts_per_token``, F = ``moe_mlp_dim`` (each expert's hidden width).

  Three parts group the fields of one variant each: :class:`MoEConfig` (``moe``), :class:`MLAConfig` (``mla``) and
  :class:`KernelConfig` (``kernel``). Their fields are arguments and attributes of the config itself, as before the
  parts: ``LLMConfig(num_experts=8, moe_dispatch="dropping")``, ``config.num_experts``, ``dataclasses.replace(config,
  kv_lora_rank=512, ...)`` and :meth:`jaxckpt.models.ModelEntry.override` take the names of :data:`FLAT_FIELDS`; a
  part may also be given whole (``LLMConfig(moe=MoEConfig(...))``), a flat name beside it replacing that field.
  Keyword arguments only.

  A config with ``num_experts`` > 0 is a Mixture of Experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020): each
  layer after the first ``first_dense_layers`` replaces the gated MLP by X gated experts of width F, each token routed
  to k of them (:class:`~jaxckpt.models.llm.MoE`), plus ``shared_experts`` experts every token passes. With
  ``kv_lora_rank`` > 0 attention is DeepSeek's multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2"):
  queries and keys have ``head_dim`` + ``qk_rope_head_dim`` channels, values ``v_head_dim``.

  Checked when made: sizes are whole numbers ≥ 1 (``vocab_size`` ≥ 2), N a multiple of K, L a multiple of the
  pattern's length, dtypes, kernels, activations and layer kinds known, a ``local`` layer has a sliding window,
  ``vocab_tiles`` divides ``seq_len``, and with ``attention="splash"`` the splash blocks tile ``seq_len``.

  Raises:
    JaxckptError: a bad field, named as its Python argument (``num_heads=30 must be a multiple of
      num_kv_heads=8``).
    TypeError: an argument that is neither a field nor a part's field (as a dataclass's own ``__init__``).

  Example::

    >>> LLM_PRESETS["llama3.1-8b"].num_params
    8030261248
  """

  num_layers: int = 2  # Real decoder layers L (Gemma 2 counts local and global ones); a multiple of the pattern.
  dim: int = 64  # Model width E (MaxText's emb_dim), channels per token.
  num_heads: int = 4  # Query heads N; a multiple of num_kv_heads.
  num_kv_heads: int = 2  # Key/value heads K (grouped-query attention; K = N: multi-head, K = 1: multi-query).
  head_dim: int = 16  # Channels per head Dh, independent of dim / num_heads as in MaxText.
  mlp_dim: int = 128  # Hidden width M of the gated MLP (channels).
  vocab_size: int = 256  # Vocabulary V (tokens); 256 = bytes.
  seq_len: int = 64  # Tokens per sequence S.
  batch_size: int = 8  # Sequences per step B (MaxText's per-device batch on the real presets; read by the tools).
  mlp_activation: str = "silu"  # "silu" (SwiGLU) or "gelu" (GeGLU, tanh-approximate GELU).
  rope_theta: float = 10_000.0  # RoPE base wavelength (MaxText's rope_max_timescale), in tokens.
  rope_scaling: str | None = None  # None, or "llama3.1" (Llama 3.1's frequency scaling, LLAMA31_ROPE_SCALING).
  norm_eps: float = 1e-5  # RMSNorm epsilon (added to the mean square).
  tie_embeddings: bool = False  # Logits through the token embedding (True) or a separate [E, V] head (False).
  scale_embeddings: bool = False  # Multiply the embedded tokens by sqrt(E) (Gemma).
  norm_scale_offset: float = 0.0  # RMSNorm multiplies by (offset + scale): 0 (Llama, scale from 1) or 1 (Gemma).
  attn_logit_softcap: float | None = None  # Attention score soft cap c: tanh(x / c) * c (Gemma 2: 50), or None.
  final_logit_softcap: float | None = None  # Output logit soft cap (Gemma 2: 30), or None.
  sliding_window: int | None = None  # Tokens a "local" layer attends to (Gemma 2: 4096), or None.
  layer_pattern: tuple[str, ...] = ("global",)  # Kinds of the layers of one scanned block, e.g. ("local", "global").
  post_norms: bool = False  # RMSNorm after attention and after the MLP too, before each residual add (Gemma 2).
  query_scale: float | None = None  # Factor q is multiplied by; None: head_dim ** -0.5 (Gemma 2 27B: (E/N) ** -0.5).
  compute_dtype: str = "float32"  # Activations and matmuls: "bfloat16" on the real presets, "float32" on tiny ones.
  weight_dtype: str = "float32"  # Parameters (and so AdamW's moments): "float32" (MaxText's default) or "bfloat16".
  vocab_tiles: int = 1  # Sequence chunks the loss computes logits for one at a time (MaxText's num_vocab_tiling).
  scan: bool = True  # Scan over blocks (True) or unroll them.
  structure: str = "block"  # Remat structure of the stack: "block", "every:K", "nested", "nested:D" (see Stack).
  qk_norm: bool = False  # RMSNorm over each head's Dh channels of q and k before RoPE (Qwen3).
  PARTS: ClassVar[dict[str, type]] = PARTS
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)  # The Mixture of Experts (MoEConfig's fields).
  mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)  # Multi-head latent attention (MLAConfig's fields).
  kernel: KernelConfig = dataclasses.field(default_factory=KernelConfig)  # The attention kernel (KernelConfig's).

  def __init__(self, **fields: Any):
    given = {part: fields.pop(part, None) for part in PARTS}
    flat: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for name in [n for n in fields if n in FLAT_FIELDS]:
      flat[FLAT_FIELDS[name]][name] = fields.pop(name)
    own = {f.name: f for f in dataclasses.fields(self)}
    unknown = [n for n in fields if n not in own]
    if unknown:
      raise TypeError(f"LLMConfig.__init__() got an unexpected keyword argument {unknown[0]!r}")
    for part, record in PARTS.items():
      base = given[part]
      if base is not None and not isinstance(base, record):
        raise JaxckptError(f"{part}={base!r} must be a {record.__name__}")
      fields[part] = dataclasses.replace(base, **flat[part]) if base is not None else record(**flat[part])
    for name, f in own.items():
      value = fields[name] if name in fields else (f.default_factory() if f.default is dataclasses.MISSING
                                                   else f.default)
      object.__setattr__(self, name, value)
    self.__post_init__()

  def __post_init__(self):
    check_fields(self)
    _check(self)

  @property
  def num_blocks(self) -> int:
    """Scanned blocks: ``num_layers / len(layer_pattern)`` (Gemma 2: pairs of a local and a global layer)."""
    return self.num_layers // len(self.layer_pattern)

  @property
  def is_moe(self) -> bool:
    """Whether the model is a Mixture of Experts (``num_experts`` > 0)."""
    return self.num_experts > 0

  @property
  def is_mla(self) -> bool:
    """Whether attention is multi-head latent attention (``kv_lora_rank`` > 0)."""
    return self.kv_lora_rank > 0

  @property
  def expert_dim(self) -> int:
    """Each expert's hidden width F: ``moe_mlp_dim``, else ``mlp_dim``."""
    return self.moe_mlp_dim or self.mlp_dim

  @property
  def num_dense_layers(self) -> int:
    """Layers with a dense gated MLP: every layer of a dense model, ``first_dense_layers`` of an MoE."""
    return self.first_dense_layers if self.is_moe else self.num_layers

  @property
  def num_moe_layers(self) -> int:
    """Layers with experts: ``num_layers - first_dense_layers`` of an MoE, 0 of a dense model."""
    return self.num_layers - self.num_dense_layers

  @property
  def attention_params(self) -> int:
    """Parameters of one layer's attention: ``E·Dh·(2N + 2K)`` (grouped-query), plus ``2·Dh`` with ``qk_norm``;
    MLA: the query's ``E·Rq + Rq + Rq·N·(Dh + Dr)`` (or ``E·N·(Dh + Dr)`` at full rank), the latent's
    ``E·(Rkv + Dr) + Rkv``, its up-projection ``Rkv·N·(Dh + Dv)`` and the output ``N·Dv·E`` (Rq, Rkv the ranks, Dr
    ``qk_rope_head_dim``, Dv ``v_head_dim``)."""
    e, n, dh = self.dim, self.num_heads, self.head_dim
    if not self.is_mla:
      return e * dh * (2 * n + 2 * self.num_kv_heads) + (2 * dh if self.qk_norm else 0)
    rq, rkv, dr, dv = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
    query = e * rq + rq + rq * n * (dh + dr) if rq else e * n * (dh + dr)
    return query + e * (rkv + dr) + rkv + rkv * n * (dh + dv) + n * dv * e

  @property
  def moe_layer_params(self) -> int:
    """Parameters of one MoE layer's experts: the router ``E·X`` (and X biases with ``router="sigmoid"``), X routed
    experts of ``3·E·F`` and the shared experts' ``3·E·F`` each."""
    experts = (self.num_experts + self.shared_experts) * 3 * self.dim * self.expert_dim
    return self.dim * self.num_experts + (self.num_experts if self.router == "sigmoid" else 0) + experts

  @property
  def num_params(self) -> int:
    """Parameters of the model, in closed form (no model built): embedding ``V·E``, an untied head ``E·V``, the
    final norm ``E``, and per layer the attention (:attr:`attention_params`), 2 norms of E (4 with ``post_norms``),
    and the gated MLP ``3·E·M`` or, in an MoE layer, the experts (:attr:`moe_layer_params`)."""
    e = self.dim
    per_layer = self.attention_params + (4 if self.post_norms else 2) * e
    embedding = self.vocab_size * e * (1 if self.tie_embeddings else 2)
    return (embedding + e + self.num_layers * per_layer + self.num_dense_layers * 3 * e * self.mlp_dim
            + self.num_moe_layers * self.moe_layer_params)

  @property
  def active_params(self) -> int:
    """Parameters one token meets (an MoE's "activated" count; :attr:`num_params` for a dense model): the MoE layers'
    k routed experts instead of X, the router and the shared experts as they are."""
    idle = (self.num_experts - self.experts_per_token) * 3 * self.dim * self.expert_dim
    return self.num_params - self.num_moe_layers * idle


def _check(config: LLMConfig) -> None:
  """The LLM family's own checks (after :func:`jaxckpt.models._configs.check_fields`)."""
  if config.num_heads % config.num_kv_heads:
    raise JaxckptError(f"num_heads={config.num_heads} must be a multiple of num_kv_heads={config.num_kv_heads}")
  if config.head_dim % 2:
    raise JaxckptError(f"head_dim={config.head_dim} must be even (RoPE rotates pairs of channels)")
  dtype_named(config.weight_dtype, argument="weight_dtype")
  if config.mlp_activation not in MLP_ACTIVATIONS:
    raise JaxckptError(f"mlp_activation={config.mlp_activation!r} is unknown; valid: {', '.join(MLP_ACTIVATIONS)}")
  if config.rope_scaling is not None and config.rope_scaling not in ROPE_SCALINGS:
    raise JaxckptError(f"rope_scaling={config.rope_scaling!r} is unknown; valid: None, {', '.join(ROPE_SCALINGS)}")
  pattern = config.layer_pattern
  if not isinstance(pattern, tuple) or not pattern or any(kind not in LAYER_KINDS for kind in pattern):
    raise JaxckptError(f"layer_pattern={pattern!r} must be a non-empty tuple of {', '.join(LAYER_KINDS)}")
  if config.num_layers % len(pattern):
    raise JaxckptError(f"num_layers={config.num_layers} must be a multiple of len(layer_pattern)={len(pattern)} "
                       f"(layer_pattern={pattern})")
  for name in ("rope_theta", "norm_eps", "attn_logit_softcap", "final_logit_softcap", "query_scale",
               "sliding_window"):
    value = getattr(config, name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
      raise JaxckptError(f"{name}={value!r} must be a number > 0" + ("" if name in ("rope_theta", "norm_eps")
                                                                       else " or None"))
  if "local" in pattern and config.sliding_window is None:
    raise JaxckptError(f"layer_pattern={pattern} has local layers: give sliding_window (tokens), e.g. 4096")
  if config.norm_scale_offset not in (0.0, 1.0):
    raise JaxckptError(f"norm_scale_offset={config.norm_scale_offset!r} must be 0 (Llama) or 1 (Gemma)")
  for name in ("scale_embeddings", "post_norms", "qk_norm"):
    if not isinstance(getattr(config, name), bool):
      raise JaxckptError(f"{name}={getattr(config, name)!r} must be True or False")
  if config.seq_len % config.vocab_tiles:
    raise JaxckptError(f"vocab_tiles={config.vocab_tiles} must divide seq_len={config.seq_len} (the loss splits "
                       "each sequence into vocab_tiles chunks)")
  if config.attention == "splash":
    config.splash_blocks.for_length(config.seq_len)  # blocks that do not tile seq_len: one line naming both
  _check_moe(config)
  _check_mla(config)


def _check_moe(config: LLMConfig) -> None:
  """What the Mixture of Experts needs of the whole model (its own fields are checked by :class:`MoEConfig`)."""
  if not config.is_moe:
    return
  k = config.experts_per_token
  if k > config.num_experts:
    raise JaxckptError(f"experts_per_token={k} must be at most num_experts={config.num_experts}")
  if config.first_dense_layers >= config.num_layers:
    raise JaxckptError(f"first_dense_layers={config.first_dense_layers} must be below num_layers={config.num_layers} "
                       "(an MoE keeps at least one layer of experts)")
  if config.first_dense_layers % len(config.layer_pattern):
    raise JaxckptError(f"first_dense_layers={config.first_dense_layers} must be a multiple of "
                       f"len(layer_pattern)={len(config.layer_pattern)}")


def _check_mla(config: LLMConfig) -> None:
  """What multi-head latent attention needs of the whole model (its own fields are checked by :class:`MLAConfig`)."""
  if config.is_mla and config.num_kv_heads != config.num_heads:
    raise JaxckptError(f"num_kv_heads={config.num_kv_heads} must equal num_heads={config.num_heads} with "
                       "kv_lora_rank > 0 (MLA gives every query head its own key and value)")


def _flat(name: str, part: str) -> property:
  return property(lambda config: getattr(getattr(config, part), name),
                  doc=f"``config.{part}.{name}`` (:class:`{PARTS[part].__name__}`).")


for _name, _part in FLAT_FIELDS.items():
  setattr(LLMConfig, _name, _flat(_name, _part))
del _name, _part


def _llama(**fields) -> LLMConfig:
  """A real-size preset: bfloat16 compute, float32 weights, the attention kernel chosen per platform."""
  return LLMConfig(compute_dtype="bfloat16", attention="auto", **fields)


def _gemma2(**fields) -> LLMConfig:
  """Gemma 2's shared settings: pairs of a local (4096-token window) and a global layer, soft caps 50 / 30, post
  norms, GeGLU, tied and scaled embeddings, (1 + scale) RMSNorm with epsilon 1e-6."""
  return _llama(mlp_activation="gelu", vocab_size=256_128, norm_eps=1e-6, tie_embeddings=True,
                scale_embeddings=True, norm_scale_offset=1.0, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                sliding_window=4096, layer_pattern=("local", "global"), post_norms=True, seq_len=8192, **fields)


def _mixtral(**fields) -> LLMConfig:
  """Mixtral's shared settings (MaxText's ``mixtral-8x7b.yml`` / ``mixtral-8x22b.yml``): a Mistral-style decoder,
  8 experts of which each token takes 2, RoPE base 1M, a 32k vocabulary, untied, 4096-token sequences."""
  return _llama(num_experts=8, experts_per_token=2, rope_theta=1_000_000.0, seq_len=4096, head_dim=128,
                num_kv_heads=8, **fields)


def _qwen3_moe(**fields) -> LLMConfig:
  """Qwen3-MoE's shared settings (MaxText's ``qwen3-30b-a3b.yml`` / ``qwen3-235b-a22b.yml``; the Qwen3 model cards):
  RMSNorm over q and k per head, 128 experts of which each token takes 8 (weights renormalised over them), epsilon
  1e-6, a 151936-token vocabulary, untied; no published training configuration (4096 tokens, one sequence)."""
  return _llama(qk_norm=True, num_experts=128, experts_per_token=8, head_dim=128, num_kv_heads=4, norm_eps=1e-6,
                vocab_size=151_936, seq_len=4096, batch_size=1, **fields)


_LLAMA_TINY = LLMConfig()
"""The default fields: a two-layer Llama for tests and CPU training."""

_LLAMA31 = dict(vocab_size=128_256, rope_theta=500_000.0, rope_scaling="llama3.1", seq_len=8192)

LLM_PRESETS: dict[str, LLMConfig] = {
    "llama2-7b": _llama(num_layers=32, dim=4096, num_heads=32, num_kv_heads=32, head_dim=128, mlp_dim=11008,
                        vocab_size=32_000, seq_len=4096, batch_size=12),
    "llama2-13b": _llama(num_layers=40, dim=5120, num_heads=40, num_kv_heads=40, head_dim=128, mlp_dim=13824,
                         vocab_size=32_000, seq_len=4096, batch_size=1),
    "llama2-70b": _llama(num_layers=80, dim=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                         vocab_size=32_000, seq_len=4096, batch_size=2),
    "llama3.1-8b": _llama(num_layers=32, dim=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                          batch_size=4, **_LLAMA31),
    "llama3.1-70b": _llama(num_layers=80, dim=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                           batch_size=5, **_LLAMA31),
    "llama3.1-405b": _llama(num_layers=126, dim=16384, num_heads=128, num_kv_heads=8, head_dim=128, mlp_dim=53248,
                            batch_size=1, **_LLAMA31),
    "mistral-7b": _llama(num_layers=32, dim=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                         vocab_size=32_000, rope_theta=1_000_000.0, seq_len=8192, batch_size=6),
    "gemma-7b": _llama(num_layers=28, dim=3072, num_heads=16, num_kv_heads=16, head_dim=256, mlp_dim=24576,
                       vocab_size=256_128, mlp_activation="gelu", norm_eps=1e-6, tie_embeddings=True,
                       scale_embeddings=True, norm_scale_offset=1.0, seq_len=8192, batch_size=1),
    "gemma2-9b": _gemma2(num_layers=42, dim=3584, num_heads=16, num_kv_heads=8, head_dim=256, mlp_dim=14336,
                         batch_size=3),
    "gemma2-27b": _gemma2(num_layers=46, dim=4608, num_heads=32, num_kv_heads=16, head_dim=128, mlp_dim=36864,
                          query_scale=(4608 / 32) ** -0.5, batch_size=2),
    # Mixtures of Experts (Jiang et al. 2024; Qwen Team 2025; DeepSeek-AI 2024): MaxText's dimensions, its dropless
    # dispatch by default (moe_dispatch="auto": the megablox kernel on a TPU); T11/T12 give "dropping".
    "mixtral-8x7b": _mixtral(num_layers=32, dim=4096, num_heads=32, mlp_dim=14336, moe_mlp_dim=14336,
                             vocab_size=32_000, batch_size=12),
    "mixtral-8x22b": _mixtral(num_layers=56, dim=6144, num_heads=48, mlp_dim=16384, moe_mlp_dim=16384,
                              vocab_size=32_768, batch_size=8),
    "qwen3-30b-a3b": _qwen3_moe(num_layers=48, dim=2048, num_heads=32, mlp_dim=768, moe_mlp_dim=768,
                                rope_theta=10_000_000.0),
    "qwen3-235b-a22b": _qwen3_moe(num_layers=94, dim=4096, num_heads=64, mlp_dim=1536, moe_mlp_dim=1536,
                                  rope_theta=5_000_000.0),
    "deepseek-v3": _llama(num_layers=61, first_dense_layers=3, dim=7168, num_heads=128, num_kv_heads=128,
                          head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
                          mlp_dim=18432, moe_mlp_dim=2048, num_experts=256, experts_per_token=8, shared_experts=1,
                          router="sigmoid", routed_scale=2.5, vocab_size=129_280, norm_eps=1e-6, seq_len=4096,
                          batch_size=1),
    # Tiny ones for tests and CPU training: float32 compute so gradients compare closely, xla attention, bytes.
    "llama-tiny": _LLAMA_TINY,
    "tiny": _LLAMA_TINY,  # every shipped model has a "tiny" preset: the tools' default
    "gemma2-tiny": LLMConfig(num_layers=4, dim=64, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=128,
                             mlp_activation="gelu", norm_eps=1e-6, tie_embeddings=True, scale_embeddings=True,
                             norm_scale_offset=1.0, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                             sliding_window=16, layer_pattern=("local", "global"), post_norms=True,
                             query_scale=(64 / 4) ** -0.5),
    "mixtral-tiny": LLMConfig(num_experts=4, experts_per_token=2, moe_mlp_dim=64),
    "deepseek-tiny": LLMConfig(num_layers=3, first_dense_layers=1, num_heads=4, num_kv_heads=4, head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32, kv_lora_rank=16, num_experts=8,
                               experts_per_token=2, moe_mlp_dim=32, shared_experts=1, router="sigmoid",
                               routed_scale=2.5, norm_eps=1e-6),
}
"""Preset name -> :class:`LLMConfig`. Real sizes with MaxText's dimensions (``llama2-7b`` … ``gemma2-27b``): bfloat16
compute, float32 weights, ``attention="auto"``; ``seq_len`` and ``batch_size`` are MaxText's published training
settings where it publishes one (per-device batch; ``batch_size=1`` where it does not). Tiny ones for tests and CPU
training: ``llama-tiny`` (also ``tiny``) and ``gemma2-tiny`` (a local/global pair of blocks, soft caps, post norms).
Mixtures of Experts at real size: ``mixtral-8x7b``, ``mixtral-8x22b``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b`` and
``deepseek-v3`` (MLA, a shared expert, three dense layers first, sigmoid routing); tiny: ``mixtral-tiny`` (4 experts,
top-2) and ``deepseek-tiny``."""
