"""Write stage: document rows -> training-group rows in parquet, plus the counts that make stats.json (SPEC
"Write").

Each batch's groups are written, per input shard, to a staging file named by the shard and the row range it covers
(written under a temporary name, then renamed). After the Ray run, :func:`compact_shard` merges one shard's staging
files into the shard's single, deterministically named part, sorted by (document row, anchor index). The operator
returns one small row per batch with the batch's counts as JSON; the driver adds them up.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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


def write_table_atomic(fs, table: pa.Table, path: str) -> None:
    """Write ``table`` as zstd parquet to ``path`` on fsspec filesystem ``fs``: first under a temporary name in the
    same folder, then renamed, so readers never see a partial file."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
    fs.mv(tmp, path)


class GroupWriter:
    """Write operator. Input: document rows after the related stage (and the consistency filter, when it runs).
    Output: one row per batch with columns ``staged`` (list<string>, staging files written) and ``stats`` (JSON of
    this batch's counts).

    Args:
        staging_dir: folder (local path or fsspec URL) for staging files (``groups/`` and ``dropped/`` below it).
        run_id: written on every group.
        model: model id written on every group.
        threshold: anchor threshold (for the anchors count).
        pool_size, k: the consistency filter's P and k, written on every group (None: the filter is off).
        side_output: also stage the groups the consistency filter dropped (for ``<run>/dropped/``).
    """

    def __init__(self, staging_dir: str, run_id: str, model: str, threshold: float, pool_size: int | None = None,
                 k: int | None = None, side_output: bool = False):
        self.staging_dir, self.run_id, self.model, self.threshold = staging_dir.rstrip("/"), run_id, model, threshold
        self.pool_size, self.k, self.side_output = pool_size, k, side_output

    def __call__(self, batch: pa.Table) -> pa.Table:
        import fsspec

        stats = Counter()
        cent_hist = np.zeros(len(CENTRALITY_BINS) - 1, dtype=np.int64)
        gpd_hist = np.zeros(GROUPS_PER_DOC_MAX + 1, dtype=np.int64)
        n_above_hist = np.zeros(len(N_ABOVE_BINS) - 1, dtype=np.int64)
        out = {"groups": _GroupRows(), "dropped": _GroupRows()}

        docs = batch.select(
            ["shard_index", "row_index", "id", "url", "skip_reason", "passages", "centrality", "groups", "no_group_reason",
             "n_short_passages", "n_truncated_passages"]
        ).to_pylist()
        for d in docs:
            stats["docs_in"] += 1
            if d["skip_reason"] is not None:
                stats[f"docs_skipped.{d['skip_reason']}"] += 1
                continue
            passages, cent, groups = d["passages"], d["centrality"], d["groups"]
            stats["passages"] += len(passages)
            stats["passages_short_dropped"] += d["n_short_passages"]
            stats["passages_truncated"] += d["n_truncated_passages"]
            stats["docs_truncated"] += d["n_truncated_passages"] > 0
            stats["anchors"] += int(np.count_nonzero(np.asarray(cent) >= self.threshold))
            if cent:
                cent_hist += np.histogram(np.clip(cent, -1.0, 1.0), bins=CENTRALITY_BINS)[0]
            stats["groups_mined"] += len(groups)
            if groups and "n_above" in groups[0]:
                n_above_hist += np.histogram([g["n_above"] for g in groups], bins=N_ABOVE_BINS)[0]
            kept = [g for g in groups if g.get("kept", True)]
            dropped = [g for g in groups if not g.get("kept", True)]
            stats["groups_dropped_consistency"] += len(dropped)
            gpd_hist[min(len(kept), GROUPS_PER_DOC_MAX)] += 1
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

        staged = []
        fs, root = fsspec.core.url_to_fs(self.staging_dir)
        for kind, rows in out.items():
            staged += rows.stage(fs, f"{root}/{kind}", kind)
        stats["centrality_histogram"] = cent_hist.tolist()
        stats["groups_per_doc_histogram"] = gpd_hist.tolist()
        stats["n_above_histogram"] = n_above_hist.tolist()
        return pa.table({"staged": pa.array([staged], pa.list_(pa.string())), "stats": [json.dumps(dict(stats))]})


class _GroupRows:
    """Group rows of one batch, column by column, with the shard of each, staged per shard."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in (*GROUP_SCHEMA.names, STAGING_SORT_COLUMN)}
        self.shards: list[int] = []

    def add(self, w: GroupWriter, d: dict, g: dict) -> None:
        a, rel, passages, c = g["anchor_index"], g["related_indices"], d["passages"], self.cols
        values = {
            "run_id": w.run_id, "group_id": group_id(d["id"], a), "doc_id": d["id"], "url": d["url"],
            "anchor_index": a, "anchor_text": passages[a], "anchor_centrality": d["centrality"][a],
            "related_indices": rel, "related_texts": [passages[j] for j in rel], "related_dense": g["dense"],
            "related_tfidf": g["tfidf"], "related_rrf": g["rrf"], "s": g.get("s"), "n_above": g.get("n_above"),
            "pool_size": w.pool_size, "consistency_k": w.k, "model": w.model, STAGING_SORT_COLUMN: d["row_index"],
        }
        for name, value in values.items():
            c[name].append(value)
        self.shards.append(d["shard_index"])

    def stage(self, fs, root: str, kind: str) -> list[str]:
        if not self.shards:
            return []
        table = pa.Table.from_pydict(self.cols, schema=GROUP_SCHEMA.append(pa.field(STAGING_SORT_COLUMN, pa.int64())))
        shards = np.asarray(self.shards)
        names = []
        for shard in np.unique(shards):
            part = table.filter(pa.array(shards == shard))
            name = staging_name(int(shard), part.column(STAGING_SORT_COLUMN).to_numpy())
            write_table_atomic(fs, part, f"{root}/{name}")
            names.append(f"{kind}/{name}")
        return names


def compact_shard(staging_dir: str, output_dir: str, shard_index: int, schema: pa.Schema = GROUP_SCHEMA,
                  sort_keys: tuple[str, ...] = (STAGING_SORT_COLUMN, "anchor_index")) -> tuple[str, int]:
    """Merge the staging files of one input shard into its single part ``part-{shard:05d}.parquet``.

    Rows are sorted by ``sort_keys`` (for groups: document row, anchor index), so the part's content does not depend
    on how Ray batched the rows. A shard with no rows gets an empty part (``schema`` only), so every input shard has
    exactly one part.

    Returns:
        (path of the part, number of groups in it).
    """
    import fsspec

    fs, staging_root = fsspec.core.url_to_fs(staging_dir.rstrip("/"))
    _, out_root = fsspec.core.url_to_fs(output_dir.rstrip("/"))
    folder = f"{staging_root}/shard-{shard_index:05d}"
    files = sorted(p for p in (fs.ls(folder, detail=False) if fs.exists(folder) else []) if p.endswith(".parquet"))
    tables = []
    for p in files:
        with fs.open(p, "rb") as f:
            tables.append(pq.read_table(f))
    if tables:
        table = pa.concat_tables(tables).sort_by([(key, "ascending") for key in sort_keys])
        table = table.drop_columns([STAGING_SORT_COLUMN]).cast(schema)
    else:
        table = schema.empty_table()
    path = f"{out_root}/{part_name(shard_index)}"
    write_table_atomic(fs, table, path)
    return path, table.num_rows
