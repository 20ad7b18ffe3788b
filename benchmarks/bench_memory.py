"""Peak memory of a whole `pairmine mine` run (the driver and every Ray process it starts), on the shipped sample
replicated 1x and Nx with fresh document ids, and the ratio. Streaming should keep the peak nearly flat as the input
grows; what does grow with the input is listed in docs/benchmarks.md ("Memory").

Memory is sampled every 0.25 s over the run's process tree (driver, GCS, raylet, workers: all are descendants of
the driver with a local Ray). Two figures per sample: the sum of PSS (proportional set size: shared pages such as
the object store's split among the processes that map them, so nothing is counted twice) and the sum of RSS (shared
pages counted once per process: an upper bound).

    python benchmarks/bench_memory.py                       # 1x and 10x, default model
    python benchmarks/bench_memory.py --tiny                # the same with a 2-layer BERT built from a config (fast)
    python benchmarks/bench_memory.py --replicas 1 4 --set embed.model=/path/to/model
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pairmine.pipeline.inputs import SAMPLE_DIR  # noqa: E402


def replicate(dst: Path, replicas: int) -> int:
    """Write the sample ``replicas`` times into ``dst`` with ids suffixed ``#rK`` (no duplicate ids). Returns docs."""
    dst.mkdir(parents=True, exist_ok=True)
    docs = 0
    for k in range(replicas):
        for p in sorted(SAMPLE_DIR.glob("*.parquet")):
            t = pq.read_table(p)
            ids = pc.binary_join_element_wise(t.column("id").cast(pa.string()), pa.scalar(f"r{k}"), "#")
            t = t.set_column(t.schema.get_field_index("id"), "id", ids)
            pq.write_table(t, dst / f"r{k:03d}-{p.name}", compression="zstd")
            docs += t.num_rows
    return docs


class TreeMemory(threading.Thread):
    """Samples the summed PSS and RSS of a process and all its descendants until stopped; keeps the peaks."""

    def __init__(self, pid: int, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.every_s = psutil.Process(pid), every_s
        self.peak_pss = self.peak_rss = 0
        self.peak_procs = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            pss = rss = 0
            for p in procs:
                try:
                    m = p.memory_full_info()
                    pss += getattr(m, "pss", m.rss)
                    rss += m.rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.peak_procs = max(self.peak_procs, len(procs))
            time.sleep(self.every_s)


def tiny_model(folder: Path) -> str:
    """A 2-layer, 64-dim BERT with the default model's real tokenizer, random weights (as in the tests)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pairmine.operators.embed import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_once(replicas: int, work: Path, sets: list[str]) -> dict:
    inp, out = work / f"in-{replicas}x", work / f"out-{replicas}x"
    docs = replicate(inp, replicas)
    cmd = [sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--input", str(inp), "--output", str(out), "--run-id", "bench"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"})
    mem = TreeMemory(proc.pid)
    mem.start()
    output = proc.communicate()[0]
    mem.stop_flag.set()
    mem.join()
    if proc.returncode != 0:
        sys.exit(f"run {replicas}x failed:\n{output[-3000:]}")
    groups = next((line for line in output.splitlines() if line.startswith("groups:")), "")
    return {"replicas": replicas, "docs": docs, "seconds": time.time() - t0, "peak_pss_mb": mem.peak_pss / 2**20,
            "peak_rss_mb": mem.peak_rss / 2**20, "processes": mem.peak_procs, "groups": groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 10], help="input sizes, in copies of the sample")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override passed to pairmine mine")
    ap.add_argument("--tiny", action="store_true", help="use a 2-layer BERT built from a config instead of the default "
                    "model (same pipeline, minutes instead of tens of minutes on 2 cores)")
    ap.add_argument("--keep", action="store_true", help="keep the replicated inputs and runs (printed folder)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pairmine-bench-memory-"))
    if args.tiny:
        args.sets = [f"embed.model={tiny_model(work / 'tiny-bert')}", "anchors.threshold=0.99", *args.sets]
    rows = []
    try:
        for r in args.replicas:
            rows.append(run_once(r, work, args.sets))
            x = rows[-1]
            print(f"{r}x: {x['docs']} documents, {x['seconds']:.0f} s, peak PSS {x['peak_pss_mb']:.0f} MB, peak RSS "
                  f"{x['peak_rss_mb']:.0f} MB, {x['processes']} processes", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = rows[0]
    print(f"\npairmine mine, peak memory of the whole run (driver + all Ray processes){' ' + ' '.join(args.sets) if args.sets else ''}")
    print(f"{'input':>8} {'documents':>10} {'seconds':>8} {'peak PSS MB':>12} {'vs 1st':>7} {'peak RSS MB':>12} {'vs 1st':>7} {'procs':>6}")
    for r in rows:
        print(f"{r['replicas']:>7}x {r['docs']:>10} {r['seconds']:>8.0f} {r['peak_pss_mb']:>12.0f} "
              f"{r['peak_pss_mb'] / base['peak_pss_mb']:>6.2f}x {r['peak_rss_mb']:>12.0f} "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:>6.2f}x {r['processes']:>6}")
    for r in rows:
        print(f"  {r['replicas']}x {r['groups']}")
    if args.keep:
        print(f"inputs and runs kept in {work}")


if __name__ == "__main__":
    main()
