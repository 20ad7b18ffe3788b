"""The standalone pair filter: ``pairmine filter-pairs`` (E5's consistency filter on existing (query, passage)
pairs, seed 004 chapter 1).

    plan               input shards, parquet footers (columns checked before Ray starts), work units
    pool               P passages drawn with seeded priorities from the pairs' own passages (default) or from a
                       document corpus (consistency.pool_path, chunked like pairmine mine), embedded once, put in
                       Ray's object store
    read -> embed (query prefix / passage prefix) -> consistency count -> write (staging)    one row per pair
    compact, commit    one part per input shard, stats.json, manifest.json, _SUCCESS last

Run folder layout: ``pairs/part-NNNNN.parquet`` (kept pairs), ``dropped/`` (with consistency.side_output),
``stats.json``, ``manifest.json``, ``_SUCCESS``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import platform
import time
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairmine.pipeline.config import ConfigError, MineConfig
from pairmine.pipeline.inputs import (
    PoolSpec, check_parquet_shards, discover_shards, pool_sample, shard_pool,
)
from pairmine.pipeline.mine import (
    MineResult, Progress, RunExistsError, _load_pool, _shard_dict,
    check_model, embed_pool, merge_stats, model_id, new_run_id, write_json,
)
from pairmine.pipeline.provenance import SUCCESS_MARKER, software_versions
from pairmine.pipeline.ray_adapter import (
    Stage, apply_stage, configure_data, init_ray, plan_for, run_remote, watched,
)

log = logging.getLogger("pairmine")


def _plan_shard(shard, cfg: MineConfig, pool_size: int, seed: int) -> tuple[list[int], list[tuple[float, int, str]]]:
    """Row-group layout of a pairs shard, and its pool candidates when the pool comes from the pairs: every usable
    pair's passage with a seeded priority; the shard's ``pool_size`` lowest (hash = the passage text's)."""
    import pyarrow.parquet as pq

    from pairmine.operators.consistency import doc_hash
    from pairmine.operators.pairs import pair_skip_reasons, read_pair_columns
    from pairmine.operators.read import open_input

    i, storage = cfg.input, cfg.storage_layer()
    if shard.format == "parquet":
        def footer():
            with open_input(shard.path, storage) as f:
                meta = pq.ParquetFile(f).metadata
                return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

        layout = storage.retry("read", shard.path, footer)
    else:
        layout = None
    if pool_size <= 0 and layout is not None:
        return layout, []
    q, p, _, invalid, _ = read_pair_columns(shard.path, shard.format, -1, i.query_column, i.passage_column,
                                            i.pair_id_column, storage)
    layout = layout or [len(q)]
    if pool_size <= 0:
        return layout, []
    usable = pc.is_null(pair_skip_reasons(q, p, invalid)).to_numpy(zero_copy_only=False)
    priority = np.random.default_rng([seed, shard.index]).random(len(p))
    rows = np.flatnonzero(usable)
    rows = rows[np.argsort(priority[rows], kind="stable")][:pool_size]
    texts = p.take(pa.array(rows, pa.int64())).to_pylist()
    return layout, [(float(priority[r]), doc_hash(t), t) for r, t in zip(rows.tolist(), texts)]


def _make_read(cfg: MineConfig):
    from pairmine.operators.pairs import ReadPairs

    return ReadPairs(cfg.input.query_column, cfg.input.passage_column, cfg.input.pair_id_column, cfg.storage_layer())


def _make_embed(cfg: MineConfig, threads: int, device: str):
    from pairmine.operators.pairs import EmbedPairs

    e = cfg.embed
    return EmbedPairs(cfg.resolved_query_prefix(), model=e.model, passage_prefix=cfg.resolved_prefix(),
                      max_length=e.max_length, batch_size=e.batch_size, dtype=e.dtype, device=device, threads=threads,
                      trust_remote_code=e.trust_remote_code)


def _make_pool_embed(cfg: MineConfig, threads: int, device: str):
    from pairmine.operators.embed import Embedder

    e = cfg.embed
    return Embedder(e.model, cfg.resolved_prefix(), e.max_length, e.batch_size, e.dtype, device, threads,
                    e.trust_remote_code)


def _make_filter(pool_ref, k: int, device: str, chunk_mb: float):
    from pairmine.operators.pairs import PairFilter

    return PairFilter(partial(_load_pool, pool_ref), k, device, chunk_mb)


def _make_write(staging: str, run_id: str, model: str, pool_size: int, k: int, side_output: bool, storage):
    from pairmine.operators.pairs import PairWriter

    return PairWriter(staging, run_id, model, pool_size, k, side_output, storage)


def _compact(staging: str, out: str, shard_index: int, storage):
    from pairmine.operators.pairs import PAIR_SCHEMA
    from pairmine.operators.write import STAGING_SORT_COLUMN, compact_shard

    path, n, _ = compact_shard(staging, out, shard_index, PAIR_SCHEMA, (STAGING_SORT_COLUMN,), storage)
    return path, n


def filter_pairs(cfg: MineConfig) -> MineResult:
    """Run the pair filter with a validated config; returns the run folder and its stats.

    Raises:
        ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError: user errors, before any work.
    """
    import ray

    from pairmine.operators.pairs import PAIR_SKIP_REASONS
    from pairmine.operators.write import N_ABOVE_BINS

    t0 = time.time()
    c = cfg.consistency
    run_id = cfg.output.run_id or new_run_id()
    storage = cfg.storage_layer()
    out = cfg.output.path.rstrip("/") or "."
    if (storage.info(out) or {}).get("type") == "file":
        raise ConfigError(f"output.path = {cfg.output.path!r} is a file; it must be a folder (created if missing)")
    run_dir = f"{out}/{run_id}"
    if storage.exists(f"{run_dir}/{SUCCESS_MARKER}"):
        raise RunExistsError(f"run {run_id} in {cfg.output.path} is already committed; choose another --run-id")
    if not cfg.input.path:
        raise ConfigError("filter-pairs needs --input (a parquet/JSONL file, folder or glob of pairs)")
    if not c.enabled:
        raise ConfigError("consistency.enabled = False: filter-pairs is the consistency filter and cannot run without it")
    shards = discover_shards(cfg.input.path, cfg.input.format, storage)
    check_parquet_shards(shards, (cfg.input.query_column, cfg.input.passage_column), storage,
                         text_columns=(cfg.input.query_column, cfg.input.passage_column))
    pool_shards = None
    if c.pool_path:
        try:
            pool_shards = discover_shards(c.pool_path, storage=storage)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"consistency.pool_path (--pool): {e}") from None
        check_parquet_shards(pool_shards, (cfg.input.text_column, cfg.input.id_column), storage)
    check_model(cfg)
    where = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    configure_data(cfg.ray.target_block_mb)
    stage_plan = plan_for(cfg, c.num_actors)
    log.info("filter-pairs run %s -> %s: %d input shard(s); Ray %s", run_id, run_dir, len(shards), where)
    log.info("stage plan: %s", stage_plan.describe())

    # ---- plan and pool --------------------------------------------------------------------------------------------
    own_pool = c.pool_size if pool_shards is None else 0
    plans = run_remote(_plan_shard, [(s, cfg, own_pool, c.seed) for s in shards])
    pairs_expected = sum(sum(layout) for layout, _ in plans)
    units = []
    for shard, (layout, _) in zip(shards, plans):
        offset = 0
        for g, rows in enumerate(layout):
            units.append({"shard_index": shard.index, "path": shard.path, "format": shard.format,
                          "row_group": g if shard.format == "parquet" else -1, "row_offset": offset, "duplicates": ""})
            offset += rows
    # Pool passages are keyed by their text in filter-pairs: a passage that appears several times (in several pairs
    # or documents) enters the pool once, and the pair's own passage never counts against it.
    if pool_shards is None:
        candidates, pool_source = [cands for _, cands in plans], "the input pairs' passages"
    else:
        spec = PoolSpec(c.pool_size, c.seed, 1.0, 0, cfg.chunk.max_words, cfg.chunk.min_words, cfg.chunk.max_passages,
                        hash_by="text", token_limit=cfg.token_limit())
        candidates = run_remote(shard_pool, [(s, cfg.input.text_column, cfg.input.id_column, spec, storage)
                                             for s in pool_shards])
        pool_source = c.pool_path
    pool_passages, pool_hashes = pool_sample(candidates, c.pool_size, unique=True)
    del plans

    actors, threads, device = stage_plan.embed_actors, stage_plan.threads, stage_plan.device
    batch, light = cfg.ray.docs_per_batch, stage_plan.light_cpus
    gpu_embed, gpu_filter = stage_plan.embed_gpus, stage_plan.filter_gpus
    t_pool = time.time()
    pool_vectors, pool_hashes = embed_pool(
        pool_passages, pool_hashes,
        Stage("embed", partial(_make_pool_embed, cfg, threads, device), batch_size=batch, actors=actors,
              num_cpus=stage_plan.embed_cpus, num_gpus=gpu_embed),
        cfg.ray.stall_warn_s, cfg.ray.stall_limit_s,
    )
    pool_size = len(pool_vectors)
    pool_ref = ray.put((pool_vectors, pool_hashes))
    del pool_vectors, pool_passages
    if pool_size == 0:
        log.warning("the pool is empty (no usable passage in %s): every usable pair will be kept", pool_source)
    log.info("pool: %d passages from %s embedded in %.1f s (asked for %d); keep iff n_above < %d; query prefix %r, "
             "passage prefix %r", pool_size, pool_source, time.time() - t_pool, c.pool_size, c.k,
             cfg.resolved_query_prefix(), cfg.resolved_prefix())

    # ---- the streaming pass -----------------------------------------------------------------------------------------
    staging = f"{run_dir}/_staging"
    storage.rm(staging)  # leftovers of an interrupted attempt of this run id
    storage.makedirs(run_dir)
    stages = [
        Stage("read_pairs", partial(_make_read, cfg), batch_size=1, num_cpus=light),
        Stage("embed_pairs", partial(_make_embed, cfg, threads, device), batch_size=batch, actors=actors,
              num_cpus=stage_plan.embed_cpus, num_gpus=gpu_embed),
        Stage("consistency", partial(_make_filter, pool_ref, c.k, device, c.chunk_mb), batch_size=batch,
              actors=stage_plan.filter_actors, num_cpus=light, num_gpus=gpu_filter),
        Stage("write_pairs", partial(_make_write, staging, run_id, model_id(cfg), pool_size, c.k, c.side_output,
                                            storage),
              batch_size=batch, num_cpus=light),
    ]
    ds = ray.data.from_items(units, override_num_blocks=max(1, len(units)))
    for stage in stages:
        ds = apply_stage(ds, stage)
    summaries, progress = [], Progress(pairs_expected, unit="pairs", counted="kept")
    done = lambda: f"{progress.docs} / {progress.total} pairs"  # noqa: E731
    for row in watched(ds.iter_rows(), stages, done, cfg.ray.stall_warn_s, cfg.ray.stall_limit_s):
        summaries.append(json.loads(row["stats"]))
        progress.update(summaries[-1].get("pairs_in", 0), summaries[-1].get("pairs_kept", 0))
    progress.done()
    parts = run_remote(_compact, [(f"{staging}/pairs", f"{run_dir}/pairs", s.index, storage) for s in shards])
    if c.side_output:
        run_remote(_compact, [(f"{staging}/dropped", f"{run_dir}/dropped", s.index, storage) for s in shards])
    storage.rm(staging)

    # ---- commit -----------------------------------------------------------------------------------------------------
    total, hists = merge_stats(summaries)
    skipped = {r: int(total.get(f"pairs_skipped.{r}", 0)) for r in PAIR_SKIP_REASONS}
    pairs_in, kept, dropped = int(total["pairs_in"]), int(total["pairs_kept"]), int(total["pairs_dropped_consistency"])
    usable = kept + dropped
    elapsed = time.time() - t0
    stats = {
        "run_id": run_id,
        "pairs_in": pairs_in,
        "pairs_skipped": skipped,
        "pairs_skipped_total": sum(skipped.values()),
        "pairs_text_repaired": int(total.get("pairs_text_repaired", 0)),
        "pairs_kept": kept,
        "pairs_dropped_consistency": dropped,
        "consistency_keep_rate_pct": round(100.0 * kept / usable, 3) if usable else 0.0,
        "pool_size": pool_size,
        "consistency_k": c.k,
        "n_above_histogram": {"bin_edges": [int(x) for x in N_ABOVE_BINS[:-1]] + ["inf"],
                              "counts": hists.get("n_above_histogram", [0] * (len(N_ABOVE_BINS) - 1))},
        "elapsed_s": round(elapsed, 2),
        "pairs_per_s": round(pairs_in / elapsed, 3) if elapsed else 0.0,
    }
    stats["reconciled"] = pairs_in == usable + stats["pairs_skipped_total"] == pairs_expected
    if not stats["reconciled"] or sum(n for _, n in parts) != kept:
        raise RuntimeError(f"counts do not reconcile: {stats}, parts hold {sum(n for _, n in parts)} pairs")
    manifest = {
        "run_id": run_id, "job": "filter-pairs",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "resolved": {"model": model_id(cfg), "query_prefix": cfg.resolved_query_prefix(),
                     "passage_prefix": cfg.resolved_prefix(), "embed_device": device, "ray": where,
                     "stage_plan": stage_plan.describe()},
        "consistency": {"pool_size": pool_size, "pool_size_requested": c.pool_size, "pool_source": pool_source,
                        "k": c.k, "seed": c.seed, "side_output": "dropped/" if c.side_output else None},
        "inputs": [_shard_dict(s) for s in shards],
        "shards": [{"shard_index": s.index, "part": f"pairs/{p.rsplit('/', 1)[-1]}", "pairs": n, "status": "committed"}
                   for s, (p, n) in zip(shards, parts)],
        "versions": software_versions(), "host": platform.node(),
    }
    write_json(storage, f"{run_dir}/stats.json", stats)
    write_json(storage, f"{run_dir}/manifest.json", manifest)
    storage.write_bytes(f"{run_dir}/{SUCCESS_MARKER}", (run_id + "\n").encode())
    log.info("done in %.1f s: kept %d of %d usable pairs (%.1f%%; n_above < %d against %d pool passages); %d skipped "
             "-> %s", elapsed, kept, usable, stats["consistency_keep_rate_pct"], c.k, pool_size,
             stats["pairs_skipped_total"], run_dir)
    return MineResult(run_dir=run_dir, stats=stats)
