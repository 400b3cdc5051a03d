"""The optional extras some tests need, as skip markers that say which: ``needs_libtpu`` (the ``[tpu]`` extra: the
TPU compiler of libtpu, for ``--topology v5e:2x2`` compiles without a TPU) and ``needs_cuda_plugin`` (the ``[gpu]``
extra: JAX's CUDA plugin, for ``--topology h100:8`` compiles without a GPU).

Without the extra a marked test is skipped with a reason naming the extra and its install command, so the fast tier
passes with and without them. CI installs both extras and sets ``JAXCKPT_REQUIRE_TPU=1`` and
``JAXCKPT_REQUIRE_GPU=1`` (``.ci/run``): then a missing extra fails the marked tests instead, so they can never be
skipped silently.
"""

from __future__ import annotations

import os
from importlib import metadata

import pytest

from jaxckpt.sharding import CUDA_PLUGIN, libtpu_version

REQUIRE_TPU = os.environ.get("JAXCKPT_REQUIRE_TPU") == "1"
"""CI sets ``JAXCKPT_REQUIRE_TPU=1`` after installing ``.[tpu]``: then no ``needs_libtpu`` test may be skipped."""
REQUIRE_GPU = os.environ.get("JAXCKPT_REQUIRE_GPU") == "1"
"""CI sets ``JAXCKPT_REQUIRE_GPU=1`` after installing ``.[gpu]``: then no ``needs_cuda_plugin`` test may be skipped."""


def _installed(distribution: str) -> bool:
  try:
    metadata.version(distribution)
  except metadata.PackageNotFoundError:
    return False
  return True


HAS_LIBTPU = libtpu_version() is not None
HAS_CUDA_PLUGIN = all(_installed(name) for name in CUDA_PLUGIN)

TPU_REASON = ("needs the [tpu] extra: libtpu is not installed (pip install -e '.[tpu]'); JAXCKPT_REQUIRE_TPU=1 turns "
              "this skip into a failure")
GPU_REASON = ("needs the [gpu] extra: JAX's CUDA plugin is not installed (pip install -e '.[gpu]'); "
              "JAXCKPT_REQUIRE_GPU=1 turns this skip into a failure")

needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU and not REQUIRE_TPU, reason=TPU_REASON)
needs_cuda_plugin = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not REQUIRE_GPU, reason=GPU_REASON)


def skip_without_libtpu() -> None:
  """Inside a test whose first part needs no extra: skips the rest without libtpu (as :data:`needs_libtpu`)."""
  if not HAS_LIBTPU and not REQUIRE_TPU:
    pytest.skip(TPU_REASON)
