"""Session setup shared by every test file: one JAX persistent compilation cache for the whole run, and the tiers.

Tiers: ``python -m pytest -q -n 2`` runs the fast tier (pyproject's ``addopts`` has ``-m 'not slow'``);
``-m slow`` runs the slow tier alone; ``--all`` runs both.

Many tests compile the same train steps (the tiny presets under the same policies), in this process, in the other
pytest-xdist worker and in the subprocesses of CLI and example tests. JAX's persistent compilation cache (JAX docs,
"Persistent compilation cache") lets each program be compiled once per run: the first compile stores the
executable, later ones load it (a tiny preset's step: ~6 s → ~0.6 s on the 2-core machine). A cache hit returns the
same executable, so every compiled statistic is unchanged (memory stats and XLA's cost analysis checked equal).

With libtpu installed (the ``tpu`` extra, for ``tests/test_topology.py``'s deviceless TPU compiles) every JAX process
would probe for a TPU when its backend starts: about 0.1 s and eight lines of libtpu warnings on stderr per process
(measured), which the one-line error checks of CLI subprocesses would read. The suite runs on CPU, so it sets
``JAX_PLATFORMS=cpu`` (unless the tester set it) for itself and every subprocess: the probe is skipped, and TPU
topologies still load (libtpu is loaded on demand, :mod:`jaxckpt.training.topology`).

The cache lives in a fresh temporary directory made by the controlling pytest process and handed to the workers
and to every subprocess through the environment (``JAX_COMPILATION_CACHE_DIR``); it is removed when the run ends.
Every compile is cached (no minimum compile time or entry size). A ``JAX_COMPILATION_CACHE_DIR`` set by the person
running the tests is left alone (and not removed). Compiles that dump XLA's passes bypass the cache
(:meth:`jaxckpt.step.LoweredPolicy.compile`), and the compile-time benchmarks turn it off.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest

_OWNED = "JAXCKPT_TESTS_OWN_JAX_CACHE"  # set (to the directory) when this run made the cache directory


def _use_run_cache() -> None:
  """Points JAX at the run's cache before JAX is imported (conftest is imported before any test module)."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # a worker (inherited) or the tester's own cache
    return
  directory = tempfile.mkdtemp(prefix="jaxckpt-tests-jax-cache-")
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": directory, _OWNED: directory,
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})


_use_run_cache()


def _skip_tpu_probe() -> None:
  """``JAX_PLATFORMS=cpu`` before JAX is imported, when libtpu is installed and the tester did not choose platforms."""
  if "JAX_PLATFORMS" not in os.environ and importlib.util.find_spec("libtpu") is not None:
    os.environ["JAX_PLATFORMS"] = "cpu"


_skip_tpu_probe()


def pytest_addoption(parser: pytest.Parser) -> None:
  """``--all``: both tiers (the fast default of ``addopts`` and the ``slow`` end-to-end cases)."""
  parser.addoption("--all", action="store_true", default=False,
                   help="run the slow tier too (the default -m 'not slow' of pyproject's addopts is dropped)")


def pytest_configure(config: pytest.Config) -> None:
  """``--all`` clears the marker expression, so every test is collected; an explicit ``-m`` with it is refused."""
  if config.getoption("all"):
    if config.option.markexpr not in ("", "not slow"):
      raise pytest.UsageError(f"--all runs every test; it cannot be combined with -m {config.option.markexpr!r}")
    config.option.markexpr = ""


def pytest_unconfigure(config: pytest.Config) -> None:
  """The controlling process removes the cache directory it made (workers and subprocesses leave it)."""
  directory = os.environ.get(_OWNED)
  if directory and not hasattr(config, "workerinput") and directory == os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    shutil.rmtree(directory, ignore_errors=True)
