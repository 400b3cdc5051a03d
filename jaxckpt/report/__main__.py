"""``python -m jaxckpt.report``: see :mod:`jaxckpt.report.cli`."""

import sys

from jaxckpt.report.cli import main

sys.exit(main())
