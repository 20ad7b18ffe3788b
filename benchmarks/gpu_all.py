"""All GPU figures in one run, written to one JSON file (driven by benchmarks/gpu_all.sh; not a test).

    python benchmarks/gpu_all.py [--out gpu_all.json] [--parts embed,consistency,train,train_xtr,train_revela]
    python benchmarks/gpu_all.py --parts negatives --out gpu_negatives.json   # the optional sixth part
    python benchmarks/gpu_all.py --cpu-smoke --out /tmp/smoke.json     # the same code on CPU with tiny sizes

Five parts (and a sixth on request), each in its own process (a part that crashes, runs out of memory or passes its
time limit is recorded as failed with the tail of its output; the others still run) and each bounded in time:

  embed        passages/s of pairmine's own Embedder (operators/embed.py: tokenizer, one padded length per forward
               batch, mean pooling, L2 norm, vectors back to the host) for a BERT-base-sized encoder (hidden 768,
               12 layers, 12 heads, intermediate 3072) built from a BertConfig with random weights and the default
               model's tokenizer (all-MiniLM-L6-v2's, BERT's 30,522-word uncased vocabulary), saved to a temporary
               folder: no hub, no network. Every passage is 300 words of the shipped sample, so every passage is cut
               to exactly max_length = 256 tokens (checked). bf16 weights on GPU. Also the forward pass alone on
               fixed-length token ids (no tokenizer), the GPU's share of that figure.
  consistency  queries/s of operators.consistency.consistency_counts against a 1,000,000 x 768 pool stored in fp16
               on the GPU (scores fp32), by benchmarks/bench_filter.py with benchmarks/gpu_filter.sh's flags
  train        groups/s of the xPRT training step (pipeline/train.py's xprt_step, one process, bf16 autocast) on the
               same random BERT-base, by benchmarks/bench_train.py's bench_step; and MFU:
                 mfu_pct          = 6 x encoder parameters x tokens per group x groups/s / peak bf16 FLOP/s
                                    (tokens per group: the real tokens of its 5 passages after truncation, no padding;
                                    counts the trained encoder's passes only)
                 mfu_counted_pct  = FLOPs that torch's FLOP counter counts on a real step (5 encoder passes, the
                                    decoder passes, the 30k-word MLM head, the frozen model's pass, backward)
                                    x groups/s / peak
               Peak dense bf16 TFLOP/s by GPU name: see PEAK_BF16_TFLOPS; another GPU gives "unknown" and no MFU.
  train_xtr    the same for the XTR objective (``xtr_step``: anchor and positive through the encoder once, the
               in-batch token retrieval over the batch), same encoder and batch; MFU by both definitions (6NT over
               the 2 passages' tokens)
  train_revela the same for Revela (``revela_step``): the encoder as retriever and a causal LM of Qwen2.5-0.5B's
               shape (hidden 896, 24 layers, 14 heads, 2 key/value heads, intermediate 4864) built from a Qwen2Config
               with random weights and the same tokenizer, LoRA rank 256 on both, 4 groups (20 passages) of <= 160
               tokens per step (the seed's 16 passages of 160 tokens); MFU from torch's FLOP counter only
  ablation     (optional: --parts ablation; estimated ~4 min, not yet run on a GPU) pairmine ablate on one GPU:
               ``pairmine mine`` of the shipped sample with the default model (its ~2,100 groups), then the four arms
               (start, xprt, random, crop) of the scratch regime with a BERT-base-sized proxy (train.scratch_*: 12
               layers x 768, 12 heads, 3072) from random init, 300 steps of 64 pairs x 128 tokens, 1 seed, bf16,
               evaluated on tests/data/fiqa-pairs-beir and STS-B test (tests/data/stsbenchmark); records every arm's
               nDCG@10, Recall@100 and Spearman, the p-values against random and start, steps/s and wall time per
               unit (ablation.json's figures), and the wall time of mining and of the ablation
  negatives    (optional: --parts negatives; ~1 min) queries/s of the hard-negative search of one exact
               1,000,000 x 768 shard, top 200: pairmine's torch engine on the GPU (TorchFlatSearch, 8,192 queries in
               batches of 1,024) against faiss IndexFlatIP on the CPU (1,024 queries), and whether their lists agree

Time on one H100/H200 (estimates, not yet measured on a GPU): driver and CUDA start ~10 s; embed ~1 min (building
and saving the 110M-parameter model ~10 s; tokenising 16,384 passages of 300 words twice, as the Embedder does, ~15 s
on 16 cores; the forward passes, ~46 GFLOP per passage, a few seconds); consistency ~40 s (drawing the 1M x 768 random
pool on the CPU ~15 s, then twice 100,000 queries x 1M x 768 x 2 = 154 TFLOP in fp32 without TF32, ~4 s each at
~40 TFLOP/s); train ~1.5 min (groups from the sample ~4 s, model load, one FLOP-counted step, 21 more steps of 64
groups at roughly 1 TFLOP per group, ~0.2-0.6 s each); train_xtr ~40 s; train_revela ~1.5 min (building and saving
the 0.5B-parameter LM ~30 s). Together ~6 minutes; the time limits per part (TIMEOUT_S, 590 s in all) keep the whole
run under 10. If batch 64 does not fit the GPU's memory (an 80 GB H100 may be short:
320 passages of <= 256 tokens through BERT-base with backward, plus the MLM logits), the train part is run again once
with batch 32 inside the same limit, and the JSON says so (retried_after_oom_with_batch).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets; matched in this order against
# torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3" is the SXM part).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("A100", 312.0),
]

SIZES = {
    "gpu": {
        "model": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
        "embed": {"passages": 16_384, "batch_size": 256, "max_length": 256, "words_per_passage": 300,
                  "dtype": "bfloat16", "forward_batches": 40},
        "consistency": {"pool": 1_000_000, "dim": 768, "queries": 100_000, "batch": 4096, "storage": "fp16",
                        "chunk_mb": 2048, "k": 2},
        "train": {"batch": 64, "steps": 20, "max_length": 256, "dtype": "bfloat16", "token_count_groups": 4000},
        "train_xtr": {"batch": 64, "steps": 20, "max_length": 256, "dtype": "bfloat16", "token_count_groups": 4000},
        "train_revela": {"batch": 4, "steps": 5, "max_length": 160, "dtype": "bfloat16", "token_count_groups": 400,
                         "lm": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                                "num_key_value_heads": 2, "intermediate_size": 4864}},

        "negatives": {"shard": 1_000_000, "dim": 768, "queries": 8192, "faiss_queries": 1024, "depth": 200,
                      "batch": 1024},
        "ablation": {"seeds": 1, "set": ["train.scratch_layers=12", "train.scratch_hidden=768",
                                         "train.scratch_heads=12", "train.scratch_intermediate=3072",
                                         "train.max_steps=300", "checkpoint.every_steps=150"]},
    },
    "cpu-smoke": {
        "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128},
        "embed": {"passages": 32, "batch_size": 16, "max_length": 256, "words_per_passage": 300,
                  "dtype": "float32", "forward_batches": 2},
        "consistency": {"pool": 20_000, "dim": 64, "queries": 512, "batch": 256, "storage": "fp32",
                        "chunk_mb": 16, "k": 2},
        "train": {"batch": 2, "steps": 1, "max_length": 32, "dtype": "float32", "token_count_groups": 100},
        "train_xtr": {"batch": 2, "steps": 1, "max_length": 32, "dtype": "float32", "token_count_groups": 100},
        "train_revela": {"batch": 2, "steps": 1, "max_length": 32, "dtype": "float32", "token_count_groups": 100,
                         "lm": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "intermediate_size": 64}},

        "negatives": {"shard": 20_000, "dim": 64, "queries": 256, "faiss_queries": 128, "depth": 200, "batch": 64},
        "ablation": {"seeds": 1, "quick": True, "docs": 60,
                     "mine_set": ["embed.model={tiny}", "anchors.threshold=0.99", "consistency.pool_size=400"],
                     "set": ["train.scratch_layers=1", "train.scratch_hidden=32", "train.scratch_heads=2",
                             "train.scratch_intermediate=64", "train.max_steps=2"]},
    },
}
TIMEOUT_S = {"gpu": {"embed": 120, "consistency": 120, "train": 180, "train_xtr": 60, "train_revela": 110,
                     "negatives": 90, "ablation": 420},
             "cpu-smoke": {"embed": 120, "consistency": 120, "train": 120, "train_xtr": 120, "train_revela": 120,
                           "negatives": 120, "ablation": 600}}
PARTS = ("embed", "consistency", "train", "train_xtr", "train_revela")
OPTIONAL_PARTS = ("negatives", "ablation")  # not in the default run (its limits already sum to 590 s): --parts ...
OBJECTIVE = {"train": "xprt", "train_xtr": "xtr", "train_revela": "revela"}


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (tiny CPU figures must not round to 0)."""
    return float(f"{x:.{digits}g}")


def peak_bf16_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU by name, or None when it is not in :data:`PEAK_BF16_TFLOPS`."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def model_name(m: dict) -> str:
    """``BERT-base-sized`` for BERT-base's sizes, else the sizes in words."""
    if m == SIZES["gpu"]["model"]:
        return "BERT-base-sized (hidden 768, 12 layers, 12 heads, intermediate 3072)"
    return (f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads, "
            f"intermediate {m['intermediate_size']}")


def build_model(folder: Path, model_sizes: dict) -> None:
    """A BERT encoder of the given sizes with random (seeded) weights and the default model's tokenizer, saved to
    ``folder`` (skipped when it is already there)."""
    if (folder / "config.json").exists():
        return
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pairmine.operators.embed import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, **model_sizes)
    tmp = folder.with_name(folder.name + ".partial")
    BertModel(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def long_passages(n: int, words: int) -> list[str]:
    """``n`` passages of ``words`` whitespace words each, windows over the shipped sample's text (each word is at
    least one token, so 300 words always reach 256 tokens)."""
    import pyarrow.parquet as pq

    from pairmine.pipeline.inputs import SAMPLE_DIR

    pool: list[str] = []
    for shard in sorted(SAMPLE_DIR.glob("*.parquet")):
        for text in pq.read_table(shard, columns=["text"]).column("text").to_pylist():
            pool += (text or "").split()
    span = len(pool) - words
    return [" ".join(pool[(i * 997) % span:][:words]) for i in range(n)]


def part_embed(sizes: dict, device: str, model_dir: Path) -> dict:
    import numpy as np
    import torch

    from pairmine.operators.embed import Embedder, mean_pool

    s = sizes["embed"]
    t0 = time.perf_counter()
    build_model(model_dir, sizes["model"])
    texts = long_passages(s["passages"], s["words_per_passage"])
    prep_s = time.perf_counter() - t0
    emb = Embedder(model=str(model_dir), max_length=s["max_length"], batch_size=s["batch_size"], dtype=s["dtype"],
                   device=device)
    emb.setup()
    sync = torch.cuda.synchronize if emb.device == "cuda" else (lambda: None)
    emb.encode(texts[: s["batch_size"]])  # warm-up (kernels, allocator)
    sync()
    t0 = time.perf_counter()
    vectors, truncated = emb.encode_counted(texts)
    sync()
    seconds = time.perf_counter() - t0
    if not truncated.all():
        raise RuntimeError(f"{int((~truncated).sum())} passages had fewer than {s['max_length']} tokens")
    if not np.isfinite(vectors).all():
        raise RuntimeError("non-finite vectors")

    # The forward pass alone (the Embedder's model, dtype and pooling) on fixed-length token ids: no tokenizer.
    model = emb._model
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (s["batch_size"], s["max_length"]), generator=gen)
    ids, mask = ids.to(emb.device), torch.ones_like(ids).to(emb.device)
    autocast = emb.dtype in ("bfloat16", "float16") and emb.device == "cpu"  # as Embedder.encode_counted

    def forward():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            return torch.nn.functional.normalize(mean_pool(h, mask).float(), dim=-1).cpu()

    forward()
    sync()
    t1 = time.perf_counter()
    for _ in range(s["forward_batches"]):
        forward()
    sync()
    fwd_s = time.perf_counter() - t1
    fwd_rate = s["forward_batches"] * s["batch_size"] / fwd_s
    return {
        "passages_per_s": round(len(texts) / seconds, 2), "units": "passages/s",
        "what": "pairmine Embedder.encode on text (tokenise, pad, forward, mean pool, L2 norm, to host)",
        "forward_only_passages_per_s": round(fwd_rate, 2),
        "forward_only_what": "the Embedder's model on fixed-length random token ids, no tokenizer",
        "forward_only_tflops_2nt": sig(2.0 * params * s["max_length"] * fwd_rate / 1e12),
        "model": f"BertModel {model_name(sizes['model'])} from a BertConfig, random weights, all-MiniLM-L6-v2's "
                 "tokenizer",
        "params": params, "device": emb.device, "dtype": emb.dtype,
        "sizes": {**sizes["model"], "passages": len(texts), "tokens_per_passage": s["max_length"],
                  "batch_size": s["batch_size"], "forward_only_passages": s["forward_batches"] * s["batch_size"]},
        "timed_s": round(seconds, 3), "forward_only_timed_s": round(fwd_s, 3), "prepare_s": round(prep_s, 3),
    }


def part_negatives(sizes: dict, device: str) -> dict:
    """The hard-negative search of one exact index shard: pairmine's torch engine on ``device``
    (operators.negatives.TorchFlatSearch, what a GPU stage plan's search actors run) against faiss ``IndexFlatIP``
    on the CPU (the engine everywhere else), queries/s of each at depth ``depth``, and how far their lists agree
    on the queries both searched (same rows at every rank; largest score difference)."""
    import faiss
    import numpy as np
    import torch

    from pairmine.operators.negatives import TorchFlatSearch

    s = sizes["negatives"]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((s["shard"], s["dim"]), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(s["shard"], s["queries"], replace=False)] + 0.1 * rng.standard_normal(
        (s["queries"], s["dim"]), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(s["dim"])
    flat.add(x)
    engine = TorchFlatSearch(x, device)
    prep_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine.search(q[: s["batch"]], s["depth"])  # warm-up
    sync()
    t0 = time.perf_counter()
    found = [engine.search(q[i:i + s["batch"]], s["depth"]) for i in range(0, s["queries"], s["batch"])]
    sync()
    torch_s = time.perf_counter() - t0
    t_scores, t_rows = np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])
    m = s["faiss_queries"]
    t0 = time.perf_counter()
    f_scores, f_rows = flat.search(q[:m], s["depth"])
    faiss_s = time.perf_counter() - t0
    same = t_rows[:m] == f_rows
    return {
        "queries_per_s": round(s["queries"] / torch_s, 2), "units": "queries/s",
        "what": f"operators.negatives.TorchFlatSearch on {device}, top {s['depth']} of one exact shard, fp32",
        "faiss_cpu_queries_per_s": round(m / faiss_s, 2), "faiss_threads": faiss.omp_get_max_threads(),
        "torch_over_faiss_cpu": sig((s["queries"] / torch_s) / (m / faiss_s)),
        "same_rows_at_every_rank_pct": sig(100.0 * float(same.all(axis=1).mean())),
        "same_rows_pct": sig(100.0 * float(same.mean())),
        "max_score_diff": sig(float(np.abs(t_scores[:m] - f_scores).max())),
        "sizes": dict(s), "device": device,
        "timed_s": round(torch_s, 3), "faiss_timed_s": round(faiss_s, 3), "prepare_s": round(prep_s, 3),
    }


def part_ablation(sizes: dict, device: str, work: Path) -> dict:
    """``pairmine mine`` of the shipped sample, then ``pairmine ablate`` (scratch regime, the sizes of
    ``sizes["ablation"]``) through the CLI as a user runs them; the figures of its ablation.json. On CPU (smoke) the
    mine uses a tiny BERT built from a config and the first ``docs`` documents, and the ablation runs ``--quick``."""
    import pyarrow.parquet as pq

    from pairmine.pipeline.inputs import SAMPLE_DIR

    s = sizes["ablation"]
    cli = [sys.executable, "-m", "pairmine.pipeline.cli"]
    runs, out = work / "runs", work / "ablation"
    mine_args = ["mine", "--output", str(runs), "--run-id", "sample"]
    if "docs" in s:  # smoke: a few documents and a tiny encoder
        tiny = work / "tiny-bert"
        build_model(tiny, SIZES["cpu-smoke"]["model"])
        pq.write_table(pq.read_table(sorted(SAMPLE_DIR.glob("*.parquet"))[0]).slice(0, s["docs"]), work / "docs.parquet")
        mine_args += ["--input", str(work / "docs.parquet")]
        for item in s.get("mine_set", []):
            mine_args += ["--set", item.format(tiny=tiny)]
    t0 = time.perf_counter()
    p = subprocess.run(cli + mine_args, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"pairmine mine failed:\n{(p.stdout + p.stderr)[-3000:]}")
    mine_s = time.perf_counter() - t0
    args = ["ablate", "--groups", str(runs / "sample"), "--beir", str(ROOT / "tests/data/fiqa-pairs-beir"),
            "--sts", str(ROOT / "tests/data/stsbenchmark/sts-test.csv"), "--output", str(out),
            "--seeds", str(s["seeds"])] + (["--quick"] if s.get("quick") else [])
    for item in s["set"]:
        args += ["--set", item]
    t0 = time.perf_counter()
    p = subprocess.run(cli + args, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"pairmine ablate failed:\n{(p.stdout + p.stderr)[-3000:]}")
    ablate_s = time.perf_counter() - t0
    summary = json.loads((out / "ablation.json").read_text())
    units = {name: {"wall_s": u["wall_s"], "steps": u["steps"], "scores": u["scores"],
                    "steps_per_s": sig(u["steps"] / u["wall_s"]) if u["steps"] and u["wall_s"] else None}
             for name, u in summary["units"].items()}
    return {"what": "pairmine mine (shipped sample) then pairmine ablate, scratch regime, through the CLI",
            "device": device, "proxy": summary["proxy"], "steps": summary["steps"],
            "pairs_per_step": summary["pairs_per_step"], "groups_in_run": summary["groups_in_run"],
            "aggregate": summary["aggregate"], "p_values": summary["p_values"], "units": units,
            "mine_wall_s": round(mine_s, 1), "ablate_wall_s": round(ablate_s, 1), "sizes": s,
            "table_md": (out / "ablation.md").read_text()}


def build_lm(folder: Path, lm_sizes: dict) -> None:
    """A Qwen2 causal LM of ``lm_sizes`` built from a config with random weights and the default model's tokenizer,
    saved to ``folder`` (Revela's LM; no hub)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from pairmine.operators.embed import default_model_path

    if (folder / "config.json").exists():
        return
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=512, **lm_sizes)
                     ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def part_train(sizes: dict, device: str, model_dir: Path, work: Path, batch: int, part: str = "train") -> dict:
    import bench_train  # benchmarks/ is on sys.path (this script's folder)
    from transformers import AutoModel, AutoTokenizer
    import pyarrow.parquet as pq

    s = sizes[part]
    objective = OBJECTIVE[part]
    build_model(model_dir, sizes["model"])
    lm_dir = work / "revela-lm-random"
    if objective == "revela":
        build_lm(lm_dir, s["lm"])
    run_dir = Path(tempfile.mkdtemp(prefix="groups-", dir=work))
    n_groups = bench_train.make_groups(run_dir)
    ns = argparse.Namespace(mode="step", model=str(model_dir), device=device, dtype=s["dtype"], batch=batch,
                            max_length=s["max_length"], steps=s["steps"], threads=0, peak_tflops=0.0,
                            objective=objective, revela_lm=str(lm_dir) if objective == "revela" else "")
    out = bench_train.bench_step(ns, run_dir)
    out.pop("mfu_pct", None)  # bench_train assumes 989 on any CUDA device; the MFU below uses the table
    out.pop("peak_tflops", None)
    # tokens per group the trained encoder sees: its 5 passages, truncated to max_length, without padding; the mean
    # over every group the steps draw from (the sample's ~3,900), or an evenly spaced subset of token_count_groups
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    t = pq.read_table(run_dir / "groups", columns=["anchor_text", "related_texts"])
    t = t.take(list(range(0, t.num_rows, max(1, -(-t.num_rows // s["token_count_groups"])))))
    texts = t.column("anchor_text").to_pylist() + [x for r in t.column("related_texts").to_pylist()
                                                   for x in (r[:1] if objective == "xtr" else r)]
    lengths = [len(x) for x in tok(texts, truncation=True, max_length=s["max_length"])["input_ids"]]
    tokens_per_group = sum(lengths) / t.num_rows
    params = sum(p.numel() for p in AutoModel.from_pretrained(str(model_dir)).parameters())
    extra = {}
    if objective == "revela":
        extra = {"lm": f"Qwen2ForCausalLM {s['lm']} from a Qwen2Config, random weights, LoRA rank 256",
                 "lm_params": sum(p.numel() for p in AutoModel.from_pretrained(str(lm_dir)).parameters())}
    return {**out, **extra, "units": "groups/s", "objective": objective,
            "model": f"BertModel {model_name(sizes['model'])} from a BertConfig, random weights"
                     + (" (a fresh MLM head)" if objective == "xprt" else ""),
            "encoder_params": params, "tokens_per_group": round(tokens_per_group, 1),
            "groups_available": n_groups, "tokens_per_group_from_groups": t.num_rows,
            "sizes": {**sizes["model"], "batch": batch, "steps": s["steps"], "max_length": s["max_length"]}}


def gpu_env() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "hostname": platform.node()}
    for dist in ("transformers", "pairmine"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    try:
        env["pairmine_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["pairmine_commit"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   gpu_capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        env["gpu"] = None
    return env


def run_part(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, wall seconds); exit code 124 when the part passed its time limit."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        def s(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        rc, text = 124, s(e.stdout) + s(e.stderr) + f"\n[gpu_all] killed after its time limit of {timeout:.0f} s"
    return rc, text, time.perf_counter() - t0


def parse_filter(text: str) -> dict:
    """bench_filter.py's printed figures."""
    def num(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    qps = num(r"pairmine count\s+([0-9.]+) queries/s")
    if qps is None:
        raise ValueError("no 'pairmine count ... queries/s' line in bench_filter.py's output")
    return {"queries_per_s": qps, "units": "queries/s",
            "timed_s": num(r"pairmine count\s+[0-9.]+ queries/s\s+\(([0-9.]+) s\)"),
            "matmul_floor_queries_per_s": num(r"matmul floor\s+([0-9.]+) queries/s"),
            "useful_matmul_tflops": num(r"pairmine count: ([0-9.]+) TFLOP/s"),
            "keep_rate_pct_random_pool": num(r"keep rate ([0-9.]+)%")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="JSON file to write (default: $OUT/gpu_all.json if $OUT is set, "
                    "else ./gpu_all.json)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the script, not a GPU)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from " + ",".join(PARTS + OPTIONAL_PARTS)
                    + " (default: all but " + ",".join(OPTIONAL_PARTS) + ")")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense bf16 TFLOP/s for MFU (default: by "
                    "GPU name from PEAK_BF16_TFLOPS; a GPU not in it gives 'unknown')")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # internal: run one part in this process
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--train-batch", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    sizes = SIZES[mode]
    device = "cpu" if args.cpu_smoke else "cuda"

    if args.part:  # one part, in a process of its own
        sys.path.insert(0, str(HERE))
        if args.part == "embed":
            result = part_embed(sizes, device, Path(args.model_dir))
        elif args.part == "negatives":
            result = part_negatives(sizes, device)
        elif args.part == "ablation":
            result = part_ablation(sizes, device, Path(args.work))
        elif args.part in OBJECTIVE:
            result = part_train(sizes, device, Path(args.model_dir), Path(args.work),
                                args.train_batch or sizes[args.part]["batch"], args.part)
        else:
            raise SystemExit(f"unknown part {args.part}")
        Path(args.result).write_text(json.dumps(result))
        return 0

    out_path = Path(args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_all.json"))
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS + OPTIONAL_PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS + OPTIONAL_PARTS))}")
    t_start = time.perf_counter()
    env = gpu_env()
    if not args.cpu_smoke and not env.get("gpu"):
        print("gpu_all: torch sees no GPU (a CUDA build of torch and a GPU are needed; --cpu-smoke runs on CPU)",
              file=sys.stderr)
        return 2
    peak = peak_bf16_tflops(env["gpu"]) if env.get("gpu") else None
    peak_source = "PEAK_BF16_TFLOPS in benchmarks/gpu_all.py (dense bf16, NVIDIA datasheets), by GPU name"
    if args.peak_tflops > 0:
        peak, peak_source = args.peak_tflops, "--peak-tflops"
    report = {"benchmark": "pairmine benchmarks/gpu_all.sh", "mode": mode,
              "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "env": env,
              "peak_bf16_tflops": peak if peak is not None else "unknown",
              "peak_source": peak_source,
              "timeouts_s": TIMEOUT_S[mode]}
    work = Path(tempfile.mkdtemp(prefix="gpu-all-"))
    model_dir = work / "bert-base-random"
    me = [sys.executable, str(Path(__file__).resolve())] + (["--cpu-smoke"] if args.cpu_smoke else [])
    try:
        for part in parts:
            print(f"gpu_all: {part} ...", flush=True)
            limit = TIMEOUT_S[mode][part]
            entry: dict = {}
            if part == "consistency":
                c = sizes["consistency"]
                cmd = [sys.executable, str(HERE / "bench_filter.py"), "--device", device, "--pool", str(c["pool"]),
                       "--dim", str(c["dim"]), "--queries", str(c["queries"]), "--storage", c["storage"],
                       "--batch", str(c["batch"]), "--chunk-mb", str(c["chunk_mb"]), "--k", str(c["k"])]
                rc, text, wall = run_part(cmd, limit)
                if rc == 0:
                    try:
                        entry = parse_filter(text)
                    except ValueError as e:
                        rc, text = 1, f"{text}\n[gpu_all] {e}"
                entry["sizes"] = {k: c[k] for k in ("pool", "dim", "queries", "batch", "storage", "chunk_mb", "k")}
                entry["what"] = "operators.consistency.consistency_counts via benchmarks/bench_filter.py"
            else:
                result = work / f"{part}.json"
                cmd = me + ["--part", part, "--result", str(result), "--model-dir", str(model_dir), "--work", str(work)]
                rc, text, wall = run_part(cmd, limit)
                if part in OBJECTIVE and rc != 0 and "out of memory" in text.lower():
                    # a smaller batch if the default does not fit this GPU (within the same overall limit)
                    half = max(2, sizes[part]["batch"] // 2)
                    entry["retried_after_oom_with_batch"] = half
                    rc, text2, wall2 = run_part(cmd + ["--train-batch", str(half)], max(30.0, limit - wall))
                    text, wall = text + "\n[gpu_all] retry:\n" + text2, wall + wall2
                if rc == 0:
                    entry.update(json.loads(result.read_text()))
            if part in OBJECTIVE and rc == 0:
                gps = entry["groups_per_s"]
                tflops_6nt = 6.0 * entry["encoder_params"] * entry["tokens_per_group"] * gps / 1e12
                tflops_counted = entry["model_gflops_per_group"] * gps / 1e3
                if OBJECTIVE[part] != "revela":  # Revela's FLOPs are mostly the LM's: the counted figure only
                    entry["model_tflops_6nt"] = sig(tflops_6nt)
                if peak is None:
                    entry["mfu_pct"] = entry["mfu_counted_pct"] = "unknown"
                else:
                    if OBJECTIVE[part] != "revela":
                        entry["mfu_pct"] = sig(100.0 * tflops_6nt / peak)
                    entry["mfu_counted_pct"] = sig(100.0 * tflops_counted / peak)
                entry["mfu_definition"] = ("mfu_pct: 6 x encoder_params x tokens_per_group x groups/s / peak; "
                                           "mfu_counted_pct: model_gflops_per_group (torch's FLOP counter on a real "
                                           f"step: every pass of the {OBJECTIVE[part]} step) x groups/s / peak")
            entry.update(ok=rc == 0, wall_s=round(wall, 1))
            if rc != 0:
                entry.update(exit_code=rc, output_tail=text[-4000:])
            print(f"gpu_all: {part} {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {wall:.1f} s", flush=True)
            report[part] = entry
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s_total"] = round(time.perf_counter() - t_start, 1)
    report["ok"] = all(report[p]["ok"] for p in parts)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    summary = {p: {k: report[p].get(k) for k in ("passages_per_s", "forward_only_passages_per_s", "queries_per_s",
                                                 "faiss_cpu_queries_per_s", "groups_per_s", "mfu_pct",
                                                 "mfu_counted_pct", "wall_s")
                   if report[p].get(k) is not None} for p in parts}
    print(json.dumps(summary, indent=1))
    print(f"gpu_all: wrote {out_path} ({report['wall_s_total']} s{'' if report['ok'] else ', some parts FAILED'})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
