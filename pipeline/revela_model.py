"""The model trained by Revela: a HuggingFace causal decoder run with the in-batch stream in every attention layer,
and the retriever whose similarities weight it (seed 001, sections 3.2-3.4 and 4.1; issue 12 item 2).

    lm           any HuggingFace causal decoder of the LLaMA / Qwen2 layout (AutoModelForCausalLM: ``model.
                 embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``model.norm``, ``model.rotary_emb``,
                 ``lm_head``), loaded by path, with LoRA (peft)
    retriever    the encoder pairmine trains and exports (AutoModel, mean pooling, as mining and pairmine eval), with
                 LoRA (peft); its vectors give Sim(D_i, D_j) (:func:`pipeline.revela.batch_similarity`)

One forward call runs the decoder's layers over two streams of the same batch (section 3.4's "duplicating documents"):
the plain stream e (standard causal self-attention, eq. 3-4) and the in-batch stream h (eq. 5-7), each layer
computing both streams' queries, keys and values with the layer's own projections and rotary embedding, so the
decoder's weights are used exactly as in its own forward (a test checks the plain stream against it). The loss is
the next-token prediction of the in-batch stream only (eq. 2).

Choices the seed leaves open: the retriever is the project's encoder with mean pooling rather than the seed's
decoder retriever with <eos> pooling (so that the trained retriever is evaluated, exported and used for mining like
any xPRT encoder); it reads the whole passage (the seed's code-corpus setting, not the first half of appendix B.5);
attention dropout is not applied in either stream (Qwen2 and LLaMA ship 0).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from pairmine.operators.embed import mean_pool
from pairmine.operators.errors import PairmineError
from pairmine.pipeline.revela import attention, batch_similarity, causal_mask, in_batch_attention, ntp_loss

log = logging.getLogger("pairmine")

LORA_TARGETS_LM = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class UnsupportedDecoderError(PairmineError, ValueError):
    """The causal LM does not have the LLaMA / Qwen2 layout the in-batch stream is built on (the message says
    what is missing). User-fixable: another ``train.revela_lm``."""


def base_of(model: nn.Module) -> nn.Module:
    """The HuggingFace model inside a peft wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_decoder(lm: nn.Module) -> None:
    """Check that ``lm`` (a causal LM, possibly peft-wrapped) has the modules the in-batch stream uses.

    Raises:
        UnsupportedDecoderError: a module is missing, sliding-window attention is on, or the attention's scaling is
            not 1 / sqrt(head_dim) (eq. 4-5's d_H).
    """
    dec = base_of(lm)
    core = getattr(dec, "model", None)
    name = type(dec).__name__
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if core is None or not hasattr(core, attr):
            raise UnsupportedDecoderError(f"{name}: no model.{attr} (Revela needs the LLaMA / Qwen2 layout)")
    if not hasattr(dec, "lm_head"):
        raise UnsupportedDecoderError(f"{name}: no lm_head")
    for i, layer in enumerate(core.layers):
        attn = getattr(layer, "self_attn", None)
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim"):
            if attn is None or not hasattr(attn, attr):
                raise UnsupportedDecoderError(f"{name}: layer {i} has no self_attn.{attr}")
        for attr in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, attr):
                raise UnsupportedDecoderError(f"{name}: layer {i} has no {attr}")
        if getattr(attn, "sliding_window", None):
            raise UnsupportedDecoderError(f"{name}: layer {i} uses sliding-window attention (not supported)")
        if abs(float(getattr(attn, "scaling", attn.head_dim ** -0.5)) - attn.head_dim ** -0.5) > 1e-9:
            raise UnsupportedDecoderError(f"{name}: attention scaling {attn.scaling} is not 1/sqrt(head_dim)")


def _qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 3 with the layer's own projections (LoRA included), q/k norms when the model has them, rotary embedding,
    and grouped key/value heads repeated to every query head.

    Args:
        x: (B, L, d) the normalised layer input; cos, sin: (B, L, head_dim) rotary tables.

    Returns:
        q, k, v: (B, H, L, head_dim).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, n, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(b, n, -1, hd)
    k = attn.k_proj(x).view(b, n, -1, hd)
    v = attn.v_proj(x).view(b, n, -1, hd)
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = n_heads // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return q, k, v


@dataclass
class RevelaOutput:
    """What :meth:`RevelaModel.forward` returns.

    Attributes:
        loss: scalar NTP loss of the in-batch stream (eq. 2), the only training loss.
        sim: (B, B) Sim(D_i, D_j) used in every layer.
        logits: (B, L, vocab) the in-batch stream's logits.
        plain_loss: scalar NTP loss of the plain stream (eq. 1), or None unless asked for (a diagnostic: it is not
            trained).
    """

    loss: torch.Tensor
    sim: torch.Tensor
    logits: torch.Tensor
    plain_loss: torch.Tensor | None = None


class RevelaModel(nn.Module):
    """Causal LM with the in-batch stream + retriever.

    Args:
        lm: a causal LM of the LLaMA / Qwen2 layout (possibly peft-wrapped), checked by :func:`check_decoder`.
        retriever: an encoder (``last_hidden_state`` output; possibly peft-wrapped).
        tau: Sim's temperature (seed 001 section 4.1: 1e-4).
        v_norm_eps: None (eq. 3-7) or the eps of appendix B.5's V-normalisation (eq. 8-9).

    Raises:
        UnsupportedDecoderError: from :func:`check_decoder`.
    """

    def __init__(self, lm: nn.Module, retriever: nn.Module, tau: float, v_norm_eps: float | None = None):
        super().__init__()
        check_decoder(lm)
        self.lm, self.retriever, self.tau, self.v_norm_eps = lm, retriever, tau, v_norm_eps

    def merged_retriever(self) -> nn.Module:
        """A copy of the retriever with its LoRA adapters merged into the weights: a plain HuggingFace encoder (what
        ``pairmine train`` exports); the retriever itself when it has no adapters."""
        import copy

        ret = copy.deepcopy(self.retriever).cpu()
        return ret.merge_and_unload() if hasattr(ret, "merge_and_unload") else ret

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The retriever's mean-pooled vectors h_i = E_Theta(D_i) (seed 001 section 3.3), not normalised:
        (B, d_E). Mining and pairmine eval pool the same way."""
        hidden = self.retriever(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, d_E)
        return mean_pool(hidden, attention_mask)

    def streams(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sim: torch.Tensor, plain: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every decoder layer over the plain stream e and the in-batch stream h (seed 001 section 3.2; the
        layer norms, MLPs and residuals that the seed omits are the decoder's own, applied to each stream).

        Args:
            input_ids, attention_mask: (B, L) the LM's tokens, right-padded.
            sim: (B, B) Sim(D_i, D_j).
            plain: also return the plain stream's logits.

        Returns:
            (in-batch logits (B, L, vocab), plain logits (B, L, vocab) or None).
        """
        dec = base_of(self.lm)
        core = dec.model
        b, n = input_ids.shape
        n_heads = int(dec.config.num_attention_heads)
        x = core.embed_tokens(input_ids)  # (B, L, d)
        pos = torch.arange(n, device=input_ids.device)[None].expand(b, n)
        cos, sin = core.rotary_emb(x, pos)  # (B, L, head_dim) each
        cos2, sin2 = torch.cat([cos, cos]), torch.cat([sin, sin])
        own = causal_mask(attention_mask)  # (B, 1, L, L)
        both = torch.cat([x, x])  # (2B, L, d): rows [0:B] the plain stream e, [B:2B] the in-batch stream h
        for layer in core.layers[: int(dec.config.num_hidden_layers)]:
            attn = layer.self_attn
            q, k, v = _qkv(attn, layer.input_layernorm(both), cos2, sin2, n_heads)  # (2B, H, L, hd) each
            out_e = attention(q[:b], k[:b], v[:b], own)  # eq. 4
            out_h = in_batch_attention(q[b:], k[b:], v[b:], k[:b], v[:b], attention_mask, sim.to(q.dtype),
                                       self.v_norm_eps)  # eq. 5-7
            out = torch.cat([out_e, out_h]).transpose(1, 2).reshape(2 * b, n, -1)  # (2B, L, H * hd)
            both = both + attn.o_proj(out)
            both = both + layer.mlp(layer.post_attention_layernorm(both))
        if plain:
            hidden = core.norm(both)
            logits = dec.lm_head(hidden)
            return logits[b:], logits[:b]
        return dec.lm_head(core.norm(both[b:])), None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, ret_ids: torch.Tensor | None = None,
                ret_mask: torch.Tensor | None = None, sim: torch.Tensor | None = None, plain: bool = False
                ) -> RevelaOutput:
        """Sim from the retriever, then both streams and the in-batch stream's NTP loss.

        Args:
            input_ids, attention_mask: (B, L) the LM's tokens of the batch's B sequences, right-padded.
            ret_ids, ret_mask: (B, T) the same sequences in the retriever's tokenizer.
            sim: (B, B) to use instead of the retriever's (tests); then ``ret_ids`` may be None.
            plain: also compute the plain stream's NTP loss (not trained).

        Returns:
            :class:`RevelaOutput`.
        """
        if sim is None:
            sim = batch_similarity(self.embed(ret_ids, ret_mask).float(), self.tau)  # (B, B)
        logits, plain_logits = self.streams(input_ids, attention_mask, sim, plain)
        loss = ntp_loss(logits, input_ids, attention_mask)
        plain_loss = ntp_loss(plain_logits, input_ids, attention_mask) if plain else None
        return RevelaOutput(loss, sim, logits, plain_loss)


def add_lora(model: nn.Module, rank: int, alpha: float, targets) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters of ``rank`` on ``targets`` (module names, or "all-linear"); the base
    weights are frozen, only the adapters train (seed 001 section 4.1: LoRA on both the LM and the retriever)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets))


def load_revela(lm_path: str, retriever_path: str, tau: float, lora_rank: int, lora_alpha: float,
                trust_remote_code: bool = False) -> RevelaModel:
    """Load the causal LM (AutoModelForCausalLM) and the retriever encoder (AutoModel) by path, add LoRA to both
    (the LM's attention and MLP projections; every linear layer of the retriever but its unused pooler), and build
    the :class:`RevelaModel`.

    Raises:
        UnsupportedDecoderError: the LM's layout (see :func:`check_decoder`).
    """
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    transformers.logging.disable_progress_bar()
    lm = AutoModelForCausalLM.from_pretrained(lm_path, trust_remote_code=trust_remote_code)
    check_decoder(lm)
    retriever = AutoModel.from_pretrained(retriever_path, trust_remote_code=trust_remote_code)
    lin = "|".join(re.escape(name) for name, m in retriever.named_modules()
                   if isinstance(m, nn.Linear) and not name.startswith("pooler"))  # a regex of full names
    lm = add_lora(lm, lora_rank, lora_alpha, LORA_TARGETS_LM)
    retriever = add_lora(retriever, lora_rank, lora_alpha, lin)
    return RevelaModel(lm, retriever, tau)
