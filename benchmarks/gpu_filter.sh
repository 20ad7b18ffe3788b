#!/usr/bin/env bash
# Consistency-filter benchmark for one H100/H200-class GPU: E5's pool size (1,000,000 x 768) stored in fp16,
# scores in fp32. Run from the repository root in an environment with a CUDA build of torch and pairmine installed.
set -euo pipefail
python benchmarks/bench_filter.py --device cuda --pool 1000000 --dim 768 --queries 100000 --storage fp16 \
    --batch 4096 --chunk-mb 2048 "$@"
