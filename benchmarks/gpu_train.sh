#!/usr/bin/env bash
# Training throughput and model FLOPs utilisation of the xPRT objective on one H100/H200-class GPU.
# Run from the repository root in an environment with a CUDA build of torch and pairmine installed
# (pip install -e . without the CPU torch pin). Prints groups/s, GFLOP per group (counted by torch's FLOP counter
# on a real step: 5 encoder passes, 10 decoder passes, the frozen pass, backward) and MFU against 989 TFLOP/s
# (dense bf16 peak of H100 SXM and H200; pass --peak-tflops for another GPU).
#
#   bash benchmarks/gpu_train.sh                                       # default model (all-MiniLM-L6-v2)
#   bash benchmarks/gpu_train.sh --model /models/e5-base-unsupervised   # the paper's starting point, BERT-base
set -euo pipefail
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# step: one process, bf16 autocast, batch 64 groups (320 passages of <= 256 tokens per step)
python benchmarks/bench_train.py --mode step --device cuda --dtype bfloat16 --batch 64 --max-length 256 --steps 20 "$@"
# job: the real pairmine train job on Ray Train with one GPU worker (nccl), same batch
python benchmarks/bench_train.py --mode job --device cuda --dtype bfloat16 --batch 64 --max-length 256 \
    --job-steps 30 --workers 1 "$@"
