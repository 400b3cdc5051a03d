"""jaxckpt's experiments: ``python -m experiments.classifier`` and ``python -m experiments.lm``.

Importing jaxckpt first checks ``JAX_REMAT3`` before anything imports JAX (an unknown value is one line, exit 2,
not JAX's traceback): the experiments import optax and JAX right after.
"""

import jaxckpt  # noqa: F401  (runs jaxckpt.remat_impl.check_env before JAX reads JAX_REMAT3)
