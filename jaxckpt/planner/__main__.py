"""``python -m jaxckpt.planner``: :func:`jaxckpt.cli.plan` (``jaxckpt-plan``)."""

import sys

from jaxckpt.cli import plan

sys.exit(plan())
