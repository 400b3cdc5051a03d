"""A remat policy that has no effect in the compiled program is never an ordinary ``ok`` row.

Three signs, each turned into a one-line ``warning`` on the row (and shown in every output):

1. The row compiled to the *same program* as ``none`` or ``everything_saveable`` (``same_program_as``): whatever
   the policy says, XLA runs the step it runs without remat (or with everything saved).
2. The residual analysis says the policy keeps at most :data:`RESIDUAL_RATIO` (50%) of ``none``'s residual bytes,
   but compiled temp stays at :data:`TEMP_RATIO` (90%) or more of ``none``'s. Residual bytes are an upper bound of
   what the backward pass keeps (XLA fusion can only drop more), and in a train step the saved activations are the
   bulk of temp; halving them leaves temp within 10% of ``none`` only when XLA undid the remat: an unrolled stack on
   XLA:CPU without the ``cse_barrier_expander`` option (measured with jax 0.10: an 8-layer residual MLP, d=512,
   batch 8192, keeps 1216 MiB of temp under ``nothing_saveable`` against 1232 MiB without remat, 272 MiB with the
   pass disabled), or an outer ``jax.checkpoint`` around a scan.
   The 10% slack covers gradient and optimizer buffers no policy changes; the 50% bar keeps policies that save a
   little (``dots_saveable`` on a model of few matmuls) from being flagged for a small, honest effect.
3. An offloading policy whose compiled host bytes are zero on a backend where host memory is separate (GPU/TPU): its
   names were never attached, so nothing moved (MaxText issue 4990: byte-identical AOT stats with and without
   offload). On CPU the report already says offloading saves nothing there.

The planner skips candidates flagged this way (:func:`no_effect`); the report (above the planner) annotates its rows
with :func:`annotate_rows`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

RESIDUAL_RATIO = 0.5
"""A row's residual bytes at most this share of ``none``'s count as "the analysis says it saves a lot"."""
TEMP_RATIO = 0.9
"""...and compiled temp at least this share of ``none``'s as "XLA did not follow"."""
CPU_FIX = ("compile with compiler_options={'xla_disable_hlo_passes': 'cse_barrier_expander'} (jaxckpt.jit and the "
           "report do unless told otherwise)")
_BASELINES = ("none", "everything_saveable")


def _ok(row: Mapping[str, Any] | None) -> bool:
  return row is not None and row.get("status") == "ok"


def row_warning(row: Mapping[str, Any], none: Mapping[str, Any] | None, *, backend: str,
                compiler_options: Mapping[str, Any] | None = None, offloads: bool = False) -> str | None:
  """The one-line "no effect" warning of a report row, or None.

  Args:
    row: a report row (keys of :data:`jaxckpt.report._keys.ROW_KEYS`).
    none: the ``none`` row of the same report (or None when there is none).
    backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    compiler_options: the XLA options the rows were compiled with (to tell whether the CPU fix was on).
    offloads: whether the row's policy offloads saved values to host memory.
  """
  policy = str(row.get("policy"))
  if not _ok(row) or policy in _BASELINES:
    return None
  twin = row.get("same_program_as")
  if twin in _BASELINES:
    return (f"no effect: {policy} compiled to the same program as {twin}; likely cause: the remat regions are not "
            f"where the memory is (a policy that saves what {twin} saves, or names the blocks never emit); check "
            f"the top residuals and the policy's names")
  if offloads and backend in ("gpu", "tpu") and not any(row.get(k) for k in ("host_temp_bytes", "host_output_bytes",
                                                                               "host_argument_bytes")):
    return (f"no effect: {policy} offloads to pinned_host but the compiled host bytes are 0; likely cause: the "
            "offloaded checkpoint names are never attached inside the remat'd blocks (check jaxckpt.checkpoint_names)")
  if not _ok(none):
    return None
  res, res0 = row.get("residual_bytes"), none.get("residual_bytes")
  temp, temp0 = row.get("temp_bytes"), none.get("temp_bytes")
  if None in (res, res0, temp, temp0) or not res0 or not temp0:
    return None
  if res <= RESIDUAL_RATIO * res0 and temp >= TEMP_RATIO * temp0:
    cpu_fix_on = "cse_barrier_expander" in str((compiler_options or {}).get("xla_disable_hlo_passes", ""))
    if backend == "cpu" and not cpu_fix_on:
      fix = f"XLA:CPU undid remat of unrolled layers; fix: {CPU_FIX}"
    else:
      fix = ("XLA did not follow the remat (e.g. an outer jax.checkpoint around a scan); fix: put the policy on "
             "the scan body (the blocks), not around the scan")
    return (f"no compiled effect: residuals {res / res0:.0%} of none's but compiled temp {temp / temp0:.0%} of "
            f"none's; likely cause: {fix}")
  return None


def annotate_rows(rows: Sequence[dict[str, Any]], *, backend: str,
                  compiler_options: Mapping[str, Any] | None = None,
                  offloads: Mapping[str, bool] | None = None) -> list[str]:
  """Sets each row's ``warning`` (:func:`row_warning`); returns the warnings as ``policy 'p': …`` lines."""
  none = next((r for r in rows if r.get("policy") == "none" and _ok(r)), None)
  out = []
  for row in rows:
    row["warning"] = row_warning(row, none, backend=backend, compiler_options=compiler_options,
                                 offloads=bool((offloads or {}).get(row.get("policy"), False)))
    if row["warning"]:
      out.append(f"policy {row['policy']!r}: {row['warning']}")
  return out


def no_effect(row: Mapping[str, Any]) -> bool:
  """Whether a row carries a "no effect" warning (the planner skips such candidates)."""
  return bool(row.get("warning"))
