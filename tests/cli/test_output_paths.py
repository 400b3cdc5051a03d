"""Every output path flag of every CLI: an unwritable path is one line on stderr and exit 2, before any compile.

The checks try to write (jaxckpt._cli.check_output_file / check_output_dir), so paths that only look writable (``/sys``
and ``/proc`` as root) are refused too, and a check that passes leaves nothing behind.
"""

import os

import pytest

from experiments import classifier, lm
from jaxckpt.cli._parser import CLIParser
from jaxckpt._paths import check_output_dir, check_output_file
from jaxckpt.errors import JaxckptError
from jaxckpt.cli import _fit as fit_cli
from jaxckpt.cli import _plan as plan_cli
from jaxckpt.cli import _report as report_cli

BAD_PATHS = {"sys": "/sys/x", "proc": "/proc/x", "proc-nested": "/proc/x/y.json"}

REPORT = lambda *argv: report_cli.main(["--model", "mlp", "--policies", "none", *argv])  # noqa: E731
PLAN = lambda *argv: plan_cli.main(["--model", "mlp", "--budget", "50%", *argv])  # noqa: E731
FIT = lambda *argv: fit_cli.main(["--model", "mlp", "--memory", "1MiB", *argv])  # noqa: E731
CLASSIFIER = lambda *argv: classifier.main(["--preset", "tiny", "--no-progress", *argv])  # noqa: E731
LM = lambda *argv: lm.main(["--preset", "tiny", "--no-progress", *argv])  # noqa: E731

CASES = [
    *[("jaxckpt-report", REPORT, flag) for flag in ("--json", "--csv", "--markdown", "--html", "--plot", "--profile",
                                                   "--xla-dump")],
    ("jaxckpt-plan", PLAN, "--json"),
    *[("jaxckpt-fit", FIT, flag) for flag in ("--json", "--plot", "--html")],
    *[("classifier", CLASSIFIER, flag) for flag in ("--out", "--ckpt-dir", "--profile")],
    *[("lm", LM, flag) for flag in ("--out", "--ckpt-dir", "--profile")],
]


def _status(run, *args):
  try:
    return run(*args)
  except SystemExit as exit_info:
    return exit_info.code


@pytest.mark.parametrize("kind", list(BAD_PATHS))
@pytest.mark.parametrize("prog, run, flag", CASES, ids=[f"{c[0]}{c[2]}" for c in CASES])
def test_unwritable_output_path_is_one_line_exit_2(capsys, prog, run, flag, kind):
  path = BAD_PATHS[kind] + (".png" if flag == "--plot" else "")
  assert _status(run, flag, path) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert f"{flag} {path}" in err and "cannot write" in err and "Traceback" not in err, err


def test_checks_leave_nothing_behind(tmp_path):
  check_output_file("--json", tmp_path / "a" / "b" / "r.json")
  check_output_dir("--out", tmp_path / "c" / "d")
  existing = tmp_path / "kept.json"
  existing.write_text("old")
  check_output_file("--json", existing)
  assert sorted(os.listdir(tmp_path)) == ["kept.json"] and existing.read_text() == "old"


def test_checks_name_the_reason(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(JaxckptError, match=r"^--json .*/file/r.json: cannot write it \(not a directory\)"):
    check_output_file("--json", blocker / "r.json")
  with pytest.raises(JaxckptError, match="is a directory; give a file path"):
    check_output_file("--csv", tmp_path)
  with pytest.raises(JaxckptError, match="exists and is not a directory"):
    check_output_dir("--out", blocker)
  with pytest.raises(JaxckptError, match=r"^--xla-dump '' is empty; give a directory"):  # not the working directory
    check_output_dir("--xla-dump", "")
  with pytest.raises(JaxckptError, match=r"^--json ' ' is empty; give a file path"):
    check_output_file("--json", " ")
  assert os.listdir(tmp_path) == ["file"]


def test_flag_message_keeps_values_that_look_like_arguments():
  parser = CLIParser(prog="p")
  parser.add_argument("--data")
  parser.add_argument("--mesh")
  parser.add_argument("--batch-size", type=int)
  message = ("--mesh data=4 covers 4 device(s) but there are 1 (e.g. data=1); mesh='data=2' too; data=x.npz "
             "is bad; batch_size=0 must be ≥ 1")
  assert parser.flag_message(message) == ("--mesh data=4 covers 4 device(s) but there are 1 (e.g. data=1); "
                                          "--mesh 'data=2' too; --data x.npz is bad; --batch-size 0 must be ≥ 1")


def test_classifier_mesh_error_names_the_mesh_flag(capsys):
  assert _status(CLASSIFIER, "--mesh", "data=4") == 2
  err = capsys.readouterr().err.strip()
  # The library says mesh='data=4'; the CLI writes --mesh and leaves the quoted axis alone (--data is a data file).
  assert "--mesh 'data=4' covers 4 device(s)" in err and "(--mesh 'data=1' fits)" in err and "--data" not in err, err


# --- --resume where nothing is saved: an error unless --resume auto -------------------------------------


@pytest.mark.parametrize("run", [CLASSIFIER, LM], ids=["classifier", "lm"])
def test_resume_with_nothing_saved_is_one_line_exit_2(tmp_path, capsys, run):
  ckpt = tmp_path / "typo"
  assert _status(run, "--ckpt-dir", str(ckpt), "--resume") == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f"nothing saved in --ckpt-dir {ckpt}" in err and "--resume auto" in err, err
  assert not ckpt.exists()  # nothing made


def test_resume_takes_only_auto(capsys):
  assert _status(CLASSIFIER, "--resume", "always") == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "--resume takes no value or 'auto', got 'always'" in err, err
  args = classifier.build_parser().parse_args(["--resume", "auto"])
  assert args.resume == "auto" and classifier.build_parser().parse_args(["--resume"]).resume is True


def test_interrupted_line_resumes_with_auto_when_nothing_is_saved():
  import signal as signals  # noqa: PLC0415

  from experiments.flags import interrupted_line  # noqa: PLC0415
  from experiments.loop import RunInterrupted  # noqa: PLC0415

  err = RunInterrupted(signals.SIGINT)
  err.step, err.total_steps, err.ckpt_dir, err.checkpoint = 3, 10, "/c", None
  line = interrupted_line("p", ["--ckpt-dir", "/c", "--resume", "auto"], err)
  assert line.endswith("resume with: p --ckpt-dir /c --resume auto"), line
  err.checkpoint = 2
  assert interrupted_line("p", ["--ckpt-dir", "/c", "--resume", "auto"], err).endswith("p --ckpt-dir /c --resume")


@pytest.mark.parametrize("prog,run,flags", [("jaxckpt-report", REPORT, ("--json", "--csv")),
                                            ("jaxckpt-fit", FIT, ("--json", "--html"))])
def test_two_outputs_to_one_file_are_refused_before_any_compile(tmp_path, capsys, prog, run, flags):
  """The second write would replace the first: one line naming both flags, exit 2, nothing written."""
  path = tmp_path / "out.json"
  argv = [arg for flag in flags for arg in (flag, str(path))]
  assert _status(run, *argv) == 2, prog
  err = capsys.readouterr().err.strip()
  assert f"{flags[0]} and {flags[1]} both name {path}; give each output its own file" in err and "\n" not in err
  assert not path.exists()


@pytest.mark.parametrize("prog,run", [("jaxckpt-report", REPORT), ("jaxckpt-plan", PLAN), ("jaxckpt-fit", FIT)])
def test_an_existing_file_of_another_kind_is_not_replaced(tmp_path, capsys, prog, run):
  """``--json model.py`` would put JSON where the user's source was: refused, the file kept byte for byte; an existing
  ``.json`` file is replaced as before (checked by the other tests of each tool)."""
  source = tmp_path / "model.py"
  source.write_text("print('mine')\n")
  assert _status(run, "--json", str(source)) == 2, prog
  err = capsys.readouterr().err.strip()
  assert f"--json {source} exists and is not a .json file" in err and "\n" not in err
  assert source.read_text() == "print('mine')\n"
