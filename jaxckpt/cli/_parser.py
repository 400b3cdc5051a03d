"""The parser every jaxckpt CLI is built on (the tools and the experiments): one-line errors in terms of flags, one
reference at the end of every ``--help`` built from the registries, and whether to draw progress bars."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from jaxckpt import names
from jaxckpt.models import MODEL_REGISTRY
from jaxckpt.policies import POLICY_FORMS, POLICY_NAMES
from jaxckpt.step._bounds import INT32_MAX


def reference_epilog(*, models: Sequence[str] | None = None, policy_words: str = "",
                     examples: Sequence[str] = (), notes: Sequence[str] = ()) -> str:
  """The end of every jaxckpt CLI's ``--help``, built from the registries, so no tool's help drifts from another's:
  presets and block types per model (:data:`jaxckpt.models.MODEL_REGISTRY`), the policy grammar and every policy name
  (:data:`jaxckpt.policies.POLICY_FORMS`, :data:`~jaxckpt.policies.POLICY_NAMES`), the checkpoint names the shipped
  layers emit (:data:`jaxckpt.names.ALL_NAMES`), then the tool's own notes and examples.

  Args:
    models: the model registry's names to describe (default all).
    policy_words: words the tool adds before the policy names (``"all (every policy worth comparing), "``).
    examples: command lines, one each.
    notes: lines of the tool's own, before the examples.

  Returns:
    The text (lines joined with newlines; for ``argparse.RawDescriptionHelpFormatter``).
  """
  entries = [(n, e) for n, e in MODEL_REGISTRY.items() if models is None or n in models]
  lines = [f"presets per model: {'; '.join(f'{n}: ' + ', '.join(e.presets) for n, e in entries)}",
           f"block types per model: {'; '.join(f'{n}: ' + ', '.join(e.block_types) for n, e in entries)}",
           POLICY_FORMS, f"policy names: {policy_words}{', '.join(POLICY_NAMES)}",
           f"checkpoint names: {', '.join(names.ALL_NAMES)}", *notes]
  if examples:
    lines += ["examples:", *(f"  {e}" for e in examples)]
  return "\n".join(lines)


EXIT_BAD_INPUT = 2
"""The exit status of every jaxckpt CLI for bad input (a flag, a file, the environment): one line on stderr."""

EXIT_OUTPUT = 1
"""The exit status of a jaxckpt CLI whose work finished but whose output file could not be written (a full disk): one
line on stderr naming the file (:class:`~jaxckpt.errors.OutputWriteError`)."""

DIMENSION_FLAGS = ("batch_size", "seq_len", "global_batch_size", "min_batch", "max_batch", "max_seq_len", "num_layers",
                   "grad_accum_steps", "vocab_tiles")
"""The flags (by ``dest``) whose value becomes an array dimension (or a count of them): each is bounded by
:data:`jaxckpt.step._bounds.INT32_MAX` when parsed, so an absurd value is one line naming the flag."""

_NEGATIVE = re.compile(r"-\d")
"""A value that starts like a negative number (``-1GiB``, ``-5%``, ``-0.5``), not a flag."""

_QUOTED = re.compile(r"((?<![\w'])'[^'\n]*'(?![\w']))")
"""A quoted value in a message (``'data=4,fsdp=2'``), not an apostrophe (``none's``): kept as it is."""


class CLIParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr with exit status 2 (no usage dump).

  The library's errors name Python arguments (``seq_len=0 must be ≥ 1``); :meth:`fail` prints them with this
  parser's flags instead (``--seq-len 0 must be ≥ 1``): the one place where the CLIs translate them.
  """

  def parse_known_args(self, args=None, namespace=None):
    """As argparse's, but a negative value after a flag that takes one (``--memory -1GiB``, ``--budget -5%``) is
    that flag's value, so it reaches the flag's own check instead of argparse's "expected one argument"."""
    args = list(sys.argv[1:] if args is None else args)
    takes_value = {o for a in self._actions if a.option_strings and a.nargs is None for o in a.option_strings}
    joined: list[str] = []
    i = 0
    while i < len(args):
      if args[i] in takes_value and i + 1 < len(args) and _NEGATIVE.match(args[i + 1]):
        joined.append(f"{args[i]}={args[i + 1]}")
        i += 2
      else:
        joined.append(args[i])
        i += 1
    namespace, extras = super().parse_known_args(joined, namespace)
    for action in self._actions:
      value = getattr(namespace, action.dest, None) if action.dest in DIMENSION_FLAGS else None
      if isinstance(value, int) and not isinstance(value, bool) and value > INT32_MAX:
        flag = next((o for o in action.option_strings if o.startswith("--")), action.dest)
        self.error(f"{flag} {value} is past {INT32_MAX} (2^31 - 1), the largest array dimension JAX indexes "
                   "(int32); give a smaller one")
    return namespace, extras

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

  def flag_message(self, message: str) -> str:
    """``message`` with the Python arguments behind this parser's flags written as the flags.

    ``dest=value`` becomes ``--flag value`` for every flag (``dest=True`` of an on/off flag becomes ``--flag``); a bare
    ``dest`` becomes ``--flag`` only for names with an underscore (``seq_len``, ``num_layers``), so plain words such as
    "model" or "preset" in a sentence stay. Values are left as they are: text in quotes (``mesh='data=4'``: ``data=``
    there is a mesh axis, not the classifier's ``--data`` flag), the word after a ``--flag`` and after "e.g.".

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
        if action.nargs == 0 or action.const is True:  # on/off flags: store_true, --resume [auto]
          parts[i] = _sub_outside_values(rf"(?<![\w.'\"-]){dest}=True\b", flag, parts[i])
        parts[i] = _sub_outside_values(rf"(?<![\w.'\"-]){dest}=(?=\S|\Z)", flag + " ", parts[i])
        if "_" in action.dest:
          parts[i] = _sub_outside_values(rf"(?<![\w.'\"-]){dest}\b", flag, parts[i])
    return "".join(parts)

  def fail(self, err: Exception, status: int = EXIT_BAD_INPUT) -> int:
    """Prints ``err`` as one line on stderr, in terms of this parser's flags (:meth:`flag_message`).

    Args:
      err: the error (usually a :class:`~jaxckpt.JaxckptError`).
      status: the exit status to return (2: bad input).

    Returns:
      ``status``, for ``return parser.fail(err)``.
    """
    print(f"{self.prog}: error: {self.flag_message(str(err))}", file=sys.stderr)
    return status


def _is_terminal(stream: object) -> bool:
  try:
    return bool(stream.isatty())  # type: ignore[attr-defined]
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    return False


def progress_enabled(requested: bool) -> bool:
  """Whether a CLI draws progress bars: asked for (no ``--no-progress``) and both stdout and stderr are terminals.

  tqdm redraws a bar in place with carriage returns on stderr. In a log file (``cmd > run.log 2>&1``, CI, ``nohup``)
  those redraws stay as fragments and run into the program's own lines (an epoch's loss, a one-line error). So a
  CLI shows bars only to a person at a terminal; elsewhere it prints whole lines only, in order (tqdm's own
  ``disable=None`` checks stderr alone; a bar also needs stdout, where its lines go, to be the same terminal).

  Args:
    requested: the CLI's ``--progress`` setting (``False`` with ``--no-progress``).

  Returns:
    ``True`` only when ``requested`` and ``sys.stdout`` and ``sys.stderr`` are both terminals.
  """
  return bool(requested) and _is_terminal(sys.stdout) and _is_terminal(sys.stderr)


_VALUE_BEFORE = re.compile(r"(?:--[\w-]+|e\.g\.)[ =]$")
"""Text right before a match that makes it a value (``--mesh data=4``, ``e.g. data=1``), not a Python argument."""


def _sub_outside_values(pattern: str, replacement: str, message: str) -> str:
  """``re.sub`` that leaves a match alone where it is a flag's value or an example (:data:`_VALUE_BEFORE`)."""

  def replace(match: re.Match) -> str:
    before = message[max(0, match.start() - 40):match.start()]
    return match.group(0) if _VALUE_BEFORE.search(before) else replacement

  return re.sub(pattern, replace, message)
