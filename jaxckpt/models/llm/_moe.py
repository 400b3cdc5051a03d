"""A Mixture-of-Experts layer: a router picks k of X gated experts per token, and one of three dispatches runs them.

- **Routing** (:func:`route`): ``softmax``, the weights the softmax of the k largest logits (Mixtral; Qwen3-MoE's
  ``norm_topk_prob``, the same numbers); ``sigmoid``, sigmoid scores, the k largest of score + a bias chosen, their
  scores normalised and scaled (DeepSeek-V3's auxiliary-loss-free routing; its group-limited choice is left out).
- **Dispatch** (``dispatch=``), MaxText's three paths (AI-Hypercomputer/maxtext ``layers/moe.py``):

  - ``dropping``: GShard's capacity dispatch (Lepikhin et al. 2020): each expert takes at most
    ``C = ceil(S·k / X) · capacity_factor`` tokens of a sequence, later tokens beyond it are dropped (they pass the
    residual only); one-hot dispatch and combine masks ``[B, S, X, C]`` and ``einsum`` s, so every matmul is a
    ``dot_general`` and XLA's SPMD partitioner splits the experts over an ``expert`` mesh axis with all-to-alls
    (MaxText's ``dense_matmul`` with ``capacity_factor > 0``, its T11/T12 configurations).
  - ``ragged``: dropless (Gale et al. 2023, "MegaBlocks"): the T·k (token, expert) pairs sorted by expert, the expert
    matmuls one ``jax.lax.ragged_dot`` each over the sorted rows (MaxText's ``sparse_matmul`` without megablox).
  - ``gmm``: dropless, the grouped matmuls by the megablox Pallas TPU kernel
    (``jax.experimental.pallas.ops.tpu.megablox``; MaxText's default ``megablox: true``), a ``jax.custom_vjp`` whose
    backward runs the kernel again (``gmm``, ``tgmm``). ``auto`` picks it on a TPU and ``ragged`` elsewhere.

  The dropless dispatches sort each device's own tokens: under a mesh they run in ``jax.shard_map``, the batch split
  over the mesh's batch axes, the experts' hidden width over ``tensor`` (their outputs summed over it), and the
  experts' weights gathered over ``fsdp`` and ``expert`` per layer (an ``expert`` axis splits them at rest, as FSDP
  does; only the dropping dispatch splits the experts' work over it).

- **Checkpoint names** at MaxText's places (:data:`jaxckpt.names.MOE_NAMES`): each expert matmul tagged twice, the
  dense MLP's name inside the MoE knob's (``mlpwi_0`` in ``moe_mlpwi_0``, ``mlpwo`` in ``moe_mlpwo``; ``mlpwi_1`` in
  ``moe_mlpwi_1`` on the dropping path, ``moe_mlpwi_1`` alone on the dropless one, as MaxText's sparse path tags it),
  and on the dropless path ``moe_x_sorted`` (the sorted tokens) and ``moe_routing_maps`` (sort order, tokens per
  expert, weights).

Parameters (logical names): ``gate [E, X]`` (embed, none), with ``sigmoid`` routing ``gate_bias [X]`` (not trained:
DeepSeek-V3 moves it by a load rule, left out), ``wi_0`` and ``wi_1 [X, E, F]`` (exp, embed, mlp), ``wo [X, F, E]``
(exp, mlp, embed): ``exp`` is split over an ``expert`` mesh axis.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import PartitionSpec

from jaxckpt import names
from jaxckpt.errors import JaxckptError
from jaxckpt.models.llm._params import param
from jaxckpt.sharding._rules import constrain, moe_split, traced_platform

class MoEDispatch(str, enum.Enum):
  """How a Mixture of Experts runs its experts (module docstring): the ``moe_dispatch=`` choices, read once
  (:meth:`parse`) and compared as members everywhere after. ``str``-valued, so JSON, CSV and the CLI's
  ``--moe-dispatch`` keep the text (``MoEDispatch.GMM == "gmm"``, ``str(MoEDispatch.GMM) == "gmm"``)."""

  AUTO = "auto"  # gmm on a TPU, ragged elsewhere (select_dispatch)
  DROPPING = "dropping"  # GShard's capacity dispatch: one-hot masks and einsums, tokens over capacity dropped
  RAGGED = "ragged"  # dropless: tokens sorted by expert, jax.lax.ragged_dot
  GMM = "gmm"  # dropless: the megablox Pallas grouped matmul (TPU)

  def __str__(self) -> str:
    return self.value

  def __format__(self, spec: str) -> str:
    return format(self.value, spec)

  @classmethod
  def parse(cls, value: "str | MoEDispatch") -> "MoEDispatch":
    """The member of ``value`` (a member or its text).

    Raises:
      JaxckptError: an unknown dispatch, named as the ``moe_dispatch`` argument with the valid ones.
    """
    try:
      return cls(value)
    except ValueError:
      raise JaxckptError(f"moe_dispatch={value!r} is unknown; valid: {', '.join(MOE_DISPATCHES)}") from None


MOE_DISPATCHES: tuple[str, ...] = tuple(d.value for d in MoEDispatch)
"""The ``moe_dispatch=`` choices as text (:class:`MoEDispatch`)."""
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid")
"""The ``router=`` choices (:func:`route`)."""

EXPERT_AXES = ("activation_exp", "activation_batch_no_exp", None, "activation_embed")
"""Logical names of the dropping dispatch's expert inputs and outputs ``[X, B, C, E]``: experts over ``expert``, the
batch over ``data`` and ``fsdp``."""
EXPERT_MLP_AXES = ("activation_exp", "activation_batch_no_exp", None, "activation_mlp")
"""Logical names of the dropping dispatch's hidden activations ``[X, B, C, F]``."""
MASK_AXES = ("activation_batch", "activation_length", None, None)
"""Logical names of the dispatch and combine masks ``[B, S, X, C]``."""


def select_dispatch(dispatch: "str | MoEDispatch") -> MoEDispatch:
  """The dispatch that runs: ``dispatch`` itself, or for ``auto`` ``gmm`` when the trace is compiled for a TPU
  (:func:`jaxckpt.sharding._rules.traced_platform`), else ``ragged``.

  Raises:
    JaxckptError: an unknown dispatch, listing the valid ones.
  """
  dispatch = MoEDispatch.parse(dispatch)
  if dispatch is not MoEDispatch.AUTO:
    return dispatch
  return MoEDispatch.GMM if traced_platform() == "tpu" else MoEDispatch.RAGGED


def route(logits: jax.Array, k: int, *, router: str = "softmax", bias: jax.Array | None = None,
          scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """The k experts of every token and their weights.

  Args:
    logits: ``[..., X]`` router logits (any float dtype; routed in float32).
    k: experts per token, ``1 ≤ k ≤ X``.
    router: ``"softmax"``: the k largest logits, weights their softmax (Mixtral, Jiang et al. 2024; equal to the
      softmax over all X renormalised over the k, Qwen3's ``norm_topk_prob``); ``"sigmoid"``: scores
      ``sigmoid(logits)``, the k largest ``score + bias`` chosen, weights their scores over the scores' sum
      (DeepSeek-V3, DeepSeek-AI 2024, §2.1.2).
    bias: ``[X]`` selection bias of ``sigmoid`` (its gradient stopped), or ``None``.
    scale: factor of the weights (DeepSeek-V3's ``routed_scaling_factor`` 2.5).

  Returns:
    ``(indices [..., k] int32, weights [..., k] float32)``.
  """
  logits = logits.astype(jnp.float32)
  if router == "softmax":
    top, indices = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top, axis=-1)
  elif router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choose = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, indices = jax.lax.top_k(choose, k)
    top = jnp.take_along_axis(scores, indices, axis=-1)
    weights = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
  else:
    raise JaxckptError(f"router={router!r} is unknown; valid: {', '.join(ROUTERS)}")
  return indices.astype(jnp.int32), weights * scale


def _activate(gate: jax.Array, activation: str) -> jax.Array:
  return jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)


def expert_capacity(seq_len: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Tokens of one sequence each expert takes in the dropping dispatch: MaxText's
  ``int(ceil(S·k / X) · capacity_factor)`` (``RoutedMoE.generate_masks``), at least 1, at most S (a token meets an
  expert once)."""
  return max(1, min(seq_len, int(math.ceil(seq_len * k / num_experts) * capacity_factor)))


def dropping_moe(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_0: jax.Array, wi_1: jax.Array,
                 wo: jax.Array, *, capacity_factor: float, activation: str) -> jax.Array:
  """The dropping dispatch (module docstring): GShard's capacity masks and ``einsum`` s.

  Args:
    x: ``[B, S, E]`` tokens (compute dtype).
    indices, weights: ``[B, S, k]`` from :func:`route`.
    wi_0, wi_1: ``[X, E, F]``; wo: ``[X, F, E]`` (compute dtype).
    capacity_factor: of :func:`expert_capacity`.
    activation: ``"silu"`` or ``"gelu"``.

  Returns:
    ``[B, S, E]`` (compute dtype): each token's kept experts' outputs, weighted; a dropped (token, expert) pair adds
    nothing.
  """
  batch, seq, _ = x.shape
  num_experts, k = wi_0.shape[0], indices.shape[-1]
  capacity = expert_capacity(seq, num_experts, k, capacity_factor)
  chosen = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # [B, S, k, X]
  # Position of each (token, expert) pair in its expert's buffer: the order of the sequence, then of the k choices.
  position = jnp.cumsum(chosen.reshape(batch, seq * k, num_experts), axis=1).reshape(chosen.shape) * chosen
  # A token picks k distinct experts, so summing over the k choices keeps each (token, expert) pair's own figures.
  position = jnp.sum(position, axis=2)  # [B, S, X]: 1-based slot, 0 where the expert was not chosen
  gain = jnp.einsum("bskx,bsk->bsx", chosen.astype(jnp.float32), weights)  # [B, S, X]: the pair's routing weight
  dispatch = constrain(jax.nn.one_hot(position - 1, capacity, dtype=x.dtype), MASK_AXES)  # [B, S, X, C]; 0 past C
  combine = constrain(dispatch * gain[..., None].astype(x.dtype), MASK_AXES)
  tokens = constrain(jnp.einsum("bse,bsxc->xbce", x, dispatch), EXPERT_AXES)  # [X, B, C, E]
  gate = jnp.einsum("xbce,xef->xbcf", tokens, wi_0)
  gate = checkpoint_name(checkpoint_name(constrain(gate, EXPERT_MLP_AXES), names.MLPWI_0), names.MOE_MLPWI_0)
  up = jnp.einsum("xbce,xef->xbcf", tokens, wi_1)
  up = checkpoint_name(checkpoint_name(constrain(up, EXPERT_MLP_AXES), names.MLPWI_1), names.MOE_MLPWI_1)
  out = jnp.einsum("xbcf,xfe->xbce", _activate(gate, activation) * up, wo)
  out = checkpoint_name(checkpoint_name(constrain(out, EXPERT_AXES), names.MLPWO), names.MOE_MLPWO)
  return jnp.einsum("xbce,bsxc->bse", out, combine)


def _tile(size: int) -> int:
  """The megablox kernel's block along a dimension of ``size``: the largest power of two ≤ 512 dividing it."""
  return math.gcd(size, 512)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, kernel: "str | MoEDispatch",
                   interpret: bool = False) -> jax.Array:
  """Rows of ``lhs`` in consecutive groups, each group times its own matrix: ``[M, K] × [G, K, N] → [M, N]``.

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    rhs: ``[G, K, N]``, same dtype.
    group_sizes: ``[G]`` int32, rows per group (summing to at most M; rows past the sum come out 0 with ``ragged``).
    kernel: ``"ragged"`` (``jax.lax.ragged_dot``: XLA's grouped matmul on every platform) or ``"gmm"`` (the megablox
      Pallas kernel: a TPU, or ``interpret``).
    interpret: run the Pallas kernel in interpret mode (any platform; slow, for tests).

  Returns:
    ``[M, N]`` in ``lhs``'s dtype.

  Raises:
    JaxckptError: ``gmm`` on a trace that is not compiled for a TPU without ``interpret``.
  """
  if kernel == MoEDispatch.RAGGED:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
  if not interpret and (platform := traced_platform()) != "tpu":
    raise JaxckptError(f"moe_dispatch='gmm' runs the megablox Pallas TPU kernel, but this step is compiled for "
                       f"{platform}: use moe_dispatch='ragged' (or 'auto'), or gmm_interpret=True (Pallas interpret "
                       "mode: slow, for tests)")
  tiling = (_tile(lhs.shape[0]), _tile(lhs.shape[1]), _tile(rhs.shape[2]))
  return megablox.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=tiling, interpret=interpret)


def sorted_moe(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
               *, kernel: "str | MoEDispatch", activation: str, interpret: bool = False,
               tensor_axis: str | None = None) -> jax.Array:
  """The dropless dispatch on one device's tokens (module docstring): sort the (token, expert) pairs by expert, three
  grouped matmuls (:func:`grouped_matmul`), unsort, weight.

  Args:
    x: ``[T, E]`` tokens (compute dtype).
    indices, weights: ``[T, k]`` from :func:`route`.
    wi_0, wi_1: ``[X, E, F]``; wo: ``[X, F, E]`` (F this device's share of the hidden width).
    kernel: ``"ragged"`` or ``"gmm"``.
    activation: ``"silu"`` or ``"gelu"``.
    interpret: the megablox kernel in interpret mode.
    tensor_axis: the mesh axis the hidden width is split over (inside ``shard_map``; the outputs are summed over
      it), or ``None``.

  Returns:
    ``[T, E]`` in ``x``'s dtype.
  """
  tokens, k = indices.shape
  num_experts = wi_0.shape[0]
  flat = indices.reshape(tokens * k)
  order = jnp.argsort(flat, stable=True)  # [T·k]: pairs by expert, tokens in order within one
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X]
  order = checkpoint_name(order, names.MOE_ROUTING_MAPS)
  group_sizes = checkpoint_name(group_sizes, names.MOE_ROUTING_MAPS)
  weights = checkpoint_name(weights, names.MOE_ROUTING_MAPS)
  x_sorted = checkpoint_name(jnp.take(x, order // k, axis=0), names.MOE_X_SORTED)  # [T·k, E]
  gate = grouped_matmul(x_sorted, wi_0, group_sizes, kernel=kernel, interpret=interpret)
  gate = checkpoint_name(checkpoint_name(gate, names.MLPWI_0), names.MOE_MLPWI_0)
  up = checkpoint_name(grouped_matmul(x_sorted, wi_1, group_sizes, kernel=kernel, interpret=interpret),
                       names.MOE_MLPWI_1)  # MaxText's sparse path: this name only
  out = grouped_matmul(_activate(gate, activation) * up, wo, group_sizes, kernel=kernel, interpret=interpret)
  out = checkpoint_name(checkpoint_name(out, names.MLPWO), names.MOE_MLPWO)  # [T·k, E], sorted
  unsort = jnp.zeros_like(order).at[order].set(jnp.arange(tokens * k, dtype=order.dtype))
  per_pair = jnp.take(out, unsort, axis=0).reshape(tokens, k, -1)  # [T, k, E]
  y = jnp.einsum("tke,tk->te", per_pair.astype(jnp.float32), weights.astype(jnp.float32))
  if tensor_axis is not None:
    y = jax.lax.psum(y, tensor_axis)
  return y.astype(x.dtype)


class MoE(nnx.Module):
  """X gated experts of hidden width F, each token through the k its router picks (module docstring).

  Args:
    dim: model width E.
    expert_dim: each expert's hidden width F.
    num_experts: X.
    experts_per_token: k.
    dispatch: a :class:`MoEDispatch` (or its text, :data:`MOE_DISPATCHES`).
    capacity_factor: the dropping dispatch's (:func:`expert_capacity`).
    router: one of :data:`ROUTERS`.
    routed_scale: factor of the routed output.
    activation: ``"silu"`` (SwiGLU experts) or ``"gelu"``.
    gmm_interpret: the megablox kernel in interpret mode.
    dtype: compute dtype.
    param_dtype: parameter dtype.
    rngs: initialisation keys (keyword-only).

  Example::

    >>> moe = MoE(64, 32, 4, 2, rngs=nnx.Rngs(0))
    >>> moe(jnp.ones((2, 16, 64))).shape
    (2, 16, 64)
  """

  def __init__(self, dim: int, expert_dim: int, num_experts: int, experts_per_token: int, *,
               dispatch: str | MoEDispatch = MoEDispatch.AUTO,
               capacity_factor: float = 1.25, router: str = "softmax", routed_scale: float = 1.0,
               activation: str = "silu", gmm_interpret: bool = False, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    dispatch = MoEDispatch.parse(dispatch)
    if router not in ROUTERS:
      raise JaxckptError(f"router={router!r} is unknown; valid: {', '.join(ROUTERS)}")
    if not 1 <= experts_per_token <= num_experts:
      raise JaxckptError(f"experts_per_token={experts_per_token} must be between 1 and num_experts={num_experts}")
    fan_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    experts = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))
    self.gate = param(rngs, fan_in, (dim, num_experts), ("embed", None), param_dtype)
    self.gate_bias = (param(rngs, nnx.initializers.zeros, (num_experts,), (None,), param_dtype)
                      if router == "sigmoid" else None)
    self.wi_0 = param(rngs, experts, (num_experts, dim, expert_dim), ("exp", "embed", "mlp"), param_dtype)
    self.wi_1 = param(rngs, experts, (num_experts, dim, expert_dim), ("exp", "embed", "mlp"), param_dtype)
    self.wo = param(rngs, experts, (num_experts, expert_dim, dim), ("exp", "mlp", "embed"), param_dtype)
    self.experts_per_token, self.dispatch, self.capacity_factor = experts_per_token, dispatch, capacity_factor
    self.router, self.routed_scale, self.activation = router, routed_scale, activation
    self.gmm_interpret, self.dtype = gmm_interpret, dtype

  @property
  def splits_experts(self) -> bool:
    """Whether an ``expert`` mesh axis splits the experts' work (the dropping dispatch's all-to-alls), not only their
    weights at rest (the dropless dispatches gather them per layer); read by
    :func:`jaxckpt.step._compile.mesh_use_notes`."""
    return self.dispatch is MoEDispatch.DROPPING

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x: [B, S, E]`` (compute dtype) -> ``[B, S, E]`` (compute dtype), the routed experts' weighted sum."""
    dtype = self.dtype
    logits = jnp.einsum("bse,ex->bsx", x, self.gate[...].astype(dtype))  # [B, S, X]
    bias = None if self.gate_bias is None else self.gate_bias[...]
    indices, weights = route(logits, self.experts_per_token, router=self.router, bias=bias, scale=self.routed_scale)
    wi_0, wi_1, wo = (w[...].astype(dtype) for w in (self.wi_0, self.wi_1, self.wo))
    kind = select_dispatch(self.dispatch)
    if kind is MoEDispatch.DROPPING:
      return dropping_moe(x, indices, weights, wi_0, wi_1, wo, capacity_factor=self.capacity_factor,
                          activation=self.activation)
    return self._dropless(x, indices, weights, wi_0, wi_1, wo, kind)

  def _dropless(self, x, indices, weights, wi_0, wi_1, wo, kind: MoEDispatch) -> jax.Array:
    """:func:`sorted_moe` on each device's tokens: directly without a mesh, else in ``jax.shard_map`` (module
    docstring)."""
    batch, seq, dim = x.shape

    def per_device(x, indices, weights, wi_0, wi_1, wo, tensor_axis=None):
      b = x.shape[0]
      y = sorted_moe(x.reshape(b * seq, dim), indices.reshape(b * seq, -1), weights.reshape(b * seq, -1), wi_0, wi_1,
                     wo, kernel=kind, activation=self.activation, interpret=self.gmm_interpret,
                     tensor_axis=tensor_axis)
      return y.reshape(b, seq, dim)

    mesh = jax.sharding.get_abstract_mesh()
    batch_axes, tensor_axis = ((), None) if mesh.empty else moe_split(mesh, batch, wi_0.shape[2])
    if not batch_axes and tensor_axis is None:
      return per_device(x, indices, weights, wi_0, wi_1, wo)
    rows = PartitionSpec(batch_axes or None, None, None)
    specs = (rows, rows, rows, PartitionSpec(None, None, tensor_axis), PartitionSpec(None, None, tensor_axis),
             PartitionSpec(None, tensor_axis, None))
    return jax.shard_map(lambda *a: per_device(*a, tensor_axis=tensor_axis), mesh=mesh, in_specs=specs,
                         out_specs=rows, check_vma=False)(x, indices, weights, wi_0, wi_1, wo)
