"""``python -m jaxckpt.fit``: see :mod:`jaxckpt.fit._cli`."""

import sys

from jaxckpt.fit._cli import main

sys.exit(main())
