"""When two float computations of the same values agree: one rule for the whole suite, from float arithmetic.

Remat, a checkpoint structure, a scan instead of a loop, a plan's rewritten loss, a Linen twin of an NNX block: each
computes the same mathematical values as its reference, but XLA may order the floating-point operations differently
(fuse the recomputation otherwise, split a reduction elsewhere), and XLA:CPU vectorises each reduction to the
instruction set of the CPU it runs on (AVX-512, AVX2, AVX, SSE4.2: other lane counts, other summation orders). So the
results agree to rounding, and how closely depends on the CPU (``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` reproduces
another x86-64 machine's rounding on this one). Tolerances copied from one machine's passing run fail on another:
an AVX2 machine saw 1.7e-6 absolute / 7.6e-5 relative on one gradient element against ``atol=1e-6,
rtol=1e-5``. This module states the rule once, from the arithmetic.

**The rule** (:func:`assert_trees_close`), per leaf ℓ of the compared trees (a gradient leaf, a loss, an output)::

    max |got_ℓ − want_ℓ|  ≤  C · u · depth · scale_ℓ,     scale_ℓ = max(max |want_ℓ|, FLOOR · max |want|)

with C = :data:`C` = 16 and FLOOR = :data:`FLOOR` = 2⁻⁵:

- ``u`` is the unit roundoff: 2⁻²⁴ ≈ 5.96e-8 for float32 (half the machine epsilon; Higham, *Accuracy and Stability
  of Numerical Algorithms*, 2nd ed., SIAM 2002, §2.1), bfloat16's 2⁻⁸ for a bfloat16 leaf or computation.
- ``depth`` is the number of layers the values pass through on the way to the compared leaf, counted by the test
  from its model: one per block of a stack (a transformer block, an MLP block, a convolution block), so a 7-block
  MLP stack is 7; a block or a single function is 1, a hand-written function one per matmul; a k-step training
  curve is k times the model's layers.
- ``max |want_ℓ|`` is the leaf's own largest magnitude (its ∞-norm): a norm-wise bound, not an element-wise one.
  ``max |want|`` (no ℓ) is the largest magnitude of the whole compared tree: the floor, for leaves that cancel.

Why this form (Higham, ch. 3): a float32 inner product of length n in any summation order satisfies
``|fl(xᵀy) − xᵀy| ≤ γ_n |x|ᵀ|y|`` with ``γ_n = n u / (1 − n u)`` (Higham §3.1, Lemma 3.1), so two orders differ by at most
``2 γ_n |x|ᵀ|y|``: proportional to u and to the magnitudes of the summands, not of the result. A layer adds its own
rounding and passes the earlier layers' on, scaled by its conditioning (Higham §3.5, matrix products: the bound
grows with the number of factors); hence the factor ``depth``. Real reorderings land far below the worst case
(rounding errors are signed and cancel, growing like √n rather than n, Higham §2.8), which is why a small C, fixed by
measurement below, bounds every case the suite has.

Why not element-wise ``rtol``: a gradient element is a sum over the batch and the paths through the network, and
its summands can be far larger than the sum (cancellation). The error bound is set by the summands' size (``|x|ᵀ|y|``
above), so a small element carries the absolute error of the large ones, and its *relative* error is unbounded: issue
38's failing element, -0.0223945 vs -0.0223962, is 7.6e-5 relative but 11.5 u of its leaf's largest entry (3.13).
Any element-wise ``rtol`` is either too tight for the small elements or too loose for the large ones; the norm-wise
bound is tight for both. A bare ``atol`` ignores the scale (a loss of 20 and a gradient of 1e-3 need different
absolute tolerances). The same cancellation can take a whole leaf: the bias of a Linear before a BatchNorm has a
gradient of exactly zero in exact arithmetic (the normalisation removes any shift), so XLA returns rounding noise of
about 1e-6 there, different noise under another fusion (``JAXCKPT_TESTS_FULL_OPT=1``: 4.8e-7 on a leaf whose largest
entry is 1.4e-6, beside gradients of 20); hence the floor: no leaf is judged on a scale below FLOOR of the tree's.

**Calibration** (measured max of ``|got − want|_∞ / (u · depth · scale)`` per test file, ``scale`` as the rule
takes it; 2-core AMD EPYC without AVX-512, so its native code is AVX2's; ``-O0`` code generation as the suite
compiles; 2026-12-04). AVX2: the whole fast tier (1110 tests) and the remat3 leg; native, SSE4_2: the
gradient-heavy files; AVX: test_structure and test_numerics; — = not run under that setting:

========================  ======  ======  ======  ======
file                      native  AVX2    AVX     SSE4_2
========================  ======  ======  ======  ======
test_llm                  8.37    8.37    —       4.17
test_regressions          6.50    6.50    —       0.00
test_mincut               5.38    5.38    —       6.21
test_pertensor            6.08    6.08    —       6.06
test_splash               4.41    4.41    —       4.41
test_numerics (honest)    —       3.15    0.00    0.00
test_planner              —       3.04    —       2.45
test_linen_unedited       —       2.23    —       —
test_gradients            2.17    2.17    —       1.87
test_autonames            —       2.08    —       —
test_structure            1.64    1.64    0.00    0.00
every other file          —       ≤ 0.93  —       0.00
========================  ======  ======  ======  ======

C = 16 leaves ≥ 1.9× headroom over the worst measured case (8.37: splash in Pallas' interpret mode against XLA
attention, depth 2) and is still tight: a residual rounded to bfloat16 in the backward pass (2⁻⁹ relative on one
tensor), a residual that lost one row, or a recomputation with another dropout key is reported by more than 10×
the limit (``tests/house/test_numerics.py``). Without vectorisation (SSE4_2, AVX here) many comparisons are exact: the
rounding the rule allows for is the vector width's.

Re-calibrate (another CPU, another XLA) with ``JAXCKPT_TESTS_NUMERICS_LOG=/tmp/n`` set: every comparison appends its
measured ratio to ``/tmp/n.<pid>``; ``python tests/numerics.py /tmp/n.*`` prints the worst per site.

Exact comparisons stay exact where the two sides are the same program on the same inputs (a resume from a saved
state, the same executable compiled twice, a parameter round trip, the same initialisation in two modes): there
any difference is a bug, not rounding. Each such site says why in a comment.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

C = 16
"""The rule's constant (dimensionless): allowed ``|got − want|_∞ = C · u · depth · scale`` per leaf."""

FLOOR = 2.0**-5
"""A leaf's scale is at least ``FLOOR`` × the largest ``|want|`` of the whole compared tree (dimensionless): a leaf
that cancels to about zero still carries the rounding of summands as large as its neighbours (module docstring)."""

_LOG = "JAXCKPT_TESTS_NUMERICS_LOG"
"""Environment variable: a path prefix; when set, every comparison appends its measurements (JSON lines) to
``<prefix>.<pid>``, for :func:`_calibration_table`."""


def unit_roundoff(dtype: Any) -> float:
  """The unit roundoff ``u`` of a float dtype: half its machine epsilon (2⁻²⁴ for float32, 2⁻⁸ for bfloat16)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top  (bfloat16's finfo; numpy alone lacks it)

  return float(jnp.finfo(dtype).eps) / 2


def _is_float(dtype: Any) -> bool:
  """Whether ``dtype`` is a float (NumPy's or ml_dtypes' bfloat16, whose NumPy kind is not ``"f"``)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return bool(jnp.issubdtype(dtype, jnp.inexact))


def _max_abs(array: np.ndarray) -> float:
  """Largest finite ``|value|`` of a float array (0 when it has none)."""
  finite = np.abs(array.astype(np.float64))[np.isfinite(array.astype(np.float64))]
  return float(finite.max()) if finite.size else 0.0


def _leaves(tree: Any) -> tuple[list[tuple[str, np.ndarray]], Any]:
  import jax  # pylint: disable=g-import-not-at-top

  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", np.asarray(leaf)) for path, leaf in flat], treedef


def mismatches(got: Any, want: Any, *, depth: int, compute_dtype: Any = np.float32) -> Iterator[str]:
  """One line per leaf of ``got`` that breaks the rule against ``want`` (same tree structure; see the module).

  Float leaves are held to ``C · u · depth · scale``; integer and bool leaves must be equal; a NaN or inf in a
  float leaf must be matched by the same value at the same place. Used by :func:`assert_trees_close`, and directly
  where the check runs in a subprocess (``tests/sharding/sharding_helper.py``).
  """
  if not (isinstance(depth, int) and depth >= 1):
    raise ValueError(f"depth={depth!r} must be an int ≥ 1: the number of layers the values pass through")
  got_leaves, got_def = _leaves(got)
  want_leaves, want_def = _leaves(want)
  if got_def != want_def:
    yield f"tree structures differ: got {got_def}, want {want_def}"
    return
  tree_scale = max([_max_abs(w) for _, w in want_leaves if _is_float(w.dtype) and w.size], default=0.0)
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    if g.shape != w.shape:
      yield f"{path}: shape {g.shape} != {w.shape}"
      continue
    if not _is_float(w.dtype):
      if not np.array_equal(g, w):
        yield f"{path}: {w.dtype} values differ at {int(np.sum(g != w))} of {w.size} places (compared exactly)"
      continue
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    finite = np.isfinite(w64)
    if not (np.array_equal(np.isfinite(g64), finite) and np.array_equal(g64[~finite], w64[~finite], equal_nan=True)):
      yield f"{path}: non-finite values differ (got {int(np.sum(~np.isfinite(g64)))}, want {int(np.sum(~finite))})"
      continue
    if not w.size:
      continue
    diff = np.where(finite, np.abs(g64 - w64), 0.0)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    u = max(unit_roundoff(w.dtype), unit_roundoff(compute_dtype))  # a float64 copy of float32 results: float32's u
    scale = max(_max_abs(w), FLOOR * tree_scale)
    limit = C * u * depth * scale
    _record(path, float(diff[worst]), _max_abs(w), tree_scale, depth, u)
    if diff[worst] > limit:
      ratio = diff[worst] / (u * depth * scale) if scale else float("inf")
      yield (f"{path}: max |got - want| = {diff[worst]:.3g} at {tuple(int(i) for i in worst)} (got {g64[worst]:.9g},"
             f" want {w64[worst]:.9g}) > allowed {limit:.3g} = C·u·depth·scale = {C}·{u:.3g}·{depth}·{scale:.3g}"
             f" (this is {ratio:.3g}·u·depth·scale; scale = max(max|want| of the leaf {_max_abs(w):.3g},"
             f" FLOOR·max|want| of the tree {FLOOR * tree_scale:.3g}))")


def assert_trees_close(got: Any, want: Any, *, depth: int, what: str, compute_dtype: Any = np.float32) -> None:
  """Asserts ``got`` equals ``want`` to float rounding: every leaf within the rule of this module.

  Args:
    got: a pytree of arrays or scalars (the computation under test: remat'd gradients, a loss, an output).
    want: the reference, with the same tree structure and shapes.
    depth: number of layers the values pass through (int ≥ 1; module docstring: one per block of a stack).
    what: what is compared, for the message (e.g. ``"gradients, every:3 dots_saveable vs no remat"``).
    compute_dtype: the precision the values were computed in, when lower than their dtype (a bfloat16 computation
      returning float32 gradients); default float32, so Python floats of float32 results get float32's u.

  Raises:
    AssertionError: naming each leaf path out of tolerance, its max difference, where, and the allowed one.
  """
  bad = list(mismatches(got, want, depth=depth, compute_dtype=compute_dtype))
  if bad:
    raise AssertionError(f"{what}: {len(bad)} leaf(s) differ by more than float rounding:\n  " + "\n  ".join(bad))


def _record(path: str, diff: float, scale: float, tree_scale: float, depth: int, u: float) -> None:
  """Appends one measurement to ``$JAXCKPT_TESTS_NUMERICS_LOG.<pid>`` when that variable is set."""
  prefix = os.environ.get(_LOG)
  if not prefix:
    return
  test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" (")[0]
  isa = next((f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(
      "--xla_cpu_max_isa=")), "native")
  with open(f"{prefix}.{os.getpid()}", "a", encoding="utf-8") as out:
    out.write(json.dumps({"test": test, "leaf": path, "diff": diff, "scale": scale, "tree_scale": tree_scale,
                          "depth": depth, "u": u, "isa": isa, "remat3": os.environ.get("JAX_REMAT3") == "1",
                          "full_opt": os.environ.get("JAXCKPT_TESTS_FULL_OPT") == "1"}) + "\n")


def _calibration_table(paths: list[str]) -> str:
  """Worst ``diff / (u · depth · scale)`` per test file and setting (ISA, remat3, full optimisation), from
  :func:`_record`'s logs; ``scale`` as the rule computes it, and the leaf's own ``max|want|`` beside it."""
  worst: dict[tuple[str, str], tuple[float, dict]] = {}
  for path in paths:
    with open(path, encoding="utf-8") as lines:
      for line in lines:
        r = json.loads(line)
        scale = max(r["scale"], FLOOR * r["tree_scale"])
        ratio = r["diff"] / (r["u"] * r["depth"] * scale) if scale else (0.0 if r["diff"] == 0 else float("inf"))
        setting = r["isa"] + ("+remat3" if r["remat3"] else "") + ("+O2" if r.get("full_opt") else "")
        key = (r["test"].split("::")[0], setting)
        if key not in worst or ratio > worst[key][0]:
          worst[key] = (ratio, r)
  rows = [f"{'file':30s} {'setting':16s} {'ratio':>6s} {'depth':>5s} {'max|diff|':>9s} {'leaf max':>9s} "
          f"{'tree max':>9s}  test, leaf"]
  for (name, setting), (ratio, r) in sorted(worst.items()):
    rows.append(f"{name:30s} {setting:16s} {ratio:6.2f} {r['depth']:5d} {r['diff']:9.2e} {r['scale']:9.2e} "
                f"{r['tree_scale']:9.2e}  {r['test'].split('::')[-1]} {r['leaf']}")
  return "\n".join(rows)


if __name__ == "__main__":
  print(_calibration_table(sys.argv[1:]))
