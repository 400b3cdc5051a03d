"""Every option of every CLI has help text (argparse prints an option without it as a bare flag)."""

import argparse

import pytest

from jaxckpt.fit._cli import build_parser as fit_parser
from jaxckpt.planner._cli import build_parser as plan_parser
from jaxckpt.report._cli import build_parser as report_parser


@pytest.mark.parametrize("build", [report_parser, plan_parser, fit_parser], ids=["report", "plan", "fit"])
def test_every_option_has_help(build):
  missing = [a.option_strings[0] for a in build()._actions
             if a.option_strings and a.help in (None, "") and a.help is not argparse.SUPPRESS]
  assert missing == []


def test_negative_sizes_and_raising_target_modules_are_one_line(tmp_path, monkeypatch, capsys):
  from jaxckpt.fit._cli import main as fit_main
  from jaxckpt.report._cli import main as report_main
  try:
    code = fit_main(["--memory", "-1GiB"])
  except SystemExit as exit_:
    code = exit_.code
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert "'-1GiB'" in err and "expected one argument" not in err and len(err.splitlines()) == 1
  (tmp_path / "raising_target.py").write_text("x = 1\nraise RuntimeError('no accelerator here')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  code = report_main(["--target", "raising_target:t", "--policies", "none"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1
  assert "RuntimeError: no accelerator here (raising_target.py:2)" in err
