"""A plan as plain JAX code: ``jax.checkpoint`` with ``jax.checkpoint_policies`` per layer range and block type; for a
Flax Linen model, ``nn.remat`` of each layer's block class (and the one-line :func:`jaxckpt.linen.apply_remat`
alternative that needs no edit of the model)."""

from __future__ import annotations

from jaxckpt.planner._plan import Plan
from jaxckpt.policies._spec import OFFLOAD_DST, OFFLOAD_SRC, REGISTRY, SAVE_TENSORS, Policy


def _plan_table(ranges, block_types) -> list[str]:
  """The exported ``PLAN = [(first, last, {block type: policy}), ...]`` lines (layers inclusive)."""
  lines = ["# (first layer, last layer, {block type: policy, or None for no remat}), layers inclusive.", "PLAN = ["]
  for first, last, spec in ranges:
    policies = ", ".join(f'"{b}": {policy_code(spec.for_block(b))}' for b in block_types)
    lines.append(f"    ({first}, {last}, {{{policies}}}),")
  return [*lines, "]"]


def policy_code(policy: Policy) -> str:
  """The Python expression of a policy's predicate, e.g. ``cp.save_only_these_names("qkv", "mlp_hidden")``
  (``cp`` = ``jax.checkpoint_policies``), ``None`` for ``none`` (no ``jax.checkpoint``), or
  ``tensors("t12_tanh", …)`` for a per-tensor policy (the snippet's tagging helper, :data:`TAGGING_CODE`)."""
  arity = REGISTRY[policy.name].arity
  quoted = lambda names: ", ".join(f'"{n}"' for n in names)  # noqa: E731
  if policy.name == "none":
    return "None"
  if policy.name == SAVE_TENSORS:
    return f"tensors({quoted(policy.names)})"
  if policy.preset is not None:
    save, offload = policy.saved_names
    if not offload:
      return f"cp.save_only_these_names({quoted(save)})"  # MaxText's preset, as MaxText builds it
    return (f"cp.save_and_offload_only_these_names(names_which_can_be_saved=[{quoted(save)}], "
            f"names_which_can_be_offloaded=[{quoted(offload)}], offload_src=\"{OFFLOAD_SRC}\", "
            f"offload_dst=\"{OFFLOAD_DST}\")")
  if policy.name == "offload_dot_with_no_batch_dims":
    return f'cp.offload_dot_with_no_batch_dims("{OFFLOAD_SRC}", "{OFFLOAD_DST}")'
  if arity == "names":
    return f"cp.{policy.name}({quoted(policy.names)})"
  if arity == "save/offload":
    return (f"cp.{policy.name}(names_which_can_be_saved=[{quoted(policy.names)}], "
            f"names_which_can_be_offloaded=[{quoted(policy.offload_names)}], offload_src=\"{OFFLOAD_SRC}\", "
            f"offload_dst=\"{OFFLOAD_DST}\")")
  return f"cp.{policy.name}"


TAGGING_CODE = '''

def tensors(*names):
  """A per-tensor policy: the automatic names (t<n>_<primitive>) of the values to save."""
  return ("tensors", names)


def tag_values(fn, names):
  """fn with value n of its jaxpr (outputs of equations in program order, jit calls inlined) tagged with
  checkpoint_name when its producer is the named primitive; save_only_these_names(*names) then saves exactly those."""
  from jax.ad_checkpoint import checkpoint_name
  from jax.extend import core
  tags = {int(n[1:].split("_", 1)[0]): n for n in names}

  def run(jaxpr, consts, args, counter):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda a: a.val if isinstance(a, core.Literal) else env[a]
    for eqn in jaxpr.eqns:
      invals = [read(a) for a in eqn.invars]
      if eqn.primitive.name in ("jit", "pjit", "closed_call", "core_call") and "jaxpr" in eqn.params:
        outs = run(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, invals, counter)
      else:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for k in range(len(outs)):
          name = tags.get(counter[0])
          counter[0] += 1
          if name and name.split("_", 1)[1] == eqn.primitive.name.replace("-", "_"):
            outs[k] = checkpoint_name(outs[k], name)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def tagged(*args):
    flat, tree = jax.tree.flatten(args)
    closed, shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
    return jax.tree.unflatten(jax.tree.structure(shape), run(closed.jaxpr, closed.consts, flat, [0]))

  return tagged
'''
"""Plain-JAX helper the exported snippet carries when a plan has per-tensor policies (``save_tensors``)."""


def export_code(plan: Plan, block_types: tuple[str, ...] | None = None) -> str:
  """Renders ``plan`` as a self-contained Python snippet that needs only JAX.

  It defines ``PLAN`` (``(first_layer, last_layer, {block_type: policy or None})`` per range, inclusive) and
  ``remat_block(block_fn, layer, block_type)``, which wraps a pure block function in
  ``jax.checkpoint(block_fn, policy=...)`` as the plan says, plus a comment on using it with a scan over layers.

  Args:
    plan: from :func:`jaxckpt.planner.plan_policy`.
    block_types: block types to list per range (default: those the plan's specs name, else ``("default",)``).

  Returns:
    The code, ending with a newline.
  """
  ranges = plan.layer_ranges()
  per_tensor = any(p.name == SAVE_TENSORS for _, _, spec in ranges for p in (spec.default, *(q for _, q in spec.blocks)))
  if block_types is None:
    named = sorted({b for _, _, spec in ranges for b, _ in spec.blocks})
    block_types = tuple(named) or ("default",)
  lines = [
      f"# Remat plan for {plan.budget} ({plan.key.replace('_bytes', '')} ≤ {plan.limit_bytes} bytes; compiled "
      f"{plan.compiled.memory[plan.key]} bytes, FLOPs {plan.flops_ratio:.3f}× no remat), made by jaxckpt.",
      "# Plain JAX: no jaxckpt needed. Names are the checkpoint_name tags of your blocks.",
      "import jax",
      "from jax import checkpoint_policies as cp",
      *(TAGGING_CODE.split("\n") if per_tensor else []),
      "",
      *_plan_table(ranges, block_types),
      "",
      "",
      "def remat_block(block_fn, layer, block_type):",
      '  """block_fn(params, x) -> y of layer `layer`, wrapped in jax.checkpoint with the plan\'s policy."""',
      "  for first, last, policies in PLAN:",
      "    if first <= layer <= last:",
      "      policy = policies[block_type]",
      "      if isinstance(policy, tuple):  # per-tensor: tag the chosen values, save exactly them",
      "        return jax.checkpoint(tag_values(block_fn, policy[1]), policy=cp.save_only_these_names(*policy[1]))",
      "      return block_fn if policy is None else jax.checkpoint(block_fn, policy=policy)",
      '  raise IndexError(f"layer {layer} is not in the plan")',
      "",
      "# With layers stacked for jax.lax.scan, scan each range on its own (a scan body has one policy):",
      "#   for first, last, policies in PLAN:",
      "#     x, _ = jax.lax.scan(lambda h, p: (remat_block(layer_fn, first, block_type)(p, h), None), x,",
      "#                         jax.tree.map(lambda a: a[first:last + 1], stacked_params))",
  ]
  return "\n".join(lines) + "\n"


def _blocks_text(blocks: tuple[tuple[str, object], ...]) -> str:
  def what(value: object) -> str:
    if isinstance(value, type):
      return value.__name__
    if isinstance(value, tuple):
      return "(" + ", ".join(what(v) for v in value) + ",)"
    return "<your predicate>"

  return "{" + ", ".join(f'"{b}": {what(v)}' for b, v in blocks) + "}"


def linen_export_code(plan: Plan, model: object) -> str:
  """Renders ``plan`` for a Flax Linen model: plain Flax (``nn.remat`` of the block class with the range's policy),
  and the jaxckpt call that applies it without editing the model.

  It defines ``PLAN`` (as :func:`export_code`) and ``remat_block_class(block_cls, layer, block_type,
  static_argnums=())``, which returns ``block_cls`` or ``nn.remat(block_cls, policy=..., static_argnums=...)``:
  create layer i's block from it (``static_argnums`` counts ``self``: a ``deterministic`` flag passed third
  positionally is ``(2,)``).

  Args:
    plan: from :func:`jaxckpt.planner.plan_policy` on a Linen target (:func:`jaxckpt.linen_model_target`).
    model: the target's :class:`jaxckpt.linen._apply.RematModule` (its module class and ``blocks=``).

  Returns:
    The code, ending with a newline.
  """
  ranges = plan.layer_ranges()
  block_types = tuple(b for b, _ in model.blocks)
  per_tensor = any(p.name == SAVE_TENSORS for _, _, spec in ranges for p in (spec.default, *(q for _, q in spec.blocks)))
  lines = [
      f"# Remat plan for {plan.budget} ({plan.key.replace('_bytes', '')} ≤ {plan.limit_bytes} bytes; compiled "
      f"{plan.compiled.memory[plan.key]} bytes, FLOPs {plan.flops_ratio:.3f}× no remat), made by jaxckpt.",
      "# With jaxckpt, your model unedited (the same parameter tree):",
      "#   model = jaxckpt.linen.apply_remat(" f"{type(model.module).__name__}(...), {str(plan.policy)!r},",
      f"#                                    blocks={_blocks_text(model.blocks)})",
  ]
  if per_tensor:
    return "\n".join([*lines, "# (per-tensor save_tensors policies need jaxckpt's tagging: use the line above)"]) + "\n"
  lines += [
      "# Plain Flax: create layer i's block from remat_block_class(BlockClass, i, block_type).",
      "import flax.linen as nn",
      "from jax import checkpoint_policies as cp",
      "",
      *_plan_table(ranges, block_types),
      "",
      "",
      "def remat_block_class(block_cls, layer, block_type, static_argnums=()):",
      '  """block_cls for layer `layer`: nn.remat with the plan\'s policy (static_argnums count self)."""',
      "  for first, last, policies in PLAN:",
      "    if first <= layer <= last:",
      "      policy = policies[block_type]",
      "      if policy is None:",
      "        return block_cls",
      "      return nn.remat(block_cls, policy=policy, prevent_cse=True, static_argnums=static_argnums)",
      '  raise IndexError(f"layer {layer} is not in the plan")',
  ]
  return "\n".join(lines) + "\n"
