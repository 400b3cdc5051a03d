"""Training services: functional train/eval steps (:mod:`~jaxckpt.training.train`), compiling so remat works on
every backend (:mod:`~jaxckpt.training.xla`), meshes and sharding (:mod:`~jaxckpt.training.sharding`), TPU topologies
to compile for without a TPU and the chip table (:mod:`~jaxckpt.training.topology`), saving the train state with
orbax (:mod:`~jaxckpt.training.saving`) and XProf traces (:mod:`~jaxckpt.training.profile`).
"""

from __future__ import annotations

from jaxckpt.training import profile, saving, sharding, topology, train, xla

__all__ = [
    "profile",
    "saving",
    "sharding",
    "topology",
    "train",
    "xla",
]
