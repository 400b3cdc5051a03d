"""Matching blocks by class or predicate, for both front-ends: the ``blocks=`` argument of
:func:`jaxckpt.nnx._apply.apply_remat` and :func:`jaxckpt.linen.apply_remat`, checked once and turned into
predicates ``(path, module) -> bool``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
from flax import nnx

from jaxckpt.errors import JaxckptError
from jaxckpt.policies._spec import DEFAULT_BLOCK
from jaxckpt.policies._spec import is_name


def block_matchers(blocks: Any, *, front_end: str = "nnx", unwrap: Callable[[type], type] = lambda cls: cls
                   ) -> dict[str, Callable[[tuple, Any], bool]]:
  """Checks a whole ``blocks=`` argument and turns each value into a predicate (:func:`block_matcher`).

  Args:
    blocks: ``{block type: module class | tuple of classes | predicate (path, module) -> bool}``, non-empty; block
      types are names (letters, digits, ``_``, ``-``, ``.``), not ``default``.
    front_end: ``"nnx"`` or ``"linen"``.
    unwrap: maps a class the front-end made (an applied subclass) back to the user's class, so either matches.

  Returns:
    ``{block type: predicate}`` in the order given.

  Raises:
    JaxckptError: ``blocks`` is not a non-empty mapping, a key is not a valid block type, or a value is invalid
      (:func:`block_matcher`).
  """
  if not isinstance(blocks, Mapping) or not blocks:
    raise JaxckptError(f"blocks={blocks!r} must be a non-empty dict block type -> class, tuple of classes or "
                       "predicate, e.g. blocks={'layer': DecoderLayer}")
  matchers = {}
  for block_type, value in blocks.items():
    if not isinstance(block_type, str) or not is_name(block_type) or block_type == DEFAULT_BLOCK:
      raise JaxckptError(f"blocks key {block_type!r} is not a valid block type: letters, digits, '_', '-', '.' and "
                         f"not {DEFAULT_BLOCK!r} (e.g. 'attn', 'mlp', 'layer')")
    matchers[block_type] = block_matcher(block_type, value, front_end=front_end, unwrap=unwrap)
  return matchers


def block_matcher(block_type: str, value: Any, *, front_end: str = "nnx", unwrap: Callable[[type], type] = lambda cls: cls
                  ) -> Callable[[tuple, Any], bool]:
  """Turns one ``blocks=`` value into a predicate ``(path, module) -> bool``, checking it (NNX and Linen alike).

  Args:
    block_type: the ``blocks=`` key (for messages).
    value: a module class, a tuple of classes, or a predicate ``(path, module) -> bool``.
    front_end: ``"nnx"`` (classes must be ``flax.nnx.Module`` s) or ``"linen"`` (``flax.linen.Module`` s).
    unwrap: see :func:`block_matchers`.

  Returns:
    The predicate.

  Raises:
    JaxckptError: a value of none of those forms, a class of the other front-end (the message names the function
      for it), or a predicate that cannot take ``(path, module)``.
  """
  base, other = (nnx.Module, nn.Module) if front_end == "nnx" else (nn.Module, nnx.Module)
  name, other_name = ("NNX", "Linen") if front_end == "nnx" else ("Linen", "NNX")
  other_fix = ("jaxckpt.linen.apply_remat(module, policy, blocks=...) for Linen models" if front_end == "nnx"
               else "jaxckpt.apply_remat(model, policy, blocks=...) for NNX models")
  classes = value if isinstance(value, tuple) else (value,) if isinstance(value, type) else None
  if classes is not None:
    for cls in classes:
      if not isinstance(cls, type):
        raise JaxckptError(f"blocks[{block_type!r}] holds {cls!r}, not a class; give {name} module classes, a tuple "
                           "of them, or a predicate (path, module) -> bool")
      if issubclass(cls, other):
        raise JaxckptError(f"blocks[{block_type!r}]={cls.__name__} is a Flax {other_name} module class: use "
                           f"{other_fix}")
      if not issubclass(cls, base):
        raise JaxckptError(f"blocks[{block_type!r}]={cls.__name__} is not a {base.__module__}.Module class")
    wanted = tuple(unwrap(c) for c in classes)
    return lambda path, module: isinstance(module, wanted)
  if callable(value):
    try:
      inspect.signature(value).bind(("path",), None)
    except (TypeError, ValueError) as err:
      raise JaxckptError(f"blocks[{block_type!r}]={value!r} must take (path, module) and return a bool") from err
    return lambda path, module: bool(value(path, module))
  article = "an" if name == "NNX" else "a"
  raise JaxckptError(f"blocks[{block_type!r}]={value!r}: give {article} {name} module class, a tuple of classes, or "
                     "a predicate (path, module) -> bool")


def describe_blocks_value(value: Any) -> str:
  """A ``blocks=`` value as the user wrote it, for messages: a class name, ``(A, B)`` or a predicate's name."""
  if isinstance(value, type):
    return value.__name__
  if isinstance(value, tuple):
    return "(" + ", ".join(getattr(v, "__name__", repr(v)) for v in value) + ")"
  return getattr(value, "__name__", repr(value))
