"""Evaluation of an encoder (SPEC "Evaluation"): BEIR-format retrieval and STS-B style similarity, plus a paired
comparison of two evaluation results (seed 004, chapter 8: read a difference per query, on the same queries).

Retrieval: embed the corpus (passage prefix) and the queries (query prefix) with pairmine's own
:class:`operators.embed.Embedder` (one embedding implementation for mining and evaluation), exact search by a
matrix product over the unit vectors (cosine), and the metrics from trec_eval through ``pytrec_eval``
(the ``pytrec-eval-terrier`` wheels):

    nDCG@10     trec_eval ``ndcg_cut_10``  (gain = relevance grade, discount log2(rank + 1), ideal from the qrels)
    Recall@100  trec_eval ``recall_100``   (relevant documents in the top 100 / relevant documents judged)
    MRR@10      trec_eval ``recip_rank`` on the run cut to its top 10 (trec_eval ``-M 10``); trec_eval's
                recip_rank takes no cutoff of its own

STS: Spearman correlation (``scipy.stats.spearmanr``) between cos(e1, e2) and the gold 0-5 scores; both sentences
get the query prefix (E5's convention for symmetric tasks).

Output folder: ``summary.json`` (means, counts, every skipped line by reason, timings, the command's settings) and
``per_query.json`` (every query's scores: the input of ``pairmine compare``).

The BEIR folder, the STS file, the output folder and compare's result files may be local or ``s3://``: they are read
and written through :class:`operators.storage.Storage` (``[storage]`` of the config, else the AWS environment; reads
retried as a whole on transient errors, files published whole). The model is loaded as ``embed.model`` names it
(a local folder or a hub id).
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import io
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pairmine.operators.errors import PairmineError
from pairmine.operators.read import BLANK, jsonl_record
from pairmine.operators.storage import LOCAL, Storage, join

log = logging.getLogger("pairmine")

METRICS = ("ndcg@10", "recall@100", "mrr@10")
# Our metric name -> the trec_eval measure pytrec_eval reports it under.
TREC_MEASURES = {"ndcg@10": "ndcg_cut_10", "recall@100": "recall_100", "mrr@10": "recip_rank"}
TOP_K = 100
MRR_DEPTH = 10
PER_QUERY_FORMAT = "pairmine-eval-per-query/1"
SKIP_EXAMPLES = 3  # line numbers kept per skip reason, to point the user at the bad lines


class EvalInputError(PairmineError, ValueError):
    """An evaluation input (BEIR folder, STS file, result file, run folder) cannot be used as given; the message
    names the file and, where it helps, the line. User-fixable."""


@dataclass
class Skips:
    """Counted skips: reason -> count, plus the first few line references of each reason."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < SKIP_EXAMPLES:
            self.examples[reason].append(where)

    def as_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    def merge(self, other: "Skips") -> None:
        for reason, n in other.counts.items():
            self.counts[reason] += n
            for where in other.examples.get(reason, []):
                self.examples.setdefault(reason, [])
                if len(self.examples[reason]) < SKIP_EXAMPLES:
                    self.examples[reason].append(where)


def _name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _shown(path: str) -> str:
    """``path`` as the summary records it: a local path made absolute, a URL as given."""
    return str(path) if "://" in str(path) else str(Path(path).resolve())


@dataclass
class BeirData:
    """A BEIR retrieval set after validation.

    Attributes:
        corpus_ids / corpus_texts: the documents ("title text" when a title is present, as BEIR does).
        query_ids / query_texts: the queries that are evaluated (those with at least one relevant judgement).
        qrels: {query id: {doc id: relevance grade}} restricted to known queries and documents.
        skips: every line or judgement left out, by reason.
    """

    corpus_ids: list[str]
    corpus_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]
    qrels: dict[str, dict[str, int]]
    skips: Skips


def _read_jsonl(path: str, kind: str, skips: Skips, storage: Storage = LOCAL) -> list[tuple[str, dict]]:
    """(id, record) per valid line of a BEIR JSONL file; invalid JSON, a missing ``_id`` or a duplicate id are
    counted as ``{kind}.invalid_json`` / ``{kind}.missing_id`` / ``{kind}.duplicate_id``."""
    name = _name(path)

    def parse(f) -> tuple[list[tuple[str, dict]], Skips]:
        out, seen, found = [], set(), Skips()  # found: merged once the read succeeded (a retry starts over)
        for n, raw in enumerate(f, start=1):
            rec = jsonl_record(raw)
            if rec is BLANK:
                continue
            if rec is None:
                found.add(f"{kind}.invalid_json", f"{name}:{n}")
                continue
            rid = rec.get("_id")
            if rid is None or str(rid).strip() == "":
                found.add(f"{kind}.missing_id", f"{name}:{n}")
                continue
            rid = str(rid)
            if rid in seen:
                found.add(f"{kind}.duplicate_id", f"{name}:{n}")
                continue
            seen.add(rid)
            out.append((rid, rec))
        return out, found

    try:
        out, found = storage.read_with(str(path), parse)
    except OSError as e:
        raise EvalInputError(f"cannot read {path}: {e}") from None
    skips.merge(found)
    return out


def _text(rec: dict, with_title: bool) -> str:
    text = rec.get("text")
    text = text if isinstance(text, str) else ""
    title = rec.get("title") if with_title else None
    if isinstance(title, str) and title.strip():
        text = f"{title} {text}"
    return text.strip()


def load_beir(folder: str | Path, split: str = "test", storage: Storage = LOCAL) -> BeirData:
    """Read and check a BEIR folder: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/{split}.tsv``.

    Lines that cannot be used are skipped and counted by reason (never silently): invalid JSON, missing or duplicate
    ``_id``, empty text, a qrels line that is not ``query-id<TAB>corpus-id<TAB>integer score``, a judgement of an
    unknown document or query. Queries without any judgement of grade > 0 are not evaluated (counted as
    ``queries.no_relevant_judgement``); queries that appear in no judgement at all are not embedded.

    Args:
        folder: local or ``s3://`` (read with ``storage``).

    Returns:
        A :class:`BeirData`.

    Raises:
        EvalInputError: the folder or one of the three files is missing, or nothing usable is left (no document,
            no query with a relevant judgement).
        StorageError: a file cannot be read (not transient, or after the retries).
    """
    root = str(folder)
    info = storage.info(root)
    if info is None or info.get("type") != "directory":
        raise EvalInputError(f"BEIR folder {root} does not exist (expected corpus.jsonl, queries.jsonl, qrels/{split}.tsv)")
    names = {"corpus.jsonl": join(root, "corpus.jsonl"), "queries.jsonl": join(root, "queries.jsonl"),
             f"qrels/{split}.tsv": join(root, "qrels", f"{split}.tsv")}
    corpus_path, queries_path, qrels_path = names.values()
    for rel, p in names.items():
        got = storage.info(p)
        if got is None or got.get("type") == "directory":
            found = sorted(_name(x) for x in storage.ls(join(root, "qrels")) if x.endswith(".tsv"))
            hint = f" (qrels files there: {', '.join(found)}; choose one with --split)" if p == qrels_path and found else ""
            raise EvalInputError(f"BEIR folder {root} has no {rel}{hint}")
    skips = Skips()
    corpus = {}
    for rid, rec in _read_jsonl(corpus_path, "corpus", skips, storage):
        text = _text(rec, with_title=True)
        if not text:
            skips.add("corpus.empty_text", f"{_name(corpus_path)} _id={rid}")
            continue
        corpus[rid] = text
    queries = {}
    for rid, rec in _read_jsonl(queries_path, "queries", skips, storage):
        text = _text(rec, with_title=False)
        if not text:
            skips.add("queries.empty_text", f"{_name(queries_path)} _id={rid}")
            continue
        queries[rid] = text
    if not corpus:
        raise EvalInputError(f"{corpus_path} holds no usable document ({_skip_text(skips)})")
    if not queries:
        raise EvalInputError(f"{queries_path} holds no usable query ({_skip_text(skips)})")

    qrels: dict[str, dict[str, int]] = {}
    qrels_name = _name(qrels_path)
    for n, raw in enumerate(storage.read_bytes(qrels_path).split(b"\n"), start=1):  # qrels are small: one read
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line.strip():
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) == 4:  # TREC qrels: qid 0 docid rel
            parts = [parts[0], parts[2], parts[3]]
        try:
            qid, did, grade = parts[0].strip(), parts[1].strip(), int(parts[2])
        except (IndexError, ValueError):
            if n == 1:  # the header "query-id corpus-id score"
                continue
            skips.add("qrels.malformed_line", f"{qrels_name}:{n}")
            continue
        if len(parts) != 3 or not qid or not did:
            skips.add("qrels.malformed_line", f"{qrels_name}:{n}")
        elif qid not in queries:
            skips.add("qrels.unknown_query_id", f"{qrels_name}:{n} {qid}")
        elif did not in corpus:
            skips.add("qrels.unknown_doc_id", f"{qrels_name}:{n} {did}")
        elif did in qrels.get(qid, {}):
            skips.add("qrels.duplicate_judgement", f"{qrels_name}:{n}")
        else:
            qrels.setdefault(qid, {})[did] = grade
    for qid in sorted(q for q, judged in qrels.items() if not any(g > 0 for g in judged.values())):
        skips.add("queries.no_relevant_judgement", qid)
        del qrels[qid]
    if not qrels:
        raise EvalInputError(f"{qrels_path} leaves no query with a relevant (grade > 0) judgement of a known "
                             f"document ({_skip_text(skips)})")
    query_ids = [q for q in queries if q in qrels]
    corpus_ids = list(corpus)
    return BeirData(corpus_ids, [corpus[d] for d in corpus_ids], query_ids, [queries[q] for q in query_ids], qrels, skips)


def _skip_text(skips: Skips) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(skips.counts.items())) or "nothing skipped"


@dataclass
class StsData:
    """STS pairs: sentence1, sentence2 and the gold similarity (0-5), plus skipped lines by reason."""

    sentence1: list[str]
    sentence2: list[str]
    gold: np.ndarray  # (n_pairs,) float64
    skips: Skips


def load_sts(path: str | Path, storage: Storage = LOCAL) -> StsData:
    """Read an STS-B style file: tab-separated ``genre, file, year, id, score, sentence1, sentence2`` (extra
    columns, such as the source notes of some STS-B lines, are ignored). No quoting: quotes are text.

    Raises:
        EvalInputError: the file is missing or holds no usable pair (lines with fewer than 7 fields, a score that
            is not a number, or an empty sentence are counted as skips).
    """
    p = str(path)
    info = storage.info(p)
    if info is None or info.get("type") == "directory":
        raise EvalInputError(f"STS file {p} does not exist")
    s1, s2, gold, skips, name = [], [], [], Skips(), _name(p)
    text = storage.read_bytes(p).decode("utf-8", errors="replace")  # an STS file is small: one read
    with io.StringIO(text, newline="") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
            if not row or not "".join(row).strip():
                continue
            if len(row) < 7:
                skips.add("sts.too_few_fields", f"{name}:{n}")
                continue
            try:
                score = float(row[4])
            except ValueError:
                skips.add("sts.bad_score", f"{name}:{n}")
                continue
            a, b = row[5].strip(), row[6].strip()
            if not a or not b or not np.isfinite(score):
                skips.add("sts.empty_sentence" if np.isfinite(score) else "sts.bad_score", f"{name}:{n}")
                continue
            s1.append(a)
            s2.append(b)
            gold.append(score)
    if len(gold) < 2:
        raise EvalInputError(f"STS file {p} holds {len(gold)} usable pair(s) ({_skip_text(skips)}); expected tab-separated "
                             "lines: genre, file, year, id, score, sentence1, sentence2")
    return StsData(s1, s2, np.asarray(gold, dtype=np.float64), skips)


def exact_search(queries: np.ndarray, corpus: np.ndarray, k: int = TOP_K, block_mb: float = 256.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product (cosine for unit vectors), fp32, in blocks of queries.

    Args:
        queries: (n_queries, dim) float32 unit vectors.
        corpus: (n_docs, dim) float32 unit vectors.
        k: hits per query; min(k, n_docs) are returned.
        block_mb: memory for one block of scores (n_block_queries x n_docs x 4 bytes).

    Returns:
        (scores (n_queries, k') float32, indices (n_queries, k') int64 into ``corpus``), best first.
    """
    import torch

    k = min(k, len(corpus))
    docs = torch.from_numpy(np.ascontiguousarray(corpus, dtype=np.float32))  # (n_docs, dim)
    step = max(1, int(block_mb * 2**20 / (4 * max(len(corpus), 1))))
    scores, indices = [], []
    with torch.inference_mode():
        for i in range(0, len(queries), step):
            q = torch.from_numpy(np.ascontiguousarray(queries[i : i + step], dtype=np.float32))  # (block, dim)
            top = torch.topk(q @ docs.T, k, dim=1)  # (block, k)
            scores.append(top.values.numpy())
            indices.append(top.indices.numpy())
    if not scores:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return np.concatenate(scores), np.concatenate(indices).astype(np.int64)


SCORINGS = ("dense", "xtr", "sum-of-max")
K_PRIME = 1000  # tokens retrieved per query token for --scoring xtr (ours; seed 002 varies k' from 100 up)


def _token_matrix(doc_tokens: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Every document token as one (T, dim) float32 matrix, and the document of each row (T,) int64 (a document with
    no token vectors owns no row; the owners are its index in ``doc_tokens`` all the same)."""
    if not doc_tokens:
        return np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
    dim = max((t.shape[1] for t in doc_tokens if t.ndim == 2), default=1)
    owner = np.repeat(np.arange(len(doc_tokens)), [len(t) for t in doc_tokens]).astype(np.int64)
    return np.ascontiguousarray(np.concatenate([t.reshape(-1, dim) for t in doc_tokens]), dtype=np.float32), owner


def sum_of_max_search(query_tokens: list[np.ndarray], doc_tokens: list[np.ndarray], k: int = TOP_K
                      ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exact late-interaction search: every document scored by ColBERT's sum-of-max over all of its tokens, divided
    by the query's token count n (the ranking of sum-of-max; the scale of XTR's scores, seed 002 eq. 4).

    A text with no token vectors (``Embedder.encode_tokens`` drops special tokens, so a text of ``[UNK]`` only, or of
    zero-width spaces, has none) has nothing to score: such a document is never retrieved (below every document with
    tokens; it is left out, not given a made-up score), and such a query retrieves nothing. Every other document
    keeps its own index, wherever the empty ones are.

    Args:
        query_tokens: one (n_i, dim) array of unit token vectors per query (n_i may be 0); doc_tokens: one (m_j, dim)
            per document (m_j may be 0).
        k: hits per query.

    Returns:
        (scores, indices): per query, up to ``k`` scores (float32) and document indices (int64, into
        ``doc_tokens``), best first, ties by index; empty for a query with no token vectors.
    """
    matrix, owner = _token_matrix(doc_tokens)
    counts = np.array([len(t) for t in doc_tokens], np.int64)
    scored = np.flatnonzero(counts > 0)  # documents with at least one token vector, in index order
    starts = (np.cumsum(counts) - counts)[scored]  # (n_scored,) first row of each in ``matrix``
    k = min(k, len(scored))
    scores, indices = [], []
    for q in query_tokens:
        if not len(q) or not k:
            scores.append(np.zeros(0, np.float32))
            indices.append(np.zeros(0, np.int64))
            continue
        sims = q.astype(np.float32) @ matrix.T  # (n, T)
        best = np.maximum.reduceat(sims, starts, axis=1)  # (n, n_scored): each scored document's best token
        doc_scores = best.astype(np.float64).sum(0) / len(q)  # (n_scored,)
        top = np.argsort(-doc_scores, kind="stable")[:k]
        scores.append(doc_scores[top].astype(np.float32))
        indices.append(scored[top].astype(np.int64))
    return scores, indices


def xtr_search(query_tokens: list[np.ndarray], doc_tokens: list[np.ndarray], k_prime: int = K_PRIME,
               k: int = TOP_K) -> tuple[list[np.ndarray], list[np.ndarray], str]:
    """XTR's search (seed 002, section 3.2): a faiss token index over every document token; each query token
    retrieves its top ``k_prime`` tokens; the documents of those tokens are scored by
    :func:`pipeline.xtr.f_xtr_prime` (best retrieved score per query token, else its k'-th score, averaged over the
    query tokens). No document token outside the retrieved ones is read.

    A document with no token vectors has no token in the index, so it is never retrieved (seed 002: a document no
    query token retrieved is not a candidate); a query with no token vectors retrieves nothing. Every other
    document keeps its own index.

    Returns:
        (scores, indices, description): per query, up to ``k`` candidate scores (float32) and document indices
        (int64), best first (ties by index; empty for a query with no token vectors or a corpus without any); the
        index and k' used, in words.
    """
    import faiss

    from pairmine.pipeline.xtr import f_xtr_prime

    matrix, owner = _token_matrix(doc_tokens)
    index = faiss.IndexFlatIP(matrix.shape[1])
    index.add(matrix)
    kp = min(k_prime, len(matrix))
    all_scores, all_indices = [], []
    for q in query_tokens:
        if not len(q) or not kp:
            all_scores.append(np.zeros(0, np.float32))
            all_indices.append(np.zeros(0, np.int64))
            continue
        sims, rows = index.search(np.ascontiguousarray(q, dtype=np.float32), kp)  # (n, k') each, best first
        scored = f_xtr_prime([(owner[r], s) for r, s in zip(rows, sims)], len(q))
        ranked = sorted(scored.items(), key=lambda item: (-item[1], item[0]))[:k]
        all_scores.append(np.array([v for _, v in ranked], np.float32))
        all_indices.append(np.array([d for d, _ in ranked], np.int64))
    return all_scores, all_indices, f"XTR (seed 002 eq. 4): faiss IndexFlatIP over {len(matrix)} token vectors, " \
                                    f"k' = {kp} tokens per query token, the k'-th score imputed"


def without_word_tokens(embedder, ids: list[str], texts: list[str], prefix: str,
                        tokens: list[np.ndarray] | None = None) -> dict:
    """Which texts have no token vector to score (``Embedder.encode_tokens``: only special tokens after the
    prefix, e.g. a run of emoji, zero-width spaces or an unsplit Thai run under all-MiniLM's vocabulary, each one
    ``[UNK]``): ``{"count": n, "examples": [first few ids]}``. ``tokens``: the texts' token vectors when already
    computed (their lengths are used), else the texts are tokenized (:meth:`Embedder.word_token_counts`)."""
    counts = [len(t) for t in tokens] if tokens is not None else embedder.word_token_counts(texts, prefix).tolist()
    empty = [i for i, c in zip(ids, counts) if c == 0]
    return {"count": len(empty), "examples": empty[:SKIP_EXAMPLES]}


NO_TOKEN_RULES = {
    "dense": "scored as any text: its pooled vector holds only the special tokens ([CLS], [UNK], [SEP])",
    "sum-of-max": "a document with no token vector is never retrieved (nothing to score: below every other "
                  "document); a query with none retrieves nothing (every metric 0)",
    "xtr": "a document with no token vector has no token in the index and is never retrieved; a query with none "
           "retrieves nothing (every metric 0)",
}


def trec_order(hits: dict[str, float]) -> list[tuple[str, float]]:
    """A query's hits in trec_eval's order: score descending, ties by document id descending (trec_eval sorts the
    run itself and ignores ranks), so a run cut to its top n is what ``trec_eval -M n`` scores."""
    return sorted(hits.items(), key=lambda x: (x[1], x[0]), reverse=True)


def ir_metrics(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """nDCG@10, Recall@100 and MRR@10 of every query, by trec_eval (``pytrec_eval``).

    Args:
        qrels: {query id: {doc id: grade}}; grade > 0 is relevant.
        run: {query id: {doc id: score}}, at least the top 100 hits of each query (more are ignored for
            Recall@100 by trec_eval's cutoff; MRR@10 uses the top 10 in :func:`trec_order`).

    Returns:
        {query id: {"ndcg@10": x, "recall@100": x, "mrr@10": x}} for every query of ``qrels`` (a query missing from
        ``run`` scores 0).
    """
    import pytrec_eval

    main = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
    top10 = {q: dict(trec_order(hits)[:MRR_DEPTH]) for q, hits in run.items()}
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    out = {}
    for q in qrels:
        m, r = main.get(q, {}), rr.get(q, {})
        out[q] = {"ndcg@10": float(m.get("ndcg_cut_10", 0.0)), "recall@100": float(m.get("recall_100", 0.0)),
                  "mrr@10": float(r.get("recip_rank", 0.0))}
    return out


def _sha256(path: str, storage: Storage = LOCAL) -> str:
    def digest(f) -> str:
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        return h.hexdigest()

    return storage.read_with(path, digest)


def make_embedder(cfg):
    """The evaluation's :class:`~operators.embed.Embedder`, built from a ``MineConfig``'s embed section exactly as
    the mining job builds it (model, passage prefix, max_length, batch size, dtype, device, threads)."""
    from pairmine.operators.embed import Embedder

    e = cfg.embed
    return Embedder(e.model, cfg.resolved_prefix(), e.max_length, e.batch_size, e.dtype, e.device, e.threads,
                    e.trust_remote_code)


@dataclass
class EvalResult:
    """What :func:`evaluate` returns: the output folder and the content of its summary.json."""

    output_dir: str
    summary: dict


def drop_identical_ids(run: dict[str, dict[str, float]], k: int = TOP_K) -> tuple[dict[str, dict[str, float]], int]:
    """BEIR's ``ignore_identical_ids``: remove from each query's hits the document whose id is the query's own id
    (ArguAna: a query argument is also in the corpus), then keep the ``k`` best of what is left.

    Args:
        run: {query id: {doc id: score}}, retrieved with at least ``k + 1`` hits per query so that ``k`` remain.
        k: hits kept per query.

    Returns:
        (the run, the number of queries whose own id was among their hits and was removed). Same convention as BEIR's
        ``EvaluateRetrieval.evaluate(..., ignore_identical_ids=True)`` and MTEB's retrieval tasks.
    """
    out, dropped = {}, 0
    for q, hits in run.items():
        if q in hits:
            dropped += 1
        kept = sorted(((s, d) for d, s in hits.items() if d != q), key=lambda x: (-x[0], x[1]))[:k]
        out[q] = {d: s for s, d in kept}
    return out, dropped


def evaluate(cfg, beir: str | None = None, sts: str | None = None, output: str = "", split: str = "test",
             scoring: str = "dense", k_prime: int = K_PRIME, ignore_identical_ids: bool = True) -> EvalResult:
    """Evaluate the encoder of ``cfg.embed`` on a BEIR folder and/or an STS file; write summary.json and
    per_query.json (retrieval only) to ``output``.

    Args:
        cfg: a validated ``MineConfig``; its embed section (model, prefixes, max_length, batch size, dtype) is used,
            and its storage section reaches ``s3://`` inputs and output.
        beir: BEIR folder (corpus.jsonl, queries.jsonl, qrels/{split}.tsv), local or ``s3://``, or None.
        sts: STS-B style file, local or ``s3://``, or None.
        output: folder for the JSON files (created), local or ``s3://``; empty: ``evals/<UTC time>-<suffix>``.
        split: the qrels file to use.
        scoring: "dense" (one pooled vector per text, exact inner product), "xtr" (token vectors, XTR's search and
            scoring from the retrieved tokens, :func:`xtr_search`) or "sum-of-max" (token vectors, ColBERT's exact
            score over every token, :func:`sum_of_max_search`). STS always uses the pooled vectors.
        k_prime: tokens retrieved per query token with ``scoring="xtr"``.
        ignore_identical_ids: a document whose id equals the query's id is never retrieved or counted (BEIR's and
            MTEB's convention, needed on ArguAna; no effect where query and corpus ids are disjoint). The number of
            queries it changed is ``summary["retrieval"]["identical_ids_removed"]``.

    Returns:
        :class:`EvalResult`. ``summary["retrieval"]["mean"]`` holds the mean nDCG@10, Recall@100, MRR@10 over the
        evaluated queries; ``summary["retrieval"]["without_word_tokens"]`` the documents and queries with no token
        vector (special tokens only; ``{"count", "examples"}`` each) and the rule the scoring gives them
        (:data:`NO_TOKEN_RULES`); ``summary["sts"]["spearman"]`` the Spearman correlation in [-1, 1].

    Raises:
        EvalInputError: bad or missing inputs (see :func:`load_beir`, :func:`load_sts`), or neither given.
        ConfigError: the model cannot be loaded.
    """
    from pairmine.pipeline.mine import check_model, model_id, new_run_id

    if not beir and not sts:
        raise EvalInputError("nothing to evaluate: give --beir DIR and/or --sts FILE")
    if scoring not in SCORINGS:
        raise EvalInputError(f"--scoring {scoring!r}: must be one of {', '.join(SCORINGS)}")
    if k_prime < 1:
        raise EvalInputError(f"--k-prime {k_prime}: must be >= 1")
    t_start = time.time()
    storage = cfg.storage_layer()
    data = load_beir(beir, split, storage) if beir else None  # fail on bad input before loading the model
    sts_data = load_sts(sts, storage) if sts else None
    check_model(cfg)
    out_dir = str(output or Path("evals") / new_run_id())
    info = storage.info(out_dir)
    if info is not None and info.get("type") != "directory":
        raise EvalInputError(f"--output {out_dir} is a file; it must be a folder (created if missing)")
    embedder = make_embedder(cfg)
    qprefix, pprefix = cfg.resolved_query_prefix(), cfg.resolved_prefix()
    summary = {
        "format": "pairmine-eval-summary/1",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model_id(cfg),
        "query_prefix": qprefix,
        "passage_prefix": pprefix,
        "embed": {"max_length": cfg.embed.max_length, "batch_size": cfg.embed.batch_size, "dtype": cfg.embed.dtype,
                  "device": cfg.embed.device},
    }
    per_query = None
    if data is not None:
        t0 = time.time()
        encode = embedder.encode if scoring == "dense" else embedder.encode_tokens
        doc_vecs = encode(data.corpus_texts, prefix=pprefix)  # (n_docs, dim), or one (m_j, dim) per document
        t_docs = time.time() - t0
        q_vecs = encode(data.query_texts, prefix=qprefix)  # (n_queries, dim), or one (n_i, dim) per query
        t_queries = time.time() - t0 - t_docs
        search = f"exact, fp32 inner product of unit vectors, top {TOP_K}"
        # One more hit than kept when a query's own id may be in the corpus, so that TOP_K remain after dropping it.
        shared = ignore_identical_ids and not set(data.query_ids).isdisjoint(data.corpus_ids)
        depth = TOP_K + 1 if shared else TOP_K
        if scoring == "dense":
            scores, idx = exact_search(q_vecs, doc_vecs, depth)  # (n_queries, depth)
        elif scoring == "sum-of-max":
            scores, idx = sum_of_max_search(q_vecs, doc_vecs, depth)
            search = f"exact late interaction (ColBERT sum-of-max / query tokens) over every token, top {TOP_K}"
        else:
            scores, idx, search = xtr_search(q_vecs, doc_vecs, k_prime, depth)
            search += f", top {TOP_K}"
        run = {q: {data.corpus_ids[j]: float(s) for j, s in zip(idx[i], scores[i])}
               for i, q in enumerate(data.query_ids)}
        identical = 0
        if shared:
            run, identical = drop_identical_ids(run, TOP_K)
            log.info("ignore_identical_ids: %d of %d queries had their own id among their hits (removed)", identical,
                     len(run))
        token_lists = scoring != "dense"  # encode_tokens' arrays: their lengths say which texts have none
        no_tokens = {
            "documents": without_word_tokens(embedder, data.corpus_ids, data.corpus_texts, pprefix,
                                             doc_vecs if token_lists else None),
            "queries": without_word_tokens(embedder, data.query_ids, data.query_texts, qprefix,
                                           q_vecs if token_lists else None),
            "rule": NO_TOKEN_RULES[scoring],
        }
        if no_tokens["documents"]["count"] or no_tokens["queries"]["count"]:
            log.info("%d document(s) and %d query(ies) have no token vector (special tokens only): %s",
                     no_tokens["documents"]["count"], no_tokens["queries"]["count"], no_tokens["rule"])
        per_query = ir_metrics(data.qrels, run)
        means = {m: float(np.mean([v[m] for v in per_query.values()])) for m in METRICS}
        root = str(beir)
        summary["retrieval"] = {
            "dataset": _shown(root),
            "split": split,
            "documents": len(data.corpus_ids),
            "queries_evaluated": len(data.query_ids),
            "judgements": sum(len(v) for v in data.qrels.values()),
            "mean": {m: round(v, 6) for m, v in means.items()},
            "metrics_library": _library_version("pytrec-eval-terrier"),
            "trec_measures": TREC_MEASURES,
            "mrr_note": "trec_eval recip_rank on the run cut to its top 10 (trec_eval -M 10)",
            "scoring": scoring,
            "search": search,
            "ignore_identical_ids": bool(ignore_identical_ids),
            "identical_ids_removed": identical,
            "skipped": data.skips.as_dict(),
            "without_word_tokens": no_tokens,
            "fingerprint": {"qrels_sha256": _sha256(join(root, "qrels", f"{split}.tsv"), storage),
                            "corpus_sha256": _sha256(join(root, "corpus.jsonl"), storage)},
            "seconds": {"embed_corpus": round(t_docs, 2), "embed_queries": round(t_queries, 2)},
        }
    if sts_data is not None:
        from scipy.stats import pearsonr, spearmanr

        t0 = time.time()
        e1 = embedder.encode(sts_data.sentence1, prefix=qprefix)  # (n_pairs, dim)
        e2 = embedder.encode(sts_data.sentence2, prefix=qprefix)  # (n_pairs, dim)
        cos = (e1 * e2).sum(axis=1).astype(np.float64)  # (n_pairs,)
        summary["sts"] = {
            "file": _shown(sts),
            "pairs": len(cos),
            "spearman": round(float(spearmanr(cos, sts_data.gold).statistic), 6),
            "pearson": round(float(pearsonr(cos, sts_data.gold).statistic), 6),
            "prefix_note": "both sentences embedded with the query prefix (symmetric task)",
            "skipped": sts_data.skips.as_dict(),
            "seconds": round(time.time() - t0, 2),
        }
    summary["seconds_total"] = round(time.time() - t_start, 2)
    summary["files"] = {"summary": "summary.json", "per_query": "per_query.json" if per_query is not None else None}
    storage.makedirs(out_dir)
    if per_query is not None:
        _write_json(join(out_dir, "per_query.json"), {
            "format": PER_QUERY_FORMAT, "model": summary["model"], "dataset": summary["retrieval"]["dataset"],
            "split": split, "fingerprint": summary["retrieval"]["fingerprint"], "metrics": list(METRICS),
            "queries": per_query,
        }, storage)
    _write_json(join(out_dir, "summary.json"), summary, storage)
    return EvalResult(out_dir, summary)


def _library_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return f"{name} {md.version(name)}"
    except md.PackageNotFoundError:  # pragma: no cover
        return name


def _write_json(path: str, obj, storage: Storage = LOCAL) -> None:
    storage.write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"))  # published whole


# ---- paired comparison ---------------------------------------------------------------------------------------------

@dataclass
class MetricComparison:
    """Paired comparison of one metric over the common queries (diff = B - A per query).

    Attributes:
        n: queries compared. mean_a / mean_b: means over those queries. mean_diff: mean of B - A.
        ci_low / ci_high: percentile bootstrap interval of mean_diff (level ``ci``).
        wins / ties / losses: queries where B is higher / equal (|diff| <= tie_tol) / lower.
        p_value: two-sided paired randomisation (sign-flip) test of mean_diff = 0.
    """

    metric: str
    n: int
    mean_a: float
    mean_b: float
    mean_diff: float
    ci_low: float
    ci_high: float
    ci: float
    wins: int
    ties: int
    losses: int
    p_value: float


def load_per_query(path: str | Path, storage: Storage = LOCAL) -> dict:
    """Read an evaluation's per-query scores: a ``pairmine eval`` output folder, its ``per_query.json``, or its
    ``summary.json`` (per_query.json is read from beside it); local or ``s3://``.

    Raises:
        EvalInputError: the file is missing, not JSON, or not a per-query result.
    """
    p = str(path)
    info = storage.info(p)
    if info is not None and info.get("type") == "directory":
        p = join(p, "per_query.json")
    elif _name(p) == "summary.json":
        p = join(p.rstrip("/").rsplit("/", 1)[0] if "://" in p else str(Path(p).parent), "per_query.json")
    info = storage.info(p)
    if info is None or info.get("type") == "directory":
        raise EvalInputError(f"{path}: no per-query result ({p} does not exist; give a `pairmine eval --beir` output "
                             "folder or its per_query.json)")
    try:
        data = json.loads(storage.read_bytes(p).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise EvalInputError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("queries"), dict) or not data["queries"]:
        raise EvalInputError(f"{p} is not a per-query result of pairmine eval (no 'queries' object with scores)")
    data["path"] = p
    return data


def paired_bootstrap(diff: np.ndarray, resamples: int = 10_000, seed: int = 0, ci: float = 0.95,
                     max_cells: int = 4_000_000) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences (``scipy.stats.bootstrap``).

    Queries are resampled with replacement; resampling each query's difference B - A is resampling the pairs
    (the same queries for both systems), which is what makes it paired: each query's difficulty cancels in its
    difference. Deterministic for a given seed.

    Args:
        diff: (n,) per-query differences B - A.
        resamples: bootstrap resamples.
        ci: interval level, e.g. 0.95 -> the 2.5th and 97.5th percentiles of the resampled means.
        max_cells: resampled values held in memory at once (scipy's ``batch``; bounds memory for large n).

    Returns:
        (low, high).
    """
    from scipy import stats

    diff = np.asarray(diff, dtype=np.float64)
    res = stats.bootstrap((diff,), np.mean, n_resamples=resamples, confidence_level=ci, method="percentile",
                          batch=max(1, max_cells // max(len(diff), 1)), vectorized=True,
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def sign_flip_p_value(diff: np.ndarray, permutations: int = 10_000, seed: int = 0, max_cells: int = 4_000_000) -> float:
    """Two-sided paired randomisation test of mean(diff) = 0 (``scipy.stats.permutation_test``,
    ``permutation_type="samples"``): under "A and B are exchangeable" each difference's sign is a coin flip.

    With 2^n <= ``permutations`` sign patterns scipy enumerates them all (an exact test); otherwise it draws
    ``permutations`` of them, and the p-value is (1 + #{as extreme}) / (1 + permutations) per side, doubled for the
    two-sided test and capped at 1. 1.0 when every diff is 0.
    """
    from scipy import stats

    diff = np.asarray(diff, dtype=np.float64)
    if not np.any(diff):
        return 1.0
    res = stats.permutation_test((diff,), lambda x, axis: np.mean(x, axis=axis), permutation_type="samples",
                                 n_resamples=permutations, alternative="two-sided", vectorized=True,
                                 batch=max(1, max_cells // max(len(diff), 1)), rng=np.random.default_rng(seed))
    return float(res.pvalue)


def compare_results(a: dict, b: dict, metrics: list[str] | None = None, common_only: bool = False,
                    resamples: int = 10_000, seed: int = 0, ci: float = 0.95, tie_tol: float = 1e-9
                    ) -> tuple[list[MetricComparison], dict]:
    """Paired per-query comparison of two per-query results (see :func:`load_per_query`); diff = B - A.

    Args:
        a, b: per-query results.
        metrics: metric names to compare; None: every metric both results hold (in METRICS order first).
        common_only: compare on the queries both hold; otherwise differing query sets are an error.
        resamples, seed, ci: paired bootstrap and randomisation test settings.
        tie_tol: |B - A| at or below this is a tie.

    Returns:
        (one :class:`MetricComparison` per metric, info dict with query counts and warnings).

    Raises:
        EvalInputError: the query sets differ (without ``common_only``; the message says how many are common),
            no query is common, or a metric is missing from one result.
    """
    qa, qb = set(a["queries"]), set(b["queries"])
    common = sorted(qa & qb)
    info = {"queries_a": len(qa), "queries_b": len(qb), "queries_common": len(common), "warnings": []}
    if not common:
        raise EvalInputError(f"the results share no query id (A: {len(qa)} queries, B: {len(qb)}); were they made on "
                             "the same dataset?")
    if qa != qb and not common_only:
        raise EvalInputError(
            f"the results were scored on different queries: A has {len(qa)}, B has {len(qb)}, {len(common)} in "
            f"common ({len(qa - qb)} only in A, {len(qb - qa)} only in B); a paired comparison needs the same queries "
            "(use --common-only to compare on the common ones)")
    fa, fb = a.get("fingerprint"), b.get("fingerprint")
    if fa and fb and fa.get("qrels_sha256") != fb.get("qrels_sha256"):
        info["warnings"].append("the two results were scored with different qrels files (qrels_sha256 differs)")
    have = [m for m in METRICS if all(m in a["queries"][q] and m in b["queries"][q] for q in common)]
    extra = sorted({m for q in common for m in a["queries"][q]} & {m for q in common for m in b["queries"][q]} - set(have))
    metrics = metrics or have + [m for m in extra if all(m in a["queries"][q] and m in b["queries"][q] for q in common)]
    out = []
    for m in metrics:
        if not all(m in a["queries"][q] and m in b["queries"][q] for q in common):
            raise EvalInputError(f"metric {m!r} is missing from one of the results (they hold: {', '.join(have)})")
        va = np.array([float(a["queries"][q][m]) for q in common])  # (n,)
        vb = np.array([float(b["queries"][q][m]) for q in common])  # (n,)
        diff = vb - va
        low, high = paired_bootstrap(diff, resamples, seed, ci)
        out.append(MetricComparison(
            metric=m, n=len(common), mean_a=float(va.mean()), mean_b=float(vb.mean()), mean_diff=float(diff.mean()),
            ci_low=low, ci_high=high, ci=ci, wins=int(np.sum(diff > tie_tol)), ties=int(np.sum(np.abs(diff) <= tie_tol)),
            losses=int(np.sum(diff < -tie_tol)), p_value=sign_flip_p_value(diff, resamples, seed)))
    return out, info


def verdict(c: MetricComparison) -> str:
    """One honest sentence on a comparison: whether the interval excludes 0 (seed 004, chapter 8)."""
    pct = round(100 * c.ci)
    if c.ties == c.n:
        return f"identical on all {c.n} queries"
    if c.ci_low > 0:
        return f"B is higher: the {pct}% interval of the mean difference excludes 0"
    if c.ci_high < 0:
        return f"B is lower: the {pct}% interval of the mean difference excludes 0"
    return f"no clear difference: the {pct}% interval includes 0 (on {c.n} queries)"
