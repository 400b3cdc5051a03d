"""How the tools show what they found: records rendered as text (:func:`memory_table`, :func:`policy_summary`; bytes
in binary units, the records themselves stay in bytes), terminal tables on ``rich`` that fit the terminal's width
(``_tables``: every CLI table of the report, the planner and the fit), and what the HTML pages share (``_pages``:
sortable tables, the Jinja2 environment and the table macros of ``templates/macros.html.j2``).

It sits below the tools that show things (the planner, the report, the fit, the CLI) and imports nothing of jaxckpt
above the ground floor, so the report and the fit share it without importing each other.
"""

from __future__ import annotations

from jaxckpt.rendering._text import memory_table, policy_summary

__all__ = [
    "memory_table",
    "policy_summary",
]
