"""Compiling remat'd steps so that remat really works, and reading XLA's compiled memory stats.

On XLA:CPU the ``cse_barrier_expander`` pass removes the optimization barriers ``jax.checkpoint`` puts around the
recomputation; CSE and scheduling then pull the recomputation into the forward pass, and remat of unrolled layers
saves nothing (measured with jax 0.10 on an 8-layer residual MLP, d=512, batch 8192: 1216 MiB of compiled temp under
``nothing_saveable`` against 1232 MiB without remat, 272 MiB with the pass disabled; scanned layers are not affected:
the backward loop cannot borrow values from the forward loop). jaxckpt disables that pass *per compile* with
``compiler_options`` on the CPU backend — never through the process-wide ``XLA_FLAGS`` — in every compile path it
owns (train steps, the report). Gradients are unchanged by it. :func:`jit` gives users the same for their own steps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jax.sharding import NamedSharding, PartitionSpec

from jaxckpt.analysis._internals import compilation_cache_switch
from jaxckpt.analysis._jaxprs import uses_remat
from jaxckpt.core._remat import remat_calls
from jaxckpt.policies._spec import PolicySpec
from jaxckpt.schema import FOOTPRINT, HOST_FOOTPRINT, MEMORY_FIELDS, footprint_bytes, host_footprint_bytes
from jaxckpt.sharding import Topology, compiles_only, topology_mesh

CPU_REMAT_FIX: dict[str, str] = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""XLA:CPU compiler option that keeps ``jax.checkpoint``'s optimization barriers, so remat saves memory."""


PEAK_BACKENDS: tuple[str, ...] = ("gpu", "cuda", "rocm", "tpu")
"""Platforms whose ``CompiledMemoryStats.peak_memory_in_bytes`` is a peak: the most device memory live at once in
XLA's buffer-assignment simulation of the program (arguments, outputs and temps; XLA:GPU fills it with
``ComputePeakMemorySizes`` over the buffer assignment, ``xla/service/gpu/legacy_gpu_aot_compilation_result.cc``;
not checked on a GPU or TPU here). On XLA:CPU (jax 0.10) the field
is argument + output bytes and ignores temps (measured: 2,621,456 = 1,572,864 argument + 1,048,592 output bytes
for a program with 1 MiB of temps), so :func:`memory_stats` reports it as ``None`` there."""


PEAK_TEMP_BACKENDS: tuple[str, ...] = ("tpu",)
"""Platforms whose compiler's ``temp_size_in_bytes`` leaves out temporaries its own ``peak_memory_in_bytes`` holds,
so :func:`memory_stats` takes ``temp_bytes`` = peak − (argument + output − alias) there: the footprint is then the
peak. Measured on the TPU compiler of libtpu 0.0.42.1,
deviceless (v5e:2x2): three 16 MiB matmul results alive at once (``h1 + h2 + h3``) give temp_size 0 and a peak of
144 MiB = 64 MiB of arguments + 16 of output + 64 of temporaries; the grad of a 4-layer ``tanh(h @ w)`` chain at n =
2048 gives temp_size 32 MiB, peak 256 MiB (arguments 80, output 64); GPT ``tiny`` under ``nothing_saveable`` gives
temp_size 4.8 MiB at 2 sequences per chip and 5.1 MiB at 64, its peak 4.0 and 31.9 MiB. The peak honours donation (a
donated 64 MiB ``sin(x) + 1``: peak 64 MiB, 128 without), and the compiler refuses, when compiling, a program that
does not fit the chip (``RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required
for HLO temporaries (18.35G) exceeds available HBM (15.75G)`` on v5e).

With host offload (``host_temp_size_in_bytes`` > 0) the peak is the larger of two figures (measured against the
buffer assignment's memory spaces, :func:`jaxckpt.analysis.read_memory_spaces`, ``docs/tpu.md``): the device's HBM
and the host space's bytes plus the resident arguments and outputs. Where the peak is above the second it is the
HBM's, and ``temp_bytes`` = peak − (argument + output − alias) (Llama 2 70B at 4096 tokens per chip on v5e:16x16
under ``qkv_proj_offloaded``: peak 13.49 GiB, the buffer assignment's HBM 13.49 GiB, while ``temp_size_in_bytes``
says 14.95 GiB of temporaries beside 3.03 GiB of arguments, 17.98 GiB on a chip with 15.75 GiB available, and the
compiler accepted the program). Where the peak equals host + resident bytes (within :data:`HOST_PEAK_TOLERANCE`) it
says nothing of the HBM, and ``temp_bytes`` is XLA's ``temp_size_in_bytes``, an upper estimate (a scanned 16-layer
``x + tanh(tanh(x @ w) @ wᵀ)`` on v5e:2x2, x 16384 × 1024 bf16 per chip offloaded: peak 800 MiB = 160 of arguments
+ 128 of output + 512 of host, the buffer assignment's HBM 616.5 MiB, temp_size-based footprint 649 MiB); the
buffer assignment gives the exact figure (:func:`jaxckpt.analysis.offload_device_bytes`)."""

HOST_PEAK_TOLERANCE = 1 << 20
"""Bytes within which a TPU offload program's peak counts as the host space's figure (host + resident bytes), not
the HBM's (:data:`PEAK_TEMP_BACKENDS`): measured equal to the byte."""


class RematIneffectiveWarning(UserWarning):
  """A remat'd step is compiled where remat will not save memory (XLA:CPU without :data:`CPU_REMAT_FIX`).

  Issued once per process: by :func:`compile_step` with ``remat_fix=False``, and by a step of
  :func:`jaxckpt.make_train_step` traced under ``nnx.jit`` or a plain ``jax.jit`` (:func:`watch_remat`)."""


def _backend(backend: str | None) -> str:
  return backend if backend is not None else jax.default_backend()


GPU_XLA_REMAT_PASS = "rematerialization"
"""XLA:GPU's own rematerialization pass (``HloRematerialization``), which recomputes values to fit its estimate of
the device's memory (0.8 × the target config's memory, less the arguments and outputs, × 0.95: openxla
``xla/service/gpu/gpu_hlo_schedule.cc``, ``GetSchedulerMemoryLimit``; the printed limit matched this to the byte on
9 deviceless compiles). jaxckpt disables it on GPU, as every published GPU recipe does
(``--xla_disable_hlo_passes=rematerialization``: MaxText's A3/A3 Ultra recipes, NVIDIA's JAX-Toolbox), so a policy's
bytes are the policy's, not the pass's. A caller who gives ``xla_disable_hlo_passes`` themselves (in ``extra`` or in
``XLA_FLAGS``) chooses the disabled passes: give ``""`` to keep the pass on."""


_LOG_LOCK = threading.Lock()
_LOG_LINE = re.compile(r"^[WE]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] (.*)$")
"""An absl warning or error line: ``W1205 10:11:12.345678   1234 hlo_rematerialization.cc:3021] message``."""


@contextlib.contextmanager
def compiler_log(enabled: bool = True):
  """Captures what a compiler writes to the process's stderr (file descriptor 2) while the block runs, writes it back
  to stderr unchanged (nothing is swallowed), and yields a list that receives its warning and error messages.

  XLA:GPU's C++ code logs through absl straight to file descriptor 2 (e.g. ``Can't reduce memory use below …`` when a
  program exceeds its memory estimate), which Python never sees; the tools attach these lines to the compile that
  wrote them. The redirect is process-wide, so compiles that capture run one at a time (a lock); measured on 2 CPU
  cores: no added seconds.

  Args:
    enabled: capture (``False``: the block runs as it is and the list stays empty).

  Yields:
    A list of the messages (without absl's prefix), filled when the block ends.
  """
  messages: list[str] = []
  if not enabled:
    yield messages
    return
  with _LOG_LOCK, tempfile.TemporaryFile(mode="w+b") as captured:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
      os.dup2(captured.fileno(), 2)
      yield messages
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode(errors="replace")
      if text:
        sys.stderr.write(text)
        sys.stderr.flush()
      messages.extend(m.group(1).strip() for line in text.splitlines() if (m := _LOG_LINE.match(line.strip())))


def xla_flags(environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """The options set in ``XLA_FLAGS`` (``--name=value`` → ``{name: value}``; a bare ``--name`` → ``"true"``).

  Args:
    environ: the environment (default ``os.environ``).
  """
  out = {}
  for word in (os.environ if environ is None else environ).get("XLA_FLAGS", "").split():
    if word.startswith("--"):
      name, eq, value = word[2:].partition("=")
      out[name] = value if eq else "true"
  return out


def remat_compiler_options(
    backend: str | None = None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
  """Returns the ``compiler_options`` jaxckpt compiles with: :data:`CPU_REMAT_FIX` on CPU, XLA:GPU's own
  rematerialization pass off on GPU (:data:`GPU_XLA_REMAT_PASS`), merged with ``extra``.

  Per-compile options replace the same option of ``XLA_FLAGS``, so the passes ``XLA_FLAGS`` disables are kept in the
  joined list.

  Args:
    backend: platform name (``"cpu"``, ``"gpu"``, ``"tpu"``); default ``jax.default_backend()``.
    extra: the caller's own options; a caller's ``xla_disable_hlo_passes`` is joined with ours on CPU
      (comma-separated), and replaces the GPU default (the caller chose which passes to disable).
  """
  options = dict(extra or {})
  platform = _backend(backend)
  flags = xla_flags()
  mine = {"cpu": CPU_REMAT_FIX["xla_disable_hlo_passes"], "gpu": GPU_XLA_REMAT_PASS}.get(platform)
  if mine is None or (platform == "gpu" and ("xla_disable_hlo_passes" in options
                                             or "xla_disable_hlo_passes" in flags)):
    return options
  passes = [p for text in (flags.get("xla_disable_hlo_passes", ""), str(options.get("xla_disable_hlo_passes", "")))
            for p in text.split(",") if p]
  if mine not in passes:
    passes.append(mine)
  options["xla_disable_hlo_passes"] = ",".join(dict.fromkeys(passes))
  return options


def _fix_in_xla_flags() -> bool:
  return CPU_REMAT_FIX["xla_disable_hlo_passes"] in os.environ.get("XLA_FLAGS", "")


_FIX_APPLIED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxckpt_fix_applied", default=False)
_WARNED: set[str] = set()  # warnings issued in this process (each once)

_UNFIXED = ("this train step uses remat (jax.checkpoint) but is compiled on XLA:CPU without jaxckpt's compiler option "
            "xla_disable_hlo_passes=cse_barrier_expander: remat of unrolled layers saves no memory there. Compile it "
            "with jaxckpt.jit(step, donate_argnums=0) or jaxckpt.compile_train_step (nnx.jit and jax.jit without "
            "compiler_options=jaxckpt.remat_compiler_options() do not apply it), or set "
            "XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander before JAX starts (an ahead-of-time "
            ".lower().compile(compiler_options=jaxckpt.remat_compiler_options()) applies it too: then ignore this)")


def _warn_once(message: str, *, stacklevel: int = 3) -> None:
  """Issues :class:`RematIneffectiveWarning` ``message`` the first time only (per process)."""
  if message in _WARNED:
    return
  _WARNED.add(message)
  warnings.warn(message, RematIneffectiveWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def watch_remat():
  """Around the tracing of a train step: warns once (:class:`RematIneffectiveWarning`) when a jaxckpt remat wrapper
  ran inside it, the backend is CPU, and the step is not being compiled by jaxckpt (:func:`jit`,
  :func:`compile_step`) nor with the fix in ``XLA_FLAGS``: the ``nnx.jit`` / plain ``jax.jit`` case, where remat of
  unrolled layers silently saves nothing."""
  with remat_calls() as seen:
    yield
  if seen and not _FIX_APPLIED.get() and jax.default_backend() == "cpu" and not _fix_in_xla_flags():
    _warn_once(_UNFIXED, stacklevel=4)


@contextlib.contextmanager
def remat_fix_applied(applied: bool = True):
  """Around tracing a step that will be compiled with :func:`remat_compiler_options` ahead of time
  (``jax.jit(step).trace(...)``, then ``.lower().compile(compiler_options=...)``): tells :func:`watch_remat` that
  the option is applied, so it does not warn."""
  token = _FIX_APPLIED.set(applied)
  try:
    yield
  finally:
    _FIX_APPLIED.reset(token)


def _traced_with_fix(fn: Callable) -> Callable:
  """``fn`` that, when traced, tells :func:`watch_remat` that jaxckpt's compiler option is applied."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with remat_fix_applied():
      return fn(*args, **kwargs)

  return wrapped


def jit(fn: Callable, *, compiler_options: Mapping[str, Any] | None = None, **jit_kwargs) -> Callable:
  """``jax.jit`` with :func:`remat_compiler_options`, so remat of unrolled layers saves memory on CPU too.

  Args:
    fn: the function to compile (e.g. a train step over ``nnx.split`` state; ``nnx.jit`` has no
      ``compiler_options``).
    compiler_options: extra XLA options, merged with jaxckpt's.
    **jit_kwargs: passed to ``jax.jit`` (``donate_argnums``, ``static_argnames``, shardings…).

  Returns:
    The jitted function.
  """
  return jax.jit(_traced_with_fix(fn), compiler_options=remat_compiler_options(extra=compiler_options),
                 **jit_kwargs)


def _sharded_device(*trees: Any) -> Any:
  """A device of the first sharding found in ``trees`` (``jit``'s shardings, or arguments'
  ``ShapeDtypeStruct.sharding``), or ``None`` when none has one."""
  for tree in trees:
    try:
      leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    except Exception:  # noqa: BLE001 - an argument that is not a pytree of arrays
      continue
    for leaf in leaves:
      found = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
      devices = getattr(found, "device_set", None)
      if devices:
        return next(iter(devices))
  return None


def compile_step(
    fn: Callable,
    *args,
    donate_argnums: int | tuple[int, ...] = (),
    compiler_options: Mapping[str, Any] | None = None,
    remat_fix: bool = True,
    topology: "str | Topology | None" = None,
    **jit_kwargs,
) -> jax.stages.Compiled:
  """Lowers and compiles ``fn`` for ``args`` (arrays or ``jax.ShapeDtypeStruct``, nothing is allocated).

  The compiler options are those of the platform the step is compiled *for*: the platform of the shardings given
  (``in_shardings``/``out_shardings``, or the arguments' own), else of ``topology``, else the default backend.

  Args:
    fn: a pure function of pytrees of arrays (e.g. a train step).
    *args: example arguments or their ``jax.ShapeDtypeStruct``s.
    donate_argnums: arguments whose buffers the step may reuse (e.g. the train state).
    compiler_options: extra XLA options, merged with jaxckpt's.
    remat_fix: apply :data:`CPU_REMAT_FIX` when compiling for CPU (default). With ``False`` a
      :class:`RematIneffectiveWarning` is issued (once per process) when the step contains ``jax.checkpoint`` and is
      compiled for CPU (unless ``XLA_FLAGS`` already holds the fix).
    topology: compile for a TPU slice without a TPU (``"v5e:2x2"``, :mod:`jaxckpt.sharding`): without
      ``in_shardings`` every argument is replicated over the slice's chips (each chip runs the whole step: the
      compiled stats are one chip's); with them, they must be over its mesh
      (:func:`jaxckpt.sharding.topology_mesh`).
    **jit_kwargs: passed to ``jax.jit``.

  Returns:
    The compiled step; call it like ``fn`` (its signature is fixed to these shapes and dtypes). A step compiled for
    a topology cannot run here: read its ``memory_analysis()`` (:func:`memory_stats`) and ``cost_analysis()``.

  Raises:
    TopologyError: a bad topology name, or libtpu missing (:func:`jaxckpt.sharding.get_topology`).
  """
  if topology is not None and "in_shardings" not in jit_kwargs:
    jit_kwargs["in_shardings"] = NamedSharding(topology_mesh(topology), PartitionSpec())
  device = _sharded_device(jit_kwargs.get("in_shardings"), jit_kwargs.get("out_shardings"), args)
  platform = jax.default_backend() if device is None else device.platform
  options = remat_compiler_options(platform, extra=compiler_options) if remat_fix else dict(compiler_options or {})
  with remat_fix_applied(remat_fix or platform != "cpu"):
    traced = jax.jit(fn, donate_argnums=donate_argnums, **jit_kwargs).trace(*args)
  if not remat_fix and platform == "cpu" and not _fix_in_xla_flags() and uses_remat(traced.jaxpr):
    _warn_once(_UNFIXED)
  with compilation_cache_switch(False) if device is not None and compiles_only([device]) else contextlib.nullcontext():
    return traced.lower().compile(compiler_options=options or None)


def offload_warning(spec: "PolicySpec", backend: str | None = None) -> str | None:
  """A warning when ``spec`` offloads residuals to host on a backend whose host and device memory are one (CPU).

  Offloading (``save_and_offload_only_these_names``, ``offload_dot_with_no_batch_dims``) moves saved values to
  ``pinned_host`` memory. On CPU that is the same RAM, so no memory is saved, whatever the compiled stats say.

  Returns:
    One line, or ``None`` when there is nothing to warn about.
  """
  if not spec.offloads or _backend(backend) != "cpu":
    return None
  return (f"policy {spec} offloads saved values to pinned_host, but on CPU host and device memory are the same RAM: "
          "offloading saves no memory here (it does on GPU/TPU)")


def _platform(compiled: Any) -> str:
  """The platform ``compiled`` runs on (from its shardings' devices), else ``jax.default_backend()``."""
  for shardings in (getattr(compiled, "input_shardings", None), getattr(compiled, "output_shardings", None)):
    try:
      leaves = jax.tree.leaves(shardings)
    except Exception:  # noqa: BLE001 - a stand-in object without real shardings
      continue
    for sharding in leaves:
      devices = getattr(sharding, "device_set", None)
      if devices:
        return next(iter(devices)).platform
  return jax.default_backend()


def memory_stats(compiled: jax.stages.Compiled, *, backend: str | None = None) -> dict[str, int | None]:
  """Reads XLA's compiled memory stats of a step under the schema's key names (:mod:`jaxckpt.schema`).

  The sizes are XLA's buffer assignment: ``argument_bytes`` (inputs), ``output_bytes``, ``temp_bytes`` (every
  intermediate, after buffer sharing), ``alias_bytes`` (outputs written into donated inputs), generated code, and
  their ``host_*`` twins; ``footprint_bytes`` = argument + output + temp − alias is jaxckpt's device footprint,
  ``host_footprint_bytes`` the same of the host fields (what an offload policy keeps in ``pinned_host`` memory).
  ``peak_memory_bytes`` is XLA's simulated peak of live device memory where that figure is one
  (:data:`PEAK_BACKENDS`: GPU, TPU); on CPU XLA reports argument + output bytes in that field, not a peak, so it is
  ``None`` there -- use ``footprint_bytes``, or the report's ``--measure`` for a measured peak. On TPU
  (:data:`PEAK_TEMP_BACKENDS`) the compiler's ``temp_size_in_bytes`` leaves out temporaries its peak holds, so
  ``temp_bytes`` is peak − (argument + output − alias) and ``footprint_bytes`` equals the peak.

  Args:
    compiled: the result of ``jax.jit(f).lower(...).compile()``.
    backend: platform name (``"cpu"``, ``"gpu"``, ``"tpu"``) the step was compiled for; default: the platform of
      ``compiled``'s devices, else ``jax.default_backend()``.

  Returns:
    ``{key: bytes}`` for every key of :data:`jaxckpt.schema.MEMORY_KEYS`, including ``footprint_bytes``. A field the
    backend does not report is ``None``. Some backends report the device fields as all zeros, meaning "unknown":
    then they are ``None`` too, not 0.
  """
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends raise NotImplementedError/XlaRuntimeError here
    analysis = None
  record: dict[str, int | None] = {}
  for key, attr in MEMORY_FIELDS.items():
    value = getattr(analysis, attr, None) if analysis is not None else None
    record[key] = int(value) if isinstance(value, int) and value >= 0 else None
  device = ("argument_bytes", "output_bytes", "temp_bytes")  # generated code can be > 0 beside unknown zeros
  if all(record[k] == 0 for k in device):
    for key in MEMORY_FIELDS:
      record[key] = None
  platform = (backend if backend is not None else _platform(compiled)).lower()
  if platform not in PEAK_BACKENDS:
    record["peak_memory_bytes"] = None
  resident = [record[k] for k in ("peak_memory_bytes", "argument_bytes", "output_bytes", "alias_bytes")]
  if platform in PEAK_TEMP_BACKENDS and all(v is not None for v in resident):
    peak, argument, output, alias = resident
    host = sum(record[k] or 0 for k in ("host_argument_bytes", "host_output_bytes", "host_temp_bytes")) - (
        record["host_alias_bytes"] or 0)
    resident = argument + output - alias
    if host > 0 and peak <= host + resident + HOST_PEAK_TOLERANCE:
      # the peak is the host space's (host bytes + the resident arguments and outputs): it does not say the HBM's,
      # and XLA's temp_size is an upper estimate of it (PEAK_TEMP_BACKENDS; exact from the buffer assignment:
      # jaxckpt.analysis.read_memory_spaces)
      record["temp_bytes"] = max(record["temp_bytes"] or 0, 0)
    elif host > 0:  # the peak is the HBM's: the device's temporaries are what it holds beyond the resident bytes
      record["temp_bytes"] = max(peak - resident, 0)
    else:
      record["temp_bytes"] = max(peak - (argument + output - alias), 0)
  record[FOOTPRINT] = footprint_bytes(record)
  record[HOST_FOOTPRINT] = host_footprint_bytes(record)
  return record
