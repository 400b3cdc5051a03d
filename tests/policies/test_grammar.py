"""The policy grammar: every name parses to the right JAX policy, errors name the bad part and suggest a fix."""

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt.errors import PolicySpecError
from jaxckpt import parse_policy
from jaxckpt.policies import ALIASES, CANONICAL_POLICIES, POLICY_NAMES, REGISTRY
from jaxckpt import Policy, PolicySpec
from jaxckpt.policies._spec import refused
from jaxckpt.policies._meaning import PROMISES, broken_policies, check_policy_meaning, saved_kinds
from jaxckpt._remat_impl import remat_implementation

# Run again under JAX's next remat (.ci/run's remat3 leg): what each policy means and refuses.
pytestmark = pytest.mark.remat3

OFFLOAD = ("save_and_offload_only_these_names", "offload_dot_with_no_batch_dims")

NAMED_ARGS = {"names": "qkv+mlp_hidden", "save/offload": "qkv/mlp_hidden"}


def spec_for(name: str) -> str:
  arity = REGISTRY[name].arity
  return name if arity == "none" else f"{name}:{NAMED_ARGS[arity]}"


def test_registry_covers_every_jax_policy():
  members = {n for n in dir(jax.checkpoint_policies) if not n.startswith("_")}
  combinators = {"save_from_both_policies"}
  assert members - combinators <= set(CANONICAL_POLICIES) | set(ALIASES)


@pytest.mark.parametrize("name", CANONICAL_POLICIES)
def test_each_canonical_policy_parses_and_builds(name):
  if (why := refused(name)) is not None:  # the installed JAX does not do what the name says: one line, no build
    with pytest.raises(PolicySpecError, match=f"policy '{name}' is refused: jax .* use "):
      parse_policy(spec_for(name))
    assert "\n" not in why
    return
  if remat_implementation() == "remat3" and (name in OFFLOAD or (REGISTRY[name].preset is not None and parse_policy(
      spec_for(name)).offloads)):  # MaxText's offloading presets build the same callable
    with pytest.raises(PolicySpecError, match="callable policy.*JAX_REMAT3"):  # remat3 would ignore it silently
      parse_policy(spec_for(name)).default.to_jax()
    return
  spec = parse_policy(spec_for(name))
  policy = spec.default
  assert policy.name == name
  assert str(parse_policy(str(spec))) == str(spec)
  built = policy.to_jax()
  assert (built is None) == (name == "none")
  if built is not None:
    assert callable(built)


@pytest.mark.parametrize("alias,canonical", sorted(ALIASES.items()))
def test_aliases_normalise(alias, canonical):
  arity = REGISTRY[canonical].arity
  text = alias if arity == "none" else f"{alias}:{NAMED_ARGS[arity]}"
  assert parse_policy(text).default.name == canonical


def test_alias_builds_the_same_jax_policy():
  assert parse_policy("checkpoint_dots").default.to_jax() is jax.checkpoint_policies.dots_saveable
  assert parse_policy("full").default.to_jax() is jax.checkpoint_policies.nothing_saveable


def test_names_and_offload_lists():
  p = parse_policy("save_and_offload_only_these_names:qkv+attn_out/mlp_hidden").default
  assert p.names == ("qkv", "attn_out") and p.offload_names == ("mlp_hidden",)
  p = parse_policy("save_and_offload_only_these_names:/mlp_hidden").default
  assert p.names == () and p.offload_names == ("mlp_hidden",)
  assert parse_policy(" save_only_these_names : qkv + attn_out ").default.names == ("qkv", "attn_out")


def test_block_map_and_default():
  spec = parse_policy("attn=dots_saveable,mlp=full,default=save_only_these_names:conv_out")
  assert spec.for_block("attn") == Policy("dots_saveable")
  assert spec.for_block("mlp") == Policy("nothing_saveable")
  assert spec.for_block("conv") == Policy("save_only_these_names", ("conv_out",))
  assert parse_policy("attn=full").for_block("mlp") == Policy("none")  # default default is none
  assert parse_policy("attn=full").remat and not parse_policy("none").remat
  assert parse_policy(str(spec)) == spec


def test_single_policy_applies_to_every_block():
  spec = parse_policy("dots_saveable")
  assert spec.for_block("attn") == spec.for_block("anything") == Policy("dots_saveable")


def test_passthrough_types():
  spec = parse_policy("full")
  assert parse_policy(spec) is spec
  assert parse_policy(Policy("dots_saveable")) == PolicySpec(default=Policy("dots_saveable"))
  assert parse_policy(None) == PolicySpec()


@pytest.mark.parametrize(
    "text,bad,suggestion",
    [
        ("dots_savable", "dots_savable", "dots_saveable"),
        ("nothing_savable", "nothing_savable", "nothing_saveable"),
        ("attn=dots_savable", "dots_savable", "dots_saveable"),
        ("save_only_these_name:qkv", "save_only_these_name", "save_only_these_names"),
    ],
)
def test_unknown_policy_suggests_closest(text, bad, suggestion):
  with pytest.raises(PolicySpecError) as info:
    parse_policy(text)
  err = info.value
  assert err.bad == bad and err.suggestion == suggestion
  message = str(err)
  assert bad in message and f"did you mean {suggestion!r}" in message
  assert "nothing_saveable" in message and "dots_saveable" in message  # lists the valid ones
  assert "\n" not in message


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "empty policy spec"),
        ("   ", "empty policy spec"),
        ("dots_saveable:qkv", "takes no arguments"),
        ("save_only_these_names", "needs at least one checkpoint name"),
        ("save_only_these_names:", "needs at least one checkpoint name"),
        ("save_only_these_names:a/b", "one '+'-joined list"),
        ("save_only_these_names:qkv+", "malformed checkpoint name"),
        ("save_only_these_names:q kv", "malformed checkpoint name"),
        ("save_only_these_names:qkv+qkv", "given twice"),
        ("save_and_offload_only_these_names:qkv", "SAVE_NAMES/OFFLOAD_NAMES"),
        ("save_and_offload_only_these_names:a/b/c", "SAVE_NAMES/OFFLOAD_NAMES"),
        ("save_and_offload_only_these_names:/", "needs at least one checkpoint name"),
        ("save_and_offload_only_these_names:qkv/qkv", "both saved and offloaded"),
        ("dots_saveable,full", "without block types"),
        ("attn=full,mlp", "malformed entry"),
        ("=full", "malformed entry"),
        ("attn=full,attn=none", "given twice"),
        ("attn=", "empty policy name"),
        ("attn=full,,mlp=full", "malformed entry"),
    ],
)
def test_malformed_specs(text, fragment):
  with pytest.raises(PolicySpecError) as info:
    parse_policy(text)
  assert fragment in str(info.value)
  assert "\n" not in str(info.value)


def test_non_string_is_rejected():
  with pytest.raises(PolicySpecError, match="must be a string"):
    parse_policy(3)


VIT_TYPES = {"attn": {"qkv", "attn_weights", "attn_context", "attn_out"}, "mlp": {"mlp_hidden", "mlp_out"}}


def test_validate_accepts_model_names():
  parse_policy("attn=save_only_these_names:qkv,mlp=full").validate(VIT_TYPES)
  parse_policy("save_only_these_names:qkv+mlp_hidden").validate(VIT_TYPES)  # each name from some block


def test_validate_unknown_block_type():
  with pytest.raises(PolicySpecError) as info:
    parse_policy("atn=full").validate(VIT_TYPES)
  assert info.value.bad == "atn" and info.value.suggestion == "attn"
  assert "attn, default, mlp" in str(info.value)


def test_validate_name_never_emitted():
  with pytest.raises(PolicySpecError) as info:
    parse_policy("save_only_these_names:qvk").validate(VIT_TYPES)
  assert info.value.suggestion == "qkv" and "would save nothing" in str(info.value)
  # A name emitted by another block than the one the policy is for is an error too.
  with pytest.raises(PolicySpecError, match="mlp_hidden"):
    parse_policy("attn=save_only_these_names:mlp_hidden").validate(VIT_TYPES)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("adefhilmnopstuvy_:+/=,. ") + ["dots", "save", "names", "full"]), max_size=20).map("".join))
def test_fuzz_parser_raises_only_its_error(text):
  try:
    spec = parse_policy(text)
  except PolicySpecError:
    return
  assert parse_policy(str(spec)) == spec


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(POLICY_NAMES), st.integers(0, 30), st.sampled_from(["", "x", "_", "s"]))
def test_fuzz_near_miss_names(name, cut, extra):
  text = name[:cut] + extra + name[cut + 1:]
  try:
    parse_policy(text)
  except PolicySpecError as err:
    assert err.bad  # names the bad part


# --- Policies mean what their names say, in the installed JAX (jaxckpt.policies._meaning) ---------------------------


def test_policy_meaning_check_covers_every_jax_policy_jaxckpt_exposes():
  exposed = {n for n in CANONICAL_POLICIES if n not in ("none", "save_tensors") and REGISTRY[n].preset is None}
  # MaxText's presets are save_only/save_and_offload: tests/policies/test_maxtext_presets.py
  assert exposed == set(PROMISES)


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_each_jax_policy_saves_what_its_name_says_or_is_refused(name):
  if remat_implementation() == "remat3" and name in (*OFFLOAD, "everything_saveable",
                                                     "save_anything_except_these_names"):
    pytest.skip("remat3: callables are refused; everything_saveable keeps only checkpoint-named values (README)")
  problem = check_policy_meaning(name)
  if problem is None:
    return
  assert name in broken_policies()
  canonical_spec = spec_for(name)
  with pytest.raises(PolicySpecError, match=f"policy '{name}' is refused: jax {jax.__version__}"):
    parse_policy(canonical_spec)


def test_the_check_can_fail_and_tells_policies_apart():
  cp = jax.checkpoint_policies
  assert saved_kinds(cp.nothing_saveable) == frozenset()
  assert saved_kinds(cp.dots_saveable) == {"dot", "batch_dot"}
  assert saved_kinds(cp.dots_with_no_batch_dims_saveable) == {"dot"}
  assert saved_kinds(cp.save_only_these_names("a")) == {"named_a"}
  assert saved_kinds(cp.save_any_names_but_these("a")) == {"named_b"}
  if remat_implementation() == "remat2":
    assert saved_kinds(cp.everything_saveable) == saved_kinds("none") == {"named_a", "named_b", "other"}
    # jax 0.10.2's save_anything_except_these_names body is `lambda *_, **__: True`: it keeps the excluded name.
    broken = saved_kinds(cp.save_anything_except_these_names("a")) != PROMISES["save_anything_except_these_names"]
    assert broken == ("save_anything_except_these_names" in broken_policies())


def test_save_any_names_but_these_is_its_own_policy():
  policy = parse_policy("save_any_names_but_these:qkv").default
  assert policy.name == "save_any_names_but_these"
  assert policy.to_jax() == jax.checkpoint_policies.save_any_names_but_these("qkv")


def test_comma_between_a_policys_names_points_to_plus():
  with pytest.raises(PolicySpecError, match=r"joined by '\+', not ','.*save_only_these_names:qkv\+mlp_out"):
    parse_policy("save_only_these_names:qkv,mlp_out")
