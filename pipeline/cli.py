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

output (<output>/<run_id>/; <output> may be s3://bucket/prefix, endpoint and credentials from the AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or [storage]):
  groups/part-NNNNN.parquet   training groups, one part per input shard (zstd), each committed on its own
  stats.json                  counts, drops by reason, the paper's figures, histograms
  manifest.json               resolved config, model, inputs, per-shard status, software versions
  tfidf.joblib                the TF-IDF vectorizer fitted on a seeded sample of the input
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
                   "--output has mined (same path, size and S3 ETag or content SHA-256); nothing new: no run. Same "
                   "as input.incremental=true")
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
                       (args.ray_address, "ray.address"), (args.incremental or None, "input.incremental")))
    result = mine(cfg)
    s = result.stats
    if result.run_dir is None:
        print(f"nothing to mine: all {s['shards_in']} input shard(s) were mined by committed runs under "
              f"{cfg.output.path} (no run folder written)")
        return 0
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
    from operators.storage import StorageError
    from pipeline.config import ConfigError
    from pipeline.inputs import InputError
    from pipeline.mine import RunExistsError

    cause = getattr(e, "cause", None) or e
    if isinstance(cause, (ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError,
                          PermissionError, StorageError)):
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
