"""The training job: continue pre-training an encoder on mined groups with the full xPRT objective, on Ray Train
(SPEC "Training job (Ray Train)"; seed 000).

    driver   check the groups (a committed run folder, the schema), count them, read them with Ray Data (local or
             s3://), optionally swap in random positives (pipeline/positives.py), start a TorchTrainer
    workers  each streams its shard of the groups (Ray Data streaming split), tokenises on the worker, masks
             (seeded), runs the 5 encoder + 10 decoder passes and the frozen model's pass, adds up the terms of
             pipeline/xprt.py, steps AdamW; DDP over gloo (CPU) or nccl (GPU), bf16 autocast on GPU
    rank 0   a metrics line per step (metrics.jsonl), checkpoints every N steps, the exported encoder at the end

Output folder (``--output``, local or s3://):

    <output>/ray-train/checkpoint_step_N/
                                       Ray Train checkpoints (state.pt: model, optimizer, schedule, step;
                                       pairmine_checkpoint.json: the step and state.pt's size, which tells a
                                       complete checkpoint from a partly written one)
    <output>/metrics.jsonl             one JSON line per step: every loss term, weights, lr, grad norm, groups/s
    <output>/export/                   the trained encoder (save_pretrained) + tokenizer: AutoModel loads it, and
                                       ``pairmine mine --set embed.model=<output>/export`` mines with it
    <output>/train_manifest.json       resolved config, groups, steps, versions

Re-running the same command with the same ``--output`` resumes from the latest complete checkpoint
(:func:`plan_resume` says which, and removes stray ones) and skips the batches of its epoch already trained: the
epoch's order is seeded and Ray Data keeps it (``preserve_order``), so step N of a resumed run trains the groups
step N of an uninterrupted run trains (``batch`` in metrics.jsonl is a digest of each step's groups).

Storage: the manifest, metrics.jsonl (whole-file writes), the export and the stray-checkpoint clean-up go through
:class:`operators.storage.Storage` (retried like mining's); Ray Train uploads its own checkpoints and snapshot
(pyarrow, its own error handling, not retried by pairmine).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass


from pairmine.pipeline import __version__
from pairmine.pipeline.provenance import SUCCESS_MARKER, software_versions
from pairmine.pipeline.run_folder import run_kind, wrong_kind
from pairmine.pipeline.config import ConfigError
from pairmine.pipeline.inputs import InputError
from pairmine.pipeline.train_config import TrainConfig

log = logging.getLogger("pairmine")

# Columns the training job reads (pairmine mine's GROUP_SCHEMA has them), with their types; lists by value type.
REQUIRED_COLUMNS = {"group_id": "string", "doc_id": "string", "anchor_index": "int32", "anchor_text": "string",
                    "related_indices": "list<int32>", "related_texts": "list<string>"}


def _type_name(t) -> str:
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type_name(t.value_type)}>"
    return "string" if pa.types.is_large_string(t) else str(t)
STATE_FILE = "state.pt"
# Written next to state.pt in every checkpoint: {"step", "epoch", "state_bytes"} (see _checkpoint_step).
CHECKPOINT_MARKER = "pairmine_checkpoint.json"
# Ray Train's record of the checkpoints it registered, in the run folder (<output>/<checkpoint.name>/).
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    output: str
    export_dir: str
    steps: int
    metrics: dict | None
    groups_per_epoch_trained: int = 0
    groups_per_epoch_left_out: int = 0


def epoch_accounting(n_groups: int, batch_size: int) -> tuple[int, int, int]:
    """Steps per epoch and the groups one epoch trains and leaves out.

    Each of the W workers gets ``n_groups // W`` groups (Ray Data's equal streaming split drops the rest) and
    trains full batches of ``batch_size // W`` (``drop_last``), so an epoch is ``n_groups // batch_size`` steps
    and the groups that do not fill a last global batch are left out of that epoch (which ones depends on the
    epoch's seeded order). E.g. 43 groups, batch 4 (2 workers x 2): 10 steps, 40 trained, 3 left out.

    Returns:
        (steps per epoch, groups trained per epoch, groups left out per epoch).
    """
    steps = n_groups // batch_size
    return steps, steps * batch_size, n_groups - steps * batch_size


# ---------------------------------------------------------------------------------------------------------------
# Driver: the groups


def find_group_parts(groups: str, storage=None, folder: str = "groups") -> tuple[list[str], str]:
    """The parquet parts of a committed mining run (or, with ``folder="negatives"``, of a negatives run).

    Args:
        groups: a run folder of ``pairmine mine`` (with ``groups/`` and ``_SUCCESS``) or its ``groups/`` folder;
            local or an fsspec URL (``s3://...``).
        storage: the :class:`operators.storage.Storage` to reach it with (default: local paths and the standard AWS
            environment).
        folder: the run's parts folder: ``groups`` (pairmine mine) or ``negatives`` (pairmine negatives).

    Returns:
        (part paths sorted, run folder), both absolute (local) or with the URL's protocol.

    Raises:
        FileNotFoundError: the folder does not exist. InputError: a committed run of another command (said what it
        is), no _SUCCESS marker (the run is incomplete) or no parts.
    """
    from pairmine.operators.storage import LOCAL

    storage = storage or LOCAL
    info = storage.info(groups.rstrip("/"))
    if info is None:
        raise FileNotFoundError(f"groups {groups} does not exist")
    job = "pairmine mine" if folder == "groups" else f"pairmine {folder}"
    if info.get("type") != "directory":
        raise InputError(f"{folder} {groups} is a file; give the run folder of {job} (with {folder}/ and _SUCCESS)")
    root = storage.absolute(groups.rstrip("/"))
    if not storage.exists(f"{root}/{folder}") and storage.exists(f"{root}/{SUCCESS_MARKER}") \
            and storage.exists(f"{root}/manifest.json"):  # a committed run, of another command?
        try:
            kind = run_kind(root, json.loads(storage.read_bytes(f"{root}/manifest.json")), storage)
        except (OSError, ValueError) as e:
            raise InputError(f"{folder} {groups}: cannot read {root}/manifest.json: {e}") from None
        hint = {("groups", "negatives"): "train on it with --negatives",
                ("negatives", "mine"): "train on it with --groups, or mine its hard negatives first (pairmine "
                                       "negatives --input RUN --corpus CORPUS) and give that run to --negatives"}
        if kind != job.split()[1]:
            raise InputError(wrong_kind(groups, kind, job.split()[1], hint.get((folder, kind), "")))
    run = root if storage.exists(f"{root}/{folder}") else root.rsplit("/", 1)[0]
    if not storage.exists(f"{run}/{SUCCESS_MARKER}"):
        raise InputError(f"{folder} {groups}: no {SUCCESS_MARKER} marker in {run}, so the run is not complete "
                         f"(or this is not a {job} run folder)")
    parts = [p for p in storage.find(f"{run}/{folder}") if p.endswith(".parquet")]
    if not parts:
        raise InputError(f"{folder} {groups}: {run}/{folder} holds no parquet part")
    return parts, run


NEGATIVES_COLUMNS = {"doc_id": "string", "query": "string", "positive": "string", "negatives": "list<string>",
                     "negative_teacher_scores": "list<float>", "positive_teacher_score": "float"}


def check_negative_parts(storage, parts: list[str], hard_negatives: int) -> tuple[int, int, bool]:
    """Check a negatives run's parts and count its pairs (reads the small ``negative_ranks`` and teacher columns).

    Returns:
        (pairs, pairs with at least ``hard_negatives`` negatives, whether every such pair has teacher scores).

    Raises:
        InputError: a part is unreadable or lacks a column of ``NEGATIVES_COLUMNS``.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def read(f, path):
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        for name, typ in NEGATIVES_COLUMNS.items():
            if name not in names or _type_name(pf.schema_arrow.field(name).type) != typ:
                raise InputError(f"negatives part {path}: no column {name!r} of type {typ}: not a pairmine "
                                 f"negatives file (columns: {', '.join(names)})")
        return pf.read(columns=["negative_ranks", "positive_teacher_score"])

    total, usable, teacher = 0, 0, True
    for path in parts:
        try:
            t = storage.read_with(path, lambda f, path=path: read(f, path))
        except InputError:
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for corrupt files
            raise InputError(f"negatives part {path} is not a readable parquet file: {str(e).splitlines()[0]}") from None
        enough = pc.greater_equal(pc.list_value_length(t.column("negative_ranks")), hard_negatives)
        enough = pc.fill_null(enough, False)
        total += t.num_rows
        usable += int(pc.sum(enough).as_py() or 0)
        scored = t.column("positive_teacher_score").filter(enough)
        teacher = teacher and scored.null_count == 0
    return total, usable, teacher and usable > 0


def check_group_parts(storage, parts: list[str]) -> tuple[int, int]:
    """Check every part's schema and count the groups (parquet footers only).

    Returns:
        (groups, related passages per group: the list length of ``related_texts`` in the first non-empty part).

    Raises:
        InputError: a part is unreadable or lacks a required column or has it with another type.
    """
    import pyarrow.parquet as pq

    def read(f, path, n_related):
        pf = pq.ParquetFile(f)
        schema, rows = pf.schema_arrow, pf.metadata.num_rows
        for name, typ in REQUIRED_COLUMNS.items():
            if name not in schema.names:
                raise InputError(f"groups part {path} has no column {name!r}: not a pairmine groups file "
                                 f"(columns: {', '.join(schema.names)})")
            if _type_name(schema.field(name).type) != typ:
                raise InputError(f"groups part {path}: column {name!r} is {_type_name(schema.field(name).type)}, "
                                 f"expected {typ}")
        if rows and not n_related:
            first = pf.read_row_group(0, columns=["related_texts"]).column(0)
            n_related = len(first[0].as_py())
        return rows, n_related

    total, n_related = 0, 0
    for path in parts:
        try:
            rows, n_related = storage.read_with(path, lambda f, path=path, n=n_related: read(f, path, n))
        except InputError:
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for corrupt files
            raise InputError(f"groups part {path} is not a readable parquet file: {str(e).splitlines()[0]}") from None
        total += rows
    return total, n_related


# ---------------------------------------------------------------------------------------------------------------
# Worker


def _autocast_dtype(cfg: TrainConfig, device_type: str):
    import torch

    if cfg.train.dtype == "float32" or (cfg.train.dtype == "auto" and device_type != "cuda"):
        return None
    return torch.bfloat16


def xprt_terms(cfg: TrainConfig) -> tuple[str, ...]:
    """The token-prediction terms of the xPRT objective that are on (weight > 0): a subset of ("mlm", "cross",
    "self"). A term whose weight is 0 is not computed at all (no decoder pass, no head pass)."""
    lo = cfg.loss
    return tuple(t for t, w in (("mlm", lo.w_mlm), ("cross", lo.w_cross), ("self", lo.w_self)) if w > 0)


def retention_on(cfg: TrainConfig) -> bool:
    """True when the retention term has a weight above 0 at some step (else no frozen model is loaded or run)."""
    return cfg.loss.retention_start > 0 or cfg.loss.retention_end > 0


def _load_models(cfg: TrainConfig, objective: str | None = None):
    """Tokenizer, trainable XPRTModel (only the modules of the terms that are on, see :func:`xprt_terms`), the
    frozen starting encoder (always the starting model, also on resume; None when the retention term is off), and
    whether the MLM head is fresh. With ``train.init = scratch`` the encoder is a randomly initialised BERT of
    ``train.scratch_*`` over the tokenizer of ``train.model`` (the ablation's scratch regime)."""
    import copy

    import torch
    from transformers import AutoTokenizer

    from pairmine.operators.embed import default_model_path
    from pairmine.pipeline.xprt import decoder_rows_per_chunk, head_rows_per_chunk
    from pairmine.pipeline.xprt_model import XPRTModel, build_scratch_encoder, load_encoder_and_head

    t = cfg.train
    path = t.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=t.trust_remote_code)
    terms = xprt_terms(cfg) if (objective or t.objective) == "xprt" else ()
    if t.init == "scratch":
        encoder, head = build_scratch_encoder(tokenizer, t.scratch_layers, t.scratch_hidden, t.scratch_heads,
                                              t.scratch_intermediate, t.max_length, t.seed, bool(terms))
        fresh_head = True
    else:
        encoder, head, fresh_head = load_encoder_and_head(path, t.trust_remote_code)
    frozen = copy.deepcopy(encoder).eval().requires_grad_(False) if retention_on(cfg) else None
    if t.attention_dropout >= 0:
        set_attention_dropout(encoder, t.attention_dropout)
    if t.gradient_checkpointing and getattr(encoder, "supports_gradient_checkpointing", False):
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(t.seed)  # the new modules start the same on every worker (DDP also broadcasts rank 0's)
    vocab = encoder.get_input_embeddings().num_embeddings  # the head predicts through the tied token table
    dec_rows = decoder_rows_per_chunk(int(encoder.config.num_attention_heads), t.max_length + cfg.loss.n_cond,
                                      cfg.loss.head_chunk_mb)
    model = XPRTModel(encoder, head, cfg.loss.n_cond, terms, head_rows_per_chunk(vocab, cfg.loss.head_chunk_mb),
                      t.gradient_checkpointing, dec_rows)
    if t.attention_dropout >= 0 and model.decoder is not None:
        model.decoder.self_attn.dropout = t.attention_dropout
    return tokenizer, model, frozen, fresh_head


def set_attention_dropout(encoder, p: float) -> int:
    """Set the attention-probability dropout of every attention module of a HuggingFace encoder to ``p`` (their
    ``dropout`` submodule, which the eager and SDPA attention paths read). Returns the modules changed."""
    n = 0
    for name, m in encoder.named_modules():
        drop = getattr(m, "dropout", None)
        if type(m).__name__.endswith("SelfAttention") and hasattr(drop, "p"):
            drop.p, n = p, n + 1
    return n


def _load_revela_models(cfg: TrainConfig):
    """Revela (``train.objective = revela``; seed 001): the retriever's tokenizer (``train.model``'s, also the
    export's), the LM's tokenizer (``train.revela_lm``, right-padded, its eos as pad token when it has none) and
    the :class:`pipeline.revela_model.RevelaModel` with LoRA on both models (the same LoRA start on every worker)."""
    import torch
    from transformers import AutoTokenizer

    from pairmine.operators.embed import default_model_path
    from pairmine.pipeline.revela_model import load_revela

    t = cfg.train
    path = t.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=t.trust_remote_code)
    lm_tokenizer = AutoTokenizer.from_pretrained(t.revela_lm, trust_remote_code=t.trust_remote_code)
    lm_tokenizer.padding_side = "right"
    if lm_tokenizer.pad_token is None:
        lm_tokenizer.pad_token = lm_tokenizer.eos_token
    torch.manual_seed(t.seed)
    model = load_revela(t.revela_lm, path, cfg.loss.revela_tau, t.revela_lora_rank, t.revela_lora_alpha,
                        t.trust_remote_code)
    model.v_norm_eps = 1e-6 if cfg.loss.revela_v_norm else None  # seed 001 appendix B.5: eps 1e-6
    return tokenizer, lm_tokenizer, model


def _param_groups(model, cfg: TrainConfig, fresh_head: bool) -> list[dict]:
    new = {id(p) for p in model.new_parameters()}
    if cfg.train.init == "scratch":  # every parameter is new: one group at train.lr_new
        new = {id(p) for p in model.parameters()}
    elif fresh_head and model.head is not None:
        emb = {id(p) for p in model.encoder.parameters()}
        new |= {id(p) for p in model.head.parameters() if id(p) not in emb}  # the tied token table stays "old"
    seen, old_p, new_p = set(), [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (new_p if id(p) in new else old_p).append(p)
    wd = cfg.train.weight_decay
    return [{"params": old_p, "lr": cfg.train.lr, "weight_decay": wd},
            {"params": new_p, "lr": cfg.train.lr_new, "weight_decay": wd}]


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total`` (0-based ``step``)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


class MetricsLog:
    """``<output>/metrics.jsonl`` written by rank 0: one line per step. On resume, lines after the checkpoint's
    step (written by the killed attempt) are dropped first, so every step appears once. Local files are appended
    line by line; object storage (no append) gets the whole file rewritten at every checkpoint and at the end.
    Whole-file writes go through the storage layer: retried, and whole (tmp + rename on disk, one PUT on S3)."""

    def __init__(self, output: str, resume_step: int, storage=None):
        from pairmine.operators.storage import LOCAL, is_local

        self.storage = storage or LOCAL
        self.path = f"{output.rstrip('/')}/metrics.jsonl"
        self.local = is_local(self.path)
        self.lines: list[str] = []
        if self.storage.exists(self.path):
            text = self.storage.read_bytes(self.path).decode("utf-8")
            self.lines = [ln for ln in text.splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
        self.flush()

    def add(self, record: dict) -> None:
        line = json.dumps(record)
        self.lines.append(line)
        if self.local:
            self.storage.append(self.path, (line + "\n").encode("utf-8"))

    def flush(self) -> None:
        self.storage.write_bytes(self.path, "".join(ln + "\n" for ln in self.lines).encode("utf-8"))


def _frozen_names(model) -> set[str]:
    """State-dict names of ``model``'s frozen parameters (``requires_grad`` False), tied aliases included."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state(model) -> dict:
    """``model.state_dict()`` without the frozen parameters (``requires_grad`` False), which every attempt loads
    again from the base model: what a checkpoint must keep. For Revela, where the LM's and the retriever's base
    weights are frozen and only LoRA adapters train, a Qwen2.5-0.5B run's checkpoint is then its adapters (MBs)
    instead of ~2 GB of unchanged weights; buffers are kept."""
    frozen = _frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trainable_state(model, state: dict) -> None:
    """Load a checkpoint's :func:`trainable_state` (or a whole ``state_dict``, as older checkpoints hold) into
    ``model``, whose frozen parameters come from the base model.

    Raises:
        RuntimeError: the checkpoint lacks a trainable parameter of ``model`` or holds keys ``model`` does not
            have (another model or objective than the run's).
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    frozen = _frozen_names(model)
    lacking = [k for k in missing if k not in frozen]
    if lacking or unexpected:
        raise RuntimeError(f"the checkpoint does not fit the model: {len(lacking)} trainable tensor(s) missing "
                           f"{lacking[:3]}, {len(unexpected)} unexpected {list(unexpected)[:3]}")


def _save_state(model, optimizer, scheduler, step: int, epoch: int, folder: str) -> None:
    """Write a checkpoint into ``folder``: ``state.pt`` (the model's :func:`trainable_state`, optimizer, schedule,
    step, epoch) and ``pairmine_checkpoint.json`` (step, epoch and state.pt's size in bytes). Ray Train copies the
    folder file by file; a copy cut short leaves a state.pt of another size than the marker records (or no
    marker), which :func:`plan_resume` treats as incomplete."""
    import torch

    state = os.path.join(folder, STATE_FILE)
    torch.save({"model": trainable_state(model), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch}, state)
    with open(os.path.join(folder, CHECKPOINT_MARKER), "w") as f:
        json.dump({"step": step, "epoch": epoch, "state_bytes": os.path.getsize(state)}, f)


def checkpoint_dir_name(step: int) -> str:
    """The folder of the checkpoint saved after ``step`` under ``<output>/<checkpoint.name>/``."""
    return f"checkpoint_step_{step:08d}"


def _checkpoint_step(storage, folder: str) -> int | None:
    """The step of the checkpoint in ``folder`` when it is complete: its ``pairmine_checkpoint.json`` reads and
    its ``state.pt`` has the size the marker records. None when it is not (no marker, an unreadable one, no
    state.pt or one of another size: an upload cut short)."""
    try:
        marker = json.loads(storage.read_bytes(f"{folder}/{CHECKPOINT_MARKER}"))
        step, size = int(marker["step"]), int(marker["state_bytes"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    info = storage.info(f"{folder}/{STATE_FILE}")
    return step if info is not None and int(info.get("size", -1)) == size else None


def _registered_checkpoints(storage, run_folder: str) -> set[str] | None:
    """Folder names of the checkpoints Ray Train's snapshot (``checkpoint_manager_snapshot.json``) names: every
    ``checkpoint_dir_name`` value in it, wherever it sits (the snapshot's layout is Ray's). An empty set when there
    is no snapshot; None when it is unreadable (Ray Train reports that itself)."""
    path = f"{run_folder.rstrip('/')}/{RAY_SNAPSHOT}"
    if not storage.exists(path):
        return set()
    try:
        data = json.loads(storage.read_bytes(path))
    except ValueError:
        return None
    names: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "checkpoint_dir_name" and isinstance(v, str):
                    names.add(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(data)
    return names


@dataclass
class ResumePlan:
    """What :func:`plan_resume` decided for a run folder."""

    resume_from: str | None = None  # a stray checkpoint folder the workers load instead of Ray Train's latest
    resume_step: int = 0  # the stray's step (0 when resume_from is None)
    removed: tuple[str, ...] = ()  # the stray folders removed, each "name (why)"


def plan_resume(storage, run_folder: str) -> ResumePlan:
    """Decide which checkpoint a run resumes from, before Ray Train starts; remove the stray ones.

    The rule. Ray Train resumes from the newest checkpoint its snapshot registers. A ``checkpoint_*`` folder the
    snapshot does not name is a stray: a run stopped between Ray Train's "checkpoint created" (the upload) and its
    snapshot, or in the middle of the upload. A complete stray (see :func:`_checkpoint_step`) newer than every
    registered checkpoint is the latest state of the run: the workers resume from it (``resume_from``) and the
    driver removes it once the run has written newer checkpoints (Ray Train's ``checkpoint.keep`` never counts
    it). Every other stray (incomplete, or not newer) is removed now. Registered checkpoints are never touched.
    Each decision is logged.

    Args:
        storage: the run's :class:`operators.storage.Storage` (retried listing, reads, removal).
        run_folder: ``<output>/<checkpoint.name>`` (Ray Train's run folder), local or s3://.
    """
    def name(path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    run_folder = run_folder.rstrip("/")
    folders = [p for p in storage.ls(run_folder)
               if name(p).startswith("checkpoint_") and (storage.info(p) or {}).get("type") == "directory"]
    if not folders:
        return ResumePlan()
    registered = _registered_checkpoints(storage, run_folder)
    if registered is None:
        log.warning("%s/%s is unreadable: the checkpoints in %s are left as they are", run_folder, RAY_SNAPSHOT,
                    run_folder)
        return ResumePlan()
    steps = {p: _checkpoint_step(storage, p) for p in folders}
    known = [steps[p] for p in folders if name(p) in registered]
    # A registered checkpoint of an older pairmine has no marker: its step is unknown, so no stray outranks it.
    newest = max((s if s is not None else math.inf for s in known), default=-1)
    strays = [p for p in folders if name(p) not in registered]
    complete = [p for p in strays if steps[p] is not None and steps[p] > newest]
    use = max(complete, key=lambda p: steps[p]) if complete else None
    removed = []
    for p in strays:
        if p == use:
            continue
        ref = steps[use] if use else newest
        why = ("incomplete: no readable pairmine_checkpoint.json or a state.pt of another size" if steps[p] is None
               else f"step {steps[p]}, not newer than the checkpoint the run resumes from"
                    + (f" (step {ref})" if ref != math.inf else ""))
        log.warning("removing stray checkpoint %s (%s): Ray Train's snapshot does not name it", p, why)
        storage.rm(p)
        removed.append(f"{name(p)} ({why})")
    if use is None:
        return ResumePlan(removed=tuple(removed))
    log.warning("checkpoint %s (step %d) is complete but Ray Train's snapshot does not name it (the last run stopped "
                "before Ray Train registered it): resuming from it, the newest state of the run", use, steps[use])
    return ResumePlan(resume_from=use, resume_step=steps[use], removed=tuple(removed))


def batch_digest(keys, world: int, device) -> str:
    """An order-free digest of the groups of one global batch: the sum mod 2**64 of each group key's 64-bit
    blake2b hash, over every worker's part (an all-gather when ``world`` > 1), as 16 hex digits. Two steps
    trained the same groups exactly when their digests are equal (up to hash collisions), whatever the order
    inside the batch; metrics.jsonl records it per step as ``batch``, so a resumed run can be compared with an
    uninterrupted one.

    Args:
        keys: this worker's group keys (strings: the group ids, or for --negatives doc id + query).
    """
    total = sum(int.from_bytes(hashlib.blake2b(str(k).encode("utf-8"), digest_size=8).digest(), "little")
                for k in keys) % 2 ** 64
    if world > 1:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([total - 2 ** 63], dtype=torch.int64, device=device)  # shifted into int64's range
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        total = sum(int(t.item()) + 2 ** 63 for t in parts) % 2 ** 64
    return f"{total:016x}"


def _export(model, tokenizer, output: str, description: dict, max_length: int, storage=None) -> str:
    """Save the trained encoder to ``<output>/export`` (via a local temp folder for object storage), in the two forms
    users load: ``transformers.AutoModel`` (``save_pretrained`` weights + tokenizer, what ``pairmine mine --set
    embed.model=...`` loads) and a sentence-transformers model (Transformer, mean Pooling, Normalize, with the
    query and passage prefixes as its prompts ``query`` / ``passage`` / ``document``, so
    ``SentenceTransformer(export).encode(texts, prompt_name="passage")`` gives pairmine's vectors), plus
    ``pairmine_model.json`` (:mod:`pipeline.model_description`: prefixes, pooling, anchor threshold, base model).

    sentence-transformers writes its own module files (modules.json, 1_Pooling/, 2_Normalize/, ...) rather than us
    hand-writing its format. Files are uploaded one by one through ``storage`` (retried, each whole).
    """
    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.model_description import ModelDescription, write_description

    try:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Pooling, Transformer

    storage = storage or LOCAL
    target = f"{output.rstrip('/')}/export"
    desc = ModelDescription(**{k: v for k, v in description.items() if k != "format"})
    with tempfile.TemporaryDirectory() as tmp:
        model.encoder.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        word = Transformer(tmp, max_seq_length=max_length)
        st = SentenceTransformer(
            modules=[word, Pooling(word.get_embedding_dimension() if hasattr(word, "get_embedding_dimension")
                                   else word.get_word_embedding_dimension(), pooling_mode="mean"), Normalize()],
            prompts={"query": desc.query_prefix, "passage": desc.passage_prefix, "document": desc.passage_prefix},
            device="cpu")
        st.save(tmp)
        write_description(tmp, desc)
        storage.rm(target)
        for folder, _, names in os.walk(tmp):
            for name in names:
                local = os.path.join(folder, name)
                with open(local, "rb") as f:
                    storage.write_bytes(f"{target}/{os.path.relpath(local, tmp)}", f.read())
    return target


def export_description(cfg: TrainConfig, storage, run_dir: str):
    """The :class:`pipeline.model_description.ModelDescription` the export carries: the starting encoder's
    prefixes (as training used them) and anchor threshold; for a starting encoder with no known threshold, the one
    the groups were mined with (their run's ``stats.json``)."""
    from pairmine.operators.embed import DEFAULT_MODEL_NAME
    from pairmine.pipeline.model_description import ModelDescription

    base = cfg.model_description()
    threshold, source = base.anchor_threshold, base.threshold_source or base.source
    if threshold is None:
        try:
            threshold = float(json.loads(storage.read_bytes(f"{run_dir}/stats.json"))["anchor_threshold"])
            source = f"the threshold its training groups were mined with ({run_dir}/stats.json)"
        except (OSError, KeyError, TypeError, ValueError):
            source = "unknown: run pairmine calibrate with this model"
    return ModelDescription(
        query_prefix=base.query_prefix, passage_prefix=cfg.resolved_prefix(),
        anchor_threshold=threshold, base_model=cfg.train.model or DEFAULT_MODEL_NAME, threshold_source=source,
        pairmine_version=__version__)


def encode_batch(tokenizer, batch: dict, cfg: TrainConfig, step: int, rank: int, related: bool = True) -> dict:
    """Tokenise a batch of groups on the worker and mask it (seeded by seed, step and rank).

    Args:
        related: also the related passages 2..R (needed by L_cross and L_MLM only); False: anchors and positives
            only (P = 2).

    Returns:
        ids, attn (P * g, seq) passage-major (anchors, positives, related passages 2..R), enc_ids/enc_chosen (15%,
        BERT 80/10/10), dec_ids/dec_chosen (60%, plain [MASK]), g (groups), doc_ids (g,) hashed document ids.
    """
    import torch

    from pairmine.operators.consistency import doc_hash
    from pairmine.pipeline.xprt import mask_tokens

    lo = cfg.loss
    g = len(batch["anchor_text"])
    positives = batch["positive_text"] if "positive_text" in batch else [r[0] for r in batch["related_texts"]]
    rel = [list(r) for r in batch["related_texts"]]
    if any(len(r) != len(rel[0]) for r in rel):
        raise ValueError("groups in one batch have different numbers of related passages")
    # passage-major: anchors, positives, then related passages 2..R (s1 itself is the xPRT positive)
    texts = list(batch["anchor_text"]) + list(positives)
    if related:
        texts += [r[k] for k in range(1, len(rel[0])) for r in rel]
    prefix = cfg.resolved_prefix()
    enc = tokenizer([prefix + t for t in texts], padding=True, truncation=True, max_length=cfg.train.max_length,
                    return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]  # (P * g, seq)
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids)) | (attn == 0)  # (P * g, seq)
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step * 1009 + rank)
    enc_ids, enc_chosen = mask_tokens(ids, special, lo.encoder_mask_rate, gen, tokenizer.mask_token_id, len(tokenizer),
                                      0.1, 0.1)
    dec_ids, dec_chosen = mask_tokens(ids, special, lo.decoder_mask_rate, gen, tokenizer.mask_token_id, len(tokenizer))
    return {"ids": ids, "attn": attn, "enc_ids": enc_ids, "enc_chosen": enc_chosen, "dec_ids": dec_ids,
            "dec_chosen": dec_chosen, "g": g,
            "doc_ids": torch.tensor([doc_hash(d) for d in batch["doc_id"]])}


def xprt_step(model, frozen, tokenizer, batch: dict, cfg: TrainConfig, step: int, total: int, rank: int, world: int,
              device, amp, optimizer, scheduler):
    """One optimizer step of the xPRT objective on this worker's part of the global batch (the training job and
    benchmarks/bench_train.py both run exactly this).

    Returns:
        (terms: dict of scalar tensors, retention weight, gradient norm, (anchors, positives, doc ids) gathered).
    """
    import torch
    import torch.nn.functional as F

    from pairmine.operators.embed import mean_pool
    from pairmine.pipeline.xprt import gather_with_grad, info_nce_symmetric, retention_kl, retention_weight, uniformity

    lo = cfg.loss
    model.train()
    inner = model.module if hasattr(model, "module") else model
    # L_cross's related -> anchor passes and L_MLM's passes need the related passages 2..R; L_xp, L_self and the
    # retention term only anchors and positives
    b = encode_batch(tokenizer, batch, cfg, step, rank, related="cross" in inner.terms or "mlm" in inner.terms)
    g = b["g"]
    ids, attn, enc_ids, enc_chosen, dec_ids, dec_chosen, docs = (
        b[k].to(device) for k in ("ids", "attn", "enc_ids", "enc_chosen", "dec_ids", "dec_chosen", "doc_ids"))
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        out = model(enc_ids, attn, enc_chosen, ids, dec_ids, dec_chosen, g)
        if frozen is not None:
            with torch.no_grad():  # the frozen starting model, unmasked anchors and positives
                hidden = frozen(input_ids=ids[: 2 * g], attention_mask=attn[: 2 * g]).last_hidden_state  # (2g, seq, dim)
                frz = F.normalize(mean_pool(hidden, attn[: 2 * g]).float(), dim=-1)  # (2g, dim)
    vec = F.normalize(out.pooled.float(), dim=-1)  # (P * g, dim)
    a, p = gather_with_grad(vec[:g]), gather_with_grad(vec[g: 2 * g])  # (world * g, dim) each
    all_docs = gather_with_grad(docs)  # (world * g,)
    w_ret = retention_weight(step, total, lo.retention_start, lo.retention_end) if frozen is not None else 0.0
    zero = a.new_zeros(())
    terms = {
        "l_xp": info_nce_symmetric(a, p, all_docs, lo.tau, lo.mask_same_doc),
        "l_unif": uniformity(a, lo.unif_t) if lo.w_unif > 0 else zero,
        "l_retention": zero,
        "l_cross": out.l_cross,
        "l_self": out.l_self,
        "l_mlm": out.l_mlm,
    }
    if frozen is not None:
        fa, fp = gather_with_grad(frz[:g]), gather_with_grad(frz[g:])  # (world * g, dim) each, constants
        terms["l_retention"] = retention_kl(a, p, fa, fp, lo.retention_tau)
    global_part = lo.w_xp * terms["l_xp"] + lo.w_unif * terms["l_unif"] + w_ret * terms["l_retention"]
    local_part = lo.w_cross * terms["l_cross"] + lo.w_self * terms["l_self"] + lo.w_mlm * terms["l_mlm"]
    # DDP averages gradients over workers. Local terms: the average of per-worker means is the global mean.
    # Global-batch terms are the same value on every worker, each backpropagating through its own rows only:
    # scaling them by the world size makes the average equal to the full gradient.
    optimizer.zero_grad(set_to_none=True)
    (world * global_part + local_part).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    return terms, w_ret, grad_norm, (a.detach(), p.detach(), all_docs)


def xtr_step(model, tokenizer, batch: dict, cfg: TrainConfig, world: int, device, amp, optimizer, scheduler):
    """One optimizer step of XTR's objective (``train.objective = xtr``; seed 002 section 3.1) on this worker's part
    of the global batch: anchors (queries) and their positives (s1, or random positives) through the encoder in one
    forward pass, token vectors L2-normalised (special tokens and padding left out), gathered over the workers;
    :func:`pipeline.xtr.f_xtr` of every anchor against every positive of the global batch with in-batch top-
    ``loss.xtr_k_train`` retrieval, a chunk of anchors at a time within ``loss.xtr_chunk_mb``
    (:func:`pipeline.xtr.f_xtr_chunked`); cross-entropy of each anchor's own positive (:func:`pipeline.xtr.xtr_loss`,
    temperature ``loss.xtr_tau``), other groups of the same document masked out (``loss.mask_same_doc``).

    Returns:
        dict of scalar tensors: loss, p_positive (mean softmax probability of the positive), z_positive (mean share
        of query tokens that retrieved a token of their positive), grad_norm.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pairmine.operators.consistency import doc_hash
    from pairmine.pipeline.xprt import gather_with_grad
    from pairmine.pipeline.xtr import (f_xtr_chunked, in_batch_alignment, query_chunk, scoreable_rows,
                                      token_similarities, xtr_loss)

    lo = cfg.loss
    g = len(batch["anchor_text"])
    positives = batch["positive_text"] if "positive_text" in batch else [r[0] for r in batch["related_texts"]]
    prefix = cfg.resolved_prefix()
    enc = tokenizer([prefix + t for t in list(batch["anchor_text"]) + list(positives)], padding=True, truncation=True,
                    max_length=cfg.train.max_length, return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]  # (2g, seq)
    if world > 1:  # every worker pads to the longest sequence of the global batch, so that the gather fits
        seq = torch.tensor([ids.shape[1]], device=device)
        dist.all_reduce(seq, op=dist.ReduceOp.MAX)
        pad = int(seq) - ids.shape[1]
        ids = F.pad(ids, (0, pad), value=tokenizer.pad_token_id or 0)
        attn = F.pad(attn, (0, pad), value=0)
    real = (attn == 1) & ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids))  # (2g, seq) scored tokens
    docs = torch.tensor([doc_hash(str(d)) for d in batch["doc_id"]], dtype=torch.int64, device=device)
    model.train()
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        hidden = model(ids.to(device), attn.to(device), tokens=True)  # (2g, seq, dim)
    tok = F.normalize(hidden.float(), dim=-1)
    q, d = gather_with_grad(tok[:g]), gather_with_grad(tok[g:])  # (world * g, seq, dim) each
    real = real.to(device)
    qm, dm = gather_with_grad(real[:g]), gather_with_grad(real[g:])  # (world * g, seq) each
    all_docs = gather_with_grad(docs)  # (world * g,)
    # (world * g, world * g) scores from the (world * g, seq, world * g, seq) token similarities, a chunk of
    # queries at a time when they exceed loss.xtr_chunk_mb
    chunk = query_chunk(q.shape[1], d.shape[0], d.shape[1], lo.xtr_chunk_mb)
    scores = f_xtr_chunked(q, d, qm, dm, lo.xtr_k_train, chunk)
    n = len(scores)
    if lo.mask_same_doc:  # another group's positive from the anchor's own document is not a negative
        same = (all_docs[:, None] == all_docs[None, :]) & ~torch.eye(n, dtype=torch.bool, device=device)
        scores = scores.masked_fill(same, float("-inf"))
    target = torch.arange(n, device=device)
    # a query or positive with no real token (special tokens only) has nothing to learn from: its row is left out
    # of the mean (issue 39 item 1); its document stays a negative that scores 0
    valid = scoreable_rows(qm, dm, target)
    loss = xtr_loss(scores, target, lo.xtr_tau, valid)
    optimizer.zero_grad(set_to_none=True)
    (world * loss).backward()  # a global-batch term on every worker (as xprt_step's): DDP's average is the gradient
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        p_pos = torch.softmax(scores / lo.xtr_tau, dim=1).diagonal().mean()
        own = torch.cat([  # (world * g, seq): query tokens that retrieved a token of their own positive
            in_batch_alignment(token_similarities(q[i:i + chunk], d), qm[i:i + chunk], dm, lo.xtr_k_train)
            .any(-1)[torch.arange(len(q[i:i + chunk])), :, target[i:i + chunk]] for i in range(0, n, chunk)])
        z_pos = (own.sum(1).float() / qm.sum(1).clamp(min=1)).mean()
    return {"loss": loss.detach(), "p_positive": p_pos, "z_positive": z_pos, "grad_norm": grad_norm,
            "rows_without_tokens": (n - valid.sum()).float()}


def revela_step(model, tokenizer, lm_tokenizer, batch: dict, cfg: TrainConfig, world: int, device, amp, optimizer,
                scheduler):
    """One optimizer step of Revela's objective (``train.objective = revela``; seed 001 sections 3.1-3.4) on this
    worker's part of the global batch. The batch's sequences are every passage of this worker's groups (anchor and
    related passages, group after group: each group's passages come from one document, as the seed batches a
    document's chunks together); the retriever (``train.model``, with the passage prefix) gives Sim over them, the
    LM (``train.revela_lm``) predicts each passage with the in-batch stream, and the NTP loss of that stream is the
    only loss (:class:`pipeline.revela_model.RevelaModel`). The in-batch attention spans this worker's sequences
    (no cross-worker attention: DDP averages the gradients).

    Returns:
        dict of scalar tensors: loss (mean over workers), sim_top (mean largest Sim of a row), sim_same_group (mean
        Sim mass a passage puts on the other passages of its own group), grad_norm, sequences (this worker's).
    """
    import torch
    import torch.distributed as dist

    g = len(batch["anchor_text"])
    groups = [[a, *list(r)] for a, r in zip(batch["anchor_text"], batch["related_texts"])]
    texts = [t for grp in groups for t in grp]
    owner = torch.tensor([i for i, grp in enumerate(groups) for _ in grp], device=device)  # (B,) group of each
    prefix = cfg.resolved_prefix()
    ret = tokenizer([prefix + t for t in texts], padding=True, truncation=True, max_length=cfg.train.max_length,
                    return_tensors="pt")
    lm = lm_tokenizer(texts, padding=True, truncation=True, max_length=cfg.train.max_length, return_tensors="pt")
    model.train()
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        out = model(lm["input_ids"].to(device), lm["attention_mask"].to(device), ret["input_ids"].to(device),
                    ret["attention_mask"].to(device))
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                               cfg.train.grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        sim = out.sim.float()
        same = (owner[:, None] == owner[None, :]) & ~torch.eye(len(owner), dtype=torch.bool, device=device)
        terms = torch.stack([out.loss.detach().float(), sim.max(1).values.mean(), (sim * same).sum(1).mean()])
        if world > 1:
            dist.all_reduce(terms)
            terms /= world
    return {"loss": terms[0], "sim_top": terms[1], "sim_same_group": terms[2], "grad_norm": grad_norm,
            "sequences": torch.tensor(len(texts)), "groups": torch.tensor(g)}


def negatives_step(model, tokenizer, batch: dict, cfg: TrainConfig, world: int, device, amp, optimizer, scheduler,
                   use_teacher: bool = False):
    """One optimizer step of the hard-negative objective (``pairmine train --negatives``; seed 004 chapter 3) on this
    worker's part of the global batch: queries (query prefix) and each group's positive + H negatives (passage
    prefix) through the encoder in one forward pass, gathered over the workers, then
    :func:`pipeline.distill.hard_negative_loss`.

    Args:
        use_teacher: the KL term against the pairs' teacher scores (every pair of the run has them).

    Returns:
        dict of scalar tensors: loss, l_nce, l_kl, p_positive, grad_norm.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    from pairmine.pipeline.distill import hard_negative_loss
    from pairmine.pipeline.xprt import gather_with_grad

    d = cfg.distill
    h = d.hard_negatives
    from pairmine.operators.consistency import doc_hash
    from pairmine.operators.negatives import text_hash

    queries = [cfg.resolved_query_prefix() + q for q in batch["query"]]
    prefix = cfg.resolved_prefix()
    texts = [t for p, ns in zip(batch["positive"], batch["negatives"]) for t in [p, *list(ns)[:h]]]
    passages = [prefix + t for t in texts]
    g = len(queries)
    # In-batch false negatives are masked: other groups' positives from the same document (pairs without a
    # document id count as their own document) and passages whose text is the query's own positive's or the query's.
    docs = [doc_hash(str(d)) if d is not None else doc_hash(f"\x00pair:{i}:{q}") for i, (d, q) in
            enumerate(zip(batch["doc_id"], batch["query"]))]
    doc_ids = gather_with_grad(torch.tensor(docs, dtype=torch.int64, device=device))  # (world * g,)
    keys = gather_with_grad(torch.tensor([text_hash(t) for t in texts], dtype=torch.int64, device=device))
    query_keys = gather_with_grad(torch.tensor([text_hash(q) for q in batch["query"]], dtype=torch.int64,
                                               device=device))
    enc = tokenizer(queries + passages, padding=True, truncation=True, max_length=cfg.train.max_length,
                    return_tensors="pt")
    model.train()
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        vec = model(enc["input_ids"].to(device), enc["attention_mask"].to(device))  # (g * (2 + H), dim)
    vec = F.normalize(vec.float(), dim=-1)
    q, p = gather_with_grad(vec[:g]), gather_with_grad(vec[g:])  # (world * g, dim), (world * g * (1 + H), dim)
    teacher = None
    if use_teacher and d.alpha < 1:  # the driver checked that every pair it feeds has teacher scores
        rows = [[float(t0), *list(ts)[:h]] for t0, ts in zip(batch["positive_teacher_score"],
                                                              batch["negative_teacher_scores"])]
        teacher = gather_with_grad(torch.tensor(np.array(rows, np.float32), device=device))  # (world * g, 1 + H)
    terms = hard_negative_loss(q, p, teacher, d.alpha, d.tau, doc_ids, keys, query_keys)
    optimizer.zero_grad(set_to_none=True)
    # Every term is over the global batch, the same value on every worker: scaled by the world size so that DDP's
    # average of the workers' gradients is the full gradient (as xprt_step's global terms).
    (world * terms["loss"]).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    terms["grad_norm"] = grad_norm
    return terms


def _report(metrics: dict, step: int, total: int, every: int, rank: int, metrics_log, model, optimizer, scheduler,
            epoch: int) -> None:
    """Rank 0 logs the step's metrics; every worker reports them to Ray Train, with a checkpoint every ``every``
    steps and after the last."""
    import ray.train

    save = step == total or (every > 0 and step % every == 0)
    if rank == 0:
        metrics_log.add(metrics)
    if save:
        if rank == 0:
            metrics_log.flush()
            with tempfile.TemporaryDirectory() as tmp:
                _save_state(model, optimizer, scheduler, step, epoch, tmp)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=checkpoint_dir_name(step))
        else:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=checkpoint_dir_name(step))
    else:
        ray.train.report(metrics)


def worker_place(rank: int, device) -> dict:
    """Where this Ray Train worker runs: its rank, Ray node id, node IP (the address the node joined the cluster
    with, as ``ray status`` shows it), host name, process id and torch device."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n.get("NodeManagerAddress") for n in ray.nodes() if n.get("NodeID") == node_id), None)
    return {"rank": rank, "node_id": node_id, "node_ip": ip or ray.util.get_node_ip_address(),
            "host": platform.node(), "pid": os.getpid(), "device": str(device)}


def record_workers(storage, output: str, rank: int, world: int, device) -> list[dict]:
    """Gather every worker's :func:`worker_place` (a collective: every rank calls it) and, on rank 0, write them into
    ``OUT/train_manifest.json`` under ``workers`` (one entry per rank, in rank order), so a run says which node each
    worker trained on. Ray Train restarts (``checkpoint.max_failures``) rewrite the list. Returns the list."""
    import torch.distributed as dist

    place = worker_place(rank, device)
    places = [place]
    if world > 1 and dist.is_available() and dist.is_initialized():
        places = [None] * world
        dist.all_gather_object(places, place)
    if rank == 0:
        path = f"{output.rstrip('/')}/train_manifest.json"
        manifest = json.loads(storage.read_bytes(path))
        manifest["workers"] = places
        nodes = sorted({p["node_id"] for p in places})
        manifest["resolved"]["nodes"] = len(nodes)
        storage.write_bytes(path, (json.dumps(manifest, indent=2) + "\n").encode())
        log.info("%d worker(s) on %d node(s): %s", world, len(nodes),
                 ", ".join(f"rank {p['rank']} on node {p['node_id'][:8]} ({p['node_ip']}, pid {p['pid']})"
                           for p in places))
    return places


def placement_tries(stall_limit_s: float) -> int:
    """Ray Train's ``FailureConfig.controller_failure_limit`` for a ``ray.stall_limit_s``: how many more times Ray
    Train may wait ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (Ray's default 60 s; Ray Train passes the driver's
    value on) for room to place the workers after a first wait, so that it waits ``stall_limit_s`` in all (rounded
    up to whole waits, at least one) before the run ends with an error. Ray's own default, -1, waits forever: a
    run whose node is gone, or whose STRICT_SPREAD asks for more nodes than there are, would never end.
    ``stall_limit_s`` 0: -1 (wait forever). 1800 s at 60 s a wait: 29."""
    if stall_limit_s <= 0:
        return -1
    start_timeout = float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60") or 60)
    return max(0, math.ceil(stall_limit_s / max(1.0, start_timeout)) - 1)


def train_loop(config: dict) -> None:
    """Ray Train worker: the training loop (the same code on a laptop's CPU workers and a GPU cluster)."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from pairmine.pipeline.xprt import positive_probability

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    # Ray Train logs every report() with all its metrics at INFO, per worker: our own line every 10 steps replaces it.
    # (Its logger is private and named by file path, so the line is dropped by its text, with no private import.)
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: not str(record.msg).startswith("Reporting training result"))
    cfg = TrainConfig.from_dict(config["cfg"])
    total, per_epoch, output = config["total_steps"], config["steps_per_epoch"], config["output"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    record_workers(config["storage"], output, rank, world, device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.scaling.threads or max(1, math.ceil(config["cpus_per_worker"])))
    amp = _autocast_dtype(cfg, device.type)
    per_worker = cfg.train.batch_size // world
    lo = cfg.loss

    on_revela = config.get("objective") == "revela"
    if on_revela:  # LoRA adapters of the LM and the retriever only, seed 001's lr and warmup steps
        tokenizer, lm_tokenizer, model = _load_revela_models(cfg)
        optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad],
                                        "lr": cfg.train.revela_lr, "weight_decay": cfg.train.weight_decay}])
        warmup = min(cfg.train.revela_warmup_steps, total)
    else:
        tokenizer, model, frozen, fresh_head = _load_models(cfg, config.get("objective"))
        if frozen is not None:
            frozen.to(device)
        optimizer = torch.optim.AdamW(_param_groups(model, cfg, fresh_head))
        warmup = int(cfg.train.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))
    step = 0
    state, source = None, ""
    checkpoint = ray.train.get_checkpoint()  # Ray Train's newest registered one (also after a worker restart)
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, STATE_FILE), map_location="cpu", weights_only=False)
        source = checkpoint.path
    stray = config.get("resume_from")  # a newer complete checkpoint Ray Train never registered (plan_resume)
    if stray and (state is None or int(state["step"]) < stray["step"]):
        blob = config["storage"].read_bytes(f"{stray['path']}/{STATE_FILE}")
        state, source = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False), stray["path"]
        del blob
    if state is not None:
        load_trainable_state(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        del state
        if rank == 0:
            epoch, k = divmod(step, per_epoch)
            if step >= total:
                rest = "nothing left to train"
            elif k:
                rest = (f"skipping the {k} batches ({k * cfg.train.batch_size} groups) of epoch {epoch} already "
                        "trained")
            else:
                rest = f"epoch {epoch} starts at its first batch"
            log.info("resumed from checkpoint at step %d of %d (%s): %s", step, total, source, rest)
    on_negatives = config.get("objective") == "negatives"
    on_xtr = config.get("objective") == "xtr"
    # The hard-negative and XTR objectives use the encoder only: DDP must not wait for the decoder's and head's
    # gradients.
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs={
        "find_unused_parameters": on_negatives or on_xtr or on_revela})
    inner = model.module if hasattr(model, "module") else model
    start_step = step
    metrics_log = MetricsLog(output, step, config["storage"]) if rank == 0 else None
    shard = ray.train.get_dataset_shard("train")
    every = cfg.checkpoint.every_steps
    t_last = time.time()

    while step < total:
        # The epoch's order is the same in every attempt (seeded block order and local shuffle, Ray Data's
        # preserve_order): after a resume mid-epoch, the batches before the checkpoint's step are read and skipped.
        epoch = step // per_epoch
        skip = step - epoch * per_epoch  # batches of this epoch trained before the checkpoint (0 but after a resume)
        todo = min(per_epoch, total - epoch * per_epoch) - skip  # batches this attempt trains in this epoch
        shuffle = cfg.train.shuffle_buffer
        batches = shard.iter_batches(batch_size=per_worker, drop_last=True, batch_format="numpy",
                                     local_shuffle_buffer_size=shuffle or None,
                                     local_shuffle_seed=cfg.train.seed + 1000 * epoch + rank if shuffle else None)
        seen, done = 0, 0
        for batch in batches:
            seen += 1
            if seen <= skip:
                continue
            done += 1
            if on_revela:
                terms = revela_step(model, tokenizer, lm_tokenizer, batch, cfg, world, device, amp, optimizer,
                                    scheduler)
                step += 1
                now = time.time()
                g = len(batch["anchor_text"])
                metrics = {k: round(float(v), 6) for k, v in terms.items() if k not in ("groups", "sequences")}
                metrics.update({"step": step, "epoch": epoch, "start_step": start_step,
                                "batch": batch_digest(batch["group_id"], world, device),
                                "lr": scheduler.get_last_lr()[0], "groups": g * world,
                                "sequences_per_worker": int(terms["sequences"]),
                                "groups_per_s": round(g * world / max(now - t_last, 1e-9), 3), "time": round(now, 3)})
                t_last = now
                if rank == 0 and (step % 10 == 0 or step == 1 or step == total):
                    log.info("step %d/%d loss %.4f (Revela in-batch NTP, %d sequences per worker) Sim top %.3f, "
                             "own group %.3f, %.2f groups/s", step, total, metrics["loss"],
                             metrics["sequences_per_worker"], metrics["sim_top"], metrics["sim_same_group"],
                             metrics["groups_per_s"])
                _report(metrics, step, total, every, rank, metrics_log, inner, optimizer, scheduler, epoch)
                if done == todo:
                    break
                continue
            if on_xtr:
                terms = xtr_step(model, tokenizer, batch, cfg, world, device, amp, optimizer, scheduler)
                step += 1
                now = time.time()
                g = len(batch["anchor_text"])
                metrics = {k: round(float(v), 6) for k, v in terms.items()}
                metrics.update({"step": step, "epoch": epoch, "start_step": start_step,
                                "batch": batch_digest(batch["group_id"], world, device),
                                "lr": scheduler.get_last_lr()[0], "groups": g * world,
                                "groups_per_s": round(g * world / max(now - t_last, 1e-9), 3), "time": round(now, 3)})
                t_last = now
                if rank == 0 and (step % 10 == 0 or step == 1 or step == total):
                    log.info("step %d/%d loss %.4f (XTR, k_train %d) p+ %.3f, query tokens retrieving their "
                             "positive %.3f, %.2f groups/s", step, total, metrics["loss"], lo.xtr_k_train,
                             metrics["p_positive"], metrics["z_positive"], metrics["groups_per_s"])
                _report(metrics, step, total, every, rank, metrics_log, inner, optimizer, scheduler, epoch)
                if done == todo:
                    break
                continue
            if on_negatives:
                terms = negatives_step(model, tokenizer, batch, cfg, world, device, amp, optimizer, scheduler,
                                       config.get("teacher", False))
                step += 1
                now = time.time()
                g = len(batch["query"])
                metrics = {k: round(float(v.detach()), 6) for k, v in terms.items()}
                metrics.update({"step": step, "epoch": epoch, "start_step": start_step,
                                "batch": batch_digest([f"{d}\x00{q}" for d, q in zip(batch["doc_id"], batch["query"])],
                                                      world, device),
                                "lr": scheduler.get_last_lr()[0], "groups": g * world,
                                "groups_per_s": round(g * world / max(now - t_last, 1e-9), 3), "time": round(now, 3)})
                t_last = now
                if rank == 0 and (step % 10 == 0 or step == 1 or step == total):
                    log.info("step %d/%d loss %.4f (InfoNCE %.4f KL %.4f) p+ %.3f %.2f groups/s", step, total,
                             metrics["loss"], metrics["l_nce"], metrics["l_kl"], metrics["p_positive"],
                             metrics["groups_per_s"])
                _report(metrics, step, total, every, rank, metrics_log, inner, optimizer, scheduler, epoch)
                if done == todo:
                    break
                continue
            terms, w_ret, grad_norm, (a, p, all_docs) = xprt_step(
                model, frozen, tokenizer, batch, cfg, step, total, rank, world, device, amp, optimizer, scheduler)
            g = len(batch["anchor_text"])
            step += 1

            # report: local terms averaged over workers; global terms are already global
            local = torch.stack([terms["l_cross"], terms["l_self"], terms["l_mlm"]]).detach().float()
            if world > 1:
                dist.all_reduce(local)
                local /= world
            terms["l_cross"], terms["l_self"], terms["l_mlm"] = local
            now = time.time()
            metrics = {k: round(float(v.detach()), 6) for k, v in terms.items()}
            metrics["loss"] = round(float(lo.w_xp * metrics["l_xp"] + lo.w_unif * metrics["l_unif"]
                                          + w_ret * metrics["l_retention"] + lo.w_cross * metrics["l_cross"]
                                          + lo.w_self * metrics["l_self"] + lo.w_mlm * metrics["l_mlm"]), 6)
            metrics.update({
                "step": step, "epoch": epoch, "start_step": start_step, "w_retention": round(w_ret, 6),
                "batch": batch_digest(batch["group_id"], world, device),
                "p_positive": round(float(positive_probability(a, p, all_docs, lo.tau, lo.mask_same_doc)), 6),
                "lr": scheduler.get_last_lr()[0], "lr_new": scheduler.get_last_lr()[1],
                "grad_norm": round(float(grad_norm), 6), "groups": g * world,
                "groups_per_s": round(g * world / max(now - t_last, 1e-9), 3), "time": round(now, 3),
            })
            t_last = now
            save = step == total or (every > 0 and step % every == 0)
            if rank == 0 and (step % 10 == 0 or step == 1 or save):
                log.info("step %d/%d loss %.4f (xp %.4f cross %.4f self %.4f mlm %.4f unif %.4f ret %.4f x %.1f) "
                         "p+ %.3f %.2f groups/s", step, total, metrics["loss"], metrics["l_xp"], metrics["l_cross"],
                         metrics["l_self"], metrics["l_mlm"], metrics["l_unif"], metrics["l_retention"], w_ret,
                         metrics["p_positive"], metrics["groups_per_s"])
            _report(metrics, step, total, every, rank, metrics_log, inner, optimizer, scheduler, epoch)
            if done == todo:
                break
        if done < todo:
            raise RuntimeError(f"epoch {epoch} ended after {seen} of {skip + todo} batches: fewer groups than "
                               "counted")

    if rank == 0:
        metrics_log.flush()
        exported = inner
        if on_revela:  # the retriever with its LoRA adapters merged: a plain encoder, as every objective exports
            import types

            exported = types.SimpleNamespace(encoder=inner.merged_retriever())
        target = _export(exported, tokenizer, output, config["description"], cfg.train.max_length,
                         config["storage"])
        log.info("exported the encoder and tokenizer to %s (step %d)", target, step)
    if world > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------------
# Driver


def check_train_model(cfg: TrainConfig) -> None:
    """Fail before Ray starts when the configured model cannot be found (reads only its config)."""
    if not cfg.train.model:
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(cfg.train.model, trust_remote_code=cfg.train.trust_remote_code)
    except Exception as e:
        raise ConfigError(f"train.model = {cfg.train.model!r} cannot be loaded: {str(e).splitlines()[0]}") from None


def check_revela_lm(cfg: TrainConfig) -> None:
    """Fail before Ray starts when ``train.revela_lm`` cannot be found or is not a causal LM of the layout Revela's
    in-batch attention is built on (reads only its config; the layout is checked on the model built from that
    config on the meta device, no weights read or allocated: raised in the training workers instead, the error
    would reach the CLI as Ray Train's traceback, after Ray started).

    Raises:
        ConfigError: naming ``train.revela_lm``.
        UnsupportedDecoderError: naming ``train.revela_lm``: its layout (see
            :func:`pipeline.revela_model.check_decoder`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pairmine.pipeline.revela_model import UnsupportedDecoderError, check_decoder

    try:
        conf = AutoConfig.from_pretrained(cfg.train.revela_lm, trust_remote_code=cfg.train.trust_remote_code)
    except Exception as e:
        raise ConfigError(f"train.revela_lm = {cfg.train.revela_lm!r} cannot be loaded: "
                          f"{str(e).splitlines()[0]}") from None
    if getattr(conf, "is_encoder_decoder", False) or not hasattr(conf, "num_attention_heads"):
        raise ConfigError(f"train.revela_lm = {cfg.train.revela_lm!r} ({conf.model_type}) is not a decoder-only "
                          "causal LM")
    try:
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(conf, trust_remote_code=cfg.train.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - the workers load it for real, and say what is wrong
        log.debug("train.revela_lm = %r: no model built from its config on the meta device: %r",
                  cfg.train.revela_lm, e)
        return
    try:
        check_decoder(lm)
    except UnsupportedDecoderError as e:
        raise UnsupportedDecoderError(f"train.revela_lm = {cfg.train.revela_lm!r}: {e}") from None


def storage_args(output: str, storage=None) -> dict:
    """Ray Train's storage for ``output``: the path itself when local; for ``s3://``, ``storage``'s pyarrow
    filesystem (:meth:`operators.storage.Storage.arrow_filesystem`: the endpoint, region and credentials that s3fs
    gets for every other read and write, from ``[storage]`` or the AWS environment and profile) and the bucket path.

    Raises:
        operators.s3config.S3ConfigError: the AWS configuration cannot be read."""
    from pairmine.operators.storage import LOCAL, is_local

    storage = storage or LOCAL
    if is_local(output) or not output.startswith("s3://"):
        return {"storage_path": output}
    fs, path = storage.arrow_filesystem(output)
    return {"storage_path": path, "storage_filesystem": fs}


class TrainingMemoryError(ConfigError):
    """Ray's memory monitor killed a process of the training run (a worker, the controller or a data task): the
    settings ask for more memory than the node has. User-fixable (the message names the keys that lower it); the CLI
    prints it as one ``pairmine: error:`` line."""


def _error_chain(e: BaseException):
    """Every exception reachable from ``e`` through Ray Train's wrappers (``cause``, ``controller_failure``,
    ``worker_failures``' values) and Python's ``__cause__`` / ``__context__``, ``e`` first, each once."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        err = stack.pop(0)
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        failures = getattr(err, "worker_failures", None)
        stack += [getattr(err, "cause", None), getattr(err, "controller_failure", None), err.__cause__,
                  err.__context__, *(failures.values() if isinstance(failures, dict) else [])]


def out_of_memory_message(e: BaseException, cfg: TrainConfig) -> str | None:
    """The one-line message for an error of ``trainer.fit()`` caused by an out-of-memory kill, or None.

    Ray reports the kill as ``ray.exceptions.OutOfMemoryError`` ("... killed due to the node running low on memory.
    Memory on the node ... was X used / Y limit ...", the memory monitor's multi-page report); Ray Train wraps a
    worker's in its own error (``cause``, ``__cause__``, ``controller_failure`` or ``WorkerGroupError``'s
    ``worker_failures``, a mapping of rank to error). The chain
    is searched for that class or that text; the message keeps the node's figures and the killed task's name and
    says which keys lower the memory, and which of them a resume on the same ``--output`` accepts
    (:func:`check_train_resume`)."""
    import re

    from ray.exceptions import OutOfMemoryError

    hit = next((str(err) for err in _error_chain(e) if isinstance(err, OutOfMemoryError)
                or "running low on memory" in str(err) or "memory monitor" in str(err)), None)
    if hit is None:
        return None
    node = re.search(r"was ([\d.]+\s*[KMGT]?B) used / ([\d.]+\s*[KMGT]?B) limit", hit)
    task = re.search(r"task name=([^,]+)", hit)
    t = cfg.train
    return (f"training ran out of memory: Ray's memory monitor killed "
            f"{task.group(1) if task else 'a process of the run'}"
            f"{f' (node memory {node.group(1)} used of {node.group(2)})' if node else ''}; lower train.batch_size "
            f"(now {t.batch_size}) or train.max_length (now {t.max_length}), or loss.head_chunk_mb (now "
            f"{cfg.loss.head_chunk_mb:g}){'' if t.gradient_checkpointing else ', set train.gradient_checkpointing=true'}"
            ", or run fewer workers per node (scaling.*); the same --output "
            "resumes after a change of loss.head_chunk_mb, train.gradient_checkpointing or scaling.* only, another "
            "batch size or length needs a new --output")


class WorkerLostError(ConfigError):
    """A training worker died (its node was lost, its process killed) and Ray Train had no restart left
    (``checkpoint.max_failures``), or Ray Train could not place the workers for ``ray.stall_limit_s``. The message
    names the worker (rank, node, pid) or what could not be placed, the latest checkpoint, and how to resume; the
    CLI prints it as one ``pairmine: error:`` line."""


def latest_checkpoint(storage, output: str, checkpoint_name: str) -> tuple[int, str] | None:
    """The newest complete checkpoint under ``OUT/<checkpoint.name>`` as (step, folder), or None (no checkpoint yet,
    or the folder cannot be listed). Complete as :func:`_checkpoint_step` reads it."""
    folder = f"{output.rstrip('/')}/{checkpoint_name}"
    try:
        names = [p for p in storage.ls(folder) if p.rstrip("/").rsplit("/", 1)[-1].startswith("checkpoint_")
                 and (storage.info(p) or {}).get("type") == "directory"]  # not Ray's checkpoint_manager_snapshot.json
        steps = [(s, p) for p in names if (s := _checkpoint_step(storage, p)) is not None]
    except (OSError, ValueError):
        return None
    return max(steps) if steps else None


def lost_worker_message(e: BaseException, cfg: TrainConfig, storage, output: str, total: int,
                        resources: dict, workers: int) -> str | None:
    """The one-line message for an error of ``trainer.fit()`` caused by a lost worker or by workers Ray Train could
    not place, or None.

    A lost worker: Ray Train's ``WorkerGroupError`` maps ranks to their errors; the rank whose error is Ray's
    ``RayActorError`` (the actor died or is unreachable: its node or process is gone), itself or as what Ray Train's
    health check met (``WorkerHealthCheckFailedError``, or its timeout), is the lost one; the others' errors are the
    collateral of the broken collective. Its node and pid come from ``OUT/train_manifest.json``'s ``workers``
    (:func:`record_workers`). Workers not placed: a ``WorkerGroupStartupTimeoutError`` (Ray Train waited
    ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` for room, as many times as ``ray.stall_limit_s`` allows). Both
    messages name the latest checkpoint (:func:`latest_checkpoint`) and the command that resumes from it."""
    from ray.exceptions import RayActorError

    from pairmine.pipeline.ray_adapter import describe_cluster

    chain = list(_error_chain(e))
    latest = latest_checkpoint(storage, output, cfg.checkpoint.name)
    resume = (f"the latest checkpoint is step {latest[0]} of {total} ({latest[1]}): the same command with the same "
              f"--output resumes from it" if latest else
              "no checkpoint was saved yet: the same command with the same --output starts the run again")
    for err in chain:
        if type(err).__name__ == "WorkerGroupStartupTimeoutError":
            waited = cfg.ray.stall_limit_s
            return (f"training stalled: Ray Train could not place its {workers} worker(s) ({resources} each, "
                    f"placement {cfg.scaling.placement}) for ~{waited:g} s (ray.stall_limit_s); the cluster is "
                    f"{describe_cluster()}; {resume} once the cluster has room, or lower scaling.num_workers or "
                    f"scaling.cpus_per_worker, or choose scaling.placement=PACK")
    def death(f):  # the actor's death: itself, or what Ray Train's health check of the worker met
        f = getattr(f, "health_check_failure", f)
        return f if isinstance(f, RayActorError) or type(f).__name__ == "WorkerHealthCheckTimeoutError" else None

    for err in chain:
        failures = getattr(err, "worker_failures", None)
        if not isinstance(failures, dict) or not failures:
            continue
        dead = [r for r, f in sorted(failures.items()) if death(f) is not None]
        if not dead:
            continue
        try:
            places = {w["rank"]: w for w in json.loads(
                storage.read_bytes(f"{output.rstrip('/')}/train_manifest.json")).get("workers") or []}
        except (OSError, ValueError):
            places = {}
        names = []
        for r in dead:
            w = places.get(r)
            names.append(f"rank {r}" + (f" (node {w['node_id'][:8]} at {w['node_ip']}, pid {w['pid']})" if w else ""))
        cause = " ".join(str(death(failures[dead[0]])).split())[:160]
        restarts = cfg.checkpoint.max_failures
        restart = (f"Ray Train's {restarts} restart(s) (checkpoint.max_failures) are used up" if restarts else
                   "checkpoint.max_failures = 0: Ray Train restarts no worker")
        return (f"training worker {', '.join(names)} was lost ({cause}); {restart}; {resume}, on the nodes that are "
                f"left (or set checkpoint.max_failures to restart within the run once capacity returns)")
    return None


# Keys that do not change what a training run computes (where it runs, how often it saves, how memory is bounded:
# chunking and recomputation give the same losses and gradients): a resumed run may change them.
_NOT_PLAN_SECTIONS = {"ray", "storage", "scaling", "checkpoint"}
_NOT_PLAN_FIELDS = {("train", "gradient_checkpointing"), ("train", "trust_remote_code"), ("loss", "head_chunk_mb"),
                    ("loss", "xtr_chunk_mb")}


def train_plan(cfg: TrainConfig, run_dir: str, n_groups: int, objective: str, workers: int) -> dict:
    """What decides a training run's output, recorded in ``train_manifest.json`` as ``plan`` and compared on a
    re-run with the same ``--output`` (:func:`check_train_resume`): the groups (or negatives) run and its group count,
    the objective, the number of workers (it sets each worker's share of the batch, the data split and the batch
    digests) and every config key but those of :data:`_NOT_PLAN_SECTIONS` / :data:`_NOT_PLAN_FIELDS` (``distill``
    only for a negatives run). Returns a JSON-able dict."""
    config = {sec: {k: v for k, v in vals.items() if (sec, k) not in _NOT_PLAN_FIELDS}
              for sec, vals in cfg.to_dict().items()
              if sec not in _NOT_PLAN_SECTIONS and (sec != "distill" or objective == "negatives")}
    return {"format": "pairmine-train-plan/1", "groups_run": run_dir.rstrip("/"), "groups": n_groups,
            "objective": objective, "workers": workers, "config": config}


def check_train_resume(storage, output: str, plan: dict, checkpoint_name: str) -> bool:
    """Refuse to resume a training run with other settings (issue 39 item 2; ray-project/ray#35812: Ray Train loads
    whatever checkpoint the folder holds). An ``output`` holding a checkpoint under ``checkpoint_name`` or an
    ``export/`` is an earlier attempt; its ``train_manifest.json``'s plan must equal ``plan`` (:func:`train_plan`).

    Returns:
        True when there is an earlier attempt to resume (its plan matches), False for a fresh output. A folder of an
        older pairmine whose manifest has no plan is resumed as before (logged).

    Raises:
        ConfigError: one line naming every differing key with its value then and now, and what to do.
    """
    root = output.rstrip("/")
    ckpt_root = f"{root}/{checkpoint_name}"
    has_ckpt = any(p.rstrip("/").rsplit("/", 1)[-1].startswith("checkpoint_")
                   for p in (storage.ls(ckpt_root) if storage.info(ckpt_root) else []))
    if not has_ckpt and not storage.info(f"{root}/export"):
        return False
    try:
        old = json.loads(storage.read_bytes(f"{root}/train_manifest.json")).get("plan")
    except (OSError, ValueError):
        old = None
    if old is None:
        log.warning("--output %s holds checkpoints or an export but no training plan (an older pairmine, or a "
                    "manifest lost): resuming without checking the settings", output)
        return True
    diffs = []
    for key in ("groups_run", "groups", "objective", "workers"):
        if old.get(key) != plan[key]:
            diffs.append(f"{key} ({old.get(key)!r} then, {plan[key]!r} now)")
    for sec, vals in plan["config"].items():
        for k, v in vals.items():
            then = (old.get("config") or {}).get(sec, {}).get(k)
            if then != v:
                diffs.append(f"{sec}.{k} ({then!r} then, {v!r} now)")
    if diffs:
        shown = ", ".join(diffs[:6]) + (f" and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise ConfigError(f"--output {output} holds a training run made with other settings: {shown}; resume it with "
                          "the same ones, or use another --output (or remove this one to start again)")
    return True


def absolute_model_paths(cfg: TrainConfig) -> None:
    """Make ``train.model`` and ``train.revela_lm`` absolute (in place) where they name a local folder: Ray Train's
    workers run in another working directory, where ``--model ./my-encoder`` would name nothing (and, as a hub id,
    end in a download error). Hub ids and s3:// paths are left as they are."""
    for key in ("model", "revela_lm"):
        value = getattr(cfg.train, key)
        if value and "://" not in value and os.path.exists(os.path.expanduser(value)):
            setattr(cfg.train, key, os.path.abspath(os.path.expanduser(value)))


def train(cfg: TrainConfig, groups: str, output: str, negatives: str = "") -> TrainResult:
    """Run the training job with a validated config.

    Args:
        groups: a committed ``pairmine mine`` run folder (or its ``groups/``), local or s3://: the xPRT objective.
        output: folder for checkpoints, metrics.jsonl and export/, local or s3://; an existing one with checkpoints
            is resumed.
        negatives: instead of ``groups``, a committed ``pairmine negatives`` run: the hard-negative objective
            (:mod:`pipeline.distill`; seed 004 chapter 3), grouped batches of 1 positive + ``distill.hard_negatives``.

    Raises:
        FileNotFoundError, InputError: missing, incomplete or malformed groups, or too few groups for one batch.
        ConfigError: a bad combination of settings (batch size vs workers), a model that cannot be loaded.
        UnsupportedDecoderError: ``train.revela_lm`` has not the LLaMA / Qwen2 layout (:func:`check_revela_lm`).
        CredentialsExpiredError: the S3 credentials expired during the run (Ray Train's checkpoints and Ray Data's
            reads go through pyarrow, outside :meth:`Storage.retry`); the message says how to renew them.
    """
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from pairmine.operators.s3config import is_expired_token
    from pairmine.operators.storage import CredentialsExpiredError, expired_message, is_local
    from pairmine.pipeline.ray_adapter import cluster_gpus, configure_data, init_ray

    def cluster_cpus() -> float:
        return float(ray.cluster_resources().get("CPU", 1))

    t0 = time.time()
    absolute_model_paths(cfg)
    storage = cfg.storage_layer()
    teacher, left_out = False, 0
    if negatives and cfg.train.positives != "xprt":
        raise ConfigError("train.positives applies to --groups; --negatives trains on the negatives run's own "
                          "positives")
    if negatives and cfg.train.objective != "xprt":
        raise ConfigError(f"train.objective = {cfg.train.objective!r} trains on --groups; --negatives has its own "
                          "objective (InfoNCE + KL)")
    if negatives:
        groups = negatives
        parts, run_dir = find_group_parts(negatives, storage, folder="negatives")
        n_pairs, n_groups, teacher = check_negative_parts(storage, parts, cfg.distill.hard_negatives)
        left_out, n_related = n_pairs - n_groups, cfg.distill.hard_negatives
        log.info("negatives run %s: %d pairs, %d with at least %d negatives (%d left out), teacher scores: %s; "
                 "L = %g InfoNCE + %g KL, tau %g", run_dir, n_pairs, n_groups, n_related, left_out,
                 "yes" if teacher else "no (InfoNCE only)", cfg.distill.alpha if teacher else 1.0,
                 1 - cfg.distill.alpha if teacher else 0.0, cfg.distill.tau)
    else:
        parts, run_dir = find_group_parts(groups, storage)
        n_groups, n_related = check_group_parts(storage, parts)
        if n_related < 1:
            raise InputError(f"groups {groups}: the groups have no related passages")
    check_train_model(cfg)
    if cfg.train.objective == "revela":
        check_revela_lm(cfg)
    description = export_description(cfg, storage, run_dir)
    per_epoch, trained_per_epoch, left_per_epoch = epoch_accounting(n_groups, cfg.train.batch_size)
    if per_epoch < 1:
        raise InputError(f"groups {groups}: {n_groups} groups are too few for one batch of train.batch_size = "
                         f"{cfg.train.batch_size}")
    if "://" not in output:
        output = os.path.abspath(output)
    if (storage.info(output) or {}).get("type") == "file":
        raise ConfigError(f"--output {output} is a file; it must be a folder (created if missing)")

    where = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    configure_data(1.0)
    sc = cfg.scaling
    gpus = cluster_gpus() if sc.device != "cpu" else 0
    use_gpu = sc.device == "cuda" or (sc.device == "auto" and gpus > 0)
    if sc.device == "cuda" and not gpus:
        raise ConfigError("scaling.device = 'cuda' but the Ray cluster has no GPU")
    workers = sc.num_workers or (gpus if use_gpu else 2)
    if cfg.train.batch_size % workers:
        raise ConfigError(f"train.batch_size = {cfg.train.batch_size} must divide by the {workers} workers "
                          "(scaling.num_workers)")
    plan_now = train_plan(cfg, run_dir, n_groups, "negatives" if negatives else cfg.train.objective, workers)
    if check_train_resume(storage, output, plan_now, cfg.checkpoint.name):
        log.info("%s holds an earlier attempt of this training run (the same plan): resuming it", output)
    total = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * per_epoch
    what = (f"1 positive + {n_related} hard negatives each, objective InfoNCE{' + KL' if teacher else ''}"
            if negatives else f"{n_related} related passages each, positives {cfg.train.positives}, objective "
            f"{cfg.train.objective}")
    log.info("training on %d groups (%s) from %s: %d steps of %d groups (%d per epoch: %d groups trained, %d left "
             "out), %d worker(s) on %s; Ray %s", n_groups, what, run_dir, total, cfg.train.batch_size, per_epoch,
             trained_per_epoch, left_per_epoch, workers, "GPU (nccl)" if use_gpu else "CPU (gloo)", where)

    columns = list(REQUIRED_COLUMNS) if not negatives else (
        ["doc_id", "query", "positive", "negatives"]
        + (["positive_teacher_score", "negative_teacher_scores"] if teacher else []))
    # Ray Data reads the parts itself (its own retries), through [storage]'s filesystem.
    fs_in, _ = storage.arrow_filesystem(run_dir)
    # Its tasks reserve scaling.data_cpus each (a fraction): Ray Data's default, 1 CPU, never fits beside workers
    # that leave less than a whole CPU free on every node (2 CPU workers spread over two 16-CPU nodes, say). Ray
    # Data's DataSourceV2 parquet path lists the files in a task of 1 CPU that no read option lowers (its
    # ListFiles operator): the training input is read through the V1 path, whose read tasks take ray_remote_args.
    data_cpus = sc.data_cpus
    data_ctx = ray.data.DataContext.get_current()
    v2, data_ctx.use_datasource_v2 = data_ctx.use_datasource_v2, False
    try:  # the dataset keeps a copy of the context as it is here
        ds = ray.data.read_parquet([storage.arrow_filesystem(p)[1] for p in parts], columns=columns,
                                   filesystem=fs_in, ray_remote_args={"num_cpus": data_cpus})
    except Exception as e:  # noqa: BLE001 - its file-info tasks can be killed for memory too
        memory = out_of_memory_message(e, cfg)
        if memory is not None:
            raise TrainingMemoryError(memory) from None
        raise
    finally:
        data_ctx.use_datasource_v2 = v2
    if negatives:
        h = cfg.distill.hard_negatives
        ds = ds.filter(lambda row: row["negatives"] is not None and len(row["negatives"]) >= h, num_cpus=data_cpus)
    elif cfg.train.positives in ("random", "crop"):
        from pairmine.pipeline.positives import with_random_positives

        try:
            run_manifest = json.loads(storage.read_bytes(f"{run_dir}/manifest.json"))
        except (OSError, ValueError) as e:
            raise InputError(f"groups {groups}: {cfg.train.positives} positives need the run's manifest.json "
                             f"({e})") from None
        ds = with_random_positives(ds, run_manifest, storage, cfg.train.seed, max(1, min(64, len(parts))),
                                   cfg.train.positives, data_cpus)
        ds = ds.select_columns(["group_id", "doc_id", "anchor_text", "related_texts", "positive_text"])
        log.info("%s: drawn from all passages of each group's document, re-chunked from the run's %d input file(s)",
                 "random positives" if cfg.train.positives == "random"
                 else "crop pairs (anchor and positive: two random spans of passage length)",
                 len(run_manifest.get("inputs") or []))
    else:
        ds = ds.select_columns(["group_id", "doc_id", "anchor_text", "related_texts"])
    ds = ds.randomize_block_order(seed=cfg.train.seed)

    alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    alive_cpus = sum(n["Resources"]["CPU"] for n in alive) or cluster_cpus()
    # Left free for Ray Data: data_cpus on every node, and at least one whole CPU; a whole CPU on every node when
    # random or crop positives shuffle the groups by document (Ray Data's shuffle tasks take 1 CPU each, not set).
    per_node = 1.0 if not negatives and cfg.train.positives in ("random", "crop") else data_cpus
    cpus = sc.cpus_per_worker or (1.0 if use_gpu
                                  else max(0.25, (alive_cpus - max(1.0, per_node * len(alive))) / workers))
    resources = {"CPU": cpus}
    if use_gpu:
        resources["GPU"] = sc.gpus_per_worker
    manifest = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "plan": plan_now,
        "groups": {"path": groups, "run": run_dir, "parts": len(parts), "groups": n_groups, "related": n_related,
                   "groups_per_epoch_trained": trained_per_epoch, "groups_per_epoch_left_out": left_per_epoch},
        "objective": "negatives" if negatives else cfg.train.objective,
        **({"negatives": {"pairs_left_out": left_out, "hard_negatives": cfg.distill.hard_negatives,
                          "teacher": teacher}} if negatives else {}),
        "resolved": {"workers": workers, "cpus_per_worker": cpus, "device": "cuda" if use_gpu else "cpu",
                     "backend": "nccl" if use_gpu else "gloo", "total_steps": total, "steps_per_epoch": per_epoch, "passage_prefix": cfg.resolved_prefix(),
                     "export_description": description.to_json(), "ray": where},
        "versions": software_versions(),
        "host": platform.node(),
    }
    storage.makedirs(output)
    storage.write_bytes(f"{output.rstrip('/')}/train_manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    plan = plan_resume(storage, f"{output.rstrip('/')}/{cfg.checkpoint.name}")
    # Ray Data keeps the block order of the (seeded) dataset through the streaming split, so an epoch is the same
    # sequence of batches in every attempt and a resume can skip exactly the batches already trained.
    from ray.train import DataConfig

    ingest = DataConfig.default_ingest_options()
    ingest.preserve_order = True

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"cfg": cfg.to_dict(), "total_steps": total, "steps_per_epoch": per_epoch, "output": output,
                           "cpus_per_worker": cpus, "description": description.to_json(),
                           "objective": "negatives" if negatives else cfg.train.objective, "teacher": teacher,
                           "resume_from": {"path": plan.resume_from, "step": plan.resume_step}
                           if plan.resume_from else None,
                           "storage": storage},  # the Storage object: its repr never shows credentials
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources,
                                              placement_strategy=sc.placement),
        run_config=ray.train.RunConfig(
            **storage_args(output, storage), name=cfg.checkpoint.name,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures,
                                                   controller_failure_limit=placement_tries(cfg.ray.stall_limit_s)),
        ),
        datasets={"train": ds},
        # Without shard locality no block goes to a rank because of the node that holds it (with it, Ray Data
        # prefers the worker on the block's node): where the workers run is one thing less that decides a rank's
        # groups. Not all: the streaming split still chooses in each run (docs/training.md, "On two nodes").
        dataset_config=DataConfig(execution_options=ingest, enable_shard_locality=False),
    )
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - an out-of-memory kill or expired credentials become one line
        memory = out_of_memory_message(e, cfg)
        if memory is not None:
            raise TrainingMemoryError(memory) from None
        lost = lost_worker_message(e, cfg, storage, output, total, resources, workers)
        if lost is not None:
            raise WorkerLostError(lost) from None
        if is_expired_token(e):  # Ray Train's checkpoints, Ray Data's reads: pyarrow's errors, no retry of ours
            where = output if not is_local(output) else run_dir
            raise CredentialsExpiredError(expired_message("train", where, storage.s3(), False)) from None
        raise
    if plan.resume_from and plan.resume_step < total:  # the run has saved newer checkpoints, which Ray Train keeps
        log.info("removing checkpoint %s (step %d), which the run resumed from: Ray Train never registered it",
                 plan.resume_from, plan.resume_step)
        storage.rm(plan.resume_from)
    export = f"{output.rstrip('/')}/export"
    log.info("done in %.1f s: %d steps -> %s; per epoch %d of %d groups trained, %d left out (batches of %d over %d "
             "worker(s))", time.time() - t0, total, export, trained_per_epoch, n_groups, left_per_epoch,
             cfg.train.batch_size, workers)
    return TrainResult(output=output, export_dir=export, steps=total, metrics=result.metrics,
                       groups_per_epoch_trained=trained_per_epoch, groups_per_epoch_left_out=left_per_epoch)
