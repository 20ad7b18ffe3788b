"""Measure how the anchor threshold shapes the groups on a corpus, to choose a model's default threshold.

Embeds the whole input once (in this process, with pairmine's own operators, through ``pipeline.calibrate``: the
code of ``pairmine calibrate``), then for each threshold prints the anchor rate, groups per document, % of eligible
documents (>= n_related + 1 passages) with groups and the passage coverage over eligible documents (passages used as
anchor or related / their passages) and over all passages (stats.json's passage_coverage_pct). The default threshold
of the default model was chosen with this script as the one that reproduces the paper's 68% passage coverage over
eligible documents (seed 000). ``pairmine calibrate`` does the same on a seeded sample and proposes a threshold.

    python benchmarks/threshold_sweep.py [--input PATH] [--model PATH] [--prefix P] [--target-coverage 68]
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="", help="parquet/JSONL file, folder or glob (default: the shipped sample)")
    ap.add_argument("--model", default="", help="model folder or hub id (default: all-MiniLM-L6-v2)")
    ap.add_argument("--prefix", default=None, help='passage prefix (default: "passage: " for E5 model names, else "")')
    ap.add_argument("--target-coverage", type=float, default=68.0, help="passage coverage to aim for, in %% (paper: 68)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from pairmine.pipeline.calibrate import embed_documents, propose_threshold, sample_texts, sweep_row
    from pairmine.pipeline.config import MineConfig

    cfg = MineConfig()
    cfg.input.path, cfg.embed.model, cfg.embed.passage_prefix = args.input, args.model, args.prefix
    texts = sample_texts(cfg.input.path, cfg.input.text_column, cfg.input.id_column, 10**9, 0)  # every document
    docs = embed_documents(texts, cfg.validate())
    eligible = [d for d in docs if d.eligible]
    print(f"{len(docs)} documents, {sum(len(d.passages) for d in docs)} passages; {len(eligible)} eligible documents "
          f"(>= {cfg.related.n_related + 1} passages) with {sum(len(d.passages) for d in eligible)} passages")
    print(f"{'threshold':>9} {'anchor%':>8} {'groups/doc':>10} {'docs%':>6} {'coverage%':>9} {'cov%(all)':>9}")
    for threshold in np.arange(0.40, 0.86, 0.025):
        r = sweep_row(docs, float(threshold))
        anchors_eligible = sum(int((d.centrality >= threshold).sum()) for d in eligible)
        print(f"{threshold:9.3f} {100.0 * anchors_eligible / max(1, sum(len(d.passages) for d in eligible)):8.1f} "
              f"{r.groups_per_doc:10.2f} {r.docs_with_groups_pct_of_eligible:6.1f} {r.coverage_eligible_pct:9.1f} "
              f"{r.coverage_pct:9.1f}")
    best = propose_threshold(docs, args.target_coverage, basis="eligible")
    print(f"closest to {args.target_coverage:.0f}% coverage of eligible documents' passages: threshold "
          f"{best.threshold} ({best.coverage_eligible_pct:.1f}%); over all passages: "
          f"{propose_threshold(docs, args.target_coverage, basis='all').threshold}")


if __name__ == "__main__":
    main()
