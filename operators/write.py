"""Write stage: document rows -> training-group rows in parquet, plus the counts that make stats.json (SPEC
"Write").

Each batch's groups are written, per work unit (an input shard's row group, or its whole JSONL file), to a staging
file named by the shard and the row set it covers (published atomically, see :mod:`operators.storage`). The operator
returns one small row per (batch, work unit) with that unit's counts as JSON; the driver adds them up per unit, records
each unit as it completes (so a resumed run keeps it, :mod:`pipeline.run_folder`), and when every document of a shard
has passed runs :func:`compact_shard`, which merges the shard's staging files into its single, deterministically
named part, sorted by (document row, anchor index), with any row staged twice kept once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairmine.operators.storage import LOCAL, Storage

# Output schema of a training group (one parquet row per group).
GROUP_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("group_id", pa.string()),
        ("doc_id", pa.string()),
        ("url", pa.string()),
        ("anchor_index", pa.int32()),
        ("anchor_text", pa.string()),
        ("anchor_centrality", pa.float32()),
        ("related_indices", pa.list_(pa.int32())),
        ("related_texts", pa.list_(pa.string())),
        ("related_dense", pa.list_(pa.float32())),
        ("related_tfidf", pa.list_(pa.float32())),
        ("related_rrf", pa.list_(pa.float32())),
        ("s", pa.float32()),  # cos(anchor, s1) as computed by the consistency filter; null when it is off
        ("n_above", pa.int64()),  # pool passages of other documents with cos(anchor, p) > s; null when it is off
        ("pool_size", pa.int64()),  # P, passages in the consistency pool; null when the filter is off
        ("consistency_k", pa.int32()),  # keep iff n_above < k; null when the filter is off
        ("model", pa.string()),
        ("passage_prefix", pa.string()),  # the text put before every passage when it was embedded ("" for none)
    ]
)
STAGING_SORT_COLUMN = "_row_index"

# Centrality histogram: 40 bins of width 0.05 over [-1, 1]; groups-per-document histogram: 0..31, last bin "32+".
CENTRALITY_BINS = np.linspace(-1.0, 1.0, 41)
GROUPS_PER_DOC_MAX = 32
# n_above histogram bins: 0, 1, 2, 3, 4, 5-9, 10-19, 20-49, 50-99, 100-999, 1000-9999, 10000+.
N_ABOVE_BINS = np.array([0, 1, 2, 3, 4, 5, 10, 20, 50, 100, 1000, 10000, np.iinfo(np.int64).max], dtype=np.float64)


def group_id(doc_id: str, anchor_index: int) -> str:
    """Deterministic group id: the first 16 hex digits of sha1(doc_id + "\\x1f" + anchor_index)."""
    return hashlib.sha1(f"{doc_id}\x1f{anchor_index}".encode("utf-8")).hexdigest()[:16]


def part_name(shard_index: int) -> str:
    """File name of the single output part of input shard ``shard_index`` (deterministic, so a retry overwrites)."""
    return f"part-{shard_index:05d}.parquet"


def staging_name(shard_index: int, rows: np.ndarray) -> str:
    """Staging file of one batch's groups of one shard, named by the document rows it holds: their range plus a hash
    of the row set. A retried task writes the same rows under the same name (overwrite, no duplicate); two batches
    never share a name because they never share a row."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    digest = hashlib.sha1(rows.tobytes()).hexdigest()[:10]
    return f"shard-{shard_index:05d}/rows-{rows[0]:012d}-{rows[-1]:012d}-{digest}.parquet"


def write_table_atomic(storage: Storage, table: pa.Table, path: str) -> None:
    """Write ``table`` as zstd parquet to ``path`` (local or object store) so that readers never see a partial file
    (:meth:`Storage.write_bytes`); transient storage errors are retried.

    Raises:
        StorageError: the write failed for good (the message names the path).
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    storage.write_bytes(path, sink.getvalue().to_pybytes())


def read_table(storage: Storage, path: str) -> pa.Table:
    """Read a whole parquet file (retried on transient storage errors)."""
    import io

    return pq.read_table(io.BytesIO(storage.read_bytes(path)))


class GroupWriter:
    """Write operator. Input: document rows after the related stage (and the consistency filter, when it runs).
    Output: one row per (batch, work unit) with columns ``shard_index``, ``unit_offset`` (the unit's first row in its
    shard), ``staged`` (list<string>, staging files written) and ``stats`` (JSON of that unit's counts in this
    batch). Rows without a ``unit_offset`` column count as one unit per shard (offset 0).

    Args:
        staging_dir: folder (local path or URL) for staging files (``groups/`` and ``dropped/`` below it).
        run_id: written on every group.
        model: model id written on every group.
        passage_prefix: the passage prefix the vectors were computed with, written on every group.
        threshold: anchor threshold (for the anchors count).
        pool_size, k: the consistency filter's P and k, written on every group (None: the filter is off).
        side_output: also stage the groups the consistency filter dropped (for ``<run>/dropped/``).
        storage: the storage layer (object store options, retries).
    """

    def __init__(self, staging_dir: str, run_id: str, model: str, threshold: float, pool_size: int | None = None,
                 k: int | None = None, side_output: bool = False, storage: Storage = LOCAL, passage_prefix: str = ""):
        self.staging_dir, self.run_id, self.model, self.threshold = staging_dir.rstrip("/"), run_id, model, threshold
        self.pool_size, self.k, self.side_output, self.storage = pool_size, k, side_output, storage
        self.passage_prefix = passage_prefix

    def __call__(self, batch: pa.Table) -> pa.Table:
        per_unit: dict[tuple[int, int], _ShardCounts] = {}
        out = {"groups": _GroupRows(), "dropped": _GroupRows()}
        if "unit_offset" not in batch.column_names:
            batch = batch.append_column("unit_offset", pa.array(np.zeros(batch.num_rows, np.int64)))
        docs = batch.select(
            ["shard_index", "unit_offset", "row_index", "id", "url", "skip_reason", "text_repaired", "passages", "centrality", "groups",
             "no_group_reason", "n_short_passages", "n_duplicate_passages", "n_truncated_passages"]
            + [c for c in ("n_token_split_passages", "n_token_truncated", "n_vector_reused", "n_chars_truncated",
                           "n_chars_cut") if c in batch.column_names]
        ).to_pylist()
        for d in docs:
            c = per_unit.setdefault((d["shard_index"], d["unit_offset"]), _ShardCounts())
            stats = c.stats
            stats["docs_in"] += 1
            stats["docs_text_repaired"] += bool(d["text_repaired"])  # invalid UTF-8 replaced with U+FFFD, kept
            if d["skip_reason"] is not None:
                stats[f"docs_skipped.{d['skip_reason']}"] += 1
                continue
            passages, cent, groups = d["passages"], d["centrality"], d["groups"]
            stats["passages"] += len(passages)
            stats["passages_short_dropped"] += d["n_short_passages"]
            stats["passages_duplicate_dropped"] += d["n_duplicate_passages"]  # repeats inside the document
            stats["passages_truncated"] += d["n_truncated_passages"]
            stats["docs_truncated"] += d["n_truncated_passages"] > 0
            stats["chars_truncated"] += d.get("n_chars_truncated") or 0  # left out by chunk.max_passages
            stats["docs_cut_max_chars"] += (d.get("n_chars_cut") or 0) > 0  # longer than chunk.max_chars
            stats["chars_cut_max_chars"] += d.get("n_chars_cut") or 0
            stats["passages_token_split"] += d.get("n_token_split_passages") or 0  # cut again to fit the model
            stats["passages_token_truncated"] += d.get("n_token_truncated") or 0
            stats["passages_vector_reused"] += d.get("n_vector_reused") or 0  # from the consistency pool's pass
            stats["anchors"] += int(np.count_nonzero(np.asarray(cent) >= self.threshold))
            if cent:
                c.cent_hist += np.histogram(np.clip(cent, -1.0, 1.0), bins=CENTRALITY_BINS)[0]
            stats["groups_mined"] += len(groups)
            if groups and "n_above" in groups[0]:
                c.n_above_hist += np.histogram([g["n_above"] for g in groups], bins=N_ABOVE_BINS)[0]
            kept = [g for g in groups if g.get("kept", True)]
            dropped = [g for g in groups if not g.get("kept", True)]
            stats["groups_dropped_consistency"] += len(dropped)
            if groups:  # the paper's figures before the consistency filter (seed 000 has none): kept + dropped
                stats["docs_with_groups_mined"] += 1
                stats["passages_in_groups_mined"] += len(
                    {g["anchor_index"] for g in groups} | {j for g in groups for j in g["related_indices"]})
            c.gpd_hist[min(len(kept), GROUPS_PER_DOC_MAX)] += 1
            if self.side_output:
                for g in dropped:
                    out["dropped"].add(self, d, g)
            if not kept:
                reason = d["no_group_reason"] or "consistency_filter"  # every mined group was dropped by the filter
                stats["docs_without_groups"] += 1
                stats[f"docs_without_groups_by_reason.{reason}"] += 1
                continue
            stats["docs_with_groups"] += 1
            stats["groups"] += len(kept)
            used = set()
            for g in kept:
                used.add(g["anchor_index"])
                used.update(g["related_indices"])
                out["groups"].add(self, d, g)
            stats["passages_in_groups"] += len(used)

        staged: dict[tuple[int, int], list[str]] = {unit: [] for unit in per_unit}
        for kind, rows in out.items():
            for unit, name in rows.stage(self.storage, f"{self.staging_dir}/{kind}", kind):
                staged[unit].append(name)
        units = sorted(per_unit)
        return pa.table({
            "shard_index": pa.array([s for s, _ in units], pa.int32()),
            "unit_offset": pa.array([o for _, o in units], pa.int64()),
            "staged": pa.array([staged[u] for u in units], pa.list_(pa.string())),
            "stats": [json.dumps(per_unit[u].as_dict()) for u in units],
        })


class _ShardCounts:
    """One work unit's counts and histograms within one batch."""

    def __init__(self):
        self.stats: Counter = Counter()
        self.cent_hist = np.zeros(len(CENTRALITY_BINS) - 1, dtype=np.int64)
        self.gpd_hist = np.zeros(GROUPS_PER_DOC_MAX + 1, dtype=np.int64)
        self.n_above_hist = np.zeros(len(N_ABOVE_BINS) - 1, dtype=np.int64)

    def as_dict(self) -> dict:
        return {**self.stats, "centrality_histogram": self.cent_hist.tolist(),
                "groups_per_doc_histogram": self.gpd_hist.tolist(), "n_above_histogram": self.n_above_hist.tolist()}


class _GroupRows:
    """Group rows of one batch, column by column, with the work unit of each, staged per unit."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in (*GROUP_SCHEMA.names, STAGING_SORT_COLUMN)}
        self.units: list[tuple[int, int]] = []

    def add(self, w: GroupWriter, d: dict, g: dict) -> None:
        a, rel, passages, c = g["anchor_index"], g["related_indices"], d["passages"], self.cols
        values = {
            "run_id": w.run_id, "group_id": group_id(d["id"], a), "doc_id": d["id"], "url": d["url"],
            "anchor_index": a, "anchor_text": passages[a], "anchor_centrality": d["centrality"][a],
            "related_indices": rel, "related_texts": [passages[j] for j in rel], "related_dense": g["dense"],
            "related_tfidf": g["tfidf"], "related_rrf": g["rrf"], "s": g.get("s"), "n_above": g.get("n_above"),
            "pool_size": w.pool_size, "consistency_k": w.k, "model": w.model,
            "passage_prefix": w.passage_prefix, STAGING_SORT_COLUMN: d["row_index"],
        }
        for name, value in values.items():
            c[name].append(value)
        self.units.append((d["shard_index"], d["unit_offset"]))

    def stage(self, storage: Storage, root: str, kind: str) -> list[tuple[tuple[int, int], str]]:
        """Write one staging file per work unit; returns ((shard, unit offset), name relative to the staging
        folder)."""
        if not self.units:
            return []
        table = pa.Table.from_pydict(self.cols, schema=GROUP_SCHEMA.append(pa.field(STAGING_SORT_COLUMN, pa.int64())))
        return stage_by_unit(storage, table, [s for s, _ in self.units], [o for _, o in self.units], root, kind)


def write_per_unit(batch: pa.Table, write_unit) -> pa.Table:
    """Run a write operator's ``write_unit`` on each work unit's rows of ``batch`` and return the operator's summary:
    one row per (batch, work unit) with ``shard_index``, ``unit_offset``, ``staged`` (list<string>) and ``stats``
    (JSON). ``write_unit(rows) -> (staged files, counts as JSON)``. Rows without a ``unit_offset`` column count as
    one unit per shard (offset 0). Shared by filter-pairs' and negatives' writers."""
    if "unit_offset" not in batch.column_names:
        batch = batch.append_column("unit_offset", pa.array(np.zeros(batch.num_rows, np.int64)))
    keys = np.stack([batch.column("shard_index").to_numpy().astype(np.int64),
                     batch.column("unit_offset").to_numpy()], axis=1)
    units = np.unique(keys, axis=0).tolist()
    rows = [write_unit(batch.filter(pa.array((keys[:, 0] == s) & (keys[:, 1] == o)))) for s, o in units]
    return pa.table({
        "shard_index": pa.array([s for s, _ in units], pa.int32()),
        "unit_offset": pa.array([o for _, o in units], pa.int64()),
        "staged": pa.array([staged for staged, _ in rows], pa.list_(pa.string())),
        "stats": [stats for _, stats in rows],
    })


def stage_by_unit(storage: Storage, table: pa.Table, shards, unit_offsets, root: str, kind: str
                  ) -> list[tuple[tuple[int, int], str]]:
    """Write ``table`` (rows with ``STAGING_SORT_COLUMN``) as one staging file per work unit under ``root``
    (:func:`staging_name`: ``shard-NNNNN/rows-FIRST-LAST-HASH.parquet``, so a file's rows lie inside one unit).
    ``shards``, ``unit_offsets``: each row's shard and unit (its first row), (rows,).

    Returns:
        ((shard, unit offset), ``kind/`` + name) of each file written.
    """
    keys = np.stack([np.asarray(shards, np.int64), np.asarray(unit_offsets, np.int64)], axis=1)
    names = []
    for shard, offset in np.unique(keys, axis=0).tolist():
        part = table.filter(pa.array((keys[:, 0] == shard) & (keys[:, 1] == offset)))
        name = staging_name(int(shard), part.column(STAGING_SORT_COLUMN).to_numpy())
        write_table_atomic(storage, part, f"{root}/{name}")
        names.append(((int(shard), int(offset)), f"{kind}/{name}"))
    return names


_STAGED_ROWS = re.compile(r"rows-(\d+)-(\d+)-[0-9a-f]+\.parquet$")


def staged_clusters(files: list[str]) -> list[list[str]]:
    """Staging files in order of the document rows they hold (from their names, :func:`staging_name`), grouped
    where their row ranges overlap (a retried batch cut differently, a late write of an interrupted attempt): the
    groups can be sorted one at a time and written one after the other. A file with another name overlaps all."""
    spans = []
    for path in files:
        m = _STAGED_ROWS.search(path)
        spans.append(((int(m.group(1)), int(m.group(2))) if m else (0, 1 << 62), path))
    spans.sort()
    clusters: list[list[str]] = []
    high = -1
    for (lo, hi), path in spans:
        if clusters and lo <= high:
            clusters[-1].append(path)
            high = max(high, hi)
        else:
            clusters.append([path])
            high = hi
    return clusters


def compact_shard(staging_dir: str, output_dir: str, shard_index: int, schema: pa.Schema = GROUP_SCHEMA,
                  sort_keys: tuple[str, ...] = (STAGING_SORT_COLUMN, "anchor_index"),
                  storage: Storage = LOCAL, buffer_rows: int = 8192) -> tuple[str, int, int]:
    """Merge the staging files of one input shard into its single part ``part-{shard:05d}.parquet``, streaming.

    Rows are sorted by ``sort_keys`` (the first is the staging files' document row, ``STAGING_SORT_COLUMN``; for
    groups: document row, anchor index), so the part's content does not depend on how Ray batched the rows. A row
    staged twice (same ``sort_keys``: a retried task whose batch was cut differently, or a late write of an
    interrupted attempt) is kept once. The files are taken in order of their row ranges (:func:`staged_clusters`):
    each set of overlapping files is read, sorted and de-duplicated alone, and rows go to the part in row groups of
    about ``buffer_rows``, so the commit's memory is about one batch's files plus ``buffer_rows`` rows, whatever the
    size of the shard (issue 15 item 8). A shard with no rows gets an empty part (``schema`` only), so every input
    shard has exactly one part. Staging files are only read, never removed here.

    Returns:
        (path of the part, rows in it, duplicate rows left out).

    Raises:
        StorageError: a staging file cannot be read or the part cannot be written.
    """
    folder = f"{staging_dir.rstrip('/')}/shard-{shard_index:05d}"
    files = sorted(p for p in storage.ls(folder) if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith("."))
    duplicates = 0

    def sorted_clusters():
        nonlocal duplicates
        for cluster in staged_clusters(files):
            table = pa.concat_tables([read_table(storage, p) for p in cluster])
            table = table.sort_by([(key, "ascending") for key in sort_keys])
            if table.num_rows > 1:
                keys = [table.column(k).to_numpy() for k in sort_keys]
                same = np.ones(table.num_rows - 1, dtype=bool)
                for k in keys:
                    same &= k[1:] == k[:-1]
                if same.any():
                    duplicates += int(same.sum())
                    table = table.filter(pa.array(np.concatenate([[True], ~same])))
            yield table.drop_columns([STAGING_SORT_COLUMN]).cast(schema)

    def row_groups():
        buffered: list[pa.Table] = []
        rows = 0
        for table in sorted_clusters():
            buffered.append(table)
            rows += table.num_rows
            if rows >= buffer_rows:
                yield pa.concat_tables(buffered).combine_chunks()
                buffered, rows = [], 0
        if buffered or not files:
            yield pa.concat_tables(buffered).combine_chunks() if buffered else schema.empty_table()

    path = f"{output_dir.rstrip('/')}/{part_name(shard_index)}"
    n = storage.write_parquet_stream(path, schema, row_groups())
    return path, n, duplicates
