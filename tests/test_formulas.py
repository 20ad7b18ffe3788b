"""Each formula with a value a person can check by hand (SPEC "Centrality and anchors", "Related passages")."""

import math

import numpy as np
import pytest

from pairmine.operators.centrality import anchor_indices, centrality
from pairmine.operators.related import (
    NO_ANCHOR, NO_PASSAGES, TOO_FEW_PASSAGES, CorpusTfidf, descending_ranks, fit_tfidf, mine_groups, related_for_anchor,
    rrf_score, unfitted_tfidf,
)


def test_rrf_hand_check_from_seed_000():
    a = rrf_score(1, 6)  # 1st dense, 6th lexical
    b = rrf_score(2, 2)  # 2nd on both
    assert a == pytest.approx(2 / 11 + 1 / 16) and round(float(a), 4) == 0.2443
    assert b == pytest.approx(3 / 12) and round(float(b), 4) == 0.2500
    assert b > a


def test_rrf_weights_and_k():
    assert rrf_score(1, 1, k=0, w_dense=1, w_lexical=1) == pytest.approx(2.0)
    assert rrf_score(3, 7, k=10, w_dense=0, w_lexical=1) == pytest.approx(1 / 17)


def test_descending_ranks_ties_go_to_lower_index():
    assert descending_ranks(np.array([0.2, 0.9, 0.2, 0.5])).tolist() == [3, 1, 4, 2]


def test_scores_within_float_noise_are_ties():
    # 4e-7 apart: the size of the batching noise that once swapped two ranks between two runs of the same input.
    noisy = np.array([0.6, 0.7000004, 0.7, 0.3])
    assert descending_ranks(noisy).tolist() == [3, 1, 2, 4]
    assert descending_ranks(noisy[[0, 2, 1, 3]]).tolist() == [3, 1, 2, 4]  # the lower index wins either way
    assert descending_ranks(noisy[[0, 2, 1, 3]], resolution=0).tolist() == [3, 2, 1, 4]  # exact: noise decides
    assert descending_ranks(np.array([0.70002, 0.7])).tolist() == [1, 2]  # 2e-5 apart: a real difference


def test_related_for_anchor_prefers_candidate_ranked_2_2_over_1_6():
    # Passage 0 is the anchor. Ranks among the candidates p1..p6:
    #   dense:   p1 1st, p2 2nd, p3 3rd, p4 4th, p5 5th, p6 6th
    #   lexical: p3 1st, p2 2nd, p4 3rd, p5 4th, p6 5th, p1 6th   (p1 is the seed's (1, 6) case, p2 its (2, 2))
    dense = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    lexical = np.array([1.0, 0.1, 0.8, 0.9, 0.5, 0.4, 0.3])  # ranks: p3 1st, p2 2nd, p4 3rd, p5 4th, p6 5th, p1 6th
    g = related_for_anchor(0, dense, lexical, n_related=4)
    # p2: 2/12 + 1/12 = 0.25; p1: 2/11 + 1/16 = 0.2443; p3: 2/13 + 1/11 = 0.2448; p4: 2/14 + 1/13 = 0.2198
    assert g.related_indices == [2, 3, 1, 4]
    assert g.rrf == pytest.approx([0.25, 2 / 13 + 1 / 11, 2 / 11 + 1 / 16, 2 / 14 + 1 / 13], abs=1e-6)
    assert 0 not in g.related_indices
    assert all(x >= y for x, y in zip(g.rrf, g.rrf[1:]))
    assert g.dense == pytest.approx([0.8, 0.7, 0.9, 0.6], abs=1e-6)
    assert g.tfidf == pytest.approx([0.8, 0.9, 0.1, 0.5], abs=1e-6)


def test_related_for_anchor_tie_goes_to_lower_index():
    # All candidates score the same: the lowest indices win, in order.
    g = related_for_anchor(2, np.full(6, 0.5), np.full(6, 0.5), n_related=4)
    assert g.related_indices == [0, 1, 3, 4]


def test_related_for_anchor_needs_enough_passages():
    with pytest.raises(ValueError, match="needs 5 passages"):
        related_for_anchor(0, np.ones(4), np.ones(4), n_related=4)


def test_centrality_of_known_vectors():
    # e1 = x, e2 = y, e3 = x: mean m = (2/3, 1/3), |m| = sqrt(5)/3
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    c = centrality(v)
    assert c == pytest.approx([2 / math.sqrt(5), 1 / math.sqrt(5), 2 / math.sqrt(5)], abs=1e-6)  # 0.8944, 0.4472
    assert anchor_indices(c, 0.825).tolist() == [0, 2]
    assert anchor_indices(c, 0.8944).tolist() == [0, 2]  # >= threshold is an anchor
    assert anchor_indices(c, 0.9).tolist() == []


def test_centrality_identical_and_cancelling_vectors():
    assert centrality(np.ones((3, 4)) / 2.0) == pytest.approx([1.0, 1.0, 1.0])
    assert centrality(np.array([[1.0, 0.0], [-1.0, 0.0]])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="2-D"):
        centrality(np.ones(3))


def test_mine_groups_reasons_and_groups():
    rng = np.random.default_rng(0)
    assert mine_groups(np.zeros((0, 4)), None, np.zeros(0), 0.5) == ([], NO_PASSAGES)
    v = rng.normal(size=(4, 8))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    assert mine_groups(v, np.eye(4), centrality(v), -1.0)[1] == TOO_FEW_PASSAGES
    v = rng.normal(size=(6, 8))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    c = centrality(v)
    assert mine_groups(v, np.eye(6), c, 1.01) == ([], NO_ANCHOR)
    groups, reason = mine_groups(v, np.eye(6), c, float(np.sort(c)[-2]))
    assert reason is None and [g.anchor_index for g in groups] == sorted(np.argsort(c)[-2:].tolist())
    for g in groups:
        assert len(g.related_indices) == 4 and g.anchor_index not in g.related_indices
        assert g.dense == pytest.approx((v[g.related_indices] @ v[g.anchor_index]).tolist(), abs=1e-5)


# ---- TF-IDF: IDF from the corpus sample, words the sample never saw weigh most (issue 14 item 11) -------------

def _cos(rows, i, j) -> float:
    return float((rows[i] @ rows[j].T).toarray()[0, 0])  # rows are L2-normalised: the cosine is a dot product


def test_unseen_word_gets_the_idf_of_document_frequency_0_hand_check():
    # Sample of n = 3 passages; "the" and "sat" are in all 3: idf = ln((1 + 3) / (1 + 3)) + 1 = 1.
    # "zorblax" is in none: idf = ln((1 + 3) / (1 + 0)) + 1 = ln 4 + 1 = 2.386294 (= L).
    # "zorblax the" -> (L, 1), "zorblax sat" -> (L, 1) on different common words, each row norm sqrt(L^2 + 1):
    #   cos = L^2 / (L^2 + 1) = 5.694401 / 6.694401 = 0.850621. Dropping "zorblax" (sklearn alone) gives 0.
    tfidf = fit_tfidf(["the cat sat", "the dog sat", "the bird sat"])
    assert tfidf.n_samples == 3 and tfidf.unseen_idf == pytest.approx(math.log(4) + 1) == pytest.approx(2.386294)
    assert tfidf.idf[tfidf.vocabulary["the"]] == pytest.approx(1.0)
    assert tfidf.idf[tfidf.vocabulary["cat"]] == pytest.approx(math.log(4 / 2) + 1)  # df 1: 1.693147
    doc = ["zorblax the", "zorblax sat"]
    rows = tfidf.transform_document(doc)
    assert rows.shape == (2, len(tfidf.vocabulary) + 1)  # one extra column: the document's one unseen word
    assert _cos(rows, 0, 1) == pytest.approx(0.850621, abs=1e-6)
    old = tfidf.vectorizer.transform(doc)  # what the lexical ranking used before: the unseen word dropped
    assert _cos(old, 0, 1) == 0.0
    # No sample at all (every word unseen, n = 0): idf = ln 1 + 1 = 1, a plain term-frequency cosine: 1/sqrt(2).
    assert _cos(unfitted_tfidf().transform_document(["cat sat", "cat"]), 0, 1) == pytest.approx(1 / math.sqrt(2))


def test_shared_rare_name_outranks_shared_common_words():
    # Sample: 20 passages that all hold the, history, of, town, and, river, in (idf 1) and one word of their own.
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
            "seventeen eighteen nineteen twenty".split()
    tfidf = fit_tfidf([f"the history of the town and the river in {w}" for w in words])
    L = math.log(21) + 1  # "quillfeather", never sampled: ln 21 + 1 = 4.044522, L^2 = 16.358162
    doc = [
        "the history of Quillfeather",  # p0, the anchor
        "Quillfeather river",  # p1: shares only the rare name
        "the history of the town",  # p2: shares only common words (the, history, of)
        "winter in the town",
        "and the river",
    ]
    rows = tfidf.transform_document(doc)
    # Anchor row (the, history, of, quillfeather) = (1, 1, 1, L), norm sqrt(L^2 + 3) = 4.399791.
    # p1 (quillfeather, river) = (L, 1): cos = L^2 / (4.399791 * sqrt(L^2 + 1)) = 16.358162 / (4.399791 * 4.166313)
    #     = 0.8924
    # p2: "the" twice, tf 1 + ln 2 = 1.693147; (the, history, of, town) = (1.693147, 1, 1, 1), norm 2.422137:
    #     cos = (1.693147 + 1 + 1) / (4.399791 * 2.422137) = 3.693147 / 10.656896 = 0.3465
    assert _cos(rows, 0, 1) == pytest.approx(L**2 / (math.sqrt(L**2 + 3) * math.sqrt(L**2 + 1)), abs=1e-5)
    assert _cos(rows, 0, 1) == pytest.approx(0.8924, abs=1e-4)
    assert _cos(rows, 0, 2) == pytest.approx(0.3465, abs=1e-4)
    # Before (sklearn alone): the name weighs nothing; p1 scores 0, p2 3.693147 / (sqrt 3 * 2.422137) = 0.8803.
    old = tfidf.vectorizer.transform(doc)
    assert _cos(old, 0, 1) == 0.0 and _cos(old, 0, 2) == pytest.approx(0.8803, abs=1e-4)
    # With equal dense scores the lexical rank decides: the rare-name passage is s1, the positive.
    lexical = (rows[0] @ rows.T).toarray()[0]  # (5,)
    assert related_for_anchor(0, np.full(5, 0.5), lexical).related_indices[0] == 1
    old_lexical = (old[0] @ old.T).toarray()[0]
    assert related_for_anchor(0, np.full(5, 0.5), old_lexical).related_indices[0] == 2


def test_in_vocabulary_words_get_exactly_sklearns_rows():
    sample = ["The river runs past the old mill.", "A mill ground corn for the town.", "The town grew along the river.",
              "Corn and wheat were sold at the market.", "The market closed in winter, the mill in summer."]
    for sublinear in (True, False):
        tfidf = fit_tfidf(sample, sublinear_tf=sublinear)
        known = ["the mill and the river", "corn corn corn market", "winter!", ""]
        rows = tfidf.transform_document(known)
        assert rows.shape == (4, len(tfidf.vocabulary)) and rows.dtype == np.float32
        assert np.array_equal(rows.toarray(), tfidf.vectorizer.transform(known).toarray())  # bit for bit
        # A passage with unseen words: its vocabulary columns are sklearn's row, scaled by the new norm.
        mixed = tfidf.transform_document(["the mill, Ostrava and the river", "Ostrava"]).toarray()
        v = len(tfidf.vocabulary)
        assert mixed.shape == (2, v + 1)
        ref = tfidf.vectorizer.transform(["the mill, Ostrava and the river"]).toarray()[0]
        assert mixed[0, :v] / np.linalg.norm(mixed[0, :v]) == pytest.approx(ref, abs=1e-6)
        # "ostrava" and "mill" both occur once: their weights stand as their IDFs (unseen: ln(1 + 5) + 1 = 2.7918).
        mill = tfidf.vocabulary["mill"]
        assert mixed[0, v] / mixed[0, mill] == pytest.approx((math.log(6) + 1) / tfidf.idf[mill], rel=1e-5)
        assert mixed[1].tolist() == [0.0] * v + [1.0]
    with pytest.raises(ValueError, match="smooth_idf=True"):
        from sklearn.feature_extraction.text import TfidfVectorizer
        CorpusTfidf(TfidfVectorizer(smooth_idf=False).fit(sample), len(sample))
