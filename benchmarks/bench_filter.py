"""Consistency-filter throughput benchmark (not a test): pairmine's count against faiss top-k search and the bare
matrix product of the same sizes (the compute floor), with ratios.

    python benchmarks/bench_filter.py                       # CPU: pool 200,000 x 384, 10,000 queries
    python benchmarks/bench_filter.py --device cuda --pool 1000000 --dim 768 --queries 100000 --storage fp16 \\
        --batch 4096 --chunk-mb 2048                          # one H100/H200-class GPU (benchmarks/gpu_filter.sh)

    git show <commit>:operators/consistency.py > /tmp/old.py
    python benchmarks/bench_filter.py --baseline /tmp/old.py  # also time another version of the count, same run
    python benchmarks/bench_filter.py --noise 8               # hard case: s among the pool's scores, few groups kept

What is timed, on the same random unit vectors (seeded):
  pairmine count     operators.consistency.consistency_counts: s, and the full n_above of other documents
  baseline count     --baseline: consistency_counts from that file (its decisions are checked against ours)
  faiss top-k        IndexFlatIP.search(queries, k) on the same pool (CPU faiss; skipped on GPU unless faiss has GPUs)
  matmul floor       the same chunked products queries @ pool.T into one reused buffer, nothing else
Queries go in batches of --batch (the pipeline's groups per batch are a few hundred to a few thousand). The methods
take turns batch by batch (the order rotates), so a machine shared with other work slows them alike and the ratios
stay fair; the seconds are each method's total over all batches after one warm-up batch each.
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
    ap.add_argument("--noise", type=float, default=0.15,
                    help="positive = anchor + noise * random unit, renormalised (default 0.15: s ~ 0.99, every group "
                         "kept; ~8 at dim 384 puts s among the pool's scores, so rows need the compare and count)")
    ap.add_argument("--baseline", default=None, help="a copy of operators/consistency.py to time beside (before/after)")
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
    positives = anchors + args.noise * unit(args.queries)  # positives close to their anchors, like real s1
    positives /= np.linalg.norm(positives, axis=1, keepdims=True)
    pool_docs = rng.integers(0, args.pool, size=args.pool).astype(np.int64)
    anchor_docs = rng.integers(0, args.pool, size=args.queries).astype(np.int64)
    dev = torch.device(args.device)
    pool_t = torch.from_numpy(pool).to(dev, dtype=torch.float16 if args.storage == "fp16" else torch.float32)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"pool {args.pool:,} x {args.dim} ({args.storage} on {args.device}), {args.queries:,} queries in batches of "
          f"{args.batch}, k = {args.k}, torch threads {torch.get_num_threads()}", flush=True)
    batches = [(i, min(i + args.batch, args.queries)) for i in range(0, args.queries, args.batch)]
    methods = {}  # name -> fn(lo, hi), timed in turns

    counts = {}

    def count_with(fn, name):
        def run(lo, hi):
            counts.setdefault(name, {})[lo] = fn(anchors[lo:hi], positives[lo:hi], pool_t, anchor_docs[lo:hi],
                                                 pool_docs, args.chunk_mb)
        return run

    methods["pairmine count"] = count_with(consistency_counts, "pairmine count")
    if args.baseline:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_consistency", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
        methods["baseline count"] = count_with(baseline.consistency_counts, "baseline count")
    chunk = max(256, int(args.chunk_mb * 1024 * 1024 / 4 / args.batch))

    out = torch.empty((args.batch, chunk), dtype=torch.float32, device=dev)  # one score buffer, reused like the count's

    def floor(lo, hi):
        a = torch.from_numpy(anchors[lo:hi]).to(dev)
        with torch.inference_mode():
            for start in range(0, args.pool, chunk):
                block = pool_t[start : start + chunk].float()
                if len(a) == args.batch and len(block) == chunk:
                    torch.mm(a, block.T, out=out)
                else:
                    _ = a @ block.T

    methods["matmul floor"] = floor
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
            methods[f"faiss IndexFlatIP top-{args.k}"] = lambda lo, hi: index.search(anchors[lo:hi], args.k)
        else:
            print("  faiss top-k on GPU: skipped (this script times the CPU index only)")
    names = list(methods)
    for name in names:  # warm-up
        methods[name](*batches[0])
    sync()
    seconds = dict.fromkeys(names, 0.0)
    for b, (lo, hi) in enumerate(batches):
        for name in names[b % len(names):] + names[: b % len(names)]:
            t0 = time.perf_counter()
            methods[name](lo, hi)
            sync()
            seconds[name] += time.perf_counter() - t0
    results = {name: args.queries / seconds[name] for name in names}
    for name in names:
        print(f"  {name:<28} {results[name]:10.1f} queries/s  ({seconds[name]:.2f} s)", flush=True)
    kept = [int((n < args.k).sum()) for _, n in counts["pairmine count"].values()]
    if "baseline count" in counts:
        same = sum(int(np.array_equal(n < args.k, counts["baseline count"][lo][1] < args.k))
                   for lo, (_, n) in counts["pairmine count"].items())
        ours = counts["pairmine count"].items()
        differ = sum(int((n != counts["baseline count"][lo][1]).sum()) for lo, (_, n) in ours)
        print(f"  baseline: same keep decisions in {same}/{len(batches)} batches; n_above differs for {differ} groups")
    flops = 2.0 * args.queries * args.pool * args.dim
    ours_qps = results["pairmine count"]
    print(f"\nkeep rate {100.0 * sum(kept) / args.queries:.2f}% (random pool; real pools are harder)")
    print(f"pairmine count: {flops / (args.queries / ours_qps) / 1e12:.2f} TFLOP/s of useful matmul")
    print("ratios (queries/s):")
    print(f"  pairmine count / matmul floor      {ours_qps / results['matmul floor']:.2f}x")
    for name, qps in results.items():
        if name.startswith("faiss") or name == "baseline count":
            print(f"  pairmine count / {name:<17} {ours_qps / qps:.2f}x")
    if "baseline count" in results:
        print(f"  baseline count / matmul floor      {results['baseline count'] / results['matmul floor']:.2f}x")
        for name, qps in results.items():
            if name.startswith("faiss"):
                print(f"  baseline count / {name:<17} {results['baseline count'] / qps:.2f}x")


if __name__ == "__main__":
    main()
