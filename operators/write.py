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
        ("s", pa.float32()),  # cos(anchor, s1) as seen by the consistency filter; null until the filter runs
        ("n_above", pa.int32()),  # pool passages above s; null until the filter runs
        ("model", pa.string()),
    ]
)
STAGING_SORT_COLUMN = "_row_index"

# Centrality histogram: 40 bins of width 0.05 over [-1, 1]; groups-per-document histogram: 0..31, last bin "32+".
CENTRALITY_BINS = np.linspace(-1.0, 1.0, 41)
GROUPS_PER_DOC_MAX = 32


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
    """Write operator. Input: document rows after the related stage. Output: one row per batch with columns
    ``staged`` (list<string>, staging files written) and ``stats`` (JSON of this batch's counts).

    Args:
        staging_dir: folder (local path or fsspec URL) for staging files.
        run_id: written on every group.
        model: model id written on every group.
        threshold: anchor threshold (for the anchors count).
    """

    def __init__(self, staging_dir: str, run_id: str, model: str, threshold: float):
        self.staging_dir, self.run_id, self.model, self.threshold = staging_dir.rstrip("/"), run_id, model, threshold

    def __call__(self, batch: pa.Table) -> pa.Table:
        import fsspec

        stats = Counter()
        cent_hist = np.zeros(len(CENTRALITY_BINS) - 1, dtype=np.int64)
        gpd_hist = np.zeros(GROUPS_PER_DOC_MAX + 1, dtype=np.int64)
        rows: dict[str, list] = {name: [] for name in GROUP_SCHEMA.names}
        rows[STAGING_SORT_COLUMN] = []
        shard_of_group: list[int] = []

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
            stats["anchors"] += sum(c >= self.threshold for c in cent)
            if cent:
                cent_hist += np.histogram(np.clip(cent, -1.0, 1.0), bins=CENTRALITY_BINS)[0]
            gpd_hist[min(len(groups), GROUPS_PER_DOC_MAX)] += 1
            if not groups:
                stats["docs_without_groups"] += 1
                stats[f"docs_without_groups_by_reason.{d['no_group_reason']}"] += 1
                continue
            stats["docs_with_groups"] += 1
            stats["groups"] += len(groups)
            used = set()
            for g in groups:
                a, rel = g["anchor_index"], g["related_indices"]
                used.add(a)
                used.update(rel)
                rows["run_id"].append(self.run_id)
                rows["group_id"].append(group_id(d["id"], a))
                rows["doc_id"].append(d["id"])
                rows["url"].append(d["url"])
                rows["anchor_index"].append(a)
                rows["anchor_text"].append(passages[a])
                rows["anchor_centrality"].append(cent[a])
                rows["related_indices"].append(rel)
                rows["related_texts"].append([passages[j] for j in rel])
                rows["related_dense"].append(g["dense"])
                rows["related_tfidf"].append(g["tfidf"])
                rows["related_rrf"].append(g["rrf"])
                rows["s"].append(None)
                rows["n_above"].append(None)
                rows["model"].append(self.model)
                rows[STAGING_SORT_COLUMN].append(d["row_index"])
                shard_of_group.append(d["shard_index"])
            stats["passages_in_groups"] += len(used)

        staged = []
        if shard_of_group:
            schema = GROUP_SCHEMA.append(pa.field(STAGING_SORT_COLUMN, pa.int64()))
            table = pa.Table.from_pydict(rows, schema=schema)
            shards = np.asarray(shard_of_group)
            fs, root = fsspec.core.url_to_fs(self.staging_dir)
            for shard in np.unique(shards):
                part = table.filter(pa.array(shards == shard))
                name = staging_name(int(shard), part.column(STAGING_SORT_COLUMN).to_numpy())
                write_table_atomic(fs, part, f"{root}/{name}")
                staged.append(name)
        stats["centrality_histogram"] = cent_hist.tolist()
        stats["groups_per_doc_histogram"] = gpd_hist.tolist()
        return pa.table({"staged": pa.array([staged], pa.list_(pa.string())), "stats": [json.dumps(dict(stats))]})


def compact_shard(staging_dir: str, output_dir: str, shard_index: int) -> tuple[str, int]:
    """Merge the staging files of one input shard into its single part ``part-{shard:05d}.parquet``.

    Rows are sorted by (document row, anchor index), so the part's content does not depend on how Ray batched the
    documents. A shard with no groups gets an empty part (schema only), so every input shard has exactly one part.

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
        table = pa.concat_tables(tables).sort_by([(STAGING_SORT_COLUMN, "ascending"), ("anchor_index", "ascending")])
        table = table.drop_columns([STAGING_SORT_COLUMN]).cast(GROUP_SCHEMA)
    else:
        table = GROUP_SCHEMA.empty_table()
    path = f"{out_root}/{part_name(shard_index)}"
    write_table_atomic(fs, table, path)
    return path, table.num_rows
