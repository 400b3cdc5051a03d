"""``python -m jaxckpt.report``: :func:`jaxckpt.cli.report` (``jaxckpt-report``)."""

import sys

from jaxckpt.cli import report

sys.exit(report())
