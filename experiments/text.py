"""Text data for the LM experiment: real text found on this machine, as byte tokens, split and batched by seed.

No downloads. The default corpus is the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), read in sorted path order up to a byte cap, so
startup is fast and the corpus is the same on every run. ``--corpus PATH`` takes a text file or a folder of text
files instead (hidden entries skipped; files that are not UTF-8 text are skipped in a folder and refused alone).

Tokens are bytes (vocabulary 256). The token stream is cut into equal contiguous chunks and a fixed share of them,
drawn with ``split_seed``, is held out for evaluation. Training batches are a pure function of ``(seed, step)``;
evaluation windows are fixed (evenly spaced over the held-out stream).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sysconfig

import numpy as np

from jaxckpt.errors import DataError

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_MAX_BYTES",
    "TextCorpus",
    "stdlib_files",
    "load_corpus",
    "unigram_entropy",
    "train_batch",
    "eval_batches",
]

VOCAB_SIZE = 256
"""Byte tokens."""
DEFAULT_MAX_BYTES = 4 * 2**20
"""Bytes read from the corpus at most (first files in sorted path order): 4 MiB."""
CHUNK_BYTES = 64 * 2**10
"""Target size of the contiguous chunks the train/eval split assigns (64 KiB; at least 10 chunks are cut)."""
MIN_CHUNKS = 10


@dataclasses.dataclass(frozen=True)
class TextCorpus:
  """Byte tokens split into a training and an evaluation stream.

  Attributes:
    train: ``[N]`` uint8 tokens.
    eval: ``[M]`` uint8 tokens (held-out chunks, concatenated).
    source: where the text came from (for metrics.json).
    files: text files read.
    skipped: files in a folder skipped as not text.
    num_bytes: bytes read in all (``N + M``).
    unigram_entropy: entropy of the byte frequencies of the whole corpus, nats per byte.
    sha256: digest of all bytes read (identifies the corpus for ``--resume``).
  """

  train: np.ndarray
  eval: np.ndarray
  source: str
  files: int
  skipped: int
  num_bytes: int
  unigram_entropy: float
  sha256: str

  def info(self) -> dict[str, object]:
    """JSON-ready summary (no tokens)."""
    return {"source": self.source, "files": self.files, "skipped_files": self.skipped, "bytes": self.num_bytes,
            "train_bytes": int(self.train.size), "eval_bytes": int(self.eval.size), "sha256": self.sha256,
            "unigram_entropy": self.unigram_entropy}


def stdlib_files(root: str | None = None) -> list[str]:
  """The ``.py`` files under the standard library (``site-packages``, ``__pycache__``, hidden dirs excluded), sorted."""
  root = sysconfig.get_paths()["stdlib"] if root is None else root
  return _walk(root, lambda name: name.endswith(".py"),
               skip_dirs=lambda name: name in ("site-packages", "dist-packages", "__pycache__"))


def _walk(root: str, keep, *, skip_dirs=lambda name: False) -> list[str]:
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not skip_dirs(d))
    found += [os.path.join(folder, f) for f in sorted(files) if not f.startswith(".") and keep(f)]
  return found


def _is_text(data: bytes) -> bool:
  if b"\x00" in data:
    return False
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


def _read(path: str, label: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as err:
    raise DataError(f"{label} {path}: cannot read ({err.strerror or err})") from err


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy of the token frequencies, in nats per token: the loss of the best model that ignores context.

  Args:
    tokens: ``[N]`` integer tokens, N ≥ 1.

  Returns:
    ``-Σ p log p`` over the tokens' empirical distribution (float, nats).
  """
  counts = np.bincount(np.asarray(tokens).ravel().astype(np.int64))
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def load_corpus(path: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES, min_window: int = 2,
                eval_fraction: float = 0.1, split_seed: int = 0) -> TextCorpus:
  """Reads a corpus as byte tokens and splits it into train and eval streams.

  Args:
    path: a text file or a folder of text files; ``None`` = the standard library's ``.py`` files.
    max_bytes: read at most this many bytes (files in sorted path order; the last one truncated), ≥ 1.
    min_window: tokens one example needs (T + 1); both streams must hold at least this many.
    eval_fraction: share of the chunks held out for evaluation, in (0, 1).
    split_seed: seed of the chunks' assignment to train/eval.

  Returns:
    The :class:`TextCorpus`.

  Raises:
    DataError: ``path`` is missing, an empty file, a folder without files or with only empty or non-text files,
      a file that is not UTF-8 text (binary), or a corpus too small for ``min_window``; the message names the path.
  """
  label = "--corpus"
  skipped = 0
  if path is None:
    root = sysconfig.get_paths()["stdlib"]
    files, source = stdlib_files(root), f"python stdlib .py files ({root})"
    if not files:
      raise DataError(f"no .py files found in the standard library at {root}; pass --corpus PATH")
  elif os.path.isfile(path):
    files, source = [path], os.path.abspath(path)
  elif os.path.isdir(path):
    files, source = _walk(path, lambda name: True), os.path.abspath(path)
    if not files:
      raise DataError(f"{label} {path}: the folder holds no files")
  else:
    raise DataError(f"{label} {path}: no such file or folder")

  parts: list[bytes] = []
  used = total = 0
  for file in files:
    if total >= max_bytes:
      break
    data = _read(file, label)
    if not data:
      continue
    if not _is_text(data):
      if path is not None and os.path.isfile(path):
        raise DataError(f"{label} {path}: not a text file (binary data: NUL bytes or invalid UTF-8)")
      skipped += 1
      continue
    data = data[:max_bytes - total]
    parts.append(data)
    used += 1
    total += len(data)
  if not parts:
    if path is not None and os.path.isfile(path):
      raise DataError(f"{label} {path}: the file is empty")
    what = "only non-text (binary) files" if skipped else "only empty files"
    raise DataError(f"{label} {path}: the folder holds {what}; need UTF-8 text files")
  blob = b"".join(parts)
  tokens = np.frombuffer(blob, dtype=np.uint8)
  train, held_out = _split(tokens, eval_fraction=eval_fraction, split_seed=split_seed)
  if min(train.size, held_out.size) < min_window:
    raise DataError(
        f"{label if path is not None else 'corpus'} {path or source}: {tokens.size} bytes are too few: the train "
        f"({train.size}) and eval ({held_out.size}) parts each need at least {min_window} bytes (sequence length + 1); "
        "use more text or a shorter --max-seq-length")
  return TextCorpus(train, held_out, source, used, skipped, int(tokens.size), unigram_entropy(tokens),
                    hashlib.sha256(blob).hexdigest())


def _split(tokens: np.ndarray, *, eval_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Cuts ``tokens`` into ≥ 10 equal contiguous chunks and holds out ``eval_fraction`` of them (≥ 1), by seed."""
  if not 0.0 < eval_fraction < 1.0:
    raise DataError(f"eval_fraction={eval_fraction} must be in (0, 1)")
  num_chunks = max(MIN_CHUNKS, math.ceil(tokens.size / CHUNK_BYTES))
  bounds = np.linspace(0, tokens.size, num_chunks + 1).astype(np.int64)
  held = np.zeros(num_chunks, bool)
  held[np.random.default_rng(split_seed).permutation(num_chunks)[:max(1, round(eval_fraction * num_chunks))]] = True
  pick = lambda mask: np.concatenate([tokens[bounds[i]:bounds[i + 1]] for i in np.flatnonzero(mask)])  # noqa: E731
  return pick(~held), pick(held)


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  return stream[starts[:, None] + np.arange(length)].astype(np.int32)


def train_batch(corpus: TextCorpus, step: int, *, batch_size: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
  """The training batch of global step ``step``: B random windows of the train stream.

  Window starts are drawn from ``numpy.random.default_rng((seed, step))``, so a resumed run sees exactly the batches
  an uninterrupted one would.

  Returns:
    ``{"tokens": [B, T+1] int32}``.
  """
  starts = np.random.default_rng((seed, step)).integers(0, corpus.train.size - seq_len, size=batch_size)
  return {"tokens": _windows(corpus.train, starts, seq_len + 1)}


def eval_batches(corpus: TextCorpus, *, batch_size: int, seq_len: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  """Fixed evaluation batches: ``num_batches · B`` windows evenly spaced over the eval stream (they may overlap
  when the stream is short).

  Returns:
    A list of ``{"tokens": [B, T+1] int32}``.
  """
  count = num_batches * batch_size
  starts = np.linspace(0, corpus.eval.size - seq_len - 1, count).astype(np.int64)
  windows = _windows(corpus.eval, starts, seq_len + 1)
  return [{"tokens": windows[i * batch_size:(i + 1) * batch_size]} for i in range(num_batches)]
