"""The public face: about 40 top-level names, each public name on exactly one face, old paths that still work (with a
warning naming the new one), and the same verbs meaning the same thing on NNX and Linen models."""

from __future__ import annotations

import importlib
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt import _deprecations
from jaxckpt.errors import JaxckptError


def _faces():
  return {face: importlib.import_module(face) for face in _deprecations.PUBLIC_FACES}


def test_the_top_level_face_is_small_and_every_name_exists():
  assert len(jaxckpt.__all__) <= 45, len(jaxckpt.__all__)
  assert len(set(jaxckpt.__all__)) == len(jaxckpt.__all__)
  for face, module in _faces().items():
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing, (face, missing)


def test_each_public_function_and_class_is_on_exactly_one_face():
  homes: dict[int, list[str]] = {}
  for face, module in _faces().items():
    for name in getattr(module, "__all__", ()):
      value = getattr(module, name)
      if inspect.isfunction(value) or inspect.isclass(value):
        homes.setdefault(id(value), []).append(f"{face}.{name}")
  twice = [paths for paths in homes.values() if len(paths) > 1]
  assert not twice, twice


def test_every_public_function_and_class_has_a_docstring():
  bare = [f"{face}.{name}" for face, module in _faces().items() for name in getattr(module, "__all__", ())
          if (inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name)))
          and not (getattr(module, name).__doc__ or "").strip()]
  assert not bare, bare


@pytest.mark.parametrize("old, new", [
    ("jaxckpt." + "Stack", "jaxckpt.nnx.Stack"), ("jaxckpt." + "GPT", "jaxckpt.models.GPT"),
    ("jaxckpt." + "PolicySpecError", "jaxckpt.errors.PolicySpecError"),
    ("jaxckpt." + "make_mesh", "jaxckpt.sharding.make_mesh"),
    ("jaxckpt." + "classification_loss", "jaxckpt.models.classification_loss"),
    ("jaxckpt.policies." + "PolicySpec", "jaxckpt.PolicySpec"),
    ("jaxckpt.report." + "shipped_target", "jaxckpt.step.shipped_target"),
    ("jaxckpt.step." + "linen_model_target", "jaxckpt.linen_model_target"),
])  # (old paths written in two parts, so that no search-and-replace of old paths rewrites them)
def test_names_that_left_a_face_still_work_and_warn_where_they_went(old, new):
  face, _, name = old.rpartition(".")
  with pytest.warns(DeprecationWarning, match=f"{old} moved: use {new}"):
    value = getattr(importlib.import_module(face), name)
  new_face, _, new_name = new.rpartition(".")
  assert value is getattr(importlib.import_module(new_face), new_name)


def test_an_old_module_path_warns_with_the_public_path():
  with pytest.warns(DeprecationWarning, match=r"jaxckpt.nnx.layers is not a public module any more .*: use "
                                              r"jaxckpt.nnx.Stack"):
    from jaxckpt.nnx.layers import Stack  # noqa: F401
  with pytest.warns(DeprecationWarning, match="use jaxckpt.planner.plan_policy"):
    assert jaxckpt.planner.plan.plan_policy is jaxckpt.planner.plan_policy


def test_an_unknown_name_is_an_attribute_error_naming_it():
  with pytest.raises(AttributeError, match="module 'jaxckpt' has no attribute 'no_such_thing'"):
    jaxckpt.no_such_thing  # noqa: B018


class _Block(nnx.Module):
  def __init__(self, d, *, rngs):
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):  # x: [B, D] float32
    return x + self.down(jnp.tanh(self.up(x)))


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):  # x: [B, D] float32
    return x + nn.Dense(x.shape[-1], name="down")(jnp.tanh(nn.Dense(2 * x.shape[-1], name="up")(x)))


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = _LinenBlock(name=f"block_{i}")(x)
    return x


def _nnx_model():
  return jaxckpt.apply_remat(nnx.Sequential(*[_Block(8, rngs=nnx.Rngs(i)) for i in range(2)]), "none",
                             blocks={"block": _Block})


@pytest.mark.remat3
def test_the_verbs_mean_the_same_on_nnx_and_linen():
  model = _nnx_model()
  linen = jaxckpt.apply_remat(_LinenModel(), "none", blocks={"block": _LinenBlock})
  assert isinstance(linen, jaxckpt.linen.RematModule)
  x = jnp.ones((2, 8))
  assert jaxckpt.block_types(model) == {"block": frozenset({"up", "down"})}
  assert jaxckpt.block_types(linen, jax.random.key(0), x) == {"block": frozenset({"up", "down"})}
  # with_policy: a copy on both; the original keeps its policy
  copy = jaxckpt.with_policy(model, "nothing_saveable")
  linen_copy = jaxckpt.with_policy(linen, "nothing_saveable")
  assert str(linen.spec) == "none" and str(linen_copy.spec) == "nothing_saveable"
  before = [str(p) for p in _applied_policies(model)]
  assert before == ["none"] * 2 and [str(p) for p in _applied_policies(copy)] == ["nothing_saveable"] * 2
  # the copy shares the arrays (nothing allocated) and computes the same
  assert model.layers[0].up.kernel.get_value() is copy.layers[0].up.kernel.get_value()
  np.testing.assert_array_equal(model(x), copy(x))  # exact: the same arrays through the same eager forward
  # set_policy: in place on NNX; Linen modules are immutable: one line naming with_policy
  jaxckpt.set_policy(model, "dots_saveable")
  assert [str(p) for p in _applied_policies(model)] == ["dots_saveable"] * 2
  with pytest.raises(JaxckptError, match=r"immutable.*jaxckpt.with_policy\(model, policy\)"):
    jaxckpt.set_policy(linen, "dots_saveable")
  with pytest.warns(DeprecationWarning, match="returns a copy .*with_policy"):
    assert str(linen.set_policy("dots_saveable").spec) == "dots_saveable"
  with pytest.raises(JaxckptError, match="takes a Flax model .*got int"):
    jaxckpt.with_policy(3, "none")


def _applied_policies(model):
  from jaxckpt.nnx._apply import applied_blocks
  return [getattr(block, "_jaxckpt_policy") for _, block in applied_blocks(model)]


def test_nnx_model_target_is_the_twin_of_linen_model_target():
  """Same loss names and refusals; the NNX target compiles, and nothing_saveable needs less temp than none."""
  from jaxckpt.step import compile_policy

  class LM(nnx.Module):
    def __init__(self, *, rngs):
      self.embed = nnx.Embed(32, 16, rngs=rngs)
      self.blocks = nnx.List([_Block(16, rngs=rngs) for _ in range(3)])

    def __call__(self, tokens):  # tokens: [B, T] int32 -> logits [B, T, 32]
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.embed.attend(x)

  tokens = jax.ShapeDtypeStruct((4, 17), jnp.int32)
  target = jaxckpt.nnx_model_target(lambda: LM(rngs=nnx.Rngs(0)), tokens, loss="next_token", blocks={"block": _Block})
  assert isinstance(target, jaxckpt.step.ModelTarget) and target.name == "LM"
  temps = {p: compile_policy(target, jaxckpt.parse_policy(p)).memory["temp_bytes"] for p in ("none", "nothing_saveable")}
  assert temps["nothing_saveable"] < temps["none"], temps
  with pytest.raises(JaxckptError, match=r"nnx_model_target\(loss='tokens'\): valid names are next_token, "
                                         r"classification"):
    jaxckpt.nnx_model_target(lambda: LM(rngs=nnx.Rngs(0)), tokens, loss="tokens")
  with pytest.raises(JaxckptError, match="Flax Linen module .*jaxckpt.linen_model_target"):
    jaxckpt.nnx_model_target(_LinenModel(), tokens, loss="next_token")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the public paths used here warn about nothing
    jaxckpt.nnx_model_target(LM(rngs=nnx.Rngs(0)), tokens, loss="next_token", blocks={"block": _Block})


def test_every_concrete_policy_speaks_the_one_protocol_and_model_level_ones_are_resolved_first():
  """Code below the policy boundary takes one type (jaxckpt.policies.ConcretePolicy); budgets, min_saved and mincut
  become one through jaxckpt.planner.resolve_policy's table."""
  from jaxckpt.planner._plan import _RESOLVERS
  from jaxckpt.policies import ConcretePolicy, LossPolicy

  concrete = [jaxckpt.parse_policy("attn=dots_saveable,mlp=full"), jaxckpt.parse_model_policy("0-1:full;2-3:none"),
              LossPolicy(lambda p, b, k: 0.0, "mincut:1MiB")]
  for policy in concrete:
    assert isinstance(policy, ConcretePolicy) and policy.resolved, policy
    assert policy.base_spec.layered is None and policy.segments_for(4)[0][0] >= 1
  assert [p.layered is not None for p in concrete] == [False, True, False]
  assert [p.scope for p in concrete] == ["blocks", "blocks", "loss"]
  for text in ("budget:40%", "min_saved", "mincut:25%"):
    parsed = jaxckpt.parse_model_policy(text)
    assert not parsed.resolved and type(parsed) in _RESOLVERS, text
