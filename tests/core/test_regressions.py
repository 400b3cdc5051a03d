"""Regression tests for the remat bugs users keep reporting against JAX and Flax, run against jaxckpt.

One section per category of public bug report: dropout RNG inside remat, static boolean flags, BatchNorm
statistics, weights shared by several remat'd calls, nested remat and remat around/inside scan, matmuls that dots
policies do not see, decoding loops, and ``memory_analysis()`` giving zeros or ``None``. The invariant throughout:
remat changes memory and FLOPs, never numbers -- gradients, updated non-parameter state and forward outputs under
every policy equal those without remat. Where a policy silently saves nothing it was meant to save,
:func:`jaxckpt.core._diagnostics.policy_warnings` must say so.

Shapes are tiny and seeds fixed; every comparison is against the same model under policy ``none``.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jaxckpt
from jaxckpt import names
from jaxckpt.core._diagnostics import RematPolicyWarning, policy_warnings, warn_policy
from jaxckpt.analysis._residuals import saved_residuals, total_residual_bytes
from jaxckpt.schema import FOOTPRINT, MEMORY_FIELDS, MEMORY_KEYS
from tests.numerics import assert_trees_close

D, F, B, T = 8, 16, 4, 6  # model width, MLP hidden width, batch, tokens

# Policies a user module (no checkpoint names) is tried under; jaxckpt's MLP block also gets name policies.
POLICIES = ("nothing_saveable", "dots_saveable", "everything_saveable")
MLP_POLICIES = ("dots_with_no_batch_dims_saveable", "save_only_these_names:mlp_hidden",
                "save_any_names_but_these:mlp_out", "save_and_offload_only_these_names:mlp_hidden/mlp_out")

_REFERENCES: dict = {}


def reference(key, compute):
  """No-remat results, computed once per key for all the policies compared against them (compiles are the cost)."""
  if key not in _REFERENCES:
    _REFERENCES[key] = compute()
  return _REFERENCES[key]


def assert_close(actual, expected, *, depth: int):
  """``actual`` (remat'd) equals ``expected`` (no remat) to float rounding; ``depth``: the layers the values pass
  through (tests/numerics.py: a block applied twice is 2, a 3-layer stack 3)."""
  assert_trees_close(actual, expected, depth=depth, what="remat'd vs no remat")


def inputs(shape=(B, D), seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def grads_and_state(model, loss_of_model, *args):
  """``value_and_grad`` over the model's params, as :func:`jaxckpt.make_train_step` does it.

  Returns ``(loss, non-parameter state after the call, grads)``; non-parameter state (batch statistics, RNG
  counters) goes in as an argument and comes out as an auxiliary output. ``copy=True``: without it the merged
  module reuses the jit-level Variables of ``other``, and mutating them under ``value_and_grad`` raises
  TraceContextError (see ``test_make_train_step_with_batchnorm_model``).
  """
  graphdef, params, other = nnx.split(model, nnx.Param, ...)

  def loss(params, other, *args):
    m = nnx.merge(graphdef, params, other, copy=True)
    return loss_of_model(m, *args), nnx.state(m, nnx.Not(nnx.Param))

  (value, new_other), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, other, *args)
  return value, new_other, grads


def sq(y):
  return jnp.sum(y**2)


# ---------------------------------------------------------------------------------------------------------------
# Dropout RNG inside remat.


class DropMLP(nnx.Module):
  """A user module holding its own RNG stream: ``fc2(Dropout(tanh(fc1(x))))``, ``x: [B, D]``."""

  def __init__(self, *, rate: float = 0.5, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x, *, deterministic: bool = False):
    return self.fc2(self.drop(jnp.tanh(self.fc1(x)), deterministic=deterministic))


def drop_mlp(policy):
  return jaxckpt.remat(DropMLP(rngs=nnx.Rngs(params=0, dropout=1)), policy)


def rng_counts(state):
  return [int(v[...]) for _, v in nnx.to_flat_state(state) if isinstance(v, nnx.RngCount)]


@pytest.mark.parametrize("policy", MLP_POLICIES)
def test_dropout_block_with_explicit_key_grads_equal_no_remat(policy):
  """jaxckpt's blocks take ``dropout_key`` as an argument of the remat'd call, so the recomputation draws the same mask.

  Reports: jax-ml/jax#19577 (key reuse is expected under remat: the recomputation re-runs the random op with the same
  key), google/flax#4151 (``nnx.Dropout`` RNG streams inside JAX transforms).
  """
  block = jaxckpt.nnx.MLPBlock(D, F, dropout_rate=0.5, rngs=nnx.Rngs(0))
  x, key = inputs(), jax.random.key(7)
  run = lambda m, x, key: sq(m(x, dropout_key=key, deterministic=False))  # noqa: E731
  ref_loss, _, ref = reference("mlp-dropout", lambda: grads_and_state(block, run, x, key))
  jaxckpt.set_policy(block, policy)
  loss, _, grads = grads_and_state(block, run, x, key)
  assert_close((loss, grads), (ref_loss, ref), depth=1)


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_module_with_rngs_grads_and_rng_state_equal_no_remat(policy):
  """A user module with ``nnx.Rngs``/``nnx.Dropout`` wrapped by ``jaxckpt.remat``: same grads and RNG state as no remat.

  ``module_call`` passes the RNG state into ``jax.checkpoint``, so the recomputation reads the same counter and draws
  the same mask, and writes the advanced counter back. Reports: google/flax#4151, google/flax#4626 (NNX remat
  computing "junk").
  """
  x = inputs()
  run = lambda m, x: sq(m(x))  # noqa: E731
  ref_loss, ref_other, ref = reference("drop-mlp", lambda: grads_and_state(drop_mlp("none"), run, x))
  loss, other, grads = grads_and_state(drop_mlp(policy), run, x)
  assert_close((loss, grads), (ref_loss, ref), depth=1)
  assert rng_counts(other) == rng_counts(ref_other) == [1]
  # The counter is written back, so the next call draws a fresh mask (not the same one forever).
  model = drop_mlp(policy)
  first, second = model(x), model(x)
  assert rng_counts(nnx.state(model)) == [2]
  assert not np.allclose(first, second)


def test_dropout_mask_in_recompute_equals_mask_in_forward():
  """The gradient of ``Dropout(x)`` under ``nothing_saveable`` is ``mask / keep``, with the forward pass's mask.

  With ``nothing_saveable`` nothing of the forward pass is kept, so the backward pass's mask comes from the
  recomputation: if it drew a new mask, the gradient's zeros would not line up with the output's. Report:
  jax-ml/jax#19577.
  """
  rate = 0.5
  module = jaxckpt.remat(nnx.Dropout(rate, rngs=nnx.Rngs(dropout=3)), "nothing_saveable")
  graphdef, state = nnx.split(module)
  x = 1.0 + jnp.abs(inputs((16, 16)))  # no zeros of its own

  y, vjp = jax.vjp(lambda x: nnx.merge(graphdef, state, copy=True)(x), x)
  (gx,) = vjp(jnp.ones_like(y))
  kept = np.asarray(y != 0)
  assert 0.2 < kept.mean() < 0.8
  np.testing.assert_array_equal(np.asarray(gx != 0), kept)
  # exact: 1 / (1 - 0.5) = 2 and the mask multiply are exact in float32, no rounding anywhere
  np.testing.assert_array_equal(gx, np.where(kept, 1 / (1 - rate), 0.0).astype(np.float32))


def test_remat_module_with_rngs_under_nnx_jit_advances_rng():
  """Under ``nnx.jit`` the written-back RNG counter reaches the outer module (no TraceContextError).

  Report: google/flax#4151.
  """
  model = drop_mlp("nothing_saveable")
  step = nnx.jit(lambda m, x: m(x))
  x = inputs()
  first, second = step(model, x), step(model, x)
  assert rng_counts(nnx.state(model)) == [2]
  assert not np.allclose(first, second)
  assert_close(first, drop_mlp("none")(x), depth=1)


# ---------------------------------------------------------------------------------------------------------------
# Static boolean flags (train / deterministic) through remat.


class FlagMLP(nnx.Module):
  """A user module branching in Python on ``train`` (dropout and BatchNorm mode), ``x: [B, D]``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.bn = nnx.BatchNorm(F, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x, *, train: bool):
    h = self.bn(self.fc1(x), use_running_average=not train)
    if train:  # a Python branch: a traced flag would raise TracerBoolConversionError here
      h = self.drop(h, deterministic=False)
    return self.fc2(jax.nn.relu(h))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_static_flag_through_remat_wrapper_under_jit_and_grad(policy, train):
  """``jaxckpt.remat(module, policy)(x, train=flag)`` closes over the flag: no tracer error, numbers equal no remat.

  Reports: google/flax#3630 and google/flax#3946 (``nn.remat`` + ``static_argnums`` on a ``train`` flag raising
  ConcretizationTypeError), jax-ml/jax#7426 (``jax.checkpoint`` + ``jax.jit`` with a concrete bool argument).
  """
  make = lambda p: jaxckpt.remat(FlagMLP(rngs=nnx.Rngs(params=0, dropout=1)), p)  # noqa: E731
  run = lambda m, x: sq(m(x, train=train))  # noqa: E731
  x = inputs()
  ref_loss, ref_other, ref = reference(("flag-mlp", train), lambda: grads_and_state(make("none"), run, x))
  loss, other, grads = grads_and_state(make(policy), run, x)
  assert_close((loss, grads, batch_stats(other)), (ref_loss, ref, batch_stats(ref_other)), depth=1)
  assert rng_counts(other) == rng_counts(ref_other) == [1 if train else 0]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("policy", ["attn=dots_saveable,mlp=save_only_these_names:mlp_hidden"])
def test_block_deterministic_flag_under_jit_and_grad(policy, deterministic):
  """A jaxckpt ``TransformerBlock``'s ``deterministic=`` as a ``jax.jit`` static argument: grads equal no remat.

  Reports: google/flax#3630, jax-ml/jax#7426.
  """
  block = jaxckpt.nnx.TransformerBlock(D, 2, F, dropout_rate=0.25, causal=True, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(block)
  x, key = inputs((B, T, D)), jax.random.key(3)

  def loss(params, x, key, deterministic):
    return sq(nnx.merge(graphdef, params)(x, dropout_key=key, deterministic=deterministic))

  grad = jax.jit(jax.value_and_grad(loss), static_argnames="deterministic")
  ref = grad(params, x, key, deterministic=deterministic)
  jaxckpt.set_policy(block, policy)
  graphdef, params = nnx.split(block)
  assert_close(grad(params, x, key, deterministic=deterministic), ref, depth=1)


def test_checkpoint_static_argnums_bool_under_jit():
  """``jaxckpt.checkpoint(fn, policy, static_argnums=...)`` with a Python bool branch, under ``jax.jit(jax.grad)``.

  Report: jax-ml/jax#7426 (and jax-ml/jax#24516, the error it gives without ``static_argnums``).
  """

  def fn(x, square):
    return jnp.sum(jnp.tanh(x) ** 2) if square else jnp.sum(jnp.sin(x))

  x = inputs()
  for flag in (True, False):
    ck = jaxckpt.checkpoint(fn, "nothing_saveable", static_argnums=(1,))
    got = jax.jit(jax.grad(lambda x: ck(x, flag)))(x)
    assert_close(got, jax.grad(fn)(x, flag), depth=1)


def _flag_fn(x, square):
  return jnp.sum(jnp.tanh(x) ** 2) if square else jnp.sum(jnp.sin(x))


@pytest.mark.parametrize("policy", ["full", "dots_saveable", "none"])
def test_checkpoint_static_argnames_by_keyword_under_jit(policy):
  """``static_argnames`` keeps a keyword flag a Python value (JAX 0.10's own ``static_argnames`` traces it).

  The issue: ``checkpoint(f, "full", static_argnums=(1,))(x, flag=True)`` raised JAX's raw ``len(args) = 1`` error;
  declared by name, the keyword flag works under ``jax.jit(jax.grad)`` and the gradients equal no remat.
  """
  x = inputs()
  ck = jaxckpt.checkpoint(_flag_fn, policy, static_argnames="square")
  for flag in (True, False):
    got = jax.jit(jax.grad(lambda x: ck(x, square=flag)))(x)
    assert_close(got, jax.grad(_flag_fn)(x, flag), depth=1)
  assert_close(ck(x, square=True), _flag_fn(x, True), depth=1)
  both = jaxckpt.checkpoint(lambda w, x, *, square: _flag_fn(x @ w, square), policy, static_argnames=("square",))
  w = inputs((D, D), seed=1)
  assert_close(jax.grad(lambda w: both(w, x, square=False))(w), jax.grad(lambda w: _flag_fn(x @ w, False))(w),
               depth=1)


@pytest.mark.parametrize("declared, call, says", [
    # declared by position, passed by keyword: names the argument and both fixes
    (dict(static_argnums=(1,)), lambda ck, x: ck(x, square=True),
     ["'square'", "static_argnums=(1,)", "by keyword", "positionally", "static_argnames=('square',)"]),
    # declared by name, passed positionally
    (dict(static_argnames="square"), lambda ck, x: ck(x, True),
     ["'square'", "static_argnames=('square',)", "positionally", "square=...", "static_argnums=(1,)"]),
    # declared position never reached
    (dict(static_argnums=(1,)), lambda ck, x: ck(x),
     ["static_argnums=(1,)", "1 ('square')", "1 positional argument"]),
    # a traced value where a Python value is needed
    (dict(static_argnames="square"), lambda ck, x: jax.jit(lambda x, s: ck(x, square=s))(x, True),
     ["'square'", "traced value", "Python value"]),
    (dict(static_argnums=1), lambda ck, x: jax.jit(lambda x, s: ck(x, s))(x, True),
     ["'square'", "traced value", "static_argnums position 1"]),
])
def test_checkpoint_static_argument_passed_the_wrong_way_says_which_and_how(declared, call, says):
  """A static flag passed another way than declared raises StaticArgumentError naming it and the fix."""
  ck = jaxckpt.checkpoint(_flag_fn, "full", **declared)
  with pytest.raises(jaxckpt.errors.StaticArgumentError) as err:
    call(ck, inputs())
  for part in says:
    assert part in str(err.value), (part, str(err.value))
  assert err.value.argument == "square"
  assert "len(args)" not in str(err.value)


@pytest.mark.parametrize("declared, says", [
    (dict(static_argnames="sqare"), ["'sqare'", "not a parameter of _flag_fn", "x, square", "did you mean 'square'"]),
    (dict(static_argnums="1"), ["static_argnums must be an int or a tuple of ints", "'1'"]),
    (dict(static_argnames=(1,)), ["static_argnames must be a str or a tuple of str", "(1,)"]),
])
def test_checkpoint_bad_static_declaration_raises_at_wrap_time(declared, says):
  """Bad declarations fail when wrapping, for every policy (``none`` too, which returns ``fn`` itself)."""
  for policy in ("full", "none"):
    with pytest.raises(jaxckpt.errors.StaticArgumentError) as err:
      jaxckpt.checkpoint(_flag_fn, policy, **declared)
    for part in says:
      assert part in str(err.value), (part, str(err.value))


def test_remat_function_static_argnames_and_module_refuses_them():
  """``jaxckpt.remat`` passes static arguments through for functions; for a module it says kwargs are static."""
  x = inputs()
  ck = jaxckpt.remat(_flag_fn, "nothing_saveable", static_argnames="square")
  assert_close(jax.grad(lambda x: ck(x, square=True))(x), jax.grad(_flag_fn)(x, True), depth=1)
  with pytest.raises(jaxckpt.errors.StaticArgumentError, match="keyword arguments of the call"):
    jaxckpt.remat(nnx.Linear(D, D, rngs=nnx.Rngs(0)), "full", static_argnames="train")


# ---------------------------------------------------------------------------------------------------------------
# BatchNorm statistics in remat'd blocks.


class BNMLP(nnx.Module):
  """``fc2(relu(BatchNorm(fc1(x))))``, ``x: [B, D]``; batch statistics update when ``train``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.bn = nnx.BatchNorm(F, momentum=0.9, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x, *, train: bool = True):
    return self.fc2(jax.nn.relu(self.bn(self.fc1(x), use_running_average=not train)))


def batch_stats(state):
  return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)
          if isinstance(v, nnx.BatchStat)}


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_grads_and_batch_stats_equal_no_remat(policy):
  """A user module with ``nnx.BatchNorm`` wrapped by ``jaxckpt.remat``: grads AND updated statistics equal no remat.

  The statistics are updated once (by the forward pass, not again by the recomputation) and written back. Reports:
  google/flax#3946 (BatchNorm + ``train`` flag through ``nn.remat``), pytorch/pytorch#62471 and
  facebookresearch/fairscale#1035 (running statistics wrong under checkpointing).
  """
  make = lambda p: jaxckpt.remat(BNMLP(rngs=nnx.Rngs(0)), p)  # noqa: E731
  x = inputs() * 3 + 1
  run = lambda m, x: sq(m(x))  # noqa: E731
  initial = batch_stats(nnx.state(make("none")))
  ref_loss, ref_other, ref = reference("bn-mlp", lambda: grads_and_state(make("none"), run, x))
  loss, other, grads = grads_and_state(make(policy), run, x)
  assert_close((loss, grads, batch_stats(other)), (ref_loss, ref, batch_stats(ref_other)), depth=1)
  changed = [k for k in initial if not np.allclose(initial[k], batch_stats(other)[k])]
  assert sorted(changed) == sorted(initial)  # every statistic moved: the test compares real updates

  # Eager calls write the statistics back to the module, equal after two steps too.
  ref_model, model = make("none"), make(policy)
  for _ in range(2):
    ref_model(x), model(x)
  assert_close(batch_stats(nnx.state(model)), batch_stats(nnx.state(ref_model)), depth=1)


class BNClassifier(nnx.Module):
  """A classifier for :func:`jaxckpt.make_train_step`: remat'd ``BNMLP`` body, linear head; ``x: [B, 2, 2, 2]``."""

  def __init__(self, policy, *, rngs: nnx.Rngs):
    self.body = jaxckpt.remat(BNMLP(rngs=rngs), policy)
    self.head = nnx.Linear(D, 10, rngs=rngs)

  def __call__(self, x, *, dropout_key=None, deterministic=True):
    del dropout_key
    return self.head(self.body(x.reshape(x.shape[0], D), train=not deterministic))


@pytest.mark.parametrize("policy", ["nothing_saveable"])
def test_make_train_step_with_batchnorm_model(policy):
  """jaxckpt's own train step on a model with BatchNorm: new params and batch statistics equal no remat.

  ``TrainState.other`` is documented to carry batch statistics. Report: google/flax#3946.
  """
  import optax  # pylint: disable=g-import-not-at-top

  batch = {"x": inputs((B, 2, 2, 2)), "y": jnp.arange(B, dtype=jnp.int32)}
  results = []
  for p in ("none", policy):
    graphdef, state = jaxckpt.create_train_state(BNClassifier(p, rngs=nnx.Rngs(0)), optax.sgd(0.1), seed=0)
    new_state, metrics = jax.jit(jaxckpt.make_train_step(graphdef, optax.sgd(0.1), jaxckpt.models.classification_loss))(state, batch)
    results.append((metrics["loss"], new_state.params, batch_stats(new_state.other)))
  assert_close(results[1], results[0], depth=2)


class BNBlock(jaxckpt.nnx.RematBlock):
  """A jaxckpt block with BatchNorm: ``x + relu(BN(fc(x)))``; block type ``bn``, emits ``bn_hidden``."""

  block_type = "bn"
  checkpoint_names = ("bn_hidden",)

  def __init__(self, *, policy=None, rngs: nnx.Rngs):
    super().__init__(policy)
    self.fc = nnx.Linear(D, D, rngs=rngs)
    self.bn = nnx.BatchNorm(D, momentum=0.9, rngs=rngs)

  def forward(self, x, dropout_key, *, deterministic):
    del dropout_key
    h = checkpoint_name(self.bn(self.fc(x), use_running_average=deterministic), "bn_hidden")
    return x + jax.nn.relu(h)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", ["nothing_saveable", "save_only_these_names:bn_hidden"])
def test_batchnorm_in_stack_grads_and_batch_stats_equal_no_remat(policy, scan):
  """BatchNorm blocks in a ``Stack`` (scanned or unrolled): grads and per-layer statistics equal no remat.

  Reports: google/flax#3602 (batch statistics carried through ``nn.scan``), google/flax#3946.
  """
  make = lambda: jaxckpt.nnx.Stack(lambda r: BNBlock(rngs=r), 3, scan=scan, rngs=nnx.Rngs(0))  # noqa: E731
  run = lambda m, x: sq(m(x, deterministic=False))  # noqa: E731
  x = inputs() * 2 + 1
  ref_loss, ref_other, ref = reference(("bn-stack", scan), lambda: grads_and_state(make(), run, x))
  model = make()
  jaxckpt.set_policy(model, policy)
  loss, other, grads = grads_and_state(model, run, x)
  assert_close((loss, grads, batch_stats(other)), (ref_loss, ref, batch_stats(ref_other)), depth=3)
  means = [v for k, v in batch_stats(other).items() if k.endswith("mean")]
  assert means and all(m.shape == (3, D) and np.abs(m).max() > 0 for m in means)


# ---------------------------------------------------------------------------------------------------------------
# The same weights used by several remat'd calls.


class Tied(nnx.Module):
  """Two attributes referring to one ``nnx.Linear``: ``b(tanh(a(x)))`` with ``a is b``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.a = nnx.Linear(D, D, rngs=rngs)
    self.b = self.a

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


@pytest.mark.parametrize("policy", POLICIES)
def test_one_remat_module_called_twice_grads_accumulate(policy):
  """One ``Remat`` module applied twice, and a module with tied weights: the gradients of both uses add up.

  Reports: google/flax#4626 (NNX remat giving wrong results), jax-ml/jax#36184 (remat with gradient accumulators).
  """
  x = inputs()
  twice = lambda m, x: sq(m(jnp.tanh(m(x))))  # noqa: E731
  make = lambda p: jaxckpt.remat(nnx.Linear(D, D, rngs=nnx.Rngs(0)), p)  # noqa: E731
  ref_loss, _, ref = reference("twice", lambda: grads_and_state(make("none"), twice, x))
  loss, _, grads = grads_and_state(make(policy), twice, x)
  assert_close((loss, grads), (ref_loss, ref), depth=2)

  make_tied = lambda p: jaxckpt.remat(Tied(rngs=nnx.Rngs(0)), p)  # noqa: E731
  once = lambda m, x: sq(m(x))  # noqa: E731
  ref_loss, _, ref = reference("tied", lambda: grads_and_state(make_tied("none"), once, x))
  loss, _, grads = grads_and_state(make_tied(policy), once, x)
  assert_close((loss, grads), (ref_loss, ref), depth=2)
  assert len(jax.tree.leaves(grads)) == 2  # one kernel, one bias: the tied weights are one parameter


@pytest.mark.parametrize("policy", MLP_POLICIES[1::2])
def test_block_applied_twice_grads_equal_no_remat(policy):
  """A jaxckpt ``MLPBlock`` applied twice with dropout (two keys): grads equal no remat."""
  block = jaxckpt.nnx.MLPBlock(D, F, dropout_rate=0.25, rngs=nnx.Rngs(0))
  k1, k2 = jax.random.split(jax.random.key(0))
  run = lambda m, x: sq(m(m(x, dropout_key=k1, deterministic=False), dropout_key=k2, deterministic=False))  # noqa: E731
  x = inputs()
  ref_loss, _, ref = reference("mlp-twice", lambda: grads_and_state(block, run, x))
  jaxckpt.set_policy(block, policy)
  loss, _, grads = grads_and_state(block, run, x)
  assert_close((loss, grads), (ref_loss, ref), depth=2)


# ---------------------------------------------------------------------------------------------------------------
# Nested remat; remat around scan vs inside scan.


@pytest.mark.parametrize(
    "outer,inner",
    [("nothing_saveable", "dots_saveable"), ("save_only_these_names:mlp_hidden", "nothing_saveable")],
)
def test_nested_remat_grads_equal_no_remat(outer, inner):
  """``Remat(Remat(block, inner), outer)`` and an outer remat over a remat'd block: grads equal no remat.

  Reports: jax-ml/jax#20877 (nested loops with remat), jax-ml/jax#2139 (nested checkpointing of scans).
  """
  make = lambda: jaxckpt.nnx.MLPBlock(D, F, dropout_rate=0.25, rngs=nnx.Rngs(0))  # noqa: E731
  x, key = inputs(), jax.random.key(5)
  run = lambda m, x: sq(m(x, dropout_key=key, deterministic=False))  # noqa: E731
  ref_loss, _, ref = reference(
      "nested", lambda: grads_and_state(jaxckpt.Remat(jaxckpt.Remat(make(), "none"), "none"), run, x))
  loss, _, grads = grads_and_state(jaxckpt.Remat(jaxckpt.Remat(make(), inner), outer), run, x)
  assert_close((loss, grads), (ref_loss, ref), depth=1)

  block = make()
  jaxckpt.set_policy(block, inner)  # the block's own remat, inside an outer remat wrapper
  loss, _, grads = grads_and_state(jaxckpt.Remat(block, outer), run, x)
  # one wrapper less in the paths: compared as leaves
  assert_close((loss, jax.tree.leaves(grads)), (ref_loss, jax.tree.leaves(ref)), depth=1)


def stack_loss(outer):
  """Loss of a 3-layer scanned MLP stack, optionally with one ``jax.checkpoint`` around the whole scan."""

  def run(m, x, key):
    call = lambda m, x: m(x, dropout_key=key, deterministic=False)  # noqa: E731
    graphdef, state = nnx.split(m)
    if outer != "none":
      pure = jaxckpt.checkpoint(lambda s, x: call(nnx.merge(graphdef, s), x), outer)
      return sq(pure(state, x))
    return sq(call(m, x))

  return run


@pytest.mark.parametrize(
    "inner,outer,scan",
    [("nothing_saveable", "none", True), ("dots_saveable", "nothing_saveable", True),
     ("save_only_these_names:mlp_hidden", "none", False)],
)
def test_remat_around_scan_vs_inside_scan_grads_equal(inner, outer, scan):
  """Policy on the scan body, ``jax.checkpoint`` around the whole scan, both, or unrolled: grads equal no remat.

  Reports: jax-ml/jax#1907 (remat with scan), jax-ml/jax#2030, jax-ml/jax#27748 (remat around ``lax.scan``).
  """
  make = lambda: jaxckpt.nnx.Stack(  # noqa: E731
      lambda r: jaxckpt.nnx.MLPBlock(D, F, dropout_rate=0.25, rngs=r), 3, scan=scan, rngs=nnx.Rngs(0))
  x, key = inputs(), jax.random.key(9)
  ref_loss, _, ref = reference(("stack", scan), lambda: grads_and_state(make(), stack_loss("none"), x, key))
  model = make()
  jaxckpt.set_policy(model, inner)
  loss, _, grads = grads_and_state(model, stack_loss(outer), x, key)
  assert_close((loss, grads), (ref_loss, ref), depth=3)


def test_remat_around_scan_only_moves_memory_to_backward():
  """What each placement saves for the backward pass (residual bytes, excluding the inputs), 3 scanned layers.

  No remat keeps every layer's intermediates; ``nothing_saveable`` on the scan body keeps one carry per layer; one
  ``jax.checkpoint`` around the scan keeps nothing but its inputs -- yet its backward pass re-runs the whole scan and
  holds every layer's intermediates at once then, so its peak is that of no remat (put the policy on the scan body:
  measured with jax 0.10 on 16 scanned layers, 436 MiB of temp with it there, 4520 MiB without remat). FLOPs: one
  extra forward pass for either placement.
  """
  x, key = jax.ShapeDtypeStruct((B, D), jnp.float32), jax.random.key(0)

  def residual_bytes(inner, outer):
    model = jaxckpt.nnx.Stack(lambda r: jaxckpt.nnx.MLPBlock(D, F, rngs=r), 3, rngs=nnx.Rngs(0))
    jaxckpt.set_policy(model, inner)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    run = stack_loss(outer)
    fn = lambda params, x: run(nnx.merge(graphdef, params, other), x, key)  # noqa: E731
    return total_residual_bytes(saved_residuals(fn, params, x), include_arguments=False)

  none, inside, around = residual_bytes("none", "none"), residual_bytes("nothing_saveable", "none"), residual_bytes(
      "none", "nothing_saveable")
  assert around < inside < none
  assert inside <= 3 * B * D * 4 * 2  # about one [B, D] carry per layer (plus its stacked copy)


# ---------------------------------------------------------------------------------------------------------------
# Matmuls that dots policies do not recognise (custom VJP).


def _kernel(x, w):
  """A matmul JAX cannot see into (stands in for a Pallas/TransformerEngine kernel): numpy through pure_callback."""
  out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[-1]), x.dtype)
  return jax.pure_callback(lambda a, b: np.asarray(a @ b, dtype=np.float32), out, x, w)


@jax.custom_vjp
def kernel_matmul(x, w):
  return _kernel(x, w)


kernel_matmul.defvjp(lambda x, w: (_kernel(x, w), (x, w)),
                     lambda res, g: (_kernel(g, res[1].T), _kernel(res[0].T, g)))


@jax.custom_vjp
def dot_matmul(x, w):
  return x @ w


dot_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


class MatmulBlock(nnx.Module):
  """``x + tanh(matmul(tanh(x), W))`` with a chosen matmul; optionally tags the matmul output ``proj``."""

  def __init__(self, matmul, *, tag: bool = False, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / np.sqrt(D))
    self.matmul, self.tag = matmul, tag

  def __call__(self, x):
    y = self.matmul(jnp.tanh(x), self.w[...])
    return x + jnp.tanh(checkpoint_name(y, "proj") if self.tag else y)


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable"])
def test_custom_vjp_matmul_grads_equal_no_remat(policy):
  """A block whose matmul is a ``jax.custom_vjp`` kernel: grads under dots policies equal no remat.

  Reports: jax-ml/jax#30717 (dots policies ignored ``scaled_dot_general``), NVIDIA/TransformerEngine#2003 (TE GEMMs
  ignored by JAX's dots policies).
  """
  make = lambda p: jaxckpt.remat(MatmulBlock(kernel_matmul, rngs=nnx.Rngs(0)), p)  # noqa: E731
  x = inputs()
  run = lambda m, x: sq(m(m(x)))  # noqa: E731
  ref_loss, _, ref = reference("kernel", lambda: grads_and_state(make("none"), run, x))
  loss, _, grads = grads_and_state(make(policy), run, x)
  assert_close((loss, grads), (ref_loss, ref), depth=2)


def test_policy_warnings_dots_policy_on_custom_vjp_kernel():
  """``policy_warnings`` says dots policies save no dot output of a kernel matmul, and suggests checkpoint names.

  Reports: jax-ml/jax#30717, NVIDIA/TransformerEngine#2003.
  """
  x = inputs()
  kernel_block = MatmulBlock(kernel_matmul, rngs=nnx.Rngs(0))
  for policy in ("dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dot_with_no_batch_dims"):
    (message,) = policy_warnings(kernel_block, x, policy=policy)
    assert f"policy {policy} saves no dot_general output" in message
    assert "custom_vjp" in message and "kernel_matmul" in message
    assert "checkpoint_name" in message and "save_only_these_names" in message

  # The suggested fix works: the tagged kernel output is saved, and no warning remains.
  tagged = MatmulBlock(kernel_matmul, tag=True, rngs=nnx.Rngs(0))
  assert policy_warnings(tagged, x, policy="save_only_these_names:proj") == []
  graphdef, state = nnx.split(tagged)
  ck = jaxckpt.checkpoint(lambda s, x: sq(nnx.merge(graphdef, s)(x)), "save_only_these_names:proj")
  assert [r.name for r in saved_residuals(ck, state, x) if r.kind == "checkpoint_name"] == ["proj"]

  with pytest.warns(RematPolicyWarning, match="custom_vjp"):
    warn_policy(kernel_block, x, policy="dots_saveable")


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable",
                                    "offload_dot_with_no_batch_dims"])
def test_policy_warnings_none_for_visible_matmuls(policy):
  """No warning when the matmuls are ``dot_general``: a plain matmul block, an ``MLPBlock``, and a ``custom_vjp``
  whose forward rule is a ``dot_general`` (JAX 0.10 applies the policy inside custom_vjp forward rules)."""
  x = inputs()
  for block in (MatmulBlock(jnp.matmul, rngs=nnx.Rngs(0)), MatmulBlock(dot_matmul, rngs=nnx.Rngs(0)),
                jaxckpt.nnx.MLPBlock(D, F, rngs=nnx.Rngs(0))):
    assert policy_warnings(block, x, policy=policy) == [], type(block).__name__


def test_policy_warnings_other_silent_policies():
  """Names never emitted (typo), batch-only dots, ``everything_saveable``; nothing for ``none``/``nothing_saveable``."""
  block = jaxckpt.nnx.MLPBlock(D, F, rngs=nnx.Rngs(0))
  x = inputs()
  (typo,) = policy_warnings(block, x, policy="save_only_these_names:mlp_hiden")
  assert "'mlp_hiden'" in typo and "never emits" in typo and names.MLP_HIDDEN in typo
  assert policy_warnings(block, x, policy="save_only_these_names:mlp_hidden") == []
  (offload,) = policy_warnings(block, x, policy="save_and_offload_only_these_names:mlp_hidden/qkv")
  assert "'qkv'" in offload
  (except_,) = policy_warnings(block, x, policy="save_any_names_but_these:attn_out")
  assert "every checkpoint-named value" in except_
  (everything,) = policy_warnings(block, x, policy="everything_saveable")
  assert "as much memory as no remat" in everything
  for quiet in ("none", "nothing_saveable", "full"):
    assert policy_warnings(block, x, policy=quiet) == []

  def attention_scores(q, k):  # [B, T, D] x [B, T, D] -> [B, T, T]: batched dots only
    return jnp.sum(jnp.tanh(jnp.einsum("btd,bsd->bts", q, k)))

  q = inputs((B, T, D))
  (batched,) = policy_warnings(attention_scores, q, q, policy="dots_with_no_batch_dims_saveable")
  assert "batch dimensions" in batched
  assert policy_warnings(attention_scores, q, q, policy="dots_saveable") == []

  def no_matmul(w, x):  # a matmul written as multiply-and-sum
    return jnp.sum(jnp.tanh(jnp.sum(x[:, :, None] * w[None], axis=1)))

  (hidden,) = policy_warnings(no_matmul, jnp.ones((D, D)), x, policy="dots_saveable")
  assert "no dot_general at all" in hidden

  (spec,) = policy_warnings(block, x, policy="attn=full,mlp=save_only_these_names:nope", block_type="mlp")
  assert "'nope'" in spec


@jax.custom_vjp
def sin_tagged_residual(x):
  """``sin(x)`` whose custom_vjp forward rule tags its residual ``cos(x)`` as ``act_cos``."""
  return jnp.sin(x)


sin_tagged_residual.defvjp(lambda x: (jnp.sin(x), checkpoint_name(jnp.cos(x), "act_cos")),
                           lambda cos, g: (g * cos,))


@jax.custom_jvp
def tanh_tagged_rule(x):
  """``tanh(x)`` whose custom_jvp rule tags its derivative ``1 - tanh(x)²`` as ``act_dtanh``."""
  return jnp.tanh(x)


@tanh_tagged_rule.defjvp
def _tanh_tagged_rule_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  y = jnp.tanh(x)
  return y, checkpoint_name(1 - y**2, "act_dtanh") * t


@pytest.mark.parametrize("custom, name", [(sin_tagged_residual, "act_cos"), (tanh_tagged_rule, "act_dtanh")])
def test_policy_warnings_count_names_emitted_inside_custom_derivative_rules(custom, name):
  """A name tagged in a custom_vjp forward rule / custom_jvp rule is saved, and the diagnostics say so.

  The issue: ``save_only_these_names:act_cos`` saved the custom_vjp residual (listed by the saved-residual analysis,
  gradients equal) while ``policy_warnings`` claimed the function "never emits" act_cos and "saves nothing for it".
  """
  from jaxckpt.analysis._jaxprs import emitted_checkpoint_names, iter_eqns

  def fn(w, x):
    return jnp.sum(custom(x @ w) ** 2)

  w, x = inputs((D, D), seed=1), inputs()
  policy = f"save_only_these_names:{name}"
  ck = jaxckpt.checkpoint(fn, policy)
  saved = [(r.name, r.shape) for r in saved_residuals(ck, w, x) if r.kind == "checkpoint_name"]
  assert saved == [(name, (B, D))]
  assert_close(jax.grad(ck, argnums=(0, 1))(w, x), jax.grad(fn, argnums=(0, 1))(w, x), depth=1)
  assert emitted_checkpoint_names(fn, w, x) == {name}
  assert emitted_checkpoint_names(ck, w, x) == {name}  # the rule inside jax.checkpoint too
  rules = {e.params["name"] for e in iter_eqns(jax.make_jaxpr(fn)(w, x), rules=True) if e.primitive.name == "name"}
  assert rules == {name}
  assert policy_warnings(fn, w, x, policy=policy) == []
  # A misspelt name is still reported, and the emitted list shows the rule's name.
  (typo,) = policy_warnings(fn, w, x, policy=f"save_only_these_names:{name}x")
  assert f"'{name}x'" in typo and "never emits" in typo and f"emitted: {name})" in typo


def test_emitted_names_found_by_vjp_trace_when_rule_thunks_cannot_be_expanded(monkeypatch):
  """If JAX's internal rule thunks change, the public ``jax.vjp`` trace still finds names inside rules."""
  from jaxckpt.analysis import _jaxprs as jaxprs

  monkeypatch.setattr(jaxprs, "rule_jaxprs", lambda eqn: [])
  fn = lambda x: jnp.sum(sin_tagged_residual(x))  # noqa: E731
  assert jaxprs.emitted_checkpoint_names(fn, inputs()) == {"act_cos"}
  assert not {e.primitive.name for e in jaxprs.iter_eqns(jax.make_jaxpr(fn)(inputs()), rules=True)} & {"name"}


# ---------------------------------------------------------------------------------------------------------------
# Decoding loops (while_loop / fori_loop) through remat'd layers.


class TinyLM(nnx.Module):
  """Embedding -> causal ``TransformerBlock`` -> tied logits; ``tokens: [B, T] int32`` -> ``[B, T, V]``."""

  def __init__(self, vocab: int = 11, *, policy="none", rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, D, rngs=rngs)
    self.block = jaxckpt.nnx.TransformerBlock(D, 2, F, causal=True, policy=policy, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.block(self.embed(tokens)))


def greedy_decode(model, prompt, *, loop: str):
  """Greedy decoding over a fixed [B, T] buffer (no KV cache), with ``while_loop`` or ``fori_loop``."""
  graphdef, state = nnx.split(model)

  def step(t, carry):
    tokens, scores = carry
    logits = nnx.merge(graphdef, state)(tokens)[:, t]  # [B, V]
    return tokens.at[:, t + 1].set(jnp.argmax(logits, -1).astype(tokens.dtype)), scores.at[:, t].set(logits)

  tokens = jnp.zeros((B, T), jnp.int32).at[:, 0].set(prompt)
  scores = jnp.zeros((B, T - 1, 11))
  if loop == "while":
    _, tokens, scores = jax.lax.while_loop(lambda c: c[0] < T - 1, lambda c: (c[0] + 1, *step(c[0], c[1:])),
                                           (0, tokens, scores))
    return tokens, scores
  return jax.lax.fori_loop(0, T - 1, step, (tokens, scores))


@pytest.mark.parametrize("loop", ["while", "fori"])
def test_greedy_decode_through_remat_layers_equals_no_remat(loop):
  """Forward-only greedy decoding with remat'd layers inside ``while_loop``/``fori_loop``: same tokens and logits.

  Policies: ``nothing_saveable`` and a block map (``attn=dots_saveable,mlp=save_only_these_names:mlp_hidden``).
  Report: google/flax#4819 (``nnx.while_loop`` failing with scan-over-layers or ``nnx.remat``).
  """
  prompt = jnp.arange(B, dtype=jnp.int32) + 1
  decode = lambda model: jax.jit(lambda p: greedy_decode(model, p, loop=loop))(prompt)  # noqa: E731
  ref_tokens, ref_scores = decode(TinyLM(rngs=nnx.Rngs(0)))
  assert len(np.unique(np.asarray(ref_tokens[:, 1:]))) > 1  # the loop really decodes, not a constant
  for policy in ("nothing_saveable", "attn=dots_saveable,mlp=save_only_these_names:mlp_hidden"):
    tokens, scores = decode(TinyLM(policy=policy, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(tokens, ref_tokens)  # exact: token ids, argmaxes of logits equal to rounding
    assert_close(scores, ref_scores, depth=1)  # each step's logits: one forward through TinyLM's one block


def test_block_closed_over_in_loop_body():
  """A jaxckpt block called directly in a ``fori_loop``/``while_loop`` body (closed over, not split): same output."""
  x = inputs()
  ref_block = jaxckpt.nnx.MLPBlock(D, F, rngs=nnx.Rngs(0))
  block = jaxckpt.nnx.MLPBlock(D, F, policy="nothing_saveable", rngs=nnx.Rngs(0))
  out = {}
  for b in (ref_block, block):
    out[b, "fori"] = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, h: b(h), x))(x)
    out[b, "while"] = jax.jit(
        lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, b(c[1])), (0, x))[1])(x)
  assert_close(out[block, "fori"], out[ref_block, "fori"], depth=3)  # the block applied 3 times
  assert_close(out[block, "while"], out[ref_block, "fori"], depth=3)


@pytest.mark.parametrize("policy", ["nothing_saveable", "save_only_these_names:mlp_hidden"])
def test_grad_through_fori_loop_of_remat_block_equals_no_remat(policy):
  """``jax.grad`` through a fixed-trip-count ``fori_loop`` (lowered to ``scan``) of a remat'd block: equal grads.

  Reports: google/flax#4819, jax-ml/jax#2030 (remat inside scan).
  """
  block = jaxckpt.nnx.MLPBlock(D, F, dropout_rate=0.25, rngs=nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(1), 3)
  run = lambda m, x: sq(jax.lax.fori_loop(  # noqa: E731
      0, 3, lambda i, h: m(h, dropout_key=keys[i], deterministic=False), x))
  x = inputs()
  ref_loss, _, ref = reference("fori", lambda: grads_and_state(block, run, x))
  jaxckpt.set_policy(block, policy)
  loss, _, grads = grads_and_state(block, run, x)
  assert_close((loss, grads), (ref_loss, ref), depth=3)


# ---------------------------------------------------------------------------------------------------------------
# memory_analysis() returning zeros or None.


class FakeCompiled:
  """Stands in for ``jax.stages.Compiled``: ``memory_analysis()`` returns ``analysis`` or raises it."""

  def __init__(self, analysis):
    self.analysis = analysis

  def memory_analysis(self):
    if isinstance(self.analysis, BaseException):
      raise self.analysis
    return self.analysis


def stats(**fields):
  return types.SimpleNamespace(**fields)


ALL_ZERO = stats(**{attr: 0 for attr in MEMORY_FIELDS.values()})


@pytest.mark.parametrize(
    "analysis",
    [None, NotImplementedError("memory_analysis"), RuntimeError("UNIMPLEMENTED"), ALL_ZERO, stats(), object(),
     stats(argument_size_in_bytes=-1, output_size_in_bytes=None, temp_size_in_bytes="12")],
    ids=["none", "not-implemented", "runtime-error", "all-zero", "no-fields", "object", "junk-values"],
)
def test_memory_stats_unknown_is_none_never_zero(analysis):
  """Every way a backend says "unknown" gives ``None`` for every key, ``footprint_bytes`` included, never 0.

  Report: jax-ml/jax#18954 (``Compiled.memory_analysis`` returning zeros).
  """
  record = jaxckpt.memory_stats(FakeCompiled(analysis))
  assert list(record) == list(MEMORY_KEYS)
  assert all(v is None for v in record.values()), record


def test_memory_stats_zero_sizes_next_to_generated_code_are_none():
  """jax-ml/jax#18954's exact pattern: every size 0 except ``generated_code_size_in_bytes`` -> sizes ``None``."""
  analysis = stats(**{**vars(ALL_ZERO), "generated_code_size_in_bytes": 2856})
  record = jaxckpt.memory_stats(FakeCompiled(analysis))
  assert record[FOOTPRINT] is None
  assert record["temp_bytes"] is None and record["argument_bytes"] is None


def test_memory_stats_missing_fields_are_none_and_real_compile_gives_ints():
  """Fields an older ``CompiledMemoryStats`` lacks are ``None``; a real compile gives ints with a footprint."""
  old = stats(argument_size_in_bytes=64, output_size_in_bytes=4, temp_size_in_bytes=128, alias_size_in_bytes=0,
              generated_code_size_in_bytes=1000)
  record = jaxckpt.memory_stats(FakeCompiled(old))
  assert record[FOOTPRINT] == 64 + 4 + 128
  assert record["peak_memory_bytes"] is None and record["host_temp_bytes"] is None

  compiled = jaxckpt.compile_step(lambda x: jnp.sum(jnp.tanh(x @ x.T)), jax.ShapeDtypeStruct((B, D), jnp.float32))
  real = jaxckpt.memory_stats(compiled)
  assert isinstance(real["argument_bytes"], int) and real["argument_bytes"] >= B * D * 4
  assert isinstance(real[FOOTPRINT], int) and real[FOOTPRINT] > 0
  assert all(v is None or (isinstance(v, int) and v >= 0) for v in real.values())
