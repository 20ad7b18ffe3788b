"""Consistency-filter throughput benchmark (not a test): pairmine's count against faiss top-k search and the bare
matrix product of the same sizes (the compute floor), with ratios.

    python benchmarks/bench_filter.py                       # CPU: pool 200,000 x 384, 10,000 queries
    python benchmarks/bench_filter.py --device cuda --pool 1000000 --dim 768 --queries 100000 --storage fp16 \\
        --batch 4096 --chunk-mb 2048                          # one H100/H200-class GPU (benchmarks/gpu_filter.sh)

What is timed, on the same random unit vectors (seeded):
  pairmine count     operators.consistency.consistency_counts: s from the same product, n_above of other documents
  faiss top-k        IndexFlatIP.search(queries, k) on the same pool (CPU faiss; skipped on GPU unless faiss has GPUs)
  matmul floor       the same chunked products queries @ pool.T with nothing else (no compare, no count)
Queries go in batches of --batch (the pipeline's groups per batch are a few hundred to a few thousand).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=200_000, help="pool passages P (default 200,000)")
    ap.add_argument("--dim", type=int, default=384, help="vector dimension (default 384)")
    ap.add_argument("--queries", type=int, default=10_000, help="groups to filter (default 10,000)")
    ap.add_argument("--batch", type=int, default=1024, help="groups per call (default 1024)")
    ap.add_argument("--k", type=int, default=2, help="keep iff n_above < k (default 2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--storage", default="fp32", choices=["fp32", "fp16"], help="pool storage dtype (scores stay fp32)")
    ap.add_argument("--chunk-mb", type=float, default=64.0, help="score-matrix memory per chunk, MB (default 64)")
    ap.add_argument("--threads", type=int, default=0, help="torch/faiss CPU threads (0: default)")
    args = ap.parse_args()

    import torch

    from pairmine.operators.consistency import consistency_counts

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    def unit(n):
        v = rng.standard_normal((n, args.dim), dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    pool = unit(args.pool)
    anchors = unit(args.queries)
    positives = anchors + 0.15 * unit(args.queries)  # positives close to their anchors, like real s1
    positives /= np.linalg.norm(positives, axis=1, keepdims=True)
    pool_docs = rng.integers(0, args.pool, size=args.pool).astype(np.int64)
    anchor_docs = rng.integers(0, args.pool, size=args.queries).astype(np.int64)
    dev = torch.device(args.device)
    pool_t = torch.from_numpy(pool).to(dev, dtype=torch.float16 if args.storage == "fp16" else torch.float32)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"pool {args.pool:,} x {args.dim} ({args.storage} on {args.device}), {args.queries:,} queries in batches of "
          f"{args.batch}, k = {args.k}, torch threads {torch.get_num_threads()}", flush=True)
    batches = [(i, min(i + args.batch, args.queries)) for i in range(0, args.queries, args.batch)]
    results = {}

    def timed(name, fn):
        fn(*batches[0])  # warm-up
        sync()
        t0 = time.perf_counter()
        for lo, hi in batches:
            fn(lo, hi)
        sync()
        seconds = time.perf_counter() - t0
        results[name] = args.queries / seconds
        print(f"  {name:<28} {results[name]:10.1f} queries/s  ({seconds:.2f} s)", flush=True)

    kept = []

    def ours(lo, hi):
        _, n = consistency_counts(anchors[lo:hi], positives[lo:hi], pool_t, anchor_docs[lo:hi], pool_docs, args.chunk_mb)
        kept.append(int((n < args.k).sum()))

    timed("pairmine count", ours)
    chunk = max(256, int(args.chunk_mb * 1024 * 1024 / 4 / args.batch))

    def floor(lo, hi):
        a = torch.from_numpy(anchors[lo:hi]).to(dev)
        with torch.inference_mode():
            for start in range(0, args.pool, chunk):
                _ = a @ pool_t[start : start + chunk].float().T

    timed("matmul floor", floor)
    try:
        import faiss
    except ImportError:
        print("  faiss not installed (pip install faiss-cpu): skipped")
    else:
        if args.device == "cpu":
            if args.threads:
                faiss.omp_set_num_threads(args.threads)
            index = faiss.IndexFlatIP(args.dim)
            index.add(pool)
            timed(f"faiss IndexFlatIP top-{args.k}", lambda lo, hi: index.search(anchors[lo:hi], args.k))
        else:
            print("  faiss top-k on GPU: skipped (this script times the CPU index only)")
    flops = 2.0 * args.queries * args.pool * args.dim
    ours_qps = results["pairmine count"]
    print(f"\nkeep rate {100.0 * sum(kept[1:]) / args.queries:.2f}% (random pool; real pools are harder)")
    print(f"pairmine count: {flops / (args.queries / ours_qps) / 1e12:.2f} TFLOP/s of useful matmul")
    print("ratios (queries/s):")
    print(f"  pairmine count / matmul floor      {ours_qps / results['matmul floor']:.2f}x")
    for name, qps in results.items():
        if name.startswith("faiss"):
            print(f"  pairmine count / {name:<17} {ours_qps / qps:.2f}x")


if __name__ == "__main__":
    main()
