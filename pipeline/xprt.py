"""The xPRT objective as plain functions over tensors (seed 000, "The objective"; SPEC "Training job").

Every term of the training loss lives here, with no model, no Ray and no data loading, so that tests can call each
one with numbers a person can check by hand. ``pipeline/xprt_model.py`` produces the tensors (vectors, logits),
``pipeline/train.py`` combines the terms with the weights of ``[loss]``.

    L_xp         symmetric InfoNCE, anchor vs its positive s1, in-batch negatives, same-document groups masked out
    L_cross      cross-entropy of the one-layer decoder's predictions of a 60%-masked passage (logits from the model)
    L_self       KL(encoder's word distribution || decoder's) at the masked positions, the passage's own vector
    L_MLM        cross-entropy of the encoder's own 15%-masked passes
    L_unif       Wang & Isola uniformity of the batch's anchor vectors
    retention    KL(frozen || current) of anchor-by-s1 similarity distributions, row- and column-wise, averaged;
                 weight falling linearly from 40 to 0

Vectors that enter the batch-level terms (L_xp, L_unif, retention) are gathered across workers with
:func:`gather_with_grad`, so the negatives span the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of positions that carry no loss (HuggingFace's convention)


def mask_tokens(
    input_ids: torch.Tensor,
    special: torch.Tensor,
    rate: float,
    generator: torch.Generator,
    mask_token_id: int,
    vocab_size: int,
    random_frac: float = 0.0,
    keep_frac: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask an exact share of each passage's tokens, seeded.

    In every row, ``round(rate * n)`` of its ``n`` maskable tokens are chosen (at least 1 when ``n >= 1``), uniformly
    at random without replacement; special tokens ([CLS], [SEP]) and padding (``special`` True) are never chosen.
    A chosen token becomes [MASK] with probability ``1 - random_frac - keep_frac``, a uniformly random vocabulary id
    with probability ``random_frac``, and stays itself with probability ``keep_frac``: BERT's 80/10/10 is
    ``random_frac = keep_frac = 0.1`` (used for the encoder's 15% passes, the MLM setting); plain [MASK] is
    ``0, 0`` (used for the decoder's 60% passes, where the conditioning vector must supply the words).

    Args:
        input_ids: (batch, seq) token ids.
        special: (batch, seq) bool, True for special tokens and padding.
        rate: share of maskable tokens to choose, in [0, 1].
        generator: a seeded CPU ``torch.Generator``: the same seed gives the same masks.
        mask_token_id, vocab_size: the tokenizer's [MASK] id and vocabulary size.

    Returns:
        (masked_ids (batch, seq), chosen (batch, seq) bool): the chosen positions are the prediction targets; their
        labels are ``input_ids[chosen]``.
    """
    if not 0.0 <= rate <= 1.0 or random_frac < 0 or keep_frac < 0 or random_frac + keep_frac > 1:
        raise ValueError(f"bad masking rates: rate={rate}, random_frac={random_frac}, keep_frac={keep_frac}")
    maskable = ~special  # (batch, seq)
    n = maskable.sum(1)  # (batch,)
    k = torch.minimum(torch.round(n.double() * rate).long().clamp(min=1 if rate > 0 else 0), n)  # (batch,)
    scores = torch.rand(input_ids.shape, generator=generator)  # (batch, seq)
    scores = scores.masked_fill(~maskable, 2.0)  # special tokens and padding sort last
    rank = scores.argsort(1).argsort(1)  # (batch, seq) rank of each position's score in its row
    chosen = rank < k.unsqueeze(1)  # (batch, seq)
    u = torch.rand(input_ids.shape, generator=generator)  # (batch, seq)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator)  # (batch, seq)
    to_mask = chosen & (u < 1.0 - random_frac - keep_frac)
    to_random = chosen & (u >= 1.0 - random_frac - keep_frac) & (u < 1.0 - keep_frac)
    masked = input_ids.masked_fill(to_mask, mask_token_id)  # (batch, seq)
    masked = torch.where(to_random, random_ids, masked)  # (batch, seq)
    return masked, chosen


def info_nce_symmetric(anchors: torch.Tensor, positives: torch.Tensor, doc_ids: torch.Tensor, tau: float = 0.05,
                       mask_same_doc: bool = True) -> torch.Tensor:
    """L_xp: symmetric InfoNCE between each anchor and its positive s1 (seed 000, "The objective").

    Row i of ``anchors @ positives.T / tau`` must pick column i (anchor -> its s1 among the batch's s1s) and column
    i must pick row i (s1 -> its anchor among the batch's anchors); the two cross-entropies are averaged. Groups of
    the same document are related too, so with ``mask_same_doc`` they are removed from each other's negatives.

    Hand check (SPEC): 3 groups of 3 documents, cos(a, own s1) = 0.8, 0.5 to the others, tau = 0.05: logits 16 vs
    10, 10; P(positive) = e^16 / (e^16 + 2 e^10) = 0.99505, loss = -log 0.99505 = 0.00496 in both directions.

    Args:
        anchors, positives: (groups, dim) L2-normalised vectors, row i of both from group i.
        doc_ids: (groups,) int64 document ids (hashed); equal ids mark groups of the same document.

    Returns:
        scalar loss (float32).
    """
    logits = anchors.float() @ positives.float().T / tau  # (groups, groups)
    if mask_same_doc:
        same = doc_ids.unsqueeze(0) == doc_ids.unsqueeze(1)  # (groups, groups)
        same.fill_diagonal_(False)  # the positive itself stays
        logits = logits.masked_fill(same, float("-inf"))  # (groups, groups)
    target = torch.arange(len(logits), device=logits.device)  # (groups,)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def positive_probability(anchors: torch.Tensor, positives: torch.Tensor, doc_ids: torch.Tensor, tau: float = 0.05,
                         mask_same_doc: bool = True) -> torch.Tensor:
    """Mean softmax probability of the positive, anchor -> s1 direction (a readable training metric)."""
    logits = anchors.float() @ positives.float().T / tau  # (groups, groups)
    if mask_same_doc:
        same = doc_ids.unsqueeze(0) == doc_ids.unsqueeze(1)  # (groups, groups)
        same.fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
    return logits.softmax(1).diagonal().mean()


def uniformity(vectors: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """L_unif (Wang & Isola 2020): log of the mean over pairs i < j of exp(-t * |x_i - x_j|^2).

    Lower is more uniform. Hand check: orthonormal vectors are all at squared distance 2, so the loss is -2t (= -4
    with t = 2); identical vectors give log 1 = 0.

    Args:
        vectors: (n, dim) L2-normalised vectors, n >= 2 (the batch's anchors).

    Returns:
        scalar loss (float32).
    """
    if len(vectors) < 2:
        raise ValueError("uniformity needs at least 2 vectors")
    sq = torch.pdist(vectors.float(), p=2).pow(2)  # (n * (n - 1) / 2,)
    return sq.mul(-t).exp().mean().log()


def retention_kl(anchors: torch.Tensor, positives: torch.Tensor, frozen_anchors: torch.Tensor,
                 frozen_positives: torch.Tensor, tau: float = 0.05) -> torch.Tensor:
    """Retention term: pull the current model's anchor-by-s1 similarities toward the frozen starting model's.

    Both models give a (groups, groups) similarity matrix anchors @ positives.T / tau. Row-wise softmax: which s1
    each anchor resembles; column-wise softmax: which anchor each s1 resembles. KL(frozen || current) in each
    direction (mean over rows, resp. columns), averaged (seed 000: "a KL from E5's distribution to the current
    model's ... the two are averaged"). It is exactly 0 when the current vectors equal the frozen ones.

    Args:
        anchors, positives: (groups, dim) current model's L2-normalised vectors (with gradient).
        frozen_anchors, frozen_positives: (groups, dim) frozen model's vectors of the same, unmasked, passages.

    Returns:
        scalar loss (float32).
    """
    cur = anchors.float() @ positives.float().T / tau  # (groups, groups)
    frz = frozen_anchors.float() @ frozen_positives.float().T / tau  # (groups, groups)
    rows = F.kl_div(cur.log_softmax(1), frz.log_softmax(1), log_target=True, reduction="batchmean")
    cols = F.kl_div(cur.T.log_softmax(1), frz.T.log_softmax(1), log_target=True, reduction="batchmean")
    return 0.5 * (rows + cols)


def retention_weight(step: int, total_steps: int, start: float = 40.0, end: float = 0.0) -> float:
    """Weight of the retention term at 0-based ``step`` of ``total_steps``: ``start`` at the first step, falling
    linearly to ``end`` at the last (seed 000: "falls from 40 to 0 over training")."""
    if total_steps <= 1:
        return start
    return start + (end - start) * min(max(step / (total_steps - 1), 0.0), 1.0)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predictions at masked positions (L_MLM on the encoder, L_cross on the decoder).

    Args:
        logits: (n_masked, vocab). labels: (n_masked,) true token ids.
    """
    if len(labels) == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), labels)


def self_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """L_self: KL(teacher || student) per masked position, averaged; the teacher (the encoder's own word
    distribution under its 15% mask) gets no gradient from this term (it is kept honest by L_MLM instead).

    Args:
        student_logits: (n_masked, vocab) decoder predictions. teacher_logits: (n_masked, vocab) encoder's.
    """
    if len(student_logits) == 0:
        return student_logits.sum() * 0.0
    teacher = teacher_logits.detach().float().log_softmax(-1)  # (n_masked, vocab)
    return F.kl_div(student_logits.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All workers' ``x`` concatenated in rank order; the local slice keeps its gradient, the others are constants.

    Without an initialised process group (one worker), returns ``x``. Every worker must pass the same shape.
    A loss of the gathered tensors, back-propagated on every worker, gives each worker the gradient through its own
    rows only; DDP then averages over workers, so the trainer scales such global-batch terms by the world size
    (see ``pipeline/train.py``).

    Args:
        x: (n, ...) local rows.

    Returns:
        (world_size * n, ...).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts)


def head_rows_per_chunk(vocab_size: int, chunk_mb: float) -> int:
    """Rows of (rows, vocab) fp32 logits that fit in ``chunk_mb`` MiB (at least 1): the chunk of
    :func:`chunked_head_cross_entropy` and :func:`chunked_head_self_kl` (``loss.head_chunk_mb``)."""
    return max(1, int(chunk_mb * 2**20 // (4 * max(1, vocab_size))))


def decoder_rows_per_chunk(heads: int, seq_len: int, chunk_mb: float) -> int:
    """Decoder rows (passages) of the checkpointed decoder layer recomputed at once in the backward pass, so that
    their attention (rows x heads x seq_len^2 fp32 probabilities, with dropout's mask and the gradient: ~3 such
    tensors) fits in ``chunk_mb`` MiB (``loss.head_chunk_mb``; at least 1 row). 12 heads at 260 positions (256 tokens
    + 4 conditioning vectors) and 256 MiB: 27 rows. Measured: with the whole batch's rows recomputed at once, the 8 cross and
    2 self rows per group were ~1.3 of the 2.9 GiB of a default step at batch 8 (docs/benchmarks.md, "Training
    memory")."""
    per_row = 3 * 4 * max(1, heads) * max(1, seq_len) ** 2
    return max(1, int(chunk_mb * 2**20 // per_row))


def _chunks(n: int, rows: int):
    return [(i, min(n, i + rows)) for i in range(0, n, rows)]


def _ce_sum(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum")


def _kl_sum(head, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the teacher gets no gradient from L_self
        target = head(teacher).float().log_softmax(-1)  # (rows, vocab)
    return F.kl_div(head(student).float().log_softmax(-1), target, log_target=True, reduction="sum")


def _chunked_sum(fn, head, a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    spans = _chunks(len(a), rows)
    if len(spans) == 1:  # one chunk: nothing to bound, no recomputation
        return fn(head, a, b)
    return torch.stack([checkpoint(fn, head, a[i:j], b[i:j], use_reentrant=False) for i, j in spans]).sum()


def chunked_head_cross_entropy(head, hidden: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
    """L_MLM / L_cross through the MLM head, ``rows`` masked positions at a time: the mean cross-entropy of
    ``head(hidden)`` against ``labels``, equal to ``masked_lm_loss(head(hidden), labels)`` within float tolerance,
    value and gradients (tests/test_xprt.py), while no (masked rows x vocab) tensor larger than ``rows x vocab`` is
    ever held: each chunk's logits, log-softmax and their gradient are recomputed in the backward pass (activation
    checkpointing, ``torch.utils.checkpoint``) instead of kept. One chunk is computed directly.

    Args:
        head: the MLM head, (n, dim) -> (n, vocab) logits.
        hidden: (n_masked, dim) hidden states at the masked positions.
        labels: (n_masked,) true token ids.
        rows: chunk size in rows (:func:`head_rows_per_chunk`).

    Returns:
        scalar float32 loss; 0 (with a graph) when there is no masked position.
    """
    if len(labels) == 0:
        return hidden.sum() * 0.0
    return _chunked_sum(_ce_sum, head, hidden, labels, rows) / len(labels)


def chunked_head_self_kl(head, student: torch.Tensor, teacher: torch.Tensor, rows: int) -> torch.Tensor:
    """L_self through the MLM head, ``rows`` positions at a time: KL(teacher || student) of the word distributions
    ``head(teacher)`` (the encoder's own 15%-masked pass, no gradient) and ``head(student)`` (the decoder's),
    averaged over positions; equal to ``self_distillation_loss(head(student), head(teacher))`` within float
    tolerance, with the memory bound of :func:`chunked_head_cross_entropy`.

    Args:
        head: the MLM head. student: (n, dim) decoder hidden states. teacher: (n, dim) encoder hidden states at the
            same positions (detached here).
        rows: chunk size in rows.

    Returns:
        scalar float32 loss; 0 (with a graph) when there is no position.
    """
    if len(student) == 0:
        return student.sum() * 0.0
    return _chunked_sum(_kl_sum, head, student, teacher.detach(), rows) / len(student)
