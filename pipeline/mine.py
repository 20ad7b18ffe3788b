"""The main job: mine training groups from documents (SPEC "Shape").

    scan (first pass)  ids, row groups, seeded text sample -> duplicate rows, work units, TF-IDF (IDF) fit
    pool               P random passages (seeded, from the first pass) embedded once, put in Ray's object store
    read -> chunk -> embed (actors) -> centrality -> related -> consistency (actors) -> write (staging)
                                                                                       one row per document
    compact            one deterministic part per input shard
    commit             stats.json, manifest.json, then the _SUCCESS marker

Run folder layout (``<output>/<run_id>/``): ``groups/part-00000.parquet`` (one part per input shard, zstd),
``tfidf.joblib`` (the fitted ``operators.related.CorpusTfidf``), ``stats.json``, ``manifest.json``, ``_SUCCESS``
(written last).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import io
import logging
import os
import platform
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

import numpy as np

from pairmine.pipeline.provenance import SUCCESS_MARKER, software_versions  # noqa: F401 - SUCCESS_MARKER re-exported
from pairmine.pipeline.config import ConfigError, MineConfig
from pairmine.pipeline.first_pass import ScanParams, first_pass
from pairmine.pipeline.inputs import (
    PoolSpec, check_parquet_shards, content_sha256, discover_shards, is_multipart_etag, sample_cut,
)
from pairmine.pipeline.ray_adapter import (
    PROGRESS_EVERY_S, Stage, apply_stage, configure_data, init_ray, plan_for, stage_figures, timing_lines,
    watched,
)
from pairmine.pipeline.run_folder import (  # noqa: F401 - RunExistsError, merge_stats, write_json re-exported
    Parts, RunExistsError, RunFolder, merge_stats, read_json, run_kind, unit_key, write_json,
)

log = logging.getLogger("pairmine")

@dataclass
class MineResult:
    """What :func:`mine` returns: the run folder (path or URL) and the content of its stats.json."""

    run_dir: str
    stats: dict


def new_run_id() -> str:
    """A new run id: UTC time to the second plus 6 random hex digits, e.g. ``20261129T124700Z-a1b2c3``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def model_id(cfg: MineConfig) -> str:
    """The model name written on every group: ``embed.model``, or the default model's hub name."""
    from pairmine.operators.embed import DEFAULT_MODEL_NAME

    return cfg.embed.model or DEFAULT_MODEL_NAME


class Progress:
    """Log lines "documents done / total, groups, rate, ETA" at most every ``every_s`` seconds (readable both on a
    terminal and in a job log)."""

    def __init__(self, total: int, every_s: float = 5.0, unit: str = "documents", counted: str = "groups"):
        self.total, self.every_s, self.unit, self.counted = total, every_s, unit, counted
        self.docs = self.groups = self.logged = 0
        self.t0 = self.last = time.time()

    def update(self, docs: int, groups: int) -> None:
        self.docs += docs
        self.groups += groups
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            self._log(now)

    def _log(self, now: float) -> None:
        self.logged = self.docs
        rate = self.docs / max(now - self.t0, 1e-9)
        eta = (self.total - self.docs) / rate if rate > 0 else float("inf")
        log.info("progress: %d / %d %s (%.1f%%), %d %s, %.1f %s/s, ETA %s",
                 self.docs, self.total, self.unit, 100.0 * self.docs / max(self.total, 1), self.groups, self.counted,
                 rate, self.unit, f"{eta:.0f} s" if eta != float("inf") else "?")

    def done(self) -> None:
        if self.logged != self.docs or self.docs == 0:
            self._log(time.time())


def check_model(cfg: MineConfig, needs_threshold: bool = False) -> None:
    """Fail before any work when the configured model cannot be found (reads only its config) or, with
    ``needs_threshold``, when no anchor threshold is known for it (see :mod:`pipeline.model_description`).

    Raises:
        ConfigError: naming embed.model and the loader's reason; or anchors.threshold and ``pairmine calibrate``;
            or an unusable pairmine_model.json.
    """
    if cfg.embed.model:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(cfg.embed.model, trust_remote_code=cfg.embed.trust_remote_code)
        except Exception as e:  # transformers raises OSError/ValueError/HF errors depending on the cause
            raise ConfigError(f"embed.model = {cfg.embed.model!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    cfg.resolved_prefix(), cfg.resolved_query_prefix()  # an unusable description file fails here
    if needs_threshold:
        cfg.resolved_threshold()


# Factories are module-level functions bound with functools.partial so that Ray can pickle them by reference.
def _make_read(cfg: MineConfig):
    from pairmine.operators.read import ReadDocuments

    return ReadDocuments(cfg.input.text_column, cfg.input.id_column, cfg.input.url_column, cfg.storage_layer())


def _make_chunk(cfg: MineConfig):
    from pairmine.operators.chunk import Chunker

    return Chunker(cfg.chunk.max_words, cfg.chunk.min_words, cfg.chunk.max_passages, cfg.token_limit(),
                   cfg.chunk.max_chars)


def _make_embed(cfg: MineConfig, threads: int, device: str, known_refs=None):
    from pairmine.operators.embed import Embedder

    e = cfg.embed
    known = partial(_load_known, *known_refs) if known_refs is not None else None
    return Embedder(e.model, cfg.resolved_prefix(), e.max_length, e.batch_size, e.dtype, device, threads,
                    e.trust_remote_code, known)


def _load_known(keys_ref, pool_ref):
    """The consistency pool's vectors as an Embedder's ``known`` lookup: (keys sorted, rows, pool vectors)."""
    import ray

    keys, rows = ray.get(keys_ref)
    return keys, rows, ray.get(pool_ref)[0]  # zero-copy from the node's object store


def _make_centrality():
    from pairmine.operators.centrality import CentralityScorer

    return CentralityScorer()


def _make_related(cfg: MineConfig, tfidf):
    from pairmine.operators.related import RelatedMiner

    r = cfg.related
    return RelatedMiner(tfidf, cfg.resolved_threshold(), r.n_related, r.rrf_k, r.w_dense, r.w_lexical)


def _make_write(staging: str, run_id: str, model: str, threshold: float, pool_size, k, side_output: bool, storage,
                passage_prefix: str = ""):
    from pairmine.operators.write import GroupWriter

    return GroupWriter(staging, run_id, model, threshold, pool_size, k, side_output, storage, passage_prefix)


def _load_pool(pool_ref):
    import ray

    return ray.get(pool_ref)  # zero-copy from the node's object store


def _make_filter(pool_ref, k: int, device: str, chunk_mb: float):
    from pairmine.operators.consistency import ConsistencyFilter

    return ConsistencyFilter(partial(_load_pool, pool_ref), k, device, chunk_mb)


EMBED_CALL_PASSAGES = 1024  # passages per embed call of a pass over loose passages (the pool, a negatives corpus):
# one progress step (~10 s on 2 CPU cores), many forward batches


def embed_pool(passages: list[str], doc_hashes: np.ndarray, embed_stage: Stage, stall_warn_s: float = 60.0,
               stall_limit_s: float = 1800.0, hint: str = "", texts_out: list | None = None,
               figures_out: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Embed the pool passages with the run's embed stage (same model, prefix, dtype) on Ray, watched for stalls
    (:func:`pipeline.ray_adapter.watched`).

    Args:
        texts_out: when given, the passages are appended to it in the order of the returned rows.
        figures_out: when given, the pass's per-stage figures (:func:`pipeline.ray_adapter.stage_figures`, stage
            names prefixed ``pool:``) are appended to it.

    Returns:
        (vectors (P, dim) float32, doc hashes (P,) int64), rows aligned (Ray may return blocks in any order, so the
        hashes travel with their passages).
    """
    import ray

    from pairmine.operators.embed import vector_matrix

    per_row = EMBED_CALL_PASSAGES
    rows = [{"passages": passages[i : i + per_row], "hashes": doc_hashes[i : i + per_row].tolist()}
            for i in range(0, len(passages), per_row)]
    if not rows:
        return np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
    # One row per call: the main pass's docs_per_batch would put the whole pool in one call, with no progress to
    # show (and the stall watch warning) until it all is embedded.
    ds = apply_stage(ray.data.from_items(rows, override_num_blocks=len(rows)),
                     dataclasses.replace(embed_stage, batch_size=1))
    mats, hashes = [], []
    done = lambda: f"{sum(len(m) for m in mats)} / {len(passages)} pool passages embedded"  # noqa: E731
    for batch in watched(ds.iter_batches(batch_size=None, batch_format="pyarrow"), [embed_stage], done,
                         stall_warn_s, stall_limit_s, hint, PROGRESS_EVERY_S, "pool"):
        matrix, _ = vector_matrix(batch.column("vectors"))
        mats.append(matrix.copy())
        hashes.append(batch.column("hashes").combine_chunks().flatten().to_numpy(zero_copy_only=False))
        if texts_out is not None:
            texts_out.extend(batch.column("passages").combine_chunks().flatten().to_pylist())
    if figures_out is not None:
        figures_out.extend(stage_figures(ds, "pool: "))
    return np.concatenate(mats), np.concatenate(hashes).astype(np.int64)


# Config sections/keys that do not change a run's groups: a resumed run may change them.
_NOT_RESULT_KEYS = {"output", "ray", "storage"}
_NOT_RESULT_FIELDS = {("input", "incremental"), ("input", "new_lineage"), ("embed", "num_actors"), ("embed", "threads"),
                      ("embed", "device"), ("consistency", "num_actors"), ("consistency", "chunk_mb"),
                      ("embed", "batch_size")}


def result_config(cfg: MineConfig, command: str = "mine") -> dict:
    """The part of the config that decides the output of a ``command`` run (mine, filter-pairs, negatives): the
    keys the command reads (:func:`pipeline.config.command_reads`) less those that do not change its rows. It is
    recorded in the run's plan (``_state/plan.json``; the manifest keeps the whole config), and a resumed run must
    match it, so a shared TOML file's keys of other commands may change between attempts (``related.n_related``
    does not stop a negatives run's resume).

    Returns:
        ``{section: {key: value}}``, sections in the config class's order.
    """
    from pairmine.pipeline.config import command_reads

    out = {}
    for sec, vals in cfg.to_dict().items():
        kept = {k: v for k, v in vals.items()
                if (sec, k) not in _NOT_RESULT_FIELDS and command_reads(command, f"{sec}.{k}")}
        if kept and sec not in _NOT_RESULT_KEYS:
            out[sec] = kept
    return out


LINEAGE_SECTIONS = ("chunk", "embed", "anchors", "related", "consistency", "tfidf")


class LineageError(ConfigError):
    """An incremental run whose group-deciding settings differ from the latest committed run's in the output.
    User-fixable (a :class:`ConfigError`, so a :class:`PairmineError`): the same settings, or another output."""


def lineage_settings(config: dict, resolved: dict) -> dict:
    """The settings that decide a run's groups, flat (``section.key`` -> value), from a run's ``config`` (as in
    manifest.json) and its ``resolved`` model, passage prefix and anchor threshold (which replace the unset
    config values they resolve). Runs of one lineage have equal settings, so their vectors share one space."""
    flat = {f"{sec}.{k}": v for sec in LINEAGE_SECTIONS for k, v in config.get(sec, {}).items()
            if (sec, k) not in _NOT_RESULT_FIELDS and (sec, k) != ("embed", "query_prefix")}
    flat["embed.model"] = resolved.get("model")
    flat["embed.passage_prefix"] = resolved.get("passage_prefix")
    flat["anchors.threshold"] = resolved.get("anchor_threshold")
    return flat


def run_lineage(run: dict) -> tuple[str, dict]:
    """(lineage id, settings) of a committed run's manifest; a run committed before lineages were recorded has
    the id "" and settings computed from its config and resolved values."""
    lineage = run.get("lineage") or {}
    return lineage.get("id", ""), lineage.get("settings") or lineage_settings(run.get("config", {}),
                                                                              run.get("resolved", {}))


def choose_lineage(runs: list[dict], settings: dict, run_id: str, new_lineage: bool, output: str
                   ) -> tuple[str, list[dict]]:
    """The lineage an incremental run joins, and the committed runs of it (whose shards are not mined again).

    The latest committed run decides: equal settings join its lineage; other settings are refused unless
    ``new_lineage``, which starts the lineage ``run_id`` with no runs (every shard is mined again).

    Raises:
        LineageError: the settings differ and ``new_lineage`` is off; the message names what differs.
    """
    if not runs:
        return run_id, []
    lineage_id, latest = run_lineage(runs[-1])
    # A key the earlier run does not record came into pairmine after it was mined (chunk.max_chars): not a
    # difference the user made, so it does not end the lineage.
    diffs = [f"{k}: {latest.get(k)!r} then, {v!r} now" for k, v in settings.items() if k in latest and latest[k] != v]
    if diffs and not new_lineage:
        raise LineageError(
            f"{output} holds runs mined with other settings (latest: {runs[-1].get('run_id')}; {'; '.join(diffs[:4])}"
            f"{'; ...' if len(diffs) > 4 else ''}): adding this run would mix vector spaces in the union of its runs. "
            "Use the same settings, another --output, or --new-lineage to start a new lineage here (every shard is "
            "mined again)")
    if diffs:
        log.info("a new lineage %s starts in %s (%s)", run_id, output, "; ".join(diffs[:4]))
        return run_id, []
    return lineage_id, [r for r in runs if run_lineage(r)[0] == lineage_id]


def committed_runs(output: str, storage) -> list[dict]:
    """The committed mine runs under ``output`` (folders with a ``_SUCCESS`` marker), oldest commit first: each the
    run's manifest plus ``run_dir``. Uncommitted (running, interrupted) run folders and the runs of other commands
    (negatives, filter-pairs: :func:`pipeline.run_folder.run_kind`) are left out.

    Raises:
        StorageError: the listing or a manifest cannot be read.
    """
    runs = []
    for folder in storage.ls(output):
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith((".", "_")) or not storage.exists(f"{folder}/{SUCCESS_MARKER}"):
            continue
        try:
            manifest = read_json(storage, f"{folder}/manifest.json")
        except FileNotFoundError:
            continue
        if run_kind(folder, manifest, storage) == "mine":  # an output may hold negatives or filter-pairs runs too
            runs.append({**manifest, "run_dir": folder})
    return sorted(runs, key=lambda m: (m.get("committed_utc") or m.get("created_utc") or "", m.get("run_id", "")))


def before_filter_figures(total: Counter, processed: int, eligible: int) -> dict:
    """The paper's figures (seed 000) over every mined group, kept or dropped by the consistency filter: the xPRT
    figures, comparable to the paper's, which has no filter. With the filter off they equal the top-level figures.

    Args:
        total: merged write-operator counts (``groups_mined``, ``docs_with_groups_mined``, ``passages_in_groups_mined``,
            ``passages``).
        processed: documents not skipped; eligible: documents with enough passages (with groups + no_anchor).

    Returns:
        docs_with_groups, docs_with_groups_pct (of processed), docs_with_groups_pct_of_eligible, groups,
        groups_per_doc (per document with groups), groups_per_processed_doc, passages_in_groups,
        passage_coverage_pct (of all passages).
    """
    with_g, groups = int(total["docs_with_groups_mined"]), int(total["groups_mined"])
    covered, passages = int(total["passages_in_groups_mined"]), int(total["passages"])
    # A document whose groups were all dropped is "without groups" after the filter but not before it.
    eligible += int(total.get("docs_without_groups_by_reason.consistency_filter", 0))
    return {
        "docs_with_groups": with_g,
        "docs_with_groups_pct": round(100.0 * with_g / processed, 3) if processed else 0.0,
        "docs_with_groups_pct_of_eligible": round(100.0 * with_g / eligible, 3) if eligible else 0.0,
        "groups": groups,
        "groups_per_doc": round(groups / with_g, 4) if with_g else 0.0,
        "groups_per_processed_doc": round(groups / processed, 4) if processed else 0.0,
        "passages_in_groups": covered,
        "passage_coverage_pct": round(100.0 * covered / passages, 3) if passages else 0.0,
    }


def build_stats(total: Counter, hists: dict, cfg: MineConfig, docs_expected: int, elapsed_s: float) -> dict:
    """stats.json: the paper's figures (seed 000: % documents with groups, groups per document, % passages
    covered), every drop by reason, and histograms.

    Raises:
        RuntimeError: when the counts do not reconcile (docs_in = with + without + skipped, and docs_in equals the
            number of input rows): a document vanished or was counted twice.
    """
    from pairmine.operators.read import SKIP_REASONS
    from pairmine.operators.related import NO_ANCHOR, NO_PASSAGES, TOO_FEW_PASSAGES
    from pairmine.operators.write import CENTRALITY_BINS, N_ABOVE_BINS

    skipped = {r: int(total.get(f"docs_skipped.{r}", 0)) for r in SKIP_REASONS}
    reasons = (NO_PASSAGES, TOO_FEW_PASSAGES, NO_ANCHOR, "consistency_filter")
    without = {r: int(total.get(f"docs_without_groups_by_reason.{r}", 0)) for r in reasons}
    docs_in = int(total["docs_in"])
    with_g, without_g = int(total["docs_with_groups"]), int(total["docs_without_groups"])
    processed = with_g + without_g
    passages, groups = int(total["passages"]), int(total["groups"])
    eligible = with_g + without["no_anchor"]
    stats = {
        "docs_in": docs_in,
        "docs_skipped": skipped,
        "docs_skipped_total": sum(skipped.values()),
        "docs_text_repaired": int(total["docs_text_repaired"]),  # invalid UTF-8 / lone surrogates -> U+FFFD
        "docs_processed": processed,
        "docs_with_groups": with_g,
        "docs_without_groups": without_g,
        "docs_without_groups_by_reason": without,
        "docs_truncated": int(total["docs_truncated"]),
        "docs_cut_max_chars": int(total["docs_cut_max_chars"]),
        "groups": groups,
        "passages": passages,
        "passages_in_groups": int(total["passages_in_groups"]),
        "passages_short_dropped": int(total["passages_short_dropped"]),
        "passages_duplicate_dropped": int(total["passages_duplicate_dropped"]),
        "passages_truncated": int(total["passages_truncated"]),
        "chars_truncated": int(total["chars_truncated"]),
        "chars_cut_max_chars": int(total["chars_cut_max_chars"]),
        "passages_token_split": int(total["passages_token_split"]),
        "passages_token_truncated": int(total["passages_token_truncated"]),
        "passages_vector_reused": int(total["passages_vector_reused"]),
        "anchors": int(total["anchors"]),
        "anchor_threshold": cfg.resolved_threshold(),
        "groups_per_doc": round(groups / with_g, 4) if with_g else 0.0,
        "groups_per_processed_doc": round(groups / processed, 4) if processed else 0.0,
        "docs_with_groups_pct": round(100.0 * with_g / processed, 3) if processed else 0.0,
        "docs_with_groups_pct_of_eligible": round(100.0 * with_g / eligible, 3) if eligible else 0.0,
        "passage_coverage_pct": round(100.0 * total["passages_in_groups"] / passages, 3) if passages else 0.0,
        "anchor_rate_pct": round(100.0 * total["anchors"] / passages, 3) if passages else 0.0,
        "centrality_histogram": {
            "bin_edges": [round(float(x), 4) for x in CENTRALITY_BINS],
            "counts": hists.get("centrality_histogram", [0] * (len(CENTRALITY_BINS) - 1)),
        },
        "groups_mined": int(total["groups_mined"]),
        "groups_dropped_consistency": int(total["groups_dropped_consistency"]),
        "consistency_keep_rate_pct": (
            round(100.0 * groups / total["groups_mined"], 3) if total["groups_mined"] else 0.0
        ),
        "n_above_histogram": {
            "bin_edges": [int(x) for x in N_ABOVE_BINS[:-1]] + ["inf"],
            "counts": hists.get("n_above_histogram", [0] * (len(N_ABOVE_BINS) - 1)),
        },
        "groups_per_doc_histogram": {
            "note": "index i = processed documents with i groups; the last entry counts 32 or more",
            "counts": hists.get("groups_per_doc_histogram", []),
        },
        "elapsed_s": round(elapsed_s, 2),
        "docs_per_s": round(docs_in / elapsed_s, 3) if elapsed_s else 0.0,
        "passages_per_s": round(passages / elapsed_s, 3) if elapsed_s else 0.0,
    }
    stats["figures_note"] = (
        "docs_with_groups*, groups, groups_per_doc* and passage_coverage_pct count the groups kept by the consistency "
        "filter; before_consistency_filter holds the same figures over every mined group (kept + dropped), the ones "
        "comparable to seed 000, which has no filter"
    )
    stats["before_consistency_filter"] = before_filter_figures(total, processed, eligible)
    stats["reconciled"] = docs_in == processed + stats["docs_skipped_total"] and docs_in == docs_expected
    if not stats["reconciled"]:
        raise RuntimeError(
            f"counts do not reconcile: docs_in={docs_in}, input rows={docs_expected}, with={with_g}, "
            f"without={without_g}, skipped={stats['docs_skipped_total']}"
        )
    return stats


def _shard_dict(shard, content_sha256: str = "") -> dict:
    return {"shard_index": shard.index, "path": shard.path, "format": shard.format, "size": shard.size,
            "fingerprint": shard.fingerprint, "key": shard.key, **({"sha256": content_sha256} if content_sha256 else {})}


def _uploaded_again(shard, hashes_by_place: dict[tuple, set], storage) -> bool:
    """True when ``shard`` is an object uploaded in parts whose (path, size) has content hashes recorded by the
    lineage's runs (``hashes_by_place``) and its bytes hash to one of them: the same content under a new ETag
    (re-uploaded with another part size), so it is not mined again. Only such shards are read here."""
    if not is_multipart_etag(shard.fingerprint):
        return False
    known = hashes_by_place.get((shard.path, shard.size))
    if not known:
        return False
    digest = content_sha256(shard.path, storage)
    if digest in known:
        log.info("incremental: %s was uploaded again with the same bytes (%s, new ETag %s): already mined",
                 shard.path, digest[:19], shard.fingerprint[5:])
        return True
    return False


def _select_shards(cfg: MineConfig, shards: list, storage, out: str, run_id: str) -> tuple[list, str, dict]:
    """The shards this run mines, its lineage id and lineage settings. A run joins the lineage of the latest committed
    run in the output when its settings are equal; an incremental run with other settings is refused unless asked
    for a new lineage; a full run with other settings starts one. With ``input.incremental``, shards that a
    committed run of the lineage already mined (same key, or a multipart object uploaded again with the same bytes)
    are left out and the rest re-indexed from 0.

    Raises:
        LineageError: see :func:`choose_lineage`.
    """
    settings = lineage_settings(cfg.to_dict(), {"model": model_id(cfg), "passage_prefix": cfg.resolved_prefix(),
                                                "anchor_threshold": cfg.resolved_threshold()})
    lineage_id, runs = choose_lineage(committed_runs(out, storage), settings, run_id,
                                      cfg.input.new_lineage or not cfg.input.incremental, cfg.output.path)
    if not cfg.input.incremental:
        return shards, lineage_id, settings
    mined = {s["key"] for run in runs for s in run.get("inputs", [])}
    hashes_by_place: dict[tuple, set] = {}  # (path, size) -> content hashes recorded for multipart objects
    for run in runs:
        for s in run.get("inputs", []):
            if s.get("sha256"):
                hashes_by_place.setdefault((s.get("path"), s.get("size")), set()).add(s["sha256"])
    new = [s for s in shards if s.key not in mined and not _uploaded_again(s, hashes_by_place, storage)]
    log.info("incremental: %d of %d input shard(s) not yet mined by a committed run of lineage %s under %s",
             len(new), len(shards), lineage_id, out)
    return [dataclasses.replace(s, index=i) for i, s in enumerate(new)], lineage_id, settings


def _fit_tfidf(cfg: MineConfig, passages: list[str]):
    """The run's TF-IDF, its IDF fitted on the passages of the first pass's seeded sample of documents (chunked like
    every document, on the workers: ``ScanParams.sample_chunk``).

    Returns:
        (CorpusTfidf, number of sample passages, a warning for the manifest or None). With no usable word in the
        whole sample (e.g. every document skipped) there are no IDF statistics: every word is unseen and weighs the
        same (idf 1), so lexical scores are term-frequency cosines; said in the log and the manifest.
    """
    from pairmine.operators.related import EmptySampleError, fit_tfidf, unfitted_tfidf

    try:
        return fit_tfidf(passages, cfg.tfidf.max_features, cfg.tfidf.sublinear_tf), len(passages), None
    except EmptySampleError as e:
        log.warning("%s; lexical (TF-IDF) scores will use no IDF (every word weighs the same)", e)
        return unfitted_tfidf(cfg.tfidf.sublinear_tf), len(passages), str(e)


def _mining_stages(cfg: MineConfig, stage_plan, tfidf, folder: RunFolder, first, figures: list, hint: str
                   ) -> tuple[list[Stage], int | None]:
    """The streaming pass's stages (read, chunk, embed, centrality, related, [consistency], write) and the pool
    size. With the consistency filter on, the pool (the first pass's seeded candidates) is embedded here with the
    run's embed stage and put in Ray's object store; the main pass then takes a passage's vector from the pool when
    the pool pass already computed it (keyed by the prefixed text) instead of embedding it twice."""
    import ray

    from pairmine.operators.embed import known_vectors

    c, batch = cfg.consistency, cfg.ray.docs_per_batch
    actors, threads, device = stage_plan.embed_actors, stage_plan.threads, stage_plan.device
    light = stage_plan.light_cpus

    def embed(known=None):
        return Stage("embed", partial(_make_embed, cfg, threads, device, known), batch_size=batch, actors=actors,
                     num_cpus=stage_plan.embed_cpus, num_gpus=stage_plan.embed_gpus)

    stages = [
        Stage("read", partial(_make_read, cfg), batch_size=1, num_cpus=light),
        Stage("chunk", partial(_make_chunk, cfg), batch_size=batch, num_cpus=light),
        embed(),
        Stage("centrality", _make_centrality, batch_size=batch, num_cpus=light),
        Stage("related", partial(_make_related, cfg, tfidf), batch_size=batch, num_cpus=light),
    ]
    pool_size = None
    if c.enabled:
        t_pool = time.time()
        pool_texts: list[str] = []  # the pool passages in the order of pool_vectors' rows
        pool_vectors, pool_hashes = embed_pool(first.pool_passages, first.pool_hashes, stages[2],
                                               cfg.ray.stall_warn_s, cfg.ray.stall_limit_s, hint, pool_texts, figures)
        pool_size = len(pool_vectors)
        pool_ref = ray.put((pool_vectors, pool_hashes))
        keys, rows, _ = known_vectors([cfg.resolved_prefix() + p for p in pool_texts], pool_vectors)
        stages[2] = embed((ray.put((keys, rows)), pool_ref))
        if pool_size == 0:
            log.warning("the consistency pool is empty (the input has no usable passage): every group will be kept")
        log.info("consistency pool: %d passages embedded in %.1f s (asked for %d; k = %d); the main pass reuses "
                 "their vectors", pool_size, time.time() - t_pool, c.pool_size, c.k)
        stages.append(Stage("consistency", partial(_make_filter, pool_ref, c.k, device, c.chunk_mb),
                            batch_size=batch, actors=stage_plan.filter_actors, num_cpus=light,
                            num_gpus=stage_plan.filter_gpus))
    stages.append(Stage("write", partial(_make_write, folder.staging, folder.run_id, model_id(cfg),
                                         cfg.resolved_threshold(), pool_size, c.k if c.enabled else None,
                                         folder.parts.side is not None, folder.storage, cfg.resolved_prefix()),
                        batch_size=batch, num_cpus=light))
    return stages, pool_size


def mine(cfg: MineConfig) -> MineResult:
    """Run the main job with a validated config. Returns the run folder and its stats.

    Exactly once (:mod:`pipeline.run_folder`): every work unit is recorded as soon as all its documents are staged,
    and every input shard's part is committed on its own (part, then its commit record under ``_state/``) as soon as
    all its units are; a re-run with the same run id checks that inputs and config are unchanged, keeps the committed
    shards and recorded units, and mines the rest; ``stats.json``, ``manifest.json`` and the ``_SUCCESS`` marker come
    last, then the ``_latest.json`` pointer beside the runs. With ``input.incremental``, shards that a committed run
    under ``output.path`` already mined (same path, size and ETag/content hash) are left out; when none is left, no
    run folder is made and ``MineResult.run_dir`` is None.

    Raises:
        FileNotFoundError: no input. InputError: an input file is unusable. MissingColumnError: a shard lacks the
        text or id column. ConfigError: the model cannot be loaded, the output path is a file.
        RunExistsError: the run id names a committed run, or a run started with other inputs or config.
        StorageError: a read or write failed for good (not transient, or still failing after the retries).
    """
    import joblib

    from pairmine.operators.write import GROUP_SCHEMA, STAGING_SORT_COLUMN

    t0 = time.time()
    storage, c = cfg.storage_layer(), cfg.consistency
    run_id = cfg.output.run_id or new_run_id()
    folder = RunFolder(cfg.output.path, run_id, storage,
                       Parts("groups", "groups", "docs_in", GROUP_SCHEMA, (STAGING_SORT_COLUMN, "anchor_index"),
                             "dropped" if c.enabled and c.side_output else None))
    # Everything that can be checked cheaply is checked before Ray starts and before the run folder exists.
    folder.check_output()
    found = discover_shards(cfg.input.path, cfg.input.format, storage)
    check_model(cfg, needs_threshold=True)
    shards, lineage_id, settings = _select_shards(cfg, found, storage, folder.output, run_id)
    if not shards:
        return MineResult(run_dir=None, stats={"docs_in": 0, "shards_in": len(found), "shards_new": 0})
    plan = {"run_id": run_id, "inputs": [_shard_dict(s) for s in shards], "config": result_config(cfg)}
    prior = folder.check_new(plan)
    layout: dict[int, list[int]] = {}
    known_rows = check_parquet_shards(shards, (cfg.input.text_column, cfg.input.id_column), storage, layout=layout)
    where = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    configure_data(cfg.ray.target_block_mb)
    stage_plan = plan_for(cfg, c.num_actors, c.enabled)
    phases = {"start": time.time() - t0}  # wall seconds of each phase of the run (stats.json "phases_s")
    log.info("run %s -> %s: %d input shard(s) from %s; Ray %s", run_id, folder.dir, len(shards),
             cfg.input.path or "the shipped sample", where)
    log.info("stage plan: %s", stage_plan.describe())

    # ---- first pass: ids (duplicates), layout (work units), seeded text sample (IDF) -----------------------------
    # A resumed run repeats it over all shards: duplicates, the IDF and the pool depend on the whole input, and
    # the pass is seeded, so it gives the first attempt's results again. One task per row group; ids go to
    # hash-range indexes on the workers, never to the driver (pipeline.first_pass).
    chunk_spec = cfg.chunk_spec()
    pool_spec = (PoolSpec(c.pool_size, c.seed, sample_cut(c.pool_size, known_rows), known_rows, chunk_spec)
                 if c.enabled else None)
    first = first_pass(shards, layout, ScanParams(cfg.input.text_column, cfg.input.id_column, cfg.tfidf.sample_docs,
                                                  cfg.tfidf.seed, sample_cut(cfg.tfidf.sample_docs, known_rows),
                                                  pool_spec, storage, cfg.input.skip_duplicate_texts, chunk_spec),
                       f"{folder.staging}/duplicates")
    tfidf, sample_passages, tfidf_note = _fit_tfidf(cfg, [p for passages in first.sample for p in passages])
    phases["first_pass"] = time.time() - t0 - sum(phases.values())
    log.info(
        "first pass: %d documents in %d work unit(s), %d duplicate id(s) and %d duplicate text(s) under other ids "
        "(found in %d hash range(s) on the workers), %.1f s; TF-IDF fitted on %d passages (vocabulary %d)",
        first.docs, len(first.units), first.duplicates, first.duplicate_texts, first.ranges, first.figures["wall_s"],
        sample_passages, len(tfidf.vocabulary),
    )

    # ---- the run folder: plan, or what an earlier attempt committed and recorded -----------------------------------
    todo = folder.open(plan, first.units, first.unit_rows, "run")
    buf = io.BytesIO()
    joblib.dump(tfidf, buf)
    storage.write_bytes(f"{folder.dir}/tfidf.joblib", buf.getvalue())
    figures = [first.figures]  # per-stage wall/busy/CPU seconds and rows, in pipeline order (stats.json "stages")

    # ---- the streaming pass: one row per document from read to write, a commit per shard ---------------------------
    uncommitted = [s for s in shards if s.index not in folder.records]
    pool_size = None
    if uncommitted:
        hint = (f"the shards committed so far stay in {folder.dir}: run the same command with --run-id {run_id} to "
                "resume once the cluster has room (or raise ray.stall_limit_s)")
        t_pool = time.time()
        stages, pool_size = _mining_stages(cfg, stage_plan, tfidf, folder, first, figures, hint)
        if c.enabled:  # embedding the consistency pool, before the main pass
            phases["pool"] = time.time() - t_pool
        t_main = time.time()
        log.info("mining %d shard(s) with %s (prefix %r, anchor threshold %.3f from %s): %d embed actor(s) on %s, "
                 "%d thread(s) each", len(uncommitted), model_id(cfg), cfg.resolved_prefix(),
                 cfg.resolved_threshold(), cfg.threshold_source(), stage_plan.embed_actors, stage_plan.device,
                 stage_plan.threads)
        folder.stream(stages, [_shard_dict(s) | {"index": s.index, "pool_size": pool_size} for s in uncommitted],
                      todo, first.unit_rows,
                      Progress(sum(first.unit_rows[unit_key(u)] for u in todo)), cfg.ray.stall_warn_s,
                      cfg.ray.stall_limit_s, hint, figures, stage_plan.light_cpus)
        phases["main_pass"] = time.time() - t_main
    elif c.enabled:  # every shard was committed by an earlier attempt
        pool_size = next((r.get("pool_size") for r in folder.records.values() if r.get("pool_size") is not None), None)

    # ---- commit: stats, manifest, then the success marker, then the pointer to the newest run --------------------
    records = folder.records
    total, hists = folder.committed_stats(shards)
    stats = build_stats(total, hists, cfg, first.docs, time.time() - t0)
    stats.update(run_id=run_id, consistency_enabled=c.enabled, shards=len(shards),
                 shards_resumed=len(shards) - len(uncommitted), units=len(first.units),
                 units_resumed=len(first.units) - len(todo), stages=figures,
                 phases_s={k: round(v, 2) for k, v in phases.items()})
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {
        "run_id": run_id, "job": "mine",
        "created_utc": (prior or {}).get("created_utc") or now,
        "committed_utc": now,
        "config": cfg.to_dict(),
        "resolved": {"model": model_id(cfg), "passage_prefix": cfg.resolved_prefix(),
                     "anchor_threshold": cfg.resolved_threshold(), "anchor_threshold_source": cfg.threshold_source(),
                     "embed_actors": stage_plan.embed_actors, "embed_device": stage_plan.device,
                     "embed_threads": stage_plan.threads, "ray": where, "stage_plan": stage_plan.describe()},
        "lineage": {"id": lineage_id, "settings": settings},
        "inputs": [_shard_dict(s, first.content_hashes.get(s.index, "")) for s in shards],
        "shards": [
            {"shard_index": s.index, "path": s.path, "part": records[s.index]["part"],
             "groups": records[s.index]["rows"], "status": "committed",
             "committed_utc": records[s.index]["committed_utc"]}
            for s in shards
        ],
        "consistency": {"enabled": c.enabled, "pool_size": pool_size, "pool_size_requested": c.pool_size, "k": c.k,
                        "seed": c.seed, "side_output": "dropped/" if folder.parts.side else None},
        "tfidf": {"file": "tfidf.joblib", "sample_docs": cfg.tfidf.sample_docs, "sample_passages": sample_passages,
                  "vocabulary": len(tfidf.vocabulary), "unseen_word_idf": round(tfidf.unseen_idf, 6),
                  "seed": cfg.tfidf.seed, "warning": tfidf_note},
        "versions": software_versions(),
        "host": platform.node(),
        "pid": os.getpid(),
    }
    folder.finalize(stats, manifest, {
        "format": 1, "run_id": run_id, "run_dir": folder.dir, "groups": f"{folder.dir}/groups/", "committed_utc": now,
        "groups_count": stats["groups"], "shards": len(shards),
    })
    _log_done(cfg, stats, pool_size, folder.dir)
    return MineResult(run_dir=folder.dir, stats=stats)


def _log_done(cfg: MineConfig, stats: dict, pool_size: int | None, run_dir: str) -> None:
    """The final log lines of a mining run: the paper's figures after and before the consistency filter, the
    per-stage figures, and a warning when passages were cut at embed.max_length."""
    c = cfg.consistency
    kept = (f"; consistency filter kept {stats['consistency_keep_rate_pct']:.1f}% of {stats['groups_mined']} groups "
            f"(n_above < {c.k} against {pool_size} pool passages)") if c.enabled else ""
    after = " after the consistency filter" if c.enabled else ""
    log.info(
        "done in %.1f s: %d groups from %d documents (%s%.1f%% of processed documents have groups, %.2f groups per "
        "document with groups, %.1f%% of passages covered)%s; %d skipped -> %s",
        stats["elapsed_s"], stats["groups"], stats["docs_in"], after.strip() + ": " if after else "",
        stats["docs_with_groups_pct"], stats["groups_per_doc"], stats["passage_coverage_pct"], kept,
        stats["docs_skipped_total"], run_dir,
    )
    if c.enabled:
        b = stats["before_consistency_filter"]
        log.info(
            "before the consistency filter (the paper's figures, seed 000: 99%% / 7.0 / 68%%): %d groups, %.1f%% of "
            "processed documents have groups, %.2f groups per document with groups, %.1f%% of passages covered",
            b["groups"], b["docs_with_groups_pct"], b["groups_per_doc"], b["passage_coverage_pct"],
        )
    reused = stats.get("passages_vector_reused", 0)
    for line in timing_lines(stats.get("phases_s") or {}, stats["stages"],
                             f"passages embedded in the main pass {stats['passages'] - reused}, taken from the pool's "
                             f"pass {reused}"):
        log.info("%s", line)
    if stats["passages_token_truncated"]:
        log.warning("%d of %d passages were longer than embed.max_length = %d tokens: the model saw only their start "
                    "(passages_token_truncated in stats.json); set chunk.fit_model_length=true, lower "
                    "chunk.max_words or raise embed.max_length",
                    stats["passages_token_truncated"], stats["passages"], cfg.embed.max_length)
