"""The model trained by xPRT: a HuggingFace encoder, its MLM head, the conditioning map and a one-layer decoder
(seed 000, "The objective"; SPEC "Training job").

    encoder      any HuggingFace BERT-style encoder (AutoModel), the model that is exported
    mlm head     the checkpoint's own masked-LM head (AutoModelForMaskedLM); a fresh one when it has none (logged)
    cond         Linear(dim, n_cond * dim): a sentence vector -> n_cond (4) conditioning vectors
    decoder      one transformer layer; its input is the encoder's embedding module applied to a 60%-masked passage
                 (so the token embedding table is shared) with the conditioning vectors inserted right after [CLS];
                 its output goes through the same MLM head

One forward call does the 5 encoder passes of a batch of groups (anchor, positive, 3 more related passages, each
once with a 15% mask) and the 10 decoder passes (4 anchor -> related, 4 related -> anchor, 2 self), and returns
only what the losses need: vectors, and logits at masked positions (never the full (rows, seq, vocab) tensor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pairmine.operators.embed import mean_pool
from pairmine.operators.errors import PairmineError

log = logging.getLogger("pairmine")


class UnsupportedModelError(PairmineError, ValueError):
    """The model has no masked-LM head class pairmine can use (the message names the model type). User-fixable:
    another ``train.model``."""


def load_encoder_and_head(path: str, trust_remote_code: bool = False) -> tuple[nn.Module, nn.Module, bool]:
    """Load ``path`` as an encoder (``AutoModel``, exactly what is exported) and its MLM head
    (``AutoModelForMaskedLM``), with the head's output projection tied to the encoder's token embeddings.

    Returns:
        (encoder, head, fresh): ``fresh`` is True when the checkpoint had no MLM head weights and a new head was
        created (the log says so).

    Raises:
        UnsupportedModelError: the masked-LM class of this model type is missing or has no single head module.
    """
    import transformers
    from transformers import AutoModel, AutoModelForMaskedLM

    transformers.logging.disable_progress_bar()
    encoder = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report of a head-less checkpoint is replaced by one line
    try:
        mlm, info = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                         output_loading_info=True)
    except ValueError as e:
        raise UnsupportedModelError(f"model {path} ({encoder.config.model_type}) has no masked-LM class: {e}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    heads = [(name, m) for name, m in mlm.named_children() if m is not mlm.base_model]
    if len(heads) != 1:
        raise UnsupportedModelError(
            f"model {path} ({encoder.config.model_type}): expected one MLM head module next to the encoder, found "
            f"{[n for n, _ in heads]}")
    name, head = heads[0]
    missing = sorted(k for k in info["missing_keys"] if k.startswith(name + "."))
    fresh = bool(missing) and len(missing) >= 2  # a tied output weight alone is not "missing"
    if fresh:
        log.warning("model %s has no MLM head in its checkpoint: created a fresh one (%s.*, %d tensors), trained with "
                    "the new modules' learning rate", path, name, len(missing))
    out = mlm.get_output_embeddings()
    if out is not None and getattr(encoder.config, "tie_word_embeddings", True):
        out.weight = encoder.get_input_embeddings().weight  # the head predicts through the shared token table
    del mlm
    # A pooler (BERT's [CLS] dense layer) is not used by mean pooling: frozen, exported unchanged.
    pooler = getattr(encoder, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)
    return encoder, head, fresh


def build_scratch_encoder(tokenizer, layers: int, hidden: int, heads: int, intermediate: int, max_length: int,
                          seed: int, with_head: bool) -> tuple[nn.Module, nn.Module | None]:
    """A randomly initialised BERT encoder over ``tokenizer``'s vocabulary (the ablation's ``scratch`` regime: seed
    000's "continued from BERT" row, scaled down), and, with ``with_head``, a fresh BERT MLM head tied to its token
    embeddings.

    Args:
        tokenizer: a HuggingFace tokenizer (its vocabulary size and pad id set the embedding table).
        layers, hidden, heads, intermediate: BertConfig's num_hidden_layers, hidden_size, num_attention_heads,
            intermediate_size (``train.scratch_*``).
        max_length: tokens per passage; position embeddings cover at least this (and 512 at least).
        seed: torch seed of the initialisation (the same start on every worker and in every arm).

    Returns:
        (encoder: transformers.BertModel, head: BertOnlyMLMHead or None).

    Raises:
        ValueError: ``hidden`` not divisible by ``heads``.
    """
    from transformers import BertConfig, BertForMaskedLM, BertModel

    if hidden % heads:
        raise ValueError(f"train.scratch_hidden = {hidden} must divide by train.scratch_heads = {heads}")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate,
                        max_position_embeddings=max(512, max_length), pad_token_id=tokenizer.pad_token_id or 0)
    torch.manual_seed(seed)
    encoder = BertModel(config)
    encoder.pooler.requires_grad_(False)  # mean pooling: the pooler is not trained (as for a loaded encoder)
    head = None
    if with_head:
        head = BertForMaskedLM(config).cls
        head.predictions.decoder.weight = encoder.get_input_embeddings().weight
    return encoder, head


@dataclass
class XPRTOutput:
    """What :meth:`XPRTModel.forward` returns: the vectors and the token-prediction terms (only what the losses
    need; no (rows, vocab) logits tensor is returned or kept beyond one chunk, see
    :func:`pipeline.xprt.chunked_head_cross_entropy`).

    Attributes:
        pooled: (passages * groups, dim) mean-pooled vectors of the 15%-masked passes, passage-major.
        l_mlm: scalar, L_MLM over the encoder's masked positions (0 when the term is off).
        l_cross: scalar, L_cross over the masked positions of the 2 * n_related cross passes (0 when off).
        l_self: scalar, L_self over the 2 self passes (anchor, positive) (0 when off).
        n_mlm, n_cross, n_self: masked positions each term was computed over (0 when off).
    """

    pooled: torch.Tensor
    l_mlm: torch.Tensor
    l_cross: torch.Tensor
    l_self: torch.Tensor
    n_mlm: int = 0
    n_cross: int = 0
    n_self: int = 0


TERMS = ("mlm", "cross", "self")


class XPRTModel(nn.Module):
    """Encoder + MLM head + conditioning map + one-layer decoder; only the modules of the terms that are on.

    Args:
        encoder: a HuggingFace encoder (``last_hidden_state`` output, an ``embeddings`` module taking input_ids).
        head: its MLM head: (..., dim) hidden states -> (..., vocab) logits; None when no term needs it.
        n_cond: conditioning vectors per sentence vector (seed 000: 4).
        terms: the token-prediction terms computed (a subset of ``TERMS``; those whose weight is 0 are left out, so
            they cost nothing: no decoder is built without "cross" and "self", no head pass without any).
        head_rows: masked positions put through the head at once (``loss.head_chunk_mb``, see
            :func:`pipeline.xprt.head_rows_per_chunk`).
        checkpoint_decoder: recompute the decoder layer's activations in the backward pass (activation
            checkpointing) instead of keeping them (``train.gradient_checkpointing``).
        decoder_rows: with ``checkpoint_decoder``, the decoder runs and is recomputed ``decoder_rows`` rows at a
            time (:func:`pipeline.xprt.decoder_rows_per_chunk`), so its attention tensors stay bounded at any batch;
            0: all rows at once. Rows are independent, so the result is the same.

    Raises:
        ValueError: a term that needs the head without one, or an unknown term.
    """

    def __init__(self, encoder: nn.Module, head: nn.Module | None, n_cond: int = 4, terms=TERMS,
                 head_rows: int = 8192, checkpoint_decoder: bool = False, decoder_rows: int = 0):
        super().__init__()
        unknown = set(terms) - set(TERMS)
        if unknown:
            raise ValueError(f"XPRTModel: unknown terms {sorted(unknown)} (known: {', '.join(TERMS)})")
        terms = tuple(t for t in TERMS if t in set(terms))
        if terms and head is None:
            raise ValueError(f"XPRTModel: terms {terms} need an MLM head")
        cfg = encoder.config
        dim = int(cfg.hidden_size)
        self.encoder, self.n_cond, self.dim, self.terms, self.head_rows = encoder, n_cond, dim, terms, head_rows
        self.head = head if terms else None
        self.checkpoint_decoder = checkpoint_decoder
        self.decoder_rows = decoder_rows  # rows per checkpointed decoder chunk; 0: all rows at once
        self.cond = self.decoder = None
        if "cross" in terms or "self" in terms:
            self.cond = nn.Linear(dim, n_cond * dim)
            self.decoder = nn.TransformerEncoderLayer(
                d_model=dim, nhead=int(cfg.num_attention_heads),
                dim_feedforward=int(getattr(cfg, "intermediate_size", 4 * dim)),
                dropout=float(getattr(cfg, "hidden_dropout_prob", 0.1)), activation="gelu", batch_first=True,
                layer_norm_eps=float(getattr(cfg, "layer_norm_eps", 1e-12)),
            )

    def new_parameters(self) -> list[nn.Parameter]:
        """Parameters created for training (conditioning map, decoder), not loaded from the checkpoint."""
        if self.decoder is None:
            return []
        return list(self.cond.parameters()) + list(self.decoder.parameters())

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled vectors, not normalised: (batch, dim). Mining uses the same pooling (``operators.embed``)."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (batch, seq, dim)
        return mean_pool(hidden, attention_mask)  # (batch, dim)

    def forward(self, enc_ids: torch.Tensor, attention_mask: torch.Tensor, enc_chosen: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, dec_ids: torch.Tensor | None = None,
                dec_chosen: torch.Tensor | None = None, groups: int = 0, tokens: bool = False
                ) -> XPRTOutput | torch.Tensor:
        """All encoder and decoder passes of one batch; with ``enc_chosen`` None, the encoder's mean-pooled vectors
        only ((rows, dim), not normalised: the hard-negative objective, which needs no decoder), or with ``tokens``
        its last hidden states ((rows, seq, dim): XTR's token vectors), so that DDP sees every step's forward.

        Args:
            enc_ids: (P * G, seq) 15%-masked passages, passage-major: rows [0:G] anchors, [G:2G] positives (s1, or
                a random passage with ``--positives random``), then the other related passages, G rows each
                (only anchors and positives, P = 2, when no token-prediction term is on).
            attention_mask: (P * G, seq).
            enc_chosen: (P * G, seq) bool, the encoder's masked positions (L_MLM targets).
            labels: (P * G, seq) the unmasked token ids.
            dec_ids: (P * G, seq) 60%-masked passages (plain [MASK]), same layout.
            dec_chosen: (P * G, seq) bool, the decoder's masked positions.
            groups: G, the number of groups in the batch (P = rows / G passages per group).
        """
        from pairmine.pipeline.xprt import chunked_head_cross_entropy, chunked_head_self_kl

        if enc_chosen is None and tokens:
            return self.encoder(input_ids=enc_ids, attention_mask=attention_mask).last_hidden_state
        if enc_chosen is None:
            return self.embed(enc_ids, attention_mask)
        rows, seq = enc_ids.shape
        n_rel = rows // groups - 1  # related passages per group (4)
        hidden = self.encoder(input_ids=enc_ids, attention_mask=attention_mask).last_hidden_state  # (rows, seq, dim)
        pooled = mean_pool(hidden, attention_mask)  # (rows, dim)
        zero = pooled.new_zeros(())
        out = XPRTOutput(pooled, zero, zero, zero)
        if "mlm" in self.terms:
            out.l_mlm = chunked_head_cross_entropy(self.head, hidden[enc_chosen], labels[enc_chosen], self.head_rows)
            out.n_mlm = int(enc_chosen.sum())
        if self.decoder is None:
            return out

        # Decoder rows: 4 x (anchor vector -> related k), 4 x (related k vector -> anchor), 2 self (anchor, s1).
        g = torch.arange(groups, device=enc_ids.device)  # (G,)
        if "cross" in self.terms:
            rel = torch.arange(1, n_rel + 1, device=enc_ids.device)  # (R,)
            rel_rows = (rel.unsqueeze(1) * groups + g).reshape(-1)  # (R * G,) rows of related k of every group
            anchor_rows = g.repeat(n_rel)  # (R * G,) the matching anchor rows
            cross_in, cross_cond = torch.cat([rel_rows, anchor_rows]), torch.cat([anchor_rows, rel_rows])
        else:
            cross_in = cross_cond = g[:0]
        self_rows = torch.cat([g, g + groups]) if "self" in self.terms else g[:0]  # (2G,) anchor and s1
        input_rows = torch.cat([cross_in, self_rows])  # (dec_rows,) passage to fill in
        cond_rows = torch.cat([cross_cond, self_rows])  # (dec_rows,) vector that conditions it
        n_cross = len(cross_in)

        cond = self.cond(pooled[cond_rows]).view(-1, self.n_cond, self.dim)  # (dec_rows, n_cond, dim)
        tok = self.encoder.embeddings(input_ids=dec_ids)[input_rows]  # (dec_rows, seq, dim), shared embeddings
        x = torch.cat([tok[:, :1], cond.to(tok.dtype), tok[:, 1:]], 1)  # (dec_rows, n_cond + seq, dim)
        keep = attention_mask[input_rows].bool()  # (dec_rows, seq)
        pad = torch.cat([~keep[:, :1], torch.zeros_like(keep[:, :1]).expand(-1, self.n_cond), ~keep[:, 1:]], 1)
        if self.checkpoint_decoder and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            step = self.decoder_rows or len(x)  # each chunk of rows is recomputed on its own in the backward pass
            dec = torch.cat([checkpoint(lambda v, m: self.decoder(v, src_key_padding_mask=m), x[i:i + step],
                                        pad[i:i + step], use_reentrant=False) for i in range(0, len(x), step)])
        else:
            dec = self.decoder(x, src_key_padding_mask=pad)  # (dec_rows, n_cond + seq, dim)
        dec = torch.cat([dec[:, :1], dec[:, 1 + self.n_cond:]], 1)  # (dec_rows, seq, dim) token positions only

        chosen = dec_chosen[input_rows]  # (dec_rows, seq)
        if n_cross:
            cross_chosen = chosen[:n_cross]  # (n_cross_rows, seq)
            out.l_cross = chunked_head_cross_entropy(self.head, dec[:n_cross][cross_chosen],
                                                     labels[input_rows[:n_cross]][cross_chosen], self.head_rows)
            out.n_cross = int(cross_chosen.sum())
        if len(self_rows):
            self_chosen = chosen[n_cross:]  # (2G, seq)
            # the teacher: the encoder's own 15%-masked passes of anchor and s1 (no gradient from L_self)
            out.l_self = chunked_head_self_kl(self.head, dec[n_cross:][self_chosen], hidden[self_rows][self_chosen],
                                              self.head_rows)
            out.n_self = int(self_chosen.sum())
        return out
