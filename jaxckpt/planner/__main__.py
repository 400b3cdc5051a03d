"""``python -m jaxckpt.planner``: see :mod:`jaxckpt.planner._cli`."""

import sys

from jaxckpt.planner._cli import main

sys.exit(main())
