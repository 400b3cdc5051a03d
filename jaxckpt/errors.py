"""The error types jaxckpt raises for bad user input.

Every error names the bad value, lists the valid choices and, where one is close, suggests it. All derive from
:class:`JaxckptError` (a :class:`ValueError`), so CLIs catch that one type, print its one-line message and exit with
status 2.
"""

from __future__ import annotations

import difflib
import os
import sysconfig
import traceback
from collections.abc import Iterable

__all__ = [
    "raised_at",
    "TracingError",
    "JaxckptError", "PolicySpecError", "DataError", "CheckpointError", "DirectoryInUseError", "NonFiniteLossError",
    "MeshSpecError", "LogicalAxisError", "TensorPlanError", "TopologyError", "StaticArgumentError", "EnvSettingError",
    "OutputWriteError",
    "closest", "shorten",
]


def closest(bad: str, valid: Iterable[str]) -> str | None:
  """Returns the valid choice closest to ``bad`` (``difflib`` ratio ≥ 0.6), or ``None``."""
  matches = difflib.get_close_matches(bad, list(valid), n=1, cutoff=0.6)
  return matches[0] if matches else None


def shorten(text: str, limit: int = 80) -> str:
  """``text`` cut to ``limit`` characters with ``...``, so a huge bad value cannot flood an error line."""
  return text if len(text) <= limit else text[: limit - 3] + "..."


_LIBRARY_DIRS = tuple(os.path.normpath(p) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    os.path.dirname(os.path.abspath(__file__))})
"""Where library frames live: the standard library, site-packages (jax, flax…) and jaxckpt itself."""

_HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_CODE = (os.path.join(_HERE, "models") + os.sep, os.path.join(_HERE, "core", "_blocks.py"))
"""jaxckpt's shipped models (``--model``) and the block math they are built of (attention, MLP, convolution):
library code for an error in your model, a model's own code for a residual's source line (:func:`is_library_file`).
The layer stacks and wrappers around them (``Stack``, ``RematBlock``) are machinery."""


def is_library_file(filename: str, *, model_code: bool = True) -> bool:
  """Whether a frame's file is a library's: the standard library, site-packages (jax, flax, optax…), jaxckpt, or no
  file (``<frozen ...>``, ``<string>``); ``model_code=False`` counts jaxckpt's shipped models and their layers
  (:data:`MODEL_CODE`) as a model's own code."""
  if filename.startswith("<"):
    return True
  path = os.path.normpath(filename)
  if not model_code and (path.startswith(MODEL_CODE[0]) or path in MODEL_CODE[1:]):
    return False
  return path.startswith(_LIBRARY_DIRS)


def raised_at(err: BaseException) -> str:
  """``"ValueError: my block cannot take width 16 (model.py:10)"``: an exception as one line, its type, the first line
  of its message and where it was raised in *your* code: the innermost frame outside the standard library,
  site-packages and jaxckpt (the innermost frame when every frame is a library's). A ``SyntaxError`` points at its
  own line. What the tools print for an error in a user's model while it is traced (JAX's traceback filtering
  drops its own frames; this drops jaxckpt's and Flax's too).

  Args:
    err: the exception, with its traceback.
  """
  if isinstance(err, SyntaxError) and err.filename:
    return f"{type(err).__name__}: {err.msg} ({os.path.basename(err.filename)}:{err.lineno})"
  frames = traceback.extract_tb(err.__traceback__)
  own = [f for f in frames if not is_library_file(f.filename)]
  frame = own[-1] if own else frames[-1] if frames else None
  where = f" ({os.path.basename(frame.filename)}:{frame.lineno})" if frame is not None else ""
  message = str(err).strip().splitlines()[0] if str(err).strip() else ""
  return f"{type(err).__name__}{': ' + message if message else ''}{where}"


def _plural(word: str) -> str:
  return word[:-1] + "ies" if word.endswith("y") else word + "s"


def _choices_message(what: str, bad: str, valid: Iterable[str], context: str = "") -> str:
  valid = sorted(set(valid))
  message = f"unknown {what} {shorten(bad)!r}{context}; valid {_plural(what)}: {', '.join(valid) if valid else '(none)'}"
  suggestion = closest(bad, valid)
  if suggestion is not None:
    message += f"; did you mean {suggestion!r}?"
  return message


class JaxckptError(ValueError):
  """Base class of jaxckpt's user-input errors; its message is one line, fit for a CLI."""


class PolicySpecError(JaxckptError):
  """A policy spec string (or its use on a model) is invalid.

  Attributes:
    spec: the whole spec string as given.
    bad: the offending part of it (a policy name, block type, checkpoint name or token).
    valid: the valid choices for that part (sorted), possibly empty.
    suggestion: the closest valid choice, or ``None``.
  """

  def __init__(self, message: str, *, spec: str, bad: str, valid: Iterable[str] = ()):
    self.spec = spec
    self.bad = bad
    self.valid = tuple(sorted(set(valid)))
    self.suggestion = closest(bad, self.valid)
    super().__init__(message)

  @classmethod
  def unknown(cls, what: str, bad: str, valid: Iterable[str], *, spec: str, context: str = "") -> "PolicySpecError":
    """Builds the 'unknown <what> <bad>; valid <what>s: ...; did you mean ...?' error."""
    valid = tuple(valid)
    return cls(
        _choices_message(what, bad, valid, f"{context} in policy spec {shorten(spec)!r}"), spec=spec, bad=bad,
        valid=valid
    )


class DataError(JaxckptError):
  """A data file is missing, empty, or has arrays of the wrong name, shape, dtype or range."""


class CheckpointError(JaxckptError):
  """A checkpoint directory cannot be used: foreign config, corrupt, or would overwrite an existing run."""


class OutputWriteError(JaxckptError):
  """An output file a tool was asked for could not be written (a full disk, a lost permission) after the work ran:
  the message names the file and the reason; the file's previous content, if any, is kept (outputs are written to a
  temporary file and renamed into place, :func:`jaxckpt._paths.write_atomically`). The CLIs exit 1 with it."""


class DirectoryInUseError(CheckpointError):
  """A run's ``--out`` or ``--ckpt-dir`` is held by another live run (:class:`jaxckpt.training._saving.DirectoryLock`)."""


class NonFiniteLossError(JaxckptError):
  """Training produced a NaN/Inf loss, gradient or updated parameter and the NaN policy is ``stop``.

  Attributes:
    step: the 0-based index of the step whose loss, gradients or updated parameters were not finite.
  """

  def __init__(self, message: str, *, step: int):
    self.step = step
    super().__init__(message)


class TracingError(JaxckptError):
  """Your model or loss raised while jaxckpt traced it (shapes only): the message names your file and line
  (:func:`raised_at`)."""


class MeshSpecError(JaxckptError):
  """A ``--mesh`` spec (``name=size[,name=size]``) or a multi-process setting is invalid: unknown axis name,
  malformed or non-positive size, repeated axis, a product of sizes that is not the device count, or a batch size
  the mesh cannot split."""


class LogicalAxisError(JaxckptError):
  """A logical axis name the rule table does not know (:data:`jaxckpt.sharding.LOGICAL_RULES`): on a parameter
  (``nnx.with_partitioning(init, ("exps", "embed"))``) or in ``constrain``: one line naming it, where it was found, the
  closest valid name and the valid ones."""


class TensorPlanError(JaxckptError):
  """A tensor plan (``tensor_plan=`` of :func:`jaxckpt.nnx_model_target`, :class:`jaxckpt.sharding.TensorPlan`) is
  invalid: a malformed entry, an unknown style, a pattern that matches no layer of the model (the message lists some
  of its layers), a layer given two styles, a parameter whose shape no style splits or whose axes are named already,
  or an automatic plan that finds no attention/MLP pair in a block."""


class TopologyError(JaxckptError):
  """A TPU topology to compile for (``--topology v5e:2x2``) cannot be used: a name that does not parse or that the TPU
  compiler refuses, the ``libtpu`` package missing or of a release that does not fit the installed jaxlib, or a tool
  asked to run on it (``--measure``) although nothing here can. One line naming the bad value and the valid ones (or
  what to install)."""


class EnvSettingError(JaxckptError):
  """An environment variable jaxckpt or JAX reads holds a value it cannot use (``JAX_REMAT3=maybe``).

  Raised by ``import jaxckpt`` (:func:`jaxckpt._remat_impl.check_env`, before JAX is imported and would raise its own
  ``ValueError`` traceback). The message names the variable, the bad value and the valid ones; the CLIs print it as
  one line and exit 2 (:func:`jaxckpt._cli.run_main`).
  """


class StaticArgumentError(JaxckptError):
  """A static argument of a remat'd function is declared or passed the wrong way.

  Raised by :func:`jaxckpt.checkpoint` when ``static_argnums``/``static_argnames`` are malformed or name no parameter
  of the function, or when a call passes a static argument by keyword although it is declared by position (or the
  reverse), or passes a traced value where a static Python value is needed. The message names the argument and the
  fix.

  Attributes:
    argument: the parameter's name (or ``"#i"`` for a position without a name), or ``None``.
  """

  def __init__(self, message: str, *, argument: str | None = None):
    self.argument = argument
    super().__init__(message)
