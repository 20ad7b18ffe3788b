"""The standalone pair filter: ``pairmine filter-pairs`` (E5's consistency filter on existing (query, passage)
pairs, seed 004 chapter 1).

    plan               input shards, parquet footers (columns checked before Ray starts), work units
    pool               P passages drawn with seeded priorities from the pairs' own passages (default) or from a
                       document corpus (consistency.pool_path, chunked like pairmine mine), embedded once, put in
                       Ray's object store
    read -> embed (query prefix / passage prefix) -> consistency count -> write (staging)    one row per pair
    compact, commit    one part per input shard as soon as its pairs are staged, then stats.json, manifest.json,
                       _SUCCESS last

The run lifecycle is mine's (:mod:`pipeline.run_folder`): a killed run re-run with the same ``--run-id`` keeps the
committed shards and the completed work units (row groups) of the others, and filters only the rest.

Run folder layout: ``pairs/part-NNNNN.parquet`` (kept pairs), ``dropped/`` (with consistency.side_output),
``stats.json``, ``manifest.json``, ``_SUCCESS``.
"""

from __future__ import annotations

import datetime as _dt
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
    MineResult, Progress, _load_pool, _shard_dict, check_model, embed_pool, model_id, new_run_id, result_config,
)
from pairmine.pipeline.provenance import software_versions
from pairmine.pipeline.ray_adapter import Stage, configure_data, init_ray, plan_for, run_remote
from pairmine.pipeline.run_folder import Parts, RunFolder, unit_key

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


def filter_pairs(cfg: MineConfig) -> MineResult:
    """Run the pair filter with a validated config; returns the run folder and its stats.

    Exactly once, as :func:`pipeline.mine.mine`: each work unit is recorded when all its pairs are staged, each
    input shard committed when all its units are; a re-run with the same run id checks that inputs and config are
    unchanged and filters only what is left.

    Raises:
        ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError: user errors, before any work.
        StorageError: a read or write failed for good.
    """
    import ray

    from pairmine.operators.pairs import PAIR_SCHEMA, PAIR_SKIP_REASONS
    from pairmine.operators.write import N_ABOVE_BINS, STAGING_SORT_COLUMN

    t0 = time.time()
    c = cfg.consistency
    run_id = cfg.output.run_id or new_run_id()
    storage = cfg.storage_layer()
    folder = RunFolder(cfg.output.path, run_id, storage, Parts("pairs", "pairs_kept", "pairs_in", PAIR_SCHEMA,
                                                               (STAGING_SORT_COLUMN,),
                                                               "dropped" if c.side_output else None))
    folder.check_output()
    if not cfg.input.path:
        raise ConfigError("filter-pairs needs --input (a parquet/JSONL file, folder or glob of pairs)")
    if not c.enabled:
        raise ConfigError("consistency.enabled = False: filter-pairs is the consistency filter and cannot run without it")
    shards = discover_shards(cfg.input.path, cfg.input.format, storage)
    prior = folder.check_new({"run_id": run_id, "inputs": [_shard_dict(s) for s in shards],
                              "config": result_config(cfg, "filter-pairs")})
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
    log.info("filter-pairs run %s -> %s: %d input shard(s); Ray %s", run_id, folder.dir, len(shards), where)
    log.info("stage plan: %s", stage_plan.describe())

    # ---- plan and pool --------------------------------------------------------------------------------------------
    own_pool = c.pool_size if pool_shards is None else 0
    plans = run_remote(_plan_shard, [(s, cfg, own_pool, c.seed) for s in shards])
    units, unit_rows = [], {}
    for shard, (layout, _) in zip(shards, plans):
        offset = 0
        for g, rows in enumerate(layout):
            units.append({"shard_index": shard.index, "path": shard.path, "format": shard.format,
                          "row_group": g if shard.format == "parquet" else -1, "row_offset": offset, "duplicates": ""})
            unit_rows[(shard.index, offset)] = rows
            offset += rows
    pairs_expected = sum(unit_rows.values())
    # Pool passages are keyed by their text in filter-pairs: a passage that appears several times (in several pairs
    # or documents) enters the pool once, and the pair's own passage never counts against it.
    if pool_shards is None:
        candidates, pool_source = [cands for _, cands in plans], "the input pairs' passages"
    else:
        spec = PoolSpec(c.pool_size, c.seed, 1.0, 0, cfg.chunk_spec(), hash_by="text")
        candidates = run_remote(shard_pool, [(s, cfg.input.text_column, cfg.input.id_column, spec, storage)
                                             for s in pool_shards])
        pool_source = c.pool_path
    pool_passages, pool_hashes = pool_sample(candidates, c.pool_size, unique=True)
    del plans
    todo = folder.open({"run_id": run_id, "inputs": [_shard_dict(s) for s in shards],
                        "config": result_config(cfg, "filter-pairs")}, units, unit_rows, "filter-pairs run")
    uncommitted = [s for s in shards if s.index not in folder.records]
    actors, threads, device = stage_plan.embed_actors, stage_plan.threads, stage_plan.device
    batch, light = cfg.ray.docs_per_batch, stage_plan.light_cpus
    gpu_embed, gpu_filter = stage_plan.embed_gpus, stage_plan.filter_gpus
    pool_size = next((r["pool_size"] for r in folder.records.values() if r.get("pool_size") is not None), None)
    if uncommitted:
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
        log.info("pool: %d passages from %s embedded in %.1f s (asked for %d); keep iff n_above < %d; query prefix "
                 "%r, passage prefix %r", pool_size, pool_source, time.time() - t_pool, c.pool_size, c.k,
                 cfg.resolved_query_prefix(), cfg.resolved_prefix())

        # ---- the streaming pass, a commit per shard -----------------------------------------------------------------
        stages = [
            Stage("read_pairs", partial(_make_read, cfg), batch_size=1, num_cpus=light),
            Stage("embed_pairs", partial(_make_embed, cfg, threads, device), batch_size=batch, actors=actors,
                  num_cpus=stage_plan.embed_cpus, num_gpus=gpu_embed),
            Stage("consistency", partial(_make_filter, pool_ref, c.k, device, c.chunk_mb), batch_size=batch,
                  actors=stage_plan.filter_actors, num_cpus=light, num_gpus=gpu_filter),
            Stage("write_pairs", partial(_make_write, folder.staging, run_id, model_id(cfg), pool_size, c.k,
                                         c.side_output, storage),
                  batch_size=batch, num_cpus=light),
        ]
        hint = (f"the shards committed so far stay in {folder.dir}: run the same command with --run-id {run_id} to "
                "resume")
        folder.stream(stages, [_shard_dict(s) | {"index": s.index, "pool_size": pool_size} for s in uncommitted],
                      todo, unit_rows,
                      Progress(sum(unit_rows[unit_key(u)] for u in todo), unit="pairs", counted="kept"),
                      cfg.ray.stall_warn_s, cfg.ray.stall_limit_s, hint, None, light)

    # ---- commit -----------------------------------------------------------------------------------------------------
    records = folder.records
    total, hists = folder.committed_stats(shards)
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
        "shards": len(shards),
        "shards_resumed": len(shards) - len(uncommitted),
        "units": len(units),
        "units_resumed": len(units) - len(todo),
        "elapsed_s": round(elapsed, 2),
        "pairs_per_s": round(pairs_in / elapsed, 3) if elapsed else 0.0,
    }
    stats["reconciled"] = pairs_in == usable + stats["pairs_skipped_total"] == pairs_expected
    if not stats["reconciled"] or sum(records[s.index]["rows"] for s in shards) != kept:
        raise RuntimeError(f"counts do not reconcile: {stats}, parts hold "
                           f"{sum(records[s.index]['rows'] for s in shards)} pairs")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {
        "run_id": run_id, "job": "filter-pairs",
        "created_utc": (prior or {}).get("created_utc") or now, "committed_utc": now,
        "config": cfg.to_dict(),
        "resolved": {"model": model_id(cfg), "query_prefix": cfg.resolved_query_prefix(),
                     "passage_prefix": cfg.resolved_prefix(), "embed_device": device, "ray": where,
                     "stage_plan": stage_plan.describe()},
        "consistency": {"pool_size": pool_size, "pool_size_requested": c.pool_size, "pool_source": pool_source,
                        "k": c.k, "seed": c.seed, "side_output": "dropped/" if c.side_output else None},
        "inputs": [_shard_dict(s) for s in shards],
        "shards": [{"shard_index": s.index, "part": records[s.index]["part"], "pairs": records[s.index]["rows"],
                    "status": "committed", "committed_utc": records[s.index]["committed_utc"]} for s in shards],
        "versions": software_versions(), "host": platform.node(),
    }
    folder.finalize(stats, manifest)
    log.info("done in %.1f s: kept %d of %d usable pairs (%.1f%%; n_above < %d against %d pool passages); %d skipped "
             "-> %s", elapsed, kept, usable, stats["consistency_keep_rate_pct"], c.k, pool_size,
             stats["pairs_skipped_total"], folder.dir)
    return MineResult(run_dir=folder.dir, stats=stats)
