"""``python -m jaxckpt.fit``: see :mod:`jaxckpt.fit.cli`."""

import sys

from jaxckpt.fit.cli import main

sys.exit(main())
