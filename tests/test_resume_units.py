"""Resume finer than a file (issue 15 item 7) and filter-pairs' run lifecycle (issue 13 item 2): a run killed in the
middle of a shard keeps the work units (row groups) it completed and mines only the rest; the output is the
uninterrupted run's, exactly once."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import Out, assert_same_groups
from tests.test_storage import kill_driver, start, wait_for


def unit_records(root, run_id: str) -> int:
    """Completed-unit records of shard 0 (they go away when the shard commits)."""
    d = root / run_id / "_state" / "units" / "shard-00000"
    return len(list(d.glob("unit-*.json"))) if d.exists() else 0


@pytest.fixture(scope="module")
def one_file(tmp_path_factory, sample_dir):
    """800 documents of the shipped sample in one parquet file of 16 row groups of 50 (FineWeb's layout, small)."""
    t = pa.concat_tables([pq.read_table(p, columns=["id", "text", "url"]) for p in sorted(sample_dir.glob("*.parquet"))])
    d = tmp_path_factory.mktemp("one-file")
    pq.write_table(t.slice(0, 800), d / "docs.parquet", row_group_size=50)
    assert pq.ParquetFile(d / "docs.parquet").metadata.num_row_groups == 16
    return d / "docs.parquet"


def mine_cmd(inp, root, run_id: str, model: str) -> list[str]:
    return [sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--input", str(inp), "--output", str(root),
            "--run-id", run_id, "--set", f"embed.model={model}", "--set", "embed.dtype=float32",
            "--set", "anchors.threshold=0.99", "--set", "consistency.pool_size=400", "--set", "ray.docs_per_batch=16",
            "--set", "ray.num_cpus=2", "--set", "consistency.side_output=true"]


@pytest.mark.slow  # ~4 min on CI; the default run keeps a driver killed between commits (test_storage)
def test_a_run_killed_mid_file_keeps_its_completed_row_groups(one_file, tiny_model_dir, tmp_path):
    root = tmp_path / "runs"
    o = Out(str(root), None)
    ref = subprocess.run(mine_cmd(one_file, root, "whole", tiny_model_dir), capture_output=True, text=True,
                         timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd = mine_cmd(one_file, root, "killed", tiny_model_dir)
    p = start(cmd, tmp_path / "killed.log")
    wait_for(lambda: unit_records(root, "killed") >= 4, p, what="4 completed work units")
    kill_driver(p)
    kept = unit_records(root, "killed")
    assert 4 <= kept < 16 and not (root / "killed" / "_state" / "shard-00000.json").exists()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{kept} work unit(s) completed earlier kept" in proc.stderr
    assert f"{16 - kept} work unit(s) to mine" in proc.stderr
    s, r = o.json("killed", "stats.json"), o.json("whole", "stats.json")
    assert (s["units"], s["units_resumed"], s["shards_resumed"], r["units_resumed"]) == (16, kept, 0, 0)
    for key in ("docs_in", "docs_with_groups", "groups", "groups_mined", "groups_dropped_consistency", "passages",
                "passages_in_groups", "anchors", "docs_skipped", "centrality_histogram", "n_above_histogram"):
        assert s[key] == r[key], key
    for folder in ("groups", "dropped"):
        a = o.table("killed", folder).drop_columns(["run_id"])
        b = o.table("whole", folder).drop_columns(["run_id"])
        assert a.num_rows == b.num_rows == len(set(a.column("group_id").to_pylist()))  # exactly once
        assert_same_groups(a, b)
    assert o.names("killed") == ["README.md", "_SUCCESS", "dropped", "groups", "manifest.json", "stats.json", "tfidf.joblib"]


def kill_after_first_commit_then_resume(cmd, root, log, job: str) -> tuple[int, dict, dict]:
    """An uninterrupted run ``whole``, then run ``killed`` SIGKILLed after its first shard commit and run again.
    Returns (shards committed at the kill, the resumed run's stats, the uninterrupted run's stats); the re-run's log
    must name the committed shards."""
    ref = subprocess.run(cmd("whole"), capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    p = start(cmd("killed"), log)
    wait_for(lambda: any((root / "killed" / "_state").glob("shard-*.json")), p, what="the first shard commit")
    kill_driver(p)
    committed = len(list((root / "killed" / "_state").glob("shard-*.json")))
    assert 1 <= committed < 4 and not (root / "killed" / "_SUCCESS").exists()
    proc = subprocess.run(cmd("killed"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming {job} run killed: {committed} of 4 shard(s) already committed" in proc.stderr
    o = Out(str(root), None)
    s = o.json("killed", "stats.json")
    assert s["shards_resumed"] == committed and s["reconciled"]
    return committed, s, o.json("whole", "stats.json")


@pytest.mark.slow  # ~3 min on CI; the same commit/resume machinery as mine's kill test in the default run
def test_filter_pairs_killed_after_a_shard_commit_resumes_the_rest(tiny_model_dir, tmp_path):
    """filter-pairs commits each shard as soon as its pairs are staged; a killed run re-run with its --run-id keeps
    the committed shards and gives the uninterrupted run's pairs."""
    from tests.test_filter_pairs import fiqa_pairs

    true, shuffled = fiqa_pairs(400)
    inp = tmp_path / "pairs"
    inp.mkdir()
    rows = true + shuffled
    for i in range(4):  # 4 shards of 200 pairs, row groups of 50
        pq.write_table(pa.Table.from_pylist(rows[i * 200:(i + 1) * 200]), inp / f"pairs-{i}.parquet",
                       row_group_size=50)
    root = tmp_path / "runs"
    o = Out(str(root), None)

    def cmd(run_id):
        return [sys.executable, "-m", "pairmine.pipeline.cli", "filter-pairs", "--input", str(inp), "--output",
                str(root), "--run-id", run_id, "--set", f"embed.model={tiny_model_dir}", "--set", "embed.dtype=float32",
                "--set", "ray.docs_per_batch=16", "--set", "ray.num_cpus=2", "--set", "consistency.side_output=true"]

    committed, s, r = kill_after_first_commit_then_resume(cmd, root, tmp_path / "killed.log", "filter-pairs")
    for key in ("pairs_in", "pairs_kept", "pairs_dropped_consistency", "pairs_skipped", "n_above_histogram",
                "pool_size"):
        assert s[key] == r[key], key
    for folder in ("pairs", "dropped"):
        a = o.table("killed", folder).drop_columns(["run_id"]).sort_by("pair_id")
        b = o.table("whole", folder).drop_columns(["run_id"]).sort_by("pair_id")
        assert a.column("pair_id").to_pylist() == b.column("pair_id").to_pylist()
        assert len(set(a.column("pair_id").to_pylist())) == a.num_rows  # exactly once
        assert_same_groups(a, b)
    assert o.names("killed") == ["README.md", "_SUCCESS", "dropped", "manifest.json", "pairs", "stats.json"]
    m = o.json("killed", "manifest.json")
    assert [sh["status"] for sh in m["shards"]] == ["committed"] * 4
    again = subprocess.run(cmd("killed"), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already committed" in again.stderr


# ~2.5 minutes (three runs of the tiny model): negatives shares the run lifecycle tested above with filter-pairs, so
# its own kill test runs with -m slow.
@pytest.mark.slow
def test_negatives_killed_after_a_shard_commit_resumes_the_rest(tiny_model_dir, tmp_path):
    from tests.test_filter_pairs import FIQA, fiqa_pairs

    true, _ = fiqa_pairs(400)
    inp = tmp_path / "pairs"
    inp.mkdir()
    for i in range(4):  # 4 shards of 100 pairs, row groups of 25
        pq.write_table(pa.Table.from_pylist(true[i * 100:(i + 1) * 100]), inp / f"pairs-{i}.parquet",
                       row_group_size=25)
    root = tmp_path / "runs"
    o = Out(str(root), None)

    def cmd(run_id):
        return [sys.executable, "-m", "pairmine.pipeline.cli", "negatives", "--input", str(inp), "--corpus",
                str(FIQA / "corpus.jsonl"), "--output", str(root), "--run-id", run_id, "--set",
                f"embed.model={tiny_model_dir}", "--set", "embed.dtype=float32", "--set", "input.id_column=_id",
                "--set", "ray.docs_per_batch=8", "--set", "ray.num_cpus=2"]

    committed, s, r = kill_after_first_commit_then_resume(cmd, root, tmp_path / "killed.log", "negatives")
    for key in ("pairs_in", "pairs_out", "negatives", "negatives_dropped", "pairs_skipped", "corpus_passages"):
        assert s[key] == r[key], key
    a = o.table("killed", "negatives").drop_columns(["run_id"]).sort_by("pair_id")
    b = o.table("whole", "negatives").drop_columns(["run_id"]).sort_by("pair_id")
    assert a.num_rows == len(set(a.column("pair_id").to_pylist())) == 400  # exactly once
    assert_same_groups(a, b)
    assert o.names("killed") == ["README.md", "_SUCCESS", "manifest.json", "negatives", "stats.json"]
