"""Each tool resolves its inputs once, at its door: a ``--policies``, ``--mesh``, ``--topology`` and
``--memory-fraction`` value is read once per run, however many layers below read the policy, the mesh, the topology
or the memory a device may use (the ``parses`` fixture of tests/parse_counts.py).

The report and the fit compile on this machine here; their topology and memory fraction are counted in their GPU
runs (tests/sharding/test_gpu.py), so no run compiles twice. The budget planner compiles for one H100
(``--topology h100:1 --memory-fraction 0.9``) where JAX's CUDA plugin is installed (CI has it).
"""

from __future__ import annotations

import pytest

from jaxckpt.cli import fit, plan, report
from tests.extras import HAS_CUDA_PLUGIN, REQUIRE_GPU
from tests.parse_counts import parses, placement_reads  # noqa: F401 - the fixture

POLICIES = ("none", "full", "attn=dots_saveable,mlp=full")
MESH = "data=1"
TOPOLOGY, FRACTION = "h100:1", 0.9
GPU = HAS_CUDA_PLUGIN or REQUIRE_GPU


def test_the_report_parses_each_policy_and_the_mesh_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--batch-size", "4", "--mesh", MESH, "--no-residuals",
          "--policies", *POLICIES]
  assert report(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in POLICIES} == {
      f"policy:{p}": 1 for p in POLICIES}
  assert placement_reads(parses) == {f"mesh:{MESH}": 1}  # no topology, no fraction: nothing reads them


def test_the_fit_parses_each_policy_and_the_mesh_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--mesh", MESH, "--memory", "64MiB", "--max-batch", "16",
          "--policies", "none", "full"]
  assert fit(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in ("none", "full")} == {
      "policy:none": 1, "policy:full": 1}
  assert placement_reads(parses) == {f"mesh:{MESH}": 1}


@pytest.mark.slow  # the planner's compiles: 40 s of the fast tier on CI's 2 cores; the fit's and report's stay
def test_the_budget_planner_parses_its_budget_and_placement_once(parses):
  gpu = ["--topology", TOPOLOGY, "--memory-fraction", str(FRACTION)] if GPU else []
  assert plan(["--model", "gpt", "--preset", "tiny", "--mesh", MESH, *gpu, "--budget", "60%",
               "--max-rounds", "1"]) == 0
  assert parses["policy:budget:60%"] == 1
  assert placement_reads(parses) == {f"mesh:{MESH}": 1,
                                     **({f"topology:{TOPOLOGY}": 1, f"fraction:{FRACTION}": 1} if GPU else {})}
