"""The CLIs as a new user meets them: help text on every option, ``--target`` documented, negative sizes
and failing target modules in one line, and progress bars only on a terminal (a log file gets whole lines; no bar
fragment before a one-line error)."""

import argparse
import io
import pathlib
import sys

import pytest

from experiments import classifier, lm
from jaxckpt.cli._parser import progress_enabled
from jaxckpt.cli._fit import build_parser as fit_parser
from jaxckpt.cli._fit import main as fit_main
from jaxckpt.cli._plan import build_parser as plan_parser
from jaxckpt.cli._plan import main as plan_main
from jaxckpt.cli._report import build_parser as report_parser

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PARSERS = [report_parser, plan_parser, fit_parser, classifier.build_parser, lm.build_parser]


def _status(main, argv):
  try:
    return main(argv)
  except SystemExit as exit_:  # argparse's own errors
    return exit_.code


@pytest.mark.parametrize("build", PARSERS, ids=["report", "plan", "fit", "classifier", "lm"])
def test_every_option_has_help(build):
  missing = [a.option_strings[0] for a in build()._actions
             if a.option_strings and a.help in (None, "") and a.help is not argparse.SUPPRESS]
  assert missing == []


def test_negative_sizes_and_raising_target_modules_are_one_line(tmp_path, monkeypatch, capsys):
  from jaxckpt.cli._fit import main as fit_main
  from jaxckpt.cli._report import main as report_main
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
  (tmp_path / "broken_target.py").write_text("def t():\n  return 1 +\n")
  (tmp_path / "failing_target.py").write_text("def t():\n  raise ValueError('no data at /x')\n")
  for spec, fragment in (("broken_target:t", "importing broken_target failed: SyntaxError: invalid syntax "
                                             "(broken_target.py:2)"),
                         ("failing_target:t", "t() failed: ValueError: no data at /x (failing_target.py:2)")):
    code = report_main(["--target", spec, "--policies", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err


@pytest.mark.parametrize("argv, value", [(["--budget", "-5%"], "'-5%'"), (["--mincut", "-5%"], "'-5%'")])
def test_negative_budgets_reach_their_own_check(capsys, argv, value):
  assert _status(plan_main, ["--model", "mlp", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert value in err and "percentage" in err and "expected one argument" not in err and len(err.splitlines()) == 1


def test_target_says_what_the_function_returns():
  help_text = " ".join(next(a.help for a in fit_parser()._actions if "--target" in a.option_strings).split())
  assert "called with the keywords it takes" in help_text and "ModelTarget" in help_text and "LossTarget" in help_text
  fit_doc = " ".join((DOCS / "fit.md").read_text().split())
  assert "--target mypkg.targets:target" in fit_doc and "is called with the keywords it takes" in fit_doc


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_bars_only_where_stdout_and_stderr_are_terminals(monkeypatch):
  assert not progress_enabled(True)  # pytest captures both streams: no terminal
  monkeypatch.setattr(sys, "stdout", _Terminal())
  assert not progress_enabled(True)  # stderr (where the bar is drawn) still a pipe
  monkeypatch.setattr(sys, "stderr", _Terminal())
  assert progress_enabled(True) and not progress_enabled(False)


def test_no_bar_fragment_before_an_error_after_the_bar_started(capsys):
  # --min-batch 0 is refused by the search, after the compile bar exists; no --no-progress
  assert _status(fit_main, ["--model", "mlp", "--min-batch", "0"]) == 2
  err = capsys.readouterr().err
  assert "\r" not in err and err.count("\n") == 1 and err.startswith("jaxckpt-fit: error: --min-batch 0"), repr(err)
