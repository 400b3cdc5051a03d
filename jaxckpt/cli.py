"""Command-line plumbing shared by jaxckpt's CLIs (the report and the experiments)."""

from __future__ import annotations

import argparse
import os
import re
import sys

from jaxckpt.errors import JaxckptError

__all__ = ["CLIParser", "check_output_file", "check_output_dir"]

_QUOTED = re.compile(r"((?<![\w'])'[^'\n]*'(?![\w']))")
"""A quoted value in a message (``'data=4,fsdp=2'``), not an apostrophe (``none's``): kept as it is."""


class CLIParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr with exit status 2 (no usage dump).

  The library's errors name Python arguments (``seq_len=0 must be ≥ 1``); :meth:`fail` prints them with this
  parser's flags instead (``--seq-len 0 must be ≥ 1``): the one place where the CLIs translate them.
  """

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

  def flag_message(self, message: str) -> str:
    """``message`` with the Python arguments behind this parser's flags written as the flags.

    ``dest=value`` becomes ``--flag value`` for every flag (``dest=True`` of an on/off flag becomes ``--flag``); a bare
    ``dest`` becomes ``--flag`` only for names with an underscore (``seq_len``, ``num_layers``), so plain words such as
    "model" or "preset" in a sentence stay. Quoted values (``mesh='data=4'``) are never rewritten: ``data=`` there
    is a mesh axis, not the ``--data`` flag.

    Args:
      message: an error message from the library.

    Returns:
      The message in terms of this CLI's flags.
    """
    parts = _QUOTED.split(message)
    for i in range(0, len(parts), 2):  # even parts lie outside quotes
      for action in self._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in ("help", argparse.SUPPRESS):
          continue
        flag, dest = longs[0], re.escape(action.dest)
        if action.nargs == 0:  # on/off flags: store_true, BooleanOptionalAction
          parts[i] = re.sub(rf"(?<![\w.-]){dest}=True\b", flag, parts[i])
        parts[i] = re.sub(rf"(?<![\w.-]){dest}=(?=\S|\Z)", flag + " ", parts[i])
        if "_" in action.dest:
          parts[i] = re.sub(rf"(?<![\w.-]){dest}\b", flag, parts[i])
    return "".join(parts)

  def fail(self, err: Exception, status: int = 2) -> int:
    """Prints ``err`` as one line on stderr, in terms of this parser's flags (:meth:`flag_message`).

    Args:
      err: the error (usually a :class:`~jaxckpt.JaxckptError`).
      status: the exit status to return (2: bad input).

    Returns:
      ``status``, for ``return parser.fail(err)``.
    """
    print(f"{self.prog}: error: {self.flag_message(str(err))}", file=sys.stderr)
    return status


def check_output_file(flag: str, path: str | None) -> None:
  """Raises :class:`JaxckptError` before any work if ``path`` cannot be written as a file (it is a directory, or its
  parent is a file), so a long run never ends with its results unwritable."""
  if path is None:
    return
  if os.path.isdir(path):
    raise JaxckptError(f"{flag} {path} is a directory; give a file path")
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
    raise JaxckptError(f"{flag} {path}: cannot create it under {parent}")


def check_output_dir(flag: str, path: str | None) -> None:
  """Raises :class:`JaxckptError` before any work if ``path`` exists and is not a directory, or cannot be created."""
  if path is None:
    return
  if os.path.exists(path) and not os.path.isdir(path):
    raise JaxckptError(f"{flag} {path} exists and is not a directory")
  check_output_file(flag, os.path.join(path, "metrics.json"))
