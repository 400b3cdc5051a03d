"""XProf traces of train steps, one run directory per policy, so XProf shows the policies side by side.

:func:`profile_trace` wraps :func:`jax.profiler.trace`: it writes ``logdir/<slug(name)>/plugins/profile/<session>/
<host>.xplane.pb`` (the file XProf and TensorBoard's profile plugin read), so ``xprof --logdir logdir`` lists one run
per name. Wrap each step in ``jax.profiler.StepTraceAnnotation`` so XProf's step views find the steps.

Example::

    >>> with profile_trace("profiles", name="attn=dots_saveable,mlp=full") as run_dir:
    ...   for i in range(3):
    ...     with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
    ...       state, metrics = jax.block_until_ready(step(state, batch))
    >>> run_dir, trace_files(run_dir)
    ('profiles/attn-dots_saveable_mlp-full',
     ['profiles/attn-dots_saveable_mlp-full/plugins/profile/2026_12_01_00_00_00/host.xplane.pb'])

What a trace holds depends on the backend: on GPU/TPU a device plane (kernels, the allocator's memory timeline for
XProf's memory profile, the compiled modules' buffers for its memory viewer); on CPU only host threads (Python, the
XLA:CPU client and its thread pools, the step markers) — no device memory timeline, no buffer view.
See https://docs.jax.dev/en/latest/profiling.html and https://openxla.org/xprof.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import jax

from jaxckpt._paths import check_output_dir
from jaxckpt.errors import JaxckptError

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def profile_slug(name: str) -> str:
  """A run-directory name for ``name`` (a policy spec): ``=`` and ``:`` become ``-``, other characters outside
  ``[A-Za-z0-9._+-]`` become ``_``; idempotent (``profile_slug(profile_slug(s)) == profile_slug(s)``).

  Args:
    name: any non-empty label, e.g. ``"budget:40%"`` → ``"budget-40"``, ``"attn=full,mlp=none"`` →
      ``"attn-full_mlp-none"``.

  Raises:
    JaxckptError: ``name`` has no character usable in a directory name (e.g. ``""`` or ``"%%"``).
  """
  slug = _UNSAFE.sub("_", name.replace("=", "-").replace(":", "-")).strip("._")
  if not slug.strip("-+"):
    raise JaxckptError(f"name={name!r} has no character usable in a directory name; give a name with letters or "
                       "digits")
  return slug


def check_profile_dir(logdir: str | os.PathLike[str], *, flag: str = "logdir") -> str:
  """Checks that ``logdir`` can hold traces before any work (it need not exist yet).

  Args:
    logdir: the XProf log directory.
    flag: how errors name it (``"--profile"`` on the CLI).

  Returns:
    ``logdir`` as an absolute path.

  Raises:
    JaxckptError: ``logdir`` is an existing file, or a probe file cannot be written in it
      (:func:`jaxckpt._cli.check_output_dir`).
  """
  check_output_dir(flag, logdir)  # tries to write there (then removes what it made)
  return os.path.abspath(os.fspath(logdir))


@contextlib.contextmanager
def profile_trace(logdir: str | os.PathLike[str], *, name: str, perfetto: bool = False) -> Iterator[str]:
  """Records a :func:`jax.profiler.trace` of the enclosed code into ``logdir/<profile_slug(name)>/``.

  Only one trace can run at a time in a process; the code inside should run *warm* steps (compiled before, inputs
  allocated) and wait for them (``jax.block_until_ready``), or the trace shows compilation and misses the work.

  Args:
    logdir: the XProf log directory (``xprof --logdir logdir``); created if missing.
    name: the run's label, e.g. the policy spec; its :func:`profile_slug` names the run directory. A second trace
      with the same name adds a session (a new timestamped folder, ``_2``… appended within one second) to that run;
      nothing is overwritten.
    perfetto: also write ``*.trace.json.gz`` in Perfetto's format (opens at https://ui.perfetto.dev without XProf).

  Yields:
    The run directory, ``logdir/<slug>`` (str).

  Raises:
    JaxckptError: ``name`` gives no directory name, or the run directory cannot be created or written (the message
      names the path), or another trace is already running in this process.
  """
  run_dir = os.path.join(os.fspath(logdir), profile_slug(name))
  try:
    os.makedirs(run_dir, exist_ok=True)
  except OSError as err:
    raise JaxckptError(f"cannot create the profile directory {run_dir}: {err.strerror or err}; give a writable "
                       "logdir") from err
  if not os.access(run_dir, os.W_OK | os.X_OK):
    raise JaxckptError(f"the profile directory {run_dir} is not writable; give a writable logdir")
  # jax names a session folder by the second it ends in: trace into a fresh folder, then move the session beside
  # the earlier ones under a name not taken yet, so two traces in one second never overwrite each other.
  staging = tempfile.mkdtemp(prefix=".tracing-", dir=run_dir)
  try:
    jax.profiler.start_trace(staging, create_perfetto_trace=perfetto)
  except RuntimeError as err:
    shutil.rmtree(staging, ignore_errors=True)
    raise JaxckptError(f"cannot start a trace into {run_dir}: {err} (only one trace can run at a time; stop the "
                       "other one first)") from err
  try:
    yield run_dir
  finally:
    try:
      jax.profiler.stop_trace()
    finally:
      _move_sessions(staging, run_dir)


def _move_sessions(staging: str, run_dir: str) -> None:
  """Moves ``staging/plugins/profile/<session>`` to ``run_dir/plugins/profile/<session>[_N]``, then drops staging."""
  sessions = os.path.join(run_dir, "plugins", "profile")
  for src in sorted(glob.glob(os.path.join(staging, "plugins", "profile", "*"))):
    os.makedirs(sessions, exist_ok=True)
    name = os.path.basename(src)
    dest, n = os.path.join(sessions, name), 1
    while os.path.exists(dest):
      n += 1
      dest = os.path.join(sessions, f"{name}_{n}")
    os.rename(src, dest)
  shutil.rmtree(staging, ignore_errors=True)


def trace_files(run_dir: str | os.PathLike[str]) -> list[str]:
  """The XProf trace files (``*.xplane.pb``) of one run directory, oldest session first.

  Args:
    run_dir: a directory :func:`profile_trace` yielded (``logdir/<slug>``).

  Returns:
    Paths ``run_dir/plugins/profile/<session>/<host>.xplane.pb``; empty if nothing was traced there.
    Each loads with ``jax.profiler.ProfileData.from_file``.
  """
  return sorted(glob.glob(os.path.join(os.fspath(run_dir), "plugins", "profile", "*", "*.xplane.pb")))
