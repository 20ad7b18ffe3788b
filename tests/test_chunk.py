"""Chunking limits on real sentences (SPEC "Chunk")."""

import unicodedata

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairmine.operators.chunk import Chunker, chunk_text, normalise_passage, split_sentences

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


def test_sentence_offsets_equal_blingfires_own_wrapper(sample_dir):
    """split_sentences maps blingfire's UTF-8 byte offsets itself (the wrapper's Python loop over every byte was
    ~40% of chunking's time): the spans must be the wrapper's, on every sample document (Arabic, Cyrillic, CJK
    pages among them) and on edge cases of multi-byte text."""
    import blingfire

    from pairmine.operators.chunk import _blingfire_sentences

    texts = [t for f in sorted(sample_dir.glob("*.parquet")) for t in pq.read_table(f).column("text").to_pylist()]
    texts += ["a", "Hi. \U0001F600 there! \u00dcn\u00efc\u00f6d\u00e9. \u4f60\u597d\u3002\u4e16\u754c\uff01",
              "x\n\ny.  Z?", "\u00e9" * 3 + ".", "\U0001F600.\U0001F600.", "\u0000abc. def.", "end without stop"]
    for text in texts:
        assert _blingfire_sentences(text) == [(int(a), int(b)) for a, b in blingfire.text_to_sentences_and_offsets(
            text)[1]], text[:80]
    assert len(texts) == 834


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
    # Chunking stops at the first passage past the cap (S3): counted once, with the 229 - 106 characters from S3 on.
    assert c.passages == [S1, S2] and c.n_truncated == 1 and c.chars_truncated == len(TEXT) - TEXT.index(S3) == 123


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
    text = "".join(f"lorem ipsum dolor sit {i} " for i in range(40000))  # ~1 MB, no sentence end, one line
    c = chunk_text(text)
    assert len(text) > 1_000_000
    words = text.split()
    assert c.passages == [" ".join(words[k * 120:(k + 1) * 120]) for k in range(256)] and set(c.words) == {120}
    # 1667 pieces of <= 120 words, 256 kept; chunking stops at the 257th (word 30,720 = "lorem" of i = 6144): the
    # text from there on is neither split nor counted in passages, only in characters.
    first_left_out = len("".join(f"lorem ipsum dolor sit {i} " for i in range(6144)))
    assert c.n_truncated == 1 and c.n_duplicate == 0 and c.chars_truncated == len(text) - first_left_out == 944112
    # The same page with one phrase repeated: every 120-word piece is the same text, kept once (not capped).
    c = chunk_text("lorem ipsum dolor sit amet " * 40000)
    assert c.words == [120, 80] and c.n_duplicate == 1667 - 2 and c.n_truncated == 0


def test_control_characters_and_mixed_scripts():
    text = ("Hello\x00 world, this line has a bell \x07 and a tab\t inside it. 日本語の文です。これは二つ目の文です。 "
            "Русский текст здесь тоже есть и он длинный. هذا نص عربي قصير للاختبار هنا. Ünïcödé ends the text here.")
    c = chunk_text(text, max_words=12, min_words=1)
    check_offsets(text, c, words=False)
    assert c.words == [12, 7, 8, 8, 11]  # 'it.' + 7 CJK characters = 1 + 5.6; 10 CJK characters = 8
    assert "".join("".join(p.split()) for p in c.passages) == "".join(text.split())  # nothing lost


def test_empty_and_whitespace_text():
    assert chunk_text("").passages == [] and chunk_text(" \n\t ").passages == []


def test_chunker_operator_passes_skipped_rows_through():
    batch = pa.table({"id": ["a", "b"], "text": [TEXT, None], "skip_reason": [None, "null_text"]})
    out = Chunker(max_words=20, min_words=1)(batch)
    assert "text" not in out.column_names
    assert out.column("passages").to_pylist() == [[f"{S1} {S2}", S3, S4], []]
    assert out.column("passage_words").to_pylist() == [[19, 11, 10], []]
    assert out.column("n_duplicate_passages").to_pylist() == [0, 0]


def test_invalid_limits_raise():
    with pytest.raises(ValueError, match="max_words"):
        chunk_text(TEXT, max_words=0)


# ---------------------------------------------------------------------------------------------------------------
# Scripts without spaces (issue 14 item 3): a CJK character counts 0.8 of a word, Hangul 1.4, Thai 0.15.

SUBJECTS = ["我们", "农民", "老师", "学生", "朋友", "邻居"]
PLACES = ["今天", "昨天", "周末", "早上", "晚上"]
# 2 + 2 + 6 = 10 Han characters (8 words) and a full stop per sentence; 30 different sentences.
ZH = [f"{a}{b}在公园里散步。" for a in SUBJECTS for b in PLACES]


def test_cjk_sentence_ends_that_blingfire_misses_are_repaired():
    text = "第一句。第二句！第三句？第四句．第五句。他说：「你好。」然后走了。她问：“真的吗？”是的"
    assert [text[s:e] for s, e in split_sentences(text)] == [
        "第一句。", "第二句！", "第三句？", "第四句．", "第五句。", "他说：「你好。」", "然后走了。", "她问：“真的吗？”", "是的"]
    ja = "東京は日本の首都です．毎日たくさんの人が電車で通勤しています｡春には桜が咲きます!"
    assert [ja[s:e] for s, e in split_sentences(ja)] == ["東京は日本の首都です．", "毎日たくさんの人が電車で通勤しています｡",
                                                         "春には桜が咲きます!"]
    th = "สวัสดีครับ วันนี้อากาศดีมาก  ผมไปตลาด"  # Thai: a space ends a phrase or sentence
    assert [th[s:e] for s, e in split_sentences(th)] == ["สวัสดีครับ", "วันนี้อากาศดีมาก", "ผมไปตลาด"]
    assert split_sentences(TEXT) == [(0, 44), (45, 105), (106, 178), (179, 229)]  # English: blingfire unchanged


def test_chinese_is_packed_by_characters():
    text = "".join(ZH)  # 330 characters, no space
    c = chunk_text(text)
    # 15 sentences of 8 words = 120 words = 150 Han characters (+15 full stops) per passage.
    assert c.passages == ["".join(ZH[:15]), "".join(ZH[15:])] and c.words == [120, 120]
    assert [len(p) for p in c.passages] == [165, 165]
    check_offsets(text, c, words=False)
    c = chunk_text(text, max_words=20)  # 2 sentences (16 words) per passage
    assert c.passages == ["".join(ZH[i:i + 2]) for i in range(0, 30, 2)] and set(c.words) == {16}


def test_japanese_run_without_a_terminator_is_cut_at_the_limit():
    text = "あいうえおかき" * 58  # 406 kana, one run: cut every 150 characters (150 x 0.8 = 120 words)
    c = chunk_text(text)
    assert [len(p) for p in c.passages] == [150, 150, 106] and c.words == [120, 120, 85]  # 106 x 0.8 = 84.8
    assert "".join(c.passages) == text and c.n_duplicate == 0
    mixed = "「東京」は2024年にGPUを使った。"  # 9 kana/Han (7.2 words) + "2024" + "GPU" (1 word each)
    assert chunk_text(mixed, min_words=1).words == [9]


def test_thai_and_korean_are_counted_by_characters():
    text = "กขคงจฉช" * 286  # 2002 Thai characters with no space: 800 characters = 800 x 0.15 = 120 words
    c = chunk_text(text)
    assert [len(p) for p in c.passages] == [800, 800, 402] and c.words == [120, 120, 60]
    # Combining marks stay with their base when a run is cut.
    c = chunk_text("กัขิคี" * 167, max_words=30)  # base + mark pairs: 200 characters (100 pairs) per passage
    assert c.words == [30, 30, 30] and [len(p) for p in c.passages] == [200, 200, 200]  # 1002 characters,
    assert c.n_duplicate == 2  # the passages at 600 and 800 repeat those at 0 and 200 (period 6), last is 2 chars
    assert all(unicodedata.category(p[0]) == "Lo" and unicodedata.category(p[-1]) == "Mn" for p in c.passages)
    ko = "서울은 한국의 수도입니다."  # 11 Hangul syllables x 1.4 = 15.4 words
    assert chunk_text(ko).words == [15]


def test_cjk_case_documents_become_several_passages():
    """tests/data/cases/cjk-no-spaces.parquet (a copy of shared/cases): 20 Chinese documents of 833-1,631 characters were one passage each."""
    from pathlib import Path

    case = Path(__file__).resolve().parent / "data" / "cases" / "cjk-no-spaces.parquet"
    texts = pq.read_table(case, columns=["text"]).column("text").to_pylist()
    counts = [len(chunk_text(t).passages) for t in texts]
    assert min(counts) >= 5 and sum(counts) == 184  # every document has enough passages for a group (1 + 4)
    assert all(len(p) <= 170 for t in texts for p in chunk_text(t).passages)  # <= 150 Han + punctuation


# Within one document, passages equal after whitespace/case normalisation are kept once (issue 14 item 5).

def test_repeated_paragraph_is_kept_once():
    text = f"{S1} {S2}\n\n{S3}\n\n{S1.upper()}   \n {S2.lower()}"
    c = chunk_text(text, max_words=19, min_words=1)
    assert c.passages == [f"{S1} {S2}", S3] and c.n_duplicate == 1
    assert normalise_passage(f"{S1.upper()}   \n {S2.lower()}") == normalise_passage(f"{S1} {S2}")
    zh = "".join(ZH[:15])
    c = chunk_text(f"{zh}\n{''.join(ZH[15:])}\n{zh}")
    assert len(c.passages) == 2 and c.n_duplicate == 1


# Passages within the model's token limit (issue 14 item 4): the embedder's tokenizer (the default model's) counts.

SENTENCES = ["The cat sat on the mat.", "A dog ran in the park.", "My hat is on the bed.", "We ate rice at the inn.",
             "He saw a bird in a tree."]  # 9, 9, 9, 9, 10 tokens with [CLS] and [SEP]


def test_passages_over_the_token_limit_are_cut_at_sentences():
    from pairmine.operators.chunk import TokenLimit

    text = " ".join(SENTENCES)  # 29 words: one passage by words
    limit = TokenLimit("", 16, "")
    assert limit.lengths(SENTENCES) == [9, 9, 9, 9, 10] and limit.lengths([" ".join(SENTENCES[:2])]) == [16]
    c = chunk_text(text, min_words=1, token_limit=limit)
    # 2 sentences = 14 tokens + 2 special = 16 fit; 3 do not: runs of two whole sentences.
    assert c.passages == [" ".join(SENTENCES[:2]), " ".join(SENTENCES[2:4]), SENTENCES[4]]
    assert c.words == [12, 12, 7] and c.n_token_split == 1
    check_offsets(text, c)
    # The prefix counts: "passage: " adds 2 tokens, so two sentences (18) no longer fit.
    c = chunk_text(text, min_words=1, token_limit=TokenLimit("", 16, "passage: "))
    assert c.passages == SENTENCES and c.n_token_split == 1
    # Within the limit, nothing changes.
    assert chunk_text(text, min_words=1, token_limit=TokenLimit("", 64, "")).passages == [text]
    assert chunk_text(TEXT, token_limit=TokenLimit("", 256, "")) == chunk_text(TEXT)


def test_a_sentence_over_the_limit_is_cut_at_words_and_a_word_at_characters():
    from pairmine.operators.chunk import TokenLimit

    words = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
             "seventeen eighteen nineteen twenty.")  # one sentence; every number word is one token, "twenty." two
    c = chunk_text(words, min_words=1, token_limit=TokenLimit("", 8, ""))
    assert c.passages == ["one two three four five six", "seven eight nine ten eleven twelve",
                          "thirteen fourteen fifteen sixteen seventeen eighteen", "nineteen twenty."]
    check_offsets(words, c)
    # A single "word" of HTML-escaped CJK (the sample's longest passage is 2,786 tokens of these): cut between
    # characters, each piece the longest that fits.
    blob = "&#26085;&#26412;&#19981;&#21345;&#20813;&#36153;&#26032;&#19968;&#20108;&#19977;&#21306;"
    limit = TokenLimit("", 32, "")
    assert limit.lengths([blob]) == [59]
    c = chunk_text(blob, min_words=1, token_limit=limit)
    assert "".join(c.passages) == blob and len(c.passages) == 2
    assert limit.lengths(c.passages) == [32, 29] and limit.lengths([blob[:c.ends[0] + 1]]) == [33]


def test_the_sample_fits_the_default_model(sample_dir):
    """All 827 sample documents with the default model's limit (256 tokens): the 57 passages of <= 120 words that
    had more tokens (Arabic, Greek and Cyrillic pages, number lists, HTML-escaped CJK) are cut again, none is left
    over the limit, and every other document is chunked exactly as by words alone."""
    from pairmine.operators.chunk import TokenLimit

    texts = [t for f in sorted(sample_dir.glob("*.parquet")) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]
    limit = TokenLimit("", 256, "")
    by_words = [chunk_text(t) for t in texts]
    fitted = [chunk_text(t, token_limit=limit) for t in texts]
    assert len(texts) == 827 and sum(c.n_token_split for c in fitted) == 57
    assert sum(n > 256 for c in by_words for n in limit.lengths(c.passages)) == 57
    assert max(n for c in fitted for n in limit.lengths(c.passages)) <= 256
    assert sum(len(c.passages) for c in fitted) == 5216 and sum(c.n_short for c in fitted) == 17  # 5144 and 3 by words
    assert all(a == b for a, b in zip(by_words, fitted) if b.n_token_split == 0)
    for t, c in zip(texts, fitted):
        check_offsets(t, c, words=False)


def test_a_huge_word_costs_at_most_the_passage_cap():
    """A 320,000-character "word" (no space: HTML-escaped text, base64, minified code) is cut only up to
    chunk.max_passages pieces; the rest is one more piece past the cap (counted as truncated), so the work and
    memory do not grow with the word."""
    from pairmine.operators.chunk import TokenLimit

    blob = "".join(f"&#{20000 + i};" for i in range(40000))
    limit = TokenLimit("", 32, "")
    c = chunk_text(blob, min_words=1, max_passages=4, token_limit=limit)
    assert len(c.passages) == 4 and c.n_truncated == 1 and c.n_token_split == 1
    assert max(limit.lengths(c.passages)) <= 32 and "".join(c.passages) == blob[:c.ends[-1]]


# One huge document (issue 39 item 10): the text is split one window at a time, and not past the cap.

def _sample_texts(sample_dir):
    return [t for f in sorted(sample_dir.glob("**/*.parquet")) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]


def test_windows_give_the_passages_of_the_whole_text(sample_dir):
    """The sample's documents of more than 2,000 characters (348 of 827), split in windows of 2,000 characters, and
    every sixth of them in windows of 300 (each sentence break then sits near a window's edge), give exactly the
    passages and counts of one call over the whole text (with the token limit: fit_spans sees the same candidates).
    Legal and newspaper pages here have breaks that depend on the text before them ("\\nMr. Justice")."""
    from pairmine.operators.chunk import TokenLimit

    texts = [t for t in _sample_texts(sample_dir) if len(t) > 2000]
    assert len(texts) == 348
    for t in texts:
        assert chunk_text(t, window=2000) == chunk_text(t), t[:80]
    limit = TokenLimit("", 256, "")
    for t in texts[::6]:
        assert chunk_text(t, token_limit=limit, window=300) == chunk_text(t, token_limit=limit), t[:80]


def test_a_huge_document_is_chunked_in_bounded_memory(sample_dir):
    """30.7 MB of real text (the sample's 3.06 MB ten times, one document, no max_chars cut): chunking stops at the
    257th passage, 159,965 characters in, and holds ~10 MB at its peak (tracemalloc: Python and numpy allocations),
    where splitting the whole text at once took ~39 bytes per character (116 MB for its first 3 MB, so ~1.2 GB). The
    passages are those of the text cut where chunking stopped."""
    import tracemalloc

    huge = "\n\n".join(_sample_texts(sample_dir) * 10)
    assert len(huge) == 30_660_968
    tracemalloc.start()
    try:
        c = chunk_text(huge, max_chars=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20  # about 1 byte per character of the text, for everything
    assert len(c.passages) == 256 and c.n_truncated == 1 and c.chars_cut == 0
    read = len(huge) - c.chars_truncated  # where the first passage past the cap starts
    assert read == 159_965
    cut = chunk_text(huge[:read], max_chars=0)  # one window: as before windows
    assert (cut.passages, cut.starts, cut.ends, cut.words) == (c.passages, c.starts, c.ends, c.words)
    assert cut.n_truncated == 0 and (cut.n_short, cut.n_duplicate) == (c.n_short, c.n_duplicate) == (0, 1)


def test_max_chars_cuts_at_a_word_and_is_counted():
    """10 MB of one phrase: every passage repeats the first, so the cap never stops chunking; max_chars does."""
    from pairmine.operators.chunk import Chunker

    phrase = "lorem ipsum dolor sit amet "  # 27 characters, 5 words
    text = phrase * 370_371  # 10,000,017 characters
    c = chunk_text(text, max_chars=1_000_000)
    # 37,037 phrases end at 999,999, where "lorem" starts: cut at the space before it (999,998), "lorem" left out.
    assert c.chars_cut == len(text) - 999_998 == 9_000_019
    # 185,185 words: 1,543 pieces of 120 words, all the same text (kept once), then 25 words.
    assert c.passages == [" ".join(text.split()[:120]), " ".join(text.split()[:25])]
    assert c.n_duplicate == 1542 and c.n_truncated == 0 and c.ends[-1] == 999_998
    assert chunk_text(text[:999_998], max_chars=0) == dataclasses_replace(c, chars_cut=0)
    assert chunk_text(text[:1_000_000], max_chars=1_000_000).chars_cut == 0  # not longer: not cut
    assert chunk_text("word " * 10, max_chars=0).chars_cut == 0
    # The operator reads only max_chars + 1 characters of a longer text into Python and counts the rest too.
    batch = pa.table({"id": ["long", "short"], "text": [text, TEXT], "skip_reason": pa.nulls(2, pa.string())})
    out = Chunker(max_chars=1_000_000)(batch)
    assert out.column("n_chars_cut").to_pylist() == [9_000_019, 0]
    assert out.column("passages").to_pylist() == [c.passages, [TEXT]]
    assert out.column("n_duplicate_passages").to_pylist() == [1542, 0]
    with pytest.raises(ValueError, match="max_chars"):
        chunk_text(TEXT, max_chars=-1)


def dataclasses_replace(c, **changes):
    import dataclasses

    return dataclasses.replace(c, **changes)
