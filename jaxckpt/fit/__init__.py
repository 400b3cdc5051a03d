"""Will it fit? The largest micro-batch per remat policy on a device, and the fastest (policy, micro-batch,
gradient accumulation) for a global batch, from a handful of compiles, verified.

- :func:`max_batch_size` (:mod:`jaxckpt.fit._search`): affine footprint model from two compiles, prediction, then
  one compile at the predicted batch and one at its successor (:class:`BatchFit`).
- :func:`plan_fit` (:mod:`jaxckpt.fit._plan`): every policy, and for a global batch the configuration with the least
  estimated step time (:mod:`jaxckpt.fit._speed`: roofline + overhead per micro-step), verified by compiling it with
  its accumulation; optionally measured.
- :func:`search_meshes` (:mod:`jaxckpt.fit._meshes`): on a TPU slice, the mesh too (``data`` × ``fsdp`` ×
  ``tensor``), compiling only the meshes that can fit and rank best by a lower bound of their step time.
- ``custom:search`` (:mod:`jaxckpt.fit._names`): MaxText's ``custom`` lists — per checkpoint name device, host
  offload or recompute — chosen by the time model from the names' bytes and FLOPs, then fitted like any policy.
- :func:`to_table`, :func:`mesh_table`: the plan as text (what ``jaxckpt-fit`` prints; the CLI is
  :func:`jaxckpt.cli.fit`, also ``python -m jaxckpt.fit``).

Example::

    >>> from jaxckpt.step import shipped_target
    >>> from jaxckpt.fit import max_batch_size
    >>> fit = max_batch_size(shipped_target("gpt", "small"), "nothing_saveable", "16GiB")
    >>> fit.max_batch_size, fit.footprint_bytes, fit.compiles
"""

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.fit._model import AffineModel, fit_affine
from jaxckpt.fit._plan import FitPlan, GlobalChoice, measure_candidates, plan_fit, spread, traffic_of
from jaxckpt.fit._names import (CUSTOM_SEARCH, CustomPlan, CustomSearch, NameCost, custom_plans, custom_policy,
                               name_costs)
from jaxckpt.fit._meshes import MeshOption, MeshSearch, mesh_shapes, search_meshes
from jaxckpt.fit._search import (DEFAULT_POLICIES, BatchFit, FitPoint, NothingFitsError, batch_size_of, batch_unit,
                                compile_point, exhausted_bytes, fit_policies, max_batch_size, max_seq_len, resolve_memory,
                                with_batch, with_seq_len)
from jaxckpt.fit._tables import mesh_table, to_table
from jaxckpt.fit._speed import (ACCELERATORS, Accelerator, Candidate, accelerator, calibrate, candidates,
                               AxisCollective, Traffic, collective_bytes, estimate_step, measure_cpu,
                               traffic_collectives, traffic_seconds)
from jaxckpt.fit._meshes import state_bytes

__all__ = [
    "state_bytes","AffineModel", "fit_affine", "FitPlan", "GlobalChoice", "measure_candidates", "plan_fit", "spread",
           "MeshOption", "MeshSearch", "mesh_shapes", "search_meshes",
           "DEFAULT_POLICIES", "BatchFit", "FitPoint", "NothingFitsError", "batch_size_of", "batch_unit",
           "compile_point", "exhausted_bytes", "fit_policies", "max_batch_size", "max_seq_len", "with_seq_len", "resolve_memory",
           "with_batch", "ACCELERATORS",
           "Accelerator", "Candidate", "accelerator", "calibrate", "candidates", "measure_cpu", "estimate_step",
           "collective_bytes", "traffic_seconds", "traffic_collectives", "AxisCollective", "Traffic", "traffic_of",
           "CUSTOM_SEARCH", "CustomPlan", "CustomSearch", "NameCost", "custom_plans", "custom_policy", "name_costs",
           "to_table", "mesh_table"]

# old module paths (e.g. jaxckpt.fit.<module>) as attributes, and the roofline's collective seconds under their old
# name (jaxckpt.timing.collective_seconds is the link model's), with a warning
__getattr__ = _forward_names(__name__, {"collective_seconds": ("jaxckpt.fit._speed", "traffic_seconds")})
