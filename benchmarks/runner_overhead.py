"""Benchmark 3, runner overhead: steps/s of the experiments' train loop vs a minimal hand-written ``jax.jit`` loop.

Usage: ``python benchmarks/runner_overhead.py [--rounds 31] [--steps-per-round N] [--out FILE.json]``.

For ``experiments.classifier`` (default run: ViT ``small``, batch 64) and ``experiments.lm`` (default run: GPT
``tiny``), the experiment's own ``train(config)`` is run up to its training loop, and what it would train with is
taken as is: the model, the AOT-compiled train step, the state, the optimizer and ``batch_at``. Then, interleaved
for ``--rounds`` rounds of ``--steps-per-round`` steps each:

- *runner*: :func:`experiments.loop.train_loop` (progress bar on, its output discarded; checkpoints off;
  evaluation a no-op, so this measures the per-step loop);
- *hand*: ``jax.jit(step, donate_argnums=0)`` of the same step function, called in a plain ``for`` loop on
  ``batch_at(s)``, waited for once at the end of the round.

Both continue the same state. The figure is the median over rounds of ``steps/s(runner) / steps/s(hand)``, target
≥ 0.95; many short rounds, so that both halves of a pair see the same load from other jobs. Separately, the experiment's full ``train(config)`` runs for two evaluation periods under
``jax_log_compiles``: every compile is logged with the phase it happened in (``setup``, ``period 1`` = after step 1,
before the first evaluation ends, ``later``); the check is that nothing compiles in ``later`` and that no function
compiles twice after setup (no re-tracing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks import common
from experiments import classifier, lm, loop
from experiments import runner as experiment_runner
from experiments.options import RunOptions, configure

NAME = "runner_overhead"
TARGET_RATIO = 0.95


class _Captured(Exception):
  """Stops an experiment's ``train`` at its training loop."""


def capture(module, config) -> dict[str, Any]:
  """Runs ``module.train(config)`` up to its call of ``train_loop`` and returns what it would train with.

  Returns:
    ``{"step": the train step function (uncompiled), "step_fn": the compiled step, "state": the train state,
    "loop_kwargs": train_loop's keyword arguments (``batch_at``, …)}``.
  """
  captured: dict[str, Any] = {}
  real_compile = experiment_runner.compile_and_describe

  def compile_hook(*args, **kwargs):
    compiled = real_compile(*args, **kwargs)
    captured["step"] = compiled.step
    return compiled

  def loop_hook(step_fn, state, **kwargs):
    captured.update(step_fn=step_fn, state=state, loop_kwargs=kwargs)
    raise _Captured

  with mock.patch.object(experiment_runner, "compile_and_describe", compile_hook), \
      mock.patch.object(experiment_runner, "train_loop", loop_hook):
    try:
      module.train(config, log=lambda *_: None)
    except _Captured:
      pass
  return captured


def throughput(module, config, *, rounds: int, steps_per_round: int) -> dict[str, Any]:
  """Interleaves the runner's loop and the hand-written loop on the same step and state; see the module docstring.

  Returns:
    ``{"runner_steps_per_s", "hand_steps_per_s" (medians over rounds), "ratio" (median of per-round
    steps/s(runner) / steps/s(hand)), "ratios", "rounds", "steps_per_round"}``.
  """
  got = capture(module, config)
  batch_at = got["loop_kwargs"]["batch_at"]
  box = {"state": got["state"], "step": int(jax.device_get(got["state"].step))}
  hand_step = jax.jit(got["step"], donate_argnums=0)
  options = RunOptions(progress=True)

  def runner():
    sink = io.StringIO()
    with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
      result = loop.train_loop(got["step_fn"], box["state"], batch_at=batch_at,
                               total_steps=box["step"] + steps_per_round, eval_every=10**9, evaluate=lambda _: {},
                               identity={}, options=options, nan_hints="", log=lambda *_: None)
    jax.block_until_ready(result.state)
    box["state"], box["step"] = result.state, box["step"] + steps_per_round

  def hand():
    state = box["state"]
    for s in range(box["step"], box["step"] + steps_per_round):
      state, metrics = hand_step(state, batch_at(s))
    jax.block_until_ready((state, metrics))
    box["state"], box["step"] = state, box["step"] + steps_per_round

  runner()  # warm-up: compiles hand_step, first touch
  hand()
  timed = common.interleaved({"hand": hand, "runner": runner}, rounds=rounds, baseline="hand")
  ratios = [1 / r for r in timed["runner"]["ratios"]]  # steps/s(runner) / steps/s(hand) = t_hand / t_runner
  return {"runner_steps_per_s": steps_per_round / timed["runner"]["median_s"],
          "hand_steps_per_s": steps_per_round / timed["hand"]["median_s"],
          "ratio": statistics.median(ratios),
          "ratios": ratios, "rounds": rounds, "steps_per_round": steps_per_round}


def compile_check(module, config) -> dict[str, Any]:
  """Runs ``module.train(config)`` (two evaluation periods) under ``jax_log_compiles``.

  Returns:
    ``{"compiles": {phase: [function names]}, "later": count compiled after the first period (must be 0),
    "repeated_after_setup": names compiled more than once after setup (must be empty), "ok": bool}``.
  """
  log = common.CompileLog()
  log.mark = "setup"

  def on_line(line: str) -> None:
    if line.startswith("compiled in "):
      log.mark = "period 1"
    elif re.match(r"^(epoch|eval) 1/", line):
      log.mark = "later"

  with log:
    module.train(config, log=on_line)
  phases: dict[str, list[str]] = {"setup": [], "period 1": [], "later": []}
  for mark, fn in log.events:
    phases[mark].append(fn)
  after = phases["period 1"] + phases["later"]
  repeated = sorted({fn for fn in after if after.count(fn) > 1})
  return {"compiles": phases, "later": len(phases["later"]), "repeated_after_setup": repeated,
          "ok": not phases["later"] and not repeated}


def experiments(quick: bool) -> dict[str, tuple[Any, Any, Any]]:
  """Experiment name -> (module, throughput config, compile-check config, steps per round ≈ 0.5 s); ``quick``: the
  tiny classifier only."""
  if quick:  # the smoke test: the classifier only (every compile costs seconds)
    cls = configure(classifier.ClassifierConfig(preset="tiny", epochs=2), progress=False)
    return {"classifier (vit tiny)": (classifier, cls, cls, 5)}
  cls = configure(classifier.ClassifierConfig(), progress=False)  # the default run: vit small, batch 64
  lmc = configure(lm.LMConfig(), progress=False)  # the default run: gpt tiny
  return {"classifier (vit small, B=64)": (classifier, cls, dataclasses.replace(cls, epochs=2), 10),
          "lm (gpt tiny, T=64, B=8)": (lm, lmc, dataclasses.replace(lmc, steps=60, eval_every=30, eval_batches=2), 40)}


def render(data: dict[str, Any]) -> str:
  """The result as markdown: a header line and the table (docs/benchmarks.md)."""
  rows = data["rows"]
  return "\n".join([
      f"{rows[0]['rounds']} interleaved rounds; {common.header(data)}", "",
      common.markdown_table(
          ["experiment", "steps / round", "runner steps/s", "hand `jax.jit` steps/s", f"ratio (target ≥ {data['target_ratio']})",
           "compiled after step 1", "compiled after period 1"],
          [[r["experiment"], str(r["steps_per_round"]), f"{r['runner_steps_per_s']:.1f}", f"{r['hand_steps_per_s']:.1f}", f"{r['ratio']:.3f}",
            ", ".join(f"`{fn}`" for fn in r["compile_check"]["compiles"]["period 1"]) or "nothing",
            str(r["compile_check"]["later"])] for r in rows])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Measures both experiments, prints the table and writes the JSON; returns the JSON's contents."""
  p = common.parser(NAME, __doc__)
  p.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default 31; ≥ {common.MIN_ROUNDS})")
  p.add_argument("--steps-per-round", type=int, default=None, help="steps per round (default: ~0.5 s of steps, 10 for the classifier, 40 for the "
                      "LM; 5 with --quick)")
  args = p.parse_args(argv)
  common.check_out(p, NAME, args)
  args.rounds = args.rounds or (2 if args.quick else 31)
  if args.steps_per_round is not None and args.steps_per_round < 1:
    p.error("--steps-per-round must be ≥ 1")
  if args.rounds < 1:
    p.error("--rounds must be ≥ 1")
  started = time.perf_counter()
  record = common.run_record(NAME, args)
  rows = []
  for name, (module, config, check_config, steps) in experiments(args.quick).items():
    speed = throughput(module, config, rounds=args.rounds, steps_per_round=args.steps_per_round or steps)
    compiles = compile_check(module, check_config)
    rows.append({"experiment": name, **speed, "meets_target": speed["ratio"] >= TARGET_RATIO,
                 "compile_check": compiles})
    print(f"{name}: ratio {speed['ratio']:.3f}, compiles {compiles}", file=sys.stderr)
  record.update({"target_ratio": TARGET_RATIO, "rows": rows})
  return common.publish(record, started, render, NAME, args)


if __name__ == "__main__":
  main()
