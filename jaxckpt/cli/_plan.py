"""``python -m jaxckpt.planner`` / ``jaxckpt-plan``: the least-recompute remat plan that fits a memory budget.

Prints the plan (ranges of layers, what each saves, predicted vs compiled bytes, recompute FLOPs, compiles taken);
``--explain`` adds the candidate table, ``--export`` prints the plan as plain JAX code, ``--json`` writes it all.
``--mincut CAP`` instead plans the whole loss under a cap on saved activation bytes (the policy ``mincut:CAP``,
:mod:`jaxckpt.planner._whole`) and prints its regions and every saved value with its source line.
Exit status 0 with a plan, 2 for bad arguments or a budget (or cap) no plan meets (one line on stderr, stating the
least memory reachable and the plan reaching it).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from jaxckpt.cli._parser import EXIT_OUTPUT, CLIParser, reference_epilog
from jaxckpt._paths import check_output_files, write_atomically
from jaxckpt.errors import JaxckptError, OutputWriteError
from jaxckpt.planner._export import export_code, linen_export_code
from jaxckpt.planner._plan import MAX_ROUNDS, plan_policy
from jaxckpt.planner._segmented import mincut_policy
from jaxckpt.policies._model import MINCUT, Budget, MinCut, parse_model_policy
from jaxckpt.cli._flags import (add_placement_flags, add_target_flags, check_placement_flags, compiler_options_from_args,
                               placement_from_flags, target_from_args)
from jaxckpt.rendering._tables import wrap_lines
from jaxckpt.step._build import target_block_types


PROG = "jaxckpt-plan"


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser."""
  parser = CLIParser(
      prog=PROG,
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=reference_epilog(
          notes=["budgets: budget:<size> (compiled footprint = argument + output + temp − alias ≤ size; binary units "
                 "B, KiB,", "  MiB, GiB, TiB), budget:<p>% (compiled temp ≤ p% of no-remat temp), auto or "
                 "auto:margin=<p>% (footprint", "  ≤ this device's memory − margin; a GPU's × its memory fraction; "
                 "CPU: available RAM)",
                 "use the plan: --policy '<printed policy>' in the experiments, or jaxckpt.set_policy(model, "
                 "plan.policy)"],
          examples=[f"{PROG} --model gpt --preset small --budget 50% --explain",
                    f"{PROG} --model vit --preset small --budget 8MiB --export",
                    f"{PROG} --model gpt --preset gpt2-small --budget auto:margin=20% --json plan.json",
                    f"{PROG} --model gpt --preset small --mincut 25%",
                    f"{PROG} --model gpt --preset small --topology v5e:2x2 --budget 50%"]),
  )
  add_target_flags(parser)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--budget", metavar="BUDGET",
                    help="budget:<size> | budget:<p>%% | auto[:margin=<p>%%] (the 'budget:' prefix may be left out)")
  what.add_argument("--mincut", metavar="CAP",
                    help="a whole-loss min-cut plan saving at most CAP of activations: <size> or <p>%% of no remat's "
                         "(the policy mincut:CAP); prints its regions and saved values (always: --explain and "
                         "--max-rounds are for --budget)")
  add_placement_flags(parser, mesh_help="plan for the step sharded over a device mesh (axes data, fsdp, expert, "
                      "tensor; product = device count, or --topology's chips): the budget is per device")
  parser.add_argument("--explain", action="store_true", help="also print every candidate per layer")
  parser.add_argument("--export", action="store_true", help="also print the plan as plain JAX code")
  parser.add_argument("--max-rounds", type=int, default=MAX_ROUNDS,
                      help=f"verification compiles after the none/full anchors (default {MAX_ROUNDS})")
  parser.add_argument("--json", default=None, metavar="FILE", help="write the plan, its compiles and candidates")
  parser.add_argument("--wide", action="store_true",
                      help="no wrapping: one line per range and candidate (default: fit the terminal, COLUMNS or 100)")
  return parser


def _budget(text: str) -> Budget:
  spec = text if text.split(":")[0].strip() in ("budget", "auto") else f"budget:{text}"
  parsed = parse_model_policy(spec)
  if not isinstance(parsed, Budget):  # unreachable: the prefix makes it a budget
    raise JaxckptError(f"--budget {text!r} is not a budget")
  return parsed


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; returns the exit status (0 a plan, 2 bad arguments or an infeasible budget)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    if args.max_rounds < 1:
      raise JaxckptError(f"--max-rounds must be ≥ 1, got {args.max_rounds}")
    check_output_files({"--json": args.json})
    flags = check_placement_flags(args)
    if args.mincut is not None:
      if args.topology is not None or args.mesh is not None:
        flag = "--topology" if args.topology is not None else "--mesh"
        raise JaxckptError(f"--mincut plans from the traced loss without compiling it, so {flag} would change "
                           f"nothing: compare the policy mincut:{args.mincut} with jaxckpt-report {flag} instead")
      return _mincut(parser, args)
    budget = _budget(args.budget)
    placement = placement_from_flags(flags)
    target = target_from_args(args, placement)
    plan = plan_policy(target, budget, max_rounds=args.max_rounds, mesh=placement,
                       compiler_options=compiler_options_from_args(args))
    where = placement.compiled_for()
    if args.json:  # before the plan is printed: a closed pipe or Ctrl-C loses no file
      _write_json(args.json, {"model": target.name, "preset": target.preset, **where, **plan.to_json()})
  except OutputWriteError as err:  # the work is done; the file could not be written (a full disk): its old one is kept
    return parser.fail(err, status=EXIT_OUTPUT)
  except JaxckptError as err:
    return parser.fail(err)
  if placement.header() is not None:
    print(placement.header())
  print(plan.explain(candidates=args.explain, wide=args.wide))
  print(f"policy: {plan.policy}")
  if args.export:
    print()
    linen_model = getattr(target, "model", None)  # a Linen target: nn.remat code
    print(linen_export_code(plan, linen_model) if linen_model is not None
          else export_code(plan, tuple(target_block_types(target))), end="")
  if args.json:
    print(f"wrote {os.path.abspath(args.json)}")
  return 0


def _mincut(parser: CLIParser, args: argparse.Namespace) -> int:
  """``--mincut CAP``: the segmented whole-loss plan (:func:`jaxckpt.planner._whole.mincut_policy`), explained."""
  if args.export:
    raise JaxckptError("--export prints per-block policies; a mincut plan remats the whole loss: use the policy "
                       f"mincut:{args.mincut} in jaxckpt-report, or jaxckpt.planner._whole in your code (docs/plans.md)")
  parsed = parse_model_policy(f"{MINCUT}:{args.mincut}")
  if not isinstance(parsed, MinCut):  # unreachable: the prefix makes it a mincut
    raise JaxckptError(f"--mincut {args.mincut!r} is not a cap")
  target = target_from_args(args)
  policy = mincut_policy(target, parsed)
  if args.json:  # before the plan is printed: a closed pipe or Ctrl-C loses no file
    plan = policy.plan
    try:
      _write_json(args.json, {"model": target.name, "preset": target.preset, "policy": str(policy),
                              "activation_bytes": plan.activation_bytes, "recompute_flops": plan.flops,
                              "mip_gap": plan.mip_gap,
                              "regions": [{"equations": [r.start, r.stop], "saved": list(names)}
                                          for r, names in zip(plan.segments.regions, plan.names)]})
    except OutputWriteError as err:
      return parser.fail(err, status=EXIT_OUTPUT)
  print("\n".join(wrap_lines(policy.plan.explain().split("\n"), wide=args.wide, indent="    ")))
  print(f"policy: {policy}")
  if args.json:
    print(f"wrote {os.path.abspath(args.json)}")
  return 0


def _write_json(path: str, data: dict) -> None:
  """``data`` as indented JSON at ``path``, whole or not at all (:func:`jaxckpt._paths.write_atomically`)."""
  text = json.dumps(data, indent=1)
  write_atomically(path, lambda f: f.write(text))
