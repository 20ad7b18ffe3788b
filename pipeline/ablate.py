"""``pairmine ablate``: the data ablation (SPEC "Does it help?"; seed 000 Table 3). Does training on the mined groups
give a better encoder than the cheap pairs from the same documents?

One proxy encoder is trained per arm and seed on the same groups, with the same pairs per step, the same steps, the
same optimiser, objective and seed; only the positive changes:

    start    no training: the proxy's starting point (scratch: the random BERT of that seed; continue: the run's model)
    xprt     anchor -> s1, the top related passage (what pairmine mines)
    random   anchor -> a random other passage of the same document, drawn from all its passages (the paper's ablation,
             ``train --positives random``)
    crop     two independent random spans of the same document, each as long as one of its passages (``train
             --positives crop``; the usual contrastive pre-training pair)

Regimes: ``scratch`` (default), a small BERT (``train.scratch_*``: 4 layers x 256, 4 heads, ~3.2M non-embedding
parameters) with the default model's tokenizer, randomly initialised, trained with L_xp alone (every other weight 0:
no decoder, head or frozen model is built, see ``pipeline/train.py`` ``xprt_terms``); ``continue``, the run's
embedding model continued with the full xPRT objective (the paper's setting from E5).

Every encoder is evaluated with :func:`pipeline.evaluate.evaluate` (``pairmine eval``) on each BEIR set and the STS
file; arms are compared with :func:`pipeline.evaluate.compare_results` (``pairmine compare``): per query, the metric
averaged over seeds, arm against ``random`` and against ``start``, paired sign-flip p-value.

Output (``OUT``): ``ablation.json`` (every figure), ``ablation.md`` (one table), ``ablation.html`` (the table and one
plot: bars per set, whiskers over seeds), ``plan.json`` (what decides the result: a re-run with another plan is
refused), and per arm and seed ``units/<arm>-s<seed>/`` (the training folder with ``export/``, the evaluations, and
``done.json`` last): a re-run with the same ``OUT`` skips finished units and resumes a unit's training from its
checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass

from pairmine.pipeline.config import ConfigError

log = logging.getLogger("pairmine")

ARMS = ("start", "xprt", "random", "crop")
REGIMES = ("scratch", "continue")

# The proxies' settings per regime, before --config/--set (which override them), sized so that the default run fits
# an hour on 2 CPU cores (no gradient checkpointing: this small model's activations are small). Measured figures:
# docs/benchmarks.md ("Ablation proxies").
SCRATCH = ["train.init=scratch", "train.max_length=128", "train.batch_size=64", "train.max_steps=80",
           "train.lr_new=5e-4", "train.warmup_ratio=0.1", "loss.w_cross=0", "loss.w_self=0", "loss.w_mlm=0",
           "loss.w_unif=0", "loss.retention_start=0", "loss.retention_end=0", "checkpoint.every_steps=40",
           "train.attention_dropout=0", "train.gradient_checkpointing=false"]
CONTINUE = ["train.max_length=128", "train.batch_size=16", "train.max_steps=60", "checkpoint.every_steps=20"]
QUICK = {"scratch": ["train.max_steps=12", "train.batch_size=16", "train.max_length=64", "checkpoint.every_steps=-1"],
         "continue": ["train.max_steps=4", "train.batch_size=8", "train.max_length=64", "checkpoint.every_steps=-1"]}


@dataclass
class AblationResult:
    """What :func:`ablate` returns: the output folder, the content of ablation.json, units trained in this call."""

    output: str
    summary: dict
    trained: int


def parse_arms(text: str) -> list[str]:
    """``--arms`` "start,xprt,random,crop" -> the list, in the given order. Raises ConfigError on an unknown or
    repeated arm, or an empty list."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if not arms or bad or len(set(arms)) != len(arms):
        raise ConfigError(f"--arms {text!r}: give distinct arms among {', '.join(ARMS)}"
                          + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return arms


def plan_config(cfg) -> dict:
    """The training config as the ablation's plan records it: every key but those that do not change what a
    training run computes (where it runs, how often it saves, how memory is bounded: the keys a training resume
    accepts, :data:`pipeline.train._NOT_PLAN_SECTIONS` / ``_NOT_PLAN_FIELDS``)."""
    from pairmine.pipeline.train import _NOT_PLAN_FIELDS, _NOT_PLAN_SECTIONS

    return {s: {k: v for k, v in d.items() if (s, k) not in _NOT_PLAN_FIELDS}
            for s, d in cfg.to_dict().items() if s not in _NOT_PLAN_SECTIONS}


def proxy_overrides(regime: str, quick: bool, run_model: str) -> list[str]:
    """The training settings of the proxies of ``regime`` (``--quick``: the small budget), before the user's."""
    if regime not in REGIMES:
        raise ConfigError(f"--regime {regime!r}: one of {', '.join(REGIMES)}")
    base = list(SCRATCH if regime == "scratch" else CONTINUE)
    if regime == "continue" and run_model:
        base.append(f"train.model={run_model}")
    return base + (QUICK[regime] if quick else [])


def _unit_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def _set_name(path: str) -> str:
    return os.path.basename(str(path).rstrip("/")) or str(path)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _save_start_encoder(cfg, folder: str, run_dir: str) -> str:
    """The untrained proxy (scratch: the seed's random BERT, exactly what training starts from) exported as the
    trained ones are; returns the export folder."""
    from pairmine.pipeline.train import _export, _load_models, export_description

    tokenizer, model, _, _ = _load_models(cfg)
    description = export_description(cfg, cfg.storage_layer(), run_dir)
    return _export(model, tokenizer, folder, description.to_json(), cfg.train.max_length)


def _evaluate_unit(model_dir: str, beirs: list[str], sts: str | None, folder: str, eval_overrides: list[str]) -> dict:
    """Evaluate one encoder on every BEIR set and the STS file; returns {set name: {metric: value}}."""
    from pairmine.pipeline.config import load_config
    from pairmine.pipeline.evaluate import evaluate

    cfg = load_config(None, [f"embed.model={model_dir}", *eval_overrides])
    out = {}
    for b in beirs:
        res = evaluate(cfg, beir=b, output=os.path.join(folder, "evals", _set_name(b)))
        out[_set_name(b)] = {k: res.summary["retrieval"]["mean"][k] for k in ("ndcg@10", "recall@100")}
    if sts:
        res = evaluate(cfg, sts=sts, output=os.path.join(folder, "evals", "sts"))
        out["sts"] = {"spearman": res.summary["sts"]["spearman"]}
    return out


def _mean_per_query(paths: list[str]) -> dict:
    """Per-query results of several seeds -> one per-query result whose scores are the means over the seeds."""
    from pairmine.pipeline.evaluate import load_per_query

    results = [load_per_query(p) for p in paths]
    first = results[0]
    queries = {}
    for q, metrics in first["queries"].items():
        queries[q] = {m: statistics.fmean(float(r["queries"][q][m]) for r in results) for m in metrics}
    return {**first, "queries": queries}


def _plot_png(summary: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = summary["sets"]
    arms = summary["arms"]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(sets), 3.6), dpi=110)
    width = 0.8 / max(1, len(arms))
    for k, arm in enumerate(arms):
        means, stds = [], []
        for s in sets:
            metric = "spearman" if s == "sts" else "ndcg@10"
            agg = summary["aggregate"][arm][s][metric]
            means.append(100 * agg["mean"])
            stds.append(100 * agg["std"])
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(sets))]
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=arm)
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels([f"{s}\n({'Spearman' if s == 'sts' else 'nDCG@10'})" for s in sets])
    ax.set_ylabel("x 100 (mean over seeds; whiskers: std)")
    ax.legend(fontsize=8)
    ax.set_title(f"pairmine ablate ({summary['regime']}, {summary['seeds']} seed(s))", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown_table(summary: dict) -> str:
    """ablation.md: one row per arm, one column per set and metric (mean +- std over seeds, x100), then the p-values
    of every arm against ``random`` and ``start`` on nDCG@10."""
    sets, arms = summary["sets"], summary["arms"]
    cols = [(s, m) for s in sets for m in (("spearman",) if s == "sts" else ("ndcg@10", "recall@100"))]
    lines = [f"# pairmine ablate: {summary['regime']} regime, {summary['seeds']} seed(s)", "",
             f"Groups: `{summary['groups']}`; {summary['steps']} steps of {summary['pairs_per_step']} pairs per arm "
             f"({summary['steps'] * summary['pairs_per_step']} pairs); figures x100, mean +- std over seeds.", "",
             "| arm | " + " | ".join(f"{s} {m}" for s, m in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for arm in arms:
        cells = []
        for s, m in cols:
            a = summary["aggregate"][arm][s][m]
            cells.append(f"{100 * a['mean']:.2f} +- {100 * a['std']:.2f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    tests = summary.get("p_values") or {}
    if tests:
        lines += ["", "Paired per-query sign-flip test on nDCG@10 (per-query scores averaged over seeds; "
                  "`pairmine compare`): difference x100 and p.", "",
                  "| arm | " + " | ".join(f"{s} vs {b}" for s in sets if s != "sts" for b in ("random", "start")) + " |",
                  "|---|" + "---|" * sum(2 for s in sets if s != "sts")]
        for arm in arms:
            cells = []
            for s in sets:
                if s == "sts":
                    continue
                for b in ("random", "start"):
                    c = tests.get(arm, {}).get(s, {}).get(b)
                    cells.append("-" if c is None else f"{100 * c['mean_diff']:+.2f} (p {c['p_value']:.3f})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", f"Wall time: {summary['wall_s']:.0f} s in all on {summary['host']}."]
    return "\n".join(lines) + "\n"


def _html(summary: dict, table_md: str) -> str:
    import html

    png = base64.b64encode(_plot_png(summary)).decode()
    return ("<!doctype html><html><head><meta charset='utf-8'><title>pairmine ablate</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}pre{background:#f4f4f4;padding:1em;"
            "overflow-x:auto}</style></head><body><h1>pairmine ablate</h1>"
            f"<img alt='nDCG@10 / Spearman per set and arm' src='data:image/png;base64,{png}'>"
            f"<pre>{html.escape(table_md)}</pre></body></html>\n")


def ablate(groups: str, beirs: list[str], sts: str | None, output: str, arms: list[str], regime: str = "scratch",
           seeds: int = 2, quick: bool = False, config: str | None = None, overrides: list[str] = (),
           eval_overrides: list[str] = ()) -> AblationResult:
    """Train and evaluate one proxy per arm and seed, compare the arms, write the report (module docstring).

    Args:
        groups: a committed ``pairmine mine`` run (local folder; random and crop re-read its input).
        beirs: BEIR folders to evaluate on (at least one, or ``sts``).
        sts: an STS-B style file, or None.
        output: the ablation's folder (local); an existing one with the same plan is resumed.
        arms: a subset of :data:`ARMS`.
        regime: "scratch" or "continue".
        seeds: seeds 0..seeds-1 per arm (>= 1).
        quick: the small budget (:data:`QUICK`), for a smoke run and the tests.
        config, overrides: the training config (``pairmine train`` keys), applied after the regime's settings.
        eval_overrides: ``embed.*`` keys for the evaluations (e.g. embed.batch_size).

    Returns:
        :class:`AblationResult`.

    Raises:
        ConfigError: unknown arm or regime, seeds < 1, nothing to evaluate, an ``OUT`` made with another plan.
        InputError, FileNotFoundError: the groups are not a committed run.
        EvalInputError: an unreadable BEIR folder or STS file.
    """
    import platform

    from pairmine.pipeline.evaluate import EvalInputError, compare_results, load_beir, load_sts
    from pairmine.pipeline.train import check_group_parts, find_group_parts, train
    from pairmine.pipeline.train_config import load_train_config

    t0 = time.time()
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: must be >= 1")
    if not beirs and not sts:
        raise ConfigError("nothing to evaluate: give --beir DIR (repeatable) and/or --sts FILE")
    if "://" in output:
        raise ConfigError(f"--output {output}: pairmine ablate writes to a local folder")
    arms = list(arms)
    # every input checked before any training
    from pairmine.operators.storage import LOCAL

    parts, run_dir = find_group_parts(groups)
    n_groups, _ = check_group_parts(LOCAL, parts)
    for b in beirs:
        load_beir(b)
    if sts:
        load_sts(sts)
    names = [_set_name(b) for b in beirs]
    if len(set(names)) != len(names) or "sts" in names:
        raise EvalInputError(f"--beir folders must have distinct names other than 'sts' (got {', '.join(names)})")
    try:
        run_manifest = json.loads(open(os.path.join(run_dir, "manifest.json")).read())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--groups {groups}: the run's manifest.json is unreadable ({e})") from None
    run_model = ((run_manifest.get("config") or {}).get("embed") or {}).get("model") or ""
    base = proxy_overrides(regime, quick, run_model)
    train_over = base + list(overrides)
    cfg0 = load_train_config(config, train_over)  # validates the user's keys before any training
    output = os.path.abspath(output)
    os.makedirs(os.path.join(output, "units"), exist_ok=True)
    plan = {"format": "pairmine-ablate-plan/1", "groups": os.path.abspath(run_dir), "beir": [os.path.abspath(b)
            for b in beirs], "sts": os.path.abspath(sts) if sts else None, "regime": regime, "quick": quick,
            "config": plan_config(cfg0), "eval_overrides": list(eval_overrides)}
    plan_path = os.path.join(output, "plan.json")
    if os.path.exists(plan_path):
        old = json.loads(open(plan_path).read())
        # A key the earlier plan does not record (a setting newer than that ablation) is not a difference.
        keys = sorted(f"{s}.{k}" for s, d in plan["config"].items() for k, v in d.items()
                      if k in ((old.get("config") or {}).get(s) or {}) and old["config"][s][k] != v)
        differ = sorted(k for k in plan if k != "config" and old.get(k) != plan[k]) + (["config"] if keys else [])
        if differ:
            detail = ", ".join(differ)
            if keys:
                detail += f" ({', '.join(keys)})"
            raise ConfigError(f"--output {output} holds an ablation made with another plan: {detail} differ; use "
                              "another --output, or remove it to start again")
    else:
        _write_json(plan_path, plan)

    units = [(arm, s) for s in range(seeds) for arm in arms]
    done_s: list[float] = []
    trained = 0
    results: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    for k, (arm, seed) in enumerate(units, 1):
        folder = os.path.join(output, "units", _unit_name(arm, seed))
        marker = os.path.join(folder, "done.json")
        if os.path.exists(marker):
            results[arm][seed] = json.loads(open(marker).read())
            log.info("ablate: %s seed %d (%d/%d) already done (%s): skipped", arm, seed, k, len(units), marker)
            continue
        eta = ""
        if done_s:
            left = len(units) - k + 1
            eta = f", ETA {statistics.fmean(done_s) * left / 60:.1f} min for the {left} unit(s) left"
        log.info("ablate: %s seed %d (%d/%d)%s", arm, seed, k, len(units), eta)
        u0 = time.time()
        cfg = load_train_config(config, [*train_over, f"train.seed={seed}",
                                         f"train.positives={'xprt' if arm == 'start' else arm}"])
        steps = pairs = 0
        if arm == "start":
            if regime == "scratch":
                model_dir = _save_start_encoder(cfg, folder, run_dir)
            else:
                from pairmine.operators.embed import default_model_path

                model_dir = run_model or default_model_path()
        else:
            res = train(cfg, run_dir, folder)
            model_dir, steps, pairs = res.export_dir, res.steps, res.steps * cfg.train.batch_size
            trained += 1
        scores = _evaluate_unit(model_dir, beirs, sts, folder, list(eval_overrides))
        record = {"arm": arm, "seed": seed, "model": model_dir, "steps": steps, "pairs": pairs,
                  "wall_s": round(time.time() - u0, 1), "scores": scores}
        _write_json(marker, record)
        results[arm][seed] = record
        done_s.append(time.time() - u0)
        log.info("ablate: %s seed %d done in %.0f s: %s", arm, seed, time.time() - u0,
                 ", ".join(f"{s} {m} {v:.4f}" for s, d in scores.items() for m, v in d.items()))

    sets = names + (["sts"] if sts else [])
    aggregate = {}
    for arm in arms:
        aggregate[arm] = {}
        for s in sets:
            aggregate[arm][s] = {}
            for m in (("spearman",) if s == "sts" else ("ndcg@10", "recall@100")):
                vals = [results[arm][seed]["scores"][s][m] for seed in sorted(results[arm])]
                aggregate[arm][s][m] = {"mean": round(statistics.fmean(vals), 6),
                                        "std": round(statistics.stdev(vals), 6) if len(vals) > 1 else 0.0,
                                        "per_seed": vals}
    p_values: dict = {}
    per_query = {arm: {s: _mean_per_query([os.path.join(output, "units", _unit_name(arm, seed), "evals", s)
                                           for seed in sorted(results[arm])]) for s in names} for arm in arms}
    for arm in arms:
        for s in names:
            for b in ("random", "start"):
                if b not in arms or b == arm:
                    continue
                comps, _ = compare_results(per_query[b][s], per_query[arm][s], ["ndcg@10", "recall@100"])
                ndcg, recall = comps  # in the order asked for
                p_values.setdefault(arm, {}).setdefault(s, {})[b] = {
                    "mean_diff": round(ndcg.mean_diff, 6), "p_value": round(ndcg.p_value, 6),
                    "ci": [round(ndcg.ci_low, 6), round(ndcg.ci_high, 6)], "n": ndcg.n,
                    "recall@100": {"mean_diff": round(recall.mean_diff, 6), "p_value": round(recall.p_value, 6)}}
    trained_units = [r for arm in arms for r in results[arm].values() if r["steps"]]
    summary = {
        "format": "pairmine-ablation/1",
        "groups": os.path.abspath(run_dir), "regime": regime, "quick": quick, "arms": arms, "seeds": seeds,
        "groups_in_run": n_groups, "sets": sets, "steps": cfg0.train.max_steps, "pairs_per_step": cfg0.train.batch_size,
        "proxy": ({"init": "scratch", "layers": cfg0.train.scratch_layers, "hidden": cfg0.train.scratch_hidden,
                   "heads": cfg0.train.scratch_heads, "intermediate": cfg0.train.scratch_intermediate,
                   "tokenizer": cfg0.train.model or "all-MiniLM-L6-v2 (default)"}
                  if regime == "scratch" else {"init": "pretrained", "model": cfg0.train.model or run_model}),
        "units": {f"{arm}-s{seed}": r for arm in arms for seed, r in sorted(results[arm].items())},
        "aggregate": aggregate,
        "p_values": p_values,
        "p_value_note": "paired sign-flip test per query (pairmine compare), per-query scores averaged over seeds; "
                        "STS has no per-query test",
        "train_wall_s": round(sum(r["wall_s"] for r in trained_units), 1),
        "wall_s": round(time.time() - t0, 1),
        "host": platform.node(),
        "config": cfg0.to_dict(),
    }
    if trained_units:
        summary["steps"] = trained_units[0]["steps"]
    _write_json(os.path.join(output, "ablation.json"), summary)
    table = markdown_table(summary)
    with open(os.path.join(output, "ablation.md"), "w") as f:
        f.write(table)
    with open(os.path.join(output, "ablation.html"), "w") as f:
        f.write(_html(summary, table))
    return AblationResult(output, summary, trained)
