"""Runs the multi-device checks of ``tests/sharding/test_sharded_training.py`` in a process with fake CPU devices;
prints JSON.

Usage (the device count must be set before JAX starts, so the test runs this file in a subprocess)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/sharding_helper.py equivalence
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/sharding_helper.py bytes
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/sharding_helper.py all '{"mesh": ...}'
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharding/sharding_helper.py train '{"mesh": ...}'
    XLA_FLAGS=--xla_force_host_platform_device_count=16 python tests/sharding/sharding_helper.py per_layer
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharding/sharding_helper.py tensor
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/sharding_helper.py accumulation

The last stdout line is the JSON result.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

# the repository root: jaxckpt, and tests.numerics (the suite's closeness rule)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MESHES = ("data=8", "fsdp=8", "data=4,fsdp=2")
POLICIES = ("none", "nothing_saveable", "attn=dots_saveable,mlp=nothing_saveable")
STEPS = 3  # optimizer steps before the replica check
BATCH = 16
FAST = {"xla_backend_optimization_level": 0}  # LLVM -O0: ~3× faster CPU compiles; same HLO, same partitioning


def _record_grads():
  """An optax transformation that passes updates through and keeps the last ones (= the raw gradients, when it comes
  first in the chain) in its state, so the real train step exposes its gradients without a second compile."""
  import jax
  import jax.numpy as jnp
  import optax

  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                      lambda updates, state, params=None: (updates, updates))


def _multitask_setup(policy: str, mesh=None):
  import optax
  from flax import nnx

  import jaxckpt
  from jaxckpt.models import MODELS, build_model

  backbone = build_model("vit", MODELS["vit"].presets["tiny"], image_shape=(8, 8, 1), num_classes=10, policy=policy,
                         seed=0)
  model = jaxckpt.models.MultiTaskClassifier(backbone, "parity", rngs=nnx.Rngs(1))
  tx = optax.chain(_record_grads(), optax.adamw(1e-2))
  graphdef, state = jaxckpt.create_train_state(model, tx, seed=0)
  loss_fn = jaxckpt.sharding.gather_params_in_loss(jaxckpt.models.multitask_loss("parity", 0.5), mesh)  # as the experiments
  step = jaxckpt.make_train_step(graphdef, tx, loss_fn)
  return model, state, step


def equivalence() -> dict:
  """Loss and gradients (of the first step) and the loss curve of ``STEPS`` AdamW steps of the multi-task ViT, for
  every mesh × policy, against the single-device no-remat run; and whether all replicas agree afterwards."""
  import jax
  import numpy as np

  import jaxckpt
  from tests import numerics
  from jaxckpt.models import MODELS
  from jaxckpt import sharding

  layers = MODELS["vit"].presets["tiny"].num_layers  # the depth of the gradient comparison (tests/numerics.py)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(BATCH, 8, 8, 1)).astype(np.float32),
              "y": rng.integers(0, 10, BATCH).astype(np.int32)} for _ in range(STEPS)]

  def run(compiled, state, put):
    losses, grads = [], None
    for batch in batches:
      state, metrics = compiled(state, put(batch))
      losses.append(float(metrics["loss"]))
      if grads is None:
        grads = sharding.gather(state.opt_state[0])  # the first step's gradients
    return state, losses, grads

  # The reference: one device, no remat.
  _, state, step = _multitask_setup("none")
  compiled = jaxckpt.training.compile_train_step(step, state, batches[0], compiler_options=FAST)
  _, ref_losses, ref_grads = run(compiled, state, lambda b: b)

  results = []
  for mesh_spec in MESHES:
    mesh = sharding.make_mesh(mesh_spec)
    for policy in POLICIES:
      model, state, step = _multitask_setup(policy, mesh)
      kwargs = sharding.step_shardings(state, batches[0], mesh, model=model)
      state = sharding.shard_state(state, kwargs["in_shardings"][0])  # same seed: the reference's initial values
      put = lambda b: sharding.shard_batch(b, mesh, global_batch_size=BATCH)  # noqa: E731
      compiled = jaxckpt.training.compile_train_step(step, state, put(batches[0]), compiler_options=FAST, **kwargs)
      state, losses, grads = run(compiled, state, put)
      grad_mismatches = list(numerics.mismatches(grads, ref_grads, depth=layers))
      params = jax.tree.leaves(state.params)
      results.append({
          "mesh": mesh_spec, "policy": policy, "losses": losses, "ref_losses": ref_losses, "layers": layers,
          "grad_mismatches": grad_mismatches,
          "grad_leaves": len(jax.tree.leaves(grads)),
          "replica_mismatches": sharding.replica_mismatches(state.params)
          + sharding.replica_mismatches(state.opt_state),
          "min_replicas": min(len(p.addressable_shards) // len({str(s.index) for s in p.addressable_shards})
                              for p in params),
          "fsdp_sharded_leaves": sum(1 for p in params if "fsdp" in str(p.sharding.spec)),
          "param_leaves": len(params),
      })
  return {"device_count": jax.device_count(), "results": results}


def report_bytes() -> dict:
  """Per-device argument bytes of the GPT tiny train step: one device vs ``fsdp=8`` vs ``data=8`` (report API)."""
  import jax

  from jaxckpt.report import build_report
  from jaxckpt.step import shipped_target

  target = shipped_target("gpt", "tiny")
  out = {"device_count": jax.device_count()}
  for mesh in (None, "fsdp=8", "data=8"):
    policies = ["none"] if mesh is None else ["none", "full"]
    report = build_report(target, policies, mesh=mesh, residuals=False, progress=False,
                          compiler_options=FAST)
    out[str(mesh)] = {"mesh": report.data["mesh"], "rows": {r["policy"]: {k: r[k] for k in (
        "status", "error", "argument_bytes", "temp_bytes", "output_bytes", "alias_bytes")} for r in report.rows}}
  return out


def train(request: dict) -> dict:
  """One classifier run (``experiments.classifier.train``) from a JSON config; ``interrupt_at`` = raise after that
  log line prefix (like a kill after the last checkpoint before it)."""
  from experiments.classifier import ClassifierConfig, train as train_classifier
  from experiments.options import configure

  interrupt_at = request.pop("interrupt_at", None)
  lines: list[str] = []

  class Interrupt(Exception):
    pass

  def log(line):
    lines.append(line)
    if interrupt_at is not None and line.startswith(interrupt_at):
      raise Interrupt(line)

  try:
    result = train_classifier(configure(ClassifierConfig(), **request), log=log)
  except Interrupt:
    return {"interrupted": True, "lines": lines}
  import jax

  keep = ("train_loss", "test_accuracy", "test_aux_accuracy", "params_sha256", "mesh", "device_count",
          "process_count", "memory", "test_loss_per_epoch", "collectives")
  return {"interrupted": False, "lines": lines, "process_index": jax.process_index(),
          **{k: result.metrics.get(k) for k in keep}}


def per_layer() -> dict:
  """FSDP per layer (16 devices): GPT ``small`` made 24 layers deep, full remat, 1 sequence per device, compiled with
  ``fsdp=4`` (4 devices) and ``fsdp=16``: per-device bytes, and the bytes of the whole layer stack's parameters."""
  import jax
  import math
  import jaxckpt
  from jaxckpt.step import compile_policy, shipped_target
  from jaxckpt.sharding import make_mesh

  out = {}
  for chips in (4, 16):
    target = shipped_target("gpt", "small", batch_size=chips, num_layers=24)
    mesh = make_mesh({"fsdp": chips}, devices=jax.devices()[:chips])
    compiled = compile_policy(target, jaxckpt.parse_policy("full"), mesh=mesh, options=FAST)
    out[str(chips)] = {k: compiled.memory[k] for k in ("argument_bytes", "temp_bytes", "footprint_bytes")}
    params = compiled.step.params
  stack = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0] if "layers" in jax.tree_util.keystr(path)]
  out["stack_param_bytes"] = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in stack)
  return out


TENSOR_MESHES = ("tensor=4", "fsdp=2,tensor=2", "data=2,tensor=2")
TENSOR_POLICIES = ("none", "full", "minimal")


def tensor() -> dict:
  """Tensor parallelism on the LLM family (4 devices): llama-tiny (4 query heads, 2 key/value heads, MLP 128, vocab
  256, float32) on each of :data:`TENSOR_MESHES` × :data:`TENSOR_POLICIES`; the first step's loss and gradients
  against one device without remat, and the bytes of the parameters each device holds against the whole."""
  import jax
  import numpy as np
  import optax

  import jaxckpt
  from tests import numerics
  from jaxckpt.models.llm import LLM_PRESETS, build_llm, llm_loss
  from jaxckpt import sharding

  config = LLM_PRESETS["llama-tiny"]
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, config.vocab_size, (BATCH, config.seq_len + 1)).astype(np.int32)}

  def setup(policy, mesh):
    model = build_llm(config, policy=policy)
    tx = optax.chain(_record_grads(), optax.adamw(1e-2))
    graphdef, state = jaxckpt.create_train_state(model, tx, seed=0)
    step = jaxckpt.make_train_step(graphdef, tx, sharding.gather_params_in_loss(llm_loss, mesh))
    return model, state, step

  _, state, step = setup("none", None)
  compiled = jaxckpt.training.compile_train_step(step, state, batch, compiler_options=FAST)
  whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
  new_state, metrics = compiled(state, batch)  # the state is donated: read it before
  ref = (float(metrics["loss"]), sharding.gather(new_state.opt_state[0]))
  results = []
  for mesh_spec in TENSOR_MESHES:
    mesh = sharding.make_mesh(mesh_spec)
    for policy in TENSOR_POLICIES:
      model, state, step = setup(policy, mesh)
      kwargs = sharding.step_shardings(state, batch, mesh, model=model)
      state = sharding.shard_state(state, kwargs["in_shardings"][0])
      put = sharding.shard_batch(batch, mesh, global_batch_size=BATCH)
      compiled = jaxckpt.training.compile_train_step(step, state, put, compiler_options=FAST, **kwargs)
      new_state, metrics = compiled(state, put)
      got = (float(metrics["loss"]), sharding.gather(new_state.opt_state[0]))
      per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(new_state.params))
      specs = {jax.tree_util.keystr(path): str(leaf.sharding.spec)
               for path, leaf in jax.tree_util.tree_flatten_with_path(new_state.params)[0]}
      results.append({"mesh": mesh_spec, "policy": policy, "mismatches": list(numerics.mismatches(
          got, ref, depth=config.num_layers)), "param_bytes_per_device": per_device, "specs": specs})
  return {"device_count": jax.device_count(), "param_bytes": whole, "results": results}


def accumulation() -> dict:
  """FSDP and gradient accumulation on an own ``nnx.scan`` decoder (tests/own_models.py, no dropout, 3 layers), 8
  devices: the first step's gradients under ``data=2,fsdp=4`` (full remat), unaccumulated and as 4 micro-batches,
  against one device without remat; per-device footprints of the step at B/k and at k × B/k under ``fsdp=8``; and the
  classifier experiment's run under ``fsdp=8`` (its metrics' collectives)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  import jaxckpt
  from jaxckpt import sharding
  from jaxckpt.step import ModelTarget, compile_policy
  from jaxckpt.step._targets import with_batch
  from jaxckpt.training._train import plain_loss_fn
  from tests import numerics
  from tests.own_models import DecoderLayer, ScannedDecoder, decoder_loss

  layers, batch = 3, 32

  def model(policy):
    return jaxckpt.apply_remat(ScannedDecoder(dim=32, hidden=64, layers=layers, dropout=0.0, rngs=nnx.Rngs(0)), policy,
                               blocks={"layer": DecoderLayer})

  tokens = np.random.default_rng(0).integers(0, 64, (batch, 9)).astype(np.int32)

  def grads(policy, mesh, k):
    m = model(policy)
    tx = optax.chain(_record_grads(), optax.adamw(1e-2))
    graphdef, state = jaxckpt.create_train_state(m, tx, seed=0)
    step = jaxckpt.make_train_step(graphdef, tx, sharding.gather_params_in_loss(plain_loss_fn(decoder_loss), mesh),
                                   grad_accum_steps=k)
    put, kwargs = {"tokens": tokens}, {}
    if mesh is not None:
      kwargs = sharding.step_shardings(state, put, mesh, model=m)
      state = sharding.shard_state(state, kwargs["in_shardings"][0])
      put = sharding.shard_batch(put, mesh, global_batch_size=batch)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():  # as the step core traces
      compiled = jaxckpt.training.compile_train_step(step, state, put, compiler_options=FAST, **kwargs)
    new_state, metrics = compiled(state, put)
    return float(metrics["loss"]), sharding.gather(new_state.opt_state[0])

  reference = grads("none", None, 1)
  mesh = sharding.make_mesh("data=2,fsdp=4")
  out = {"device_count": jax.device_count(), "layers": layers, "mismatches": {
      f"k={k}": list(numerics.mismatches(grads("full", mesh, k), reference, depth=layers)) for k in (1, 4)}}

  def wide():  # activations, not parameters, make the step's footprint (as they do at real sizes)
    return jaxckpt.apply_remat(ScannedDecoder(dim=64, hidden=256, layers=layers, dropout=0.0, rngs=nnx.Rngs(0)),
                               "none", blocks={"layer": DecoderLayer})

  target = ModelTarget(make_model=wide, batch={"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)},
                       loss_fn=decoder_loss, name="own-scanned")
  fsdp = sharding.make_mesh("fsdp=8")
  footprints = {}
  for rows, k in ((8, 1), (32, 4)):
    compiled = compile_policy(with_batch(target, rows, grad_accum_steps=k), jaxckpt.parse_policy("none"), mesh=fsdp,
                              options=FAST)
    footprints[f"{k}x{rows // k}"] = compiled.memory["footprint_bytes"]
  params = nnx.state(nnx.eval_shape(wide), nnx.Param)
  out["footprints"] = footprints
  out["param_bytes_per_device"] = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)) // 8
  out["train"] = train({"model": "mlp", "preset": "tiny", "epochs": 1, "batch_size": 64, "policy": "full",
                        "mesh": "fsdp=8", "progress": False})
  return out


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "equivalence":
    result = equivalence()
  elif mode == "all":  # one process start for the three: equivalence, bytes, and a classifier run (JSON config)
    result = {**equivalence(), "bytes": report_bytes(), "train": train(json.loads(sys.argv[2]))}
  elif mode == "bytes":
    result = report_bytes()
  elif mode == "train":
    result = train(json.loads(sys.argv[2]))
  elif mode == "per_layer":
    result = per_layer()
  elif mode == "tensor":
    result = tensor()
  elif mode == "accumulation":
    result = accumulation()
  else:
    raise SystemExit(f"unknown mode {mode!r}; valid: equivalence, bytes, train, all, per_layer, tensor, accumulation")
  print(json.dumps(result))
