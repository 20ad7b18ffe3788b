"""pairmine filter-pairs on real pairs built from ../shared/data/fiqa-pairs-beir: true (query, answer) pairs must be
kept far more often than shuffled ones (seed 004 chapter 1: the filter keeps pairs the model agrees with)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from pipeline.config import load_config
from pipeline.filter_pairs import filter_pairs

FIQA = Path(__file__).resolve().parents[2] / "shared" / "data" / "fiqa-pairs-beir"


def fiqa_pairs(n: int) -> tuple[list[dict], list[dict]]:
    corpus = {r["_id"]: r["text"] for r in map(json.loads, (FIQA / "corpus.jsonl").read_text().splitlines())}
    queries = {r["_id"]: r["text"] for r in map(json.loads, (FIQA / "queries.jsonl").read_text().splitlines())}
    qrels = [line.split("\t")[:2] for line in (FIQA / "qrels" / "test.tsv").read_text().splitlines()[1:]][:n]
    true = [{"id": f"true-{i}", "query": queries[q], "passage": corpus[c]} for i, (q, c) in enumerate(qrels)]
    passages = [p["passage"] for p in true]
    random.Random(0).shuffle(passages)
    shuffled = [{"id": f"shuffled-{i}", "query": t["query"], "passage": p} for i, (t, p) in enumerate(zip(true, passages))]
    return true, shuffled


@pytest.fixture(scope="module")
def fiqa_run(tmp_path_factory):
    if not FIQA.exists():
        pytest.skip(f"{FIQA} is not there")
    d = tmp_path_factory.mktemp("fiqa")
    true, shuffled = fiqa_pairs(400)
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in true + shuffled))
    cfg = load_config(overrides=[f"input.path={d / 'pairs.jsonl'}", f"output.path={d / 'runs'}", "output.run_id=fiqa",
                                 "consistency.side_output=true"])
    return filter_pairs(cfg), d / "runs" / "fiqa"


def test_true_pairs_are_kept_far_more_often_than_shuffled(fiqa_run):
    result, run = fiqa_run
    kept = pads.dataset(str(run / "pairs"), format="parquet").to_table().to_pylist()
    dropped = pads.dataset(str(run / "dropped"), format="parquet").to_table().to_pylist()

    def rate(prefix):
        k = sum(r["pair_id"].startswith(prefix) for r in kept)
        return k / (k + sum(r["pair_id"].startswith(prefix) for r in dropped))

    # Measured with all-MiniLM-L6-v2 (pool = the 800 pairs' passages, k = 2): ~30% of true pairs kept, 0% of shuffled.
    assert rate("true-") >= 0.2
    assert rate("shuffled-") <= 0.02
    assert rate("true-") >= 10 * max(rate("shuffled-"), 0.001)
    assert all(r["n_above"] < 2 for r in kept) and all(r["n_above"] >= 2 for r in dropped)


def test_stats_and_layout(fiqa_run):
    result, run = fiqa_run
    s = result.stats
    assert s["pairs_in"] == 800 and s["reconciled"]
    assert s["pairs_in"] == s["pairs_kept"] + s["pairs_dropped_consistency"] + s["pairs_skipped_total"]
    assert s["pool_size"] == 800 - s["pairs_skipped"]["empty_passage"]  # the usable pairs' passages
    assert sum(s["n_above_histogram"]["counts"]) == s["pairs_kept"] + s["pairs_dropped_consistency"]
    assert sorted(p.name for p in run.iterdir()) == ["_SUCCESS", "dropped", "manifest.json", "pairs", "stats.json"]
    m = json.loads((run / "manifest.json").read_text())
    assert m["job"] == "filter-pairs" and m["consistency"]["pool_source"] == "the input pairs' passages"


def test_cli_bad_pairs(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"question": "q", "passage": "p"}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "filter-pairs", "--input", str(tmp_path / "p.jsonl"),
                           "--output", str(tmp_path / "runs")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "has no column 'query'" in proc.stderr and "Traceback" not in proc.stderr
