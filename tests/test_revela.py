"""Revela's formulas (seed 001, sections 3.2-3.4; issue 12 item 2) checked by hand, and its model wrapper on a tiny
Qwen2 built from a config: Sim over j != i, eq. 5-7 on a 2-token example, the in-batch stream reading an identical
sequence, the retriever learning only through the LM loss, LoRA on both models."""

import json
import math

import numpy as np
import pytest
import torch

from pairmine.pipeline.revela import (
    batch_similarity, causal_mask, cross_document_attention, cross_document_outputs, in_batch_attention,
    ntp_loss,
)
from pairmine.pipeline.revela_model import RevelaModel, UnsupportedDecoderError, load_revela

E = math.e
HI, LO = E / (1 + E), 1 / (1 + E)  # softmax([1, 0]) = [0.7310585786300049, 0.2689414213699951]


def tiny_qwen2(vocab=16, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


def tiny_bert(vocab=16, seed=0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return BertModel(BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64))


def two_token_example():
    """B = 3 sequences of L = 2 tokens, one head of d_H = 4 (sqrt(d_H) = 2). Sequence 0's in-batch queries:
    token 0 = [2, 0, 0, 0], token 1 = 0. Sequence 1's self-attention keys [1, 0, 0, 0] and 0, values [1, 2, 3, 4]
    and [5, 6, 7, 8]. Sequences 0 and 2 get random keys and values (one-hot Sim must ignore them)."""
    g = torch.Generator().manual_seed(0)
    q_h = torch.randn(3, 1, 2, 4, generator=g, dtype=torch.float64)
    k_e = torch.randn(3, 1, 2, 4, generator=g, dtype=torch.float64)
    v_e = torch.randn(3, 1, 2, 4, generator=g, dtype=torch.float64)
    q_h[0, 0] = torch.tensor([[2.0, 0, 0, 0], [0, 0, 0, 0]])
    k_e[1, 0] = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]])
    v_e[1, 0] = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    return q_h, k_e, v_e


def test_with_sim_one_hot_on_j_b_i_is_the_attention_to_j_computed_by_hand():
    q_h, k_e, v_e = two_token_example()
    mask = torch.ones(3, 2, dtype=torch.bool)
    # Token 0: logits [2*1, 0] / 2 = [1, 0] -> weights [e/(1+e), 1/(1+e)]; token 1: [0, 0] / 2 -> [1/2, 1/2].
    # b_0 = [HI * [1,2,3,4] + LO * [5,6,7,8], (1/2)([1,2,3,4] + [5,6,7,8])] = [1 + 4 LO, ...], [3, 4, 5, 6]
    expected = torch.tensor([[1 + 4 * LO, 2 + 4 * LO, 3 + 4 * LO, 4 + 4 * LO], [3.0, 4, 5, 6]], dtype=torch.float64)
    assert math.isclose(1 + 4 * LO, 2.0757656854799804, rel_tol=1e-12)
    sim = torch.tensor([[0.0, 1, 0], [0.5, 0, 0.5], [0.5, 0.5, 0]], dtype=torch.float64)  # row 0 one-hot on j = 1
    b = cross_document_attention(q_h, k_e, v_e, mask, sim)  # (B, H, L, d_H)
    assert torch.allclose(b[0, 0], expected, atol=1e-12)
    # Eq. 5 for the pair alone, and softmax(Q K^T / sqrt(d_H)) V written out with torch.
    assert torch.allclose(cross_document_outputs(q_h, k_e, v_e, mask)[0, 1, 0], expected, atol=1e-12)
    by_hand = torch.softmax(q_h[0, 0] @ k_e[1, 0].T / 2, dim=-1) @ v_e[1, 0]
    assert torch.allclose(by_hand, expected, atol=1e-12)
    # A padding key of D_1 is never attended to: token 1 of D_1 masked -> every query reads V_1[0] only.
    mask[1, 1] = False
    b = cross_document_attention(q_h, k_e, v_e, mask, sim)
    assert torch.allclose(b[0, 0], torch.tensor([[1.0, 2, 3, 4]] * 2, dtype=torch.float64), atol=1e-12)


def test_in_batch_attention_is_own_causal_prefix_plus_weighted_cross_documents():
    q_h, k_e, v_e = two_token_example()
    k_h, v_h = torch.zeros_like(k_e), torch.zeros_like(v_e)
    v_h[0, 0] = torch.tensor([[1.0, 1, 1, 1], [3, 3, 3, 3]])
    # s_0: token 0 sees only itself -> [1,1,1,1]; token 1 (query 0, keys 0) sees both equally -> [2,2,2,2].
    mask = torch.ones(3, 2)
    sim = torch.tensor([[0.0, 1, 0], [0.5, 0, 0.5], [0.5, 0.5, 0]], dtype=torch.float64)
    h = in_batch_attention(q_h, k_h, v_h, k_e, v_e, mask, sim)
    expected = torch.tensor([[2 + 4 * LO, 3 + 4 * LO, 4 + 4 * LO, 5 + 4 * LO], [5.0, 6, 7, 8]], dtype=torch.float64)
    assert torch.allclose(h[0, 0], expected, atol=1e-12)  # eq. 7: s + b
    # Sim split evenly over two sequences: b is the mean of the two pairs' outputs (eq. 6).
    pairs = cross_document_outputs(q_h, k_e, v_e, mask)
    b = cross_document_attention(q_h, k_e, v_e, mask, sim)
    assert torch.allclose(b[1], 0.5 * pairs[1, 0] + 0.5 * pairs[1, 2], atol=1e-12)
    # The causal mask: token k sees 0..k of its own real tokens.
    assert causal_mask(torch.tensor([[1, 1, 0]]))[0, 0].tolist() == [[True, False, False], [True, True, False],
                                                                       [True, True, False]]


def test_sim_sums_to_one_over_the_other_sequences_and_excludes_the_diagonal():
    # S = [[1, 1, 0], [1, 1, 0], [0, 0, 1]]; tau = 0.5. Row 0 over j in {1, 2}: e^2 / (e^2 + 1), 1 / (e^2 + 1).
    # Row 2 over {0, 1}: S = 0, 0 -> 1/2, 1/2, although S_22 = 1 is its largest.
    sim = batch_similarity(torch.tensor([[2.0, 0], [1, 0], [0, 3]], dtype=torch.float64), tau=0.5)
    a = E ** 2 / (E ** 2 + 1)
    assert math.isclose(a, 0.8807970779778823, rel_tol=1e-12)
    assert torch.allclose(sim, torch.tensor([[0, a, 1 - a], [a, 0, 1 - a], [0.5, 0.5, 0]], dtype=torch.float64),
                          atol=1e-12)
    # The seed's tau = 1e-4 (scores up to 1e4): finite, rows sum to 1, zero diagonal, near one-hot.
    v = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    sim = batch_similarity(v, tau=1e-4)
    assert torch.isfinite(sim).all()
    assert torch.allclose(sim.sum(1), torch.ones(5))
    assert (sim.diagonal() == 0).all()
    assert sim.max(1).values.min() > 0.99
    with pytest.raises(ValueError, match="at least 2"):
        batch_similarity(v[:1], tau=1.0)
    with pytest.raises(ValueError, match="tau"):
        batch_similarity(v, tau=0.0)


def test_ntp_loss_predicts_the_next_real_token():
    # Vocab 2, one sequence [0, 1, pad]: one prediction, of token 1 from position 0; logits [0, ln 3] -> p = 3/4.
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, -5.0], [9.0, 9.0]]])
    loss = ntp_loss(logits, torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 0]]))
    assert math.isclose(loss.item(), -math.log(0.75), rel_tol=1e-6)
    with pytest.raises(ValueError, match="no sequence"):
        ntp_loss(logits, torch.tensor([[0, 1, 1]]), torch.tensor([[1, 0, 0]]))


def test_the_plain_stream_is_the_decoders_own_forward():
    lm = tiny_qwen2(vocab=64).eval()
    m = RevelaModel(lm, tiny_bert(vocab=64), tau=1e-4)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    with torch.no_grad():
        _, plain = m.streams(ids, mask, torch.full((3, 3), 0.5).fill_diagonal_(0), plain=True)
        ref = lm(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(plain[mask.bool()], ref[mask.bool()], atol=1e-5)
    with pytest.raises(UnsupportedDecoderError, match="embed_tokens"):
        RevelaModel(torch.nn.Linear(2, 2), tiny_bert(), tau=1e-4)


def test_with_an_identical_sequence_and_near_one_hot_sim_the_in_batch_stream_predicts_better():
    """8 pairs of identical random sequences (vocab 16, 8 tokens: nothing to learn from a sequence alone, chance is
    ln 16 = 2.77 nats); Sim 0.98 on the copy. A few hundred steps of the in-batch NTP loss teach the LM to read the
    copy: on fresh sequences its in-batch loss falls far below the plain stream's, and below chance, while Sim on a
    different sequence gives no such gain."""
    v, n, p = 16, 8, 8
    lm = tiny_qwen2(vocab=v)
    m = RevelaModel(lm, torch.nn.Identity(), tau=1e-4)
    partner = torch.arange(2 * p) ^ 1  # 0<->1, 2<->3, ...
    sim = torch.full((2 * p, 2 * p), 0.02 / (2 * p - 2))
    sim[torch.arange(2 * p), partner] = 0.98
    sim.fill_diagonal_(0)
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and stays fast on a busy machine
    try:
        for _ in range(500):  # about 175 steps
            ids = torch.randint(0, v, (p, n), generator=g).repeat_interleave(2, 0)  # a fresh batch every step
            loss = m(ids, torch.ones_like(ids), sim=sim).loss
            if loss.item() < 0.5:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    ids = torch.randint(0, v, (p, n), generator=g).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = m(ids, mask, sim=sim, plain=True)
        wrong = sim[(torch.arange(2 * p) + 2) % (2 * p)]  # near-one-hot on another pair's sequence
        wrong.fill_diagonal_(0)
        wrong = wrong / wrong.sum(1, keepdim=True)
        off = m(ids, mask, sim=wrong).loss
    assert out.loss < 1.0 < math.log(v) < out.plain_loss + 0.1
    assert out.loss < out.plain_loss - 1.5
    assert off > out.loss + 1.5


def test_gradients_reach_the_retriever_only_through_the_lm_loss():
    torch.manual_seed(0)
    m = RevelaModel(tiny_qwen2(vocab=32), tiny_bert(vocab=32), tau=0.5).eval()  # eval: no dropout
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    out = m(ids, mask, ids, mask)
    out.sim.retain_grad()
    out.loss.backward()
    ret = [p for p in m.retriever.parameters()]
    full = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in ret]
    assert sum(float(x.abs().sum()) for x in full) > 0  # the retriever learns
    # Chain rule through Sim alone: dL/dTheta = (dL/dSim) . (dSim/dTheta) -- nothing else of the loss reaches it.
    m.zero_grad()
    with torch.no_grad():
        d_sim = out.sim.grad.clone()
    (batch_similarity(m.embed(ids, mask), 0.5) * d_sim).sum().backward()
    for a, p in zip(full, ret):
        b = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # B = 2: Sim is 1 on the only other sequence whatever the retriever says, so it gets no gradient at all.
    m.zero_grad()
    m(ids[:2], mask[:2], ids[:2], mask[:2]).loss.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for p in m.retriever.parameters())


def test_load_revela_puts_lora_on_the_lm_and_the_retriever(tmp_path):
    tiny_qwen2(vocab=32).save_pretrained(tmp_path / "lm")
    tiny_bert(vocab=32).save_pretrained(tmp_path / "ret")
    m = load_revela(str(tmp_path / "lm"), str(tmp_path / "ret"), tau=0.5, lora_rank=4, lora_alpha=4)
    lm_train = [n for n, p in m.lm.named_parameters() if p.requires_grad]
    ret_train = [n for n, p in m.retriever.named_parameters() if p.requires_grad]
    assert lm_train and ret_train
    assert all("lora_" in n for n in lm_train + ret_train)
    assert not any("pooler" in n for n in ret_train)
    assert any("q_proj" in n for n in lm_train) and any("down_proj" in n for n in lm_train)
    ids = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    m.retriever.eval()
    m(ids, mask, ids, mask).loss.backward()
    # LoRA's B matrices start at zero, so the first gradient reaches them (A's gradient is zero until B moves).
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0
               for n, p in m.retriever.named_parameters() if "lora_B" in n)


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory) -> str:
    """A 2-layer, 32-dim Qwen2 built from a config with the shipped all-MiniLM-L6-v2 tokenizer (random weights)."""
    from transformers import AutoTokenizer

    from pairmine.operators.embed import default_model_path

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tiny_qwen2(vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow  # ~3.5 min on CI: Ray Train end to end; the objective's maths and errors stay in the default run
def test_train_with_the_revela_objective(tiny_groups, tiny_model_dir, tiny_lm_dir, tmp_path):
    """pairmine train --objective revela on the tiny run's groups (2 CPU workers, gloo, a tiny Qwen2 from a config):
    every step logs the in-batch NTP loss and Sim's diagnostics; the loss falls; killed once after step 6's
    checkpoint, the run resumes there (LoRA adapters, optimizer and schedule from the checkpoint); the export is a
    plain encoder (the retriever, LoRA merged) that loads without adapters (issue 12 items 1, 2 and 5)."""
    from transformers import AutoModel

    from tests.test_train import TRAIN_ARGS, train_objective_smoke

    out = tmp_path / "revela"
    args = [*TRAIN_ARGS, "--set", f"train.revela_lm={tiny_lm_dir}", "--set", "train.revela_lr=5e-3", "--set",
            "train.revela_warmup_steps=0", "--set", "train.revela_lora_rank=8", "--set", "train.revela_lora_alpha=16",
            "--set", "loss.revela_tau=0.1"]
    proc, rows = train_objective_smoke(tiny_groups, tiny_model_dir, out, "revela", args, {"sim_top", "sim_same_group"})
    assert all(0 < r["sim_top"] <= 1 and 0 <= r["sim_same_group"] <= 1 for r in rows)
    manifest = json.loads((out / "train_manifest.json").read_text())
    assert manifest["objective"] == "revela" and manifest["config"]["train"]["revela_lm"] == tiny_lm_dir
    assert "Revela in-batch NTP" in proc.stdout
    # Checkpoints keep the trainable tensors only: the LoRA adapters, not the LM's or the retriever's base weights.
    ckpt = sorted((out / "ray-train").glob("checkpoint_*"))[-1]
    keys = list(torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)["model"])
    assert keys and all("lora_" in k for k in keys if k.endswith("weight")), keys[:5]
    exported = AutoModel.from_pretrained(str(out / "export"))
    assert not any("lora" in n for n, _ in exported.named_parameters())


def test_revela_needs_a_causal_lm(tiny_groups, tiny_model_dir, tmp_path):
    from pairmine.pipeline.config import ConfigError
    from pairmine.pipeline.train import train
    from pairmine.pipeline.train_config import load_train_config

    with pytest.raises(ConfigError, match="train.revela_lm .*required when train.objective is revela"):
        load_train_config(overrides=["train.objective=revela"])
    cfg = load_train_config(overrides=["train.objective=revela", f"train.revela_lm={tmp_path / 'missing'}",
                                       f"train.model={tiny_model_dir}"])
    with pytest.raises(ConfigError, match="train.revela_lm = .* cannot be loaded"):
        train(cfg, str(tiny_groups), str(tmp_path / "out"))


def test_the_merged_export_is_the_trained_retriever_not_the_start_model(tiny_model_dir, tmp_path):
    """Issue 39 item 8 (peft#2502, #1381): the Revela export (the retriever with its LoRA adapters merged, through
    train's own ``_export``) gives the vectors of the trained base + adapters, read back both with transformers
    (pairmine's Embedder: AutoModel, mean pooling) and with sentence-transformers (its saved modules), cosine >=
    0.9999 on every passage; and not those of the start model (the adapters moved it). A few real optimizer steps
    of the in-batch NTP loss on the tiny BERT (the conftest's, with the real tokenizer) and a tiny Qwen2."""
    import types

    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from pairmine.operators.embed import Embedder
    from pairmine.pipeline.train import _export

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tiny_qwen2(vocab=len(tokenizer)).save_pretrained(tmp_path / "lm")
    m = load_revela(str(tmp_path / "lm"), tiny_model_dir, tau=0.1, lora_rank=4, lora_alpha=16)
    texts = ["the cat sat on the mat", "a dog ran in the park", "cats like to sit on mats",
             "dogs run in parks every day", "stock prices fell on monday", "the market dropped at the open"]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.05)
    for _ in range(4):
        optimizer.zero_grad()
        m(ids, mask, ids, mask).loss.backward()
        optimizer.step()
    assert any(float(p.detach().abs().max()) > 0 for n, p in m.retriever.named_parameters() if "lora_B" in n)
    m.retriever.eval()
    with torch.no_grad():
        trained = torch.nn.functional.normalize(m.embed(ids, mask), dim=-1).numpy()  # base + adapters, (6, 64)
    target = _export(types.SimpleNamespace(encoder=m.merged_retriever()), tokenizer, str(tmp_path / "out"),
                     {"query_prefix": "", "passage_prefix": ""}, 64)
    with torch.no_grad():  # merging worked on a copy: the trained model still has its adapters
        assert torch.allclose(torch.nn.functional.normalize(m.embed(ids, mask), dim=-1), torch.from_numpy(trained))
    via_transformers = Embedder(target, dtype="float32").encode(texts)
    via_st = SentenceTransformer(target, device="cpu").encode(texts, prompt_name="passage", convert_to_numpy=True)
    start = Embedder(tiny_model_dir, dtype="float32").encode(texts)
    cos = lambda a, b: (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))  # noqa: E731
    assert cos(via_transformers, trained).min() >= 0.9999
    assert cos(via_st, trained).min() >= 0.9999
    assert cos(start, trained).min() < 0.999  # the export is not the start model (-0.47 measured)


def test_a_decoder_without_the_llama_layout_is_one_cli_error_line(tiny_groups, tiny_model_dir, tmp_path, capsys):
    """pairmine train --objective revela with a causal LM of another layout (a GPT-2, from its config alone): one
    ``pairmine: error:`` line naming train.revela_lm and what is missing, exit 2, before Ray starts (no output
    folder), not a traceback from the training workers (issue 41 item 3)."""
    from transformers import GPT2Config

    from pairmine.pipeline.cli import main

    lm = tmp_path / "gpt2"
    GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2).save_pretrained(lm)
    out = tmp_path / "out"
    code = main(["train", "--groups", str(tiny_groups), "--output", str(out), "--model", tiny_model_dir,
                 "--objective", "revela", "--set", f"train.revela_lm={lm}"])
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("pairmine:")] == [
        f"pairmine: error: train.revela_lm = '{lm}': GPT2LMHeadModel: no model.embed_tokens (Revela needs the "
        "LLaMA / Qwen2 layout)"], err
    assert "Traceback" not in err and not out.exists()


def test_check_revela_lm_refuses_an_unsupported_decoder_before_ray(tmp_path):
    """The driver's layout check (the model built from the config on the meta device) passes the Qwen2 layout and
    raises UnsupportedDecoderError for what check_decoder refuses (here sliding-window attention)."""
    from transformers import Qwen2Config

    from pairmine.pipeline.train import check_revela_lm
    from pairmine.pipeline.train_config import load_train_config

    def check(conf):
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        conf.save_pretrained(path)
        check_revela_lm(load_train_config(overrides=["train.objective=revela", f"train.revela_lm={path}"]))

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    check(Qwen2Config(**tiny))
    with pytest.raises(UnsupportedDecoderError, match="train.revela_lm = .*layer 0 uses sliding-window attention"):
        check(Qwen2Config(**tiny, use_sliding_window=True, sliding_window=16, max_window_layers=0))
