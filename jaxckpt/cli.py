"""Command-line plumbing shared by jaxckpt's CLIs (the report and the experiments)."""

from __future__ import annotations

import argparse

__all__ = ["CLIParser"]


class CLIParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr with exit status 2 (no usage dump)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
