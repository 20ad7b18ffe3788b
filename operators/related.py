"""Related passages stage: weighted RRF of dense and TF-IDF rankings (SPEC "Related passages"; seed 000).

For anchor a, the candidates are the document's other passages. They are ranked 1..n by dense cosine
cos(e_a, e_p) and, separately, by TF-IDF cosine (both descending; ties go to the lower passage index), and fused:

    rrf(p) = w_dense / (k + rank_dense(p)) + w_lexical / (k + rank_lexical(p)),   k = 10, w_dense = 2, w_lexical = 1

The ``n_related`` highest are kept (ties again to the lower index); the first is s1, the positive.
Hand check (seed 000): ranks (1, 6) give 2/11 + 1/16 = 0.2443; ranks (2, 2) give 3/12 = 0.2500 and win.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pairmine.operators.centrality import anchor_indices

GROUP_TYPE = pa.struct(
    [
        ("anchor_index", pa.int32()),
        ("related_indices", pa.list_(pa.int32())),
        ("dense", pa.list_(pa.float32())),
        ("tfidf", pa.list_(pa.float32())),
        ("rrf", pa.list_(pa.float32())),
    ]
)

# A group after the consistency filter (operators/consistency.py): s, n_above, kept added.
FILTERED_GROUP_TYPE = pa.struct(
    list(GROUP_TYPE) + [("s", pa.float32()), ("n_above", pa.int64()), ("kept", pa.bool_())]
)

# Why a processed document yields no group (counted in stats as docs_without_groups_by_reason).
NO_PASSAGES = "no_passages"
TOO_FEW_PASSAGES = "too_few_passages"
NO_ANCHOR = "no_anchor"


def rrf_score(rank_dense, rank_lexical, k: float = 10.0, w_dense: float = 2.0, w_lexical: float = 1.0):
    """Weighted reciprocal rank fusion of two 1-based ranks (seed 000 appendix; SPEC "Related passages").

    Works on scalars or numpy arrays of ranks. ``rrf_score(1, 6) == 2/11 + 1/16 == 0.24432``;
    ``rrf_score(2, 2) == 3/12 == 0.25``.
    """
    return w_dense / (k + np.asarray(rank_dense, dtype=np.float64)) + w_lexical / (
        k + np.asarray(rank_lexical, dtype=np.float64)
    )


SCORE_RESOLUTION = 1e-5
"""Scores closer than this are the same score when ranking (cosines are compared on a 1e-5 grid).

Batched float32 matmuls give the same passage vectors to ~1e-6 whatever the batch (padding changes the summation
order), so two candidates whose scores differ by float noise must not swap ranks between two runs of the same input
(issue: a re-run with ``ray.docs_per_batch`` 17 instead of 64 changed one ``related_rrf`` by 0.0048). Scores are
rounded to this grid and ties are broken by passage index."""


def descending_ranks(scores: np.ndarray, resolution: float = SCORE_RESOLUTION) -> np.ndarray:
    """1-based ranks of ``scores`` in descending order; scores equal on a ``resolution`` grid rank the lower index
    first.

    Args:
        scores: (n,) float scores (cosines).
        resolution: scores are compared after rounding to multiples of this; 0 compares them exactly.

    Example: ``descending_ranks([0.2, 0.9, 0.2]) -> [2, 1, 3]``; ``descending_ranks([0.5, 0.5000004]) -> [1, 2]``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if resolution > 0:
        scores = np.round(scores / resolution)
    order = np.argsort(-scores, kind="stable")  # stable: ties keep index order
    ranks = np.empty(len(scores), dtype=np.int64)
    ranks[order] = np.arange(1, len(scores) + 1)
    return ranks


@dataclass
class Group:
    """One training group: an anchor and its related passages (indices into the document's passages)."""

    anchor_index: int
    related_indices: list[int]
    dense: list[float]
    tfidf: list[float]
    rrf: list[float]


def related_for_anchor(
    anchor: int,
    dense_row: np.ndarray,
    lexical_row: np.ndarray,
    n_related: int = 4,
    k: float = 10.0,
    w_dense: float = 2.0,
    w_lexical: float = 1.0,
) -> Group:
    """The ``n_related`` passages most related to ``anchor`` by weighted RRF.

    Args:
        anchor: the anchor's passage index.
        dense_row: (n_passages,) dense cosine of the anchor to every passage of the document (anchor included).
        lexical_row: (n_passages,) TF-IDF cosine of the anchor to every passage.
        n_related, k, w_dense, w_lexical: see the module docstring.

    Returns:
        A :class:`Group` whose related passages are sorted by RRF descending (ties: lower index first).

    Raises:
        ValueError: when the document has fewer than ``n_related + 1`` passages or the rows differ in length.
    """
    n = len(dense_row)
    if len(lexical_row) != n:
        raise ValueError(f"dense_row has {n} entries but lexical_row has {len(lexical_row)}")
    if n < n_related + 1:
        raise ValueError(f"a group needs {n_related + 1} passages, the document has {n}")
    candidates = np.delete(np.arange(n), anchor)  # (n - 1,) in index order
    dense = np.asarray(dense_row, dtype=np.float32)[candidates]
    lexical = np.asarray(lexical_row, dtype=np.float32)[candidates]
    fused = rrf_score(descending_ranks(dense), descending_ranks(lexical), k, w_dense, w_lexical)
    top = np.argsort(-fused, kind="stable")[:n_related]
    return Group(
        anchor_index=int(anchor),
        related_indices=candidates[top].tolist(),
        dense=dense[top].tolist(),
        tfidf=lexical[top].tolist(),
        rrf=fused[top].astype(np.float32).tolist(),
    )


def mine_groups(
    vectors: np.ndarray,
    tfidf_rows,
    centralities: np.ndarray,
    threshold: float,
    n_related: int = 4,
    k: float = 10.0,
    w_dense: float = 2.0,
    w_lexical: float = 1.0,
) -> tuple[list[Group], str | None]:
    """All groups of one document.

    Args:
        vectors: (n_passages, dim) unit passage vectors.
        tfidf_rows: (n_passages, columns) L2-normalised TF-IDF rows (scipy sparse or dense), e.g.
            :meth:`CorpusTfidf.transform_document`.
        centralities: (n_passages,) centrality of each passage.
        threshold: anchor threshold on centrality.

    Returns:
        (groups ordered by anchor index, reason) where reason is None when there are groups, else one of
        ``no_passages``, ``too_few_passages`` (fewer than n_related + 1 passages) or ``no_anchor``.
    """
    n = len(vectors)
    if n == 0:
        return [], NO_PASSAGES
    if n < n_related + 1:
        return [], TOO_FEW_PASSAGES
    anchors = anchor_indices(centralities, threshold)
    if len(anchors) == 0:
        return [], NO_ANCHOR
    dense = vectors[anchors] @ vectors.T  # (n_anchors, n_passages)
    lexical = tfidf_rows[anchors] @ tfidf_rows.T  # (n_anchors, n_passages), sparse or dense
    lexical = lexical.toarray() if hasattr(lexical, "toarray") else np.asarray(lexical)
    groups = [
        related_for_anchor(int(a), dense[i], lexical[i], n_related, k, w_dense, w_lexical)
        for i, a in enumerate(anchors)
    ]
    return groups, None


class RelatedMiner:
    """Related-passages operator: adds ``groups`` (list<struct>, see ``GROUP_TYPE``) and ``no_group_reason``
    (string, null when the document has groups or was skipped) to each document row.

    Args:
        tfidf: a :class:`CorpusTfidf` (IDF from the corpus sample; words it never saw weigh most), applied per
            document.
        threshold, n_related, k, w_dense, w_lexical: see :func:`mine_groups`.

    Input columns: ``passages``, ``vectors``, ``centrality``, ``skip_reason``.
    """

    def __init__(self, tfidf: CorpusTfidf, threshold: float, n_related: int = 4, k: float = 10.0, w_dense: float = 2.0,
                 w_lexical: float = 1.0):
        self.tfidf = tfidf
        self.threshold = threshold
        self.n_related, self.k, self.w_dense, self.w_lexical = n_related, k, w_dense, w_lexical

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pairmine.operators.embed import vector_matrix

        matrix, offsets = vector_matrix(batch.column("vectors"))
        passages = batch.column("passages").to_pylist()
        skips = batch.column("skip_reason").to_pylist()
        cent, cent_offsets = _float_lists(batch.column("centrality"))
        all_groups, reasons = [], []
        for i in range(batch.num_rows):
            if skips[i] is not None:
                all_groups.append([])
                reasons.append(None)
                continue
            lo, hi = offsets[i], offsets[i + 1]
            # One transform per document: its own unseen words are its extra columns.
            groups, reason = mine_groups(
                matrix[lo:hi],
                self.tfidf.transform_document(passages[i]) if hi - lo > self.n_related else None,  # (n, vocab + unseen)
                cent[cent_offsets[i] : cent_offsets[i + 1]],
                self.threshold,
                self.n_related,
                self.k,
                self.w_dense,
                self.w_lexical,
            )
            all_groups.append([g.__dict__ for g in groups])
            reasons.append(reason)
        batch = batch.append_column("groups", pa.array(all_groups, pa.list_(GROUP_TYPE)))
        return batch.append_column("no_group_reason", pa.array(reasons, pa.string()))


def _float_lists(column) -> tuple[np.ndarray, np.ndarray]:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    return arr.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0]


class CorpusTfidf:
    """TF-IDF for lexical ranking: IDF statistics from a corpus sample, and every word of a document weighted, even
    one the sample never saw (SPEC "Related passages"; issue 14 item 11).

    Words of the sample's vocabulary get scikit-learn's weights (``TfidfVectorizer`` with ``smooth_idf=True``,
    ``norm="l2"``): with n the number of sampled passages and df(t) the number of them holding t,

        idf(t) = ln((1 + n) / (1 + df(t))) + 1          (scikit-learn's smooth idf)

    A word outside the vocabulary is at least as rare as the rarest sampled word, so it gets the same formula with
    df = 0: ``idf = ln(1 + n) + 1``, the largest IDF the sample allows (n = 20,000 passages: 10.90; a word seen in
    one of them: 10.21). It would otherwise weigh nothing, while the rare, page-specific words (names, products,
    places) are what make TF-IDF useful inside one page. Words cut by ``max_features`` get that IDF too.

    :meth:`transform_document` works on the passages of one document: its unseen words become extra columns after
    the vocabulary's, shared by the document's passages only, so two passages of one page that share a rare name
    score on it. tf is ``1 + ln(count)`` when ``sublinear_tf`` (else the count); rows are L2-normalised, so a cosine
    is a dot product. A passage whose words are all in the vocabulary gets exactly scikit-learn's row (float32).

    Args:
        vectorizer: a scikit-learn ``TfidfVectorizer`` with ``smooth_idf`` and ``use_idf`` on, fitted on ``n_samples``
            passages, or unfitted when the sample held no word (then every word is unseen: n = 0, idf = 1).
        n_samples: the number of passages it was fitted on (n above).

    Raises:
        ValueError: ``smooth_idf`` or ``use_idf`` is off (df = 0 would give an infinite or no IDF), or
            ``norm`` is not "l2".
    """

    def __init__(self, vectorizer, n_samples: int):
        if not (vectorizer.smooth_idf and vectorizer.use_idf) or vectorizer.norm != "l2":
            raise ValueError("CorpusTfidf needs a TfidfVectorizer with smooth_idf=True, use_idf=True, norm='l2'")
        self.vectorizer = vectorizer
        self.n_samples = int(n_samples)
        fitted = hasattr(vectorizer, "idf_")
        self.vocabulary: dict[str, int] = dict(vectorizer.vocabulary_) if fitted else {}
        self.dtype = np.dtype(vectorizer.dtype)
        self.idf = np.asarray(vectorizer.idf_, dtype=self.dtype) if fitted else np.zeros(0, self.dtype)  # (vocab,)
        self.unseen_idf = float(np.log1p(self.n_samples) + 1.0)
        self._analyzer = None

    @property
    def vocabulary_(self) -> dict[str, int]:
        """The sample's vocabulary (word -> column), as scikit-learn names it."""
        return self.vocabulary

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_analyzer"] = None  # a closure: rebuilt after unpickling
        return state

    def transform_document(self, passages: list[str]):
        """TF-IDF rows of one document's passages.

        Args:
            passages: the document's passages (m of them).

        Returns:
            scipy CSR matrix, shape (m, vocab + u) with u the number of distinct words of these passages outside the
            vocabulary (columns vocab.. in order of first appearance), rows L2-normalised (all-zero for a passage
            with no word), dtype float32.
        """
        import scipy.sparse as sp
        from sklearn.preprocessing import normalize

        if self._analyzer is None:
            self._analyzer = self.vectorizer.build_analyzer()
        vocab, v = self.vocabulary, len(self.idf)
        unseen: dict[str, int] = {}
        indptr, indices, counts = [0], [], []
        for text in passages:
            row: dict[int, int] = {}
            for word in self._analyzer(text):
                j = vocab.get(word)
                if j is None:
                    j = unseen.setdefault(word, v + len(unseen))
                row[j] = row.get(j, 0) + 1
            indices.extend(row)
            counts.extend(row.values())
            indptr.append(len(indices))
        x = sp.csr_matrix(
            (np.asarray(counts, dtype=self.dtype), np.asarray(indices, dtype=np.int64), np.asarray(indptr, np.int64)),
            shape=(len(passages), v + len(unseen)),
        )  # (m, vocab + u) counts
        x.sort_indices()
        # scikit-learn's TfidfTransformer.transform, step for step (same dtype, same order): sublinear tf, idf, l2.
        if self.vectorizer.sublinear_tf:
            np.log(x.data, x.data)
            x.data += 1.0
        idf = np.concatenate([self.idf, np.full(len(unseen), self.unseen_idf, dtype=self.dtype)])  # (vocab + u,)
        x.data *= idf[x.indices]
        return normalize(x, norm="l2", copy=False)


def fit_tfidf(passages: list[str], max_features: int = 1 << 18, sublinear_tf: bool = True) -> CorpusTfidf:
    """Fit the TF-IDF used for lexical ranking on a sample of the corpus' passages (SPEC: IDF statistics from the
    corpus, not from the single document). scikit-learn's ``TfidfVectorizer`` (smooth idf, L2-normalised rows,
    unigrams, lower-cased, float32), wrapped in a :class:`CorpusTfidf` that also weights words the sample never saw.

    Args:
        passages: the sampled passages (n of them).
        max_features: vocabulary size cap (the most frequent words are kept).
        sublinear_tf: tf = 1 + ln(count) instead of the count.

    Raises:
        EmptySampleError: when ``passages`` is empty or holds no word at all.
    """
    try:
        vectorizer = _vectorizer(max_features, sublinear_tf).fit(passages)
    except ValueError as e:
        raise EmptySampleError(f"cannot fit TF-IDF on {len(passages)} sampled passages: {e}") from e
    return CorpusTfidf(vectorizer, len(passages))


def unfitted_tfidf(sublinear_tf: bool = True) -> CorpusTfidf:
    """The TF-IDF when the sample held no word (:class:`EmptySampleError`): no vocabulary, n = 0, so every word is
    unseen and gets idf = ln(1 + 0) + 1 = 1: lexical scores are cosines of (sublinear) term frequencies."""
    return CorpusTfidf(_vectorizer(1, sublinear_tf), 0)


def _vectorizer(max_features: int, sublinear_tf: bool):
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(max_features=max_features, sublinear_tf=sublinear_tf, dtype=np.float32, norm="l2",
                           smooth_idf=True)


class EmptySampleError(ValueError):
    """The TF-IDF sample holds no word (no passage at all, or only punctuation/numbers-free noise).

    Internal, not a :class:`operators.errors.PairmineError`: a signal that every caller (``pipeline.mine``,
    ``pipeline.calibrate``) catches to fall back to :func:`unfitted_tfidf` (said in the log and the manifest); one
    that reached the CLI would be a pairmine bug, so it keeps its traceback."""
