"""The Revela objective as plain functions over tensors (seed 001, sections 3.1-3.4 and 4.1; SPEC "Other objectives
trained on the same groups"; issue 12 item 2).

Revela trains a retriever through language modelling: a causal LM predicts each sequence D_i of a batch while an
in-batch attention lets it read the batch's other sequences D_j, weighted by the retriever's similarities
Sim(D_i, D_j). The next-token-prediction loss of that in-batch stream is the only loss; the retriever learns through
it alone (Sim is its only way in). These functions take vectors, queries, keys and values, with no model, no Ray and
no data loading, so that tests can check each one by hand; ``pipeline/revela_model.py`` runs them inside every
attention layer of a HuggingFace decoder.

    cosine_matrix        S_ij = h~_i . h~_j of the retriever's L2-normalised vectors (seed 001 section 3.3)
    batch_similarity     Sim(D_i, D_j) = exp(S_ij / tau) / sum_{k != i} exp(S_ik / tau), Sim(D_i, D_i) = 0
                         (section 3.3)
    attention            softmax(Q K^T / sqrt(d_H)) V under a boolean mask: eq. 4 (causal, the plain stream), the
                         in-batch stream's own-prefix term s_i (between eq. 4 and 5), eq. 5 (full, b_ij)
    cross_document_outputs  b_ij = softmax(Q_i^h K_j^e^T / sqrt(d_H)) V_j^e for every pair (eq. 5)
    cross_document_attention b_i = sum_{j != i} Sim(D_i, D_j) b_ij (eq. 6), optionally V-normalised (eq. 8-9)
    in_batch_attention   h_i = s_i + b_i (eq. 7), for one layer and every head
    ntp_loss             next-token cross-entropy of a stream's logits (eq. 1 for the plain stream, eq. 2 for the
                         in-batch stream, which Revela trains)

Shapes: B sequences, H heads, L tokens per sequence (right-padded), d_H = d / H per head. The projections
(eq. 3: Q = e W^Q, K = e W^K, V = e W^V; the in-batch stream uses the same W's on h) and the rotary position
embedding of the model are applied by the caller, so these functions see per-head Q, K, V.

Choices the seed leaves open (each stated where it is made):
  * padding tokens of D_j are never attended to (eq. 5's "full attention mask" covers D_j's real tokens);
  * eq. 6 sums over j != i only; Sim(D_i, D_i) = 0 makes the diagonal term vanish exactly, and it is also skipped;
  * positions: the in-batch stream of D_i uses D_i's own positions 0..L-1, and K_j^e are the keys D_j's own
    self-attention uses (rotated at D_j's positions): "cached keys K_j^e" (section 3.2);
  * V-normalisation (appendix B.5, eq. 8-9) is off by default: eq. 3-7 are the method, the seed uses eq. 8-9 on
    Wikipedia only and reports code retrieval better without it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100  # label of positions that carry no loss (HuggingFace's convention)


def cosine_matrix(vectors: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarities of the retriever's vectors (seed 001 section 3.3, step 2):
    h~_i = h_i / ||h_i||_2, S_ij = h~_i . h~_j.

    Args:
        vectors: (B, d_E) retriever vectors h_i = E_Theta(D_i), any norm (not all zero).

    Returns:
        (B, B) S, in [-1, 1], 1 on the diagonal.
    """
    unit = F.normalize(vectors, dim=-1)
    return unit @ unit.T


def batch_similarity(vectors: torch.Tensor, tau: float) -> torch.Tensor:
    """Sim(D_i, D_j) = exp(S_ij / tau) / sum_{k != i} exp(S_ik / tau) (seed 001 section 3.3, step 3), a
    softmax over the other sequences of the batch: the diagonal is excluded (Sim(D_i, D_i) = 0) and every row sums
    to 1 over j != i. Computed as a log-softmax with the diagonal at -inf, so the seed's tau = 1e-4 (scores up to
    1e4) neither overflows nor underflows to NaN.

    Args:
        vectors: (B, d_E) retriever vectors, B >= 2.
        tau: temperature > 0 (seed 001 section 4.1: 1e-4).

    Returns:
        (B, B) Sim, rows summing to 1, zero diagonal; differentiable in ``vectors`` (the retriever's only gradient).

    Raises:
        ValueError: B < 2 (no other sequence to attend to) or tau <= 0.
    """
    if vectors.shape[0] < 2:
        raise ValueError(f"Revela needs at least 2 sequences per batch, got {vectors.shape[0]}")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    s = cosine_matrix(vectors) / tau
    eye = torch.eye(len(s), dtype=torch.bool, device=s.device)
    return torch.softmax(s.masked_fill(eye, float("-inf")), dim=-1)


def causal_mask(lengths_mask: torch.Tensor) -> torch.Tensor:
    """The plain stream's mask (eq. 4) and the in-batch stream's own-prefix mask (s_i): token k attends to the real
    tokens 0..k of its own sequence.

    Args:
        lengths_mask: (B, L) attention mask, 1 (True) for real tokens, right-padded.

    Returns:
        (B, 1, L, L) bool, True where query k may attend to key m (m <= k and m real); broadcast over heads.
    """
    b, n = lengths_mask.shape
    tri = torch.ones(n, n, dtype=torch.bool, device=lengths_mask.device).tril()
    return tri[None, None] & lengths_mask.bool()[:, None, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_H)) V under a boolean mask (seed 001 eq. 4 with a causal mask; the in-batch stream's
    s_i^l with its own causal mask; eq. 5 with a full mask over D_j's real tokens).

    Args:
        q: (..., Lq, d_H) queries; k: (..., Lk, d_H) keys; v: (..., Lk, d_v) values.
        mask: bool, broadcastable to (..., Lq, Lk), True where a query may attend to a key. A query row with no
            allowed key (a padding query of a left-padded batch) outputs 0 rather than NaN.

    Returns:
        (..., Lq, d_v).
    """
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return weights @ v


def pair_weights(q_h: torch.Tensor, k_e: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """softmax(Q_i^h K_j^e^T / sqrt(d_H)) for every pair (i, j) over D_j's real tokens: the attention weights of
    seed 001 eq. 5, shared by :func:`cross_document_outputs` and :func:`cross_document_attention`.

    Args:
        q_h: (B, H, L, d_H) in-batch queries; k_e: (B, H, L, d_H) plain-stream keys; key_mask: (B, L) real tokens.

    Returns:
        (B_i, B_j, H, L, L) weights, each row summing to 1 over D_j's real tokens.
    """
    logits = torch.einsum("ihqd,jhkd->ijhqk", q_h, k_e) / math.sqrt(q_h.shape[-1])
    logits = logits.masked_fill(~key_mask.bool()[None, :, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


def cross_document_outputs(q_h: torch.Tensor, k_e: torch.Tensor, v_e: torch.Tensor, key_mask: torch.Tensor
                           ) -> torch.Tensor:
    """b_ij = softmax(Q_i^h K_j^e^T / sqrt(d_H)) V_j^e (seed 001 eq. 5) for every pair (i, j), with a full
    attention mask over D_j's real tokens: each of D_i's in-batch queries sees all of D_j.

    Args:
        q_h: (B, H, L, d_H) the in-batch stream's queries Q_i^h = h_i^{l-1} W^Q.
        k_e, v_e: (B, H, L, d_H) the plain stream's keys and values K_j^e = e_j^{l-1} W^K, V_j^e = e_j^{l-1} W^V.
        key_mask: (B, L) 1 (True) for D_j's real tokens.

    Returns:
        (B_i, B_j, H, L, d_H) b_ij (the diagonal i = j included here; eq. 6 drops it).
    """
    return torch.einsum("ijhqk,jhkd->ijhqd", pair_weights(q_h, k_e, key_mask), v_e)


def cross_document_attention(q_h: torch.Tensor, k_e: torch.Tensor, v_e: torch.Tensor, key_mask: torch.Tensor,
                             sim: torch.Tensor, v_norm_eps: float | None = None) -> torch.Tensor:
    """b_i = sum_{j != i} Sim(D_i, D_j) b_ij (seed 001 eq. 6, with b_ij of eq. 5), without materialising every b_ij:
    the attention weights of each pair are scaled by Sim(D_i, D_j) and contracted with V_j^e in one einsum.

    With ``v_norm_eps`` set, the V-normalised variant of appendix B.5 (eq. 8-9): b~_ij = b_ij / (N_ij + eps),
    N_ij = softmax(Q_i^h K_j^e^T / sqrt(d_H)) ||V_j^e||_2 (per query token and head: the attention-weighted mean
    norm of D_j's value vectors), b_i = sum_{j != i} Sim(D_i, D_j) b~_ij; the seed's eps is 1e-6.

    Args:
        q_h: (B, H, L, d_H); k_e, v_e: (B, H, L, d_H); key_mask: (B, L) real tokens of each D_j.
        sim: (B, B) Sim from :func:`batch_similarity` (its diagonal is ignored: j != i).
        v_norm_eps: None (eq. 6, the default) or eps of eq. 8.

    Returns:
        (B, H, L, d_H) b_i.

    Memory: the (B, B, H, L, L) attention weights of every pair are held for the backward pass (B = 16 passages of
    160 tokens and 14 heads: 0.37 GB per layer in fp32), as in the seed's duplicated-documents implementation.
    """
    weights = pair_weights(q_h, k_e, key_mask)  # (B_i, B_j, H, L, L)
    off = ~torch.eye(len(sim), dtype=torch.bool, device=sim.device)
    w = sim.masked_fill(~off, 0.0).to(weights.dtype)  # (B_i, B_j): j != i only
    if v_norm_eps is not None:
        norms = v_e.norm(dim=-1)  # (B_j, H, L) ||V_j^e||_2 per token
        n_ij = torch.einsum("ijhqk,jhk->ijhq", weights, norms)  # (B_i, B_j, H, L)
        weights = weights / (n_ij[..., None] + v_norm_eps)
    return torch.einsum("ijhqk,ij,jhkd->ihqd", weights, w, v_e)


def in_batch_attention(q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor, k_e: torch.Tensor,
                       v_e: torch.Tensor, attention_mask: torch.Tensor, sim: torch.Tensor,
                       v_norm_eps: float | None = None) -> torch.Tensor:
    """The in-batch attention of one layer (seed 001 section 3.2): h_i^l = s_i^l + b_i^l (eq. 7), where
    s_i^l = softmax(Q_i^h K_i^h^T / sqrt(d_H)) V_i^h attends causally to D_i's own prefix in the in-batch stream
    (same W^Q, W^K, W^V as the self-attention, eq. 3) and b_i^l is the Sim-weighted cross-document attention to the
    other sequences' self-attention keys and values (eq. 5-6). The two softmaxes are separate, as written in eq. 5
    and 7 (not one softmax over the concatenated keys); the sum is what the layer's output projection receives.

    Args:
        q_h, k_h, v_h: (B, H, L, d_H) the in-batch stream's queries, keys, values.
        k_e, v_e: (B, H, L, d_H) the plain stream's keys and values of the same layer.
        attention_mask: (B, L) 1 for real tokens (right-padded).
        sim: (B, B) Sim(D_i, D_j).
        v_norm_eps: see :func:`cross_document_attention`.

    Returns:
        (B, H, L, d_H) h_i^l per head, before the output projection.
    """
    s = attention(q_h, k_h, v_h, causal_mask(attention_mask))
    return s + cross_document_attention(q_h, k_e, v_e, attention_mask, sim, v_norm_eps)


def ntp_loss(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Next-token prediction: mean cross-entropy of token l+1 given the logits at l, over the real tokens of every
    sequence (seed 001 eq. 1 on the plain stream; eq. 2, P_R(x_l^i) = P(x_l^i | x_<l^i, {D_j}_{j != i}), on the
    in-batch stream, Revela's only loss).

    Args:
        logits: (B, L, vocab); input_ids: (B, L); attention_mask: (B, L), right-padded.

    Returns:
        scalar mean loss in nats per predicted token.

    Raises:
        ValueError: no sequence has two real tokens (nothing to predict).
    """
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE)  # (B, L - 1)
    if not (labels != IGNORE).any():
        raise ValueError("no sequence has a token to predict (every sequence is shorter than 2 tokens)")
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE)
