"""``python -m jaxckpt.report``: see :mod:`jaxckpt.report._cli`."""

import sys

from jaxckpt.report._cli import main

sys.exit(main())
