"""The ``pairmine`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import textwrap


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
  read -> chunk -> embed -> centrality + anchors -> related passages (weighted RRF) -> write, on Ray Data, one row
  per document. Without --input it mines the 827-document sample that ships with pairmine. Without a cluster
  address (ray.address or $RAY_ADDRESS) it starts a local Ray on this machine.

output (<output>/<run_id>/):
  groups/part-NNNNN.parquet   training groups, one part per input shard (zstd)
  stats.json                  counts, drops by reason, the paper's figures, histograms
  manifest.json               resolved config, model, inputs, per-shard status, software versions
  tfidf.joblib                the TF-IDF vectorizer fitted on a seeded sample of the input
  _SUCCESS                    written last: the run is complete

examples:
  pairmine mine
  pairmine mine --input data/ --output runs/ --set embed.batch_size=64 --set anchors.threshold=0.62
  pairmine mine --input 'shards/*.jsonl' --set input.text_column=content --set embed.model=/models/e5-base

"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pairmine",
        description="Mine training groups (anchor passages and their related passages) from web documents for "
        "dense-retriever pretraining (xPRT), on Ray.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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
    m.add_argument("--config", metavar="FILE", help="TOML file with [section] tables, see the keys below")
    m.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set embed.batch_size=64 (repeatable; applied after --config)")
    m.add_argument("--run-id", metavar="ID", help="run folder name (default: UTC time + random suffix). Same as "
                   "output.run_id; a committed run id is refused")
    m.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: $RAY_ADDRESS, else start a "
                   "local Ray). Same as ray.address")
    return parser


def cmd_mine(args) -> int:
    from pipeline.config import load_config
    from pipeline.mine import mine

    overrides = list(args.overrides)
    for flag, key in ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                      (args.ray_address, "ray.address")):
        if flag:
            overrides.append(f"{key}={flag}")
    cfg = load_config(args.config, overrides)
    result = mine(cfg)
    s = result.stats
    print(textwrap.dedent(f"""\
        run folder: {result.run_dir}
        documents: {s['docs_in']} in, {s['docs_with_groups']} with groups, {s['docs_without_groups']} without, {s['docs_skipped_total']} skipped
        groups: {s['groups']} ({s['groups_per_doc']} per document with groups); passages covered: {s['passage_coverage_pct']}%"""))
    return 0


def user_error(e: BaseException) -> str | None:
    """The message to show for an error the user can fix (bad config, input, run id), or None for a bug.

    Errors raised inside Ray tasks arrive wrapped in a RayTaskError; their cause is unwrapped here so the user sees
    the message, not a remote traceback."""
    from operators.read import MissingColumnError
    from pipeline.config import ConfigError
    from pipeline.inputs import InputError
    from pipeline.mine import RunExistsError

    cause = getattr(e, "cause", None) or e
    if isinstance(cause, (ConfigError, InputError, MissingColumnError, RunExistsError, FileNotFoundError)):
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
