"""Input discovery and the first, small pass over the input (SPEC "Read" and "Related passages": TF-IDF IDF from a
seeded sample of the corpus).

``discover_shards`` turns ``--input`` (file, folder or glob; local or any fsspec URL) into an ordered list of
shards. ``scan_shard`` reads one shard (or one of its row groups): its ids (for duplicate detection across the run), its
row-group layout and a seeded sample of its texts (for the IDF) and passages (for the pool). The mining job runs it
per row group through ``pipeline.first_pass``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairmine.operators.chunk import MAX_CHARS
from pairmine.operators.read import (  # noqa: F401  (InputError is re-exported: pipeline code imports it from here)
    InputError, check_column_types, jsonl_document_columns, open_input, parquet_document_columns, read_jsonl_records,
    require_columns, require_keys, strip_compression_suffix,
)
from pairmine.operators.storage import LOCAL, Storage

SAMPLE_DIR = Path(__file__).parent / "sample" / "web-docs"
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # each also with a compression suffix: .gz, .zst, .zstd, .bz2, .xz


@dataclass
class Shard:
    """One input file. ``index`` is its position in the run's sorted shard list."""

    index: int
    path: str
    format: str  # parquet | jsonl
    size: int = 0  # bytes
    fingerprint: str = ""  # "etag:<S3 ETag>" or "sha256:<content hash>": with the path, what --incremental compares

    @property
    def key(self) -> str:
        """Identity of the shard's content for ``--incremental``: path, size and fingerprint."""
        return f"{self.path}|{self.size}|{self.fingerprint}"


@dataclass(frozen=True)
class ChunkSpec:
    """The run's chunking (``operators.chunk.chunk_text``'s arguments, from ``MineConfig.chunk_spec``), for work
    that chunks documents outside the chunk stage: the first pass chunks the TF-IDF sample and the pool candidates
    with it on the workers (:func:`scan_shard`)."""

    max_words: int = 120
    min_words: int = 5
    max_passages: int = 256
    token_limit: object = None  # operators.chunk.TokenLimit | None
    max_chars: int = MAX_CHARS  # chunk.max_chars; 0: no cut (run_chunk_spec of a run mined before it existed)

    def chunk(self, text: str):
        """``chunk_text(text, ...)`` with these settings: an ``operators.chunk.Chunked``."""
        from pairmine.operators.chunk import chunk_text

        return chunk_text(text, self.max_words, self.min_words, self.max_passages, self.token_limit, self.max_chars)

    def texts(self, texts: pa.Array) -> list:
        """``texts.to_pylist()``, each text cut to the ``max_chars + 1`` characters that :meth:`chunk` reads of it
        (same passages), so a huge document is never a whole Python string (4 bytes per character with one emoji)."""
        if self.max_chars and len(texts) and (pc.max(pc.utf8_length(texts)).as_py() or 0) > self.max_chars:
            texts = pc.utf8_slice_codeunits(texts, 0, self.max_chars + 1)
        return texts.to_pylist()


@dataclass
class PoolSpec:
    """How the first pass samples the consistency filter's pool of random passages (see :func:`scan_shard`).

    Attributes:
        size: passages wanted in the whole pool (P).
        seed: pool seed: same seed and input, same pool.
        doc_cut: documents whose pool priority is below this are chunked into candidates.
        known_rows: rows of the input known from parquet footers (0: unknown), to size each shard's share.
        chunk: the chunking of the run (pool passages are chunked like all others).
        hash_by: "doc" (a pool passage is known by its document id: mine excludes the group's own document) or
            "text" (by its own text: filter-pairs excludes pool passages equal to the pair's passage).
    """

    size: int
    seed: int
    doc_cut: float
    known_rows: int
    chunk: ChunkSpec = ChunkSpec()
    hash_by: str = "doc"


@dataclass
class ShardScan:
    """What the first pass learns about one shard (see :func:`scan_shard`)."""

    shard_index: int
    row_group_rows: list[int]  # rows per parquet row group; one entry (all rows) for JSONL
    ids: pa.Array  # string ids in row order (null where missing)
    # (priority, text) of the sampled documents; (priority, passages: tuple of str) when scanned with a ChunkSpec
    sample: list[tuple[float, str | tuple[str, ...]]] = field(default_factory=list)
    pool: list[tuple[float, int, str]] = field(default_factory=list)  # (priority, doc hash, passage) pool candidates
    content_sha256: str = ""  # "sha256:<hex>" of the whole file, for a multipart-uploaded object only (see below)
    # (rows, 2) int64 128-bit content hashes of the texts (text_hashes()), and which rows are usable (the read stage's
    # rules, ids not yet compared): only usable texts take part in duplicate_text (None unless asked for)
    text_hashes: np.ndarray | None = None
    usable: np.ndarray | None = None
    # documents not usable, by the read stage's skip reason (null_text, empty_text, null_id, invalid_json, ...), and
    # with ``pool``: usable documents among the pool's whose chunking gave no passage ("no_passage")
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(sum(self.row_group_rows))


def _format_of(path: str, forced: str) -> str | None:
    if forced != "auto":
        return forced
    low = path.lower()
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if strip_compression_suffix(low).endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


_MULTIPART_ETAG = re.compile(r"etag:[0-9A-Fa-f]+-[0-9]+")


def is_multipart_etag(fingerprint: str) -> bool:
    """True for the fingerprint of an object uploaded in parts: its ETag (``<md5 of the parts' md5s>-<parts>``)
    changes when the same bytes are uploaded again with another part size, so it does not identify the content."""
    return _MULTIPART_ETAG.fullmatch(fingerprint) is not None


def _sha256_of(f) -> str:
    """``sha256:<hex>`` of an open binary file's remaining bytes, read in 4 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
    return "sha256:" + h.hexdigest()


def content_sha256(path: str, storage: Storage = LOCAL) -> str:
    """``sha256:<hex>`` of a file's bytes, streamed (retried as a whole on a transient error)."""
    from pairmine.operators.read import open_input

    def digest() -> str:
        with open_input(path, storage) as f:
            return _sha256_of(f)

    return storage.retry("read", path, digest)


def content_fingerprint(storage: Storage, path: str, info: dict) -> str:
    """``etag:<ETag>`` for an object-store file (no read needed), else ``sha256:<hash of the content>`` (retried
    as a whole on a transient error)."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return "etag:" + str(etag).strip('"')
    return storage.read_with(path, _sha256_of, "fingerprint")


def discover_shards(path: str = "", fmt: str = "auto", storage: Storage = LOCAL) -> list[Shard]:
    """The input shards of ``path``, sorted by path, each with its size and content fingerprint.

    Args:
        path: a parquet/JSONL file, a folder (searched recursively), or a glob; local or an fsspec URL such as
            ``s3://bucket/prefix/``. Empty: the sample that ships with pairmine. Files and folders whose name starts
            with ``.`` or ``_`` are ignored in folders (hidden, temporary, markers).
        fmt: ``auto`` (by extension: .parquet/.pq, .jsonl/.json/.ndjson, the latter also compressed:
            .jsonl.gz, .jsonl.zst, .jsonl.bz2, .jsonl.xz...), ``parquet`` or ``jsonl`` (JSONL files are decompressed
            by their magic bytes, whatever their name).
        storage: object store options and retries.

    Raises:
        FileNotFoundError: the path does not exist, or matches no parquet/JSONL file.
        InputError: a file's format cannot be told from its name.
        StorageError: the listing failed (not transient, or after the retries).
    """
    path = path or str(SAMPLE_DIR)
    try:
        kind, root, files = storage.files(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"input {path} does not exist") from None
    if kind == "folder":
        def hidden(p: str) -> bool:
            return any(part.startswith((".", "_")) for part in p[len(root):].strip("/").split("/"))

        files = [(p, i) for p, i in files if not hidden(p) and (fmt != "auto" or _format_of(p, "auto"))]
    shards = []
    for p, info in files:
        f = _format_of(p, fmt)
        if f is None:
            raise InputError(
                f"input {p}: cannot tell the format from the name (.parquet/.pq or .jsonl/.json/.ndjson, the latter "
                "optionally .gz/.zst/.bz2/.xz); "
                "set input.format to parquet or jsonl, or point --input at the data files"
            )
        fp = content_fingerprint(storage, p, info)
        shards.append(Shard(index=len(shards), path=p, format=f, size=int(info.get("size") or 0), fingerprint=fp))
    if not shards:
        raise FileNotFoundError(f"input {path} holds no parquet or JSONL file")
    return shards


def check_parquet_shards(shards: list[Shard], required: tuple[str, ...], storage: Storage = LOCAL,
                         text_columns: tuple[str, ...] | None = None, layout: dict | None = None) -> int:
    """Read every parquet shard's footer (cheap, also on s3://): check that it is parquet, has the required
    columns, and that its text columns hold text, before any work starts.

    Args:
        required: the columns every shard must have.
        text_columns: those of ``required`` that must be text (string or binary); the others are ids (strings or
            numbers). None: the first of ``required`` (the text column; ``(text, id)`` is the usual order).

    Returns:
        The parquet shards' total row count (JSONL shards count 0).

    Raises:
        InputError: a file is not readable parquet. MissingColumnError: a required column is missing.
        ColumnTypeError (an InputError): a text column is not text, or an id column is a list or struct; the
            message names the column, its type and the file.
    """
    text_columns = tuple(required[:1]) if text_columns is None else tuple(text_columns)
    id_columns = tuple(c for c in required if c not in text_columns)
    total = 0
    for shard in shards:
        if shard.format != "parquet":
            continue
        def footer(path=shard.path):
            with open_input(path, storage) as f:
                pf = pq.ParquetFile(f)
                md = pf.metadata
                return pf.schema_arrow, md.num_rows, [md.row_group(i).num_rows for i in range(md.num_row_groups)]

        try:
            schema, rows, groups = storage.retry("read", shard.path, footer)
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"input {shard.path} is not a readable parquet file: {e}") from None
        require_columns(shard.path, schema.names, required)
        check_column_types(shard.path, schema, text_columns, id_columns)
        total += rows
        if layout is not None:
            layout[shard.index] = groups
    return total


def sample_cut(sample_docs: int, known_rows: int) -> float:
    """Priority below which a document may join the TF-IDF sample: 3x the expected rate, so the union of the shards'
    candidates almost always holds the global ``sample_docs`` lowest priorities while each shard returns only
    ~3 * sample_docs * (its share of the rows) texts. 1.0 (no cut) when no row count is known (JSONL)."""
    return 1.0 if known_rows <= 0 else min(1.0, 3.0 * sample_docs / known_rows)


TEXT_HASH_KEYS = ("pairmine-text-k1", "pairmine-text-k2")  # two SipHash keys (16 bytes each): a 128-bit hash


def text_hashes(texts: pa.Array) -> np.ndarray:
    """(n, 2) int64: a 128-bit content hash of every text (two ``pandas.util.hash_array`` SipHash-2-4 passes with
    fixed keys, deterministic across processes and machines); null texts hash like the empty string. Two different
    texts share a hash with probability ~2^-128 per pair, so a billion documents repeat none by chance."""
    import pandas as pd

    values = np.asarray(pc.fill_null(texts, "").to_numpy(zero_copy_only=False), dtype=object)
    if len(values) == 0:
        return np.zeros((0, 2), np.int64)
    return np.stack([pd.util.hash_array(values, hash_key=k, categorize=False).view(np.int64)
                     for k in TEXT_HASH_KEYS], axis=1)


def scan_shard(
    shard: Shard, text_column: str, id_column: str, sample_docs: int, seed: int, cut: float = 1.0,
    pool: PoolSpec | None = None, storage: Storage = LOCAL, row_group: int | None = None, hash_texts: bool = False,
    sample_chunk: ChunkSpec | None = None,
) -> ShardScan:
    """First pass over one shard, or over one of its row groups (``row_group``: a parquet row group's index; None or
    -1: the whole file).

    Every document gets a seeded random priority in [0, 1) (seed, shard index and, for one row group, its index:
    the same priorities whatever the scheduling); usable documents (the read
    stage's rules) whose priority is below ``cut`` are candidates, and the shard returns its ``sample_docs`` lowest.
    Merging the shards' candidates and keeping the lowest priorities overall (bottom-k sampling) gives a uniform
    sample of the input that does not depend on scheduling: same seed and input, same sample.

    With ``pool``, the same scheme draws the consistency filter's pool: usable documents below ``pool.doc_cut``
    (a second seeded priority) are chunked, each passage gets its own seeded priority, and the shard returns its
    lowest ``2 * size * (its share of the rows)`` passages, so the lowest ``size`` over all shards are a uniform,
    seeded sample of the input's passages.

    With ``sample_chunk``, each sampled document comes back as its passages (a tuple of str, ``chunk_text`` with
    those settings) instead of its text, so the driver does not chunk the TF-IDF sample itself; a document in both
    the sample and the pool is chunked once when the two use the same settings.

    With ``hash_texts``, the scan also returns every text's content hash (:func:`text_hashes`) and which rows are
    usable, for the run-wide ``duplicate_text`` step of :mod:`pipeline.first_pass`.

    Texts and ids are decoded as the read stage decodes them (:func:`operators.read.parquet_document_columns`,
    :func:`operators.read.jsonl_document_columns`): invalid UTF-8 replaced, compressed JSONL decompressed.

    Raises:
        MissingColumnError: the shard lacks the text or id column (the message names the column and the file).
        ColumnTypeError (an InputError): the text column is not text (for JSONL: a record's text is a number,
            list, ...); the message names the column, its type and the file.
        InputError: a JSONL shard is binary, or a compressed file that cannot be decompressed.
    """
    from pairmine.operators.read import skip_reasons

    if shard.format == "parquet":
        def read():
            with open_input(shard.path, storage) as f:
                pf = pq.ParquetFile(f)
                require_columns(shard.path, pf.schema_arrow.names, (text_column, id_column))
                check_column_types(shard.path, pf.schema_arrow, (text_column,), (id_column,))
                if row_group is not None and row_group >= 0:
                    return [pf.metadata.row_group(row_group).num_rows], pf.read_row_group(
                        row_group, columns=[id_column, text_column])
                rows = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
                return rows, pf.read(columns=[id_column, text_column])

        rg_rows, table = storage.retry("read", shard.path, read)
        cols = parquet_document_columns(shard.path, table, text_column, id_column)
    else:
        records = read_jsonl_records(shard.path, storage)
        require_keys(shard.path, records, (text_column, id_column))
        rg_rows = [len(records)]
        cols = jsonl_document_columns(shard.path, records, text_column, id_column)
    ids, texts, invalid = cols.ids, cols.texts, cols.invalid
    piece = [shard.index] if row_group is None or row_group < 0 else [shard.index, row_group]
    priority = np.random.default_rng([seed, *piece]).random(len(ids))  # (rows,)
    reasons = skip_reasons(ids, texts, np.zeros(len(ids), bool), invalid)
    usable = pc.is_null(reasons).to_numpy(zero_copy_only=False)  # (rows,) bool
    candidate = usable & (priority < cut)
    rows = np.flatnonzero(candidate)
    rows = rows[np.argsort(priority[rows], kind="stable")][:sample_docs]
    chunked = _ChunkOnce()
    sample_texts = texts.take(pa.array(rows, pa.int64()))
    if sample_chunk is None:
        sample = list(zip(priority[rows].tolist(), sample_texts.to_pylist()))
    else:
        sample = [(p, chunked(row, text, sample_chunk))
                  for p, row, text in zip(priority[rows].tolist(), rows.tolist(), sample_chunk.texts(sample_texts))]
    pool_candidates, without = (_pool_candidates(piece, ids, texts, reasons, pool, chunked)
                                if pool is not None and pool.size > 0 else ([], 0))
    skipped = {v["values"]: int(v["counts"]) for v in pc.value_counts(pc.drop_null(reasons)).to_pylist()}
    if without:
        skipped["no_passage"] = without
    # A multipart object's ETag does not survive an upload of the same bytes: its content hash, recorded in the
    # manifest, lets --incremental recognise such a re-upload (computed here, on a worker, while the shard is read).
    first = row_group is None or row_group <= 0
    content = content_sha256(shard.path, storage) if first and is_multipart_etag(shard.fingerprint) else ""
    hashes = text_hashes(texts) if hash_texts else None
    return ShardScan(shard_index=shard.index, row_group_rows=rg_rows, ids=ids, sample=sample, pool=pool_candidates,
                     content_sha256=content, text_hashes=hashes, usable=usable if hash_texts else None,
                     skipped=skipped)


def shard_pool(shard: Shard, text_column: str, id_column: str, pool: PoolSpec, storage: Storage = LOCAL) -> list:
    """The pool candidates of one shard (``scan_shard(...).pool``), run as a Ray task: only they travel back, not
    the shard's ids."""
    return scan_shard(shard, text_column, id_column, 0, 0, 1.0, pool, storage).pool


class _ChunkOnce:
    """``chunk_text`` of one scan's documents, each (row, settings) chunked once; returns the passages as a tuple."""

    def __init__(self):
        self.done: dict[tuple, tuple[str, ...]] = {}

    def __call__(self, row: int, text: str, spec: ChunkSpec) -> tuple[str, ...]:
        key = (row, spec)
        if key not in self.done:
            self.done[key] = tuple(spec.chunk(text).passages)
        return self.done[key]


def _pool_candidates(piece: list[int], ids: pa.Array, texts: pa.Array, reasons: pa.Array, spec: PoolSpec,
                     chunked: _ChunkOnce) -> tuple[list, int]:
    """(the shard's pool candidates, (priority, hash, passage), lowest priorities first; how many of the documents
    drawn gave no passage)."""
    from pairmine.operators.consistency import doc_hash

    rng = np.random.default_rng([spec.seed, *piece])
    doc_priority = rng.random(len(ids))  # (rows,)
    usable = pc.is_null(reasons).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(usable & (doc_priority < spec.doc_cut))
    cap = spec.size if spec.known_rows <= 0 else int(np.ceil(2 * spec.size * len(ids) / spec.known_rows)) + 64
    candidates, without = [], 0
    for row, text, doc_id in zip(rows.tolist(), spec.chunk.texts(texts.take(pa.array(rows, pa.int64()))),
                                 ids.take(pa.array(rows, pa.int64())).to_pylist()):
        passages = chunked(row, text, spec.chunk)
        without += not passages
        for p, priority in zip(passages, rng.random(len(passages)).tolist()):
            candidates.append((priority, doc_hash(p if spec.hash_by == "text" else doc_id), p))
    candidates.sort(key=lambda c: c[0])
    return candidates[:cap], without


def pool_sample(candidates: list[list[tuple[float, int, str]]], size: int, unique: bool = False
                ) -> tuple[list[str], np.ndarray]:
    """The consistency pool: the ``size`` passage candidates with the lowest priorities across all shards (fewer
    when the input offers fewer).

    Args:
        candidates: per shard, in shard order, (priority, hash, passage) tuples (``ShardScan.pool``).
        size: P.
        unique: keep one passage per hash (when hashes are of the passage text, a passage that appears several
            times enters the pool once, so one better passage is counted once).

    Returns:
        (passages, hashes (n,) int64).
    """
    merged, seen = [], set()
    for _, _, h, t in sorted((p, i, h, t) for i, shard in enumerate(candidates) for p, h, t in shard):
        if len(merged) == size:
            break
        if unique:
            if h in seen:
                continue
            seen.add(h)
        merged.append((h, t))
    return [t for _, t in merged], np.array([h for h, _ in merged], dtype=np.int64)


def tfidf_sample(scans: list[ShardScan], sample_docs: int) -> list[str]:
    """The ``sample_docs`` texts with the lowest priorities across all shards (a seeded uniform sample)."""
    merged = sorted((p, s.shard_index, t) for s in scans for p, t in s.sample)[:sample_docs]
    return [t for _, _, t in merged]
