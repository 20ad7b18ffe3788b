"""The consistency filter with hand-built vectors (SPEC "Consistency filter"; seed 004 chapter 1)."""

import numpy as np
import pyarrow as pa
import pytest

from pairmine.operators.consistency import ConsistencyFilter, consistency_counts, doc_hash
from pairmine.operators.embed import vectors_array
from pairmine.operators.related import GROUP_TYPE
from pairmine.pipeline.inputs import PoolSpec, discover_shards, pool_sample, scan_shard


def unit(*rows):
    v = np.array(rows, dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# Anchor a = x; positive s1 at cosine 0.8. Pool (doc, cosine to a):
POOL = unit(
    [0.8, 0.6, 0.0],  # doc 2: exactly s1's direction, cosine == s: a tie, not above
    [0.9, np.sqrt(1 - 0.81), 0.0],  # doc 2: 0.9 > 0.8, above
    [1.0, 0.0, 0.0],  # doc 1 (the group's own document): 1.0 > 0.8 but never counted
    [0.0, 1.0, 0.0],  # doc 3: 0.0, below
    [0.85, 0.0, np.sqrt(1 - 0.85**2)],  # doc 3: 0.85 > 0.8, above
)
POOL_DOCS = np.array([2, 2, 1, 3, 3], dtype=np.int64)


def test_counts_by_hand():
    s, n = consistency_counts(unit([1, 0, 0]), unit([0.8, 0.6, 0]), POOL, np.array([1]), POOL_DOCS)
    assert s == pytest.approx([0.8], abs=1e-6)
    assert n.tolist() == [2]  # the tie and the same-document passage do not count
    # The same group seen from document 2: now the 1.0 passage counts and the two doc-2 passages do not.
    _, n = consistency_counts(unit([1, 0, 0]), unit([0.8, 0.6, 0]), POOL, np.array([2]), POOL_DOCS)
    assert n.tolist() == [2]  # 1.0 (doc 1) and 0.85 (doc 3)


def test_chunking_does_not_change_counts():
    rng = np.random.default_rng(0)
    a, s1 = unit(*rng.normal(size=(40, 64))), unit(*rng.normal(size=(40, 64)))
    pool = unit(*rng.normal(size=(3000, 64)))
    docs, pool_docs = np.arange(40), rng.integers(0, 60, size=3000)
    one = consistency_counts(a, s1, pool, docs, pool_docs, chunk_mb=1000)
    many = consistency_counts(a, s1, pool, docs, pool_docs, chunk_mb=0.05)  # chunks of a few hundred rows
    assert np.array_equal(one[1], many[1]) and np.allclose(one[0], many[0], atol=1e-6)
    # Reference in float64 with an explicit loop.
    ref = [sum(1 for p, d in zip(pool, pool_docs) if d != docs[i] and float(a[i] @ p) > float(a[i] @ s1[i]) + 1e-6)
           for i in range(40)]
    assert np.abs(one[1] - np.array(ref)).max() <= 1  # within float rounding of near-ties


def test_copies_of_the_positive_in_the_pool_never_count():
    rng = np.random.default_rng(1)
    a, s1 = unit(*rng.normal(size=(64, 384))), unit(*rng.normal(size=(64, 384)))
    pool = np.concatenate([s1, s1, unit(*rng.normal(size=(500, 384)))])  # exact copies from other documents
    pool_docs = np.full(len(pool), -1, dtype=np.int64)
    _, n = consistency_counts(a, s1, pool, np.arange(64), pool_docs, chunk_mb=0.1)
    _, n_without = consistency_counts(a, s1, pool[128:], np.arange(64), pool_docs[128:], chunk_mb=0.1)
    # Other groups' positives may beat a group's own s1 (twice: two copies each); its own copies never do.
    cross = a.astype(np.float64) @ s1.T.astype(np.float64)  # (64, 64)
    others_above = (cross > np.diag(cross)[:, None]).sum(axis=1)
    assert np.array_equal(n, n_without + 2 * others_above)  # ties at exactly s are never "above"


def test_empty_pool_keeps_everything():
    s, n = consistency_counts(unit([1, 0, 0]), unit([0.8, 0.6, 0]), np.zeros((0, 3), np.float32), np.array([1]),
                              np.zeros(0, np.int64))
    assert n.tolist() == [0] and s == pytest.approx([0.8], abs=1e-6)


@pytest.mark.parametrize("k, kept", [(1, [False, False]), (2, [False, True]), (3, [True, True])])
def test_operator_keeps_iff_n_above_below_k(k, kept):
    # Document "d1": anchor 0 = x, s1 = passage 1 at 0.8 (n_above = 2 against POOL from doc 1's view).
    # Document "d3": anchor 0 = x, s1 = passage 1 at 0.95: only the pool's 1.0 passage (of document d1, another
    # document from d3's view) beats it, so n_above = 1; its own document's pool passages (0.0 and 0.85) do not count.
    v1 = unit([1, 0, 0], [0.8, 0.6, 0], [0, 0, 1], [0, 1, 0], [0.5, 0.5, 0.5])
    v3 = unit([1, 0, 0], [0.95, np.sqrt(1 - 0.95**2), 0], [0, 0, 1], [0, 1, 0], [0.5, 0.5, 0.5])
    group = {"anchor_index": 0, "related_indices": [1, 2, 3, 4], "dense": [0.0] * 4, "tfidf": [0.0] * 4, "rrf": [0.0] * 4}
    batch = pa.table({
        "id": ["d1", "d3"],
        "vectors": vectors_array([v1, v3], 3),
        "groups": pa.array([[group], [group]], pa.list_(GROUP_TYPE)),
    })
    pool_docs = np.array([doc_hash(f"d{d}") for d in POOL_DOCS])
    op = ConsistencyFilter(lambda: (POOL, pool_docs), k=k)
    out = op(batch).column("groups").to_pylist()
    assert [g[0]["n_above"] for g in out] == [2, 1]
    assert [g[0]["kept"] for g in out] == kept
    assert out[1][0]["s"] == pytest.approx(0.95, abs=1e-6)


def test_pool_is_seeded_and_sized_to_the_input(sample_dir):
    shards = discover_shards(str(sample_dir))

    def pool(seed, size):
        spec = PoolSpec(size=size, seed=seed, doc_cut=1.0, known_rows=827)
        return pool_sample([scan_shard(s, "text", "id", 10, 0, 1.0, spec).pool for s in shards], size)

    a, b, c = pool(7, 300), pool(7, 300), pool(8, 300)
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[0] != c[0] and len(a[0]) == 300
    everything = pool(7, 10**6)
    assert len(everything[0]) == 5144  # the sample offers 5144 passages: the pool takes them all
    assert len(set(pool(7, 300)[1].tolist())) > 100  # drawn across many documents


def test_pool_size_zero_is_refused_with_a_hint():
    from pairmine.pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="consistency.enabled=false"):
        load_config(overrides=["consistency.pool_size=0"])


def exact_n_above(a, s1, pool, anchor_docs, pool_docs):
    """Brute force in exact arithmetic: for every (group, pool passage) of another document, the sign of
    a . p - a . s1 from math.fsum of the float64 products (each product of two float32 is exact in float64, and fsum
    rounds the exact sum once, so the sign is exact)."""
    import math

    a64, s64, p64 = a.astype(np.float64), s1.astype(np.float64), pool.astype(np.float64)
    counts = []
    for i in range(len(a)):
        own = -(a64[i] * s64[i])
        counts.append(sum(1 for j in range(len(pool)) if pool_docs[j] != anchor_docs[i]
                          and math.fsum(np.concatenate([a64[i] * p64[j], own])) > 0))
    return np.array(counts)


def tie_case(seed=4, g=24, dim=16, n_random=400):
    """A seeded batch with exact ties at s, copies of s1, one-ulp neighbours of s1 on both sides, and same-document
    passages above s. Returns (anchors, positives, pool, anchor_docs, pool_docs, counts of each kind)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(g, dim)).astype(np.float32)
    a[:, 1] = a[:, 0] = np.abs(a[:, 0])  # a[0] == a[1] > 0: swapping coordinates 0 and 1 of s1 keeps a . s1
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    s1 = (a + 0.3 * rng.normal(size=(g, dim))).astype(np.float32)
    s1 /= np.linalg.norm(s1, axis=1, keepdims=True)
    anchor_docs = np.arange(g, dtype=np.int64) // 2  # two groups per document
    rows, docs = [unit(*rng.normal(size=(n_random, dim)))], [rng.integers(100, 140, size=n_random)]
    swapped = s1[:, [1, 0] + list(range(2, dim))]  # exact ties in real arithmetic, not bit copies
    up, down = s1.copy(), s1.copy()
    for i in range(g):  # one ulp along a coordinate where a > 0: exactly above / below s
        k = int(np.argmax(a[i, 2:])) + 2
        up[i, k] = np.nextafter(s1[i, k], np.float32(np.inf))
        down[i, k] = np.nextafter(s1[i, k], np.float32(-np.inf))
    other = (anchor_docs + 1) % (g // 2) + 200  # documents no group has
    for block, doc in ((s1, other), (s1, other + 1000), (swapped, other), (up, other), (down, other)):
        rows.append(block)
        docs.append(doc)
    rows.append(a)  # same-document neighbours: each anchor itself (cos 1 > s) and a near copy, in its own document
    docs.append(anchor_docs)
    rows.append(unit(*(a + 0.01 * rng.normal(size=(g, dim)))))
    docs.append(anchor_docs)
    order = rng.permutation(sum(len(r) for r in rows))  # spread the special rows over the chunks
    pool = np.concatenate(rows).astype(np.float32)[order]
    pool_docs = np.concatenate(docs).astype(np.int64)[order]
    return a, s1, pool, anchor_docs, pool_docs


@pytest.mark.parametrize("chunk_mb", [1000.0, 0.02])  # one chunk; chunks of 256 rows (hot rows gathered)
def test_counts_equal_an_exact_brute_force_with_ties_and_same_document_neighbours(chunk_mb):
    a, s1, pool, anchor_docs, pool_docs = tie_case()
    s, n = consistency_counts(a, s1, pool, anchor_docs, pool_docs, chunk_mb=chunk_mb)
    ref = exact_n_above(a, s1, pool, anchor_docs, pool_docs)
    assert n.dtype == np.int64 and s.dtype == np.float32 and n.shape == s.shape == (24,)
    assert np.array_equal(n, ref)
    for k in (1, 2, 3, 5):
        assert np.array_equal(n < k, ref < k)
    # The "up" copy is the only special row above s from another document; the copies of s1, the swapped ties and
    # the "down" copy never count, and nor do the anchor itself (cos 1) and its near copy in the group's document.
    above_random = exact_n_above(a, s1, pool[np.isin(pool_docs, np.arange(100, 140))], anchor_docs,
                                 pool_docs[np.isin(pool_docs, np.arange(100, 140))])
    other_special = ref - above_random
    assert other_special.min() >= 1  # at least its own "up" neighbour
    assert 0 < np.sum(ref < 2) < 24  # the case has both kept and dropped groups at k = 2
    exact_s = np.array([np.float32(np.sum(a[i].astype(np.float64) * s1[i].astype(np.float64))) for i in range(24)])
    assert np.abs(s - exact_s).max() <= np.spacing(np.float32(1.0))  # float32 rounding of a . s1, at most one ulp


def test_counts_exact_with_an_fp16_pool_tensor():
    torch = pytest.importorskip("torch")
    a, s1, pool, anchor_docs, pool_docs = tie_case(seed=5)
    pool16 = pool.astype(np.float16)  # the stored fp16 values are the pool; scores are fp32
    _, n = consistency_counts(a, s1, torch.from_numpy(pool16), anchor_docs, pool_docs, chunk_mb=0.02)
    assert np.array_equal(n, exact_n_above(a, s1, pool16.astype(np.float32), anchor_docs, pool_docs))


def test_shapes_that_disagree_are_refused():
    with pytest.raises(ValueError, match="shapes disagree"):
        consistency_counts(unit([1, 0, 0]), unit([0.8, 0.6, 0]), POOL, np.array([1]), POOL_DOCS[:3])
    with pytest.raises(ValueError, match="shapes disagree"):
        consistency_counts(unit([1, 0, 0]), unit([0.8, 0.6, 0], [1, 0, 0]), POOL, np.array([1]), POOL_DOCS)
