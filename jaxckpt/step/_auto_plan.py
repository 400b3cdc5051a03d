"""The automatic tensor plan: Megatron-LM's column/row pairs in each block of your own model, found by data flow.

``tensor_plan="auto"`` (:func:`jaxckpt.nnx_model_target`) resolves here, once, into an ordinary path plan
(:class:`jaxckpt.sharding.TensorPlan`) that it prints. In each block (a module :func:`jaxckpt.apply_remat` matched:
``blocks=``; a stack of blocks made with ``nnx.vmap`` and run with ``nnx.scan`` is one block whose kernels are
``[L, in, out]``) the ``nnx.Linear`` layers are taken in the order the traced loss calls them, and each matmul's
input is followed back to the matmuls it depends on (:func:`jaxckpt.analysis._dataflow.matmul_reads`: through
reshapes, rotary embeddings, attention and its softmax). Megatron-LM's Transformer split (Shoeybi et al. 2019, §3)
is then a sequence of *pairs*: layers that read nothing of each other (the query/key/value projections; the MLP's
gate and up projections) are ``colwise``, and the next layer, which reads all of them (attention's output
projection; the MLP's down projection), is ``rowwise`` and closes the pair: one all-reduce per pair and pass. Names
play no part, so ``wq``/``w1``/``c_fc`` read as well as ``q_proj``.

A pair must also fit by shape: the colwise layers read the width the rowwise layer writes (``[D, ·]`` ... ``[·, D]``),
and the rowwise layer reads what a colwise one writes, or a part of it (a fused projection: timm's ``qkv`` ``[D, 3D]``
before ``proj`` ``[D, D]``).

**Modulation layers** are ``colwise`` on their own: a layer whose output the later layers of the block read only as
a broadcast scale or shift, adaLN's ``adaLN_modulation`` in a DiT block (Peebles & Xie 2023: one ``[D, 6D]``
projection of the per-example conditioning into the shift, scale and gate of attention and MLP; a third of the
block's parameters). Its output is one small vector per example, gathered over ``tensor`` where the token stream
reads it, so the split costs an all-gather of ``[B, 6D]`` and divides the layer's bytes like the pairs'.

A block whose layers are none of these (a lone projection, a layer that reads part of an open pair, shapes that do
not fit) is refused in one line naming the layer and the link it could not follow: write a path plan for it.
Layers outside blocks (embedding, LM head, a DiT's timestep embedder and final layer) are left to the FSDP rule,
and the printed plan can be copied, edited and passed instead of ``"auto"``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxckpt.analysis._dataflow import matmul_reads
from jaxckpt.errors import TensorPlanError, TracingError, raised_at
from jaxckpt.nnx._apply import applied_blocks
from jaxckpt.nnx._layers import RematBlock
from jaxckpt.sharding._state import path_names
from jaxckpt.sharding._tensor_plan import TensorPlan, generalize_path


def _block_linears(model: nnx.Module) -> dict[str, list[str]]:
  """Outermost block path -> the paths of the ``nnx.Linear`` layers inside it."""
  blocks = [tuple(map(str, p)) for p, m in applied_blocks(model)]
  blocks += [tuple(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, RematBlock)]
  outer = sorted({b for b in blocks if not any(b != o and b[:len(o)] == o for o in blocks)})
  found: dict[str, list[str]] = {"/".join(b): [] for b in outer}
  for path, module in nnx.iter_modules(model):
    path = tuple(map(str, path))
    if isinstance(module, nnx.Linear):
      owner = next((b for b in outer if path[:len(b)] == b), None)
      if owner is not None:
        found["/".join(owner)].append("/".join(path))
  return found


class LayerCall(NamedTuple):
  """One linear layer of a block as the traced loss first calls it."""

  layer: str  # the layer's path, e.g. "layers/self_attn/q_proj"
  reads: frozenset[str]  # layers whose matmuls its input depends on as data
  mods: frozenset[str]  # layers whose outputs only modulate its input (a broadcast scale or shift)


def _call_order(make_model: Callable[[], nnx.Module], loss_fn: Callable[..., Any], batch: Any, kernels: set[str]
                ) -> tuple[list[LayerCall], dict[str, tuple[int, ...]], list[str]]:
  """The layers whose kernels are ``kernels`` (layer paths) in the traced loss's order (first use, as
  :class:`LayerCall`), each kernel's shape ``[in, out]`` (a stacked kernel's leading layer axes dropped), and every
  layer of the model (the paths of the modules that hold parameters)."""
  model = nnx.eval_shape(make_model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  layers = ["/".join(path_names(path)[:-2]) if path_names(path)[-2:-1] == ("kernel",) else None for path, _ in flat]

  def loss(values, rest_state, b, key):
    m = nnx.merge(graphdef, jax.tree.unflatten(treedef, values), rest_state)
    return loss_fn(m, b, dropout_key=key, deterministic=False)[0]

  values = [leaf for _, leaf in flat]
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  try:
    jaxpr = jax.make_jaxpr(loss)(values, rest, batch, key)
  except Exception as err:  # noqa: BLE001 - your model raised while traced: one line, your file:line
    raise TracingError(f"tensor_plan='auto' traces the loss, which failed: {raised_at(err)}") from err
  wanted = {i for i, layer in enumerate(layers) if layer in kernels}
  order: dict[str, LayerCall] = {}
  for read in matmul_reads(jaxpr, wanted):
    layer = layers[read.weight]
    order.setdefault(layer, LayerCall(layer, frozenset(layers[i] for i in read.reads),
                                      frozenset(layers[i] for i in read.mods)))
  shapes = {layers[i]: tuple(values[i].shape)[-2:] for i in wanted}
  every = list(dict.fromkeys("/".join(path_names(path)[:-2]) for path, _ in flat))
  return list(order.values()), shapes, every


def modulation_layers(calls: list[LayerCall]) -> list[str]:
  """The layers of one block whose outputs the later layers read only as a modulation (module docstring), in call
  order."""
  return [c.layer for i, c in enumerate(calls)
          if any(c.layer in later.mods for later in calls[i + 1:])
          and not any(c.layer in later.reads for later in calls[i + 1:])]


def block_pairs(block: str, calls: list[LayerCall], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
  """The Megatron pairs and modulation layers of one block: layer path -> ``"colwise"`` or ``"rowwise"`` (module
  docstring).

  Args:
    block: the block's path (for messages).
    calls: the block's linear layers in call order, each with the layers of the block its input reads.
    shapes: each layer's kernel shape ``[in, out]``.

  Raises:
    TensorPlanError: the layers are not a sequence of pairs (the first layer that breaks the pattern named, and the
      link it could not follow).
  """
  modulation = modulation_layers(calls)
  styles: dict[str, str] = {layer: "colwise" for layer in modulation}
  pending: list[str] = []
  for layer, reads, _ in (c for c in calls if c.layer not in styles):
    opened = [p for p in pending if p in reads]
    if not opened:
      pending.append(layer)
      continue
    if len(opened) < len(pending):
      raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: {layer} reads "
                            f"{', '.join(opened)} but not {', '.join(p for p in pending if p not in opened)}; "
                            "write a path plan for this model (tensor_plan={pattern: style})")
    width, hidden = shapes[layer][1], shapes[layer][0]
    if any(shapes[p][0] != width for p in pending) or all(shapes[p][1] % hidden for p in pending):
      raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: {layer} {shapes[layer]} "
                            f"does not close {', '.join(f'{p} {shapes[p]}' for p in pending)} (the colwise layers "
                            "read the width the rowwise one writes, and it reads what one of them writes, or a part "
                            "of it); write a path plan for this model (tensor_plan={pattern: style})")
    styles.update({p: "colwise" for p in pending})
    styles[layer] = "rowwise"
    pending = []
  if pending:
    raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: no later linear layer of "
                          f"the block reads {', '.join(pending)} (a colwise layer needs a rowwise one after it, or, "
                          "as adaLN's modulation, its output scales or shifts what a later one reads); write a path "
                          "plan for this model (tensor_plan={pattern: style})")
  return {c.layer: styles[c.layer] for c in calls}


def _rules(styles: dict[str, str], layers: list[str]) -> tuple[tuple[str, str], ...]:
  """``styles`` as plan rules, one ``*`` pattern where it names only layers of that style (``layers``: every layer
  of the model)."""
  rules: list[tuple[str, str]] = []
  done: set[str] = set()
  for layer, style in styles.items():
    if layer in done:
      continue
    pattern = generalize_path(layer)
    same = [x for x in layers if generalize_path(x) == pattern]
    if all(styles.get(x) == style for x in same):
      rules.append((pattern, style))
      done.update(same)
    else:
      rules.append((layer, style))
      done.add(layer)
  return tuple(rules)


def auto_tensor_plan(make_model: Callable[[], nnx.Module], loss_fn: Callable[..., Any], batch: Any, *,
                     name: str) -> TensorPlan:
  """Resolves ``tensor_plan="auto"`` into a path plan (module docstring) and prints it (one line, stderr).

  Args:
    make_model: ``() -> nnx.Module``, your model with its blocks matched (:func:`jaxckpt.apply_remat`'s
      ``blocks=``); built under ``nnx.eval_shape``.
    loss_fn: jaxckpt's form ``loss_fn(model, batch, *, dropout_key, deterministic) -> (loss, metrics)``.
    batch: the example batch (``jax.ShapeDtypeStruct`` pytree).
    name: the model's name, for messages.

  Returns:
    A :class:`~jaxckpt.sharding.TensorPlan` with rules (``*`` for list indices where every block agrees).

  Raises:
    TensorPlanError: no blocks, a block without ``nnx.Linear`` layers, a layer the trace does not show as a
      matmul, or layers that are neither Megatron pairs nor modulation layers (:func:`block_pairs`).
    TracingError: the loss raised while traced.
  """
  model = nnx.eval_shape(make_model)
  blocks = _block_linears(model)
  if not blocks:
    raise TensorPlanError(f"tensor_plan='auto' splits the attention and MLP layers of each block, and {name} has no "
                          "blocks: name your block classes (blocks={'layer': DecoderLayer}), or write a path plan "
                          "(tensor_plan={pattern: style})")
  empty = [b for b, layers in blocks.items() if not layers]
  if empty:
    raise TensorPlanError(f"tensor_plan='auto' splits nnx.Linear layers, and block {empty[0]} of {name} has none: "
                          "write a path plan (tensor_plan={pattern: style}) naming its layers")
  kernels = {layer for layers in blocks.values() for layer in layers}
  calls, shapes, every = _call_order(make_model, loss_fn, batch, kernels)
  called = {c.layer for c in calls}
  styles: dict[str, str] = {}
  for block, layers in blocks.items():
    missing = [layer for layer in layers if layer not in called]
    if missing:
      raise TensorPlanError(f"tensor_plan='auto': {missing[0]} of block {block} is not seen as a matmul in the "
                            f"traced loss of {name} (unused, or inside a while loop or cond): write a path plan "
                            "(tensor_plan={pattern: style})")
    inside = set(layers)
    styles.update(block_pairs(block, [LayerCall(c.layer, c.reads & inside, c.mods & inside) for c in calls
                                      if c.layer in inside], shapes))
  plan = TensorPlan(_rules(styles, every))
  print(f"{name}: tensor_plan='auto' chose {plan}", file=sys.stderr)
  return plan
