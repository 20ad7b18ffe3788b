"""Driver memory and task memory of the mining job's first pass as the corpus grows (issue 15 items 1 and 2).

A synthetic corpus of short documents (ids + ~40-word texts, 1% repeated ids), in parquet shards of 50 row groups,
FineWeb's layout. Each figure comes from a fresh process, so one run's peak does not hide another's.

1. **Driver peak RSS** of the first pass (scans, duplicate ids, IDF sample, pool candidates, the work units) at
   1x, 10x, 100x the documents (20k, 200k, 2M by default), with a private local Ray and a pool of P = 5,000
   passages and an IDF sample of 2,000 documents (both filled at 1x: what they hold is bounded by P and the sample
   size, not by the corpus): ``after`` is
   ``pipeline.first_pass`` (ids go to hash-range indexes on the workers); ``before`` is the previous design, each
   shard's scan returning every id to the driver, which found the duplicates with the same Arrow group-by. The
   duplicate count is printed for both (it must be equal). Goal: after at 100x <= 1.2x after at 1x.
2. **Scan task peak RSS** for one shard of 1x and 10x the rows (100k and 1M rows: 50 and 500 row groups of the
   same 2,000 rows): ``after`` scans one row group (a work unit), ``before`` the whole shard (one task per file).
   Goal: after at 10x <= 1.2x after at 1x.

    python benchmarks/bench_first_pass.py                  # 20k / 200k / 2M documents (about 10 minutes here)
    python benchmarks/bench_first_pass.py --docs 20000 200000 --no-before
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
import pyarrow as pa
import pyarrow.parquet as pq

ROWS_PER_SHARD = 100_000
ROW_GROUPS = 50
# The driver holds P pool passages and the IDF sample whatever the corpus size (bounded by configuration, not by
# documents): small values here, so that the 1x corpus already fills them and the ratio shows what grows with documents.
POOL = 5_000
SAMPLE_DOCS = 2_000


def make_corpus(folder: Path, docs: int, rows_per_shard: int = ROWS_PER_SHARD, seed: int = 0,
                row_group_rows: int = ROWS_PER_SHARD // ROW_GROUPS) -> None:
    """``docs`` documents in shards of ``rows_per_shard`` rows, in row groups of ``row_group_rows`` (a writer's
    fixed row-group size, as FineWeb's: a 100k-row shard has 50 row groups); ids ``d<n>``, 1% of
    them repeating an earlier id (in the same or an earlier shard); texts of 30-50 words from a 20k-word vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(20_000)], dtype=object)
    written = 0
    shard = 0
    while written < docs:
        n = min(rows_per_shard, docs - written)
        numbers = np.arange(written, written + n)
        repeat = rng.random(n) < 0.01
        numbers[repeat] = rng.integers(0, np.maximum(numbers[repeat], 1))
        words = rng.integers(0, len(vocab), size=(n, 50))
        lengths = rng.integers(30, 51, size=n)
        texts = [" ".join(vocab[w[:k]]) + "." for w, k in zip(words, lengths)]
        table = pa.table({"id": pa.array([f"d{i}" for i in numbers]), "text": pa.array(texts)})
        pq.write_table(table, folder / f"shard-{shard:05d}.parquet", row_group_size=row_group_rows)
        written += n
        shard += 1


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage's ru_maxrss: that survives fork + exec, so a child would
    report the parent's peak (here: the corpus generation)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child_driver(folder: str, mode: str) -> dict:
    """The first pass as the mining job's driver runs it; returns the figures (run in a fresh process)."""
    import ray

    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.first_pass import DuplicateIndex, ScanParams, first_pass
    from pairmine.pipeline.inputs import PoolSpec, check_parquet_shards, discover_shards, sample_cut, scan_shard

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    base = _peak_mb()
    t0 = time.time()
    shards = discover_shards(folder)
    layout: dict = {}
    known = check_parquet_shards(shards, ("text", "id"), layout=layout)
    pool = PoolSpec(POOL, 0, sample_cut(POOL, known), known)
    params = ScanParams("text", "id", SAMPLE_DOCS, 0, sample_cut(SAMPLE_DOCS, known), pool, LOCAL)
    if mode == "after":
        first = first_pass(shards, layout, params, tempfile.mkdtemp(prefix="bench-dups-"))
        dups, docs = first.duplicates, first.docs
    else:  # the previous design: every shard's ids (and sample, pool) come back to the driver
        scan = ray.remote(num_cpus=1)(scan_shard)
        scans = ray.get([scan.remote(s, "text", "id", SAMPLE_DOCS, 0, params.cut, pool, LOCAL) for s in shards])
        index = DuplicateIndex()
        for s in scans:
            rows = np.arange(len(s.ids), dtype=np.int64)
            index.add(s.ids, (np.int64(s.shard_index) << 40) | rows)
        docs = sum(s.num_rows for s in scans)
        dups = sum(index.find()["id"].values())
    out = {"docs": docs, "duplicates": dups, "seconds": round(time.time() - t0, 1),
           "peak_mb": round(_peak_mb(), 1), "after_ray_init_mb": round(base, 1)}
    ray.shutdown()
    return out


def child_task(path: str, mode: str) -> dict:
    """One scan task's work in this process: one row group (after) or the whole shard (before)."""
    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.first_pass import DuplicateIndex, ScanParams, scan_units
    from pairmine.pipeline.inputs import PoolSpec, check_parquet_shards, discover_shards

    shard = discover_shards(path)[0]
    layout: dict = {}
    known = check_parquet_shards([shard], ("text", "id"), layout=layout)
    base = _peak_mb()
    params = ScanParams("text", "id", SAMPLE_DOCS, 0, 0.03, PoolSpec(POOL, 0, 0.03, known), LOCAL)
    out = scan_units(shard, [(0 if mode == "after" else -1, 0)], params, [DuplicateIndex()], remote=False)[0]
    return {"rows": out["rows"], "peak_mb": round(_peak_mb(), 1), "before_scan_mb": round(base, 1)}


def run_child(*args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, nargs="+", default=[20_000, 200_000, 2_000_000])
    ap.add_argument("--task-rows", type=int, nargs=2, default=[100_000, 1_000_000],
                    help="rows of the one-shard inputs for the task-memory figure (1x, 10x)")
    ap.add_argument("--no-before", action="store_true", help="skip the previous design's figures")
    ap.add_argument("--workdir", default="", help="where the synthetic corpora go (default: a temp folder)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, folder, mode = a.child
        print(json.dumps(child_driver(folder, mode) if kind == "driver" else child_task(folder, mode)))
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-first-pass-"))
    modes = ["after"] if a.no_before else ["after", "before"]
    print("1. driver peak RSS of the first pass (fresh process each; private local Ray, 2 CPUs)")
    print(f"{'documents':>10} {'mode':>7} {'dups':>7} {'seconds':>8} {'peak MB':>8} {'vs 1x':>6}")
    first_peak: dict[str, float] = {}
    for docs in a.docs:
        folder = work / f"corpus-{docs}"
        if not (folder / "_done").exists():
            make_corpus(folder, docs)
            (folder / "_done").write_text("")
        for mode in modes:
            r = run_child("driver", str(folder), mode)
            first_peak.setdefault(mode, r["peak_mb"])
            print(f"{r['docs']:>10} {mode:>7} {r['duplicates']:>7} {r['seconds']:>8} {r['peak_mb']:>8.0f} "
                  f"{r['peak_mb'] / first_peak[mode]:>5.2f}x", flush=True)
    print("\n2. peak RSS of one scan task, one shard of 1x and 10x the rows (row groups of 2,000 rows)")
    print(f"{'rows':>10} {'mode':>7} {'peak MB':>8} {'vs 1x':>6}")
    task_peak: dict[str, float] = {}
    for rows in a.task_rows:
        folder = work / f"shard-{rows}-rg2000"
        if not (folder / "_done").exists():
            make_corpus(folder, rows, rows_per_shard=rows)
            (folder / "_done").write_text("")
        for mode in modes:
            r = run_child("task", str(folder), mode)
            task_peak.setdefault(mode, r["peak_mb"])
            print(f"{rows:>10} {mode:>7} {r['peak_mb']:>8.0f} {r['peak_mb'] / task_peak[mode]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
