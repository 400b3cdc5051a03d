"""Each tool resolves its inputs once, at its door: a ``--policies`` value and a ``--mesh`` value are parsed once per
run, however many layers below read the policy or the mesh."""

from __future__ import annotations

import collections

import pytest

from jaxckpt.cli import fit, plan, report
from jaxckpt.policies import _model as policy_model
from jaxckpt.sharding import _mesh as sharding_mesh

POLICIES = ("none", "full", "attn=dots_saveable,mlp=full")
MESH = "data=1"


@pytest.fixture
def parses(monkeypatch):
  """Counts the calls of the one reader of policy strings and of mesh strings, by their text."""
  counts: collections.Counter[str] = collections.Counter()

  def counting(name, real):
    def wrapper(text):
      counts[f"{name}:{text}"] += 1
      return real(text)
    return wrapper

  monkeypatch.setattr(policy_model, "_parse_text", counting("policy", policy_model._parse_text))
  monkeypatch.setattr(sharding_mesh, "_parse_text", counting("mesh", sharding_mesh._parse_text))
  return counts


def test_the_report_parses_each_policy_and_the_mesh_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--batch-size", "4", "--mesh", MESH, "--no-residuals",
          "--policies", *POLICIES]
  assert report(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in (*POLICIES, MESH)} == {
      **{f"policy:{p}": 1 for p in POLICIES}, f"mesh:{MESH}": 1}


def test_the_fit_parses_each_policy_and_the_mesh_once(parses):
  argv = ["--model", "gpt", "--preset", "tiny", "--mesh", MESH, "--memory", "64MiB", "--max-batch", "16",
          "--policies", "none", "full"]
  assert fit(argv) == 0
  assert {k: v for k, v in parses.items() if k.split(":", 1)[1] in ("none", "full", MESH)} == {
      "policy:none": 1, "policy:full": 1, f"mesh:{MESH}": 1}


def test_the_budget_planner_parses_its_budget_and_mesh_once(parses):
  assert plan(["--model", "gpt", "--preset", "tiny", "--mesh", MESH, "--budget", "60%", "--max-rounds", "1"]) == 0
  assert parses["policy:budget:60%"] == 1 and parses[f"mesh:{MESH}"] == 1
