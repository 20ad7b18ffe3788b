"""Chunk stage: document text -> passages of whole sentences (SPEC "Chunk").

Sentences come from blingfire (a maintained, offline sentence splitter that also returns character offsets;
~0.05 s/MB of web text on our machines). Consecutive whole sentences are packed into passages of at most
``max_words`` words; a sentence longer than ``max_words`` is split at word boundaries. Passages shorter than
``min_words`` are dropped and counted; a document is capped at ``max_passages`` and the rest counted as truncated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pyarrow as pa

_WORD = re.compile(r"\S+")

# Columns this stage adds to the document row.
PASSAGE_FIELDS = ("passages", "passage_start", "passage_end", "passage_words")


@dataclass
class Chunked:
    """Passages of one document.

    Attributes:
        passages: passage texts, in document order (text[start:end] of the document).
        starts / ends: character offsets into the document text (Python str indices), end exclusive.
        words: whitespace-separated word count of each passage.
        n_short: passages dropped because they had fewer than ``min_words`` words.
        n_truncated: passages past ``max_passages`` that were not kept.
    """

    passages: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    words: list[int] = field(default_factory=list)
    n_short: int = 0
    n_truncated: int = 0


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans of ``text`` as (start, end) character offsets, end exclusive, in order.

    Uses blingfire's ``text_to_sentences_and_offsets``, whose offsets are Python string (code point) offsets, so
    ``text[start:end]`` is the sentence.
    """
    import blingfire

    if not text or text.isspace():
        return []
    _, spans = blingfire.text_to_sentences_and_offsets(text)
    return [(int(s), int(e)) for s, e in spans]


def _word_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in _WORD.finditer(text, start, end)]  # offsets into the whole text


def chunk_text(text: str, max_words: int = 120, min_words: int = 5, max_passages: int = 256) -> Chunked:
    """Pack the sentences of ``text`` into passages (SPEC "Chunk"; max_words 120 is Revela's setting, seed 001).

    Args:
        text: the document text.
        max_words: a passage holds at most this many words (whitespace-separated tokens).
        min_words: passages with fewer words are dropped and counted in ``n_short``.
        max_passages: passages kept per document; the rest are counted in ``n_truncated``.

    Returns:
        A :class:`Chunked` whose passages are exact slices of ``text`` (from the first word of the first sentence
        to the last word of the last sentence), so offsets can be used to find them in the document.

    Raises:
        ValueError: when max_words < 1, min_words < 1 or max_passages < 1.
    """
    if max_words < 1 or min_words < 1 or max_passages < 1:
        raise ValueError(f"max_words, min_words and max_passages must be >= 1, got {max_words}, {min_words}, {max_passages}")
    out = Chunked()
    # Word spans grouped by sentence; a sentence longer than max_words becomes several pieces.
    pieces: list[list[tuple[int, int]]] = []
    for s_start, s_end in split_sentences(text):
        words = _word_spans(text, s_start, s_end)
        for i in range(0, len(words), max_words):
            if words[i : i + max_words]:
                pieces.append(words[i : i + max_words])

    current: list[tuple[int, int]] = []

    def flush() -> None:
        if not current:
            return
        if len(current) < min_words:
            out.n_short += 1
        elif len(out.passages) >= max_passages:
            out.n_truncated += 1
        else:
            start, end = current[0][0], current[-1][1]
            out.passages.append(text[start:end])
            out.starts.append(start)
            out.ends.append(end)
            out.words.append(len(current))

    for piece in pieces:
        if current and len(current) + len(piece) > max_words:
            flush()
            current = []
        current = current + piece
    flush()
    return out


class Chunker:
    """Chunk operator over a batch of document rows (pyarrow Table in, pyarrow Table out).

    Input columns: ``text`` and ``skip_reason`` (rows with a skip reason pass through with empty passage lists).
    Output: the input without ``text``, plus list columns ``passages`` (string), ``passage_start``,
    ``passage_end``, ``passage_words`` (int32) and int32 counters ``n_short_passages``, ``n_truncated_passages``.
    """

    def __init__(self, max_words: int = 120, min_words: int = 5, max_passages: int = 256):
        self.max_words, self.min_words, self.max_passages = max_words, min_words, max_passages

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column("text").to_pylist()
        skips = batch.column("skip_reason").to_pylist()
        cols: dict[str, list] = {k: [] for k in (*PASSAGE_FIELDS, "n_short_passages", "n_truncated_passages")}
        for text, skip in zip(texts, skips):
            c = Chunked() if skip is not None else chunk_text(text, self.max_words, self.min_words, self.max_passages)
            cols["passages"].append(c.passages)
            cols["passage_start"].append(c.starts)
            cols["passage_end"].append(c.ends)
            cols["passage_words"].append(c.words)
            cols["n_short_passages"].append(c.n_short)
            cols["n_truncated_passages"].append(c.n_truncated)
        out = batch.drop_columns(["text"])
        out = out.append_column("passages", pa.array(cols["passages"], pa.list_(pa.string())))
        for name in ("passage_start", "passage_end", "passage_words"):
            out = out.append_column(name, pa.array(cols[name], pa.list_(pa.int32())))
        for name in ("n_short_passages", "n_truncated_passages"):
            out = out.append_column(name, pa.array(cols[name], pa.int32()))
        return out
