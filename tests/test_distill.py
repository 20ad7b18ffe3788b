"""The hard-negative objective's terms by hand (pipeline/distill.py; seed 004 chapter 3's worked example)."""

import math

import pytest
import torch

from pairmine.pipeline.distill import batch_logits, candidate_kl, grouped_info_nce, hard_negative_loss

TEACHER = torch.tensor([[8.2, 5.1, 4.6, -1.3]])  # the gold passage, a secretly relevant one, two others
STUDENT = torch.tensor([[0.71, 0.68, 0.55, 0.12]])


def _unit_vectors(cosines: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A query e0 and one passage per cosine: cos_i e0 + sqrt(1 - cos_i^2) e_(i+1) (unit vectors, exact cosines)."""
    dim = len(cosines) + 1
    q = torch.zeros(1, dim, dtype=torch.float64)
    q[0, 0] = 1
    p = torch.zeros(len(cosines), dim, dtype=torch.float64)
    for i, c in enumerate(cosines):
        p[i, 0], p[i, i + 1] = c, math.sqrt(1 - c * c)
    return q, p


def test_seed_004_worked_example():
    # Teacher distribution 0.9325 / 0.0420 / 0.0255 / 0.0000698; KL against the student at tau 0.01 and 0.05.
    assert torch.softmax(TEACHER, -1)[0].tolist() == pytest.approx([0.9325, 0.0420, 0.0255, 0.0000698], abs=1e-4)
    assert candidate_kl(TEACHER, STUDENT, 0.01).item() == pytest.approx(0.294, abs=5e-4)
    assert candidate_kl(TEACHER, STUDENT, 0.05).item() == pytest.approx(0.2785, abs=5e-4)
    # InfoNCE with the gold first, over the same four at tau 0.01: -ln(0.95257) = 0.0486.
    q, p = _unit_vectors(STUDENT[0].tolist())
    assert grouped_info_nce(q, p, 0.01).item() == pytest.approx(0.0486, abs=5e-4)
    terms = hard_negative_loss(q, p, TEACHER, alpha=0.5, tau=0.01)
    assert terms["loss"].item() == pytest.approx(0.5 * 0.0486 + 0.5 * 0.294, abs=5e-4)
    assert terms["p_positive"].item() == pytest.approx(0.95257, abs=1e-4)
    assert hard_negative_loss(q, p, None, alpha=0.5, tau=0.01)["loss"].item() == pytest.approx(0.0486, abs=5e-4)


def test_in_batch_false_negatives_are_masked():
    # Two groups of 1 positive + 1 negative: passages [p0, n0, p1, n1]. Query 1's text is n0 (a repeated anchor).
    q = torch.eye(4, dtype=torch.float64)[:2]
    p = torch.eye(4, dtype=torch.float64)
    logits = batch_logits(q, p, 1.0)
    assert torch.isfinite(logits).all()
    docs = torch.tensor([7, 7])  # both groups from one document: each other's positive is masked
    keys = torch.tensor([10, 11, 12, 13])
    masked = batch_logits(q, p, 1.0, docs, keys, query_keys=torch.tensor([99, 11]))
    assert torch.isinf(masked[0, 2]) and torch.isinf(masked[1, 0])  # the other group's positive, same document
    assert torch.isinf(masked[1, 1])  # n0 has query 1's own text
    assert torch.isfinite(masked[0, 0]) and torch.isfinite(masked[1, 2])  # never the own positive
    assert torch.isfinite(masked[0, 1]) and torch.isfinite(masked[0, 3])  # ordinary negatives stay
    # A duplicate of the own positive elsewhere in the batch is masked too.
    dup = batch_logits(q, p, 1.0, None, torch.tensor([10, 11, 12, 10]))
    assert torch.isinf(dup[0, 3]) and torch.isfinite(dup[1, 3])
