"""Stages of ``pairmine negatives``: hard negatives for (query, positive) pairs from a corpus (seed 004, chapter 3;
SPEC "Hard negatives and distillation").

read pairs -> embed (query prefix / passage prefix) -> search the corpus index (faiss; one stage per index shard,
their candidate lists merged exactly) -> select the negatives from a rank window -> optional cross-encoder teacher
scores -> write.

Why a rank window: retrieval sets are sparsely labelled, and a good retriever puts the unlabelled relevant passages
at the top of its list, so the top ranks are mostly false negatives (seed 004: of ~6 unlabelled relevant passages
per query, ~4 land in the top 30 and ~2 more in ranks 31-200). Negatives are therefore taken from ranks
``rank_start..rank_end`` of the retrieved list, after dropping the positive and exact duplicates of it, passages of
the pair's own document, and optionally candidates too close to the positive's score.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairmine.operators.chunk import normalise_passage
from pairmine.operators.consistency import doc_hash
from pairmine.operators.embed import Embedder
from pairmine.operators.pairs import EmbedPairs
from pairmine.operators.pairs import _matrix
from pairmine.operators.read import open_input
from pairmine.operators.storage import LOCAL, Storage

# Why a retrieved candidate is not kept as a negative; each count goes to stats.json (negatives_dropped).
DROP_REASONS = ("positive_duplicate", "query_duplicate", "same_document", "before_window", "after_window", "above_margin",
                "above_relative_margin", "beyond_count", "negative_duplicate")

NEGATIVES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("pair_id", pa.string()),
        ("doc_id", pa.string()),  # the pair's document (mine runs); null for plain pairs
        ("query", pa.string()),
        ("positive", pa.string()),
        ("positive_score", pa.float32()),  # cos(query, positive)
        ("negatives", pa.list_(pa.string())),
        ("negative_ranks", pa.list_(pa.int32())),  # 1-based rank in the retrieved list (before any drop)
        ("negative_scores", pa.list_(pa.float32())),  # cos(query, negative) as the index returned it
        ("positive_teacher_score", pa.float32()),  # the cross-encoder's logit; null without --teacher
        ("negative_teacher_scores", pa.list_(pa.float32())),
        ("model", pa.string()),
        ("teacher", pa.string()),
    ]
)


def select_negatives(ids: np.ndarray, scores: np.ndarray, text_hashes: np.ndarray, doc_hashes: np.ndarray,
                     positive_text_hash: int, positive_doc_hash: int | None, positive_score: float, rank_start: int,
                     rank_end: int, count: int, margin: float | None = None, relative_margin: float | None = None,
                     query_text_hash: int | None = None) -> tuple[list[int], Counter]:
    """The negatives of one query from its retrieved list.

    Args:
        ids: (depth,) corpus rows retrieved, best first (-1: no result, as faiss pads).
        scores: (depth,) their cosines with the query.
        text_hashes, doc_hashes: (corpus,) per corpus row: ``doc_hash`` of the normalised text
            (:func:`operators.chunk.normalise_passage`) and of the document id.
        positive_text_hash: the same hash of the pair's positive; positive_doc_hash: of its document id, or None.
        positive_score: cos(query, positive).
        rank_start, rank_end: the window of 1-based ranks (in the retrieved list, before any drop) to keep from.
        count: most negatives kept (the highest-ranked eligible ones).
        margin: drop candidates scoring above ``positive_score - margin`` (absolute margin); None: off.
        relative_margin: drop candidates scoring above ``relative_margin * positive_score``; None: off.
        query_text_hash: the same hash of the query: a passage with the query's own text (a mined anchor repeated
            in another document) is not a negative of it; None: off.

    A candidate with the text (normalised, as ``text_hashes``) of a negative already kept is dropped as
    ``negative_duplicate``: a corpus that repeats a passage (web pages, boilerplate) gives it one place in the list,
    as sentence-transformers' ``mine_hard_negatives`` does by de-duplicating its corpus.

    Returns:
        (positions in ``ids`` of the kept negatives, best first; Counter of :data:`DROP_REASONS`). Every retrieved
        candidate is either kept or counted under exactly one reason (checked in that order).
    """
    kept, kept_texts, drops = [], set(), Counter()
    for pos, (row, score) in enumerate(zip(ids.tolist(), scores.tolist())):
        if row < 0:
            continue
        rank = pos + 1
        if text_hashes[row] == positive_text_hash:
            drops["positive_duplicate"] += 1
        elif query_text_hash is not None and text_hashes[row] == query_text_hash:
            drops["query_duplicate"] += 1
        elif positive_doc_hash is not None and doc_hashes[row] == positive_doc_hash:
            drops["same_document"] += 1
        elif rank < rank_start:
            drops["before_window"] += 1
        elif rank > rank_end:
            drops["after_window"] += 1
        elif margin is not None and score > positive_score - margin:
            drops["above_margin"] += 1
        elif relative_margin is not None and score > relative_margin * positive_score:
            drops["above_relative_margin"] += 1
        elif len(kept) >= count:
            drops["beyond_count"] += 1
        elif text_hashes[row] in kept_texts:
            drops["negative_duplicate"] += 1
        else:
            kept.append(pos)
            kept_texts.add(text_hashes[row])
    return kept, drops


def text_hash(text: str) -> int:
    """The identity of a passage for "exact duplicate of the positive": ``doc_hash`` of its normalised form
    (:func:`operators.chunk.normalise_passage`) without outer whitespace, control and format characters
    (:func:`outer_trim`), so that a positive written as ``"\x00Yes.\u2060"`` is its corpus passage ``"Yes."``."""
    return doc_hash(normalise_passage(outer_trim(text)))


class ReadGroupPairs:
    """Read operator for a ``pairmine mine`` run as input: work units over its ``groups/`` parts -> one pair per
    group: ``pair_id`` (group id), ``doc_id``, ``query`` (the anchor), ``passage`` (s1, the top related passage),
    ``skip_reason`` (null), ``text_repaired`` (False), ``shard_index``, ``unit_offset`` (the work unit's first row),
    ``row_index``."""

    def __init__(self, storage: Storage = LOCAL):
        self.storage = storage

    def __call__(self, units: pa.Table) -> pa.Table:
        tables = []
        for u in units.to_pylist():
            def read(path=u["path"], rg=u["row_group"]) -> pa.Table:
                with open_input(path, self.storage) as f:
                    return pq.ParquetFile(f).read_row_group(rg, columns=["group_id", "doc_id", "anchor_text",
                                                                          "related_texts"])

            t = self.storage.retry("read", u["path"], read)
            n = t.num_rows
            tables.append(pa.table({
                "shard_index": pa.array(np.full(n, u["shard_index"], np.int32)),
                "unit_offset": pa.array(np.full(n, u["row_offset"], np.int64)),
                "row_index": pa.array(np.arange(u["row_offset"], u["row_offset"] + n, dtype=np.int64)),
                "pair_id": t.column("group_id"), "doc_id": t.column("doc_id"), "query": t.column("anchor_text"),
                "passage": pc.list_element(t.column("related_texts"), 0),
                "skip_reason": pa.nulls(n, pa.string()), "text_repaired": pa.array(np.zeros(n, bool)),
            }))
        return pa.concat_tables(tables)


class EmbedPairVectors(EmbedPairs):
    """Embed operator: adds ``query_vector`` and ``passage_vector`` (fixed_size_list<float32, dim>) to every pair, the
    query with ``query_prefix`` and the positive with the passage prefix (E5: "query: " / "passage: "), and
    ``vectors_reused`` (int32, 0-2 per row): how many of the row's two vectors were not computed but taken from
    ``known``. Skipped rows get zero vectors.

    ``known`` (as :class:`operators.embed.Embedder`'s): the corpus vectors, keyed by their prefixed text. A positive
    found in the corpus (the usual case: a mine run's s1, or a pair whose passage is a corpus document) gets its corpus
    vector without a forward pass, as sentence-transformers' ``mine_hard_negatives`` does; so does a query whose
    prefixed text is a corpus passage's (only when the query prefix equals the passage prefix, e.g. all-MiniLM's
    empty ones: with E5's "query: " no key matches and every query is embedded). A text is looked up as it is, or
    without outer whitespace when that gives the same input ids (:meth:`texts_to_embed`). Reused vectors equal a forward
    pass's to ~1e-7 (a vector does not depend on its batch). Other args as :class:`operators.embed.Embedder`.
    """

    count_reused = True

    def __init__(self, query_prefix: str = "", known=None, **embedder_kwargs):
        super().__init__(query_prefix, known=known, **embedder_kwargs)

    def setup(self) -> None:
        """With ``known``, only its vectors now: the tokenizer once a text is not found as it is, the model once a
        text is not found at all (when the corpus pass embedded the queries and looked up the positives' forms, a
        pairs actor that finds every text in ``known`` imports neither transformers nor torch). Without ``known``,
        tokenizer and model."""
        if self.embedder._known_loader is None:
            self.embedder.setup()
        else:
            self.embedder.setup_known()

    def texts_to_embed(self, texts: list[str], prefix: str) -> list[str]:
        """Each text as it is looked up in ``known``: as it is when ``known`` has it (the corpus pass stores the
        forms it found for the pairs' texts as aliases), else its :func:`lookup_forms` form."""
        if self.embedder._known_loader is None:
            return texts
        from pairmine.operators.embed import find_known

        self.embedder.setup_known()
        found, _ = find_known(self.embedder._known, [prefix + t for t in texts])
        missing = np.flatnonzero(~found).tolist()
        if not missing:
            return texts
        self.embedder.setup_tokenizer()
        forms = lookup_forms(self.embedder._tokenizer, self.embedder.max_length, [texts[i] for i in missing], prefix)
        out = list(texts)
        for i, form in zip(missing, forms):
            out[i] = form
        return out


_INVISIBLE = ("Zs", "Zl", "Zp", "Cc", "Cf")  # Unicode categories of spaces, controls and format characters (U+200B)


def outer_trim(text: str) -> str:
    """``text`` without outer whitespace, control and format characters (a zero-width space, a BOM): how a corpus
    passage begins and ends, since it runs from its first word to its last. ``outer_trim(" \u200bYes. ") == "Yes."``"""
    import unicodedata

    lo, hi = 0, len(text)
    while lo < hi and (text[lo].isspace() or unicodedata.category(text[lo]) in _INVISIBLE):
        lo += 1
    while hi > lo and (text[hi - 1].isspace() or unicodedata.category(text[hi - 1]) in _INVISIBLE):
        hi -= 1
    return text[lo:hi]


def lookup_forms(tokenizer, max_length: int, texts: list[str], prefix: str) -> list[str]:
    """Each text, or its form without outer whitespace and invisible characters (:func:`outer_trim`) where
    ``tokenizer`` gives both the same input ids with ``prefix`` before them (so the model computes the same vector from
    either): a corpus passage is a slice of its document from its first word to its last, so a positive that is a
    whole document (" \u200bYes you can ...") finds its passage's key. The corpus pass stores the queries it embeds
    in this form, so the pairs pass finds them."""
    stripped = [outer_trim(t) for t in texts]
    differ = [i for i, (t, s) in enumerate(zip(texts, stripped)) if t != s and s]
    if not differ:
        return texts
    tokenize = partial(tokenizer, truncation=True, max_length=max_length)
    before = tokenize([prefix + texts[i] for i in differ])["input_ids"]
    after = tokenize([prefix + stripped[i] for i in differ])["input_ids"]
    out = list(texts)
    for i, a, b in zip(differ, before, after):
        if a == b:
            out[i] = stripped[i]
    return out


class EmbedCorpus(Embedder):
    """Embed operator of the negatives corpus pass: rows of ``passages`` (list<string>), ``query_rows`` (bool) and
    ``positives`` (list<string>). Corpus rows are embedded as :class:`operators.embed.Embedder` does (passage
    prefix); query rows (the pairs' queries, embedded in the same pass so that the pairs pass needs no model of its
    own) with ``query_prefix``, their texts first put in the form the pairs pass looks up (:func:`lookup_forms`,
    written back to ``passages``). A query row's ``positives`` (the pairs' positives) are not embedded: their
    lookup forms are found, so that the pairs pass finds a positive that is a corpus passage up to outer whitespace
    without a tokenizer. Adds ``vectors``, ``n_token_truncated`` and ``n_vector_reused`` as the Embedder does, and
    ``alias_keys`` / ``alias_targets`` (list<string>, prefixed texts: each text of the row whose lookup form differs,
    and that form); drops ``positives``. Other args as :class:`operators.embed.Embedder`."""

    def __init__(self, query_prefix: str = "", **embedder_kwargs):
        super().__init__(**embedder_kwargs)
        self.query_prefix = query_prefix

    def _aliases(self, texts: list[str], prefix: str) -> tuple[list[str], list[str], list[str]]:
        """(lookup forms of ``texts``; prefixed texts whose form differs; their prefixed forms)."""
        forms = lookup_forms(self._tokenizer, self.max_length, texts, prefix)
        pairs = [(prefix + t, prefix + f) for t, f in zip(texts, forms) if t != f]
        return forms, [a for a, _ in pairs], [b for _, b in pairs]

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.setup_tokenizer()
        flags = batch.column("query_rows").to_numpy(zero_copy_only=False)
        n = batch.num_rows
        keys, targets = [[] for _ in range(n)], [[] for _ in range(n)]
        positives = batch.column("positives").to_pylist() if "positives" in batch.column_names else [[]] * n
        batch = batch.drop_columns([c for c in ("positives",) if c in batch.column_names])
        if not flags.any():
            out = super().__call__(batch)
        else:
            passages = batch.column("passages").to_pylist()
            for i in np.flatnonzero(flags):
                passages[i], keys[i], targets[i] = self._aliases(passages[i], self.query_prefix)
                _, more_keys, more_targets = self._aliases(positives[i], self.passage_prefix)
                keys[i] += more_keys
                targets[i] += more_targets
            tables = []
            for i in range(n):  # one prefix per row; rows keep their order
                row = batch.slice(i, 1).set_column(batch.schema.get_field_index("passages"), "passages",
                                                   pa.array([passages[i]], pa.list_(pa.string())))
                tables.append(self.embed_rows(row, self.query_prefix if flags[i] else None))
            out = pa.concat_tables(tables)
        return (out.append_column("alias_keys", pa.array(keys, pa.list_(pa.string())))
                .append_column("alias_targets", pa.array(targets, pa.list_(pa.string()))))


class PassageKeys:
    """One partition of the set of corpus passages already seen, for exact de-duplication before embedding (run as
    a Ray actor, one per hash range: partition ``k`` of ``K`` holds the keys with ``key % K == k``, so the set grows
    with the corpus over more actors, not in one process). Keys are :func:`operators.embed.text_keys` of the passage
    texts (64-bit); 16 bytes per distinct passage (key and document hash), in sorted numpy arrays.

    A passage is embedded by whichever chunk task claims its key first (every copy has the same text, so the same
    vector); its document is the smallest document hash among the copies (:meth:`documents`), so that the index
    does not depend on which task came first.
    """

    def __init__(self):
        self.keys = np.zeros(0, np.int64)  # sorted
        self.docs = np.zeros(0, np.int64)  # smallest document hash of each key's copies
        self.duplicates = 0

    def claim(self, keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
        """(n,) bool: True for the first copy of each key not seen before (the one to embed); every copy's
        document is recorded. Keys (n,) int64, docs (n,) int64 document hashes."""
        keys, docs = np.asarray(keys, np.int64), np.asarray(docs, np.int64)
        first = np.zeros(len(keys), bool)
        if not len(keys):
            return first
        order = np.lexsort((np.arange(len(keys)), keys))  # by key, then position: each key's first copy first
        k, d = keys[order], docs[order]
        head = np.ones(len(k), bool)
        head[1:] = k[1:] != k[:-1]
        starts = np.flatnonzero(head)
        batch_keys, batch_docs = k[starts], np.minimum.reduceat(d, starts)  # distinct keys of the call
        pos = np.searchsorted(self.keys, batch_keys)
        seen = (pos < len(self.keys)) & (self.keys[np.minimum(pos, len(self.keys) - 1)] == batch_keys) \
            if len(self.keys) else np.zeros(len(batch_keys), bool)
        self.docs[pos[seen]] = np.minimum(self.docs[pos[seen]], batch_docs[seen])
        first[order[starts[~seen]]] = True
        at = pos[~seen]  # the new keys are sorted (batch_keys is): one linear insert keeps the arrays sorted
        self.keys, self.docs = np.insert(self.keys, at, batch_keys[~seen]), np.insert(self.docs, at, batch_docs[~seen])
        self.duplicates += int(len(keys) - first.sum())
        return first

    def documents(self, keys: np.ndarray) -> np.ndarray:
        """(n,) int64: the smallest document hash among the copies of each claimed key."""
        pos = np.searchsorted(self.keys, np.asarray(keys, np.int64))
        return self.docs[np.minimum(pos, len(self.keys) - 1)]

    def count(self) -> tuple[int, int]:
        """(distinct passages, copies dropped) so far."""
        return len(self.keys), self.duplicates


def load_index(blob: np.ndarray):
    """A faiss index from :func:`faiss.serialize_index` bytes (uint8 array)."""
    import faiss

    return faiss.deserialize_index(blob)


# The running candidate list of each pair, carried between the search stages (one per index shard): global corpus
# rows, scores, and what the selection needs of each candidate (its text, the hashes of its text and document).
CANDIDATE_COLUMNS = {"cand_ids": pa.list_(pa.int64()), "cand_scores": pa.list_(pa.float32()),
                     "cand_text_hashes": pa.list_(pa.int64()), "cand_doc_hashes": pa.list_(pa.int64()),
                     "cand_texts": pa.list_(pa.string())}


def merge_candidates(ids_a: np.ndarray, scores_a: np.ndarray, ids_b: np.ndarray, scores_b: np.ndarray,
                     depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``depth`` of two candidate lists of one query, as positions into their concatenation.

    Exact: each index shard returns its own top ``depth``, so the corpus's top ``depth`` is among the shards' lists
    together, and merging them shard by shard gives the same list as one search of the whole corpus. Order: score
    descending, then global corpus row ascending (one order whatever the sharding; a tie at equal scores is the only
    place where an exact faiss search over the whole corpus may order two candidates otherwise).

    Args:
        ids_a, scores_a: (a,) global corpus rows and cosines of the list so far (a may be 0).
        ids_b, scores_b: (b,) the same from the next shard (rows < 0, faiss's padding, are dropped).
        depth: most candidates kept.

    Returns:
        (positions (<= depth,) int64 into ``concat(a, b)``, best first; their scores float32).
    """
    order, valid = merge_candidate_lists(np.asarray(ids_a)[None], np.asarray(scores_a)[None], np.asarray(ids_b)[None],
                                         np.asarray(scores_b)[None], depth)
    order = order[0][valid[0]]
    return order, np.concatenate([scores_a, scores_b]).astype(np.float32)[order]


def merge_candidate_lists(ids_a: np.ndarray, scores_a: np.ndarray, ids_b: np.ndarray, scores_b: np.ndarray,
                          depth: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`merge_candidates` for m queries at once, on lists padded with row -1 (faiss's padding).

    Args:
        ids_a, scores_a: (m, a) global corpus rows and cosines of the lists so far (a may be 0).
        ids_b, scores_b: (m, b) the same from the next shard.
        depth: most candidates kept.

    Returns:
        (positions (m, min(depth, a + b)) int64 into each row of ``concat(a, b, axis=1)``, best first (score
        descending, then row ascending; padding last); valid (m, min(depth, a + b)) bool: False for padding).
    """
    ids = np.concatenate([ids_a, ids_b], axis=1).astype(np.int64)
    scores = np.concatenate([scores_a, scores_b], axis=1).astype(np.float32)
    padding = ids < 0
    order = np.lexsort((ids, -scores, padding), axis=-1)[:, :depth]
    return order, ~np.take_along_axis(padding, order, axis=1)


class TorchFlatSearch:
    """Exact inner-product top-k with torch, for a GPU: the shard's vectors live on ``device`` and each query batch is
    scored against them a chunk of rows at a time (a running top-k, so the (queries x shard) score matrix is never
    whole; each chunk's top k by ``torch.topk``, then one stable sort of 2k per query). Full fp32 (TF32 off), so
    its scores are those of faiss ``IndexFlatIP`` to float rounding. Used for an exact index on CUDA: faiss's GPU
    build (``faiss-gpu-cu12``) and the CPU build (``faiss-cpu``) install the same ``faiss`` module and cannot live
    side by side, while torch with CUDA is there already.

    Args:
        vectors: (n, dim) float32 unit vectors of the shard.
        device: a torch device ("cuda", "cpu").
        chunk_mb: MiB of fp32 scores per chunk of shard rows.
    """

    def __init__(self, vectors: np.ndarray, device: str = "cuda", chunk_mb: float = 256):
        import torch

        self.device = torch.device(device)
        self.x = torch.from_numpy(np.ascontiguousarray(vectors, np.float32)).to(self.device)  # (n, dim)
        self.ntotal, self.chunk_mb = len(vectors), chunk_mb

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss's ``search``: (scores (m, k) float32, rows (m, k) int64), best first, for (m, dim) queries; rows
        -1 where the shard has fewer than ``k`` vectors. Ties at equal scores: the lower row first."""
        import torch

        m = len(q)
        k_eff = min(k, self.ntotal)
        rows_per_chunk = max(k_eff, int(self.chunk_mb * 2 ** 20 / 4 / max(m, 1)))
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with torch.inference_mode():
                qt = torch.from_numpy(np.ascontiguousarray(q, np.float32)).to(self.device)
                best_s = torch.empty((m, 0), device=self.device)
                best_i = torch.empty((m, 0), dtype=torch.int64, device=self.device)
                for lo in range(0, self.ntotal, rows_per_chunk):
                    s = qt @ self.x[lo:lo + rows_per_chunk].T  # (m, chunk)
                    s, i = self._chunk_top(s, lo, min(k_eff, s.shape[1]))
                    s, i = torch.cat([best_s, s], 1), torch.cat([best_i, i], 1)
                    # stable sort by score descending keeps the lower row first among equal scores (the earlier
                    # chunks' rows are lower and come first)
                    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k_eff]
                    best_s, best_i = torch.gather(s, 1, order), torch.gather(i, 1, order)
                scores, rows = best_s.cpu().numpy(), best_i.cpu().numpy()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if k_eff < k:
            scores = np.pad(scores, ((0, 0), (0, k - k_eff)), constant_values=-np.inf)
            rows = np.pad(rows, ((0, 0), (0, k - k_eff)), constant_values=-1)
        return scores.astype(np.float32), rows

    def _chunk_top(self, s, lo: int, k: int):
        """One chunk's top ``k`` per query, (scores (m, k), rows (m, k)) in row order: ``torch.topk`` finds each
        query's k-th score t; the entries >= t are the top k in row order unless a score equal to t repeats across
        the cut, and then (rare: equal fp32 scores) the whole chunk is returned, for the caller's stable sort to
        cut."""
        import torch

        t = torch.topk(s, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values  # (m, 1)
        keep = s >= t
        rows = torch.arange(lo, lo + s.shape[1], device=s.device)
        if bool((keep.sum(dim=1) == k).all()):
            cols = torch.nonzero(keep)[:, 1].view(len(s), k)  # row-major: each query's columns ascending
            return torch.gather(s, 1, cols), rows[cols]
        return s, rows.expand(len(s), -1)


class SearchShard:
    """Search operator for one shard of the corpus index: its top ``depth`` for every usable pair's query, merged
    (:func:`merge_candidates`) into the pair's running candidate list (:data:`CANDIDATE_COLUMNS`; the first shard's
    stage starts the list). A chain of these, one per shard, each actor holding only its shard, is an exact search
    of the whole corpus; with one shard it is one faiss search.

    Args:
        load_shard: callable -> (index bytes (uint8 array), text hashes (n,) int64, doc hashes (n,) int64, texts
            (pa.StringArray, n)) of this shard, called once per actor (from Ray's object store).
        offset: the global corpus row of the shard's first passage.
        depth: candidates kept per query.
        threads: faiss OpenMP threads (0: faiss's default).
        device: "cuda": an exact (flat) shard is searched on the GPU with :class:`TorchFlatSearch`; IVF and HNSW
            shards, and "cpu", with faiss on the CPU. ``torch_device`` forces the torch engine on another device
            (the tests compare both engines on a CPU).
    """

    def __init__(self, load_shard, offset: int = 0, depth: int = 200, threads: int = 0, device: str = "cpu",
                 torch_device: str | None = None):
        self.load_shard, self.offset, self.depth, self.threads = load_shard, offset, depth, threads
        self.torch_device = torch_device or ("cuda" if device == "cuda" else None)
        self._shard = None

    def shard(self):
        if self._shard is None:
            import faiss

            if self.threads:
                faiss.omp_set_num_threads(self.threads)
            blob, text_hashes, doc_hashes, texts = self.load_shard()
            index = load_index(blob)
            if self.torch_device and isinstance(index, faiss.IndexFlat):
                index = TorchFlatSearch(index.reconstruct_n(0, index.ntotal), self.torch_device)
            self._shard = (index, text_hashes, doc_hashes, texts)
        return self._shard

    def __call__(self, batch: pa.Table) -> pa.Table:
        index, text_hashes, doc_hashes, texts = self.shard()
        n = batch.num_rows
        ok = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(ok)
        first = "cand_ids" not in batch.column_names
        # Each list column as (flat values, offsets (n + 1,)): the old lists, empty before the first shard.
        old = {c: _flat_lists(batch.column(c)) if not first else (pa.array([], t.value_type), np.zeros(n + 1, int))
               for c, t in CANDIDATE_COLUMNS.items()}
        old_ids, old_scores = old["cand_ids"][0].to_numpy(), old["cand_scores"][0].to_numpy()
        bounds = old["cand_ids"][1]
        counts, src = np.zeros(n + 1, np.int64), np.zeros(0, np.int64)  # src: positions in concat(old, new values)
        found_scores, found = np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64)
        if len(rows):
            q = np.ascontiguousarray(_matrix(batch.column("query_vector"))[rows], np.float32)  # (usable, dim)
            found_scores, found = index.search(q, min(self.depth, index.ntotal))  # (usable, b), row -1: padding
            # each usable row's old list, padded to the longest: its flat positions, rows and scores
            lengths = (bounds[1:] - bounds[:-1])[rows]
            a = int(lengths.max())
            has = np.arange(a) < lengths[:, None]  # (usable, a)
            old_pos = np.where(has, bounds[rows][:, None] + np.arange(a), 0)
            ids_a = np.where(has, old_ids[old_pos] if a else 0, -1)
            scores_a = np.where(has, old_scores[old_pos] if a else 0, -np.inf)
            order, valid = merge_candidate_lists(ids_a, scores_a, np.where(found >= 0, found + self.offset, -1),
                                                 found_scores, self.depth)
            old_src = np.take_along_axis(old_pos, np.minimum(order, a - 1), axis=1) if a else 0
            new_src = len(old_ids) + np.arange(len(rows))[:, None] * found.shape[1] + order - a
            src = np.where(order < a, old_src, new_src)[valid]  # row by row, best first
            counts[rows + 1] = valid.sum(axis=1)
        offsets = np.cumsum(counts)
        take = pa.array(src)
        local = np.maximum(found, 0).ravel()  # this shard's rows, padding pointing at row 0 (never taken)
        new = {"cand_ids": pa.array(local + self.offset), "cand_scores": pa.array(found_scores.ravel()),
               "cand_text_hashes": pa.array(text_hashes[local]), "cand_doc_hashes": pa.array(doc_hashes[local]),
               "cand_texts": texts.take(pa.array(local))}
        mask = pa.array(~ok)
        out = batch if first else batch.drop_columns(list(CANDIDATE_COLUMNS))
        for c, t in CANDIDATE_COLUMNS.items():
            values = pa.concat_arrays([old[c][0].cast(t.value_type), new[c].cast(t.value_type)]).take(take)
            out = out.append_column(c, pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=mask))
        return out


def _flat_lists(column) -> tuple[pa.Array, np.ndarray]:
    """A list column as (its values, offsets (rows + 1,) from 0): row r's list is ``values[offsets[r]:offsets[r+1]]``
    (a null row: an empty range)."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = lists.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    return lists.values.slice(offsets[0], offsets[-1] - offsets[0]), offsets - offsets[0]


class SelectNegatives:
    """Select operator, after the search stages: each usable pair's negatives from its merged candidate list
    (:func:`select_negatives`). Replaces the vectors and candidate columns with ``positive_score`` (cos(query,
    positive)), ``negatives``, ``negative_ranks`` (1-based, in the merged list), ``negative_scores`` and a JSON
    ``drops`` column (the batch's Counter of drop reasons, on its first row).

    Args: as :func:`select_negatives` (rank_start, rank_end, count, margin, relative_margin).
    """

    def __init__(self, rank_start: int = 31, rank_end: int = 200, count: int = 7, margin: float | None = None,
                 relative_margin: float | None = None):
        self.window = dict(rank_start=rank_start, rank_end=rank_end, count=count, margin=margin,
                           relative_margin=relative_margin)

    def __call__(self, batch: pa.Table) -> pa.Table:
        ok = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(ok)
        n = batch.num_rows
        pos_score = np.full(n, np.nan, np.float32)
        negs: list = [None] * n
        ranks: list = [None] * n
        scores: list = [None] * n
        drops = Counter()
        if len(rows):
            q = _matrix(batch.column("query_vector"))[rows]  # (usable, dim)
            p = _matrix(batch.column("passage_vector"))[rows]  # (usable, dim)
            positives, queries = batch.column("passage").to_pylist(), batch.column("query").to_pylist()
            doc_ids = batch.column("doc_id").to_pylist() if "doc_id" in batch.column_names else [None] * n
            cand_scores, bounds = _flat_lists(batch.column("cand_scores"))
            cand_scores = cand_scores.to_numpy()
            text_hashes = _flat_lists(batch.column("cand_text_hashes"))[0].to_numpy()
            doc_hashes = _flat_lists(batch.column("cand_doc_hashes"))[0].to_numpy()
            cand_texts = _flat_lists(batch.column("cand_texts"))[0]
            for k, r in enumerate(rows.tolist()):
                s = float(np.dot(q[k], p[k]))
                pos_score[r] = s
                lo, hi = int(bounds[r]), int(bounds[r + 1])
                kept, d = select_negatives(np.arange(hi - lo), cand_scores[lo:hi], text_hashes[lo:hi],
                                           doc_hashes[lo:hi], text_hash(positives[r]),
                                           None if doc_ids[r] is None else doc_hash(doc_ids[r]), s, **self.window,
                                           query_text_hash=text_hash(queries[r]))
                drops.update(d)
                negs[r] = cand_texts.take(pa.array(lo + np.asarray(kept, np.int64))).to_pylist()
                ranks[r] = [i + 1 for i in kept]
                scores[r] = cand_scores[lo:hi][kept].tolist()
        out = batch.drop_columns(["query_vector", "passage_vector", *CANDIDATE_COLUMNS])
        out = out.append_column("positive_score", pa.array(pos_score, mask=~ok))
        out = out.append_column("negatives", pa.array(negs, pa.list_(pa.string())))
        out = out.append_column("negative_ranks", pa.array(ranks, pa.list_(pa.int32())))
        out = out.append_column("negative_scores", pa.array(scores, pa.list_(pa.float32())))
        return out.append_column("drops", pa.array([json.dumps(dict(drops))] + [None] * (n - 1), pa.string()))


class SearchAndSelect:
    """Search then select in one operator, for an index of one shard (the whole corpus): :class:`SearchShard`'s
    candidate lists go straight into :class:`SelectNegatives` inside the same actor, so a pair's ``depth``
    candidates (their texts included: ~200 KB a pair at depth 200 with 1,000-character passages) never pass through
    Ray's object store; only its negatives do (``count`` texts). With several index shards the chain of search
    stages has to carry the lists from shard to shard, and selection is a stage of its own.

    Args:
        search: the shard's :class:`SearchShard` (offset 0).
        select: the run's :class:`SelectNegatives`.

    Input and output columns: :class:`SearchShard`'s input, :class:`SelectNegatives`' output.
    """

    def __init__(self, search: SearchShard, select: SelectNegatives):
        self.search, self.select = search, select

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.select(self.search(batch))


class TeacherScores:
    """Teacher operator: a cross-encoder (any HuggingFace sequence-classification model with one output, e.g. the
    ms-marco MiniLM or bge rerankers) scores (query, positive) and every (query, negative) once, offline (seed 004:
    the teacher never runs during training). Adds ``positive_teacher_score`` (float32) and
    ``negative_teacher_scores`` (list<float32>): the model's logits.

    Args:
        model: folder or hub id. max_length: tokens per (query, passage) pair. batch_size: pairs per forward pass.
        device: cpu | cuda. threads: torch CPU threads (0: leave torch's default).

    Raises:
        ValueError: the model has more than one output (a classifier, not a relevance scorer).
    """

    def __init__(self, model: str, max_length: int = 512, batch_size: int = 32, device: str = "cpu",
                 threads: int = 0):
        self.model_path, self.max_length, self.batch_size = model, max_length, batch_size
        self.device, self.threads = device, threads
        self.model = None

    def setup(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.threads:
            torch.set_num_threads(self.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.model_path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"teacher {self.model_path} has {self.model.config.num_labels} outputs; a cross-encoder "
                             "teacher gives one relevance logit per (query, passage) pair")

    def score(self, queries: list[str], passages: list[str]) -> np.ndarray:
        """(n,) float32 logits of the (query, passage) pairs."""
        import torch

        if self.model is None:
            self.setup()
        out = []
        with torch.inference_mode():
            for i in range(0, len(queries), self.batch_size):
                enc = self.tokenizer(queries[i:i + self.batch_size], passages[i:i + self.batch_size], padding=True,
                                     truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
                out.append(self.model(**enc).logits[:, 0].float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def __call__(self, batch: pa.Table) -> pa.Table:
        queries, positives = batch.column("query").to_pylist(), batch.column("passage").to_pylist()
        negatives = batch.column("negatives").to_pylist()
        qs, ps, owner = [], [], []
        for r, (q, p, ns) in enumerate(zip(queries, positives, negatives)):
            if ns is None:
                continue
            for text in [p, *ns]:
                qs.append(q), ps.append(text), owner.append(r)
        logits = self.score(qs, ps)
        pos = [None] * batch.num_rows
        neg: list = [None] * batch.num_rows
        k = 0
        for r, ns in enumerate(negatives):
            if ns is None:
                continue
            pos[r] = float(logits[k])
            neg[r] = logits[k + 1:k + 1 + len(ns)].tolist()
            k += 1 + len(ns)
        return batch.append_column("positive_teacher_score", pa.array(pos, pa.float32())) \
            .append_column("negative_teacher_scores", pa.array(neg, pa.list_(pa.float32())))


class NegativesWriter:
    """Write operator: stages every usable pair with its negatives per work unit (``NEGATIVES_SCHEMA`` plus the
    staging sort column; :func:`operators.write.stage_by_unit`) and returns one row per (batch, work unit) with
    columns ``shard_index``, ``unit_offset``, ``staged`` and ``stats`` (that unit's counts in this batch, JSON)."""

    def __init__(self, staging_dir: str, run_id: str, model: str, teacher: str, storage: Storage = LOCAL):
        self.staging_dir, self.run_id, self.model, self.teacher = staging_dir.rstrip("/"), run_id, model, teacher
        self.storage = storage

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pairmine.operators.write import write_per_unit

        return write_per_unit(batch, self._write_unit)

    def _write_unit(self, batch: pa.Table) -> tuple[list[str], str]:
        """Stage one work unit's pairs of a batch; returns (files staged, counts as JSON)."""
        from pairmine.operators.write import STAGING_SORT_COLUMN, stage_by_unit

        stats = Counter()
        stats["pairs_in"] = batch.num_rows
        stats["pairs_text_repaired"] = int(batch.column("text_repaired").to_numpy(zero_copy_only=False).sum())
        if "vectors_reused" in batch.column_names:
            stats["vectors_reused"] = int(pc.sum(batch.column("vectors_reused")).as_py() or 0)
        for r in batch.column("skip_reason").to_pylist():
            if r is not None:
                stats[f"pairs_skipped.{r}"] += 1
        for d in batch.column("drops").to_pylist():
            if d:
                stats.update({f"negatives_dropped.{k}": v for k, v in json.loads(d).items()})
        usable = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        part = batch.filter(pa.array(usable))
        counts = pc.list_value_length(part.column("negatives")).to_numpy(zero_copy_only=False) if part.num_rows else []
        stats["pairs_out"] = part.num_rows
        stats["negatives"] = int(np.sum(counts))
        stats["pairs_without_negatives"] = int(np.sum(np.asarray(counts) == 0))
        staged = []
        if part.num_rows:
            m = part.num_rows
            has_teacher = "positive_teacher_score" in part.column_names
            table = pa.table({
                "run_id": pa.array([self.run_id] * m, pa.string()), "pair_id": part.column("pair_id"),
                "doc_id": part.column("doc_id") if "doc_id" in part.column_names else pa.nulls(m, pa.string()),
                "query": part.column("query"), "positive": part.column("passage"),
                "positive_score": part.column("positive_score"), "negatives": part.column("negatives"),
                "negative_ranks": part.column("negative_ranks"), "negative_scores": part.column("negative_scores"),
                "positive_teacher_score": part.column("positive_teacher_score") if has_teacher
                else pa.nulls(m, pa.float32()),
                "negative_teacher_scores": part.column("negative_teacher_scores") if has_teacher
                else pa.nulls(m, pa.list_(pa.float32())),
                "model": pa.array([self.model] * m, pa.string()),
                "teacher": pa.array([self.teacher or None] * m, pa.string()),
                STAGING_SORT_COLUMN: part.column("row_index"),
            })
            staged = [name for _, name in stage_by_unit(self.storage, table, part.column("shard_index").to_numpy(),
                                                        part.column("unit_offset").to_numpy(),
                                                        f"{self.staging_dir}/negatives", "negatives")]
        return staged, json.dumps(dict(stats))
