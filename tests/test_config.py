"""Typed config: file, --set overrides, validation errors that name the field."""

import pytest

from pairmine.pipeline.config import DEFAULT_MINILM_THRESHOLD, E5_THRESHOLD, ConfigError, load_config


def test_defaults_and_resolution():
    cfg = load_config()
    assert cfg.chunk.max_words == 120 and cfg.chunk.min_words == 5 and cfg.chunk.max_passages == 256
    assert cfg.related.n_related == 4 and cfg.related.rrf_k == 10 and cfg.related.w_dense == 2 and cfg.related.w_lexical == 1
    assert cfg.resolved_threshold() == DEFAULT_MINILM_THRESHOLD and cfg.resolved_prefix() == ""


def test_e5_model_gets_prefix_and_paper_threshold():
    cfg = load_config(overrides=["embed.model=intfloat/e5-base-unsupervised"])
    assert cfg.resolved_prefix() == "passage: " and cfg.resolved_threshold() == E5_THRESHOLD == 0.825
    cfg = load_config(overrides=["embed.model=intfloat/e5-base-unsupervised", "embed.passage_prefix=", "anchors.threshold=0.7"])
    assert cfg.resolved_prefix() == "" and cfg.resolved_threshold() == 0.7


def test_toml_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[chunk]\nmax_words = 80\n[embed]\nbatch_size = 8\ntrust_remote_code = false\n[anchors]\nthreshold = 0.7\n')
    cfg = load_config(f, ["embed.batch_size=16", "tfidf.sublinear_tf=no"])
    assert cfg.chunk.max_words == 80 and cfg.embed.batch_size == 16 and cfg.anchors.threshold == 0.7
    assert cfg.tfidf.sublinear_tf is False
    assert cfg.to_dict()["embed"]["batch_size"] == 16


@pytest.mark.parametrize(
    "override, message",
    [
        ("chunk.max_words=0", "chunk.max_words = 0 is not allowed: must be >= 1"),
        ("chunk.max_words=many", "chunk.max_words = 'many': expected int"),
        ("chunk.max_chars=-1", "chunk.max_chars = -1 is not allowed: must be >= 0"),
        ("embed.dtype=int8", "embed.dtype = 'int8' is not allowed: must be one of auto, float32, bfloat16, float16"),
        ("anchors.threshold=1.5", "anchors.threshold = 1.5 is not allowed"),
        ("embed.modle=x", "unknown config key 'embed.modle'"),
        ("embedding.model=x", "unknown config section 'embedding'"),
        ("batch_size", "must look like section.key=value"),
        ("embed.trust_remote_code=maybe", "expected true or false"),
    ],
)
def test_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(overrides=[override])


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[chunk\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "typed.toml").write_text('[chunk]\nmax_words = "eighty"\n')
    with pytest.raises(ConfigError, match="chunk.max_words"):
        load_config(tmp_path / "typed.toml")


def test_each_command_validates_only_the_sections_it_uses(tmp_path):
    """A bad value in a section a command does not read is not that command's error (issue 13 item 7)."""
    import subprocess
    import sys

    from pairmine.pipeline.config import COMMAND_SECTIONS, load_negatives_config

    bad = ["related.n_related=0", "tfidf.sample_docs=0"]  # mining-only sections
    for command in ("filter-pairs", "eval", "report", "compare"):
        cfg = load_config(overrides=bad, sections=COMMAND_SECTIONS[command])
        assert cfg.related.n_related == 0 and cfg.tfidf.sample_docs == 0
    load_negatives_config(overrides=bad)  # negatives validates its own sections by default
    with pytest.raises(ConfigError, match=r"related.n_related = 0 is not allowed: must be >= 1"):
        load_config(overrides=bad, sections=COMMAND_SECTIONS["mine"])
    with pytest.raises(ConfigError, match=r"related.n_related = 0"):
        load_config(overrides=bad)  # no sections named: every section
    with pytest.raises(ConfigError, match=r"embed.batch_size = -1"):  # a section eval uses is still checked
        load_config(overrides=["embed.batch_size=-1"], sections=COMMAND_SECTIONS["eval"])
    with pytest.raises(ConfigError, match=r"negatives.depth = 0"):
        load_negatives_config(overrides=["negatives.depth=0"])
    # Through the CLI: report with a bad mining-only value reaches its own check (the run folder), not the config's.
    proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "report", str(tmp_path / "no-run"),
                           "--set", "related.n_related=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "related.n_related" not in proc.stderr and "no-run" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--input", str(tmp_path),
                           "--set", "related.n_related=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "related.n_related = 0 is not allowed" in proc.stderr


def test_each_commands_help_lists_the_keys_it_reads():
    """--help of negatives and filter-pairs lists their keys, not mine's anchors/related/tfidf; texts written for
    mine (input.path: "empty: the sample") are replaced where the command means something else."""
    import re

    from pairmine.pipeline.cli import _config_reference
    from pairmine.pipeline.config import NegativesConfig

    def keys(text):
        return set(re.findall(r"^  ([a-z_]+\.[a-z_]+) = ", text, re.M))

    mine, pairs = _config_reference(), _config_reference(command="filter-pairs")
    negatives = _config_reference(NegativesConfig, "negatives")
    assert {"anchors.threshold", "related.rrf_k", "tfidf.seed", "input.incremental"} <= keys(mine)
    assert not {"input.query_column", "input.pair_id_column"} & keys(mine)
    assert {"consistency.k", "input.query_column", "input.text_column"} <= keys(pairs)
    assert not {"anchors.threshold", "tfidf.seed", "input.url_column"} & keys(pairs)
    assert {"negatives.depth", "negatives.corpus", "embed.query_prefix", "ray.stall_limit_s"} <= keys(negatives)
    assert not [k for k in keys(negatives) if k.split(".")[0] in ("anchors", "related", "tfidf", "consistency")]
    assert "the sample" in mine.split("input.path = ''\n")[1].splitlines()[0]
    for text in (pairs, negatives):
        assert "required" in text.split("input.path = ''\n")[1].splitlines()[0]
        assert "the sample" not in text.split("input.path = ''\n")[1].splitlines()[0]
    assert "[anchors]" in negatives.splitlines()[-1] and "negatives does not use them" in negatives.splitlines()[-1]
    assert "consistency.pool_path" not in keys(mine) and "consistency.pool_path" in keys(pairs)


def test_a_runs_recorded_config_holds_only_the_keys_its_command_reads():
    """A TOML file shared by several commands: a key another command reads may change between a run's attempts
    (resume), one its own command reads may not. The recorded config is what a resume compares."""
    from pairmine.pipeline.config import COMMAND_SECTIONS, load_negatives_config
    from pairmine.pipeline.mine import result_config
    from pairmine.pipeline.run_folder import RunExistsError, check_resume

    def plan(command, overrides):
        cfg = (load_negatives_config(overrides=overrides) if command == "negatives" else
               load_config(overrides=overrides, sections=COMMAND_SECTIONS[command]))
        return {"inputs": [{"key": "a.parquet|1"}], "config": result_config(cfg, command)}

    negatives = plan("negatives", [])["config"]
    assert set(negatives) == {"input", "chunk", "embed", "negatives"}
    assert "incremental" not in negatives["input"] and "query_column" in negatives["input"]
    assert set(plan("filter-pairs", [])["config"]) == {"input", "chunk", "embed", "consistency"}
    mine = plan("mine", [])["config"]
    assert {"anchors", "related", "tfidf"} <= set(mine) and "query_column" not in mine["input"]
    assert "pool_path" not in mine["consistency"] and "num_actors" not in mine["embed"]
    for command, other, own in [("negatives", "related.n_related=3", "negatives.depth=300"),
                                ("filter-pairs", "anchors.threshold=0.5", "consistency.k=7"),
                                ("mine", "input.query_column=q", "anchors.threshold=0.5")]:
        prior = plan(command, [])
        check_resume(plan(command, [other]), prior, "r1")  # not this command's key: the resume goes on
        with pytest.raises(RunExistsError, match=rf"another config \({own.split('=')[0]} differ"):
            check_resume(plan(command, [own]), prior, "r1")


def test_the_cli_puts_back_the_callers_sigterm_handler_and_names_unknown_folders():
    """main() takes SIGTERM for the length of a command (a run ends as on Ctrl-C) and gives it back after, so a
    program calling it in-process keeps its own; a committed folder that no pairmine command wrote is named so."""
    import signal

    from pairmine.pipeline.cli import main
    from pairmine.pipeline.run_folder import wrong_kind

    before = signal.getsignal(signal.SIGTERM)
    assert main(["report", "/nonexistent/run"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    assert wrong_kind("out/x", None, "mine", "give a mine run") == (
        "out/x is a committed folder but not a run of pairmine mine, filter-pairs or negatives (mine wanted); give a "
        "mine run")
    assert wrong_kind("out/n", "negatives", "mine") == "out/n is a pairmine negatives run (it holds negatives/), " \
        "not a mine run"


def test_config_file_read_from_s3_with_the_storage_keys_of_the_overrides(s3_server):
    """Issue 39 item 6: a --config reaches a cluster's head without a working_dir upload when it is an s3:// object;
    it is read with the --set storage.* keys (or the environment's endpoint), and a missing object is one error."""
    import uuid

    from pairmine.operators.storage import Storage
    from pairmine.pipeline.train_config import load_train_config

    root = f"s3://pairmine-test/config-{uuid.uuid4().hex[:8]}"
    store = Storage(endpoint_url=s3_server.endpoint)
    store.write_bytes(f"{root}/mine.toml", b"[anchors]\nthreshold = 0.61\n")
    store.write_bytes(f"{root}/train.toml", b"[train]\nbatch_size = 32\n")
    endpoint = f"storage.endpoint_url={s3_server.endpoint}"
    assert load_config(f"{root}/mine.toml", [endpoint]).anchors.threshold == 0.61
    assert load_config(f"{root}/mine.toml", [endpoint, "anchors.threshold=0.7"]).anchors.threshold == 0.7  # --set wins
    assert load_train_config(f"{root}/train.toml", [endpoint]).train.batch_size == 32
    with pytest.raises(ConfigError, match=rf"config file {root}/missing.toml does not exist"):
        load_train_config(f"{root}/missing.toml", [endpoint])
    with pytest.raises(ConfigError, match="unknown config section 'anchors'"):
        load_train_config(f"{root}/mine.toml", [endpoint])  # read, then checked as a local file is
