"""Peak memory of one shard's commit (compacting its staging files into its part) at 1x and 10x the groups
(issue 15 item 8). Synthetic staging files as the write stage makes them (one per batch of 64 documents, ~8 groups
per document, ~3.9 KB of text per group: 600,000 groups are ~2.2 GiB, as in the issue's report), in a local folder.

``after``: ``operators.write.compact_shard`` (files taken in row order, overlapping ones merged, row groups of
8,192 rows streamed to the part). ``before``: the previous commit, every staging file of the shard read, then one
sort and one write. Each figure is the peak RSS of a fresh process.

    python benchmarks/bench_commit.py                    # 20,000 and 200,000 groups
    python benchmarks/bench_commit.py --groups 60000 600000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DOCS_PER_BATCH = 64
GROUPS_PER_DOC = 8


def make_staging(folder: Path, groups: int, seed: int = 0) -> None:
    from pairmine.operators.write import STAGING_SORT_COLUMN, staging_name

    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(5000)], dtype=object)
    docs = groups // GROUPS_PER_DOC
    order = rng.permutation(-(-docs // DOCS_PER_BATCH))  # batches finish in any order
    for b in order:
        rows = np.arange(b * DOCS_PER_BATCH, min(docs, (b + 1) * DOCS_PER_BATCH), dtype=np.int64)
        row = np.repeat(rows, GROUPS_PER_DOC)
        n = len(row)
        anchor = " ".join(words[rng.integers(0, 5000, 100)])  # ~650 chars, shared per batch to build fast
        related = [[anchor[::-1]] * 4] * n  # 4 related texts: ~3.9 KB per group in all
        table = pa.table({"doc_id": [f"d{r}" for r in row],
                          "anchor_index": pa.array(np.tile(np.arange(GROUPS_PER_DOC), len(rows)), pa.int32()),
                          "anchor_text": [anchor] * n, "related_texts": related, STAGING_SORT_COLUMN: row})
        path = folder / "shard-00000" / staging_name(0, row).split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")


def child(folder: str, mode: str) -> dict:
    from pairmine.operators.write import STAGING_SORT_COLUMN, compact_shard, read_table, write_table_atomic
    from pairmine.operators.storage import LOCAL

    schema = pa.schema([("doc_id", pa.string()), ("anchor_index", pa.int32()), ("anchor_text", pa.string()),
                        ("related_texts", pa.list_(pa.string()))])
    t0 = time.time()
    out = tempfile.mkdtemp(prefix="bench-commit-")
    if mode == "after":
        _, n, _ = compact_shard(folder, out, 0, schema)
    else:
        files = sorted(str(p) for p in Path(folder, "shard-00000").glob("*.parquet"))
        table = pa.concat_tables([read_table(LOCAL, p) for p in files])
        table = table.sort_by([(STAGING_SORT_COLUMN, "ascending"), ("anchor_index", "ascending")])
        table = table.drop_columns([STAGING_SORT_COLUMN]).cast(schema)
        write_table_atomic(LOCAL, table, f"{out}/part-00000.parquet")
        n = table.num_rows
    return {"groups": n, "seconds": round(time.time() - t0, 1),
            "peak_mb": round(_peak_mb(), 1)}


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM; getrusage's ru_maxrss would carry the parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="+", default=[20_000, 200_000])
    ap.add_argument("--workdir", default="")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-commit-"))
    print(f"{'groups':>9} {'text MB':>8} {'mode':>7} {'seconds':>8} {'peak MB':>8} {'vs 1x':>6}")
    first: dict[str, float] = {}
    for groups in a.groups:
        folder = work / f"staging-{groups}"
        if not (folder / "_done").exists():
            make_staging(folder, groups)
            (folder / "_done").write_text("")
        for mode in ("after", "before"):
            r = subprocess.run([sys.executable, __file__, "--child", str(folder), mode], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            res = json.loads(r.stdout.strip().splitlines()[-1])
            first.setdefault(mode, res["peak_mb"])
            print(f"{res['groups']:>9} {groups * 3.9 / 1024:>8.0f} {mode:>7} {res['seconds']:>8} {res['peak_mb']:>8.0f} "
                  f"{res['peak_mb'] / first[mode]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
