"""Hard-negative mining benchmark (not a test): ``pairmine negatives`` against sentence-transformers'
``mine_hard_negatives`` on the same model, pairs, corpus, depth and window, plus the search alone and the recall of
the approximate indexes against exact search. Prints figures and ratios.

    pip install -e '.[bench]'              # sentence-transformers' mining needs the datasets library
    python benchmarks/bench_negatives.py   # fiqa-pairs-beir (499 pairs, 1,236 answers with text), default model, CPU
    python benchmarks/bench_negatives.py --skip-search --copies 4   # the corpus 5x larger: start-up a small share
    python benchmarks/bench_negatives.py --skip-search --copies 4 --threads 1 --repeat 3   # each model on one core;
        # 3 rounds, the sides alternating, medians compared (a shared machine's speed drifts)
    python benchmarks/bench_negatives.py --skip-search --copies 4 --dtype float32  # both sides in fp32
    python benchmarks/bench_negatives.py --skip-search --copies 4 --threads 1 --embed-actors 2   # the whole machine:
        # pairmine's 2 embed actors of 1 thread each against sentence-transformers with 2 threads

What is timed:
  end to end   pairmine negatives (a subprocess: Ray start, corpus embedding, index, streaming pass, commit) and
               mine_hard_negatives (a subprocess too, so that both start cold: imports, model load, embeds corpus
               and queries, faiss search, range_min/range_max window, num_negatives) on the same pairs and corpus,
               in the same compute dtype (pairmine's embed.dtype, resolved once here: on a CPU with AMX, or an AMD
               one with AVX512-BF16, ``auto`` is bf16 autocast, and sentence-transformers then runs under the same
               ``torch.autocast``); pairs/s and the ratio pairmine / sentence-transformers
  search       on random unit vectors (N x dim, seeded): faiss IndexFlatIP top-depth + pairmine's window selection
               (operators.negatives.select_negatives), queries/s; IVF and HNSW queries/s and recall@depth vs exact
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FIQA = Path(__file__).resolve().parents[1] / "tests" / "data" / "fiqa-pairs-beir"


def fiqa_pairs() -> tuple[list[dict], list[dict]]:
    """(pairs: one per judged question, its first judged answer; corpus documents: every answer)."""
    corpus = [json.loads(x) for x in (FIQA / "corpus.jsonl").read_text().splitlines()]
    queries = {q["_id"]: q["text"] for q in map(json.loads, (FIQA / "queries.jsonl").read_text().splitlines())}
    qrels: dict[str, list] = {}
    for line in (FIQA / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, score = line.split("\t")
        if int(score) > 0:
            qrels.setdefault(q, []).append(d)
    text = {d["_id"]: d["text"] for d in corpus}
    pairs = [{"id": q, "query": queries[q], "passage": text[sorted(ds)[0]]} for q, ds in sorted(qrels.items())
             if text.get(sorted(ds)[0], "").strip()]
    return pairs, [{"id": d["_id"], "text": d["text"]} for d in corpus if d["text"].strip()]


def end_to_end(depth: int, rank_start: int, count: int, copies: int = 0, threads: int = 0,
               dtype: str = "auto", embed_actors: int = 0, repeat: int = 1) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairmine.operators.embed import default_model_path, pick_dtype

    # One compute dtype for both sides: pairmine's `auto` picks bf16 autocast on some CPUs (pick_dtype), and comparing
    # that with sentence-transformers' fp32 would time the dtype, not the pipeline (2.07x on an AMX machine, 2026-12-04).
    dtype = pick_dtype(dtype, "cpu")
    if dtype not in ("float32", "bfloat16"):
        sys.exit(f"--dtype {dtype}: on the CPU the comparison runs in float32 or bfloat16")

    pairs, docs = fiqa_pairs()
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.Table.from_pylist(pairs), f"{tmp}/pairs.parquet")
        corpus = f"{tmp}/answers"
        os.makedirs(corpus)
        pq.write_table(pa.Table.from_pylist(docs), f"{corpus}/answers.parquet")
        if copies:  # the answers plus copies with their sentences reshuffled (bench_embed's corpus maker)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_embed import reshuffled_corpus

            corpus = reshuffled_corpus(corpus, copies, f"{tmp}/corpus")
            docs = pa.concat_tables([pq.read_table(f) for f in sorted(Path(corpus).glob("*.parquet"))]).to_pylist()
            docs = [d for d in docs if d["text"].strip()]
        pm_cmd = ([sys.executable, "-m", "pairmine.pipeline.cli", "negatives", "--input",
                   f"{tmp}/pairs.parquet", "--corpus", corpus, "--output", tmp,
                   "--set", "chunk.max_words=100000",
                   # one passage per document, as sentence-transformers is given the corpus
                   "--set", "chunk.fit_model_length=false", "--set",
                   f"negatives.depth={depth}", "--set", f"negatives.rank_end={depth}", "--set",
                   f"negatives.rank_start={rank_start}", "--set", f"negatives.count={count}",
                   "--set", f"embed.dtype={dtype}", "--set", "embed.device=cpu"]
                  + (["--set", f"embed.threads={threads}"] if threads else [])
                  + (["--set", f"embed.num_actors={embed_actors}"] if embed_actors else []))
        # sentence-transformers in a process of its own too, so that both sides start cold (imports, model load)
        job = {"model": default_model_path(), "pairs": [{"query": p["query"], "passage": p["passage"]} for p in pairs],
               "corpus": [d["text"] for d in docs], "range_min": rank_start - 1, "range_max": depth, "count": count,
               "threads": threads * max(embed_actors, 1), "dtype": dtype}
        Path(f"{tmp}/st.json").write_text(json.dumps(job))
        pm_times, st_times = [], []

        def pairmine_side(k):
            t0 = time.time()
            proc = subprocess.run(pm_cmd + ["--run-id", f"bench{k}"], capture_output=True, text=True)
            pm_times.append(time.time() - t0)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            return proc, json.loads(Path(f"{tmp}/bench{k}/stats.json").read_text())

        def st_side_run():
            t0 = time.time()
            st = subprocess.run([sys.executable, __file__, "--st-side", f"{tmp}/st.json"], capture_output=True,
                                text=True)
            st_times.append(time.time() - t0)
            if st.returncode:
                sys.exit(st.stderr[-3000:])
            return json.loads(st.stdout.strip().splitlines()[-1])["rows"]

        for k in range(repeat):  # the sides alternate (A B B A ...), so that a slower spell or a cold page cache
            if k % 2 == 0:       # falls on both
                (proc, stats), mined_rows = pairmine_side(k), st_side_run()
            else:
                mined_rows = st_side_run()
                proc, stats = pairmine_side(k)
            if repeat > 1:
                print(f"  round {k + 1}/{repeat}: pairmine {pm_times[-1]:.1f} s, sentence-transformers "
                      f"{st_times[-1]:.1f} s ({st_times[-1] / pm_times[-1]:.2f}x)", flush=True)
    n = len(pairs)
    cores = f", {threads} thread(s) per model" if threads else ""
    if embed_actors:
        cores = (f", pairmine {embed_actors} embed actor(s) x {threads} thread(s) against {threads * embed_actors} "
                 "sentence-transformers thread(s)")
    print(f"end to end, {n} pairs, corpus {len(docs)} passages, depth {depth}, window {rank_start}-{depth}, "
          f"{count} negatives per pair, all-MiniLM-L6-v2 on CPU, {dtype} on both sides"
          f"{cores}; each side a process of its own, timed from its "
          "start (imports and model load included)" + (f"; the median of {repeat} alternating rounds" if repeat > 1
                                                       else "") + ":")
    pm_s, st_s = float(np.median(pm_times)), float(np.median(st_times))
    print(f"  pairmine negatives      {pm_s:8.1f} s  {n / pm_s:8.2f} pairs/s  ({stats['negatives']} negatives; "
          "includes Ray start and the commit)")
    print(f"    vectors reused from the corpus: {stats.get('vectors_reused', 0)} of {2 * stats['pairs_out']} "
          "(queries and positives); its last run's log's timings:")
    for line in proc.stderr.splitlines():
        if "INFO" in line and any(k in line for k in ("embedded and indexed", "done in ", "phases (wall s)")):
            print("      " + line.strip()[:200])
    print(f"  mine_hard_negatives     {st_s:8.1f} s  {n / st_s:8.2f} pairs/s  ({mined_rows} rows with {count} "
          "negatives)")
    print(f"  ratio pairmine / sentence-transformers (pairs/s): {st_s / pm_s:.2f}x"
          + (f" (rounds: {min(b / a for a, b in zip(pm_times, st_times)):.2f}-"
             f"{max(b / a for a, b in zip(pm_times, st_times)):.2f}x)" if repeat > 1 else ""))


def st_side(job_path: str) -> None:
    """The sentence-transformers side of the end-to-end comparison, run as a process of its own (``--st-side``):
    imports, model load and ``mine_hard_negatives`` on the job that :func:`end_to_end` wrote; prints {"rows": n}."""
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    job = json.loads(Path(job_path).read_text())
    if job["threads"]:  # encode and its faiss search with the same threads as pairmine's actor
        import faiss

        torch.set_num_threads(job["threads"])
        faiss.omp_set_num_threads(job["threads"])
    model = SentenceTransformer(job["model"], device="cpu")
    # pairmine's Embedder on a CPU: fp32 weights, bf16 autocast around the forward pass; the same here
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=job["dtype"] == "bfloat16"):
        mined = mine_hard_negatives(
            Dataset.from_list(job["pairs"]), model, anchor_column_name="query", positive_column_name="passage",
            corpus=job["corpus"], range_min=job["range_min"], range_max=job["range_max"],
            num_negatives=job["count"], sampling_strategy="top", output_format="n-tuple", use_faiss=True,
            batch_size=32, verbose=False)
    print(json.dumps({"rows": len(mined)}))


def search(n: int, dim: int, queries: int, depth: int, rank_start: int, count: int) -> None:
    import faiss

    from pairmine.operators.negatives import select_negatives
    from pairmine.pipeline.negatives import build_index, measure_recall

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(256, dim))
    x = centres[rng.integers(256, size=n)] + 0.5 * rng.normal(size=(n, dim))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = x[rng.choice(n, size=queries, replace=False)] + 0.05 * rng.normal(size=(queries, dim)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    text_hashes, doc_hashes = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) // 8
    print(f"search, {n} x {dim} corpus, {queries} queries, depth {depth} (faiss {faiss.__version__}, "
          f"{faiss.omp_get_max_threads()} threads):")
    flat_qps = None
    for kind in ("flat", "ivf", "hnsw"):
        t0 = time.time()
        index, desc = build_index(x, kind)
        build_s = time.time() - t0
        t0 = time.time()
        scores, ids = index.search(q, depth)
        for k in range(queries):
            select_negatives(ids[k], scores[k], text_hashes, doc_hashes, -1, None, 1.0, rank_start, depth, count)
        qps = queries / (time.time() - t0)
        flat_qps = flat_qps or qps
        recall = measure_recall(index, x, depth, 256) if kind != "flat" else 1.0
        print(f"  {desc:55s} build {build_s:6.1f} s  {qps:9.1f} queries/s ({qps / flat_qps:.2f}x exact)  "
              f"recall@{depth} {recall:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=200, help="candidates retrieved per query (default 200)")
    ap.add_argument("--rank-start", type=int, default=31,
                    help="first rank of the window negatives are taken from (default 31; the window ends at --depth)")
    ap.add_argument("--count", type=int, default=7, help="negatives per pair (default 7)")
    ap.add_argument("--n", type=int, default=200_000, help="search part: corpus vectors (default 200,000)")
    ap.add_argument("--dim", type=int, default=384, help="search part: vector dimension (default 384)")
    ap.add_argument("--queries", type=int, default=5_000, help="search part: queries (default 5,000)")
    ap.add_argument("--copies", type=int, default=0,
                    help="end to end: add this many copies of each answer with its sentences reshuffled to the "
                         "corpus, so that start-up is a small share (default 0: the 1,236 answers alone)")
    ap.add_argument("--threads", type=int, default=0,
                    help="end to end: torch threads of both models (pairmine's embed.threads; sentence-transformers' "
                         "torch and faiss threads); 0: the defaults (the node's CPUs)")
    ap.add_argument("--embed-actors", type=int, default=0,
                    help="end to end: pairmine's embed.num_actors (the corpus pass's embed actors), each with --threads "
                         "threads; sentence-transformers then gets actors x threads threads, the same cores "
                         "(default 0: pairmine's default, one actor on a CPU node); needs --threads")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="end to end: compute dtype of both models (pairmine's embed.dtype; sentence-transformers under "
                         "the same bf16 autocast); auto: what pairmine picks on this CPU (bf16 with AMX or AMD's "
                         "AVX512-BF16, else fp32)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="end to end: rounds, the two sides alternating (pairmine, sentence-transformers, "
                         "sentence-transformers, pairmine, ...); the medians are compared. A shared machine's speed drifts by 10-15%% within minutes "
                         "(2026-12-04: the same sentence-transformers job took 76-103 s in one hour), so one round "
                         "each can show a ratio that is the drift's")
    ap.add_argument("--skip-end-to-end", action="store_true", help="only the search part")
    ap.add_argument("--skip-search", action="store_true", help="only the end-to-end comparison")
    ap.add_argument("--st-side", metavar="JOB", help=argparse.SUPPRESS)  # the subprocess of the end-to-end part
    args = ap.parse_args()
    if args.st_side:
        return st_side(args.st_side)
    if args.embed_actors and not args.threads:
        ap.error("--embed-actors needs --threads (each actor's threads; sentence-transformers gets actors x threads)")
    if not args.skip_search:
        search(args.n, args.dim, args.queries, args.depth, args.rank_start, args.count)
    if not args.skip_end_to_end:
        end_to_end(args.depth, args.rank_start, args.count, args.copies, args.threads, args.dtype,
                   args.embed_actors, max(1, args.repeat))


if __name__ == "__main__":
    main()
