"""pairmine eval: metrics by hand on a toy qrels, bad BEIR/STS input, and the default model pinned on fiqa-pairs-beir
and STS-B test (tests/data, copies of shared/data with provenance)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pairmine.pipeline.cli import main
from pairmine.pipeline.config import load_config
from pairmine.pipeline.evaluate import EvalInputError, evaluate, exact_search, ir_metrics, load_beir, load_sts, trec_order

DATA = Path(__file__).resolve().parent / "data"
FIQA = DATA / "fiqa-pairs-beir"
STS_TEST = DATA / "stsbenchmark" / "sts-test.csv"


def test_metrics_on_a_three_document_toy_by_hand():
    # Three documents d1, d2, d3. q1 judges d1 (grade 1) and d3 (grade 2); q2 judges d2 (grade 1).
    qrels = {"q1": {"d1": 1, "d3": 2, "d2": 0}, "q2": {"d2": 1}}
    run = {"q1": {"d2": 0.9, "d3": 0.8, "d1": 0.7}, "q2": {"d1": 0.5, "d3": 0.4, "d2": 0.1}}
    m = ir_metrics(qrels, run)
    # q1 ranks d2 (grade 0), d3 (grade 2), d1 (grade 1). trec_eval's nDCG: gain = grade, discount log2(rank + 1):
    #   DCG  = 0/log2(2) + 2/log2(3) + 1/log2(4) = 0 + 1.26186 + 0.5     = 1.76186
    #   IDCG = 2/log2(2) + 1/log2(3)             = 2 + 0.63093           = 2.63093
    #   nDCG@10 = 1.76186 / 2.63093 = 0.66967; first relevant at rank 2: MRR@10 = 1/2; both relevant in the top 100.
    dcg = 2 / math.log2(3) + 1 / math.log2(4)
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert dcg / idcg == pytest.approx(0.66967, abs=1e-5)
    assert m["q1"]["ndcg@10"] == pytest.approx(dcg / idcg, abs=1e-6)
    assert m["q1"]["mrr@10"] == pytest.approx(0.5)
    assert m["q1"]["recall@100"] == pytest.approx(1.0)
    # q2: its one relevant document at rank 3: nDCG@10 = (1/log2(4)) / (1/log2(2)) = 0.5, MRR@10 = 1/3.
    assert m["q2"] == pytest.approx({"ndcg@10": 0.5, "mrr@10": 1 / 3, "recall@100": 1.0})


def test_mrr_is_cut_at_10_and_recall_at_100():
    # The only relevant document at rank 11: reciprocal rank 1/11 without a cutoff, 0 for MRR@10; nDCG@10 is 0.
    docs = {f"d{i:03d}": 1.0 - i / 1000 for i in range(150)}  # d000 best, ..., d149 worst
    m = ir_metrics({"q": {"d010": 1}}, {"q": docs})["q"]
    assert m["mrr@10"] == 0.0 and m["ndcg@10"] == 0.0 and m["recall@100"] == 1.0
    m = ir_metrics({"q": {"d009": 1}}, {"q": docs})["q"]
    assert m["mrr@10"] == pytest.approx(1 / 10)
    # Relevant at rank 101: outside the top 100, Recall@100 = 0 (trec_eval's cutoff, even though the run holds it).
    assert ir_metrics({"q": {"d100": 1}}, {"q": docs})["q"]["recall@100"] == 0.0
    # Two relevant, one in the top 100: Recall@100 = 1/2.
    assert ir_metrics({"q": {"d005": 1, "d120": 1}}, {"q": docs})["q"]["recall@100"] == pytest.approx(0.5)


def test_trec_order_breaks_ties_by_doc_id_descending():
    # trec_eval sorts by score, ties by document id descending; the MRR@10 cut must cut the same list.
    assert [d for d, _ in trec_order({"a": 0.5, "c": 0.5, "b": 0.9})] == ["b", "c", "a"]


def test_exact_search_is_the_top_k_of_the_dot_product():
    import numpy as np

    rng = np.random.default_rng(0)
    docs = rng.standard_normal((50, 8)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = docs[[3, 7]] + 0.01  # nearly documents 3 and 7
    scores, idx = exact_search(queries, docs, k=5, block_mb=0.0001)  # tiny blocks: one query per block
    assert idx[:, 0].tolist() == [3, 7]
    full = queries @ docs.T
    assert np.allclose(scores, -np.sort(-full, axis=1)[:, :5], atol=1e-6)
    assert exact_search(queries, docs[:3], k=100)[1].shape == (2, 3)  # k larger than the corpus


def write_beir(root: Path, corpus: list[str], queries: list[str], qrels: str) -> Path:
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("\n".join(corpus) + "\n")
    (root / "queries.jsonl").write_text("\n".join(queries) + "\n")
    (root / "qrels" / "test.tsv").write_text(qrels)
    return root


def test_bad_beir_lines_are_counted_with_their_reason(tmp_path):
    root = write_beir(
        tmp_path / "b",
        corpus=['{"_id": "d1", "title": "T", "text": "one"}', '{"_id": "d2", "text": "two"}', "not json",
                '{"text": "no id"}', '{"_id": "d1", "text": "again"}', '{"_id": "d3", "text": "   "}'],
        queries=['{"_id": "q1", "text": "first"}', '{"_id": "q2", "text": ""}', '{"_id": "q3", "text": "third"}',
                 '{"_id": "q4", "text": "fourth"}', "[1, 2]"],
        qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td9\t1\nq2\td2\t1\nq3\td2\t0\nq1\td2\tx\nq1\td2\nq5\td1\t1\n"
              "q1\td1\t1\n",
    )
    data = load_beir(root)
    assert data.corpus_ids == ["d1", "d2"] and data.corpus_texts[0] == "T one"  # BEIR: title + " " + text
    assert data.query_ids == ["q1"] and data.qrels == {"q1": {"d1": 1}}
    assert dict(data.skips.counts) == {
        "corpus.invalid_json": 1, "corpus.missing_id": 1, "corpus.duplicate_id": 1, "corpus.empty_text": 1,
        "queries.empty_text": 1, "queries.invalid_json": 1,
        "qrels.unknown_doc_id": 1, "qrels.unknown_query_id": 2,  # q2 (empty text, skipped) and q5 (absent)
        "qrels.malformed_line": 2, "qrels.duplicate_judgement": 1,
        "queries.no_relevant_judgement": 1,  # q3 judges only grade 0
    }
    assert data.skips.examples["qrels.unknown_doc_id"] == ["test.tsv:3 d9"]


@pytest.mark.parametrize("case, message", [
    ("no_folder", "does not exist"),
    ("no_corpus", "has no corpus.jsonl"),
    ("no_qrels", "has no qrels/test.tsv (qrels files there: dev.tsv; choose one with --split)"),
    ("empty_queries", "holds no usable query"),
    ("unknown_docs", "leaves no query with a relevant"),
])
def test_unusable_beir_folders_are_clear_errors(tmp_path, case, message):
    root = tmp_path / "b"
    if case != "no_folder":
        write_beir(root, ['{"_id": "d1", "text": "one"}'],
                   ['{"_id": "q1", "text": ""}' if case == "empty_queries" else '{"_id": "q1", "text": "q"}'],
                   "q1\td7\t1\n" if case == "unknown_docs" else "q1\td1\t1\n")
    if case == "no_corpus":
        (root / "corpus.jsonl").unlink()
    if case == "no_qrels":
        (root / "qrels" / "test.tsv").rename(root / "qrels" / "dev.tsv")
    with pytest.raises(EvalInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_beir(root)


def test_sts_file_lines_and_errors(tmp_path):
    p = tmp_path / "sts.csv"
    p.write_text('g\tf\t2012\t1\t2.5\tA "quoted" girl.\tA girl.\n'  # quotes are text
                 "g\tf\t2012\t2\t4.0\tOne.\tTwo.\tsource note\textra\n"  # extra fields (as in STS-B) are ignored
                 "g\tf\t2012\t3\tfive\tOne.\tTwo.\n"
                 "too\tfew\n"
                 "g\tf\t2012\t4\t1.0\t\tTwo.\n")
    s = load_sts(p)
    assert s.sentence1 == ['A "quoted" girl.', "One."] and s.gold.tolist() == [2.5, 4.0]
    assert dict(s.skips.counts) == {"sts.bad_score": 1, "sts.too_few_fields": 1, "sts.empty_sentence": 1}
    with pytest.raises(EvalInputError, match="does not exist"):
        load_sts(tmp_path / "nope.csv")
    (tmp_path / "bad.csv").write_text("a,b,c\n")
    with pytest.raises(EvalInputError, match="holds 0 usable pair"):
        load_sts(tmp_path / "bad.csv")


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    assert main(["eval", "--beir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pairmine: error: BEIR folder") and "Traceback" not in err and err.count("\n") == 1
    assert main(["eval"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["eval", "--sts", str(STS_TEST), "--model", str(tmp_path / "no-model")]) == 2
    assert "cannot be loaded" in capsys.readouterr().err


def test_cli_eval_with_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    root = write_beir(tmp_path / "b", [f'{{"_id": "d{i}", "text": "document number {i} about topic {i % 3}"}}' for i in range(30)],
                      ['{"_id": "q1", "text": "topic 1"}', '{"_id": "q2", "text": "number 7"}'], "q1\td1\t1\nq2\td7\t2\n")
    out = tmp_path / "ev"
    assert main(["eval", "--model", tiny_model_dir, "--beir", str(root), "--output", str(out),
                 "--query-prefix", "query: ", "--set", "embed.batch_size=4"]) == 0
    printed = capsys.readouterr().out
    assert "retrieval: 2 queries, 30 documents" in printed and "query prefix 'query: '" in printed
    summary = json.loads((out / "summary.json").read_text())
    per_query = json.loads((out / "per_query.json").read_text())
    assert set(per_query["queries"]) == {"q1", "q2"} and per_query["metrics"] == ["ndcg@10", "recall@100", "mrr@10"]
    for m in per_query["metrics"]:
        mean = sum(q[m] for q in per_query["queries"].values()) / 2
        assert summary["retrieval"]["mean"][m] == pytest.approx(mean, abs=1e-6)
    assert summary["retrieval"]["mean"]["recall@100"] == 1.0  # 30 documents: all are in the top 100
    assert summary["query_prefix"] == "query: " and summary["passage_prefix"] == ""


def test_eval_and_compare_read_and_write_s3_with_the_endpoint_only_in_storage(tiny_model_dir, s3_server, tmp_path,
                                                                              capsys):
    """The BEIR folder, the STS file and both outputs on the test S3 server, reached through [storage] (the
    environment has no AWS_ENDPOINT_URL); the model folder stays local. Same scores as the local run."""
    import time

    from tests.conftest import Out

    local = write_beir(tmp_path / "b", [f'{{"_id": "d{i}", "text": "document number {i} about topic {i % 3}"}}'
                                        for i in range(30)],
                       ['{"_id": "q1", "text": "topic 1"}', '{"_id": "q2", "text": "number 7"}'], "q1\td1\t1\nq2\td7\t2\n")
    sts = tmp_path / "sts.csv"
    sts.write_text("g\tf\t2012\t1\t2.5\tA girl.\tA girl runs.\ng\tf\t2012\t2\t4.0\tOne.\tTwo.\n"
                   "g\tf\t2012\t3\t1.0\tRockets.\tCooking.\n")
    o = Out(f"s3://pairmine-test/eval-{time.time_ns()}", s3_server.endpoint)
    for f in [*local.rglob("*"), sts]:
        if f.is_file():
            o.storage.write_bytes(o.path("data", str(f.relative_to(tmp_path))), f.read_bytes())
    config = tmp_path / "s3.toml"
    config.write_text(f'[storage]\nendpoint_url = "{s3_server.endpoint}"\n')
    common = ["--model", tiny_model_dir, "--config", str(config), "--set", "embed.batch_size=4"]
    assert main(["eval", "--beir", o.path("data", "b"), "--sts", o.path("data", "sts.csv"), "--output", o.path("ev"),
                 *common]) == 0
    assert main(["eval", "--beir", str(local), "--sts", str(sts), "--output", str(tmp_path / "ev"), *common]) == 0
    on_s3, here = o.json("ev", "summary.json"), json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert on_s3["retrieval"]["dataset"] == o.path("data", "b") and on_s3["sts"]["file"] == o.path("data", "sts.csv")
    assert on_s3["retrieval"]["mean"] == here["retrieval"]["mean"] and on_s3["sts"]["pairs"] == 3
    assert on_s3["retrieval"]["fingerprint"] == here["retrieval"]["fingerprint"]
    capsys.readouterr()
    assert main(["compare", o.path("ev"), str(tmp_path / "ev"), "--resamples", "200", "--config", str(config),
                 "--output", o.path("cmp.json")]) == 0
    assert "identical on all 2 queries" in capsys.readouterr().out
    assert o.json("cmp.json")["queries_common"] == 2


# ~5.5 minutes of the real model pinning docs/evaluation.md's figures: -m slow (eval's kind stays in the default run
# through the tiny-model tests above: metrics by hand, skips, prefixes, S3).
@pytest.mark.slow
def test_default_model_on_fiqa_and_sts_benchmark(tmp_path):
    """all-MiniLM-L6-v2 (the default model) on fiqa-pairs-beir (500 queries, 1,236 usable passages) and STS-B test
    (1,379 pairs). Measured on 2 cores (bf16 autocast): nDCG@10 0.7129, Recall@100 0.9533, MRR@10 0.7598,
    Spearman 0.8204 (sentence-transformers publishes 82.03 for this model on STS-B test), ~20 s in all. The tolerance
    covers bf16 vs fp32 (CPUs without native bf16)."""
    cfg = load_config()
    res = evaluate(cfg, str(FIQA), str(STS_TEST), str(tmp_path / "ev"))
    r, s = res.summary["retrieval"], res.summary["sts"]
    assert r["queries_evaluated"] == 500 and r["documents"] == 1236 and r["judgements"] == 1236
    # The shipped data holds one document with empty text (d470), judged twice: counted, not evaluated.
    assert r["skipped"]["counts"] == {"corpus.empty_text": 1, "qrels.unknown_doc_id": 2}
    assert r["mean"]["ndcg@10"] == pytest.approx(0.7129, abs=0.006)
    assert r["mean"]["recall@100"] == pytest.approx(0.9533, abs=0.006)
    assert r["mean"]["mrr@10"] == pytest.approx(0.7598, abs=0.008)
    assert s["pairs"] == 1379 and s["skipped"]["counts"] == {}
    assert s["spearman"] == pytest.approx(0.8204, abs=0.003)
    assert (tmp_path / "ev" / "per_query.json").is_file()


def test_texts_without_token_vectors_keep_every_other_document_id_in_every_scoring(tiny_model_dir, tmp_path):
    """Issue 39 item 1 (pyterrier_colbert#49): encode_tokens drops special tokens, so a run of emoji or of
    zero-width spaces, or an unsplit Thai run (each one [UNK] under all-MiniLM's vocabulary), has a (0, dim) array.
    Such a document used to shift every later document's id in sum-of-max search (and break its reshape on a small
    corpus). Every scoring now scores the other documents under their own ids, never retrieves a document with no
    token vector in the token scorings, retrieves nothing for a query with none, and counts both in the summary."""
    from pairmine.pipeline.evaluate import make_embedder, sum_of_max_search, xtr_search

    empty = ["\U0001F600\U0001F389", "\u200b\u200b", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a"]
    words = [f"document number {i} about topic {i % 3} and item {i % 7}" for i in range(6)]
    texts = [empty[0], words[0], words[1], empty[1], words[2], words[3], empty[2], words[4], words[5]]  # 9 documents
    cfg = load_config(overrides=[f"embed.model={tiny_model_dir}", "embed.dtype=float32", "embed.batch_size=4"])
    embedder = make_embedder(cfg)
    tokens = embedder.encode_tokens(texts)
    assert [len(t) for t in tokens] == [0, 9, 9, 0, 9, 9, 0, 9, 9]
    assert embedder.word_token_counts(texts).tolist() == [len(t) for t in tokens]
    queries = embedder.encode_tokens([words[3], empty[0]])  # a copy of document 5, and a query with no token

    def brute(q):  # sum-of-max / n of every document with tokens, under its own index
        return {j: float((q @ d.T).max(axis=1).sum() / len(q)) for j, d in enumerate(tokens) if len(d)}

    scores, idx = sum_of_max_search(queries, tokens, k=100)
    want = brute(queries[0])
    assert idx[0].tolist() == sorted(want, key=lambda j: (-want[j], j)) and idx[0][0] == 5
    assert np.allclose(scores[0], [want[j] for j in idx[0]], atol=1e-6) and scores[0][0] == pytest.approx(1.0)
    assert len(idx[1]) == len(scores[1]) == 0  # a query with no token vector retrieves nothing
    n_tokens = sum(len(t) for t in tokens)
    xs, xi, _ = xtr_search(queries, tokens, k_prime=n_tokens, k=100)  # every token retrieved: sum-of-max / n
    assert xi[0].tolist() == idx[0].tolist() and np.allclose(xs[0], scores[0], atol=1e-5) and len(xi[1]) == 0
    assert not {0, 3, 6} & set(xi[0].tolist())

    corpus = [json.dumps({"_id": f"d{j}", "text": t}) for j, t in enumerate(texts)]
    root = write_beir(tmp_path / "b", corpus, [json.dumps({"_id": "q1", "text": words[3]}),
                                               json.dumps({"_id": "q2", "text": empty[0]})], "q1\td5\t1\nq2\td1\t1\n")
    for scoring in ("dense", "sum-of-max", "xtr"):
        res = evaluate(cfg, str(root), output=str(tmp_path / scoring), scoring=scoring)
        per_query = json.loads((tmp_path / scoring / "per_query.json").read_text())["queries"]
        assert per_query["q1"]["ndcg@10"] == pytest.approx(1.0), scoring  # d5, behind two empty documents, is first
        counted = res.summary["retrieval"]["without_word_tokens"]
        assert counted["documents"] == {"count": 3, "examples": ["d0", "d3", "d6"]}, scoring
        assert counted["queries"] == {"count": 1, "examples": ["q2"]} and counted["rule"]
        if scoring != "dense":
            assert per_query["q2"] == {"ndcg@10": 0.0, "recall@100": 0.0, "mrr@10": 0.0}


def test_ignore_identical_ids_drops_the_query_own_document_as_beir_does(tiny_model_dir, tmp_path):
    """ArguAna (shared/data/README.md): 1,298 query ids are also corpus ids, the query's own argument. BEIR and MTEB
    evaluate with ignore_identical_ids: that document is never retrieved or counted. By hand on a run, then end to end:
    the query's own text ranks first (cosine 1), so dropping it moves the relevant document up exactly one rank."""
    from pairmine.pipeline.evaluate import drop_identical_ids

    run = {"a": {"a": 0.9, "b": 0.8, "c": 0.7}, "x": {"b": 0.5, "c": 0.6}}
    assert drop_identical_ids(run, k=2) == ({"a": {"b": 0.8, "c": 0.7}, "x": {"c": 0.6, "b": 0.5}}, 1)

    texts = [f"argument number {i} about topic {i % 3} and item {i % 7}" for i in range(30)]
    texts[11] = texts[4] + " indeed"  # the counter-argument: near the query, so within its top 10
    corpus = [json.dumps({"_id": f"d{i}", "text": t}) for i, t in enumerate(texts)]
    root = write_beir(tmp_path / "b", corpus, [json.dumps({"_id": "d4", "text": texts[4]}),
                                               json.dumps({"_id": "q9", "text": texts[9]})], "d4\td11\t1\nq9\td9\t1\n")
    cfg = load_config(overrides=[f"embed.model={tiny_model_dir}", "embed.dtype=float32", "embed.batch_size=4"])
    kept = evaluate(cfg, str(root), output=str(tmp_path / "keep"), ignore_identical_ids=False)
    dropped = evaluate(cfg, str(root), output=str(tmp_path / "drop"))
    assert kept.summary["retrieval"]["identical_ids_removed"] == 0
    assert dropped.summary["retrieval"]["identical_ids_removed"] == 1  # d4 only: q9 is no corpus id
    assert dropped.summary["retrieval"]["ignore_identical_ids"] is True
    keep_q = json.loads((tmp_path / "keep" / "per_query.json").read_text())["queries"]
    drop_q = json.loads((tmp_path / "drop" / "per_query.json").read_text())["queries"]
    rank = round(1 / keep_q["d4"]["mrr@10"])  # d11's rank, behind the query's own document
    assert 2 <= rank <= 10 and keep_q["d4"]["ndcg@10"] == pytest.approx(1 / math.log2(rank + 1), abs=1e-6)
    assert drop_q["d4"]["ndcg@10"] == pytest.approx(1 / math.log2(rank), abs=1e-6)  # one rank up
    assert drop_q["q9"] == keep_q["q9"] and drop_q["q9"]["ndcg@10"] == pytest.approx(1.0)  # its own text is d9
