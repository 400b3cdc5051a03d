"""Output paths: checked before any work, by trying them, and written atomically after it.

Trying beats guessing from permission bits: ``/sys`` and ``/proc`` look writable to root, and only the attempt
fails. Used by the CLIs for their output flags and by the library for directories it writes (XProf traces).

:func:`write_atomically` writes a tool's output as POSIX allows a file to be replaced whole: into a temporary file in
the same directory, flushed to disk (``fsync``), then renamed over the path (``os.replace``), so a reader, a killed
run or a full disk never leaves a torn or empty file where a good one was; a failed write removes its temporary
file and raises :class:`~jaxckpt.errors.OutputWriteError` naming the path. A path that is not a regular file
(``/dev/null``, a terminal, a pipe) is written in place.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from jaxckpt.errors import JaxckptError, OutputWriteError

_UMASK = os.umask(0o022)
os.umask(_UMASK)
"""The process's umask (read at import, while one thread runs): a replaced file gets the permissions ``open`` would
have given it."""

_LIVE: set[str] = set()
"""Temporary files being written now (:func:`remove_temporaries` deletes them when a run is interrupted)."""
_LIVE_LOCK = threading.Lock()


def _made_parents(path: str) -> list[str]:
  """Creates the missing directories above ``path`` (``os.makedirs``); returns those it made, outermost first."""
  missing, parent = [], os.path.dirname(path)
  while parent and not os.path.exists(parent):
    missing.append(parent)
    parent = os.path.dirname(parent)
  made = []
  try:
    for directory in reversed(missing):
      os.mkdir(directory)
      made.append(directory)
  except OSError:
    _remove_dirs(made)
    raise
  return made


def _remove_dirs(made: list[str]) -> None:
  for directory in reversed(made):
    try:
      os.rmdir(directory)
    except OSError:
      pass


def _reason(err: OSError) -> str:
  return (err.strerror or type(err).__name__).lower()


OUTPUT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "--json": (".json",), "--csv": (".csv",), "--markdown": (".md", ".markdown"), "--html": (".html", ".htm")}
"""The tools' output flags and the suffixes of their kinds (:func:`check_output_files`: an existing file at the path
must end in one; ``--plot``'s are its image formats, checked where it is drawn)."""


def check_output_files(outputs: Mapping[str, str | os.PathLike[str] | None], *,
                       suffixes: Mapping[str, Sequence[str]] | None = None) -> None:
  """Checks a tool's output flags together before any work: each as :func:`check_output_file` does, no two naming one
  file (the second write would replace the first), and none replacing an existing file of another kind (``--json
  model.py`` would put JSON where the user's source was).

  Args:
    outputs: flag (``"--json"``) -> its path, ``None`` where not given.
    suffixes: flag -> the lower-case suffixes of its kind (default :data:`OUTPUT_SUFFIXES`); an existing regular
      file at that flag's path must end in one. A new file may have any name; paths that are not regular files
      (``/dev/stdout``, a pipe) are written in place and may be named twice.

  Raises:
    JaxckptError: one line naming the flag(s), the path and what to give instead.
  """
  suffixes = OUTPUT_SUFFIXES if suffixes is None else suffixes
  seen: dict[str, str] = {}
  for flag, path in outputs.items():
    if path is None:
      continue
    check_output_file(flag, path)
    full = os.path.realpath(os.fspath(path))
    if os.path.exists(full) and not os.path.isfile(full):
      continue
    if full in seen:
      raise JaxckptError(f"{seen[full]} and {flag} both name {os.fspath(path)}; give each output its own file")
    seen[full] = flag
    wanted = tuple(suffixes.get(flag, ()))
    if wanted and os.path.isfile(full) and os.path.splitext(full)[1].lower() not in wanted:
      raise JaxckptError(f"{flag} {os.fspath(path)} exists and is not a {' or '.join(wanted)} file, which {flag} "
                         f"would replace; give a new path or one ending in {' or '.join(wanted)}")


def check_output_file(flag: str, path: str | os.PathLike[str] | None) -> None:
  """Raises :class:`JaxckptError` before any work if ``path`` cannot be written as a file, by trying it.

  The missing parent directories are created and a new file opened exclusively (an existing file is opened for
  append, which changes nothing); whatever the check made is removed again. Trying beats guessing from permission
  bits: ``/sys`` and ``/proc`` look writable to root, and only the attempt fails.

  Args:
    flag: how messages name the path (``"--json"``).
    path: the output file; ``None`` checks nothing.

  Raises:
    JaxckptError: one line naming ``flag``, ``path`` and the operating system's reason (a directory, a file where a
      directory is needed, permission denied, no such file or directory, read-only file system).
  """
  if path is None:
    return
  path = os.fspath(path)
  if not path.strip():
    raise JaxckptError(f"{flag} {path!r} is empty; give a file path")
  full = os.path.abspath(path)
  if os.path.isdir(full):
    raise JaxckptError(f"{flag} {path} is a directory; give a file path")
  if os.path.exists(full) and not os.path.isfile(full):
    _check_special(flag, path, full)
    return
  made: list[str] = []
  try:
    made = _made_parents(full)
    if os.path.exists(full):
      with open(full, "a"):
        pass
    fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".probe", dir=os.path.dirname(full))
    try:  # what write_atomically does: a file beside it, written, renamed (a full disk refuses the byte)
      os.write(fd, b"\n")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.remove(probe)
  except OSError as err:
    raise JaxckptError(f"{flag} {path}: cannot write it ({_reason(err)}); give a writable file path") from None
  finally:
    _remove_dirs(made)


def _check_special(flag: str, path: str, full: str) -> None:
  """An output path that exists and is not a regular file: ``/dev/null``, a terminal and a pipe are written in place;
  any other device (``/dev/full``, ``/dev/zero``, a disk) or a socket is refused."""
  mode = os.stat(full).st_mode
  if stat.S_ISFIFO(mode):
    return
  if stat.S_ISCHR(mode):
    if os.stat(full).st_rdev == os.stat(os.devnull).st_rdev:
      return
    with contextlib.suppress(OSError):
      fd = os.open(full, os.O_WRONLY | os.O_NONBLOCK)
      try:
        if os.isatty(fd):
          return
      finally:
        os.close(fd)
  raise JaxckptError(f"{flag} {path} is a device or special file, not a file; give a file path (or {os.devnull})")


def check_output_dir(flag: str, path: str | os.PathLike[str] | None) -> None:
  """Raises :class:`JaxckptError` before any work if ``path`` cannot be a directory to write into, by trying it.

  The directory (and its missing parents) is created and a probe file written in it; whatever the check made is
  removed again.

  Args:
    flag: how messages name the path (``"--ckpt-dir"``).
    path: the output directory; it need not exist; ``None`` checks nothing.

  Raises:
    JaxckptError: one line naming ``flag``, ``path`` and the reason (empty, exists as a file, permission denied, ...).
  """
  if path is None:
    return
  path = os.fspath(path)
  if not path.strip():
    raise JaxckptError(f"{flag} {path!r} is empty; give a directory (e.g. {flag} ./out)")
  full = os.path.abspath(path)
  if os.path.exists(full) and not os.path.isdir(full):
    raise JaxckptError(f"{flag} {path} exists and is not a directory; give a directory")
  made: list[str] = []
  try:
    made = _made_parents(os.path.join(full, "probe"))
    fd, probe = tempfile.mkstemp(prefix=".jaxckpt-probe-", dir=full)
    os.close(fd)
    os.remove(probe)
  except OSError as err:
    raise JaxckptError(f"{flag} {path}: cannot write into it ({_reason(err)}); give a writable directory") from None
  finally:
    _remove_dirs(made)


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[Any]], Any], *, binary: bool = False) -> None:
  """Writes a file whole or not at all (module docstring): ``write(f)`` fills a temporary file beside ``path``
  (parent directories created), which is flushed to disk and renamed over ``path``.

  Args:
    path: the output file. One that exists and is not a regular file (``/dev/null``, a pipe) is written in place.
    write: called with the open file (text, UTF-8, or ``binary``) to write the content.
    binary: open the file in binary mode.

  Raises:
    OutputWriteError: the file could not be written (a full disk, permission denied): one line naming ``path`` and
      the reason; the previous file is kept and no temporary file is left.
  """
  path = os.fspath(path)
  full = os.path.abspath(path)
  kwargs: dict[str, Any] = {} if binary else {"encoding": "utf-8"}
  mode = "wb" if binary else "w"
  try:
    if os.path.exists(full) and not os.path.isfile(full):
      with open(full, mode, **kwargs) as f:
        write(f)
      return
    os.makedirs(os.path.dirname(full), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".tmp", dir=os.path.dirname(full))
  except OSError as err:
    raise OutputWriteError(f"{path}: cannot write it ({_reason(err)})") from None
  with _LIVE_LOCK:
    _LIVE.add(tmp)
  try:
    with os.fdopen(fd, mode, **kwargs) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    previous = os.stat(full).st_mode & 0o7777 if os.path.exists(full) else 0o666 & ~_UMASK
    os.chmod(tmp, previous)
    os.replace(tmp, full)
  except OSError as err:
    kept = "; the previous file is kept" if os.path.exists(full) else ""
    raise OutputWriteError(f"{path}: cannot write it ({_reason(err)}){kept}") from None
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    with _LIVE_LOCK:
      _LIVE.discard(tmp)


def write_text(path: str | os.PathLike[str], text: str) -> None:
  """:func:`write_atomically` of ``text`` (UTF-8)."""
  write_atomically(path, lambda f: f.write(text))


def remove_temporaries() -> None:
  """Deletes the temporary files :func:`write_atomically` is writing now (a run stopped by Ctrl-C exits without
  finishing them)."""
  with _LIVE_LOCK:
    live = list(_LIVE)
  for tmp in live:
    with contextlib.suppress(OSError):
      os.remove(tmp)
