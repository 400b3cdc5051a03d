"""The compiled-stats cache: a TPU topology compile made once is not made again (a second identical run of a
planner answers from it), entries survive a torn write, and a refused compile is remembered as refused."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

import jaxckpt
from jaxckpt.analysis import parse_hlo
from jaxckpt.errors import JaxckptError
from jaxckpt.step import shipped_target
from jaxckpt.step._compile import CachedRefusal, lower_policy
from jaxckpt.step._stats_cache import (ENV, STALE_TMP_S, CachedStats, StatsCache, StatsCacheWarning, cache_key,
                                       compiler_environment, stats_cache)
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


# --- the key: everything that changes the compiled program -----------------------------------------------------

BASE = dict(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", device_count=8)
PROGRAM = "module @jit_step { func.func public @main() { return } }"


def _key(monkeypatch, **changes):
  """``cache_key`` of one program with one input changed (the environment starts clean of compiler variables)."""
  for name in list(os.environ):
    if name.startswith(("XLA_", "LIBTPU_", "TPU_")):
      monkeypatch.delenv(name)
  env = changes.pop("env", {})
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  kwargs = {**BASE, "options": {"xla_gpu_enable_latency_hiding_scheduler": True}, "program_text": PROGRAM,
            "target": {"backend": "PJRT C API", "topology": "123", "target_config": "ab"}, **changes}
  return cache_key(kwargs.pop("program_text"), kwargs.pop("options"), **kwargs)


@pytest.mark.parametrize("change", [
    {"env": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}},  # served stale numbers before
    {"env": {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=true"}},
    {"env": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}},  # the memory fraction XLA's client reads
    {"env": {"TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}},
    {"program_text": PROGRAM.replace("main", "main2")},
    {"options": {"xla_gpu_enable_latency_hiding_scheduler": False}},
    {"options": {"xla_gpu_enable_latency_hiding_scheduler": "True"}},  # the same text, another type
    {"options": {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_triton_gemm": False}},
    {"compile_options": b"\x08\x01"},  # the CompileOptions JAX builds (its debug options parsed from XLA_FLAGS)
    {"versions": {"jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.3"}},  # the compiler's version
    {"target": {"backend": "PJRT C API", "topology": "456", "target_config": "ab"}},  # another topology
    {"target": {"backend": "PJRT C API", "topology": "123", "target_config": "cd"}},  # another GPU target config
    {"target": {"backend": "PJRT C API 2", "topology": "123", "target_config": "ab"}},  # libtpu's build string
    {"device_count": 16}, {"device_kind": "NVIDIA H200"}, {"platform": "tpu"},
], ids=lambda c: "-".join(c) + ("-" + "-".join(c["env"]) if "env" in c else ""))
def test_every_input_that_changes_the_program_changes_the_key(monkeypatch, change):
  versions = {"jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.2"}
  base = _key(monkeypatch, versions=versions)
  assert _key(monkeypatch, **{"versions": versions, **change}) != base
  assert _key(monkeypatch, versions=versions) == base  # and only the change


def test_inputs_that_change_no_program_keep_the_key(monkeypatch):
  """Dump flags, the host platform's device count and the TPU variables jaxckpt itself sets are not in the key (a
  test's ``--xla_force_host_platform_device_count=8`` must not miss every entry), and XLA_FLAGS's word order is not."""
  base = _key(monkeypatch, env={"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"})
  same = _key(monkeypatch, env={"XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/d "
                                             "--xla_force_host_platform_device_count=8 "
                                             "--xla_gpu_enable_triton_gemm=false",
                                "TPU_ACCELERATOR_TYPE": "v5litepod-4", "JAX_PLATFORMS": "cpu"})
  assert same == base


def test_the_environment_the_compilers_read():
  env = {"XLA_FLAGS": "--b=1 --a=2 --xla_dump_to=x", "LIBTPU_INIT_ARGS": "--x", "TPU_WORKER_HOSTNAMES": "h",
         "XLA_CLIENT_MEM_FRACTION": ".5", "HOME": "/root", "JAX_PLATFORMS": "cpu"}
  assert compiler_environment(env) == {"LIBTPU_INIT_ARGS": "--x", "XLA_CLIENT_MEM_FRACTION": ".5",
                                       "XLA_FLAGS": "--a=2 --b=1"}


# --- entries checked on read ------------------------------------------------------------------------------------

KEY = "ab" + "4" * 62
HLO = "HloModule m\n\nENTRY %e () -> () {\n}\n"


def _put(tmp_path, entry=None, text=HLO):
  cache = StatsCache(str(tmp_path))
  cache.put(KEY, entry or CachedStats({"temp_bytes": 5, "footprint_bytes": 9}, {"flops": 3.0}, 1.5),
            program_text=text)
  return cache


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_program_text_is_a_miss_removed_with_one_warning(tmp_path, damage):
  """A truncated, empty or garbage ``.hlo.gz`` served before as a hit whose text could not be read (the fit then
  found "no mesh fits", the report dropped est. step): now a miss, the entry removed, one warning naming it."""
  cache = _put(tmp_path)
  path = tmp_path / KEY[:2] / (KEY + ".hlo.gz")
  data = path.read_bytes()
  path.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "garbage": b"not gzip at all"}[damage])
  with pytest.warns(StatsCacheWarning, match=rf"entry .*{KEY}\.json was damaged .*removed it, compiling afresh"):
    assert cache.get(KEY) is None
  assert not list((tmp_path / KEY[:2]).iterdir())  # removed: the next compile writes it again
  _put(tmp_path)
  assert cache.get(KEY).has_program


@pytest.mark.parametrize("data", [
    {"memory": None, "cost": {}, "compile_s": 1.0},  # neither stats nor a refusal
    {"memory": {"temp_bytes": "lots"}, "cost": {}, "compile_s": 1.0},
    {"memory": {"temp_bytes": 5}, "cost": {"flops": "many"}, "compile_s": 1.0},
    {"memory": {"temp_bytes": 5}, "cost": {}, "compile_s": "soon"},
    {"memory": {"tmp_bytes": 5}, "cost": {}, "compile_s": 1.0},
    {"memory": {"temp_bytes": -5}, "cost": {}, "compile_s": 1.0},
    {"memory": None, "cost": {}, "compile_s": 1.0, "error": 42},
    [1, 2], "", None,
])
def test_an_entry_with_the_wrong_types_is_a_miss(tmp_path, data):
  path = tmp_path / KEY[:2] / (KEY + ".json")
  path.parent.mkdir()
  path.write_text(json.dumps(data) if data != "" else "")
  cache = StatsCache(str(tmp_path))
  with pytest.warns(StatsCacheWarning, match="was damaged"):
    assert cache.get(KEY) is None
  assert not path.exists() and cache.damaged == 1


def test_a_refusal_entry_is_valid(tmp_path):
  cache = StatsCache(str(tmp_path))
  cache.put(KEY, CachedStats(None, {}, 2.0, "RESOURCE_EXHAUSTED: Ran out of memory"))
  assert cache.get(KEY).error.startswith("RESOURCE_EXHAUSTED")


def test_a_failed_write_leaves_no_temporary_file_and_warns_once_per_run(tmp_path, monkeypatch):
  """A full disk during a write: the temporary file is removed (it kept the disk full), the entry is not written,
  and one warning is given for the whole run although every compile makes its own cache object."""
  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)
  directory = tmp_path / "cache"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3):  # stats_cache() makes one StatsCache per compile
      StatsCache(str(directory)).put(f"{i:02d}" + "5" * 62, CachedStats({"temp_bytes": 1}, {}, 1.0),
                                     program_text=HLO)
  messages = [str(w.message) for w in caught if issubclass(w.category, StatsCacheWarning)]
  assert len(messages) == 1 and "cannot be written (no space left on device)" in messages[0], messages
  assert [p for p in directory.rglob("*") if p.is_file()] == []


def test_temporaries_left_by_a_killed_writer_are_removed_at_the_next_start(tmp_path):
  shard = tmp_path / "ab"
  shard.mkdir()
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  host = socket.gethostname().replace("-", "_")
  gone = shard / f".tmp-{host}-{dead.stdout.strip()}-x1.json"  # its writer is dead (kill -9 mid-write)
  live = shard / f".tmp-{host}-{os.getpid()}-x2.json"  # a writer of this process, still writing
  old = shard / ".tmp-otherhost-12-x3.json"  # another host's: removed once stale
  young = shard / ".tmp-otherhost-12-x4.json"
  for path in (gone, live, old, young):
    path.write_text("{")
  os.utime(old, (time.time() - 2 * STALE_TMP_S,) * 2)
  StatsCache(str(tmp_path))
  assert sorted(p.name for p in shard.iterdir()) == sorted([live.name, young.name])
