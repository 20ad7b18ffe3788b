"""Read stage: input shards -> one row per document, with every unusable document marked (SPEC "Read").

The unit of reading is a *work unit*: one parquet row group, or one whole JSONL file. Each output row carries the
document's position (``shard_index``, ``row_index`` in its shard), its id, url and text, ``skip_reason``: null for a
usable document, else one of the reasons below, and ``text_repaired``: whether invalid UTF-8 (or a lone UTF-16
surrogate) in the document's text, id or url was replaced with U+FFFD. Skipped rows keep flowing to the write stage
so that they are counted there; nothing is dropped silently.

Text is decoded the same way everywhere an input is read (mining, its first pass, filter-pairs, report, eval):
invalid UTF-8 sequences and lone surrogates become U+FFFD (counted per document, never a traceback), a byte order
mark at the start of a line or a text is dropped, and a text column whose type is not text (numbers, lists,
structs) is refused with :class:`ColumnTypeError`. JSONL may be compressed (gzip, zstd, bz2, xz): the codec is told
from the file's first bytes, whatever its name.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairmine.operators.storage import LOCAL, Storage, is_transient
from pairmine.operators.errors import PairmineError

# Skip reasons (the keys of stats.json's docs_skipped).
NULL_ID = "null_id"
NULL_TEXT = "null_text"
EMPTY_TEXT = "empty_text"  # empty or whitespace-only
DUPLICATE_ID = "duplicate_id"
DUPLICATE_TEXT = "duplicate_text"  # the exact text of an earlier document of the run, under another id
INVALID_JSON = "invalid_json"
SKIP_REASONS = (NULL_ID, NULL_TEXT, EMPTY_TEXT, DUPLICATE_ID, DUPLICATE_TEXT, INVALID_JSON)

DOC_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int32()),
        ("unit_offset", pa.int64()),  # the row index of the first row of the document's work unit (its unit's key)
        ("row_index", pa.int64()),
        ("id", pa.string()),
        ("url", pa.string()),
        ("text", pa.string()),
        ("skip_reason", pa.string()),
        ("text_repaired", pa.bool_()),  # invalid UTF-8 / lone surrogates in text, id or url replaced with U+FFFD
    ]
)

UNIT_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int32()),
        ("path", pa.string()),
        ("format", pa.string()),
        ("row_group", pa.int32()),  # -1: the whole file
        ("row_offset", pa.int64()),  # row index (in the shard) of the unit's first row
        # "" or an .npz file of row indices (in the shard) whose id (array duplicate_id) or exact text (duplicate_text)
        # appeared earlier in the run (pipeline.first_pass)
        ("duplicates", pa.string()),
    ]
)

BOM = "\ufeff"
REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Compressed JSONL: the codec (fsspec's name) by the file's first bytes, and the suffixes that name one.
COMPRESSION_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz")
SNIFF_BYTES = 8192  # decompressed bytes checked for binary content before a JSONL file is parsed


class InputError(PairmineError, ValueError):
    """The input cannot be used as given (unknown format, unreadable, corrupt or binary file); the message names
    the path. User-fixable."""


class MissingColumnError(PairmineError, ValueError):
    """An input shard lacks a required column (the message names the column, the file and the columns found).
    User-fixable (the column settings or the input)."""


class ColumnTypeError(InputError):
    """A text column holds values that are not text (numbers, lists, structs), or an id column holds lists or
    structs; the message names the column, its type and the file. User-fixable (an :class:`InputError`)."""


def open_input(path: str, storage: Storage = LOCAL):
    """Open ``path`` (local path or any fsspec URL such as ``s3://``) for binary reading. Call it inside
    ``storage.retry(...)`` (or use ``storage.read_with``) so that a transient error retries the whole read."""
    return storage.open(path)


def compression_of(head: bytes) -> str | None:
    """The compression codec (fsspec name: gzip, zstd, bz2, xz) whose magic bytes start ``head``, else None."""
    for magic, codec in COMPRESSION_MAGIC:
        if head.startswith(magic):
            return codec
    return None


def strip_compression_suffix(name: str) -> str:
    """``name`` without a trailing compression suffix (``a.jsonl.gz`` -> ``a.jsonl``)."""
    low = name.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if low.endswith(suffix):
            return name[: -len(suffix)]
    return name


@contextlib.contextmanager
def open_jsonl(path: str, storage: Storage = LOCAL):
    """Open a JSONL file for reading its lines as bytes, decompressed when its first bytes are those of gzip, zstd,
    bz2 or xz (whatever its name, so ``input.format=jsonl`` on any file name works too). Decompression goes through
    fsspec's codecs (zstd: ``backports.zstd`` / ``compression.zstd``), so local paths and ``s3://`` read alike.

    Yields:
        (binary file object iterable by lines, codec name or None).

    Raises:
        InputError: the file is compressed with a codec that is not installed.
    """
    with open_input(path, storage) as raw:
        head = raw.read(8)
        raw.seek(0)
        codec = compression_of(head)
        if codec is None:
            yield raw, None
            return
        from fsspec.compression import compr

        if codec not in compr:
            raise InputError(f"input {path} is {codec}-compressed and no {codec} codec is installed "
                             "(zstd: pip install backports-zstd)")
        with compr[codec](raw, mode="rb") as f:
            yield f, codec


def _binary_reason(head: bytes) -> str | None:
    """Why the first decompressed bytes of a JSONL file are not JSONL text, or None when they may be."""
    if head.startswith(b"PAR1"):
        return "it is a parquet file (set input.format to parquet or auto)"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "it is UTF-16 text (convert it to UTF-8)"
    if b"\x00" in head:
        return "it holds binary data (NUL bytes), not JSON lines"
    return None


class JsonRecord(dict):
    """A JSON object of one JSONL line; ``repaired`` names the top-level keys whose string value held invalid UTF-8
    or a lone UTF-16 surrogate (now U+FFFD)."""

    repaired: tuple[str, ...] = ()


BLANK = object()  # what jsonl_record returns for an empty or whitespace-only line


def repair_text(s: str) -> tuple[str, bool]:
    """``s`` with every lone UTF-16 surrogate (from a JSON escape such as ``"\\ud83d"``, or an undecodable byte
    decoded with ``surrogateescape``) replaced by U+FFFD, and whether any was. Such a string cannot be encoded to
    UTF-8 (Arrow, tokenizers and parquet need UTF-8)."""
    if s.isascii():
        return s, False
    fixed, n = _SURROGATE.subn(REPLACEMENT, s)
    return fixed, n > 0


def jsonl_record(raw: bytes):
    """One JSONL line -> its JSON object (a :class:`JsonRecord`), None when the line is not a JSON object (invalid
    JSON, a list, a number...), or ``BLANK`` when the line is empty. A byte order mark before the object is dropped;
    invalid UTF-8 bytes and lone surrogate escapes in top-level string values become U+FFFD (the keys are listed in
    ``record.repaired``), so every string value encodes to UTF-8."""
    line = raw.decode("utf-8", errors="surrogateescape").strip()
    if line.startswith(BOM):
        line = line[1:].strip()
    if not line:
        return BLANK
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    out = JsonRecord(rec)
    repaired = []
    for key, value in rec.items():
        if isinstance(value, str):
            fixed, changed = repair_text(value)
            if changed:
                out[key] = fixed
                repaired.append(key)
    if repaired:
        out.repaired = tuple(repaired)
    return out


def read_jsonl_records(path: str, storage: Storage = LOCAL) -> list[JsonRecord | None]:
    """Parse a JSONL file (plain or gzip/zstd/bz2/xz-compressed, see :func:`open_jsonl`) line by line; the whole
    read is retried on transient storage errors.

    Returns:
        One entry per non-blank line: a :class:`JsonRecord`, or None where the line is not a JSON object.

    Raises:
        InputError: the file is not JSONL text (binary data, parquet, UTF-16 in its first 8 KiB), or it is
            compressed and cannot be decompressed (corrupt or truncated); the message names the file.
        StorageError: the file cannot be read (the message names it).
    """

    def parse() -> list[JsonRecord | None]:
        codec = None
        try:
            with open_jsonl(path, storage) as (f, codec):
                head = f.read(SNIFF_BYTES)
                why = _binary_reason(head)
                if why:
                    what = f"{codec}-compressed file" if codec else "file"
                    raise InputError(f"input {path} cannot be read as JSONL: the {what} is not text: {why}")
                if head and not head.endswith(b"\n"):
                    head += f.readline()  # complete the last line of the sniffed block
                lines = head.split(b"\n")
                if lines and not lines[-1]:
                    lines.pop()
                records = [rec for rec in map(jsonl_record, lines) if rec is not BLANK]
                records.extend(rec for rec in map(jsonl_record, f) if rec is not BLANK)
                return records
        except InputError:
            raise
        except Exception as e:  # a decompressor's error (corrupt data) vs. the storage's (retried by storage.retry)
            if codec is None or is_transient(e) or type(e).__module__.split(".")[0] in ("botocore", "s3fs", "aiohttp"):
                raise
            raise InputError(f"input {path} is not a readable {codec} file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'corrupt data'})") from None

    return storage.retry("read", path, parse)


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


# ---- text columns: type checks and decoding, shared by every reader ------------------------------------------------

def is_text_type(t: pa.DataType) -> bool:
    """True for Arrow types that hold text: string, binary (decoded as UTF-8) and their large/view/fixed-size and
    dictionary forms, and the null type (a column with no value)."""
    if pa.types.is_dictionary(t):
        return is_text_type(t.value_type)
    return any(f(t) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                              pa.types.is_large_binary, pa.types.is_fixed_size_binary, pa.types.is_null,
                              getattr(pa.types, "is_string_view", lambda _: False),
                              getattr(pa.types, "is_binary_view", lambda _: False)))


def is_id_type(t: pa.DataType) -> bool:
    """True for Arrow types usable as document ids: text types and scalars written as text (integers, ...)."""
    if pa.types.is_dictionary(t):
        return is_id_type(t.value_type)
    return not pa.types.is_nested(t)


def check_column_types(path: str, schema: pa.Schema, text_columns=(), id_columns=()) -> None:
    """Refuse a parquet file whose text columns are not text, or whose id columns are lists/structs (only the
    columns present are checked; missing ones are :func:`require_columns`' business).

    Raises:
        ColumnTypeError: naming the column, its type and the file.
    """
    for names, ok, want in ((text_columns, is_text_type, "text (string or binary)"),
                            (id_columns, is_id_type, "a string or a number")):
        for name in names:
            if name in schema.names and not ok(schema.field(name).type):
                raise ColumnTypeError(f"input {path}: column {name!r} has type {schema.field(name).type}, which is "
                                      f"not {want}; point its setting (input.text_column, input.id_column, "
                                      "input.query_column, input.passage_column, ...) at another column or convert it")


def _json_type(v) -> str:
    names = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
    return names.get(type(v), type(v).__name__)


def jsonl_text_column(records: list[dict | None], key: str, path: str, kind: str = "text"
                      ) -> tuple[pa.Array, np.ndarray]:
    """One field of JSONL records as a string array (null where the record is invalid or lacks the key), and which
    records had the field repaired (see :func:`jsonl_record`).

    Args:
        kind: ``text`` (values must be JSON strings), ``id`` (numbers and booleans are written as text, e.g. 7 ->
            "7") or ``any`` (every scalar written as text; for optional pass-through columns such as url).

    Raises:
        ColumnTypeError: a text field holds a number, boolean, array or object, or an id field an array or object
            (the message names the column, the JSON type, the record and the file).
    """
    values, repaired = [], np.zeros(len(records), dtype=bool)
    for i, r in enumerate(records):
        v = None if r is None else r.get(key)
        if v is None or isinstance(v, str):
            values.append(v)
        elif kind == "text" or isinstance(v, (list, dict)):
            want = "a string" if kind == "text" else "a string or a number"
            raise ColumnTypeError(f"input {path}: column {key!r} holds a JSON {_json_type(v)} in record {i + 1} "
                                  f"({json.dumps(v)[:40]}), not {want}; point its setting (input.text_column, "
                                  "input.query_column, input.passage_column, ...) at a text field")
        else:
            values.append(str(v))
        repaired[i] = r is not None and key in getattr(r, "repaired", ())
    arr = pa.array(values, pa.string())
    return (_drop_bom(arr) if kind == "text" else arr), repaired


def arrow_text_column(arr: pa.ChunkedArray | pa.Array, name: str, path: str, kind: str = "text"
                      ) -> tuple[pa.Array, np.ndarray]:
    """An Arrow column as a valid UTF-8 string array, and which rows were repaired.

    Binary (and string) values that are not valid UTF-8 are decoded with invalid sequences replaced by U+FFFD;
    a byte order mark at the start of a text is dropped. Ids (``kind="id"``) may also be numbers or other scalars,
    written as text.

    Returns:
        (string array (rows,), repaired mask (rows,) bool).

    Raises:
        ColumnTypeError: the column's type is not text (``kind="text"``), or not a scalar (``kind="id"``).
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    check_column_types(path, pa.schema([(name, arr.type)]), (name,) if kind == "text" else (),
                       (name,) if kind != "text" else ())
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    repaired = np.zeros(len(arr), dtype=bool)
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), pa.string()), repaired
    if not is_text_type(arr.type):  # an id of another scalar type: integers, ...
        try:
            return pc.cast(arr, pa.string()), repaired
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ColumnTypeError(f"input {path}: column {name!r} has type {arr.type}, which cannot be read as "
                                  f"text: {e}") from None
    try:
        out = pc.cast(arr, pa.string())  # validates UTF-8 when casting from binary
        out.validate(full=True)  # a string column written without validation may still hold invalid UTF-8
    except pa.ArrowInvalid:
        out, repaired = _decode_replacing(arr)
    return (_drop_bom(out) if kind == "text" else out), repaired


def _decode_replacing(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    try:
        raw = pc.cast(arr, pa.large_binary()).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raw = [s.as_buffer().to_pybytes() if s.is_valid else None for s in arr]
    values, repaired = [], np.zeros(len(raw), dtype=bool)
    for i, b in enumerate(raw):
        if b is None:
            values.append(None)
            continue
        try:
            values.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            values.append(b.decode("utf-8", errors="replace"))
            repaired[i] = True
    return pa.array(values, pa.string()), repaired


def _drop_bom(texts: pa.Array) -> pa.Array:
    """Texts without a leading byte order mark (a file's or a value's first character when written with one)."""
    if len(texts) and pc.any(pc.starts_with(texts, BOM)).as_py():
        return pc.utf8_ltrim(texts, characters=BOM)
    return texts


@dataclass
class DocColumns:
    """The columns of a read shard or work unit, one entry per document (rows,)."""

    ids: pa.Array  # string
    texts: pa.Array  # string, valid UTF-8
    urls: pa.Array  # string (null when the input has no url column)
    invalid: np.ndarray | None  # bool: JSONL line that is not a JSON object (None for parquet)
    repaired: np.ndarray  # bool: invalid UTF-8 / lone surrogates replaced with U+FFFD in text, id or url


def jsonl_document_columns(path: str, records: list[dict | None], text_column: str, id_column: str,
                           url_column: str | None = None) -> DocColumns:
    """:class:`DocColumns` of parsed JSONL records (see :func:`read_jsonl_records`).

    Raises:
        ColumnTypeError: see :func:`jsonl_text_column`.
    """
    texts, rep_t = jsonl_text_column(records, text_column, path, "text")
    ids, rep_i = jsonl_text_column(records, id_column, path, "id")
    if url_column:
        urls, rep_u = jsonl_text_column(records, url_column, path, "any")
    else:
        urls, rep_u = pa.nulls(len(records), pa.string()), False
    return DocColumns(ids, texts, urls, np.array([r is None for r in records], dtype=bool), rep_t | rep_i | rep_u)


def parquet_document_columns(path: str, table: pa.Table, text_column: str, id_column: str,
                             url_column: str | None = None) -> DocColumns:
    """:class:`DocColumns` of a table read from parquet (the url column is optional).

    Raises:
        ColumnTypeError: see :func:`arrow_text_column`.
    """
    texts, rep_t = arrow_text_column(table.column(text_column), text_column, path, "text")
    ids, rep_i = arrow_text_column(table.column(id_column), id_column, path, "id")
    if url_column and url_column in table.column_names:
        urls, rep_u = arrow_text_column(table.column(url_column), url_column, path, "id")
    else:
        urls, rep_u = pa.nulls(table.num_rows, pa.string()), False
    return DocColumns(ids, texts, urls, None, rep_t | rep_i | rep_u)


def skip_reasons(ids: pa.Array, texts: pa.Array, duplicate_mask: np.ndarray, invalid_mask: np.ndarray | None = None,
                 duplicate_text_mask: np.ndarray | None = None) -> pa.Array:
    """Skip reason of each document (null = usable), first matching reason wins in this order:
    invalid_json, null_id, duplicate_id, duplicate_text, null_text, empty_text (empty or whitespace-only)."""
    n = len(ids)
    reasons = np.full(n, None, dtype=object)
    empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(texts)), 0), False).to_numpy(zero_copy_only=False)
    for mask, reason in (
        (empty, EMPTY_TEXT),
        (pc.is_null(texts).to_numpy(zero_copy_only=False), NULL_TEXT),
        (duplicate_text_mask if duplicate_text_mask is not None else np.zeros(n, bool), DUPLICATE_TEXT),
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
        ColumnTypeError: the text column is not text (or the id column not a scalar).
        InputError: a JSONL file is binary or a corrupt compressed file.
        StorageError: a shard cannot be read (not transient, or still failing after the retries).
    """

    def __init__(self, text_column: str = "text", id_column: str = "id", url_column: str = "url",
                 storage: Storage = LOCAL):
        self.text_column, self.id_column, self.url_column = text_column, id_column, url_column
        self.storage = storage
        self._dup_cache: dict[str, np.ndarray] = {}

    def _read_parquet_unit(self, path: str, row_group: int) -> pa.Table:
        with open_input(path, self.storage) as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            require_columns(path, names, (self.text_column, self.id_column))
            check_column_types(path, pf.schema_arrow, (self.text_column,), (self.id_column,))
            cols = [self.text_column, self.id_column] + ([self.url_column] if self.url_column in names else [])
            return pf.read_row_group(row_group, columns=cols) if row_group >= 0 else pf.read(columns=cols)

    def _duplicates(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        """A shard's duplicate rows (int64, sorted): (by id, by text), loaded once per file by this operator."""
        if not path:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if path not in self._dup_cache:
            data = self.storage.read_bytes(path)
            if len(self._dup_cache) >= 4:
                self._dup_cache.pop(next(iter(self._dup_cache)))
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                self._dup_cache[path] = (npz["duplicate_id"], npz["duplicate_text"])
        return self._dup_cache[path]

    def read_unit(self, unit: dict) -> pa.Table:
        path = unit["path"]
        if unit["format"] == "jsonl":
            records = read_jsonl_records(path, self.storage)
            cols = jsonl_document_columns(path, records, self.text_column, self.id_column, self.url_column)
        else:
            table = self.storage.retry("read", path, lambda: self._read_parquet_unit(path, unit["row_group"]))
            cols = parquet_document_columns(path, table, self.text_column, self.id_column, self.url_column)
        n = len(cols.ids)
        row_index = np.arange(unit["row_offset"], unit["row_offset"] + n, dtype=np.int64)
        by_id, by_text = self._duplicates(unit.get("duplicates") or "")
        reasons = skip_reasons(cols.ids, cols.texts, np.isin(row_index, by_id), cols.invalid,
                               np.isin(row_index, by_text))
        # Skipped documents keep their row (to be counted) but not their text.
        texts = pc.if_else(pc.is_null(reasons), cols.texts, pa.scalar(None, pa.string()))
        return pa.Table.from_arrays(
            [pa.array(np.full(n, unit["shard_index"], np.int32)), pa.array(np.full(n, unit["row_offset"], np.int64)),
             pa.array(row_index), cols.ids, cols.urls, texts,
             reasons, pa.array(np.asarray(cols.repaired, dtype=bool))],
            schema=DOC_SCHEMA,
        )

    def __call__(self, units: pa.Table) -> pa.Table:
        tables = [self.read_unit(u) for u in units.to_pylist()]
        return pa.concat_tables(tables) if tables else DOC_SCHEMA.empty_table()
