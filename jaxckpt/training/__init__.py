"""Training services below the tools: functional train/eval steps over ``nnx.split`` state (``jaxckpt.make_train_step``
and friends are on the top-level face), compiling so remat works on every backend (``jaxckpt.jit``,
``jaxckpt.compile_step``; XLA's options per platform, :data:`CPU_REMAT_FIX`, :data:`GPU_XLA_REMAT_PASS`), saving the
train state with orbax (``jaxckpt.TrainStateSaver``) and XProf traces (:func:`profile_trace`). Meshes, sharding and
the topologies to compile for are in :mod:`jaxckpt.sharding`.

What is here: the rest of that floor's public names. Implementation modules are private (``_train``, ``_xla``,
``_saving``, ``_profile``).
"""

from __future__ import annotations

from jaxckpt._deprecations import forward_names as _forward_names
from jaxckpt.training._profile import profile_trace, trace_files
from jaxckpt.training._train import LossFn, abstract_train_state, compile_train_step, micro_batches
from jaxckpt.training._xla import CPU_REMAT_FIX, GPU_XLA_REMAT_PASS, xla_flags
from jaxckpt.training._saving import TMP_MARKER, check_checkpoint_directory
from jaxckpt.training._profile import check_profile_dir

__all__ = [
    "TMP_MARKER",
    "check_checkpoint_directory",
    "check_profile_dir",
    "abstract_train_state",
    "compile_train_step",
    "micro_batches",
    "LossFn",
    "CPU_REMAT_FIX",
    "GPU_XLA_REMAT_PASS",
    "xla_flags",
    "profile_trace",
    "trace_files",
]

__getattr__ = _forward_names(__name__, {})  # old module paths (e.g. jaxckpt.training.<module>) as attributes, with a warning
