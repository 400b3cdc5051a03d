"""Benchmark 1, policy sweep: temp bytes, true FLOPs and step time of every policy, each as a ratio to ``none``.

Usage: ``python benchmarks/policy_sweep.py [--preset small] [--policies all …] [--structures nested] [--rounds 7]``.

The model is the GPT decoder (:mod:`jaxckpt.models._gpt`, ``small`` preset: L=6 d=256 H=4 T=256 B=8, byte vocabulary) and
the step is the full AdamW train step the report compiles. Per row:

- compiled ``temp_bytes`` and ``footprint_bytes`` (:func:`jaxckpt.report.build_report`, nothing allocated);
- FLOPs of the whole step counted from the jaxpr (:mod:`jaxckpt.analysis._flops`; XLA counts a scan body once);
- median step time: every row's step is compiled with full optimisation and run in *this* process, the rows
  interleaved round by round (``--rounds`` ≥ 5), and the ratio to ``none`` taken within each round, then the median.

``--policies`` takes any spec of :func:`jaxckpt.parse_policy` (``all`` = ``none`` + every built-in zero-argument
policy + ``save_only_these_names:<name>`` per checkpoint name) and, where jaxckpt has model-level specs, budget plans
(``budget:50%``): the report plans them, and the step is timed under the policy the plan chose.
``--structures`` adds rows of policy ``nothing_saveable`` under a checkpoint structure (default ``nested``).

Physical reference lines, printed under the table:

- FLOPs: full remat adds one forward pass to forward + backward (≈ 1 + 2 matmul units), so for matmul-bound blocks
  ``flops(full) / flops(none) ≤ 4/3`` (less here: embedding, head and optimizer are not recomputed).
- Activation floor of per-block checkpointing: the block inputs (L × B·T·d × 4 bytes) plus one block's working set,
  taken as what one block saves for its backward pass without remat, from JAX's saved-residual analysis
  (:mod:`jaxckpt.analysis._residuals`): ``(residual_bytes(none) − residual_bytes(nothing_saveable)) / L`` + one block input
  (what the two policies save outside the blocks cancels). The table shows ``temp / floor`` and ``temp − floor``
  (what the step holds beyond activations: logits, gradients, optimizer temporaries). A structure such as ``nested``
  keeps fewer than L block inputs, so it can go below this floor.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks import common
from jaxckpt.models import GPT_PRESETS
try:  # model-level specs (budget plans, layered policies) where this jaxckpt has them
  from jaxckpt import parse_model_policy as parse_spec
except ImportError:  # per-block specs only
  from jaxckpt import parse_policy as parse_spec
from jaxckpt.report import build_report, expand_policies
from jaxckpt.step import shipped_target
from jaxckpt.step import compile_policy
from jaxckpt.step import concrete_inputs, default_optimizer, target_block_types
from jaxckpt.core import parse_structure

NAME = "policy_sweep"
FULL_FLOPS_BOUND = 4 / 3
"""Reference: full remat's FLOPs over no remat's for matmul-bound blocks (forward 1 + backward 2 + recompute 1)."""


def build_parser():
  """The flags (``--quick`` = the ``tiny`` preset, 2 rounds: the smoke test)."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--preset", default=None, choices=list(GPT_PRESETS), help="GPT preset (default small; tiny with --quick)")
  p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
  p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
  p.add_argument("--policies", nargs="+", default=None, metavar="SPEC",
                 help="policy specs (default all: every built-in policy; with --quick none, nothing_saveable); "
                      "append budget plans here")
  p.add_argument("--structures", nargs="*", default=["nested"], metavar="STRUCTURE",
                 help="extra rows: nothing_saveable under these checkpoint structures (default nested)")
  p.add_argument("--rounds", type=int, default=None, help=f"interleaved timing rounds (default 7; ≥ {common.MIN_ROUNDS})")
  p.add_argument("--no-timing", dest="timing", action="store_false", help="compiled stats and FLOPs only")
  return p


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of the sweep: a policy under a checkpoint structure (``block`` = per-block remat)."""

  policy: str
  structure: str = "block"

  @property
  def label(self) -> str:
    """``policy`` alone for per-block remat, else ``'policy + structure'``."""
    return self.policy if self.structure == "block" else f"{self.policy} + {self.structure}"


def _target(args, structure: str = "block", num_layers: int | None = None):
  return shipped_target("gpt", args.preset, batch_size=args.batch_size, seq_len=args.seq_len,
                        structure=structure, num_layers=num_layers)


def compiled_rows(args, rows: Sequence[Row]) -> dict[Row, dict[str, Any]]:
  """Compiled stats and FLOPs per row (one report per structure; compile only)."""
  out = {}
  for structure in dict.fromkeys(r.structure for r in rows):
    policies = [r.policy for r in rows if r.structure == structure]
    report = build_report(_target(args, structure), policies, residuals=structure == "block", progress=False)
    for row, data in zip([r for r in rows if r.structure == structure], report.rows):
      if data["status"] != "ok":
        if row.label in ("none", "nothing_saveable"):  # the baselines every ratio needs
          raise SystemExit(f"{NAME}: error: policy {row.label!r} failed: {data['error']}")
        print(f"{NAME}: warning: policy {row.label!r} left out: {data['error']}", file=sys.stderr)
        continue
      out[row] = {k: data[k] for k in ("temp_bytes", "footprint_bytes", "flops", "residual_bytes", "compile_s")}
      plan = data.get("plan")  # a budget row: the report compiled the plan's policy
      out[row]["resolved_policy"] = plan["policy"] if plan else data["policy"]
  return out


def timed_rows(args, rows: Sequence[Row], stats: dict[Row, dict[str, Any]], rounds: int) -> dict[str, dict[str, Any]]:
  """Median step time per row, rows interleaved in this process (``common.interleaved``), ratios to ``none``.

  A budget row runs the policy its plan resolved to (``stats[row]["resolved_policy"]``).
  """
  tx = default_optimizer()
  runs = {}
  for row in rows:
    target = _target(args, row.structure)
    # The step core's compile path, full optimisation (this executable runs), remat fix.
    compiled = compile_policy(target, parse_spec(stats[row]["resolved_policy"]), tx=tx, stats_only=False).compiled
    box = list(concrete_inputs(target, tx)())
    box[0], metrics = compiled(*box)  # warm-up: first touch, allocator caches
    jax.block_until_ready(metrics)

    def run(compiled=compiled, box=box):
      box[0], metrics = compiled(*box)
      jax.block_until_ready((box[0], metrics))

    runs[row.label] = run
  return common.interleaved(runs, rounds=rounds, baseline=rows[0].label)


def render(data: dict[str, Any]) -> str:
  """The result as markdown: a header line, the table, and the reference lines (docs/benchmarks.md)."""
  m, ref = data["model"], data["reference"]
  table = [[f"`{r['label']}`", common.mib(r["temp_bytes"]), f"{r['temp_vs_none']:.2f}", f"{r['temp_vs_floor']:.2f}",
            common.mib(r["temp_minus_floor_bytes"]), f"{r['flops_vs_none']:.3f}",
            "—" if r["step_time_s"] is None else f"{r['step_time_s'] * 1e3:.0f}",
            "—" if r["step_time_vs_none"] is None else f"{r['step_time_vs_none']:.2f}"] for r in data["rows"]]
  lines = [f"GPT `{m['preset']}` (L={m['num_layers']} d={m['dim']} T={m['seq_len']} B={m['batch_size']}), "
           f"{data['rounds']} interleaved rounds; {common.header(data)}", "",
           common.markdown_table(["policy", "temp", "temp / none", "temp / floor", "temp − floor", "FLOPs / none",
                                  "step (ms)", "step / none"], table), ""]
  notes = []
  if ref["full_flops_vs_none"] is not None:
    notes.append(f"FLOPs: `nothing_saveable` / `none` = {ref['full_flops_vs_none']:.3f}, reference ≤ 4/3 for "
                 f"matmul-bound blocks: {'holds' if ref['full_flops_within_bound'] else 'EXCEEDED'}.")
  notes.append(f"Activation floor = {m['num_layers']} block inputs × {common.mib(ref['block_input_bytes'])} + one "
               f"block's working set {common.mib(ref['block_working_set_bytes'])} (what one block saves without "
               f"remat) = {common.mib(ref['activation_floor_bytes'])}.")
  return "\n".join([*lines, " ".join(notes)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the sweep, prints the table and writes the JSON; returns the JSON's contents."""
  p = build_parser()
  args = p.parse_args(argv)
  common.check_out(p, NAME, args)
  args.preset = args.preset or ("tiny" if args.quick else "small")
  args.rounds = args.rounds or (2 if args.quick else 7)
  args.policies = args.policies or (["none", "nothing_saveable"] if args.quick else ["all"])
  if args.rounds < 1 or (args.batch_size is not None and args.batch_size < 1) or \
      (args.seq_len is not None and args.seq_len < 1):
    p.error("--rounds, --batch-size and --seq-len must be ≥ 1")
  try:
    specs = expand_policies(args.policies, target_block_types(_target(args)))
    structures = [str(parse_structure(s)) for s in args.structures]
  except ValueError as err:
    p.error(str(err).splitlines()[0])
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  policies = [str(s) for s in specs]
  if "none" in policies:
    policies.remove("none")
  rows = [Row("none"), *(Row(pol) for pol in policies), *(Row("nothing_saveable", s) for s in structures)]
  stats = compiled_rows(args, rows + ([] if Row("nothing_saveable") in rows else [Row("nothing_saveable")]))
  rows = [r for r in rows if r in stats]  # rows that failed to compile or plan were warned about and left out
  times = timed_rows(args, rows, stats, args.rounds) if args.timing else {}

  config = dataclasses.replace(GPT_PRESETS[args.preset], **{k: v for k, v in
                               (("batch_size", args.batch_size), ("seq_len", args.seq_len)) if v is not None})
  block_input_bytes = config.batch_size * config.seq_len * config.dim * 4  # [B, T, d] float32
  saved = {p: stats[Row(p)]["residual_bytes"] for p in ("none", "nothing_saveable")}
  working_set = (saved["none"] - saved["nothing_saveable"]) // config.num_layers + block_input_bytes
  floor = config.num_layers * block_input_bytes + working_set
  base = stats[rows[0]]
  out_rows = []
  for row in rows:
    s = stats[row]
    t = times.get(row.label)
    out_rows.append({
        "policy": row.policy, "structure": row.structure, "label": row.label, **s,
        "temp_vs_none": s["temp_bytes"] / base["temp_bytes"],
        "flops_vs_none": s["flops"] / base["flops"],
        "temp_vs_floor": s["temp_bytes"] / floor,
        "temp_minus_floor_bytes": s["temp_bytes"] - floor,
        "step_time_s": None if t is None else t["median_s"],
        "step_time_vs_none": None if t is None else t["median_ratio"],
        "step_time_ratios": None if t is None else t["ratios"],
    })
  full = next((r for r in out_rows if r["label"] == "nothing_saveable"), None)
  record.update({
      "model": {"name": "gpt", "preset": args.preset, **dataclasses.asdict(config)},
      "rounds": args.rounds if args.timing else 0,
      "rows": out_rows,
      "reference": {
          "full_flops_bound": FULL_FLOPS_BOUND,
          "full_flops_vs_none": None if full is None else full["flops_vs_none"],
          "full_flops_within_bound": None if full is None else full["flops_vs_none"] <= FULL_FLOPS_BOUND,
          "block_input_bytes": block_input_bytes,
          "residual_bytes": saved,
          "block_working_set_bytes": working_set,
          "activation_floor_bytes": floor,
      },
  })
  return common.publish(record, started, render, NAME, args)


if __name__ == "__main__":
  main()
