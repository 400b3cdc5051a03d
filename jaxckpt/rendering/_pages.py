"""What jaxckpt's HTML pages share: sortable tables (cells with raw sort values, the inline sorting script) and the
Jinja2 environment that finds a package's templates and the table macros (``templates/macros.html.j2``).

The report's page (:mod:`jaxckpt.report._html`) and the fit planner's (:mod:`jaxckpt.fit._html`) are built on it; it
sits below both, so neither tool imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2


Cell = tuple[str, "float | str | None"]
"""A table cell: ``(shown text, sort value)``, the sort value the raw number, or the text."""

# Click a header: sort its table's rows by the cells' data-sort (raw numbers) or text; missing values stay last.
SORT_JS = """
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var col = Array.prototype.indexOf.call(th.parentNode.children, th);
    var asc = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    function key(row) {
      var cell = row.cells[col], v = cell.getAttribute("data-sort");
      if (v === null) v = cell.textContent;
      var n = Number(v);
      return v === "" ? null : (isNaN(n) ? v.toLowerCase() : n);
    }
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      if (x === null || y === null) return x === y ? 0 : (x === null ? 1 : -1);
      var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
      return asc ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""
"""The inline script that sorts every ``table.sortable`` by a click on a header (numbers by their raw value)."""


def cell(text: str, sort: Any = None, *, text_col: bool = False, **extra: Any) -> dict[str, Any]:
  """A table cell for the template: shown ``text``, raw ``sort`` value (numbers sort by it; ``None`` = missing)."""
  number = isinstance(sort, (int, float)) and not isinstance(sort, bool)
  return {"text": text, "sort": repr(sort) if number else None, "missing": sort is None and not text_col,
          "text_col": text_col, "sub": None, "details": None, "lines": None, "links": None, "code": False, **extra}


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell | dict]], *, text_columns: Sequence[int] = (0,),
           titles: Mapping[str, str] | None = None) -> dict[str, Any]:
  """A sortable table for the template's ``table`` macro; cells are ``(text, sort value)`` or :func:`cell` dicts."""
  out_rows = []
  for row in rows:
    out_rows.append([c if isinstance(c, dict) else cell(c[0], c[1], text_col=i in text_columns)
                     for i, c in enumerate(row)])
    for i, c in enumerate(out_rows[-1]):
      c["text_col"] = i in text_columns
  return {"headers": [{"text": h, "text_col": i in text_columns, "title": (titles or {}).get(h)}
                      for i, h in enumerate(headers)], "rows": out_rows}


def table_data(headers: Sequence[str], rows: Sequence[Sequence[Cell]], *,
               text_columns: Sequence[int] = (0,)) -> dict[str, Any]:
  """A sortable table for the ``table`` macro of ``templates/macros.html.j2``: ``headers`` (str) and rows of
  ``(shown text, raw sort value)`` cells (numbers sort by the raw value; ``None`` sorts last). Other pages
  (:mod:`jaxckpt.fit._html`) build their tables with it."""
  return table(headers, rows, text_columns=text_columns)


def template_env(*packages: str) -> jinja2.Environment:
  """A Jinja2 environment (autoescaped, strict) that finds templates in ``<package>/templates`` for each of
  ``packages``, then the shared table macros (``jaxckpt/rendering/templates/macros.html.j2``)."""
  loaders = [jinja2.PackageLoader(p, "templates") for p in packages]
  shared = jinja2.PackageLoader("jaxckpt.rendering", "templates")
  return jinja2.Environment(loader=jinja2.ChoiceLoader([*loaders, shared]),
                            autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
