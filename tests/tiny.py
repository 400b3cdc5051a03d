"""Pieces of the tiny presets that several test files share, and the references conftest.py's session fixtures
build from them once per run (once per pytest-xdist worker): a file that compares remat against a no-remat
reference of a tiny preset asks for the fixture instead of computing the same reference again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxckpt
from jaxckpt.models.llm import LLM_PRESETS, build_llm, llm_loss

LLM_GRAD_SEQ = 32
"""Tokens per sequence of the LLM gradient comparisons: longer than gemma2-tiny's 16-token window, so its local
layers mask."""


def llm_batch(batch: int = 2, seq: int = LLM_GRAD_SEQ, vocab: int = 256, seed: int = 0) -> dict:
  """``{"tokens": int32 [batch, seq + 1]}``, uniform over ``vocab``, fixed by ``seed``."""
  return {"tokens": jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)), jnp.int32)}


def llm_loss_and_grads(model, batch: dict):
  """``(loss, grads)`` of the LLM's loss w.r.t. its parameters, jitted with jaxckpt's compiler options."""
  graphdef, params, other = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return llm_loss(nnx.merge(graphdef, params, other), batch)[0]

  return jaxckpt.jit(jax.value_and_grad(loss))(params)


def llm_reference(preset: str):
  """``(model, (loss, grads), layers)``: the preset at :data:`LLM_GRAD_SEQ` tokens built with policy ``none``, and
  its loss and gradients on :func:`llm_batch`'s default batch."""
  config = dataclasses.replace(LLM_PRESETS[preset], seq_len=LLM_GRAD_SEQ)
  model = build_llm(config, policy="none")
  return model, llm_loss_and_grads(model, llm_batch()), config.num_layers
