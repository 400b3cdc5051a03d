"""Runs the multi-device checks of ``tests/sharding/test_expert_axis.py`` with 8 fake CPU devices; prints JSON.

Usage (the device count must be set before JAX starts, so the test runs this file in a subprocess)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/expert_helper.py

Compiled through the tools' path (:func:`jaxckpt.step.compile_policy`), one step from one initial state:

- the LLM family's ``mixtral-tiny`` (4 experts of 64, top-2) with the dropping dispatch (capacity factor 4: no token
  dropped, so every mesh computes the same function) and the dropless ``ragged`` one, on one device without remat
  (the reference) and under ``expert=4,fsdp=2`` and ``expert=2,fsdp=2,tensor=2``;
- the own Mixtral-style model (:mod:`own_moe`, its experts named ``("exp", "embed", "mlp")``, nothing else named)
  under ``tensor=4`` and ``fsdp=2,tensor=2`` (where an ``exp`` name used to raise ``KeyError`` / ``ValueError``) and
  ``expert=4,fsdp=2``.

For each run: the gradients' mismatches against the reference (``tests/numerics.py``), each expert parameter's bytes
per device (from the compiled step's input shardings) and the compiled collectives. The last stdout line is the JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

FAST = {"xla_backend_optimization_level": 0}  # LLVM -O0: faster CPU compiles; same HLO, same partitioning
LLM_RUNS = (("dropping", "expert=4,fsdp=2", 8, "full"), ("dropping", "expert=2,fsdp=2,tensor=2", 8, "none"),
            ("ragged", "expert=4,fsdp=2", 8, "full"), ("ragged", "expert=2,fsdp=2,tensor=2", 8, "none"))
OWN_RUNS = (("tensor=4", 4), ("fsdp=2,tensor=2", 4), ("expert=4,fsdp=2", 8))


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

  import jaxckpt
  from tests import numerics
  from tests.models import own_moe
  from jaxckpt import sharding
  from jaxckpt.analysis import read_compiled
  from jaxckpt.models import model_entry
  from jaxckpt.sharding._state import path_names
  from jaxckpt.step import ModelTarget, compile_policy

  tx = optax.chain(_record_grads(), optax.adamw(1e-2))
  entry = model_entry("llm")

  def llm_target(dispatch: str) -> ModelTarget:
    config = entry.override("mixtral-tiny", moe_dispatch=dispatch, capacity_factor=4.0, batch_size=8)
    return ModelTarget(lambda: entry.build(config), entry.batch(8, config), entry.loss_fn, name="llm")

  def run(target, policy, mesh, batch):
    compiled = compile_policy(target, jaxckpt.parse_policy(policy), tx=tx, mesh=mesh, options=FAST, stats_only=False)
    state = jaxckpt.create_train_state(target.make_model(), tx, seed=0)[1]
    if mesh is None:
      new_state, metrics = compiled.compiled(state, batch)
    else:
      (state_shardings, batch_sharding), _ = compiled.compiled.input_shardings
      new_state, metrics = compiled.compiled(jax.device_put(state, state_shardings),
                                             jax.device_put(batch, batch_sharding))
    per_device = {}
    if mesh is not None:
      shardings = {jax.tree_util.keystr(p): s
                   for p, s in jax.tree_util.tree_flatten_with_path(state_shardings.params)[0]}
      for path, leaf in jax.tree_util.tree_flatten_with_path(compiled.step.params)[0]:
        shard = shardings[jax.tree_util.keystr(path)].shard_shape(leaf.shape)
        per_device["/".join(path_names(path))] = {"bytes": math.prod(leaf.shape) * leaf.dtype.itemsize,
                                                  "per_device": math.prod(shard) * leaf.dtype.itemsize}
    collectives = [] if mesh is None else [{"kind": c.kind, "group_size": c.group_size, "count": c.count,
                                            "in_loop": c.in_loop}
                                           for c in read_compiled(compiled).collectives()]
    grads = {jax.tree_util.keystr(p): g for p, g in
             jax.tree_util.tree_flatten_with_path(sharding.gather(new_state.opt_state[0]))[0]}
    return (float(metrics["loss"]), grads), per_device, collectives

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (8, 65)).astype(np.int32)
  results = []
  for dispatch, spec, devices, policy in LLM_RUNS:
    target = llm_target(dispatch)
    ref, _, _ = run(target, "none", None, {"tokens": tokens})
    mesh = sharding.make_mesh(spec, devices=jax.devices()[:devices])
    got, per_device, collectives = run(target, policy, mesh, {"tokens": tokens})
    results.append({"model": f"llm/{dispatch}", "mesh": spec, "policy": policy,
                    "mismatches": list(numerics.mismatches(got, ref, depth=2)),
                    "per_device": {p: b for p, b in per_device.items() if "/mlp/" in p},
                    "collectives": collectives})
  own = own_moe.target(exp_axis=True)
  own_tokens = rng.integers(0, own_moe.VOCAB, (own_moe.BATCH, own_moe.SEQ + 1)).astype(np.int32)
  ref, _, _ = run(own, "none", None, own_tokens)
  for spec, devices in OWN_RUNS:
    mesh = sharding.make_mesh(spec, devices=jax.devices()[:devices])
    got, per_device, collectives = run(own, "full", mesh, own_tokens)
    results.append({"model": "own", "mesh": spec, "policy": "full",
                    "mismatches": list(numerics.mismatches(got, ref, depth=own_moe.LAYERS)),
                    "per_device": {p: b for p, b in per_device.items() if "/moe/" in p and "router" not in p},
                    "collectives": collectives})
  return {"device_count": jax.device_count(), "results": results}


if __name__ == "__main__":
  print(json.dumps(main()))
