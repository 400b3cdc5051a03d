"""A plan as plain JAX code: ``jax.checkpoint`` with ``jax.checkpoint_policies`` per layer range and block type."""

from __future__ import annotations

from jaxckpt.planner.plan import Plan
from jaxckpt.policies import OFFLOAD_DST, OFFLOAD_SRC, REGISTRY, Policy

__all__ = ["policy_code", "export_code"]


def policy_code(policy: Policy) -> str:
  """The Python expression of a policy's predicate, e.g. ``cp.save_only_these_names("qkv", "mlp_hidden")``
  (``cp`` = ``jax.checkpoint_policies``), or ``None`` for ``none`` (no ``jax.checkpoint``)."""
  arity = REGISTRY[policy.name].arity
  quoted = lambda names: ", ".join(f'"{n}"' for n in names)  # noqa: E731
  if policy.name == "none":
    return "None"
  if policy.name == "offload_dot_with_no_batch_dims":
    return f'cp.offload_dot_with_no_batch_dims("{OFFLOAD_SRC}", "{OFFLOAD_DST}")'
  if arity == "names":
    return f"cp.{policy.name}({quoted(policy.names)})"
  if arity == "save/offload":
    return (f"cp.{policy.name}(names_which_can_be_saved=[{quoted(policy.names)}], "
            f"names_which_can_be_offloaded=[{quoted(policy.offload_names)}], offload_src=\"{OFFLOAD_SRC}\", "
            f"offload_dst=\"{OFFLOAD_DST}\")")
  return f"cp.{policy.name}"


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
  if block_types is None:
    named = sorted({b for _, _, spec in ranges for b, _ in spec.blocks})
    block_types = tuple(named) or ("default",)
  lines = [
      f"# Remat plan for {plan.budget} ({plan.key.replace('_bytes', '')} ≤ {plan.limit_bytes} bytes; compiled "
      f"{plan.compiled.memory[plan.key]} bytes, FLOPs {plan.flops_ratio:.3f}× no remat), made by jaxckpt.",
      "# Plain JAX: no jaxckpt needed. Names are the checkpoint_name tags of your blocks.",
      "import jax",
      "from jax import checkpoint_policies as cp",
      "",
      "# (first layer, last layer, {block type: policy, or None for no remat}), layers inclusive.",
      "PLAN = [",
  ]
  for first, last, spec in ranges:
    policies = ", ".join(f'"{b}": {policy_code(spec.for_block(b))}' for b in block_types)
    lines.append(f"    ({first}, {last}, {{{policies}}}),")
  lines += [
      "]",
      "",
      "",
      "def remat_block(block_fn, layer, block_type):",
      '  """block_fn(params, x) -> y of layer `layer`, wrapped in jax.checkpoint with the plan\'s policy."""',
      "  for first, last, policies in PLAN:",
      "    if first <= layer <= last:",
      "      policy = policies[block_type]",
      "      return block_fn if policy is None else jax.checkpoint(block_fn, policy=policy)",
      '  raise IndexError(f"layer {layer} is not in the plan")',
      "",
      "# With layers stacked for jax.lax.scan, scan each range on its own (a scan body has one policy):",
      "#   for first, last, policies in PLAN:",
      "#     x, _ = jax.lax.scan(lambda h, p: (remat_block(layer_fn, first, block_type)(p, h), None), x,",
      "#                         jax.tree.map(lambda a: a[first:last + 1], stacked_params))",
  ]
  return "\n".join(lines) + "\n"
