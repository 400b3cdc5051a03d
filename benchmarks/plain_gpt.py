"""A plain-JAX twin of jaxckpt's GPT train step, written by hand: the floor the report's compile time is held to.

Same shapes as :data:`jaxckpt.models._gpt.GPT_PRESETS` (pre-LN decoder, tied embeddings, learned positions, dropout on the
attention weights and on each sublayer's output, tanh-GELU MLP), layers stacked on a leading axis and run with
``jax.lax.scan``; each sublayer under ``jax.checkpoint`` with a ``jax.checkpoint_policies`` policy (none: no
checkpoint), the same checkpoint names as :mod:`jaxckpt.names`; one ``optax.adamw(1e-3)`` update. No jaxckpt code:
this is what a user would write to get the same program (benchmarks/report_speed.py compares the two).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.models import GPT_PRESETS, GPTConfig

__all__ = ["policy_of", "abstract_inputs", "train_step", "lower_and_compile", "timed_compile"]

NAMES = ("qkv", "attn_weights", "attn_context", "attn_out", "mlp_hidden", "mlp_out")
CPU_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander", "xla_backend_optimization_level": 0}
"""The options the report compiles with on CPU (the remat fix and the stats-only optimisation level)."""


def policy_of(text: str) -> Any:
  """A ``jax.checkpoint_policies`` policy for a report policy string (``none`` -> ``None``: no checkpoint).

  Args:
    text: ``none``, a plain policy name, or ``save_only_these_names:a+b``.

  Raises:
    ValueError: a policy this twin does not write by hand.
  """
  cp = jax.checkpoint_policies
  if text == "none":
    return None
  name, _, args = text.partition(":")
  if name == "save_only_these_names":
    return cp.save_only_these_names(*args.split("+"))
  if name in ("nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    return getattr(cp, name)
  raise ValueError(f"the twins have no policy {text!r}; valid: {', '.join(TWIN_POLICIES)}")


TWIN_POLICIES = ("none", "nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                 "save_only_these_names:NAME[+NAME…]")
"""The policies the twins write by hand (whole-model policies; no per-block maps)."""


def twin_args(prog: str, argv: list[str]) -> tuple[GPTConfig, list[str]]:
  """``PRESET POLICY…`` of a twin's command line: ``(config, policies)``.

  Raises:
    SystemExit: (status 2, one line on stderr) no preset, an unknown preset or a policy the twins do not write.
  """
  def fail(message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)

  if not argv or argv[0] not in GPT_PRESETS:
    fail(f"usage: {prog} PRESET POLICY…; PRESET {argv[0]!r} is not one of {', '.join(GPT_PRESETS)}" if argv else
         f"usage: {prog} PRESET POLICY… (PRESET: {', '.join(GPT_PRESETS)})")
  for text in argv[1:]:
    try:
      policy_of(text)
    except ValueError as err:
      fail(str(err))
  return GPT_PRESETS[argv[0]], list(argv[1:])


def abstract_inputs(config: GPTConfig) -> tuple[dict[str, Any], dict[str, Any], Any]:
  """``(params, batch, opt_state)`` as ``jax.ShapeDtypeStruct`` s: params float32, ``tokens: [B, T+1] int32``."""
  d, f, n, v, t = config.dim, config.mlp_dim, config.num_layers, config.vocab_size, config.seq_len
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  layer = {"ln1_scale": s(n, d), "ln1_bias": s(n, d), "qkv_w": s(n, d, 3 * d), "qkv_b": s(n, 3 * d),
           "out_w": s(n, d, d), "out_b": s(n, d), "ln2_scale": s(n, d), "ln2_bias": s(n, d),
           "fc1_w": s(n, d, f), "fc1_b": s(n, f), "fc2_w": s(n, f, d), "fc2_b": s(n, d)}
  params = {"embed": s(v, d), "pos": s(t, d), "layers": layer, "norm_scale": s(d), "norm_bias": s(d)}
  batch = {"tokens": jax.ShapeDtypeStruct((config.batch_size, t + 1), jnp.int32)}
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
  return params, batch, opt_state


def _ln(x, scale, bias):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def _dropout(key, rate, x):
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def train_step(config: GPTConfig, policy: Any):
  """``step(params, opt_state, batch, key) -> (params, opt_state, loss)`` under ``policy`` (``None`` = no remat)."""
  heads, rate, tx = config.num_heads, config.dropout_rate, optax.adamw(1e-3)

  def attn(p, h, key):
    b, t, d = h.shape
    x = _ln(h, p["ln1_scale"], p["ln1_bias"])
    qkv = checkpoint_name(x @ p["qkv_w"] + p["qkv_b"], "qkv")  # [B, T, 3d]
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
    k1, k2 = jax.random.split(key)
    weights = checkpoint_name(_dropout(k1, rate, jax.nn.softmax(logits, axis=-1)), "attn_weights")
    context = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d), "attn_context")
    out = checkpoint_name(context @ p["out_w"] + p["out_b"], "attn_out")
    return h + _dropout(k2, rate, out)

  def mlp(p, h, key):
    x = _ln(h, p["ln2_scale"], p["ln2_bias"])
    hidden = checkpoint_name(jax.nn.gelu(x @ p["fc1_w"] + p["fc1_b"], approximate=True), "mlp_hidden")
    out = checkpoint_name(hidden @ p["fc2_w"] + p["fc2_b"], "mlp_out")
    return h + _dropout(key, rate, out)

  if policy is not None:
    attn, mlp = jax.checkpoint(attn, policy=policy), jax.checkpoint(mlp, policy=policy)

  def loss_fn(params, tokens, key):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t = inputs.shape[1]
    h = params["embed"][inputs] + params["pos"][:t]  # [B, T, d]

    def layer(h, xs):
      p, k = xs
      ka, km = jax.random.split(k)
      return mlp(p, attn(p, h, ka), km), None

    keys = jax.random.split(key, config.num_layers)
    h, _ = jax.lax.scan(layer, h, (params["layers"], keys))
    logits = _ln(h, params["norm_scale"], params["norm_bias"]) @ params["embed"].T  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["tokens"], key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def lower_and_compile(config: GPTConfig, policy_text: str, *, options: dict[str, Any] | None = None
                      ) -> dict[str, float | int]:
  """Traces, lowers and compiles the twin's step under one policy (nothing is allocated).

  Returns:
    ``{"trace_s", "lower_s", "compile_s", "total_s"}`` (wall seconds), ``"cpu_s"`` (CPU seconds of this process
    over the three, XLA's threads included) and ``"temp_bytes"`` (int bytes).
  """
  params, batch, opt_state = abstract_inputs(config)
  key = jax.eval_shape(lambda: jax.random.key(0))
  started = time.perf_counter(), time.process_time()
  return timed_compile(train_step(config, policy_of(policy_text)), (params, opt_state, batch, key),
                       options=options, started=started)


def timed_compile(step: Any, args: tuple[Any, ...], *, options: dict[str, Any] | None,
                  started: tuple[float, float]) -> dict[str, float | int]:
  """Traces, lowers and compiles ``step`` (arguments 0 and 1 donated) on abstract ``args``, timing each stage.

  Args:
    step: the twin's train step.
    args: its abstract arguments (``jax.ShapeDtypeStruct`` pytrees).
    options: XLA options; ``None``: :data:`CPU_OPTIONS` on CPU, none elsewhere.
    started: ``(time.perf_counter(), time.process_time())`` when the caller began (its own set-up counts as trace).

  Returns:
    ``{"trace_s", "lower_s", "compile_s", "total_s"}`` (wall seconds), ``"cpu_s"`` (CPU seconds since ``started``,
    XLA's threads included) and ``"temp_bytes"`` (int bytes).
  """
  options = CPU_OPTIONS if options is None and jax.default_backend() == "cpu" else (options or {})
  t0, cpu0 = started
  traced = jax.jit(step, donate_argnums=(0, 1)).trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile(compiler_options=options)
  t3 = time.perf_counter()
  return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t0,
          "cpu_s": time.process_time() - cpu0,
          "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}


def main(argv: list[str] | None = None) -> None:
  """``python -m benchmarks.plain_gpt PRESET POLICY…``: compiles the twin per policy in this fresh process and prints
  one JSON object: ``{"policies": {policy: lower_and_compile(...)}}``."""
  config, policies = twin_args("python -m benchmarks.plain_gpt", sys.argv[1:] if argv is None else argv)
  print(json.dumps({"policies": {p: lower_and_compile(config, p) for p in policies}}))


if __name__ == "__main__":
  main()
