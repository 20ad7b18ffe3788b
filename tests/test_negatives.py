"""``pairmine negatives`` (issue 11; seed 004 chapter 3; SPEC "Hard negatives and distillation"): the rank window and
drop rules by hand, the faiss indexes' recall, a run on the tiny mine run with a tiny cross-encoder teacher, and the
false-negative check on fiqa-pairs-beir with the default model (the top of the retrieved list holds more judged-
relevant passages than the default window)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairmine.operators.chunk import chunk_text
from pairmine.pipeline.config import run_token_limit
from pairmine.operators.negatives import TeacherScores, select_negatives

FIQA = Path(__file__).parent / "data" / "fiqa-pairs-beir"


def _distinct(corpus: list[tuple[str, str]]) -> tuple[list[str], np.ndarray]:
    """The (document id, passage) pairs of a corpus as the corpus pass indexes them (``negatives.dedupe_corpus``):
    each passage text once, its document hash the smallest among its copies' documents."""
    from pairmine.operators.consistency import doc_hash

    docs: dict[str, int] = {}
    for i, p in corpus:
        docs[p] = min(docs.get(p, doc_hash(i)), doc_hash(i))
    return list(docs), np.array(list(docs.values()), np.int64)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "negatives", *args], capture_output=True,
                          text=True, timeout=900)


def test_rank_window_and_drop_reasons_by_hand():
    # Retrieved list, best first: corpus rows and cosines; -1 is faiss's padding. Row 3 holds the positive's text,
    # row 7 is a passage of the pair's own document.
    ids = np.array([5, 3, 7, 2, 9, 1, 4, -1])
    scores = np.array([0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.0])
    text_hashes = np.arange(10) * 10
    text_hashes[3] = 777
    doc_hashes = np.arange(10) + 100
    doc_hashes[7] = 42
    window = dict(positive_text_hash=777, positive_doc_hash=42, positive_score=0.9, rank_start=3, rank_end=6, count=2)
    kept, drops = select_negatives(ids, scores, text_hashes, doc_hashes, **window)
    assert kept == [3, 4]  # rows 2 and 9, at ranks 4 and 5
    assert drops == Counter(before_window=1, positive_duplicate=1, same_document=1, beyond_count=1, after_window=1)
    # margin 0.25: candidates above 0.9 - 0.25 = 0.65 go (row 2 at 0.7); rows 9 and 1 take the two places.
    kept, drops = select_negatives(ids, scores, text_hashes, doc_hashes, **window, margin=0.25)
    assert kept == [4, 5] and drops["above_margin"] == 1 and drops["beyond_count"] == 0
    # relative margin 0.7: above 0.7 * 0.9 = 0.63 goes (row 2 again).
    kept, drops = select_negatives(ids, scores, text_hashes, doc_hashes, **window, relative_margin=0.7)
    assert kept == [4, 5] and drops["above_relative_margin"] == 1
    # Plain pairs have no document: row 7 is then an ordinary candidate at rank 3.
    kept, _ = select_negatives(ids, scores, text_hashes, doc_hashes, **{**window, "positive_doc_hash": None})
    assert kept == [2, 3]
    # Every retrieved candidate is kept or counted once.
    assert len(kept) + sum(drops.values()) == 7
    # A passage with the query's own text (row 2 here) is not a negative of it.
    kept, drops = select_negatives(ids, scores, text_hashes, doc_hashes, **window, query_text_hash=20)
    assert kept == [4, 5] and drops["query_duplicate"] == 1
    # A corpus that repeats a passage: row 9 has row 2's text (ranks 4 and 5); it is kept once, and row 1 takes the
    # second place.
    repeated = text_hashes.copy()
    repeated[9] = repeated[2]
    kept, drops = select_negatives(ids, scores, repeated, doc_hashes, **window)
    assert kept == [3, 5] and drops["negative_duplicate"] == 1 and drops["beyond_count"] == 0
    assert len(kept) + sum(drops.values()) == 7


def test_approximate_indexes_report_their_recall_against_exact_search():
    from pairmine.pipeline.negatives import build_index, measure_recall

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(20, 32))
    x = centres[rng.integers(20, size=4000)] + 0.3 * rng.normal(size=(4000, 32))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    flat, desc = build_index(x, "flat")
    assert desc == "exact (faiss IndexFlatIP)" and measure_recall(flat, x, 50, 100) == 1.0
    for kind in ("ivf", "hnsw"):
        index, desc = build_index(x, kind, nprobe=8, ef_search=128)
        assert desc.startswith("approximate")
        recall = measure_recall(index, x, 50, 100)
        assert 0.5 < recall <= 1.0, (kind, recall)
    ivf, desc = build_index(x, "ivf", nprobe=1)
    assert "nlist 102" in desc  # 4 sqrt(4000) = 252, capped at 4000 / 39 = 102 lists
    assert measure_recall(ivf, x, 50, 100) < measure_recall(build_index(x, "ivf", nprobe=102)[0], x, 50, 100) == 1.0
    # A shard of one passage (negatives.index_shards above the corpus size) is searched exactly, and says so.
    assert build_index(x[:1], "ivf")[1] == "exact (faiss IndexFlatIP); negatives.index = ivf needs 2 or more " \
        "passages a shard"


def test_shard_by_shard_search_is_the_search_of_the_whole_corpus():
    """The corpus split into index shards, searched shard by shard with the candidate lists merged, gives the same
    candidates, scores and negatives as one index over the whole corpus (random vectors: no two scores tie)."""
    import faiss

    from pairmine.operators.consistency import doc_hash
    from pairmine.operators.negatives import SearchShard, SelectNegatives, merge_candidates, text_hash
    from pairmine.pipeline.negatives import build_index

    # By hand: a = rows 4, 9 (0.8, 0.5); b = rows 1, 7, 2 (0.8, 0.6, 0.1); depth 3 -> 0.8 (row 1, the lower row of
    # the tie), 0.8 (row 4), 0.6 (row 7); row 2 and the padding (-1) are left out.
    order, scores = merge_candidates(np.array([4, 9]), np.array([0.8, 0.5], np.float32), np.array([1, 7, 2, -1]),
                                     np.array([0.8, 0.6, 0.1, 0.0], np.float32), 3)
    assert order.tolist() == [2, 0, 3] and scores.tolist() == pytest.approx([0.8, 0.8, 0.6])

    rng = np.random.default_rng(1)
    n, dim, queries = 900, 48, 40
    x = rng.normal(size=(n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    texts = [f"passage {i}" for i in range(n)]
    text_hashes = np.array([text_hash(t) for t in texts], np.int64)
    doc_hashes = np.array([doc_hash(str(i // 3)) for i in range(n)], np.int64)  # three passages per document
    q = x[:queries] + 0.5 * rng.normal(size=(queries, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    vec = lambda m: pa.FixedSizeListArray.from_arrays(pa.array(m.ravel()), dim)  # noqa: E731
    batch = pa.table({"pair_id": [str(i) for i in range(queries)], "doc_id": [str(i // 3) for i in range(queries)],
                      "query": [f"q{i}" for i in range(queries)], "passage": texts[:queries],
                      "skip_reason": pa.array([None] * (queries - 1) + ["empty"], pa.string()),
                      "query_vector": vec(q), "passage_vector": vec(x[:queries])})

    def shard(lo, hi):
        blob = faiss.serialize_index(build_index(np.ascontiguousarray(x[lo:hi]), "flat")[0])
        return lambda: (blob, text_hashes[lo:hi], doc_hashes[lo:hi], pa.array(texts[lo:hi]))

    select = SelectNegatives(rank_start=5, rank_end=150, count=10)
    whole = SearchShard(shard(0, n), 0, depth=150)(batch)
    merged = batch
    for lo, hi in ((0, 250), (250, 700), (700, n)):  # uneven shards
        merged = SearchShard(shard(lo, hi), lo, depth=150)(merged)
    assert merged.column("cand_ids").to_pylist() == whole.column("cand_ids").to_pylist()
    assert merged.column("cand_texts").to_pylist() == whole.column("cand_texts").to_pylist()
    assert np.allclose(np.array(merged.column("cand_scores").to_pylist()[:-1]),
                       np.array(whole.column("cand_scores").to_pylist()[:-1]), atol=1e-6)
    assert merged.column("cand_ids").to_pylist()[-1] is None  # a skipped pair is not searched
    # The list is the brute-force top 150 by cosine.
    truth = np.argsort(-(q[:-1] @ x.T), axis=1)[:, :150]
    assert np.array(merged.column("cand_ids").to_pylist()[:-1]).tolist() == truth.tolist()
    # The torch engine (a GPU's exact search; here on the CPU) finds the same lists, shard by shard.
    with_torch = batch
    for lo, hi in ((0, 250), (250, 700), (700, n)):
        with_torch = SearchShard(shard(lo, hi), lo, depth=150, torch_device="cpu")(with_torch)
    assert with_torch.column("cand_ids").to_pylist() == whole.column("cand_ids").to_pylist()
    assert np.allclose(np.array(with_torch.column("cand_scores").to_pylist()[:-1]),
                       np.array(whole.column("cand_scores").to_pylist()[:-1]), atol=1e-6)
    from pairmine.operators.negatives import TorchFlatSearch

    small = TorchFlatSearch(x[:5], "cpu", chunk_mb=1e-4)  # 2 rows per chunk; fewer rows than k: faiss's padding
    scores, found = small.search(q[:2], 7)
    assert found[:, 5:].tolist() == [[-1, -1]] * 2 and np.isneginf(scores[:, 5:]).all()
    assert found[:, :5].tolist() == np.argsort(-(q[:2] @ x[:5].T), axis=1).tolist()
    # Equal scores (each vector four times, so ties straddle chunk cuts and the top-k cut): the lower row first.
    # Small integers, so that every dot product is exact in fp32 whatever order a kernel sums in (with real-valued
    # vectors, a CPU matmul over a 13-row chunk can round a repeated row's score differently by its place).
    ints = np.random.default_rng(1).integers(-3, 4, size=(62, x.shape[1])).astype(np.float32)
    tied, qi = np.repeat(ints[:60], 4, axis=0), ints[60:]  # rows 4j..4j+3 are ints[j]
    for chunk_mb in (1e-4, 4e-3, 256):  # 13, 524 and all 240 rows per chunk for 2 queries
        scores, found = TorchFlatSearch(tied, "cpu", chunk_mb=chunk_mb).search(qi, 10)
        want = np.argsort(-(qi @ tied.T), axis=1, kind="stable")[:, :10]
        assert found.tolist() == want.tolist(), chunk_mb
    a, b = select(merged).to_pylist(), select(whole).to_pylist()
    assert [r["negatives"] for r in a] == [r["negatives"] for r in b]
    assert [r["negative_ranks"] for r in a] == [r["negative_ranks"] for r in b]
    assert all(len(r["negatives"]) == 10 and min(r["negative_ranks"]) >= 5 for r in a[:-1])
    drops = json.loads(a[0]["drops"])  # the positive itself and rows of the query's own document are dropped
    assert drops["positive_duplicate"] > 0 and drops["same_document"] > 0


def test_split_passages_into_index_shards():
    from pairmine.pipeline.negatives import split_passages

    # 10 passages in two blocks, three shards of 3, 3 and 4 passages: the middle one spans both blocks.
    assert split_passages([5, 5], 3) == [[(0, 0, 3)], [(0, 3, 5), (1, 0, 1)], [(1, 1, 5)]]
    assert split_passages([5, 5, 5, 5], 2) == [[(0, 0, 5), (1, 0, 5)], [(2, 0, 5), (3, 0, 5)]]
    assert split_passages([5, 5], 1) == [[(0, 0, 5), (1, 0, 5)]]
    assert split_passages([2], 5) == [[(0, 0, 1)], [(0, 1, 2)]]  # no empty shard
    parts = split_passages([1024, 1024, 173], 4)
    assert [sum(hi - lo for _, lo, hi in p) for p in parts] == [555, 555, 555, 556]


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory) -> str:
    """A 2-layer cross-encoder (BERT, one output logit) with the real all-MiniLM-L6-v2 tokenizer, seeded weights."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from pairmine.operators.embed import default_model_path

    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def teacher_run(tiny_run, tiny_teacher, tmp_path_factory):
    """Negatives of the tiny mine run's groups, searched in its own input with HNSW, scored by the tiny teacher."""
    run_dir, _ = tiny_run
    tmp = tmp_path_factory.mktemp("negatives")
    proc = _cli("--input", str(run_dir), "--corpus", str(run_dir), "--output", str(tmp), "--run-id", "neg",
                "--teacher", tiny_teacher, "--set", "negatives.index=hnsw")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "neg", proc


def test_export_of_a_negatives_run_to_s3_has_one_column_per_negative(teacher_run, tiny_model_dir, s3_server,
                                                                       tmp_path):
    """Issue 41 item 5: (anchor, positive, negative_1..n) columns from a negatives run, written to S3; rows with
    fewer than n negatives are skipped and counted; sentence-transformers' MNRL trains on them as they are."""
    from pairmine.pipeline.cli import main
    from tests.conftest import Out
    from tests.test_export import _load, _st_step

    neg_dir, _ = teacher_run
    rows = pq.read_table(neg_dir / "negatives").to_pylist()
    o = Out(f"s3://pairmine-test/export-{tmp_path.name}", s3_server.endpoint)
    assert main(["export", str(neg_dir), o.path("st"), "--negatives", "3",
                 "--set", f"storage.endpoint_url={o.endpoint}"]) == 0
    manifest = o.json("st", "export_manifest.json")
    assert manifest["columns"] == ["anchor", "positive", "negative_1", "negative_2", "negative_3"]
    full = [r for r in rows if len(r["negatives"] or []) >= 3]
    assert manifest["rows"] == len(full) > 0 and sum(manifest["skipped"].values()) == len(rows) - len(full)
    table = o.storage.read_parquet(o.path("st", "data", "part-00000.parquet"))
    first = table.to_pylist()[0]
    assert first == {"anchor": full[0]["query"], "positive": full[0]["positive"],
                     **{f"negative_{i + 1}": full[0]["negatives"][i] for i in range(3)}}
    local = tmp_path / "from-s3"
    for name in ["README.md", "data/part-00000.parquet"]:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(o.storage.read_bytes(o.path("st", name)))
    loss, moved = _st_step(tiny_model_dir, _load(local), tmp_path)  # (anchor, positive, negative_1..3) as MNRL reads them
    assert math.isfinite(loss) and moved > 0
    (neg_dir / "README.md").read_text().index("    path: negatives/part-*.parquet")  # the run's own card


def test_negatives_of_a_mine_run_with_a_teacher(tiny_run, tiny_teacher, teacher_run):
    run_dir, _ = tiny_run
    out, proc = teacher_run
    assert (out / "_SUCCESS").exists() and sorted(p.name for p in (out / "negatives").iterdir()) == ["part-00000.parquet"]
    stats = json.loads((out / "stats.json").read_text())
    groups = pq.read_table(run_dir / "groups").to_pylist()
    rows = pq.read_table(out / "negatives").to_pylist()
    assert stats["reconciled"] and stats["pairs_in"] == stats["pairs_out"] == len(rows) == len(groups)
    assert stats["index"].startswith("approximate (faiss IndexHNSWFlat") and 0.9 <= stats["index_recall_at_depth"] <= 1
    assert "recall@200 against exact search" in proc.stderr
    # The tiny run's own input is the corpus, chunked as mined: map every passage to its documents.
    docs = pq.read_table(json.loads((run_dir / "manifest.json").read_text())["inputs"][0]["path"],
                         columns=["id", "text"]).to_pylist()
    limit = run_token_limit(json.loads((run_dir / "manifest.json").read_text()))  # the tiny model's 256 tokens
    assert limit is not None and limit.max_length == 256
    owners: dict[str, set] = {}
    for d in docs:
        for p in chunk_text(d["text"], token_limit=limit).passages:
            owners.setdefault(p, set()).add(d["id"])
    # Each distinct passage is embedded and indexed once (this shard repeats none across its documents).
    total = sum(len(chunk_text(d["text"], token_limit=limit).passages) for d in docs)
    assert stats["corpus_passages"] == len(owners) and stats["corpus_duplicates"] == total - len(owners)
    by_group = {g["group_id"]: g for g in groups}
    for r in rows:
        g = by_group[r["pair_id"]]
        assert (r["query"], r["positive"], r["doc_id"]) == (g["anchor_text"], g["related_texts"][0], g["doc_id"])
        assert len(r["negatives"]) == 7 and r["negative_ranks"] == sorted(r["negative_ranks"])
        assert all(31 <= k <= 200 for k in r["negative_ranks"])
        assert r["negative_scores"] == sorted(r["negative_scores"], reverse=True)
        assert r["positive"] not in r["negatives"] and len(set(r["negatives"])) == 7
        assert not any(g["doc_id"] in owners[n] and len(owners[n]) == 1 for n in r["negatives"])  # no own-doc passage
        assert len(r["negative_teacher_scores"]) == 7 and r["teacher"] == tiny_teacher
    dropped = stats["negatives_dropped"]
    assert stats["candidates_retrieved"] == stats["negatives"] + sum(dropped.values())
    # Where the time went: phases and Ray Data's per-stage figures, corpus pass first, then the pairs pass.
    assert list(stats["phases_s"]) == ["start", "corpus", "pairs_pass"]
    assert sum(stats["phases_s"].values()) <= stats["elapsed_s"] + 0.05
    names = [f["stage"] for f in stats["stages"]]
    assert names[0].startswith("corpus: ") and any("embed" in n for n in names if n.startswith("corpus: "))
    pairs_stages = [f for f in stats["stages"] if not f["stage"].startswith("corpus: ")]
    assert any("teacher" in f["stage"] for f in pairs_stages)
    # One index shard: the search actor selects too, so the candidate lists never leave it (no select stage).
    assert any(f["stage"] == "search_and_select" for f in pairs_stages), names
    assert not any("select" in f["stage"] for f in pairs_stages if f["stage"] != "search_and_select"), names
    assert pairs_stages[-1]["stage"].endswith("write_negatives") and pairs_stages[0]["rows_out"] == len(rows)
    assert all(f["tasks"] > 0 for f in stats["stages"]) and sum(f["busy_s"] for f in stats["stages"]) > 0
    assert "stage figures: " in proc.stderr and "phases (wall s): start " in proc.stderr
    assert dropped["positive_duplicate"] > 0  # the positive itself is in the corpus (when retrieved)
    assert dropped["same_document"] > 0 and dropped["before_window"] > 0
    # The stored teacher scores are the cross-encoder's logits for exactly those pairs.
    teacher = TeacherScores(tiny_teacher)
    first = rows[0]
    expected = teacher.score([first["query"]] * 8, [first["positive"], *first["negatives"]])
    assert np.allclose([first["positive_teacher_score"], *first["negative_teacher_scores"]], expected, atol=1e-4)


def test_positives_and_queries_found_in_the_corpus_are_not_embedded_again(tiny_run, teacher_run):
    """A positive (or a query, with equal query and passage prefixes) whose prefixed text is a corpus passage takes
    the corpus vector instead of a forward pass; the mined negatives are those of embedding everything."""
    import faiss

    from pairmine.operators.consistency import doc_hash
    from pairmine.operators.embed import Embedder, known_vectors
    from pairmine.operators.negatives import EmbedPairVectors, SearchShard, SelectNegatives, text_hash
    from pairmine.pipeline.negatives import build_index
    from tests.conftest import SCORE_ATOL

    run_dir, _ = tiny_run
    out, _ = teacher_run
    stats = json.loads((out / "stats.json").read_text())
    resolved = json.loads((out / "manifest.json").read_text())["resolved"]
    assert resolved["query_prefix"] == resolved["passage_prefix"]  # the tiny model's: queries can be reused too
    # Every positive (s1) and every query (the anchor) is a passage of the corpus (the run's own input).
    assert stats["vectors_reused"] == 2 * stats["pairs_out"]
    rows = pq.read_table(out / "negatives").to_pylist()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    embed = {k: manifest["config"]["embed"][k] for k in ("model", "max_length", "dtype")}
    embed["passage_prefix"] = resolved["passage_prefix"]
    docs = pq.read_table(manifest["inputs"][0]["path"], columns=["id", "text"]).to_pylist()
    corpus = [(d["id"], p) for d in docs for p in chunk_text(d["text"], token_limit=run_token_limit(manifest)).passages]
    texts = [p for _, p in corpus]
    vectors = Embedder(**embed).encode(texts)  # (N, dim)
    blob = faiss.serialize_index(build_index(vectors, "flat")[0])
    corpus_arrays = (blob, np.array([text_hash(t) for t in texts]), np.array([doc_hash(i) for i, _ in corpus]),
                     pa.array(texts))
    batch = pa.table({"pair_id": [r["pair_id"] for r in rows], "doc_id": [r["doc_id"] for r in rows],
                      "query": [r["query"] for r in rows],
                      # outer whitespace (a whole document as positive) leaves the input ids, so the key, as they are
                      "passage": [f" {r['positive']}\n" if k % 2 else r["positive"] for k, r in enumerate(rows)],
                      "skip_reason": pa.nulls(len(rows), pa.string())})
    known = known_vectors([resolved["passage_prefix"] + t for t in texts], vectors)
    mined = {}
    for name, lookup in (("reused", lambda: known), ("embedded", None)):
        embedded = EmbedPairVectors(resolved["query_prefix"], lookup, **embed)(batch)
        mined[name] = SelectNegatives()(SearchShard(lambda: corpus_arrays)(embedded)).to_pylist()
        assert sum(r["vectors_reused"] for r in mined[name]) == (2 * len(rows) if lookup else 0)
    for a, b, run_row in zip(mined["reused"], mined["embedded"], rows):
        assert (a["negatives"], a["negative_ranks"]) == (b["negatives"], b["negative_ranks"])
        assert np.allclose(a["negative_scores"], b["negative_scores"], atol=SCORE_ATOL)
        # The run's cos(query, positive), from corpus vectors, is that of vectors embedded afresh.
        assert a["positive_score"] == pytest.approx(b["positive_score"], abs=SCORE_ATOL)
        assert run_row["positive_score"] == pytest.approx(b["positive_score"], abs=SCORE_ATOL)


def test_passage_keys_claim_each_text_once_and_keep_the_smallest_document():
    """The corpus pass's de-duplication set (one PassageKeys actor per key range), by hand: a key is claimed by its
    first copy only, within a call and across calls; a key's document is the smallest among its copies'."""
    from pairmine.operators.negatives import PassageKeys

    keys = PassageKeys()
    assert keys.claim(np.array([5, 3, 5, 9]), np.array([50, 30, 40, 90])).tolist() == [True, True, False, True]
    assert keys.claim(np.array([3, 7, 9, 9]), np.array([10, 70, 95, 80])).tolist() == [False, True, False, False]
    assert keys.documents(np.array([5, 3, 9, 7])).tolist() == [40, 10, 80, 70]
    assert keys.count() == (4, 4)
    rng = np.random.default_rng(0)
    many, seen = rng.integers(-1000, 1000, 5000), PassageKeys()
    first = np.concatenate([seen.claim(part, part * 2) for part in np.array_split(many, 7)])
    assert first.sum() == len(np.unique(many)) == seen.count()[0] and np.array_equal(seen.keys, np.unique(many))
    assert np.array_equal(np.unique(many[first]), np.unique(many))  # every distinct key claimed exactly once


def test_outer_trim_and_lookup_forms():
    """A text is looked up without its outer spaces and invisible characters only where the tokenizer gives the same
    input ids (so the same vector): a BOM or a zero-width space before a positive (fiqa has one) leaves them."""
    from transformers import AutoTokenizer

    from pairmine.operators.embed import default_model_path
    from pairmine.operators.negatives import lookup_forms, outer_trim

    assert outer_trim(" \u200bYes. ") == "Yes." and outer_trim("\ufeff a\u00a0b\u00a0\n") == "a\u00a0b"
    assert outer_trim("\u200b \t") == "" and outer_trim("inner\u200bspace") == "inner\u200bspace"
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    texts = [" \u200bEstimated costs ", "plain", "\ufeffBOM first", " \t "]
    assert lookup_forms(tokenizer, 256, texts, "query: ") == ["Estimated costs", "plain", "BOM first", " \t "]
    ids = tokenizer(["query: " + t for t in texts[:3]])["input_ids"]
    assert ids == tokenizer(["query: Estimated costs", "query: plain", "query: BOM first"])["input_ids"]
    assert lookup_forms(tokenizer, 256, ["same"], "") == ["same"]
    # A positive with invisible characters at its ends is its own corpus passage for "positive_duplicate"
    from pairmine.operators.negatives import text_hash

    assert text_hash("\x00I finally got one.\u2060") == text_hash(" \u200bI  finally got ONE.\ufeff") == \
        text_hash("I finally got one.") != text_hash("I finally got one")


def test_a_default_model_mine_run_gives_negatives_its_own_embed_settings(tiny_run, tmp_path):
    """A mine run made with the default model (``embed.model`` recorded as "") still lends its prefixes, dtype and
    max_length to ``negatives --input RUN`` when the negatives config sets no model."""
    import shutil

    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.config import load_negatives_config
    from pairmine.pipeline.negatives import resolve_input

    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["embed"].update(model="", query_prefix="query: ", passage_prefix="passage: ", dtype="float32",
                                       max_length=128)
    (run / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_negatives_config(overrides=[f"input.path={run}"])
    assert resolve_input(cfg, LOCAL)[0] == "groups"
    e = cfg.embed
    assert (e.model, e.query_prefix, e.passage_prefix, e.dtype, e.max_length) == ("", "query: ", "passage: ",
                                                                                  "float32", 128)


def test_the_corpus_pass_embeds_query_rows_with_the_query_prefix(tiny_model_dir):
    """EmbedCorpus: corpus rows get the passage prefix, query rows the query prefix and their lookup form; every
    vector is the one the Embedder gives the same prefixed text."""
    from pairmine.operators.embed import Embedder, vector_matrix
    from pairmine.operators.negatives import EmbedCorpus

    kw = dict(model=str(tiny_model_dir), dtype="float32", device="cpu")
    op = EmbedCorpus("query: ", passage_prefix="passage: ", **kw)
    batch = pa.table({"passages": [["The mill by the river.", "Corn prices rose."], [" \u200bwhere is the mill? "]],
                      "hashes": [[1, 1], [0]], "query_rows": [False, True]})
    out = op(batch)
    assert out.column("passages").to_pylist() == [["The mill by the river.", "Corn prices rose."],
                                                 ["where is the mill?"]]
    got, offsets = vector_matrix(out.column("vectors"))
    assert offsets.tolist() == [0, 2, 3]
    reference = Embedder(passage_prefix="passage: ", **kw)
    want = np.concatenate([reference.encode(["The mill by the river.", "Corn prices rose."]),
                           reference.encode(["where is the mill?"], prefix="query: ")])
    assert np.abs(got - want).max() < 1e-6
    assert np.abs(got[2] - reference.encode(["where is the mill?"])[0]).max() > 1e-3  # the prefix counts
    assert out.column("alias_keys").to_pylist() == [[], ["query:  \u200bwhere is the mill? "]]
    assert out.column("alias_targets").to_pylist() == [[], ["query: where is the mill?"]]


def test_the_pairs_pass_finds_texts_by_their_aliases_without_a_tokenizer(tiny_model_dir, tmp_path):
    """The corpus pass stores each query's and positive's lookup form as an alias (raw prefixed text -> the form's
    key) in the index shard's ``known`` lookup; a pairs-pass actor given that lookup takes a query and a positive
    written with outer whitespace from it, in a process that imports neither transformers nor torch. A positive
    not in the corpus has no alias and is embedded (with the model) as before."""
    import subprocess
    import sys

    from pairmine.operators.embed import Embedder
    from pairmine.operators.negatives import EmbedCorpus
    from pairmine.pipeline.negatives import build_index_shard

    kw = dict(model=str(tiny_model_dir), dtype="float32", device="cpu")
    query, positive = " \u200bwhere is the mill? ", " The mill by the river.\n"
    batch = pa.table({"passages": [["The mill by the river.", "Corn prices rose."], [query]], "hashes": [[1, 1], [0]],
                      "query_rows": [False, True], "positives": [[], [positive, "Not in the corpus."]]})
    out = EmbedCorpus("query: ", passage_prefix="passage: ", **kw)(batch)
    assert "positives" not in out.column_names
    assert out.column("alias_keys").to_pylist()[1] == ["query: " + query, "passage: " + positive]
    assert out.column("alias_targets").to_pylist()[1] == ["query: where is the mill?",
                                                          "passage: The mill by the river."]
    _, info, (keys, rows, vectors) = build_index_shard("flat", 1, 1, 10, 0, "passage: ", "query: ", None, [(0, 2)],
                                                       out)
    assert info["passages"] == 2 and len(keys) == 5 and sorted(rows.tolist()) == [0, 0, 1, 2, 2]
    np.savez(tmp_path / "known.npz", keys=keys, rows=rows, vectors=vectors)
    pq.write_table(pa.table({"query": [query, query], "passage": [positive, "Not in the corpus."],
                             "skip_reason": pa.nulls(2, pa.string())}), tmp_path / "pairs.parquet")
    probe = f"""
import sys, numpy as np, pyarrow.parquet as pq
from pairmine.operators.negatives import EmbedPairVectors
z = np.load({str(tmp_path / "known.npz")!r})
op = EmbedPairVectors("query: ", lambda: (z["keys"], z["rows"], z["vectors"]), model={str(tiny_model_dir)!r},
                      passage_prefix="passage: ", dtype="float32", device="cpu")
op.setup()
first = op(pq.read_table({str(tmp_path / "pairs.parquet")!r}).slice(0, 1))
print(first.column("vectors_reused").to_pylist()[0], "transformers" in sys.modules, "torch" in sys.modules)
both = op(pq.read_table({str(tmp_path / "pairs.parquet")!r}))
print(both.column("vectors_reused").to_pylist(), "transformers" in sys.modules)
np.save({str(tmp_path / "vectors.npy")!r}, np.stack([np.stack(both.column(c).to_pylist()) for c in
                                                     ("query_vector", "passage_vector")]))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["2 False False", "[2, 1] True"]
    got = np.load(tmp_path / "vectors.npy")  # (query/passage, pair, dim)
    reference = Embedder(passage_prefix="passage: ", **kw)
    assert np.abs(got[0] - reference.encode(["where is the mill?"] * 2, prefix="query: ")).max() < 1e-6
    assert np.abs(got[1] - reference.encode(["The mill by the river.", "Not in the corpus."])).max() < 1e-6


def test_model_dim_reads_a_local_config_as_json(tiny_model_dir, tmp_path):
    """The driver reads a local model folder's config.json without importing transformers (2.9 s on this machine);
    the size is the one transformers reports, also where the config names it otherwise (DistilBERT's ``dim``) or
    leaves it to the model type's default."""
    import subprocess
    import sys

    from transformers import AutoConfig

    from pairmine.pipeline.config import load_negatives_config
    from pairmine.pipeline.negatives import model_dim

    def size(folder):
        return model_dim(load_negatives_config(overrides=[f"embed.model={folder}"]))

    assert size(tiny_model_dir) == AutoConfig.from_pretrained(str(tiny_model_dir)).hidden_size
    probe = ("import sys; from pairmine.pipeline.config import load_negatives_config; "
             "from pairmine.pipeline.negatives import model_dim; "
             f"print(model_dim(load_negatives_config(overrides=['embed.model={tiny_model_dir}'])), "
             "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == [str(size(tiny_model_dir)), "False"]
    for config in ({"model_type": "distilbert", "dim": 48, "n_heads": 4}, {"model_type": "bert"}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert size(tmp_path) == AutoConfig.from_pretrained(str(tmp_path)).hidden_size
    assert size(tmp_path) == 768  # bert's default


def test_queries_embedded_with_the_corpus_leave_the_pairs_pass_without_a_model(tiny_run, tiny_model_dir, tmp_path):
    """Plain pairs whose queries are not corpus passages: the corpus pass embeds them (query prefix "query: "), the
    pairs pass takes every query and positive vector from the index shard (the positives are corpus passages written
    with outer whitespace and a zero-width space) and embeds nothing. The corpus holds 15 of its documents twice
    (a second file, new ids): their passages are embedded and indexed once. The negatives are those of embedding every
    pair afresh, in-process, against the distinct passages."""
    import faiss

    from pairmine.operators.embed import Embedder
    from pairmine.operators.negatives import EmbedPairVectors, SearchShard, SelectNegatives, text_hash
    from pairmine.pipeline.negatives import build_index
    from tests.conftest import SCORE_ATOL

    run_dir, _ = tiny_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    docs = pq.read_table(manifest["inputs"][0]["path"], columns=["id", "text"]).to_pylist()
    limit = run_token_limit(manifest)
    copies = [{"id": f"{d['id']}-copy", "text": d["text"]} for d in docs[:15]]
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "corpus" / "a.parquet")
    pq.write_table(pa.Table.from_pylist(copies), tmp_path / "corpus" / "b.parquet")
    bad = pa.table({"id": ["n1", None, "n3", "n4", "n5"], "text": [None, "A document without an id, long enough.",
                                                                   " \u200b ", "Too short.", "\n"]})
    pq.write_table(bad, tmp_path / "corpus" / "c.parquet")  # documents skipped, each counted by its reason
    corpus = [(d["id"], p) for d in docs + copies for p in chunk_text(d["text"], token_limit=limit).passages]
    picked = corpus[::40][:12]
    pairs = pa.table({"id": [f"q{k}" for k in range(len(picked))],
                      "query": [f"what does this say: {' '.join(p.split()[:6][::-1])}?" for _, p in picked],
                      "passage": [(" \u200b" if k % 2 else " ") + p + "\n" for k, (_, p) in enumerate(picked)]})
    pq.write_table(pairs, tmp_path / "pairs.parquet")
    proc = _cli("--input", str(tmp_path / "pairs.parquet"), "--corpus", str(tmp_path / "corpus"), "--output",
                str(tmp_path),
                "--run-id", "plain", "--set", f"embed.model={tiny_model_dir}", "--set", "embed.dtype=float32",
                "--set", "embed.query_prefix=query: ", "--set", "negatives.rank_start=3",
                "--set", "negatives.rank_end=40", "--set", "negatives.depth=40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads((tmp_path / "plain" / "stats.json").read_text())
    assert stats["reconciled"] and stats["pairs_out"] == len(picked)
    assert stats["queries_embedded_with_corpus"] == len(picked)
    assert stats["vectors_reused"] == 2 * len(picked)  # nothing embedded in the pairs pass
    texts, doc_hashes = _distinct(corpus)
    copied = sum(len(chunk_text(d["text"], token_limit=limit).passages) for d in copies)
    assert stats["corpus_passages"] == len(texts) and stats["corpus_duplicates"] == len(corpus) - len(texts) == copied
    assert stats["corpus_docs_skipped"] == {"empty_text": 1, "no_passage": 2, "null_id": 1, "null_text": 1}
    assert f"({copied} exact copies of another dropped) and {len(picked)} queries embedded and indexed" in proc.stderr
    rows = {r["pair_id"]: r for r in pq.read_table(tmp_path / "plain" / "negatives").to_pylist()}
    resolved = json.loads((tmp_path / "plain" / "manifest.json").read_text())["resolved"]
    assert resolved["query_prefix"] == "query: " != resolved["passage_prefix"]
    embed = dict(model=str(tiny_model_dir), dtype="float32", passage_prefix=resolved["passage_prefix"])
    blob = faiss.serialize_index(build_index(Embedder(**embed).encode(texts), "flat")[0])
    arrays = (blob, np.array([text_hash(t) for t in texts]), doc_hashes, pa.array(texts))
    batch = pairs.rename_columns(["pair_id", "query", "passage"]).append_column(
        "doc_id", pa.nulls(len(picked), pa.string())).append_column("skip_reason", pa.nulls(len(picked), pa.string()))
    want = SelectNegatives(3, 40, 7)(SearchShard(lambda: arrays, depth=40)(
        EmbedPairVectors("query: ", **embed)(batch))).to_pylist()
    for w in want:
        got = rows[w["pair_id"]]
        assert got["positive_score"] == pytest.approx(w["positive_score"], abs=SCORE_ATOL)
        assert np.allclose(got["negative_scores"], w["negative_scores"], atol=SCORE_ATOL)
        assert len(got["negatives"]) == len(w["negatives"]) == 7


@pytest.mark.slow  # ~1.5 min on CI; shard-by-shard search equals whole-corpus search in the default run
def test_a_sharded_index_finds_the_negatives_of_one_index(tiny_run, tmp_path):
    """negatives.index_shards=3: the corpus index is built by three Ray tasks from the embedded blocks (no corpus
    passage in the driver) and searched by three search actors in a chain; the negatives are those of one exact
    index over the whole corpus, computed here in-process."""
    import faiss

    from pairmine.operators.embed import Embedder
    from pairmine.operators.negatives import EmbedPairVectors, SearchShard, SelectNegatives, text_hash
    from pairmine.pipeline.negatives import build_index
    from tests.conftest import SCORE_ATOL

    run_dir, _ = tiny_run
    proc = _cli("--input", str(run_dir), "--corpus", str(run_dir), "--output", str(tmp_path), "--run-id", "sharded",
                "--set", "negatives.index_shards=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "sharded"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["reconciled"] and stats["pairs_out"] == len(pq.read_table(run_dir / "groups"))
    assert stats["index"].startswith("exact (faiss IndexFlatIP), 3 shards of ")
    assert stats["vectors_reused"] == 0  # with several shards every query and positive is embedded
    assert stats["queries_embedded_with_corpus"] == 0  # and the corpus pass embeds no query
    names = [f["stage"] for f in stats["stages"]]  # the chain of three search actors, then the select stage
    assert [n for n in names if n.startswith("search")] == ["search_shard_0", "search_shard_1", "search_shard_2"]
    assert any(n.split("+")[0] == "select" for n in names), names
    rows = pq.read_table(out / "negatives").to_pylist()
    # One exact index over the whole corpus, in-process, on the same queries.
    manifest = json.loads((run_dir / "manifest.json").read_text())
    embed = {k: manifest["config"]["embed"][k] for k in ("model", "max_length", "dtype")}
    docs = pq.read_table(manifest["inputs"][0]["path"], columns=["id", "text"]).to_pylist()
    corpus = [(d["id"], p) for d in docs for p in chunk_text(d["text"], token_limit=run_token_limit(manifest)).passages]
    texts, doc_hashes = _distinct(corpus)
    assert stats["corpus_passages"] == len(texts) and stats["corpus_duplicates"] == len(corpus) - len(texts)
    blob = faiss.serialize_index(build_index(Embedder(**embed).encode(texts), "flat")[0])
    arrays = (blob, np.array([text_hash(t) for t in texts]), doc_hashes, pa.array(texts))
    batch = pa.table({"pair_id": [r["pair_id"] for r in rows], "doc_id": [r["doc_id"] for r in rows],
                      "query": [r["query"] for r in rows], "passage": [r["positive"] for r in rows],
                      "skip_reason": pa.nulls(len(rows), pa.string())})
    expected = SelectNegatives()(SearchShard(lambda: arrays)(EmbedPairVectors(**embed)(batch))).to_pylist()
    # The tiny model's cosines all lie near 0.99, so two candidates' scores may tie to within the ~1e-7 by which a
    # query vector embedded in another batch differs (SCORE_ATOL): such a pair may swap ranks, which may move a
    # negative by a rank or trade it for its near-tie. At every kept place the score is the same, and the rest of
    # the rows are identical.
    same = 0
    for got, want in zip(rows, expected):
        assert got["positive_score"] == pytest.approx(want["positive_score"], abs=SCORE_ATOL)
        assert len(got["negatives"]) == len(want["negatives"]) == 7
        assert np.allclose(got["negative_scores"], want["negative_scores"], atol=SCORE_ATOL)
        same += (got["negatives"], got["negative_ranks"]) == (want["negatives"], want["negative_ranks"])
    assert same >= 0.98 * len(rows), (same, len(rows))


@pytest.mark.slow  # ~1.5 min on CI: Ray Train end to end; distillation's loss is tested in test_distill
def test_train_on_negatives_with_teacher_scores(teacher_run, tiny_model_dir, tmp_path):
    """pairmine train --negatives: grouped batches (G x (1 + H)), alpha InfoNCE + (1 - alpha) KL, on Ray Train."""
    out, _ = teacher_run
    proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "train", "--negatives", str(out), "--output",
                           str(tmp_path / "train"), "--model", tiny_model_dir, "--set", "scaling.num_workers=2",
                           "--set", "train.batch_size=4", "--set", "train.max_steps=2", "--set", "train.max_length=64",
                           "--set", "distill.alpha=0.25"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "teacher scores: yes" in proc.stderr and "1 positive + 7 hard negatives each" in proc.stderr
    metrics = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["l_kl"] > 0 and m["l_nce"] > 0 and m["groups"] == 4
        assert m["loss"] == pytest.approx(0.25 * m["l_nce"] + 0.75 * m["l_kl"], abs=2e-5)
    manifest = json.loads((tmp_path / "train" / "train_manifest.json").read_text())
    assert manifest["objective"] == "negatives" and manifest["negatives"]["teacher"] is True
    assert (tmp_path / "train" / "export" / "config.json").exists()


def test_bad_input_is_one_line(tiny_run, tiny_model_dir, tmp_path):
    run_dir, _ = tiny_run
    proc = _cli("--input", str(run_dir), "--corpus", str(tmp_path / "nowhere"), "--output", str(tmp_path))
    assert proc.returncode == 2 and "pairmine: error: negatives.corpus (--corpus): input" in proc.stderr
    proc = _cli("--input", str(run_dir), "--corpus", str(run_dir), "--set", "negatives.rank_start=0")
    assert proc.returncode == 2 and "negatives.rank_start = 0 is not allowed" in proc.stderr
    proc = _cli("--input", str(run_dir), "--corpus", str(run_dir), "--teacher", str(tmp_path / "no-model"),
                "--output", str(tmp_path))
    assert proc.returncode == 2 and f"negatives.teacher = '{tmp_path / 'no-model'}' does not exist" in proc.stderr
    # An encoder saved with a one-logit config: no trained classification head, so its scores would be noise.
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    AutoModel.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "encoder")
    config.save_pretrained(tmp_path / "encoder")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "encoder")
    proc = _cli("--input", str(run_dir), "--corpus", str(run_dir), "--teacher", str(tmp_path / "encoder"),
                "--output", str(tmp_path))
    assert proc.returncode == 2 and "lacks trained weights for classifier.bias, classifier.weight (transformers " \
        "would start them at random" in proc.stderr
    # An unfinished run as input is named as such.
    (tmp_path / "unfinished" / "groups").mkdir(parents=True)
    proc = _cli("--input", str(tmp_path / "unfinished"), "--corpus", str(run_dir), "--output", str(tmp_path))
    assert proc.returncode == 2 and "is a pairmine run folder without _SUCCESS" in proc.stderr
    # Pairs that hold no row: refused before the corpus is embedded for nothing.
    pq.write_table(pa.table({"query": pa.array([], pa.string()), "passage": pa.array([], pa.string())}),
                   tmp_path / "no-pairs.parquet")
    proc = _cli("--input", str(tmp_path / "no-pairs.parquet"), "--corpus", str(run_dir), "--output", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"pairmine: error: --input {tmp_path / 'no-pairs.parquet'}: no pairs (its 1 file(s) hold no rows)")


@pytest.mark.slow  # ~2.5 min on CI: each case starts Ray; the checks before Ray above stay in the default run
def test_bad_input_found_after_ray_starts_is_one_line(tiny_run, tiny_model_dir, tmp_path):
    run_dir, _ = tiny_run
    # A corpus of skipped documents only: the error counts them.
    pq.write_table(pa.table({"id": ["a", "b", None], "text": [None, "  ", "x"]}), tmp_path / "skipped.parquet")
    proc = _cli("--input", str(run_dir), "--corpus", str(tmp_path / "skipped.parquet"), "--output", str(tmp_path),
                "--set", f"embed.model={tiny_model_dir}", "--run-id", "skipped-corpus")
    assert proc.returncode == 2 and "no usable passage (documents skipped: empty_text 1, null_id 1, null_text 1)" \
        in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "skipped-corpus").exists()  # found after the corpus pass: the run folder is removed again
    # A corpus too small to reach the rank window is refused once it is embedded, and leaves no run folder: the same
    # --run-id then runs with a window that fits (before, its plan was kept and the rerun refused as another config).
    docs = pq.read_table(json.loads((run_dir / "manifest.json").read_text())["inputs"][0]["path"],
                         columns=["id", "text"])
    pq.write_table(docs.slice(0, 1), tmp_path / "one-doc.parquet")
    n = len(chunk_text(docs.column("text")[0].as_py(),
                       token_limit=run_token_limit(json.loads((run_dir / "manifest.json").read_text()))).passages)
    proc = _cli("--input", str(run_dir), "--corpus", str(tmp_path / "one-doc.parquet"), "--output", str(tmp_path),
                "--set", f"negatives.rank_start={n + 1}", "--set", f"negatives.rank_end={n + 1}", "--run-id", "small")
    assert proc.returncode == 2 and f"has {n} usable passage(s), fewer than negatives.rank_start" in proc.stderr
    assert not (tmp_path / "small").exists()
    # A folder that was there before the run (here with the user's own file) is not the run's: only the plan goes.
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "notes.txt").write_text("mine")
    proc = _cli("--input", str(run_dir), "--corpus", str(tmp_path / "one-doc.parquet"), "--output", str(tmp_path),
                "--set", f"negatives.rank_start={n + 1}", "--set", f"negatives.rank_end={n + 1}", "--run-id", "there")
    assert proc.returncode == 2 and (tmp_path / "there" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "there" / "_state" / "plan.json").exists()
    proc = _cli("--input", str(run_dir), "--corpus", str(tmp_path / "one-doc.parquet"), "--output", str(tmp_path),
                "--set", "negatives.rank_start=1", "--set", f"negatives.rank_end={n}", "--run-id", "small")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "small" / "stats.json").read_text())["corpus_passages"] == n
    # A query that is a JSON number, found by a Ray worker mid-run: one error line, not a remote traceback.
    (tmp_path / "pairs.jsonl").write_text('{"query": "q", "passage": "p"}\n{"query": 123, "passage": "p"}\n')
    proc = _cli("--input", str(tmp_path / "pairs.jsonl"), "--corpus", str(tmp_path / "one-doc.parquet"), "--output",
                str(tmp_path), "--set", f"embed.model={tiny_model_dir}", "--set", "negatives.rank_start=1",
                "--set", "negatives.rank_end=1", "--set", "negatives.depth=1")
    assert proc.returncode == 2 and "pairmine: error: " in proc.stderr and "holds a JSON number" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "negatives run" not in proc.stderr  # no run folder announced that is never made


def test_a_run_of_the_wrong_kind_is_named(tiny_run, teacher_run, tmp_path):
    """Runs of mine, negatives and filter-pairs share an output layout: given where another kind is wanted, each
    command says what the run is (one line, exit 2, no folder written), and an output folder holding both kinds
    lists only the mine runs as a lineage's (mine --incremental picked a negatives run as the latest)."""
    import shutil

    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.mine import committed_runs
    from pairmine.pipeline.negatives import _run_folder

    run_dir, _ = tiny_run
    neg_dir, _ = teacher_run

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", *args], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return proc.stderr.strip().splitlines()[-1]

    negatives_run = f"{neg_dir} is a pairmine negatives run (it holds negatives/)"
    assert cli("negatives", "--input", str(neg_dir), "--corpus", str(run_dir), "--output", str(tmp_path)) == (
        f"pairmine: error: {negatives_run}, not a mine or filter-pairs run; give a mine run, a filter-pairs run, "
        "or parquet/JSONL (query, passage) pairs")
    assert cli("negatives", "--input", str(run_dir), "--corpus", str(neg_dir), "--output", str(tmp_path)) == (
        f"pairmine: error: {negatives_run}, not a mine run; give a mine run (its input is the corpus) or a folder "
        "of documents")
    assert f"--input {run_dir.parent} holds 1 pairmine run folder(s) ({run_dir}, ...): give one of them" in cli(
        "negatives", "--input", str(run_dir.parent), "--corpus", str(run_dir), "--output", str(tmp_path))
    assert f"{negatives_run}, not a mine run; pairmine report shows" in cli("report", str(neg_dir))
    assert not (neg_dir / "report").exists()
    assert f"{negatives_run}, not a mine run; train on it with --negatives" in cli(
        "train", "--groups", str(neg_dir), "--output", str(tmp_path / "t"))
    assert f"{run_dir} is a pairmine mine run (it holds groups/), not a negatives run; train on it with --groups" in \
        cli("train", "--negatives", str(run_dir), "--output", str(tmp_path / "t"))
    # A run's data folder stands for the run (train --groups takes one too).
    path, manifest = _run_folder(f"{run_dir}/groups/", "--input", LOCAL)
    assert path == str(run_dir) and manifest["run_id"] == "tiny"
    out = tmp_path / "runs"
    shutil.copytree(run_dir, out / "tiny")
    shutil.copytree(neg_dir, out / "neg")
    assert [r["run_id"] for r in committed_runs(str(out), LOCAL)] == ["tiny"]


@pytest.mark.slow  # the default model over fiqa-pairs-beir's corpus: ~3.5 minutes, a figure more than a check
def test_the_window_holds_fewer_judged_relevant_passages_than_the_top_of_the_list(tmp_path):
    """Seed 004: the top of the retrieved list is where unlabelled positives sit. On fiqa-pairs-beir (qrels judge the
    true answers), with the default model: negatives at ranks 1-10 are judged relevant to their query more often
    than negatives inside the default window (ranks 31-200)."""
    corpus = [json.loads(x) for x in (FIQA / "corpus.jsonl").read_text().splitlines()]
    queries = {q["_id"]: q["text"] for q in map(json.loads, (FIQA / "queries.jsonl").read_text().splitlines())}
    qrels: dict[str, set] = {}
    for line in (FIQA / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, score = line.split("\t")
        if int(score) > 0:
            qrels.setdefault(q, set()).add(d)
    text_of = {d["_id"]: d["text"] for d in corpus}
    # One pair per query: its first judged answer; the corpus: every answer, one passage each (chunk.max_words large).
    pairs = [{"id": q, "query": queries[q], "passage": text_of[sorted(ds)[0]]} for q, ds in sorted(qrels.items())
             if text_of.get(sorted(ds)[0], "").strip()]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "pairs.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": d["_id"], "text": d["text"]} for d in corpus]), tmp_path / "corpus.parquet")
    proc = _cli("--input", str(tmp_path / "pairs.parquet"), "--corpus", str(tmp_path / "corpus.parquet"),
                "--output", str(tmp_path), "--run-id", "fiqa", "--set", "chunk.max_words=100000",
                "--set", "chunk.fit_model_length=false",  # one passage per BEIR document, as BEIR scores them
                "--set", "negatives.rank_start=1", "--set", "negatives.count=200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    owner = {}
    for d in corpus:
        for p in chunk_text(d["text"], max_words=100000).passages:
            owner[p] = d["_id"]
    judged = {"top": [0, 0], "window": [0, 0]}  # [judged relevant, negatives]
    for r in pq.read_table(tmp_path / "fiqa" / "negatives").to_pylist():
        for text, rank in zip(r["negatives"], r["negative_ranks"]):
            where = "top" if rank <= 10 else "window" if 31 <= rank <= 200 else None
            if where:
                judged[where][0] += owner[text] in qrels[r["pair_id"]]
                judged[where][1] += 1
    top, window = (judged[k][0] / judged[k][1] for k in ("top", "window"))
    print(f"\njudged relevant among mined negatives: ranks 1-10 {judged['top'][0]} / {judged['top'][1]} = "
          f"{top:.4%}; ranks 31-200 {judged['window'][0]} / {judged['window'][1]} = {window:.4%}")
    assert judged["top"][0] > 0 and window < top
