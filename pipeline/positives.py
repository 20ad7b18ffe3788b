"""Random positives (SPEC "Random positives"; seed 000's main ablation): the positive of every group is replaced by a
passage drawn uniformly from *all* passages of the group's document other than its anchor.

The groups hold only their anchor and related passages, and the passages nobody grouped (navigation, widgets,
off-topic asides) are exactly what makes random positives weak in the paper. So the documents are read again from
the run's input (the files its manifest lists) and re-chunked exactly as mining chunked them (the run's own
``[input]`` and ``[chunk]`` settings, the same :class:`~pairmine.operators.read.ReadDocuments` and
:class:`~pairmine.operators.chunk.Chunker`), on Ray Data, then brought together with the groups by document id in
one shuffle (``groupby("doc_id").map_groups``): no per-document state in the driver.

A document's re-chunked passages are used only when they agree with every group of it (the anchor and the related
passages sit at their recorded indices); a document id the input holds twice (mining kept the first) is resolved
the same way. When no copy agrees (the input changed in place since mining, or pairmine's chunker changed), the
document falls back to the passages its groups hold, and the worker logs a warning with the count. An input file
that is gone or whose size (or, on S3, single-part ETag) differs from the manifest's record is refused up front.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pyarrow as pa

from pairmine.operators.read import InputError

log = logging.getLogger("pairmine")

# One schema for both kinds of rows that meet in the shuffle: group rows (``passages`` null) and document rows
# (``group_id`` null).
ROW_SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("group_id", pa.string()),
    ("anchor_index", pa.int32()),
    ("anchor_text", pa.string()),
    ("related_indices", pa.list_(pa.int32())),
    ("related_texts", pa.list_(pa.string())),
    ("passages", pa.list_(pa.string())),
])
GROUP_COLUMNS = ("group_id", "doc_id", "anchor_index", "anchor_text", "related_indices", "related_texts")


def _rng(seed: int, group_id: str) -> np.random.Generator:
    """The draw's generator: seeded per group (seed + group id), so the same groups always get the same positives."""
    return np.random.default_rng(int(hashlib.sha1(f"{seed}:{group_id}".encode()).hexdigest()[:15], 16))


def agrees(passages: list[str], anchor_index: int, anchor_text: str, related_indices, related_texts) -> bool:
    """True when a document's passage list holds the group's anchor and related passages at their indices."""
    n = len(passages)
    if not (0 <= anchor_index < n and passages[anchor_index] == anchor_text):
        return False
    return all(0 <= i < n and passages[i] == t for i, t in zip(related_indices, related_texts))


def crop_pair(passages: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """Two independent random spans of one document: the usual contrastive pre-training pair ("two random spans from
    one document", which seed 000 argues against; ``train.positives = crop``).

    The document is the sequence of its passages' words in order (``passages``: all its passages, as mining chunked
    them). Each span's length L is drawn uniformly from the word counts of those passages (so spans are as long as
    passages are: "each of a passage's length distribution", SPEC "Does it help?"), its first word uniformly from
    the ``n_words - L + 1`` possible starts; the two spans are drawn independently (they may overlap, as in
    Contriever's cropping).

    Args:
        passages: the document's passages (at least 1, each at least 1 word).
        rng: the group's generator (seeded per group, :func:`_rng`).

    Returns:
        (anchor span, positive span), words joined by single spaces.
    """
    words = [w for p in passages for w in p.split()]
    lengths = [len(p.split()) for p in passages]
    spans = []
    for _ in range(2):
        n = min(lengths[int(rng.integers(len(lengths)))], len(words))
        start = int(rng.integers(len(words) - n + 1))
        spans.append(" ".join(words[start:start + n]))
    return spans[0], spans[1]


def draw_random_positives(batch: pa.Table, seed: int, mode: str = "random") -> pa.Table:
    """The random positives of ONE document's groups (the ``map_groups`` function); with ``mode = "crop"``, the
    anchor and the positive are both replaced by :func:`crop_pair`'s two random spans of the document.

    Args:
        batch: rows of :data:`ROW_SCHEMA` with one ``doc_id``: its groups (``group_id`` set) and its re-chunked
            passage lists (``passages`` set; none, one, or one per copy of a repeated id).
        seed: ``train.seed``.

    Returns:
        the group rows (``GROUP_COLUMNS``) plus ``positive_text`` (string) and ``positive_index`` (int32, the
        passage's index in the document; -1 when the document fell back to its groups' passages, and always -1 for
        crops). Uniform over the document's passages other than the group's anchor (SPEC "Random positives").
    """
    groups = batch.filter(batch.column("group_id").is_valid())
    lists = [p for p in batch.column("passages").to_pylist() if p is not None]
    if groups.num_rows == 0:  # a document of the input without groups
        return pa.table({**{c: pa.array([], ROW_SCHEMA.field(c).type) for c in GROUP_COLUMNS},
                         "positive_text": pa.array([], pa.string()), "positive_index": pa.array([], pa.int32())})
    col = {c: groups.column(c).to_pylist() for c in GROUP_COLUMNS}
    rows = list(zip(col["anchor_index"], col["anchor_text"], col["related_indices"], col["related_texts"]))
    passages = next((p for p in lists if all(agrees(p, *r) for r in rows)), None)
    fallback = passages is None
    if fallback:
        log.warning("random positives: document %r re-chunked from the input does not match its %d group(s) (%s); "
                    "its positives are drawn from the passages its groups hold", col["doc_id"][0], len(rows),
                    "not in the input" if not lists else "the input or the chunker changed since mining")
        held: dict[int, str] = {}
        for ai, at, ris, rts in rows:
            held[ai] = at
            held.update(zip(ris, rts))
        indices = sorted(held)
        texts = [held[i] for i in indices]
    else:
        indices, texts = list(range(len(passages))), passages
    chosen, chosen_index = [], []
    if mode == "crop":
        anchors = []
        for gid in col["group_id"]:
            a, p = crop_pair(texts, _rng(seed, gid))
            anchors.append(a)
            chosen.append(p)
        out = groups.select(list(GROUP_COLUMNS))
        out = out.set_column(out.schema.get_field_index("anchor_text"), "anchor_text", pa.array(anchors, pa.string()))
        return out.append_column("positive_text", pa.array(chosen, pa.string())) \
            .append_column("positive_index", pa.array([-1] * len(chosen), pa.int32()))
    for (ai, *_), gid in zip(rows, col["group_id"]):
        others = [k for k, i in enumerate(indices) if i != ai]  # at least the group's own related passages
        k = others[int(_rng(seed, gid).integers(len(others)))]
        chosen.append(texts[k])
        chosen_index.append(-1 if fallback else indices[k])
    return groups.select(list(GROUP_COLUMNS)).append_column("positive_text", pa.array(chosen, pa.string())) \
        .append_column("positive_index", pa.array(chosen_index, pa.int32()))


def check_inputs_unchanged(inputs: list[dict], storage) -> None:
    """Refuse a run whose input files are gone or changed since mining (their manifest records).

    Args:
        inputs: the manifest's ``inputs`` (path, size, fingerprint per file).
        storage: the :class:`~pairmine.operators.storage.Storage` to reach them with.

    Raises:
        InputError: a file is missing, its size differs, or (object storage) its single-part ETag differs. Local
            files are not hashed again here (that would read the whole corpus in the driver); a change that keeps
            the size shows as a document whose passages do not match (see :func:`draw_random_positives`).
    """
    from pairmine.pipeline.inputs import is_multipart_etag

    if not inputs:
        raise InputError("random positives need the run's input, and its manifest lists none")
    for rec in inputs:
        info = storage.info(rec["path"])
        if info is None:
            raise InputError(f"random positives re-chunk the run's input, and {rec['path']} is gone (it was mined "
                             "from there); restore it, or train with --positives xprt")
        size = int(info.get("size") or 0)
        etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
        fp = rec.get("fingerprint", "")
        if size != int(rec.get("size", size)) or (fp.startswith("etag:") and etag and not is_multipart_etag(fp)
                                                  and fp != "etag:" + etag):
            raise InputError(f"random positives re-chunk the run's input, and {rec['path']} changed since it was "
                             f"mined (size {size} bytes, was {rec.get('size')}); train with --positives xprt, or mine "
                             "it again")


def input_units(inputs: list[dict], storage) -> list[dict]:
    """Work units (``operators.read.UNIT_SCHEMA``) over the run's input files: one per parquet row group (from the
    file's footer), one per JSONL file. No duplicate rows are marked: a repeated id is resolved per document."""
    import pyarrow.parquet as pq

    from pairmine.operators.read import open_input

    units = []
    for k, rec in enumerate(inputs):
        groups = [-1]
        if rec["format"] == "parquet":
            def footer(path=rec["path"]) -> int:
                with open_input(path, storage) as f:
                    return pq.ParquetFile(f).metadata.num_row_groups

            groups = list(range(storage.retry("read", rec["path"], footer)))
        for rg in groups:
            units.append({"shard_index": int(rec.get("shard_index", k)), "path": rec["path"], "format": rec["format"],
                          "row_group": rg, "row_offset": 0, "duplicates": ""})
    return units


class _DocumentPassages:
    """Read + chunk over a batch of work units -> :data:`ROW_SCHEMA` document rows (skipped documents dropped)."""

    def __init__(self, input_cfg: dict, chunk_cfg: dict, token_limit, storage):
        from pairmine.operators.chunk import Chunker
        from pairmine.operators.read import ReadDocuments

        self.read = ReadDocuments(input_cfg.get("text_column", "text"), input_cfg.get("id_column", "id"),
                                  input_cfg.get("url_column", "url"), storage)
        self.chunk = Chunker(chunk_cfg.get("max_words", 120), chunk_cfg.get("min_words", 5),
                             chunk_cfg.get("max_passages", 256), token_limit,
                             int(chunk_cfg.get("max_chars", 0)))  # 0: a run mined before chunk.max_chars

    def __call__(self, units: pa.Table) -> pa.Table:
        docs = self.chunk(self.read(units))
        docs = docs.filter(docs.column("skip_reason").is_null())
        n = docs.num_rows
        return pa.table({"doc_id": docs.column("id"), "group_id": pa.nulls(n, pa.string()),
                         "anchor_index": pa.nulls(n, pa.int32()), "anchor_text": pa.nulls(n, pa.string()),
                         "related_indices": pa.nulls(n, ROW_SCHEMA.field("related_indices").type),
                         "related_texts": pa.nulls(n, ROW_SCHEMA.field("related_texts").type),
                         "passages": docs.column("passages")}, schema=ROW_SCHEMA)


def _group_rows(batch: pa.Table) -> pa.Table:
    t = batch.select(list(GROUP_COLUMNS))
    return pa.table({**{c: t.column(c).cast(ROW_SCHEMA.field(c).type) for c in GROUP_COLUMNS},
                     "passages": pa.nulls(t.num_rows, ROW_SCHEMA.field("passages").type)}).select(ROW_SCHEMA.names)


def with_random_positives(groups_ds, manifest: dict, storage, seed: int, num_partitions: int, mode: str = "random",
                          num_cpus: float = 1.0):
    """The groups dataset with a ``positive_text`` drawn from all passages of each group's document (``mode``
    "random"), or with its anchor and positive replaced by two random spans of the document (``mode`` "crop",
    :func:`crop_pair`).

    Args:
        groups_ds: a Ray Dataset of the run's groups (at least ``GROUP_COLUMNS``).
        manifest: the run's ``manifest.json`` (its ``inputs`` and ``config``: input columns, chunk settings).
        storage: the storage layer to read the input with.
        seed: ``train.seed``.
        num_partitions: partitions of the shuffle by document id.
        num_cpus: CPUs each of these Ray Data tasks reserves (``scaling.data_cpus`` in training).

    Returns:
        a Ray Dataset of ``GROUP_COLUMNS`` + ``positive_text`` + ``positive_index``, one row per group.

    Raises:
        InputError: see :func:`check_inputs_unchanged`.
    """
    import ray.data

    from pairmine.pipeline.config import run_token_limit

    inputs = manifest.get("inputs") or []
    check_inputs_unchanged(inputs, storage)
    config = manifest.get("config") or {}
    input_cfg, chunk_cfg = config.get("input") or {}, config.get("chunk") or {}
    units = input_units(inputs, storage)
    docs = ray.data.from_items(units, override_num_blocks=max(1, len(units))).map_batches(
        _DocumentPassages(input_cfg, chunk_cfg, run_token_limit(manifest), storage), batch_size=1,
        batch_format="pyarrow", num_cpus=num_cpus)
    rows = groups_ds.map_batches(_group_rows, batch_format="pyarrow", num_cpus=num_cpus).union(docs)
    return rows.groupby("doc_id", num_partitions=num_partitions).map_groups(
        lambda b: draw_random_positives(b, seed, mode), batch_format="pyarrow", num_cpus=num_cpus)
