"""Bad input at the read stage: every unusable document is marked with its reason, never dropped (SPEC "Read")."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairmine.operators.read import MissingColumnError, ReadDocuments
from pairmine.pipeline.first_pass import ScanParams, first_pass
from pairmine.pipeline.inputs import check_parquet_shards, discover_shards, sample_cut, scan_shard, tfidf_sample


def _plan(path, fmt="auto", storage=None, ranges=3, duplicate_texts=True):
    """The mining job's first pass, in-process, with ``ranges`` hash ranges for the ids: (shards, first, units)."""
    import tempfile

    from pairmine.operators.storage import LOCAL

    storage = storage or LOCAL
    shards = discover_shards(str(path), fmt, storage)
    layout: dict = {}
    check_parquet_shards(shards, ("text", "id"), storage, layout=layout)
    first = first_pass(shards, layout, ScanParams("text", "id", 100, 0, 1.0, None, storage, duplicate_texts),
                       tempfile.mkdtemp(prefix="pairmine-dups-"), in_process=True, ranges=ranges)
    return shards, first, first.units


def _duplicates(first, kind: str = "duplicate_id") -> dict[int, list[int]]:
    """{shard: duplicate rows} as the read operator sees them (the first pass's per-shard files), by id or
    (``kind="duplicate_text"``) by text."""
    import numpy as np

    out = {u["shard_index"]: np.load(u["duplicates"])[kind].tolist() for u in first.units if u["duplicates"]}
    return {shard: rows for shard, rows in out.items() if rows}


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
    for ranges in (1, 3, 7):  # the ids' hash ranges do not change which rows are duplicates
        _, first, units = _plan(tmp_path, ranges=ranges)
        assert _duplicates(first) == {1: [0, 2]} and first.duplicates == 2
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    assert docs.column("skip_reason").to_pylist() == [None, None, "duplicate_id", None, "duplicate_id"]


def test_jsonl_with_invalid_lines_and_numeric_ids(tmp_path):
    lines = [json.dumps({"id": 1, "text": "first document"}), "{not json", json.dumps([1, 2]),
             json.dumps({"id": 2, "text": "second"}), "", json.dumps({"id": 3})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    _, first, units = _plan(tmp_path)
    assert first.rows_per_shard == {0: 5}  # blank lines are not documents
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


def test_the_sample_can_come_back_chunked_from_the_workers(sample_dir):
    """With a ChunkSpec the scans return each sampled document's passages (chunk_text with those settings) in the
    sample's order, so the driver does not chunk the TF-IDF sample; the pool candidates are unchanged."""
    from pairmine.operators.chunk import chunk_text
    from pairmine.pipeline.inputs import ChunkSpec, PoolSpec

    shards = discover_shards(str(sample_dir))
    pool = PoolSpec(300, 3, 0.5, 827)
    spec = ChunkSpec(60, 5, 8)
    plain = [scan_shard(s, "text", "id", 40, 7, 1.0, pool) for s in shards]
    chunked = [scan_shard(s, "text", "id", 40, 7, 1.0, pool, sample_chunk=spec) for s in shards]
    for a, b in zip(plain, chunked):
        assert [p for p, _ in a.sample] == [p for p, _ in b.sample] and len(a.sample) == 40
        assert [tuple(chunk_text(t, 60, 5, 8).passages) for _, t in a.sample] == [ps for _, ps in b.sample]
        assert a.pool == b.pool and len(a.pool) > 0
    assert all(isinstance(ps, tuple) and len(ps) <= 8 for s in chunked for _, ps in s.sample)


def test_the_first_pass_reads_only_max_chars_of_a_huge_document(tmp_path):
    """The TF-IDF sample and the pool chunk a document as the chunk stage does, with chunk.max_chars: only its first
    max_chars + 1 characters become a Python string on the worker (issue 39 item 10), and the passages are
    chunk_text's of the whole text with the same max_chars."""
    from pairmine.operators.chunk import chunk_text
    from pairmine.pipeline.inputs import ChunkSpec, PoolSpec

    huge = "".join(f"lorem ipsum dolor sit {i} " for i in range(200_000))  # 5.7 MB, one line
    (tmp_path / "h.jsonl").write_text(json.dumps({"id": "huge", "text": huge}) + "\n")
    spec = ChunkSpec(120, 5, 8, None, 100_000)
    texts = spec.texts(pa.array([huge, "short", None]))
    assert [len(t) if t else t for t in texts] == [100_001, 5, None]
    assert ChunkSpec(max_chars=0).texts(pa.array([huge]))[0] == huge  # 0: no cut
    (shard,) = discover_shards(str(tmp_path))
    scan = scan_shard(shard, "text", "id", 1, 0, 1.0, PoolSpec(10, 0, 1.0, 1, spec), sample_chunk=spec)
    expected = chunk_text(huge, 120, 5, 8, max_chars=100_000)
    assert expected.chars_cut > 0 and len(expected.passages) == 8
    assert scan.sample[0][1] == tuple(expected.passages) and {p for *_, p in scan.pool} == set(expected.passages)


def test_duplicates_inside_one_shard_and_null_ids(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "a", None, None, "b", "a"], "text": [f"t{i}" for i in range(7)]}),
                   tmp_path / "x.parquet")
    _, first, units = _plan(tmp_path)
    assert _duplicates(first) == {0: [2, 5, 6]} and first.duplicates == 3
    docs = ReadDocuments()(pa.Table.from_pylist(units))
    assert docs.column("skip_reason").to_pylist() == [None, None, "duplicate_id", "null_id", "null_id",
                                                      "duplicate_id", "duplicate_id"]


def test_duplicates_across_row_groups_and_shards(tmp_path):
    """Row groups are the first pass's units: a repeat in a later row group, or in a later shard, is found; the
    first occurrence in run order (shard, then row) is kept, whatever the number of hash ranges."""
    ids = [f"d{i % 40}" for i in range(100)]  # 0-39 first, 40-99 repeat them
    pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in range(100)]}), tmp_path / "a.parquet",
                   row_group_size=16)
    pq.write_table(pa.table({"id": ["d5", "new", "d5"], "text": ["u0", "u1", "u2"]}), tmp_path / "b.parquet")
    for ranges in (1, 4):
        _, first, units = _plan(tmp_path, ranges=ranges)
        assert len(units) == 7 + 1 and [u["row_offset"] for u in units[:3]] == [0, 16, 32]
        assert first.figures["tasks"] == 2 and first.figures["rows_out"] == 103  # small row groups share a task
        assert _duplicates(first) == {0: list(range(40, 100)), 1: [0, 2]} and first.duplicates == 62
        docs = ReadDocuments()(pa.Table.from_pylist(units))
        reasons = docs.column("skip_reason").to_pylist()
        assert reasons.count("duplicate_id") == 62 and reasons[:40] == [None] * 40


def test_duplicate_texts_under_new_ids_are_skipped_and_counted(tmp_path):
    """Issue 14 item 5: web corpora repeat pages under new ids. A document whose exact text an earlier usable
    document of the run has is skipped as duplicate_text (the first copy in run order is kept), across row groups
    and shards, whatever the number of hash ranges; a row that repeats both id and text is a duplicate_id; empty
    and null texts are never text duplicates; a text that differs by one character is not a duplicate; with
    input.skip_duplicate_texts off nothing is looked for."""
    page = "A page about rain gauges. It says how to read one. " * 4
    texts_a = [page, "other page", page, "", "", page + "!", "third page", "other page"]
    ids_a = ["p1", "p2", "copy1", "e1", "e2", "near", "p3", "p2"]  # row 7 repeats p2's id and text
    pq.write_table(pa.table({"id": ids_a, "text": texts_a}), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(pa.table({"id": ["copy2", "p4", "copy3", None], "text": ["third page", "fourth", page, page]}),
                   tmp_path / "b.parquet")
    for ranges in (1, 3, 7):
        _, first, units = _plan(tmp_path, ranges=ranges)
        assert _duplicates(first, "duplicate_text") == {0: [2], 1: [0, 2]} and first.duplicate_texts == 3
        assert _duplicates(first) == {0: [7]} and first.duplicates == 1
        reasons = ReadDocuments()(pa.Table.from_pylist(units)).column("skip_reason").to_pylist()
        assert reasons == [None, None, "duplicate_text", "empty_text", "empty_text", None, None, "duplicate_id",
                           "duplicate_text", None, "duplicate_text", "null_id"]
    _, off, _ = _plan(tmp_path, duplicate_texts=False)
    assert off.duplicate_texts == 0 and off.duplicates == 1
    reasons = ReadDocuments()(pa.Table.from_pylist(off.units)).column("skip_reason").to_pylist()
    assert reasons.count("duplicate_text") == 0 and reasons.count("duplicate_id") == 1


# ---- text that is not valid UTF-8 or not text, compressed JSONL (issue 14 items 1 and 2) ----------------------------

CASES = Path(__file__).resolve().parent / "data" / "cases"  # copies of shared/cases (see its README)
DOCS = [{"id": i, "text": f"Document number {i} says something about topic {i % 3}. " * 3, "url": f"https://x/{i}"}
        for i in range(6)]


def _compress(codec: str, data: bytes) -> bytes:
    import bz2
    import gzip
    import lzma

    if codec == "zstd":
        from backports import zstd

        half = len(data) // 2
        return zstd.compress(data[:half]) + zstd.compress(data[half:])  # two frames, as streaming writers make
    if codec == "gzip":
        half = len(data) // 2
        return gzip.compress(data[:half]) + gzip.compress(data[half:])  # two members
    return {"bz2": bz2.compress, "xz": lzma.compress}[codec](data)


def _read(path, fmt="auto", storage=None):
    from pairmine.operators.storage import LOCAL

    storage = storage or LOCAL
    shards = discover_shards(str(path), fmt, storage)
    scans = [scan_shard(s, "text", "id", 100, 0, storage=storage) for s in shards]
    units = _plan(path, fmt, storage)[2]
    return shards, scans, ReadDocuments(storage=storage)(pa.Table.from_pylist(units))


def _jsonl_bytes(rows) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


@pytest.mark.parametrize("codec,suffix", [("gzip", ".gz"), ("zstd", ".zst"), ("bz2", ".bz2"), ("xz", ".xz")])
def test_compressed_jsonl_gives_the_rows_of_the_plain_file(tmp_path, codec, suffix):
    data = _jsonl_bytes(DOCS)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "d.jsonl").write_bytes(data)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / f"d.jsonl{suffix}").write_bytes(_compress(codec, data))
    (tmp_path / "packed" / "notes.txt").write_text("not an input")  # ignored in a folder, as before
    _, _, plain = _read(tmp_path / "plain")
    shards, scans, packed = _read(tmp_path / "packed")  # found by suffix in a folder
    assert [s.format for s in shards] == ["jsonl"] and scans[0].num_rows == 6
    assert packed.equals(plain) and packed.column("skip_reason").null_count == 6  # no invalid_json
    # Any name, format forced: the codec is told from the magic bytes.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "part-0.data").write_bytes(_compress(codec, data))
    _, _, forced = _read(tmp_path / "other" / "part-0.data", fmt="jsonl")
    assert forced.drop_columns(["shard_index"]).equals(plain.drop_columns(["shard_index"]))


@pytest.mark.parametrize("codec", ["gzip", "zstd", "bz2", "xz"])
def test_corrupt_compressed_jsonl_is_one_input_error(tmp_path, codec):
    from pairmine.operators.read import InputError

    packed = _compress(codec, _jsonl_bytes(DOCS * 50))
    (tmp_path / "cut.jsonl.x").write_bytes(packed[: len(packed) * 2 // 3])  # truncated download
    with pytest.raises(InputError, match=rf"input .*cut\.jsonl\.x is not a readable {codec} file"):
        _read(tmp_path / "cut.jsonl.x", fmt="jsonl")


def test_binary_file_read_as_jsonl_is_one_input_error(tmp_path):
    from pairmine.operators.read import InputError

    (tmp_path / "image.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(InputError, match=r"image\.jsonl cannot be read as JSONL: .*binary data"):
        _read(tmp_path / "image.jsonl")
    pq.write_table(pa.table({"id": ["a"], "text": ["t"]}), tmp_path / "p.bin")
    with pytest.raises(InputError, match=r"p\.bin cannot be read as JSONL: .*parquet file"):
        _read(tmp_path / "p.bin", fmt="jsonl")


def test_datatrove_style_gzip_case_reads_10_documents():
    shards, scans, docs = _read(CASES / "datatrove-style.jsonl.gz")
    assert shards[0].format == "jsonl" and scans[0].num_rows == 10
    assert docs.num_rows == 10 and docs.column("skip_reason").null_count == 10  # 0 invalid_json (was 66)


def test_jsonl_lone_surrogates_latin1_bytes_and_boms_are_repaired(tmp_path):
    lines = [
        b'\xef\xbb\xbf{"id": "bom-file", "text": "starts the file after a BOM"}',
        b'{"id": "surrogate", "text": "broken emoji \\ud83d here", "url": "https://x/\\udc00"}',
        b'{"id": "pair", "text": "a whole emoji \\ud83d\\ude00 stays"}',
        b'{"id": "latin1", "text": "caf\xe9 cr\xe8me"}',
        b'\xef\xbb\xbf{"id": "bom-line", "text": "\\ufeffBOM on the line and in the text"}',
        b'{"id": "id-\\udfff", "text": "only the id is broken"}',
    ]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _, scans, docs = _read(tmp_path / "d.jsonl")
    assert docs.column("skip_reason").to_pylist() == [None] * 6  # the BOM lines are not invalid JSON
    assert docs.column("text").to_pylist() == [
        "starts the file after a BOM", "broken emoji \ufffd here", "a whole emoji \U0001F600 stays",
        "caf\ufffd cr\ufffdme", "BOM on the line and in the text", "only the id is broken"]
    assert docs.column("id").to_pylist()[5] == "id-\ufffd" and docs.column("url").to_pylist()[1] == "https://x/\ufffd"
    assert docs.column("text_repaired").to_pylist() == [False, True, False, True, False, True]
    assert len(scans[0].sample) == 6  # the first pass reads the same texts (it crashed on the surrogate)
    assert all(t.encode("utf-8") for _, t in scans[0].sample)


def test_lone_surrogate_case_reads_8_documents_one_repaired():
    _, _, docs = _read(CASES / "lone-surrogate.jsonl")
    assert docs.num_rows == 8 and docs.column("skip_reason").null_count == 8
    assert docs.column("text_repaired").to_pylist() == [False, False, False, True, False, False, False, False]
    assert docs.column("text").to_pylist()[3].startswith("broken emoji \ufffd here")


def test_parquet_binary_text_with_invalid_utf8_and_bom_is_repaired(tmp_path):
    texts = [b"plain valid text", b"latin-1 caf\xe9 bytes", b"\xef\xbb\xbfBOM then text", None, "caf\u00e9".encode()]
    pq.write_table(pa.table({"id": pa.array([1, 2, 3, 4, 5], pa.int64()), "text": pa.array(texts, pa.binary())}),
                   tmp_path / "b.parquet")
    check_parquet_shards(discover_shards(str(tmp_path)), ("text", "id"))  # binary is text: accepted
    _, scans, docs = _read(tmp_path)
    assert docs.column("text").to_pylist() == ["plain valid text", "latin-1 caf\ufffd bytes", "BOM then text", None,
                                               "caf\u00e9"]
    assert docs.column("id").to_pylist() == ["1", "2", "3", "4", "5"]  # integer ids stay fine
    assert docs.column("text_repaired").to_pylist() == [False, True, False, False, False]
    assert docs.column("skip_reason").to_pylist() == [None, None, None, "null_text", None]
    assert len(scans[0].sample) == 4


@pytest.mark.parametrize("values,type_name", [
    (pa.array([1, 2], pa.int64()), "int64"),
    (pa.array([1.5, 2.5], pa.float64()), "double"),
    (pa.array([["a"], ["b"]], pa.list_(pa.string())), "list<element: string>"),
    (pa.array([{"body": "a"}, {"body": "b"}]), "struct<body: string>"),
])
def test_parquet_text_column_that_is_not_text_is_refused(tmp_path, values, type_name):
    from pairmine.operators.read import ColumnTypeError

    pq.write_table(pa.table({"id": ["a", "b"], "text": values}), tmp_path / "x.parquet")
    message = rf"input .*x\.parquet: column 'text' has type {re.escape(type_name)}, which is not text"
    with pytest.raises(ColumnTypeError, match=message):
        check_parquet_shards(discover_shards(str(tmp_path)), ("text", "id"))  # footer only, before any work
    with pytest.raises(ColumnTypeError, match=message):
        _read(tmp_path)


def test_parquet_id_column_of_lists_is_refused(tmp_path):
    from pairmine.operators.read import ColumnTypeError

    pq.write_table(pa.table({"id": [[1], [2]], "text": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(ColumnTypeError, match=r"x\.parquet: column 'id' has type list<element: int64>"):
        check_parquet_shards(discover_shards(str(tmp_path)), ("text", "id"))


@pytest.mark.parametrize("value,json_type", [(7, "number"), (2.5, "number"), (["a", "b"], "array"),
                                             ({"body": "a"}, "object"), (True, "boolean")])
def test_jsonl_text_that_is_not_a_string_is_refused(tmp_path, value, json_type):
    from pairmine.operators.read import ColumnTypeError

    rows = [{"id": 1, "text": "a real text"}, {"id": 2, "text": value}]
    (tmp_path / "d.jsonl").write_bytes(_jsonl_bytes(rows))
    with pytest.raises(ColumnTypeError, match=rf"d\.jsonl: column 'text' holds a JSON {json_type} in record 2"):
        _read(tmp_path)


def test_pairs_are_read_with_the_same_decoding(tmp_path):
    import gzip

    from pairmine.operators.pairs import read_pair_columns

    rows = b'{"query": "q \\ud83d", "passage": "caf\xe9", "id": 5}\n\xef\xbb\xbf{"query": "q2", "passage": "p2"}\n'
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(rows))
    q, p, ids, invalid, repaired = read_pair_columns(str(tmp_path / "p.jsonl.gz"), "jsonl", -1, "query", "passage",
                                                     "id")
    assert q.to_pylist() == ["q \ufffd", "q2"] and p.to_pylist() == ["caf\ufffd", "p2"]
    assert ids.to_pylist() == ["5", None] and invalid.tolist() == [False, False] and repaired.tolist() == [True, False]
    pq.write_table(pa.table({"query": pa.array([b"ok", b"\xff"], pa.binary()), "passage": ["a", "b"]}),
                   tmp_path / "p.parquet")
    q, _, _, _, repaired = read_pair_columns(str(tmp_path / "p.parquet"), "parquet", -1, "query", "passage", "id")
    assert q.to_pylist() == ["ok", "\ufffd"] and repaired.tolist() == [False, True]


def test_compressed_jsonl_on_s3(s3_server, tmp_path):
    from backports import zstd

    from pairmine.operators.storage import Storage

    storage = Storage(endpoint_url=s3_server.endpoint)
    data = _jsonl_bytes(DOCS)
    root = f"s3://pairmine-test/read-compressed-{tmp_path.name}"
    storage.write_bytes(f"{root}/a.jsonl.zst", zstd.compress(data))
    storage.write_bytes(f"{root}/b.jsonl.gz", _compress("gzip", data))
    shards, _, docs = _read(root, storage=storage)
    assert [s.path.rsplit("/", 1)[-1] for s in shards] == ["a.jsonl.zst", "b.jsonl.gz"]
    assert docs.num_rows == 12 and docs.column("skip_reason").to_pylist() == [None] * 6 + ["duplicate_id"] * 6
    assert docs.column("text").to_pylist()[:6] == [d["text"] for d in DOCS]


def test_a_pair_text_of_invisible_characters_only_is_empty():
    """A query or positive of nothing but zero-width, format and control characters leaves the model no text: it
    is skipped as empty (as whitespace is), where before it was embedded and given negatives."""
    import pyarrow as pa

    from pairmine.operators.pairs import pair_skip_reasons

    queries = pa.array(["\u200b", "\u00ad\u200d\ufeff", "\x00\x00", " \u3000\n", None, "a\u200b", "\u200bé", "q"])
    passages = pa.array(["p"] * 7 + ["\u2028\u200b "])
    assert pair_skip_reasons(queries, passages, None).to_pylist() == [
        "empty_query", "empty_query", "empty_query", "empty_query", "null_query", None, None, "empty_passage"]
