"""The command-line flags that choose what to compile (``--model``/``--target``, ``--preset``, shape overrides) and
what to compile it for (``--topology``), shared by every tool's CLI (``jaxckpt-report``, ``jaxckpt-plan``,
``jaxckpt-fit``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from jaxckpt.errors import JaxckptError, TopologyError
from jaxckpt.models._registry import COMPUTE_DTYPES
from jaxckpt.step._targets import DEFAULT_BATCH_SIZE, SHIPPED_MODELS, Target, load_target, shipped_target
from jaxckpt.sharding import TOPOLOGY_FORMS



def add_target_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the flags that choose what to compile: ``--model``/``--target``, ``--preset`` and the shape overrides."""
  what = parser.add_mutually_exclusive_group()
  what.add_argument("--model", default=None, help=f"shipped model: {', '.join(SHIPPED_MODELS)} (default vit; llm: "
                    "Llama, Mistral and Gemma at their real sizes, docs/llm.md)")
  what.add_argument("--target", default=None, metavar="MODULE:FUNCTION", help="your own model or loss: MODULE:FUNCTION names a function that takes no arguments and returns a "
                    "jaxckpt ModelTarget (e.g. jaxckpt.linen_model_target(...)) or LossTarget; the module is imported "
                    "from the current directory or PYTHONPATH (docs/own-model.md)")
  parser.add_argument("--preset", default=None, help="preset of --model (default tiny; llm: llama3.1-8b, "
                      "gemma2-27b, ..., docs/llm.md)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help=f"examples per step (default {DEFAULT_BATCH_SIZE}; gpt, llm: the preset's)")
  parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (sequence models only)")
  parser.add_argument("--layers", type=int, dest="num_layers", default=None, help="override the preset's depth")
  parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default=None,
                      help="dtype of --model's activations and matmuls (default: the preset's; float32, bfloat16 on "
                           "llm's real presets)")
  parser.add_argument("--weight-dtype", choices=list(COMPUTE_DTYPES), default=None,
                      help="dtype of --model llm's parameters and so of AdamW's moments (default: the preset's, "
                           "float32; the other models keep float32 parameters)")
  parser.add_argument("--attention", default=None,
                      help="attention kernel of --model: gpt xla or dot_product_attention; llm auto (splash on a "
                           "TPU from 128 tokens, else xla), xla or splash (default: the preset's)")
  parser.add_argument("--vocab-tiles", type=int, default=None,
                      help="--model llm: the loss computes logits one sequence chunk at a time, in this many chunks "
                           "(MaxText's num_vocab_tiling; divides --seq-len; default 1)")
  parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                      help="scan over layers or --no-scan to unroll them (default: the preset's)")
  parser.add_argument("--structure", default=None,
                      help="checkpoint structure of the layer stack: block, every:K, nested, nested:D (default block)")
  parser.add_argument("--grad-accum-steps", type=int, default=1,
                      help="micro-batches per step, gradients averaged (compare B with remat vs N×B/N accumulated)")
  parser.add_argument("--target-arg", action="append", default=[], metavar="KEY=VALUE", dest="target_args",
                      help="a keyword argument of the --target function (repeatable): KEY=VALUE, the value an int, a "
                           "float, true/false/none or text; --batch-size, --seq-len, --layers and the dtype flags "
                           "reach a --target function as batch_size, seq_len, num_layers, compute_dtype, weight_dtype")


def target_from_args(args: argparse.Namespace) -> Target:
  """The target the flags of :func:`add_target_flags` describe.

  Args:
    args: parsed flags of a parser that :func:`add_target_flags` set up.

  Returns:
    The :class:`~jaxckpt.step.ModelTarget` of ``--model`` or the target ``--target`` names.

  Raises:
    JaxckptError: shape flags with ``--target``, or what :func:`shipped_target` / :func:`load_target` raise.
  """
  if args.target is not None:
    given = [f for f in ("preset", "scan", "structure", "attention", "vocab_tiles")
             if getattr(args, f, None) is not None]
    if args.grad_accum_steps != 1:
      given.append("grad_accum_steps")
    if given:
      flags = ", ".join("--" + f.replace("_", "-") for f in given)
      raise JaxckptError(f"{flags} apply to --model only; a --target sets its own structure (its function may take "
                         f"sizes and dtypes: --batch-size, --seq-len, --layers, dtypes, --target-arg KEY=VALUE)")
    return load_target(args.target, target_kwargs(args))
  if getattr(args, "target_args", None):
    raise JaxckptError("--target-arg applies to --target only (keyword arguments of your target function); "
                       "--model takes its shapes from --batch-size, --seq-len, --layers")
  return shipped_target(
      args.model or "vit", args.preset or "tiny",
      batch_size=args.batch_size,
      seq_len=args.seq_len, num_layers=args.num_layers, compute_dtype=args.compute_dtype, scan=args.scan,
      structure=args.structure, grad_accum_steps=args.grad_accum_steps, weight_dtype=args.weight_dtype,
      attention=args.attention, vocab_tiles=args.vocab_tiles)


TARGET_SIZE_ARGS: tuple[str, ...] = ("batch_size", "seq_len", "num_layers", "compute_dtype", "weight_dtype")
"""The flags' destinations a ``--target`` function receives as keyword arguments of the same names, when given."""


def _value(text: str) -> Any:
  """``--target-arg`` values: int, float, true/false/none, else the text itself."""
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  if lowered == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def target_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  """The keyword arguments of the ``--target`` function: the size and dtype flags that were given
  (:data:`TARGET_SIZE_ARGS`) and every ``--target-arg KEY=VALUE``.

  Raises:
    JaxckptError: a ``--target-arg`` without ``=`` or with a key that is not a Python name, a key given twice, or
      a key that repeats a size flag.
  """
  out = {name: getattr(args, name) for name in TARGET_SIZE_ARGS if getattr(args, name, None) is not None}
  for item in getattr(args, "target_args", None) or []:
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
      raise JaxckptError(f"bad --target-arg {item!r}: write KEY=VALUE with KEY a Python name (e.g. num_experts=8)")
    if key in out:
      raise JaxckptError(f"--target-arg {key}= is given twice (or repeats the flag that sets {key}): give it once")
    out[key] = _value(value)
  return out


def add_topology_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--topology NAME``: compile for a TPU slice without a TPU (:mod:`jaxckpt.sharding`)."""
  parser.add_argument("--topology", default=None, metavar="NAME",
                      help=f"compile for a TPU slice without a TPU, with the TPU compiler of libtpu (pip install -e "
                           f"'.[tpu]'): {TOPOLOGY_FORMS}; --mesh is laid over its chips (default: all on data); "
                           "memory per chip")


def check_topology_flags(args: argparse.Namespace, *, runs: Sequence[str]) -> None:
  """Refuses ``--topology`` together with a flag that runs the step on this machine (there is no TPU to run on).

  Checked before libtpu is looked for, so the line is the same with or without it.

  Args:
    args: parsed flags with ``topology`` (:func:`add_topology_flags`).
    runs: the ``dest`` of every flag that runs steps (``measure``, ``profile``): set (truthy) is refused.

  Raises:
    TopologyError: one line naming both flags.
  """
  if args.topology is None:
    return
  for dest in runs:
    if getattr(args, dest):
      raise TopologyError(f"--{dest.replace('_', '-')} runs steps on this machine, but --topology {args.topology} "
                          "compiles for a TPU slice without a TPU: there is nothing to run them on (drop one of them)")
