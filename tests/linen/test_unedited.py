"""Published model code adopted unedited. Models whose methods are jitted inside (``nn.jit`` on a Linen model's
``__call__`` or block class; ``nnx.jit`` / ``jax.jit`` in an NNX model) take remat by block class: each policy is
traced under its own policy (a jit inside caches on it), the parameter tree stays, gradients equal no remat; a cache
jaxckpt cannot key is an error naming the wrapper (tests/linen/linen_lms.py: :class:`JittedDecoder`). The Linen target's
``inputs=`` default, refused in one line where the batch has no ``"inputs"``."""

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxckpt
from jaxckpt.analysis._jaxprs import outermost_remats, remat_policy
from jaxckpt.errors import JaxckptError
from jaxckpt.linen import _apply as linen_apply
from jaxckpt.planner import plan_policy
from jaxckpt import parse_model_policy
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.step import compile_policy
from tests.linen.linen_lms import DECODER_TOKENS, DecoderBlock, DecoderConfig, JittedDecoder, jitted_decoder_target
from tests.numerics import assert_trees_close

TOKENS = jax.random.randint(jax.random.key(1), DECODER_TOKENS.shape, 0, DecoderConfig.vocab_size)
LAYERED = "0-1:nothing_saveable;2-3:dots_saveable"


def _policy_kinds(jaxpr) -> list[str]:
  """The class (or function) name of each outermost remat region's policy, sorted (the backward pass runs the
  regions in reverse)."""
  kinds = []
  for eqn in outermost_remats(jaxpr):
    policy = remat_policy(eqn)  # None: save nothing (remat3's form of nothing_saveable)
    kinds.append("nothing_saveable" if policy is None else getattr(policy, "__name__", type(policy).__name__))
  return sorted(kinds)


def _loss(model, params, tokens):
  logits = model.apply({"params": params}, tokens[:, :-1], deterministic=False,
                       rngs={"dropout": jax.random.key(3)})
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


@pytest.fixture(scope="module")
def decoder():
  model = jaxckpt.linen.apply_remat(JittedDecoder(), "none", blocks={"block": DecoderBlock})
  params = model.init(jax.random.key(0), TOKENS[:, :-1])["params"]
  reference = jax.grad(functools.partial(_loss, JittedDecoder()))(params, TOKENS)
  return model, params, reference


@pytest.mark.remat3
@pytest.mark.parametrize("policy, kinds", [
    ("nothing_saveable", ["nothing_saveable"] * 4),
    ("dots_saveable", ["DotsSaveable"] * 4),
    ("save_only_these_names:mlp.wi+attention.key", ["SaveOnlyTheseNames"] * 4),
    (LAYERED, ["DotsSaveable"] * 2 + ["nothing_saveable"] * 2),
    ("none", []),
])
def test_nn_jit_decoder_traces_each_policy_and_keeps_gradients(decoder, policy, kinds):
  model, params, reference = decoder
  applied = model.with_policy(policy)
  grad = jax.grad(functools.partial(_loss, applied))
  forward = jax.make_jaxpr(functools.partial(_loss, applied))(params, TOKENS)
  assert _policy_kinds(forward) == kinds  # its own trace, not the trace of an earlier policy
  assert jax.tree.structure(params) == jax.tree.structure(reference)
  assert_trees_close(grad(params, TOKENS), reference, depth=DecoderConfig().num_layers,
                     what=f"nn.jit decoder gradients, {policy} vs the plain decoder")


def test_nn_jit_decoder_retraces_once_per_policy():
  calls = []

  class CountedBlock(DecoderBlock):
    def __call__(self, x, deterministic: bool = True):
      calls.append(self.name)
      return super().__call__(x, deterministic=deterministic)

  class Counted(JittedDecoder):
    def setup(self):
      cfg = self.config
      self.embed = nn.Embed(cfg.vocab_size, cfg.emb_dim)
      self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.max_len, cfg.emb_dim))
      self.layers = [CountedBlock(cfg) for _ in range(cfg.num_layers)]
      self.ln_f = nn.LayerNorm()

  model = jaxckpt.linen.apply_remat(Counted(), "dots_saveable", blocks={"block": CountedBlock})
  variables = model.init(jax.random.key(0), TOKENS[:, :-1])
  calls.clear()
  for _ in range(3):  # eager applies under one policy: nn.jit's cached trace serves them
    model.apply(variables, TOKENS[:, :-1])
  assert len(calls) == 4
  for _ in range(2):  # another policy: traced once more, then cached again
    model.with_policy("nothing_saveable").apply(variables, TOKENS[:, :-1])
  assert len(calls) == 8


@pytest.fixture(scope="module")
def decoder_target():
  return jitted_decoder_target()


def _target_grads(target, policies):
  leaves, tree = jax.tree.flatten(target.params)
  params = tree.unflatten([0.02 * jax.random.normal(jax.random.key(i), s.shape, s.dtype)
                           for i, s in enumerate(leaves)])
  batch = {"batch": TOKENS, "dropout_seed": jnp.uint32(7)}
  return [jax.grad(lambda q, p=p: target.loss(q, batch, policy=p))(params) for p in policies]


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_nn_jit_decoder_as_a_target_compiles_each_policy(decoder_target):
  target = decoder_target
  assert target.num_layers == 4 and "mlp.wi" in target.block_types["block"]
  temps = [compile_policy(target, parse_model_policy(p)).memory["temp_bytes"] for p in ("none", "nothing_saveable")]
  if remat_implementation() == "remat2":  # remat3 keeps no barrier XLA:CPU honours for unrolled blocks (README)
    assert temps[1] < temps[0]  # the second policy is compiled, not the first one's trace
  reference, layered = _target_grads(target, [parse_model_policy("none"), parse_model_policy(LAYERED)])
  assert_trees_close(layered, reference, depth=target.num_layers, what=f"target gradients, {LAYERED} vs none")


@pytest.mark.slow
def test_nn_jit_decoder_budget_plan(decoder_target):
  target = decoder_target
  plan = plan_policy(target, "budget:50%", max_rounds=1)
  assert plan.compiled.temp_bytes <= plan.limit_bytes < plan.none.temp_bytes
  reference, planned = _target_grads(target, [parse_model_policy("none"), plan.policy])
  assert_trees_close(planned, reference, depth=target.num_layers, what=f"target gradients, {plan.policy} vs none")


def test_a_cache_that_ignores_the_trace_context_is_named(monkeypatch):
  monkeypatch.setattr(linen_apply, "_TRACE_KEY", lambda key: contextlib.nullcontext())  # as a cache of its own would
  model = jaxckpt.linen.apply_remat(JittedDecoder(DecoderConfig(dropout_rate=0.2)), "nothing_saveable",
                                    blocks={"block": DecoderBlock})
  variables = model.init(jax.random.key(0), TOKENS[:, :-1])
  model.apply(variables, TOKENS[:, :-1])
  with pytest.raises(JaxckptError) as err:  # nn.jit's cache now serves the nothing_saveable trace again
    model.with_policy("save_only_these_names:mlp.wo").apply(variables, TOKENS[:, :-1])
  message = str(err.value)
  assert "JittedDecoder.__call__ is wrapped in nn.jit" in message and "fix: " in message
  assert "matched no module" not in message and len(message.splitlines()) == 1


def test_block_class_under_nn_jit_fixed_policy_works_layered_names_it():
  JitBlock = nn.jit(DecoderBlock)  # noqa: N806 - a class

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      cfg = DecoderConfig()
      x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
      for i in range(cfg.num_layers):
        x = JitBlock(cfg, name=f"layers_{i}")(x)
      return nn.Dense(cfg.vocab_size)(x)

  model = jaxckpt.linen.apply_remat(Stack(), "none", blocks={"block": DecoderBlock})
  params = model.init(jax.random.key(0), TOKENS[:, :-1])["params"]
  loss = lambda m, p: m.apply({"params": p}, TOKENS[:, :-1]).mean()  # noqa: E731
  reference = jax.grad(functools.partial(loss, Stack()))(params)
  applied = model.with_policy("dots_saveable")
  assert _policy_kinds(jax.make_jaxpr(functools.partial(loss, applied))(params)) == ["DotsSaveable"] * 4
  assert_trees_close(jax.grad(functools.partial(loss, applied))(params), reference, depth=DecoderConfig().num_layers,
                     what="gradients of nn.jit blocks, dots_saveable vs the plain stack")
  with pytest.raises(JaxckptError, match=r"DecoderBlock is wrapped in nn\.jit \(class JitDecoderBlock.*give one spec"):
    model.with_policy(LAYERED).apply({"params": params}, TOKENS[:, :-1])


class NNXBlock(nnx.Module):
  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.fc, self.proj = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.proj(jax.nn.gelu(self.fc(x)))


class NNXJitted(nnx.Module):
  """``nnx.jit`` on ``__call__``."""

  def __init__(self, d: int = 16, layers: int = 3, *, rngs: nnx.Rngs):
    self.layers = nnx.List([NNXBlock(d, rngs=rngs) for _ in range(layers)])

  @nnx.jit
  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


class NNXInnerJit(NNXJitted):
  """``jax.jit`` on a method the call goes through (NNX modules are pytrees)."""

  def __call__(self, x):
    return self.forward(x)

  @jax.jit
  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


@pytest.mark.remat3
@pytest.mark.parametrize("cls", [NNXJitted, NNXInnerJit])
def test_nnx_jit_and_jax_jit_inside_an_nnx_model(cls):
  model, x = cls(rngs=nnx.Rngs(0)), jax.random.normal(jax.random.key(2), (4, 16))
  graphdef, state = nnx.split(model)
  loss = lambda g: lambda s: nnx.merge(g, s)(x).mean()  # noqa: E731
  reference = jax.grad(loss(graphdef))(state)
  jaxckpt.apply_remat(model, "none", blocks={"block": NNXBlock})
  for policy, kinds in (("nothing_saveable", ["nothing_saveable"] * 3), ("dots_saveable", ["DotsSaveable"] * 3),
                        ("none", [])):
    jaxckpt.set_policy(model, policy)
    graphdef, state = nnx.split(model)
    assert _policy_kinds(jax.make_jaxpr(loss(graphdef))(state)) == kinds, policy
    assert_trees_close(jax.tree.leaves(jax.grad(loss(graphdef))(state)), jax.tree.leaves(reference), depth=3,
                       what=f"{cls.__name__} gradients, {policy} vs before apply_remat")  # three blocks


@pytest.mark.parametrize("batch", [DECODER_TOKENS, {"ids": DECODER_TOKENS}], ids=["array", "dict"])
def test_custom_loss_without_inputs_names_inputs(batch):
  with pytest.raises(JaxckptError) as err:
    jaxckpt.linen_model_target(JittedDecoder(), batch, loss=lambda out, b: out.mean(),
                               blocks={"block": DecoderBlock})
  message = str(err.value)
  assert "inputs=" in message and "has no 'inputs'" in message and "int32[8, 17]" in message
  assert "string indexing" not in message and len(message.splitlines()) == 1
  tokens_of = lambda b: b["ids"] if isinstance(b, dict) else b  # noqa: E731
  target = jaxckpt.linen_model_target(JittedDecoder(), batch, loss=lambda out, b: out.mean(),
                                      blocks={"block": DecoderBlock}, inputs=lambda b: (tokens_of(b)[:, :-1],))
  assert target.num_layers == 4


def test_next_token_batch_without_tokens_is_named():
  with pytest.raises(JaxckptError, match=r"loss='next_token'\) needs batch= token ids .*got \{'ids': 'int32\[8, 17"):
    jaxckpt.linen_model_target(JittedDecoder(), {"ids": DECODER_TOKENS}, loss="next_token",
                               blocks={"block": DecoderBlock})
