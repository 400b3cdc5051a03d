"""jaxckpt's experiments: ``python -m experiments.classifier`` and ``python -m experiments.lm``.

Importing jaxckpt first checks ``JAX_REMAT3`` before anything imports JAX: the experiments import optax and JAX right
after. The library raises :class:`jaxckpt.errors.EnvSettingError` for an unknown value; this package is a program,
so it prints that as one line and exits 2 (not JAX's ``ValueError`` traceback, nor jaxckpt's).
"""

import sys

try:
  import jaxckpt  # noqa: F401  (runs jaxckpt._remat_impl.check_env before JAX reads JAX_REMAT3)
except ValueError as _err:  # jaxckpt.errors.EnvSettingError (a JaxckptError, a ValueError): the package did not load
  if type(_err).__name__ != "EnvSettingError":
    raise
  sys.stderr.write(f"jaxckpt: {_err}\n")
  raise SystemExit(2) from None
