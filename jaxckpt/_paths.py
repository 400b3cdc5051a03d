"""Output paths checked before any work, by trying them: a file or a directory a tool will write.

Trying beats guessing from permission bits: ``/sys`` and ``/proc`` look writable to root, and only the attempt
fails. Used by the CLIs for their output flags and by the library for directories it writes (XProf traces).
"""

from __future__ import annotations

import os
import tempfile

from jaxckpt.errors import JaxckptError


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
  made: list[str] = []
  try:
    made = _made_parents(full)
    if os.path.exists(full):
      with open(full, "a"):
        pass
    else:
      os.close(os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
      os.remove(full)
  except OSError as err:
    raise JaxckptError(f"{flag} {path}: cannot write it ({_reason(err)}); give a writable file path") from None
  finally:
    _remove_dirs(made)


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
