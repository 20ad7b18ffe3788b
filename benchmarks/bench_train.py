"""Training throughput of the training objectives (groups/s), and the model FLOPs per group for MFU.

Two measurements, both running pipeline/train.py's own code:

  step   one process, no Ray: the objective's step of pipeline/train.py (``--objective``: ``xprt_step``, 5 encoder
         passes, 10 decoder passes, the frozen model's pass, every loss term; ``xtr_step``, 2 encoder passes and
         the token retrieval; ``revela_step``, the encoder on every passage and the causal LM ``--revela-lm``
         with its in-batch stream; then backward, AdamW) on batches of groups; prints groups/s, FLOPs per group
         counted by torch.utils.flop_counter on one step (matmuls and attention, forward + backward), achieved
         TFLOP/s and,
         with a peak (``--peak-tflops``, default 989 on CUDA = H100/H200 dense bf16), model FLOPs utilisation
  memory one process per batch size (``--batches``, default 16,32,64 groups): the peak RSS of one xprt_step of the
         default objective at that batch (the model, its optimizer state and one step's activations), the peak
         over the RSS after loading (what the batch costs), the growth per group, and the figure derived for
         BERT-base at batch 1024 x 256 tokens in bf16 (activations scale with layers x width x tokens; the head's
         logits are bounded by loss.head_chunk_mb whatever the batch)
  job    the real ``pairmine train`` job (Ray Train, DDP workers, Ray Data streaming), groups/s = median of the
         per-step figures in metrics.jsonl after the first steps (start-up excluded)

Groups come from the shipped sample, chunked like pairmine mine: for every document with >= 5 passages, passage i is
an anchor and the next 4 passages (cyclically) its related passages. Throughput depends on passage lengths, not on
how related passages were chosen, so this needs no embedding pass.

    python benchmarks/bench_train.py                            # default model, CPU, step + job
    python benchmarks/bench_train.py --mode step --batch 8 --steps 5
    python benchmarks/bench_train.py --mode step --objective revela --revela-lm /models/Qwen2.5-0.5B
    python benchmarks/bench_train.py --device cuda --batch 64   # one GPU (see benchmarks/gpu_train.sh)
    python benchmarks/bench_train.py --mode memory --batches 16,32,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_groups(run_dir: Path, max_docs: int = 10_000) -> int:
    """A committed run folder of groups built from the shipped sample (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairmine.operators.chunk import chunk_text
    from pairmine.operators.write import GROUP_SCHEMA, group_id
    from pairmine.pipeline.inputs import SAMPLE_DIR

    rows = []
    for shard in sorted(SAMPLE_DIR.glob("*.parquet")):
        t = pq.read_table(shard, columns=["id", "text"])
        for doc_id, text in zip(t.column("id").to_pylist(), t.column("text").to_pylist()):
            passages = chunk_text(text).passages
            if len(passages) < 5:
                continue
            for i, anchor in enumerate(passages):
                rel = [(i + k) % len(passages) for k in range(1, 5)]
                rows.append({"run_id": "bench", "group_id": group_id(doc_id, i), "doc_id": doc_id, "url": None,
                             "anchor_index": i, "anchor_text": anchor, "anchor_centrality": 1.0,
                             "related_indices": rel, "related_texts": [passages[j] for j in rel],
                             "related_dense": [0.0] * 4, "related_tfidf": [0.0] * 4, "related_rrf": [0.0] * 4,
                             "s": None, "n_above": None, "pool_size": None, "consistency_k": None, "model": "bench"})
    rows = rows[: max_docs * 1000]
    (run_dir / "groups").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=GROUP_SCHEMA), run_dir / "groups" / "part-00000.parquet")
    (run_dir / "_SUCCESS").write_text("bench\n")
    return len(rows)


def bench_step(args, run_dir: Path) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pairmine.pipeline.train import (
        _autocast_dtype, _load_models, _load_revela_models, _param_groups, lr_factor, revela_step, xprt_step, xtr_step,
    )
    from pairmine.pipeline.train_config import load_train_config

    objective = getattr(args, "objective", "xprt")
    overrides = [f"train.batch_size={args.batch}", f"train.max_length={args.max_length}", f"train.dtype={args.dtype}",
                 f"train.objective={objective}"]
    if args.model:
        overrides.append(f"train.model={args.model}")
    overrides += list(getattr(args, "set", None) or [])
    if objective == "revela":
        overrides.append(f"train.revela_lm={args.revela_lm}")
    cfg = load_train_config(overrides=overrides)
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    amp = _autocast_dtype(cfg, device.type)
    total = args.steps + 2
    if objective == "revela":
        tokenizer, lm_tokenizer, model = _load_revela_models(cfg)
        model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.revela_lr)
    else:
        tokenizer, model, frozen, fresh = _load_models(cfg)
        model.to(device)
        if frozen is not None:
            frozen.to(device)
        opt = torch.optim.AdamW(_param_groups(model, cfg, fresh))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, 0))

    def step(i):  # one optimizer step of the objective, as train_loop runs it on one worker of one
        if objective == "revela":
            revela_step(model, tokenizer, lm_tokenizer, batch(i), cfg, 1, device, amp, opt, sched)
        elif objective == "xtr":
            xtr_step(model, tokenizer, batch(i), cfg, 1, device, amp, opt, sched)
        else:
            xprt_step(model, frozen, tokenizer, batch(i), cfg, i, total, 0, 1, device, amp, opt, sched)
    table = pq.read_table(run_dir / "groups", columns=["doc_id", "anchor_text", "related_texts"])
    rng = np.random.default_rng(0)
    order = rng.permutation(table.num_rows)

    def batch(i):
        t = table.take(order[(i * args.batch) % (table.num_rows - args.batch):][: args.batch])
        return {"doc_id": t.column("doc_id").to_pylist(), "anchor_text": t.column("anchor_text").to_pylist(),
                "related_texts": t.column("related_texts").to_pylist()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    import resource

    def rss_mib() -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    if getattr(args, "memory_step", False):  # one step, its peak RSS (ru_maxrss: the process's high-water mark)
        loaded = rss_mib()
        t0 = time.perf_counter()
        step(0)
        return {"mode": "memory", "model": cfg.train.model or "all-MiniLM-L6-v2 (default)", "batch": args.batch,
                "max_length": args.max_length, "rss_after_load_mib": round(loaded, 1),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "head_chunk_mb": cfg.loss.head_chunk_mb, "s_per_step": round(time.perf_counter() - t0, 1),
                "threads": torch.get_num_threads()}
    counter = FlopCounterMode(display=False)
    with counter:  # one counted step (also the warm-up)
        step(0)
    flops_per_group = counter.get_total_flops() / args.batch
    step(1)  # warm-up
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(2 + i)
    sync()
    elapsed = time.perf_counter() - t0
    gps = args.steps * args.batch / elapsed
    out = {"mode": "step", "objective": objective, "model": cfg.train.model or "all-MiniLM-L6-v2 (default)",
           "revela_lm": cfg.train.revela_lm or None, "device": str(device),
           "dtype": str(amp or "float32"), "threads": torch.get_num_threads() if device.type == "cpu" else None,
           "batch": args.batch, "max_length": args.max_length, "steps": args.steps,
           "s_per_step": round(elapsed / args.steps, 3), "groups_per_s": round(gps, 3),
           "model_gflops_per_group": round(flops_per_group / 1e9, 2),
           "achieved_tflops": round(flops_per_group * gps / 1e12, 3)}
    peak = args.peak_tflops or (989.0 if device.type == "cuda" else 0.0)
    if peak:
        out["peak_tflops"] = peak
        out["mfu_pct"] = round(100.0 * flops_per_group * gps / (peak * 1e12), 2)
    return out


def bench_memory(args) -> list[dict]:
    """Peak RSS of one default xprt step per batch size, each in a fresh process (see the module docstring)."""
    import subprocess

    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        cmd = [sys.executable, __file__, "--mode", "step", "--memory-step", "--batch", str(b), "--max-length",
               str(args.max_length), "--device", args.device, "--dtype", args.dtype]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        for item in args.set or []:
            cmd += ["--set", item]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith('{"mode": "memory"')), None)
        if line is None:
            rows.append({"mode": "memory", "batch": b, "error": (out.stderr or out.stdout)[-600:]})
        else:
            rows.append(json.loads(line))
            rows[-1]["step_mib"] = round(rows[-1]["peak_rss_mib"] - rows[-1]["rss_after_load_mib"], 1)
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    if len(ok) >= 2:
        a, z = ok[0], ok[-1]
        per_group = (z["peak_rss_mib"] - a["peak_rss_mib"]) / (z["batch"] - a["batch"])
        # BERT-base (12 layers x 768) against all-MiniLM-L6-v2 (6 x 384): activations per token x 4, bf16 halves
        # them; the head's chunk stays ~3 x head_chunk_mb (logits, log-softmax, gradient) at any batch
        derived = per_group * 4 * 0.5 * 1024 / 1024
        print(f"memory: {per_group:.1f} MiB per group per worker (batch {a['batch']} -> {z['batch']}); derived for "
              f"BERT-base, batch 1024 x 256 tokens, bf16 on one device: ~{derived:.0f} GiB of activations "
              f"(+ ~{3 * a['head_chunk_mb'] / 1024:.2f} GiB for one head chunk), ~{derived / 8:.0f} GiB per GPU "
              "on 8 GPUs (128 groups each)", flush=True)
    return rows


def bench_job(args, run_dir: Path) -> dict:
    from pairmine.pipeline.train import train
    from pairmine.pipeline.train_config import load_train_config

    out_dir = Path(tempfile.mkdtemp(prefix="bench-train-"))
    overrides = [f"train.batch_size={args.batch}", f"train.max_length={args.max_length}", f"train.dtype={args.dtype}",
                 f"train.max_steps={args.job_steps}", "checkpoint.every_steps=-1", f"scaling.device={args.device}"]
    if args.workers:
        overrides.append(f"scaling.num_workers={args.workers}")
    if args.model:
        overrides.append(f"train.model={args.model}")
    t0 = time.time()
    train(load_train_config(overrides=overrides), str(run_dir), str(out_dir))
    wall = time.time() - t0
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["groups_per_s"] for r in rows[2:]] or [r["groups_per_s"] for r in rows]
    manifest = json.loads((out_dir / "train_manifest.json").read_text())
    return {"mode": "job", "model": args.model or "all-MiniLM-L6-v2 (default)", "device": args.device,
            "workers": manifest["resolved"]["workers"], "batch": args.batch, "max_length": args.max_length,
            "steps": len(rows), "groups_per_s_median": round(statistics.median(steady), 3),
            "wall_s_including_startup": round(wall, 1), "output": str(out_dir)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("step", "job", "both", "memory"), default="both")
    p.add_argument("--batches", default="16,32,64", help="memory mode: batch sizes (groups per worker)")
    p.add_argument("--memory-step", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help="starting encoder (default: all-MiniLM-L6-v2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="step and memory modes: a pairmine train key, e.g. --set loss.w_cross=0 (repeatable)")
    p.add_argument("--objective", default="xprt", choices=("xprt", "xtr", "revela"),
                   help="step mode: the objective whose step is timed (default xprt)")
    p.add_argument("--revela-lm", default="", help="--objective revela: the causal LM (folder)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="autocast dtype (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--batch", type=int, default=8, help="groups per step (global batch in job mode)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per passage")
    p.add_argument("--steps", type=int, default=5, help="timed steps in step mode (after 2 warm-up steps)")
    p.add_argument("--job-steps", type=int, default=8, help="steps of the training job in job mode")
    p.add_argument("--workers", type=int, default=0, help="job mode: training workers (0: the job's default)")
    p.add_argument("--threads", type=int, default=0, help="step mode on CPU: torch threads (0: torch's default)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak of the device for MFU (CUDA default 989: "
                   "H100/H200 dense bf16)")
    args = p.parse_args()
    import logging

    if args.mode == "memory":
        bench_memory(args)
        return

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-groups-"))
    n = make_groups(run_dir)
    print(f"groups: {n} built from the shipped sample in {run_dir}", flush=True)
    results = []
    if args.mode in ("step", "both"):
        results.append(bench_step(args, run_dir))
        print(json.dumps(results[-1]), flush=True)
        if args.memory_step:
            return
    if args.mode in ("job", "both"):
        results.append(bench_job(args, run_dir))
        print(json.dumps(results[-1]), flush=True)
    print("\nsummary:")
    for r in results:
        gps = r.get("groups_per_s", r.get("groups_per_s_median"))
        extra = f", {r['model_gflops_per_group']} GFLOP/group, {r['achieved_tflops']} TFLOP/s" if "achieved_tflops" in r else ""
        mfu = f", MFU {r['mfu_pct']}%" if "mfu_pct" in r else ""
        print(f"  {r['mode']:4s} {r['model']} on {r['device']}, batch {r['batch']}, max_length {r['max_length']}: "
              f"{gps} groups/s{extra}{mfu}")


if __name__ == "__main__":
    main()
