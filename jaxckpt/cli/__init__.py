"""The command-line tools: ``jaxckpt-report``, ``jaxckpt-plan`` and ``jaxckpt-fit``, and the plumbing they share.

Each tool's ``main`` parses its flags, resolves them once into the objects the library takes (a target, concrete
policies, a placement: the mesh and what it is compiled for) and calls the library (:func:`jaxckpt.report.build_report`,
:func:`jaxckpt.planner.plan_policy`, :func:`jaxckpt.fit.plan_fit`). Exit status: 0 done, 1 nothing succeeded (the
report; an output file that could not be written), 2 bad input — one line on stderr naming the flag, never a
traceback (:data:`EXIT_BAD_INPUT`), 130 stopped by Ctrl-C (143 by SIGTERM) at once, with one line
(:func:`jaxckpt.cli._exits.run_tool`: also a closed pipe and a narrow terminal encoding).

- :func:`report`, :func:`plan`, :func:`fit`: the console scripts' entry points (and ``python -m jaxckpt.report`` …).
- :class:`CLIParser`: ``argparse`` with one-line errors that speak in flags, not Python arguments.
- :func:`progress_enabled`: progress bars only for a person at a terminal.
- :func:`reference_epilog`: the end of every ``--help`` (presets, block types, the policy grammar and names, the
  checkpoint names), built from the registries.
- :func:`check_output_file`, :func:`check_output_dir`: an output path checked before any work, by trying it;
  :func:`check_output_files`: a tool's output flags together (no two naming one file, no existing file of another kind
  replaced).

The modules behind this face are private: ``_parser`` (the parser class), ``_exits`` (how a run ends), ``_flags``
(the flags every tool shares: what to compile, ``--model``/``--target``, and what to compile it for,
``--topology``/``--mesh``), ``_report``, ``_plan``, ``_fit`` (the three tools).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxckpt._paths import check_output_dir, check_output_file, check_output_files
from jaxckpt.cli._exits import run_tool
from jaxckpt.cli._fit import main as _fit_main
from jaxckpt.cli._parser import EXIT_BAD_INPUT, CLIParser, progress_enabled, reference_epilog
from jaxckpt.cli._plan import main as _plan_main
from jaxckpt.cli._report import main as _report_main

__all__ = ["report", "plan", "fit", "CLIParser", "progress_enabled", "reference_epilog", "EXIT_BAD_INPUT",
           "check_output_file", "check_output_files", "check_output_dir"]


def report(argv: Sequence[str] | None = None) -> int:
  """``jaxckpt-report``: compare remat policies on a model's train step.

  Args:
    argv: the flags (default ``sys.argv[1:]``); ``--help`` lists them.

  Returns:
    The exit status: 0 some policy row succeeded, 1 none did (or an output could not be written), 2 bad input,
    130 stopped by Ctrl-C.
  """
  return run_tool("jaxckpt-report", _report_main, argv)


def plan(argv: Sequence[str] | None = None) -> int:
  """``jaxckpt-plan``: the least-recompute policy within a memory budget, verified by compiling.

  Args:
    argv: the flags (default ``sys.argv[1:]``).

  Returns:
    The exit status: 0 done, 1 an output could not be written, 2 bad input (or a budget no plan reaches),
    130 stopped by Ctrl-C.
  """
  return run_tool("jaxckpt-plan", _plan_main, argv)


def fit(argv: Sequence[str] | None = None) -> int:
  """``jaxckpt-fit``: the largest micro-batch per policy, and the fastest configuration for a global batch.

  Args:
    argv: the flags (default ``sys.argv[1:]``).

  Returns:
    The exit status: 0 done, 1 an output could not be written, 2 bad input, 130 stopped by Ctrl-C.
  """
  return run_tool("jaxckpt-fit", _fit_main, argv)
