"""``python -m jaxckpt.planner``: see :mod:`jaxckpt.planner.cli`."""

import sys

from jaxckpt.planner.cli import main

sys.exit(main())
