#!/usr/bin/env bash
# The checks that need an accelerator (GPU/TPU), in one short self-contained run:
#   0. GPU only: the deviceless figures checked (benchmarks/gpu_check.py): the same LLM steps compiled on the GPU and
#      without it (--topology <gpu>:1, jaxckpt's target config), memory stats side by side, host offload included,
#      and each step's measured peak_bytes_in_use beside its compiled footprint,
#   1. policy sweep on the GPT-2-small shape (temp, FLOPs, step time vs none; policies interleaved),
#   3. runner overhead of experiments.classifier / experiments.lm vs a hand-written jax.jit loop,
#   5. truth check: peak_bytes_in_use of each policy's step vs the compiled footprint (target within 10%).
# Usage (from the repository root, in an environment with jaxckpt and an accelerator build of jax, e.g.
# `pip install -e ".[test]" "jax[cuda12]"`):
#   bash benchmarks/gpu.sh [OUT_DIR]          # default OUT_DIR: benchmarks/results/gpu
# Sizes can be changed by environment variables (defaults fit a 40 GB GPU):
#   SWEEP_PRESET=gpt2-small SWEEP_BATCH=4 TRUTH_CASES="mlp:65536 vit:8192"
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu}"
mkdir -p "$out"
# The measuring children of the truth check need the memory the parent would otherwise preallocate.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
backend="$(python -c 'import jax; print(jax.default_backend())')"
if [[ "$backend" == "cpu" ]]; then
  echo "benchmarks/gpu.sh: error: jax sees no accelerator (backend cpu); install an accelerator build of jax" >&2
  exit 2
fi
python -c 'import jax; print("devices:", jax.devices())'
if [[ "$backend" == "gpu" ]]; then
  python benchmarks/gpu_check.py --out "$out/gpu_check.json"
fi
python benchmarks/policy_sweep.py --preset "${SWEEP_PRESET:-gpt2-small}" --batch-size "${SWEEP_BATCH:-4}" \
  --out "$out/policy_sweep.json"
python benchmarks/runner_overhead.py --out "$out/runner_overhead.json"
# shellcheck disable=SC2086
python benchmarks/truth_check.py --cases ${TRUTH_CASES:-mlp:65536 vit:8192} --out "$out/truth_check.json"
echo "wrote $out/policy_sweep.json $out/runner_overhead.json $out/truth_check.json (and gpu_check.json on a GPU)"
