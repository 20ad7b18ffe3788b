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
import json
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
    Stage, apply_stage, configure_data, format_stage_figures, init_ray, plan_for, stage_figures, watched,
)

log = logging.getLogger("pairmine")

STATE_DIR = "_state"  # plan.json (inputs + config of the first attempt) and one commit record per committed shard
LATEST_POINTER = "_latest.json"  # beside the run folders: the most recently committed run (format 1, see README)


class RunExistsError(RuntimeError):
    """The run folder already holds a committed run (a ``_SUCCESS`` marker)."""


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

    return Chunker(cfg.chunk.max_words, cfg.chunk.min_words, cfg.chunk.max_passages, cfg.token_limit())


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

    per_row = 256
    rows = [{"passages": passages[i : i + per_row], "hashes": doc_hashes[i : i + per_row].tolist()}
            for i in range(0, len(passages), per_row)]
    if not rows:
        return np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
    ds = apply_stage(ray.data.from_items(rows, override_num_blocks=len(rows)), embed_stage)
    mats, hashes = [], []
    done = lambda: f"{sum(len(m) for m in mats)} / {len(passages)} pool passages embedded"  # noqa: E731
    for batch in watched(ds.iter_batches(batch_size=None, batch_format="pyarrow"), [embed_stage], done,
                         stall_warn_s, stall_limit_s, hint):
        matrix, _ = vector_matrix(batch.column("vectors"))
        mats.append(matrix.copy())
        hashes.append(batch.column("hashes").combine_chunks().flatten().to_numpy(zero_copy_only=False))
        if texts_out is not None:
            texts_out.extend(batch.column("passages").combine_chunks().flatten().to_pylist())
    if figures_out is not None:
        figures_out.extend(stage_figures(ds, "pool: "))
    return np.concatenate(mats), np.concatenate(hashes).astype(np.int64)


def commit_shard(run_dir: str, shard: dict, stats: dict, side_output: bool, storage) -> dict:
    """Make one input shard's output visible: compact its staging files into ``groups/part-NNNNN.parquet`` (and
    ``dropped/``), check the part against the write stage's count, then write the shard's commit record
    ``_state/shard-NNNNN.json`` (the shard's counts; its existence is what "committed" means). Runs as a Ray task.

    Raises:
        RuntimeError: the part holds another number of groups than the write stage counted.
        StorageError: a staging file, the part or the record cannot be read or written.
    """
    from pairmine.operators.write import compact_shard

    i = shard["index"]
    path, n, dup = compact_shard(f"{run_dir}/_staging/groups", f"{run_dir}/groups", i, storage=storage)
    if n != stats.get("groups", 0):
        raise RuntimeError(f"shard {i} ({shard['path']}): part holds {n} groups, the write stage counted "
                           f"{stats.get('groups', 0)}")
    dropped = None
    if side_output:
        _, dropped, _ = compact_shard(f"{run_dir}/_staging/dropped", f"{run_dir}/dropped", i, storage=storage)
    record = {"shard_index": i, "path": shard["path"], "key": shard["key"], "part": f"groups/{path.rsplit('/', 1)[-1]}",
              "groups": n, "dropped_groups": dropped, "staged_twice": dup, "pool_size": shard.get("pool_size"),
              "stats": stats,
              "committed_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    write_json(storage, f"{run_dir}/{STATE_DIR}/shard-{i:05d}.json", record)
    return record


def read_json(storage, path: str):
    return json.loads(storage.read_bytes(path))


def write_json(storage, path: str, obj) -> None:
    """Write ``obj`` as indented JSON, atomically (readers see the old or the whole new file)."""
    storage.write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


# Config sections/keys that do not change a run's groups: a resumed run may change them.
_NOT_RESULT_KEYS = {"output", "ray", "storage"}
_NOT_RESULT_FIELDS = {("input", "incremental"), ("input", "new_lineage"), ("embed", "num_actors"), ("embed", "threads"),
                      ("embed", "device"), ("consistency", "num_actors"), ("consistency", "chunk_mb"),
                      ("embed", "batch_size")}


def result_config(cfg: MineConfig) -> dict:
    """The part of the config that decides a run's groups (a resumed run must match it)."""
    d = cfg.to_dict()
    return {sec: {k: v for k, v in vals.items() if (sec, k) not in _NOT_RESULT_FIELDS}
            for sec, vals in d.items() if sec not in _NOT_RESULT_KEYS}


def check_resume(plan: dict, prior: dict, run_id: str) -> None:
    """Refuse to resume run ``run_id`` when its inputs or result-deciding config differ from the first attempt's.

    Raises:
        RunExistsError: naming what differs.
    """
    if [s["key"] for s in prior["inputs"]] != [s["key"] for s in plan["inputs"]]:
        old = {s["key"] for s in prior["inputs"]}
        new = {s["key"] for s in plan["inputs"]}
        changed = sorted(k.split("|")[0] for k in old ^ new)[:3]
        raise RunExistsError(
            f"run {run_id} was started on other input shards ({len(prior['inputs'])} then, {len(plan['inputs'])} now; "
            f"differing: {', '.join(changed) or 'their order'}); resume it with the same input, or use a new --run-id")
    diffs = [f"{sec}.{k}" for sec, vals in plan["config"].items() for k, v in vals.items()
             if prior["config"].get(sec, {}).get(k) != v]
    if diffs:
        raise RunExistsError(f"run {run_id} was started with another config ({', '.join(diffs[:5])} differ); resume it "
                             "with the same config, or use a new --run-id")


LINEAGE_SECTIONS = ("chunk", "embed", "anchors", "related", "consistency", "tfidf")


class LineageError(ConfigError):
    """An incremental run whose group-deciding settings differ from the latest committed run's in the output."""


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
    diffs = [f"{k}: {latest.get(k)!r} then, {v!r} now" for k, v in settings.items() if latest.get(k) != v]
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
    """The committed runs under ``output`` (folders with a ``_SUCCESS`` marker), oldest commit first: each the run's
    manifest plus ``run_dir``. Uncommitted (running, interrupted) run folders are left out.

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
        runs.append({**manifest, "run_dir": folder})
    return sorted(runs, key=lambda m: (m.get("committed_utc") or m.get("created_utc") or "", m.get("run_id", "")))


def merge_stats(parts: list[dict]) -> tuple[Counter, dict[str, list[int]]]:
    """Add up the write operator's per-batch counts; histograms (lists) are added element-wise.

    Returns:
        (counts, histograms).
    """
    total: Counter = Counter()
    hists: dict[str, list[int]] = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, list):
                hists[k] = [a + b for a, b in zip(hists[k], v)] if k in hists else list(v)
            else:
                total[k] += v
    return total, hists


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
        "groups": groups,
        "passages": passages,
        "passages_in_groups": int(total["passages_in_groups"]),
        "passages_short_dropped": int(total["passages_short_dropped"]),
        "passages_duplicate_dropped": int(total["passages_duplicate_dropped"]),
        "passages_truncated": int(total["passages_truncated"]),
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


def mine(cfg: MineConfig) -> MineResult:
    """Run the main job with a validated config. Returns the run folder and its stats.

    Exactly once: every input shard's part is committed on its own (part, then its commit record under
    ``_state/``) as soon as all its documents are written; a re-run with the same run id checks that inputs and
    config are unchanged, skips the committed shards and mines the rest; ``stats.json``, ``manifest.json`` and the
    ``_SUCCESS`` marker come last, then the ``_latest.json`` pointer beside the runs. With ``input.incremental``,
    shards that a committed run under ``output.path`` already mined (same path, size and ETag/content hash) are left
    out; when none is left, no run folder is made and ``MineResult.run_dir`` is None.

    Raises:
        FileNotFoundError: no input. InputError: an input file is unusable. MissingColumnError: a shard lacks the
        text or id column. ConfigError: the model cannot be loaded, the output path is a file.
        RunExistsError: the run id names a committed run, or a run started with other inputs or config.
        StorageError: a read or write failed for good (not transient, or still failing after the retries).
    """
    import joblib
    import ray

    from pairmine.operators.embed import known_vectors

    t0 = time.time()
    storage = cfg.storage_layer()
    out = cfg.output.path.rstrip("/") or "."
    if (storage.info(out) or {}).get("type") == "file":
        raise ConfigError(f"output.path = {cfg.output.path!r} is a file; it must be a folder (created if missing)")
    # Everything that can be checked cheaply is checked before Ray starts and before the run folder exists.
    shards = discover_shards(cfg.input.path, cfg.input.format, storage)
    check_model(cfg, needs_threshold=True)
    run_id = cfg.output.run_id or new_run_id()
    settings = lineage_settings(cfg.to_dict(), {"model": model_id(cfg), "passage_prefix": cfg.resolved_prefix(),
                                                "anchor_threshold": cfg.resolved_threshold()})
    # A run joins the lineage of the latest committed run in the output when its settings are equal; an incremental
    # run with other settings is refused unless asked for a new lineage; a full run with other settings starts one.
    lineage_id, runs = choose_lineage(committed_runs(out, storage), settings, run_id,
                                      cfg.input.new_lineage or not cfg.input.incremental, cfg.output.path)
    if cfg.input.incremental:
        mined = {s["key"] for run in runs for s in run.get("inputs", [])}
        hashes_by_place: dict[tuple, set] = {}  # (path, size) -> content hashes recorded for multipart objects
        for run in runs:
            for s in run.get("inputs", []):
                if s.get("sha256"):
                    hashes_by_place.setdefault((s.get("path"), s.get("size")), set()).add(s["sha256"])
        new = [s for s in shards if s.key not in mined and not _uploaded_again(s, hashes_by_place, storage)]
        log.info("incremental: %d of %d input shard(s) not yet mined by a committed run of lineage %s under %s",
                 len(new), len(shards), lineage_id, out)
        if not new:
            return MineResult(run_dir=None, stats={"docs_in": 0, "shards_in": len(shards), "shards_new": 0})
        shards = [dataclasses.replace(s, index=i) for i, s in enumerate(new)]
    run_dir = f"{out}/{run_id}"
    if storage.exists(f"{run_dir}/{SUCCESS_MARKER}"):
        raise RunExistsError(
            f"run {run_id} in {cfg.output.path} is already committed ({run_dir}/{SUCCESS_MARKER}); "
            "choose another --run-id, or leave it out for a new one"
        )
    plan = {"run_id": run_id, "inputs": [_shard_dict(s) for s in shards], "config": result_config(cfg)}
    prior = read_json(storage, f"{run_dir}/{STATE_DIR}/plan.json") if storage.exists(
        f"{run_dir}/{STATE_DIR}/plan.json") else None
    if prior is not None:
        check_resume(plan, prior, run_id)
    staging = f"{run_dir}/_staging"
    layout: dict[int, list[int]] = {}
    known_rows = check_parquet_shards(shards, (cfg.input.text_column, cfg.input.id_column), storage, layout=layout)
    where = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    configure_data(cfg.ray.target_block_mb)
    c = cfg.consistency
    stage_plan = plan_for(cfg, c.num_actors, c.enabled)
    log.info("run %s -> %s: %d input shard(s) from %s; Ray %s", run_id, run_dir, len(shards),
             cfg.input.path or "the shipped sample", where)
    log.info("stage plan: %s", stage_plan.describe())

    # ---- first pass: ids (duplicates), layout (work units), seeded text sample (IDF) -----------------------------
    # A resumed run repeats it over all shards: duplicates, the IDF and the pool depend on the whole input, and
    # the pass is seeded, so it gives the first attempt's results again. One task per row group; ids go to
    # hash-range indexes on the workers, never to the driver (pipeline.first_pass).
    if prior is None:
        storage.rm(staging)  # leftovers of an attempt killed before its plan was written
    cut = sample_cut(cfg.tfidf.sample_docs, known_rows)
    pool_spec = PoolSpec(c.pool_size, c.seed, sample_cut(c.pool_size, known_rows), known_rows, cfg.chunk.max_words,
                         cfg.chunk.min_words, cfg.chunk.max_passages, token_limit=cfg.token_limit()
                         ) if c.enabled else None
    first = first_pass(shards, layout, ScanParams(cfg.input.text_column, cfg.input.id_column, cfg.tfidf.sample_docs,
                                                  cfg.tfidf.seed, cut, pool_spec, storage,
                                                  cfg.input.skip_duplicate_texts), f"{staging}/duplicates")
    docs_expected = first.docs
    rows_per_shard = first.rows_per_shard
    units = first.units
    content_hashes = first.content_hashes
    from pairmine.operators.chunk import chunk_text
    from pairmine.operators.related import EmptySampleError, fit_tfidf, unfitted_tfidf

    sample_passages = [
        p for text in first.sample
        for p in chunk_text(text, cfg.chunk.max_words, cfg.chunk.min_words, cfg.chunk.max_passages,
                            cfg.token_limit()).passages
    ]
    try:
        tfidf = fit_tfidf(sample_passages, cfg.tfidf.max_features, cfg.tfidf.sublinear_tf)
        tfidf_note = None
    except EmptySampleError as e:
        # No usable word in the whole sample (e.g. every document skipped): no IDF statistics, every word is
        # unseen and weighs the same (idf 1), so lexical scores are term-frequency cosines; said in the log and the
        # manifest.
        log.warning("%s; lexical (TF-IDF) scores will use no IDF (every word weighs the same)", e)
        tfidf, tfidf_note = unfitted_tfidf(cfg.tfidf.sublinear_tf), str(e)

    # ---- the run folder: plan, committed shards of an earlier attempt, clean staging ------------------------------
    records: dict[int, dict] = {}
    if prior is None:
        storage.makedirs(run_dir)
        write_json(storage, f"{run_dir}/{STATE_DIR}/plan.json", plan)
    else:
        for path in storage.ls(f"{run_dir}/{STATE_DIR}"):
            if path.rsplit("/", 1)[-1].startswith("shard-") and path.endswith(".json"):
                rec = read_json(storage, path)
                records[rec["shard_index"]] = rec
        for s in shards:  # staging files of shards not committed are partial: they are written again
            if s.index not in records:
                storage.rm(f"{staging}/groups/shard-{s.index:05d}")
                storage.rm(f"{staging}/dropped/shard-{s.index:05d}")
        log.info("resuming run %s: %d of %d shard(s) already committed, %d to mine", run_id, len(records), len(shards),
                 len(shards) - len(records))
    buf = io.BytesIO()
    joblib.dump(tfidf, buf)
    storage.write_bytes(f"{run_dir}/tfidf.joblib", buf.getvalue())
    todo = [s for s in shards if s.index not in records]
    todo_units = [u for u in units if u["shard_index"] not in records]
    pool_passages, pool_hashes = (first.pool_passages, first.pool_hashes) if c.enabled and todo else ([], None)
    log.info(
        "first pass: %d documents in %d work unit(s), %d duplicate id(s) and %d duplicate text(s) under other ids "
        "(found in %d hash range(s) on the workers), %.1f s; TF-IDF fitted on %d passages (vocabulary %d)",
        docs_expected, len(units), first.duplicates, first.duplicate_texts, first.ranges, first.figures["wall_s"], len(sample_passages), len(tfidf.vocabulary),
    )
    figures = [first.figures]  # per-stage wall/busy/CPU seconds and rows, in pipeline order (stats.json "stages")
    del first

    # ---- the streaming pass: one row per document from read to write ---------------------------------------------
    actors, threads, device = stage_plan.embed_actors, stage_plan.threads, stage_plan.device
    batch = cfg.ray.docs_per_batch
    threshold = cfg.resolved_threshold()
    side_output = c.enabled and c.side_output
    pool_size = None
    stall_hint = (f"the shards committed so far stay in {run_dir}: run the same command with --run-id {run_id} to "
                  "resume once the cluster has room (or raise ray.stall_limit_s)")
    if todo:
        light, gpu_embed, gpu_filter = stage_plan.light_cpus, stage_plan.embed_gpus, stage_plan.filter_gpus
        embed_stage = Stage("embed", partial(_make_embed, cfg, threads, device), batch_size=batch, actors=actors,
                            num_cpus=stage_plan.embed_cpus, num_gpus=gpu_embed)
        stages = [
            Stage("read", partial(_make_read, cfg), batch_size=1, num_cpus=light),
            Stage("chunk", partial(_make_chunk, cfg), batch_size=batch, num_cpus=light),
            embed_stage,
            Stage("centrality", _make_centrality, batch_size=batch, num_cpus=light),
            Stage("related", partial(_make_related, cfg, tfidf), batch_size=batch, num_cpus=light),
        ]
        if c.enabled:
            t_pool = time.time()
            pool_texts: list[str] = []  # the pool passages in the order of pool_vectors' rows
            pool_vectors, pool_hashes = embed_pool(pool_passages, pool_hashes, embed_stage, cfg.ray.stall_warn_s,
                                                   cfg.ray.stall_limit_s, stall_hint, pool_texts, figures)
            pool_size = len(pool_vectors)
            pool_ref = ray.put((pool_vectors, pool_hashes))
            # The main pass takes a passage's vector from the pool when the pool pass already computed it (by the
            # prefixed text), instead of embedding it twice: on the sample, the pool is every passage.
            keys, rows, _ = known_vectors([cfg.resolved_prefix() + p for p in pool_texts], pool_vectors)
            stages[2] = Stage("embed", partial(_make_embed, cfg, threads, device, (ray.put((keys, rows)), pool_ref)),
                              batch_size=batch, actors=actors, num_cpus=stage_plan.embed_cpus, num_gpus=gpu_embed)
            if pool_size == 0:
                log.warning("the consistency pool is empty (the input has no usable passage): every group will be kept")
            log.info("consistency pool: %d passages embedded in %.1f s (asked for %d; k = %d); the main pass reuses "
                     "their vectors", pool_size, time.time() - t_pool, c.pool_size, c.k)
            del pool_vectors, pool_passages, pool_texts
            stages.append(Stage("consistency", partial(_make_filter, pool_ref, c.k, device, c.chunk_mb),
                                batch_size=batch, actors=stage_plan.filter_actors, num_cpus=light, num_gpus=gpu_filter))
        stages.append(Stage("write", partial(_make_write, staging, run_id, model_id(cfg), threshold, pool_size,
                                             c.k if c.enabled else None, side_output, storage, cfg.resolved_prefix()),
                            batch_size=batch, num_cpus=light))
        log.info(
            "mining %d shard(s) with %s (prefix %r, anchor threshold %.3f from %s): %d embed actor(s) on %s, "
            "%d thread(s) each",
            len(todo), model_id(cfg), cfg.resolved_prefix(), threshold, cfg.threshold_source(), actors, device, threads,
        )
        records.update(_stream_and_commit(stages, todo, todo_units, rows_per_shard, run_dir, side_output, pool_size,
                                          storage, cfg.ray.stall_warn_s, cfg.ray.stall_limit_s, stall_hint, figures,
                                          stage_plan.light_cpus))

    # ---- commit: stats, manifest, then the success marker, then the pointer to the newest run --------------------
    missing = [s.index for s in shards if s.index not in records]
    if missing:
        raise RuntimeError(f"shards {missing[:10]} were not committed; re-run with --run-id {run_id} to finish them")
    total, hists = merge_stats([records[s.index]["stats"] for s in shards])
    if pool_size is None and c.enabled:  # every shard was committed by an earlier attempt
        pool_size = next((r.get("pool_size") for r in records.values() if r.get("pool_size") is not None), None)
    stats = build_stats(total, hists, cfg, docs_expected, time.time() - t0)
    stats["run_id"] = run_id
    stats["consistency_enabled"] = c.enabled
    stats["shards"] = len(shards)
    stats["shards_resumed"] = len(shards) - len(todo)
    stats["stages"] = figures
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {
        "run_id": run_id,
        "created_utc": (prior or {}).get("created_utc") or now,
        "committed_utc": now,
        "config": cfg.to_dict(),
        "resolved": {"model": model_id(cfg), "passage_prefix": cfg.resolved_prefix(), "anchor_threshold": threshold,
                     "anchor_threshold_source": cfg.threshold_source(),
                     "embed_actors": actors, "embed_device": device, "embed_threads": threads, "ray": where,
                     "stage_plan": stage_plan.describe()},
        "lineage": {"id": lineage_id, "settings": settings},
        "inputs": [_shard_dict(s, content_hashes.get(s.index, "")) for s in shards],
        "shards": [
            {"shard_index": s.index, "path": s.path, "part": records[s.index]["part"],
             "groups": records[s.index]["groups"], "status": "committed",
             "committed_utc": records[s.index]["committed_utc"]}
            for s in shards
        ],
        "consistency": {"enabled": c.enabled, "pool_size": pool_size, "pool_size_requested": c.pool_size, "k": c.k,
                        "seed": c.seed, "side_output": "dropped/" if side_output else None},
        "tfidf": {"file": "tfidf.joblib", "sample_docs": cfg.tfidf.sample_docs, "sample_passages": len(sample_passages),
                  "vocabulary": len(tfidf.vocabulary), "unseen_word_idf": round(tfidf.unseen_idf, 6),
                  "seed": cfg.tfidf.seed, "warning": tfidf_note},
        "versions": software_versions(),
        "host": platform.node(),
        "pid": os.getpid(),
    }
    write_json(storage, f"{run_dir}/stats.json", stats)
    write_json(storage, f"{run_dir}/manifest.json", manifest)
    storage.rm(staging)
    storage.rm(f"{run_dir}/{STATE_DIR}")
    for folder in ("groups", "dropped"):  # temporary files of writes cut short by a kill (local disks only)
        for path in storage.ls(f"{run_dir}/{folder}"):
            if path.rsplit("/", 1)[-1].startswith(".") and ".tmp-" in path:
                storage.rm(path)
    storage.write_bytes(f"{run_dir}/{SUCCESS_MARKER}", (run_id + "\n").encode())
    write_json(storage, f"{out}/{LATEST_POINTER}", {
        "format": 1, "run_id": run_id, "run_dir": run_dir, "groups": f"{run_dir}/groups/", "committed_utc": now,
        "groups_count": stats["groups"], "shards": len(shards),
    })
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
    for line in format_stage_figures(figures):
        log.info("stage figures: %s", line)
    if stats["passages_token_truncated"]:
        log.warning("%d of %d passages were longer than embed.max_length = %d tokens: the model saw only their start "
                    "(passages_token_truncated in stats.json); set chunk.fit_model_length=true, lower "
                    "chunk.max_words or raise embed.max_length",
                    stats["passages_token_truncated"], stats["passages"], cfg.embed.max_length)
    return MineResult(run_dir=run_dir, stats=stats)


def _stream_and_commit(stages: list[Stage], todo: list, units: list[dict], rows_per_shard: dict[int, int],
                       run_dir: str, side_output: bool, pool_size: int | None, storage, stall_warn_s: float = 60.0,
                       stall_limit_s: float = 1800.0, hint: str = "", figures_out: list | None = None,
                       commit_cpus: float = 0.5) -> dict[int, dict]:
    """Stream the work units of the shards in ``todo`` through ``stages``, and commit each shard (a Ray task running
    :func:`commit_shard`) as soon as all of its documents have been written.

    ``figures_out``: when given, the pass's per-stage figures (:func:`pipeline.ray_adapter.stage_figures`) are
    appended to it. ``commit_cpus``: CPUs per commit task (the stage plan's light share, ``ray.task_cpus``).

    Returns:
        The commit records of the shards in ``todo``, by shard index.

    Raises:
        RuntimeError: a shard received more documents than it has (a document written twice).
        StallError: no batch completed for ``stall_limit_s`` seconds (see :func:`pipeline.ray_adapter.watched`).
    """
    import ray

    commit = ray.remote(num_cpus=commit_cpus, max_retries=2)(commit_shard)
    per_shard: dict[int, list[dict]] = {s.index: [] for s in todo}  # one running sum per shard (bounded memory)
    seen = {s.index: 0 for s in todo}
    by_index = {s.index: s for s in todo}
    pending: dict = {}
    records: dict[int, dict] = {}

    def submit(i: int) -> None:
        counts, hists = merge_stats(per_shard[i])
        shard_stats = {**counts, **hists}
        pending[commit.remote(run_dir, _shard_dict(by_index[i]) | {"index": i, "pool_size": pool_size}, shard_stats, side_output,
                              storage)] = i

    def collect(timeout: float | None) -> None:
        if not pending:
            return
        done, _ = ray.wait(list(pending), num_returns=len(pending) if timeout is None else 1, timeout=timeout)
        for ref in done:
            i = pending.pop(ref)
            records[i] = ray.get(ref)
            log.info("shard %d committed: %s (%d groups)", i, records[i]["part"], records[i]["groups"])

    for i in list(seen):
        if rows_per_shard.get(i, 0) == 0:  # an empty shard still gets its (empty) part
            submit(i)
    ds = ray.data.from_items(units, override_num_blocks=max(1, len(units)))
    for stage in stages:
        ds = apply_stage(ds, stage)
    progress = Progress(sum(rows_per_shard.get(s.index, 0) for s in todo))
    done = lambda: f"{progress.docs} / {progress.total} documents"  # noqa: E731
    # one small row per (written batch, shard), streamed as batches finish
    for row in watched(ds.iter_rows(), stages, done, stall_warn_s, stall_limit_s, hint):
        i = int(row["shard_index"])
        summary = json.loads(row["stats"])
        counts, hists = merge_stats(per_shard[i] + [summary])
        per_shard[i] = [{**counts, **hists}]
        seen[i] += summary.get("docs_in", 0)
        progress.update(summary.get("docs_in", 0), summary.get("groups", 0))
        if seen[i] > rows_per_shard[i]:
            raise RuntimeError(f"shard {i} received {seen[i]} documents but has {rows_per_shard[i]}")
        if seen[i] == rows_per_shard[i]:
            submit(i)
        collect(timeout=0)
    progress.done()
    short = {i: (seen[i], rows_per_shard[i]) for i in seen if seen[i] != rows_per_shard[i]}
    if short:
        raise RuntimeError(f"documents missing after the stream (shard: seen, expected): {short}")
    collect(timeout=None)
    if figures_out is not None:
        figures_out.extend(stage_figures(ds))
    return records
