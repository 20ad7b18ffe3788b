"""One run's folder and its lifecycle, shared by the jobs that write one (``mine``, ``filter-pairs``,
``negatives``).

    check      the output path is a folder; the run id is not committed; a plan of an earlier attempt
               (``_state/plan.json``) has the same inputs and result-deciding config (else RunExistsError)
    open       first attempt: write the plan. Resumed: read the commit records of the committed shards
               (``_state/shard-NNNNN.json``) and of the completed work units of the others
               (``_state/units/shard-NNNNN/unit-OOOOOOOOOOOO.json``), delete the staging files of every other unit
               (partial work of the units in flight when the run stopped), and give the units left to mine
    stream     the units through the job's stages; each summary row (one per batch and work unit) is added to its
               unit; a unit whose rows have all passed is recorded at once; a shard whose units are all recorded
               is compacted into its part and committed (a Ray task, :func:`commit_shard`)
    finalize   stats.json, manifest.json, staging and state removed, ``_SUCCESS`` last, then (mine) ``_latest.json``

A work unit is a parquet row group, or a whole JSONL file (``operators.read.UNIT_SCHEMA``), keyed by (shard index,
its first row in the shard). A killed run loses at most the units that were in flight; the output stays exactly
once, because a unit's staging files are kept only when its record exists, and the record is written only after every
one of its rows was staged (SPEC "Exactly once"; issue 13 item 2, issue 15 item 7).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from pairmine.operators.errors import PairmineError
from pairmine.pipeline.config import ConfigError
from pairmine.pipeline.provenance import SUCCESS_MARKER

log = logging.getLogger("pairmine")

STATE_DIR = "_state"  # plan.json (inputs + config of the first attempt), shard and unit commit records
STAGING_DIR = "_staging"
# beside the run folders: the most recently committed run (format 1, docs/operations.md)
LATEST_POINTER = "_latest.json"


RUN_DATA = {"mine": "groups", "filter-pairs": "pairs", "negatives": "negatives"}  # a run's kind -> its data folder


def run_kind(run: str, manifest: dict, storage) -> str | None:
    """What wrote the committed run folder ``run``: "mine", "filter-pairs" or "negatives" (its manifest's ``job``;
    a mine run committed before mine recorded it has ``lineage`` or a ``groups/`` folder), or None (a training
    run's output, or not a pairmine run). Used to refuse a run of the wrong kind with what it is, and so that an
    output folder holding runs of several commands lists the mine runs as a lineage's (``--incremental``)."""
    if manifest.get("job"):
        return manifest["job"]
    if "lineage" in manifest or storage.exists(f"{run.rstrip('/')}/groups"):
        return "mine"
    return next((kind for kind, folder in RUN_DATA.items() if storage.exists(f"{run.rstrip('/')}/{folder}")), None)


def wrong_kind(run: str, kind: str | None, wanted: str, hint: str = "") -> str:
    """The one-line reason a ``wanted`` run was expected at ``run`` and a run of ``kind`` was found (see
    :func:`run_kind`), with ``hint`` (what to give instead) after it."""
    if kind in RUN_DATA:
        what = f"{run} is a pairmine {kind} run (it holds {RUN_DATA[kind]}/), not a {wanted} run"
    else:
        what = (f"{run} is a committed folder but not a run of pairmine mine, filter-pairs or negatives ({wanted} "
                "wanted)")
    return what + (f"; {hint}" if hint else "")


class RunExistsError(PairmineError, RuntimeError):
    """The run folder already holds a committed run (a ``_SUCCESS`` marker), or an attempt with other inputs or
    config. User-fixable: another run id or output, or the same inputs and config."""


@dataclass(frozen=True)
class Parts:
    """What a job's write stage stages and its commit compacts, one part per input shard.

    Attributes:
        folder: the parts' folder in the run (``groups``, ``pairs``); staged under ``_staging/<folder>/``.
        count: the stats key of the rows that go to ``folder`` (``groups``, ``pairs_kept``): a part must hold that
            many rows.
        rows: the stats key of the input rows a summary covers (``docs_in``, ``pairs_in``): a unit is complete
            when this adds up to its rows.
        schema: the parts' schema; sort_keys: their sort order (the first is the staging row column).
        side: the side output's folder (``dropped``), or None when it is off.
    """

    folder: str
    count: str
    rows: str
    schema: pa.Schema
    sort_keys: tuple[str, ...]
    side: str | None = None


def read_json(storage, path: str):
    return json.loads(storage.read_bytes(path))


def write_json(storage, path: str, obj) -> None:
    """Write ``obj`` as indented JSON, atomically (readers see the old or the whole new file)."""
    storage.write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def merge_stats(parts: list[dict]) -> tuple[Counter, dict[str, list[int]]]:
    """Add up the write operator's per-batch counts; histograms (lists) are added element-wise.

    Returns:
        (counts, histograms).
    """
    total: Counter = Counter()
    hists: dict[str, list[int]] = {}
    for p in parts:
        for key, value in p.items():
            if isinstance(value, list):
                prev = hists.get(key)
                hists[key] = list(value) if prev is None else [a + b for a, b in zip(prev, value)]
            else:
                total[key] += value
    return total, hists


def merged(parts: list[dict]) -> dict:
    """:func:`merge_stats` as one dict (counts and histograms), the form unit and shard records keep."""
    counts, hists = merge_stats(parts)
    return {**counts, **hists}


def check_resume(plan: dict, prior: dict, run_id: str) -> None:
    """Refuse to resume run ``run_id`` when its inputs or result-deciding config differ from the first attempt's.

    Raises:
        RunExistsError: naming what differs.
    """
    if [s["key"] for s in prior["inputs"]] != [s["key"] for s in plan["inputs"]]:
        old = {s["key"] for s in prior["inputs"]}
        new = {s["key"] for s in plan["inputs"]}
        changed = sorted({k.split("|")[0] for k in old ^ new})[:3]  # a path once, whether changed or added
        raise RunExistsError(
            f"run {run_id} was started on other input shards ({len(prior['inputs'])} then, {len(plan['inputs'])} now; "
            f"differing: {', '.join(changed) or 'their order'}); resume it with the same input, or use a new --run-id")
    diffs = [f"{sec}.{k}" for sec, vals in plan["config"].items() for k, v in vals.items()
             if prior["config"].get(sec, {}).get(k) != v]
    if diffs:
        raise RunExistsError(f"run {run_id} was started with another config ({', '.join(diffs[:5])} differ); resume it "
                             "with the same config, or use a new --run-id")


def unit_key(unit: dict) -> tuple[int, int]:
    """A work unit's key: (shard index, its first row in the shard)."""
    return int(unit["shard_index"]), int(unit["row_offset"])


_STAGED_ROWS = re.compile(r"rows-(\d+)-(\d+)-[0-9a-f]+\.parquet$")


def commit_shard(run_dir: str, shard: dict, stats: dict, parts: Parts, storage) -> dict:
    """Make one input shard's output visible: compact its staging files into ``<folder>/part-NNNNN.parquet`` (and
    the side output's), check the part against the write stage's count, write the shard's commit record
    ``_state/shard-NNNNN.json`` (its existence is what "committed" means), then drop its unit records. Runs as a
    Ray task.

    Raises:
        RuntimeError: the part holds another number of rows than the write stage counted.
        StorageError: a staging file, the part or the record cannot be read or written.
    """
    from pairmine.operators.write import compact_shard

    i = shard["index"]
    staging = f"{run_dir}/{STAGING_DIR}"
    path, n, dup = compact_shard(f"{staging}/{parts.folder}", f"{run_dir}/{parts.folder}", i, parts.schema,
                                 parts.sort_keys, storage)
    if n != stats.get(parts.count, 0):
        raise RuntimeError(f"shard {i} ({shard['path']}): part holds {n} rows, the write stage counted "
                           f"{stats.get(parts.count, 0)} {parts.count}")
    side = None
    if parts.side:
        _, side, _ = compact_shard(f"{staging}/{parts.side}", f"{run_dir}/{parts.side}", i, parts.schema,
                                   parts.sort_keys, storage)
    record = {"shard_index": i, "path": shard["path"], "key": shard["key"],
              "part": f"{parts.folder}/{path.rsplit('/', 1)[-1]}", "rows": n, "side_rows": side, "staged_twice": dup, "pool_size": shard.get("pool_size"),
              "stats": stats, "committed_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    write_json(storage, f"{run_dir}/{STATE_DIR}/shard-{i:05d}.json", record)
    storage.rm(f"{run_dir}/{STATE_DIR}/units/shard-{i:05d}")
    return record


class RunFolder:
    """One run folder ``<output>/<run_id>/`` through its lifecycle (module docstring): the plan and resume checks,
    the kept work of an earlier attempt, per-unit records and per-shard commits while streaming, and the final
    commit. Used by :func:`pipeline.mine.mine`, :func:`pipeline.filter_pairs.filter_pairs` and
    :func:`pipeline.negatives.negatives`.

    Args:
        output: the folder (path or URL) that holds runs; run_id: this run's id.
        storage: the storage layer (every read, write, list and delete goes through it).
        parts: what the job's write stage stages and its commit compacts.
    """

    last_run_id: str | None = None
    """The run id of the latest run folder this process made (the CLI names it in its Ctrl-C line)."""

    def __init__(self, output: str, run_id: str, storage, parts: Parts):
        RunFolder.last_run_id = run_id
        self.output = output.rstrip("/") or "."
        self.run_id, self.storage, self.parts = run_id, storage, parts
        self.dir = f"{self.output}/{run_id}"
        self.staging = f"{self.dir}/{STAGING_DIR}"
        self.state = f"{self.dir}/{STATE_DIR}"
        self.prior: dict | None = None  # the first attempt's plan, when this run resumes one
        self.made_dir = False  # open() created the run folder (it did not exist before this attempt)
        self.records: dict[int, dict] = {}  # commit records of the committed shards, by shard index
        self.units_kept: dict[tuple[int, int], dict] = {}  # counts of completed units of uncommitted shards

    def check_output(self) -> None:
        """Raises: ConfigError: the output path is a file."""
        if (self.storage.info(self.output) or {}).get("type") == "file":
            raise ConfigError(f"output.path = {self.output!r} is a file; it must be a folder (created if missing)")

    def check_new(self, plan: dict) -> dict | None:
        """Check that the run id is not committed and, when an earlier attempt of it left a plan, that ``plan``
        (``{"run_id", "inputs": [{"key", ...}], "config": {...}}``) matches it. Returns that earlier plan or None.

        Raises:
            RunExistsError: the run is committed, or was started with other inputs or config.
        """
        if self.storage.exists(f"{self.dir}/{SUCCESS_MARKER}"):
            raise RunExistsError(
                f"run {self.run_id} in {self.output} is already committed ({self.dir}/{SUCCESS_MARKER}); "
                "choose another --run-id, or leave it out for a new one")
        plan_path = f"{self.state}/plan.json"
        self.prior = read_json(self.storage, plan_path) if self.storage.exists(plan_path) else None
        if self.prior is not None:
            check_resume(plan, self.prior, self.run_id)
        else:
            self.storage.rm(self.staging)  # leftovers of an attempt killed before its plan was written
        return self.prior

    @contextlib.contextmanager
    def removed_on_error(self):
        """Around work done after :meth:`open` that records nothing (a negatives run's corpus pass: the corpus is
        embedded again on every attempt): when the block raises an ``Exception`` on a first attempt (no earlier
        plan), what :meth:`open` wrote is removed again, so that an input error found there (a corpus with no usable
        passage, a corrupt corpus file) leaves no run folder, as errors found before :meth:`open` do, and the same
        ``--run-id`` can be run again with the input fixed. Only what this attempt made goes: the whole run folder
        when :meth:`open` created it, else (a folder that was there before, whatever it holds) only the plan. A
        resumed run's folder is kept; so is any folder on Ctrl-C or SIGTERM (``KeyboardInterrupt``), whose message
        says how to resume. A failed removal is logged, and the block's own error is raised either way."""
        try:
            yield
        except Exception:
            if self.prior is None:  # a first attempt: nothing committed or recorded yet
                target = self.dir if self.made_dir else f"{self.state}/plan.json"
                try:
                    self.storage.rm(target)
                except Exception as e:  # noqa: BLE001 - the block's error is the one to report
                    log.warning("could not remove %s of the unfinished run: %s", target, e)
            raise

    def open(self, plan: dict, units: list[dict], rows_by_unit: dict[tuple[int, int], int],
             job: str = "run") -> list[dict]:
        """Start the run folder: write the plan (first attempt), or take what an earlier attempt left: committed
        shards and completed units are kept, staging files of every other unit are deleted. Returns the units left
        to mine, in order.

        Args:
            units: every work unit of the run (dicts with ``shard_index`` and ``row_offset``).
            rows_by_unit: rows of each unit, by :func:`unit_key`.

        Raises:
            StorageError: the state or staging folders cannot be read, or the plan written.
        """
        if self.prior is None:
            self.made_dir = not self.storage.exists(self.dir)  # else the folder and what it holds are not ours
            self.storage.makedirs(self.dir)
            write_json(self.storage, f"{self.state}/plan.json", plan)
            return list(units)
        planned = {unit_key(u) for u in units}
        for path in self.storage.ls(self.state):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("shard-") and name.endswith(".json"):
                rec = read_json(self.storage, path)
                self.records[rec["shard_index"]] = rec
        for folder in self.storage.ls(f"{self.state}/units"):
            shard = int(folder.rstrip("/").rsplit("-", 1)[-1])
            if shard in self.records:
                continue
            for path in self.storage.ls(folder):
                if path.endswith(".json") and not path.rsplit("/", 1)[-1].startswith("."):
                    rec = read_json(self.storage, path)
                    key = (rec["shard_index"], rec["row_offset"])
                    if key in planned and rec.get("rows") == rows_by_unit.get(key):
                        self.units_kept[key] = rec["stats"]
        removed = self._drop_partial_staging(units, rows_by_unit)
        todo = [u for u in units if u["shard_index"] not in self.records and unit_key(u) not in self.units_kept]
        shards = {u["shard_index"] for u in units}
        log.info("resuming %s %s: %d of %d shard(s) already committed; of the others, %d work unit(s) completed "
                 "earlier kept, %d staging file(s) of unfinished units removed; %d work unit(s) to mine",
                 job, self.run_id, len(self.records), len(shards), len(self.units_kept), removed, len(todo))
        return todo

    def _drop_partial_staging(self, units: list[dict], rows_by_unit: dict) -> int:
        """Delete the staging files of uncommitted shards that do not lie inside a kept unit; returns how many."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for u in units:
            key = unit_key(u)
            if key in self.units_kept:
                spans.setdefault(key[0], []).append((key[1], key[1] + rows_by_unit[key]))
        removed = 0
        for folder in (self.parts.folder, self.parts.side or "dropped"):
            for shard_dir in self.storage.ls(f"{self.staging}/{folder}"):
                name = shard_dir.rstrip("/").rsplit("/", 1)[-1]
                if not name.startswith("shard-") or int(name.split("-", 1)[1]) in self.records:
                    continue
                kept = spans.get(int(name.split("-", 1)[1]), [])
                for path in self.storage.ls(shard_dir):
                    m = _STAGED_ROWS.search(path)
                    inside = m and any(lo <= int(m.group(1)) and int(m.group(2)) < hi for lo, hi in kept)
                    if not inside:
                        self.storage.rm(path)
                        removed += 1
        return removed

    def record_unit(self, key: tuple[int, int], rows: int, stats: dict) -> None:
        """Record a completed work unit (all of its ``rows`` staged; ``stats`` its counts): a resumed run keeps
        it."""
        shard, offset = key
        write_json(self.storage, f"{self.state}/units/shard-{shard:05d}/unit-{offset:012d}.json",
                   {"shard_index": shard, "row_offset": offset, "rows": rows, "stats": stats})

    def stream(self, stages: list, shards: list[dict], units: list[dict], rows_by_unit: dict[tuple[int, int], int],
               progress, stall_warn_s: float = 60.0, stall_limit_s: float = 1800.0, hint: str = "",
               figures_out: list | None = None, commit_cpus: float = 0.5) -> None:
        """Stream the work units ``units`` (those :meth:`open` left to mine) through ``stages``; record each unit as
        soon as all of its rows were staged, and commit each shard (a Ray task, :func:`commit_shard`) as soon as
        all of its units are recorded. Afterwards :attr:`records` holds every shard's commit record.

        Args:
            shards: every shard not yet committed, as dicts (``index``, ``path``, ``key``, optional
                ``pool_size``) that go to :func:`commit_shard`.
            rows_by_unit: rows of every unit of the run, by :func:`unit_key` (units of committed shards are ignored).
            progress: a :class:`pipeline.mine.Progress` (rows, the job's count of kept rows).
            figures_out: when given, the pass's per-stage figures (:func:`pipeline.ray_adapter.stage_figures`) are
                appended to it. commit_cpus: CPUs per commit task (the stage plan's ``ray.task_cpus``).

        Raises:
            RuntimeError: a unit received more rows than it has, or rows are missing after the stream.
            StallError: no batch completed for ``stall_limit_s`` seconds (:func:`pipeline.ray_adapter.watched`).
        """
        import ray

        from pairmine.pipeline.ray_adapter import apply_stage, stage_figures, watched

        commit = ray.remote(num_cpus=commit_cpus, max_retries=2)(commit_shard)
        by_index = {s["index"]: s for s in shards if s["index"] not in self.records}
        left: dict[int, int] = {i: 0 for i in by_index}  # units of each shard not yet recorded
        shard_stats: dict[int, list[dict]] = {i: [] for i in by_index}  # one running sum per shard (bounded memory)
        for key, rows in rows_by_unit.items():
            if key[0] in by_index:
                if key in self.units_kept:
                    shard_stats[key[0]] = [merged(shard_stats[key[0]] + [self.units_kept[key]])]
                else:
                    left[key[0]] += 1
        unit_stats: dict[tuple[int, int], dict] = {}  # units in flight
        seen: dict[tuple[int, int], int] = {}
        pending: dict = {}

        def submit(i: int) -> None:
            pending[commit.remote(self.dir, by_index[i], merged(shard_stats.pop(i)), self.parts, self.storage)] = i

        def collect(timeout: float | None) -> None:
            if not pending:
                return
            done, _ = ray.wait(list(pending), num_returns=len(pending) if timeout is None else 1, timeout=timeout)
            for ref in done:
                i = pending.pop(ref)
                self.records[i] = ray.get(ref)
                log.info("shard %d committed: %s (%d %s)", i, self.records[i]["part"], self.records[i]["rows"],
                         self.parts.count.replace("_", " "))  # "groups", "pairs kept", "pairs out"

        def unit_done(key: tuple[int, int]) -> None:
            stats = unit_stats.pop(key, {})
            self.record_unit(key, rows_by_unit[key], stats)
            shard_stats[key[0]] = [merged(shard_stats[key[0]] + [stats])]
            left[key[0]] -= 1
            if left[key[0]] == 0:
                submit(key[0])

        for i in list(by_index):
            if left[i] == 0:  # every unit recorded by an earlier attempt, or an empty shard
                submit(i)
        todo = []
        for u in units:
            key = unit_key(u)
            if rows_by_unit.get(key, 0) == 0 and key[0] in by_index:
                unit_done(key)  # an empty unit (a row group without rows) has nothing to stream
            else:
                todo.append(u)
        if todo:
            ds = ray.data.from_items(todo, override_num_blocks=max(1, len(todo)))
            for stage in stages:
                ds = apply_stage(ds, stage)
            done = lambda: f"{progress.docs} / {progress.total} {progress.unit}"  # noqa: E731
            # one small row per (written batch, work unit), streamed as batches finish
            for row in watched(ds.iter_rows(), stages, done, stall_warn_s, stall_limit_s, hint):
                key = (int(row["shard_index"]), int(row["unit_offset"]))
                summary = json.loads(row["stats"])
                unit_stats[key] = merged([unit_stats.get(key, {}), summary])
                seen[key] = seen.get(key, 0) + summary.get(self.parts.rows, 0)
                progress.update(summary.get(self.parts.rows, 0), summary.get(self.parts.count, 0))
                if seen[key] > rows_by_unit[key]:
                    raise RuntimeError(f"work unit {key} (shard, first row) received {seen[key]} rows but has "
                                       f"{rows_by_unit[key]}")
                if seen[key] == rows_by_unit[key]:
                    unit_done(key)
                collect(timeout=0)
            if figures_out is not None:
                figures_out.extend(stage_figures(ds))
        progress.done()
        short = {k: (seen.get(k, 0), rows_by_unit[k]) for k in map(unit_key, todo) if seen.get(k, 0) != rows_by_unit[k]}
        if short:
            raise RuntimeError("rows missing after the stream (work unit: seen, expected): "
                               f"{dict(list(short.items())[:10])}")
        collect(timeout=None)

    def committed_stats(self, shards: list) -> tuple[Counter, dict[str, list[int]]]:
        """The merged counts of every shard in ``shards`` (objects with ``index``), from their commit records
        (:func:`merge_stats`).

        Raises:
            RuntimeError: a shard is not committed (the message says to re-run with the run id).
        """
        missing = [s.index for s in shards if s.index not in self.records]
        if missing:
            raise RuntimeError(f"shards {missing[:10]} were not committed; re-run with --run-id {self.run_id} to "
                               "finish them")
        return merge_stats([self.records[s.index]["stats"] for s in shards])

    def finalize(self, stats: dict, manifest: dict, latest: dict | None = None) -> None:
        """Commit the run: stats.json and manifest.json, staging and state removed (with temporary files of
        writes cut short by a kill), the run's dataset card ``README.md`` (:func:`pipeline.export.write_run_card`), the
        ``_SUCCESS`` marker last; then ``latest`` (when given) as the
        ``_latest.json`` pointer beside the runs.

        Raises:
            StorageError: a write or delete failed for good (the run stays uncommitted and can be resumed).
        """
        write_json(self.storage, f"{self.dir}/stats.json", stats)
        write_json(self.storage, f"{self.dir}/manifest.json", manifest)
        self.storage.rm(self.staging)
        self.storage.rm(self.state)
        for folder in (self.parts.folder, self.parts.side):
            for path in self.storage.ls(f"{self.dir}/{folder}") if folder else []:
                if path.rsplit("/", 1)[-1].startswith(".") and ".tmp-" in path:
                    self.storage.rm(path)
        if self.parts.folder and self.parts.schema is not None:  # a dataset card: datasets.load_dataset reads it
            from pairmine.pipeline.export import write_run_card

            write_run_card(self.storage, self.dir, self.parts.folder, self.parts.schema, self.run_id)
        self.storage.write_bytes(f"{self.dir}/{SUCCESS_MARKER}", (self.run_id + "\n").encode())
        if latest is not None:
            write_json(self.storage, f"{self.output}/{LATEST_POINTER}", latest)
