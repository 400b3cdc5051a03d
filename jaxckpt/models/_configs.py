"""Model configs are checked once, here: every shipped config dataclass (:class:`~jaxckpt.models.ViTConfig`,
:class:`~jaxckpt.models._gpt.GPTConfig`...) calls :func:`check_config` from ``__post_init__``, so a config that exists is
valid, whether built from a preset, ``dataclasses.replace`` or :func:`override`.

Errors name the Python argument and the bad value (``seq_len=0 must be ≥ 1``), never a command-line flag; the CLIs
translate them to their flags in one place (:func:`jaxckpt._cli.flag_error`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any, TypeVar

import jax.numpy as jnp

from jaxckpt.core._blocks import ATTENTION_IMPLEMENTATIONS, check_attention, check_dropout_rate
from jaxckpt.errors import JaxckptError, closest
from jaxckpt.core._structure import parse_structure

COMPUTE_DTYPES: dict[str, jnp.dtype] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""Dtype name -> dtype, for compute dtypes (every model) and weight dtypes (the LLM family's ``weight_dtype``; the
other models keep float32 parameters)."""

_AT_LEAST_ONE = ("num_layers", "dim", "num_heads", "mlp_dim", "hidden_dim", "stem_channels", "patch_size", "channels",
                 "kernel_size", "seq_len", "batch_size", "num_kv_heads", "head_dim", "vocab_tiles")
"""Config fields that are counts or sizes: whole numbers ≥ 1."""
_AT_LEAST_TWO = ("vocab_size",)
_FLAGS = ("scan", "tie_embeddings")

Config = TypeVar("Config")


def compute_dtype(name: str) -> jnp.dtype:
  """The dtype of a compute dtype name.

  Args:
    name: a key of :data:`COMPUTE_DTYPES` (``float32``, ``bfloat16``).

  Returns:
    The ``jnp`` dtype.

  Raises:
    JaxckptError: an unknown name, listing the valid ones.
  """
  return dtype_named(name, argument="compute_dtype")


def dtype_named(name: str, *, argument: str) -> jnp.dtype:
  """The dtype of a dtype name given as the Python argument ``argument`` (``compute_dtype``, ``weight_dtype``).

  Args:
    name: a key of :data:`COMPUTE_DTYPES` (``float32``, ``bfloat16``).
    argument: the argument's name, for the message.

  Returns:
    The ``jnp`` dtype.

  Raises:
    JaxckptError: an unknown name, naming ``argument`` and listing the valid ones
      (``weight_dtype='fp16' is unknown; valid: float32, bfloat16``).
  """
  if not isinstance(name, str) or name not in COMPUTE_DTYPES:
    hint = closest(name, COMPUTE_DTYPES) if isinstance(name, str) else None
    raise JaxckptError(f"{argument}={name!r} is unknown; valid: {', '.join(COMPUTE_DTYPES)}"
                       + (f"; did you mean {hint!r}?" if hint else ""))
  return COMPUTE_DTYPES[name]


def check_config(config: Any) -> None:
  """Checks every field of a model config dataclass that follows jaxckpt's field names.

  Sizes (``num_layers``, ``dim``, ``seq_len``, ``batch_size``...) must be whole numbers ≥ 1, ``vocab_size`` ≥ 2,
  ``dropout_rate`` in [0, 1), ``num_heads`` a divisor of ``dim``, ``compute_dtype`` a key of :data:`COMPUTE_DTYPES`,
  ``structure`` a checkpoint structure (:func:`jaxckpt.core._structure.parse_structure`), ``attention`` one of
  :data:`jaxckpt.core._blocks.ATTENTION_IMPLEMENTATIONS`, ``scan`` and ``tie_embeddings`` bools.

  Args:
    config: a config dataclass instance.

  Raises:
    JaxckptError: the first bad field, named as the Python argument with its value (``seq_len=0 must be ≥ 1``).
  """
  values = check_fields(config)
  if "num_heads" in values:
    check_attention(values["dim"], values["num_heads"], values.get("attention", ATTENTION_IMPLEMENTATIONS[0]))


def check_fields(config: Any) -> dict[str, Any]:
  """The checks of :func:`check_config` that hold for every model family: sizes, flags, dropout rate, compute
  dtype and structure (not the attention choice, which is each family's own: the LLM family checks its kernels).

  Args:
    config: a config dataclass instance.

  Returns:
    ``{field name: value}`` of the config.

  Raises:
    JaxckptError: the first bad field, named as the Python argument with its value.
  """
  values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  for name, value in values.items():
    if name in _AT_LEAST_ONE or name in _AT_LEAST_TWO:
      least = 2 if name in _AT_LEAST_TWO else 1
      if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise JaxckptError(f"{name}={value!r} must be a whole number ≥ {least}")
    elif name in _FLAGS and not isinstance(value, bool):
      raise JaxckptError(f"{name}={value!r} must be True or False")
  if "dropout_rate" in values:
    check_dropout_rate(values["dropout_rate"])
  if "compute_dtype" in values:
    compute_dtype(values["compute_dtype"])
  if "structure" in values:
    parse_structure(values["structure"])
  return values


def override(config: Config, **overrides: Any) -> Config:
  """A copy of a model config with some fields replaced, checked once (:func:`check_config`).

  ``None`` values are left out, so optional overrides pass straight through (``override(c, seq_len=None)`` is
  ``c``).

  Args:
    config: a config dataclass instance (e.g. a preset).
    **overrides: field name -> new value.

  Returns:
    The new config (``config`` itself when nothing is overridden).

  Raises:
    JaxckptError: a name that is not a field of this config (:func:`field_names`, with the closest one), or a bad
      value.

  Example::

    >>> override(GPT_PRESETS["tiny"], seq_len=128, num_layers=None)  # seq_len replaced, num_layers kept
  """
  given = {name: value for name, value in overrides.items() if value is not None}
  fields = field_names(config)
  for name, value in given.items():
    if name not in fields:
      raise JaxckptError(_unknown_field(type(config).__name__, name, value, fields))
  return dataclasses.replace(config, **given) if given else config


def _unknown_field(config_name: str, name: str, value: Any, fields: Iterable[str]) -> str:
  hint = closest(name, list(fields))
  return (f"{name}={value!r} is not a field of {config_name}; its fields: {', '.join(fields)}"
          + (f"; did you mean {hint!r}?" if hint else ""))


def unknown_preset(model: str, name: str, presets: Iterable[str]) -> JaxckptError:
  """The error for a preset name a model lacks: the valid ones and the closest.

  Args:
    model: the model's registry name (``gpt``, ``llm``…).
    name: the bad preset name.
    presets: the model's preset names.

  Returns:
    A :class:`~jaxckpt.errors.JaxckptError` to raise: ``unknown preset 'llama3-8b' for model llm; valid presets:
    ...; did you mean 'llama3.1-8b'?``.
  """
  presets = list(presets)
  hint = closest(name, presets) if isinstance(name, str) else None
  return JaxckptError(f"unknown preset {name!r} for model {model}; valid presets: {', '.join(presets)}"
                      + (f"; did you mean {hint!r}?" if hint else ""))


def field_names(config: Any) -> tuple[str, ...]:
  """The arguments a model config (or its class) takes: its dataclass fields, and for a config with parts (its
  ``PARTS``, ``{field: record}``: :class:`~jaxckpt.models.llm.LLMConfig`'s ``moe``, ``mla`` and ``kernel``) each
  part's fields by their own names after the part's (``moe``, ``num_experts``, ...)."""
  parts = getattr(config, "PARTS", {})
  out: list[str] = []
  for f in dataclasses.fields(config):
    out.append(f.name)
    if f.name in parts:
      out.extend(g.name for g in dataclasses.fields(parts[f.name]))
  return tuple(out)


def config_record(config: Any) -> dict[str, Any]:
  """A model config as one flat JSON-ready ``{argument: value}`` record: a part's fields (:func:`field_names`) in place
  of the part, an enum member as its value, a nested dataclass (splash blocks) as a dict. What metrics.json's
  ``model_config`` and a run's identity keep, the same for a config with parts as before them.

  Example::

    >>> config_record(LLM_PRESETS["mixtral-tiny"])["moe_dispatch"]
    'auto'
  """
  parts = getattr(config, "PARTS", {})
  out: dict[str, Any] = {}
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if f.name in parts:
      out.update({g.name: getattr(value, g.name) for g in dataclasses.fields(value)})
    else:
      out[f.name] = value
  return {k: (v.value if isinstance(v, enum.Enum) else dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
          for k, v in out.items()}
