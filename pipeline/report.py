"""``pairmine report RUN``: a static HTML page with PNG plots (matplotlib, Agg) about one mined run.

Plots come from the run's ``stats.json`` (centrality histogram with the anchor threshold, groups per document,
passage and document coverage, the consistency filter's n_above histogram and keep rate). Example tables, like the
paper's Table 5 (seed 000), come from the groups of a seeded sample of documents: the anchor with its centrality,
its related passages with dense, TF-IDF and RRF scores, and the passages never used by any kept group.

Passages never used are not in the run's output (only groups are written), so the report finds them by re-reading
the sampled documents from the run's input (``manifest.json``: inputs, id/text columns, chunk settings), chunking
them again with the mine operator (deterministic) and, for their centrality, embedding them again with the run's
model and prefix. Each document's re-chunked passages are checked against the run's anchor and related texts, and
the recomputed anchor centralities against the stored ones; the page shows both checks. Where the input or the
model is not available, the page says so and shows what the groups alone allow.

The run, its input and the output folder may be local or on an object store (``s3://``): every read and write goes
through :class:`operators.storage.Storage` (``[storage]`` of the command's config, else the AWS environment), with
its retries; each file is published whole.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pairmine.operators.storage import LOCAL, Storage, join
from pairmine.pipeline.evaluate import EvalInputError
from pairmine.pipeline.provenance import SUCCESS_MARKER
from pairmine.pipeline.run_folder import run_kind, wrong_kind

log = logging.getLogger("pairmine")

# The paper's figures on FineWeb with E5 (seed 000): % documents with groups, groups per document, % passages covered.
PAPER = {"docs_with_groups_pct": 99.0, "groups_per_doc": 7.0, "passage_coverage_pct": 68.0}
PLOTS = ("centrality.png", "groups_per_doc.png", "coverage.png", "n_above.png")
TEXT_CHARS = 320
_CREDENTIALS = ("access_key_id", "secret_access_key", "session_token")  # passage characters shown in the tables (the full text is in the cell's title)


@dataclass
class ReportResult:
    """What :func:`build_report` returns: the HTML file, the PNG files, the sampled documents and notes shown on
    the page (re-chunking/re-embedding checks, what could not be done and why)."""

    html: str
    pngs: list[str]
    docs: list[dict]
    notes: list[str] = field(default_factory=list)


def _load_run(run: str, storage: Storage = LOCAL) -> tuple[dict, dict]:
    info = storage.info(run)
    if info is None or info.get("type") != "directory":
        raise EvalInputError(f"run folder {run} does not exist")
    if not storage.exists(join(run, SUCCESS_MARKER)):
        raise EvalInputError(f"{run} is not a committed run folder (no _SUCCESS marker; the run failed, is still "
                             "running, or this is not a pairmine run)")
    try:
        stats = json.loads(storage.read_bytes(join(run, "stats.json")))
        manifest = json.loads(storage.read_bytes(join(run, "manifest.json")))
    except (OSError, ValueError) as e:
        raise EvalInputError(f"run {run}: cannot read stats.json/manifest.json: {e}") from None
    kind = run_kind(run, manifest, storage)
    if kind != "mine":
        raise EvalInputError(wrong_kind(run, kind, "mine", "pairmine report shows what a mine run mined (its groups)"))
    return stats, manifest


def input_storage(recorded: Storage, storage: Storage | None) -> Storage:
    """The storage to re-read the run's input with: the run's recorded ``[storage]`` (endpoint, region, retries;
    credentials are never recorded: the environment's), each setting replaced by the command's own ``[storage]``
    where that one is set (not its default)."""
    if storage is None:
        return recorded
    default = Storage()
    given = {f.name: getattr(storage, f.name) for f in dataclasses.fields(Storage)
             if getattr(storage, f.name) != getattr(default, f.name)}
    return dataclasses.replace(recorded, **given)


def _config(manifest: dict):
    from pairmine.pipeline.config import ConfigError, MineConfig

    cfg = MineConfig()
    try:
        for section, values in manifest.get("config", {}).items():
            for key, value in values.items():
                if section == "storage" and key in _CREDENTIALS:
                    continue  # redacted in the manifest: the environment (or the defaults) provide them
                cfg.set(f"{section}.{key}", value)
    except ConfigError as e:
        raise EvalInputError(f"the run's manifest.json holds a config this pairmine cannot read: {e}") from None
    return cfg


# ---- plots ---------------------------------------------------------------------------------------------------------

def _save(fig, path, storage: Storage) -> None:
    """The figure as a PNG file at ``path`` (local or ``s3://``), published whole."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    storage.write_bytes(str(path), buf.getvalue())


def _figure(width: float = 6.4, height: float = 3.4):
    import matplotlib

    matplotlib.use("Agg")  # no display; also what Figure.savefig uses
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def plot_centrality(stats: dict, threshold: float, path: str | Path, storage: Storage = LOCAL) -> None:
    """Bar chart of stats.json's centrality histogram (all passages) with the anchor threshold as a line."""
    h = stats["centrality_histogram"]
    edges, counts = np.asarray(h["bin_edges"], dtype=float), np.asarray(h["counts"], dtype=float)
    fig, ax = _figure()
    nz = np.flatnonzero(counts)
    lo = edges[nz[0]] if len(nz) else 0.0
    lo = max(-1.0, min(lo, threshold - 0.1))
    keep = edges[:-1] >= lo - 1e-9
    colours = ["#3b7dd8" if e >= threshold - 1e-9 else "#b0b7c3" for e in edges[:-1][keep]]
    ax.bar(edges[:-1][keep], counts[keep], width=np.diff(edges)[keep], align="edge", color=colours, edgecolor="white")
    ax.axvline(threshold, color="#d62728", lw=2, label=f"anchor threshold {threshold:.3f}")
    ax.set_xlabel("centrality = cos(passage, document mean)")
    ax.set_ylabel("passages")
    ax.set_title(f"Centrality of {stats.get('passages', int(counts.sum()))} passages; "
                 f"{stats.get('anchor_rate_pct', 0):.1f}% are anchors")
    ax.legend(loc="upper left")
    _save(fig, path, storage)


def plot_groups_per_doc(stats: dict, path: str | Path, storage: Storage = LOCAL) -> None:
    """Processed documents by number of kept groups (0 = no group); the last bar counts 32 or more."""
    counts = np.asarray(stats["groups_per_doc_histogram"]["counts"], dtype=float)
    last = int(np.flatnonzero(counts)[-1]) if counts.any() else 0
    fig, ax = _figure()
    x = np.arange(last + 1)
    ax.bar(x, counts[: last + 1], color=["#b0b7c3"] + ["#3b7dd8"] * last, edgecolor="white")
    ax.axvline(stats.get("groups_per_doc", 0), color="#d62728", lw=2,
               label=f"mean over documents with groups: {stats.get('groups_per_doc', 0):.2f}")
    ax.set_xlabel("groups in the document (last bin: 32 or more)")
    ax.set_ylabel("documents")
    ax.set_title(f"Groups per document ({stats.get('docs_with_groups', 0)} of {stats.get('docs_processed', 0)} "
                 "documents have groups)")
    ax.legend(loc="upper right")
    _save(fig, path, storage)


def plot_coverage(stats: dict, path: str | Path, storage: Storage = LOCAL) -> None:
    """Two stacked bars: passages used in a kept group vs never used; documents by outcome."""
    fig, ax = _figure(6.4, 3.4)
    used, total = stats.get("passages_in_groups", 0), max(stats.get("passages", 0), 1)
    by = stats.get("docs_without_groups_by_reason", {})
    docs_in = max(stats.get("docs_in", 0), 1)
    rows = [
        ("passages", [("in a kept group", used, "#3b7dd8"), ("never used", total - used, "#b0b7c3")], total),
        ("documents", [("with groups", stats.get("docs_with_groups", 0), "#3b7dd8"),
                       ("too few passages", by.get("too_few_passages", 0), "#7f8a9b"),
                       ("no anchor", by.get("no_anchor", 0), "#f0a04b"),
                       ("all groups dropped by the consistency filter", by.get("consistency_filter", 0), "#d62728"),
                       ("no passages", by.get("no_passages", 0), "#8c564b"),
                       ("skipped (read)", stats.get("docs_skipped_total", 0), "#555555")], docs_in),
    ]
    seen = set()
    for y, (name, parts, denom) in enumerate(rows):
        left = 0.0
        for label, n, colour in parts:
            share = 100.0 * n / denom
            if n:
                ax.barh(y, share, left=left, color=colour, edgecolor="white",
                        label=None if label in seen else label)
                seen.add(label)
                if share >= 8:
                    ax.text(left + share / 2, y, f"{share:.1f}%", ha="center", va="center", color="white", fontsize=9)
            left += share
    ax.axvline(PAPER["passage_coverage_pct"], ymin=0.5, color="black", ls="--", lw=1, label="paper: 68% of passages")
    ax.set_yticks([0, 1], ["passages", "documents"])
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_xlabel("% of passages / % of input documents")
    ax.set_title(f"Passage coverage {stats.get('passage_coverage_pct', 0):.1f}%")
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    _save(fig, path, storage)


def plot_n_above(stats: dict, k: int | None, path: str | Path, storage: Storage = LOCAL) -> None:
    """The consistency filter's n_above histogram (mined groups), bars with n_above < k (kept) in colour."""
    h = stats["n_above_histogram"]
    edges, counts = h["bin_edges"], np.asarray(h["counts"], dtype=float)
    labels = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        labels.append(str(lo) if hi == "inf" or hi == lo + 1 else f"{lo}-{hi - 1}")
    labels[-1] = f"{edges[-2]}+"
    fig, ax = _figure()
    kept = [k is not None and isinstance(e, int) and e < k for e in edges[:-1]]
    ax.bar(np.arange(len(counts)), counts, color=["#3b7dd8" if c else "#d62728" for c in kept], edgecolor="white")
    ax.set_xticks(np.arange(len(counts)), labels, rotation=45, fontsize=8)
    ax.set_xlabel("n_above = pool passages of other documents\nwith cos(anchor, p) > s = cos(anchor, s1)")
    ax.set_ylabel("mined groups")
    if stats.get("consistency_enabled", True) and k is not None:
        ax.set_title(f"Consistency filter (k = {k}): kept {stats.get('groups', 0)} of {stats.get('groups_mined', 0)} "
                     f"groups ({stats.get('consistency_keep_rate_pct', 0):.1f}%)")
    else:
        ax.set_title("Consistency filter was off for this run")
    _save(fig, path, storage)


# ---- examples --------------------------------------------------------------------------------------------------------

def _read_groups(run: str, storage: Storage = LOCAL) -> list[tuple[int, "object"]]:
    import fnmatch

    names = sorted(p.rsplit("/", 1)[-1] for p in storage.ls(join(run, "groups")))
    parts = [n for n in names if fnmatch.fnmatchcase(n, "part-*.parquet")]
    if not parts:
        raise EvalInputError(f"run {run} has no groups/part-*.parquet")
    return [(int(n[: -len(".parquet")].split("-")[1]), storage.read_parquet(join(run, "groups", n))) for n in parts]


def _find_texts(shard: dict, id_column: str, text_column: str, ids: set[str], storage) -> dict[str, str]:
    """The text of each of ``ids`` in one input shard (first occurrence), decoded as the read stage decodes it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pairmine.operators.read import jsonl_document_columns, parquet_document_columns, read_jsonl_records

    path = shard["path"]
    if shard["format"] == "parquet":
        cols = parquet_document_columns(path, storage.read_parquet(path, [id_column, text_column]), text_column,
                                        id_column)
    else:
        cols = jsonl_document_columns(path, read_jsonl_records(path, storage), text_column, id_column)
    mask = pc.is_in(cols.ids, value_set=pa.array(sorted(ids), pa.string()))
    found: dict[str, str] = {}
    for i, text in zip(cols.ids.filter(mask).to_pylist(), cols.texts.filter(mask).to_pylist()):
        found.setdefault(i, text)
    return found


def sample_documents(run: str | Path, manifest: dict, examples: int, seed: int, groups_per_doc: int, reembed: bool,
                     notes: list[str], storage: Storage | None = None) -> list[dict]:
    """Seeded sample of documents with groups, each with its groups and (when its text can be re-read) every
    passage's index, text, centrality and whether a kept group used it.

    ``storage`` reads the run (default: local paths and the AWS environment) and, over the run's recorded
    ``[storage]`` (:func:`input_storage`), its input.

    Returns:
        One dict per document: doc_id, url, groups (up to ``groups_per_doc`` rows of the run), n_groups, passages
        (list of {index, text, centrality or None, used}) or None, check (text of the re-chunk check).
    """
    from pairmine.operators.centrality import centrality
    from pairmine.pipeline.config import run_chunk_spec

    parts = _read_groups(str(run), storage or LOCAL)
    by_doc: dict[str, dict] = {}
    for shard_index, table in parts:
        for row in table.to_pylist():
            d = by_doc.setdefault(row["doc_id"], {"doc_id": row["doc_id"], "url": row["url"], "shard": shard_index,
                                                  "rows": []})
            d["rows"].append(row)
    ids = sorted(by_doc)
    rng = np.random.default_rng(seed)
    chosen = [ids[i] for i in sorted(rng.choice(len(ids), size=min(examples, len(ids)), replace=False))] if ids else []
    docs = [by_doc[i] for i in chosen]
    for d in docs:
        d["rows"].sort(key=lambda r: r["anchor_index"])
        d["n_groups"] = len(d["rows"])
        d["passages"] = None
        d["check"] = ""
    if not docs:
        notes.append("the run has no group, so there is no example")
        return docs

    cfg = _config(manifest)
    shards = {s["shard_index"]: s for s in manifest.get("inputs", [])}
    texts: dict[str, str] = {}
    inputs = input_storage(cfg.storage_layer(), storage)
    for shard_index in sorted({d["shard"] for d in docs}):
        shard = shards.get(shard_index)
        want = {d["doc_id"] for d in docs if d["shard"] == shard_index}
        try:
            texts.update(_find_texts(shard, cfg.input.id_column, cfg.input.text_column, want, inputs)
                         if shard else {})
        except Exception as e:  # a moved/removed input: the page says so instead of failing
            notes.append(f"input shard {shard_index} ({shard['path'] if shard else '?'}) could not be read again "
                         f"({type(e).__name__}: {e}); its documents show their groups only")
    spec = run_chunk_spec(manifest)  # the run's own chunking, token limit included
    for d in docs:
        text = texts.get(d["doc_id"])
        if not isinstance(text, str):
            d["check"] = "document text not found in the run's input: groups only"
            continue
        passages = spec.chunk(text).passages
        ok = all(r["anchor_index"] < len(passages) and passages[r["anchor_index"]] == r["anchor_text"]
                 and all(j < len(passages) and passages[j] == t for j, t in zip(r["related_indices"], r["related_texts"]))
                 for r in d["rows"])
        if not ok:
            d["check"] = "re-chunking the input does not give the run's passages (input or chunk settings changed): groups only"
            continue
        used = {r["anchor_index"] for r in d["rows"]} | {j for r in d["rows"] for j in r["related_indices"]}
        d["passages"] = [{"index": i, "text": p, "centrality": None, "used": i in used} for i, p in enumerate(passages)]
        d["check"] = f"re-chunked: {len(passages)} passages, anchor and related texts identical to the run's"

    if reembed and any(d["passages"] for d in docs):
        from pairmine.pipeline.evaluate import make_embedder
        from pairmine.pipeline.mine import check_model

        try:
            check_model(cfg)
            embedder = make_embedder(cfg)
            with_text = [d for d in docs if d["passages"]]
            flat = [p["text"] for d in with_text for p in d["passages"]]
            matrix = embedder.encode(flat)  # (total_passages, dim), the run's model and passage prefix
        except Exception as e:
            notes.append(f"the run's model {cfg.embed.model or 'default'} could not embed the passages again "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); centrality of unused "
                         "passages not shown")
        else:
            lo, worst = 0, 0.0
            for d in with_text:
                n = len(d["passages"])
                cent = centrality(matrix[lo : lo + n])  # (n,)
                lo += n
                for p, v in zip(d["passages"], cent.tolist()):
                    p["centrality"] = v
                for r in d["rows"]:
                    worst = max(worst, abs(cent[r["anchor_index"]] - r["anchor_centrality"]))
            notes.append(f"centrality recomputed with {cfg.embed.model or 'the default model'} for the sampled "
                         f"documents; largest difference to the run's stored anchor centrality: {worst:.4f}")
    elif not reembed:
        notes.append("--no-reembed: passages never used are listed without their centrality")
    for d in docs:
        d["groups"] = d.pop("rows")[:groups_per_doc]
    return docs


# ---- HTML ----------------------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"DejaVu Sans",sans-serif;margin:24px auto;max-width:1180px;color:#1d2330;
line-height:1.4}
h1{font-size:1.5em;margin-bottom:0}h2{margin-top:1.8em;border-bottom:1px solid #d8dde6}
.sub{color:#5b6577;margin-top:4px}
table{border-collapse:collapse;margin:8px 0 16px 0;font-size:0.9em;width:100%}
th,td{border:1px solid #d8dde6;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#eef2f8}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.figs{display:grid;grid-template-columns:1fr 1fr;gap:12px}.figs img{width:100%;border:1px solid #d8dde6}
tr.anchor td{background:#e8f0fc}tr.unused td{color:#5b6577}.tag{font-size:0.8em;color:#5b6577}
.note{background:#fff8e6;border-left:4px solid #f0a04b;padding:6px 10px;margin:6px 0}
table.summary{width:auto}
"""


def _short(text: str) -> str:
    t = " ".join(str(text).split())
    cut = t if len(t) <= TEXT_CHARS else t[:TEXT_CHARS].rsplit(" ", 1)[0] + " …"
    return f'<span title="{html.escape(t)}">{html.escape(cut)}</span>'


def _num(v, fmt: str = "{:.3f}") -> str:
    return "" if v is None else fmt.format(v)


def _summary_rows(stats: dict, manifest: dict) -> list[tuple[str, str, str]]:
    res = manifest.get("resolved", {})
    cons = manifest.get("consistency", {})
    rows = [
        ("model", html.escape(str(res.get("model", ""))), ""),
        ("passage prefix", html.escape(repr(res.get("passage_prefix", ""))), ""),
        ("anchor threshold (centrality)", _num(stats.get("anchor_threshold")), "0.825 with E5"),
        ("documents in / processed / skipped",
         f"{stats.get('docs_in', 0)} / {stats.get('docs_processed', 0)} / {stats.get('docs_skipped_total', 0)}", ""),
        ("documents skipped, by reason",
         html.escape(", ".join(f"{r} {n}" for r, n in (stats.get("docs_skipped") or {}).items() if n) or "none"), ""),
        ("documents whose invalid UTF-8 was replaced (U+FFFD)", str(stats.get("docs_text_repaired", 0)), ""),
        ("passages / anchors (anchor rate)",
         f"{stats.get('passages', 0)} / {stats.get('anchors', 0)} ({stats.get('anchor_rate_pct', 0):.1f}%)", ""),
        ("passages cut again to fit embed.max_length tokens (chunk.fit_model_length)",
         str(stats.get("passages_token_split", 0)), ""),
        ("passages cut to embed.max_length tokens (the model saw only their start)",
         str(stats.get("passages_token_truncated", 0)), ""),
        ("passages dropped: repeated inside their document / under chunk.min_words",
         f"{stats.get('passages_duplicate_dropped', 0)} / {stats.get('passages_short_dropped', 0)}", ""),
    ]
    before = stats.get("before_consistency_filter")
    filtered = stats.get("consistency_enabled", True)
    if filtered and before:
        # The paper's figures (seed 000) have no consistency filter: they sit beside the figures before it.
        rows += [
            ("<b>before the consistency filter</b> (every mined group; comparable to the paper)", "", ""),
            ("documents with groups, % of processed", f"{before['docs_with_groups']} "
             f"({before['docs_with_groups_pct']:.1f}%)", "99%"),
            ("groups (mined) / groups per document with groups",
             f"{before['groups']} / {before['groups_per_doc']:.2f}", "7.0 per document"),
            ("passage coverage (in a mined group)", f"{before['passage_coverage_pct']:.1f}%", "68%"),
            ("<b>after the consistency filter</b> (kept groups, the run's output)", "", "(the paper has no filter)"),
        ]
    paper = not (filtered and before)  # no before-filter figures (filter off, or a run from an older version)
    rows += [
        ("documents with groups, % of processed", f"{stats.get('docs_with_groups', 0)} "
         f"({stats.get('docs_with_groups_pct', 0):.1f}%)", "99%" if paper else ""),
        ("documents with groups, % of those with enough passages",
         f"{stats.get('docs_with_groups_pct_of_eligible', 0):.1f}%", ""),
        ("groups (kept) / groups per document with groups",
         f"{stats.get('groups', 0)} / {stats.get('groups_per_doc', 0):.2f}", "7.0 per document" if paper else ""),
        ("passage coverage (in a kept group)", f"{stats.get('passage_coverage_pct', 0):.1f}%", "68%" if paper else ""),
    ]
    if filtered:
        rows.append(("consistency filter: pool P, k, groups kept",
                     f"P = {cons.get('pool_size')}, k = {cons.get('k')}; {stats.get('groups', 0)} of "
                     f"{stats.get('groups_mined', 0)} ({stats.get('consistency_keep_rate_pct', 0):.1f}%)",
                     "P = 1,000,000, k = 2 (E5)"))
    else:
        rows.append(("consistency filter", "off", ""))
    return rows


def _stages_html(figures: list[dict]) -> str:
    """The per-stage figures of stats.json (``stages``: wall, busy and CPU seconds, tasks, rows) as a small table;
    empty for runs that have none."""
    if not figures:
        return ""
    rows = "\n".join(
        f'<tr><td>{html.escape(str(f.get("stage", "")))}</td><td class="n">{f.get("wall_s", 0):.1f}</td>'
        f'<td class="n">{f.get("busy_s", 0):.1f}</td><td class="n">{f.get("cpu_s", 0):.1f}</td>'
        f'<td class="n">{f.get("tasks", 0)}</td><td class="n">{f.get("rows_out", 0)}</td></tr>' for f in figures)
    return ("<h2>Stages</h2>\n<p>From Ray Data's execution stats: <b>wall</b> = first start to last end of the "
            "stage, <b>busy</b> = task time summed over its tasks and actors, rows = rows it produced. Stages that Ray "
            "fused into one operator share a row.</p>\n<table class=\"summary\"><tr><th>stage</th><th>wall s</th>"
            f"<th>busy s</th><th>CPU s</th><th>tasks</th><th>rows out</th></tr>\n{rows}\n</table>")


def _doc_html(d: dict, threshold: float) -> str:
    out = [f"<h3>{html.escape(str(d['doc_id']))}</h3>"]
    if d.get("url"):
        out.append(f'<div class="sub">{html.escape(d["url"])}</div>')
    out.append(f'<div class="sub">{d["n_groups"]} group(s) in this document'
               f'{", first " + str(len(d["groups"])) + " shown" if len(d["groups"]) < d["n_groups"] else ""}; '
               f'{html.escape(d["check"])}</div>')
    for g in d["groups"]:
        out.append("<table><tr><th>role</th><th>passage</th><th>text</th><th>centrality</th><th>dense</th>"
                   "<th>TF-IDF</th><th>RRF</th></tr>")
        extra = "" if g.get("s") is None else f'<br><span class="tag">s = {g["s"]:.3f}, n_above = {g["n_above"]}</span>'
        out.append(f'<tr class="anchor"><td>anchor{extra}</td><td class="n">{g["anchor_index"]}</td>'
                   f'<td>{_short(g["anchor_text"])}</td><td class="n">{g["anchor_centrality"]:.3f}</td>'
                   "<td></td><td></td><td></td></tr>")
        cent = {p["index"]: p["centrality"] for p in d["passages"]} if d["passages"] else {}
        for rank, (j, t, dn, tf, rr) in enumerate(zip(g["related_indices"], g["related_texts"], g["related_dense"],
                                                      g["related_tfidf"], g["related_rrf"]), start=1):
            role = "related 1 (positive, s1)" if rank == 1 else f"related {rank}"
            out.append(f'<tr><td>{role}</td><td class="n">{j}</td><td>{_short(t)}</td>'
                       f'<td class="n">{_num(cent.get(j))}</td><td class="n">{dn:.3f}</td><td class="n">{tf:.3f}</td>'
                       f'<td class="n">{rr:.4f}</td></tr>')
        out.append("</table>")
    if d["passages"] is not None:
        unused = [p for p in d["passages"] if not p["used"]]
        out.append(f"<p><b>Passages never used</b> (neither anchor nor related passage of a kept group): "
                   f"{len(unused)} of {len(d['passages'])}</p>")
        if unused:
            out.append("<table><tr><th>passage</th><th>text</th><th>centrality</th><th></th></tr>")
            for p in unused:
                c = p["centrality"]
                tag = ("above the threshold: an anchor whose group the consistency filter dropped"
                       if c is not None and c >= threshold else "")
                out.append(f'<tr class="unused"><td class="n">{p["index"]}</td><td>{_short(p["text"])}</td>'
                           f'<td class="n">{_num(c)}</td><td class="tag">{tag}</td></tr>')
            out.append("</table>")
    return "\n".join(out)


def build_report(run: str, output: str = "", examples: int = 5, seed: int = 0, groups_per_doc: int = 1,
                 reembed: bool = True, storage: Storage | None = None) -> ReportResult:
    """Write ``report.html`` and its PNG plots for a committed run folder.

    Args:
        run: run folder (``<output>/<run_id>`` of ``pairmine mine``), local or ``s3://``.
        output: folder for the page and plots, local or ``s3://``; empty: ``<run>/report``.
        examples: documents with groups sampled for the example tables (seeded by ``seed``).
        groups_per_doc: groups shown per sampled document (all its unused passages are shown).
        reembed: embed the sampled documents' passages again to show the centrality of unused passages.
        storage: reads the run and writes the page (default: local paths and the AWS environment); the run's input
            is re-read with its recorded ``[storage]`` overlaid with this one's settings (:func:`input_storage`).

    Returns:
        :class:`ReportResult`.

    Raises:
        EvalInputError: the run folder is missing, not committed, or its files cannot be read.
    """
    fs_storage = storage or LOCAL
    run = str(run)
    stats, manifest = _load_run(run, fs_storage)
    out = str(output) if output else join(run, "report")
    info = fs_storage.info(out)
    if info is not None and info.get("type") != "directory":
        raise EvalInputError(f"--output {out} is a file; it must be a folder (created if missing)")
    fs_storage.makedirs(out)
    run_name = run.rstrip("/").rsplit("/", 1)[-1]
    where = str(Path(run).resolve()) if "://" not in run else run.rstrip("/")
    threshold = float(stats.get("anchor_threshold", manifest.get("resolved", {}).get("anchor_threshold", 0.0)))
    k = manifest.get("consistency", {}).get("k") if stats.get("consistency_enabled", True) else None
    plot_centrality(stats, threshold, join(out, "centrality.png"), fs_storage)
    plot_groups_per_doc(stats, join(out, "groups_per_doc.png"), fs_storage)
    plot_coverage(stats, join(out, "coverage.png"), fs_storage)
    plot_n_above(stats, k, join(out, "n_above.png"), fs_storage)
    notes: list[str] = []
    docs = sample_documents(run, manifest, examples, seed, groups_per_doc, reembed, notes, storage)

    rows = "\n".join(f'<tr><td>{a}</td><td class="n">{b}</td><td class="n">{c}</td></tr>'
                     for a, b, c in _summary_rows(stats, manifest))
    figs = "\n".join(f'<img src="{p}" alt="{p[:-4].replace("_", " ")}">' for p in PLOTS)
    stages = _stages_html(stats.get("stages") or [])
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pairmine report: {html.escape(str(stats.get('run_id', run_name)))}</title>
<style>{_CSS}</style></head><body>
<h1>pairmine run {html.escape(str(stats.get('run_id', run_name)))}</h1>
<div class="sub">{html.escape(where)} &middot; created {html.escape(str(manifest.get('created_utc', '')))}
&middot; {len(manifest.get('inputs', []))} input shard(s)</div>
<h2>Figures</h2>
<table class="summary"><tr><th></th><th>this run</th><th>paper (seed 000, E5 on FineWeb)</th></tr>
{rows}
</table>
<div class="figs">
{figs}
</div>
{stages}
<h2>Examples</h2>
<p>{len(docs)} documents with groups, sampled with seed {seed}. Scores: <b>centrality</b> = cos(passage, document
mean); <b>dense</b> = cos(anchor, passage); <b>TF-IDF</b> = cosine of TF-IDF vectors; <b>RRF</b> =
2/(10 + rank_dense) + 1/(10 + rank_TF-IDF); <b>s</b> = cos(anchor, s1) and <b>n_above</b> = pool passages above s
(consistency filter). Passages never used come from re-chunking the input (and re-embedding it for their
centrality): they are not in the run's output.</p>
{''.join(f'<div class="note">{html.escape(n)}</div>' for n in notes)}
{''.join(_doc_html(d, threshold) for d in docs)}
</body></html>
"""
    html_path = join(out, "report.html")
    fs_storage.write_bytes(html_path, page.encode("utf-8"))
    return ReportResult(html_path, [join(out, p) for p in PLOTS], docs, notes)
