"""The XTR objective and XTR scoring as plain functions (seed 002, sections 3.1 and 3.2; SPEC "Other objectives
trained on the same groups").

XTR is a multi-vector (token-level) retriever: a query is ``n`` token vectors ``q_i``, a document ``m`` token vectors
``d_j``, all L2-normalised, so ``q_i . d_j`` is a cosine. These functions take the token vectors (or their
similarities) and masks, with no model, no Ray and no data loading, so that tests can check each one by hand.

    sum_of_max      ColBERT's score: sum_i max_j q_i . d_j over all of D's tokens
    f_xtr           training score (seed 002 eq. 2): (1 / Z) sum_i max_j A_ij q_i . d_j, A_ij = 1 iff d_j is in
                    the top-k_train of q_i over every document token of the mini-batch, Z the number of query tokens
                    that retrieved anything from D; Z = 0 gives 0 (the seed clips Z to a small positive value, so
                    the score is 0)
    f_xtr_chunked   f_xtr a chunk of queries at a time, recomputed in the backward pass: the memory of one chunk's
                    token similarities, for global batches of hundreds of groups
    xtr_loss        cross-entropy over the batch's documents of f_xtr (seed 002 eq. 3), over the rows that
                    ``scoreable_rows`` keeps (a query or positive with no real token: a text of special tokens only)
    f_xtr_prime     inference score (seed 002 eq. 4) from the retrieved tokens only: (1 / n) sum_i of the best
                    retrieved score of D for q_i, else m_i, the k'-th retrieval score of q_i (the imputation)

The seed trains with ``f_xtr`` and scores with ``f_xtr_prime`` (footnote 5: training with ``f_xtr_prime`` does not
converge).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def token_similarities(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """All query-token x document-token inner products of a batch.

    Args:
        q: (Bq, n, dim) query token vectors; d: (Bd, m, dim) document token vectors (normalised by the caller).

    Returns:
        (Bq, n, Bd, m) similarities ``q[a, i] . d[b, j]``.
    """
    return torch.einsum("aid,bjd->aibj", q, d)


def sum_of_max(sims: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """ColBERT's late interaction: for each (query, document), the sum over real query tokens of the best real
    document token's similarity.

    Args:
        sims: (Bq, n, Bd, m) from :func:`token_similarities`.
        q_mask: (Bq, n) bool, True for real query tokens; d_mask: (Bd, m) bool, True for real document tokens.

    A document with no real token (a passage of special tokens only, e.g. ``[CLS] [UNK] [SEP]``) has no best token:
    it scores 0 for every query (as :func:`f_xtr` scores a document no query token retrieved), not the sum of n
    ``-inf`` (or of ``finfo.min``, which overflows to ``-inf``), so a loss over the scores stays finite. A query with
    no real token scores 0 against every document.

    Returns:
        (Bq, Bd) scores.
    """
    neg = torch.finfo(sims.dtype).min
    best = sims.masked_fill(~d_mask[None, None], neg).amax(-1)  # (Bq, n, Bd)
    best = torch.where(d_mask.any(-1)[None, None], best, torch.zeros_like(best))  # a document with no token: 0
    return (best * q_mask[:, :, None]).sum(1)


def in_batch_alignment(sims: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor, k_train: int
                       ) -> torch.Tensor:
    """Seed 002's A_ij: for each real query token, True for the ``k_train`` real document tokens of the whole batch
    (all documents' tokens together) with the highest similarity; ties at the k-th place are broken by position
    (``torch.topk``).

    Returns:
        (Bq, n, Bd, m) bool; False everywhere for padding query tokens.

    Raises:
        ValueError: ``k_train`` < 1.
    """
    if k_train < 1:
        raise ValueError(f"k_train must be >= 1, got {k_train}")
    bq, n, bd, m = sims.shape
    flat = sims.masked_fill(~d_mask[None, None], float("-inf")).reshape(bq, n, bd * m)
    k = min(k_train, int(d_mask.sum()))
    top = flat.topk(k, dim=-1).indices  # (Bq, n, k)
    aligned = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, top, True)
    return aligned.reshape(bq, n, bd, m) & q_mask[:, :, None, None]


def f_xtr(sims: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor, k_train: int) -> torch.Tensor:
    """XTR's training score (seed 002 eq. 2): (1 / Z) sum_i max_j A_ij q_i . d_j, with A from
    :func:`in_batch_alignment` and Z the number of query tokens with at least one aligned token of D. A query token
    that retrieved nothing of D adds 0; a document with Z = 0 scores 0 (the seed clips Z to a small positive value).
    So a row of ``q_mask`` or of ``d_mask`` with no True (a text of special tokens only) gives 0 scores, finite
    values and finite gradients; :func:`scoreable_rows` says which rows of a loss have something to learn from.

    Args:
        sims: (Bq, n, Bd, m); q_mask (Bq, n), d_mask (Bd, m) bool; k_train: tokens retrieved per query token.

    Returns:
        (Bq, Bd) scores; differentiable through the aligned similarities.
    """
    aligned = in_batch_alignment(sims, q_mask, d_mask, k_train)
    best = sims.masked_fill(~aligned, float("-inf")).amax(-1)  # (Bq, n, Bd)
    hit = aligned.any(-1)  # (Bq, n, Bd)
    total = torch.where(hit, best, torch.zeros_like(best)).sum(1)  # (Bq, Bd)
    z = hit.sum(1)
    return torch.where(z > 0, total / z.clamp(min=1), torch.zeros_like(total))


def query_chunk(n: int, bd: int, m: int, chunk_mb: float) -> int:
    """Queries per chunk so that one chunk's (chunk, n, bd, m) fp32 similarities take at most ``chunk_mb`` MiB
    (at least 1 query).

    Example: a global batch of 512 groups of 128 tokens is 32 MiB of similarities per query: 1,024 MiB gives 32."""
    return max(1, int(chunk_mb * 2 ** 20 // (4 * max(1, n * bd * m))))


def f_xtr_chunked(q: torch.Tensor, d: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor, k_train: int,
                  chunk: int) -> torch.Tensor:
    """:func:`f_xtr` of :func:`token_similarities` ``(q, d)``, computed ``chunk`` queries at a time, each chunk under
    activation checkpointing: its similarities are recomputed in the backward pass instead of kept, so the memory
    of the batch's token similarity is one chunk's (``chunk x n x Bd x m``), not the whole (Bq x n x Bd x m).
    Each query's row depends on that query's tokens and all document tokens only (A_ij is a top-k over the
    documents' tokens per query token), so the rows equal the unchunked ones.

    Args:
        q: (Bq, n, dim), d: (Bd, m, dim) normalised token vectors; q_mask (Bq, n), d_mask (Bd, m) bool;
        k_train: tokens retrieved per query token; chunk: queries per chunk (>= 1; :func:`query_chunk`).

    Returns:
        (Bq, Bd) scores, differentiable with respect to ``q`` and ``d``.

    Raises:
        ValueError: ``chunk`` < 1 or ``k_train`` < 1.
    """
    from torch.utils.checkpoint import checkpoint

    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")

    def rows(qc: torch.Tensor, mc: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
        return f_xtr(token_similarities(qc, dd), mc, d_mask, k_train)

    if chunk >= len(q):
        return rows(q, q_mask, d)
    grad = torch.is_grad_enabled() and (q.requires_grad or d.requires_grad)
    parts = [checkpoint(rows, q[i:i + chunk], q_mask[i:i + chunk], d, use_reentrant=False) if grad
             else rows(q[i:i + chunk], q_mask[i:i + chunk], d) for i in range(0, len(q), chunk)]
    return torch.cat(parts)


def scoreable_rows(q_mask: torch.Tensor, d_mask: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """(Bq,) bool: the training rows with something to learn from, those whose query and whose positive document both
    have at least one real token. A text of special tokens only (``[CLS] [UNK] [SEP]`` for a run of emoji or of
    zero-width spaces under all-MiniLM's vocabulary) leaves none: its query row scores 0 against every document
    (:func:`f_xtr`'s Z = 0), a constant with no gradient, and a positive with no token scores 0 whatever the query,
    so the row would only push its negatives down under a "positive" that says nothing.

    Args:
        q_mask: (Bq, n) bool real query tokens; d_mask: (Bd, m) bool real document tokens; positives: (Bq,) int64.
    """
    return q_mask.any(-1) & d_mask.any(-1)[positives]


def xtr_loss(scores: torch.Tensor, positives: torch.Tensor, tau: float = 1.0,
             valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of each query's positive document among the batch's documents (seed 002 eq. 3), on
    ``scores / tau`` (the seed uses the scores as logits: tau 1).

    Args:
        scores: (Bq, Bd) from :func:`f_xtr`; positives: (Bq,) int64 index of each query's positive document.
        valid: (Bq,) bool, the rows that count (:func:`scoreable_rows`); None: every row. The loss is the mean over
            the valid rows; with none valid it is 0 (still a function of ``scores``, so a backward pass runs and
            gives zero gradients). A document with no token stays in every row as a negative scoring 0.

    Returns:
        scalar mean loss, finite for finite scores.
    """
    if valid is None:
        return F.cross_entropy(scores / tau, positives)
    if not bool(valid.any()):
        return (scores * 0.0).sum()
    return F.cross_entropy(scores[valid] / tau, positives[valid])


def f_xtr_prime(query_hits: list[tuple[np.ndarray, np.ndarray]], n_query_tokens: int) -> dict[int, float]:
    """XTR's inference score (seed 002 eq. 4) of every document that any query token retrieved a token of.

    For query token i, ``query_hits[i] = (doc_ids (k',), scores (k',))``: the documents of its k' retrieved tokens
    and their similarities, best first (a token index search, e.g. faiss, over every document token of the corpus).
    A document's score is (1 / n) sum_i [the best score among D's tokens retrieved by q_i, else m_i], where m_i, the
    imputed similarity, is q_i's k'-th (lowest retrieved) score: every token not retrieved scores at most that.

    Args:
        query_hits: one (doc_ids, scores) pair per real query token, each sorted by descending score.
        n_query_tokens: n, the number of real query tokens (``len(query_hits)``).

    Returns:
        {doc id: score} for the candidate documents.

    Raises:
        ValueError: ``len(query_hits) != n_query_tokens``, or a query token with no retrieved token.
    """
    if len(query_hits) != n_query_tokens:
        raise ValueError(f"{len(query_hits)} query token hit lists for {n_query_tokens} query tokens")
    best: list[dict[int, float]] = []
    imputed = np.zeros(n_query_tokens)
    for i, (docs, scores) in enumerate(query_hits):
        if len(scores) == 0:
            raise ValueError(f"query token {i} retrieved no token (k' must be >= 1)")
        imputed[i] = float(scores[-1])
        per_doc: dict[int, float] = {}
        for doc, score in zip(np.asarray(docs).tolist(), np.asarray(scores, dtype=np.float64).tolist()):
            if doc not in per_doc:  # best first: the first hit of a document is its best
                per_doc[doc] = score
        best.append(per_doc)
    candidates = set().union(*best) if best else set()
    return {doc: float(sum(b.get(doc, imputed[i]) for i, b in enumerate(best)) / n_query_tokens)
            for doc in candidates}
