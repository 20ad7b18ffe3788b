"""Consistency filter stage (SPEC "Consistency filter"; seed 004 chapter 1, E5's filter and "the early exit").

For a group with anchor a and positive s1: s = cos(a, s1), and n_above = the number of pool passages p from *other*
documents with cos(a, p) > s. The group is kept iff n_above < k (E5: k = 2 with a pool of one million, i.e. s1 would
rank in the top 2 of pool + s1). No sort and no rank: a comparison and a count, over the pool in chunks so memory
stays bounded.

Rounding: s is taken from the same matrix product as the pool scores it is compared with (s1 is appended to every
pool chunk), so a pool passage identical to s1 can never be counted above it because of a different rounding
path. Scores are fp32 even when the pool is stored in fp16 on a GPU (bf16/fp16 products flip many counts).
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
    """s and n_above for a batch of groups (seed 004 ch. 1: keep iff n_above < k).

    Args:
        anchors: (G, dim) unit anchor vectors (numpy or torch).
        positives: (G, dim) unit vectors of each group's positive s1.
        pool: (P, dim) unit pool vectors, numpy or a torch tensor (may live on a GPU, may be fp16).
        anchor_docs: (G,) int64 document hashes of the groups (:func:`doc_hash`).
        pool_docs: (P,) int64 document hashes of the pool passages; pool passages of the group's own document are
            never counted.
        chunk_mb: memory for one chunk's (G, G + chunk) fp32 score matrix, in MB.

    Returns:
        (s, n_above): (G,) float32 cos(a, s1) and (G,) int64 counts of pool passages of other documents with
        cos(a, p) > s (strictly greater: ties at exactly s do not count).

    Raises:
        ValueError: when shapes disagree.
    """
    import torch

    pool_t = pool if isinstance(pool, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(pool, dtype=np.float32))
    device = pool_t.device
    a = torch.as_tensor(np.ascontiguousarray(anchors, dtype=np.float32), device=device)  # (G, dim)
    s1 = torch.as_tensor(np.ascontiguousarray(positives, dtype=np.float32), device=device)  # (G, dim)
    g, dim = a.shape
    if len(pool_t) == 0:  # an empty pool (an input with no usable passage): nothing can be above s
        pool_t = torch.zeros((0, dim), dtype=torch.float32, device=device)
    if s1.shape != a.shape or pool_t.shape[-1] != dim or len(anchor_docs) != g or len(pool_docs) != len(pool_t):
        raise ValueError(
            f"shapes disagree: anchors {tuple(a.shape)}, positives {tuple(s1.shape)}, pool {tuple(pool_t.shape)}, "
            f"anchor_docs {len(anchor_docs)}, pool_docs {len(pool_docs)}"
        )
    if g == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.int64)
    anchor_docs = np.asarray(anchor_docs, dtype=np.int64)
    pool_docs = np.asarray(pool_docs, dtype=np.int64)
    chunk = max(256, int(chunk_mb * 1024 * 1024 / 4 / g) - g)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round the scores to ~1e-3: full fp32 for the comparison
    try:
        return _count(a, s1, pool_t, anchor_docs, pool_docs, chunk)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _count(a, s1, pool_t, anchor_docs, pool_docs, chunk):
    import torch

    g, device, s_first = len(a), pool_t.device, None
    n_above = torch.zeros(g, dtype=torch.int64, device=device)
    with torch.inference_mode():
        for start in range(0, max(len(pool_t), 1), chunk):
            block = pool_t[start : start + chunk].float().reshape(-1, a.shape[1])  # (C, dim), fp32 for the comparison
            x = torch.cat([s1, block])  # (G + C, dim): s1 rides along with the pool chunk
            scores = a @ x.T  # (G, G + C)
            s = scores[:, :g].diagonal().clone()  # (G,) cos(a, s1), same product as the pool scores
            # In place on the score block (the compare and count cost ~15% of the product instead of ~100%):
            # x - s > 0 exactly when x > s for finite floats (gradual underflow), so ties at s never count.
            above = scores[:, g:].sub_(s[:, None]).gt_(0)  # (G, C) 1.0 where the pool passage beats s1
            docs = pool_docs[start : start + chunk]  # (C,)
            shared = np.flatnonzero(np.isin(docs, anchor_docs))  # pool columns from some group's document
            if len(shared):
                cols = torch.as_tensor(shared, device=device)
                same = torch.as_tensor(docs[shared][None, :] == anchor_docs[:, None], device=device)  # (G, S)
                above[:, cols] = above[:, cols].masked_fill(same, 0.0)
            n_above += above.sum(dim=1).to(torch.int64)  # exact: fp32 sums of 0/1 below 2**24
            if s_first is None:
                s_first = s
    return s_first.float().cpu().numpy(), n_above.cpu().numpy()


class ConsistencyFilter:
    """Consistency-filter operator: adds ``s`` and ``n_above`` to every group of every document row and marks
    each group kept (n_above < k) or dropped.

    Args:
        load_pool: zero-argument callable returning (pool vectors (P, dim) float32/float16 numpy, pool doc hashes
            (P,) int64); called once per operator instance (the pipeline hands the pool over from Ray's object
            store, so each node holds one copy).
        k: keep iff n_above < k.
        device: "cpu" or "cuda" (the pool is moved there once, fp16 storage on GPU, fp32 scores).
        chunk_mb: see :func:`consistency_counts`.

    Input columns: ``id``, ``vectors``, ``groups`` (``operators.related.GROUP_TYPE``). Output: ``groups`` with the
    extra fields ``s`` (float32), ``n_above`` (int64) and ``kept`` (bool).
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
