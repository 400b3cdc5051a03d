"""Command-line plumbing shared by jaxckpt's CLIs (the report and the experiments)."""

from __future__ import annotations

import argparse
import os

from jaxckpt.errors import JaxckptError

__all__ = ["CLIParser", "check_output_file", "check_output_dir"]


class CLIParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr with exit status 2 (no usage dump)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
