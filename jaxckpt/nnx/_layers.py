"""Remat-wrapped Flax NNX layers: residual blocks with named checkpoints, and scan-over-layers stacks.

Each block is one *block type* with its own policy (``attn``, ``mlp``, ``conv``): its call runs inside
``nnx.remat(policy=...)`` and tags its important intermediates with ``checkpoint_name`` (names in
:mod:`jaxckpt.names`), so ``save_only_these_names:...`` policies can pick them. A :class:`TransformerBlock` is two
blocks, ``attn`` then ``mlp`` (pre-LayerNorm; each LN + sublayer + residual is remat'd on its own), so
``attn=dots_saveable,mlp=full`` gives them different policies. :class:`Stack` stacks N identical blocks with
``jax.lax.scan`` over a leading layer axis (default), the policy sitting on the scan body, or unrolls them.

Dropout is driven by explicit keys: ``dropout_key`` goes into the remat'd call as an argument, so the forward pass and
the recomputation draw the same mask, and a stack splits it into one key per layer, so layers draw different masks.
Static flags (``deterministic``) are closed over, never traced.

The block math lives in :mod:`jaxckpt.core._blocks` and the stack's grouping and looping in :mod:`jaxckpt.core._structure`, shared
with the Linen front-end (:mod:`jaxckpt.linen`); this module holds what is NNX's own: parameters as ``nnx.Param``,
remat through :func:`jaxckpt.remat.module_call`, policies set in place (:func:`set_policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt import names
from jaxckpt.core import _blocks as blocks
from jaxckpt.sharding._rules import BATCH, constrain
from jaxckpt.nnx._apply import (applied_block_types, linen_error, no_blocks_error, set_applied_policy,
                               set_layered_policy, validate_applied)
from jaxckpt.errors import JaxckptError
from jaxckpt.policies._spec import SAVE_TENSORS, PolicySpec, parse_policy
from jaxckpt.policies._model import LayeredPolicy, parse_model_policy
from jaxckpt.core._remat import module_call
from jaxckpt.core._structure import Structure, apply_layers, apply_segments, parse_structure

PolicyLike = "str | Policy | PolicySpec | None"


_STACK_INPUTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxckpt_stack_inputs", default=None)


@contextlib.contextmanager
def record_stack_inputs():
  """Within this context every :class:`Stack` call appends ``(stack, jax.ShapeDtypeStruct of its input)`` to the list
  it yields: how :mod:`jaxckpt.planner` learns a layer's input shape from a traced train step (micro-batching
  included). Only shapes are kept, so it works under ``jax.eval_shape``.

  Yields:
    The list the stacks append to.
  """
  found: list = []
  token = _STACK_INPUTS.set(found)
  try:
    yield found
  finally:
    _STACK_INPUTS.reset(token)


_BLOCK_CALLS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxckpt_block_calls", default=None)


@contextlib.contextmanager
def shared_block_traces():
  """Within this context, blocks of one graph, policy and ``deterministic`` flag call one ``jax.checkpoint`` function
  (:func:`jaxckpt.remat.module_call` with ``share_traces``), so JAX traces and differentiates that block once and
  reuses the jaxpr from its trace cache: the L layers of an unrolled stack cost one block trace, not L. For analyses
  that trace a model for its jaxpr (the report's residual analysis); the jaxpr is the same, but a block's Python code
  runs once per (graph, policy, flag), so trace-time side effects inside a block happen once. ``save_tensors``
  policies (which tag values per module) are not shared.
  """
  token = _BLOCK_CALLS.set({})
  try:
    yield
  finally:
    _BLOCK_CALLS.reset(token)


class RematBlock(blocks.BlockMath, nnx.Module):
  """Base of jaxckpt's residual blocks: a block type, the checkpoint names it emits, and a policy spec.

  :meth:`forward` is the block's math (a :class:`jaxckpt.core._blocks.BlockMath` mixin, shared with the other
  front-end); :meth:`__call__` runs it under ``nnx.remat`` with the policy of
  :attr:`block_type` (no remat for ``none``).

  Attributes:
    block_type: class constant, e.g. ``"mlp"``.
    checkpoint_names: class constant, the names :meth:`forward` tags (see :mod:`jaxckpt.names`).
    policy: the :class:`~jaxckpt.PolicySpec` in use (static; change it with :func:`set_policy`).
    dropout_rate: the block's dropout rate, in [0, 1).

  Raises:
    JaxckptError: a dropout rate outside [0, 1).
  """

  block_type: ClassVar[str]
  checkpoint_names: ClassVar[tuple[str, ...]]

  def __init__(self, policy: PolicyLike = None, dropout_rate: float = 0.0):
    blocks.check_dropout_rate(dropout_rate)
    self.policy = parse_policy(policy)
    self.dropout_rate = dropout_rate


  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the block under ``jax.checkpoint`` (through ``module_call``) with the policy of its block type.

    Args:
      x: input activations (shape per subclass), float32 or bfloat16.
      dropout_key: PRNG key for dropout; required when ``deterministic=False`` and the dropout rate is > 0.
      deterministic: ``True`` turns dropout off (evaluation).

    Returns:
      Output of the same shape and dtype as ``x``.
    """
    policy = self.policy.for_block(self.block_type)
    shared = _BLOCK_CALLS.get()
    if shared is None or policy.name == SAVE_TENSORS:
      call = module_call(lambda block, h, key: block.forward(h, key, deterministic=deterministic), policy)
    else:  # one call per (policy, flag) in this context; module_call shares its jax.checkpoint per block graph
      call = shared.get((policy, deterministic))
      if call is None:
        call = shared[(policy, deterministic)] = module_call(
            lambda block, h, key: block.forward(h, key, deterministic=deterministic), policy, share_traces=True)
    with jax.named_scope(self.block_type):  # traces and HLO op names read by block (metadata only)
      return call(self, x, dropout_key)


class AttentionBlock(blocks.AttentionMath, RematBlock):
  """Pre-LN multi-head self-attention with a residual: ``x + Dropout(Wo · softmax(QKᵀ/√K) V)``; block type ``attn``.

  Emits ``qkv`` ``[B, T, 3, H, K]``, ``attn_weights`` ``[B, H, T, T]``, ``attn_context`` ``[B, T, H, K]`` and
  ``attn_out`` ``[B, T, D]``. With ``attention="xla"`` attention is written with ``einsum`` (``dot_general``), so dots
  policies see it. With ``attention="dot_product_attention"`` the core is ``jax.nn.dot_product_attention``: there
  are no ``attn_weights``, and its output is tagged ``attn_context`` — save it with
  ``save_only_these_names:attn_context``. Where it runs cuDNN flash attention (GPU, bf16/fp16) it is a custom call,
  not a ``dot_general``, so dots policies do not save it; elsewhere (CPU, float32) JAX's fallback is einsums, which
  they do.
  Dropout on the attention weights needs ``attention="xla"``.

  Args:
    dim: model width D.
    num_heads: heads H; must divide ``dim``.
    dropout_rate: dropout on the attention weights (xla attention only) and on the output, in [0, 1).
    causal: mask future tokens (decoders).
    attention: ``"xla"`` (einsum + softmax) or ``"dot_product_attention"``.
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``attn`` entry applies).
    rngs: parameter initialisation keys (keyword-only).

  Raises:
    JaxckptError: ``num_heads`` does not divide ``dim``, or a rate outside [0, 1).
  """

  block_type = "attn"
  checkpoint_names = blocks.attention_checkpoint_names("xla")

  def __init__(
      self,
      dim: int,
      num_heads: int,
      *,
      dropout_rate: float = 0.0,
      causal: bool = False,
      attention: str = "xla",
      dtype: jnp.dtype = jnp.float32,
      policy: PolicyLike = None,
      rngs: nnx.Rngs,
  ):
    super().__init__(policy, dropout_rate)
    blocks.check_attention(dim, num_heads, attention)
    self.num_heads, self.causal, self.dtype = num_heads, causal, dtype
    self.attention = attention
    if attention != "xla":
      self.checkpoint_names = blocks.attention_checkpoint_names(attention)
    self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)


class MLPBlock(blocks.MLPMath, RematBlock):
  """Pre-LN residual MLP: ``x + Dropout(W2 · gelu(W1 · LN(x)))``; block type ``mlp``.

  Emits ``mlp_hidden`` ``[..., F]`` and ``mlp_out`` ``[..., D]``.

  Args:
    dim: width D of the input ``x: [..., D]``.
    hidden_dim: hidden width F.
    dropout_rate: dropout on the output, in [0, 1).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``mlp`` entry applies).
    rngs: parameter initialisation keys (keyword-only).
  """

  block_type = "mlp"
  checkpoint_names = (names.MLP_HIDDEN, names.MLP_OUT)

  def __init__(
      self,
      dim: int,
      hidden_dim: int,
      *,
      dropout_rate: float = 0.0,
      dtype: jnp.dtype = jnp.float32,
      policy: PolicyLike = None,
      rngs: nnx.Rngs,
  ):
    super().__init__(policy, dropout_rate)
    self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.fc1 = nnx.Linear(dim, hidden_dim, dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(hidden_dim, dim, dtype=dtype, rngs=rngs)


class ConvBlock(blocks.ConvMath, RematBlock):
  """Pre-norm residual conv block: ``x + Dropout(conv3x3(gelu(conv3x3(LN(x)))))``; block type ``conv``.

  Emits ``conv_hidden`` and ``conv_out``, both ``[B, h, w, C]``. LayerNorm normalises over channels.

  Args:
    channels: channels C of ``x: [B, h, w, C]`` (kept: 'SAME' padding, stride 1).
    kernel_size: square kernel side (pixels).
    dropout_rate: dropout on the output, in [0, 1).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``conv`` entry applies).
    rngs: parameter initialisation keys (keyword-only).
  """

  block_type = "conv"
  checkpoint_names = (names.CONV_HIDDEN, names.CONV_OUT)

  def __init__(
      self,
      channels: int,
      *,
      kernel_size: int = 3,
      dropout_rate: float = 0.0,
      dtype: jnp.dtype = jnp.float32,
      policy: PolicyLike = None,
      rngs: nnx.Rngs,
  ):
    super().__init__(policy, dropout_rate)
    kernel = (kernel_size, kernel_size)
    self.norm = nnx.LayerNorm(channels, dtype=dtype, rngs=rngs)
    self.conv1 = nnx.Conv(channels, channels, kernel, padding="SAME", dtype=dtype, rngs=rngs)
    self.conv2 = nnx.Conv(channels, channels, kernel, padding="SAME", dtype=dtype, rngs=rngs)


class TransformerBlock(nnx.Module):
  """Pre-LN Transformer encoder layer: an ``attn`` block then an ``mlp`` block, each remat'd with its own policy.

  ``x: [B, T, D]`` -> ``[B, T, D]``. With ``attn=dots_saveable,mlp=full`` the attention sublayer (LN + attention +
  residual) runs under ``remat(policy=dots_saveable)`` and the MLP sublayer under ``remat(policy=nothing_saveable)``.

  Args:
    dim: model width D.
    num_heads: attention heads H (divides D).
    mlp_dim: MLP hidden width F.
    dropout_rate: dropout in both sublayers, in [0, 1).
    causal: causal attention mask.
    attention: ``"xla"`` or ``"dot_product_attention"`` (see :class:`AttentionBlock`).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec with block types ``attn`` and ``mlp``.
    rngs: parameter initialisation keys (keyword-only).
  """

  def __init__(
      self,
      dim: int,
      num_heads: int,
      mlp_dim: int,
      *,
      dropout_rate: float = 0.0,
      causal: bool = False,
      attention: str = "xla",
      dtype: jnp.dtype = jnp.float32,
      policy: PolicyLike = None,
      rngs: nnx.Rngs,
  ):
    self.attn = AttentionBlock(
        dim, num_heads, dropout_rate=dropout_rate, causal=causal, attention=attention, dtype=dtype, policy=policy,
        rngs=rngs,
    )
    self.mlp = MLPBlock(dim, mlp_dim, dropout_rate=dropout_rate, dtype=dtype, policy=policy, rngs=rngs)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the attention then the MLP block (:func:`jaxckpt.core._blocks.transformer`).

    Args:
      x: ``[B, T, D]``.
      dropout_key: PRNG key, split between the two sublayers; ``None`` when dropout is off.
      deterministic: ``True`` turns dropout off.

    Returns:
      ``[B, T, D]``.
    """
    return blocks.transformer(x, attn=self.attn, mlp_block=self.mlp, dropout_key=dropout_key,
                              deterministic=deterministic)


class Stack(nnx.Module):
  """N identical blocks with parameters stacked on a leading layer axis, applied by ``jax.lax.scan`` or unrolled.

  Scanned (default): the blocks' remat sits inside the scan body, so the backward loop recomputes one layer at a
  time; this keeps remat effective on every backend and compiles one layer instead of N. Unrolled (``scan=False``):
  a Python loop over the same stacked parameters (same parameter tree, so checkpoints and gradients compare
  one-to-one); on XLA:CPU compile it with :func:`jaxckpt.jit` for remat to save memory.

  ``structure`` groups the blocks (:mod:`jaxckpt.core._structure`): ``every:K`` rematerializes groups of K blocks,
  ``nested[:D]`` nests D levels of groups (√N memory for D = 2), each group under ``jax.checkpoint(nothing_saveable)``
  with the blocks' own policies inside. Non-parameter state of the blocks (e.g. batch statistics) is carried out of
  the loops and written back.

  A :class:`~jaxckpt.policies.LayeredPolicy` set by :func:`set_policy` (attribute ``layered``) splits the layers into
  consecutive ranges, each its own scan (or unrolled run) with its blocks under that range's spec: the mixed plans of
  :mod:`jaxckpt.planner`. It needs ``structure="block"``.

  Args:
    make_block: ``rngs -> block``; the block is called as ``block(x, dropout_key=..., deterministic=...)``.
    num_layers: N ≥ 1.
    scan: scan over layers (and groups) (``True``) or unroll (``False``).
    structure: ``"block"`` (default), ``"every:K"``, ``"nested"`` or ``"nested:D"``.
    rngs: initialisation keys, split into one per layer (keyword-only).

  Raises:
    JaxckptError: ``num_layers`` < 1 or a malformed ``structure``.
  """

  stacked_layers: ClassVar[str] = "layers"
  """The attribute whose parameters are stacked on a leading layer axis (axis 0): what a module declares so that
  :func:`jaxckpt.sharding.stacked_layer_paths` finds it (the FSDP rule never splits that axis)."""

  def __init__(
      self,
      make_block: Callable[[nnx.Rngs], nnx.Module],
      num_layers: int,
      *,
      scan: bool = True,
      structure: "str | Structure" = "block",
      rngs: nnx.Rngs,
  ):
    if num_layers < 1:
      raise JaxckptError(f"num_layers={num_layers} must be ≥ 1")
    self.num_layers, self.scan = num_layers, scan
    self.structure = parse_structure(structure)
    self.layered: LayeredPolicy | None = None

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> nnx.Module:
      return make_block(rngs)

    self.layers = create(rngs)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the N blocks in order; layer i gets ``jax.random.split(dropout_key, N)[i]``.

    Args:
      x: input of the first block (any shape the blocks take).
      dropout_key: PRNG key, or ``None`` when dropout is off.
      deterministic: ``True`` turns dropout off.

    Returns:
      Output of the last block, shaped like ``x``.
    """
    recorded = _STACK_INPUTS.get()
    if recorded is not None:
      recorded.append((self, jax.ShapeDtypeStruct(x.shape, x.dtype)))
    graphdef, params, other = nnx.split(self.layers, nnx.Param, ...)
    keys = None if dropout_key is None else jax.random.split(dropout_key, self.num_layers)

    def apply_block(h, layer, spec: PolicySpec | None = None):
      layer_params, layer_other, key = layer
      h = constrain(h, (BATCH,) + (None,) * (h.ndim - 1))  # each layer's input split over the batch axes of the mesh
      block = nnx.merge(graphdef, layer_params, layer_other)
      if spec is not None:  # a range of a LayeredPolicy: its spec, validated by set_policy
        for sub in remat_blocks(block):
          sub.policy = spec
      h = block(h, dropout_key=key, deterministic=deterministic)
      return h, nnx.state(block, nnx.Not(nnx.Param))

    layers = (params, other, keys)
    if self.layered is None:
      x, new_other = apply_layers(apply_block, x, layers, self.num_layers, structure=self.structure, scan=self.scan)
    else:
      x, new_other = apply_segments(lambda spec: functools.partial(apply_block, spec=spec), x, layers,
                                    self.layered.segments, scan=self.scan)
    nnx.update(self.layers, new_other)
    return x


def stacks(module: nnx.Module) -> list[Stack]:
  """Every :class:`Stack` inside ``module`` (``module`` itself included), in ``nnx.iter_modules`` order.

  The one place jaxckpt finds a model's layer stacks: :func:`set_policy`, the planner, the step core and FSDP
  sharding all ask here.
  """
  return [m for _, m in nnx.iter_modules(module) if isinstance(m, Stack)]


def remat_blocks(module: nnx.Module) -> list[RematBlock]:
  """The jaxckpt blocks inside an NNX module, in graph order.

  Args:
    module: any NNX module.

  Returns:
    Every :class:`RematBlock` found (the module itself included, if it is one).
  """
  return [m for _, m in nnx.iter_modules(module) if isinstance(m, RematBlock)]



def block_types(module: nnx.Module) -> dict[str, frozenset[str]]:
  """Returns the block types of a model and the checkpoint names each emits.

  Args:
    module: any NNX module containing jaxckpt blocks or blocks applied by :func:`jaxckpt.apply_remat`.

  Returns:
    ``{block_type: frozenset(checkpoint names)}``, e.g. ``{"attn": {...}, "mlp": {...}}`` for a ViT.

  Raises:
    JaxckptError: ``module`` is a Flax Linen module (the message names the Linen call).
  """
  linen = linen_error(module, "jaxckpt.block_types")
  if linen is not None:
    raise linen
  found: dict[str, set[str]] = {}
  for block in remat_blocks(module):
    found.setdefault(block.block_type, set()).update(block.checkpoint_names)
  for block_type, block_names in applied_block_types(module).items():  # your own blocks (jaxckpt.apply_remat)
    found.setdefault(block_type, set()).update(block_names)
  return {k: frozenset(v) for k, v in sorted(found.items())}


def set_policy(module: nnx.Module, policy: "PolicyLike | LayeredPolicy") -> PolicySpec | LayeredPolicy:
  """Sets the policy of every jaxckpt block inside ``module``, after validating it against them.

  Parameters are untouched, so one model can be compiled under several policies.

  Args:
    module: an NNX module containing jaxckpt blocks.
    policy: a policy spec (:func:`jaxckpt.parse_policy`), or a per-layer-range policy
      (:class:`~jaxckpt.policies.LayeredPolicy`, text ``0-3:dots_saveable;4-11:full``) for the model's
      stacks (:class:`Stack`): every stack must have that many layers and ``structure="block"``; blocks outside stacks
      get the first range's spec. A :class:`~jaxckpt.policies.Budget` must be planned first
      (:func:`jaxckpt.planner.plan_policy`).

  Returns:
    The parsed and validated spec or layered policy.

  Raises:
    PolicySpecError: malformed spec, a block type the model does not have, or a checkpoint name its blocks never
      emit.
    JaxckptError: a remat policy for a model without blocks (the message lists its classes); a layered policy for
      a model without stacks, or whose layer count or structure does not fit a stack; a budget (not yet planned).
  """
  parsed = parse_model_policy(policy)
  if parsed.scope == "loss":
    raise JaxckptError(f"policy {str(parsed)!r} remats the whole loss, not the model's blocks, so it cannot be set on a "
                       "model: the report and the planner apply it to the train step they build "
                       "(jaxckpt.planner.resolve_policy), and jaxckpt.planner._whole gives its loss as plain JAX")
  if not parsed.resolved:
    raise JaxckptError(f"policy {str(parsed)!r} is model-level: plan it for the model first with "
                       "jaxckpt.planner.resolve_policy(target, policy), then set the policy it returns")
  types = block_types(module)
  if not types and parsed.remat:  # ``none`` on a model without blocks is true as it is; a remat policy is not
    raise no_blocks_error(module, f"set_policy({str(parsed)!r})")
  parsed = validate_applied(module, parsed, types)  # names your own blocks tag themselves: checked when traced
  found = stacks(module)
  layered = parsed.layered
  if layered is not None and not found and applied_block_types(module):
    set_layered_policy(module, layered)  # your own model's layers (jaxckpt.apply_remat): one spec per instance
    for block in remat_blocks(module):
      block.policy = parsed.base_spec
    return parsed
  if layered is not None and not found:
    raise JaxckptError(f"layered policy {str(parsed)!r} needs a model with a jaxckpt Stack; this one has none")
  for stack in found:
    parsed.segments_for(stack.num_layers)  # raises for another layer count
    if layered is not None and stack.structure.levels != 1:
      raise JaxckptError(f"layered policy {str(parsed)!r} needs structure block, the stack has {stack.structure}")
  for block in remat_blocks(module):
    block.policy = parsed.base_spec
  set_applied_policy(module, parsed.base_spec)
  for stack in found:
    stack.layered = layered
  return parsed

