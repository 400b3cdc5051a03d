"""Which remat implementation JAX uses ("remat2" or "remat3"), and what a policy must be to work under it.

JAX 0.10 has two implementations of ``jax.checkpoint``: the default ("remat2": a ``remat2`` primitive whose policy is
any predicate ``(prim, *avals, **params) -> bool``) and the next one ("remat3", JAX's ``jax_remat3`` config flag,
env ``JAX_REMAT3=1``; JAX's remat doc calls it "on its way to becoming the default"). Under remat3 a policy takes
effect only as *data*: the policy objects of ``jax.checkpoint_policies`` that JAX's remat rules recognise
(``nothing_saveable``, ``everything_saveable``, ``dots_saveable``/``dots_with_no_batch_dims_saveable``
(``DotsSaveable``), ``save_only_these_names`` (``SaveOnlyTheseNames``), ``save_any_names_but_these``
(``SaveAnyNamesButThese``)). Any other callable -- a hand-written predicate, ``save_from_both_policies``, the offload
policies -- silently becomes full remat there, so jaxckpt refuses it under remat3
(:func:`jaxckpt.policies._meaning.check_policy`).

Other differences under remat3 (jax 0.10.2, ``jax/_src/ad_checkpoint.py``): ``everything_saveable`` saves the
checkpoint-named values (and nothing unnamed); ``prevent_cse`` is ignored (an optimization barrier guards the
backward's inputs instead).

A ground module: it imports no JAX at import time, so :func:`check_env` runs before JAX reads ``JAX_REMAT3``.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from jaxckpt.errors import JaxckptError  # no JAX import: check_env runs before JAX reads the env

REMAT2 = "remat2"
"""JAX's default remat implementation (primitive ``remat2``)."""
REMAT3 = "remat3"
"""JAX's next remat implementation (config flag ``jax_remat3``)."""
ENV_VAR = "JAX_REMAT3"
"""The environment variable JAX reads its ``jax_remat3`` flag from."""

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def check_env(environ: "dict[str, str] | None" = None) -> str | None:
  """The one-line problem with ``JAX_REMAT3`` in the environment, or None when it is unset or a valid truth value.

  JAX reads ``JAX_REMAT3`` when it is imported and raises a ``ValueError`` traceback for a value it cannot read as
  a bool; jaxckpt checks it first (``jaxckpt/__init__.py``, before JAX is imported) and stops with this line.

  Args:
    environ: the environment (default ``os.environ``).
  """
  value = (os.environ if environ is None else environ).get(ENV_VAR)
  if value is None or value.strip().lower() in _TRUE + _FALSE:
    return None
  return (f"{ENV_VAR}={value!r} is not a value JAX accepts: use one of {', '.join(_TRUE)} (JAX's next remat, "
          f"remat3) or {', '.join(_FALSE)} (the default, remat2), or unset it")


def remat_implementation(*, config: Any = None, environ: "dict[str, str] | None" = None
                         ) -> Literal["remat2", "remat3"]:
  """The remat implementation ``jax.checkpoint`` uses now: ``"remat3"`` when JAX's ``jax_remat3`` flag is on.

  Args:
    config: where to read the flag (default ``jax.config``; tests pass a stand-in).
    environ: the environment (default ``os.environ``).

  Returns:
    ``"remat2"`` or ``"remat3"``.

  Raises:
    JaxckptError: ``JAX_REMAT3`` asks for remat3 but the installed JAX has no ``jax_remat3`` flag (it would be
      ignored silently).
  """
  import jax  # pylint: disable=g-import-not-at-top

  environ = os.environ if environ is None else environ
  flag = getattr(jax.config if config is None else config, "jax_remat3", None)
  if flag is None:
    if environ.get(ENV_VAR, "").strip().lower() in _TRUE:
      raise JaxckptError(f"{ENV_VAR}={environ[ENV_VAR]!r} asks for JAX's next remat, but jax {jax.__version__} has "
                         f"no jax_remat3 flag (jaxckpt is tested with jax 0.10.2); unset {ENV_VAR} or install "
                         f"jax>=0.10.2")
    return REMAT2
  return REMAT3 if flag else REMAT2
