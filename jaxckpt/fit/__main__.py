"""``python -m jaxckpt.fit``: :func:`jaxckpt.cli.fit` (``jaxckpt-fit``)."""

import sys

from jaxckpt.cli import fit

sys.exit(fit())
