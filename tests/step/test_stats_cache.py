"""The compiled-stats cache: a TPU topology compile made once is not made again (a second identical run of a
planner answers from it), entries survive a torn write, and a refused compile is remembered as refused."""

from __future__ import annotations


import pytest

import jaxckpt
from jaxckpt.analysis import parse_hlo
from jaxckpt.errors import JaxckptError
from jaxckpt.step import shipped_target
from jaxckpt.step._compile import CachedRefusal, lower_policy
from jaxckpt.step._stats_cache import ENV, CachedStats, StatsCache, stats_cache
from tests.extras import needs_libtpu


def test_entries_round_trip_and_a_torn_file_is_a_miss(tmp_path):
  cache = StatsCache(str(tmp_path))
  entry = CachedStats({"temp_bytes": 5, "footprint_bytes": 9}, {"flops": 3.0}, 1.5)
  cache.put("ab" + "0" * 62, entry)
  assert cache.get("ab" + "0" * 62) == entry
  path = tmp_path / "cd" / ("cd" + "1" * 62 + ".json")
  path.parent.mkdir()
  path.write_text('{"memory": {"temp')  # a write cut short (not one this module makes: it renames into place)
  assert cache.get("cd" + "1" * 62) is None and cache.misses == 1
  assert not [p for p in tmp_path.rglob(".tmp-*")]  # no temporary file left behind


def test_env_turns_it_off_or_points_it(monkeypatch, tmp_path):
  monkeypatch.setenv(ENV, "off")
  assert stats_cache() is None
  monkeypatch.setenv(ENV, str(tmp_path))
  assert stats_cache().directory == str(tmp_path)


@needs_libtpu
def test_a_topology_compile_is_served_from_the_cache_the_second_time(monkeypatch, tmp_path):
  monkeypatch.setenv(ENV, str(tmp_path))
  mesh = jaxckpt.sharding.get_topology("v5e:2x2").mesh()
  target = shipped_target("gpt", "tiny", batch_size=8)
  first = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile()
  second = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile()
  assert not first.cached and second.cached and second.compiled is None
  assert dict(second.memory) == dict(first.memory) and second.cost == first.cost
  assert second.cost.get("flops", 0) > 0


@needs_libtpu
def test_a_refused_compile_is_remembered(monkeypatch, tmp_path):
  """A program over the chip's HBM (GPT small at 4096 sequences per v5e chip): the second time the refusal comes
  from the cache, with the compiler's own message (the fit planner reads the required bytes from it)."""
  monkeypatch.setenv(ENV, str(tmp_path))
  mesh = jaxckpt.sharding.get_topology("v5e:2x2").mesh()
  target = shipped_target("gpt", "small", batch_size=4 * 4096)
  with pytest.raises(Exception) as first:
    lower_policy(target, jaxckpt.parse_policy("none"), mesh=mesh).compile()
  assert "RESOURCE_EXHAUSTED" in str(first.value)
  with pytest.raises(CachedRefusal) as again:
    lower_policy(target, jaxckpt.parse_policy("none"), mesh=mesh).compile()
  assert str(again.value) == str(first.value)
  assert len(list(tmp_path.rglob("*.json"))) == 1


def test_the_program_text_is_kept_beside_an_entry_and_an_entry_without_it_is_one(tmp_path):
  """``put(..., program_text=...)`` writes the compiled program's text compressed before the JSON that names it;
  an entry written without it reads back without it."""
  cache = StatsCache(str(tmp_path))
  key, bare = "ef" + "2" * 62, "ef" + "3" * 62
  cache.put(key, CachedStats({"temp_bytes": 5}, {}, 1.0), program_text="HloModule m\n\nENTRY %e () -> () {\n}\n")
  cache.put(bare, CachedStats({"temp_bytes": 5}, {}, 1.0))
  assert cache.get(key).has_program and cache.program_text(key).startswith("HloModule m")
  assert not cache.get(bare).has_program and cache.program_text(bare) is None


@needs_libtpu
def test_a_cached_topology_compile_keeps_its_program_text(monkeypatch, tmp_path):
  """The second compile is served from the cache with the program's text (the step-time model reads it); an entry
  without it is not served to a caller that needs the text (``program_text=True``), which compiles again."""
  monkeypatch.setenv(ENV, str(tmp_path))
  mesh = jaxckpt.sharding.get_topology("v5e:2x2").mesh()
  target = shipped_target("gpt", "tiny", batch_size=8)
  first = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile()
  second = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile(program_text=True)
  assert second.cached and second.hlo_text() == first.compiled.as_text()
  for path in tmp_path.rglob("*.hlo.gz"):
    path.unlink()
  third = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile()
  assert third.cached and third.program_path is None
  with pytest.raises(JaxckptError, match="program_text=True"):
    third.hlo_text()
  fourth = lower_policy(target, jaxckpt.parse_policy("full"), mesh=mesh).compile(program_text=True)
  assert not fourth.cached  # the same program (its text differs only in the source lines of the trace)
  assert parse_hlo(fourth.hlo_text()).totals() == parse_hlo(first.compiled.as_text()).totals()
