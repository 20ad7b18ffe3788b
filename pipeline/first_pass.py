"""The mining job's first pass, in bounded pieces and with no per-document state in the driver (issue 15).

The *scan unit* is a parquet row group, or a whole JSONL file; a Ray task scans one unit, or consecutive small row
groups of one shard up to ``TASK_ROWS`` rows, one after the other, reading only one unit's id and text columns at a
time, and returns bounded summaries per unit: its bottom-k candidates for the TF-IDF sample and for the consistency pool (merged in
the driver into running bottom-k buffers of ``sample_docs`` and ``pool.size`` items, whatever the number of units),
and its row count. Its ids go to :class:`DuplicateIndex` actors by hash range (``pandas.util.hash_array`` of the id,
modulo the number of ranges), never to the driver. Once every unit is scanned, each index finds the repeated ids of
its range exactly (an Arrow group-by, as the in-driver step it replaces), and the rows to skip as ``duplicate_id``
are written per shard to ``<duplicates_dir>/shard-XXXXX.npy`` (sorted int64 row indices in the shard), which the
read operator loads for its shard. The driver holds per-unit layout (a few integers per row group), per-shard
counts, the two bottom-k buffers and the actor handles: nothing that grows with the number of documents.

Which occurrence is kept is as before: the first in run order (shard order, then row order).

Exact duplicate texts (web corpora repeat pages under new ids; issue 14 item 5) are found the same way: every usable
row's 128-bit content hash (:func:`pipeline.inputs.text_hashes`) goes with its position to the index of its hash
range, and a row whose text an earlier usable row of the run already has is skipped as ``duplicate_text``
(``input.skip_duplicate_texts``, on by default). A row that is both keeps the reason ``duplicate_id``. The copy kept
is the first usable one in run order; if that copy is itself skipped as ``duplicate_id`` (its id was taken by an
earlier, different text), the text is not mined, and both rows are counted under their reasons.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairmine.pipeline.inputs import PoolSpec, Shard, scan_shard

log = logging.getLogger("pairmine")

ROW_BITS = 40  # position of a row in run order: shard index << ROW_BITS | row index in the shard
IDS_PER_RANGE = 1_000_000  # ids one DuplicateIndex is sized for (about 50-100 MB of Arrow memory on its worker)
MAX_RANGES = 256


def index_ranges(expected_docs: int) -> int:
    """Number of hash ranges (DuplicateIndex actors) for a run of about ``expected_docs`` documents: one per
    ``IDS_PER_RANGE`` ids, at least 1, at most ``MAX_RANGES``."""
    return max(1, min(MAX_RANGES, math.ceil(max(0, expected_docs) / IDS_PER_RANGE)))


def id_ranges(ids: pa.Array, ranges: int) -> np.ndarray:
    """Hash range of every id (int64 (n,), in [0, ranges)); ids are strings. Deterministic across processes
    (``pandas.util.hash_array``: SipHash with a fixed key)."""
    import pandas as pd

    if ranges == 1 or len(ids) == 0:
        return np.zeros(len(ids), np.int64)
    h = pd.util.hash_array(np.asarray(ids.to_numpy(zero_copy_only=False), dtype=object))
    return (h % np.uint64(ranges)).astype(np.int64)


def _repeated_positions(table: pa.Table, keys: list[str]) -> np.ndarray:
    """Sorted int64 positions of the rows of ``table`` (key columns + ``pos``) whose key an earlier position has:
    an Arrow group-by keeps the minimum position per key (the occurrence kept), every other row of a repeated key
    is returned."""
    first = table.group_by(keys).aggregate([("pos", "min"), ("pos", "count")])
    repeated = first.filter(pc.greater(first.column("pos_count"), 1))
    if repeated.num_rows == 0:
        return np.zeros(0, np.int64)
    joined = table.join(repeated.select([*keys, "pos_min"]), keys, join_type="inner")
    dup = joined.filter(pc.not_equal(joined.column("pos"), joined.column("pos_min")))
    return np.sort(dup.column("pos").to_numpy())


def _per_shard(positions: np.ndarray) -> dict[int, int]:
    shards, counts = np.unique(positions >> ROW_BITS, return_counts=True)
    return {int(s): int(c) for s, c in zip(shards, counts)}


def _rows_of(positions: np.ndarray, shard: int) -> np.ndarray:
    lo, hi = np.searchsorted(positions, [shard << ROW_BITS, (shard + 1) << ROW_BITS])
    return positions[lo:hi] & ((1 << ROW_BITS) - 1)


class DuplicateIndex:
    """The ids (and text hashes) of one hash range of the run, and the rows whose id (or text) appeared earlier in
    run order.

    ``add`` takes (ids, positions) from the scan tasks and, in the same call, (128-bit text hashes as two int64
    columns, positions) of the usable rows; ``find`` (called once, after every unit is scanned) finds the repeated ids and texts
    with Arrow group-bys (minimum position per key: the occurrence kept) and returns per-shard counts
    ``{"id": {shard: n}, "text": {shard: n}}``; ``rows(shard)`` gives that shard's duplicate rows (id rows, text
    rows). Positions are ``shard << ROW_BITS | row``. Null ids never reach it (they are skipped as ``null_id``)."""

    def __init__(self):
        self.parts: list[pa.Table] = []
        self.text_parts: list[pa.Table] = []
        self.duplicates = np.zeros(0, np.int64)
        self.duplicate_texts = np.zeros(0, np.int64)

    def add(self, ids: pa.Array, positions: np.ndarray, hashes: np.ndarray | None = None,
            text_positions: np.ndarray | None = None) -> int:
        """``ids`` (n,) with ``positions`` (n,) int64; optionally ``hashes`` (m, 2) int64
        (:func:`pipeline.inputs.text_hashes`) with ``text_positions`` (m,) int64. Returns n + m."""
        if len(ids):
            self.parts.append(pa.table({"id": ids, "pos": pa.array(positions, pa.int64())}))
        if hashes is not None and len(hashes):
            self.text_parts.append(pa.table({"h1": pa.array(hashes[:, 0]), "h2": pa.array(hashes[:, 1]),
                                             "pos": pa.array(text_positions, pa.int64())}))
        return len(ids) + (0 if hashes is None else len(hashes))

    def find(self) -> dict[str, dict[int, int]]:
        if self.parts:
            self.duplicates = _repeated_positions(pa.concat_tables(self.parts), ["id"])
        if self.text_parts:
            self.duplicate_texts = _repeated_positions(pa.concat_tables(self.text_parts), ["h1", "h2"])
        self.parts, self.text_parts = [], []
        return {"id": _per_shard(self.duplicates), "text": _per_shard(self.duplicate_texts)}

    def rows(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        return _rows_of(self.duplicates, shard), _rows_of(self.duplicate_texts, shard)


@dataclass
class ScanParams:
    """What every scan task needs (see :func:`pipeline.inputs.scan_shard`)."""

    text_column: str
    id_column: str
    sample_docs: int
    seed: int
    cut: float
    pool: PoolSpec | None
    storage: object
    duplicate_texts: bool = True  # find exact duplicate texts (input.skip_duplicate_texts)
    sample_chunk: object = None  # pipeline.inputs.ChunkSpec: the sample comes back chunked (FirstPass.sample)


def scan_units(shard: Shard, pieces: list[tuple[int, int]], params: ScanParams, indexes: list,
               remote: bool = True) -> list[dict]:
    """Ray task (``remote``; else in-process with plain :class:`DuplicateIndex` objects): scan units of one shard,
    one after the other (:func:`pipeline.inputs.scan_shard` on one row group each: ``pieces`` are (row group, row
    offset in the shard); row group -1: the whole JSONL file), send their ids to the :class:`DuplicateIndex` of
    their hash range, and return one bounded summary per unit (rows, sample, pool candidates, the file's content
    hash where the shard needs one). A task holds the ids of its units (at most ``TASK_ROWS`` rows) and the columns
    of one unit at a time."""
    summaries, all_ids, all_positions, all_hashes, hash_positions = [], [], [], [], []
    for row_group, row_offset in pieces:
        t0, c0 = time.perf_counter(), time.process_time()
        scan = scan_shard(shard, params.text_column, params.id_column, params.sample_docs, params.seed, params.cut,
                          params.pool, params.storage, row_group=row_group, hash_texts=params.duplicate_texts,
                          sample_chunk=params.sample_chunk)
        valid = pc.is_valid(scan.ids).to_numpy(zero_copy_only=False)
        all_ids.append(scan.ids.filter(pa.array(valid)))
        base = np.int64(shard.index) << ROW_BITS
        all_positions.append(base | (np.flatnonzero(valid).astype(np.int64) + row_offset))
        if scan.text_hashes is not None:
            all_hashes.append(scan.text_hashes[scan.usable])
            hash_positions.append(base | (np.flatnonzero(scan.usable).astype(np.int64) + row_offset))
        summaries.append({"shard_index": shard.index, "row_group": row_group, "rows": scan.num_rows,
                          "sample": scan.sample, "pool": scan.pool, "content_sha256": scan.content_sha256,
                          "busy_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
        del scan
    t0 = time.perf_counter()
    ids = pa.concat_arrays([a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in all_ids]) \
        if all_ids else pa.array([], pa.string())
    positions = np.concatenate(all_positions) if all_positions else np.zeros(0, np.int64)
    which = id_ranges(ids, len(indexes))
    hashes = np.concatenate(all_hashes) if all_hashes else np.zeros((0, 2), np.int64)
    text_positions = np.concatenate(hash_positions) if hash_positions else np.zeros(0, np.int64)
    text_range = (hashes[:, 0].view(np.uint64) % np.uint64(len(indexes))).astype(np.int64)
    sent = []
    for r, index in enumerate(indexes):
        mask, text_mask = which == r, text_range == r
        if mask.any() or text_mask.any():
            args = (ids.filter(pa.array(mask)), positions[mask], hashes[text_mask], text_positions[text_mask])
            if remote:
                sent.append(index.add.remote(*args))
            else:
                index.add(*args)
    if sent:
        import ray

        ray.get(sent)  # delivered before the task ends: the driver asks the indexes only after every task has ended
    if summaries:
        summaries[-1]["busy_s"] += time.perf_counter() - t0
    return summaries


def write_shard_duplicates(shard_index: int, indexes: list, path: str, storage,
                           remote: bool = True) -> tuple[int, int, int]:
    """Ray task (or in-process, as :func:`scan_units`): gather one shard's duplicate rows from every index, write
    them to ``path`` as an .npz of two sorted int64 arrays of row indices in the shard, ``duplicate_id`` and
    ``duplicate_text`` (what :class:`operators.read.ReadDocuments` loads; a row that is both is only in
    ``duplicate_id``). Returns (duplicate ids, duplicate texts found, duplicate texts written)."""
    if remote:
        import ray

        parts = ray.get([i.rows.remote(shard_index) for i in indexes])
    else:
        parts = [i.rows(shard_index) for i in indexes]
    by_id = np.sort(np.concatenate([np.zeros(0, np.int64), *(p[0] for p in parts)]))
    by_text = np.sort(np.concatenate([np.zeros(0, np.int64), *(p[1] for p in parts)]))
    text_only = np.setdiff1d(by_text, by_id, assume_unique=True)  # sorted
    buf = io.BytesIO()
    np.savez(buf, duplicate_id=by_id, duplicate_text=text_only)
    storage.write_bytes(path, buf.getvalue())
    return len(by_id), len(by_text), len(text_only)


class Lowest:
    """The ``k`` smallest of the items added so far (totally ordered tuples), in memory bounded by ~3k items."""

    def __init__(self, k: int):
        self.k, self.items = max(0, k), []

    def add(self, items) -> None:
        self.items.extend(items)
        if len(self.items) > 2 * self.k + 1024:
            self.items.sort()
            del self.items[self.k:]

    def result(self) -> list:
        self.items.sort()
        return self.items[:self.k]


@dataclass
class FirstPass:
    """What the first pass learned (see :func:`first_pass`).

    Attributes:
        rows_per_shard: rows of every shard, by shard index.
        units: the read operator's work units (``operators.read.UNIT_SCHEMA``), one per row group / JSONL file.
        unit_rows: rows of each unit, by (shard index, the unit's first row) (``pipeline.run_folder.unit_key``).
        duplicates: ids that repeat an earlier one (rows skipped as ``duplicate_id``), over the whole input.
        duplicate_texts: rows skipped as ``duplicate_text`` (their exact text is an earlier usable row's, and they
            are not a ``duplicate_id``), over the whole input; 0 when not looked for.
        sample: the TF-IDF sample (the ``sample_docs`` lowest priorities over the input): texts, or each
            document's passages (a tuple of str) when scanned with ``ScanParams.sample_chunk``.
        pool_passages, pool_hashes: the consistency pool candidates (``pool.size`` lowest priorities), hashes (n,).
        content_hashes: ``sha256:...`` of multipart-uploaded shards, by shard index.
        ranges: hash ranges (DuplicateIndex actors) used.
        figures: wall, busy (summed over the scan tasks) and CPU seconds, tasks and rows, as
            :func:`pipeline.ray_adapter.stage_figures` gives them for the Ray Data stages.
    """

    rows_per_shard: dict[int, int]
    units: list[dict]
    duplicates: int
    sample: list  # of str, or of tuple[str, ...] (see above)
    pool_passages: list[str] = field(default_factory=list)
    pool_hashes: np.ndarray | None = None
    content_hashes: dict[int, str] = field(default_factory=dict)
    ranges: int = 1
    duplicate_texts: int = 0
    figures: dict = field(default_factory=dict)  # the first pass's row of the per-stage figures (stats.json)
    unit_rows: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def docs(self) -> int:
        return sum(self.rows_per_shard.values())


TASK_ROWS = 65_536  # consecutive small row groups of a shard share a scan task up to this many rows


def _tasks(todo: list) -> list[tuple[Shard, list[tuple[int, int]]]]:
    """Scan tasks: consecutive units of one shard, up to ``TASK_ROWS`` rows (a unit larger than that, or a JSONL
    file, alone)."""
    tasks: list[tuple[Shard, list[tuple[int, int]]]] = []
    rows_in_last = 0
    for shard, rg, offset, rows in todo:
        if tasks and tasks[-1][0] is shard and rg >= 0 and rows_in_last + rows <= TASK_ROWS:
            tasks[-1][1].append((rg, offset))
            rows_in_last += rows
        else:
            tasks.append((shard, [(rg, offset)]))
            rows_in_last = rows if rg >= 0 else TASK_ROWS
    return tasks


def _scans(todo: list, params: ScanParams, indexes: list, in_process: bool):
    """Scan summaries of every unit, as their tasks finish (at most twice the cluster's CPUs in flight)."""
    tasks = _tasks(todo)
    if in_process:
        for shard, pieces in tasks:
            yield from scan_units(shard, pieces, params, indexes, remote=False)
        return
    import ray

    scan = ray.remote(num_cpus=1)(scan_units)
    window = max(4, 2 * int(ray.cluster_resources().get("CPU", 1)))
    pending: dict = {}
    nxt = 0
    while nxt < len(tasks) or pending:
        while nxt < len(tasks) and len(pending) < window:
            shard, pieces = tasks[nxt]
            pending[scan.remote(shard, pieces, params, indexes)] = nxt
            nxt += 1
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            pending.pop(ref)
            yield from ray.get(ref)


def first_pass(shards: list[Shard], layout: dict[int, list[int]], params: ScanParams, duplicates_dir: str,
               progress_every_s: float = 10.0, in_process: bool = False, ranges: int = 0) -> FirstPass:
    """Scan every unit of ``shards`` as Ray tasks (at most twice the cluster's CPUs in flight), find duplicate ids
    across the run by hash range, write each shard's duplicate rows under ``duplicates_dir``.

    Args:
        layout: rows per row group of every parquet shard, by shard index (from the footers:
            :func:`pipeline.inputs.check_parquet_shards`); JSONL shards are one unit each.
        params: what every scan needs; ``params.pool`` None: no pool.
        duplicates_dir: where ``shard-XXXXX.npy`` files go (only for shards with duplicates).
        in_process: scan one unit after the other in this process, with plain indexes (no Ray: small inputs,
            ``pairmine calibrate``, tests); the results are the same.
        ranges: hash ranges (0: :func:`index_ranges` of the expected documents).

    Raises:
        What a scan raises (InputError, MissingColumnError, ColumnTypeError, StorageError), through Ray.
    """
    t0 = time.time()
    todo = []  # (shard, row group, row offset, rows)
    for shard in shards:
        if shard.format == "parquet":
            offset = 0
            for rg, rows in enumerate(layout.get(shard.index, [])):
                todo.append((shard, rg, offset, rows))
                offset += rows
        else:
            todo.append((shard, -1, 0, 0))
    expected = sum(sum(v) for v in layout.values()) + sum(s.size // 500 for s in shards if s.format != "parquet")
    ranges = ranges or index_ranges(expected)
    if in_process:
        indexes = [DuplicateIndex() for _ in range(ranges)]
    else:
        import ray

        indexes = [ray.remote(num_cpus=0, scheduling_strategy="SPREAD")(DuplicateIndex).remote()
                   for _ in range(ranges)]
    try:
        sample, pool = Lowest(params.sample_docs), Lowest(params.pool.size if params.pool else 0)
        rows_by_unit: dict[tuple[int, int], int] = {}
        content: dict[int, str] = {}
        last_log = time.time()
        busy = cpu = 0.0
        for r in _scans(todo, params, indexes, in_process):
            s, rg = r["shard_index"], r["row_group"]
            rows_by_unit[(s, rg)] = r["rows"]
            sample.add((p, s, rg, t) for p, t in r["sample"])
            pool.add((p, s, rg, h, t) for p, h, t in r["pool"])
            if r["content_sha256"]:
                content[s] = r["content_sha256"]
            busy += r["busy_s"]
            cpu += r["cpu_s"]
            if time.time() - last_log >= progress_every_s:
                last_log = time.time()
                log.info("first pass: %d of %d unit(s) scanned (%.0f s)", len(rows_by_unit), len(todo), last_log - t0)
        per_shard: Counter = Counter()  # duplicate ids by shard
        text_per_shard: Counter = Counter()  # duplicate texts by shard (rows; some may also be duplicate ids)
        for counts in ([i.find() for i in indexes] if in_process else ray.get([i.find.remote() for i in indexes])):
            per_shard.update(counts["id"])
            text_per_shard.update(counts["text"])
        paths = {s: f"{duplicates_dir}/shard-{s:05d}.npz" for s in set(per_shard) | set(text_per_shard)}
        if in_process:
            written = [write_shard_duplicates(s, indexes, paths[s], params.storage, False) for s in sorted(paths)]
        else:
            write = ray.remote(num_cpus=0.25)(write_shard_duplicates)
            written = ray.get([write.remote(s, indexes, paths[s], params.storage) for s in sorted(paths)])
        found = (sum(per_shard.values()), sum(text_per_shard.values()))
        if (sum(w[0] for w in written), sum(w[1] for w in written)) != found:
            raise RuntimeError(f"duplicate rows written ({written}) differ from those found ({found})")
    finally:
        if not in_process:
            for i in indexes:
                ray.kill(i)
    rows_per_shard = {s.index: 0 for s in shards}
    units, unit_rows = [], {}
    for shard, rg, offset, _ in todo:
        rows_per_shard[shard.index] += rows_by_unit[(shard.index, rg)]
        unit_rows[(shard.index, offset)] = rows_by_unit[(shard.index, rg)]
        units.append({"shard_index": shard.index, "path": shard.path, "format": shard.format, "row_group": rg,
                      "row_offset": offset, "duplicates": paths.get(shard.index, "")})
    chosen = pool.result()
    return FirstPass(
        rows_per_shard=rows_per_shard, units=units, duplicates=sum(per_shard.values()),
        duplicate_texts=sum(w[2] for w in written),
        sample=[t for *_, t in sample.result()],
        pool_passages=[t for *_, t in chosen], pool_hashes=np.array([c[3] for c in chosen], dtype=np.int64),
        content_hashes=content, ranges=ranges, unit_rows=unit_rows,
        figures={"stage": "first pass", "wall_s": round(time.time() - t0, 2), "busy_s": round(busy, 2),
                 "cpu_s": round(cpu, 2), "tasks": len(_tasks(todo)), "rows_out": sum(rows_by_unit.values())},
    )
