"""Centrality and anchors stage (SPEC "Centrality and anchors"; seed 000, "How anchors and related passages are
chosen").

With unit vectors e_1..e_n of one document and m = mean(e_i): centrality_i = e_i . m / |m|.
A passage is an anchor when centrality_i >= threshold.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def centrality(vectors: np.ndarray) -> np.ndarray:
    """Cosine of each passage vector to the document's mean vector.

    Args:
        vectors: (n_passages, dim) float array of L2-normalised passage vectors of one document.

    Returns:
        (n_passages,) float32 array, centrality_i = e_i . m / |m| with m the mean of the rows. Values in [-1, 1]
        for unit rows. When |m| is 0 (vectors that cancel out) every centrality is 0.

    Raises:
        ValueError: when ``vectors`` is not 2-D.
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be 2-D (n_passages, dim), got shape {vectors.shape}")
    if len(vectors) == 0:
        return np.zeros(0, dtype=np.float32)
    mean = vectors.mean(axis=0)  # (dim,)
    norm = float(np.linalg.norm(mean))
    if norm == 0.0:
        return np.zeros(len(vectors), dtype=np.float32)
    return (vectors @ (mean / norm)).astype(np.float32)  # (n_passages,)


def anchor_indices(centralities: np.ndarray, threshold: float) -> np.ndarray:
    """Indices (ascending) of the passages whose centrality is >= ``threshold``."""
    return np.flatnonzero(np.asarray(centralities) >= threshold)


class CentralityScorer:
    """Centrality operator: adds a ``centrality`` column (list<float32>, one value per passage) to each document row.

    Input column: ``vectors`` (list<fixed_size_list<float32, dim>>, one unit vector per passage).
    """

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pairmine.operators.embed import vector_matrix

        matrix, offsets = vector_matrix(batch.column("vectors"))
        values = [centrality(matrix[offsets[i] : offsets[i + 1]]) for i in range(batch.num_rows)]
        flat = np.concatenate(values) if values else np.zeros(0, np.float32)
        return batch.append_column("centrality", pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat)))
