"""Terminal tables that fit the terminal, on ``rich``: one function every CLI table uses (report, plan, fit planner).

:func:`render_table` returns plain text (no colour, no box-drawing characters), so it can be printed, logged or
compared in tests. By default it fits the terminal's width (``COLUMNS`` when set, else the terminal's, else 100):
cells wrap at spaces and at the line breaks they contain; ``wide=True`` keeps every cell on one line however long
the line gets. :func:`short_labels` turns long strings (budget plans, ``save_tensors:`` policies) into short labels
with a legend, so the full strings go below the table instead of pushing every column right.
"""

from __future__ import annotations

import io
import re
import shutil
import textwrap
from collections.abc import Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

DEFAULT_WIDTH = 100
"""Characters per line when neither ``COLUMNS`` nor a terminal says otherwise."""

_WIDE = 100_000  # "no limit" for wide=True


def terminal_width() -> int:
  """Characters per line: ``COLUMNS`` when set, else the terminal's width, else :data:`DEFAULT_WIDTH`."""
  return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


class _Wrapper(textwrap.TextWrapper):
  """``textwrap`` that may also break after ``+`` and ``,`` (inside policy strings: ``t7_div+t11_sub,mlp=…``)."""

  wordsep_simple_re = re.compile(r"(\s+|(?<=[+,])(?=[^\s+,]))")


def wrap_lines(lines: Sequence[str], *, width: int | None = None, wide: bool = False, indent: str = "  ") -> list[str]:
  """``lines`` wrapped to ``width`` at spaces and after ``+``/``,`` (continuations indented by ``indent`` more than
  the line's own indent); unchanged with ``wide``. A word longer than the width is broken."""
  if wide:
    return list(lines)
  width = width or terminal_width()
  out = []
  for line in lines:
    lead = line[:len(line) - len(line.lstrip(" "))]
    wrapper = _Wrapper(width=width, subsequent_indent=lead + indent, break_on_hyphens=False)
    out += wrapper.wrap(line) or [""]
  return out


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
                 notes: Sequence[str] = (), width: int | None = None, wide: bool = False,
                 right: Sequence[int] = (), widths: Mapping[int, int] | None = None,
                 no_wrap: Sequence[int] = ()) -> str:
  """A plain-text table: a header line, a rule, one or more lines per row, then ``notes``.

  Args:
    headers: column headers.
    rows: cells as text; a ``"\\n"`` in a cell starts a new line within it.
    title: a line above the table (wrapped like the notes).
    notes: lines below the table (footnotes, legends, warnings), wrapped to the width.
    width: characters per line; ``None`` = :func:`terminal_width`. No line is longer (a single word longer than
      its column is broken).
    wide: every cell and note on one line, whatever the width.
    right: indices of right-aligned columns (numbers).
    widths: column index -> its width in characters (fixed: cells wrap inside it); the other columns share the
      rest (:func:`fit_widths` computes widths that fit).
    no_wrap: indices of columns whose cells are never wrapped (they keep their width; others share the rest).

  Returns:
    The table as text, lines without trailing spaces, no final newline.

  Source: ``rich.table.Table`` (https://rich.readthedocs.io/en/stable/tables.html), which shares out the width and
  wraps cells.
  """
  width = _WIDE if wide else (width or terminal_width())
  table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False, padding=(0, 1), collapse_padding=True,
                header_style="", show_header=True)
  for i, header in enumerate(headers):
    table.add_column(Text(header), justify="right" if i in right else "left", no_wrap=wide or i in no_wrap, overflow="fold",
                     width=None if wide else (widths or {}).get(i))
  for row in rows:
    table.add_row(*(Text(" ".join(cell.split("\n")) if wide else cell) for cell in row))
  buffer = io.StringIO()
  console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False,
                    emoji=False, markup=False, soft_wrap=False, legacy_windows=False)
  console.print(table)
  lines = [line.rstrip() for line in buffer.getvalue().rstrip("\n").split("\n")]
  head = wrap_lines([title], width=width, wide=wide) if title else []
  return "\n".join([*head, *lines, *wrap_lines(notes, width=width, wide=wide)])


def fit_widths(natural: Sequence[int], width: int, *, keep: Sequence[int] = (), flex: int = -1,
               least: int = 8, floors: Mapping[int, int] | None = None) -> dict[int, int]:
  """Column widths that fit ``width`` characters with two spaces between columns.

  Columns in ``keep`` (numbers) get their natural width; the others too when everything fits. Otherwise the
  ``flex`` column gets what is left, but at least ``least`` characters, taken from the widest other column.

  Args:
    natural: each column's widest line (characters).
    width: characters per line.
    keep: columns never narrowed.
    flex: the column that wraps first (default the last).
    least: the narrowest any narrowed column gets.
    floors: column -> its longest word (:func:`longest_word`): a column is narrowed to it, not below, so a
      ``file.py:231`` or a policy name stays whole; when the table does not fit so, the ``keep`` columns are
      narrowed to their longest words too (a number over its unit); when it still does not, to ``least``.

  Returns:
    ``{column: width}`` for :func:`render_table`'s ``widths``.
  """
  flex = flex % len(natural)
  room = width - 2 * (len(natural) - 1)
  if sum(natural) <= room:
    return dict(enumerate(natural))
  words = {i: max(least, (floors or {}).get(i, 0)) for i in range(len(natural))}
  tries = ((keep, words), ((), {i: (floors or {}).get(i, least) if i in keep else words[i] for i in words}),
           (keep, dict.fromkeys(words, least)))  # words whole, the kept columns natural; then narrowed to their
  for fixed, floor in tries:  # longest words; then words broken (the kept columns natural)
    out = dict(enumerate(natural))
    out[flex] = max(floor[flex], room - sum(w for i, w in out.items() if i != flex))
    while sum(out.values()) > room:
      others = [i for i in out if i != flex and i not in fixed and out[i] > floor[i]]
      if not others:
        break
      out[max(others, key=out.get)] -= 1
    if sum(out.values()) <= room:
      break
  return out


def longest_word(cells: Sequence[str]) -> int:
  """The longest word (between spaces and line breaks) of ``cells``: the narrowest a column of them may be without
  breaking one (:func:`fit_widths`' ``floors``)."""
  return max((len(word) for cell in cells for word in cell.split()), default=0)


def short_labels(texts: Sequence[str], *, max_len: int = 28, keep: int = 16) -> tuple[dict[str, str], list[str]]:
  """Short labels for texts longer than ``max_len``, and the legend giving each one in full.

  A long text becomes its first ``keep`` characters, ``…`` and a number in brackets (``attn=save_tensors:…
  [1]``); the legend has one line per label, ``[1] attn=save_tensors:t7_div+…`` in full. Short texts are their own
  labels.

  Args:
    texts: the strings (e.g. policy specs), in table order; repeats get one label.
    max_len: longest text kept whole (characters).
    keep: characters of a long text kept in its label.

  Returns:
    ``({text: label}, legend lines)``.
  """
  labels, legend = {}, []
  for text in texts:
    if text in labels:
      continue
    if len(text) <= max_len:
      labels[text] = text
    else:
      n = len(legend) + 1
      labels[text] = f"{text[:keep]}… [{n}]"
      legend.append(f"[{n}] {text}")
  return labels, legend
