"""The command-line flags that choose what to compile (``--model``/``--target``, ``--preset``, shape overrides) and
what to compile it for (``--topology``), shared by every tool's CLI (``jaxckpt-report``, ``jaxckpt-plan``,
``jaxckpt-fit``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxckpt.errors import JaxckptError
from jaxckpt.step._job import runs_beside_refusal
from jaxckpt.sharding import (DEFAULT_MEMORY_FRACTION, MemoryFraction, Placement, TopologyName, check_topology_name,
                              memory_fraction, parse_topology, resolve_placement)
from jaxckpt.training import GPU_XLA_REMAT_PASS, xla_flags
from jaxckpt.models._configs import COMPUTE_DTYPES
from jaxckpt.models.llm import MOE_DISPATCHES
from jaxckpt.models._registry import DEFAULT_BATCH_SIZE
from jaxckpt.step._bounds import check_array_sizes
from jaxckpt.step._targets import SHIPPED_MODELS, Target, load_target, shipped_target, with_grad_accum
from jaxckpt.sharding import TOPOLOGY_FORMS



def add_target_flags(parser: argparse.ArgumentParser) -> None:
  """Adds the flags that choose what to compile: ``--model``/``--target``, ``--preset`` and the shape overrides."""
  what = parser.add_mutually_exclusive_group()
  what.add_argument("--model", default=None, help=f"shipped model: {', '.join(SHIPPED_MODELS)} (default vit; llm: "
                    "Llama, Mistral and Gemma at their real sizes, docs/llm.md)")
  what.add_argument("--target", default=None, metavar="MODULE:FUNCTION",
                    help="your own model or loss: MODULE:FUNCTION names a function, called with the keywords it takes "
                    "of --batch-size, --seq-len, --layers, --scan and each --target-arg, that returns a "
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
                      help="attention kernel of --model: gpt xla or dot_product_attention; llm auto (from 128 tokens "
                           "splash on a TPU, pallas on a GPU, else xla), xla, splash (TPU), pallas or cudnn (GPU: "
                           "Pallas Triton or cuDNN flash attention) (default: the preset's)")
  parser.add_argument("--vocab-tiles", type=int, default=None,
                      help="--model llm: the loss computes logits one sequence chunk at a time, in this many chunks "
                           "(MaxText's num_vocab_tiling; divides --seq-len; default 1)")
  parser.add_argument("--moe-dispatch", default=None, choices=list(MOE_DISPATCHES),
                      help="--model llm, a Mixture of Experts: dropping (capacity factor, one-hot einsums), ragged "
                           "(dropless, jax.lax.ragged_dot), gmm (dropless, the megablox Pallas kernel, TPU), auto "
                           "(gmm on a TPU, else ragged) (default: the preset's, auto)")
  parser.add_argument("--capacity-factor", type=float, default=None,
                      help="--moe-dispatch dropping: each expert takes ceil(S·k/X)·factor tokens of a sequence "
                           "(default 1.25)")
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


def _devices(placement: Placement | None) -> int:
  """The devices a placement compiles for: its topology's chips (a mesh search's), its mesh's, else 1."""
  if placement is None:
    return 1
  return placement.topology.chips if placement.topology is not None else placement.device_count


def target_from_args(args: argparse.Namespace, placement: Placement | None = None) -> Target:
  """The target the flags of :func:`add_target_flags` describe; with sizes given (``--batch-size``, ``--seq-len``,
  ``--layers``), its arrays checked against what any device holds (:func:`jaxckpt.step._bounds.check_array_sizes`:
  one line naming the flag, not an abort inside XLA).

  Args:
    args: parsed flags of a parser that :func:`add_target_flags` set up.
    placement: what the step is compiled for (:func:`placement_from_flags`): its device count bounds the arrays;
      ``None``: one device.

  Returns:
    The :class:`~jaxckpt.step.ModelTarget` of ``--model`` or the target ``--target`` names.

  Raises:
    JaxckptError: shape flags with ``--target``, an array past any device, or what :func:`shipped_target` /
      :func:`load_target` raise.
  """
  if args.target is not None:
    given = [f for f in ("preset", "scan", "structure", "attention", "vocab_tiles", "moe_dispatch", "capacity_factor")
             if getattr(args, f, None) is not None]
    if given:
      flags = ", ".join("--" + f.replace("_", "-") for f in given)
      raise JaxckptError(f"{flags} apply to --model only; a --target sets its own structure (its function may take "
                         f"sizes and dtypes: --batch-size, --seq-len, --layers, dtypes, --target-arg KEY=VALUE)")
    target = with_grad_accum(load_target(args.target, target_kwargs(args)), args.grad_accum_steps)
    if args.batch_size is not None or args.seq_len is not None:
      check_array_sizes(target, devices=_devices(placement))
    return target
  if getattr(args, "target_args", None):
    raise JaxckptError("--target-arg applies to --target only (keyword arguments of your target function); "
                       "--model takes its shapes from --batch-size, --seq-len, --layers")
  target = shipped_target(
      args.model or "vit", args.preset or "tiny",
      batch_size=args.batch_size,
      seq_len=args.seq_len, num_layers=args.num_layers, compute_dtype=args.compute_dtype, scan=args.scan,
      structure=args.structure, grad_accum_steps=args.grad_accum_steps, weight_dtype=args.weight_dtype,
      attention=args.attention, vocab_tiles=args.vocab_tiles, moe_dispatch=args.moe_dispatch,
      capacity_factor=args.capacity_factor)
  given = {k: getattr(args, k) for k in ("batch_size", "seq_len", "num_layers") if getattr(args, k) is not None}
  if given:  # a preset's own sizes fit a device: only sizes given on the command line are traced (~0.05 s)
    check_array_sizes(target, devices=_devices(placement), sizes=given)  # not an abort inside XLA: one line
  return target


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


def add_placement_flags(parser: argparse.ArgumentParser, *, mesh_help: str, auto_mesh: bool = False) -> None:
  """Adds the flags that say where the step is compiled: ``--mesh``, ``--topology``, ``--memory-fraction`` and
  ``--xla-rematerialization`` (:func:`check_placement_flags` reads them once, :func:`placement_from_flags` resolves them).

  Args:
    parser: the tool's parser.
    mesh_help: what ``--mesh`` does in this tool.
    auto_mesh: ``--mesh auto`` is accepted (the fit's mesh search).
  """
  parser.add_argument("--mesh", default=None, metavar="NAME=SIZE[,NAME=SIZE]" + ("|auto" if auto_mesh else ""),
                      help=mesh_help)
  parser.add_argument("--topology", default=None, metavar="NAME",
                      help=f"compile for a TPU slice or an NVIDIA GPU cluster without its hardware: {TOPOLOGY_FORMS}; "
                           "TPU: the TPU compiler of libtpu (pip install -e '.[tpu]'), GPU: XLA:GPU of JAX's CUDA "
                           "plugin (pip install -e '.[gpu]'); --mesh is laid over the chips (default: all on data); "
                           "memory per chip")
  parser.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                      help="with a GPU --topology: the share of each GPU's memory XLA may use, in (0, 1] (default: "
                           f"XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's {DEFAULT_MEMORY_FRACTION}; published recipes "
                           "run at 0.9-0.975)")
  parser.add_argument("--xla-rematerialization", action="store_true",
                      help="with a GPU --topology: keep XLA:GPU's own rematerialization pass on (default off, as "
                           "published GPU recipes run: --xla_disable_hlo_passes=rematerialization)")


class PlacementFlags(NamedTuple):
  """The placement flags, each read once at a tool's door (:func:`check_placement_flags`); what is below takes
  these, never the text again (:func:`placement_from_flags`)."""

  mesh: str | None  # --mesh as given ("auto": the fit's mesh search), read by resolve_placement
  topology: TopologyName | None  # --topology, read (not loaded: no compiler is started by reading it)
  fraction: MemoryFraction | None  # a GPU topology's --memory-fraction (else the environment's or JAX's); None off GPU


def check_placement_flags(args: argparse.Namespace, *, runs: Sequence[str] = (), compiler: bool = True
                          ) -> PlacementFlags:
  """Reads and checks the placement flags without loading anything (a bad flag is one line whatever is
  installed): the topology's name and its compiler, the memory fraction, and no flag that runs steps beside
  ``--topology``.

  Args:
    args: parsed flags of :func:`add_placement_flags`.
    runs: the ``dest`` of every flag that runs steps (``measure``, ``profile``): set (truthy) beside ``--topology``
      is refused.
    compiler: also check that the topology's compiler is installed (:func:`jaxckpt.sharding.check_topology_name`).
      A tool with more flags to check passes False and calls that itself after them (with the returned
      ``topology``), so a bad flag is reported before a missing package.

  Returns:
    The :class:`PlacementFlags`, each flag read once.

  Raises:
    TopologyError: a flag that runs steps beside ``--topology``; a bad topology name or its compiler missing.
    JaxckptError: a bad ``--memory-fraction``, or one (or ``--xla-rematerialization``) without a GPU topology.
  """
  if args.topology is not None:
    for dest in runs:
      if getattr(args, dest):
        raise runs_beside_refusal(f"--{dest.replace('_', '-')}", topology=f"--topology {args.topology}")
  topology = None if args.topology is None else parse_topology(args.topology)
  gpu = topology is not None and topology.is_gpu
  # The flag's fraction, or on a GPU topology the environment's: checked before JAX's CUDA plugin reads
  # XLA_PYTHON_CLIENT_MEM_FRACTION and fails on a bad one with a traceback.
  fraction = memory_fraction(args.memory_fraction) if args.memory_fraction is not None or gpu else None
  for flag, value in (("--memory-fraction", args.memory_fraction), ("--xla-rematerialization",
                                                                    args.xla_rematerialization or None)):
    if value is not None and not gpu:
      raise JaxckptError(f"{flag} applies to a GPU --topology (e.g. --topology h100:8); drop it or give one")
  if compiler and topology is not None:
    check_topology_name(topology)
  return PlacementFlags(args.mesh, topology, fraction)


def placement_from_flags(flags: PlacementFlags) -> Placement:
  """The :class:`~jaxckpt.sharding.Placement` of the placement flags read at the door (``--mesh auto``: the
  topology alone, the mesh left to the search).

  Raises:
    TopologyError, MeshSpecError, JaxckptError: as :func:`jaxckpt.sharding.resolve_placement`.
  """
  mesh = None if flags.mesh == "auto" else flags.mesh
  return resolve_placement(mesh, flags.topology, memory_fraction=flags.fraction)


def compiler_options_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
  """The XLA options the placement flags ask for: ``--xla-rematerialization`` keeps XLA:GPU's pass on (the passes
  ``XLA_FLAGS`` disables stay disabled); ``None`` for jaxckpt's defaults."""
  if not getattr(args, "xla_rematerialization", False):
    return None
  passes = [p for p in xla_flags().get("xla_disable_hlo_passes", "").split(",") if p and p != GPU_XLA_REMAT_PASS]
  return {"xla_disable_hlo_passes": ",".join(passes)}
