"""JAX's logged traceback of its CUDA plugin failing to start: dropped on a machine without an NVIDIA device (JAX
runs on the CPU there, as it must), kept where one exists (docs/gpu.md)."""

from __future__ import annotations

import logging
import sys

from jaxckpt.analysis import _internals


def _record(error: BaseException | None) -> logging.LogRecord:
  exc_info = (type(error), error, None) if error is not None else None
  return logging.LogRecord("jax._src.xla_bridge", logging.ERROR, __file__, 1, "Jax plugin configuration error: "
                           "Exception when calling %s.initialize()", ("jax_plugins.xla_cuda12",), exc_info)


def test_the_cuda_traceback_is_dropped_only_without_an_nvidia_device(monkeypatch):
  no_cuda = RuntimeError("Unable to load CUDA. Is it installed?")
  keep = _internals._NoCudaWithoutGpu()  # noqa: SLF001 - the filter itself
  monkeypatch.setattr(_internals.glob, "glob", lambda pattern: [])
  assert not keep.filter(_record(no_cuda))
  assert keep.filter(_record(RuntimeError("cuDNN version mismatch")))  # another failure stays
  other = logging.LogRecord("jax._src.xla_bridge", logging.WARNING, __file__, 1, "something else", (), None)
  assert keep.filter(other)
  monkeypatch.setattr(_internals.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  assert keep.filter(_record(no_cuda))  # a GPU is here: CUDA failing is a real problem


def test_importing_jaxckpt_installs_the_filter_once():
  import jaxckpt  # noqa: F401

  _internals.quiet_cuda_plugin_without_gpu()
  filters = [f for f in logging.getLogger("jax._src.xla_bridge").filters
             if isinstance(f, _internals._NoCudaWithoutGpu)]  # noqa: SLF001
  assert len(filters) == 1 and "jaxckpt" in sys.modules
