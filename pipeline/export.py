"""Groups any trainer loads: the dataset card of a run's data folder, and ``pairmine export``.

Dataset card. Every committed run holds a ``README.md`` in the HuggingFace datasets format: YAML front matter with
``configs`` (one ``default`` config whose ``train`` split is its data folder's ``part-*.parquet``: ``groups/`` of
mine, ``pairs/`` of filter-pairs, ``negatives/`` of negatives) and ``dataset_info.features`` (the parts' arrow schema
as datasets' feature types), then a short description. ``datasets.load_dataset(<run>)`` reads the run through its
card, and ``datasets.load_dataset(<run>/groups)``, ``ray.data.read_parquet(<run>/groups)`` and
``pyarrow.parquet.read_table(<run>/groups)`` read the data folder as it is. The card sits beside the data folder, not
in it: pyarrow and pandas read every file of a folder as parquet, and a README.md there would break them.

Export. ``pairmine export RUN --format sentence-transformers|pairs|jsonl OUT`` writes the columns that
sentence-transformers' ``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss`` trains on (the loss takes
(anchor, positive[, negative_1..n]) in that column order):

    mine run          anchor = anchor_text, positive = related_texts[0] (s1, the top related passage: seed 000's
                      positive)
    filter-pairs run  anchor = query, positive = passage
    negatives run     anchor = query, positive = positive, negative_1..negative_n = the first n mined negatives

``sentence-transformers``: parquet parts with every column; ``pairs``: parquet parts with (anchor, positive) only;
``jsonl``: the same columns as ``sentence-transformers``, one JSON object per line (``datasets.load_dataset("json")``
reads it). One output part per input part under ``OUT/data/``, one part in memory at a time, local or ``s3://``;
``OUT/README.md`` is its dataset card (``datasets.load_dataset(OUT)``) and ``OUT/export_manifest.json`` says the
source run, format, rows written and rows skipped with their reason.
"""

from __future__ import annotations

import json
import logging

import pyarrow as pa

from pairmine.pipeline.config import ConfigError
from pairmine.pipeline.run_folder import RUN_DATA as DATA_FOLDERS  # a run's kind -> its data folder

log = logging.getLogger("pairmine")

FORMATS = ("sentence-transformers", "pairs", "jsonl")
CARD = "README.md"
EXPORT_MANIFEST = "export_manifest.json"


def _feature(t: pa.DataType) -> dict:
    """One arrow type as a datasets feature in its YAML form: ``{"dtype": "string"}`` or ``{"list": {...}}``."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _feature(t.value_type)
        return {"list": inner["dtype"] if set(inner) == {"dtype"} else inner}
    names = {pa.string(): "string", pa.large_string(): "large_string", pa.int32(): "int32", pa.int64(): "int64",
             pa.float32(): "float32", pa.float64(): "float64", pa.bool_(): "bool", pa.int16(): "int16",
             pa.int8(): "int8"}
    if t not in names:
        raise ValueError(f"no datasets feature type for arrow type {t}")
    return {"dtype": names[t]}


def dataset_card(schema: pa.Schema, title: str, description: str, pattern: str = "part-*.parquet") -> str:
    """A HuggingFace datasets ``README.md`` for a folder of parquet files with ``schema``.

    Args:
        schema: the files' arrow schema (string, integer, float, bool and list-of-those columns).
        title: the card's heading. description: its text (markdown).
        pattern: the files of the ``train`` split, relative to the folder.

    Returns:
        The card's text: YAML front matter (``configs``, ``dataset_info.features``; the format of
        https://huggingface.co/docs/hub/datasets-manual-configuration) and the description.

    Raises:
        ValueError: a column of a type datasets has no plain feature for.
    """
    lines = ["configs:", "- config_name: default", "  data_files:", "  - split: train", f"    path: {pattern}",
             "dataset_info:", "  features:"]
    for f in schema:  # the YAML of datasets' Features._to_yaml_list, written out (names are plain identifiers)
        feat = _feature(f.type)
        lines.append(f"  - name: {f.name}")
        lines += [f"    {k}: {v}" for k, v in feat.items()] if all(isinstance(v, str) for v in feat.values()) else \
            [f"    list:", *[f"      {k}: {v}" for k, v in feat["list"].items()]]
    front = "\n".join(lines) + "\n"
    return f"---\n{front}---\n\n# {title}\n\n{description.strip()}\n"


def run_card(kind: str, run_id: str, schema: pa.Schema, folder: str) -> str:
    """The card of a committed run whose parts are ``folder/part-*.parquet`` with ``schema`` (written by
    :meth:`pipeline.run_folder.RunFolder.finalize`)."""
    what = {
        "mine": "xPRT training groups mined by `pairmine mine`: one row per anchor passage, with its related "
                "passages from the same document (`related_texts`, best first: `related_texts[0]` is s1, the "
                "positive) and their dense, TF-IDF and RRF scores.",
        "filter-pairs": "(query, passage) pairs kept by `pairmine filter-pairs`, the consistency filter against a "
                        "random pool.",
        "negatives": "(query, positive, negatives) rows mined by `pairmine negatives`: hard negatives from a corpus "
                     "index, with their ranks and scores (and a cross-encoder's, with --teacher).",
    }[kind]
    return dataset_card(schema, f"pairmine {kind} run {run_id}",
                        f"{what}\n\nLoad with `datasets.load_dataset(\"<this run folder>\")`, or read "
                        f"`{folder}/` with `ray.data.read_parquet` or pyarrow. How it was made: `manifest.json`; its "
                        "counts: `stats.json`. For sentence-transformers columns (anchor, positive, negative_1..n) "
                        "use `pairmine export RUN --format sentence-transformers OUT`.", f"{folder}/part-*.parquet")


def export_schema(fmt: str, negatives: int) -> pa.Schema:
    """The output columns: anchor, positive, then negative_1..negative_``negatives`` (not for ``pairs``)."""
    cols = ["anchor", "positive"] + ([f"negative_{i}" for i in range(1, negatives + 1)] if fmt != "pairs" else [])
    return pa.schema([(c, pa.string()) for c in cols])


def _rows(kind: str, table: pa.Table, n_neg: int, skips: dict) -> pa.Table:
    """One input part -> the export's columns (module docstring); rows without a positive, or with fewer than
    ``n_neg`` negatives, are counted in ``skips`` by reason."""
    if kind == "mine":
        anchors = table.column("anchor_text").to_pylist()
        positives = [r[0] if r else None for r in table.column("related_texts").to_pylist()]
        negs = [[] for _ in anchors]
    elif kind == "filter-pairs":
        anchors, positives = table.column("query").to_pylist(), table.column("passage").to_pylist()
        negs = [[] for _ in anchors]
    else:
        anchors, positives = table.column("query").to_pylist(), table.column("positive").to_pylist()
        negs = [r or [] for r in table.column("negatives").to_pylist()]
    keep = []
    for i, (a, p, n) in enumerate(zip(anchors, positives, negs)):
        if not a or not p:
            skips["no_anchor_or_positive"] = skips.get("no_anchor_or_positive", 0) + 1
        elif len(n) < n_neg:
            skips["fewer_negatives"] = skips.get("fewer_negatives", 0) + 1
        else:
            keep.append(i)
    data = {"anchor": [anchors[i] for i in keep], "positive": [positives[i] for i in keep]}
    for j in range(n_neg):
        data[f"negative_{j + 1}"] = [negs[i][j] for i in keep]
    return pa.table(data, schema=export_schema("sentence-transformers", n_neg))


def export(run: str, fmt: str, output: str, storage, negatives: int | None = None) -> dict:
    """Write a committed run's rows as trainer-ready columns (module docstring).

    Args:
        run: a committed mine, filter-pairs or negatives run folder, local or ``s3://``.
        fmt: one of :data:`FORMATS`.
        output: the export's folder, local or ``s3://``; must not hold an earlier export.
        storage: the :class:`operators.storage.Storage` for both.
        negatives: negatives run only: negative columns per row; None: the run's ``negatives.count`` (rows with
            fewer are skipped and counted). 0 writes none.

    Returns:
        The export manifest (also written as ``OUT/export_manifest.json``): source run and kind, format, columns,
        parts, ``rows`` written, ``skipped`` {reason: count}.

    Raises:
        ConfigError: unknown format, negatives for a run that has none, an output holding an export.
        InputError, FileNotFoundError: not a committed pairmine run (:func:`pipeline.train.find_group_parts`).
    """
    from pairmine.pipeline.run_folder import run_kind, wrong_kind
    from pairmine.pipeline.train import find_group_parts

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    root = run.rstrip("/")
    try:
        manifest = json.loads(storage.read_bytes(f"{root}/manifest.json"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{run} holds no manifest.json: give a committed pairmine mine, filter-pairs or "
                                "negatives run folder") from None
    kind = run_kind(root, manifest, storage)
    if kind not in DATA_FOLDERS:
        from pairmine.pipeline.inputs import InputError

        raise InputError(wrong_kind(run, kind, "mine, filter-pairs or negatives"))
    parts, run_dir = find_group_parts(root, storage, folder=DATA_FOLDERS[kind])
    if negatives is not None and negatives > 0 and kind != "negatives":
        raise ConfigError(f"--negatives {negatives}: {run} is a {kind} run, which has no mined negatives (export a "
                          "pairmine negatives run)")
    n_neg = 0
    if kind == "negatives" and fmt != "pairs":
        count = ((manifest.get("config") or {}).get("negatives") or {}).get("count")
        n_neg = negatives if negatives is not None else int(count or 0)
    out = output.rstrip("/")
    if storage.exists(f"{out}/{EXPORT_MANIFEST}"):
        raise ConfigError(f"--output {output} holds an earlier export ({EXPORT_MANIFEST}); use another folder or "
                          "remove it")
    storage.makedirs(out)
    schema = export_schema(fmt, n_neg)
    skips: dict[str, int] = {}
    rows = 0
    names = []
    for k, part in enumerate(sorted(parts)):
        table = _rows(kind, storage.read_parquet(part), n_neg, skips).select(schema.names)
        name = f"data/part-{k:05d}." + ("jsonl" if fmt == "jsonl" else "parquet")
        if fmt == "jsonl":
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in table.to_pylist())
            storage.write_bytes(f"{out}/{name}", text.encode("utf-8"))
        else:
            storage.write_parquet_stream(f"{out}/{name}", schema, [table])
        rows += table.num_rows
        names.append(name)
        log.info("export: %s -> %s/%s (%d rows)", part, out, name, table.num_rows)
    pattern = "data/part-*.jsonl" if fmt == "jsonl" else "data/part-*.parquet"
    card = dataset_card(schema, f"pairmine export ({fmt}) of {kind} run {manifest.get('run_id', root)}",
                        f"Columns for sentence-transformers' `SentenceTransformerTrainer` with "
                        f"`MultipleNegativesRankingLoss` (anchor, positive{', negative_1..' + str(n_neg) if n_neg else ''}"
                        f"). Source: `{run_dir}`. Written by `pairmine export`.", pattern)
    storage.write_bytes(f"{out}/{CARD}", card.encode())
    result = {"format": "pairmine-export/1", "source": run_dir, "kind": kind, "export_format": fmt,
              "columns": schema.names, "parts": names, "rows": rows, "skipped": skips}
    storage.write_bytes(f"{out}/{EXPORT_MANIFEST}", (json.dumps(result, indent=2) + "\n").encode())
    return result


def write_run_card(storage, run_dir: str, folder: str, schema: pa.Schema, run_id: str) -> None:
    """Write a committed run's dataset card, ``<run_dir>/README.md``, for its data folder ``folder`` (called at
    commit, before ``_SUCCESS``). A schema datasets cannot express is logged and no card written: the card is for
    other tools, the run stands without it."""
    kind = {v: k for k, v in DATA_FOLDERS.items()}.get(folder)
    if kind is None:
        return
    try:
        text = run_card(kind, run_id, schema, folder)
    except ValueError as e:
        log.warning("no dataset card for %s: %s", run_dir, e)
        return
    storage.write_bytes(f"{run_dir.rstrip('/')}/{CARD}", text.encode())


__all__ = ["FORMATS", "dataset_card", "run_card", "export", "export_schema", "write_run_card"]
