#!/usr/bin/env bash
# Every GPU figure in one run, written to one JSON file: embedder passages/s (BERT-base-sized encoder, 256 tokens,
# bf16, through pairmine's Embedder), consistency-filter queries/s against a 1,000,000 x 768 fp16 pool, and training
# groups/s and MFU of each training objective (the xPRT, XTR and Revela steps on the same encoder; Revela with a
# causal LM of Qwen2.5-0.5B's shape). The models are built from configs with random weights and the shipped default
# model's tokenizer: nothing is downloaded. Each part runs in its own process under a time limit
# (120 + 120 + 180 + 60 + 110 s); estimated ~6 minutes in all on one H100/H200 (see benchmarks/gpu_all.py's docstring).
# Not yet run on a GPU.
#
# Run from the repository root with pairmine and a CUDA build of torch installed:
#   bash benchmarks/gpu_all.sh                     # writes $OUT/gpu_all.json if $OUT is set, else ./gpu_all.json
#   bash benchmarks/gpu_all.sh results/h200.json   # or the path given
#   bash benchmarks/gpu_all.sh --cpu-smoke /tmp/smoke.json   # the same code on the CPU with tiny sizes (~1 minute)
#   bash benchmarks/gpu_all.sh abl.json --parts ablation      # the optional ablation part (pairmine ablate of a
#                                                  # BERT-base-sized scratch proxy, 4 arms, 1 seed; estimated ~4 min)
# Exit code 0 when every part produced its figures, 1 when one failed (the JSON says which, with its output's tail).
set -euo pipefail
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
smoke=()
if [[ "${1:-}" == "--cpu-smoke" ]]; then smoke=(--cpu-smoke); shift; fi
out="${1:-${OUT:-.}/gpu_all.json}"
if [[ $# -gt 0 ]]; then shift; fi
[[ "$out" == /* ]] || out="$PWD/$out"
cd "$(dirname "$0")/.."   # the repository root
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
exec "$PYTHON" benchmarks/gpu_all.py ${smoke[@]+"${smoke[@]}"} --out "$out" "$@"
