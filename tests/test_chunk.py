"""Chunking limits on real sentences (SPEC "Chunk")."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from operators.chunk import Chunker, chunk_text, split_sentences

S1 = "The perfect game is a rare feat in baseball."  # 9 words
S2 = "No opposing player reaches first base during the whole game."  # 10 words
S3 = "Only twenty-four perfect games have been thrown in major league history."  # 11 words
S4 = "Don Larsen pitched the only one in a World Series."  # 10 words
TEXT = " ".join([S1, S2, S3, S4])


def check_offsets(text, c, words=True):
    for p, s, e in zip(c.passages, c.starts, c.ends):
        assert text[s:e] == p
        assert not p[0].isspace() and not p[-1].isspace()
    if words:  # (words are counted per sentence: two CJK sentences with no space between are two words)
        assert c.words == [len(p.split()) for p in c.passages]


def test_sentences_are_found_with_offsets():
    spans = split_sentences(TEXT)
    assert [TEXT[s:e] for s, e in spans] == [S1, S2, S3, S4]


def test_whole_sentences_are_packed_up_to_max_words():
    c = chunk_text(TEXT, max_words=20, min_words=1)
    assert c.passages == [f"{S1} {S2}", S3, S4] and c.words == [19, 11, 10]
    c = chunk_text(TEXT, max_words=25, min_words=1)
    assert c.passages == [f"{S1} {S2}", f"{S3} {S4}"] and c.words == [19, 21]
    c = chunk_text(TEXT, max_words=120, min_words=1)
    assert c.passages == [TEXT] and c.words == [40]
    check_offsets(TEXT, c)


def test_sentence_longer_than_max_words_is_split_at_word_boundaries():
    c = chunk_text(f"{S1} {S2}", max_words=4, min_words=1)
    assert c.passages == [
        "The perfect game is", "a rare feat in", "baseball.",
        "No opposing player reaches", "first base during the", "whole game.",
    ]
    check_offsets(f"{S1} {S2}", c)


def test_short_passages_are_dropped_and_counted():
    c = chunk_text(f"{S1} {S2}", max_words=4, min_words=3)
    assert c.passages == ["The perfect game is", "a rare feat in", "No opposing player reaches", "first base during the"]
    assert c.n_short == 2


def test_max_passages_caps_and_counts():
    c = chunk_text(TEXT, max_words=11, min_words=1, max_passages=2)
    assert c.passages == [S1, S2] and c.n_truncated == 2


def test_real_document_from_the_sample(sample_dir):
    texts = pq.read_table(sample_dir / "000_00000.parquet", columns=["text"]).column("text").to_pylist()
    text = max(texts, key=len)  # the longest document of the shard
    c = chunk_text(text)
    check_offsets(text, c)
    assert all(5 <= w <= 120 for w in c.words)
    assert c.starts == sorted(c.starts) and all(e <= s for e, s in zip(c.ends, c.starts[1:]))
    # Every word of the document is in a passage, or in a counted dropped/truncated passage.
    if c.n_short == 0 and c.n_truncated == 0:
        assert sum(c.words) == len(text.split())


def test_one_megabyte_single_line_document_is_capped():
    text = "lorem ipsum dolor sit amet " * 40000  # ~1 MB, no sentence end, one line
    c = chunk_text(text)
    assert len(text) > 1_000_000
    assert len(c.passages) == 256 and all(w == 120 for w in c.words)
    assert c.n_truncated == 200000 // 120 + 1 - 256  # 1667 pieces of <= 120 words, 256 kept


def test_control_characters_and_mixed_scripts():
    text = ("Hello\x00 world, this line has a bell \x07 and a tab\t inside it. 日本語の文です。これは二つ目の文です。 "
            "Русский текст здесь тоже есть и он длинный. هذا نص عربي قصير للاختبار هنا. Ünïcödé ends the text here.")
    c = chunk_text(text, max_words=12, min_words=1)
    check_offsets(text, c, words=False)
    assert c.words == [12, 11, 11]
    assert "".join("".join(p.split()) for p in c.passages) == "".join(text.split())  # nothing lost


def test_empty_and_whitespace_text():
    assert chunk_text("").passages == [] and chunk_text(" \n\t ").passages == []


def test_chunker_operator_passes_skipped_rows_through():
    batch = pa.table({"id": ["a", "b"], "text": [TEXT, None], "skip_reason": [None, "null_text"]})
    out = Chunker(max_words=20, min_words=1)(batch)
    assert "text" not in out.column_names
    assert out.column("passages").to_pylist() == [[f"{S1} {S2}", S3, S4], []]
    assert out.column("passage_words").to_pylist() == [[19, 11, 10], []]


def test_invalid_limits_raise():
    with pytest.raises(ValueError, match="max_words"):
        chunk_text(TEXT, max_words=0)
