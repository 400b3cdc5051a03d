"""Flax Linen counterparts of :mod:`jaxckpt.nnx._layers`: the same blocks, math, parameter trees and policy strings.

For codebases that have not moved to NNX. Each block is one *block type* (``attn``, ``mlp``, ``conv``) whose forward
pass runs under ``nn.remat(policy=...)`` with the policy of its block type from a jaxckpt policy spec
(:func:`jaxckpt.parse_policy`; ``none`` = no remat), and tags the same intermediates with the same checkpoint names
(:mod:`jaxckpt.names`) as the NNX block. :class:`TransformerBlock` is an ``attn`` block then an ``mlp`` block, each
remat'd on its own. :class:`Stack` applies N copies of a block with parameters on a leading layer axis (created by
``nn.scan``), scanned with ``jax.lax.scan`` (the remat inside the scan body) or unrolled over the same parameters.

The block math is :mod:`jaxckpt.core._blocks` and the stack's grouping and looping :mod:`jaxckpt.core._structure`, the same
code the NNX front-end calls; this module holds what is Linen's own (module fields, ``setup``, ``nn.remat``, the
``'dropout'`` RNG stream).

Parameter trees equal the NNX ones leaf for leaf (``norm``/``qkv``/``out``, ``norm``/``fc1``/``fc2``,
``norm``/``conv1``/``conv2``, ``attn``/``mlp``, ``layers`` with a leading layer axis), so
:func:`linen_params_from_nnx` and :func:`nnx_update_from_linen` move weights either way.

Two Flax traps are handled here, so users never meet them:

- ``nn.remat(..., static_argnums=...)`` counts ``self`` as argument 0 (Flax subtracts one before calling
  ``jax.checkpoint``). The remat'd function is ``forward(self, x, dropout_key, deterministic)``, so the static flag is
  ``static_argnums=(3,)``. Counting from ``x`` (``(2,)``) makes the dropout key static instead and leaves
  ``deterministic`` traced: ``TracerBoolConversionError`` at ``if deterministic`` (checked on Flax 0.12).
- ``deterministic`` must be a Python bool. A traced bool would hit ``if deterministic`` and raise
  ``TracerBoolConversionError``; jaxckpt checks it up front and says how to fix it (``static_argnames`` in ``jax.jit``).

Dropout uses an explicit ``dropout_key`` exactly as the NNX blocks do (same key → same masks as NNX, and the
recomputation draws the masks of the forward pass). If no key is given and dropout is on, one key is drawn from the
Linen ``'dropout'`` RNG stream (``module.apply(variables, x, rngs={'dropout': key}, deterministic=False)``) by the
outermost jaxckpt module and split as with an explicit key.

Example::

  >>> block = TransformerBlock(64, 4, 256, dropout_rate=0.1, policy="attn=dots_saveable,mlp=full")
  >>> model = Stack(block, num_layers=6)                                  # nn.scan over 6 layers
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 16, 64)))
  >>> y = model.apply(variables, x, dropout_key=jax.random.key(1), deterministic=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt import names
from jaxckpt.core import _blocks as blocks
from jaxckpt.errors import JaxckptError
from jaxckpt.linen import _apply as _own
from jaxckpt.policies._spec import PolicySpec, parse_policy
from jaxckpt.core._structure import apply_layers, parse_structure

PolicyLike = "str | Policy | PolicySpec | None"

_FORWARD_STATIC_ARGNUMS = (3,)
"""``forward(self, x, dropout_key, deterministic)``: ``nn.remat`` counts ``self`` as 0, so ``deterministic`` is 3."""


@dataclasses.dataclass(frozen=True)
class _CheckedSpec(PolicySpec):
  """A spec a parent module already validated against *its* block types; sub-blocks do not re-validate it.

  (A sub-block sees only its own block type: ``attn=full,mlp=full`` or ``save_only_these_names:qkv+mlp_hidden`` are
  valid for a Transformer layer but would fail against the attention sub-block alone.)
  """


def _checked(spec: PolicySpec) -> _CheckedSpec:
  return _CheckedSpec(default=spec.default, blocks=spec.blocks, text=spec.text)


def _static_flag(name: str, value: Any) -> bool:
  """Returns ``value`` as a Python bool, or raises a fix-it error for a traced/array flag."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise JaxckptError(
      f"{name} must be a Python bool (it selects code paths at trace time), got {type(value).__name__}: {value!r}; "
      f"under jax.jit pass it as a static argument (jax.jit(f, static_argnames='{name}')) or close over it"
  )


def _dropout_key(module: nn.Module, key: jax.Array | None, deterministic: bool) -> jax.Array | None:
  """The explicit key if given, else (dropout on) one drawn from the ``'dropout'`` RNG stream if there is one."""
  if key is None and not deterministic and module.has_rng("dropout"):
    return module.make_rng("dropout")
  return key


def _missing_key_error(module: nn.Module) -> JaxckptError:
  return JaxckptError(
      f"dropout is on in {type(module).__name__} (deterministic=False, dropout_rate > 0) but no dropout_key was given "
      "and no 'dropout' RNG stream: pass dropout_key=jax.random.key(...) or apply(..., rngs={'dropout': key})"
  )


class _Validating(nn.Module):
  """Validates ``policy`` against the module's block types at construction (unless a parent already did)."""

  def __post_init__(self):
    super().__post_init__()
    spec = parse_policy(self.policy)  # raises PolicySpecError for a malformed spec
    if not isinstance(spec, _CheckedSpec):
      spec.validate(self.block_types)

  @property
  def spec(self) -> PolicySpec:
    """The parsed :class:`~jaxckpt.PolicySpec` of ``policy``."""
    return parse_policy(self.policy)


class RematBlock(blocks.BlockMath, _Validating):
  """Base of the Linen residual blocks: a block type, the checkpoint names it emits, and a policy spec.

  :meth:`forward` is the block's math (a :class:`jaxckpt.core._blocks.BlockMath` mixin, shared with the other
  front-end); :meth:`__call__` runs it under ``nn.remat`` with the policy of
  :attr:`block_type` (no remat for ``none``), ``deterministic`` static.

  Attributes:
    block_type: class constant, e.g. ``"mlp"``.
    checkpoint_names: class constant, the names :meth:`forward` tags (see :mod:`jaxckpt.names`).
  """

  block_type: ClassVar[str]
  checkpoint_names: ClassVar[tuple[str, ...]]

  @property
  def block_types(self) -> dict[str, frozenset[str]]:
    """``{block_type: checkpoint names}``, the argument of :meth:`jaxckpt.PolicySpec.validate`."""
    return {self.block_type: frozenset(self.checkpoint_names)}


  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the block under ``nn.remat`` with the policy of its block type.

    Args:
      x: input activations (shape per subclass), float32 or bfloat16.
      dropout_key: PRNG key for dropout (same key → same masks as the NNX block); if ``None`` and dropout is on, one
        is drawn from the ``'dropout'`` RNG stream.
      deterministic: Python bool; ``True`` turns dropout off (evaluation).

    Returns:
      Output of the same shape and dtype as ``x``.

    Raises:
      JaxckptError: ``deterministic`` is not a Python bool, or dropout is on without any key.
    """
    deterministic = _static_flag("deterministic", deterministic)
    dropout_key = _dropout_key(self, dropout_key, deterministic)
    if dropout_key is None and not deterministic and self.dropout_rate > 0:
      raise _missing_key_error(self)
    policy = self.spec.for_block(self.block_type)
    forward = type(self).forward
    if policy.remat:
      forward = nn.remat(forward, policy=policy.to_jax(), prevent_cse=True, static_argnums=_FORWARD_STATIC_ARGNUMS)
    with jax.named_scope(self.block_type):  # traces and HLO op names read by block (metadata only), as in NNX
      return forward(self, x, dropout_key, deterministic)


class AttentionBlock(blocks.AttentionMath, RematBlock):
  """Pre-LN multi-head self-attention with a residual: ``x + Dropout(Wo · softmax(QKᵀ/√K) V)``; block type ``attn``.

  Linen twin of :class:`jaxckpt.nnx._layers.AttentionBlock` (same math, :func:`jaxckpt.core._blocks.attention`; parameters
  ``norm``/``qkv``/``out`` of the same shapes, same checkpoint names ``qkv``, ``attn_weights``, ``attn_context``,
  ``attn_out``). ``x: [B, T, D]``. With ``attention="dot_product_attention"`` the core is
  ``jax.nn.dot_product_attention`` and there are no ``attn_weights`` (nor dropout on them), as in NNX.

  Attributes:
    dim: model width D.
    num_heads: heads H; must divide ``dim``.
    dropout_rate: dropout on the attention weights (xla attention only) and on the output, in [0, 1).
    causal: mask future tokens (decoders).
    attention: ``"xla"`` (einsum + softmax) or ``"dot_product_attention"`` (:data:`jaxckpt.core._blocks.ATTENTION_IMPLEMENTATIONS`).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``attn`` entry applies).

  Raises:
    JaxckptError: ``num_heads`` does not divide ``dim``, an unknown ``attention``, or a rate outside [0, 1).
    PolicySpecError: a spec invalid for this block (e.g. ``mlp=full``).
  """

  dim: int
  num_heads: int
  dropout_rate: float = 0.0
  causal: bool = False
  dtype: Any = jnp.float32
  policy: Any = None
  attention: str = "xla"

  block_type = "attn"
  checkpoint_names = blocks.attention_checkpoint_names("xla")

  def __post_init__(self):
    blocks.check_attention(self.dim, self.num_heads, self.attention)
    blocks.check_dropout_rate(self.dropout_rate)
    super().__post_init__()

  @property
  def block_types(self) -> dict[str, frozenset[str]]:
    """``{"attn": names}``; without ``attn_weights`` for ``attention="dot_product_attention"``."""
    return {self.block_type: frozenset(blocks.attention_checkpoint_names(self.attention))}

  def setup(self):
    self.norm = nn.LayerNorm(dtype=self.dtype)
    self.qkv = nn.Dense(3 * self.dim, dtype=self.dtype)
    self.out = nn.Dense(self.dim, dtype=self.dtype)


class MLPBlock(blocks.MLPMath, RematBlock):
  """Pre-LN residual MLP: ``x + Dropout(W2 · gelu(W1 · LN(x)))``; block type ``mlp``.

  Linen twin of :class:`jaxckpt.nnx._layers.MLPBlock` (parameters ``norm``/``fc1``/``fc2``; names ``mlp_hidden``
  ``[..., F]`` and ``mlp_out`` ``[..., D]``). ``x: [..., D]``.

  Attributes:
    dim: width D.
    hidden_dim: hidden width F.
    dropout_rate: dropout on the output, in [0, 1).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``mlp`` entry applies).
  """

  dim: int
  hidden_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  policy: Any = None

  block_type = "mlp"
  checkpoint_names = (names.MLP_HIDDEN, names.MLP_OUT)

  def __post_init__(self):
    blocks.check_dropout_rate(self.dropout_rate)
    super().__post_init__()

  def setup(self):
    self.norm = nn.LayerNorm(dtype=self.dtype)
    self.fc1 = nn.Dense(self.hidden_dim, dtype=self.dtype)
    self.fc2 = nn.Dense(self.dim, dtype=self.dtype)


class ConvBlock(blocks.ConvMath, RematBlock):
  """Pre-norm residual conv block: ``x + Dropout(conv(gelu(conv(LN(x)))))``; block type ``conv``.

  Linen twin of :class:`jaxckpt.nnx._layers.ConvBlock` (parameters ``norm``/``conv1``/``conv2``, kernels
  ``[k, k, C, C]``; names ``conv_hidden`` and ``conv_out``, both ``[B, h, w, C]``). ``x: [B, h, w, C]``.

  Attributes:
    channels: channels C ('SAME' padding, stride 1).
    kernel_size: square kernel side (pixels).
    dropout_rate: dropout on the output, in [0, 1).
    dtype: compute dtype (parameters stay float32).
    policy: policy spec (the ``conv`` entry applies).
  """

  channels: int
  kernel_size: int = 3
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  policy: Any = None

  block_type = "conv"
  checkpoint_names = (names.CONV_HIDDEN, names.CONV_OUT)

  def __post_init__(self):
    blocks.check_dropout_rate(self.dropout_rate)
    super().__post_init__()

  def setup(self):
    kernel = (self.kernel_size, self.kernel_size)
    self.norm = nn.LayerNorm(dtype=self.dtype)
    self.conv1 = nn.Conv(self.channels, kernel, padding="SAME", dtype=self.dtype)
    self.conv2 = nn.Conv(self.channels, kernel, padding="SAME", dtype=self.dtype)


class TransformerBlock(_Validating):
  """Pre-LN Transformer encoder layer: an ``attn`` block then an ``mlp`` block, each remat'd with its own policy.

  Linen twin of :class:`jaxckpt.nnx._layers.TransformerBlock` (parameters ``attn``, ``mlp``). ``x: [B, T, D]``.
  ``dropout_key`` is split in two, one per sublayer, as in NNX.

  Attributes:
    dim: model width D.
    num_heads: attention heads H (divides D).
    mlp_dim: MLP hidden width F.
    dropout_rate: dropout in both sublayers, in [0, 1).
    causal: causal attention mask.
    dtype: compute dtype (parameters stay float32).
    policy: policy spec with block types ``attn`` and ``mlp``.
    attention: ``"xla"`` or ``"dot_product_attention"`` (see :class:`AttentionBlock`).

  Raises:
    JaxckptError: ``num_heads`` does not divide ``dim``, an unknown ``attention``, or a rate outside [0, 1).
    PolicySpecError: a spec invalid for this layer.
  """

  dim: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  causal: bool = False
  dtype: Any = jnp.float32
  policy: Any = None
  attention: str = "xla"

  def __post_init__(self):
    blocks.check_attention(self.dim, self.num_heads, self.attention)
    super().__post_init__()

  @property
  def block_types(self) -> dict[str, frozenset[str]]:
    """``{"attn": ..., "mlp": ...}`` with the checkpoint names of each."""
    return {"attn": frozenset(blocks.attention_checkpoint_names(self.attention)),
            "mlp": frozenset(MLPBlock.checkpoint_names)}

  def setup(self):
    spec = _checked(self.spec)
    self.attn = AttentionBlock(self.dim, self.num_heads, dropout_rate=self.dropout_rate, causal=self.causal,
                               dtype=self.dtype, policy=spec, attention=self.attention)
    self.mlp = MLPBlock(self.dim, self.mlp_dim, dropout_rate=self.dropout_rate, dtype=self.dtype, policy=spec)

  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the attention then the MLP block (:func:`jaxckpt.core._blocks.transformer`), ``deterministic`` static.

    Args:
      x: ``[B, T, D]``.
      dropout_key: PRNG key, split between the two sublayers; if ``None`` and dropout is on, one is drawn from the
        ``'dropout'`` RNG stream.
      deterministic: Python bool; ``True`` turns dropout off.

    Returns:
      ``[B, T, D]``.

    Raises:
      JaxckptError: ``deterministic`` is not a Python bool.
    """
    deterministic = _static_flag("deterministic", deterministic)
    return blocks.transformer(x, attn=self.attn, mlp_block=self.mlp,
                              dropout_key=_dropout_key(self, dropout_key, deterministic), deterministic=deterministic)


class Stack(nn.Module):
  """N copies of a block with parameters stacked on a leading layer axis, applied by ``jax.lax.scan`` or unrolled.

  Linen twin of :class:`jaxckpt.nnx._layers.Stack`. Parameters: ``{"layers": <block's tree, each leaf [N, ...]>}`` in both
  modes (and equal to the NNX stack's), so scanned and unrolled stacks share checkpoints.

  - Parameters are created by ``nn.scan(variable_axes={'params': 0}, split_rngs={'params': True}, length=N)`` at
    ``init``.
  - Scanned (default): ``jax.lax.scan`` over the layers' parameter slices, ``block.apply`` with the block's own
    ``nn.remat`` inside the scan body, so the backward loop recomputes one layer at a time (remat works on every
    backend; one layer is compiled).
  - Unrolled (``scan=False``): a Python loop over layer ``i``'s slice of the same stacked parameters. Initialisation
    runs ``nn.scan`` in both modes, so ``scan=True`` and ``scan=False`` give the same parameters from the same key. On
    XLA:CPU compile with :func:`jaxckpt.jit` for remat to save memory.

  ``structure`` groups the blocks with the NNX stack's code (:func:`jaxckpt.core._structure.apply_layers`): ``every:K``
  rematerializes groups of K blocks, ``nested[:D]`` nests D levels of groups, each group under
  ``jax.checkpoint(nothing_saveable)`` with the blocks' own policies inside; runs of equal-size groups are scanned
  (or looped with ``scan=False``). The parameter tree is the same in every mode.

  Layer ``i`` gets ``jax.random.split(dropout_key, N)[i]``, as in NNX. Only the ``params`` collection is supported
  (jaxckpt's blocks have no other state).

  Attributes:
    block: an unbound block *template*, e.g. ``TransformerBlock(64, 4, 256, policy="full")``, called as
      ``block(x, dropout_key=..., deterministic=...)``; its ``policy`` is the stack's.
    num_layers: N ≥ 1.
    scan: scan over layers (and groups) (``True``) or unroll (``False``).
    structure: ``"block"`` (default), ``"every:K"``, ``"nested"`` or ``"nested:D"`` (or a
      :class:`~jaxckpt.core._structure.Structure`).

  Raises:
    JaxckptError: ``num_layers`` < 1, a malformed ``structure``, or a ``block`` without ``block_types`` (not a
      jaxckpt Linen block).
  """

  block: nn.Module
  num_layers: int
  scan: bool = True
  structure: Any = "block"

  def __post_init__(self):
    if self.num_layers < 1:
      raise JaxckptError(f"num_layers={self.num_layers} must be ≥ 1")
    parse_structure(self.structure)  # raises JaxckptError (with a did-you-mean) for a malformed structure
    if not hasattr(type(self.block), "block_types"):
      raise JaxckptError(
          f"Stack needs a jaxckpt.linen block (AttentionBlock, MLPBlock, ConvBlock, TransformerBlock or Stack), got "
          f"{type(self.block).__name__}"
      )
    super().__post_init__()

  @property
  def block_types(self) -> dict[str, frozenset[str]]:
    """The block types of ``block``."""
    return self.block.block_types

  @property
  def policy(self) -> Any:
    """The block's policy."""
    return self.block.policy

  @nn.compact
  def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """Applies the N blocks in order; layer i gets ``jax.random.split(dropout_key, N)[i]``.

    Args:
      x: input of the first block (any shape the block takes).
      dropout_key: PRNG key, or ``None`` (then drawn from the ``'dropout'`` stream if dropout is on).
      deterministic: Python bool; ``True`` turns dropout off.

    Returns:
      Output of the last block, shaped like ``x``.
    """
    deterministic = _static_flag("deterministic", deterministic)
    dropout_key = _dropout_key(self, dropout_key, deterministic)
    keys = None if dropout_key is None else jax.random.split(dropout_key, self.num_layers)
    if self.is_initializing():  # nn.scan creates the stacked parameters ("layers", leading axis N)

      def body(layer, h, key):
        return layer(h, dropout_key=key, deterministic=deterministic), None

      scan = nn.scan(
          body, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0, length=self.num_layers
      )
      x, _ = scan(self.block.clone(parent=self, name="layers"), x, keys)
      return x
    layer = self.block.clone(parent=None, name=None)

    def apply_block(h, layer_i):
      params_i, key_i = layer_i
      return layer.apply({"params": params_i}, h, dropout_key=key_i, deterministic=deterministic), None

    x, _ = apply_layers(apply_block, x, (self.variables["params"]["layers"], keys), self.num_layers,
                        structure=self.structure, scan=self.scan)
    return x


def block_types(module: Any, *args, **kwargs) -> dict[str, frozenset[str]]:
  """Returns the block types of a Linen model and the checkpoint names each emits.

  Args:
    module: a block, :class:`TransformerBlock` or :class:`Stack` from this module (bound or not); or your own model
      from :func:`apply_remat` (a :class:`~jaxckpt.linen._apply.RematModule`), whose names are found by tracing
      ``module.init(*args, **kwargs)`` (:func:`jaxckpt.linen._apply.block_types`).
    *args: for a RematModule: what its ``init`` takes, an RNG key then the inputs (arrays or
      ``jax.ShapeDtypeStruct``).
    **kwargs: for a RematModule: keyword arguments of ``init`` (``deterministic=True``, ``train=False``).

  Returns:
    ``{block_type: frozenset(checkpoint names)}``, sorted by block type, for :meth:`jaxckpt.PolicySpec.validate`.

  Raises:
    JaxckptError: ``module`` is neither a jaxckpt Linen module nor a RematModule; a RematModule without the
      arguments of its ``init``.
  """
  if isinstance(module, _own.RematModule):
    if not args:
      raise JaxckptError(f"block_types({type(module.module).__name__} from apply_remat) traces its init: give an RNG "
                         "key and example inputs, block_types(model, jax.random.key(0), x), or read "
                         "target.block_types of jaxckpt.linen_model_target")
    return dict(sorted(_own.block_types(module, *args, **kwargs).items()))
  types = getattr(module, "block_types", None)
  if not isinstance(types, Mapping):
    raise JaxckptError(
        f"{type(module).__name__} declares no block types; use a jaxckpt.linen block (AttentionBlock, MLPBlock, "
        "ConvBlock, TransformerBlock or Stack), or your own model through jaxckpt.linen.apply_remat(module, policy, "
        "blocks=...)"
    )
  return dict(sorted(types.items()))


def with_policy(module: nn.Module, policy: PolicyLike) -> nn.Module:
  """Returns a copy of an (unbound) jaxckpt Linen module with another policy, validated against it.

  Linen modules are immutable, so there is no in-place ``set_policy`` here; this is the counterpart of
  :func:`jaxckpt.nnx.with_policy`. Parameters are unchanged (a policy does not change the parameter tree), so the
  same variables apply.

  Args:
    module: a block, :class:`TransformerBlock` or :class:`Stack`; or your model from :func:`apply_remat` (a
      :class:`~jaxckpt.linen.RematModule`: :meth:`~jaxckpt.linen.RematModule.with_policy`, which also takes layered
      policies).
    policy: the policy spec.

  Returns:
    The new module.

  Raises:
    PolicySpecError: malformed spec, a block type the module does not have, or a checkpoint name it never emits.
  """
  if isinstance(module, _own.RematModule):
    return module.with_policy(policy)
  spec = parse_policy(policy).validate(block_types(module))
  if isinstance(module, Stack):
    return module.clone(block=with_policy(module.block, spec))
  return module.clone(policy=spec)


def _pure(tree: Any) -> Any:
  """A nested plain ``dict`` (Flax may hand out ``FrozenDict``s or ``State``s)."""
  return {k: _pure(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def linen_params_from_nnx(module: nnx.Module) -> dict[str, Any]:
  """Returns the Linen ``params`` of an NNX jaxckpt block/stack: its ``nnx.Param`` values as a nested dict.

  The Linen twin of a :mod:`jaxckpt.nnx._layers` module has the same parameter tree, so
  ``linen_twin.apply({"params": linen_params_from_nnx(nnx_module)}, x)`` computes what ``nnx_module(x)`` does.

  Args:
    module: an NNX module (e.g. :class:`jaxckpt.nnx._layers.TransformerBlock` or :class:`jaxckpt.nnx._layers.Stack`).

  Returns:
    ``{name: {...: array}}`` (the arrays themselves, not copies).

  Example::

    >>> nnx_block = jaxckpt.TransformerBlock(64, 4, 256, rngs=nnx.Rngs(0))
    >>> y = TransformerBlock(64, 4, 256).apply({"params": linen_params_from_nnx(nnx_block)}, x)
  """
  return _pure(nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def nnx_update_from_linen(module: nnx.Module, params: Mapping[str, Any]) -> nnx.Module:
  """Writes Linen ``params`` (e.g. ``variables["params"]``) into the NNX twin, in place (migrating to NNX).

  Args:
    module: the NNX module with the same parameter tree.
    params: the Linen parameters.

  Returns:
    ``module``, updated.

  Raises:
    JaxckptError: the trees differ (names or shapes), naming the first mismatch.
  """
  state = nnx.state(module, nnx.Param)
  want = jax.tree_util.tree_flatten_with_path(_pure(nnx.to_pure_dict(state)))[0]
  got = dict(jax.tree_util.tree_flatten_with_path(_pure(params))[0])
  for path, leaf in want:
    where = jax.tree_util.keystr(path)
    if path not in got:
      raise JaxckptError(f"Linen params lack {where} that {type(module).__name__} has; is it the same block type?")
    if got[path].shape != leaf.shape:
      raise JaxckptError(f"shape mismatch at {where}: Linen {got[path].shape} vs NNX {leaf.shape}")
  if len(got) != len(want):
    extra = sorted(set(got) - {p for p, _ in want}, key=str)
    raise JaxckptError(f"Linen params have {jax.tree_util.keystr(extra[0])} that {type(module).__name__} lacks")
  nnx.replace_by_pure_dict(state, _pure(params))
  nnx.update(module, state)
  return module
