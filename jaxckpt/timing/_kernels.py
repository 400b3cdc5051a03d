"""FLOPs of custom-call kernels that carry no cost estimate, by a table of known kernels.

A Pallas kernel written with ``pl.CostEstimate`` carries its FLOPs in its custom call's backend config (the rule in
:mod:`._ops` reads it). JAX's splash attention kernel (``jax.experimental.pallas.ops.tpu.splash_attention``, the
kernel MaxText and jaxckpt's LLM family run on TPU) passes none, and the compiled program says only its operands
and its block sizes (the ``kernel_metadata`` the TPU compiler prints with it). Its FLOPs follow from them:

| kernel (its custom call's name) | matmuls per (query, key) block pair | blocks |
|---|---|---|
| ``splash_mha_fwd…`` | 2: QKᵀ, PV | ``block_q`` × ``block_kv`` |
| ``splash_mha_dkv…`` | 4: QKᵀ again, dV = Pᵀ dO, dP = dO Vᵀ, dK = dSᵀ Q | ``block_q_dkv`` × ``block_kv_dkv`` |
| ``splash_mha_dq…`` | 3: QKᵀ again, dP = dO Vᵀ, dQ = dS K | ``block_q_dq`` × ``block_kv_dq`` |
| ``splash_mha_dkv…`` with ``use_fused_bwd_kernel`` (dQ in the dKV kernel: a result ending in the query's shape) | 5 | ``block_q_dkv`` × ``block_kv_dkv`` |

each matmul 2 × heads × block_q × block_kv × head_dim FLOPs per block pair (heads: the query's leading dimension,
the batch folded in under ``vmap``), over the block pairs a causal mask leaves (splash skips a block wholly above
the diagonal and computes a block the diagonal crosses in full). The mask is taken causal, as every decoder's is.
Each matmul has the head dimension as one of its sides (QKᵀ contracts over it, PV produces it), so on a chip whose
matrix unit is wider than the head dimension (v6e's 256 against a head of 128) it fills part of the unit: the
kernel's matmuls are derated by their shape as any matmul without a cycle estimate (:mod:`._ops`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from jaxckpt.analysis.hlo import HloInstruction, HloModule

KERNEL_MATMULS: dict[str, tuple[tuple[tuple[str, str, str], ...], str, str]] = {
    "splash_mha_fwd": ((("q", "kv", "d"), ("q", "d", "kv")), "block_q", "block_kv"),
    "splash_mha_dkv": ((("q", "kv", "d"), ("kv", "d", "q"), ("q", "kv", "d"), ("kv", "d", "q")),
                       "block_q_dkv", "block_kv_dkv"),
    "splash_mha_dq": ((("q", "kv", "d"), ("q", "kv", "d"), ("q", "d", "kv")), "block_q_dq", "block_kv_dq"),
}
"""Kernel name prefix -> (its matmuls per block pair as (M, N, K) over the query block ``q``, the key block ``kv`` and
the head dimension ``d``; its query block key; its key block key) (module docstring); the fused backward adds dQ =
dS K, ``("q", "d", "kv")``, to the dK/dV kernel."""

_FUSED_DQ = ("q", "d", "kv")

_METADATA = re.compile(r'"xprof_metadata":"((?:[^"\\]|\\.)*)"')


def causal_block_fraction(seq_q: int, seq_kv: int, block_q: int, block_kv: int) -> float:
  """The fraction of (query block, key block) pairs a causal mask leaves a blocked kernel to compute: those with a
  key at or before some query of the block (the diagonal's blocks in full)."""
  nq, nkv = -(-seq_q // block_q), -(-seq_kv // block_kv)
  offset = seq_kv - seq_q  # queries sit at the end of the keys
  kept = sum(min(nkv, -(-(min(seq_q, (i + 1) * block_q) + offset) // block_kv)) for i in range(nq))
  return kept / (nq * nkv)


def _metadata(ins: HloInstruction) -> Mapping[str, object]:
  m = _METADATA.search(ins.attributes.get("frontend_attributes", ""))
  if not m:
    return {}
  try:
    return json.loads(json.loads(f'"{m.group(1)}"'))
  except ValueError:
    return {}


def kernel_matmuls(module: HloModule, *, causal: bool = True) -> dict[str, list[tuple[float, tuple[int, int, int]]]]:
  """The matmuls of each known kernel of ``module`` without a cost estimate (module docstring), by custom-call
  instruction name: ``[(FLOPs per run, (M, N, K) of one block pair's matmul)]``, for the shape efficiency of each
  (:func:`jaxckpt.timing.matmul_efficiency`: a head dimension of 128 fills half of v6e's 256-wide matrix unit).

  Args:
    module: the program.
    causal: the attention mask is causal (else every block pair is computed).
  """
  out: dict[str, list[tuple[float, tuple[int, int, int]]]] = {}
  for comp in module.computations.values():
    for ins in comp.instructions:
      if ins.opcode != "custom-call" or ins.custom_call_target != "tpu_custom_call":
        continue
      kind = next((k for k in KERNEL_MATMULS if ins.name.startswith(k) or (ins.op_name or "").find(k) >= 0), None)
      if kind is None:
        continue
      arrays = [comp.by_name[o].arrays[0] for o in ins.operands if o in comp.by_name and comp.by_name[o].arrays]
      three = [a for a in arrays if len(a.dims) == 3 and a.dtype in ("bf16", "f32", "f16")]
      if len(three) < 2:
        continue
      q, k = three[0], three[1]
      heads, seq_q, head_dim = q.dims
      seq_kv = k.dims[1]
      meta = _metadata(ins)
      shapes, q_key, kv_key = KERNEL_MATMULS[kind]
      fused = meta.get("use_fused_bwd_kernel") or any(a.dims[-3:] == q.dims for a in ins.arrays)
      if kind == "splash_mha_dkv" and fused:  # the fused backward: dQ in the dK/dV kernel (a query-shaped result)
        shapes = (*shapes, _FUSED_DQ)
      block_q = min(seq_q, int(meta.get(q_key) or seq_q))
      block_kv = min(seq_kv, int(meta.get(kv_key) or seq_kv))
      fraction = causal_block_fraction(seq_q, seq_kv, block_q, block_kv) if causal else 1.0
      size = {"q": block_q, "kv": block_kv, "d": head_dim}
      flops = 2.0 * heads * seq_q * seq_kv * head_dim * fraction
      out[ins.name] = [(flops, tuple(size[x] for x in shape)) for shape in shapes]
  return out


def kernel_flops(module: HloModule, *, causal: bool = True) -> dict[str, float]:
  """FLOPs per run of each known kernel of ``module`` without a cost estimate (:func:`kernel_matmuls` summed), by
  custom-call instruction name; empty where there are none."""
  return {name: sum(f for f, _ in matmuls) for name, matmuls in kernel_matmuls(module, causal=causal).items()}
