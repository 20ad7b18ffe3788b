"""The hard-negative objective (seed 004, chapter 3: E5's second stage; SPEC "Hard negatives and distillation"), each
term a plain function over tensors.

A batch is G groups of 1 positive + H mined negatives. Every query scores every passage of the (global) batch:
its own positive is the InfoNCE target, and every other passage, its own negatives and the other groups' positives
and negatives, is a negative. When the negatives carry cross-encoder teacher scores, a KL term pulls the student's
distribution over the query's own candidate list (positive + its H negatives) towards the teacher's:

    L = alpha * InfoNCE + (1 - alpha) * KL(softmax(teacher logits) || softmax(cos / tau))

Hand check (seed 004's worked example; ``tests/test_distill.py``): one query, four candidates, teacher logits
(8.2, 5.1, 4.6, -1.3), student cosines (0.71, 0.68, 0.55, 0.12): KL = 0.294 at tau 0.01 and 0.2785 at tau 0.05;
InfoNCE over the four = -ln(0.95257) = 0.0486 at tau 0.01.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def candidate_kl(teacher_logits: torch.Tensor, student_cosines: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over queries of KL(P || Q), P = softmax(teacher logits), Q = softmax(student cosines / tau).

    Args:
        teacher_logits: (G, M) the cross-encoder's logits of each query's M candidates (positive first).
        student_cosines: (G, M) the student's cosines of the same pairs.
        tau: the student's temperature (the teacher's logits are used as they are).

    Returns:
        scalar tensor (nats).
    """
    p_log = F.log_softmax(teacher_logits.float(), dim=-1)
    q_log = F.log_softmax(student_cosines.float() / tau, dim=-1)
    return torch.sum(p_log.exp() * (p_log - q_log), dim=-1).mean()


def batch_logits(queries: torch.Tensor, passages: torch.Tensor, tau: float, doc_ids: torch.Tensor | None = None,
                 passage_keys: torch.Tensor | None = None, query_keys: torch.Tensor | None = None) -> torch.Tensor:
    """(G, G * (1 + H)) logits q_g . p / tau of every query against every passage of the batch, with the in-batch
    false negatives masked (-inf): the positives of other groups of the query's own document (``doc_ids``; seed
    000 masks same-document groups the same way), every passage whose text is the query's own positive's
    (``passage_keys``: hashes of the normalised texts), and every passage whose text is the query's own
    (``query_keys``: a mined anchor is often another group's negative, and it scores ~1 against itself); never the
    positive itself.

    Args:
        queries: (G, dim) unit vectors.
        passages: (G * (1 + H), dim) unit vectors, group-major: group g's positive at row g * (1 + H), then its H
            negatives.
        tau: temperature.
        doc_ids: (G,) int64 document hashes, or None (no document masking).
        passage_keys: (G * (1 + H),) int64 text hashes, or None (no duplicate masking).
        query_keys: (G,) int64 text hashes of the queries (same hash), or None.
    """
    g = queries.shape[0]
    per_group = passages.shape[0] // g
    logits = queries.float() @ passages.float().T / tau  # (G, G * (1 + H))
    own = torch.arange(g, device=queries.device) * per_group  # (G,) column of each query's positive
    mask = torch.zeros_like(logits, dtype=torch.bool)
    if doc_ids is not None:
        same_doc = doc_ids.unsqueeze(1) == doc_ids.unsqueeze(0)  # (G, G)
        mask[:, own] |= same_doc
    if passage_keys is not None:
        mask |= passage_keys.unsqueeze(0) == passage_keys[own].unsqueeze(1)
        if query_keys is not None:
            mask |= passage_keys.unsqueeze(0) == query_keys.unsqueeze(1)
    mask[torch.arange(g), own] = False
    return logits.masked_fill(mask, float("-inf"))


def grouped_info_nce(queries: torch.Tensor, passages: torch.Tensor, tau: float, doc_ids: torch.Tensor | None = None,
                     passage_keys: torch.Tensor | None = None, query_keys: torch.Tensor | None = None) -> torch.Tensor:
    """InfoNCE of G queries against all G * (1 + H) passages of the batch (:func:`batch_logits`, masks included).

    Returns:
        scalar tensor: mean over queries of -log softmax(logits_g)[g * (1 + H)].
    """
    g = queries.shape[0]
    target = torch.arange(g, device=queries.device) * (passages.shape[0] // g)
    return F.cross_entropy(batch_logits(queries, passages, tau, doc_ids, passage_keys, query_keys), target)


def own_candidate_cosines(queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
    """(G, 1 + H): each query's cosines with its own positive and negatives (unit vectors in, layout as
    :func:`grouped_info_nce`)."""
    g, dim = queries.shape
    own = passages.view(g, -1, dim)  # (G, 1 + H, dim)
    return torch.einsum("gd,gmd->gm", queries.float(), own.float())


def hard_negative_loss(queries: torch.Tensor, passages: torch.Tensor, teacher_logits: torch.Tensor | None,
                       alpha: float, tau: float, doc_ids: torch.Tensor | None = None,
                       passage_keys: torch.Tensor | None = None, query_keys: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """alpha * InfoNCE + (1 - alpha) * KL, the KL only when teacher logits exist (else the loss is InfoNCE alone).

    Args:
        queries, passages, doc_ids, passage_keys, query_keys: as :func:`batch_logits` (the global batch).
        teacher_logits: (G, 1 + H) or None.
        alpha, tau: the mix and the temperature.

    Returns:
        {"loss", "l_nce", "l_kl" (0 without a teacher), "p_positive" (mean softmax probability of the positive)}.
    """
    logits = batch_logits(queries, passages, tau, doc_ids, passage_keys, query_keys)
    g = queries.shape[0]
    own = torch.arange(g, device=queries.device) * (passages.shape[0] // g)
    l_nce = F.cross_entropy(logits, own)
    if teacher_logits is None:
        l_kl, loss = torch.zeros((), device=queries.device), l_nce
    else:
        l_kl = candidate_kl(teacher_logits, own_candidate_cosines(queries, passages), tau)
        loss = alpha * l_nce + (1 - alpha) * l_kl
    with torch.no_grad():
        p_pos = torch.softmax(logits, dim=-1)[torch.arange(g), own].mean()
    return {"loss": loss, "l_nce": l_nce, "l_kl": l_kl, "p_positive": p_pos}
