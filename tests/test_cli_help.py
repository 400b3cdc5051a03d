"""Every option of every CLI has help text (argparse prints an option without it as a bare flag)."""

import argparse

import pytest

from jaxckpt.fit.cli import build_parser as fit_parser
from jaxckpt.planner.cli import build_parser as plan_parser
from jaxckpt.report.cli import build_parser as report_parser


@pytest.mark.parametrize("build", [report_parser, plan_parser, fit_parser], ids=["report", "plan", "fit"])
def test_every_option_has_help(build):
  missing = [a.option_strings[0] for a in build()._actions
             if a.option_strings and a.help in (None, "") and a.help is not argparse.SUPPRESS]
  assert missing == []
