"""What one target's plans share: compiled points and the whole loss, traced and cut once (the report resolves
several budgets and ``mincut`` caps of one target with one :class:`PlanCache`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class PlanCache:
  """Work shared between plans of one target.

  Attributes:
    points: compiled train steps by policy text (:class:`jaxckpt.planner._plan.CompiledPoint`).
    whole_loss: the traced whole loss (:class:`jaxckpt.planner._whole.WholeLoss`), or ``None`` until first needed.
    segments: its regions (:class:`jaxckpt.planner._segments.Segments`), or ``None`` until first needed.
    none_activation_bytes: activation bytes the step saves without remat (what ``mincut:<p>%`` is a share of),
      or ``None`` until first needed.
  """

  points: dict[str, Any] = dataclasses.field(default_factory=dict)
  whole_loss: Any = None
  segments: Any = None
  none_activation_bytes: int | None = None
