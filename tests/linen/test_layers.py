"""Linen blocks: equal to their NNX twins, gradients unchanged by remat, static flags safe, specs validated.

Compile time dominates these tiny graphs, so dropout keys use the ``rbg`` PRNG implementation (same semantics: same
key → same mask) and compiles use XLA's backend optimization level 0 (:data:`FAST`; LLVM codegen only, the HLO passes
and jaxckpt's CPU remat fix are unchanged).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.nnx import _layers as layers
from jaxckpt import linen as L
from jaxckpt.errors import JaxckptError, PolicySpecError
from jaxckpt.policies._spec import refused
from jaxckpt.analysis._jaxprs import checkpoint_name_of, emitted_checkpoint_names, is_remat, iter_eqns, remat_body, uses_remat
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.policies import CANONICAL_POLICIES, REGISTRY
from jaxckpt.training._xla import jit as remat_jit
from tests.numerics import assert_trees_close

RATE = 0.2
SEQ, IMG = (2, 4, 8), (2, 4, 4, 4)
LAYERS = 2
FAST = {"xla_backend_optimization_level": 0}


def _key(seed):
  return jax.random.key(seed, impl="rbg")


def _x(shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _linen(kind, policy="none", scan=True):
  """(Linen module, input shape) of one structure."""
  if kind == "attn":
    return L.AttentionBlock(8, 2, dropout_rate=RATE, policy=policy), SEQ
  if kind == "mlp":
    return L.MLPBlock(8, 16, dropout_rate=RATE, policy=policy), SEQ
  if kind == "conv":
    return L.ConvBlock(4, dropout_rate=RATE, policy=policy), IMG
  if kind == "transformer":
    return L.TransformerBlock(8, 2, 16, dropout_rate=RATE, causal=True, policy=policy), SEQ
  assert kind == "stack"
  return L.Stack(L.TransformerBlock(8, 2, 16, dropout_rate=RATE, policy=policy), LAYERS, scan=scan), SEQ


def _nnx(kind, policy="none", scan=True):
  """The NNX twin of :func:`_linen`."""
  r = nnx.Rngs(0)
  if kind == "attn":
    return layers.AttentionBlock(8, 2, dropout_rate=RATE, policy=policy, rngs=r)
  if kind == "mlp":
    return layers.MLPBlock(8, 16, dropout_rate=RATE, policy=policy, rngs=r)
  if kind == "conv":
    return layers.ConvBlock(4, dropout_rate=RATE, policy=policy, rngs=r)
  if kind == "transformer":
    return layers.TransformerBlock(8, 2, 16, dropout_rate=RATE, causal=True, policy=policy, rngs=r)
  make = lambda rr: layers.TransformerBlock(8, 2, 16, dropout_rate=RATE, policy=policy, rngs=rr)  # noqa: E731
  return layers.Stack(make, LAYERS, scan=scan, rngs=r)


STRUCTURES = [("attn", True), ("mlp", True), ("conv", True), ("transformer", True), ("stack", True), ("stack", False)]
IDS = ["attn", "mlp", "conv", "transformer", "stack-scan", "stack-unrolled"]


def _loss(apply):
  """A scalar loss with a nonlinear head (so gradients depend on every intermediate), and the output as aux."""
  def loss(params, x, key):
    y = apply(params, x, key)
    return jnp.sum(jnp.sin(y) * y), y
  return loss


def _depth(module) -> int:
  """Layers a comparison's values pass through (tests/numerics.py): a stack's blocks, else one block."""
  return module.num_layers if isinstance(module, L.Stack) else 1


def _linen_loss(module, deterministic=False):
  return _loss(lambda p, x, key: module.apply({"params": p}, x, dropout_key=key, deterministic=deterministic))


def _init(module, shape):
  """Parameter shapes, nothing computed."""
  return jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros(shape))["params"])


def _params(module, shape, seed=0):
  """Random parameters from NumPy (eager JAX initialisers would compile once per shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.3, jnp.float32), _init(module, shape))


@pytest.mark.parametrize("kind,scan", STRUCTURES, ids=IDS)
def test_linen_equals_nnx_with_the_same_weights_and_key(kind, scan):
  linen, shape = _linen(kind, "full", scan)
  _assert_linen_equals_nnx(linen, _nnx(kind, "full", scan), shape)


def test_dot_product_attention_linen_equals_nnx_and_has_no_attention_weights():
  policy = "save_only_these_names:attn_context"
  linen = L.TransformerBlock(8, 2, 16, dropout_rate=RATE, causal=True, policy=policy, attention="dot_product_attention")
  nnx_module = layers.TransformerBlock(8, 2, 16, dropout_rate=RATE, causal=True, policy=policy,
                                       attention="dot_product_attention", rngs=nnx.Rngs(0))
  _assert_linen_equals_nnx(linen, nnx_module, SEQ)
  names = {"qkv", "attn_context", "attn_out"}
  assert L.block_types(linen)["attn"] == jaxckpt.block_types(nnx_module)["attn"] == names
  x, key = jax.ShapeDtypeStruct(SEQ, jnp.float32), _key(0)
  assert emitted_checkpoint_names(_linen_loss(linen), _init(linen, SEQ), x, key) == names | {"mlp_hidden", "mlp_out"}
  with pytest.raises(PolicySpecError, match="attn_weights"):
    L.AttentionBlock(8, 2, attention="dot_product_attention", policy="save_only_these_names:attn_weights")
  with pytest.raises(JaxckptError, match="attention='flash'.*dot_product_attention"):
    L.TransformerBlock(8, 2, 16, attention="flash")


def _assert_linen_equals_nnx(linen, nnx_module, shape):
  """Same parameter tree, and with the NNX weights the same loss, output and gradients (dropout on)."""
  x, key = _x(shape), _key(7)
  params = L.linen_params_from_nnx(nnx_module)
  assert jax.tree.map(jnp.shape, _init(linen, shape)) == jax.tree.map(jnp.shape, params)  # same tree and shapes

  graphdef, nnx_params, other = nnx.split(nnx_module, nnx.Param, ...)
  nnx_loss = _loss(lambda p, x, key: nnx.merge(graphdef, p, other)(x, dropout_key=key, deterministic=False))
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True), compiler_options=FAST)  # noqa: E731
  (l_loss, l_y), (l_gp, l_gx) = grad(_linen_loss(linen))(params, x, key)
  (n_loss, n_y), (n_gp, n_gx) = grad(nnx_loss)(nnx_params, x, key)
  what = f"Linen {type(linen).__name__} vs its NNX twin"
  assert_trees_close((l_loss, l_y, l_gx), (n_loss, n_y, n_gx), depth=_depth(linen), what=f"{what}: loss, output, dx")
  assert_trees_close(l_gp, nnx.to_pure_dict(n_gp), depth=_depth(linen), what=f"{what}: parameter gradients")


STACK_POLICIES = ["nothing_saveable", "dots_saveable", "save_only_these_names:qkv+mlp_hidden",
                  "attn=dots_saveable,mlp=full"]
BLOCK_POLICIES = {"attn": ["save_only_these_names:qkv+attn_out"], "mlp": ["dots_saveable"], "conv": ["full"]}
GRAD_STRUCTURES = [("attn", True), ("mlp", True), ("conv", True), ("stack", True), ("stack", False)]
GRAD_CASES = [(k, s, p) for (k, s) in GRAD_STRUCTURES for p in BLOCK_POLICIES.get(k, STACK_POLICIES)]


def _grads(module, params, x, key):
  loss_and_grads = jax.value_and_grad(_linen_loss(module), argnums=(0, 1), has_aux=True)
  return remat_jit(loss_and_grads, compiler_options=FAST)(params, x, key)


@pytest.fixture(scope="module")
def no_remat_grads():
  """Parameters, inputs and no-remat loss and gradients (dropout on) per structure, computed once each."""
  cache = {}

  def get(kind, scan):
    if (kind, scan) not in cache:
      module, shape = _linen(kind, "none", scan)
      x, key = _x(shape), _key(3)
      params = _params(module, shape)
      cache[kind, scan] = (params, x, key, _grads(module, params, x, key))
    return cache[kind, scan]

  return get


@pytest.mark.remat3
@pytest.mark.parametrize(
    "kind,scan,policy", GRAD_CASES, ids=[f"{k}-{'scan' if s else 'unrolled'}-{p}" for k, s, p in GRAD_CASES]
)
def test_gradients_equal_no_remat_under_jaxckpt_jit(no_remat_grads, kind, scan, policy):
  params, x, key, ((ref_loss, ref_y), ref_grads) = no_remat_grads(kind, scan)
  module, _ = _linen(kind, policy, scan)
  (loss, y), grads = _grads(module, params, x, key)
  assert_trees_close((loss, y, grads), (ref_loss, ref_y, ref_grads), depth=_depth(module),
                     what=f"Linen {kind} {policy}: loss, output and gradients vs no remat")


OFFLOAD = ("save_and_offload_only_these_names", "offload_dot_with_no_batch_dims")


def _every_policy():
  args = {"names": "qkv+mlp_hidden", "save/offload": "qkv/mlp_hidden"}
  specs = []
  for name in CANONICAL_POLICIES:
    if refused(name) is not None:  # the installed JAX does not implement it as named (test_policies)
      continue
    if REGISTRY[name].preset is not None:  # MaxText's names, not emitted here (tests/policies/test_maxtext_presets.py)
      continue
    if remat_implementation() == "remat3" and name in OFFLOAD:  # refused under remat3 (tests/house/test_remat3.py)
      continue
    arity = REGISTRY[name].arity
    arg = "attn_weights" if name in ("save_anything_except_these_names", "save_any_names_but_these") else args.get(arity)
    specs.append(name if arity == "none" else f"{name}:{arg}")
  return [*specs, "attn=dots_saveable,mlp=full"]


@pytest.mark.parametrize("policy", _every_policy())
def test_deterministic_python_bool_under_jit_and_grad_for_every_policy(policy):
  stack, shape = _linen("stack", policy, scan=True)
  block, _ = _linen("transformer", policy)
  x = _x(shape)
  for flag in (True, False):  # traced under jit(grad): a non-static flag would raise TracerBoolConversionError here
    jaxpr = jax.jit(jax.grad(_linen_loss(stack, flag), has_aux=True)).trace(_init(stack, shape), x, _key(0)).jaxpr
    assert uses_remat(jaxpr) is (policy != "none")
  params = _params(block, shape)
  out = {(flag, seed): block.apply({"params": params}, x, dropout_key=_key(seed), deterministic=flag)
         for flag in (True, False) for seed in (1, 2)}
  # key ignored: exact, the same program on the same inputs (the key is not read)
  chex.assert_trees_all_equal(out[True, 1], out[True, 2], block.apply({"params": params}, x))
  assert not jnp.allclose(out[False, 1], out[False, 2])  # dropout on: the key matters


def test_deterministic_as_static_argname_and_traced_flag_error():
  block, shape = _linen("transformer", "full")
  x, key = _x(shape), _key(4)
  params = _params(block, shape)
  apply = lambda p, x, key, deterministic: block.apply(  # noqa: E731
      {"params": p}, x, dropout_key=key, deterministic=deterministic)
  jitted = jax.jit(apply, static_argnames="deterministic", compiler_options=FAST)
  assert_trees_close(jitted(params, x, key, deterministic=True), block.apply({"params": params}, x), depth=1,
                     what="deterministic=True under jit vs eager default")
  assert_trees_close(jitted(params, x, key, deterministic=False), apply(params, x, key, False), depth=1,
                     what="deterministic=False under jit vs eager")
  with pytest.raises(JaxckptError, match="static_argnames"):
    jax.jit(apply)(params, x, key, True)  # a traced flag: a clear error, not TracerBoolConversionError


@pytest.mark.remat3
@pytest.mark.parametrize("kind,scan", STRUCTURES, ids=IDS)
def test_remat_present_iff_policy_is_not_none_and_names_match_nnx(kind, scan):
  key = _key(0)
  for policy in ("none", "full", "dots_saveable"):
    module, shape = _linen(kind, policy, scan)
    x, params = jax.ShapeDtypeStruct(shape, jnp.float32), _init(module, shape)
    jaxpr = jax.make_jaxpr(jax.grad(_linen_loss(module), has_aux=True))(params, x, key)
    assert uses_remat(jaxpr) is (policy != "none"), policy
  emitted = emitted_checkpoint_names(_linen_loss(module), params, x, key)
  graphdef, state = nnx.split(_nnx(kind, "none", scan))
  nnx_emitted = emitted_checkpoint_names(
      lambda s, x, k: nnx.merge(graphdef, s)(x, dropout_key=k, deterministic=False), state, x, key)
  assert emitted == nnx_emitted == frozenset().union(*L.block_types(module).values())


@pytest.mark.remat3
def test_each_sublayer_gets_its_own_policy():
  module, shape = _linen("transformer", "attn=dots_saveable,mlp=none")
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  jaxpr = jax.make_jaxpr(_linen_loss(module))(_init(module, shape), x, _key(0))
  remats = [e for e in iter_eqns(jaxpr) if is_remat(e)]  # either remat implementation
  assert len(remats) == 1  # the attention sublayer only
  inside = {n for e in iter_eqns(remat_body(remats[0])) if (n := checkpoint_name_of(e)) is not None}
  assert inside == set(L.AttentionBlock.checkpoint_names)


def test_bad_spec_names_the_valid_block_types():
  with pytest.raises(PolicySpecError, match="valid block types: default, mlp"):
    L.MLPBlock(8, 16, policy="attn=full")
  with pytest.raises(PolicySpecError, match="valid block types: attn, default, mlp"):
    L.TransformerBlock(8, 2, 16, policy="conv=full")
  with pytest.raises(PolicySpecError, match="conv_out"):
    L.TransformerBlock(8, 2, 16, policy="save_only_these_names:conv_out")
  with pytest.raises(PolicySpecError, match="did you mean 'dots_saveable'"):
    L.ConvBlock(4, policy="dots_savable")
  stack = L.Stack(L.TransformerBlock(8, 2, 16), 2)
  with pytest.raises(PolicySpecError, match="valid block types: attn, default, mlp"):
    L.with_policy(stack, "conv=full")
  # Valid for a Transformer layer although one sub-block alone has no 'mlp' / never emits mlp_hidden:
  for spec in ("save_only_these_names:qkv+mlp_hidden", "attn=full,mlp=dots_saveable"):
    _init(L.TransformerBlock(8, 2, 16, policy=spec), SEQ)
    _init(L.Stack(L.TransformerBlock(8, 2, 16, policy=spec), 2), SEQ)
  assert str(L.with_policy(stack, "mlp=full").block.spec) == "mlp=nothing_saveable"
  assert L.block_types(stack) == {"attn": frozenset(L.AttentionBlock.checkpoint_names),
                                  "mlp": frozenset(L.MLPBlock.checkpoint_names)}
  with pytest.raises(JaxckptError, match="declares no block types"):
    L.block_types(jax.nn)


def test_bad_arguments_and_missing_dropout_key():
  with pytest.raises(JaxckptError, match="num_heads=3"):
    L.AttentionBlock(8, 3)
  with pytest.raises(JaxckptError, match="dropout_rate=1.5"):
    L.MLPBlock(4, 4, dropout_rate=1.5)
  with pytest.raises(JaxckptError, match="num_layers=0"):
    L.Stack(L.MLPBlock(4, 4), 0)
  with pytest.raises(JaxckptError, match="jaxckpt.linen block"):
    L.Stack(jax.nn, 2)
  block, shape = _linen("mlp", "full")
  x = _x(shape)
  with pytest.raises(JaxckptError, match="no dropout_key"):
    block.apply({"params": _params(block, shape)}, x, deterministic=False)


def test_stack_layer_keys_rng_stream_and_scan_unrolled_agree():
  scanned, shape = _linen("stack", "full", scan=True)
  unrolled, _ = _linen("stack", "full", scan=False)
  x, key = _x(shape), _key(5)

  @functools.partial(jax.jit, compiler_options=FAST)
  def run(x, key):  # one compile for all of it
    v_scan, v_unrolled = scanned.init(jax.random.key(0), x), unrolled.init(jax.random.key(0), x)
    keys = jax.random.split(key, LAYERS)
    manual = x  # layer i gets split(key, N)[i]
    for i in range(LAYERS):
      p_i = jax.tree.map(lambda t: t[i], v_scan["params"]["layers"])
      manual = scanned.block.apply({"params": p_i}, manual, dropout_key=keys[i], deterministic=False)
    outs = [m.apply(v_scan, x, dropout_key=key, deterministic=False) for m in (scanned, unrolled)]
    streams = [unrolled.apply(v_scan, x, deterministic=False, rngs={"dropout": jax.random.key(s)}) for s in (1, 2)]
    return v_scan, v_unrolled, manual, outs, streams

  v_scan, v_unrolled, manual, (out_scan, out_unrolled), (stream_1, stream_2) = run(x, key)
  chex.assert_trees_all_equal(v_scan, v_unrolled)  # exact: the same init from the same key in both modes
  assert_trees_close(out_scan, manual, depth=LAYERS, what="scanned stack vs layer-by-layer output")
  assert_trees_close(out_unrolled, manual, depth=LAYERS, what="unrolled stack vs layer-by-layer output")
  assert not jnp.allclose(stream_1, stream_2)  # keys drawn from the 'dropout' stream when none is given


def test_nnx_update_from_linen_migrates_weights():
  linen, shape = _linen("transformer", "full")
  nnx_module = _nnx("transformer", "full")
  x = _x(shape)
  params = _params(linen, shape, seed=42)
  assert L.nnx_update_from_linen(nnx_module, params) is nnx_module
  assert_trees_close(nnx_module(x), linen.apply({"params": params}, x), depth=1,
                     what="NNX block with migrated weights vs Linen output")
  chex.assert_trees_all_equal(L.linen_params_from_nnx(nnx_module), params)  # exact: a round trip copies arrays
  with pytest.raises(JaxckptError, match="lack"):
    L.nnx_update_from_linen(nnx_module, {"attn": params["attn"]})
  bad = jax.tree.map(lambda a: a, params)
  bad["mlp"]["fc1"]["bias"] = jnp.zeros(3)
  with pytest.raises(JaxckptError, match="shape mismatch"):
    L.nnx_update_from_linen(nnx_module, bad)


GROUPED = [(s, True, ("none", "full")) for s in ("every:1", "every:3", "nested", "nested:3")]
GROUPED += [("nested:3", False, ("full",))]
DEPTH = 7


def _mlp_stack(policy, scan=True, structure="block"):
  return L.Stack(L.MLPBlock(8, 16, dropout_rate=RATE, policy=policy), DEPTH, scan=scan, structure=structure)


@pytest.fixture(scope="module")
def block_structure_grads():
  """Parameters, inputs and the no-remat, block-structure loss and gradients of the 7-layer MLP stack (dropout on)."""
  module = _mlp_stack("none")
  x, key = _x(SEQ), _key(11)
  params = _params(module, SEQ)
  grad = jax.jit(jax.value_and_grad(_linen_loss(module), argnums=(0, 1), has_aux=True), compiler_options=FAST)
  return params, x, key, grad(params, x, key)


@pytest.mark.parametrize(
    "structure,scan,policies", GROUPED, ids=[f"{s}-{'scan' if sc else 'unrolled'}" for s, sc, _ in GROUPED]
)
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_structure_gradients_equal_block_structure_and_nnx(block_structure_grads, structure, scan, policies):
  params, x, key, ref = block_structure_grads
  linens, nnx_losses, nnx_params = [], [], []
  for policy in policies:
    linens.append(_mlp_stack(policy, scan, structure))
    make = lambda rr, policy=policy: layers.MLPBlock(8, 16, dropout_rate=RATE, policy=policy, rngs=rr)  # noqa: E731
    nnx_stack = nnx.eval_shape(lambda: layers.Stack(make, DEPTH, scan=scan, structure=structure, rngs=nnx.Rngs(0)))
    graphdef, n_params, other = nnx.split(L.nnx_update_from_linen(nnx_stack, params), nnx.Param, ...)
    nnx_losses.append(_loss(lambda p, x, key, g=graphdef, o=other: nnx.merge(g, p, o)(
        x, dropout_key=key, deterministic=False)))
    nnx_params.append(n_params)

  @functools.partial(jax.jit, compiler_options=FAST)
  def run(params, nnx_params, x, key):  # one compile for the Linen and NNX stacks under each policy
    grad = lambda f, p: jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x, key)  # noqa: E731
    return [grad(_linen_loss(m), params) for m in linens], [grad(f, p) for f, p in zip(nnx_losses, nnx_params)]

  linen_out, nnx_out = run(params, nnx_params, x, key)
  for policy, got, ((n_loss, n_y), (n_gp, n_gx)) in zip(policies, linen_out, nnx_out):
    assert_trees_close(got, ref, depth=DEPTH, what=f"Linen {structure} {policy} vs block no remat")
    assert_trees_close(((n_loss, n_y), (nnx.to_pure_dict(n_gp), n_gx)), ref, depth=DEPTH,
                       what=f"NNX {structure} {policy} vs Linen block no remat")
  jaxpr = jax.make_jaxpr(jax.grad(_linen_loss(linens[0]), has_aux=True))(params, x, key)
  assert uses_remat(jaxpr)  # the groups are remat'd even when the blocks' policy is 'none'


def test_bad_structure_raises():
  with pytest.raises(JaxckptError, match="did you mean 'nested'"):
    _mlp_stack("none", structure="nestd")
  with pytest.raises(JaxckptError, match="every:4"):
    _mlp_stack("none", structure="every")
  with pytest.raises(JaxckptError, match="D ≥ 2"):
    _mlp_stack("none", structure="nested:1")
  assert L.with_policy(_mlp_stack("none", structure="every:2"), "full").structure == "every:2"
