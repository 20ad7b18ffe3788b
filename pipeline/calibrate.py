"""``pairmine calibrate``: choose the anchor threshold for a model and corpus before a large run.

Centrality depends on the model (and the corpus), so a threshold measured for one model does not carry over: E5's
0.825 keeps ~11% of passages as anchors with all-MiniLM-L6-v2. This module samples documents (seeded, the same
bottom-k scheme as the mining job's TF-IDF sample), chunks them and embeds them with the mine operators, and
computes, for any threshold, what the mining job would produce before its consistency filter: anchors, groups,
documents with groups and passage coverage, with the mine code itself (``operators.related.mine_groups``). It then
proposes the threshold that reaches a target passage coverage (default: the paper's 68%, seed 000) or a target
anchor rate. ``benchmarks/threshold_sweep.py`` prints the same sweep with these functions.

Coverage: passages used as anchor or related passage / passages of the documents with at least n_related + 1
passages (``basis="eligible"``, the default: shorter documents can never yield a group; the paper's 68% is over a
corpus where 99% of documents yield groups, and the default model's 0.675 was chosen on this basis), or / all
passages as in stats.json (``basis="all"``); both are shown.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("pairmine")

BASES = ("all", "eligible")


@dataclass
class EmbeddedDoc:
    """One sampled document after chunk, embed and centrality.

    Attributes:
        passages: passage texts (the mine chunker's output).
        centrality: (n_passages,) float32, cos(passage, document mean).
        used_if_anchor: for each passage i, the passages a group anchored at i uses ({i} and its related passages,
            from ``mine_groups``); empty lists when the document has too few passages for a group.
    """

    passages: list[str]
    centrality: np.ndarray
    used_if_anchor: list[list[int]] = field(default_factory=list)

    @property
    def eligible(self) -> bool:
        return bool(self.used_if_anchor)


@dataclass
class SweepRow:
    """What the mining job (before its consistency filter) gives at one threshold on the sampled documents.

    Percentages are 0-100. ``coverage_pct`` is stats.json's passage_coverage_pct (over all passages);
    ``coverage_eligible_pct`` counts only passages of documents with >= n_related + 1 passages.
    """

    threshold: float
    anchors: int
    anchor_rate_pct: float
    groups: int
    docs_with_groups: int
    groups_per_doc: float
    docs_with_groups_pct: float
    docs_with_groups_pct_of_eligible: float
    covered: int
    coverage_pct: float
    coverage_eligible_pct: float


def sample_texts(path: str, text_column: str, id_column: str, sample_docs: int, seed: int, fmt: str = "auto",
                 storage=None) -> list[str]:
    """A seeded uniform sample of ``sample_docs`` usable documents of the input (all of them when it has fewer),
    drawn like the mining job's TF-IDF sample (``pipeline.inputs.scan_shard``: bottom-k of seeded priorities), so
    the same seed gives the same documents.

    ``storage``: an ``operators.storage.Storage`` (endpoint, retries) for s3:// inputs; None: the default one.

    Raises:
        FileNotFoundError, InputError, MissingColumnError, StorageError: as ``pairmine mine`` for the same input.
    """
    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.inputs import check_parquet_shards, discover_shards, sample_cut, scan_shard

    storage = storage or LOCAL  # local paths, or s3:// with the standard AWS environment
    shards = discover_shards(path, fmt, storage)
    layout: dict[int, list[int]] = {}
    known_rows = check_parquet_shards(shards, (text_column, id_column), storage, layout=layout)
    cut = sample_cut(sample_docs, known_rows)
    merged = []  # per unit (row group or JSONL file) as the mining job's first pass (pipeline.first_pass)
    for s in shards:
        for rg in (range(len(layout.get(s.index, []))) if s.format == "parquet" else [-1]):
            scan = scan_shard(s, text_column, id_column, sample_docs, seed, cut, storage=storage, row_group=rg)
            merged.extend((p, s.index, rg, t) for p, t in scan.sample)
    return [t for *_, t in sorted(merged)[:sample_docs]]


def embed_documents(texts: list[str], cfg, embedder=None) -> list[EmbeddedDoc]:
    """Chunk (``cfg.chunk``), embed (``cfg.embed``: model, passage prefix), score centrality, and find the group
    every passage would anchor (``cfg.related``), with the mine operators. TF-IDF is fitted on the passages of
    ``texts`` (the mining job fits it on its own seeded sample of the input).

    Args:
        texts: document texts.
        cfg: a ``MineConfig``.
        embedder: an :class:`operators.embed.Embedder` to reuse; None builds one from ``cfg.embed``.

    Returns:
        One :class:`EmbeddedDoc` per text, in order.
    """
    from pairmine.operators.centrality import centrality
    from pairmine.operators.related import EmptySampleError, fit_tfidf, mine_groups, unfitted_tfidf
    from pairmine.pipeline.evaluate import make_embedder

    r, spec = cfg.related, cfg.chunk_spec()
    chunked = [spec.chunk(t).passages for t in texts]
    flat = [p for doc in chunked for p in doc]
    try:
        tfidf = fit_tfidf(flat, cfg.tfidf.max_features, cfg.tfidf.sublinear_tf)
    except EmptySampleError:
        tfidf = unfitted_tfidf(cfg.tfidf.sublinear_tf)  # as the mining job: no IDF, every word weighs the same
    embedder = embedder or make_embedder(cfg)
    log.info("calibrate: embedding %d passages of %d documents", len(flat), len(texts))
    matrix = embedder.encode(flat)  # (total_passages, dim)
    bounds = np.cumsum([0] + [len(d) for d in chunked])
    docs = []
    for i, passages in enumerate(chunked):
        vectors = matrix[bounds[i] : bounds[i + 1]]  # (n, dim)
        cent = centrality(vectors) if len(passages) else np.zeros(0, np.float32)
        used: list[list[int]] = []
        if len(passages) >= r.n_related + 1:
            # Every passage as an anchor (threshold below any centrality): the group a passage anchors does not
            # depend on the threshold, so coverage at any threshold is a union of these.
            groups, _ = mine_groups(vectors, tfidf.transform_document(passages), cent, -2.0, r.n_related, r.rrf_k,
                                    r.w_dense, r.w_lexical)
            used = [[g.anchor_index, *g.related_indices] for g in groups]
        docs.append(EmbeddedDoc(passages, cent, used))
    return docs


def sweep_row(docs: list[EmbeddedDoc], threshold: float) -> SweepRow:
    """The mining job's figures (before the consistency filter) at ``threshold`` on the embedded documents:
    anchors are passages with centrality >= threshold (``operators.centrality.anchor_indices``)."""
    from pairmine.operators.centrality import anchor_indices

    anchors = groups = with_groups = covered = covered_eligible = 0
    passages = sum(len(d.passages) for d in docs)
    eligible_docs = [d for d in docs if d.eligible]
    eligible_passages = sum(len(d.passages) for d in eligible_docs)
    for d in docs:
        a = anchor_indices(d.centrality, threshold)
        anchors += len(a)
        if not d.eligible or not len(a):
            continue
        used = {j for i in a for j in d.used_if_anchor[i]}
        groups += len(a)
        with_groups += 1
        covered += len(used)
    covered_eligible = covered  # only eligible documents have groups
    pct = lambda x, n: round(100.0 * x / n, 3) if n else 0.0  # noqa: E731
    return SweepRow(
        threshold=float(threshold), anchors=anchors, anchor_rate_pct=pct(anchors, passages), groups=groups,
        docs_with_groups=with_groups, groups_per_doc=round(groups / with_groups, 4) if with_groups else 0.0,
        docs_with_groups_pct=pct(with_groups, len(docs)),
        docs_with_groups_pct_of_eligible=pct(with_groups, len(eligible_docs)), covered=covered,
        coverage_pct=pct(covered, passages), coverage_eligible_pct=pct(covered_eligible, eligible_passages),
    )


def shortest_threshold(above: float, at_most: float) -> float:
    """The threshold with the fewest decimals (at least 3) in (above, at_most]: it selects exactly the passages
    with centrality >= at_most when ``above`` is the next lower centrality, whether the comparison is made in
    float32 (the anchor stage) or float64. Example: (0.6712, 0.6748] -> 0.674.
    """
    for digits in range(3, 10):
        t = math.floor(at_most * 10**digits) / 10**digits  # <= at_most, so float32(t) <= at_most too
        if t > above and np.float32(t) > np.float32(above):
            return round(t, digits)
    return float(at_most)


def propose_threshold(docs: list[EmbeddedDoc], target_coverage_pct: float | None = 68.0,
                      target_anchor_rate_pct: float | None = None, basis: str = "eligible") -> SweepRow:
    """The anchor threshold whose figure is closest to the target, searched over the centralities themselves.

    A threshold t selects the passages with centrality >= t, so only the distinct centrality values matter, and both
    coverage and anchor rate grow as t falls (a lower threshold only adds anchors, and the group an anchor gets does
    not depend on the threshold): a binary search over the sorted values finds the closest one (ties: the higher
    threshold). The threshold returned is the shortest decimal (>= 3 digits) that selects the same anchors.

    Args:
        target_coverage_pct: passage coverage to reach, in %; ignored when ``target_anchor_rate_pct`` is given.
        target_anchor_rate_pct: % of passages that should be anchors.
        basis: "all" (coverage as stats.json's passage_coverage_pct) or "eligible" (passages of documents with
            enough passages for a group).

    Raises:
        ValueError: unknown basis, no target, a target outside 0-100, or no passage at all.
    """
    if basis not in BASES:
        raise ValueError(f"basis must be one of {', '.join(BASES)}, got {basis!r}")
    target = target_anchor_rate_pct if target_anchor_rate_pct is not None else target_coverage_pct
    if target is None or not 0 <= target <= 100:
        raise ValueError(f"the target must be a percentage between 0 and 100, got {target!r}")
    if target_anchor_rate_pct is not None:
        key = "anchor_rate_pct"
    else:
        key = "coverage_pct" if basis == "all" else "coverage_eligible_pct"
    values = np.unique(np.concatenate([d.centrality for d in docs] + [np.zeros(0, np.float32)]))[::-1]  # descending
    if not len(values):
        raise ValueError("no passage to calibrate on")
    rows: dict[int, SweepRow] = {}

    def at(j: int) -> SweepRow:  # threshold = the j-th largest centrality: a figure that grows with j
        if j not in rows:
            rows[j] = sweep_row(docs, float(values[j]))
        return rows[j]

    lo, hi = 0, len(values) - 1  # smallest j whose figure reaches the target (hi when none does)
    while lo < hi:
        mid = (lo + hi) // 2
        if getattr(at(mid), key) >= target:
            hi = mid
        else:
            lo = mid + 1
    j = lo
    if j > 0 and abs(getattr(at(j - 1), key) - target) <= abs(getattr(at(j), key) - target):
        j -= 1
    below = float(values[j + 1]) if j + 1 < len(values) else -1.0
    row = at(j)
    row.threshold = shortest_threshold(below, float(values[j]))
    return row


@dataclass
class Calibration:
    """What :func:`calibrate` returns (everything ``pairmine calibrate`` prints)."""

    input: str
    model: str
    prefix: str
    docs: int
    passages: int
    eligible_docs: int
    eligible_passages: int
    quantiles: dict
    histogram: tuple  # (bin edges, counts) over all passages
    sweep: list[SweepRow]
    target: str
    basis: str
    proposal: SweepRow
    other_basis: SweepRow | None
    above: list[tuple[float, int, str]]  # (centrality, doc number, text) of anchors just above the threshold
    below: list[tuple[float, int, str, bool]]  # (centrality, doc number, text, used as a related passage)


def calibrate(cfg, sample_docs: int = 1000, seed: int = 0, target_coverage_pct: float = 68.0,
              target_anchor_rate_pct: float | None = None, basis: str = "eligible", examples: int = 5,
              band: float = 0.03) -> Calibration:
    """Sample documents of ``cfg.input.path``, embed them with ``cfg.embed`` and propose an anchor threshold.

    Args:
        cfg: a validated ``MineConfig`` (input, chunk, embed, related sections are used).
        sample_docs: documents to sample (seeded with ``seed``).
        target_coverage_pct / target_anchor_rate_pct / basis: see :func:`propose_threshold`.
        examples: passages shown on each side of the proposed threshold.
        band: width of centrality on each side of the threshold the examples come from.

    Raises:
        FileNotFoundError, InputError, MissingColumnError: bad input. ConfigError: the model cannot be loaded.
        EvalInputError: no usable passage in the sample, a bad target or basis.
    """
    from pairmine.pipeline.evaluate import EvalInputError
    from pairmine.pipeline.mine import check_model, model_id

    target_value = target_anchor_rate_pct if target_anchor_rate_pct is not None else target_coverage_pct
    if target_value is None or not 0 <= target_value <= 100:
        raise EvalInputError(f"the target must be a percentage between 0 and 100, got {target_value!r}")
    if basis not in BASES:
        raise EvalInputError(f"the coverage basis must be one of {', '.join(BASES)}, got {basis!r}")
    if sample_docs < 1:
        raise EvalInputError(f"--sample-docs must be >= 1, got {sample_docs}")
    texts = sample_texts(cfg.input.path, cfg.input.text_column, cfg.input.id_column, sample_docs, seed, cfg.input.format,
                         cfg.storage_layer())
    check_model(cfg)
    docs = embed_documents(texts, cfg)
    cents = np.concatenate([d.centrality for d in docs]) if docs else np.zeros(0)
    if not len(cents):
        raise EvalInputError(f"the {len(texts)} sampled documents of {cfg.input.path or 'the sample'} hold no passage "
                         f"of at least {cfg.chunk.min_words} words")
    proposal = propose_threshold(docs, target_coverage_pct, target_anchor_rate_pct, basis)
    other = None
    if target_anchor_rate_pct is None:
        other = propose_threshold(docs, target_coverage_pct, None, "eligible" if basis == "all" else "all")
        target = f"{target_coverage_pct:g}% passage coverage ({'all passages, as stats.json' if basis == 'all' else 'passages of documents with enough passages'})"
    else:
        target = f"{target_anchor_rate_pct:g}% of passages as anchors"
    qs = (1, 5, 10, 25, 50, 75, 90, 95, 99)
    quantiles = {f"p{q}": float(v) for q, v in zip(qs, np.percentile(cents, qs))}
    edges = np.round(np.arange(np.floor(cents.min() * 20) / 20, 1.0001, 0.05), 4)
    hist = np.histogram(np.clip(cents, edges[0], 1.0), bins=edges)[0] if len(edges) > 1 else np.array([len(cents)])
    t = proposal.threshold
    above, below = [], []
    for n, d in enumerate(docs):
        if not d.eligible:
            continue
        anchors = np.flatnonzero(d.centrality >= t)
        used = {j for i in anchors for j in d.used_if_anchor[i]}
        for i, c in enumerate(d.centrality.tolist()):
            if t <= c < t + band:
                above.append((c, n, d.passages[i]))
            elif t - band <= c < t:
                below.append((c, n, d.passages[i], i in used))
    rng = np.random.default_rng(seed)
    pick = lambda xs: [xs[i] for i in sorted(rng.choice(len(xs), size=min(examples, len(xs)), replace=False))] if xs else []  # noqa: E731
    eligible = [d for d in docs if d.eligible]
    return Calibration(
        input=cfg.input.path or "the shipped sample", model=model_id(cfg), prefix=cfg.resolved_prefix(), docs=len(docs),
        passages=len(cents), eligible_docs=len(eligible), eligible_passages=sum(len(d.passages) for d in eligible),
        quantiles=quantiles, histogram=(edges.tolist(), hist.tolist()),
        sweep=[sweep_row(docs, float(x)) for x in _grid(quantiles["p5"], quantiles["p99"])],
        target=target, basis=basis if target_anchor_rate_pct is None else "anchor rate", proposal=proposal, other_basis=other,
        above=sorted(pick(above), reverse=True), below=sorted(pick(below), reverse=True),
    )


def _grid(low: float, high: float, rows: int = 24) -> np.ndarray:
    """Sweep thresholds from ``low`` to ``high`` on a round step (0.025 for spreads like MiniLM's)."""
    step = next((s for s in (0.05, 0.025, 0.01, 0.005, 0.0025, 0.001, 0.0005, 0.0001) if (high - low) / s >= rows / 2),
                0.0001)
    start, stop = math.floor(low / step) * step, math.ceil(high / step) * step
    return np.round(np.arange(start, stop + step / 2, step), 6)[:rows * 2]


def _clip(text: str, n: int = 150) -> str:
    t = " ".join(text.split())
    return t if len(t) <= n else t[:n].rsplit(" ", 1)[0] + " ..."


def format_calibration(c: Calibration) -> str:
    """The text ``pairmine calibrate`` prints."""
    lines = [
        f"sample: {c.docs} documents of {c.input}, {c.passages} passages ({c.eligible_passages} in the "
        f"{c.eligible_docs} documents with enough passages for a group)",
        f"model: {c.model} (passage prefix {c.prefix!r})",
        "",
        "centrality of all passages (cos(passage, document mean)):",
        "  " + "  ".join(f"{k} {v:.3f}" for k, v in c.quantiles.items()),
    ]
    edges, counts = c.histogram
    top = max(counts) if counts else 1
    for lo, hi, n in zip(edges[:-1], edges[1:], counts):
        lines.append(f"  [{lo:5.2f}, {hi:5.2f})  {n:6d}  {'#' * int(round(40 * n / top)) if top else ''}")
    lines += ["", "threshold sweep (before the consistency filter):",
              f"  {'threshold':>9} {'anchors%':>8} {'groups/doc':>10} {'docs%':>6} {'docs%elig':>9} "
              f"{'coverage%':>9} {'cov%elig':>8}"]
    for r in c.sweep:
        lines.append(f"  {r.threshold:9.4f} {r.anchor_rate_pct:8.1f} {r.groups_per_doc:10.2f} "
                     f"{r.docs_with_groups_pct:6.1f} {r.docs_with_groups_pct_of_eligible:9.1f} {r.coverage_pct:9.1f} "
                     f"{r.coverage_eligible_pct:8.1f}")
    p = c.proposal
    lines += [
        "  (docs% = documents with groups / sampled documents; elig = only documents with enough passages;",
        "   coverage% = passages in a group / all passages, as stats.json's passage_coverage_pct)",
        "",
        f"proposed anchor threshold for {c.target}: {p.threshold}",
        f"  anchors {p.anchor_rate_pct:.1f}%, {p.groups_per_doc:.2f} groups per document with groups, "
        f"{p.docs_with_groups_pct_of_eligible:.1f}% of eligible documents with groups, coverage {p.coverage_pct:.1f}% "
        f"of all passages ({p.coverage_eligible_pct:.1f}% of eligible documents' passages)",
        f"  use it: pairmine mine --set anchors.threshold={p.threshold}",
    ]
    if c.other_basis is not None:
        o = c.other_basis
        other = "passages of eligible documents only" if c.basis == "all" else "all passages (as stats.json)"
        lines.append(f"  (the same target over {other} gives {o.threshold}; the default model's 0.675 was "
                     "chosen over eligible documents)")
    lines += ["", f"anchors just above {p.threshold} (centrality, document):"]
    lines += [f"  {cent:.3f}  doc {n:<4d} {_clip(t)}" for cent, n, t in c.above] or ["  (none in the band)"]
    lines += ["", f"excluded passages just below {p.threshold} (not anchors; 'related' = still used as a related "
              "passage):"]
    lines += [f"  {cent:.3f}  doc {n:<4d} {'related ' if used else 'unused  '}{_clip(t)}" for cent, n, t, used in c.below] \
        or ["  (none in the band)"]
    lines.append("note: coverage here is before the consistency filter (a run's stats.json counts kept groups only); "
                 "the IDF is fitted on the sampled documents")
    return "\n".join(lines)
