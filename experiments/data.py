"""Image data for the classifier: scikit-learn's handwritten digits, or the user's own ``.npz`` file.

No downloads: the digits (1,797 8×8 grey images, 10 classes) ship inside scikit-learn. Batching is a pure function
of (seed, step), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile

import numpy as np
from sklearn.model_selection import train_test_split

from jaxckpt.errors import DataError

__all__ = ["ImageDataset", "load_digits", "load_npz", "load_dataset", "train_batch", "eval_batches"]


@dataclasses.dataclass(frozen=True)
class ImageDataset:
  """A train/test split of images, standardised with the train set's per-channel mean and std.

  Attributes:
    x_train: ``[N, H, W, C]`` float32.
    y_train: ``[N]`` int32 in ``0..num_classes-1``.
    x_test: ``[M, H, W, C]`` float32.
    y_test: ``[M]`` int32.
    num_classes: K.
    source: where the data came from (for metrics.json).
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  source: str

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """``(H, W, C)``."""
    return tuple(self.x_train.shape[1:])


def _split_and_standardise(x: np.ndarray, y: np.ndarray, num_classes: int, source: str, *, split_seed: int,
                           test_fraction: float) -> ImageDataset:
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=test_fraction, random_state=split_seed, stratify=y if np.unique(y, return_counts=True)[1].min() >= 2 else None
  )
  mean = x_train.mean(axis=(0, 1, 2), keepdims=True)
  std = x_train.std(axis=(0, 1, 2), keepdims=True) + 1e-6
  standardise = lambda a: ((a - mean) / std).astype(np.float32)  # noqa: E731
  return ImageDataset(standardise(x_train), y_train.astype(np.int32), standardise(x_test), y_test.astype(np.int32),
                      num_classes, source)


def load_digits(*, split_seed: int = 0, test_fraction: float = 0.2) -> ImageDataset:
  """scikit-learn's handwritten digits as ``[N, 8, 8, 1]`` images, split stratified by ``split_seed``.

  Args:
    split_seed: seed of the fixed train/test split.
    test_fraction: share of examples held out for test, in (0, 1).
  """
  from sklearn.datasets import load_digits as sklearn_digits

  digits = sklearn_digits()
  x = digits.images.astype(np.float32)[..., None]  # [1797, 8, 8, 1], values 0..16
  return _split_and_standardise(x, digits.target.astype(np.int64), 10, "sklearn.datasets.load_digits",
                                split_seed=split_seed, test_fraction=test_fraction)


def load_npz(path: str, *, split_seed: int = 0, test_fraction: float = 0.2,
             num_classes: int | None = None) -> ImageDataset:
  """Loads the user's images from an ``.npz`` file with arrays ``x`` and ``y``.

  ``x``: float (or integer) ``[N, H, W]`` or ``[N, H, W, C]``; ``y``: integer ``[N]`` with values in ``0..K-1``.
  K is ``num_classes`` when given (classes without examples are then allowed), else inferred as ``max(y) + 1``, and
  then every class ``0..K-1`` must have an example: labels 100..109 would otherwise train a 110-way head with 100
  classes no example can teach. The file is split into train/test like the digits.

  Args:
    path: the ``.npz`` file.
    split_seed: seed of the fixed train/test split.
    test_fraction: share of examples held out for test, in (0, 1).
    num_classes: the class count K (``--num-classes``), ≥ 2; ``None`` infers it.

  Raises:
    DataError: the file is missing, unreadable or empty, lacks ``x`` or ``y``, has wrong ranks, dtypes or lengths,
      non-finite pixels, negative labels, labels ≥ ``num_classes``, fewer than 2 classes, inferred classes without
      an example (naming them), or too few examples to split.
  """
  if os.path.isdir(path):
    raise DataError(f"--data {path} is a directory; give an .npz file")
  if not os.path.isfile(path):
    raise DataError(f"--data {path}: no such file")
  try:
    loaded = np.load(path, allow_pickle=False)
  except ValueError as err:  # pickled objects (or not numpy at all): never unpickled
    raise DataError(f"--data {path}: not a readable .npz file of plain arrays (jaxckpt never loads pickled data); "
                    "write it with numpy.savez(path, x=..., y=...)") from err
  except (OSError, zipfile.BadZipFile, EOFError) as err:
    raise DataError(f"--data {path}: not a readable .npz file ({err})") from err
  if not isinstance(loaded, np.lib.npyio.NpzFile):
    raise DataError(f"--data {path}: a single .npy array, not an .npz archive; write it with "
                    "numpy.savez(path, x=..., y=...)")
  try:
    with loaded as npz:
      arrays = {k: npz[k] for k in npz.files}
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
    raise DataError(f"--data {path}: not a readable .npz file ({err})") from err
  missing = [k for k in ("x", "y") if k not in arrays]
  if missing:
    raise DataError(f"--data {path}: missing array(s) {', '.join(missing)}; found {sorted(arrays) or 'none'} "
                    "(need x: [N,H,W] or [N,H,W,C] float, y: [N] int)")
  x, y = arrays["x"], arrays["y"]
  if x.ndim == 3:
    x = x[..., None]
  if x.ndim != 4:
    raise DataError(f"--data {path}: x has shape {x.shape}; need [N,H,W] or [N,H,W,C]")
  if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
    raise DataError(f"--data {path}: x has dtype {x.dtype}; need a float (or integer) dtype")
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise DataError(f"--data {path}: y has shape {y.shape} and dtype {y.dtype}; need [N] integers")
  if x.shape[0] != y.shape[0]:
    raise DataError(f"--data {path}: x has {x.shape[0]} examples but y has {y.shape[0]}")
  if x.shape[0] == 0:
    raise DataError(f"--data {path}: the file holds no examples")
  if min(x.shape[1:]) == 0:
    raise DataError(f"--data {path}: x has an empty dimension, shape {x.shape}")
  x = x.astype(np.float32)
  if not np.isfinite(x).all():
    raise DataError(f"--data {path}: x holds NaN or Inf values")
  if y.min() < 0:
    raise DataError(f"--data {path}: labels must be in 0..K-1, found {int(y.min())}")
  if num_classes is not None:
    if y.max() >= num_classes:
      raise DataError(f"--data {path}: labels must be in 0..{num_classes - 1} (--num-classes {num_classes}), found "
                      f"{int(y.max())}")
  else:
    num_classes = int(y.max()) + 1
    if num_classes < 2:
      raise DataError(f"--data {path}: labels have {num_classes} class; need at least 2")
    if num_classes > len(y):
      raise DataError(f"--data {path}: labels go up to {num_classes - 1} but there are only {len(y)} examples "
                      "(K is inferred as max(y) + 1); renumber the labels 0..K-1")
    empty = np.flatnonzero(np.bincount(y, minlength=num_classes) == 0)
    if empty.size:
      raise DataError(f"--data {path}: labels {_ranges(np.unique(y))} leave {empty.size} of the {num_classes} "
                      f"inferred classes (K = max(y) + 1) without an example: {_ranges(empty)}; renumber the labels "
                      "0..K-1, or pass --num-classes K to keep empty classes")
  if round(x.shape[0] * test_fraction) < 1 or x.shape[0] - round(x.shape[0] * test_fraction) < 1:
    raise DataError(f"--data {path}: {x.shape[0]} example(s) are too few to split into train and test")
  try:
    return _split_and_standardise(x, y.astype(np.int64), num_classes, os.path.abspath(path),
                                  split_seed=split_seed, test_fraction=test_fraction)
  except ValueError as err:  # e.g. a stratified split with a class too small for the test share
    raise DataError(f"--data {path}: cannot split into train/test ({err})") from err


def _ranges(values: np.ndarray, limit: int = 8) -> str:
  """``0..99, 105, 107`` for sorted integers (runs joined), at most ``limit`` pieces."""
  pieces, start = [], None
  for i, v in enumerate(values):
    if start is None:
      start = v
    if i + 1 == len(values) or values[i + 1] != v + 1:
      pieces.append(f"{start}" if start == v else f"{start}..{v}")
      start = None
  return ", ".join(pieces[:limit]) + (f", … ({len(pieces) - limit} more)" if len(pieces) > limit else "")


def load_dataset(path: str | None, *, split_seed: int = 0, num_classes: int | None = None) -> ImageDataset:
  """The digits when ``path`` is ``None``, else :func:`load_npz` of ``path``.

  Raises:
    DataError: ``num_classes`` with the digits other than 10, or a bad ``--data`` file (:func:`load_npz`).
  """
  if path is None:
    if num_classes not in (None, 10):
      raise DataError(f"--num-classes {num_classes} does not fit the digits (10 classes); it is for --data files")
    return load_digits(split_seed=split_seed)
  return load_npz(path, split_seed=split_seed, num_classes=num_classes)


def train_batch(data: ImageDataset, step: int, *, batch_size: int, seed: int) -> dict[str, np.ndarray]:
  """The training batch of global step ``step``: epoch ``step // steps_per_epoch`` of a per-epoch permutation.

  The permutation of epoch e is drawn from ``numpy.random.default_rng((seed, e))``; the last partial batch of each
  epoch is dropped so every batch has the compiled shape.

  Returns:
    ``{"x": [B, H, W, C] float32, "y": [B] int32}``.
  """
  steps_per_epoch = len(data.y_train) // batch_size
  epoch, index = divmod(step, steps_per_epoch)
  order = np.random.default_rng((seed, epoch)).permutation(len(data.y_train))
  take = order[index * batch_size:(index + 1) * batch_size]
  return {"x": data.x_train[take], "y": data.y_train[take]}


def eval_batches(x: np.ndarray, y: np.ndarray, *, batch_size: int):
  """Yields fixed-size batches over all of ``x``/``y``, the last padded with ``mask`` False (no recompile).

  Yields:
    ``{"x": [B, H, W, C] float32, "y": [B] int32, "mask": [B] bool}``.
  """
  for start in range(0, len(y), batch_size):
    xb, yb = x[start:start + batch_size], y[start:start + batch_size]
    pad = batch_size - len(yb)
    mask = np.arange(batch_size) < len(yb)
    if pad:
      xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
      yb = np.concatenate([yb, np.zeros((pad,), yb.dtype)])
    yield {"x": xb, "y": yb, "mask": mask}
