"""The report's HTML page (plotly charts, sortable tables; rendered in headless Chromium) and its static plot."""

import html
import json
import os
import re
import shutil
import subprocess

import pytest

from jaxckpt.errors import JaxckptError
from jaxckpt.report import build_report, to_html, write_outputs
from jaxckpt.step import shipped_target
from jaxckpt.report._html import SPREAD_WITHIN, chart_figures, short_source, spread_points
from jaxckpt.report._plot import PLOT_SUFFIXES, label_groups, pareto_figure, plot_format, plot_pareto

POLICIES = ["none", "full", "dots_saveable", "budget:90%", "save_only_these_names:mlp_out"]


@pytest.fixture(scope="module")
def report():
  # MLP tiny: none 287008 temp bytes, dots_saveable 243408; save_only_these_names:mlp_out lowers to the very program
  # of nothing_saveable (the same point on every chart).
  return build_report(shipped_target("mlp", "tiny", batch_size=8), POLICIES, progress=False)


def test_fixture_has_every_kind_of_row(report):
  assert [r["status"] for r in report.rows] == ["ok"] * 5
  plan = report.row("budget:90%")["plan"]
  assert plan["ranges"] and plan["ranges"][0]["first"] == 0


def test_charts_carry_exact_bytes_and_flops(report):
  figures = chart_figures(report)
  assert list(figures) == ["pareto", "memory", "residuals", "plan"]
  ok = report.rows
  # Pareto: one marker trace per policy and panel, hover data = (policy, exact bytes, exact FLOPs, ratio).
  points = [t for t in figures["pareto"].data if t.mode == "markers"]
  by_policy = {}
  for t in points:
    by_policy.setdefault(t.customdata[0][0], []).append(t.customdata[0])
  assert set(by_policy) == {r["policy"] for r in ok}
  none_flops = report.row("none")["flops"]
  for r in ok:
    temp, footprint = (c for c in by_policy[r["policy"]])
    assert temp[1] == r["temp_bytes"] and footprint[1] == r["footprint_bytes"] and temp[2] == r["flops"]
    assert temp[3] == pytest.approx(r["flops"] / none_flops)
  assert [t.name for t in points if t.marker.symbol == "diamond"] == ["budget:90%", "budget:90%"]
  # Memory: argument + output + temp stacked per policy, exact bytes in customdata.
  memory = {t.name.split(" ")[0]: [c[0] for c in t.customdata] for t in figures["memory"].data}
  assert memory["temp"] == [r["temp_bytes"] for r in ok]
  assert memory["arguments"] == [r["argument_bytes"] for r in ok]
  # Residuals: stacked segments of each policy add up to its residual bytes.
  totals = [sum(t.customdata[i][1] for t in figures["residuals"].data) for i in range(len(ok))]
  assert totals == [r["residual_bytes"] for r in ok]
  # Plan: one bar per layer range of the budget row.
  plan = report.row("budget:90%")["plan"]
  bars = figures["plan"].data
  assert [(b.base[0], b.base[0] + b.x[0] - 1, b.name) for b in bars] == [
      (g["first"], g["last"], g["spec"]) for g in plan["ranges"]]


def test_page_is_self_contained_and_sortable(report, tmp_path):
  page = to_html(report)
  assert page.count("plotly.js v") == 1  # the library inlined once, before the first chart
  assert not re.search(r"<script[^>]*\ssrc=", page)  # nothing fetched: works offline
  assert "Plotly.newPlot" in page and page.count('class="chart"') == 4
  assert page.count('<table class="sortable">') >= 2 + len(report.rows)  # summary, plans, residuals per policy
  none = report.row("none")
  assert f'data-sort="{none["temp_bytes"]}"' in page and f'data-sort="{none["flops"]}"' in page
  assert "<details>" in page and html.escape(report.row("budget:90%")["plan"]["policy"]) in page
  small = to_html(report, plotlyjs="cdn")
  assert len(small) < 300_000 and re.search(r'<script [^>]*src="https://cdn.plot.ly/', small)
  assert "plotly.js v" not in to_html(report, plot=False)
  with pytest.raises(JaxckptError, match="plotlyjs='offline' is not one of inline, cdn"):
    to_html(report, plotlyjs="offline")


def _chromium() -> str | None:
  return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


_CLICK_TEMP = """<script>
var th = Array.prototype.find.call(document.querySelectorAll("table.sortable")[0].tHead.rows[0].cells,
                                   function (c) { return c.textContent === "temp/device"; });
th.click(); th.click();  // descending
</script></body></html>"""


@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (apt-get install chromium); the browser test "
                                                 "needs a real browser")
def test_page_renders_in_headless_chromium(report, tmp_path):
  """Every chart draws SVG (one marker per policy and panel, one bar per policy and segment), the console shows no
  error, and a click on the 'temp/device' header sorts the summary by the raw bytes."""
  path = tmp_path / "report.html"
  path.write_text(to_html(report).replace("</body></html>", _CLICK_TEMP))
  done = subprocess.run(
      [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
       "--no-first-run", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
       "--virtual-time-budget=10000", "--dump-dom", path.as_uri()],
      capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  dom = done.stdout
  # Chromium logs every console message (errors, uncaught exceptions, warnings) as ":CONSOLE" at one level.
  assert [line for line in done.stderr.splitlines() if ":CONSOLE" in line] == []
  starts = [(m.group(1), m.start()) for m in re.finditer(r'<div id="plot-(\w+)"', dom)]
  charts = {}
  for (chart_id, start), (_, end) in zip(starts, [*starts[1:], ("", len(dom))]):
    charts[chart_id] = dom[start:end].split("<script", 1)[0]  # the drawn div, not the script that drew it
  assert list(charts) == ["pareto", "memory", "residuals", "plan"]
  points = {k: len(re.findall(r'class="point[" ]', body)) for k, body in charts.items()}
  for chart_id, body in charts.items():
    assert '<svg class="main-svg"' in body, chart_id
  n = len(report.rows)
  assert points["pareto"] == 2 * n  # temp and footprint panels
  assert points["memory"] == 3 * n  # argument, output, temp bars
  assert points["residuals"] >= n
  assert points["plan"] == len(report.row("budget:90%")["plan"]["ranges"])
  summary = re.search(r'<table class="sortable">.*?</table>', dom, re.S).group(0)
  assert 'aria-sort="descending"' in summary
  order = re.findall(r"<tr><td class=\"text\"[^>]*>([^<]+)</td>", summary)
  expected = [r["policy"] for r in sorted(report.rows, key=lambda r: -r["temp_bytes"])]
  assert order == expected


def test_static_plot_writes_the_format_its_suffix_names(report, tmp_path):
  magic = {"png": b"\x89PNG\r\n\x1a\n", "jpg": b"\xff\xd8\xff", "pdf": b"%PDF", "svg": b"<?xml"}
  for suffix, fmt in PLOT_SUFFIXES.items():
    path = tmp_path / f"pareto{suffix.upper() if suffix == '.jpg' else suffix}"
    data = plot_pareto(report, str(path))
    assert path.read_bytes() == data and data.startswith(magic[fmt]), suffix
  assert plot_format("a.JPEG") == "jpg"
  with pytest.raises(JaxckptError, match=r"path=\S*/out.gif: unknown image format \('.gif'\); valid suffixes: .png, "):
    plot_pareto(report, str(tmp_path / "out.gif"))
  with pytest.raises(JaxckptError, match="plot_path=out: unknown image format \\(no suffix\\)"):
    write_outputs(report, json_path=str(tmp_path / "r.json"), plot_path="out")
  assert not (tmp_path / "r.json").exists()  # refused before anything is written


def test_static_plot_numbers_points_and_keys_them(report, tmp_path):
  svg = plot_pareto(report, str(tmp_path / "p.svg")).decode()
  texts = re.findall(r"<!-- (.*?) -->", svg)  # matplotlib's SVG names each text it draws
  for r in report.rows:  # names only in the key, once each; the points carry numbers
    assert texts.count(r["policy"]) == 1, r["policy"]
  labels = [t for t in texts if re.fullmatch(r"\d+(,\d+)*", t)]
  n = len(report.rows)
  assert sorted(int(x) for label in labels for x in label.split(",")) == sorted([*range(1, n + 1)] * 2)
  # nothing_saveable (2) and save_only_these_names:mlp_out (5) are one program: one shared label per panel.
  full, named = report.row("nothing_saveable"), report.row("save_only_these_names:mlp_out")
  assert named["same_program_as"] == "nothing_saveable" and named["temp_bytes"] == full["temp_bytes"]
  assert named["flops"] == full["flops"]
  assert labels.count("2,5") == 2


def test_cli_bad_plot_suffix_exits_2_before_compiling(tmp_path, capsys):
  from jaxckpt.cli._report import main

  assert main(["--model", "mlp", "--policies", "none", "--plot", str(tmp_path / "out.gif"),
               "--json", str(tmp_path / "r.json")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "unknown image format ('.gif')" in err and ".svg" in err
  assert not (tmp_path / "r.json").exists()


def test_cli_writes_html_with_plotly_and_json(tmp_path, capsys):
  from jaxckpt.cli._report import main

  out = tmp_path / "r.html"
  assert main(["--model", "mlp", "--preset", "tiny", "--batch-size", "8", "--policies", "none", "full",
               "--no-progress", "--no-residuals", "--html", str(out), "--plotlyjs", "cdn",
               "--json", str(tmp_path / "r.json")]) == 0
  page = out.read_text()
  assert "Plotly.newPlot" in page and os.path.getsize(out) < 300_000
  data = json.loads((tmp_path / "r.json").read_text())
  assert all(r["profile"] is None for r in data["rows"])


# --- readable output: legend names, spread points, labels apart, template only, fits the window ---------


def test_residual_legend_names_a_user_can_place(report):
  names = [t.name for t in chart_figures(report)["residuals"].data]
  assert names and not any("unnamed" in n for n in names)
  for name in names:  # a checkpoint name, or the op and the source line that made most of its bytes
    assert name.endswith("(checkpoint name)") or re.search(r" at \S+\.py:\d+", name) or name in ("other",) \
        or name.endswith("values (made by no op: constants, scalars)"), name
  assert short_source("/a/b/jaxckpt/core/blocks.py:207:27 (_residual_pair)") == "blocks.py:207 (_residual_pair)"
  assert short_source(None) == "no source line"


def test_spread_points_separates_only_overlapping_ones():
  xs = spread_points([(1.0, 5.0), (1.0, 5.0), (1.0, 5.0), (2.0, 9.0), (1.5, 7.0)])
  assert xs[3:] == [2.0, 1.5]  # alone: where they are
  assert sorted(xs[:3]) == pytest.approx([0.975, 1.0, 1.025]) and len(set(xs[:3])) == 3
  assert spread_points([(0.0, 0.0), (SPREAD_WITHIN * 2, 0.0), (1.0, 1.0)])[:2] == [0.0, SPREAD_WITHIN * 2]


def test_label_groups_pairs_only_points_within_4_percent_of_each_other():
  points = [(0.0, 0.0), (0.03, 0.0), (0.06, 0.0), (1.0, 1.0)]  # 0-1 and 1-2 are 3% apart, 0-2 are 6%
  assert label_groups(points) == [[0, 1], [2], [3]]
  assert label_groups([(0.5, 0.5), (0.5, 0.5), (0.0, 0.0), (1.0, 1.0)]) == [[0, 1], [2], [3]]


def test_static_plot_labels_do_not_overlap(report):
  from matplotlib import pyplot as plt

  fig = pareto_figure(report)
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  for ax in fig.axes:
    boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_gid() == "point-label"]
    assert boxes
    assert not [(i, j) for i, a in enumerate(boxes) for j, b in enumerate(boxes) if i < j and a.overlaps(b)]
  plt.close(fig)


def test_no_html_is_built_in_python():
  """The page's markup lives in the Jinja2 template; Python modules hand it data (plotly hover text aside)."""
  folder = os.path.join(os.path.dirname(__file__), "..", "..", "jaxckpt", "report")
  for name in sorted(os.listdir(folder)):
    if name.endswith(".py"):
      source = open(os.path.join(folder, name)).read()
      assert not re.search(r"<(table|tr|td|th|thead|tbody|details|summary|p|h\d|ul|li|div|a|code|style|html|body)"
                           r"[\s>]", source), name
  assert os.path.exists(os.path.join(folder, "templates", "report.html.j2"))


_MEASURE = """<script>
window.addEventListener("load", function () {
  setTimeout(function () {
    var root = document.documentElement, out = document.createElement("pre");
    out.id = "measured";
    var points = [];
    document.querySelectorAll("#plot-pareto g.subplot").forEach(function (sub) {
      sub.querySelectorAll("path.point").forEach(function (p) {
        var r = p.getBoundingClientRect();
        points.push([sub.getAttribute("class"), r.x + r.width / 2, r.y + r.height / 2]);
      });
    });
    out.textContent = JSON.stringify({scroll: root.scrollWidth, client: root.clientWidth, points: points});
    document.body.appendChild(out);
  }, 3000);
});
</script></body></html>"""


@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (apt-get install chromium)")
@pytest.mark.parametrize("width", [1400, 1000])
def test_page_fits_the_window_and_points_stay_apart(report, tmp_path, width):
  """At 1400 and 1000 px: no horizontal scrollbar on the page, no two Pareto markers of a panel within 4 px."""
  path = tmp_path / "report.html"
  path.write_text(to_html(report).replace("</body></html>", _MEASURE))
  done = subprocess.run(
      [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
       "--no-first-run", f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={width},900",
       "--virtual-time-budget=10000", "--dump-dom", path.as_uri()],
      capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  measured = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', done.stdout, re.S).group(1)))
  assert measured["scroll"] <= measured["client"], measured
  points = measured["points"]
  assert len(points) == 2 * len(report.rows)
  close = [(a, b) for i, a in enumerate(points) for b in points[i + 1:]
           if a[0] == b[0] and abs(a[1] - b[1]) < 4 and abs(a[2] - b[2]) < 4]
  assert close == []
