"""How the tools' runs end under faults: outputs written whole before the table (a closed pipe, a narrow encoding, a
full disk), absurd shapes and long specs as one line, the compiled-stats cache's warning as one line per run."""

import errno
import io
import os
import sys
import warnings

import pytest

import jaxckpt.cli
from jaxckpt._paths import check_output_file, write_atomically
from jaxckpt.cli import _fit as fit_cli
from jaxckpt.cli import _report as report_cli
from jaxckpt.cli._exits import run_tool
from jaxckpt.errors import JaxckptError, OutputWriteError
from jaxckpt.step._stats_cache import CachedStats, StatsCache

REPORT = ["--model", "mlp", "--preset", "tiny", "--policies", "none", "--no-progress"]


def test_a_write_that_fails_keeps_the_previous_file_and_no_temporary(tmp_path):
  """Killed or failing mid-write, an output used to be left torn or empty (a 4.9 MB page became 0 bytes)."""
  path = tmp_path / "good.html"
  path.write_text("the previous page")

  def half(f):
    f.write("<html>half")
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OutputWriteError, match=rf"{path}: cannot write it \(no space left on device\); the previous "
                                             "file is kept"):
    write_atomically(path, half)
  assert path.read_text() == "the previous page" and os.listdir(tmp_path) == ["good.html"]
  write_atomically(path, lambda f: f.write("the new page"))
  assert path.read_text() == "the new page" and os.listdir(tmp_path) == ["good.html"]
  assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_a_full_disk_after_the_work_is_one_line_exit_1(tmp_path, capsys):
  """A full disk at the end of a run gave a raw OSError traceback after the whole run; now one line naming the file,
  exit 1 (the real CLI on a full tmpfs: benchmarks/fault_cases.py, and the slow test below)."""
  out = tmp_path / "r.json"
  out.write_text('{"old": true}')

  def main(argv):
    def full(f):
      f.write("{")
      raise OSError(errno.ENOSPC, "No space left on device")

    write_atomically(out, full)
    return 0

  assert run_tool("jaxckpt-report", main, []) == 1
  err = capsys.readouterr().err
  assert err == f"jaxckpt-report: error: {out}: cannot write it (no space left on device); the previous file is kept\n"
  assert out.read_text() == '{"old": true}' and os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("device", ["/dev/full", "/dev/zero"])
def test_the_up_front_check_refuses_a_device_that_is_not_null(device):
  if not os.path.exists(device):
    pytest.skip(f"no {device} here")
  with pytest.raises(JaxckptError, match=f"--json {device} is a device or special file"):
    check_output_file("--json", device)
  check_output_file("--json", os.devnull)  # written in place, as ever


class _ClosedPipe(io.TextIOBase):
  """stdout of ``jaxckpt-report ... | head -1`` once ``head`` has read its line."""

  encoding = "utf-8"

  def write(self, text):
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")

  def fileno(self):
    raise io.UnsupportedOperation("fileno")


def test_a_closed_pipe_keeps_the_outputs_and_the_exit_status(tmp_path, capsys, monkeypatch):
  """The table was printed before the outputs were written: ``| head -1`` gave a BrokenPipeError traceback and no
  file. Now the files are written first and the printing ends quietly."""
  out = tmp_path / "r.json"
  monkeypatch.setattr(sys, "stdout", _ClosedPipe())
  assert jaxckpt.cli.report([*REPORT, "--json", str(out)]) == 0
  assert out.stat().st_size > 1000
  assert "Traceback" not in capsys.readouterr().err


def test_a_narrow_encoding_prints_the_table_in_ascii(tmp_path, monkeypatch):
  """``PYTHONIOENCODING=ascii``: the table's ``×`` and box lines raised UnicodeEncodeError; now they are ASCII."""
  raw = io.BytesIO()
  stream = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
  monkeypatch.setattr(sys, "stdout", stream)
  assert jaxckpt.cli.report(REPORT) == 0
  stream.flush()
  text = raw.getvalue().decode("ascii")
  assert "xnone" in text and "---" in text and "mlp (tiny)" in text
  assert stream.errors == "strict"  # restored after the run


@pytest.mark.parametrize("argv, flag", [
    (["--batch-size", "1099511627776"], "--batch-size 1099511627776 is past 2147483647"),
    (["--model", "gpt", "--seq-len", "3000000000"], "--seq-len 3000000000 is past 2147483647"),
])
def test_a_dimension_past_int32_is_one_line_naming_the_flag(argv, flag, capsys):
  """1099511627776 examples gave an "ok" row of 1.8 million TiB from a program whose indices JAX truncated."""
  with pytest.raises(SystemExit) as info:
    report_cli.main(["--policies", "none", *argv])
  err = capsys.readouterr().err
  assert info.value.code == 2 and err.count("\n") == 1 and flag in err, err


def test_an_array_no_device_holds_is_one_line_naming_the_flag(capsys):
  """``--seq-len 110000000``: the attention scores of 1.5 EiB aborted the process inside XLA's heap simulator."""
  assert report_cli.main(["--model", "gpt", "--preset", "tiny", "--policies", "none", "--seq-len", "110000000"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--seq-len 110000000 makes an array of" in err, err
  assert "more than any device holds" in err and "give a smaller --seq-len" in err


LONG = ";".join(f"{i}-{i}:dots_saveable" for i in range(1300))  # 28,979 characters


def test_a_long_layered_spec_is_cut_in_its_error(capsys):
  """A 20,000-character layered spec was echoed in full in its error (659 lines); other spec errors cut it."""
  assert len(LONG) > 20000
  assert fit_cli.main(["--model", "gpt", "--preset", "tiny", "--memory", "1GiB", "--policies", LONG,
                       "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and len(err) < 400 and "covers 1300 layers" in err, err
  assert report_cli.main(["--model", "gpt", "--preset", "tiny", "--policies", LONG, "--no-progress"]) == 1
  out = capsys.readouterr().out
  assert len(out) < 3000 and "covers 1300" in out, len(out)


def test_the_caches_unwritable_warning_is_one_line_once_per_run(tmp_path, capsys):
  """An unwritable cache warned once per compile (8 times in one fit), in Python's two-line warning format."""
  blocked = tmp_path / "file"
  blocked.write_text("a file where the cache directory should be")

  def main(argv):
    for i in range(8):  # every compile makes its own cache object (stats_cache())
      StatsCache(str(blocked / "cache")).put(f"{i:02d}" + "6" * 62, CachedStats({"temp_bytes": 1}, {}, 1.0))
    return 0

  with warnings.catch_warnings():
    warnings.simplefilter("default")
    assert run_tool("jaxckpt-fit", main, []) == 0
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(f"jaxckpt-fit: warning: the compiled-stats cache {blocked / 'cache'} "
                                             "cannot be written (not a directory)"), err


_BLOCKED_IN_NATIVE_CODE = """
import ctypes, sys, threading
from jaxckpt.cli._exits import run_tool
from jaxckpt._paths import write_atomically

def main(argv):
  write_atomically(sys.argv[1], lambda f: f.write("done before the interrupt"))
  print("compiling", flush=True)
  ctypes.CDLL(None).sleep(60)  # a compile in native code: the main thread runs no Python until it returns
  return 0

sys.exit(run_tool("jaxckpt-report", main, []))
"""


@pytest.mark.slow  # a subprocess importing JAX (~4 s)
@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)])
def test_ctrl_c_stops_at_once_while_a_compile_runs(tmp_path, signum, code):
  """Ctrl-C printed a 9-43-frame KeyboardInterrupt traceback and waited for the compile in flight (6.8 s seen)."""
  import signal
  import subprocess
  import time

  done = tmp_path / "done.json"
  proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_IN_NATIVE_CODE, str(done)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert proc.stdout.readline() == "compiling\n"
  sent = time.perf_counter()
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == code and time.perf_counter() - sent < 2.0
  lines = [line for line in err.splitlines() if line.strip() and "cuda" not in line and "absl" not in line]
  assert len(lines) == 1 and lines[0].startswith(f"jaxckpt-report: stopped by {signal.Signals(signum).name}"), err
  assert done.read_text() == "done before the interrupt"  # what finished is kept


def test_a_tool_is_known_by_its_script_or_its_module():
  from jaxckpt._console import running_console_script

  assert running_console_script("/venv/bin/jaxckpt-fit", [])
  assert running_console_script("-m", ["python", "-m", "jaxckpt.report", "--model", "gpt"])
  assert not running_console_script("/venv/bin/pytest", ["python", "-m", "pytest", "jaxckpt.report"])
  assert not running_console_script("-c", ["python", "-c", "import jaxckpt"])  # a library user: no handlers set


@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)])
def test_a_signal_while_the_tool_starts_is_one_line_and_its_exit_status(signum, code):
  """Ctrl-C while JAX imported was swallowed by JAX's gc callback (the run went on, exit 0) or ended in a
  KeyboardInterrupt traceback from inside an import."""
  import signal
  import subprocess

  import jaxckpt._console

  # The module alone, by its file (a ground module: no JAX), as the package's first lines run it in a tool.
  probe = ("import importlib.util, os, sys, time\n"
           "spec = importlib.util.spec_from_file_location('console', sys.argv[1])\n"
           "console = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(console)\n"
           f"console.stop_while_starting()\nos.kill(os.getpid(), {signum})\ntime.sleep(30)\nprint('went on')\n")
  done = subprocess.run([sys.executable, "-c", probe, jaxckpt._console.__file__], capture_output=True, text=True,
                        timeout=60)
  assert done.returncode == code and done.stdout == "", (done.stdout, done.stderr)
  assert done.stderr == f"\njaxckpt: stopped by {signal.Signals(signum).name}" \
      f"{' (Ctrl-C)' * (signum == 2)} while starting; nothing was written\n"


@pytest.mark.slow  # a report subprocess interrupted while it imports JAX (~2 s)
def test_ctrl_c_while_the_real_cli_imports_jax_stops_it():
  import signal
  import subprocess
  import time

  proc = subprocess.Popen([sys.executable, "-m", "jaxckpt.report", "--model", "gpt", "--preset", "tiny", "--policies",
                           "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
  time.sleep(0.6)  # inside `import jaxckpt` (JAX, XLA, Flax: seconds)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130 and out == "" and "Traceback" not in err, err
  assert "stopped by SIGINT (Ctrl-C)" in err


@pytest.mark.slow  # three report subprocesses (~15 s)
def test_the_real_cli_under_a_closed_pipe_and_an_ascii_terminal(tmp_path):
  import subprocess

  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  out = tmp_path / "r.json"
  piped = subprocess.run(f"{sys.executable} -m jaxckpt.report {' '.join(REPORT)} --json {out} | head -1", shell=True,
                         capture_output=True, text=True, env=env)
  assert out.stat().st_size > 1000 and "Traceback" not in piped.stderr, piped.stderr
  ascii_run = subprocess.run([sys.executable, "-m", "jaxckpt.report", *REPORT], capture_output=True, env={
      **env, "PYTHONIOENCODING": "ascii"})
  assert ascii_run.returncode == 0 and b"xnone" in ascii_run.stdout, ascii_run.stderr[-2000:]
  full = subprocess.run([sys.executable, "-m", "jaxckpt.report", *REPORT, "--json", "/dev/full"], capture_output=True,
                        text=True, env=env)
  assert full.returncode == 2 and "--json /dev/full is a device" in full.stderr


@pytest.mark.slow  # a report compile (~3 s)
def test_the_report_on_a_full_disk_keeps_the_previous_file(tmp_path, capsys, monkeypatch):
  out = tmp_path / "r.json"
  out.write_text('{"old": true}')

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(report_cli, "check_output_files", lambda outputs, **_: None)  # it passed: the disk filled later
  monkeypatch.setattr(os, "fsync", full)
  assert report_cli.main([*REPORT, "--json", str(out)]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{out}: cannot write it (no space left on device)" in err, err
  assert out.read_text() == '{"old": true}' and os.listdir(tmp_path) == ["r.json"]
