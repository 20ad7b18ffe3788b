"""Stages of the standalone pair filter (``pairmine filter-pairs``): E5's consistency filter applied to existing
(query, passage) pairs, the way E5 filtered CCPairs (seed 004 chapter 1).

read pairs -> embed (query with the query prefix, passage with the passage prefix) -> consistency count -> write.
A pair is kept iff fewer than k pool passages beat its own score s = cos(query, passage); pool passages with the
pair's own passage text never count (the pair's own passage may be in the pool).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairmine.operators.consistency import consistency_counts, doc_hash
from pairmine.operators.embed import Embedder
from pairmine.operators.read import (
    INVALID_JSON, arrow_text_column, check_column_types, jsonl_text_column, open_input, read_jsonl_records,
    require_columns, require_keys,
)
from pairmine.operators.storage import LOCAL, Storage

NULL_QUERY, EMPTY_QUERY, NULL_PASSAGE, EMPTY_PASSAGE = "null_query", "empty_query", "null_passage", "empty_passage"
PAIR_SKIP_REASONS = (INVALID_JSON, NULL_QUERY, EMPTY_QUERY, NULL_PASSAGE, EMPTY_PASSAGE)
INVISIBLE_ONLY = r"^[\s\p{Z}\p{Cc}\p{Cf}]*$"  # (RE2) a text with nothing to read: its skip reason is empty_*

PAIR_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("pair_id", pa.string()),
        ("query", pa.string()),
        ("passage", pa.string()),
        ("s", pa.float32()),  # cos(query, passage)
        ("n_above", pa.int64()),  # pool passages (other texts) with cos(query, p) > s
        ("pool_size", pa.int64()),
        ("consistency_k", pa.int32()),
        ("model", pa.string()),
    ]
)


def read_pair_columns(path: str, fmt: str, row_group: int, query_column: str, passage_column: str,
                      id_column: str, storage: Storage = LOCAL
                      ) -> tuple[pa.Array, pa.Array, pa.Array | None, np.ndarray | None, np.ndarray]:
    """(queries, passages, ids or None, invalid-line mask or None, repaired mask) of one work unit: string arrays
    (rows,) decoded as the read stage decodes documents (invalid UTF-8 replaced with U+FFFD, ``repaired`` (rows,)
    bool says where; compressed JSONL read transparently).

    Raises:
        MissingColumnError: the query or passage column is missing (parquet), or no JSONL record has it.
        ColumnTypeError: the query or passage column is not text (numbers, lists, structs).
        InputError: a JSONL file is binary or a corrupt compressed file.
    """
    if fmt == "jsonl":
        records = read_jsonl_records(path, storage)
        require_keys(path, records, (query_column, passage_column))
        q, rep_q = jsonl_text_column(records, query_column, path, "text")
        p, rep_p = jsonl_text_column(records, passage_column, path, "text")
        ids = (jsonl_text_column(records, id_column, path, "id")[0]
               if any(r is not None and id_column in r for r in records) else None)
        return q, p, ids, np.array([r is None for r in records], dtype=bool), rep_q | rep_p

    def read() -> pa.Table:
        with open_input(path, storage) as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            require_columns(path, names, (query_column, passage_column))
            check_column_types(path, pf.schema_arrow, (query_column, passage_column), (id_column,))
            cols = [query_column, passage_column] + ([id_column] if id_column in names else [])
            return pf.read_row_group(row_group, columns=cols) if row_group >= 0 else pf.read(columns=cols)

    table = storage.retry("read", path, read)
    q, rep_q = arrow_text_column(table.column(query_column), query_column, path, "text")
    p, rep_p = arrow_text_column(table.column(passage_column), passage_column, path, "text")
    ids = (arrow_text_column(table.column(id_column), id_column, path, "id")[0]
           if id_column in table.column_names else None)
    return q, p, ids, None, rep_q | rep_p


def pair_skip_reasons(queries: pa.Array, passages: pa.Array, invalid: np.ndarray | None) -> pa.Array:
    """Skip reason per pair (null = usable): invalid_json, null or empty query or passage. Empty: nothing but
    whitespace, control and format characters (a zero-width space, a soft hyphen, a BOM, NUL: Unicode categories
    Z*, Cc, Cf, as :func:`operators.negatives.outer_trim` strips), which leave a model no text to read."""
    n = len(queries)
    reasons = np.full(n, None, dtype=object)
    for arr, null_reason, empty_reason in ((passages, NULL_PASSAGE, EMPTY_PASSAGE), (queries, NULL_QUERY, EMPTY_QUERY)):
        empty = pc.fill_null(pc.match_substring_regex(arr, INVISIBLE_ONLY), False).to_numpy(zero_copy_only=False)
        reasons[empty] = empty_reason
        reasons[pc.is_null(arr).to_numpy(zero_copy_only=False)] = null_reason
    if invalid is not None:
        reasons[invalid] = INVALID_JSON
    return pa.array(reasons, pa.string())


class ReadPairs:
    """Read operator of filter-pairs: work units (``operators.read.UNIT_SCHEMA``) -> one row per pair with
    ``shard_index, unit_offset`` (the work unit's first row), ``row_index, pair_id`` (the id column, else "shard:row"), ``query, passage, skip_reason`` and
    ``text_repaired`` (invalid UTF-8 in the query or passage replaced with U+FFFD)."""

    def __init__(self, query_column: str = "query", passage_column: str = "passage", id_column: str = "id",
                 storage: Storage = LOCAL):
        self.query_column, self.passage_column, self.id_column = query_column, passage_column, id_column
        self.storage = storage

    def __call__(self, units: pa.Table) -> pa.Table:
        tables = []
        for u in units.to_pylist():
            q, p, ids, invalid, repaired = read_pair_columns(u["path"], u["format"], u["row_group"],
                                                             self.query_column, self.passage_column, self.id_column,
                                                             self.storage)
            rows = np.arange(u["row_offset"], u["row_offset"] + len(q), dtype=np.int64)
            fallback = pa.array([f"{u['shard_index']}:{r}" for r in rows.tolist()], pa.string())
            pair_ids = fallback if ids is None else pc.coalesce(ids, fallback)
            tables.append(pa.table({
                "shard_index": pa.array(np.full(len(q), u["shard_index"], np.int32)),
                "unit_offset": pa.array(np.full(len(q), u["row_offset"], np.int64)), "row_index": rows,
                "pair_id": pair_ids, "query": q, "passage": p, "skip_reason": pair_skip_reasons(q, p, invalid),
                "text_repaired": pa.array(repaired, pa.bool_()),
            }))
        return pa.concat_tables(tables)


class EmbedPairs:
    """Embed operator of filter-pairs: adds ``query_vector`` and ``passage_vector`` (fixed_size_list<float32>) with
    one model: the query with ``query_prefix``, the passage with the passage prefix (E5: "query: " / "passage: ").
    Skipped rows get zero vectors. Args as :class:`operators.embed.Embedder`, plus ``query_prefix``.
    (``operators.negatives.EmbedPairVectors`` extends it with vectors taken from a corpus.)"""

    count_reused = False  # add a ``vectors_reused`` column (subclasses that look vectors up)

    def __init__(self, query_prefix: str = "", **embedder_kwargs):
        self.embedder = Embedder(**embedder_kwargs)
        self.query_prefix = query_prefix

    def setup(self) -> None:
        self.embedder.setup()

    def texts_to_embed(self, texts: list[str], prefix: str) -> list[str]:
        """The texts handed to the embedder (here: as they are)."""
        return texts

    def __call__(self, batch: pa.Table) -> pa.Table:
        ok = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        rows = pa.array(np.flatnonzero(ok), pa.int64())
        reused = np.zeros(batch.num_rows, np.int32)
        out = batch
        for name, column, prefix in (("query_vector", "query", self.query_prefix), ("passage_vector", "passage", None)):
            texts = self.texts_to_embed(batch.column(column).take(rows).to_pylist(),
                                        self.embedder.passage_prefix if prefix is None else prefix)
            encoded = self.embedder.encode(texts, prefix=prefix)  # (usable, dim)
            reused[ok] += self.embedder.last_reused
            vecs = np.zeros((batch.num_rows, encoded.shape[1]), np.float32)  # (rows, dim), zeros for skipped rows
            vecs[ok] = encoded
            out = out.append_column(name, pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), encoded.shape[1]))
        return out.append_column("vectors_reused", pa.array(reused, pa.int32())) if self.count_reused else out


class PairFilter:
    """Consistency operator of filter-pairs: adds ``s``, ``n_above`` and ``kept`` (n_above < k) to every usable pair.

    Args:
        load_pool: callable -> (pool vectors (P, dim), pool hashes (P,) int64), hashes as :func:`doc_hash` of each
            pool passage's text (so a pool passage equal to the pair's own passage never counts).
        k, device, chunk_mb: as :class:`operators.consistency.ConsistencyFilter`.
    """

    def __init__(self, load_pool, k: int = 2, device: str = "cpu", chunk_mb: float = 64.0):
        from pairmine.operators.consistency import ConsistencyFilter

        self._inner = ConsistencyFilter(load_pool, k, device, chunk_mb)
        self.k = k

    def __call__(self, batch: pa.Table) -> pa.Table:
        pool, pool_docs = self._inner.pool()
        ok = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(ok)
        s = np.full(batch.num_rows, np.nan, np.float32)
        n = np.full(batch.num_rows, -1, np.int64)
        if len(rows):
            q = _matrix(batch.column("query_vector"))[rows]  # (usable, dim)
            p = _matrix(batch.column("passage_vector"))[rows]  # (usable, dim)
            own = np.array([doc_hash(t) for t in batch.column("passage").take(pa.array(rows, pa.int64())).to_pylist()])
            s[rows], n[rows] = consistency_counts(q, p, pool, own, pool_docs, self._inner.chunk_mb)
        out = batch.drop_columns(["query_vector", "passage_vector"])
        out = out.append_column("s", pa.array(s, mask=~ok))
        out = out.append_column("n_above", pa.array(n, mask=~ok))
        return out.append_column("kept", pa.array(ok & (n < self.k) & (n >= 0)))


def _matrix(column) -> np.ndarray:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size)


class PairWriter:
    """Write operator of filter-pairs: stages kept pairs (and dropped ones with ``side_output``) per work unit
    (:func:`operators.write.stage_by_unit`) and returns one row per (batch, work unit) with columns ``shard_index``,
    ``unit_offset``, ``staged`` and ``stats`` (that unit's counts in this batch, JSON)."""

    def __init__(self, staging_dir: str, run_id: str, model: str, pool_size: int, k: int, side_output: bool = False,
                 storage: Storage = LOCAL):
        self.staging_dir, self.run_id, self.model = staging_dir.rstrip("/"), run_id, model
        self.pool_size, self.k, self.side_output, self.storage = pool_size, k, side_output, storage

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pairmine.operators.write import write_per_unit

        return write_per_unit(batch, self._write_unit)

    def _write_unit(self, batch: pa.Table) -> tuple[list[str], str]:
        """Stage one work unit's rows of a batch; returns (files staged, counts as JSON)."""
        from pairmine.operators.write import N_ABOVE_BINS, STAGING_SORT_COLUMN, stage_by_unit

        stats = Counter()
        reasons = batch.column("skip_reason").to_pylist()
        stats["pairs_in"] = batch.num_rows
        stats["pairs_text_repaired"] = int(batch.column("text_repaired").to_numpy(zero_copy_only=False).sum())
        for r in reasons:
            if r is not None:
                stats[f"pairs_skipped.{r}"] += 1
        kept = batch.column("kept").to_numpy(zero_copy_only=False)
        usable = pc.is_null(batch.column("skip_reason")).to_numpy(zero_copy_only=False)
        stats["pairs_kept"] = int(kept.sum())
        stats["pairs_dropped_consistency"] = int((usable & ~kept).sum())
        n = batch.column("n_above").to_numpy(zero_copy_only=False)
        hist = np.histogram(n[usable], bins=N_ABOVE_BINS)[0]
        staged = []
        for kind, mask in (("pairs", kept), ("dropped", usable & ~kept if self.side_output else np.zeros_like(kept))):
            part = batch.filter(pa.array(mask))
            if part.num_rows == 0:
                continue
            table = pa.table({
                "run_id": pa.array([self.run_id] * part.num_rows, pa.string()), "pair_id": part.column("pair_id"),
                "query": part.column("query"), "passage": part.column("passage"), "s": part.column("s"),
                "n_above": part.column("n_above"), "pool_size": pa.array([self.pool_size] * part.num_rows, pa.int64()),
                "consistency_k": pa.array([self.k] * part.num_rows, pa.int32()),
                "model": pa.array([self.model] * part.num_rows, pa.string()),
                STAGING_SORT_COLUMN: part.column("row_index"),
            })
            staged += [name for _, name in stage_by_unit(self.storage, table, part.column("shard_index").to_numpy(),
                                                         part.column("unit_offset").to_numpy(),
                                                         f"{self.staging_dir}/{kind}", kind)]
        stats["n_above_histogram"] = hist.tolist()
        return staged, json.dumps(dict(stats))
