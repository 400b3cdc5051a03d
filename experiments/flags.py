"""The command line every experiment shares: run and policy flags, and how errors and signals become exit codes."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from experiments import supervisor
from experiments.loop import RunInterrupted
from experiments.options import NAN_POLICIES, RESUME_AUTO, RunOptions, configure
from experiments.placement import await_lost_peer
from jaxckpt import sharding
from jaxckpt.cli import CLIParser, progress_enabled
from jaxckpt.errors import JaxckptError, NonFiniteLossError

__all__ = ["CLIParser", "add_policy_flags", "add_run_flags", "run_cli", "command", "interrupted_line", "exit_with"]


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--policy`` and the Hugging Face-style ``--gradient-checkpointing/--no-gradient-checkpointing``."""
  parser.add_argument("--policy", default=None,
                      help="remat policy spec (grammar below; default none), a layered policy 0-3:SPEC;4-5:SPEC, or a "
                           "memory budget planned for this run: budget:1GiB (footprint), budget:40%% (of no-remat "
                           "temp), auto")
  parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                      help="Hugging Face-style switch: on = --policy full, off = --policy none (not with another "
                           "--policy)")


def _resume_value(text: str) -> str:
  if text != RESUME_AUTO:
    raise argparse.ArgumentTypeError(f"--resume takes no value or {RESUME_AUTO!r}, got {text!r}")
  return text


def add_run_flags(parser: argparse.ArgumentParser, defaults: RunOptions = RunOptions()) -> None:
  """Adds the flags of :class:`RunOptions` (but the policy's: :func:`add_policy_flags`) to an experiment's parser."""
  parser.add_argument("--out", default=None, help="directory for metrics.json")
  parser.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory")
  parser.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help="save every N steps")
  parser.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_value, metavar="auto",
                      help="continue from the latest checkpoint in --ckpt-dir (an error when it holds none: a mistyped "
                           "directory never starts over silently); --resume auto: continue if there is one, else start")
  parser.add_argument("--allow-config-change", action="store_true",
                      help="resume even if the checkpoint's run config differs (the differences are printed)")
  parser.add_argument("--nan-policy", choices=NAN_POLICIES, default=defaults.nan_policy,
                      help="on a NaN/Inf loss: stop (default; the last good checkpoint is kept) or skip the update")
  parser.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar (there is none unless stdout and stderr are a terminal: a log file gets "
                           "whole lines)")
  parser.add_argument("--mesh", default=None, metavar="NAME=SIZE[,NAME=SIZE]",
                      help=f"shard over a device mesh, axes {', '.join(sharding.MESH_AXES)}, product = device count "
                           "(data: batch split, state replicated; fsdp: batch, parameters and optimizer state split), "
                           "e.g. data=4,fsdp=2")
  parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="multi-process run: address of process 0 (jax.distributed; gloo on CPU); needs --mesh")
  parser.add_argument("--num-processes", type=int, default=defaults.num_processes,
                      help="processes of the multi-process run")
  parser.add_argument("--process-id", type=int, default=defaults.process_id, help="this process, 0..N-1")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="XProf trace of --profile-steps warm train steps into DIR/<policy>/ (xprof --logdir DIR)")
  parser.add_argument("--profile-steps", type=int, default=defaults.profile_steps,
                      help=f"steps inside the --profile trace (default {defaults.profile_steps})")
  parser.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                      help="examples per update: the fit planner chooses micro-batch and --grad-accum-steps (and, "
                           "with --policy auto, the fastest fitting policy) within --memory")
  parser.add_argument("--memory", default=defaults.memory, metavar="SIZE|auto",
                      help="device memory --batch-size auto / --global-batch-size plan for (default auto: this "
                           "device less 10%%)")


def interrupted_line(prog: str, argv: Sequence[str], err: RunInterrupted) -> str:
  """One line for a run stopped by a signal: the step reached, the last complete checkpoint, how to resume."""
  name = signal.Signals(err.signum).name
  total = f" of {err.total_steps}" if err.total_steps is not None else ""
  reached = f"at step {err.step}{total}" if err.step is not None else "before training began"
  if err.ckpt_dir is None:
    return (f"{prog}: stopped by {name} {reached}; nothing was saved (no --ckpt-dir): rerun it with --ckpt-dir DIR "
            "to be able to resume")
  kept = (f"last complete checkpoint: step {err.checkpoint} in {err.ckpt_dir}" if err.checkpoint is not None
          else f"no checkpoint saved yet in {err.ckpt_dir}")
  again = list(argv)
  if "--resume" in again:  # the same run, resuming: --resume, or --resume auto while nothing is saved
    at = again.index("--resume")
    del again[at:at + (2 if again[at + 1:at + 2] == [RESUME_AUTO] else 1)]
  again += ["--resume"] if err.checkpoint is not None else ["--resume", RESUME_AUTO]
  return f"{prog}: stopped by {name} {reached}; {kept}; resume with: {prog} {shlex.join(again)}"


def run_cli(parser: argparse.ArgumentParser, make_config: Callable[[argparse.Namespace], Any],
            train: Callable[[Any], Any], argv: Sequence[str] | None) -> int:
  """Parses flags, trains, and maps errors to exit codes: 2 bad input (one line), 1 non-finite loss, 0 success,
  128 + signal number for SIGINT (130) / SIGTERM (143), each with one line on stderr."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  try:
    try:
      train(make_config(args))
    except (JaxckptError, RunInterrupted):
      raise
    except Exception:
      await_lost_peer()  # a collective failed because a process of the run died: its one line, not this traceback
      raise
  except NonFiniteLossError as err:  # a failed run, not bad input
    return parser.fail(err, status=1)
  except JaxckptError as err:
    return parser.fail(err)
  except RunInterrupted as err:
    print(interrupted_line(parser.prog, argv, err), file=sys.stderr)
    return err.exit_code
  return 0


def command(build_parser: Callable[[], argparse.ArgumentParser], config_class: type,
            train: Callable[[Any], Any]) -> Callable[[Sequence[str] | None], int]:
  """An experiment's CLI entry point: ``main(argv=None) -> exit status``.

  Args:
    build_parser: ``() -> parser`` whose flags are fields of ``config_class`` or of
      :class:`experiments.options.RunOptions` (one-to-one, by ``dest``).
    config_class: the experiment's config dataclass (its defaults fill unset fields).
    train: ``config -> result``.

  Returns:
    ``main``: parses ``argv`` (``sys.argv[1:]`` when ``None``), trains, and returns the exit status of
    :func:`run_cli` (2 bad input, 1 non-finite loss, 130/143 interrupted, each with a one-line message).
  """

  def main(argv: Sequence[str] | None = None) -> int:
    def make_config(args: argparse.Namespace) -> Any:
      return configure(config_class(), **{**vars(args), "progress": progress_enabled(args.progress)})

    parser = build_parser()
    if argv is None:  # a program's command line: a process of a multi-process run is watched from outside
      args = parser.parse_args()
      if supervisor.wanted(argv, args.coordinator, args.num_processes):
        return supervisor.supervise(args.process_id, args.num_processes)
      supervisor.die_with_supervisor()
    return run_cli(parser, make_config, train, argv)

  main.__doc__ = command.__doc__.split("\n")[0]
  return main


def exit_with(status: int) -> NoReturn:
  """Ends a ``python -m experiments.<name>`` process with ``main``'s exit status.

  ``SystemExit`` as usual, except after SIGINT or SIGTERM (130, 143): then the streams are flushed and the process
  leaves with ``os._exit``, as jaxckpt's tools do (:mod:`jaxckpt.cli`). A signal that lands while XLA compiles the
  first step leaves its threads running, and the interpreter's teardown beside them crashed (a segmentation fault
  after the one-line message). What the run saved is complete before ``main`` returns: a save in flight finishes
  first (:class:`experiments.loop.SignalGuard`).

  Args:
    status: ``main``'s exit status (0 success, 1 non-finite loss, 2 bad input, 130/143 interrupted).
  """
  if status in (128 + signal.SIGINT, 128 + signal.SIGTERM):
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):  # a closed pipe or stream: nothing more to say on it
        pass
    os._exit(status)
  raise SystemExit(status)

