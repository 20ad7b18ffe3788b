"""Read stage: input shards -> one row per document, with every unusable document marked (SPEC "Read").

The unit of reading is a *work unit*: one parquet row group, or one whole JSONL file. Each output row carries the
document's position (``shard_index``, ``row_index`` in its shard), its id, url and text, and ``skip_reason``:
null for a usable document, else one of the reasons below. Skipped rows keep flowing to the write stage so that
they are counted there; nothing is dropped silently.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from operators.storage import LOCAL, Storage

# Skip reasons (the keys of stats.json's docs_skipped).
NULL_ID = "null_id"
NULL_TEXT = "null_text"
EMPTY_TEXT = "empty_text"  # empty or whitespace-only
DUPLICATE_ID = "duplicate_id"
INVALID_JSON = "invalid_json"
SKIP_REASONS = (NULL_ID, NULL_TEXT, EMPTY_TEXT, DUPLICATE_ID, INVALID_JSON)

DOC_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int32()),
        ("row_index", pa.int64()),
        ("id", pa.string()),
        ("url", pa.string()),
        ("text", pa.string()),
        ("skip_reason", pa.string()),
    ]
)

UNIT_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int32()),
        ("path", pa.string()),
        ("format", pa.string()),
        ("row_group", pa.int32()),  # -1: the whole file
        ("row_offset", pa.int64()),  # row index (in the shard) of the unit's first row
        ("duplicate_rows", pa.list_(pa.int64())),  # row indices (in the shard) whose id appeared earlier in the run
    ]
)


class MissingColumnError(ValueError):
    """An input shard lacks a required column (the message names the column, the file and the columns found)."""


def open_input(path: str, storage: Storage = LOCAL):
    """Open ``path`` (local path or any fsspec URL such as ``s3://``) for binary reading. Call it inside
    ``storage.retry(...)`` so that a transient error retries the whole read."""
    fs, p = storage.fs(path)
    return fs.open(p, "rb")


BLANK = object()  # what jsonl_record returns for an empty or whitespace-only line


def jsonl_record(raw: bytes):
    """One JSONL line -> its JSON object (a dict), None when the line is not a JSON object (invalid JSON, a list,
    a number...), or ``BLANK`` when the line is empty. Undecodable bytes are replaced, not fatal."""
    line = raw.decode("utf-8", errors="replace").strip()
    if not line:
        return BLANK
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_jsonl_records(path: str, storage: Storage = LOCAL) -> tuple[list[dict | None], int]:
    """Parse a JSONL file line by line (the whole read is retried on transient storage errors).

    Returns:
        (records, n_invalid): one entry per non-blank line, None where the line is not a JSON object.

    Raises:
        StorageError: the file cannot be read (the message names it).
    """

    def parse() -> list[dict | None]:
        with open_input(path, storage) as f:
            return [rec for rec in map(jsonl_record, f) if rec is not BLANK]

    records = storage.retry("read", path, parse)
    return records, sum(r is None for r in records)


def require_columns(path: str, names: list[str], columns) -> None:
    """Raise MissingColumnError naming the first of ``columns`` missing from a parquet file's ``names``."""
    for col in columns:
        if col not in names:
            raise MissingColumnError(f"input {path} has no column {col!r} (columns: {names})")


def require_keys(path: str, records: list[dict | None], keys) -> None:
    """Raise MissingColumnError when no valid JSONL record of ``path`` has one of ``keys`` (a record without a key
    is a document with that field null; a file where no record has it was read with the wrong column name)."""
    valid = [r for r in records if r is not None]
    for key in keys:
        if valid and not any(key in r for r in valid):
            raise MissingColumnError(f"input {path} has no column {key!r} (no record has that key)")


def _as_string(arr: pa.ChunkedArray | pa.Array, name: str, path: str) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    try:
        return pc.cast(arr, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"column {name!r} of {path} has type {arr.type}, which cannot be read as text: {e}") from e


def skip_reasons(ids: pa.Array, texts: pa.Array, duplicate_mask: np.ndarray, invalid_mask: np.ndarray | None = None) -> pa.Array:
    """Skip reason of each document (null = usable), first matching reason wins in this order:
    invalid_json, null_id, duplicate_id, null_text, empty_text (empty or whitespace-only)."""
    n = len(ids)
    reasons = np.full(n, None, dtype=object)
    empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(texts)), 0), False).to_numpy(zero_copy_only=False)
    for mask, reason in (
        (empty, EMPTY_TEXT),
        (pc.is_null(texts).to_numpy(zero_copy_only=False), NULL_TEXT),
        (duplicate_mask, DUPLICATE_ID),
        (pc.is_null(ids).to_numpy(zero_copy_only=False), NULL_ID),
        (invalid_mask if invalid_mask is not None else np.zeros(n, bool), INVALID_JSON),
    ):
        reasons[np.asarray(mask, bool)] = reason
    return pa.array(reasons, pa.string())


class ReadDocuments:
    """Read operator: a batch of work units (``UNIT_SCHEMA``) -> a batch of document rows (``DOC_SCHEMA``).

    Args:
        text_column, id_column: required input columns.
        url_column: optional input column passed through to the output (null when absent).
        storage: the storage layer (object store options, retries of transient errors).

    Raises:
        MissingColumnError: when a parquet shard lacks the text or id column.
        StorageError: a shard cannot be read (not transient, or still failing after the retries).
    """

    def __init__(self, text_column: str = "text", id_column: str = "id", url_column: str = "url",
                 storage: Storage = LOCAL):
        self.text_column, self.id_column, self.url_column = text_column, id_column, url_column
        self.storage = storage

    def _read_parquet_unit(self, path: str, row_group: int) -> pa.Table:
        with open_input(path, self.storage) as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            require_columns(path, names, (self.text_column, self.id_column))
            cols = [self.text_column, self.id_column] + ([self.url_column] if self.url_column in names else [])
            return pf.read_row_group(row_group, columns=cols) if row_group >= 0 else pf.read(columns=cols)

    def read_unit(self, unit: dict) -> pa.Table:
        path = unit["path"]
        if unit["format"] == "jsonl":
            records, _ = read_jsonl_records(path, self.storage)
            invalid = np.array([r is None for r in records], dtype=bool)
            get = lambda key: [None if r is None else r.get(key) for r in records]  # noqa: E731
            ids = _as_string(pa.array([None if v is None else str(v) for v in get(self.id_column)], pa.string()), self.id_column, path)
            texts = pa.array([v if v is None or isinstance(v, str) else str(v) for v in get(self.text_column)], pa.string())
            urls = pa.array([None if v is None else str(v) for v in get(self.url_column)], pa.string())
        else:
            table = self.storage.retry("read", path, lambda: self._read_parquet_unit(path, unit["row_group"]))
            invalid = None
            ids = _as_string(table.column(self.id_column), self.id_column, path)
            texts = _as_string(table.column(self.text_column), self.text_column, path)
            urls = (
                _as_string(table.column(self.url_column), self.url_column, path)
                if self.url_column in table.column_names
                else pa.nulls(table.num_rows, pa.string())
            )
        n = len(ids)
        row_index = np.arange(unit["row_offset"], unit["row_offset"] + n, dtype=np.int64)
        duplicate = np.isin(row_index, np.asarray(unit["duplicate_rows"] or [], dtype=np.int64))
        reasons = skip_reasons(ids, texts, duplicate, invalid)
        # Skipped documents keep their row (to be counted) but not their text.
        texts = pc.if_else(pc.is_null(reasons), texts, pa.scalar(None, pa.string()))
        return pa.Table.from_arrays(
            [pa.array(np.full(n, unit["shard_index"], np.int32)), pa.array(row_index), ids, urls, texts, reasons],
            schema=DOC_SCHEMA,
        )

    def __call__(self, units: pa.Table) -> pa.Table:
        tables = [self.read_unit(u) for u in units.to_pylist()]
        return pa.concat_tables(tables) if tables else DOC_SCHEMA.empty_table()
