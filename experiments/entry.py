"""Console-script entry points of the library's CLIs (``jaxckpt-report``, ``jaxckpt-plan``, ``jaxckpt-fit``).

A program, not the library: importing :mod:`experiments` first turns a bad environment (``JAX_REMAT3=maybe``, which
``import jaxckpt`` raises as :class:`jaxckpt.errors.EnvSettingError`) into one line on stderr and exit status 2, the
CLIs' contract for bad input. Each function then runs the CLI's ``main`` and returns its exit status.
"""

from __future__ import annotations

import experiments  # noqa: F401  (one line + exit 2 on a bad environment, before jaxckpt's CLIs import JAX)
from jaxckpt.fit._cli import main as _fit_main
from jaxckpt.planner._cli import main as _plan_main
from jaxckpt.report._cli import main as _report_main

__all__ = ["report", "plan", "fit"]


def report(argv: "list[str] | None" = None) -> int:
  """``jaxckpt-report``: :func:`jaxckpt.report._cli.main`; returns its exit status (0 ok, 2 bad input)."""
  return _report_main(argv)


def plan(argv: "list[str] | None" = None) -> int:
  """``jaxckpt-plan``: :func:`jaxckpt.planner._cli.main`; returns its exit status (0 ok, 2 bad input)."""
  return _plan_main(argv)


def fit(argv: "list[str] | None" = None) -> int:
  """``jaxckpt-fit``: :func:`jaxckpt.fit._cli.main`; returns its exit status (0 ok, 2 bad input)."""
  return _fit_main(argv)
