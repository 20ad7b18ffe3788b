"""The ``pairmine`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import textwrap

from pipeline import __version__


def _config_reference() -> str:
    from pipeline.config import MineConfig

    lines = ["configuration keys (TOML [section] key = value, or --set section.key=value):"]
    cfg = MineConfig()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            default = getattr(getattr(cfg, section.name), f.name)
            lines.append(f"  {section.name}.{f.name} = {default!r}")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)


MINE_EPILOG = """\
what it does:
  read -> chunk -> embed -> centrality + anchors -> related passages (weighted RRF) -> consistency filter (E5: keep
  a group iff fewer than k random pool passages beat cos(anchor, s1)) -> write, on Ray Data, one row per document. Without --input it mines the 827-document sample that ships with pairmine. Without a cluster
  address (ray.address or $RAY_ADDRESS) it starts a local Ray on this machine.

output (<output>/<run_id>/):
  groups/part-NNNNN.parquet   training groups, one part per input shard (zstd)
  stats.json                  counts, drops by reason, the paper's figures, histograms
  manifest.json               resolved config, model, inputs, per-shard status, software versions
  tfidf.joblib                the TF-IDF vectorizer fitted on a seeded sample of the input
  dropped/part-NNNNN.parquet  groups the consistency filter dropped (with consistency.side_output=true)
  _SUCCESS                    written last: the run is complete

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
  ray-train/checkpoint_*/      checkpoints every checkpoint.every_steps steps; the same command resumes from the latest
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
    from pipeline.train_config import TrainConfig

    lines = ["configuration keys (TOML [section] key = value, or --set section.key=value):"]
    cfg = TrainConfig()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            lines.append(f"  {section.name}.{f.name} = {getattr(getattr(cfg, section.name), f.name)!r}")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)


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
    t.add_argument("--groups", metavar="PATH", required=True, help="a committed pairmine mine run folder (with "
                   "groups/ and _SUCCESS) or its groups/ folder; local or s3://")
    t.add_argument("--output", metavar="PATH", required=True, help="folder for checkpoints, metrics.jsonl and "
                   "export/; local or s3://. An existing one is resumed from its latest checkpoint")
    t.add_argument("--positives", choices=("xprt", "random"), help="xprt (default): the positive is s1, the top "
                   "related passage; random: a random other passage of the same document (the paper's ablation). "
                   "Same as train.positives")
    t.add_argument("--model", metavar="MODEL", help="starting encoder (folder or hub id; default: all-MiniLM-L6-v2). "
                   "Same as train.model")
    t.add_argument("--config", metavar="FILE", help="TOML file with [section] tables, see the keys below")
    t.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set train.batch_size=32 (repeatable; applied after --config)")
    t.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: $RAY_ADDRESS, else start a "
                   "local Ray). Same as ray.address")


def cmd_train(args) -> int:
    from pipeline.train import train
    from pipeline.train_config import load_train_config

    overrides = list(args.overrides)
    for flag, key in ((args.positives, "train.positives"), (args.model, "train.model"), (args.ray_address, "ray.address")):
        if flag:
            overrides.append(f"{key}={flag}")
    result = train(load_train_config(args.config, overrides), args.groups, args.output)
    m = result.metrics or {}
    print(f"output: {result.output}\nsteps: {result.steps}; last loss {m.get('loss')} (L_xp {m.get('l_xp')}, "
          f"P(positive) {m.get('p_positive')})\nexported encoder: {result.export_dir}")
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
    m.add_argument("--output", metavar="DIR", help="folder that receives the run folder (default: ./runs). "
                   "Same as output.path")
    _common_args(m)
    f = sub.add_parser(
        "filter-pairs",
        help="keep (query, passage) pairs that pass E5's consistency filter",
        description="E5's consistency filter on existing (query, passage) pairs (seed 004, chapter 1): embed the query "
        "(query prefix) and the passage (passage prefix), and keep a pair iff fewer than k passages of a random pool "
        "beat its own score s = cos(query, passage). Writes one run folder like pairmine mine.",
        epilog=FILTER_EPILOG + _config_reference(),
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
    _add_train_parser(sub)
    return parser


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables, see the keys below")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set embed.batch_size=64 (repeatable; applied after --config)")
    p.add_argument("--run-id", metavar="ID", help="run folder name (default: UTC time + random suffix). Same as "
                   "output.run_id; a committed run id is refused")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: $RAY_ADDRESS, else start a "
                   "local Ray). Same as ray.address")


def _load(args, flags) -> "object":
    from pipeline.config import load_config

    overrides = list(args.overrides)
    for flag, key in flags:
        if flag:
            overrides.append(f"{key}={flag}")
    return load_config(args.config, overrides)


def cmd_filter_pairs(args) -> int:
    from pipeline.filter_pairs import filter_pairs

    cfg = _load(args, ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                       (args.ray_address, "ray.address"), (args.query_column, "input.query_column"),
                       (args.passage_column, "input.passage_column"), (args.pool, "consistency.pool_path"),
                       (args.id_column, "input.pair_id_column")))
    result = filter_pairs(cfg)
    s = result.stats
    print(f"run folder: {result.run_dir}\n"
          f"pairs: {s['pairs_in']} in, {s['pairs_kept']} kept, {s['pairs_dropped_consistency']} dropped by the "
          f"consistency filter ({s['consistency_keep_rate_pct']}% kept), {s['pairs_skipped_total']} skipped")
    return 0


def cmd_mine(args) -> int:
    from pipeline.mine import mine

    cfg = _load(args, ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                       (args.ray_address, "ray.address")))
    result = mine(cfg)
    s = result.stats
    print(textwrap.dedent(f"""\
        run folder: {result.run_dir}
        documents: {s['docs_in']} in, {s['docs_with_groups']} with groups, {s['docs_without_groups']} without, {s['docs_skipped_total']} skipped
        groups: {s['groups']} ({s['groups_per_doc']} per document with groups); passages covered: {s['passage_coverage_pct']}%"""))
    if s["consistency_enabled"]:
        print(f"consistency filter: kept {s['groups']} of {s['groups_mined']} mined groups "
              f"({s['consistency_keep_rate_pct']}%)")
    return 0


def user_error(e: BaseException) -> str | None:
    """The message to show for an error the user can fix (bad config, input, run id), or None for a bug.

    Errors raised inside Ray tasks arrive wrapped in a RayTaskError; their cause is unwrapped here so the user sees
    the message, not a remote traceback."""
    from operators.read import MissingColumnError
    from pipeline.config import ConfigError
    from pipeline.inputs import InputError
    from pipeline.mine import RunExistsError
    from pipeline.xprt_model import UnsupportedModelError

    cause = getattr(e, "cause", None) or e
    if isinstance(cause, (ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError,
                          UnsupportedModelError)):
        return str(cause)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command == "mine":
            return cmd_mine(args)
        if args.command == "filter-pairs":
            return cmd_filter_pairs(args)
        if args.command == "train":
            return cmd_train(args)
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
