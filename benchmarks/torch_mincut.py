"""External reference: PyTorch's AOTAutograd min-cut partitioner on jaxckpt's GPT ``small``, counted in jaxckpt's units.

Usage (a SEPARATE venv with torch; torch is no jaxckpt dependency and this script is run by no test or CI)::

    python3 -m venv /work/torchvenv && /work/torchvenv/bin/pip install torch numpy
    /work/torchvenv/bin/python benchmarks/torch_mincut.py [--budgets 1.0 0.6 0.3] [--out FILE.json]

It rebuilds GPT ``small`` exactly as jaxckpt ships it (6 pre-LN layers, d=256, 4 heads, F=1024, T=256, B=8, vocab
256, dropout 0.1 on the attention weights and on each sublayer's output, tanh-GELU, learned positions, tied
embeddings, mean cross-entropy) in PyTorch, compiles its train step with ``torch.compile`` through a backend that is
inductor's front half (AOTAutograd with inductor's decompositions and ``min_cut_rematerialization_partition(...,
compiler="inductor")``, the partitioner ``torch.compile`` uses) and keeps the forward and backward FX graphs the
partitioner emits, before any code generation, for each ``torch._functorch.config.activation_memory_budget``. The
no-remat reference is ``default_partition`` (save what the backward reads, recompute nothing).

Both graphs are then counted with ONE convention, jaxckpt's (:mod:`jaxckpt.analysis._flops`, XLA's ``HloCostAnalysis``):
matmuls ``2·M·N·K`` (a fused bias add 1 per output element), elementwise arithmetic, comparisons, selects and dtype
conversions 1 per output element, ``x**2`` 1 and ``x**3`` 2, reductions ``input − output`` elements, data movement 0,
transcendentals (``exp``, ``tanh``, ``rsqrt``, ...) 0 FLOPs (counted apart). Random numbers: generating bits costs 0 in
jaxckpt (``random_bits``); its uniform-from-bits arithmetic costs 7 per element (shift, or, bitcast, sub, mul, add,
max: measured with ``jaxckpt.count_flops(jax.random.bernoulli)``), so ``rand``/``rand_like`` count 7 here. Saved =
bytes of the tensors the backward graph takes from the forward graph, values that depend on parameters only
excluded (jaxckpt's ``activation_residual_bytes``). Writes ``benchmarks/results/torch_mincut.json``: per budget, saved
MiB, FLOPs ÷ no remat in this convention and counting matmuls only, and the saved tensors grouped by shape and dtype.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import math
import os
import platform
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

MIB = 2**20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RAND_FLOPS = 7
"""jaxckpt's FLOPs per element of a uniform float drawn from random bits (the bits themselves cost 0)."""

CONFIG = dict(num_layers=6, dim=256, num_heads=4, mlp_dim=1024, seq_len=256, vocab_size=256, batch_size=8,
              dropout_rate=0.1)


class Layer(nn.Module):
  """jaxckpt's ``TransformerBlock``: ``x + Drop(Wo·attn(LN x))`` then ``x + Drop(W2·gelu_tanh(W1·LN x))``."""

  def __init__(self, d, h, f, p):
    super().__init__()
    self.h, self.p = h, p
    self.ln1, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(f, d)

  def forward(self, x):
    b, t, d = x.shape
    k = d // self.h
    qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.h, k)
    q, kk, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, K]
    logits = torch.einsum("bthk,bshk->bhts", q, kk) / math.sqrt(k)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    logits = torch.where(mask, logits, float("-inf"))
    w = F.dropout(torch.softmax(logits, dim=-1), self.p, self.training)
    ctx = torch.einsum("bhts,bshk->bthk", w, v)
    x = x + F.dropout(self.out(ctx.reshape(b, t, d)), self.p, self.training)
    hidden = F.gelu(self.fc1(self.ln2(x)), approximate="tanh")
    return x + F.dropout(self.fc2(hidden), self.p, self.training)


class GPT(nn.Module):
  """jaxckpt's ``GPT`` (tied embeddings, learned positions, final LayerNorm)."""

  def __init__(self, c):
    super().__init__()
    self.embed = nn.Embedding(c["vocab_size"], c["dim"])
    self.pos = nn.Parameter(torch.randn(c["seq_len"], c["dim"]) * 0.02)
    self.layers = nn.ModuleList(Layer(c["dim"], c["num_heads"], c["mlp_dim"], c["dropout_rate"])
                                for _ in range(c["num_layers"]))
    self.norm = nn.LayerNorm(c["dim"])

  def forward(self, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h = self.embed(inputs) + self.pos[: inputs.shape[1]]
    for layer in self.layers:
      h = layer(h)
    logits = self.norm(h) @ self.embed.weight.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------------------
# FLOPs of an aten FX graph in jaxckpt's convention.

_ZERO = {"view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose", "select", "slice", "squeeze",
         "unsqueeze", "clone", "copy", "alias", "cat", "stack", "index", "gather", "embedding", "full", "full_like",
         "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "scalar_tensor", "iota", "arange",
         "detach", "lift_fresh_copy", "split", "split_with_sizes", "as_strided", "new_zeros", "new_empty", "new_ones",
         "fill", "constant_pad_nd", "slice_scatter", "select_scatter", "unbind", "view_as", "expand_as",
         "_reshape_alias", "squeeze_copy", "unsqueeze_copy", "permute_copy", "view_copy", "index_select",
         "philox_rand", "scatter", "inductor_seeds", "inductor_lookup_seed", "inductor_random", "seed"}
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "neg", "where", "lt", "le", "gt", "ge", "eq", "ne", "maximum",
                "minimum", "clamp", "clamp_min", "clamp_max", "abs", "sign", "logical_not", "logical_and",
                "logical_or", "bitwise_and", "bitwise_or", "bitwise_not", "_to_copy", "convert_element_type",
                "reciprocal", "masked_fill", "threshold_backward", "fmod", "remainder", "floor", "ceil", "round",
                "le_", "square", "copy_"}
_TRANSCENDENTAL = {"exp", "log", "tanh", "rsqrt", "sqrt", "erf", "sin", "cos", "log1p", "expm1", "exp2", "log2"}
_REDUCE = {"sum", "amax", "amin", "max", "min", "prod", "any", "all", "argmax", "argmin"}


def _numel(val) -> int:
  return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def _out_numel(node) -> int:
  val = node.meta.get("val")
  if isinstance(val, (tuple, list)):
    return sum(_numel(v) for v in val)
  return _numel(val)


def _arg_numel(node, i=0) -> int:
  a = node.args[i]
  return _numel(a.meta.get("val")) if isinstance(a, torch.fx.Node) else 0


def node_flops(node) -> tuple[int, int, int, str | None]:
  """(FLOPs, matmul FLOPs, transcendentals, unknown op name or None) of one ``call_function`` node."""
  name = node.target.__name__.split(".")[0] if hasattr(node.target, "__name__") else str(node.target)
  name = name.lstrip("_") if name not in ("_to_copy", "_unsafe_view", "_reshape_alias") else name
  out = _out_numel(node)
  shape = lambda i: tuple(node.args[i].meta["val"].shape)  # noqa: E731
  if name in ("mm", "bmm", "addmm", "baddbmm", "matmul"):
    a, b = (shape(1), shape(2)) if name in ("addmm", "baddbmm") else (shape(0), shape(1))
    k = a[-1]
    mat = 2 * out * k
    return mat + (out if name in ("addmm", "baddbmm") else 0), mat, 0, None
  if name in ("getitem",) or name in _ZERO:
    return 0, 0, 0, None
  if name in _ELEMENTWISE:
    return out, 0, 0, None
  if name in _TRANSCENDENTAL:
    return 0, 0, out, None
  if name == "sigmoid":
    return 3 * out, 0, out, None
  if name == "pow":
    exp = node.args[1]
    if isinstance(exp, (int, float)) and float(exp).is_integer():
      n = abs(int(exp))
      muls = (n.bit_length() - 1) + (bin(n).count("1") - 1) if n else 0
      return (muls + (1 if exp < 0 else 0)) * out, 0, 0, None
    return 0, 0, out, None
  if name in _REDUCE:
    steps = max(_arg_numel(node) - out, 0)
    return (9 if name.startswith("arg") else 1) * steps, 0, 0, None
  if name == "mean":
    return max(_arg_numel(node) - out, 0) + out, 0, 0, None
  if name in ("var_mean", "var"):  # mean; then sub, square, sum, divide
    n = _arg_numel(node)
    o = _numel(node.meta["val"][0]) if isinstance(node.meta["val"], (tuple, list)) else out
    return (n - o + o) + (n + n + (n - o) + o), 0, 0, None
  if name in ("rand", "rand_like", "randn", "randn_like", "bernoulli", "native_dropout"):
    return RAND_FLOPS * out, 0, 0, None
  if name == "fma":  # a * b + c
    return 2 * out, 0, 0, None
  if name in ("embedding_dense_backward", "index_put", "scatter_add", "index_add",
              "unsafe_masked_index_put_accumulate"):
    return _arg_numel(node, len(node.args) - 1), 0, 0, None  # one add per update element (the last argument)
  return 0, 0, 0, name


def graph_flops(gm) -> dict:
  """FLOPs, matmul FLOPs, transcendentals and unknown ops of an FX graph."""
  total = matmul = trans = 0
  unknown = collections.Counter()
  for node in gm.graph.nodes:
    if node.op != "call_function":
      continue
    f, m, t, bad = node_flops(node)
    total, matmul, trans = total + f, matmul + m, trans + t
    if bad:
      unknown[bad] += 1
  return {"flops": total, "matmul_flops": matmul, "transcendentals": trans, "unknown_ops": dict(unknown)}


def _bytes(val) -> int:
  return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def saved_tensors(fw, bw) -> list[dict]:
  """Tensors the backward graph reads from the forward graph, with bytes and whether they depend on parameters
  only (or on constants only). The parameters are the floating-point inputs (the only other input is the int64
  tokens)."""
  placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
  param_only = {n.name for n in placeholders
                if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()}
  for node in fw.graph.nodes:
    if node.op == "call_function":
      inputs = [a for a in node.all_input_nodes]
      if all(a.name in param_only for a in inputs):  # parameters only, or constants only (no inputs)
        param_only.add(node.name)
  out = []
  for node in bw.graph.nodes:
    if node.op != "placeholder" or node.name.startswith("tangents"):
      continue
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
      continue
    out.append({"name": node.name, "shape": list(val.shape), "dtype": str(val.dtype).replace("torch.", ""),
                "bytes": _bytes(val), "parameter_only": node.name in param_only})
  return out


def capture(model, tokens, partition) -> tuple:
  """(forward graph, backward graph) of the train step under ``partition``."""
  from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415
  from torch._functorch.aot_autograd import make_boxed_func  # noqa: PLC0415
  from torch._inductor.decomposition import select_decomp_table  # noqa: PLC0415

  got = {}

  def compiler(kind):
    def run(gm, example_inputs):
      got[kind] = gm
      return make_boxed_func(gm.forward)
    return run

  backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition,
                         decompositions=select_decomp_table())
  torch._dynamo.reset()
  step = torch.compile(model, backend=backend, fullgraph=True)
  loss = step(tokens)
  loss.backward()
  return got["fw"], got["bw"]


def measure(model, tokens, partition) -> dict:
  """Saved bytes and FLOPs of one partition of the train step."""
  fw, bw = capture(model, tokens, partition)
  saved = saved_tensors(fw, bw)
  f, b = graph_flops(fw), graph_flops(bw)
  return {"saved": saved, "activation_bytes": sum(s["bytes"] for s in saved if not s["parameter_only"]),
          "parameter_only_bytes": sum(s["bytes"] for s in saved if s["parameter_only"]),
          "flops": f["flops"] + b["flops"], "matmul_flops": f["matmul_flops"] + b["matmul_flops"],
          "forward_flops": f["flops"], "transcendentals": f["transcendentals"] + b["transcendentals"],
          "unknown_ops": sorted(set(f["unknown_ops"]) | set(b["unknown_ops"])),
          "fw_graph": fw, "bw_graph": bw}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python benchmarks/torch_mincut.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--budgets", type=float, nargs="*",
                      default=[1.0, 0.9, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
  parser.add_argument("--out", default=os.path.join(RESULTS, "torch_mincut.json"))
  parser.add_argument("--dump", default=None, help="directory to write the FX graphs' code to")
  args = parser.parse_args(argv)
  started, load_start = time.perf_counter(), os.getloadavg()
  import torch._functorch.config as fconfig  # noqa: PLC0415
  from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition  # noqa: PLC0415

  torch.manual_seed(0)
  torch.set_num_threads(1)
  c = CONFIG
  model = GPT(c).train()
  tokens = torch.randint(0, c["vocab_size"], (c["batch_size"], c["seq_len"] + 1))
  none = measure(model, tokens, default_partition)
  rows = []

  def row(label, got):
    r = {k: v for k, v in got.items() if not k.endswith("_graph") and k != "saved"}
    groups = collections.Counter((tuple(t["shape"]), t["dtype"], t["parameter_only"]) for t in got["saved"])
    r["saved"] = [{"shape": list(shape), "dtype": dtype, "parameter_only": param, "count": n,
                   "bytes": n * next(t["bytes"] for t in got["saved"] if tuple(t["shape"]) == shape
                                     and t["dtype"] == dtype)}
                  for (shape, dtype, param), n in sorted(groups.items(), key=lambda kv: -kv[1])]
    r.update(label=label, activation_mib=got["activation_bytes"] / MIB, flops_ratio=got["flops"] / none["flops"],
             matmul_flops_ratio=got["matmul_flops"] / none["matmul_flops"],
             saved_by_dtype=dict(collections.Counter(t["dtype"] for t in got["saved"] if not t["parameter_only"])))
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      for kind in ("fw", "bw"):
        with open(os.path.join(args.dump, f"{label}.{kind}.py"), "w") as fh:
          fh.write(got[f"{kind}_graph"].code)
    print(f"{label:>12}: saved {r['activation_mib']:7.1f} MiB (+{got['parameter_only_bytes'] / MIB:.1f} parameter-only)"
          f"  FLOPs ÷ none {r['flops_ratio']:.5f}  matmul-only {r['matmul_flops_ratio']:.5f}"
          f"  unknown ops {r['unknown_ops']}", flush=True)
    return r

  rows.append(row("none", none))
  for budget in args.budgets:
    fconfig.activation_memory_budget = budget
    got = measure(model, tokens, functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    r = row(f"budget={budget:g}", got)
    r["budget"] = budget
    rows.append(r)
  record = {"benchmark": "torch_mincut", "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch_version": torch.__version__, "python": sys.version.split()[0], "platform": platform.platform(),
            "loadavg_start_end": [list(load_start), list(os.getloadavg())], "config": c, "rand_flops_per_element": RAND_FLOPS,
            "none_flops": none["flops"], "none_matmul_flops": none["matmul_flops"], "rows": rows,
            "wall_s": time.perf_counter() - started}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(record, fh, indent=1)
  print(f"wrote {args.out}")
  return record


if __name__ == "__main__":
  main()
