"""Runs the multi-device checks of ``tests/sharding/test_tensor_plan.py`` with 8 fake CPU devices; prints JSON.

Usage (the device count must be set before JAX starts, so the test runs this file in a subprocess)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/tensor_plan_helper.py

The own Llama (:mod:`own_llama`, no logical axis names) is compiled through the tools' path
(:func:`jaxckpt.step.compile_policy`) with its tensor plan: on one device without remat (the reference) and under
``tensor=4`` (4 devices). Each sharded step runs once from the reference's
initial state; its gradients, each parameter's bytes per device (from the compiled step's input shardings) and its
collectives are reported. The model without a plan is compiled under ``tensor=4`` too, which must be refused. Then the
stacked models of ``tests/own_models.py`` (:data:`STACKED`): the Llama whose layers ``nnx.vmap`` stacks (kernels
``[L, in, out]``) with its plan by path and with ``"auto"``, and the DiT with ``"auto"`` (adaLN's modulation
included), each against its own one-device reference. The last stdout line is the JSON result.
"""

from __future__ import annotations

import json
import math
import os
import sys

# the repository root: jaxckpt, tests.numerics and tests.sharding.own_llama
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FAST = {"xla_backend_optimization_level": 0}  # LLVM -O0: faster CPU compiles; same HLO, same partitioning
RUNS = (("tensor=4", 4, "none", "path"),)
"""(mesh, devices, policy, plan) of the own Llama: its path plan (the embedding and the head planned too); a path plan
under ``fsdp=2,tensor=4`` with ``full`` (FSDP gathered inside each remat'd block) is the scanned Llama's, and the
automatic plan is compiled on the DiT (:data:`STACKED`)."""
STACKED = (("llama-scan", "path", "full"), ("dit", "auto", "none"))
"""(model, plan, policy) of the stacked models, each under ``fsdp=2,tensor=4`` (the scanned Llama's automatic plan is
its path plan, checked without compiling)."""


def _record_grads():
  """An optax transformation that passes updates through and keeps them (the raw gradients, first in a chain)."""
  import jax
  import jax.numpy as jnp
  import optax

  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                      lambda updates, state, params=None: (updates, updates))


def main() -> dict:
  import jax
  import numpy as np
  import optax
  from flax import nnx

  import jaxckpt
  from tests import numerics
  from tests.sharding import own_llama
  from jaxckpt import sharding
  from jaxckpt.analysis import read_compiled
  from jaxckpt.errors import MeshSpecError
  from jaxckpt.sharding._state import path_names
  from jaxckpt.step import compile_policy

  tx = optax.chain(_record_grads(), optax.adamw(1e-2))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, own_llama.VOCAB, (own_llama.BATCH, own_llama.SEQ + 1)).astype(np.int32)
  targets = {"path": own_llama.target(), "auto": own_llama.target(tensor_plan="auto")}

  def run(target, policy, mesh, batch=tokens):
    compiled = compile_policy(target, jaxckpt.parse_policy(policy), tx=tx, mesh=mesh, options=FAST, stats_only=False)
    state = jaxckpt.create_train_state(target.make_model(), tx, seed=0)[1]
    (state_shardings, batch_sharding), _ = compiled.compiled.input_shardings
    new_state, metrics = compiled.compiled(jax.device_put(state, state_shardings), jax.device_put(batch, batch_sharding))
    shardings = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(state_shardings.params)[0]}
    per_device = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(compiled.step.params)[0]:
      shard = shardings[jax.tree_util.keystr(path)].shard_shape(leaf.shape)
      per_device["/".join(path_names(path)[:-1])] = {"bytes": math.prod(leaf.shape) * leaf.dtype.itemsize,
                                                     "per_device": math.prod(shard) * leaf.dtype.itemsize}
    collectives = [{"kind": c.kind, "group_size": c.group_size, "count": c.count}
                   for c in read_compiled(compiled).collectives()]
    grads = {jax.tree_util.keystr(p): g for p, g in  # by path: a plan's metadata is part of the tree structure
             jax.tree_util.tree_flatten_with_path(sharding.gather(new_state.opt_state[0]))[0]}
    return (float(metrics["loss"]), grads), per_device, collectives

  def stacked(model, plan):
    from tests import own_models  # pylint: disable=g-import-not-at-top

    if model == "dit":
      return own_models.dit_target(batch_size=8, adaln_zero=False, tensor_plan=plan), own_models.dit_batch(
          own_models.DiTConfig(), 8, seed=1)
    return own_models.llama_target(tensor_plan=own_models.LLAMA_PLAN if plan == "path" else plan), tokens

  ref, _, _ = run(targets["path"], "none", None)
  results = []
  for spec, devices, policy, plan in RUNS:
    mesh = sharding.make_mesh(spec, devices=jax.devices()[:devices])
    got, per_device, collectives = run(targets[plan], policy, mesh)
    results.append({"mesh": spec, "policy": policy, "plan": plan,
                    "mismatches": list(numerics.mismatches(got, ref, depth=own_llama.LAYERS)),
                    "per_device": per_device, "collectives": collectives})
  try:
    compile_policy(own_llama.target(tensor_plan=None), jaxckpt.parse_policy("none"), tx=tx, options=FAST,
                   mesh=sharding.make_mesh("tensor=4", devices=jax.devices()[:4]))
    refusal = None
  except MeshSpecError as err:
    refusal = str(err)
  refs, stacked_results = {}, []
  for model, plan, policy in STACKED:
    target, batch = stacked(model, plan)
    if model not in refs:
      refs[model] = run(target, "none", None, batch)[0]
    styles = {path: style for path, style, *_ in sharding.planned_params(
        nnx.eval_shape(target.make_model))}
    got, per_device, collectives = run(target, policy, sharding.make_mesh("fsdp=2,tensor=4"), batch)
    stacked_results.append({"model": model, "mesh": "fsdp=2,tensor=4", "plan": str(target.tensor_plan),
                            "policy": policy, "collectives": collectives,
                            "mismatches": list(numerics.mismatches(got, refs[model], depth=2)),
                            "per_device": {k: {**v, "style": styles.get(k)} for k, v in per_device.items()}})
  return {"device_count": jax.device_count(), "auto_plan": str(targets["auto"].tensor_plan), "results": results,
          "refusal": refusal, "stacked": stacked_results}


if __name__ == "__main__":
  print(json.dumps(main()))
