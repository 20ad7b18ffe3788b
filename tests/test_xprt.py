"""Every term of the xPRT objective on values a person can check by hand (seed 000; SPEC "Training job"), the
masking on a fixed seed, the model's passes on a tiny BERT, and the training config."""

import math

import pytest
import torch
import torch.nn.functional as F

from pairmine.pipeline.config import ConfigError
from pairmine.pipeline.train_config import load_train_config
from pairmine.pipeline.xprt import (
    chunked_head_cross_entropy, chunked_head_self_kl, head_rows_per_chunk, info_nce_symmetric, mask_tokens,
    masked_lm_loss, positive_probability, retention_kl, retention_weight, self_distillation_loss, uniformity,
)


def unit_pairs(cos_pos: float, cos_neg: float, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """n anchors and n positives (unit vectors) with cos(a_i, p_i) = cos_pos and cos(a_i, p_j) = cos_neg for i != j,
    and cos_neg between any two anchors or any two positives: the rows of the Cholesky factor of that Gram matrix."""
    eye = torch.eye(n, dtype=torch.float64)
    same_side = eye + cos_neg * (1 - eye)  # (n, n)
    cross = cos_pos * eye + cos_neg * (1 - eye)  # (n, n)
    gram = torch.cat([torch.cat([same_side, cross], 1), torch.cat([cross, same_side], 1)])  # (2n, 2n)
    vectors = torch.linalg.cholesky(gram)  # (2n, 2n), rows have the Gram matrix above
    return vectors[:n], vectors[n:]


def test_info_nce_spec_example_gives_the_positive_99_5_percent():
    a, p = unit_pairs(0.8, 0.5)
    assert torch.allclose(a @ p.T, torch.tensor([[0.8, 0.5, 0.5], [0.5, 0.8, 0.5], [0.5, 0.5, 0.8]], dtype=torch.float64))
    assert torch.allclose(p.norm(dim=1), torch.ones(3, dtype=torch.float64))
    docs = torch.tensor([1, 2, 3])
    prob = math.exp(16) / (math.exp(16) + 2 * math.exp(10))  # 16 = 0.8 / 0.05, 10 = 0.5 / 0.05
    assert round(prob, 4) == 0.9951  # "99.5%"
    assert positive_probability(a, p, docs).item() == pytest.approx(prob, abs=1e-6)
    assert info_nce_symmetric(a, p, docs).item() == pytest.approx(-math.log(prob), rel=1e-4)  # 0.00496


def test_same_document_group_is_masked_out_of_the_negatives():
    a, p = unit_pairs(0.8, 0.5)
    docs = torch.tensor([7, 7, 3])  # groups 0 and 1 come from the same document
    # Rows 0 and 1 (and columns 0 and 1) lose one negative: -log(e^16 / (e^16 + e^10)); row/column 2 keeps both.
    two, one = -math.log(math.exp(16) / (math.exp(16) + 2 * math.exp(10))), -math.log(math.exp(16) / (math.exp(16) + math.exp(10)))
    by_hand = (2 * one + two) / 3  # the same in both directions (the matrix is symmetric)
    assert info_nce_symmetric(a, p, docs).item() == pytest.approx(by_hand, rel=1e-4)
    assert info_nce_symmetric(a, p, docs, mask_same_doc=False).item() == pytest.approx(two, rel=1e-4)
    assert info_nce_symmetric(a, p, docs).item() < info_nce_symmetric(a, p, docs, mask_same_doc=False).item()


def test_info_nce_is_symmetric_in_its_two_directions():
    torch.manual_seed(0)
    a = F.normalize(torch.randn(5, 8), dim=1)
    p = F.normalize(torch.randn(5, 8), dim=1)
    docs = torch.tensor([1, 2, 3, 4, 5])
    logits = a @ p.T / 0.05
    t = torch.arange(5)
    by_hand = 0.5 * (F.cross_entropy(logits, t) + F.cross_entropy(logits.T, t))
    assert info_nce_symmetric(a, p, docs).item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert info_nce_symmetric(p, a, docs).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_uniformity_of_known_vectors():
    assert uniformity(torch.eye(4)).item() == pytest.approx(-4.0)  # all pairs at squared distance 2: log e^-4
    assert uniformity(torch.eye(4), t=1.0).item() == pytest.approx(-2.0)
    same = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert uniformity(same).item() == pytest.approx(0.0)
    # e1, e1, e2: pairs at squared distance 0, 2, 2 -> log((1 + 2 e^-4) / 3)
    three = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert uniformity(three).item() == pytest.approx(math.log((1 + 2 * math.exp(-4)) / 3), rel=1e-5)
    # opposite unit vectors: squared distance 4 -> -8
    assert uniformity(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])).item() == pytest.approx(-8.0)


def test_retention_kl_is_zero_when_the_model_equals_its_frozen_copy_and_positive_otherwise():
    torch.manual_seed(0)
    a = F.normalize(torch.randn(6, 16), dim=1)
    p = F.normalize(torch.randn(6, 16), dim=1)
    assert retention_kl(a, p, a.clone(), p.clone()).item() == pytest.approx(0.0, abs=1e-7)
    a2 = F.normalize(a + 0.3 * torch.randn(6, 16), dim=1)
    kl = retention_kl(a2, p, a, p).item()
    cur, frz = a2 @ p.T / 0.05, a @ p.T / 0.05
    rows = (frz.softmax(1) * (frz.log_softmax(1) - cur.log_softmax(1))).sum(1).mean()
    cols = (frz.softmax(0) * (frz.log_softmax(0) - cur.log_softmax(0))).sum(0).mean()
    assert kl > 0 and kl == pytest.approx(0.5 * (rows + cols).item(), rel=1e-4)


def test_retention_weight_falls_linearly_from_40_to_0():
    assert [retention_weight(s, 5) for s in range(5)] == [40.0, 30.0, 20.0, 10.0, 0.0]
    assert retention_weight(0, 1) == 40.0 and retention_weight(99, 100) == 0.0


def test_masked_lm_and_self_distillation_losses():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    assert masked_lm_loss(logits, torch.tensor([0, 1])).item() == pytest.approx(-(math.log(0.5) + math.log(0.8)) / 2)
    assert self_distillation_loss(logits, logits.clone()).item() == pytest.approx(0.0, abs=1e-7)
    teacher = torch.log(torch.tensor([[1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]]))
    by_hand = sum((1 / 3) * math.log((1 / 3) / q) for q in (0.5, 0.25, 0.25))  # KL(uniform || row 0)
    by_hand += sum((1 / 3) * math.log((1 / 3) / q) for q in (0.1, 0.8, 0.1))
    assert self_distillation_loss(logits, teacher).item() == pytest.approx(by_hand / 2, rel=1e-5)


def _tiny_head(dim: int = 16, vocab: int = 50) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.LayerNorm(dim),
                               torch.nn.Linear(dim, vocab))


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def test_chunked_head_losses_equal_the_unchunked_ones_in_value_and_gradient():
    head = _tiny_head()
    params = list(head.parameters())
    n = 37  # 8 chunks of 5 rows, the last one of 2
    hidden = torch.randn(n, 16, requires_grad=True)
    teacher = torch.randn(n, 16, requires_grad=True)
    labels = torch.randint(50, (n,))
    ref = masked_lm_loss(head(hidden), labels)
    got = chunked_head_cross_entropy(head, hidden, labels, rows=5)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(_grads(got, [hidden, *params]), _grads(ref, [hidden, *params])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    ref = self_distillation_loss(head(hidden), head(teacher))
    got = chunked_head_self_kl(head, hidden, teacher, rows=5)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(_grads(got, [hidden, *params]), _grads(ref, [hidden, *params])):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # the teacher gets no gradient from L_self, chunked or not
    assert chunked_head_self_kl(head, hidden, teacher, rows=5).grad_fn is not None
    assert torch.autograd.grad(chunked_head_self_kl(head, hidden, teacher, rows=5), teacher,
                               allow_unused=True)[0] is None
    # no masked position: 0 with a graph
    empty = torch.zeros(0, 16, requires_grad=True)
    assert chunked_head_cross_entropy(head, empty, labels[:0], rows=5).item() == 0.0
    assert head_rows_per_chunk(30522, 256) == 2198 and head_rows_per_chunk(10**9, 1) == 1


def test_no_tensor_larger_than_one_chunk_of_logits_exists_forward_or_backward():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        """The largest tensor any op produces whose last dimension is the vocabulary (logits and their kin)."""

        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.rows = vocab, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                    self.rows = max(self.rows, t.numel() // self.vocab)
            return out

    head = _tiny_head(dim=4, vocab=50)  # dim < the chunk: the head's (dim, vocab) weight gradient is smaller
    hidden, teacher = torch.randn(37, 4, requires_grad=True), torch.randn(37, 4)
    labels = torch.randint(50, (37,))
    for loss in (lambda r: chunked_head_cross_entropy(head, hidden, labels, r),
                 lambda r: chunked_head_self_kl(head, hidden, teacher, r)):
        probe = Largest(50)
        with probe:
            loss(5).backward()
        assert probe.rows == 5  # at most one chunk of (rows, vocab), forward and backward
        probe = Largest(50)
        with probe:
            loss(37).backward()
        assert probe.rows == 37  # one chunk holding every row: the probe sees the full logits


def test_masking_rates_on_a_fixed_seed():
    ids = torch.arange(1000, 1000 + 4 * 200).view(4, 200)
    special = torch.zeros(4, 200, dtype=torch.bool)
    special[:, 0] = special[:, -1] = True  # [CLS], [SEP]
    special[3, 100:] = True  # row 3 is padded after 100 tokens
    masked, chosen = mask_tokens(ids, special, 0.15, torch.Generator().manual_seed(0), 103, 30522, 0.1, 0.1)
    assert chosen.sum(1).tolist() == [round(198 * 0.15)] * 3 + [round(99 * 0.15)]  # exactly 15% of maskable tokens
    assert not (chosen & special).any()  # never a special token or padding
    assert torch.equal(masked[~chosen], ids[~chosen])
    again, chosen2 = mask_tokens(ids, special, 0.15, torch.Generator().manual_seed(0), 103, 30522, 0.1, 0.1)
    assert torch.equal(again, masked) and torch.equal(chosen2, chosen)  # same seed, same masks
    # 80/10/10 over many tokens
    big = torch.arange(100_000).view(100, 1000) + 1000
    m, c = mask_tokens(big, torch.zeros_like(big, dtype=torch.bool), 0.15, torch.Generator().manual_seed(1), 103, 30522, 0.1, 0.1)
    n = c.sum().item()
    assert n == 100 * 150
    assert (m[c] == 103).float().mean().item() == pytest.approx(0.8, abs=0.02)
    assert (m[c] == big[c]).float().mean().item() == pytest.approx(0.1, abs=0.02)
    # decoder masking: 60%, plain [MASK]
    m, c = mask_tokens(ids, special, 0.6, torch.Generator().manual_seed(0), 103, 30522)
    assert c.sum(1).tolist() == [round(198 * 0.6)] * 3 + [round(99 * 0.6)] and (m[c] == 103).all()


def test_train_config_defaults_and_errors(tmp_path):
    cfg = load_train_config()
    assert cfg.loss.tau == 0.05 and cfg.loss.w_cross == 0.1 and cfg.loss.n_cond == 4
    assert cfg.loss.retention_start == 40.0 and cfg.loss.retention_end == 0.0
    assert cfg.loss.encoder_mask_rate == 0.15 and cfg.loss.decoder_mask_rate == 0.6 and cfg.train.positives == "xprt"
    f = tmp_path / "t.toml"
    f.write_text("[train]\nbatch_size = 8\n[loss]\nw_unif = 0\n")
    cfg = load_train_config(f, ["train.positives=random", "scaling.num_workers=2"])
    assert cfg.train.batch_size == 8 and cfg.loss.w_unif == 0.0 and cfg.train.positives == "random"
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="train.positives = 'spans' is not allowed"):
        load_train_config(overrides=["train.positives=spans"])
    with pytest.raises(ConfigError, match="unknown config key 'loss.temperature'"):
        load_train_config(overrides=["loss.temperature=0.1"])
    with pytest.raises(ConfigError, match="unknown config section 'embed'"):
        load_train_config(overrides=["embed.model=x"])
