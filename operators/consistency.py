"""Consistency filter stage (SPEC "Consistency filter"; seed 004 chapter 1, E5's filter and "the early exit").

For a group with anchor a and positive s1: s = cos(a, s1), and n_above = the number of pool passages p from *other*
documents with cos(a, p) > s. The group is kept iff n_above < k (E5: k = 2 with a pool of one million, i.e. s1 would
rank in the top 2 of pool + s1). No sort and no rank: a comparison and a count, over the pool in chunks so memory
stays bounded. n_above is the full count (not capped at k): the stats' n_above histogram reads it.

Rounding: the comparison cos(a, p) > s is decided exactly on the stored vectors (float32, or the fp16 values of a
GPU pool), as real numbers. The pool scores come from one fp32 matrix product per chunk; s is computed once in
float64. Every score further than a proven bound from s (Higham's gamma_dim * |a| * max|p|, about 2.3e-5 for
dim 384, plus s's own float64 error) is a clear call; the few inside it are settled by float64 dot products and,
for the ties and near-ties left (copies of s1, equal cosines), by math.fsum of the exact float64 products, whose
sign is exact. So a copy of s1 in the pool never counts, a true tie never counts, and a passage one float32 ulp
above s1 always does, whatever order the BLAS kernel summed in (before, s rode along with every pool chunk in the
same product so that ties rounded alike; that cost a (G, dim) copy and G extra columns per chunk, and fp32
rounding still decided near-ties). The reported s is the float64 value rounded to float32. Scores are fp32 even
when the pool is stored in fp16 on a GPU (bf16/fp16 products flip many counts), and TF32 is switched off.

Speed (benchmarks/bench_filter.py, docs/benchmarks.md "Consistency filter"): the chunk's score matrix is written
into one reused buffer, a row maximum clears the rows with nothing near s (most rows: one read, no write), and only the
remaining rows are compared and counted; pool passages of the group's own document are taken back per chunk from
the (group, pool row) pairs found once per call.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

KEPT = "kept"


def doc_hash(doc_id: str) -> int:
    """64-bit signed hash of a document id (first 8 bytes of sha1), to tell pool passages of the same document."""
    return int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "little", signed=True)


def consistency_counts(
    anchors: np.ndarray,
    positives: np.ndarray,
    pool,
    anchor_docs: np.ndarray,
    pool_docs: np.ndarray,
    chunk_mb: float = 64.0,
) -> tuple[np.ndarray, np.ndarray]:
    """s and n_above for a batch of groups (seed 004 ch. 1, E5's filter: keep iff n_above < k).

    Args:
        anchors: (G, dim) anchor vectors, unit length (numpy or a CPU torch tensor; cast to float32).
        positives: (G, dim) vectors of each group's positive s1, unit length.
        pool: (P, dim) unit pool vectors, numpy or a torch tensor (may live on a GPU, may be fp16: the stored
            values are the pool; scores are fp32 and the close calls are settled exactly on those values).
        anchor_docs: (G,) int64 document hashes of the groups (:func:`doc_hash`).
        pool_docs: (P,) int64 document hashes of the pool passages; pool passages of the group's own document are
            never counted.
        chunk_mb: memory for one chunk's (G, C) fp32 score matrix, in MB (256 <= C <= 2**22 pool rows); rows with
            a pool score near or above s take up to two more buffers of that size.

    Returns:
        (s, n_above): (G,) float32 cos(a, s1) (computed in float64, rounded once to float32; a dot product, so a
        cosine only for unit vectors) and (G,) int64 full counts (not capped at k) of pool passages of other
        documents with a . p > a . s1, decided exactly (strictly greater: ties do not count; see the module
        docstring).

    Raises:
        ValueError: when shapes disagree.
    """
    import torch

    pool_t = pool if isinstance(pool, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(pool, dtype=np.float32))
    device = pool_t.device
    a32 = np.ascontiguousarray(anchors, dtype=np.float32)  # (G, dim)
    s1_32 = np.ascontiguousarray(positives, dtype=np.float32)  # (G, dim)
    if a32.ndim != 2:
        raise ValueError(f"anchors must be (G, dim), got shape {a32.shape}")
    g, dim = a32.shape
    if len(pool_t) == 0:  # an empty pool (an input with no usable passage): nothing can be above s
        pool_t = torch.zeros((0, dim), dtype=torch.float32, device=device)
    if s1_32.shape != a32.shape or pool_t.shape[-1] != dim or len(anchor_docs) != g or len(pool_docs) != len(pool_t):
        raise ValueError(
            f"shapes disagree: anchors {a32.shape}, positives {s1_32.shape}, pool {tuple(pool_t.shape)}, "
            f"anchor_docs {len(anchor_docs)}, pool_docs {len(pool_docs)}"
        )
    if g == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.int64)
    anchor_docs = np.asarray(anchor_docs, dtype=np.int64)
    pool_docs = np.asarray(pool_docs, dtype=np.int64)
    a64, s1_64 = a32.astype(np.float64), s1_32.astype(np.float64)  # products of two float32 are exact in float64
    s64 = (a64 * s1_64).sum(axis=1)  # (G,) within _gamma(dim, 2**-53) * sum|a s1| of the exact a . s1
    chunk = min(max(256, int(chunk_mb * 1024 * 1024 / 4 / g)), 1 << 22)  # float sums of 0/1 exact below 2**24
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round the scores to ~1e-3: full fp32 for the comparison
    try:
        a = torch.as_tensor(a32, device=device)
        n_above, close = _count(a, a64, s1_64, s64, pool_t, anchor_docs, pool_docs, chunk)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    n_above += _settle(close, a64, s1_64, s64, pool_t)
    return s64.astype(np.float32), n_above


def _gamma(n: int, unit_roundoff: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): |fl(x . y) - x . y| <= gamma_n * sum|x_i y_i| for a length-n dot product
    in any summation order, fused multiply-adds or not (what every BLAS / cuBLAS fp32 kernel computes)."""
    return n * unit_roundoff / (1.0 - n * unit_roundoff)


def _same_doc_pairs(anchor_docs: np.ndarray, pool_docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group rows, pool rows) of every pair from the same document, sorted by pool row."""
    order = np.argsort(anchor_docs, kind="stable")
    sorted_docs = anchor_docs[order]
    cols = np.flatnonzero(np.isin(pool_docs, sorted_docs))
    first = np.searchsorted(sorted_docs, pool_docs[cols], "left")
    reps = np.searchsorted(sorted_docs, pool_docs[cols], "right") - first
    pair_j = np.repeat(cols, reps)
    within = np.arange(len(pair_j)) - np.repeat(np.cumsum(reps) - reps, reps)  # 0, 1, .. inside each pool row's run
    return order[np.repeat(first, reps) + within], pair_j


def _count(a, a64, s1_64, s64, pool_t, anchor_docs, pool_docs, chunk):
    """Clear calls from fp32 scores, per chunk: n_above counting pool scores above s + tol (certainly above s) and
    the (group, pool row) pairs within tol of s, left to :func:`_settle`. tol bounds the fp32 product's error
    (:func:`_gamma`) plus that of s64, with the thresholds rounded outwards to float32."""
    import torch

    g, dim, device = len(a), a.shape[1], pool_t.device
    a_norm = np.linalg.norm(a64, axis=1)
    s_err = _gamma(dim, 2.0**-53) * (np.abs(a64) * np.abs(s1_64)).sum(axis=1)
    pair_i, pair_j = _same_doc_pairs(anchor_docs, pool_docs)
    n_above = torch.zeros(g, dtype=torch.int64, device=device)
    close_i, close_j = [], []
    width = min(chunk, len(pool_t))
    buf = torch.empty((g, width), dtype=torch.float32, device=device)
    flags = None  # two (G, C) fp32 0/1 buffers for the rows that need the compare (made on first use)
    all_rows = torch.arange(g, device=device)
    norm_margin = 1 + _gamma(dim + 4, 2.0**-24)  # fp32 norm -> an upper bound on the exact norm
    with torch.inference_mode():
        for start in range(0, len(pool_t), chunk):
            block = pool_t[start : start + chunk].float()  # (C, dim): fp16 storage widens exactly
            c = len(block)
            p_max = float(torch.linalg.vector_norm(block, dim=1).amax()) * norm_margin
            tol = _gamma(dim, 2.0**-24) * a_norm * p_max * (1 + 1e-6) + s_err * 2
            hi = torch.from_numpy(np.nextafter((s64 + tol).astype(np.float32), np.float32(np.inf))).to(device)
            lo = torch.from_numpy(np.nextafter((s64 - tol).astype(np.float32), np.float32(-np.inf))).to(device)
            scores = torch.mm(a, block.T, out=buf) if c == width else a @ block.T  # (G, C)
            # Most rows have no pool passage anywhere near s: one max per row (a read, no write) clears them.
            hot = torch.nonzero(scores.amax(dim=1) > lo).flatten()
            if len(hot) == 0:
                continue
            rows, sub = (all_rows, scores) if 2 * len(hot) > g else (hot, scores.index_select(0, hot))
            if flags is None:
                flags = torch.empty((2, g * width), dtype=torch.float32, device=device)
            h = len(rows)
            above, near = flags[0, : h * c].view(h, c), flags[1, : h * c].view(h, c)
            # Compares written as fp32 0/1 and summed as floats (exact below 2**24): twice as fast on CPU as bools.
            n_hi = torch.gt(sub, hi[rows, None], out=above).sum(dim=1)  # certainly above s
            n_lo = torch.gt(sub, lo[rows, None], out=near).sum(dim=1)  # above s - tol
            n_above.index_add_(0, rows, n_hi.to(torch.int64))
            band = torch.nonzero(n_lo > n_hi).flatten()  # rows with a score within tol of s: rare
            if len(band):
                bi, bj = torch.nonzero(near.index_select(0, band).sub_(above.index_select(0, band)), as_tuple=True)
                close_i.append(rows[band[bi]].cpu().numpy())
                close_j.append(bj.cpu().numpy() + start)
            lo_pair, hi_pair = np.searchsorted(pair_j, [start, start + c])
            if hi_pair > lo_pair:  # the group's own document: take back what was counted
                pi = torch.from_numpy(pair_i[lo_pair:hi_pair]).to(device)
                pj = torch.from_numpy(pair_j[lo_pair:hi_pair] - start).to(device)
                n_above.index_add_(0, pi, -(scores[pi, pj] > hi[pi]).long())
    close_i = np.concatenate(close_i) if close_i else np.zeros(0, np.int64)
    close_j = np.concatenate(close_j) if close_j else np.zeros(0, np.int64)
    other = anchor_docs[close_i] != pool_docs[close_j]
    return n_above.cpu().numpy(), (close_i[other], close_j[other])


def _settle(close, a64, s1_64, s64, pool_t, batch: int = 65536) -> np.ndarray:
    """(G,) int64 number of close pairs (group i, pool row j) with a_i . p_j > a_i . s1_i exactly: float64 dot
    products settle all but a few (error bound as in :func:`_count`); the rest (copies of s1, true ties) go to
    math.fsum of the exact float64 products a_ik p_jk and -a_ik s1_ik, whose correctly rounded sum has the sign of
    the exact difference."""
    import math

    import torch

    ci, cj = close
    extra = np.zeros(len(a64), dtype=np.int64)
    dim = a64.shape[1]
    nonzero = a64.any(axis=1)  # a zero anchor scores 0 against everything: all ties
    keep = nonzero[ci]
    ci, cj = ci[keep], cj[keep]
    for lo in range(0, len(ci), batch):
        i, j = ci[lo : lo + batch], cj[lo : lo + batch]
        p64 = pool_t[torch.from_numpy(j).to(pool_t.device)].double().cpu().numpy()  # (B, dim) the stored values
        prod = a64[i] * p64
        d = prod.sum(axis=1) - s64[i]
        bound = 4 * _gamma(dim + 1, 2.0**-53) * (np.abs(prod).sum(axis=1) + np.abs(a64[i] * s1_64[i]).sum(axis=1))
        np.add.at(extra, i[d > bound], 1)
        for r in np.flatnonzero(np.abs(d) <= bound):
            if np.array_equal(p64[r], s1_64[i[r]]):  # a copy of s1: a tie
                continue
            if math.fsum(np.concatenate([prod[r], -(a64[i[r]] * s1_64[i[r]])])) > 0:
                extra[i[r]] += 1
    return extra


class ConsistencyFilter:
    """Consistency-filter operator (seed 004 ch. 1, E5's filter): adds ``s`` and ``n_above`` to every group of
    every document row and marks each group kept (n_above < k) or dropped; the counts come from
    :func:`consistency_counts` (exact decisions, full counts).

    Args:
        load_pool: zero-argument callable returning (pool vectors (P, dim) float32/float16 numpy, pool doc hashes
            (P,) int64); called once per operator instance (the pipeline hands the pool over from Ray's object
            store, so each node holds one copy).
        k: keep iff n_above < k.
        device: "cpu" or "cuda" (the pool is moved there once, fp16 storage on GPU, fp32 scores).
        chunk_mb: see :func:`consistency_counts`.

    Input columns: ``id``, ``vectors``, ``groups`` (``operators.related.GROUP_TYPE``). Output: ``groups`` with the
    extra fields ``s`` (float32 cos(anchor, s1)), ``n_above`` (int64, pool passages of other documents strictly
    above s, uncapped) and ``kept`` (bool).

    Raises:
        ValueError: from :func:`consistency_counts` when the pool's dimension is not the vectors'.
    """

    def __init__(self, load_pool, k: int = 2, device: str = "cpu", chunk_mb: float = 64.0):
        self.load_pool, self.k, self.device, self.chunk_mb = load_pool, k, device, chunk_mb
        self._pool = None

    def pool(self):
        """(pool tensor on the operator's device, pool doc hashes (P,) int64), loaded on first use."""
        if self._pool is None:
            self.setup()
        return self._pool, self._pool_docs

    def setup(self) -> None:
        import warnings

        import torch

        vectors, docs = self.load_pool()
        with warnings.catch_warnings():  # the pool comes read-only from Ray's object store; it is never written
            warnings.simplefilter("ignore", UserWarning)
            pool = torch.from_numpy(np.ascontiguousarray(vectors))
        if self.device == "cuda":
            pool = pool.to("cuda", dtype=torch.float16)
        else:
            pool = pool.float()
        self._pool, self._pool_docs = pool, np.asarray(docs, dtype=np.int64)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pairmine.operators.embed import vector_matrix
        from pairmine.operators.related import FILTERED_GROUP_TYPE

        pool, pool_docs = self.pool()
        matrix, offsets = vector_matrix(batch.column("vectors"))
        groups = batch.column("groups").to_pylist()
        ids = batch.column("id").to_pylist()
        a_rows, s1_rows, docs = [], [], []
        for i, doc_groups in enumerate(groups):
            for g in doc_groups:
                a_rows.append(offsets[i] + g["anchor_index"])
                s1_rows.append(offsets[i] + g["related_indices"][0])
                docs.append(doc_hash(ids[i]))
        if a_rows:
            s, n_above = consistency_counts(
                matrix[a_rows], matrix[s1_rows], pool, np.asarray(docs, np.int64), pool_docs, self.chunk_mb
            )
        else:
            s, n_above = np.zeros(0, np.float32), np.zeros(0, np.int64)
        j = 0
        for doc_groups in groups:
            for g in doc_groups:
                g["s"], g["n_above"], g[KEPT] = float(s[j]), int(n_above[j]), bool(n_above[j] < self.k)
                j += 1
        index = batch.column_names.index("groups")
        return batch.set_column(index, "groups", pa.array(groups, pa.list_(FILTERED_GROUP_TYPE)))
