"""Remat policies by name: one grammar, one parser, one registry.

A JAX remat policy is a predicate ``(primitive, *avals, **params) -> bool`` that tells ``jax.checkpoint`` which
intermediate values it may save for the backward pass; everything else is recomputed (JAX docs, "Gradient
checkpointing with jax.checkpoint"). jaxckpt names every policy in ``jax.checkpoint_policies`` and lets a different
one apply to each block type of a model. Every CLI flag and API argument that takes a policy goes through
:func:`parse_policy`; nothing else interprets policy strings.

Grammar (EBNF)::

    spec      := block_map | policy
    block_map := block "=" policy ("," block "=" policy)*     # attn=dots_saveable,mlp=full,default=none
    policy    := name [":" args]
    args      := names | names "/" names                       # save_only_these_names:qkv+attn_out
    names     := [name ("+" name)*]                            # save_and_offload_only_these_names:qkv/mlp_hidden
    name      := (letter | "_") (letter | digit | "_" | "-" | ".")*

Whitespace around tokens is ignored. Policy names (:data:`POLICY_NAMES`):

- ``none``: no ``jax.checkpoint`` at all (every intermediate is kept, nothing is recomputed).
- ``full``: recompute everything; an alias of ``nothing_saveable``.
- Every member of ``jax.checkpoint_policies`` under its canonical name: ``nothing_saveable``,
  ``everything_saveable``, ``dots_saveable``, ``dots_with_no_batch_dims_saveable``, ``save_only_these_names:N+…``,
  ``save_anything_except_these_names:N+…``, ``save_and_offload_only_these_names:SAVE+…/OFFLOAD+…`` and
  ``offload_dot_with_no_batch_dims``. JAX's aliases (``checkpoint_dots``, ``checkpoint_dots_with_no_batch_dims``,
  ``save_any_names_but_these``) are accepted and normalised to the canonical name. Offloading policies move the
  saved values from ``device`` to ``pinned_host`` memory.

In a block map each block type gets its own policy; ``default=`` covers the block types not named (else ``none``).
A single policy applies to every block type. Which block types a model has, and which checkpoint names each emits,
is declared by its layers (see :mod:`jaxckpt.nnx._layers`); :meth:`PolicySpec.validate` checks a spec against them.

Example::

  >>> spec = parse_policy("attn=dots_saveable,mlp=full")
  >>> spec.for_block("mlp")
  Policy(name='nothing_saveable', names=(), offload_names=())
  >>> str(spec)
  'attn=dots_saveable,mlp=nothing_saveable'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping
from typing import Literal

import jax

from jaxckpt.errors import PolicySpecError, shorten
from jaxckpt.policies._meaning import check_policy_meaning
from jaxckpt.policies._meaning import check_policy

DEFAULT_BLOCK = "default"
"""The block-map key whose policy covers every block type not named in the map."""
OFFLOAD_SRC = "device"
"""Memory kind offloading policies move saved values from."""
OFFLOAD_DST = "pinned_host"
"""Memory kind offloading policies move saved values to."""

SAVE_TENSORS = "save_tensors"
"""The per-tensor policy: ``save_tensors:t12_tanh+…`` saves the values with those automatic names
(:mod:`jaxckpt.core._tagging`); the remat wrappers tag them before ``jax.checkpoint``."""

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def is_name(text: str) -> bool:
  """Whether ``text`` is a valid block type or checkpoint name: a letter or ``_``, then letters, digits, ``_``,
  ``.``, ``-`` (e.g. ``attn``, ``mlp_hidden``, ``attn.q_einsum``)."""
  return bool(_NAME_RE.match(text))

Arity = Literal["none", "names", "save/offload"]


@dataclasses.dataclass(frozen=True)
class PolicyKind:
  """One entry of the policy registry.

  Attributes:
    name: canonical name, as in ``jax.checkpoint_policies`` (or ``none``).
    arity: the arguments it takes: ``"none"`` (no ``:args``), ``"names"`` (``:a+b``, at least one checkpoint name)
      or ``"save/offload"`` (``:save+names/offload+names``, at least one name in all).
    build: turns a parsed :class:`Policy` into the JAX predicate, or ``None`` for no remat.
    doc: one line for ``--help``.
  """

  name: str
  arity: Arity
  build: Callable[["Policy"], Callable[..., bool] | None]
  doc: str
  preset: "MaxTextPreset | None" = None


@dataclasses.dataclass(frozen=True)
class MaxTextPreset:
  """One of MaxText's ``remat_policy`` presets, as MaxText maps it to a JAX policy.

  Source: ``Decoder.get_remat_policy`` in MaxText's ``src/maxtext/layers/decoders.py`` (and ``nnx_decoders.py``;
  AI-Hypercomputer/maxtext at e591f30c, 2026-08-22): every "save" preset is
  ``jax.checkpoint_policies.save_only_these_names(*save)``, every offloading one
  ``save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=offload,
  offload_src="device", offload_dst="pinned_host")``; ``full`` is no policy (everything recomputed) and is jaxckpt's
  ``full`` already. The names are MaxText's checkpoint names (:data:`jaxckpt.names.DECODER_NAMES`); those in
  :data:`MAXTEXT_OTHER_ARCHITECTURES` belong to layers a Llama-style decoder does not have (fused QKV, shared KV
  projections, single-activation MLPs), so a model need not emit them for the preset to apply.

  Attributes:
    save: names saved on device.
    offload: names offloaded to host memory.
  """

  save: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()

  @property
  def required(self) -> frozenset[str]:
    """The names a model must emit for the preset to mean what MaxText means by it."""
    return frozenset(self.save + self.offload) - frozenset(MAXTEXT_OTHER_ARCHITECTURES)


_S = ("query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj")  # MaxText's list of attention projections
_MLP = ("mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
MAXTEXT_OTHER_ARCHITECTURES: tuple[str, ...] = ("kv_proj", "qkv_proj", "mlpwi")
"""Names in MaxText's presets that only other architectures emit: ``kv_proj`` (compressed/shared KV attention),
``qkv_proj`` (``fused_qkv``), ``mlpwi`` (a single-activation or fused MLP)."""

MAXTEXT_MOE_TWINS: dict[str, str] = {"mlpwi_0": "moe_mlpwi_0", "mlpwi_1": "moe_mlpwi_1", "mlpwo": "moe_mlpwo"}
"""A dense MLP name -> the MoE knob's name of the same expert matmul (:data:`jaxckpt.names.MOE_NAMES`). MaxText tags
each expert matmul with both, except its dropless path's up projection, tagged ``moe_mlpwi_1`` only
(``layers/moe.py`` at e591f30c): a preset naming ``mlpwi_1`` applies to such a block (and saves nothing there, as in
MaxText)."""

MAXTEXT_PRESETS: dict[str, MaxTextPreset] = {
    "minimal_with_context": MaxTextPreset(save=(*_S, "out_proj", *_MLP, "context")),
    "minimal": MaxTextPreset(save=(*_S, "out_proj", *_MLP)),
    "save_dot_with_context_except_mlp": MaxTextPreset(save=(*_S, "context", "out_proj")),
    "save_dot_except_mlpwi": MaxTextPreset(save=(*_S, "out_proj", "mlpwo")),
    "save_dot_except_mlp": MaxTextPreset(save=(*_S, "out_proj")),
    "save_qkv_proj": MaxTextPreset(save=_S),
    "qkv_proj_offloaded": MaxTextPreset(offload=("query_proj", "value_proj", "key_proj", "kv_proj")),
    "minimal_offloaded": MaxTextPreset(offload=(*_S, "out_proj", *_MLP)),
    "save_out_proj": MaxTextPreset(save=("out_proj",)),
}
"""MaxText's ``remat_policy`` presets (published-configs §4b), name -> names saved / offloaded. MaxText's ``full`` is
jaxckpt's ``full``; its ``custom`` is ``save_and_offload_only_these_names:SAVE/OFFLOAD``. Ordered as MaxText's
``base.yml`` orders them: fastest and largest first."""


def _preset_policy(preset: MaxTextPreset) -> Callable[..., bool]:
  if preset.offload:
    return _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(preset.save), names_which_can_be_offloaded=list(preset.offload),
        offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)
  return _cp.save_only_these_names(*preset.save)


_cp = jax.checkpoint_policies

REGISTRY: dict[str, PolicyKind] = {
    kind.name: kind
    for kind in [
        PolicyKind("none", "none", lambda p: None, "no remat: keep every intermediate, recompute nothing"),
        PolicyKind("nothing_saveable", "none", lambda p: _cp.nothing_saveable, "save nothing, recompute the block"),
        PolicyKind("everything_saveable", "none", lambda p: _cp.everything_saveable, "save every intermediate"),
        PolicyKind("dots_saveable", "none", lambda p: _cp.dots_saveable, "save outputs of matmuls (dot_general)"),
        PolicyKind(
            "dots_with_no_batch_dims_saveable",
            "none",
            lambda p: _cp.dots_with_no_batch_dims_saveable,
            "save outputs of matmuls without batch dimensions (weight matmuls, not attention)",
        ),
        PolicyKind(
            "save_only_these_names",
            "names",
            lambda p: _cp.save_only_these_names(*p.names),
            "save only the named checkpoints: save_only_these_names:qkv+mlp_hidden",
        ),
        PolicyKind(
            "save_tensors",
            "names",
            lambda p: _cp.save_only_these_names(*p.names),
            "save chosen intermediate values by automatic name (per-tensor plans of jaxckpt-plan): "
            "save_tensors:t12_tanh+t30_dot_general",
        ),
        PolicyKind(
            "save_anything_except_these_names",
            "names",
            lambda p: _cp.save_anything_except_these_names(*p.names),
            "save everything but the named checkpoints: save_anything_except_these_names:attn_weights",
        ),
        PolicyKind(
            "save_any_names_but_these",
            "names",
            lambda p: _cp.save_any_names_but_these(*p.names),
            "save the checkpoint-named values except these (nothing unnamed): save_any_names_but_these:attn_weights",
        ),
        PolicyKind(
            "save_and_offload_only_these_names",
            "save/offload",
            lambda p: _cp.save_and_offload_only_these_names(
                names_which_can_be_saved=list(p.names),
                names_which_can_be_offloaded=list(p.offload_names),
                offload_src=OFFLOAD_SRC,
                offload_dst=OFFLOAD_DST,
            ),
            "save the first names on device, offload the second to host: save_and_offload_only_these_names:qkv/mlp_hidden",
        ),
        PolicyKind(
            "offload_dot_with_no_batch_dims",
            "none",
            lambda p: _cp.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST),
            "offload outputs of matmuls without batch dimensions to host memory",
        ),
        *(PolicyKind(name, "none", lambda p, preset=preset: _preset_policy(preset),
                     f"MaxText's remat_policy {name}: "
                     + "; ".join(part for part in (f"save {'+'.join(preset.save)}" if preset.save else "",
                                                   f"offload {'+'.join(preset.offload)}" if preset.offload else "")
                                 if part),
                     preset=preset)
          for name, preset in MAXTEXT_PRESETS.items()),
    ]
}
"""Canonical policy name -> :class:`PolicyKind`."""

ALIASES: dict[str, str] = {
    "full": "nothing_saveable",
    "checkpoint_dots": "dots_saveable",
    "checkpoint_dots_with_no_batch_dims": "dots_with_no_batch_dims_saveable",
    "minimal_flash": "minimal_with_context",
}
"""Accepted alias -> canonical name (``full`` is jaxckpt's; ``minimal_flash`` MaxText's deprecated name of
``minimal_with_context``; the others are JAX's)."""

_CHECKED: dict[str, str] = {
    "save_anything_except_these_names": "save_any_names_but_these:NAMES (keeps the other checkpoint-named values) or "
                                        "everything_saveable",
}
"""Policies whose meaning is checked on the installed JAX when parsed -> what to use instead if it fails."""


def refused(name: str) -> str | None:
  """Why the parser refuses canonical policy ``name`` in the installed JAX (its body does not do what its name says,
  :func:`jaxckpt.policies._meaning.check_policy_meaning`), with what to use instead; None when it is accepted."""
  if name not in _CHECKED:
    return None
  problem = check_policy_meaning(name)
  return None if problem is None else f"{problem}; use {_CHECKED[name]}"


POLICY_NAMES: tuple[str, ...] = tuple(sorted([*REGISTRY, *ALIASES]))
"""Every name the parser accepts."""
CANONICAL_POLICIES: tuple[str, ...] = tuple(REGISTRY)
"""Canonical names, each once (the test matrix)."""


@dataclasses.dataclass(frozen=True)
class Policy:
  """A parsed remat policy for one block type.

  Attributes:
    name: canonical policy name (a key of :data:`REGISTRY`).
    names: checkpoint names it saves (``save_only_these_names``, ``save_and_offload_only_these_names``) or refuses
      to save (``save_anything_except_these_names``); empty for the others.
    offload_names: checkpoint names offloaded to host (``save_and_offload_only_these_names`` only).
  """

  name: str
  names: tuple[str, ...] = ()
  offload_names: tuple[str, ...] = ()

  @property
  def remat(self) -> bool:
    """Whether this policy wraps the block in ``jax.checkpoint`` (every policy but ``none``)."""
    return self.name != "none"

  @property
  def preset(self) -> MaxTextPreset | None:
    """The MaxText preset this policy is (``minimal``, ``qkv_proj_offloaded``…), or ``None``."""
    return REGISTRY[self.name].preset

  @property
  def offloads(self) -> bool:
    """Whether the policy moves saved values to host memory (``pinned_host``)."""
    preset = self.preset
    return (self.name == "offload_dot_with_no_batch_dims" or bool(self.offload_names)
            or (preset is not None and bool(preset.offload)))

  @property
  def checkpoint_names(self) -> frozenset[str]:
    """Every checkpoint name the policy refers to and a model must emit (``save_tensors``' automatic names are not
    checkpoint names the blocks emit: :func:`jaxckpt.core._tagging.tag_values` adds them at trace time; a MaxText
    preset's are :attr:`MaxTextPreset.required`)."""
    if self.name == SAVE_TENSORS:
      return frozenset()
    if self.preset is not None:
      return self.preset.required
    return frozenset(self.names) | frozenset(self.offload_names)

  @property
  def saved_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(names saved on device, names offloaded to host)`` of a name-based policy (a MaxText preset's full lists)."""
    if self.preset is not None:
      return self.preset.save, self.preset.offload
    return self.names, self.offload_names

  def to_jax(self) -> Callable[..., bool] | None:
    """Returns the ``jax.checkpoint`` policy predicate, or ``None`` for ``none`` (no remat).

    Raises:
      PolicySpecError: under JAX's next remat (``JAX_REMAT3=1``), a policy JAX would build as a callable that remat3
        ignores (the offload policies): :func:`jaxckpt.policies._meaning.check_policy`.
    """
    return check_policy(REGISTRY[self.name].build(self), what=f"policy {str(self)!r}")

  def __str__(self) -> str:
    arity = REGISTRY[self.name].arity
    if arity == "names":
      return f"{self.name}:{'+'.join(self.names)}"
    if arity == "save/offload":
      return f"{self.name}:{'+'.join(self.names)}/{'+'.join(self.offload_names)}"
    return self.name


NO_REMAT = Policy("none")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
  """A parsed policy spec: one :class:`Policy` per block type, and a default for the rest.

  Attributes:
    default: policy of every block type not in ``blocks``.
    blocks: ``(block_type, policy)`` pairs, in the order given.
    text: the string it was parsed from (for error messages; not compared).
  """

  default: Policy = NO_REMAT
  blocks: tuple[tuple[str, Policy], ...] = ()
  text: str = dataclasses.field(default="", compare=False, repr=False)

  def for_block(self, block_type: str) -> Policy:
    """Returns the policy of ``block_type`` (its own, else the default)."""
    return dict(self.blocks).get(block_type, self.default)

  @property
  def remat(self) -> bool:
    """Whether any block type is wrapped in ``jax.checkpoint``."""
    return self.default.remat or any(p.remat for _, p in self.blocks)

  @property
  def offloads(self) -> bool:
    """Whether any block type's policy offloads saved values to host memory."""
    return self.default.offloads or any(p.offloads for _, p in self.blocks)

  # The concrete-policy interface, shared with LayeredPolicy and LossPolicy (jaxckpt.policies._model): code below the
  # boundary where a policy string is resolved reads these instead of asking which kind it has.
  resolved = True
  """A concrete policy: applied as it is (a budget, ``min_saved`` or ``mincut`` must be resolved first)."""
  scope = "blocks"
  """What the policy remats: ``"blocks"`` (the model's blocks) or ``"loss"`` (the whole loss, ``mincut``)."""
  whole_loss = None
  """The loss function of a whole-loss plan (:class:`~jaxckpt.policies.LossPolicy`); ``None`` for block policies."""
  layered = None
  """The per-layer-range policy (:class:`~jaxckpt.policies.LayeredPolicy`); ``None`` for one spec for every layer."""

  @property
  def base_spec(self) -> "PolicySpec":
    """The spec of blocks outside a layer stack (and of the first layer range): this spec."""
    return self

  def segments_for(self, num_layers: int) -> tuple[tuple[int, "PolicySpec"], ...]:
    """``((num_layers, spec),)``: one range of ``num_layers`` layers with this spec (as :class:`LayeredPolicy`)."""
    return ((num_layers, self),)

  def validate(self, block_types: Mapping[str, Collection[str]]) -> "PolicySpec":
    """Checks the spec against a model's block types and the checkpoint names each emits.

    Args:
      block_types: block type -> checkpoint names that block emits, e.g.
        ``{"attn": {"qkv", "attn_out"}, "mlp": {"mlp_hidden"}}`` (see :func:`jaxckpt.block_types`).

    Returns:
      ``self``, so calls chain.

    Raises:
      PolicySpecError: a block type in the map that the model does not have, or a checkpoint name in a policy that
        the blocks it applies to never emit (that policy would silently save nothing it was meant to).
    """
    spec = self.text or str(self)
    for block, policy in self.blocks:
      if block not in block_types:
        raise PolicySpecError.unknown("block type", block, [*block_types, DEFAULT_BLOCK], spec=spec)
      self._check_names(policy, block_types[block], f"block {block!r}", spec)
    named = {b for b, _ in self.blocks}
    rest = [b for b in block_types if b not in named]
    if rest or not self.blocks:
      emitted = set().union(*(block_types[b] for b in rest)) if rest else set()
      self._check_names(self.default, emitted, f"block types {', '.join(rest) or '(none)'}", spec)
    return self

  @staticmethod
  def _check_names(policy: Policy, emitted: Collection[str], where: str, spec: str) -> None:
    missing = sorted(policy.checkpoint_names - set(emitted))
    if policy.preset is not None:  # an MoE's dropless experts emit some dense names only as their MoE twin
      missing = [n for n in missing if MAXTEXT_MOE_TWINS.get(n) not in emitted]
      if not missing:
        return
    if policy.preset is not None and missing:
      raise PolicySpecError(
          f"MaxText preset {policy.name!r} saves MaxText's checkpoint names, but {where} never emit "
          f"{', '.join(missing)} (it emits {', '.join(sorted(emitted)) or 'no checkpoint names'}): the presets apply to "
          "models whose decoder layer emits MaxText's names (the llm model family); name the values yourself with "
          "save_only_these_names:NAME+...", spec=spec, bad=missing[0], valid=tuple(sorted(emitted)))
    for name in sorted(policy.checkpoint_names):
      if name not in emitted:
        raise PolicySpecError.unknown(
            "checkpoint name", name, emitted, spec=spec, context=f" (never emitted by {where}, so it would save nothing)"
        )

  def __str__(self) -> str:
    if not self.blocks:
      return str(self.default)
    parts = [f"{block}={policy}" for block, policy in self.blocks]
    if self.default != NO_REMAT:
      parts.append(f"{DEFAULT_BLOCK}={self.default}")
    return ",".join(parts)


def _parse_names(text: str, spec: str) -> tuple[str, ...]:
  if not text.strip():
    return ()
  names = tuple(n.strip() for n in text.split("+"))
  for name in names:
    if not _NAME_RE.match(name):
      raise PolicySpecError(
          f"malformed checkpoint name {shorten(name)!r} in policy spec {shorten(spec)!r}: names are letters, digits, '_', '-', '.' "
          "joined by '+' (e.g. save_only_these_names:qkv+mlp_hidden)",
          spec=spec,
          bad=name,
      )
  if len(set(names)) != len(names):
    dup = next(n for n in names if names.count(n) > 1)
    raise PolicySpecError(f"checkpoint name {dup!r} given twice in policy spec {shorten(spec)!r}", spec=spec, bad=dup)
  return names


def _parse_one(text: str, spec: str) -> Policy:
  name, sep, args = (part.strip() for part in text.partition(":"))
  if not name:
    raise PolicySpecError(
        f"empty policy name in policy spec {shorten(spec)!r}; valid policies: {', '.join(POLICY_NAMES)}",
        spec=spec,
        bad=text,
        valid=POLICY_NAMES,
    )
  canonical = ALIASES.get(name, name)
  if canonical not in REGISTRY:
    raise PolicySpecError.unknown("policy", name, POLICY_NAMES, spec=spec)
  kind = REGISTRY[canonical]
  if (problem := refused(canonical)) is not None:
    raise PolicySpecError(f"policy {name!r} is refused: {problem}", spec=spec, bad=name)
  if kind.arity == "none":
    if sep:
      raise PolicySpecError(
          f"policy {name!r} takes no arguments, got {shorten(args)!r} in policy spec {shorten(spec)!r}", spec=spec, bad=text
      )
    return Policy(canonical)
  example = kind.doc.rsplit(": ", 1)[-1]
  if kind.arity == "names":
    if "/" in args:
      raise PolicySpecError(
          f"policy {name!r} takes one '+'-joined list of checkpoint names, got {shorten(args)!r} in policy spec {shorten(spec)!r} "
          f"(e.g. {example})",
          spec=spec,
          bad=args,
      )
    names = _parse_names(args, spec)
    if not names:
      raise PolicySpecError(
          f"policy {name!r} needs at least one checkpoint name in policy spec {shorten(spec)!r} (e.g. {example})",
          spec=spec,
          bad=text,
      )
    return Policy(canonical, names)
  save_text, slash, offload_text = args.partition("/")
  if not slash or "/" in offload_text:
    raise PolicySpecError(
        f"policy {name!r} takes SAVE_NAMES/OFFLOAD_NAMES (one '/'), got {shorten(args)!r} in policy spec {shorten(spec)!r} "
        f"(e.g. {example})",
        spec=spec,
        bad=args or text,
    )
  save, offload = _parse_names(save_text, spec), _parse_names(offload_text, spec)
  if not save and not offload:
    raise PolicySpecError(
        f"policy {name!r} needs at least one checkpoint name in policy spec {shorten(spec)!r} (e.g. {example})",
        spec=spec,
        bad=text,
    )
  both = set(save) & set(offload)
  if both:
    bad = sorted(both)[0]
    raise PolicySpecError(
        f"checkpoint name {bad!r} is both saved and offloaded in policy spec {shorten(spec)!r}; list it on one side of '/'",
        spec=spec,
        bad=bad,
    )
  return Policy(canonical, save, offload)


def parse_policy(spec: "str | Policy | PolicySpec | None") -> PolicySpec:
  """Parses a policy spec string (grammar in the module docstring) into a :class:`PolicySpec`.

  Args:
    spec: a spec string such as ``"dots_saveable"``, ``"save_only_these_names:qkv+mlp_hidden"`` or
      ``"attn=dots_saveable,mlp=full,default=none"``; a :class:`Policy` (applied to every block); a
      :class:`PolicySpec` (returned as is); or ``None`` (= ``"none"``).

  Returns:
    The parsed spec, with every policy name canonical. ``str()`` of it parses back to an equal spec.

  Raises:
    PolicySpecError: unknown policy name (with the closest valid one), arguments where none are taken or missing
      where needed, malformed names, an empty or repeated block type, or a string that fits neither form. Whether the
      block types and checkpoint names exist in a model is checked by :meth:`PolicySpec.validate`.
  """
  if spec is None:
    return PolicySpec()
  if isinstance(spec, PolicySpec):
    return spec
  if isinstance(spec, Policy):
    return PolicySpec(default=spec)
  if not isinstance(spec, str):
    raise PolicySpecError(
        f"a policy spec must be a string, Policy or PolicySpec, got {type(spec).__name__}: {shorten(repr(spec))}",
        spec=repr(spec),
        bad=repr(spec),
    )
  text = spec.strip()
  if not text:
    raise PolicySpecError(
        f"empty policy spec; valid policies: {', '.join(POLICY_NAMES)}", spec=spec, bad=spec, valid=POLICY_NAMES
    )
  word = text.partition(":")[0].strip()
  if ";" in text and not text[:1].isdigit():
    raise PolicySpecError(
        f"';' in policy spec {shorten(spec)!r}: ',' separates the block types of a block map (e.g. "
        f"{shorten(text.replace(';', ','))!r}); ';' only joins layer ranges of a layered policy "
        "(0-3:dots_saveable;4-11:full)", spec=spec, bad=";", valid=(",",))
  if word in ("budget", "auto") or text[:1].isdigit():
    raise PolicySpecError(
        f"policy spec {shorten(spec)!r} is a model-level policy (a memory budget or layer ranges), not a per-block "
        "spec: give it where a whole model's policy is set (set_policy, parse_model_policy, the tools' policy "
        "arguments, jaxckpt-plan)", spec=spec, bad=text)
  if "=" not in text:
    if "," in text:
      first = text.split(",", 1)[0]
      if ":" in first:  # e.g. save_only_these_names:a,b — a list of arguments, not of policies
        raise PolicySpecError(
            f"policy spec {shorten(spec)!r}: the arguments of {first.split(':', 1)[0]} are joined by '+', not ',' "
            f"(e.g. {text.replace(',', '+')}); ',' separates block=policy pairs (attn=dots_saveable,mlp=full)",
            spec=spec, bad=",", valid=("+",))
      raise PolicySpecError(
          f"policy spec {shorten(spec)!r} lists several policies without block types; write block=policy pairs, "
          "e.g. attn=dots_saveable,mlp=full",
          spec=spec,
          bad=text,
      )
    return PolicySpec(default=_parse_one(text, spec), text=spec)
  default = NO_REMAT
  blocks: dict[str, Policy] = {}
  seen: set[str] = set()
  for item in text.split(","):
    block, eq, policy_text = (part.strip() for part in item.partition("="))
    if not eq or not block or not _NAME_RE.match(block):
      raise PolicySpecError(
          f"malformed entry {shorten(item.strip())!r} in policy spec {shorten(spec)!r}: a block map is block=policy pairs joined by ',' "
          "(e.g. attn=dots_saveable,mlp=full,default=none)",
          spec=spec,
          bad=item.strip(),
      )
    if block in seen:
      raise PolicySpecError(f"block type {shorten(block)!r} given twice in policy spec {shorten(spec)!r}", spec=spec, bad=block)
    seen.add(block)
    policy = _parse_one(policy_text, spec)
    if block == DEFAULT_BLOCK:
      default = policy
    else:
      blocks[block] = policy
  return PolicySpec(default=default, blocks=tuple(blocks.items()), text=spec)
