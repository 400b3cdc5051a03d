"""Terminal tables (jaxckpt.rendering._tables on rich): the report and plan tables fit the width, long policies become
labels, an error row's message is printed once, --wide keeps one line per row, CSV holds JSON text, --help lists every
policy form. A hand-made report keeps these cheap; one slow test runs the CLI on the tiny GPT."""

import csv
import io
import json

import pytest

from jaxckpt.policies import AUTO, BUDGET, MIN_SAVED, MINCUT
from jaxckpt.report._build import Report
from jaxckpt.report._keys import STATUS_ERROR, empty_row
from jaxckpt.report._outputs import to_csv, to_markdown, to_table
from jaxckpt.rendering._tables import render_table, short_labels, wrap_lines

MiB = 2**20
PLAN = ("attn=save_tensors:" + "+".join(f"t{i}_squeeze" for i in range(12)) + ",mlp=save_tensors:"
        + "+".join(f"t{i}_add" for i in range(8)))
ERROR = ("no plan fits budget:30% (temp ≤ 4.32 MiB): the least memory any plan reaches is temp 4.74 MiB (33% of "
         "none's), with policy nothing_saveable on every layer (footprint 6.12 MiB); to go lower use a smaller batch")


def _row(policy, temp_mib, flops, **extra):
  row = empty_row(policy)
  row.update(temp_bytes=temp_mib * MiB, footprint_bytes=(temp_mib + 1.4) * MiB, residual_bytes=temp_mib * MiB // 2,
             flops=flops, flops_xla_raw=flops // 2, compile_s=1.5, stages_s={"build": 0.1, "compile": 1.4},
             residuals={"count": 3, "groups": [{"by": "name", "key": "dot_general", "bytes": 2 * MiB},
                                               {"by": "kind", "key": "add", "bytes": MiB // 2}]}, **extra)
  return row


def _report():
  rows = [_row("none", 14, 422_000_000), _row("nothing_saveable", 5, 505_000_000),
          _row("save_only_these_names:attn_context", 6, 496_000_000), _row(PLAN, 7, 440_000_000),
          {**empty_row("budget:30%"), "status": STATUS_ERROR, "error": ERROR},
          _row("budget:50%", 7, 434_000_000, plan={"policy": PLAN, "compiles": 5, "seconds": 58.2})]
  return Report({"model": "gpt", "preset": "tiny", "structure": "scan", "backend": "cpu", "device_count": 1,
                 "mesh": None, "warnings": [f"policy 'budget:30%': {ERROR}",
                                            "policy 'x' saves no memory: temp 17.0 MiB ≥ none's 14.4 MiB"],
                 "rows": rows})


@pytest.mark.parametrize("width", [100, 80])
def test_report_table_fits_the_width_with_labels_and_one_error(width):
  text = to_table(_report(), width=width)
  lines = text.splitlines()
  assert max(map(len, lines)) <= width
  assert text.count("no plan fits budget:30%") == 1  # the error once, wrapped, not in the row and the warnings
  assert text.count("[1]") == 2 and f"[1] {PLAN[:40]}" in text  # the long policy: a label and its legend
  assert "save_only_these_names:\nattn_context" in text.replace(" ", "").replace("\n\n", "\n") or \
      "attn_context" in text
  assert "14.00 MiB" in text and "0.36 *" in text  # nothing_saveable's temp ratio, marked best
  assert "XLA FLOPs" not in text and "saves no memory" in text


def test_wide_table_is_one_line_per_row():
  text = to_table(_report(), wide=True)
  row_lines = [line for line in text.splitlines() if line.startswith(("none ", "budget:30%", PLAN[:20]))]
  assert len(row_lines) == 3 and any(PLAN in line for line in row_lines)
  assert "XLA FLOPs (raw)" in text and text.count("no plan fits budget:30%") == 1


def test_markdown_prints_an_error_rows_message_once():
  text = to_markdown(_report())
  assert text.count("no plan fits budget:30%") == 1 and "saves no memory" in text  # other warnings stay


def test_csv_nested_values_are_json_text():
  rows = list(csv.DictReader(io.StringIO(to_csv(_report()))))
  assert json.loads(rows[0]["stages_s"]) == {"build": 0.1, "compile": 1.4}
  assert json.loads(rows[-1]["plan"])["policy"] == PLAN and rows[0]["plan"] == ""


def test_render_table_wraps_cells_and_notes():
  text = render_table(["a", "long column"], [["x", "word " * 30], ["y\nz", "1"]], notes=["n " * 40], width=40,
                      right=(1,))
  assert max(map(len, text.splitlines())) <= 40 and text.count("word") == 30
  assert len(render_table(["a"], [["word " * 30]], wide=True).splitlines()) == 3  # header, rule, one row


def test_wrap_and_labels():
  assert wrap_lines(["k = a+bb+ccc+dddd"], width=9) == ["k = a+bb+", "  ccc+", "  dddd"]
  labels, legend = short_labels(["short", "x" * 40, "short"], max_len=10, keep=4)
  assert labels == {"short": "short", "x" * 40: "xxxx… [1]"} and legend == ["[1] " + "x" * 40]


@pytest.mark.parametrize("module", ["jaxckpt.cli._report", "experiments.classifier", "experiments.lm"])
def test_help_lists_every_policy_form(module, capsys):
  import importlib  # noqa: PLC0415

  with pytest.raises(SystemExit):
    importlib.import_module(module).main(["--help"])
  out = capsys.readouterr().out
  for form in (f"{BUDGET}:SIZE", f"{BUDGET}:P%", f"{AUTO}:margin=", MIN_SAVED, f"{MINCUT}:SIZE", "FIRST-LAST:SPEC",
               "BLOCK=POLICY"):
    assert form in out, form


@pytest.mark.slow  # compiles 13 policies of the tiny GPT and plans two budgets (~2 min on 2 cores)
def test_cli_report_fits_100_columns(monkeypatch, capsys):
  from jaxckpt.cli._report import main  # noqa: PLC0415

  monkeypatch.setenv("COLUMNS", "100")
  assert main(["--model", "gpt", "--preset", "tiny", "--policies", "all", "budget:30%", "budget:50%",
               "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert max(map(len, out.splitlines())) <= 100
  assert out.count("no plan fits budget:30%") == 1


def test_value_without_a_source_line_says_so():
  from jaxckpt.planner._tensors import BlockGraph  # noqa: PLC0415
  from jaxckpt.core._tagging import ValueInfo  # noqa: PLC0415

  values = tuple(ValueInfo(index=i, op=i, primitive="add", shape=(2, 3), dtype="float32", bytes=24, inputs=(),
                           source=src, taggable=True, eqn=None) for i, src in enumerate(["m.py:3 (f)", ""]))
  graph = BlockGraph("attn", values, frozenset(), {}, {}, 0)
  assert graph.describe(0).endswith("24 B from m.py:3 (f)")
  assert graph.describe(1).endswith("24 B (no source line: made by JAX)") and "from" not in graph.describe(1)


def test_saves_no_memory_warning_in_mib():
  from jaxckpt.report._build import saving_warnings  # noqa: PLC0415

  rows = [{**empty_row("none"), "temp_bytes": 14 * MiB}, {**empty_row("everything_saveable"), "temp_bytes": 17 * MiB}]
  assert saving_warnings(rows) == ["policy 'everything_saveable' saves no memory: temp 17.00 MiB ≥ none's 14.00 MiB"]


def test_a_narrow_table_keeps_file_lines_and_policy_names_whole():
  """A column is narrowed to its longest word, not below, while the table fits: ``model.py:231`` and
  ``nothing_saveable`` are never broken; numbers then go over their units; only a table that cannot fit so breaks
  words."""
  from jaxckpt.rendering._tables import fit_widths, longest_word

  cells = ["3.38 MiB multiply at own_models.py:231", "nothing_saveable"]
  assert longest_word(cells) == len("own_models.py:231")
  natural, floors = [16, 8, 8, 40], {0: 16, 1: 4, 2: 4, 3: 17}
  assert fit_widths(natural, 60, keep=(1, 2), least=12, floors=floors) == {0: 16, 1: 8, 2: 8, 3: 22}
  assert fit_widths(natural, 52, keep=(1, 2), least=12, floors=floors) == {0: 16, 1: 6, 2: 7, 3: 17}
  assert fit_widths(natural, 40, keep=(1, 2), least=12, floors=floors) == {0: 12, 1: 8, 2: 8, 3: 12}
