"""Model-level policies: a policy spec per range of layers, or a memory budget the planner turns into one.

Per-block specs (:mod:`jaxckpt.policies._spec`) say what each block type saves; a model-level policy says which spec
each *layer* of a stack uses (:class:`LayeredPolicy`, what a plan compiles to), or asks for the least-recompute plan
that fits a memory budget (:class:`Budget`), or names a per-tensor plan (:class:`MinSaved`; :class:`MinCut`, a plan
of the whole loss). These are resolved once, where they enter, by :func:`jaxckpt.planner.resolve_policy`; everything
below it sees only a :class:`~jaxckpt.PolicySpec`, a :class:`LayeredPolicy`, or (a resolved ``mincut``) a
:class:`LossPolicy`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from jaxckpt.errors import PolicySpecError, shorten
from jaxckpt.policies._spec import Policy, PolicySpec, parse_policy
from jaxckpt._units import format_bytes, parse_bytes


_RANGE_RE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+))?\s*\Z")
_PERCENT_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*\Z")
BUDGET = "budget"
"""The policy word of a memory budget: ``budget:1.5GiB`` (footprint) or ``budget:40%`` (of no-remat temp)."""
AUTO = "auto"
"""The policy word of the least-recompute plan that fits this device's memory (``auto``, ``auto:margin=20%``)."""
DEFAULT_MARGIN = 0.10
"""Share of the device's memory ``auto`` leaves free by default."""
MIN_SAVED = "min_saved"
"""The policy word of the least saved set at (almost) no extra FLOPs: ``min_saved``, ``min_saved:tol=0.05%``."""
MINCUT = "mincut"
"""The policy word of a whole-loss per-tensor plan under a cap on saved activation bytes: ``mincut:150MiB``,
``mincut:25%`` (of what the step saves without remat)."""
DEFAULT_MIN_SAVED_TOLERANCE = 0.002
"""Recompute FLOPs ``min_saved`` allows by default, as a share of each layer's forward FLOPs (0.2% of the forward is
about 0.07% of the train step)."""

_FORMS = (
    ("NAME", "one policy for every block (policy names below)"),
    ("NAME:N+N", "a name-taking policy: save_only_these_names:qkv+mlp_hidden"),
    ("BLOCK=POLICY,...", "per block type: attn=dots_saveable,mlp=full,default=none"),
    ("FIRST-LAST:SPEC;...", "per range of layers: 0-3:full;4-11:dots_saveable"),
    (f"{BUDGET}:SIZE | {BUDGET}:P%", "least-recompute plan: footprint ≤ SIZE (B, KiB, MiB, GiB, TiB) or temp ≤ P% "
                                   "of no remat's"),
    (f"{AUTO} | {AUTO}:margin=P%", f"a budget of this device's memory less a margin (default {DEFAULT_MARGIN:.0%})"),
    (f"{MIN_SAVED} | {MIN_SAVED}:tol=P%", "the least saved values per layer at ≤ P% more FLOPs (default "
                                        f"{DEFAULT_MIN_SAVED_TOLERANCE * 100:g}%)"),
    (f"{MINCUT}:SIZE | {MINCUT}:P%", "a whole-loss plan saving at most SIZE (or P% of no remat's) activations"),
)
POLICY_FORMS = "policy forms (one grammar, jaxckpt.parse_model_policy):\n" + "\n".join(
    f"  {form:<30} {meaning}" for form, meaning in _FORMS)
"""Every form a policy string takes, for the CLIs' ``--help`` (the one list: a new form is added here)."""


@dataclasses.dataclass(frozen=True)
class LayeredPolicy:
  """A policy spec per consecutive range of a layer stack's layers: what a memory-budget plan compiles to.

  Text form (``str()`` parses back with :func:`parse_model_policy`): ranges of layer indices (0-based, inclusive)
  joined by ``;``, each ``first-last:spec``, covering ``0..N-1`` in order, e.g.
  ``0-3:attn=save_only_these_names:qkv,mlp=full;4-11:full``. In a :class:`~jaxckpt.Stack` each range is its own
  ``scan`` (or unrolled run) whose blocks use that range's spec (Checkmate-style mixed plans; Jain et al., MLSys
  2020). Blocks outside any stack use the first range's spec.

  Attributes:
    segments: ``(num_layers, spec)`` per range, in layer order; counts ≥ 1.
    text: the string it was parsed from (not compared).
  """

  segments: tuple[tuple[int, PolicySpec], ...]
  text: str = dataclasses.field(default="", compare=False, repr=False)

  @property
  def num_layers(self) -> int:
    """Layers covered, N."""
    return sum(count for count, _ in self.segments)

  @property
  def remat(self) -> bool:
    """Whether any range wraps blocks in ``jax.checkpoint``."""
    return any(spec.remat for _, spec in self.segments)

  @property
  def offloads(self) -> bool:
    """Whether any range offloads saved values to host memory."""
    return any(spec.offloads for _, spec in self.segments)

  def layer_specs(self) -> list[PolicySpec]:
    """The spec of each layer, ``[spec_0, ..., spec_{N-1}]``."""
    return [spec for count, spec in self.segments for _ in range(count)]

  resolved = True
  """A concrete policy (see :attr:`jaxckpt.PolicySpec.resolved`)."""
  scope = "blocks"
  whole_loss = None
  """Not a whole-loss plan."""

  @property
  def layered(self) -> "LayeredPolicy":
    """This policy: what a stack applies range by range."""
    return self

  @property
  def base_spec(self) -> PolicySpec:
    """The first range's spec: what blocks outside a layer stack use."""
    return self.segments[0][1]

  def segments_for(self, num_layers: int) -> tuple[tuple[int, PolicySpec], ...]:
    """The ranges, for a stack of ``num_layers`` layers.

    Raises:
      PolicySpecError: the ranges cover another number of layers.
    """
    if num_layers != self.num_layers:
      raise PolicySpecError(f"layered policy {shorten(str(self))!r} covers {self.num_layers} layers but the model's "
                            f"stack has "
                            f"{num_layers}: ranges must cover 0-{num_layers - 1}", spec=str(self), bad=str(self))
    return self.segments

  def validate(self, block_types: Mapping[str, Collection[str]]) -> "LayeredPolicy":
    """Validates every range's spec (see :meth:`PolicySpec.validate`); returns ``self``.

    Raises:
      PolicySpecError: as :meth:`PolicySpec.validate`.
    """
    for _, spec in self.segments:
      spec.validate(block_types)
    return self

  def __str__(self) -> str:
    parts, first = [], 0
    for count, spec in self.segments:
      last = first + count - 1
      parts.append(f"{first}-{last}:{spec}" if last > first else f"{first}:{spec}")
      first = last + 1
    return ";".join(parts)


@dataclasses.dataclass(frozen=True)
class Budget:
  """A memory budget for the train step, to be met with the least recomputation (see :mod:`jaxckpt.planner`).

  Exactly one of ``bytes`` / ``fraction`` is set, or ``auto``.

  Attributes:
    bytes: ``budget:<size>``: the step's compiled ``footprint_bytes`` (argument + output + temp − alias) must be at
      most this many bytes.
    fraction: ``budget:<p>%``: the compiled ``temp_bytes`` must be at most ``p/100`` × those of ``none``.
    auto: ``auto``: footprint at most the device's memory (GPU/TPU: ``bytes_limit``; CPU: available RAM) × (1 − margin).
    margin: share of that memory left free (``auto`` only), in [0, 1).
    text: the string it was parsed from.
  """

  bytes: int | None = None
  fraction: float | None = None
  auto: bool = False
  margin: float = DEFAULT_MARGIN
  text: str = dataclasses.field(default="", compare=False)

  resolved = False
  """Model-level: :func:`jaxckpt.planner.resolve_policy` turns it into a concrete policy for one model."""
  scope = "blocks"

  def __str__(self) -> str:
    if self.auto:
      return AUTO if self.margin == DEFAULT_MARGIN else f"{AUTO}:margin={self.margin * 100:g}%"
    if self.fraction is not None:
      return f"{BUDGET}:{self.fraction * 100:g}%"
    return f"{BUDGET}:{format_bytes(self.bytes).replace(' ', '')}"


@dataclasses.dataclass(frozen=True)
class MinSaved:
  """The top of the memory/recompute front: the least saved bytes per layer whose recomputation costs at most
  ``tolerance`` of the layer's forward FLOPs (a min-cut of the blocks' graphs, :mod:`jaxckpt.planner._tensors`).

  PyTorch's AOTAutograd min-cut partitioner makes the same choice by default (``activation_memory_budget=1``):
  keep the forward's cost, save the smallest set the backward can be recomputed from. It needs the model, so it is
  resolved by :func:`jaxckpt.planner.resolve_policy` into a :class:`~jaxckpt.PolicySpec` of ``save_tensors``.

  Attributes:
    tolerance: recompute FLOPs allowed, as a share of each layer's forward FLOPs, in [0, 1).
    text: the string it was parsed from.
  """

  tolerance: float = DEFAULT_MIN_SAVED_TOLERANCE
  text: str = dataclasses.field(default="", compare=False)

  resolved = False
  """Model-level: :func:`jaxckpt.planner.resolve_policy` turns it into a concrete policy for one model."""
  scope = "blocks"

  def __str__(self) -> str:
    if self.tolerance == DEFAULT_MIN_SAVED_TOLERANCE:
      return MIN_SAVED
    return f"{MIN_SAVED}:tol={self.tolerance * 100:g}%"


def _parse_min_saved(text: str, spec: str) -> MinSaved:
  _, colon, arg = (part.strip() for part in text.partition(":"))
  if not colon:
    return MinSaved(text=spec)
  key, eq, value = (part.strip() for part in arg.partition("="))
  if key != "tol" or not eq:
    raise PolicySpecError(f"bad argument {shorten(arg)!r} of {MIN_SAVED!r} in policy spec {shorten(spec)!r}: the only "
                          f"one is tol=<percent> (e.g. {MIN_SAVED}:tol=0.1%)", spec=spec, bad=arg)
  match = _PERCENT_RE.match(value)
  if not match or not 0 <= float(match.group(1)) / 100 < 1:
    raise PolicySpecError(f"bad tolerance {shorten(value)!r} in policy spec {shorten(spec)!r}: write a percentage in "
                          f"[0%, 100%) such as 0.1%", spec=spec, bad=value)
  return MinSaved(tolerance=float(match.group(1)) / 100, text=spec)


@dataclasses.dataclass(frozen=True)
class MinCut:
  """A per-tensor plan of the whole loss, like PyTorch's min-cut partitioner: the least recompute whose saved
  activation bytes (the report's ``activation_residual_bytes``) are at most a cap (:mod:`jaxckpt.planner._whole`).

  The loss is traced with layers unrolled, cut into regions at its narrowest points (the residual stream between
  blocks) and one 0-1 program chooses every region's saved values together; each region then runs under its own
  ``jax.checkpoint`` saving exactly those. Resolved by :func:`jaxckpt.planner.resolve_policy` into a
  :class:`LossPolicy`.

  Exactly one of ``bytes`` / ``fraction`` is set.

  Attributes:
    bytes: ``mincut:<size>``: cap on saved activation bytes.
    fraction: ``mincut:<p>%``: cap as a share of the activation bytes the step saves without remat.
    text: the string it was parsed from.
  """

  bytes: int | None = None
  fraction: float | None = None
  text: str = dataclasses.field(default="", compare=False)

  resolved = False
  """Model-level: :func:`jaxckpt.planner.resolve_policy` turns it into a concrete policy for one model."""
  scope = "loss"

  def __str__(self) -> str:
    if self.fraction is not None:
      return f"{MINCUT}:{self.fraction * 100:g}%"
    return f"{MINCUT}:{format_bytes(self.bytes).replace(' ', '')}"


def _parse_mincut(text: str, spec: str) -> MinCut:
  _, _, arg = (part.strip() for part in text.partition(":"))
  example = f"e.g. {MINCUT}:150MiB (saved activation bytes) or {MINCUT}:25% (of no remat's)"
  size, fraction = _size_or_percent(MINCUT, text, arg, spec, example, zero=True)
  return MinCut(bytes=size, fraction=fraction, text=spec)


def _size_or_percent(word: str, text: str, arg: str, spec: str, example: str, *,
                     zero: bool) -> tuple[int | None, float | None]:
  """``(bytes, None)`` or ``(None, fraction)`` of ``<word>:<size>|<p>%`` (``zero``: 0 allowed, else ≥ 1 byte and
  > 0%). Raises :class:`PolicySpecError` naming the bad part, with ``example``."""
  if not arg:
    raise PolicySpecError(f"{word!r} needs a size or a percentage in policy spec {shorten(spec)!r} ({example})",
                          spec=spec, bad=text)
  if arg.endswith("%"):
    fraction = _percent(arg, spec, word)
    if not (0 <= fraction <= 1 if zero else 0 < fraction <= 1):
      valid = "[0%, 100%]" if zero else "(0%, 100%]"
      raise PolicySpecError(f"{word} {shorten(arg)!r} in policy spec {shorten(spec)!r} must be in {valid}",
                            spec=spec, bad=arg)
    return None, fraction
  try:
    size = parse_bytes(arg)
  except ValueError as err:
    raise PolicySpecError(f"{err} in policy spec {shorten(spec)!r} ({example})", spec=spec, bad=arg) from None
  if size <= 0 and not zero:
    raise PolicySpecError(f"{word} {shorten(arg)!r} in policy spec {shorten(spec)!r} must be at least 1 byte",
                          spec=spec, bad=arg)
  return size, None


@dataclasses.dataclass(frozen=True, eq=False)
class LossPolicy:
  """A remat plan of the whole loss rather than of the model's blocks (a resolved :class:`MinCut`).

  The train step differentiates ``loss_fn`` instead of the model's own loss: the same loss with the model's layers
  unrolled and no block remat, run region by region under ``jax.checkpoint`` (:mod:`jaxckpt.planner._whole`). It
  applies to the step the report and the planner build (:mod:`jaxckpt.step`), not to a model object:
  :func:`jaxckpt.set_policy` refuses it.

  Attributes:
    loss_fn: ``(params, batch, dropout_key) -> scalar float32 loss``, params the model's ``nnx.Param`` state.
    text: how it is shown (the :class:`MinCut` it came from).
    plan: the plan behind it (a :class:`jaxckpt.planner._whole.SegmentedPlan`), for explanations.
  """

  loss_fn: Callable[..., Any]
  text: str
  plan: Any = None

  remat = True
  offloads = False
  resolved = True
  scope = "loss"
  layered = None

  @property
  def whole_loss(self) -> Callable[..., Any]:
    """The loss the step differentiates instead of the model's: :attr:`loss_fn`."""
    return self.loss_fn

  @property
  def base_spec(self) -> PolicySpec:
    """``none``: the model's own blocks run without remat; the plan remats the loss region by region."""
    return parse_policy("none")

  def segments_for(self, num_layers: int) -> tuple[tuple[int, PolicySpec], ...]:
    """``((num_layers, none),)``: the model's layers run without block remat (the plan remats the loss)."""
    return ((num_layers, self.base_spec),)

  def validate(self, block_types: Mapping[str, Collection[str]]) -> "LossPolicy":  # noqa: ARG002
    """Nothing to check against the block types (the plan was made for this target's loss); returns itself."""
    return self

  def __str__(self) -> str:
    return self.text


ModelPolicy = PolicySpec | LayeredPolicy | Budget | MinSaved | MinCut
"""What a model-level ``--policy`` can be: one spec for every layer, a spec per layer range, a budget, ``min_saved``
or a whole-loss ``mincut``."""

@typing.runtime_checkable
class ConcretePolicy(typing.Protocol):
  """The one type code below the policy boundary takes: a policy that can be applied as it is.

  A policy string enters once, where a tool or a user call takes it: :func:`parse_model_policy` parses it and
  :func:`jaxckpt.planner.resolve_policy` turns a budget, ``min_saved`` or ``mincut:<cap>`` into a concrete one.
  Below that, the step builder, ``set_policy`` on both front-ends, the report and the fit planner read only these
  members, never the policy's class (as optax passes one ``GradientTransformation`` around). Implemented by
  :class:`~jaxckpt.PolicySpec` (one spec for every layer), :class:`LayeredPolicy` (a spec per layer range) and
  :class:`LossPolicy` (a whole-loss plan).

  Attributes:
    resolved: ``True`` (budgets and the other model-level policies have ``False`` until resolved).
    scope: ``"blocks"`` (the model's blocks are rematted) or ``"loss"`` (the whole loss, region by region).
    whole_loss: the loss function the step differentiates instead of the model's (``scope == "loss"``), or
      ``None``.
    layered: the :class:`LayeredPolicy` to apply range by range, or ``None`` (one spec for every layer).
    base_spec: the :class:`~jaxckpt.PolicySpec` of blocks outside a layer stack (and of the first range).
    remat: whether anything is wrapped in ``jax.checkpoint``.
    offloads: whether saved values are offloaded to host memory.
  """

  resolved: bool
  scope: str
  whole_loss: Callable[..., Any] | None
  layered: "LayeredPolicy | None"
  base_spec: PolicySpec
  remat: bool
  offloads: bool

  def segments_for(self, num_layers: int) -> tuple[tuple[int, PolicySpec], ...]:
    """``(layers, spec)`` per range for a stack of ``num_layers`` layers (raises ``PolicySpecError`` for a layered
    policy of another length)."""

  def validate(self, block_types: Mapping[str, Collection[str]]) -> "ConcretePolicy":
    """Checks the policy against a model's block types and their checkpoint names; returns itself (raises
    ``PolicySpecError``)."""


def _percent(text: str, spec: str, what: str) -> float:
  match = _PERCENT_RE.match(text)
  if not match:
    valid = {"margin": "in [0%, 100%)", MINCUT: "in [0%, 100%]"}.get(what, "in (0%, 100%]")
    raise PolicySpecError(f"bad {what} {shorten(text)!r} in policy spec {shorten(spec)!r}: write a percentage {valid} "
                          "such as 40%", spec=spec, bad=text)
  return float(match.group(1)) / 100


def _parse_budget(text: str, spec: str) -> Budget:
  word, _, arg = (part.strip() for part in text.partition(":"))
  if word == AUTO:
    if not arg:
      if ":" in text:
        raise PolicySpecError(f"{AUTO!r} has an empty argument in policy spec {shorten(spec)!r}: write {AUTO} or "
                              f"{AUTO}:margin=<percent> (e.g. {AUTO}:margin=20%)", spec=spec, bad=text)
      return Budget(auto=True, text=spec)
    key, eq, value = (part.strip() for part in arg.partition("="))
    if key != "margin" or not eq:
      raise PolicySpecError(f"bad argument {shorten(arg)!r} of {AUTO!r} in policy spec {shorten(spec)!r}: the only "
                            f"one is margin=<percent> (e.g. {AUTO}:margin=20%)", spec=spec, bad=arg)
    margin = _percent(value, spec, "margin")
    if not 0 <= margin < 1:
      raise PolicySpecError(f"margin {shorten(value)!r} in policy spec {shorten(spec)!r} must be in [0%, 100%)",
                            spec=spec, bad=value)
    return Budget(auto=True, margin=margin, text=spec)
  example = f"e.g. {BUDGET}:1.5GiB (compiled footprint) or {BUDGET}:40% (of no-remat temp)"
  size, fraction = _size_or_percent(BUDGET, text, arg, spec, example, zero=False)
  return Budget(bytes=size, fraction=fraction, text=spec)


def _parse_layered(text: str, spec: str) -> LayeredPolicy:
  segments: list[tuple[int, PolicySpec]] = []
  expected = 0
  for item in text.split(";"):
    range_text, colon, spec_text = item.partition(":")
    match = _RANGE_RE.match(range_text)
    if not colon or not match:
      raise PolicySpecError(
          f"malformed layer range {shorten(item.strip())!r} in policy spec {shorten(spec)!r}: write first-last:spec "
          "ranges joined by ';' (e.g. 0-3:dots_saveable;4-11:full)", spec=spec, bad=item.strip())
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first != expected or last < first:
      raise PolicySpecError(
          f"layer range {shorten(range_text.strip())!r} in policy spec {shorten(spec)!r} must start at layer {expected} "
          "and not end before it starts (ranges cover 0..N-1 in order)", spec=spec, bad=range_text.strip())
    try:
      segments.append((last - first + 1, parse_policy(spec_text.strip() and spec_text)))
    except PolicySpecError as err:
      raise PolicySpecError(f"{err} (layer range {shorten(range_text.strip())} of policy spec {shorten(spec)!r})",
                            spec=spec,
                            bad=err.bad, valid=err.valid) from None
    expected = last + 1
  return LayeredPolicy(tuple(segments), text=spec)


def parse_model_policy(spec: "str | Policy | PolicySpec | LayeredPolicy | Budget | None") -> ModelPolicy:
  """Parses a model-level policy: a :func:`parse_policy` spec, a :class:`LayeredPolicy` or a :class:`Budget`.

  Grammar (EBNF), on top of :func:`parse_policy`'s ``spec``::

      model_policy := spec | layered | budget | min_saved
      layered      := range ":" spec (";" range ":" spec)*  # 0-3:attn=dots_saveable,mlp=full;4-11:full
      range        := int ["-" int]                          # layer indices, 0-based, inclusive, covering 0..N-1
      budget       := "budget:" (size | percent)             # budget:1.5GiB (footprint), budget:40% (of none's temp)
                    | "auto" [":margin=" percent]            # auto, auto:margin=20%
      min_saved    := "min_saved" [":tol=" percent]         # least saved at ≤ tol extra FLOPs per block
      mincut       := "mincut:" (size | percent)             # whole-loss plan: saved activations ≤ cap
      size         := number unit                            # binary units: B, KiB, MiB, GiB, TiB

  Args:
    spec: a string, or an already parsed object (returned as is; a :class:`Policy` becomes a :class:`PolicySpec`).

  Returns:
    A :class:`PolicySpec`, :class:`LayeredPolicy`, :class:`Budget`, :class:`MinSaved` or :class:`MinCut`. A budget
    (or ``min_saved``, ``mincut``) is turned into a concrete policy by :func:`jaxckpt.planner.resolve_policy` once the model is known.

  Raises:
    PolicySpecError: anything :func:`parse_policy` refuses, malformed or non-contiguous layer ranges, a budget
      without a size, with a decimal unit (``GB``), ≤ 0 or above 100%, or a margin outside [0%, 100%).
  """
  if isinstance(spec, (LayeredPolicy, Budget, MinSaved, MinCut, LossPolicy)):
    return spec
  if not isinstance(spec, str):
    return parse_policy(spec)
  return _parse_text(spec)


def _parse_text(spec: str) -> ModelPolicy:
  """The string form of :func:`parse_model_policy`: the one place a model-level policy string is read (a tool parses
  each ``--policies`` value here once, at its door; tests count the calls)."""
  text = spec.strip()
  word = text.partition(":")[0].strip()
  if word in (BUDGET, AUTO):
    return _parse_budget(text, spec)
  if word == MIN_SAVED:
    return _parse_min_saved(text, spec)
  if word == MINCUT:
    return _parse_mincut(text, spec)
  if text[:1].isdigit():
    return _parse_layered(text, spec)
  return parse_policy(spec)
