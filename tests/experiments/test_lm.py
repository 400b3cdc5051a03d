"""The GPT decoder and the LM experiment: it learns real text (beats the unigram entropy), remat keeps gradients,
tied/untied heads, --max-seq-length, bad corpora → exit 2, metrics.json, resume, and the report's ``--model gpt``."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from experiments import text
from experiments.lm import LMConfig, main, model_config, train
from experiments.options import configure
from jaxckpt.models._gpt import GPT, GPT_PRESETS, build_gpt, lm_batch_struct, lm_loss
from jaxckpt.schema import MEMORY_KEYS, METRICS_KEYS
from tests.numerics import assert_trees_close

SMALL_CORPUS_MIB = 0.25  # the first 256 KiB of the stdlib's .py files: real text, loads and splits in milliseconds
SHORT = configure(LMConfig(preset="tiny", steps=150, eval_every=75, eval_batches=4, corpus_max_mib=SMALL_CORPUS_MIB),
                  progress=False)


def quiet(*_):
  pass


# --- data -----------------------------------------------------------------------------------------------------------


def test_unigram_entropy_in_nats():
  assert text.unigram_entropy(np.array([0, 1, 2, 3] * 5, np.uint8)) == pytest.approx(math.log(4))
  assert text.unigram_entropy(np.zeros(10, np.uint8)) == 0.0


def test_corpus_split_and_batches_are_fixed_by_seed():
  corpus = text.load_corpus(None, max_bytes=int(SMALL_CORPUS_MIB * 2**20), min_window=65)
  again = text.load_corpus(None, max_bytes=int(SMALL_CORPUS_MIB * 2**20), min_window=65)
  other = text.load_corpus(None, max_bytes=int(SMALL_CORPUS_MIB * 2**20), min_window=65, split_seed=1)
  assert corpus.num_bytes == corpus.train.size + corpus.eval.size == 2**18 and corpus.files >= 2
  assert abs(corpus.eval.size - 2**18 / 10) <= 1  # 1 of 10 equal chunks held out
  np.testing.assert_array_equal(corpus.eval, again.eval)
  assert not np.array_equal(corpus.eval, other.eval)
  batch = text.train_batch(corpus, 7, batch_size=8, seq_len=64, seed=0)["tokens"]
  assert batch.shape == (8, 65) and batch.dtype == np.int32
  np.testing.assert_array_equal(batch, text.train_batch(corpus, 7, batch_size=8, seq_len=64, seed=0)["tokens"])
  assert not np.array_equal(batch, text.train_batch(corpus, 8, batch_size=8, seq_len=64, seed=0)["tokens"])
  evals = text.eval_batches(corpus, batch_size=8, seq_len=64, num_batches=3)
  assert [b["tokens"].shape for b in evals] == [(8, 65)] * 3
  assert 2.5 < corpus.unigram_entropy < 4.0  # Python source: ~3.1 nats/byte, far below log(256) = 5.5


# --- training -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_run():
  return train(configure(SHORT, policy="attn=dots_saveable,mlp=full"), log=quiet)


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_eval_loss_below_unigram_entropy(short_run):
  metrics = short_run.metrics
  assert metrics["eval_loss"] < metrics["unigram_entropy"] - 0.2, (metrics["eval_loss"], metrics["unigram_entropy"])
  assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
  assert len(metrics["eval_loss_history"]) == 2 and metrics["eval_loss_history"][-1] < metrics["eval_loss_history"][0]


@pytest.mark.slow  # moved from the fast tier: README's test command ≤ 10 min on 2 cores
def test_metrics_schema(short_run):
  metrics = short_run.metrics
  assert set(METRICS_KEYS) <= set(metrics) and set(metrics["memory"]) == set(MEMORY_KEYS)
  assert metrics["model"] == "gpt" and metrics["preset"] == "tiny"
  assert metrics["policy_per_block"] == {"attn": "dots_saveable", "mlp": "nothing_saveable"}
  assert metrics["corpus"]["bytes"] == 2**18 and metrics["corpus"]["source"].startswith("python stdlib")
  assert metrics["tokens_per_step"] == 8 * 64 and 0 < metrics["test_accuracy"] < 1
  assert metrics["memory"]["temp_bytes"] > 0
  json.dumps(metrics)


def test_llm_family_trains_on_cpu():
  """--model llm: a tiny preset of the LLM family (Llama-shaped, float32) learns the same corpus in a few steps."""
  config = configure(LMConfig(model="llm", preset="llama-tiny", max_seq_length=32, steps=20, eval_every=10,
                              eval_batches=2, corpus_max_mib=SMALL_CORPUS_MIB), progress=False,
                     policy="save_only_these_names:query_proj+key_proj+value_proj")
  metrics = train(config, log=quiet).metrics
  assert metrics["model"] == "llm" and metrics["preset"] == "llama-tiny"
  assert metrics["model_config"]["num_kv_heads"] == 2 and metrics["model_config"]["seq_len"] == 32
  history = metrics["eval_loss_history"]
  assert len(history) == 2 and history[-1] < history[0] < math.log(256), history


@pytest.mark.slow
def test_default_run_beats_unigram_entropy():
  """The documented default (tiny, 600 steps, first 4 MiB of the stdlib's .py files)."""
  started = time.perf_counter()
  metrics = train(configure(LMConfig(), progress=False), log=quiet).metrics
  assert metrics["eval_loss"] < metrics["unigram_entropy"] - 0.4, metrics
  assert time.perf_counter() - started < 180


class Interrupt(Exception):
  pass


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
  config = configure(SHORT, steps=30, eval_every=10, ckpt_every=10, policy="nothing_saveable")
  straight = train(config, log=quiet)

  def interrupt_at_eval_2(line):
    if line.startswith("eval 2/"):
      raise Interrupt

  ckpt = str(tmp_path / "ckpt")
  with pytest.raises(Interrupt):
    train(configure(config, ckpt_dir=ckpt), log=interrupt_at_eval_2)
  lines = []
  resumed = train(configure(config, ckpt_dir=ckpt, resume=True, policy="dots_saveable"), log=lines.append)
  assert any("resumed from step 10" in line for line in lines)
  chex.assert_trees_all_equal(resumed.state.params, straight.state.params)
  assert resumed.metrics["eval_loss"] == straight.metrics["eval_loss"]


# --- remat keeps the numbers ----------------------------------------------------------------------------------------

GRAD_CONFIG = dataclasses.replace(GPT_PRESETS["tiny"], seq_len=16, dropout_rate=0.1)
POLICIES = ["nothing_saveable", "dots_saveable", "save_only_these_names:qkv+mlp_hidden", "attn=dots_saveable,mlp=full"]
ATTENTIONS = ["xla", "dot_product_attention"]


def grad_batch():
  return {"tokens": np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)}


def loss_and_grads_fn(model):
  """``key -> (loss, grads)`` of ``model`` under its current policy, compiled once (the key is an argument)."""
  graphdef, params, other = nnx.split(model, nnx.Param, ...)

  def loss(params, key):
    return lm_loss(nnx.merge(graphdef, params, other), grad_batch(), dropout_key=key, deterministic=False)[0]

  compiled = jaxckpt.jit(jax.value_and_grad(loss))
  return lambda key: compiled(params, key)


@pytest.fixture(scope="module")
def references():
  """Per attention implementation: the model (dropout 0.1, no remat) and its compiled loss-and-gradients."""
  return {attention: (model := build_gpt(dataclasses.replace(GRAD_CONFIG, attention=attention), policy="none"),
                      loss_and_grads_fn(model)) for attention in ATTENTIONS}


KEY = 42


@pytest.mark.parametrize("attention,policy", [(a, p) for a in ATTENTIONS for p in POLICIES])
def test_gradients_equal_no_remat(references, attention, policy):
  model, reference = references[attention]
  ref_loss, ref_grads = reference(jax.random.key(KEY))
  jaxckpt.set_policy(model, policy)
  try:
    loss, grads = loss_and_grads_fn(model)(jax.random.key(KEY))
  finally:
    jaxckpt.set_policy(model, "none")
  what = f"{policy} vs no remat, {attention} attention"
  assert_trees_close(loss, ref_loss, depth=GRAD_CONFIG.num_layers, what=f"GPT loss, {what}")
  assert_trees_close(grads, ref_grads, depth=GRAD_CONFIG.num_layers, what=f"GPT gradients, {what}")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_dropout_is_really_on(references, attention):
  """Guards the test above: another key changes the loss, so equal losses there mean equal dropout masks."""
  _, reference = references[attention]
  assert abs(float(reference(jax.random.key(7))[0]) - float(reference(jax.random.key(KEY))[0])) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("structure", ["every:2", "nested"])
def test_structures_keep_gradients(references, structure):
  _, reference = references["xla"]
  ref_loss, ref_grads = reference(jax.random.key(KEY))
  model = build_gpt(dataclasses.replace(GRAD_CONFIG, structure=structure), policy="dots_saveable")
  loss, grads = loss_and_grads_fn(model)(jax.random.key(KEY))
  what = f"{structure} dots_saveable vs block no remat"
  assert_trees_close(loss, ref_loss, depth=GRAD_CONFIG.num_layers, what=f"GPT loss, {what}")
  assert_trees_close(grads, ref_grads, depth=GRAD_CONFIG.num_layers, what=f"GPT gradients, {what}")


def test_dot_product_attention_output_is_named():
  model = build_gpt(dataclasses.replace(GRAD_CONFIG, attention="dot_product_attention"))
  assert jaxckpt.block_types(model)["attn"] == {"qkv", "attn_context", "attn_out"}
  with pytest.raises(jaxckpt.errors.PolicySpecError, match="attn_weights"):
    jaxckpt.set_policy(model, "save_only_these_names:attn_weights")


# --- model shapes ---------------------------------------------------------------------------------------------------


def param_shapes(config):
  abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  return {"/".join(map(str, path)): leaf.shape for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def test_tied_and_untied_parameter_trees():
  tiny = GPT_PRESETS["tiny"]
  tied, untied = param_shapes(tiny), param_shapes(dataclasses.replace(tiny, tie_embeddings=False))
  assert set(untied) - set(tied) == {"head/kernel"} and set(tied) <= set(untied)
  assert untied["head/kernel"] == (64, 256) and tied["embed/embedding"] == (256, 64) and tied["pos"] == (64, 64)
  assert tied["layers/layers/attn/qkv/kernel"] == (2, 64, 192)  # L stacked layers
  assert sum(math.prod(s) for s in untied.values()) - sum(math.prod(s) for s in tied.values()) == 64 * 256
  for config in (tiny, dataclasses.replace(tiny, tie_embeddings=False)):
    logits = nnx.eval_shape(lambda c=config: build_gpt(c)(jnp.zeros((3, 64), jnp.int32)))
    assert logits.shape == (3, 64, 256) and logits.dtype == jnp.float32


def test_presets_carry_the_issue_numbers():
  shape = lambda c: (c.num_layers, c.dim, c.num_heads, c.seq_len, c.batch_size, c.vocab_size, c.mlp_dim)  # noqa: E731
  assert shape(GPT_PRESETS["tiny"]) == (2, 64, 2, 64, 8, 256, 256)
  assert shape(GPT_PRESETS["small"]) == (6, 256, 4, 256, 8, 256, 1024)
  assert shape(GPT_PRESETS["gpt2-small"]) == (12, 768, 12, 1024, 8, 50257, 3072)
  params = param_shapes(GPT_PRESETS["gpt2-small"])  # abstract: nothing allocated
  assert sum(math.prod(s) for s in params.values()) == 124_439_808  # GPT-2 small


def test_max_seq_length_overrides_t():
  assert model_config(LMConfig(preset="small")).seq_len == 256
  config = model_config(LMConfig(preset="small", max_seq_length=512))
  assert config.seq_len == 512 and config.num_layers == 6
  assert param_shapes(config)["pos"] == (512, 256)
  assert lm_batch_struct(config.batch_size, config.seq_len)["tokens"].shape == (8, 513)


def test_too_many_tokens_is_an_error():
  model = nnx.eval_shape(lambda: build_gpt(GPT_PRESETS["tiny"]))
  with pytest.raises(jaxckpt.errors.JaxckptError, match="exceed the model's seq_len=64"):
    model(jnp.zeros((1, 65), jnp.int32))


# --- CLI ------------------------------------------------------------------------------------------------------------


def bad_inputs(tmp_path):
  empty_dir = tmp_path / "empty_dir"
  empty_dir.mkdir()
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  binary = tmp_path / "blob.bin"
  binary.write_bytes(bytes(range(256)) * 64)
  binary_dir = tmp_path / "binaries"
  binary_dir.mkdir()
  (binary_dir / "a.bin").write_bytes(b"\x00\xff" * 100)
  (binary_dir / "b.dat").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
  empties_dir = tmp_path / "empties"
  empties_dir.mkdir()
  (empties_dir / "a.txt").write_bytes(b"")
  short = tmp_path / "short.txt"
  short.write_text("print('hello')\n" * 10)
  return {
      "empty folder": (["--corpus", str(empty_dir)], [str(empty_dir), "holds no files"]),
      "empty file": (["--corpus", str(empty)], [str(empty), "the file is empty"]),
      "binary file": (["--corpus", str(binary)], [str(binary), "not a text file"]),
      "binary folder": (["--corpus", str(binary_dir)], [str(binary_dir), "only non-text (binary) files"]),
      "empty files": (["--corpus", str(empties_dir)], [str(empties_dir), "only empty files"]),
      "missing": (["--corpus", str(tmp_path / "nope")], ["no such file or folder"]),
      "too short": (["--corpus", str(short)], [str(short), "too few", "--max-seq-length"]),
      "preset": (["--preset", "huge"], ["'huge'", "tiny, small, gpt2-small"]),
      "llm preset": (["--model", "llm", "--preset", "llama3-8b"], ["'llama3-8b'", "did you mean 'llama3.1-8b'?"]),
      "another model's kernel": (["--attention", "splash"],
                                 ["--attention 'splash' is unknown", "dot_product_attention"]),
      "block type": (["--policy", "conv=full"], ["'conv'", "attn"]),
      "name": (["--policy", "save_only_these_names:conv_out"], ["conv_out"]),
      "seq len": (["--max-seq-length", "0"], ["--max-seq-length must be ≥ 1"]),
      "attention": (["--attention", "flash"], ["invalid choice", "dot_product_attention"]),
      "structure": (["--structure", "bogus"], ["'bogus'"]),
  }


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
  for case, (argv, fragments) in bad_inputs(tmp_path).items():
    try:
      code = main(["--steps", "1", "--no-progress", *argv])
    except SystemExit as exit_:  # argparse's own errors
      code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, (case, err)
    assert err.count("\n") == 1 and "Traceback" not in err, (case, err)
    for fragment in fragments:
      assert fragment in err, (case, fragment, err)


def test_data_errors_are_data_errors(tmp_path):
  (tmp_path / "x.bin").write_bytes(b"\x00" * 10)
  with pytest.raises(jaxckpt.errors.DataError, match="not a text file"):
    text.load_corpus(str(tmp_path / "x.bin"))


def test_folder_skips_binary_files(tmp_path):
  (tmp_path / "a.txt").write_text("hello world\n" * 200)
  (tmp_path / "b.bin").write_bytes(b"\x00\x01" * 50)
  (tmp_path / ".hidden").write_text("secret")
  corpus = text.load_corpus(str(tmp_path), min_window=17)
  assert (corpus.files, corpus.skipped, corpus.num_bytes) == (1, 1, 2400)


@pytest.mark.slow  # a CLI run in a fresh process (~10 s); the classifier's smoke test stays in the inner loop
def test_cli_smoke(tmp_path):
  out = tmp_path / "out"
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  ok = subprocess.run([sys.executable, "-m", "experiments.lm", "--steps", "20", "--eval-every", "20",
                       "--max-seq-length", "32", "--corpus-max-mib", str(SMALL_CORPUS_MIB), "--policy",
                       "dots_saveable", "--attention", "dot_product_attention", "--no-tie-embeddings", "--out",
                       str(out)], capture_output=True, text=True, env=env)
  assert ok.returncode == 0, ok.stderr
  assert "compiled train step memory" in ok.stdout and "eval 1/1" in ok.stdout and "perplexity" in ok.stdout
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["policy"] == "dots_saveable" and metrics["model_config"]["seq_len"] == 32
  assert metrics["model_config"]["tie_embeddings"] is False and metrics["attention"] == "dot_product_attention"
  assert metrics["tokens_per_step"] == 8 * 32 and metrics["steps"] == 20


# --- report ---------------------------------------------------------------------------------------------------------


def test_report_model_gpt(tmp_path, capsys, monkeypatch):
  from jaxckpt.cli._report import main as report_main

  monkeypatch.setenv("COLUMNS", "100")  # the table fits the terminal; CI's may be narrower

  path = tmp_path / "r.json"
  assert report_main(["--model", "gpt", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--policies",
                      "none", "save_only_these_names:qkv", "--no-progress", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "save_only_these_names:" in out and "qkv" in out  # a long policy breaks after ':' to fit the column
  data = json.loads(path.read_text())
  assert data["model"] == "gpt" and data["preset"] == "tiny" and data["structure"] == "scan"
  rows = {r["policy"]: r for r in data["rows"]}
  assert set(rows) == {"none", "save_only_these_names:qkv"} and all(r["status"] == "ok" for r in rows.values())
  qkv = next(g for g in rows["save_only_these_names:qkv"]["residuals"]["groups"] if g["key"] == "qkv")
  assert qkv["count"] == 2 and qkv["bytes"] == 2 * (2 * 16 * 3 * 64 * 4)  # L × [B, T, 3, H, K] float32
  assert rows["save_only_these_names:qkv"]["temp_bytes"] < rows["none"]["temp_bytes"]


@pytest.mark.slow
def test_report_compiles_gpt2_small_without_allocating():
  from jaxckpt.report import build_report
  from jaxckpt.step import shipped_target

  started = time.perf_counter()
  report = build_report(shipped_target("gpt", "gpt2-small"), ["nothing_saveable"], residuals=False, progress=False)
  assert time.perf_counter() - started < 30
  row = report.row("nothing_saveable")
  assert row["status"] == "ok", row["error"]
  assert row["argument_bytes"] > 124_439_808 * 4 * 3  # params + AdamW's two moments, float32
