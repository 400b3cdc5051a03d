"""Counts the reads of a tool's input strings (the ``parses`` fixture): the one reader of policy strings, of mesh
strings, of topology names and of memory fractions, each by its text (``"topology:h100:8"``). The tools read each
once, at their door (tests/cli/test_resolve_once.py; the GPU runs of tests/sharding/test_gpu.py)."""

from __future__ import annotations

import collections

import pytest

from jaxckpt.policies import _model as policy_model
from jaxckpt.sharding import _mesh as sharding_mesh
from jaxckpt.sharding import _placement as sharding_placement
from jaxckpt.sharding import _topology as sharding_topology


@pytest.fixture
def parses(monkeypatch):
  """A counter of reads by ``"<kind>:<text>"``, kinds ``policy``, ``mesh``, ``topology`` and ``fraction``."""
  counts: collections.Counter[str] = collections.Counter()

  def counting(name, real):
    def wrapper(text, *rest):
      counts[f"{name}:{text}"] += 1
      return real(text, *rest)
    return wrapper

  monkeypatch.setattr(policy_model, "_parse_text", counting("policy", policy_model._parse_text))
  monkeypatch.setattr(sharding_mesh, "_parse_text", counting("mesh", sharding_mesh._parse_text))
  monkeypatch.setattr(sharding_topology, "_parse_text", counting("topology", sharding_topology._parse_text))
  monkeypatch.setattr(sharding_placement, "_read_fraction", counting("fraction", sharding_placement._read_fraction))
  return counts


def placement_reads(counts: collections.Counter[str]) -> dict[str, int]:
  """The reads of placement flags (mesh, topology, memory fraction) among ``counts``."""
  return {k: v for k, v in counts.items() if k.split(":", 1)[0] in ("mesh", "topology", "fraction")}
