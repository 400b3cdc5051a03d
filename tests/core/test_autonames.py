"""Checkpoint names for any layer: GPT-2-style models whose projections are their own ``Conv1D`` class (a weight
made with ``nnx.Param`` / ``self.param`` and ``jnp.dot``, as ported GPT-2 code writes it), NNX and Linen, get
automatic names from their attribute paths; ``names=`` chooses other layers; bad ``names=`` values are one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx

import jaxckpt
from tests.gemma_lm import Block as GemmaBlock
from tests.gemma_lm import GemmaConfig, GemmaLM
from jaxckpt.analysis._residuals import saved_residuals
from jaxckpt._remat_impl import remat_implementation
from jaxckpt.errors import JaxckptError
from jaxckpt.linen import _apply as linen_apply
from jaxckpt.step import ModelTarget, linen_target
from jaxckpt.report import build_report
from jaxckpt.cli._report import main as report_main
from tests.numerics import assert_trees_close

D, T, B, VOCAB, LAYERS = 32, 16, 8, 64, 2
GPT2_NAMES = frozenset({"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"})
TOKENS = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)


def one_line(err) -> None:
  assert "\n" not in str(err.value), str(err.value)


# ----------------------------------------------------------------------------------------------------------- NNX


class Conv1D(nnx.Module):
  """GPT-2's dense layer: weight ``[nin, nout]``, ``x @ w + b``."""

  def __init__(self, nin: int, nout: int, *, rngs: nnx.Rngs):
    self.weight = nnx.Param(jax.random.normal(rngs.params(), (nin, nout)) * 0.02)
    self.bias = nnx.Param(jnp.zeros((nout,)))

  def __call__(self, x):
    return jnp.dot(x, self.weight[...]) + self.bias[...]


class LayerNorm(nnx.Module):
  """A hand-written norm: rank-1 parameters only, so not named by default."""

  def __init__(self, d: int):
    self.g = nnx.Param(jnp.ones((d,)))
    self.b = nnx.Param(jnp.zeros((d,)))

  def __call__(self, x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * self.g[...] + self.b[...]


class Attention(nnx.Module):
  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.c_attn = Conv1D(d, 3 * d, rngs=rngs)
    self.c_proj = Conv1D(d, d, rngs=rngs)
    self.resid_dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):                                   # [B, T, D]
    b, t, d = x.shape
    q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in jnp.split(self.c_attn(x), 3, axis=-1))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(b, t, d)
    return self.resid_dropout(self.c_proj(out))


class MLP(nnx.Module):
  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.c_fc = Conv1D(d, 4 * d, rngs=rngs)
    self.c_proj = Conv1D(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.ln_1 = LayerNorm(d)
    self.attn = Attention(d, heads, rngs=rngs)
    self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp = MLP(d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
    self.h = nnx.List([Block(D, 4, rngs=rngs) for _ in range(LAYERS)])
    self.ln_f = LayerNorm(D)

  def __call__(self, tokens):                              # [B, T] int32 -> [B, T, V]
    x = self.wte(tokens)
    for block in self.h:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def gpt2_loss(model, batch):
  tokens = batch["tokens"]
  return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def nnx_gpt2(policy="none", names=None):
  return jaxckpt.apply_remat(GPT2(rngs=nnx.Rngs(0)), policy, blocks={"block": Block}, names=names)


def nnx_target():
  """``--target tests.core.test_autonames:nnx_target``."""
  return ModelTarget(make_model=nnx_gpt2, batch={"tokens": TOKENS}, loss_fn=gpt2_loss, name="nnx-gpt2")


# --------------------------------------------------------------------------------------------------------- Linen


class LinenConv1D(nn.Module):
  """GPT-2's dense layer as the Hugging Face Flax port writes it: ``self.param`` and ``jnp.dot``."""

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    return jnp.dot(x, kernel) + bias


class LinenAttention(nn.Module):
  heads: int

  def setup(self):
    self.c_attn = LinenConv1D(3 * D)
    self.c_proj = LinenConv1D(D)
    self.resid_dropout = nn.Dropout(0.1)

  def __call__(self, x, deterministic: bool = True):
    b, t, d = x.shape
    q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in jnp.split(self.c_attn(x), 3, axis=-1))
    mask = nn.make_causal_mask(jnp.ones((b, t)))
    out = nn.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d)
    return self.resid_dropout(self.c_proj(out), deterministic=deterministic)


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return LinenConv1D(x.shape[-1], name="c_proj")(nn.gelu(LinenConv1D(4 * x.shape[-1], name="c_fc")(x)))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    x = x + LinenAttention(4, name="attn")(nn.LayerNorm(name="ln_1")(x), deterministic)
    return x + LinenMLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class LinenGPT2(nn.Module):
  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    wte = nn.Embed(VOCAB, D, name="wte")
    x = wte(tokens)
    for i in range(LAYERS):
      x = LinenBlock(name=f"h_{i}")(x, deterministic)
    return wte.attend(nn.LayerNorm(name="ln_f")(x))


def linen_gpt2(policy="none", names=None):
  return linen_apply.apply_remat(LinenGPT2(), policy, blocks={"block": LinenBlock}, names=names)


def linen_loss(apply_fn, params, batch):
  tokens = batch["tokens"]
  logits = apply_fn(params, tokens[:, :-1], deterministic=False)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def linen_gpt2_target():
  """``--target tests.core.test_autonames:linen_gpt2_target``."""
  return linen_target(linen_gpt2(), batch={"tokens": TOKENS}, loss_fn=linen_loss,
                      init_args=(jax.ShapeDtypeStruct((B, T), jnp.int32),), name="linen-gpt2")


def linen_names(model) -> dict:
  return linen_apply.block_types(model, jax.random.key(0), jnp.ones((B, T), jnp.int32))


# ------------------------------------------------------------------------------------------------------- listing


@pytest.mark.remat3
def test_custom_layers_get_names_nnx_and_linen():
  """The default rule names the Conv1D outputs (they hold a weight); not norms (custom or Flax), dropout, or
  modules that only hold submodules (attn, mlp)."""
  model = nnx_gpt2()
  assert jaxckpt.block_types(model) == {"block": GPT2_NAMES}
  assert jaxckpt.nnx.checkpoint_names(model, jnp.ones((B, T), jnp.int32)) == {"block": GPT2_NAMES}  # traced: the same
  assert linen_names(linen_gpt2()) == {"block": GPT2_NAMES}


@pytest.mark.parametrize("target", ["nnx_target", "linen_gpt2_target"])
def test_list_blocks_shows_the_custom_layer_names(target, capsys):
  assert report_main(["--target", f"tests.core.test_autonames:{target}", "--list-blocks"]) == 0
  assert capsys.readouterr().out.strip() == "block: " + ", ".join(sorted(GPT2_NAMES))


def test_names_argument_classes_predicate_all_and_none():
  is_mlp = lambda path, module: path[0] == "mlp"  # noqa: E731
  assert jaxckpt.block_types(nnx_gpt2(names=(LayerNorm, nnx.LayerNorm))) == {"block": frozenset({"ln_1", "ln_2"})}
  assert jaxckpt.block_types(nnx_gpt2(names=is_mlp)) == {"block": frozenset({"mlp", "mlp.c_fc", "mlp.c_proj"})}
  assert jaxckpt.block_types(nnx_gpt2(names=())) == {"block": frozenset()}
  everything = {"ln_1", "attn", "attn.resid_dropout", "ln_2", "mlp"} | GPT2_NAMES
  assert jaxckpt.block_types(nnx_gpt2(names="all")) == {"block": frozenset(everything)}
  assert linen_names(linen_gpt2(names=(nn.LayerNorm,))) == {"block": frozenset({"ln_1", "ln_2"})}
  assert linen_names(linen_gpt2(names=is_mlp)) == {"block": frozenset({"mlp", "mlp.c_fc", "mlp.c_proj"})}
  assert linen_names(linen_gpt2(names=())) == {"block": frozenset()}
  assert linen_names(linen_gpt2(names="all")) == {"block": frozenset(everything)}
  # re-applying replaces the rule; a name the blocks no longer emit is refused by set_policy
  model = nnx_gpt2(names=is_mlp)
  jaxckpt.apply_remat(model, "none", blocks={"block": Block})
  assert jaxckpt.block_types(model) == {"block": GPT2_NAMES}
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="ln_1"):
    jaxckpt.set_policy(model, "save_only_these_names:ln_1")


def test_no_names_still_says_so(capsys):
  assert report_main(["--target", "tests.core.test_autonames:nnx_target_without_names", "--list-blocks"]) == 0
  assert capsys.readouterr().out.strip() == "block: (no checkpoint names)"


def nnx_target_without_names():
  return ModelTarget(make_model=lambda: nnx_gpt2(names=()), batch={"tokens": TOKENS}, loss_fn=gpt2_loss)


@pytest.mark.parametrize("front_end", ["nnx", "linen"])
@pytest.mark.parametrize("bad, message", [
    ("every", "names='every' is not a names rule: give 'auto' (default), 'all', "),
    ([Conv1D], "names=[Conv1D] is a list: "),
    ((Conv1D, 3), "names=(Conv1D, 3) holds 3, which is not a class: "),
    (int, "names=int is not {article} {front} module class: "),
    (lambda module: True, "names=<lambda> cannot take (path, module): "),
    (3, "names=3 is not a names rule: "),
])
def test_bad_names_are_one_line(front_end, bad, message):
  if front_end == "linen" and isinstance(bad, (list, tuple)):
    bad = type(bad)(LinenConv1D if v is Conv1D else v for v in bad)
    message = message.replace("Conv1D", "LinenConv1D")
  message = message.format(article="an" if front_end == "nnx" else "a", front="NNX" if front_end == "nnx" else "Linen")
  with pytest.raises(JaxckptError, match=re.escape(message)) as err:
    nnx_gpt2(names=bad) if front_end == "nnx" else linen_gpt2(names=bad)
  one_line(err)
  assert str(err.value).endswith("a tuple of them, or a predicate (path, module) -> bool") or "a list" in message


def test_a_class_of_the_other_front_end_names_the_fix():
  with pytest.raises(JaxckptError, match="names=LinenConv1D is a Flax Linen module class, and this model is NNX") as e:
    nnx_gpt2(names=LinenConv1D)
  one_line(e)
  with pytest.raises(JaxckptError, match=r"names=\(Conv1D,\) holds Conv1D, which is a Flax NNX module class") as e:
    linen_gpt2(names=(Conv1D,))
  one_line(e)


# --------------------------------------------------------------------------------------- parameters, gradients


def test_parameter_tree_and_classes_unchanged_split_merge_eval_shape():
  plain, model = GPT2(rngs=nnx.Rngs(0)), nnx_gpt2("save_only_these_names:mlp.c_fc")
  assert jax.tree.map(jnp.shape, nnx.state(plain)) == jax.tree.map(jnp.shape, nnx.state(model))
  tokens = jnp.ones((B, T), jnp.int32)
  model.eval()  # dropout off: two calls give the same output
  out = model(tokens)
  assert type(model.h[0].mlp.c_fc) is Conv1D and type(model.h[1].ln_2) is nnx.LayerNorm  # only copies are swapped
  graphdef, state = nnx.split(model)
  # exact: split and merge move no number, the same program runs on the same arrays
  np.testing.assert_array_equal(nnx.merge(graphdef, state)(tokens), out)
  abstract = nnx.eval_shape(lambda: nnx_gpt2("save_only_these_names:mlp.c_fc"))
  assert jaxckpt.block_types(abstract) == {"block": GPT2_NAMES}
  variables = linen_gpt2().init(jax.random.key(0), tokens)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, LinenGPT2().init(jax.random.key(0), tokens))


@pytest.mark.remat3
@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_gradients_equal_no_remat():
  batch = {"tokens": jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)}
  grads = {}
  for policy in ("none", "save_only_these_names:attn.c_attn+mlp.c_fc"):
    grads[policy] = jax.tree.leaves(nnx.grad(gpt2_loss)(nnx_gpt2(policy), batch))
  policy = "save_only_these_names:attn.c_attn+mlp.c_fc"
  assert_trees_close(grads[policy], grads["none"], depth=LAYERS, what=f"NNX GPT-2 gradients, {policy} vs none")
  params = LinenGPT2().init(jax.random.key(0), batch["tokens"][:, :-1])["params"]
  linen = {}
  for policy in ("none", "save_only_these_names:attn.c_attn+mlp.c_fc"):
    model = linen_gpt2(policy)
    apply_fn = lambda p, *a, **k: model.apply({"params": p}, *a, rngs={"dropout": jax.random.key(2)}, **k)  # noqa
    linen[policy] = jax.tree.leaves(jax.grad(lambda p: linen_loss(apply_fn, p, batch))(params))
  assert_trees_close(linen[policy], linen["none"], depth=LAYERS, what=f"Linen GPT-2 gradients, {policy} vs none")


# ---------------------------------------------------------------------------------------------- compiled memory

POLICIES = ["none", "nothing_saveable", "save_only_these_names:attn.c_attn"]
BIG_TOKENS = jax.ShapeDtypeStruct((32, 33), jnp.int32)  # activations dominate the temp


@pytest.mark.remat3
@pytest.mark.parametrize("front_end", ["nnx", "linen"])
def test_a_custom_layer_name_policy_compiles_between_none_and_nothing(front_end):
  """jaxckpt's compile path (the report's train step, with the CPU remat option): saving the attention's Conv1D
  output takes more temp than saving nothing and less than no remat (measured: NNX 6.53 < 6.92 < 11.19 MB).

  Not ``mlp.c_fc``: saving it compiles to *less* temp than ``nothing_saveable`` here (the backward pass then does
  not rebuild the whole block at once), so it cannot show the order."""
  if front_end == "nnx":
    target = ModelTarget(make_model=nnx_gpt2, batch={"tokens": BIG_TOKENS}, loss_fn=gpt2_loss)
  else:
    target = linen_target(linen_gpt2(), batch={"tokens": BIG_TOKENS}, loss_fn=linen_loss,
                          init_args=(jax.ShapeDtypeStruct((32, 32), jnp.int32),))
  remat3 = remat_implementation() == "remat3"
  report = build_report(target, POLICIES, progress=False, residuals=remat3)  # residuals: for the no-effect check
  rows = {row["policy"]: row for row in report.rows}
  assert all(row["status"] == "ok" for row in rows.values()), rows
  temp = {p: rows[p]["temp_bytes"] for p in POLICIES}
  if remat3:  # no barrier XLA:CPU honours around unrolled blocks (docs/policies.md)
    assert rows["nothing_saveable"]["warning"].startswith("no compiled effect"), rows["nothing_saveable"]
    return
  assert temp["nothing_saveable"] < temp["save_only_these_names:attn.c_attn"] < temp["none"], temp


# ---------------------------------------------------------------------------------------------- stacked blocks


class ScannedGPT2(nnx.Module):
  """The same blocks stacked with ``nnx.vmap`` (parameters ``[LAYERS, ...]``) and applied with ``nnx.scan``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.wte = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(D, 4, rngs=rngs)

    self.h = create(rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.wte.attend(body(self.wte(tokens), self.h))


def test_stacked_blocks_name_the_same_layers():
  """In a stacked block every parameter has a layer axis: the custom norm's ``[L, D]`` scale is still no weight, and
  the names listed without tracing are those the scan body emits."""
  model = jaxckpt.apply_remat(ScannedGPT2(rngs=nnx.Rngs(0)), "none", blocks={"block": Block})
  assert jaxckpt.block_types(model) == {"block": GPT2_NAMES}
  assert jaxckpt.nnx.checkpoint_names(model, jnp.ones((B, T), jnp.int32)) == {"block": GPT2_NAMES}


@pytest.mark.parametrize("shapes, stacked", [
    ([(2, 32, 96), (2, 96), (2, 32)], 1),            # stacked: one leading size, not elsewhere
    ([(2, 2, 32), (2, 32), (2,)], 1),                 # the size is elsewhere, but a stacked RNG counter settles it
    ([(32, 32), (32, 32), (32,)], 0),                 # square weights and a bias: 32 appears elsewhere
    ([(32, 128), (128, 32)], 0),                      # different leading sizes
    ([(2, 32), ()], 0),                               # a scalar: not stacked
    ([(32, 128)], 0),                                 # one variable: never taken as stacked
])
def test_layer_axes(shapes, stacked):
  from jaxckpt.core._autonames import layer_axes
  counter = lambda s: s == (2,)  # noqa: E731 - the (2,) entry is an RNG counter (uint32)
  variables = [jax.ShapeDtypeStruct(s, jnp.uint32 if counter(s) else jnp.float32) for s in shapes]
  assert layer_axes(variables) == stacked


# ---------------------------------------------------------------------------------- names below one scope (parts)
# Issue 33: a GeGLU MLP that keeps its gate and up projections in one scope (one einsum each on one (2, d, f)
# parameter) gets `mlp.0` (gate) and `mlp.1` (up); its down projection is the layer's output, named `mlp`.

GATED_F = 48


class NNXFeedForward(nnx.Module):
  """GeGLU written as public Gemma code writes it: gate and up in one stacked parameter, one einsum each."""

  def __init__(self, d: int, f: int, *, rngs: nnx.Rngs):
    self.gating_einsum = nnx.Param(jax.random.normal(rngs.params(), (2, d, f)) * 0.1)
    self.linear = nnx.Param(jax.random.normal(rngs.params(), (f, d)) * 0.1)

  def __call__(self, x):
    gate = jnp.einsum("btd,df->btf", x, self.gating_einsum[0])
    up = jnp.einsum("btd,df->btf", x, self.gating_einsum[1])
    return jnp.einsum("btf,fd->btd", jax.nn.gelu(gate) * up, self.linear[...])


class NNXGatedBlock(nnx.Module):
  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.norm = LayerNorm(d)
    self.mlp = NNXFeedForward(d, GATED_F, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


class NNXGatedLM(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([NNXGatedBlock(D, rngs=rngs) for _ in range(LAYERS)])

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(x)


def _next_token(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.fixture(scope="module")
def gemma():
  """The issue's Gemma-style Linen LM (tests/gemma_lm.py): model, params, loss and its no-remat gradients."""
  tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, 256)
  params = jax.jit(GemmaLM().init)(jax.random.key(0), tokens[:, :-1])["params"]
  model = jaxckpt.linen.apply_remat(GemmaLM(), "none", blocks={"block": GemmaBlock})

  def loss(applied, p):
    return _next_token(applied.apply({"params": p}, tokens[:, :-1]), tokens)

  return model, params, loss


def nnx_gated(policy="none"):
  model = NNXGatedLM(rngs=nnx.Rngs(0))
  jaxckpt.apply_remat(model, "none", blocks={"block": NNXGatedBlock})
  jaxckpt.nnx.checkpoint_names(model, jnp.ones((B, T), jnp.int32))  # traced: learns the parts
  jaxckpt.set_policy(model, policy)
  return model


PARTS = {"mlp.0", "mlp.1"}


def test_a_name_over_several_projections_lists_its_parts(gemma, capsys):
  model = gemma[0]
  listed = jaxckpt.linen.block_types(model, jax.random.key(0), jax.ShapeDtypeStruct((4, 64), jnp.int32))
  assert listed == {"block": frozenset({"attn", "attn.q_proj", "attn.o_proj", "mlp"} | PARTS)}  # attn: one
  fresh = NNXGatedLM(rngs=nnx.Rngs(0))
  jaxckpt.apply_remat(fresh, "none", blocks={"block": NNXGatedBlock})
  assert jaxckpt.block_types(fresh) == {"block": frozenset({"mlp"})}  # NNX without a trace: the layers only
  assert jaxckpt.nnx.checkpoint_names(fresh, jnp.ones((B, T), jnp.int32)) == {"block": frozenset({"mlp"} | PARTS)}
  assert jaxckpt.block_types(fresh) == {"block": frozenset({"mlp"} | PARTS)}  # learned: set_policy takes them
  assert report_main(["--target", "tests.gemma_lm:gemma_target", "--list-blocks"]) == 0
  assert capsys.readouterr().out.strip() == "block: attn, attn.o_proj, attn.q_proj, mlp, mlp.0, mlp.1"


def _saved(loss, params):
  residuals = saved_residuals(loss, params)
  return (sum(r.bytes for r in residuals if r.kind != "argument"),
          {r.name: r.shape for r in residuals if r.name is not None})


GATED_POLICIES = ("nothing_saveable", "save_only_these_names:mlp.0", "save_only_these_names:mlp.1",
                  "save_only_these_names:mlp.0+mlp.1")


def _same_gradients(grad_of, policies, *, depth: int):
  """Gradients (jitted) under each policy equal those without remat (tests/numerics.py; ``depth``: the layers)."""
  reference = jax.tree.leaves(grad_of("none"))
  for policy in policies:
    assert_trees_close(jax.tree.leaves(grad_of(policy)), reference, depth=depth, what=f"gradients, {policy} vs none")


def test_each_part_is_saved_by_name_linen(gemma):
  """Saving a part saves its [B, T, F] per layer: more than nothing, less than both; gradients equal no remat."""
  model, params, loss = gemma
  saved = {p: _saved(lambda q, m=model.with_policy(p): loss(m, q), params) for p in GATED_POLICIES}
  _same_gradients(lambda p: jax.jit(jax.grad(lambda q: loss(model.with_policy(p), q)))(params),
                  [GATED_POLICIES[-1]], depth=GemmaConfig().num_layers)
  part = 4 * 64 * 384 * 4 * 4  # B · T · F float32, 4 layers
  nothing, gate, up, both = (saved[p][0] for p in GATED_POLICIES)
  assert gate - nothing == up - nothing == part and both - nothing == 2 * part
  assert saved[GATED_POLICIES[1]][1] == {"mlp.0": (4, 64, 384)} and set(saved[GATED_POLICIES[3]][1]) == PARTS


def test_each_part_is_saved_by_name_nnx():
  tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)

  def loss_of(policy):
    graphdef, params, rest = nnx.split(nnx_gated(policy), nnx.Param, ...)
    return (lambda p: _next_token(nnx.merge(graphdef, p, rest)(tokens[:, :-1]), tokens)), params

  saved = {p: _saved(*loss_of(p)) for p in GATED_POLICIES}
  _same_gradients(lambda p: jax.jit(jax.grad(loss_of(p)[0]))(loss_of(p)[1]), [GATED_POLICIES[-1]], depth=LAYERS)
  part = B * T * GATED_F * 4 * LAYERS
  nothing, gate, up, both = (saved[p][0] for p in GATED_POLICIES)
  assert gate - nothing == up - nothing == part and both - nothing == 2 * part
  assert saved[GATED_POLICIES[2]][1] == {"mlp.1": (B, T, GATED_F)}


def test_a_part_that_is_not_there_is_one_line(gemma):
  model, params, loss = gemma
  for name, fix in (("mlp.2", "its parts are mlp.0, mlp.1"), ("attn.0", "no parts (fewer than two projections)")):
    with pytest.raises(jaxckpt.errors.PolicySpecError, match=re.escape(fix)) as err:
      loss(model.with_policy(f"save_only_these_names:{name}"), params)
    one_line(err)
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="'mlp.2'.*never emitted") as err:
    jaxckpt.set_policy(nnx_gated(), "save_only_these_names:mlp.2")
  one_line(err)


def nnx_gated_target():
  """``--target tests.core.test_autonames:nnx_gated_target``: the NNX GeGLU LM as a ModelTarget."""
  def make():
    return jaxckpt.apply_remat(NNXGatedLM(rngs=nnx.Rngs(0)), "none", blocks={"block": NNXGatedBlock})

  def loss_fn(model, batch, *, dropout_key=None, deterministic=True):
    return _next_token(model(batch["tokens"][:, :-1]), batch["tokens"]), {}

  return ModelTarget(make_model=make, batch={"tokens": TOKENS}, loss_fn=loss_fn)


def test_a_target_lists_and_saves_parts(capsys):
  """A target's listing traces the parts, and its train step takes a policy naming them (the abstract model the
  step is built on learns the traced names); the report's residual analysis shows them saved."""
  from jaxckpt.report._residuals import analyse_residuals
  from jaxckpt.step import default_optimizer, policy_step

  assert report_main(["--target", "tests.core.test_autonames:nnx_gated_target", "--list-blocks"]) == 0
  assert capsys.readouterr().out.strip() == "block: mlp, mlp.0, mlp.1"
  step = policy_step(nnx_gated_target(), jaxckpt.parse_policy("save_only_these_names:mlp.0+mlp.1"),
                     default_optimizer())
  groups = {g["key"]: g for g in analyse_residuals(step)["groups"] if g["by"] == "name"}
  assert set(groups) == PARTS and groups["mlp.0"]["count"] == LAYERS
  assert groups["mlp.0"]["bytes"] == B * T * GATED_F * 4 * LAYERS
