"""``python -m jaxckpt.report`` / ``jaxckpt-report``: compare remat policies on a model's full train step.

The CLI only parses flags, builds a target and calls :func:`jaxckpt.report.build_report`; exit status 0 if any policy
row succeeded, 1 if none did (or an output file could not be written), 2 for bad arguments (one line on stderr, no
traceback). The output files are written before the table is printed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


from jaxckpt.cli._parser import EXIT_OUTPUT, CLIParser, progress_enabled, reference_epilog
from jaxckpt._paths import check_output_dir, check_output_files
from jaxckpt.errors import JaxckptError, OutputWriteError
from jaxckpt.report._build import build_report
from jaxckpt.training._profile import check_profile_dir
from jaxckpt.report._html import PLOTLYJS_MODES
from jaxckpt.report._outputs import to_table, write_outputs
from jaxckpt.report._plot import PLOT_SUFFIXES, plot_format
from jaxckpt.report._policies import ALL, check_policy_names, expand_policies
from jaxckpt.step._build import target_block_types
from jaxckpt.cli._flags import (add_placement_flags, add_target_flags, check_placement_flags, compiler_options_from_args,
                               placement_from_flags, target_from_args)
from jaxckpt.sharding import check_topology_name
from jaxckpt.step._job import runs_beside_refusal


PROG = "jaxckpt-report"


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser."""
  parser = CLIParser(
      prog=PROG,
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=reference_epilog(
          policy_words=f"{ALL} (every policy worth comparing on the target), ",
          notes=["--target package.module:function: function() returns a jaxckpt ModelTarget or LossTarget (e.g.",
                 "  jaxckpt.nnx_model_target(make_model, batch, loss='next_token', blocks={'layer': MyLayer}) or",
                 "  jaxckpt.linen_model_target(module, tokens, loss='next_token', blocks={'layer': MyBlock})); its",
                 "  checkpoint names are the layers' attribute paths (attn.q_proj, mlp.up_proj): --list-blocks prints "
                 "them"],
          examples=[f"{PROG} --model vit --preset small --policies all --html report.html --plot pareto.png",
                    f"{PROG} --model vit --policies none attn=dots_saveable,mlp=full save_only_these_names:qkv "
                    "--measure",
                    f"{PROG} --model vit --policies none full dots_saveable --profile prof/  # xprof --logdir prof",
                    f"{PROG} --model gpt --preset small --seq-len 128 --policies all",
                    f"{PROG} --target mypkg.targets:target --policies none full --json report.json",
                    f"XLA_FLAGS=--xla_force_host_platform_device_count=8 {PROG} --model gpt --preset small --mesh "
                    "fsdp=8 --policies none full",
                    f"{PROG} --model gpt --preset small --topology v5e:2x2 --policies none full dots_saveable "
                    "--compare-cpu",
                    f"{PROG} --model llm --preset llama2-7b --topology h100:8 --mesh fsdp=8 --seq-len 4096 "
                    "--policies full minimal_flash"]),
  )
  add_target_flags(parser)
  add_placement_flags(parser, mesh_help="compile sharded over a device mesh, axes data (batch), fsdp (batch, "
                      "parameters, optimizer state) and tensor (heads, MLP width, vocabulary), product = device count "
                      "(or --topology's chips), e.g. data=4,fsdp=2; memory is then per device")
  parser.add_argument("--compare-cpu", action="store_true",
                      help="with --topology: also compile each policy on XLA:CPU at the per-chip batch and show its "
                           "footprint and temp beside the TPU's (data-only meshes)")
  parser.add_argument("--policies", nargs="+", default=[ALL], metavar="SPEC", help="policy specs (default all)")
  parser.add_argument("--measure", action="store_true", help="also run each policy: step time and measured peak")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per policy with --measure (default 5)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
  parser.add_argument("--jobs", type=int, default=1, help="XLA compilations at once (default 1)")
  parser.add_argument("--no-residuals", dest="residuals", action="store_false", help="skip the residual analysis")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="XProf traces of a few warm steps per policy into DIR/<policy>/ (xprof --logdir DIR)")
  parser.add_argument("--profile-steps", type=int, default=3, help="traced steps per policy with --profile (default 3)")
  parser.add_argument("--xla-dump", default=None, metavar="DIR", help="keep XLA's memory reports per policy in DIR")
  parser.add_argument("--json", default=None, metavar="FILE", help="write every row and the target (.json)")
  parser.add_argument("--csv", default=None, metavar="FILE", help="write the rows as a table (.csv)")
  parser.add_argument("--markdown", default=None, metavar="FILE", help="write the table as Markdown (.md)")
  parser.add_argument("--html", default=None, metavar="FILE",
                      help="one self-contained page: interactive charts, sortable tables")
  parser.add_argument("--plotlyjs", choices=list(PLOTLYJS_MODES), default="inline",
                      help="--html gets plotly.js inline (default; works offline, ~4.8 MB) or from its CDN (small)")
  parser.add_argument("--plot", default=None, metavar="FILE",
                      help="static Pareto chart (memory vs FLOPs / time); format from the suffix: "
                           + ", ".join(PLOT_SUFFIXES))
  parser.add_argument("--wide", action="store_true",
                      help="one line per policy, every column (default: fit the terminal, COLUMNS or 100 characters, "
                           "long policies as labels with a legend)")
  parser.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bars (there are none unless stdout and stderr are a terminal)")
  parser.add_argument("--list-blocks", action="store_true",
                      help="print the target's block types and the checkpoint names each emits (your own model's "
                           "automatic names included) and exit")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point; returns the exit status (0 some row ok, 1 none, 2 bad arguments)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    flags = check_placement_flags(args, runs=("measure", "profile"), compiler=False)
    for flag in ("steps", "warmup", "jobs", "profile_steps"):
      if getattr(args, flag) < 1:
        raise JaxckptError(f"--{flag.replace('_', '-')} must be ≥ 1, got {getattr(args, flag)}")
    check_output_files({f"--{flag}": getattr(args, flag) for flag in ("json", "csv", "markdown", "html", "plot")})
    check_output_dir("--xla-dump", args.xla_dump)
    if args.plot is not None:
      plot_format(args.plot, flag="plot")
    if args.profile is not None:
      check_profile_dir(args.profile, flag="--profile")
    if args.compare_cpu and args.topology is None:
      raise JaxckptError("--compare-cpu puts XLA:CPU's figures beside a topology's: give --topology too")
    if args.mesh is not None and args.topology is None and (args.measure or args.profile is not None):
      raise runs_beside_refusal("--measure" if args.measure else "--profile", mesh="--mesh")
    policies = expand_policies(args.policies, {}, keep_all=True)  # parsed once, here: a typo exits 2 now
    if flags.topology is not None:
      check_topology_name(flags.topology)  # after every flag: a bad flag is one line whatever is installed
    placement = placement_from_flags(flags)  # a bad mesh, no compiler: exit 2 before the target is built
    target = target_from_args(args, placement)
    if args.list_blocks:
      for block, block_names in target_block_types(target).items():
        print(f"{block}: {', '.join(sorted(block_names)) or '(no checkpoint names)'}")
      return 0
    check_policy_names(policies, lambda: target_block_types(target))  # a checkpoint-name typo exits 2 too
    report = build_report(target, policies, measure=args.measure, steps=args.steps, warmup=args.warmup,
                          xla_dump=args.xla_dump, jobs=args.jobs, residuals=args.residuals,
                          progress=progress_enabled(args.progress), mesh=placement, profile=args.profile,
                          profile_steps=args.profile_steps, compare_cpu=args.compare_cpu,
                          compiler_options=compiler_options_from_args(args))
    written = write_outputs(report, json_path=args.json, csv_path=args.csv, markdown_path=args.markdown,
                            html_path=args.html, plot_path=args.plot, plotlyjs=args.plotlyjs)  # before the table
  except OutputWriteError as err:  # the work is done; a file could not be written (a full disk): its old one is kept
    return parser.fail(err, status=EXIT_OUTPUT)
  except JaxckptError as err:
    return parser.fail(err)
  print(to_table(report, wide=args.wide))
  for path in written:
    print(f"wrote {os.path.abspath(path)}")
  if args.profile is not None:
    runs = [r["profile"]["dir"] for r in report.rows if r.get("profile")]
    print(f"wrote {len(runs)} XProf run(s) under {os.path.abspath(args.profile)}: xprof --logdir {args.profile}")
  return 0 if report.ok else 1
