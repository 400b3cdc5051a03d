"""Measured step time and peak memory of a policy's train step (``--measure``), each in a fresh process.

Per policy a child process (``python -m jaxckpt.report._measure``, request as JSON on stdin, result as JSON on the
last stdout line) rebuilds the target from its ``ref``, compiles the step exactly as the report does, and:

1. allocates real inputs and runs ``warmup`` steps (compiles, first-touch, allocator caches);
2. on CPU: frees them, reads the resident set size (``VmRSS``) as the *baseline* (runtime, compiled code, caches),
   allocates fresh inputs, resets the kernel's peak-RSS counter (writes ``5`` to ``/proc/self/clear_refs``), runs
   ``steps`` steps and reads ``VmHWM``. ``peak_bytes_measured = VmHWM − baseline``: the inputs (arguments) plus
   what the steps allocate (temps, outputs not aliased), i.e. the quantity ``footprint_bytes`` (argument + output
   + temp − alias) predicts. The child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers return to the
   OS and the baseline does not keep them;
3. on GPU/TPU: ``device.memory_stats()["peak_bytes_in_use"]`` of the fresh process (inputs, steps, and the input
   initialisation's temporaries);
4. ``step_time_s`` = median wall seconds of the ``steps`` steps (each waited for with ``block_until_ready``);
5. with a profile directory (``--profile DIR``): after those, ``profile_steps`` more warm steps under
   :func:`jaxckpt.training._profile.profile_trace`, one XProf run ``DIR/<policy slug>/`` per policy (the trace never overlaps
   the measured steps). ``--profile`` without ``--measure`` skips 2 and 4.

Below ~100 MiB the process's own noise (allocator pages, thread stacks) is of the same order as the step: compare
small measured peaks by their order only. Targets without a ``ref`` (Python objects) are measured in this process,
which is less exact (its baseline keeps whatever the process freed).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxckpt.errors import NonFiniteLossError
from jaxckpt.planner._plan import resolve_policy
from jaxckpt.training._profile import profile_trace, trace_files
from jaxckpt.step._targets import Target, rebuild_target
from jaxckpt.step._compile import compile_policy
from jaxckpt.step._build import concrete_inputs, default_optimizer

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc settings of the measuring child: buffers ≥ 64 KiB are mmapped, so freeing them lowers the RSS."""


def _status_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _run_steps(compiled, state, batch, count: int, *, annotate: bool = False):
  """Runs ``count`` steps, each waited for; returns ``(state, metrics, seconds per step)``.

  Raises:
    NonFiniteLossError: a step's loss (or another float metric) is NaN or infinite: the step ran, but what it
      computes is broken (a NaN in the model, e.g. its router), so its time and memory measure nothing useful.
  """
  times, metrics = [], None
  for i in range(count):
    started = time.perf_counter()
    with (jax.profiler.StepTraceAnnotation("train_step", step_num=i) if annotate else contextlib.nullcontext()):
      state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - started)
    _check_finite(metrics, i)
  return state, metrics, times


def _check_finite(metrics: Any, step: int) -> None:
  """Raises :class:`NonFiniteLossError` when a float scalar of ``metrics`` (the loss first) is not finite."""
  items = metrics.items() if isinstance(metrics, Mapping) else [("loss", metrics)]
  for name, value in sorted(items, key=lambda kv: kv[0] != "loss"):
    array = np.asarray(value)
    if array.size == 1 and np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
      raise NonFiniteLossError(f"the step's {name} is {float(array.reshape(()))} at step {step}: it runs, but computes "
                               "NaN/Inf (a NaN in the model or its inputs, e.g. a router's logits), so it is not "
                               "measured", step=step)


def measure_in_process(target: Target, policy: str, *, steps: int = 5, warmup: int = 2,
                       compiler_options: Mapping[str, Any] | None = None, measure: bool = True,
                       profile_dir: str | None = None, profile_name: str | None = None,
                       profile_steps: int = 3) -> dict[str, Any]:
  """Compiles and runs the step of ``target`` under ``policy`` here; see the module docstring for what is measured.

  Args:
    target: the target.
    policy: a policy spec string (per block or layered, :func:`jaxckpt.policies.parse_model_policy`), or
      ``min_saved[:tol=…]`` / ``mincut:<cap>``, resolved here (:func:`jaxckpt.planner.resolve_policy`).
    steps: timed steps k ≥ 1.
    warmup: untimed steps before them, ≥ 1.
    compiler_options: extra XLA options (merged with the remat fix).
    measure: time the steps and measure the peak (``False``: only warm up, e.g. to profile).
    profile_dir: also record an XProf trace of ``profile_steps`` warm steps, after the measured ones, into
      ``profile_dir/<slug of profile_name>/`` (:func:`jaxckpt.training._profile.profile_trace`); ``None`` = no trace.
    profile_name: the trace's run name (default ``policy``).
    profile_steps: steps inside the trace, ≥ 1, each marked with ``StepTraceAnnotation("train_step")``.

  Returns:
    ``{"step_time_s": float seconds (median) | None, "step_times_s": [seconds of each timed step] (when measured),
    "peak_bytes_measured": int bytes | None, "baseline_bytes": int | None,
    "method": str | None, "profile": {"dir": str, "files": [*.xplane.pb paths]} | None}`` (measurements ``None``
    when ``measure`` is false).

  Raises:
    PolicySpecError: an invalid spec; JaxckptError: an unwritable ``profile_dir``; any error of compiling or
    running the step (e.g. out of memory).
  """
  tx = default_optimizer()
  # The measuring process's boundary: a report row's policy arrives as text (a planned budget as its layered
  # policy); min_saved and mincut are planned here again, as a whole-loss plan is a function, not text.
  parsed, _ = resolve_policy(target, policy, tx=tx, compiler_options=compiler_options)
  compiled = compile_policy(target, parsed, tx=tx, options=compiler_options, stats_only=False).compiled
  make_inputs = concrete_inputs(target, tx)
  state, batch = make_inputs()
  state, metrics, _ = _run_steps(compiled, state, batch, max(1, warmup))
  result: dict[str, Any] = {"step_time_s": None, "peak_bytes_measured": None, "baseline_bytes": None,
                            "method": None, "profile": None}
  if measure:
    cpu = jax.default_backend() == "cpu"
    baseline = reset = None
    if cpu:
      del state, batch, metrics
      gc.collect()
      baseline = _status_kib("VmRSS")
      state, batch = jax.block_until_ready(make_inputs())
      reset = _reset_peak()
    state, metrics, times = _run_steps(compiled, state, batch, max(1, steps))
    if cpu:
      hwm = _status_kib("VmHWM")
      peak = hwm - baseline if reset and hwm is not None and baseline is not None else None
      method = "VmHWM - VmRSS baseline (after clear_refs)" if peak is not None else "unavailable (/proc not writable)"
    else:
      stats = jax.local_devices()[0].memory_stats() or {}
      peak = stats.get("peak_bytes_in_use")
      method = "device peak_bytes_in_use"
    result.update(step_time_s=statistics.median(times), step_times_s=list(times),
                  peak_bytes_measured=None if peak is None else int(peak),
                  baseline_bytes=baseline, method=method)
  if profile_dir is not None:
    with profile_trace(profile_dir, name=profile_name or policy) as run_dir:
      state, metrics, _ = _run_steps(compiled, state, batch, max(1, profile_steps), annotate=True)
    result["profile"] = {"dir": run_dir, "files": trace_files(run_dir)}
  return result


def child_env() -> dict[str, str]:
  """The measuring child's environment: ours (``XLA_FLAGS`` untouched), :data:`MALLOC_ENV`, and our ``sys.path``."""
  env = dict(os.environ)
  for key, value in MALLOC_ENV.items():
    env.setdefault(key, value)
  paths = [p for p in sys.path if p and os.path.isdir(p)]
  env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
  return env


def measure_policy(target: Target, policy: str, *, steps: int = 5, warmup: int = 2,
                   compiler_options: Mapping[str, Any] | None = None, timeout_s: float = 900.0,
                   measure: bool = True, profile_dir: str | None = None, profile_name: str | None = None,
                   profile_steps: int = 3) -> dict[str, Any]:
  """Measures (and/or profiles) one policy in a fresh process (in this one if the target has no ``ref``).

  Args:
    target, policy, steps, warmup, compiler_options, measure, profile_dir, profile_name, profile_steps: as
      :func:`measure_in_process`.
    timeout_s: seconds the child may run.

  Returns:
    As :func:`measure_in_process`, plus ``"in_process": bool``.

  Raises:
    RuntimeError: the child failed (its last error line is the message), timed out, or printed no result.
  """
  options = {"steps": steps, "warmup": warmup, "measure": measure, "profile_steps": profile_steps,
             "profile_dir": None if profile_dir is None else os.path.abspath(profile_dir),
             "profile_name": profile_name}
  what = "measuring" if measure else "profiling"
  if target.ref is None:
    return {**measure_in_process(target, policy, compiler_options=compiler_options, **options), "in_process": True}
  request = {"ref": dict(target.ref), "policy": policy, "compiler_options": dict(compiler_options or {}), **options}
  try:
    done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(request),
                          capture_output=True, text=True, env=child_env(), timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired as err:
    raise RuntimeError(f"{what} {policy!r} timed out after {timeout_s:.0f} s") from err
  lines = done.stdout.strip().splitlines()
  if done.returncode != 0 or not lines:
    errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
    reason = errors[-1] if errors else f"exit status {done.returncode}"
    if done.returncode < 0:
      reason = f"killed by signal {-done.returncode} (out of memory?)"
    raise RuntimeError(f"{what} {policy!r} failed: {reason}")
  return {**json.loads(lines[-1]), "in_process": False}


_CHILD = "import sys; from jaxckpt.report._measure import _child; sys.exit(_child())"


def _child() -> int:
  request = json.loads(sys.stdin.read())
  target = rebuild_target(request["ref"])
  options = {k: request[k] for k in ("steps", "warmup", "measure", "profile_dir", "profile_name", "profile_steps")}
  result = measure_in_process(target, request["policy"], compiler_options=request.get("compiler_options"), **options)
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(_child())
