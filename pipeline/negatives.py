"""``pairmine negatives``: hard negatives for training pairs, searched in a corpus with faiss, optionally scored once
by a cross-encoder teacher (seed 004, chapter 3: E5's second stage; SPEC "Hard negatives and distillation").

    plan     the pairs: a ``pairmine mine`` run (anchor -> s1, with its document id), a ``filter-pairs`` run, or any
             parquet/JSONL of (query, passage); the corpus: documents chunked like mine's input, or a mine run's
             input chunked with that run's settings
    corpus   every distinct corpus passage (exact repeats dropped before embedding: :class:`_ChunkCorpus`,
             ``negatives.dedupe_corpus``) is chunked and embedded with the pairs' embedder (same model, passage prefix,
             dtype; a mine run's own embed settings unless embed.model is set) in a Ray Data pass whose blocks stay
             in Ray's object store, and indexed with faiss by Ray tasks in ``negatives.index_shards`` shards (equal
             passage ranges; exact IndexFlatIP by default, IVF or HNSW as options with their recall@depth against
             exact search measured on probe passages and logged); the driver holds object refs and counts only.
             The same pass embeds the queries of the pairs left to search (query prefix) when the index is one shard
             and their vectors fit one shard's memory (:func:`queries_with_corpus`): the pairs pass then takes every
             query's vector, and every positive's found in the corpus, from the shard, and loads no model
    read -> embed (query prefix / passage prefix) -> search (one actor per index shard, each holding its shard; the
             candidate lists merged exactly; an exact shard on a GPU plan is searched with torch on the GPU) ->
             select (rank window; in the search actor itself when the index is one shard, so that a pair's
             candidate lists, depth texts, never pass through Ray's object store) -> [teacher] -> write (staging)
    commit   one part per input shard as soon as its pairs are written (pipeline.run_folder: a killed run re-run
             with its --run-id keeps committed shards and completed row groups, and searches only the rest; the
             corpus is embedded and indexed again), then stats.json (drop reasons counted), manifest.json, _SUCCESS

Run folder layout: ``negatives/part-NNNNN.parquet`` (``operators.negatives.NEGATIVES_SCHEMA``), ``stats.json``,
``manifest.json``, ``_SUCCESS``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import time
from collections import Counter
from functools import partial

import numpy as np
import pyarrow as pa

from pairmine.operators.read import InputError
from pairmine.pipeline.config import ConfigError, NegativesConfig, run_chunk_spec
from pairmine.pipeline.inputs import PoolSpec, Shard, check_parquet_shards, discover_shards, scan_shard
from pairmine.pipeline.mine import (
    EMBED_CALL_PASSAGES, MineResult, Progress, _load_pool, _shard_dict, check_model, model_id,
    new_run_id, result_config,
)
from pairmine.pipeline.provenance import SUCCESS_MARKER, software_versions
from pairmine.pipeline.ray_adapter import (
    Stage, configure_data, init_ray, plan_for, run_remote, stage_figures, timing_lines,
)
from pairmine.pipeline.run_folder import RUN_DATA, Parts, RunFolder, run_kind, unit_key, wrong_kind

log = logging.getLogger("pairmine")

ALL_PASSAGES = 1 << 62  # a "pool" as large as the corpus: every passage of every usable document


def _run_manifest(path: str, storage) -> dict | None:
    """The manifest of a committed pairmine run folder at ``path``, or None when ``path`` is not one."""
    path = path.rstrip("/")
    if (storage.info(path) or {}).get("type") != "directory":
        return None
    if not storage.exists(f"{path}/{SUCCESS_MARKER}") or not storage.exists(f"{path}/manifest.json"):
        return None
    return json.loads(storage.read_bytes(f"{path}/manifest.json"))


def _run_folder(path: str, flag: str, storage) -> tuple[str, dict | None]:
    """``path`` as ``--input``/``--corpus`` means it: (the path, with a committed run's data folder (``groups/``,
    ``pairs/``) replaced by its run folder; the run's manifest, or None when it is not a committed run).

    Raises:
        InputError: ``path`` is a folder of run folders (one of them was meant), or a run without ``_SUCCESS``.
    """
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    manifest = _run_manifest(parent, storage) if name in RUN_DATA.values() and parent else None
    if manifest is not None:
        log.info("%s %s is the data folder of run %s: reading that run", flag, path, parent)
        return parent, manifest
    _refuse_uncommitted(path, flag, storage)
    manifest = _run_manifest(path, storage)
    if manifest is None and (storage.info(path) or {}).get("type") == "directory":
        folders = [c.rstrip("/") for c in storage.ls(path) if "." not in c.rstrip("/").rsplit("/", 1)[-1]][:50]
        runs = [c for c in folders  # (data files have a suffix)
                if storage.exists(f"{c}/{SUCCESS_MARKER}") and storage.exists(f"{c}/manifest.json")]
        if runs:
            raise InputError(f"{flag} {path} holds {len(runs)} pairmine run folder(s) ({runs[0]}, ...): give one of "
                             "them")
    return path, manifest


def _refuse_uncommitted(path: str, flag: str, storage) -> None:
    """A pairmine run folder (``groups/``, ``pairs/`` or ``negatives/`` inside) without ``_SUCCESS`` is an unfinished
    run: refused with that said, rather than read as a folder of data files. Raises InputError."""
    if (storage.info(path) or {}).get("type") != "directory" or storage.exists(f"{path}/{SUCCESS_MARKER}"):
        return
    for folder in RUN_DATA.values():
        if storage.exists(f"{path}/{folder}"):
            raise InputError(f"{flag} {path} is a pairmine run folder without {SUCCESS_MARKER}: the run is not "
                             "complete; finish it (the same command with its --run-id) or give a committed run")


def _layout(shard: Shard, storage, columns: tuple[str, str, str] | None = None) -> list[int]:
    """Rows per parquet row group of a shard (one entry for JSONL, counted by reading it). With ``columns``
    (query, passage, pair id), a JSONL file of pairs is decoded as the read stage will decode it, so that a
    record of the wrong type is refused here, before any work (parquet types are checked from the footers)."""
    import pyarrow.parquet as pq

    from pairmine.operators.pairs import read_pair_columns
    from pairmine.operators.read import open_input, read_jsonl_records

    if shard.format != "parquet":
        if columns is not None:
            return [len(read_pair_columns(shard.path, "jsonl", -1, *columns, storage)[0])]
        return [len(read_jsonl_records(shard.path, storage))]

    def footer():
        with open_input(shard.path, storage) as f:
            meta = pq.ParquetFile(f).metadata
            return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    return storage.retry("read", shard.path, footer)


def resolve_input(cfg: NegativesConfig, storage) -> tuple[str, list[Shard]]:
    """What ``--input`` is and its shards: ("groups", a mine run's parts), ("pairs", a filter-pairs run's parts: its
    query/passage/pair_id columns) or ("pairs", plain parquet/JSONL with [input] query/passage/pair_id columns).
    A mine run's embed settings become the config's when ``embed.model`` is not set (same model, prefixes, dtype).

    Raises:
        ConfigError: no --input. FileNotFoundError, InputError, MissingColumnError: as :func:`discover_shards`.
    """
    if not cfg.input.path:
        raise ConfigError("negatives needs --input: a pairmine mine run, a filter-pairs run, or parquet/JSONL pairs")
    root, run = _run_folder(cfg.input.path, "--input", storage)
    kind = run_kind(root, run, storage) if run is not None else None
    if run is not None and kind not in ("mine", "filter-pairs"):
        raise InputError(wrong_kind(root, kind, "mine or filter-pairs",
                                    "give a mine run, a filter-pairs run, or parquet/JSONL (query, passage) pairs"))
    if run is not None:
        embed = (run.get("config") or {}).get("embed") or {}
        if not cfg.embed.model and "model" in embed:  # the run's model, also when it is the default one ("")
            for key in ("model", "passage_prefix", "query_prefix", "max_length", "dtype", "trust_remote_code"):
                if key in embed:
                    cfg.set(f"embed.{key}", embed[key])
            log.info("embedding with the input run's own embed settings: %s", embed["model"] or "the default model")
    if run is not None and storage.exists(f"{root}/groups"):
        shards = discover_shards(f"{root}/groups", "parquet", storage)
        check_parquet_shards(shards, ("anchor_text", "group_id", "doc_id"), storage)
        return "groups", shards
    if run is not None and storage.exists(f"{root}/pairs"):
        cfg.input.query_column, cfg.input.passage_column, cfg.input.pair_id_column = "query", "passage", "pair_id"
        root = f"{root}/pairs"
    shards = discover_shards(root, cfg.input.format, storage)
    check_parquet_shards(shards, (cfg.input.query_column, cfg.input.passage_column), storage,
                         text_columns=(cfg.input.query_column, cfg.input.passage_column))
    return "pairs", shards


def resolve_corpus(cfg: NegativesConfig, storage) -> tuple[list[Shard], str, str, PoolSpec]:
    """The corpus documents: (shards, text column, id column, chunking as a PoolSpec that takes every passage).
    A mine run folder stands for its input, chunked with that run's settings.

    Raises:
        ConfigError: no corpus. FileNotFoundError: the corpus does not exist.
    """
    n = cfg.negatives
    if not n.corpus:
        raise ConfigError("negatives needs --corpus: documents (parquet/JSONL) or a pairmine mine run folder")
    corpus, run = _run_folder(n.corpus, "--corpus", storage)
    kind = run_kind(corpus, run, storage) if run is not None else None
    if run is not None and kind != "mine":
        raise InputError(wrong_kind(corpus, kind, "mine",
                                    "give a mine run (its input is the corpus) or a folder of documents"))
    if run is not None and run.get("inputs"):
        config = run.get("config") or {}
        ic = config.get("input") or {}
        shards = [Shard(index=i, path=r["path"], format=r["format"], size=int(r.get("size", 0)),
                        fingerprint=r.get("fingerprint", "")) for i, r in enumerate(run["inputs"])]
        spec = PoolSpec(ALL_PASSAGES, 0, 1.0, 0, run_chunk_spec(run))
        return shards, ic.get("text_column", "text"), ic.get("id_column", "id"), spec
    try:
        shards = discover_shards(corpus, "auto", storage)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"negatives.corpus (--corpus): {e}") from None
    check_parquet_shards(shards, (cfg.input.text_column, cfg.input.id_column), storage)
    spec = PoolSpec(ALL_PASSAGES, 0, 1.0, 0, cfg.chunk_spec())
    return shards, cfg.input.text_column, cfg.input.id_column, spec


def build_index(vectors: np.ndarray, kind: str, nprobe: int = 32, ef_search: int = 256):
    """A faiss inner-product index over ``vectors`` (N, dim) float32, unit-normalised (so scores are cosines).

    ``flat``: exact (IndexFlatIP). ``ivf``: IndexIVFFlat with nlist = 4 sqrt(N) (faiss's rule of thumb, at least 1,
    at most N / 39 so that every list trains on 39 points), ``nprobe`` lists searched. ``hnsw``: IndexHNSWFlat, M 32,
    ``efSearch`` = ef_search. Fewer than 2 vectors: exact, whatever ``kind`` (the description says so).

    Returns:
        (index, description in words: "exact ..." or "approximate ...").
    """
    import faiss

    n, dim = vectors.shape
    if kind == "flat" or n < 2:
        index = faiss.IndexFlatIP(dim)
        index.add(vectors)
        return index, "exact (faiss IndexFlatIP)" + ("" if kind == "flat" else
                                                      f"; negatives.index = {kind} needs 2 or more passages a shard")
    if kind == "ivf":
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.add(vectors)
        index.nprobe = min(nprobe, nlist)
        return index, f"approximate (faiss IndexIVFFlat, nlist {nlist}, nprobe {index.nprobe})"
    index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efSearch = ef_search
    index.add(vectors)
    return index, f"approximate (faiss IndexHNSWFlat, M 32, efSearch {ef_search})"


def measure_recall(index, vectors: np.ndarray, depth: int, probes: int, seed: int = 0) -> float:
    """recall@depth of ``index`` against exact search: the share of the exact top ``depth`` that ``index`` also
    returns, averaged over ``probes`` corpus vectors used as queries (seeded)."""
    import faiss

    n, dim = vectors.shape
    depth = min(depth, n)
    rows = np.random.default_rng(seed).choice(n, size=min(probes, n), replace=False)
    queries = np.ascontiguousarray(vectors[rows])
    exact = faiss.IndexFlatIP(dim)
    exact.add(vectors)
    _, truth = exact.search(queries, depth)
    _, found = index.search(queries, depth)
    return float(np.mean([len(set(t.tolist()) & set(f.tolist())) / depth for t, f in zip(truth, found)]))


def _make_read(cfg: NegativesConfig, kind: str):
    from pairmine.operators.negatives import ReadGroupPairs
    from pairmine.operators.pairs import ReadPairs

    if kind == "groups":
        return ReadGroupPairs(cfg.storage_layer())
    return ReadPairs(cfg.input.query_column, cfg.input.passage_column, cfg.input.pair_id_column, cfg.storage_layer())


def _make_embed(cfg: NegativesConfig, threads: int, device: str, known_ref=None):
    from pairmine.operators.negatives import EmbedPairVectors

    e = cfg.embed
    known = partial(_load_pool, known_ref) if known_ref is not None else None  # zero-copy (keys, rows, vectors)
    return EmbedPairVectors(cfg.resolved_query_prefix(), known, model=e.model, passage_prefix=cfg.resolved_prefix(),
                            max_length=e.max_length, batch_size=e.batch_size, dtype=e.dtype, device=device,
                            threads=threads, trust_remote_code=e.trust_remote_code)


def _make_corpus_embed(cfg: NegativesConfig, threads: int, device: str):
    from pairmine.operators.negatives import EmbedCorpus

    e = cfg.embed
    return EmbedCorpus(cfg.resolved_query_prefix(), model=e.model, passage_prefix=cfg.resolved_prefix(),
                       max_length=e.max_length, batch_size=e.batch_size, dtype=e.dtype, device=device,
                       threads=threads, trust_remote_code=e.trust_remote_code)


def _make_search(shard_ref, offset: int, cfg: NegativesConfig, threads: int, device: str):
    from pairmine.operators.negatives import SearchShard

    return SearchShard(partial(_load_pool, shard_ref), offset, cfg.negatives.depth, threads, device)


def _make_select(cfg: NegativesConfig):
    from pairmine.operators.negatives import SelectNegatives

    n = cfg.negatives
    return SelectNegatives(n.rank_start, n.rank_end, n.count, n.margin, n.relative_margin)


def _make_search_select(shard_ref, cfg: NegativesConfig, threads: int, device: str):
    from pairmine.operators.negatives import SearchAndSelect

    return SearchAndSelect(_make_search(shard_ref, 0, cfg, threads, device), _make_select(cfg))


class _ChunkCorpus:
    """Chunk operator of the corpus pass: a batch of items -> rows of up to ``per_row`` texts (``passages``
    list<string>, ``hashes`` list<int64>, ``query_rows`` bool, ``skipped``: on a corpus shard's first row, JSON of its
    documents skipped by reason, ``{"empty_text": 2, "no_passage": 1}``, else "", ``positives`` list<string>: on a
    query unit's first row, its pairs' distinct positives, else empty). An item ``{"shard": i, "unit": -1}`` gives
    every usable passage of corpus shard i (:func:`pipeline.inputs.scan_shard` with a pool as large as the corpus;
    hashes: of each passage's document id); ``{"shard": -1, "unit": j}`` gives the distinct queries of the usable
    pairs of work unit ``units[j]``, read by the pairs pass's own read operator (``make_read()``), as query rows
    (hashes 0), so that the corpus pass embeds them (and finds the positives' lookup forms) and the pairs pass loads
    no model."""

    per_row = EMBED_CALL_PASSAGES

    def __init__(self, shards: list[Shard], text_column: str, id_column: str, spec: PoolSpec, storage,
                 units: list[dict] | None = None, make_read=None, dedupe: list | None = None):
        self.shards, self.text_column, self.id_column, self.spec, self.storage = (shards, text_column, id_column,
                                                                                  spec, storage)
        self.units, self.make_read, self.dedupe = units or [], make_read, dedupe or []

    def _first_copies(self, texts: list[str], hashes: list[int]) -> tuple[list[str], list[int]]:
        """The passages whose text no chunk task has claimed before (``dedupe``: the
        :class:`operators.negatives.PassageKeys` actors, one per key range)."""
        first = ask_key_ranges(self.dedupe, "claim", texts, np.asarray(hashes, np.int64),
                               out=np.zeros(len(texts), bool))
        return [t for t, f in zip(texts, first) if f], [h for h, f in zip(hashes, first) if f]

    def _queries(self, unit: dict) -> tuple[list[str], list[str]]:
        """The distinct queries and the distinct positives of the unit's usable pairs."""
        import pyarrow.compute as pc

        pairs = self.make_read()(pa.Table.from_pylist([unit]))
        usable = pairs.filter(pc.is_null(pairs.column("skip_reason")))
        return (list(dict.fromkeys(usable.column("query").to_pylist())),
                list(dict.fromkeys(usable.column("passage").to_pylist())))

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows: list[tuple[list[str], list[int], bool, str, list[str]]] = []
        for i, j in zip(batch.column("shard").to_pylist(), batch.column("unit").to_pylist()):
            skipped, positives = "", []
            if i >= 0:
                scan = scan_shard(self.shards[i], self.text_column, self.id_column, 0, 0, 1.0, self.spec,
                                  self.storage)
                texts, hashes = [p for _, _, p in scan.pool], [h for _, h, _ in scan.pool]
                skipped = json.dumps(scan.skipped) if scan.skipped else ""
                if self.dedupe and texts:
                    texts, hashes = self._first_copies(texts, hashes)
            else:
                texts, positives = self._queries(self.units[j])
                hashes = [0] * len(texts)
            # The shard's skipped documents ride on its first row (a row without passages when it has none), as do
            # a unit's positives.
            for k in range(0, max(len(texts), 1 if skipped else 0), self.per_row):
                rows.append((texts[k:k + self.per_row], hashes[k:k + self.per_row], i < 0,
                             skipped if k == 0 else "", positives if k == 0 else []))
        return pa.table({"passages": pa.array([r[0] for r in rows], pa.list_(pa.string())),
                         "hashes": pa.array([r[1] for r in rows], pa.list_(pa.int64())),
                         "query_rows": pa.array([r[2] for r in rows], pa.bool_()),
                         "skipped": pa.array([r[3] for r in rows], pa.string()),
                         "positives": pa.array([r[4] for r in rows], pa.list_(pa.string()))})


def ask_key_ranges(actors: list, method: str, texts: list[str], *arrays: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Call ``method`` of the :class:`operators.negatives.PassageKeys` actors, each with the text keys
    (:func:`operators.embed.text_keys`) of its key range (``key % len(actors)``) and the same rows of ``arrays``,
    all at once; their (rows,) answers are written into ``out`` (n,) at those rows, which is returned."""
    import ray

    from pairmine.operators.embed import text_keys

    keys = text_keys(texts)
    part = keys % len(actors)
    calls = [(idx, getattr(actor, method).remote(keys[idx], *(a[idx] for a in arrays)))
             for k, actor in enumerate(actors) if len(idx := np.flatnonzero(part == k))]
    for idx, ref in calls:
        out[idx] = ray.get(ref)
    return out


def _rows_of(block: pa.Table, queries: bool) -> pa.Table:
    """The corpus rows (``queries`` False) or the query rows (True) of an embedded corpus-pass block."""
    import pyarrow.compute as pc

    flags = block.column("query_rows")
    return block.filter(flags if queries else pc.invert(flags))


def build_index_shard(kind: str, nprobe: int, ef_search: int, depth: int, probes: int, known_prefix: str | None,
                      query_prefix: str, dedupe: list | None, slices: list[tuple[int, int]], *blocks: pa.Table):
    """One shard of the corpus index, built from slices of embedded corpus blocks (rows of ``passages``, ``hashes``,
    ``vectors``, ``query_rows``; ``slices[i]`` = (first passage, end passage) of the corpus rows of ``blocks[i]``),
    run as a Ray task next to the blocks so that no corpus passage passes through the driver. Blocks after the
    first ``len(slices)`` hold query rows only; query rows are never indexed. With ``dedupe`` (the corpus pass's
    :class:`operators.negatives.PassageKeys` actors), each passage's document is the smallest document hash among
    its copies.

    Returns:
        three values (the task's three ObjectRefs): the shard as :class:`operators.negatives.SearchShard` loads it
        (index bytes, text hashes (n,), document hashes (n,), texts); ``{"passages": n, "index": description,
        "recall": recall@depth of the shard's index against exact search of the shard, or None}``; and with
        ``known_prefix`` not None, the shard's vectors as an Embedder's ``known`` lookup (keys of ``known_prefix``
        + text) together with the query rows' vectors of every block given (keys of ``query_prefix`` + text) and
        the query rows' aliases (``alias_keys`` -> ``alias_targets``, :class:`operators.negatives.EmbedCorpus`),
        else None.
    """
    import faiss

    from pairmine.operators.embed import known_vectors, vector_matrix
    from pairmine.operators.negatives import text_hash

    mats, texts, hashes = [], [], []
    for (lo, hi), block in zip(slices, blocks):
        block = _rows_of(block, queries=False)
        matrix, _ = vector_matrix(block.column("vectors"))  # (passages of the block, dim)
        mats.append(matrix[lo:hi])
        texts.extend(block.column("passages").combine_chunks().flatten()[lo:hi].to_pylist())
        hashes.append(block.column("hashes").combine_chunks().flatten()[lo:hi].to_numpy(zero_copy_only=False))
    vectors = np.ascontiguousarray(np.concatenate(mats), np.float32)  # (n, dim)
    doc_hashes = np.concatenate(hashes).astype(np.int64)
    if dedupe:
        doc_hashes = ask_key_ranges(dedupe, "documents", texts, out=doc_hashes)
    index, desc = build_index(vectors, kind, nprobe, ef_search)
    recall = measure_recall(index, vectors, depth, probes) if desc.startswith("approximate") else None
    shard = (faiss.serialize_index(index), np.array([text_hash(t) for t in texts], np.int64), doc_hashes,
             pa.array(texts, pa.string()))
    known = None
    if known_prefix is not None:
        keys, mats, aliases = [known_prefix + t for t in texts], [vectors], []
        for block in blocks:
            queries = _rows_of(block, queries=True)
            if queries.num_rows:
                mats.append(vector_matrix(queries.column("vectors"))[0])
                keys += [query_prefix + t for t in queries.column("passages").combine_chunks().flatten().to_pylist()]
                aliases += zip(queries.column("alias_keys").combine_chunks().flatten().to_pylist(),
                               queries.column("alias_targets").combine_chunks().flatten().to_pylist())
        known = known_vectors(keys, np.concatenate(mats) if len(mats) > 1 else vectors, aliases)
    return shard, {"passages": len(texts), "index": desc, "recall": recall}, known


def split_passages(counts: list[int], shards: int) -> list[list[tuple[int, int, int]]]:
    """Contiguous, equal ranges of the corpus's passages (within one passage), one per index shard, as slices of its
    embedded blocks: per shard ``[(block position, first passage, end passage), ...]``. Shards are never empty
    (fewer shards when there are fewer passages). ``split_passages([5, 5], 3) == [[(0, 0, 3)], [(0, 3, 5), (1, 0, 1)],
    [(1, 1, 5)]]``.

    Args:
        counts: passages per embedded block, in corpus order.
        shards: shards wanted (>= 1).
    """
    total = sum(counts)
    shards = max(1, min(shards, total))
    bounds = [total * k // shards for k in range(shards + 1)]  # (shards + 1,) global passage offsets
    starts = np.cumsum([0] + list(counts))
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = [(i, max(lo, int(starts[i])) - int(starts[i]), min(hi, int(starts[i + 1])) - int(starts[i]))
                for i in range(len(counts)) if starts[i] < hi and starts[i + 1] > lo]
        out.append(part)
    return out


def _passages_in_block(block) -> tuple[int, int, dict]:
    """(corpus passages, queries, corpus documents skipped by reason) in one embedded corpus-pass block (rows of up
    to ``_ChunkCorpus.per_row``)."""
    import pyarrow.compute as pc

    corpus, queries = (int(pc.sum(pc.list_value_length(_rows_of(block, q).column("passages"))).as_py() or 0)
                       for q in (False, True))
    skipped: Counter = Counter()
    for text in block.column("skipped").to_pylist():
        skipped.update(json.loads(text) if text else {})
    return corpus, queries, dict(skipped)


def _make_teacher(cfg: NegativesConfig, device: str, threads: int):
    from pairmine.operators.negatives import TeacherScores

    n = cfg.negatives
    return TeacherScores(n.teacher, n.teacher_max_length, n.teacher_batch_size, device, threads)


def _make_write(staging: str, run_id: str, model: str, teacher: str, storage):
    from pairmine.operators.negatives import NegativesWriter

    return NegativesWriter(staging, run_id, model, teacher, storage)


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def _checkpoint_keys(path: str) -> set[str] | None:
    """The names of the weights a local model folder stores, read without loading a tensor (a sharded checkpoint's
    index, or model.safetensors' header); None when they cannot be listed so (a hub id, a single .bin file)."""
    if not os.path.isdir(path):
        return None
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index), encoding="utf-8") as f:
                return set(json.load(f).get("weight_map") or {})
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            return set(f.keys())
    return None


def _missing_head_weights(path: str, config) -> list[str]:
    """The weights of the teacher's sequence-classification head (those outside its base model) that its checkpoint
    does not store, sorted. The model is built on torch's meta device (no memory for weights) and its head's names
    are looked up in the checkpoint's key list (:func:`_checkpoint_keys`); where that list cannot be read, the
    teacher is loaded once on the CPU and transformers' own list of missing weights is used.

    Raises:
        ConfigError: the teacher cannot be loaded."""
    import torch
    from transformers import AutoModelForSequenceClassification

    stored = _checkpoint_keys(os.path.expanduser(path))
    try:
        if stored is not None:
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config)
            base = model.base_model_prefix + "."
            return sorted(k for k in model.state_dict() if not k.startswith(base) and k not in stored)
        _, loading = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
    except Exception as e:  # transformers raises OSError/ValueError/HF errors depending on the cause
        raise ConfigError(f"negatives.teacher = {path!r} cannot be loaded: {_first_line(e)}") from None
    return sorted(loading.get("missing_keys") or [])


def check_teacher(path: str) -> None:
    """Fail before any work when the teacher cannot be found, is not a one-logit cross-encoder (its config), or its
    checkpoint lacks weights of the model (an encoder saved with ``num_labels = 1`` has no trained classification
    head: transformers starts one at random and only logs it): :func:`_missing_head_weights`.

    Raises:
        ConfigError: naming negatives.teacher.
    """
    import os

    from transformers import AutoConfig

    if (path.startswith((".", "/", "~")) or os.sep in path and path.count("/") != 1) and not os.path.exists(
            os.path.expanduser(path)):
        raise ConfigError(f"negatives.teacher = {path!r} does not exist (a local folder, or a hub id in the local "
                          "Hugging Face cache)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/HF errors depending on the cause
        raise ConfigError(f"negatives.teacher = {path!r} cannot be loaded: {_first_line(e)}") from None
    if getattr(config, "num_labels", 1) != 1:
        raise ConfigError(f"negatives.teacher = {path!r} has {config.num_labels} outputs; a cross-encoder teacher gives "
                          "one relevance logit per (query, passage) pair")
    missing = _missing_head_weights(path, config)
    if missing:
        raise ConfigError(f"negatives.teacher = {path!r} lacks trained weights for {', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''} (transformers would start them at random, and "
                          "every teacher score would be noise): give a trained cross-encoder, not an encoder")


def build_corpus_index(cfg: NegativesConfig, corpus_shards: list[Shard], text_column: str, id_column: str,
                       spec: PoolSpec, threads: int, device: str, actors: int, embed_cpus: float, embed_gpus: float,
                       light: float, figures_out: list | None = None, query_units: list[dict] | None = None,
                       make_read=None, skipped_out: dict | None = None) -> list[dict]:
    """Chunk and embed the corpus on Ray and build its index in ``negatives.index_shards`` shards (0: as many as
    ``negatives.index_shard_mb`` of embedded blocks per shard asks), each by a Ray task from the embedded blocks;
    the driver holds only object refs and per-shard counts, so the corpus may be larger than its memory (Ray's
    object store spills to disk). With ``figures_out``, the corpus pass's per-stage figures
    (:func:`pipeline.ray_adapter.stage_figures`, stages named "corpus: ...") are appended to it. With
    ``query_units`` (work units of pairs) and ``make_read`` (their read operator's factory), the same pass embeds
    those pairs' queries with the query prefix; with one shard they join its ``known`` lookup, so that the pairs
    pass embeds no query (with several they are not used). With ``skipped_out``, the corpus documents skipped are
    counted into it by reason (the read stage's: null_text, empty_text, null_id, ...; "no_passage": usable, but no
    passage came of its chunking).

    Returns:
        per shard, in corpus-row order (none for a corpus without a usable passage): ``{"ref": ObjectRef of the
        shard (index, hashes, texts), "offset": its first global corpus row, "passages", "index": description,
        "recall", "memory": bytes an actor holding it needs, "duplicates": corpus passages dropped as exact copies of
        another (``negatives.dedupe_corpus``; the same figure in every shard's dict),
        "known": ObjectRef of the shard's ``known`` lookup (one shard only: its passages and the queries) or None,
        "queries": queries embedded}``.

    Raises:
        StallError: the corpus pass stopped making progress (``ray.stall_limit_s``).
    """
    import ray

    from pairmine.pipeline.ray_adapter import PROGRESS_EVERY_S, apply_stage, iter_block_refs, submit, watched

    n = cfg.negatives
    from pairmine.operators.negatives import PassageKeys

    query_units = query_units or []
    dedupe = []
    if n.dedupe_corpus:  # the set of passages seen, one actor per GiB of corpus input (its key range)
        keys_actor = ray.remote(num_cpus=0)(PassageKeys)
        dedupe = [keys_actor.remote() for _ in range(max(1, math.ceil(sum(s.size for s in corpus_shards) / 2 ** 30)))]
    chunk = Stage("chunk_corpus", partial(_ChunkCorpus, corpus_shards, text_column, id_column, spec,
                                          cfg.storage_layer(), query_units, make_read, dedupe), batch_size=1,
                  num_cpus=light)
    embed = Stage("embed", partial(_make_corpus_embed, cfg, threads, device), batch_size=1, actors=actors,
                  num_cpus=embed_cpus, num_gpus=embed_gpus)
    items = [{"shard": i, "unit": -1} for i in range(len(corpus_shards))] + [
        {"shard": -1, "unit": j} for j in range(len(query_units))]  # the corpus first, then the pairs' queries
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = apply_stage(apply_stage(ds, chunk), embed)
    blocks: list[tuple] = []

    def done() -> str:
        rows = sum(r for _, r, _ in blocks)
        return f"{rows} corpus batch{'' if rows == 1 else 'es'} of up to {_ChunkCorpus.per_row} passages embedded"

    counting = []  # each block's counts, asked for as it comes (on a core the embed actors leave free)
    count = ray.remote(_passages_in_block).options(num_cpus=light)  # exported once
    for item in watched(iter_block_refs(ds), [chunk, embed], done, cfg.ray.stall_warn_s, cfg.ray.stall_limit_s,
                        every_s=PROGRESS_EVERY_S, label="corpus"):
        blocks.append(item)
        if item[1] > 0:
            counting.append(count.remote(item[0]))
    if figures_out is not None:
        figures_out.extend(stage_figures(ds, "corpus: "))
    blocks = [b for b in blocks if b[1] > 0]
    total = sum(size for _, _, size in blocks)
    wanted = n.index_shards or max(1, math.ceil(total / (n.index_shard_mb * 2 ** 20)))
    both = ray.get(counting)
    counts, queries = [c for c, _, _ in both], sum(q for _, q, _ in both)
    if skipped_out is not None:
        skipped_out.update(sum((Counter(s) for _, _, s in both), Counter()))
    if queries and wanted > 1:
        log.info("the index is sharded: the %d queries embedded with the corpus are not used (the pairs pass embeds "
                 "them)", queries)
    built = []
    for part in split_passages(counts, wanted) if sum(counts) else []:
        # With one shard its task also takes the blocks that hold only queries, for the known lookup.
        extra = [i for i, (c, q, _) in enumerate(both) if q and not c] if wanted == 1 else []
        refs = submit(build_index_shard, [(n.index, n.nprobe, n.ef_search, n.depth, n.recall_probes,
                                           cfg.resolved_prefix() if wanted == 1 else None,
                                           cfg.resolved_query_prefix(), dedupe, [(lo, hi) for _, lo, hi in part],
                                           *[blocks[i][0] for i, _, _ in part], *[blocks[i][0] for i in extra])],
                      num_returns=3)[0]
        share = sum((hi - lo) / max(counts[i], 1) * blocks[i][2] for i, lo, hi in part)  # bytes of the slices
        built.append((refs, int(share)))
    blocks.clear()  # the tasks hold the blocks they need; the rest can leave the object store
    del ds
    infos = ray.get([refs[1] for refs, _ in built])
    duplicates = sum(d for _, d in ray.get([a.count.remote() for a in dedupe]))
    for actor in dedupe:
        ray.kill(actor)
    shards, offset = [], 0
    for (refs, size), info in zip(built, infos):
        shards.append({"ref": refs[0], "offset": offset, "memory": 2 * size, "known": refs[2],
                       "queries": queries if wanted == 1 else 0, "duplicates": duplicates, **info})
        offset += info["passages"]
    if len(shards) != wanted:
        log.info("negatives.index_shards: %d asked, %d built (one per corpus passage at most)", wanted, len(shards))
    return shards


def model_dim(cfg: NegativesConfig) -> int:
    """The embedding model's vector size, from its config (``hidden_size``; 1024 when the config does not say). A
    local model folder's ``config.json`` that states ``hidden_size`` is read as JSON (importing transformers for it
    cost the driver 2.9 s); any other config goes through transformers' AutoConfig, which also knows the other names
    of the size (DistilBERT's ``dim``, T5's ``d_model``) and each model type's default."""
    from pairmine.operators.embed import default_model_path

    path = cfg.embed.model or default_model_path()
    local = os.path.join(path, "config.json")
    if os.path.isfile(local):
        with open(local, encoding="utf-8") as f:
            size = json.load(f).get("hidden_size")
        if isinstance(size, int) and size > 0:
            return size
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.embed.trust_remote_code)
    return int(getattr(config, "hidden_size", 0) or 1024)


def queries_with_corpus(cfg: NegativesConfig, kind: str, pairs: int) -> bool:
    """Whether the corpus pass embeds the queries of the ``pairs`` pairs left to search as well, so that the pairs
    pass takes every query vector (and every positive found in the corpus) from the index shard's ``known`` lookup and
    starts no model of its own: when the index may be one shard (``negatives.index_shards`` 0 or 1; with several,
    vectors are not looked up) and the queries' vectors fit the memory of one shard (``pairs x 4 x dim`` bytes at most
    ``negatives.index_shard_mb``). Not for a mine run's groups (``kind`` "groups") when the query and passage prefixes
    are equal: its queries are anchors, passages of the mined documents, already in the corpus when it is that run.
    Otherwise the pairs pass embeds them, batch by batch."""
    n = cfg.negatives
    if kind == "groups" and cfg.resolved_query_prefix() == cfg.resolved_prefix():
        return False
    return 0 < pairs and n.index_shards <= 1 and pairs * 4 * model_dim(cfg) <= n.index_shard_mb * 2 ** 20


def negatives(cfg: NegativesConfig) -> MineResult:
    """Mine hard negatives with a validated config; returns the run folder and its stats.

    Exactly once, with mine's run lifecycle (:mod:`pipeline.run_folder`): each work unit of pairs is recorded when
    its pairs are staged, each input shard committed when all its units are; a re-run with the same ``--run-id``
    checks that inputs and config are unchanged, embeds and indexes the corpus again (it is not stored) and searches
    only the pairs left.

    Raises:
        ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError: user errors, before any work,
            except those only the corpus pass finds (a corpus without a usable passage or smaller than
            ``negatives.rank_start``, a corrupt corpus file): these remove the run folder this attempt made
            (:meth:`pipeline.run_folder.RunFolder.removed_on_error`).
    """
    from pairmine.operators.negatives import DROP_REASONS, NEGATIVES_SCHEMA
    from pairmine.operators.pairs import PAIR_SKIP_REASONS
    from pairmine.operators.write import STAGING_SORT_COLUMN

    t0 = time.time()
    n = cfg.negatives
    run_id = cfg.output.run_id or new_run_id()
    storage = cfg.storage_layer()
    folder = RunFolder(cfg.output.path, run_id, storage,
                       Parts("negatives", "pairs_out", "pairs_in", NEGATIVES_SCHEMA, (STAGING_SORT_COLUMN,)))
    folder.check_output()
    run_dir = folder.dir
    kind, shards = resolve_input(cfg, storage)
    corpus_shards, text_column, id_column, spec = resolve_corpus(cfg, storage)
    plan = {"run_id": run_id, "inputs": [_shard_dict(s) for s in shards] + [_shard_dict(s) for s in corpus_shards],
            "config": result_config(cfg, "negatives")}
    prior = folder.check_new(plan)
    check_model(cfg)
    if n.teacher:
        check_teacher(n.teacher)
    where = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    configure_data(cfg.ray.target_block_mb)
    stage_plan = plan_for(cfg, 1)
    embed_cpus, embed_gpus = stage_plan.embed_cpus, stage_plan.embed_gpus
    if n.teacher:  # the teacher actors share the embed actors' slots (on GPU: half of each embed share)
        if stage_plan.device == "cpu":
            stage_plan = plan_for(cfg, 1, embed_actors=2 * stage_plan.embed_actors)
            embed_cpus = stage_plan.embed_cpus
        else:
            embed_gpus = stage_plan.embed_gpus / 2
    actors = cfg.embed.num_actors or (stage_plan.gpus if stage_plan.device == "cuda" else 1)
    threads, device, light = stage_plan.threads, stage_plan.device, stage_plan.light_cpus

    # ---- the pairs' layout (JSONL pairs decoded and type-checked here, before the corpus work) ----------------------
    columns = (cfg.input.query_column, cfg.input.passage_column, cfg.input.pair_id_column) if kind == "pairs" else None
    layouts = run_remote(_layout, [(s, storage, columns) for s in shards])
    if not any(sum(layout) for layout in layouts):  # before the corpus is embedded for nothing
        raise InputError(f"--input {cfg.input.path}: no {'groups' if kind == 'groups' else 'pairs'} (its "
                         f"{len(shards)} file(s) hold no rows)")
    # Announced once the pairs passed their checks: a refused input names no run folder that is never made.
    log.info("negatives run %s -> %s: %d input shard(s) (%s), corpus %s (%d file(s)); Ray %s", run_id, run_dir,
             len(shards), "a mine run's groups: anchor -> s1" if kind == "groups" else "pairs", n.corpus,
             len(corpus_shards), where)
    units, unit_rows = [], {}
    for shard, layout in zip(shards, layouts):
        offset = 0
        for g, rows in enumerate(layout):
            units.append({"shard_index": shard.index, "path": shard.path, "format": shard.format,
                          "row_group": g if shard.format == "parquet" else -1, "row_offset": offset, "duplicates": ""})
            unit_rows[(shard.index, offset)] = rows
            offset += rows
    expected = sum(unit_rows.values())
    todo = folder.open(plan, units, unit_rows, "negatives run")
    uncommitted = [s for s in shards if s.index not in folder.records]

    # ---- corpus: chunk, embed, index (no passage passes through the driver) -----------------------------------------
    t_corpus = time.time()
    phases = {"start": t_corpus - t0}  # wall seconds of each phase of the run (stats.json "phases_s")
    figures: list[dict] = []  # per-stage wall/busy/CPU seconds and rows, in pipeline order (stats.json "stages")
    with_queries = queries_with_corpus(cfg, kind, sum(unit_rows[unit_key(u)] for u in todo))
    corpus_skipped: dict[str, int] = {}  # corpus documents skipped, by reason
    # An input error found here (no usable corpus passage, a corrupt corpus file) leaves no run folder.
    with folder.removed_on_error():
        index_shards = build_corpus_index(cfg, corpus_shards, text_column, id_column, spec, threads, device, actors,
                                          embed_cpus, embed_gpus, light, figures, todo if with_queries else None,
                                          partial(_make_read, cfg, kind), corpus_skipped)
        phases["corpus"] = time.time() - t_corpus
        corpus_size = sum(s["passages"] for s in index_shards)
        skipped_words = ", ".join(f"{k} {v}" for k, v in sorted(corpus_skipped.items()))
        if corpus_skipped:
            log.info("corpus: documents skipped: %s", skipped_words)
        if corpus_size == 0:
            raise InputError(f"negatives.corpus {n.corpus}: no usable passage (documents skipped: "
                             f"{skipped_words or 'none; no document'})")
        if corpus_size < n.rank_start:
            raise InputError(f"negatives.corpus {n.corpus} has {corpus_size} usable passage(s), fewer than "
                             f"negatives.rank_start = {n.rank_start}: no candidate could reach the rank window; give a "
                             "larger corpus or lower negatives.rank_start")
    index_desc = index_shards[0]["index"]
    if len(index_shards) > 1:
        sizes = [s["passages"] for s in index_shards]
        index_desc += f", {len(index_shards)} shards of {min(sizes)}-{max(sizes)} passages, merged exactly"
    recalls = [(s["recall"], s["passages"]) for s in index_shards if s["recall"] is not None]
    recall = sum(r * w for r, w in recalls) / sum(w for _, w in recalls) if recalls else None
    queries_with = index_shards[0]["queries"]
    duplicates = index_shards[0]["duplicates"]
    log.info("corpus: %d passages%s%s embedded and indexed in %.1f s, %s%s", corpus_size,
             f" ({duplicates} exact copies of another dropped)" if duplicates else "",
             f" and {queries_with} queries" if queries_with else "", time.time() - t_corpus, index_desc,
             "" if recall is None else f"; recall@{n.depth} against exact search {recall:.4f} "
             f"({min(n.recall_probes, corpus_size)} corpus passages per shard as probe queries)")
    # The pairs' embedder takes a positive's (or a query's) vector from the corpus when its prefixed text is there
    # (one shard only: with several, each pairs actor would have to hold every shard's vectors).
    known_ref = index_shards[0]["known"] if len(index_shards) == 1 else None
    if len(index_shards) > 1:
        log.info("the index is sharded: every query and positive is embedded (corpus vectors are reused with one "
                 "shard only)")

    # ---- the streaming pass, a commit per shard ----------------------------------------------------------------------
    batch = cfg.ray.docs_per_batch
    stages = [
        Stage("read_pairs", partial(_make_read, cfg, kind), batch_size=1, num_cpus=light),
        Stage("embed_pairs", partial(_make_embed, cfg, threads, device, known_ref), batch_size=batch, actors=actors,
              num_cpus=embed_cpus, num_gpus=embed_gpus),
    ]
    # One search stage per index shard, each actor holding its shard only (Ray places it where its memory fits);
    # together they take the stage plan's filter slot: its light CPU share and, on GPUs, its GPU share (an exact
    # shard is then searched on the GPU with torch; IVF/HNSW stay on faiss's CPU build).
    search_device = device if n.index == "flat" else "cpu"
    search_gpus = stage_plan.filter_gpus / len(index_shards) if search_device == "cuda" else 0.0
    # With one shard the search actor also selects, so that the candidate lists (depth texts a pair) stay in it.
    if len(index_shards) == 1:
        stages.append(Stage("search_and_select", partial(_make_search_select, index_shards[0]["ref"], cfg, threads,
                                                     search_device),
                            batch_size=batch, actors=1, num_cpus=light, num_gpus=search_gpus))
    else:
        for k, shard in enumerate(index_shards):
            stages.append(Stage(f"search_shard_{k}",
                                partial(_make_search, shard["ref"], shard["offset"], cfg, threads, search_device),
                                batch_size=batch, actors=1, num_cpus=light / len(index_shards), num_gpus=search_gpus,
                                memory=shard["memory"]))
        stages.append(Stage("select", partial(_make_select, cfg), batch_size=batch, num_cpus=light))
    if n.teacher:
        stages.append(Stage("teacher", partial(_make_teacher, cfg, device, threads), batch_size=batch, actors=actors,
                            num_cpus=embed_cpus, num_gpus=embed_gpus))
    stages.append(Stage("write_negatives", partial(_make_write, folder.staging, run_id, model_id(cfg), n.teacher,
                                                   storage), batch_size=batch, num_cpus=light))
    t_pairs = time.time()
    if uncommitted:
        hint = f"the shards committed so far stay in {run_dir}: run the same command with --run-id {run_id} to resume"
        folder.stream(stages, [_shard_dict(s) | {"index": s.index} for s in uncommitted], todo,
                      unit_rows,
                      Progress(sum(unit_rows[unit_key(u)] for u in todo), unit="pairs", counted="pairs written"),
                      cfg.ray.stall_warn_s, cfg.ray.stall_limit_s, hint, figures, light)
        phases["pairs_pass"] = time.time() - t_pairs

    # ---- commit -----------------------------------------------------------------------------------------------------
    records = folder.records
    total, _ = folder.committed_stats(shards)
    skipped = {r: int(total.get(f"pairs_skipped.{r}", 0)) for r in PAIR_SKIP_REASONS}
    dropped = {r: int(total.get(f"negatives_dropped.{r}", 0)) for r in DROP_REASONS}
    pairs_in, pairs_out, kept = int(total["pairs_in"]), int(total["pairs_out"]), int(total["negatives"])
    elapsed = time.time() - t0
    stats = {
        "run_id": run_id,
        "pairs_in": pairs_in,
        "pairs_skipped": skipped,
        "pairs_out": pairs_out,
        "pairs_text_repaired": int(total.get("pairs_text_repaired", 0)),
        "pairs_without_negatives": int(total["pairs_without_negatives"]),
        "negatives": kept,
        "negatives_per_pair": round(kept / pairs_out, 4) if pairs_out else 0.0,
        "candidates_retrieved": kept + sum(dropped.values()),
        "negatives_dropped": dropped,
        "corpus_passages": corpus_size,
        "corpus_docs_skipped": dict(sorted(corpus_skipped.items())),
        "vectors_reused": int(total.get("vectors_reused", 0)),
        "queries_embedded_with_corpus": queries_with,
        "corpus_duplicates": duplicates,
        "index": index_desc,
        "index_recall_at_depth": recall,
        "shards": len(shards),
        "shards_resumed": len(shards) - len(uncommitted),
        "units": len(units),
        "units_resumed": len(units) - len(todo),
        "elapsed_s": round(elapsed, 2),
        "pairs_per_s": round(pairs_in / elapsed, 3) if elapsed else 0.0,
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "stages": figures,
    }
    stats["reconciled"] = pairs_in == pairs_out + sum(skipped.values()) == expected
    in_parts = sum(records[s.index]["rows"] for s in shards)
    if not stats["reconciled"] or in_parts != pairs_out:
        raise RuntimeError(f"counts do not reconcile: {stats}, parts hold {in_parts} pairs")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {
        "run_id": run_id, "job": "negatives",
        "created_utc": (prior or {}).get("created_utc") or now, "committed_utc": now,
        "config": cfg.to_dict(),
        "resolved": {"model": model_id(cfg), "query_prefix": cfg.resolved_query_prefix(),
                     "passage_prefix": cfg.resolved_prefix(), "embed_device": device, "ray": where,
                     "stage_plan": stage_plan.describe(), "input_kind": kind, "index": index_desc,
                     "search": "torch on cuda (exact)" if search_device == "cuda" else "faiss on cpu",
                     "index_recall_at_depth": recall, "teacher": n.teacher or None},
        "inputs": [_shard_dict(s) for s in shards],
        "corpus": [_shard_dict(s) for s in corpus_shards],
        "shards": [{"shard_index": s.index, "part": records[s.index]["part"], "pairs": records[s.index]["rows"],
                    "status": "committed", "committed_utc": records[s.index]["committed_utc"]} for s in shards],
        "versions": software_versions(), "host": platform.node(),
    }
    folder.finalize(stats, manifest)
    log.info("done in %.1f s: %d negatives for %d pairs (%.2f per pair; ranks %d-%d of %d retrieved from %d corpus "
             "passages); %d skipped -> %s", elapsed, kept, pairs_out, stats["negatives_per_pair"], n.rank_start,
             n.rank_end, min(n.depth, corpus_size), corpus_size, sum(skipped.values()), run_dir)
    for line in timing_lines(stats["phases_s"], figures):
        log.info("%s", line)
    return MineResult(run_dir=run_dir, stats=stats)
