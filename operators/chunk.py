"""Chunk stage: document text -> passages of whole sentences (SPEC "Chunk").

Sentences come from blingfire (a maintained, offline sentence splitter that also returns character offsets;
~0.05 s/MB of web text on our machines). Consecutive whole sentences are packed into passages of at most
``max_words`` words; a sentence longer than ``max_words`` is cut at word boundaries. Passages shorter than
``min_words`` are dropped and counted; passages equal to an earlier passage of the same document after whitespace and
case normalisation are dropped and counted (a page's repeated paragraph must not become its anchor's own positive,
issue 14 item 5); a document is capped at ``max_passages``: chunking stops at the first passage past the cap, and the
document and the characters left out are counted (``n_truncated``, ``chars_truncated``).

One huge document (issue 39 item 10). Splitting a whole text at once cost about 46 bytes of memory per character of
it (blingfire's buffers and offsets, then a tuple per word): 6.5 GiB over the input's 0.5 GiB for a 150 MB page, of
which 256 passages (~0.2 MB) were kept (benchmarks/bench_chunk_memory.py, docs/benchmarks.md "Memory"). The text is
therefore split one window of ``WINDOW_CHARS`` characters at a time (a text no longer than that, i.e. every page of
the sample, is one window, as before), and nothing past the first passage over the cap is split or tokenized; a text
longer than ``max_chars`` (``chunk.max_chars``, 4 million characters) is cut and counted (``chars_cut``), which also
bounds the time spent on a long page that never reaches the cap (one paragraph repeated). The passages are those of
the whole text: tests/test_chunk.py compares them on the sample's documents in windows of 300 and 2,000 characters,
and the 2,000 documents of ../shared/data/fineweb-long (legal and OCR'd newspaper pages among them), compared the
same way by hand, gave the same passages too (blingfire's breaks depend on the text on either side of them:
:func:`_pieces` gives it ``CONTEXT`` characters on each side).

Scripts written without spaces between words (issue 14 item 3). A "word" is a whitespace-separated token, which
makes a Chinese, Japanese or Thai page one enormous word. In such scripts every *character* counts as a fraction of
a word, chosen so that a passage is about as long in model tokens as a 120-word English passage:

=====================================  ============  ==============================  ===========================
script (Unicode blocks)                words / char  measured tokens per character   source
=====================================  ============  ==============================  ===========================
Han, Hiragana, Katakana (CJK)          0.8           1.080 zh, 1.025 ja (MiniLM)     default tokenizer
Hangul                                 1.4           1.814 (MiniLM: NFD -> jamo)      default tokenizer
Thai, Lao, Khmer, Myanmar              0.15          0.212 Thai (XLM-R)              multilingual tokenizer
=====================================  ============  ==============================  ===========================

Measured with the default tokenizer (all-MiniLM-L6-v2, ``operators.embed.default_model_path()``): English 1.298
tokens per word on the 82 pure-ASCII documents of the sample's first shard (18,240 words), Chinese 1.080 tokens per
Han character on ``../shared/cases/cjk-no-spaces.parquet`` (23,995 characters; punctuation included in the tokens),
Japanese 1.025 per Han/kana character and Korean 1.814 per Hangul syllable on a few hand-written paragraphs. The
factor is tokens-per-character / tokens-per-word: 0.79-0.83 for CJK (0.8: a passage holds <= 150 characters, ~160
tokens, against ~156 for 120 English words) and 1.40 for Hangul (<= 85 syllables). MiniLM turns a whole space-free
Thai run into one [UNK], so it cannot measure Thai; with XLM-R's tokenizer (blingfire's ``xlm_roberta_base``, the
tokenizer of multilingual E5) Thai has 0.212 tokens per character (combining marks included) against 1.423 per
English word: 0.15 (a passage holds <= 800 Thai characters). Lao, Khmer and Myanmar are unmeasured and take Thai's
factor (abugidas written the same way). With XLM-R, CJK would be 0.44 and Hangul 0.48 words per character: the
factors follow the default model; a multilingual model sees shorter CJK/Hangul passages than 120 English words.
Lengths are integers in 1/20 of a word (factors 16/20, 28/20, 3/20), so packing is exact; a Latin word, a number or
a code token inside a CJK run counts 1, punctuation attached to a CJK character counts 0, and a whitespace token
with no such character counts 1 exactly as before (English chunking is unchanged).

blingfire splits after 。！？ but not after the full-width full stop ．(U+FF0E) or the half-width ｡, and it starts
the next sentence with a closing quote (「你好。」 -> 「你好。 | 」): both are repaired, only next to these scripts. Thai
(and Lao, Khmer, Myanmar) mark a phrase or sentence end with a space, not a full stop: a space between two such
characters ends a sentence, and ។ (Khmer) and ။ (Myanmar) end one too. A run with no terminator is cut at the limit
like any long sentence, at a character boundary (combining marks stay with their base).

Passages within the model's token limit (issue 14 item 4). Words are only a proxy for the model's tokens: on the
sample, 57 of 5,144 passages of <= 120 words had more than 256 MiniLM tokens (Arabic, Greek and Cyrillic pages,
lists of numbers, HTML-escaped CJK up to 2,786 tokens) and the embedder saw only their first 256. With a
:class:`TokenLimit` (the embedding model's tokenizer, its ``max_length`` and passage prefix), a passage whose
prefixed text has more tokens than ``max_length`` (special tokens included, exactly as the embedder counts) is cut
again: into runs of whole sentences where a sentence fits, else of whole words, else of characters, each the longest
run that fits (a galloping search with the tokenizer). The pieces then go through the same short / duplicate / cap
rules as any passage; passages past ``max_passages`` are never embedded, so they are neither tokenized nor cut.
Passages within the limit, i.e. nearly all English text, are untouched. The cost is one more tokenization of every
passage (~2,000 passages/s on one loaded core, against ~120 passages/s for the model's forward pass).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import islice

import pyarrow as pa

_WORD = re.compile(r"\S+")
_SPACE = re.compile(r"\s")
_LAST_SPACE = re.compile(r"\s\S*\Z")

# Characters of one document's text that are chunked: a longer text is cut (chunk.max_chars; counted). The longest
# of the 2,000 documents of shared/data/fineweb-long has 47,628 characters.
MAX_CHARS = 4_000_000
# Characters split into sentences and words at a time (chunk_text's window): a few MB of per-word structures.
WINDOW_CHARS = 1 << 18
# Characters of text that blingfire sees on either side of a sentence break it is trusted with (_pieces).
CONTEXT = 1000

# Lengths are integers in 1/UNIT of a word.
UNIT = 20
_CJK = "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002fa1f"
_HANGUL = "\u1100-\u11ff\u3130-\u318f\ua960-\ua97f\uac00-\ud7af\ud7b0-\ud7ff"
_SEA = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u19e0-\u19ff"  # Thai, Lao, Myanmar, Khmer (+ Khmer symbols)
# (character class, units per character): see the module docstring for the measurement.
SPACELESS_SCRIPTS = ((_CJK, 16), (_HANGUL, 28), (_SEA, 3))
_SPACELESS = _CJK + _HANGUL + _SEA
_HAS_SPACELESS = re.compile(f"[{_SPACELESS}]")
_PIECE = re.compile(f"[{_SPACELESS}]|[^{_SPACELESS}]+")
_UNITS = [(re.compile(f"[{cls}]"), u) for cls, u in SPACELESS_SCRIPTS]
# Sentence repair next to these scripts (blingfire's misses).
_CLOSERS = "」』）】〕〉》〗〙〛｣”’\"')"
_CJK_END = re.compile(f"[。．｡！？]+[{_CLOSERS}]*|(?<=[{_SPACELESS}])[!?]+[{_CLOSERS}]*|[។៕။]+")
_SEA_SPACE = re.compile(f"(?<=[{_SEA}])\\s+(?=[{_SEA}])")
_LEADING_CLOSERS = re.compile(f"\\s*[{_CLOSERS}]+")

# Columns this stage adds to the document row.
PASSAGE_FIELDS = ("passages", "passage_start", "passage_end", "passage_words")


@dataclass
class Chunked:
    """Passages of one document.

    Attributes:
        passages: passage texts, in document order (text[start:end] of the document).
        starts / ends: character offsets into the document text (Python str indices), end exclusive.
        words: length of each passage in words: whitespace-separated words, where a character of a script written
            without spaces counts as a fraction of a word (module docstring), rounded to the nearest integer.
        n_short: passages dropped because they had fewer than ``min_words`` words.
        n_duplicate: passages dropped because an earlier passage of the document has the same text after whitespace
            and case normalisation (:func:`normalise_passage`).
        n_truncated: 1 when the document has a passage past ``max_passages`` (not kept; chunking stops at it, so
            the passages after it are not counted), else 0.
        n_token_split: passages of at most ``max_words`` words that had more model tokens than the token limit and
            were cut again (:func:`chunk_text`'s ``token_limit``); their pieces are counted like any passage.
        chars_truncated: characters from the start of the first passage past ``max_passages`` to the end of the
            chunked text (0 when none): the text the cap left out.
        chars_cut: characters left out by :func:`chunk_text`'s ``max_chars`` (0 when the text was not longer).
    """

    passages: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    words: list[int] = field(default_factory=list)
    n_short: int = 0
    n_duplicate: int = 0
    n_truncated: int = 0
    n_token_split: int = 0
    chars_truncated: int = 0
    chars_cut: int = 0


def normalise_passage(text: str) -> str:
    """The form two passages of one document are compared in: whitespace runs -> one space, casefolded.

    Example: ``normalise_passage("The  Cat\\n sat.") == normalise_passage("the cat sat.") == "the cat sat."``.
    """
    return " ".join(text.split()).casefold()


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans of ``text`` as (start, end) character offsets, end exclusive, in order.

    Uses blingfire's ``text_to_sentences_and_offsets``, whose offsets are Python string (code point) offsets, so
    ``text[start:end]`` is the sentence. In text holding a script written without spaces, blingfire's misses are
    repaired (module docstring): a sentence also ends after ．｡ (and after !? that follow such a character), a
    closing quote or bracket after the terminator stays with its sentence, and a space between two Thai, Lao, Khmer
    or Myanmar characters ends a sentence. Text without such characters gets blingfire's spans unchanged.
    """
    if not text or text.isspace():
        return []
    spans = _blingfire_sentences(text)
    if not _HAS_SPACELESS.search(text):
        return spans
    return _repair_sentences(text, spans)


def _blingfire_sentences(text: str) -> list[tuple[int, int]]:
    """blingfire's ``text_to_sentences_and_offsets(text)`` spans, from the same C call, with its UTF-8 byte offsets
    mapped to code-point offsets by array arithmetic. The wrapper maps them in a Python loop over every byte: over
    the sample's 827 documents, splitting took 0.63-0.68 s with it and 0.23-0.25 s this way, ``chunk_text`` (with
    the token limit) 3.2-3.6 s and 2.6-3.0 s. The spans are the same (tests/test_chunk.py compares them on the
    sample and on multi-byte text)."""
    import ctypes

    import blingfire
    import numpy as np

    data = text.encode("utf-8")
    capacity = 2 * len(data)  # the wrapper's buffer sizes
    out = ctypes.create_string_buffer(capacity)
    starts, ends = np.zeros(capacity, np.int32), np.zeros(capacity, np.int32)
    pointer = ctypes.POINTER(ctypes.c_int32)
    n_out = blingfire.blingfire.TextToSentencesWithOffsets(
        ctypes.c_char_p(data), ctypes.c_int(len(data)), ctypes.byref(out), starts.ctypes.data_as(pointer),
        ends.ctypes.data_as(pointer), ctypes.c_int(capacity))
    if n_out == -1 or n_out > capacity:
        return []
    count = out.value.count(b"\n") + 1  # sentences: the output is one per line
    # chars[b] = code points before byte b (a UTF-8 continuation byte is 10xxxxxx); an end offset is the sentence's
    # last byte, so the exclusive end is the code point that starts after it.
    chars = np.zeros(len(data) + 1, np.int64)
    np.cumsum((np.frombuffer(data, np.uint8) & 0xC0) != 0x80, out=chars[1:])
    return list(zip(chars[starts[:count]].tolist(), chars[ends[:count].astype(np.int64) + 1].tolist()))


def _ends_with_terminator(text: str, start: int, end: int) -> bool:
    last = text[end - 1]
    return last in "。．｡！？។៕။" or (last in "!?" and end - start > 1 and bool(_HAS_SPACELESS.match(text, end - 2)))


def _repair_sentences(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in spans:  # a closing quote that blingfire put at the start of the next sentence goes back
        if merged and _ends_with_terminator(text, *merged[-1]):
            m = _LEADING_CLOSERS.match(text, s, e)
            if m:
                merged[-1] = (merged[-1][0], m.end())
                s = m.end()
                while s < e and text[s].isspace():
                    s += 1
                if s >= e:
                    continue
        merged.append((s, e))
    out: list[tuple[int, int]] = []
    for s, e in merged:  # cut after the terminators blingfire missed, and at spaces inside Thai-family text
        cuts = sorted([(m.end(), m.end()) for m in _CJK_END.finditer(text, s, e)]
                      + [(m.start(), m.end()) for m in _SEA_SPACE.finditer(text, s, e)])
        pos = s
        for cut_end, next_start in cuts:
            if cut_end > pos:
                out.append((pos, cut_end))
            pos = max(pos, next_start)
        if pos < e:
            out.append((pos, e))
    # Whitespace at either end of a piece is not part of the sentence.
    spans_out = []
    for s, e in out:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if s < e:
            spans_out.append((s, e))
    return spans_out


def _char_units(ch: str) -> int:
    for pattern, units in _UNITS:
        if pattern.match(ch):
            return units
    return UNIT


def _atoms(text: str, start: int, end: int) -> list[tuple[int, int, int]]:
    """(start, end, units) of the smallest pieces a passage may be cut between, offsets into the whole text.

    A whitespace-separated word with no character of a spaceless script is one atom of one word (UNIT units). In a
    word that has such characters, each character is an atom (its script's units; a combining mark joins its base),
    each run of other letters or digits is an atom of one word, and punctuation joins the atom before it (or after
    it, at the start of the word) and counts nothing.
    """
    out: list[tuple[int, int, int]] = []
    for m in _WORD.finditer(text, start, end):
        if not _HAS_SPACELESS.search(m.group()):
            out.append((m.start(), m.end(), UNIT))
            continue
        first, lead = len(out), None
        for p in _PIECE.finditer(text, m.start(), m.end()):
            g = p.group()
            spaceless = len(g) == 1 and _HAS_SPACELESS.match(g) is not None
            if spaceless and unicodedata.category(g)[0] == "M" and len(out) > first:
                a = out[-1]
                out[-1] = (a[0], p.end(), a[2] + _char_units(g))
            elif spaceless or any(ch.isalnum() for ch in g):
                out.append((p.start() if lead is None else lead, p.end(), _char_units(g) if spaceless else UNIT))
                lead = None
            elif len(out) > first:  # punctuation after an atom
                out[-1] = (out[-1][0], p.end(), out[-1][2])
            else:  # punctuation at the start of the word: joins the next atom
                lead = p.start()
    return out


@lru_cache(maxsize=8)
def _tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class TokenLimit:
    """The embedding model's token limit for a passage, as the embedder applies it (``operators.embed.Embedder``).

    Attributes:
        model: the embedding model's folder or hub id ("" : the default model, ``operators.embed.default_model_path``).
        max_length: tokens the model sees per passage, special tokens and the prefix included (``embed.max_length``).
        prefix: the passage prefix put before every passage ("passage: " for E5, "" for all-MiniLM).
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.

    Picklable and hashable (Ray ships it to the chunk tasks); the tokenizer is loaded once per process.
    """

    model: str
    max_length: int = 256
    prefix: str = ""
    trust_remote_code: bool = False

    def lengths(self, passages: list[str]) -> list[int]:
        """Tokens of ``prefix + passage`` with special tokens, untruncated: (n,) ints, the count the embedder cuts
        to ``max_length``."""
        if not passages:
            return []
        from pairmine.operators.embed import default_model_path

        tok = _tokenizer(self.model or default_model_path(), self.trust_remote_code)
        ids = tok([self.prefix + p for p in passages], add_special_tokens=True, truncation=False,
                  verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def fits(self, passage: str) -> bool:
        """Whether the embedder sees all of ``passage`` (its prefixed tokens <= ``max_length``)."""
        return self.lengths([passage])[0] <= self.max_length


def _gallop(n: int, fits_upto) -> int:
    """The largest j in [0, n] with ``fits_upto(j)`` true, for a ``fits_upto`` that is true up to some j and false
    after (token counts grow with the text); ``fits_upto(0)`` is taken as true. Galloping (1, 2, 4, ... then
    bisection): O(log j) calls on texts at most about twice as long as the answer."""
    lo, step = 0, 1
    while lo + step <= n and fits_upto(lo + step):
        lo += step
        step *= 2
    hi = min(lo + step, n + 1)  # fits_upto(hi) is false (or hi is past n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_upto(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _fit_characters(text: str, start: int, end: int, limit: TokenLimit, max_parts: int | None,
                    out: list[tuple[int, int]]) -> None:
    """Append to ``out`` the longest runs of characters of text[start:end] that fit (one character when not even
    that fits); once ``out`` holds ``max_parts`` spans, the rest goes in as one span. Characters are never listed,
    so a multi-megabyte "word" costs O(parts x log) tokenizer calls, not memory per character."""
    pos = start
    while pos < end:
        if max_parts is not None and len(out) >= max_parts:
            out.append((pos, end))
            return
        n = max(1, _gallop(end - pos, lambda j: limit.fits(text[pos:pos + j])))
        out.append((pos, pos + n))
        pos += n


def fit_spans(text: str, levels: list[list[tuple[int, int]]], limit: TokenLimit, max_parts: int | None = None,
              out: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Cut ``text[levels[0][0][0]:levels[0][-1][1]]`` into consecutive spans that each fit ``limit``.

    Args:
        text: the document text (spans are offsets into it).
        levels: cut points from coarse to fine, each a list of consecutive (start, end) spans covering the same
            text: e.g. [sentences, words]. Characters are the last resort and need not be given.
        limit: the token limit.
        max_parts: once this many spans are out, the rest of the text goes in as one more span (unfitted): bounds
            the work on a pathological document (the chunker passes its passage cap).
        out: a list to append to (the spans so far); a new one when None.

    Returns:
        (start, end) spans in order, greedily the longest run of the coarsest units that fits; a unit that does not
        fit alone is cut with the next level (characters last). A single character that does not fit is kept alone.
    """
    out = [] if out is None else out
    spans, rest = levels[0], levels[1:]
    i = 0
    while i < len(spans):
        if max_parts is not None and len(out) >= max_parts:
            out.append((spans[i][0], spans[-1][1]))
            return out
        base = spans[i][0]
        j = i + _gallop(len(spans) - i, lambda m: limit.fits(text[base:spans[i + m - 1][1]]))
        if j > i:
            out.append((base, spans[j - 1][1]))
            i = j
            continue
        s, e = spans[i]
        finer = [(a, b) for a, b in rest[0] if a >= s and b <= e] if rest else []
        if finer:
            fit_spans(text, [finer, *[[x for x in lv if x[0] >= s and x[1] <= e] for lv in rest[1:]]], limit,
                      max_parts, out)
        else:
            _fit_characters(text, s, e, limit, max_parts, out)
        i += 1
    return out


def _cut_point(text: str, max_chars: int) -> int:
    """Where ``max_chars`` cuts ``text``: ``len(text)`` when it is not longer (or ``max_chars`` is 0), else
    ``max_chars`` moved back to the last whitespace of the 1,000 characters before it, so the word it would split is
    left out whole (exactly ``max_chars`` when those characters hold no whitespace)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return len(text)
    if text[max_chars].isspace() or text[max_chars - 1].isspace():
        return max_chars
    tail = text[max(0, max_chars - 1000):max_chars]
    m = _LAST_SPACE.search(tail)
    return max_chars - (len(tail) - m.start()) if m else max_chars


def _sentence_pieces(text: str, start: int, end: int, limit: int):
    """The pieces of the sentence text[start:end]: its atoms (:func:`_atoms`) in greedy runs of at most ``limit``
    units (one atom longer than the limit is a piece alone), as (atoms, units)."""
    cur: list[tuple[int, int, int]] = []
    units = 0
    for atom in _atoms(text, start, end):
        if cur and units + atom[2] > limit:
            yield cur, units
            cur, units = [], 0
        cur.append(atom)
        units += atom[2]
    if cur:
        yield cur, units


def _pieces(text: str, stop: int, limit: int, window: int):
    """The pieces of text[:stop] in order (:func:`_sentence_pieces` of every sentence), found one window of about
    ``window`` characters at a time, so the per-word structures of a huge text are never all in memory.

    blingfire's breaks depend on the text on both sides ("\\nMr. Justice" is two sentences, "Mr. Justice" at the
    start of a text one; "not\\nD. A." ends a sentence when the text stops there), so a window is split with the
    ``CONTEXT`` characters before it, and a break is used only with ``CONTEXT`` characters of the window after it.
    The next window starts at the first sentence not used. A window that gives no such break (a sentence of about
    ``window`` characters or more) gives its first sentence's pieces that end ``CONTEXT`` characters before the
    window's end, but the last, and the next window starts at the next piece, inside the sentence; a window that
    gives neither is doubled (words of many characters). A window ends at a whitespace (when one is within 1,000
    characters of its size). A text of at most ``window`` characters is one window: exactly the pieces of
    :func:`split_sentences` over the whole text, as before windows.
    """
    pos, size = 0, window
    while pos < stop:
        if stop - pos <= size:
            end = stop
        else:  # end the window at a whitespace, so that no word is cut
            m = _SPACE.search(text, pos + size, min(stop, pos + size + 1000))
            end = m.start() if m else pos + size
        ctx = max(0, pos - CONTEXT)  # a sentence across pos starts at pos (pos is a sentence's or a piece's start)
        spans = [(max(ctx + s, pos), ctx + e) for s, e in split_sentences(text[ctx:end]) if ctx + e > pos]
        if end >= stop:
            for s, e in spans:
                yield from _sentence_pieces(text, s, e, limit)
            return
        trusted = end - CONTEXT
        n = 0
        while n + 1 < len(spans) and spans[n + 1][0] <= trusted:
            n += 1
        if n:
            for s, e in spans[:n]:
                yield from _sentence_pieces(text, s, e, limit)
            pos, size = spans[n][0], window
            continue
        if not spans:  # whitespace only
            pos, size = end, window
            continue
        first = list(_sentence_pieces(text, *spans[0], limit))
        k = 0  # pieces of the first sentence to give: not the last (it may go on past the window), none untrusted
        while k + 1 < len(first) and first[k][0][-1][1] <= trusted:
            k += 1
        if k:
            yield from first[:k]
            pos, size = first[k][0][0][0], window
        else:
            size *= 2


def _candidates(pieces, limit: int):
    """Candidate passages: greedy runs of whole pieces of at most ``limit`` units, each a list of pieces' atoms."""
    current: list[list[tuple[int, int, int]]] = []
    current_units = 0
    for piece, units in pieces:
        if current and current_units + units > limit:
            yield current
            current, current_units = [], 0
        current.append(piece)
        current_units += units
    if current:
        yield current


def chunk_text(text: str, max_words: int = 120, min_words: int = 5, max_passages: int = 256,
               token_limit: TokenLimit | None = None, max_chars: int = MAX_CHARS,
               window: int = WINDOW_CHARS) -> Chunked:
    """Pack the sentences of ``text`` into passages (SPEC "Chunk"; max_words 120 is Revela's setting, seed 001).

    Every stage that needs a document's passages (mining, the consistency pool, the TF-IDF sample, calibrate, the
    report, random positives) calls this function, so they all see the same passages.

    The text is read from its start, one window of about ``window`` characters at a time (:func:`_pieces`), and
    chunking stops at the first passage past ``max_passages``: the text after it is neither split nor tokenized,
    so the memory of one call is bounded by the window and the kept passages, not by the text (issue 39 item 10;
    a run of ``window`` characters without whitespace is read whole, bounded by ``max_chars``).

    Args:
        text: the document text.
        max_words: a passage holds at most this many words (whitespace-separated words; a character of a script
            written without spaces counts 0.8 (CJK), 1.4 (Hangul) or 0.15 (Thai, Lao, Khmer, Myanmar) of a word,
            module docstring).
        min_words: passages with fewer words are dropped and counted in ``n_short``.
        max_passages: passages kept per document (after dropping short and duplicate passages). The first passage
            past them is counted in ``n_truncated`` (so 0 or 1) and the characters from its start to the end of the
            (cut) text in ``chars_truncated``; short and duplicate passages before it are counted as usual.
        token_limit: when given, a passage whose prefixed text has more than ``token_limit.max_length`` model
            tokens is cut again at sentence, then word, then character boundaries (:func:`fit_spans`; counted in
            ``n_token_split``). None: word lengths only.
        max_chars: a text longer than this many characters is chunked as its first ``max_chars`` characters (cut at
            the last whitespace before, when one is within 1,000 characters; ``chunk.max_chars``); the characters
            left out are counted in ``chars_cut``. 0: no cut.
        window: characters per window (a text of at most this many is split in one call, as a whole).

    Returns:
        A :class:`Chunked` whose passages are exact slices of ``text`` (from the first word of the first sentence
        to the last word of the last sentence), so offsets can be used to find them in the document. No two kept
        passages are equal after :func:`normalise_passage` (later copies are counted in ``n_duplicate``).

    Raises:
        ValueError: when max_words < 1, min_words < 1, max_passages < 1, max_chars < 0 or window < 1.
    """
    if max_words < 1 or min_words < 1 or max_passages < 1:
        raise ValueError(f"max_words, min_words and max_passages must be >= 1, got {max_words}, {min_words}, {max_passages}")
    if max_chars < 0 or window < 1:
        raise ValueError(f"max_chars must be >= 0 (0: no cut) and window >= 1, got {max_chars}, {window}")
    out = Chunked()
    limit, least = max_words * UNIT, min_words * UNIT
    stop = _cut_point(text, max_chars)
    out.chars_cut = len(text) - stop
    seen: set[str] = set()

    def keep(start: int, end: int, units: int) -> bool:
        """Keep or count one passage; False at the first passage past the cap (chunking stops there)."""
        if units < least:
            out.n_short += 1
            return True
        key = normalise_passage(text[start:end])
        if key in seen:
            out.n_duplicate += 1
        elif len(out.passages) >= max_passages:
            out.n_truncated += 1
            out.chars_truncated = stop - start
            return False
        else:
            seen.add(key)
            out.passages.append(text[start:end])
            out.starts.append(start)
            out.ends.append(end)
            out.words.append((units + UNIT // 2) // UNIT)
        return True

    candidates = _candidates(_pieces(text, stop, limit, window), limit)
    while True:
        # Token counts for the next candidates, one tokenizer call: at most as many as could still be kept, so no
        # text past the cap is tokenized. Past the cap, candidates are never embedded: neither tokenized nor cut.
        batch = list(islice(candidates, max(1, min(64, max_passages - len(out.passages)))))
        if not batch:
            return out
        over = ([n > token_limit.max_length for n in
                 token_limit.lengths([text[c[0][0][0]:c[-1][-1][1]] for c in batch])]
                if token_limit is not None and len(out.passages) < max_passages else [False] * len(batch))
        for candidate, too_long in zip(batch, over):
            if not too_long or len(out.passages) >= max_passages:
                if not keep(candidate[0][0][0], candidate[-1][-1][1], sum(a[2] for p in candidate for a in p)):
                    return out
                continue
            sentences = [(p[0][0], p[-1][1]) for p in candidate]
            words = [(a[0], a[1]) for p in candidate for a in p]
            parts = fit_spans(text, [sentences, words], token_limit, max_parts=max_passages)
            out.n_token_split += 1
            for s, e in parts:
                if not keep(s, e, sum(a[2] for a in _atoms(text, s, e))):
                    return out


class Chunker:
    """Chunk operator over a batch of document rows (pyarrow Table in, pyarrow Table out).

    Input columns: ``text`` and ``skip_reason`` (rows with a skip reason pass through with empty passage lists).
    Output: the input without ``text``, plus list columns ``passages`` (string), ``passage_start``,
    ``passage_end``, ``passage_words`` (int32), int32 counters ``n_short_passages``, ``n_duplicate_passages``,
    ``n_truncated_passages``, ``n_token_split_passages`` and int64 character counts ``n_chars_truncated``,
    ``n_chars_cut`` (:class:`Chunked`). Arguments as :func:`chunk_text`.
    """

    COUNTERS = ("n_short_passages", "n_duplicate_passages", "n_truncated_passages", "n_token_split_passages")
    CHAR_COUNTERS = ("n_chars_truncated", "n_chars_cut")

    def __init__(self, max_words: int = 120, min_words: int = 5, max_passages: int = 256,
                 token_limit: TokenLimit | None = None, max_chars: int = MAX_CHARS):
        self.max_words, self.min_words, self.max_passages = max_words, min_words, max_passages
        self.token_limit, self.max_chars = token_limit, max_chars

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        texts = batch.column("text")
        lengths = pc.utf8_length(texts).to_pylist()  # characters (code points), as len() of the Python str
        if self.max_chars and max((n or 0 for n in lengths), default=0) > self.max_chars:
            # Only the first max_chars + 1 characters of a longer text become a Python str (chunk_text cuts it):
            # a 150 MB text would be 600 MB in Python with one emoji in it.
            texts = pc.utf8_slice_codeunits(texts, 0, self.max_chars + 1)
        skips = batch.column("skip_reason").to_pylist()
        cols: dict[str, list] = {k: [] for k in (*PASSAGE_FIELDS, *self.COUNTERS, *self.CHAR_COUNTERS)}
        for i, skip in enumerate(skips):  # one text at a time: a batch's texts are not all copied into Python
            if skip is not None:
                c = Chunked()
            else:
                text = texts[i].as_py()
                c = chunk_text(text, self.max_words, self.min_words, self.max_passages, self.token_limit,
                               self.max_chars)
                c.chars_cut += lengths[i] - len(text)  # the characters past max_chars + 1, never read
            cols["passages"].append(c.passages)
            cols["passage_start"].append(c.starts)
            cols["passage_end"].append(c.ends)
            cols["passage_words"].append(c.words)
            cols["n_short_passages"].append(c.n_short)
            cols["n_duplicate_passages"].append(c.n_duplicate)
            cols["n_truncated_passages"].append(c.n_truncated)
            cols["n_token_split_passages"].append(c.n_token_split)
            cols["n_chars_truncated"].append(c.chars_truncated)
            cols["n_chars_cut"].append(c.chars_cut)
        out = batch.drop_columns(["text"])
        out = out.append_column("passages", pa.array(cols["passages"], pa.list_(pa.string())))
        for name in ("passage_start", "passage_end", "passage_words"):
            out = out.append_column(name, pa.array(cols[name], pa.list_(pa.int32())))
        for name in self.COUNTERS:
            out = out.append_column(name, pa.array(cols[name], pa.int32()))
        for name in self.CHAR_COUNTERS:
            out = out.append_column(name, pa.array(cols[name], pa.int64()))
        return out
