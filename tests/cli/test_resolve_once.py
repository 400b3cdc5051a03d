"""Each tool resolves its inputs once, at its door: a ``--policies``, ``--mesh``, ``--topology`` and
``--memory-fraction`` value is read once per run, however many layers below read the policy, the mesh, the topology
or the memory a device may use.

With JAX's CUDA plugin (the ``[gpu]`` extra; CI has it) each run compiles for one H100 (``--topology h100:1
--memory-fraction 0.9``), so the topology and the fraction are counted too; without it the same runs compile on
this machine and count the policies and the mesh.
"""

from __future__ import annotations

import collections

import pytest

from jaxckpt.cli import fit, plan, report
from jaxckpt.policies import _model as policy_model
from jaxckpt.sharding import _mesh as sharding_mesh
from jaxckpt.sharding import _placement as sharding_placement
from jaxckpt.sharding import _topology as sharding_topology
from tests.extras import HAS_CUDA_PLUGIN, REQUIRE_GPU

POLICIES = ("none", "full", "attn=dots_saveable,mlp=full")
MESH = "data=1"
TOPOLOGY, FRACTION = "h100:1", 0.9
GPU = HAS_CUDA_PLUGIN or REQUIRE_GPU
PLACEMENT = ["--topology", TOPOLOGY, "--memory-fraction", str(FRACTION)] if GPU else []
"""The placement flags every run gives beside ``--mesh``: one H100 where XLA:GPU is installed."""
ONCE = {f"mesh:{MESH}": 1, **({f"topology:{TOPOLOGY}": 1, f"fraction:{FRACTION}": 1} if GPU else {})}
"""What every run reads once of its placement flags."""


@pytest.fixture
def parses(monkeypatch):
  """Counts the calls of the one reader of policy strings, of mesh strings, of topology names and of memory
  fractions, by their text."""
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


def _placement_reads(counts: collections.Counter[str]) -> dict[str, int]:
  return {k: v for k, v in counts.items() if k.split(":", 1)[0] in ("mesh", "topology", "fraction")}


def test_the_report_parses_each_policy_and_the_placement_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--batch-size", "4", "--mesh", MESH, *PLACEMENT, "--no-residuals",
          "--policies", *POLICIES]
  assert report(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in POLICIES} == {
      f"policy:{p}": 1 for p in POLICIES}
  assert _placement_reads(parses) == ONCE


def test_the_fit_parses_each_policy_and_the_placement_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--mesh", MESH, *PLACEMENT, "--memory", "64MiB", "--max-batch", "16",
          "--policies", "none", "full"]
  assert fit(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in ("none", "full")} == {
      "policy:none": 1, "policy:full": 1}
  assert _placement_reads(parses) == ONCE


def test_the_budget_planner_parses_its_budget_and_placement_once(parses):
  assert plan(["--model", "gpt", "--preset", "tiny", "--mesh", MESH, *PLACEMENT, "--budget", "60%",
               "--max-rounds", "1"]) == 0
  assert parses["policy:budget:60%"] == 1
  assert _placement_reads(parses) == ONCE
