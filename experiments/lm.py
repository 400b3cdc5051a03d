"""Train a byte-level language model with a remat policy: ``python -m experiments.lm``.

Trains a shipped language model of :data:`jaxckpt.models.MODEL_REGISTRY`: ``--model gpt`` (default),
:class:`jaxckpt.models._gpt.GPT` (causal self-attention, learned positions, tied or untied embeddings; presets
``tiny``, ``small``, ``gpt2-small``), or ``--model llm``, the LLM family of :mod:`jaxckpt.models.llm` (Llama-, Mistral-
and Gemma-shaped decoders; CPU-sized presets ``llama-tiny`` and ``gemma2-tiny``), on real text found locally: by
default the ``.py`` files of this Python's standard library (first 4 MiB in sorted path order), or ``--corpus PATH``
(a text file or folder). Before training
it prints the compiled memory stats of the train step; during training a progress bar; after each evaluation the
train loss, eval loss (nats/byte) and perplexity; at the end the eval loss against the corpus's unigram (byte
frequency) entropy, the loss of a model that ignores context. ``--out DIR`` writes ``DIR/metrics.json``.

The CLI only parses flags into an :class:`LMConfig` and calls :func:`train`, which tests call directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import text
from experiments.autofit import autofit, batch_size_flag
from experiments.flags import CLIParser, add_policy_flags, add_run_flags, command, exit_with
from jaxckpt.cli import reference_epilog
from experiments.options import RunOptions, configure, run_identity
from experiments.runner import RunResult, Setup, run
from jaxckpt.errors import JaxckptError
from jaxckpt.names import DECODER_NAMES
from jaxckpt.models import MODEL_REGISTRY, LanguageModelEntry, config_record, model_entry
from jaxckpt.models.llm import ATTENTION_KERNELS
from jaxckpt.nnx import ATTENTION_IMPLEMENTATIONS
from jaxckpt.models import COMPUTE_DTYPES
from jaxckpt.step import ModelTarget

__all__ = ["LMConfig", "LMResult", "train", "main", "build_parser", "model_config"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """One LM run. Model fields left ``None`` come from the preset; how it runs is in ``run``."""

  preset: str = "tiny"  # A preset of the model: gpt tiny, small, gpt2-small; llm llama-tiny, gemma2-tiny, ...
  structure: str = "block"  # Remat structure of the layer stack: block, every:K, nested, nested:D.
  model: str = "gpt"  # The language model of jaxckpt.models.MODEL_REGISTRY: gpt or llm.
  max_seq_length: int | None = None  # Context length T (tokens); overrides the preset's.
  attention: str | None = None  # gpt: xla, dot_product_attention; llm: auto, xla, splash; None: the preset's.
  batch_size: int | str | None = None  # Sequences per step B; None: the preset's; "auto": the largest that fits.
  grad_accum_steps: int = 1  # Micro-batches per step (gradients averaged, one update); must divide B.
  num_layers: int | None = None  # Overrides the preset's depth.
  tie_embeddings: bool | None = None  # Tied (True) or untied (False) output head; None keeps the preset's (tied).
  scan: bool | None = None  # Scan over layers (True) or unroll (False); None keeps the preset's (scan).
  compute_dtype: str = "float32"  # float32 or bfloat16 (parameters stay float32).
  steps: int = 600  # Optimizer steps.
  eval_every: int = 100  # Steps between evaluations.
  eval_batches: int = 8  # Fixed evaluation batches of B sequences each.
  learning_rate: float = 3e-3  # Peak AdamW learning rate (linear warmup, then cosine decay to 0).
  warmup_steps: int = 50  # Warmup steps (capped at half the run).
  weight_decay: float = 0.01
  seed: int = 0  # Initialisation, batch windows and dropout.
  split_seed: int = 0  # The fixed train/eval split of the corpus.
  corpus: str | None = None  # A text file or folder; None = the stdlib's .py files.
  corpus_max_mib: float = text.DEFAULT_MAX_BYTES / 2**20  # Read at most this many MiB of the corpus.
  run: RunOptions = RunOptions()  # Policy, outputs, checkpoints, faults, devices (experiments.options).


LMResult = RunResult
"""What :func:`train` returns: ``metrics`` (as written to metrics.json) and the final train ``state``."""


LANGUAGE_MODELS: tuple[str, ...] = tuple(n for n, e in MODEL_REGISTRY.items() if isinstance(e, LanguageModelEntry))
"""The models this experiment trains (``--model``): the registry's language models, ``gpt`` and ``llm``."""


def _entry(config: LMConfig) -> LanguageModelEntry:
  if config.model not in LANGUAGE_MODELS:
    raise JaxckptError(f"--model {config.model} is not a language model; valid: {', '.join(LANGUAGE_MODELS)} "
                       "(image classifiers train with python -m experiments.classifier)")
  return model_entry(config.model)


def _check(config: LMConfig) -> None:
  _entry(config).config(config.preset)  # an unknown preset: the valid ones and the closest
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise JaxckptError(f"unknown compute dtype {config.compute_dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}")
  for name, flag in (("steps", "steps"), ("eval_every", "eval-every"), ("eval_batches", "eval-batches"),
                     ("batch_size", "batch-size"), ("num_layers", "layers"), ("max_seq_length", "max-seq-length")):
    value = getattr(config, name)
    if value is not None and value < 1:
      raise JaxckptError(f"--{flag} must be ≥ 1, got {value}")
  if config.grad_accum_steps < 1:
    raise JaxckptError(f"--grad-accum-steps must be ≥ 1, got {config.grad_accum_steps}")
  if config.warmup_steps < 0:
    raise JaxckptError(f"--warmup-steps must be ≥ 0, got {config.warmup_steps}")
  if not config.learning_rate > 0:
    raise JaxckptError(f"--learning-rate must be > 0, got {config.learning_rate}")
  if not config.corpus_max_mib > 0:
    raise JaxckptError(f"--corpus-max-mib must be > 0, got {config.corpus_max_mib}")


def model_config(config: LMConfig) -> Any:
  """The model's config (``GPTConfig`` or ``LLMConfig``): the preset with this run's overrides (T, B, depth,
  attention, head, scan, structure, dtype), checked once by the registry (errors name the Python argument)."""
  return _entry(config).override(
      config.preset, compute_dtype=config.compute_dtype, structure=config.structure, seq_len=config.max_seq_length,
      batch_size=config.batch_size, num_layers=config.num_layers, attention=config.attention,
      tie_embeddings=config.tie_embeddings, scan=config.scan)


def _score(results: list[Mapping[str, Any]]) -> dict[str, float]:
  """Mean loss over the fixed eval batches (equal sizes, so the mean of means is the mean per token)."""
  loss = float(np.mean([float(r["loss"]) for r in results]))
  accuracy = float(np.mean([float(r["accuracy"]) for r in results]))
  return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_accuracy": accuracy}


def _setup(config: LMConfig, log) -> Setup:  # noqa: ARG001 - the runner's setup signature
  """The LM's part of a run: corpus, model, loss, optimizer, evaluation and result lines."""
  entry, model_cfg = _entry(config), model_config(config)
  if model_cfg.vocab_size < text.VOCAB_SIZE:
    raise JaxckptError(f"preset {config.preset} has vocab_size={model_cfg.vocab_size} < 256 byte tokens")
  corpus = text.load_corpus(config.corpus, max_bytes=int(config.corpus_max_mib * 2**20),
                            min_window=model_cfg.seq_len + 1, split_seed=config.split_seed)
  batch_size, seq_len = model_cfg.batch_size, model_cfg.seq_len
  if batch_size % config.grad_accum_steps:
    raise JaxckptError(f"--grad-accum-steps {config.grad_accum_steps} must divide the batch size {batch_size}")
  warmup = min(config.warmup_steps, config.steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, config.steps + 1)

  def report(final: Mapping[str, float], history: Mapping[str, list[float]]) -> tuple[dict[str, Any], list[str]]:
    extra = dict(model=config.model, preset=config.preset, scan=model_cfg.scan, compute_dtype=model_cfg.compute_dtype,
                 test_accuracy=final["eval_accuracy"], eval_loss=final["eval_loss"], perplexity=final["perplexity"],
                 eval_loss_history=history.get("eval_loss", []), unigram_entropy=corpus.unigram_entropy,
                 corpus=corpus.info(), structure=model_cfg.structure, attention=model_cfg.attention,
                 model_config=config_record(model_cfg), tokens_per_step=batch_size * seq_len)
    verdict = "below" if final["eval_loss"] < corpus.unigram_entropy else "NOT below"
    return extra, [f"eval loss {final['eval_loss']:.4f} nats/byte (perplexity {final['perplexity']:.3f}), {verdict} "
                   f"the unigram entropy {corpus.unigram_entropy:.4f}"]

  return Setup(
      model=config.model, preset=config.preset,
      make_model=lambda policy=None: entry.build(model_cfg, policy=policy, seed=config.seed),
      loss_fn=entry.loss_fn,
      tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=config.weight_decay)),
      batch_at=functools.partial(text.train_batch, corpus, batch_size=batch_size, seq_len=seq_len, seed=config.seed),
      batch_size=batch_size, total_steps=config.steps, eval_every=config.eval_every,
      eval_batches=text.eval_batches(corpus, batch_size=batch_size, seq_len=seq_len, num_batches=config.eval_batches),
      score=_score, period="eval",
      identity=run_identity(config, model_cfg, ignore=("corpus", "eval_every", "eval_batches"),
                            corpus={"source": corpus.source, "sha256": corpus.sha256}),
      headline=(f"model {config.model} ({config.preset}: L={model_cfg.num_layers} d={model_cfg.dim} "
                f"H={model_cfg.num_heads} "
                f"T={seq_len} B={batch_size}, {model_cfg.attention} attention, "
                f"{'tied' if model_cfg.tie_embeddings else 'untied'} embeddings, "
                f"{'scanned' if model_cfg.scan else 'unrolled'} layers, structure {model_cfg.structure}, "
                f"{model_cfg.compute_dtype}); corpus {corpus.source}: {corpus.files} files, {corpus.num_bytes} bytes "
                f"({corpus.train.size} train / {corpus.eval.size} eval), unigram entropy "
                f"{corpus.unigram_entropy:.4f} nats/byte"),
      report=report,
  )


def train(config: LMConfig, *, log=print) -> LMResult:
  """Trains and evaluates one LM run ``config``, logging progress lines to ``log`` (``print`` on the CLI):
  :func:`experiments.runner.run` with the LM's parts.

  Returns:
    :class:`LMResult` with ``metrics`` = the contents of metrics.json: the shared keys of
    :func:`experiments.outputs.run_metrics`, ``model`` (``"gpt"`` or ``"llm"``), ``preset``, ``test_accuracy``
    (next-byte accuracy on the eval stream, 0–1), ``eval_loss`` (nats/byte), ``perplexity``, ``eval_loss_history``, ``unigram_entropy``
    (nats/byte), ``corpus`` (source, files, bytes, split sizes, sha256), ``model_config``, ``tokens_per_step``, …

  Raises:
    DataError: a bad ``--corpus``; the others of :func:`experiments.runner.run`.
  """
  return run(autofit(config, functools.partial(fit_target, config), log=log), check=_check, setup=_setup, log=log)


def fit_target(config: LMConfig, batch_size: int) -> ModelTarget:
  """The run's model, loss and a batch of ``batch_size`` sequences ``{"tokens": [B, T+1] int32}``, as shapes (for the
  fit planner, :mod:`experiments.autofit`)."""
  entry = _entry(config)
  model_cfg = model_config(configure(config, batch_size=batch_size, grad_accum_steps=1))
  batch = {"tokens": jax.ShapeDtypeStruct((batch_size, model_cfg.seq_len + 1), jnp.int32)}
  return ModelTarget(make_model=lambda: entry.build(model_cfg, seed=config.seed), batch=batch,
                     loss_fn=entry.loss_fn, name=config.model, preset=config.preset)


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser (flags map one-to-one onto :class:`LMConfig` fields)."""
  defaults = LMConfig()
  presets = "; ".join(f"{name}: L={c.num_layers} d={c.dim} H={c.num_heads} T={c.seq_len} B={c.batch_size} "
                      f"V={c.vocab_size}" for name, c in MODEL_REGISTRY["gpt"].presets.items())
  parser = CLIParser(
      prog="python -m experiments.lm",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=reference_epilog(
          models=tuple(LANGUAGE_MODELS),
          notes=[f"gpt presets: {presets}",
                 "gpt checkpoint names: qkv, attn_weights (xla attention only), attn_context, attn_out, mlp_hidden, "
                 f"mlp_out; llm (MaxText's): {', '.join(DECODER_NAMES)}",
                 "--attention dot_product_attention uses jax.nn.dot_product_attention (cuDNN flash attention on GPU "
                 "with", "  --compute-dtype bfloat16): that is not a dot_general, so dots policies do not save it; its "
                 "output is", "  tagged attn_context (save it with save_only_these_names:attn_context). On CPU JAX's "
                 "fallback is einsum."],
          examples=["python -m experiments.lm --preset small --policy dots_saveable --max-seq-length 512",
                    "python -m experiments.lm --policy attn=save_only_these_names:qkv,mlp=full --corpus notes/ --out "
                    "run1",
                    "python -m experiments.lm --model llm --preset gemma2-tiny --policy "
                    "save_only_these_names:query_proj"]),
  )
  parser.add_argument("--model", choices=list(LANGUAGE_MODELS), default=defaults.model,
                      help="the language model: gpt (GPT-2 style) or llm (Llama, Mistral, Gemma; docs/llm.md) "
                           "(default %(default)s)")
  parser.add_argument("--preset", default=defaults.preset,
                      help=f"model preset: gpt {', '.join(MODEL_REGISTRY['gpt'].presets)}; llm llama-tiny, "
                           "gemma2-tiny, ... (default %(default)s)")
  add_policy_flags(parser)
  parser.add_argument("--grad-accum-steps", type=int, default=defaults.grad_accum_steps,
                      help="split each batch into N micro-batches, one update (must divide the batch size)")
  parser.add_argument("--structure", default=defaults.structure,
                      help="remat structure of the layer stack: block, every:K, nested, nested:D (default block)")
  parser.add_argument("--max-seq-length", type=int, default=None, help="context length T (overrides the preset's)")
  parser.add_argument("--attention", choices=list(dict.fromkeys(ATTENTION_IMPLEMENTATIONS + ATTENTION_KERNELS)),
                      default=None, help="attention implementation: gpt xla or dot_product_attention, llm auto, "
                                         "xla or splash (default: the preset's, xla)")
  parser.add_argument("--batch-size", type=batch_size_flag, default=None,
                      help="sequences per step (default: the preset's), or auto: the largest that fits --memory")
  parser.add_argument("--layers", type=int, dest="num_layers", default=None, help="override the preset's depth")
  parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                      help="output head tied to the token embedding (default) or --no-tie-embeddings")
  parser.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                      help="scan over layers (default) or --no-scan to unroll them")
  parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default=defaults.compute_dtype,
                      help="dtype of activations and matmuls (parameters stay float32; default %(default)s)")
  parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)")
  parser.add_argument("--eval-every", type=int, default=defaults.eval_every, help="steps between evaluations")
  parser.add_argument("--eval-batches", type=int, default=defaults.eval_batches, help="fixed eval batches")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                      help="AdamW's peak learning rate: linear warm-up, then cosine decay to 0 (default %(default)s)")
  parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                      help="linear learning-rate warm-up steps, at most half the run (default %(default)s)")
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                      help="AdamW's decoupled weight decay (default %(default)s)")
  parser.add_argument("--seed", type=int, default=defaults.seed,
                      help="seed of the parameters, dropout and batch order (default %(default)s)")
  parser.add_argument("--split-seed", type=int, default=defaults.split_seed, help="seed of the train/eval split")
  parser.add_argument("--corpus", default=None, help="a text file or folder (default: the stdlib's .py files)")
  parser.add_argument("--corpus-max-mib", type=float, default=defaults.corpus_max_mib,
                      help="read at most this many MiB of the corpus (default %(default)s)")
  add_run_flags(parser)
  return parser


main = command(build_parser, LMConfig, train)
"""CLI entry point ``main(argv=None) -> exit status`` (:func:`experiments.flags.command`)."""


if __name__ == "__main__":
  exit_with(main())
