"""Bad input at the read stage: every unusable document is marked with its reason, never dropped (SPEC "Read")."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from operators.read import MissingColumnError, ReadDocuments
from pipeline.inputs import (
    check_parquet_shards, discover_shards, duplicate_rows, sample_cut, scan_shard, tfidf_sample, work_units,
)


def _plan(path):
    shards = discover_shards(str(path))
    scans = [scan_shard(s, "text", "id", 100, 0) for s in shards]
    return shards, scans, work_units(shards, scans, duplicate_rows(scans))


def test_skip_reasons_parquet(tmp_path):
    pq.write_table(pa.table({
        "id": ["a", "b", None, "d", "a", "f", "g"],
        "text": ["good text here", "", "has text but no id", "  \n\t ", "duplicate of a", None, "fine"],
        "url": ["u1", None, None, None, None, None, "u7"],
    }), tmp_path / "x.parquet")
    _, _, units = _plan(tmp_path)
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    assert docs.column("skip_reason").to_pylist() == [None, "empty_text", "null_id", "empty_text", "duplicate_id", "null_text", None]
    assert docs.column("row_index").to_pylist() == list(range(7))
    assert docs.column("url").to_pylist()[0] == "u1"
    assert docs.column("text").to_pylist()[1:6] == [None] * 5  # skipped rows keep no text


def test_duplicates_across_shards_keep_the_first(tmp_path):
    pq.write_table(pa.table({"id": ["x", "y"], "text": ["one", "two"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["y", "z", "x"], "text": ["three", "four", "five"]}), tmp_path / "b.parquet")
    _, scans, units = _plan(tmp_path)
    assert duplicate_rows(scans) == {1: [0, 2]}
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    assert docs.column("skip_reason").to_pylist() == [None, None, "duplicate_id", None, "duplicate_id"]


def test_jsonl_with_invalid_lines_and_numeric_ids(tmp_path):
    lines = [json.dumps({"id": 1, "text": "first document"}), "{not json", json.dumps([1, 2]),
             json.dumps({"id": 2, "text": "second"}), "", json.dumps({"id": 3})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    _, scans, units = _plan(tmp_path)
    assert scans[0].num_rows == 5  # blank lines are not documents
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    assert docs.column("id").to_pylist() == ["1", None, None, "2", "3"]
    assert docs.column("skip_reason").to_pylist() == [None, "invalid_json", "invalid_json", None, "null_text"]


def test_missing_text_column_names_the_column(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "content": ["text"]}), tmp_path / "x.parquet")
    with pytest.raises(MissingColumnError, match=r"has no column 'text' \(columns: \['id', 'content'\]\)"):
        _plan(tmp_path)
    (tmp_path / "x.parquet").unlink()
    (tmp_path / "y.jsonl").write_text(json.dumps({"id": "a", "content": "t"}) + "\n")
    with pytest.raises(MissingColumnError, match="has no column 'text'"):
        _plan(tmp_path)


def test_discover_inputs(tmp_path, sample_dir):
    assert [s.path.rsplit("/", 1)[-1] for s in discover_shards(str(sample_dir))] == [
        "000_00000.parquet", "001_00000.parquet", "002_00000.parquet", "003_00000.parquet"]
    assert len(discover_shards(str(sample_dir / "00[12]_*.parquet"))) == 2
    assert len(discover_shards("")) == 4  # empty: the shipped sample
    with pytest.raises(FileNotFoundError, match="does not exist"):
        discover_shards(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no parquet or JSONL"):
        discover_shards(str(tmp_path))


def test_tfidf_sample_is_seeded_and_uniform_over_shards(sample_dir):
    shards = discover_shards(str(sample_dir))
    a = tfidf_sample([scan_shard(s, "text", "id", 50, 7) for s in shards], 50)
    b = tfidf_sample([scan_shard(s, "text", "id", 50, 7) for s in shards], 50)
    c = tfidf_sample([scan_shard(s, "text", "id", 50, 8) for s in shards], 50)
    assert a == b and a != c and len(a) == 50
    # With the per-shard cut (3x the expected rate) each shard returns far fewer texts, same sample.
    cut = sample_cut(50, check_parquet_shards(shards, ("text", "id")))
    assert cut == pytest.approx(150 / 827)
    scans = [scan_shard(s, "text", "id", 50, 7, cut) for s in shards]
    assert sum(len(s.sample) for s in scans) < 4 * 50 and tfidf_sample(scans, 50) == a


def test_duplicates_inside_one_shard_and_null_ids(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "a", None, None, "b", "a"], "text": ["t"] * 7}), tmp_path / "x.parquet")
    _, scans, units = _plan(tmp_path)
    assert duplicate_rows(scans) == {0: [2, 5, 6]}
    assert units[0]["duplicate_rows"] == [2, 5, 6]
