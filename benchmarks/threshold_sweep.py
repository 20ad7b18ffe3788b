"""Measure how the anchor threshold shapes the groups on a corpus, to choose a model's default threshold.

Embeds the input once (in this process, with pairmine's own operators), then for each threshold prints the anchor
rate, groups per document, % of eligible documents (>= n_related + 1 passages) with groups and the passage coverage
over eligible documents (passages used as anchor or related / their passages). The default threshold of the default
model was chosen with this script as the one that reproduces the paper's 68% passage coverage (seed 000).

    python benchmarks/threshold_sweep.py [--input PATH] [--model PATH] [--target-coverage 68]
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="", help="parquet/JSONL file, folder or glob (default: the shipped sample)")
    ap.add_argument("--model", default="", help="model folder or hub id (default: all-MiniLM-L6-v2)")
    ap.add_argument("--prefix", default="", help="passage prefix")
    ap.add_argument("--target-coverage", type=float, default=68.0, help="passage coverage to aim for, in %% (paper: 68)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import pyarrow as pa

    from operators.centrality import centrality
    from operators.chunk import chunk_text
    from operators.embed import Embedder
    from operators.read import ReadDocuments
    from operators.related import fit_tfidf, mine_groups
    from pipeline.inputs import discover_shards, duplicate_rows, scan_shard, work_units

    shards = discover_shards(args.input)
    scans = [scan_shard(s, "text", "id", 10**9, 0) for s in shards]
    units = work_units(shards, scans, duplicate_rows(scans))
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    texts = [t for t, r in zip(docs.column("text").to_pylist(), docs.column("skip_reason").to_pylist()) if r is None]
    chunked = [chunk_text(t).passages for t in texts]
    vectorizer = fit_tfidf([p for doc in chunked for p in doc])
    embedder = Embedder(args.model, args.prefix)
    flat = [p for doc in chunked for p in doc]
    print(f"{len(texts)} documents, {len(flat)} passages; embedding ...", flush=True)
    matrix = embedder.encode(flat)
    bounds = np.cumsum([0] + [len(d) for d in chunked])
    per_doc = [(matrix[bounds[i] : bounds[i + 1]], chunked[i]) for i in range(len(chunked))]
    eligible = [(v, p, centrality(v), vectorizer.transform(p)) for v, p in per_doc if len(p) >= 5]
    n_pass = sum(len(p) for _, p, _, _ in eligible)
    print(f"{len(eligible)} eligible documents (>= 5 passages) with {n_pass} passages")
    print(f"{'threshold':>9} {'anchor%':>8} {'groups/doc':>10} {'docs%':>6} {'coverage%':>9}")
    best = None
    for threshold in np.arange(0.40, 0.86, 0.025):
        groups = covered = anchors = with_groups = 0
        for v, p, c, t in eligible:
            gs, _ = mine_groups(v, t, c, float(threshold))
            used = {g.anchor_index for g in gs} | {j for g in gs for j in g.related_indices}
            groups += len(gs)
            covered += len(used)
            anchors += int((c >= threshold).sum())
            with_groups += bool(gs)
        cov = 100.0 * covered / n_pass
        print(f"{threshold:9.3f} {100.0 * anchors / n_pass:8.1f} {groups / max(with_groups, 1):10.2f} "
              f"{100.0 * with_groups / len(eligible):6.1f} {cov:9.1f}")
        if best is None or abs(cov - args.target_coverage) < abs(best[1] - args.target_coverage):
            best = (float(threshold), cov)
    print(f"closest to {args.target_coverage:.0f}% coverage: threshold {best[0]:.3f} ({best[1]:.1f}%)")


if __name__ == "__main__":
    main()
