"""``python -m jaxckpt.fit`` / ``jaxckpt-fit``: which micro-batch, accumulation and policy fit a device, and which
trains fastest, from a handful of compiles, verified.

The CLI parses flags, builds a target and calls :func:`jaxckpt.fit.plan_fit`; exit status 0, 1 when an output file
could not be written, or 2 for bad input (one line on stderr, no traceback). The output files are written before
the tables are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from jaxckpt.cli._parser import EXIT_OUTPUT, CLIParser, reference_epilog, progress_enabled
from jaxckpt._paths import check_output_files, write_atomically
from jaxckpt.errors import JaxckptError, OutputWriteError
from jaxckpt.fit._html import to_html
from jaxckpt.fit._meshes import DEFAULT_MAX_MESHES, MeshSearch, search_meshes
from jaxckpt.fit._names import CUSTOM_SEARCH, DEFAULT_CUSTOM_LISTS
from jaxckpt.fit._plan import FitPlan, plan_fit
from jaxckpt.fit._plot import plot_fit
from jaxckpt.fit._tables import mesh_table, to_table
from jaxckpt.fit._search import DEFAULT_MAX_BATCH, DEFAULT_POLICIES, fit_policies, resolve_memory
from jaxckpt.fit._speed import ACCELERATORS, accelerator
from jaxckpt.policies._model import parse_model_policy
from jaxckpt.cli._flags import (add_placement_flags, add_target_flags, check_placement_flags, compiler_options_from_args,
                               PlacementFlags, placement_from_flags, target_from_args)
from jaxckpt.sharding import check_topology_name
from jaxckpt.step._job import runs_beside_refusal
from jaxckpt._units import parse_bytes


PROG = "jaxckpt-fit"


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser."""
  parser = CLIParser(
      prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=reference_epilog(
          notes=["method: per policy, compile at two batch sizes, fit footprint = a + b·batch (argument + output +",
                 "  temp − alias bytes), predict the largest batch within --memory, then compile it and its "
                 "successor:", "  the first must fit and the second must not (else correct and re-verify; bisect "
                 "where not affine)",
                 "time model (--global-batch-size): k × (max(FLOPs/peak, bytes/bandwidth) + overhead) per "
                 "micro-batch", f"  b = G/k; devices: {', '.join(ACCELERATORS)}, cpu (calibrated: measured matmul "
                 "FLOP/s, bandwidth", "  by working-set size, dispatch overhead), or --peak-flops/--bandwidth"],
          examples=[f"{PROG} --model gpt --preset small --memory 16GiB --html fit.html",
                    f"{PROG} --model gpt --preset small --memory 4GiB --global-batch-size 256 --device h100",
                    f"{PROG} --model gpt --preset small --memory 4GiB --batch-size 8 --max-seq-len 4096",
                    f"{PROG} --model vit --preset small --memory auto --global-batch-size 512 --measure --json "
                    "fit.json",
                    f"XLA_FLAGS=--xla_force_host_platform_device_count=8 {PROG} --model gpt --mesh data=2,fsdp=4 "
                    "--memory 1GiB",
                    f"{PROG} --model gpt --preset gpt2-small --topology v5e:2x2 --global-batch-size 64  # TPU "
                    "compiler, no TPU",
                    f"{PROG} --model llm --preset llama3.1-8b --topology v6e:16x16 --seq-len 8192 "
                    "--global-batch-size 1024 --mesh auto",
                    f"{PROG} --model llm --preset llama3.1-70b --topology h200:32x8 --seq-len 8192 "
                    "--global-batch-size 512  # XLA:GPU, no GPU; the mesh searched"]))
  add_target_flags(parser)
  add_placement_flags(parser, auto_mesh=True,
                      mesh_help="compile sharded over a device mesh (axes data, fsdp, expert, tensor): memory per "
                                "device; auto (with --topology and --global-batch-size; the default there on more than "
                                "one chip): search the mesh too")
  parser.add_argument("--max-meshes", type=int, default=DEFAULT_MAX_MESHES, metavar="N",
                      help=f"--mesh auto: meshes compiled, the best N by a lower bound of their step time (default "
                           f"{DEFAULT_MAX_MESHES})")
  parser.add_argument("--memory", default="auto", metavar="SIZE|auto",
                      help="device memory to fit, binary units (16GiB), or auto: this device less 10%% (default; "
                           "--topology: the chip's HBM, a GPU's memory × --memory-fraction, less 10%%)")
  parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="SPEC",
                      help=f"policies to fit (default {' '.join(DEFAULT_POLICIES)}; min_saved, mincut:<cap> too; "
                           f"{CUSTOM_SEARCH}: MaxText's custom lists, device/offload/recompute per checkpoint name, "
                           "chosen by the time model, with --global-batch-size)")
  parser.add_argument("--custom-lists", type=int, default=None, metavar="N",
                      help=f"{CUSTOM_SEARCH}: name lists fitted at most (default {DEFAULT_CUSTOM_LISTS}; each about 3 "
                           "compiles): the best predicted, and after a compile over its prediction the next best "
                           "with what it taught")
  parser.add_argument("--min-batch", type=int, default=None, help="smallest micro-batch (default 1 mesh unit)")
  parser.add_argument("--max-batch", type=int, default=None,
                      help=f"largest micro-batch searched (default {DEFAULT_MAX_BATCH}; G with --global-batch-size, "
                           "and at most G)")
  parser.add_argument("--max-seq-len", type=int, default=None, metavar="T",
                      help="instead of the batch: the largest sequence length ≤ T at --batch-size (sequence models)")
  parser.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                      help="examples per optimizer step: choose policy, micro-batch b and accumulation G/b")
  parser.add_argument("--device", default=None, help=f"time model device: {', '.join(ACCELERATORS)}, cpu "
                                                     "(default: this one, CPU measured; --topology: its chip)")
  parser.add_argument("--peak-flops", type=float, default=None, help="FLOP/s of the time model's device")
  parser.add_argument("--bandwidth", type=float, default=None, help="memory bytes/s of the time model's device")
  parser.add_argument("--overhead", type=float, default=None, help="seconds per micro-step (default 20e-6)")
  parser.add_argument("--host-memory", dest="host_memory_bytes", default=None, metavar="SIZE",
                      help="host memory per device that offloaded residuals may fill, binary units (default: the "
                           "chip table's DRAM per chip; a candidate over it does not fit)")
  parser.add_argument("--measure", nargs="?", const=6, default=0, type=int, metavar="N",
                      help="time N (default 6) configurations on this device, spanning policies and micro-batches "
                           "(the fastest estimate first), and rank by measurement")
  parser.add_argument("--rank-compiled", type=int, default=None, metavar="N",
                      help="with --topology and --global-batch-size: compile the N fastest configurations by the "
                           "roofline as they will run and rank them by their compiled programs' step times "
                           "(docs/timing.md); default 3 on a named mesh, 1 per mesh in the mesh search; 0: the "
                           "roofline alone")
  parser.add_argument("--jobs", type=int, default=None, metavar="N",
                      help="compiles at once: a predicted batch and its successor together (default 2 with "
                           "--topology, whose compiles take seconds to minutes, else 1)")
  parser.add_argument("--json", default=None, metavar="FILE", help="write the plan, its fits and candidates (.json)")
  parser.add_argument("--plot", default=None, metavar="FILE", help="footprint vs batch per policy (.png, .svg, .pdf)")
  parser.add_argument("--html", default=None, metavar="FILE",
                      help="one HTML page: the tables and the footprint-vs-batch plot (.html)")
  parser.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar at a terminal, no progress lines on stderr elsewhere (a log)")
  parser.add_argument("--wide", action="store_true",
                      help="one line per table row, whatever the terminal's width (default: fit the width)")
  return parser


def _host_memory(text: str | None) -> int | None:
  """``--host-memory``'s bytes (> 0); ``None`` when not given (the chip table's).

  Raises:
    JaxckptError: not a size in binary units, or 0.
  """
  if text is None:
    return None
  try:
    value = parse_bytes(text)
  except ValueError as err:
    raise JaxckptError(f"--host-memory: {err}") from None
  if value <= 0:
    raise JaxckptError(f"--host-memory {text} must be > 0")
  return value


def _search(args: argparse.Namespace, options: FitOptions, target, placement, device, on_compile, bar,
            started_at: float) -> MeshSearch:
  """``--mesh auto``: :func:`jaxckpt.fit.search_meshes` with a progress line per mesh settled (stderr; through the
  bar at a terminal)."""
  def on_mesh(option) -> None:
    status = f"fitting (bound {option.bound_s * 1e3:.3g} ms)" if option.status == "fitting" else option.status
    message = f"jaxckpt-fit: mesh {option.name}: {status} ({time.perf_counter() - started_at:.0f} s elapsed)"
    if bar.disable:
      print(message, file=sys.stderr, flush=True)
    else:
      bar.write(message, file=sys.stderr)

  return search_meshes(target, options.policies, args.memory, topology=placement.topology,
                       memory_fraction=placement.fraction,
                       global_batch=args.global_batch_size, device=device, max_meshes=args.max_meshes,
                       on_compile=on_compile, compiler_options=compiler_options_from_args(args),
                       on_mesh=on_mesh if args.progress else None, min_batch=args.min_batch, jobs=args.jobs,
                       custom_lists=options.custom_lists,
                       **({} if options.max_batch is None else {"max_batch": options.max_batch}),
                       **({} if args.rank_compiled is None else {"rank_compiled": args.rank_compiled}))


class FitOptions(NamedTuple):
  """What the fit's flags resolve to at its door (:func:`_check_args`), read once; the namespace is never written."""

  mesh: str | None  # --mesh, or "auto" (more than one chip of a --topology, a --global-batch-size and no mesh named)
  policies: tuple[Any, ...]  # --policies parsed (jaxckpt.policies.parse_model_policy), or CUSTOM_SEARCH
  custom_lists: int  # --custom-lists, else DEFAULT_CUSTOM_LISTS
  max_batch: int | None  # --max-batch, else DEFAULT_MAX_BATCH without a --global-batch-size (with one: G)


def _check_args(args: argparse.Namespace, flags: PlacementFlags) -> FitOptions:
  """Checks the flags that need no compile (output paths, flag combinations, policy specs), then that the
  topology's compiler is installed, before any work.

  Args:
    args: the parsed flags.
    flags: the placement flags read at the door (:func:`jaxckpt.cli._flags.check_placement_flags`).

  Returns:
    The :class:`FitOptions`.

  Raises:
    JaxckptError: the first bad flag or combination, naming it. TopologyError: the topology's compiler missing.
  """
  if (args.batch_size is not None and args.max_seq_len is None) or args.grad_accum_steps != 1:
    raise JaxckptError("--batch-size and --grad-accum-steps are what jaxckpt-fit chooses; give --min-batch, "
                       "--max-batch or --global-batch-size instead (--batch-size goes with --max-seq-len)")
  if args.max_seq_len is not None and (args.global_batch_size is not None or args.seq_len is not None):
    raise JaxckptError("--max-seq-len searches the sequence length at --batch-size; drop --global-batch-size and "
                       "--seq-len")
  check_output_files({f"--{flag}": getattr(args, flag) for flag in ("json", "plot", "html")})
  if args.plot is not None and os.path.splitext(args.plot)[1].lower() not in (".png", ".svg", ".pdf"):
    raise JaxckptError(f"--plot {args.plot}: use a .png, .svg or .pdf file")
  if args.html is not None and os.path.splitext(args.html)[1].lower() not in (".html", ".htm"):
    raise JaxckptError(f"--html {args.html}: use a .html file")
  if args.measure < 0:
    raise JaxckptError(f"--measure {args.measure} must be ≥ 0")
  topology = flags.topology
  if args.device is not None and topology is not None and args.device != topology.key:
    raise JaxckptError(f"--device {args.device} times another chip than --topology {args.topology} compiles for "
                       f"({topology.key}): drop --device (the topology's chip is the time model's)")
  if args.rank_compiled is not None and args.rank_compiled < 0:
    raise JaxckptError(f"--rank-compiled {args.rank_compiled} must be ≥ 0 (0: rank by the roofline alone)")
  if args.rank_compiled is not None and (args.topology is None or args.global_batch_size is None):
    missing = " and ".join(f for f, v in (("--topology", args.topology), ("--global-batch-size",
                                                                         args.global_batch_size)) if v is None)
    raise JaxckptError(f"--rank-compiled {args.rank_compiled} times the configurations of a --global-batch-size "
                       f"compiled for a --topology: give {missing}")
  if args.jobs is not None and args.jobs < 1:
    raise JaxckptError(f"--jobs {args.jobs} must be ≥ 1")
  if args.measure and args.global_batch_size is None:
    raise JaxckptError("--measure ranks the configurations of a --global-batch-size; give one")
  if args.measure and args.mesh:
    raise runs_beside_refusal("--measure", mesh="--mesh")
  if args.mesh == "auto" and (args.topology is None or args.global_batch_size is None or args.max_seq_len):
    raise JaxckptError("--mesh auto searches the mesh of a --topology for a --global-batch-size: give both "
                       "(and no --max-seq-len)")
  mesh = args.mesh
  if mesh is None and topology is not None and args.global_batch_size is not None and args.max_seq_len is None \
      and topology.chips > 1:
    mesh = "auto"  # more than one chip and no mesh named: the mesh is part of the answer
  if args.max_meshes < 1:
    raise JaxckptError(f"--max-meshes {args.max_meshes} must be ≥ 1")
  if args.min_batch is not None and args.min_batch < 1:
    raise JaxckptError(f"--min-batch {args.min_batch} must be ≥ 1")
  if args.min_batch is not None and args.global_batch_size is not None and args.min_batch > args.global_batch_size:
    raise JaxckptError(f"--min-batch {args.min_batch} > --global-batch-size {args.global_batch_size}: no "
                       "micro-batch between")
  searched = False
  parsed = []
  for spec in args.policies:
    if spec.strip() == CUSTOM_SEARCH:
      parsed.append(CUSTOM_SEARCH)
      searched = True
      if args.max_seq_len is not None:
        raise JaxckptError(f"--policies {CUSTOM_SEARCH} chooses name lists for a --global-batch-size; it does not "
                           "go with --max-seq-len (drop one of them)")
      if args.global_batch_size is None:
        raise JaxckptError(f"--policies {CUSTOM_SEARCH} chooses by the step-time model of a --global-batch-size; "
                           "give one")
      continue
    if spec.strip().lower().startswith("custom"):
      raise JaxckptError(f"--policies {spec}: unknown; did you mean {CUSTOM_SEARCH} (MaxText's custom lists chosen "
                         "by the time model), or save_and_offload_only_these_names:SAVE/OFFLOAD (a list you give)?")
    parsed.append(parse_model_policy(spec))  # parsed once, here: a typo exits 2 before any compile
  if args.custom_lists is not None and not searched:
    raise JaxckptError(f"--custom-lists {args.custom_lists} goes with --policies {CUSTOM_SEARCH}; add it or drop "
                       "--custom-lists")
  custom_lists = DEFAULT_CUSTOM_LISTS if args.custom_lists is None else args.custom_lists
  if custom_lists < 1:
    raise JaxckptError(f"--custom-lists {custom_lists} must be ≥ 1")
  max_batch = args.max_batch
  if max_batch is None and args.global_batch_size is None:
    max_batch = DEFAULT_MAX_BATCH  # with a global batch: G, or the one given (at most G)
  if topology is not None:  # every flag before the compiler: a bad flag is one line whatever is installed
    check_topology_name(topology)
  return FitOptions(mesh, tuple(parsed), custom_lists, max_batch)


def _plan_options(args: argparse.Namespace, fit: FitOptions, options: Mapping[str, Any] | None) -> dict[str, Any]:
  """:func:`jaxckpt.fit.plan_fit`'s keyword arguments from the flags given (a flag not given keeps its default)."""
  given = {"max_batch": fit.max_batch, "compiler_options": options, "rank_compiled": args.rank_compiled,
           "custom_lists": None if args.global_batch_size is None else fit.custom_lists}
  return {"min_batch": args.min_batch, "jobs": args.jobs, **{k: v for k, v in given.items() if v is not None}}


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; returns the exit status (0 done, 2 bad input)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  bar = None
  try:
    flags = check_placement_flags(args, runs=("measure",), compiler=False)
    fit = _check_args(args, flags)
    search = None
    auto = fit.mesh == "auto"
    placement = placement_from_flags(flags._replace(mesh=fit.mesh))
    chip = None if placement.topology is None and placement.mesh is None else placement.device
    resolve_memory(args.memory, placement=placement)
    target = target_from_args(args, placement)
    device = None
    timing = [f for f, v in (("--device", args.device), ("--peak-flops", args.peak_flops),
                             ("--bandwidth", args.bandwidth), ("--overhead", args.overhead),
                             ("--host-memory", args.host_memory_bytes)) if v is not None]
    if timing and args.global_batch_size is None:
      raise JaxckptError(f"{', '.join(timing)} set the time model that ranks configurations of a global batch; "
                         "give --global-batch-size G (without it only the largest batch per policy is planned)")
    if args.global_batch_size is not None:
      device = accelerator(args.device, peak_flops=args.peak_flops, bandwidth=args.bandwidth,
                           overhead_s=args.overhead, device=chip,
                           host_memory_bytes=_host_memory(args.host_memory_bytes))
    bar = tqdm(desc="compiles", unit="compile", disable=not progress_enabled(args.progress),
               leave=False)

    lines = args.progress and bar.disable  # not a terminal (a log, CI): whole progress lines instead of a bar
    started_at, count = time.perf_counter(), [0]

    def on_compile(policy: str, batch: int) -> None:
      bar.set_postfix_str(f"{policy} @ {batch}")
      bar.update(1)
      count[0] += 1
      if lines:
        print(f"jaxckpt-fit: compile {count[0]}: {policy} at {batch} ({time.perf_counter() - started_at:.0f} s "
              "elapsed)", file=sys.stderr, flush=True)

    options = compiler_options_from_args(args)
    if auto:
      search = _search(args, fit, target, placement, device, on_compile, bar, started_at)
      plan = search.winner.plan
      placement = placement.with_mesh(dict(search.winner.shape))
    elif args.max_seq_len is not None:
      started = time.perf_counter()
      limit, source = resolve_memory(args.memory, placement=placement)
      fits = fit_policies(target, fit.policies, limit, mesh=placement.mesh, on_compile=on_compile, axis="seq_len",
                          min_batch=1, max_batch=args.max_seq_len, probes=(256, 1024), jobs=args.jobs,
                          compiler_options=options)
      plan = FitPlan(fits=tuple(fits), limit_bytes=limit, memory_source=source, device=None, choice=None,
                     seconds=time.perf_counter() - started, axis="seq_len", compiled_for=placement.compiled_for())
    else:
      plan = plan_fit(target, fit.policies, args.memory, global_batch=args.global_batch_size, device=device,
                      measure=args.measure, mesh=placement, on_compile=on_compile,
                      **_plan_options(args, fit, options))
  except JaxckptError as err:
    if bar is not None:
      bar.close()
    return parser.fail(err)
  bar.close()
  try:
    written = _write_outputs(args, plan, search)  # before the tables: a closed pipe or Ctrl-C loses no file
  except OutputWriteError as err:  # the work is done; a file could not be written (a full disk): its old one is kept
    return parser.fail(err, status=EXIT_OUTPUT)
  if placement.header() is not None:
    print(placement.header())
  if search is not None:
    print(mesh_table(search, wide=args.wide), end="\n\n")
    print(f"the winner's mesh, {search.winner.name}:")
  print(to_table(plan, wide=args.wide), end="")
  for path in written:
    print(f"wrote {os.path.abspath(path)}")
  return 0


def _write_outputs(args: argparse.Namespace, plan: FitPlan, search: MeshSearch | None) -> list[str]:
  """Writes ``--json``, ``--plot`` and ``--html`` (each whole or not at all); returns the paths written.

  Raises:
    OutputWriteError: a file could not be written.
  """
  if args.json:
    text = json.dumps(search.as_json() if search is not None else plan.as_json(), indent=1)
    write_atomically(args.json, lambda f: f.write(text))
  if args.plot:
    plot_fit(plan, args.plot)
  if args.html:
    page = to_html(plan)
    write_atomically(args.html, lambda f: f.write(page))
  return [p for p in (args.json, args.plot, args.html) if p]
