"""The ``pairmine`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import textwrap
import threading

from pairmine.operators.errors import PairmineError
from pairmine.pipeline import __version__


# Help texts of the keys a command reads with another meaning than mine's (the field's own help is mine's).
CONFIG_HELP = {
    "filter-pairs": {"input.path": "parquet/JSONL file, folder or glob of (query, passage) pairs (--input); required",
                     "input.text_column": "with consistency.pool_path: the pool documents' text column or key",
                     "input.id_column": "with consistency.pool_path: the pool documents' id column or key"},
    "negatives": {"input.path": "the pairs (--input): a mine run folder, a filter-pairs run folder, or a parquet/JSONL "
                                "file, folder or glob of (query, passage) pairs; required",
                  "input.text_column": "the corpus documents' text column or key (--corpus; a mine run folder as "
                                       "the corpus uses its own)",
                  "input.id_column": "the corpus documents' id column or key (as text_column; with a mine run's "
                                     "groups, no negative comes from the group's own document)",
                  "input.pair_id_column": "plain pairs: column or key holding the pair id (absent: 'shard:row')",
                  "input.query_column": "plain pairs: column or key holding the query",
                  "input.passage_column": "plain pairs: column or key holding the positive",
                  "embed.query_prefix": 'None: from the model (its pairmine_model.json, else "query: " for E5, else "")'},
}


def _config_reference(config_cls=None, command: str = "mine") -> str:
    """The "configuration keys" part of a command's --help: each key ``command`` reads (the sections of
    :data:`pairmine.pipeline.config.COMMAND_SECTIONS` less ``config.COMMAND_KEYS_UNUSED``; a command not listed
    there, train, reads every section of its class), its default and its help (:data:`CONFIG_HELP` where the
    command's meaning differs), then the keys of the config class it leaves out."""
    from pairmine.pipeline.config import COMMAND_KEYS_UNUSED, COMMAND_SECTIONS, MineConfig

    notes = CONFIG_HELP.get(command, {})
    lines = ["configuration keys (TOML [section] key = value, or --set section.key=value):"]
    cfg = (config_cls or MineConfig)()
    sections = COMMAND_SECTIONS.get(command) or [s.name for s in dataclasses.fields(cfg)]  # train: every section
    unused = [f"[{s.name}]" for s in dataclasses.fields(cfg) if s.name not in sections]
    for section in dataclasses.fields(cfg):
        if section.name not in sections:
            continue
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            if key in COMMAND_KEYS_UNUSED.get(command, ()):
                unused.append(key)
                continue
            lines.append(f"  {key} = {getattr(getattr(cfg, section.name), f.name)!r}")
            lines.append(f"      {notes.get(key, f.metadata.get('help', ''))}")
    if unused:
        lines.append(f"(a config file shared with other commands may hold their keys too: {', '.join(unused)}; "
                     f"{command} does not use them, and a resumed run may change them)")
    return "\n".join(lines)


MINE_EPILOG = """\
what it does:
  read -> chunk -> embed -> centrality + anchors -> related passages (weighted RRF) -> consistency filter (E5: keep
  a group iff fewer than k random pool passages beat cos(anchor, s1)) -> write, on Ray Data, one row per document. Without --input it mines the 827-document sample that ships with pairmine. Without a cluster
  address (ray.address or $RAY_ADDRESS) it starts a private local Ray on this machine, never joining a Ray
  cluster that happens to run there (the manifest's resolved.ray says which Ray was used).

output (<output>/<run_id>/; <output> may be s3://bucket/prefix, endpoint and credentials from the AWS environment
(AWS_ENDPOINT_URL_S3, AWS_PROFILE, ...) or [storage], the same for every client):
  groups/part-NNNNN.parquet   training groups, one part per input shard (zstd), each committed on its own
  stats.json                  counts, drops by reason, the paper's figures, histograms
  manifest.json               resolved config, model, inputs, per-shard status, software versions
  tfidf.joblib                the TF-IDF (operators.related.CorpusTfidf) fitted on a seeded sample of the input
  dropped/part-NNNNN.parquet  groups the consistency filter dropped (with consistency.side_output=true)
  _SUCCESS                    written last: the run is complete
  <output>/_latest.json       beside the runs: the most recently committed run (format 1)

interrupted runs: run the same command with the same --run-id: committed shards are kept, the rest is mined.
nightly: pairmine mine --incremental --input s3://corpus/shards/ --output s3://groups/runs/ --run-id nightly-$(date +%F)

examples:
  pairmine mine
  pairmine mine --input data/ --output runs/ --set embed.batch_size=64 --set anchors.threshold=0.62
  pairmine mine --input 'shards/*.jsonl' --set input.text_column=content --set embed.model=/models/e5-base

"""


FILTER_EPILOG = """\
output (<output>/<run_id>/):
  pairs/part-NNNNN.parquet    kept pairs (run_id, pair_id, query, passage, s, n_above, pool_size, consistency_k,
                              model), one part per input shard
  dropped/part-NNNNN.parquet  dropped pairs, with --set consistency.side_output=true
  stats.json, manifest.json, _SUCCESS (written last)

examples:
  pairmine filter-pairs --input pairs.jsonl --output runs/
  pairmine filter-pairs --input qa.parquet --query-column question --passage-column answer --set consistency.k=1
  pairmine filter-pairs --input pairs/ --pool corpus/ --set consistency.pool_size=1000000

"""


TRAIN_EPILOG = """\
the objective (seed 000, xPRT; weights are [loss] keys):
  L_xp         symmetric InfoNCE anchor <-> positive (s1), tau 0.05, negatives = the other groups' positives (and
               anchors) of the global batch, gathered from every worker; same-document groups masked out
  L_cross      x0.1: the anchor vector -> 4 conditioning vectors after [CLS] of a 60%-masked related passage; a
               one-layer decoder (shared token embeddings and MLM head) fills it in; both directions, 4 related: 8
               decoder passes
  L_self       x0.1 (our default): the decoder fills the anchor's and s1's own masked words from their own vectors;
               target = the encoder's word distribution under its 15% mask
  L_MLM        x0.1 (our default): the encoder's 15%-masked passes (BERT 80/10/10)
  L_unif       x0.1 (our default): Wang & Isola uniformity of the batch's anchor vectors
  retention    KL(frozen starting model || current) of anchor-by-s1 similarity softmaxes, row- and column-wise,
               on unmasked text; weight falls linearly 40 -> 0
  5 encoder passes per group (anchor + 4 related, each with a 15% mask) give the sentence vectors (mean pooling).

output (--output, local or s3://):
  ray-train/checkpoint_step_N/ checkpoints every checkpoint.every_steps steps; the same command resumes from the latest
  metrics.jsonl                one line per step: every loss term, retention weight, lr, grad norm, groups/s
  export/                      the trained encoder (save_pretrained) + tokenizer: transformers.AutoModel loads it
  train_manifest.json          resolved config, groups, steps, versions

examples:
  pairmine train --groups runs/sample --output train/xprt
  pairmine train --groups runs/sample --output train/random --positives random
  pairmine train --groups s3://bucket/runs/2026-11-29 --output s3://bucket/train/e5-xprt \\
      --set train.model=/models/e5-base-unsupervised --set scaling.num_workers=8 --set train.batch_size=1024
  pairmine mine --set embed.model=train/xprt/export        # mine again with the trained encoder

"""


def _train_config_reference() -> str:
    from pairmine.pipeline.train_config import TrainConfig

    return _config_reference(TrainConfig, "train")


def _add_train_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="continue pre-training an encoder on mined groups (xPRT objective, Ray Train)",
        description="Train an encoder on the groups of a pairmine mine run with the full xPRT objective (seed 000) "
        "on Ray Train: DDP workers (gloo on CPU, nccl on GPU) stream the groups from Ray Data, checkpoint to "
        "--output and export the final encoder in HuggingFace format.",
        epilog=TRAIN_EPILOG + _train_config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = t.add_mutually_exclusive_group(required=True)
    source.add_argument("--groups", metavar="PATH", help="a committed pairmine mine run folder (with groups/ and "
                        "_SUCCESS) or its groups/ folder; local or s3://: the xPRT objective")
    source.add_argument("--negatives", metavar="RUN", help="instead of --groups, a committed pairmine negatives run: "
                        "E5's second stage (seed 004): grouped batches of 1 positive + distill.hard_negatives mined "
                        "negatives, every passage of the batch a negative for every other query, L = alpha InfoNCE + "
                        "(1 - alpha) KL against the run's teacher scores (InfoNCE only without them)")
    t.add_argument("--output", metavar="PATH", required=True, help="folder for checkpoints, metrics.jsonl and "
                   "export/; local or s3://. An existing one is resumed from its latest checkpoint")
    t.add_argument("--positives", choices=("xprt", "random", "crop"), help="xprt (default): the positive is s1, the "
                   "top related passage; random: a random other passage of the same document, drawn from all its "
                   "passages (re-chunked from the run's input, which must still be there; the paper's ablation); "
                   "crop: anchor and positive are two independent random spans of the document, each as long as one "
                   "of its passages (the usual contrastive pre-training pair). Same as train.positives")
    t.add_argument("--objective", choices=("xprt", "xtr", "revela"), help="xprt (default): the full xPRT objective "
                   "(seed 000); xtr: XTR's in-batch token retrieval loss on anchor -> positive (seed 002), a "
                   "multi-vector model to evaluate with pairmine eval --scoring xtr; revela: a causal LM "
                   "(train.revela_lm) predicts each passage while attending to the batch's other passages weighted "
                   "by the encoder's similarities, which learns through that loss alone (seed 001). Same as "
                   "train.objective")
    t.add_argument("--model", metavar="MODEL", help="starting encoder (folder or hub id; default: all-MiniLM-L6-v2). "
                   "Same as train.model")
    t.add_argument("--config", metavar="FILE", help="TOML file with [section] tables, see the keys below")
    t.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set train.batch_size=32 (repeatable; applied after --config)")
    t.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: $RAY_ADDRESS, else start a private "
                   "local Ray). Same as ray.address")


def cmd_train(args) -> int:
    from pairmine.pipeline.train import train
    from pairmine.pipeline.train_config import load_train_config

    cfg = _load(args, ((args.positives, "train.positives"), (args.objective, "train.objective"),
                       (args.model, "train.model"), (args.ray_address, "ray.address")), load_train_config)
    result = train(cfg, args.groups or "", args.output, args.negatives or "")
    m = result.metrics or {}
    terms = (f"InfoNCE {m.get('l_nce')}, KL {m.get('l_kl')}" if args.negatives
             else f"XTR, query tokens retrieving their positive {m.get('z_positive')}" if cfg.train.objective == "xtr"
             else f"Revela in-batch NTP, Sim on the own group {m.get('sim_same_group')}"
             if cfg.train.objective == "revela"
             else f"L_xp {m.get('l_xp')}")
    print(f"output: {result.output}\nsteps: {result.steps}; last loss {m.get('loss')} ({terms}, "
          f"P(positive) {m.get('p_positive')})\nexported encoder: {result.export_dir}")
    return 0


ABLATE_EPILOG = """\
Arms (one proxy encoder per arm and seed; the same groups, pairs per step, steps, optimiser and seed; only the
positive changes):
  start    no training (scratch: the seed's random BERT; continue: the run's model)
  xprt     anchor -> s1, the top related passage: what pairmine mines
  random   anchor -> a random other passage of the same document (train --positives random, the paper's ablation)
  crop     two random spans of the same document, each of passage length (train --positives crop)

Regimes:
  scratch  (default) a 4-layer, 256-wide BERT (train.scratch_*) with the default model's tokenizer, random init, L_xp
           alone: 80 steps of 64 pairs x 128 tokens per arm (--quick: 12 steps of 16 x 64); the default on ~10k
           groups with 2 seeds, evaluated on fiqa + STS-B, took 24 min on 2 CPU cores (docs/evaluation.md)
  continue the run's embedding model continued with the full xPRT objective: 60 steps of 16 groups

Output: OUT/ablation.json, OUT/ablation.md (the table), OUT/ablation.html (the table and a plot),
OUT/units/<arm>-s<seed>/ (training folder, export/, evals/, done.json). Re-running with the same OUT skips the
finished units; another plan (groups, sets, regime, config) on the same OUT is refused.

Examples:
  pairmine ablate --groups runs/fineweb-long --beir ../shared/data/fiqa-pairs-beir --sts STS.csv --output abl/fwl
  pairmine ablate --groups runs/sample --beir tests/data/fiqa-pairs-beir --output abl/quick --quick --seeds 2
"""


def _add_ablate_parser(sub) -> None:
    a = sub.add_parser(
        "ablate", help="the data ablation: train proxy encoders on xprt / random / crop positives and compare them",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=ABLATE_EPILOG,
        description="Does training on the mined groups give a better encoder than the cheap pairs from the same "
        "documents? Trains one proxy per arm and seed, evaluates each with pairmine eval, compares them with "
        "pairmine compare (SPEC 'Does it help?'; seed 000 Table 3).")
    a.add_argument("--groups", metavar="RUN", required=True, help="a committed pairmine mine run folder (local); "
                   "random and crop re-read its input")
    a.add_argument("--beir", metavar="DIR", action="append", default=[], help="BEIR folder to evaluate on "
                   "(repeatable)")
    a.add_argument("--sts", metavar="FILE", help="STS-B style file: adds Spearman")
    a.add_argument("--output", metavar="OUT", required=True, help="the ablation's folder (resumed when it exists)")
    a.add_argument("--arms", default="start,xprt,random,crop", help="comma-separated arms (default: all four)")
    a.add_argument("--regime", choices=("scratch", "continue"), default="scratch", help="scratch (default) or "
                   "continue, see below")
    a.add_argument("--seeds", type=int, default=2, help="seeds per arm (default 2)")
    a.add_argument("--quick", action="store_true", help="the small budget (minutes), for a smoke run")
    a.add_argument("--config", metavar="FILE", help="TOML file of pairmine train keys (see pairmine train --help), "
                   "applied after the regime's settings")
    a.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a pairmine train key, e.g. --set train.max_steps=300 (repeatable)")
    a.add_argument("--eval-set", dest="eval_overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override an embed key of the evaluations, e.g. --eval-set embed.batch_size=64")


def cmd_ablate(args) -> int:
    from pairmine.pipeline.ablate import ablate, parse_arms

    arms = parse_arms(args.arms)
    res = ablate(args.groups, args.beir, args.sts, args.output, arms, args.regime, args.seeds, args.quick,
                 args.config, args.overrides, args.eval_overrides)
    with open(os.path.join(res.output, "ablation.md")) as f:
        print(f.read())
    print(f"ablation: {res.output}/ablation.json, ablation.md, ablation.html ({res.trained} unit(s) trained now, "
          f"{res.summary['wall_s']:.0f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pairmine",
        description="Mine training groups (anchor passages and their related passages) from web documents for "
        "dense-retriever pretraining (xPRT), on Ray.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"pairmine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    m = sub.add_parser(
        "mine",
        help="mine training groups from documents",
        description="Mine training groups from documents and write one run folder.",
        epilog=MINE_EPILOG + _config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("--input", metavar="PATH", help="parquet or JSONL file, folder (recursive) or glob; local or "
                   "s3://. Default: the shipped sample (827 FineWeb-schema documents). Same as input.path")
    m.add_argument("--output", metavar="DIR", help="folder that receives the run folder (default: ./runs); local or "
                   "s3://bucket/prefix. Same as output.path")
    m.add_argument("--incremental", action="store_true", help="mine only the input shards that no committed run under "
                   "--output has mined (same path, size and S3 ETag or content SHA-256); nothing new: no run. Refused "
                   "when the settings that decide the groups (model, prefix, threshold, chunk, related, consistency, "
                   "tfidf) differ from the latest committed run's. Same as input.incremental=true")
    m.add_argument("--new-lineage", action="store_true", help="with --incremental and changed settings: start a new "
                   "lineage of runs in --output and mine every shard again with the new settings. Same as "
                   "input.new_lineage=true")
    _common_args(m)
    f = sub.add_parser(
        "filter-pairs",
        help="keep (query, passage) pairs that pass E5's consistency filter",
        description="E5's consistency filter on existing (query, passage) pairs (seed 004, chapter 1): embed the query "
        "(query prefix) and the passage (passage prefix), and keep a pair iff fewer than k passages of a random pool "
        "beat its own score s = cos(query, passage). Writes one run folder like pairmine mine.",
        epilog=FILTER_EPILOG + _config_reference(command="filter-pairs"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("--input", metavar="PAIRS", required=True, help="parquet or JSONL file, folder or glob of pairs")
    f.add_argument("--output", metavar="DIR", help="folder that receives the run folder (default: ./runs)")
    f.add_argument("--id-column", metavar="ID", help="pair id column or key (default: id; absent: shard:row). Same "
                   "as input.pair_id_column")
    f.add_argument("--query-column", metavar="Q", help="query column or key (default: query). Same as input.query_column")
    f.add_argument("--passage-column", metavar="P", help="passage column or key (default: passage). Same as "
                   "input.passage_column")
    f.add_argument("--pool", metavar="PATH", help="documents (parquet/JSONL with text and id) to draw the pool from, "
                   "chunked like pairmine mine's input (default: the pairs' own passages). Same as consistency.pool_path")
    _common_args(f)
    _add_negatives_parser(sub)
    _add_train_parser(sub)
    _add_ablate_parser(sub)
    add_eval_commands(sub)
    _add_export_parser(sub)
    return parser


EXPORT_EPILOG = """\
Columns (the order sentence-transformers' MultipleNegativesRankingLoss reads: anchor, positive, negatives):
  mine run          anchor = anchor_text, positive = related_texts[0] (s1, the top related passage)
  filter-pairs run  anchor = query, positive = passage
  negatives run     anchor = query, positive = positive, negative_1..negative_N (N: --negatives, default the
                    run's negatives.count; rows with fewer are skipped and counted)

Formats: sentence-transformers (parquet, every column), pairs (parquet, anchor and positive), jsonl (the same columns
as sentence-transformers, one JSON object per line). OUT gets one part per run part, a dataset card (README.md) and
export_manifest.json (rows written, rows skipped by reason); the parts go to OUT/data/.

Examples:
  pairmine export runs/sample --format sentence-transformers st/sample
  pairmine export negatives/<run_id> --format jsonl st/negatives
  then: datasets.load_dataset("st/sample")["train"] -> SentenceTransformerTrainer(train_dataset=..., loss=
        MultipleNegativesRankingLoss(model))
"""


def _add_export_parser(sub) -> None:
    x = sub.add_parser(
        "export", help="write a run's rows as (anchor, positive, negative_i) columns any trainer loads",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXPORT_EPILOG,
        description="Write the rows of a committed mine, filter-pairs or negatives run as the columns that "
        "sentence-transformers' SentenceTransformerTrainer with MultipleNegativesRankingLoss trains on directly. "
        "Local or s3://.")
    x.add_argument("run", metavar="RUN", help="a committed pairmine mine, filter-pairs or negatives run folder")
    x.add_argument("output", metavar="OUT", help="folder for the export (created; refused if it holds an export)")
    x.add_argument("--format", default="sentence-transformers", choices=("sentence-transformers", "pairs", "jsonl"),
                   help="output format (default: sentence-transformers)")
    x.add_argument("--negatives", type=int, metavar="N", help="negatives run: negative columns per row (default: "
                   "the run's negatives.count; 0: none)")
    x.add_argument("--config", metavar="FILE", help="TOML file; its [storage] table reaches s3:// runs and outputs")
    x.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. --set storage.endpoint_url=http://127.0.0.1:8333")


def cmd_export(args) -> int:
    from pairmine.pipeline.export import export

    storage = _load(args, command="export").storage_layer()
    if args.negatives is not None and args.negatives < 0:
        from pairmine.pipeline.config import ConfigError

        raise ConfigError(f"--negatives {args.negatives}: must be >= 0")
    res = export(args.run, args.format, args.output, storage, args.negatives)
    skipped = ", ".join(f"{k} {v}" for k, v in res["skipped"].items()) or "none"
    print(f"export: {res['rows']} rows of {res['kind']} run {res['source']} -> {args.output} ({args.format}; "
          f"columns {', '.join(res['columns'])}; skipped: {skipped})")
    return 0


NEGATIVES_EPILOG = """\
what it does (seed 004, chapter 3; SPEC "Hard negatives and distillation"):
  every corpus passage is embedded with the pairs' embedder and indexed with faiss (exact by default); each pair's
  query retrieves its top negatives.depth (200) passages; the positive, exact duplicates of it or of the query
  (normalised text) and
  passages of the pair's own document (mine runs) are dropped; negatives come from ranks negatives.rank_start to
  rank_end (31-200: the top 30 is where unlabelled positives sit), at most negatives.count (7) per pair, optionally
  only those below the positive's score by negatives.margin or under negatives.relative_margin x that score. Every
  drop is counted by reason in stats.json. With --teacher, a cross-encoder scores (query, positive) and every
  (query, negative) once, and the scores are stored beside the negatives.

input: a pairmine mine run folder (query = anchor, positive = s1), a filter-pairs run folder (a run's own embed
settings are used unless embed.model is set), or parquet/JSONL pairs ([input] query_column, passage_column, pair_id_column).
corpus: documents (parquet/JSONL; [input] text_column and id_column; chunked with [chunk]) or a mine run folder
(its input, chunked with that run's settings).

output (<output>/<run_id>/):
  negatives/part-NNNNN.parquet  one row per usable pair: run_id, pair_id, doc_id, query, positive, positive_score,
                                negatives, negative_ranks (1-based, in the retrieved list), negative_scores,
                                positive_teacher_score, negative_teacher_scores (null without --teacher), model,
                                teacher; one part per input shard
  stats.json, manifest.json (index kind, its recall@depth when approximate), _SUCCESS (written last)

examples:
  pairmine negatives --input runs/sample --corpus runs/sample --output negatives/
  pairmine negatives --input pairs.jsonl --corpus corpus/ --teacher /models/ms-marco-MiniLM-L-6-v2
  pairmine negatives --input runs/big --corpus s3://corpus/docs/ --set negatives.index=hnsw

"""


def _add_negatives_parser(sub) -> None:
    from pairmine.pipeline.config import NegativesConfig

    n = sub.add_parser(
        "negatives",
        help="mine hard negatives for training pairs from a corpus (faiss), optionally with teacher scores",
        description="Hard negatives for (query, positive) pairs: search a corpus with the pairs' embedder (faiss), "
        "keep negatives from a rank window, optionally score them once with a cross-encoder teacher. Writes one run "
        "folder like pairmine mine.",
        epilog=NEGATIVES_EPILOG + _config_reference(NegativesConfig, "negatives"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    n.add_argument("--input", metavar="RUN_OR_PAIRS", required=True, help="a pairmine mine run folder, a filter-pairs "
                   "run folder, or a parquet/JSONL file, folder or glob of (query, passage) pairs. Same as input.path")
    n.add_argument("--corpus", metavar="CORPUS", required=True, help="documents to search (parquet/JSONL file, folder "
                   "or glob) or a pairmine mine run folder (its input). Same as negatives.corpus")
    n.add_argument("--output", metavar="DIR", help="folder that receives the run folder (default: ./runs). Same as "
                   "output.path")
    n.add_argument("--teacher", metavar="MODEL", help="cross-encoder (HuggingFace sequence classification, one "
                   "output) scoring the positive and every negative. Same as negatives.teacher")
    _common_args(n)


def cmd_negatives(args) -> int:
    from pairmine.pipeline.config import load_negatives_config
    from pairmine.pipeline.negatives import negatives

    cfg = _load(args, ((args.input, "input.path"), (args.corpus, "negatives.corpus"), (args.output, "output.path"),
                       (args.run_id, "output.run_id"), (args.ray_address, "ray.address"),
                       (args.teacher, "negatives.teacher")), load_negatives_config, "negatives")
    result = negatives(cfg)
    s = result.stats
    drops = ", ".join(f"{k} {v}" for k, v in s["negatives_dropped"].items() if v)
    print(f"run folder: {result.run_dir}\n"
          f"pairs: {s['pairs_in']} in, {s['pairs_out']} with negatives searched, {sum(s['pairs_skipped'].values())} "
          f"skipped; negatives: {s['negatives']} ({s['negatives_per_pair']} per pair, {s['pairs_without_negatives']} "
          f"pairs without any)\ncandidates retrieved: {s['candidates_retrieved']} from {s['corpus_passages']} corpus "
          f"passages, {s['index']}; not kept: {drops or 'none'}")
    return 0


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables, see the keys below")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set embed.batch_size=64 (repeatable; applied after --config)")
    p.add_argument("--run-id", metavar="ID", help="run folder name (default: UTC time + random suffix). Same as "
                   "output.run_id; a committed run id is refused")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: $RAY_ADDRESS, else start a private "
                   "local Ray). Same as ray.address")


def _load(args, flags=(), loader=None, command: str | None = None) -> "object":
    """The validated config of a command: ``--config``, then ``--set``, then each given flag as ``key=value``
    (``flags``: (flag value, config key) pairs; a flag that was not given is None and skipped, while an empty value
    such as ``--query-prefix ''`` is kept). ``loader``: the config's loader (default: mine's ``load_config``);
    ``command``: validate only the sections that command uses (``config.COMMAND_SECTIONS``). The one way every
    command maps its flags to config keys."""
    from pairmine.pipeline.config import COMMAND_SECTIONS, load_config

    overrides = list(args.overrides) + [f"{key}={flag}" for flag, key in flags if flag is not None]
    if command is None:
        return (loader or load_config)(args.config, overrides)
    return (loader or load_config)(args.config, overrides, COMMAND_SECTIONS[command])


def cmd_filter_pairs(args) -> int:
    from pairmine.pipeline.filter_pairs import filter_pairs

    cfg = _load(args, ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                       (args.ray_address, "ray.address"), (args.query_column, "input.query_column"),
                       (args.passage_column, "input.passage_column"), (args.pool, "consistency.pool_path"),
                       (args.id_column, "input.pair_id_column")), command="filter-pairs")
    result = filter_pairs(cfg)
    s = result.stats
    print(f"run folder: {result.run_dir}\n"
          f"pairs: {s['pairs_in']} in, {s['pairs_kept']} kept, {s['pairs_dropped_consistency']} dropped by the "
          f"consistency filter ({s['consistency_keep_rate_pct']}% kept), {s['pairs_skipped_total']} skipped")
    return 0


def cmd_mine(args) -> int:
    from pairmine.pipeline.mine import mine

    cfg = _load(args, ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                       (args.ray_address, "ray.address"), (args.incremental or None, "input.incremental"),
                       (args.new_lineage or None, "input.new_lineage")), command="mine")
    result = mine(cfg)
    s = result.stats
    if result.run_dir is None:
        print(f"nothing to mine: all {s['shards_in']} input shard(s) were mined by committed runs under "
              f"{cfg.output.path} (no run folder written)")
        return 0
    print(textwrap.dedent(f"""\
        run folder: {result.run_dir}
        documents: {s['docs_in']} in, {s['docs_with_groups']} with groups, {s['docs_without_groups']} without, {s['docs_skipped_total']} skipped, {s.get('docs_text_repaired', 0)} with invalid UTF-8 replaced
        groups: {s['groups']} ({s['groups_per_doc']} per document with groups); passages covered: {s['passage_coverage_pct']}%"""))
    if s["consistency_enabled"]:
        print(f"consistency filter: kept {s['groups']} of {s['groups_mined']} mined groups "
              f"({s['consistency_keep_rate_pct']}%)")
    return 0


# ---- evaluation and inspection: eval, compare, report, calibrate ----------------------------------------------------

EVAL_EPILOG = """\
metrics (per query, then the mean over the evaluated queries; computed by trec_eval via pytrec_eval):
  nDCG@10      trec_eval ndcg_cut_10 (graded gain, log2 discount)
  Recall@100   trec_eval recall_100
  MRR@10       trec_eval recip_rank on each query's top 10 (trec_eval -M 10)
  Spearman     (--sts) rank correlation of cos(sentence1, sentence2) with the gold 0-5 score

output (--output DIR, default evals/<UTC time>-<suffix>/):
  summary.json     means, counts, skipped lines by reason, timings, model and prefixes
  per_query.json   every query's nDCG@10, Recall@100 and MRR@10: the input of pairmine compare

examples:
  pairmine eval --beir data/fiqa-pairs-beir --output evals/minilm
  pairmine eval --beir data/fiqa-pairs-beir --sts data/stsbenchmark/sts-test.csv --output evals/minilm
  pairmine eval --model /models/e5-base-unsupervised --beir data/scifact --output evals/e5   # prefixes: query:/passage:
  pairmine eval --model checkpoints/step-1000 --beir data/fiqa --query-prefix '' --set embed.batch_size=64
  pairmine eval --beir data/fiqa-pairs-beir --scoring xtr --k-prime 1000    # multi-vector (token) scoring
"""

COMPARE_EPILOG = """\
reading the result (seed 004, chapter 8): both systems are scored on the same queries, so each query's difficulty
cancels in its difference B - A. The interval is a paired percentile bootstrap of the mean difference (queries
resampled with replacement); p is a two-sided paired randomisation (sign-flip) test. An interval that includes 0
means this query set cannot tell the two apart; wins/ties/losses show whether a mean gain is broad or carried by a
few queries.

examples:
  pairmine compare evals/minilm evals/minilm-trained
  pairmine compare evals/a/per_query.json evals/b/per_query.json --metric ndcg@10 --output cmp.json
"""

REPORT_EPILOG = """\
output (--output DIR, default RUN/report/):
  report.html          the page: the run's figures next to the paper's, the plots, example tables
  centrality.png       centrality histogram with the anchor threshold
  groups_per_doc.png   documents by number of groups
  coverage.png         passages in a kept group vs never used; documents by outcome
  n_above.png          the consistency filter's n_above histogram and keep rate

Passages never used are not in the run's output: the report re-reads the sampled documents from the run's input,
chunks them again (checked against the run's anchor and related texts) and embeds them again with the run's model
for their centrality (--no-reembed skips that).
Screenshot in headless Chromium: scripts/report_screenshot.sh RUN/report/report.html shot.png

examples:
  pairmine report runs/20261129T124700Z-a1b2c3
  pairmine report runs/sample --examples 8 --seed 1 --output /tmp/sample-report
  pairmine report s3://bucket/runs/sample --config s3.toml      # [storage] endpoint_url = "http://..."
"""

CALIBRATE_EPILOG = """\
what it prints: the centrality distribution of the sampled passages (quantiles and a histogram), a threshold sweep
(anchors, groups per document, documents with groups, passage coverage; before the consistency filter), the
proposed threshold, and example anchors just above it and excluded passages just below it.

coverage = passages used as anchor or related passage / passages of the documents with enough passages for a group
(the default, as the default 0.675 was chosen; --coverage-basis all: over all passages, as stats.json's
passage_coverage_pct).

examples:
  pairmine calibrate                                        # the shipped sample, the default model, 68% coverage
  pairmine calibrate --input docs/ --model /models/e5-base-unsupervised --sample-docs 2000
  pairmine calibrate --target-anchor-rate 50 --set chunk.max_words=200
"""


def add_eval_commands(sub) -> None:
    """Register eval, compare, report and calibrate on the ``pairmine`` subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    e = sub.add_parser(
        "eval", help="retrieval (BEIR) and STS evaluation of an encoder", formatter_class=raw, epilog=EVAL_EPILOG,
        description="Evaluate an encoder with pairmine's own embedding code: BEIR-format retrieval (corpus.jsonl, "
        "queries.jsonl, qrels/<split>.tsv) by exact search, nDCG@10, Recall@100 and MRR@10 per query and on average; "
        "with --sts, Spearman correlation on an STS-B style file.")
    e.add_argument("--model", metavar="PATH_OR_ID", help="local model folder or hub id (default: the mining job's "
                   "default, all-MiniLM-L6-v2). Same as embed.model")
    e.add_argument("--beir", metavar="DIR", help="BEIR folder with corpus.jsonl, queries.jsonl, qrels/<split>.tsv "
                   "(local or s3://; [storage] of --config/--set, else the AWS environment)")
    e.add_argument("--split", default="test", help="qrels file to use: qrels/<split>.tsv (default: test)")
    e.add_argument("--sts", metavar="FILE", help="STS-B style tab-separated file (genre, file, year, id, score, "
                   "sentence1, sentence2): adds Spearman correlation")
    e.add_argument("--scoring", choices=("dense", "xtr", "sum-of-max"), default="dense",
                   help="dense (default): one mean-pooled vector per text, exact search; xtr: the encoder's token "
                   "vectors, a faiss token index, documents scored from the retrieved tokens only with the k'-th "
                   "score imputed (seed 002, XTR); sum-of-max: token vectors, ColBERT's exact score over every token")
    e.add_argument("--k-prime", type=int, default=1000, metavar="N",
                   help="with --scoring xtr: tokens retrieved per query token (default 1000)")
    e.add_argument("--ignore-identical-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="a document whose id equals the query's id is never retrieved or counted (default: on, the "
                   "convention of BEIR and MTEB; ArguAna needs it: a query's own argument is in its corpus; no effect "
                   "where query and corpus ids differ)")
    e.add_argument("--output", metavar="DIR", help="folder for summary.json and per_query.json, local or s3:// "
                   "(default: evals/<UTC time>-<suffix>); files there are replaced")
    e.add_argument("--query-prefix", metavar="TEXT", help='text put before each query (default: from the model: its '
                   'pairmine_model.json, else "query: " for E5, else ""). Same as embed.query_prefix')
    e.add_argument("--passage-prefix", metavar="TEXT", help='text put before each document (default: from the '
                   'model: its pairmine_model.json, else "passage: " for E5, else ""). Same as embed.passage_prefix')
    e.add_argument("--config", metavar="FILE", help="TOML file; its [embed] and [storage] tables are used (see "
                   "pairmine mine --help)")
    e.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. --set embed.batch_size=64 --set embed.max_length=512")
    c = sub.add_parser(
        "compare", help="paired per-query comparison of two eval results", formatter_class=raw, epilog=COMPARE_EPILOG,
        description="Compare two `pairmine eval` results query by query (B - A): mean difference with a paired "
        "bootstrap confidence interval, a paired randomisation test, and wins/ties/losses.")
    c.add_argument("result_a", metavar="RESULT_A", help="eval output folder, or its per_query.json (the baseline, A)")
    c.add_argument("result_b", metavar="RESULT_B", help="eval output folder, or its per_query.json (B)")
    c.add_argument("--metric", action="append", help="metric to compare (repeatable; default: all of ndcg@10, "
                   "recall@100, mrr@10)")
    c.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples and randomisation-test "
                   "permutations (default: 10000)")
    c.add_argument("--seed", type=int, default=0, help="seed of the resampling (default: 0)")
    c.add_argument("--ci", type=float, default=0.95, help="confidence level of the interval (default: 0.95)")
    c.add_argument("--common-only", action="store_true", help="compare on the queries both results hold (default: "
                   "differing query sets are an error)")
    c.add_argument("--output", metavar="FILE", help="also write the comparison as JSON (local or s3://)")
    c.add_argument("--config", metavar="FILE", help="TOML file; its [storage] table reaches s3:// results")
    c.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. --set storage.endpoint_url=http://127.0.0.1:8333")
    r = sub.add_parser(
        "report", help="HTML page with plots and example groups of a mined run", formatter_class=raw,
        epilog=REPORT_EPILOG,
        description="Write a static HTML page with PNG plots (matplotlib) for a committed run folder: centrality "
        "histogram with the threshold, groups per document, passage coverage, the consistency filter's n_above "
        "histogram and keep rate, and example tables (like the paper's Table 5): anchors, related passages with "
        "dense, TF-IDF and RRF scores, and the passages never used with their centrality.")
    r.add_argument("run", metavar="RUN", help="run folder (<output>/<run_id> of pairmine mine), local or s3://")
    r.add_argument("--output", metavar="DIR", help="folder for report.html and the PNGs, local or s3:// "
                   "(default: RUN/report)")
    r.add_argument("--examples", type=int, default=5, help="documents with groups to show (default: 5)")
    r.add_argument("--groups-per-doc", type=int, default=1,
                   help="groups shown per document (default: 1, as in the paper's Table 5)")
    r.add_argument("--seed", type=int, default=0, help="seed of the document sample (default: 0)")
    r.add_argument("--no-reembed", action="store_true", help="do not embed the sampled documents again (unused "
                   "passages are then listed without their centrality)")
    r.add_argument("--config", metavar="FILE", help="TOML file; its [storage] table reaches an s3:// run, output and "
                   "input (the run's recorded [storage] is the default for its input)")
    r.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. --set storage.endpoint_url=http://127.0.0.1:8333")
    k = sub.add_parser(
        "calibrate", help="propose an anchor threshold for a model and corpus", formatter_class=raw,
        epilog=CALIBRATE_EPILOG,
        description="Sample documents (seeded), chunk and embed them with the mine operators, print the centrality "
        "distribution, and propose the anchor threshold that reaches a target passage coverage (default: the "
        "paper's 68%) or anchor rate, with example passages on both sides of it.")
    k.add_argument("--input", metavar="PATH", help="parquet/JSONL file, folder or glob (default: the shipped sample). "
                   "Same as input.path")
    k.add_argument("--model", metavar="PATH_OR_ID", help="model folder or hub id (default: all-MiniLM-L6-v2). Same "
                   "as embed.model")
    k.add_argument("--passage-prefix", metavar="TEXT", help='default: from the model (its pairmine_model.json, else '
                   '"passage: " for E5, else "")')
    k.add_argument("--sample-docs", type=int, default=1000, help="documents to sample (default: 1000)")
    k.add_argument("--seed", type=int, default=0, help="seed of the sample (default: 0)")
    target = k.add_mutually_exclusive_group()
    target.add_argument("--target-coverage", type=float, default=68.0, metavar="PCT",
                        help="passage coverage to reach, in %% (default: 68, the paper's figure)")
    target.add_argument("--target-anchor-rate", type=float, metavar="PCT", help="%% of passages that should be anchors")
    k.add_argument("--coverage-basis", choices=("all", "eligible"), default="eligible",
                   help="eligible (default): over documents with enough passages for a group, the paper's setting "
                   "(99%% of its documents yield groups) and the basis of the default 0.675; all: over all passages, "
                   "as stats.json's passage_coverage_pct")
    k.add_argument("--examples", type=int, default=5, help="example passages on each side of the threshold")
    k.add_argument("--config", metavar="FILE", help="TOML file (chunk, embed, related sections are used)")
    k.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. --set chunk.max_words=200")


def cmd_eval(args) -> int:
    from pairmine.pipeline.evaluate import METRICS, evaluate

    cfg = _load(args, ((args.model, "embed.model"), (args.query_prefix, "embed.query_prefix"),
                       (args.passage_prefix, "embed.passage_prefix")), command="eval")
    res = evaluate(cfg, args.beir, args.sts, args.output or "", args.split, args.scoring, args.k_prime,
                   args.ignore_identical_ids)
    s = res.summary
    print(f"model: {s['model']} (query prefix {s['query_prefix']!r}, passage prefix {s['passage_prefix']!r})")
    if "retrieval" in s:
        r = s["retrieval"]
        print(f"retrieval: {r['queries_evaluated']} queries, {r['documents']} documents ({r['dataset']}, {r['split']})")
        print("  " + "  ".join(f"{m} {r['mean'][m]:.4f}" for m in METRICS))
        if r["skipped"]["counts"]:
            print("  skipped: " + ", ".join(f"{k} {v}" for k, v in r["skipped"]["counts"].items()))
        if r["identical_ids_removed"]:
            print(f"  ignore_identical_ids: {r['identical_ids_removed']} queries had their own id among their hits "
                  "(removed, as BEIR and MTEB do; --no-ignore-identical-ids keeps them)")
    if "sts" in s:
        t = s["sts"]
        print(f"sts: {t['pairs']} pairs, Spearman {t['spearman']:.4f} (x100: {100 * t['spearman']:.2f})")
        if t["skipped"]["counts"]:
            print("  skipped: " + ", ".join(f"{k} {v}" for k, v in t["skipped"]["counts"].items()))
    print(f"results: {res.output_dir} ({s['seconds_total']:.1f} s)")
    return 0


def cmd_compare(args) -> int:
    import json

    from pairmine.pipeline.evaluate import compare_results, load_per_query, verdict

    storage = _load(args, command="compare").storage_layer()
    a, b = load_per_query(args.result_a, storage), load_per_query(args.result_b, storage)
    comps, info = compare_results(a, b, args.metric, args.common_only, args.resamples, args.seed, args.ci)
    print(f"A: {a['path']} ({a.get('model', '?')})\nB: {b['path']} ({b.get('model', '?')})")
    print(f"queries: {info['queries_common']} compared (A {info['queries_a']}, B {info['queries_b']})")
    for w in info["warnings"]:
        print(f"warning: {w}")
    pct = round(100 * args.ci)
    print(f"{'metric':<11} {'A':>7} {'B':>7} {'B - A':>8} {f'{pct}% CI':>19} {'wins/ties/losses':>17} {'p':>7}")
    for c in comps:
        print(f"{c.metric:<11} {c.mean_a:7.4f} {c.mean_b:7.4f} {c.mean_diff:+8.4f} [{c.ci_low:+.4f}, {c.ci_high:+.4f}] "
              f"{f'{c.wins}/{c.ties}/{c.losses}':>17} {c.p_value:7.4f}")
    for c in comps:
        print(f"{c.metric}: {verdict(c)}")
    if args.output:
        storage.write_bytes(args.output, json.dumps({
            "a": a["path"], "b": b["path"], **info, "resamples": args.resamples, "seed": args.seed,
            "comparisons": [c.__dict__ for c in comps]}, indent=1).encode("utf-8"))
    return 0


def cmd_report(args) -> int:
    from pairmine.pipeline.report import build_report

    storage = _load(args, command="report").storage_layer()
    res = build_report(args.run, args.output or "", args.examples, args.seed, args.groups_per_doc, not args.no_reembed,
                       storage)
    for n in res.notes:
        print(f"note: {n}")
    print(f"report: {res.html}\nplots: {', '.join(res.pngs)}")
    return 0


def cmd_calibrate(args) -> int:
    from pairmine.pipeline.calibrate import calibrate, format_calibration

    cfg = _load(args, ((args.input, "input.path"), (args.model, "embed.model"),
                       (args.passage_prefix, "embed.passage_prefix")), command="calibrate")
    result = calibrate(cfg, args.sample_docs, args.seed, args.target_coverage, args.target_anchor_rate,
                       args.coverage_basis, args.examples)
    print(format_calibration(result))
    return 0


EVAL_COMMANDS = {"eval": cmd_eval, "compare": cmd_compare, "report": cmd_report, "calibrate": cmd_calibrate}


USER_BUILTINS = (FileNotFoundError, PermissionError)  # builtins the CLI shows as a user error (a path to fix)


def user_error(e: BaseException) -> str | None:
    """The message to show for an error the user can fix (bad config, input, run id), or None for a bug.

    A user-fixable error is a :class:`operators.errors.PairmineError` (every such pairmine error derives from it)
    or one of the builtins in :data:`USER_BUILTINS`. Errors raised inside Ray tasks arrive wrapped in a
    RayTaskError; their cause is unwrapped here so the user sees the message, not a remote traceback."""
    # Ray wraps a task's error once (RayTaskError.cause) or twice (Ray Data's UserCodeException around the UDF's
    # error, as __cause__): follow the whole chain.
    # The innermost user error wins: a RayTaskError is itself an instance of its cause's class (so a PairmineError
    # too), and its own text is the remote traceback.
    seen: set[int] = set()

    def innermost(err) -> str | None:
        if not isinstance(err, BaseException) or id(err) in seen:
            return None
        seen.add(id(err))
        for inner in (getattr(err, "cause", None), err.__cause__):
            found = innermost(inner)
            if found is not None:
                return found
        return str(err) if isinstance(err, (PairmineError, *USER_BUILTINS)) else None

    message = innermost(e)
    if message is not None:
        return message
    # Ray Data re-raises an operator's error as a UserCodeException that keeps only the remote traceback's text:
    # a user error is recognised there by its class, named with its module on a line of its own
    # (``pairmine.operators.read.ColumnTypeError: <message>``), and its message is the rest of that line. Only
    # pairmine's own PairmineError classes (imported by that name here), in errors that came from a Ray task; the
    # first such line wins (a chained traceback prints the cause first).
    from ray.exceptions import RayError

    if not isinstance(e, RayError):
        return None
    for found in re.finditer(r"^(pairmine(?:\.\w+)+)\.(\w+): (.+)$", str(e), re.MULTILINE):
        if _is_pairmine_error(found.group(1), found.group(2)):
            return found.group(3)
    return None


def _is_pairmine_error(module: str, name: str) -> bool:
    """Whether ``module.name`` (as a traceback names a class) is a :class:`PairmineError` subclass of pairmine's."""
    import importlib

    try:
        cls = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - a module that is not pairmine's (or not importable here) names no user error
        return False
    return isinstance(cls, type) and issubclass(cls, PairmineError)


# What Ctrl-C (or SIGTERM) leaves, per command (printed after "pairmine: interrupted"; exit code 130, or 143).
def interrupted_hint(command: str) -> str:
    """How to resume a ``command`` run that Ctrl-C or SIGTERM ended, naming its run id when a run folder was made
    (:attr:`pipeline.run_folder.RunFolder.last_run_id`)."""
    if command == "train":
        return "; run the same command (same --output) to resume from its newest checkpoint"
    if command == "ablate":
        return "; run the same command (same --output) to resume: finished arms are skipped"
    if command not in ("mine", "filter-pairs", "negatives"):
        return ""
    from pairmine.pipeline.run_folder import RunFolder

    run = f"--run-id {RunFolder.last_run_id}" if RunFolder.last_run_id else "the run's --run-id (logged at its start)"
    return (f"; what was committed stays: run the same command with {run} to resume (committed shards and work "
            "units are kept)")


_terminated = False  # SIGTERM arrived (what tells it from Ctrl-C: both end as a KeyboardInterrupt)


def _terminate(signum, frame):
    """SIGTERM (what ``timeout``, systemd and Kubernetes send to stop a process) ends a run as Ctrl-C does (its Ray
    Data execution ended before Ray shuts down, one line saying how to resume), with exit code 143 (128 + 15). A
    flag tells the two apart: Ray turns an exception raised in a handler during ray.get into a KeyboardInterrupt."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    global _terminated
    _terminated = False
    from pairmine.pipeline.run_folder import RunFolder

    RunFolder.last_run_id = None  # (a process may run several commands)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None  # kept across init_ray's ray.init
    try:
        code = _run(parser, args)
        if code == 0 and argv is None:
            _shutdown_ray()
        return code
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _shutdown_ray() -> None:
    """Shut down the private local Ray this command started (:func:`pipeline.ray_adapter.init_ray`) after it
    succeeded, run as a program (``main()`` without argv): Ray's own exit hook would first sleep 0.5 s for workers'
    last messages, which a run that succeeded can do without (a worker's log line still in flight may be lost). A
    caller that passes argv (tests, a library) keeps its Ray, as does one that started Ray itself. The run is
    committed by now, so a signal or an error during the shutdown is ignored; Ray's exit hook then does the rest."""
    from pairmine.pipeline import ray_adapter

    if not ray_adapter.started_private_ray:
        return
    try:
        import ray

        ray.shutdown()
        ray_adapter.started_private_ray = False
    except BaseException as e:  # noqa: BLE001 - Ctrl-C or SIGTERM here must not turn a committed run into a failure
        logging.getLogger("pairmine").debug("Ray's shutdown: %r", e)


def _run(parser, args) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # faiss's loader logs a failed optional import (its AVX2 build) at INFO, which reads like an error.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command == "mine":
            return cmd_mine(args)
        if args.command == "filter-pairs":
            return cmd_filter_pairs(args)
        if args.command == "negatives":
            return cmd_negatives(args)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "ablate":
            return cmd_ablate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command in EVAL_COMMANDS:
            return EVAL_COMMANDS[args.command](args)
    except KeyboardInterrupt:
        how = "terminated (SIGTERM)" if _terminated else "interrupted"
        print(f"pairmine: {how}{interrupted_hint(args.command)}", file=sys.stderr)
        return 143 if _terminated else 130
    except Exception as e:
        message = user_error(e)
        if message is None:
            raise
        print(f"pairmine: error: {message}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
