"""Embedding throughput benchmark (not a test): the model's own forward pass, sentence-transformers ``encode`` and
``pairmine mine`` end to end, on the same passages (the shipped sample, chunked by pairmine), with ratios.

    python benchmarks/bench_embed.py [--input PATH] [--batch-size 32] [--max-length 256] [--skip-mine]

Prints passages/s for:
  forward fp32 / bf16   tokenizer + AutoModel forward + mean pooling + L2 norm, batches sorted by length
  Embedder            pairmine's embed operator in this process (the code the Ray actors run; dtype auto)
  sentence-transformers encode fp32 / bf16   the same model folder, same batch size and max length
  pairmine mine       the whole job (Ray start, first pass, read, chunk, embed, centrality, related, write)
Needs ``pip install sentence-transformers`` (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def sample_passages(path: str, max_length: int = 256) -> list[str]:
    """The passages ``pairmine mine`` embeds for ``path`` (default model, its token limit at ``max_length``)."""
    import pyarrow as pa

    from pairmine.operators.chunk import TokenLimit, chunk_text
    from pairmine.operators.read import ReadDocuments
    import tempfile

    from pairmine.operators.storage import LOCAL
    from pairmine.pipeline.first_pass import ScanParams, first_pass
    from pairmine.pipeline.inputs import check_parquet_shards, discover_shards

    shards = discover_shards(path)
    layout: dict = {}
    check_parquet_shards(shards, ("text", "id"), layout=layout)
    first = first_pass(shards, layout, ScanParams("text", "id", 1, 0, 1.0, None, LOCAL), tempfile.mkdtemp(),
                       in_process=True)
    docs = ReadDocuments()(pa.Table.from_pylist(first.units))
    texts = [t for t, r in zip(docs.column("text").to_pylist(), docs.column("skip_reason").to_pylist()) if r is None]
    limit = TokenLimit("", max_length, "")
    return [p for t in texts for p in chunk_text(t, token_limit=limit).passages]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def forward(model_dir: str, passages: list[str], batch_size: int, max_length: int, bf16: bool) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    order = np.argsort([len(p) for p in passages], kind="stable")
    out = np.zeros((len(passages), model.config.hidden_size), np.float32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            enc = tok([passages[j] for j in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            out[idx] = torch.nn.functional.normalize(((h * m).sum(1) / m.sum(1)).float(), dim=-1).numpy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="", help="documents to chunk (default: the shipped sample)")
    ap.add_argument("--batch-size", type=int, default=32, help="passages per forward pass (default 32)")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per passage (default 256)")
    ap.add_argument("--skip-mine", action="store_true", help="do not run pairmine mine end to end")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from pairmine.operators.embed import Embedder, default_model_path

    model_dir = default_model_path()
    passages = sample_passages(args.input, args.max_length)
    n = len(passages)
    print(f"{n} passages from {args.input or 'the shipped sample'}; model all-MiniLM-L6-v2; torch threads "
          f"{torch.get_num_threads()}; batch {args.batch_size}; max_length {args.max_length}", flush=True)
    rows: list[tuple[str, float]] = []
    vecs = {}

    def record(name, seconds):
        rows.append((name, n / seconds))
        print(f"  {name:<44} {n / seconds:8.1f} passages/s  ({seconds:.1f} s)", flush=True)

    for bf16 in (False, True):
        name = f"forward {'bf16 autocast' if bf16 else 'fp32'}"
        record(name, timed(lambda: vecs.__setitem__(name, forward(model_dir, passages, args.batch_size, args.max_length, bf16))))

    emb = Embedder(batch_size=args.batch_size, max_length=args.max_length, device="cpu")
    emb.setup()
    record(f"pairmine Embedder ({emb.dtype})", timed(lambda: vecs.__setitem__("embedder", emb.encode(passages))))

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("  sentence-transformers not installed (pip install sentence-transformers): skipped")
    else:
        st = SentenceTransformer(model_dir, device="cpu")
        st.max_seq_length = args.max_length
        for bf16 in (False, True):
            name = f"sentence-transformers encode {'bf16 autocast' if bf16 else 'fp32'}"

            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    vecs[name] = st.encode(passages, batch_size=args.batch_size, normalize_embeddings=True)

            record(name, timed(run))

    if not args.skip_mine:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--output", out, "--run-id", "bench",
                   "--set", f"embed.batch_size={args.batch_size}", "--set", f"embed.max_length={args.max_length}"]
            if args.input:
                cmd += ["--input", args.input]
            seconds = timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
            stats = json.load(open(os.path.join(out, "bench", "stats.json")))
            if stats["passages"] != n:
                print(f"  note: mine counted {stats['passages']} passages, the benchmark {n}")
            record("pairmine mine end to end (wall, incl. Ray start)", seconds)
            rows.append(("pairmine mine (its own elapsed_s)", stats["passages_per_s"]))
            print(f"  {'pairmine mine (stats.json elapsed_s)':<44} {stats['passages_per_s']:8.1f} passages/s", flush=True)

    base = dict(rows)["forward fp32"]
    base16 = dict(rows)["forward bf16 autocast"]
    print("\nratios (passages/s over forward fp32 | over forward bf16):")
    for name, rate in rows:
        print(f"  {name:<44} {rate / base:6.2f}x | {rate / base16:6.2f}x")
    ref = vecs["forward fp32"]
    print("\nagreement with forward fp32 (min cosine):")
    for name, v in vecs.items():
        print(f"  {name:<44} {float(np.min(np.sum(np.asarray(v) * ref, axis=1))):.5f}")


if __name__ == "__main__":
    main()
