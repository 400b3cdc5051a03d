"""The automatic tensor plan: Megatron-LM's column/row pairs in each block of your own model, found by data flow.

``tensor_plan="auto"`` (:func:`jaxckpt.nnx_model_target`) resolves here, once, into an ordinary path plan
(:class:`jaxckpt.sharding.TensorPlan`) that it prints. In each block (a module :func:`jaxckpt.apply_remat` matched:
``blocks=``) the ``nnx.Linear`` layers are taken in the order the traced loss calls them, and each matmul's input is
followed back to the matmuls it depends on (:func:`jaxckpt.analysis._dataflow.matmul_reads`). Megatron-LM's
Transformer split (Shoeybi et al. 2019, §3) is then a sequence of *pairs*: layers that read nothing of each other
(the query/key/value projections; the MLP's gate and up projections) are ``colwise``, and the next layer, which reads
all of them (attention's output projection; the MLP's down projection), is ``rowwise`` and closes the pair: one
all-reduce per pair and pass. Names play no part, so ``wq``/``w1``/``c_fc`` read as well as ``q_proj``.

A pair must also fit by shape: the colwise layers read the width the rowwise layer writes (``[D, ·]`` ... ``[·, D]``),
and the rowwise layer reads what a colwise one writes. A block whose layers are not such pairs (a lone projection, a
layer that reads part of an open pair, shapes that do not fit) is refused in one line naming the layer: write a path
plan for it. Layers outside blocks (embedding, LM head) are left to the FSDP rule, and the printed plan can be
copied, edited and passed instead of ``"auto"``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

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


def _call_order(make_model: Callable[[], nnx.Module], loss_fn: Callable[..., Any], batch: Any, kernels: set[str]
                ) -> tuple[list[tuple[str, frozenset[str]]], dict[str, tuple[int, ...]], list[str]]:
  """``[(kernel's layer, layers whose matmuls its input depends on)]`` in the traced loss's order (first use), each
  kernel's shape, for the layers whose kernels are ``kernels`` (layer paths); and every layer of the model (the
  paths of the modules that hold parameters)."""
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
  order: dict[str, frozenset[str]] = {}
  for read in matmul_reads(jaxpr, wanted):
    order.setdefault(layers[read.weight], frozenset(layers[i] for i in read.reads))
  shapes = {layers[i]: tuple(values[i].shape) for i in wanted}
  every = list(dict.fromkeys("/".join(path_names(path)[:-2]) for path, _ in flat))
  return list(order.items()), shapes, every


def block_pairs(block: str, calls: list[tuple[str, frozenset[str]]], shapes: dict[str, tuple[int, ...]]
                ) -> dict[str, str]:
  """The Megatron pairs of one block: layer path -> ``"colwise"`` or ``"rowwise"`` (module docstring).

  Args:
    block: the block's path (for messages).
    calls: ``[(layer, layers its input depends on)]`` of the block's linear layers in call order.
    shapes: each layer's kernel shape ``[in, out]``.

  Raises:
    TensorPlanError: the layers are not a sequence of pairs (the first layer that breaks the pattern named).
  """
  styles: dict[str, str] = {}
  pending: list[str] = []
  for layer, reads in calls:
    opened = [p for p in pending if p in reads]
    if not opened:
      pending.append(layer)
      continue
    if len(opened) < len(pending):
      raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: {layer} reads "
                            f"{', '.join(opened)} but not {', '.join(p for p in pending if p not in opened)}; "
                            "write a path plan for this model (tensor_plan={pattern: style})")
    width, hidden = shapes[layer][1], shapes[layer][0]
    if any(shapes[p][0] != width for p in pending) or all(shapes[p][1] != hidden for p in pending):
      raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: {layer} {shapes[layer]} "
                            f"does not close {', '.join(f'{p} {shapes[p]}' for p in pending)} (the colwise layers "
                            "read the width the rowwise one writes, and it reads what one of them writes); write a "
                            "path plan for this model (tensor_plan={pattern: style})")
    styles.update({p: "colwise" for p in pending})
    styles[layer] = "rowwise"
    pending = []
  if pending:
    raise TensorPlanError(f"tensor_plan='auto' finds no Megatron pair in block {block}: no later linear layer of "
                          f"the block reads {', '.join(pending)} (a colwise layer needs a rowwise one after it); "
                          "write a path plan for this model (tensor_plan={pattern: style})")
  return styles


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
      matmul, or layers that are not Megatron pairs (:func:`block_pairs`).
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
  called = dict(calls)
  styles: dict[str, str] = {}
  for block, layers in blocks.items():
    missing = [layer for layer in layers if layer not in called]
    if missing:
      raise TensorPlanError(f"tensor_plan='auto': {missing[0]} of block {block} is not seen as a matmul in the "
                            f"traced loss of {name} (unused, or inside a while loop or cond): write a path plan "
                            "(tensor_plan={pattern: style})")
    inside = set(layers)
    styles.update(block_pairs(block, [(layer, reads & inside) for layer, reads in calls if layer in inside], shapes))
  plan = TensorPlan(_rules(styles, every))
  print(f"{name}: tensor_plan='auto' chose {plan}", file=sys.stderr)
  return plan
