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

from operators.centrality import anchor_indices

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
        tfidf_rows: (n_passages, vocab) L2-normalised TF-IDF rows (scipy sparse or dense).
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
        vectorizer: a fitted scikit-learn ``TfidfVectorizer`` (IDF from the corpus sample, L2-normalised rows).
        threshold, n_related, k, w_dense, w_lexical: see :func:`mine_groups`.

    Input columns: ``passages``, ``vectors``, ``centrality``, ``skip_reason``.
    """

    def __init__(self, vectorizer, threshold: float, n_related: int = 4, k: float = 10.0, w_dense: float = 2.0, w_lexical: float = 1.0):
        self.vectorizer = vectorizer
        self.threshold = threshold
        self.n_related, self.k, self.w_dense, self.w_lexical = n_related, k, w_dense, w_lexical

    def __call__(self, batch: pa.Table) -> pa.Table:
        from operators.embed import vector_matrix

        matrix, offsets = vector_matrix(batch.column("vectors"))
        passages = batch.column("passages").to_pylist()
        skips = batch.column("skip_reason").to_pylist()
        cent, cent_offsets = _float_lists(batch.column("centrality"))
        flat_passages = [p for doc in passages for p in doc]
        tfidf = self.vectorizer.transform(flat_passages) if flat_passages else None  # (total_passages, vocab)
        all_groups, reasons = [], []
        for i in range(batch.num_rows):
            if skips[i] is not None:
                all_groups.append([])
                reasons.append(None)
                continue
            lo, hi = offsets[i], offsets[i + 1]
            groups, reason = mine_groups(
                matrix[lo:hi],
                tfidf[lo:hi] if hi > lo else None,
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


def fit_tfidf(passages: list[str], max_features: int = 1 << 18, sublinear_tf: bool = True):
    """Fit the TF-IDF used for lexical ranking on a sample of the corpus' passages (SPEC: IDF statistics from the
    corpus, not from the single document). scikit-learn's ``TfidfVectorizer`` with L2-normalised rows, so the
    cosine of two passages is the dot product of their rows; unigrams, lower-cased, float32.

    Raises:
        EmptySampleError: when ``passages`` is empty or holds no word at all.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(max_features=max_features, sublinear_tf=sublinear_tf, dtype=np.float32, norm="l2")
    try:
        vectorizer.fit(passages)
    except ValueError as e:
        raise EmptySampleError(f"cannot fit TF-IDF on {len(passages)} sampled passages: {e}") from e
    return vectorizer


class EmptySampleError(ValueError):
    """The TF-IDF sample holds no word (no passage at all, or only punctuation/numbers-free noise)."""
