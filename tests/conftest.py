"""Session setup shared by every test file: one JAX persistent compilation cache for the whole run, and the tiers.

Tiers: ``python -m pytest -q -n 2`` runs the fast tier (pyproject's ``addopts`` has ``-m 'not slow'``);
``-m slow`` runs the slow tier alone; ``--all`` runs both. The remat3 cases (run again under ``JAX_REMAT3=1`` by
``.ci/run``) are marked ``@pytest.mark.remat3`` at each test.

Many tests compile the same train steps (the tiny presets under the same policies), in this process, in the other
pytest-xdist worker and in the subprocesses of CLI and example tests. JAX's persistent compilation cache (JAX docs,
"Persistent compilation cache") lets each program be compiled once per run: the first compile stores the
executable, later ones load it (a tiny preset's step: ~6 s → ~0.6 s on the 2-core machine). A cache hit returns the
same executable, so every compiled statistic is unchanged (memory stats and XLA's cost analysis checked equal).

With libtpu installed (the ``tpu`` extra, for ``tests/sharding/test_topology.py``'s deviceless TPU compiles) every JAX
process would probe for a TPU when its backend starts: about 0.1 s and eight lines of libtpu warnings on stderr per
process (measured), which the one-line error checks of CLI subprocesses would read. The suite runs on CPU, so it sets
``JAX_PLATFORMS=cpu`` (unless the tester set it) for itself and every subprocess: the probe is skipped, and TPU
topologies still load (libtpu is loaded on demand, :mod:`jaxckpt.sharding`).

The cache lives in a fresh temporary directory made by the controlling pytest process and handed to the workers
and to every subprocess through the environment (``JAX_COMPILATION_CACHE_DIR``); it is removed when the run ends.
Every compile is cached (no minimum compile time or entry size). A ``JAX_COMPILATION_CACHE_DIR`` set by the person
running the tests is left alone (and not removed). Compiles that dump XLA's passes bypass the cache
(:meth:`jaxckpt.step.LoweredPolicy.compile`), and the compile-time benchmarks turn it off.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import pytest

_MADE_HERE: list[str] = []
"""The cache directory this process made (the controlling pytest process): removed at its end. Workers and
subprocesses, pytest runs among them (tests/house/test_layout.py), inherit the directory, not its ownership."""
_FAST_CODEGEN = "--xla_backend_optimization_level=0"
"""XLA:CPU's LLVM code generation at -O0 for every executable the tests compile (in this process, the workers and
the CLI subprocesses, through ``XLA_FLAGS``). It changes no HLO pass, so buffer assignment and every compiled memory
stat are the same (:data:`jaxckpt.step.STATS_ONLY_OPTIONS` already compiles the report's stats this way), and matmuls
run in XLA's runtime library either way; compiles of tiny models take a third of the time
(tests/policies/test_gradients.py: 264 s -> 95 s on the 2-core machine). Set ``JAXCKPT_TESTS_FULL_OPT=1`` to test with
XLA's default code generation."""


def _use_run_cache() -> None:
  """Points JAX at the run's cache before JAX is imported (conftest is imported before any test module)."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # a worker (inherited) or the tester's own cache
    return
  directory = tempfile.mkdtemp(prefix="jaxckpt-tests-jax-cache-")
  _MADE_HERE.append(directory)
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": directory,
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})


_use_run_cache()

# The compiled-stats cache of topology compiles (jaxckpt.step._stats_cache) is off in the tests unless the tester sets
# it: a test that counts compiles or times them must see them run; tests/step/test_stats_cache.py turns it on in a
# tmp dir.
os.environ.setdefault("JAXCKPT_STATS_CACHE", "off")


def _use_fast_codegen() -> None:
  """Appends :data:`_FAST_CODEGEN` to ``XLA_FLAGS`` (before JAX is imported), unless the tester set the level or
  ``JAXCKPT_TESTS_FULL_OPT=1``."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags and os.environ.get("JAXCKPT_TESTS_FULL_OPT") != "1":
    os.environ["XLA_FLAGS"] = f"{flags} {_FAST_CODEGEN}".strip()


_use_fast_codegen()

def _findable(module: str) -> bool:
  """Whether ``module`` can be imported; ``False`` also when a parent package is missing (``jax_plugins`` without
  the ``gpu`` extra: ``importlib.util.find_spec`` raises there)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def _skip_tpu_probe() -> None:
  """``JAX_PLATFORMS=cpu`` before JAX is imported, when libtpu or JAX's CUDA plugin is installed and the tester did
  not choose platforms: the suite runs on the CPU; TPU topologies load libtpu on demand, and XLA:GPU compiles for a
  GPU topology only when JAX's backends are the CPU's (:mod:`jaxckpt.sharding`)."""
  installed = any(_findable(name) for name in ("libtpu", "jax_plugins.xla_cuda12"))
  if "JAX_PLATFORMS" not in os.environ and installed:
    os.environ["JAX_PLATFORMS"] = "cpu"


_skip_tpu_probe()


DURATIONS = "tests/durations.json"
"""The committed seconds of each fast-tier test (setup + call, on the 2-core machine), written by
``--write-durations``: what the fast tier costs, test by test."""


def pytest_addoption(parser: pytest.Parser) -> None:
  """``--all``: both tiers (the fast default of ``addopts`` and the ``slow`` end-to-end cases); ``--write-durations``:
  record each test's seconds in :data:`DURATIONS`."""
  parser.addoption("--all", action="store_true", default=False,
                   help="run the slow tier too (the default -m 'not slow' of pyproject's addopts is dropped)")
  parser.addoption("--write-durations", nargs="?", const=DURATIONS, default=None, metavar="PATH",
                   help=f"write each test's setup + call seconds to PATH (default {DURATIONS}, relative to the "
                        "repository): the tests of the files that ran replace theirs, other files' entries stay")


def pytest_configure(config: pytest.Config) -> None:
  """``--all`` clears the marker expression, so every test is collected; an explicit ``-m`` with it is refused.
  ``--write-durations`` registers the :class:`_Durations` recorder in the controlling process."""
  if config.getoption("all"):
    if config.option.markexpr not in ("", "not slow"):
      raise pytest.UsageError(f"--all runs every test; it cannot be combined with -m {config.option.markexpr!r}")
    config.option.markexpr = ""
  path = config.getoption("write_durations")
  if path and not hasattr(config, "workerinput"):  # the workers' reports reach the controller's hook
    config.pluginmanager.register(_Durations(config.rootpath, config.rootpath / path), "jaxckpt-durations")


class _Durations:
  """Sums each test's setup and call seconds (pytest's reports, forwarded by pytest-xdist's workers) and writes them
  as one JSON object, node id -> seconds, sorted by node id. Entries of test files that did not run are kept while
  their file exists, so a run of one file updates that file's tests."""

  def __init__(self, root: pathlib.Path, path: pathlib.Path):
    self.root, self.path = root, path
    self.seconds: dict[str, float] = {}

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    if report.when in ("setup", "call"):
      self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

  def pytest_sessionfinish(self) -> None:
    if not self.seconds:
      return
    ran = {nodeid.split("::")[0] for nodeid in self.seconds}
    old = json.loads(self.path.read_text()) if self.path.exists() else {}
    kept = {k: v for k, v in old.items() if k.split("::")[0] not in ran and (self.root / k.split("::")[0]).exists()}
    merged = {**kept, **{k: round(v, 2) for k, v in self.seconds.items()}}
    self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1, ensure_ascii=False) + "\n")


@pytest.fixture(scope="session")
def llm_tiny_reference():
  """``get(preset) -> (model, (loss, grads), layers)`` for ``"llama-tiny"`` or ``"gemma2-tiny"``: the preset at 32
  tokens built without remat, and its loss and gradients (:func:`tests.tiny.llm_reference`), computed once per run
  (per pytest-xdist worker) for the files that compare remat against it (tests/models/test_llm.py,
  tests/policies/test_maxtext_presets.py). A test that sets a policy on the model sets ``none`` back (``finally``)."""
  from tests import tiny  # noqa: PLC0415 - imports JAX, which must start after the environment set above

  built: dict[str, tuple] = {}

  def get(preset: str) -> tuple:
    if preset not in built:
      built[preset] = tiny.llm_reference(preset)
    return built[preset]

  return get


@pytest.fixture(scope="session")
def gpt_tiny_whole_loss():
  """``(target, loss, graph)``: GPT ``tiny``'s train-step loss as one whole loss (layers unrolled, no remat:
  :func:`jaxckpt.planner.target_whole_loss`) and its min-cut graph, traced once per run (per pytest-xdist
  worker) for the whole-loss planners' tests (tests/planner/test_whole_loss.py, tests/planner/test_mincut.py)."""
  from jaxckpt.planner import target_whole_loss, whole_graph  # noqa: PLC0415 - JAX after the environment above
  from jaxckpt.step import shipped_target  # noqa: PLC0415

  target = shipped_target("gpt", "tiny")
  loss = target_whole_loss(target)
  return target, loss, whole_graph(loss)


def pytest_unconfigure(config: pytest.Config) -> None:
  """The controlling process removes the cache directory it made (workers and subprocesses leave it)."""
  del config
  for directory in _MADE_HERE:
    shutil.rmtree(directory, ignore_errors=True)
