"""Embedding throughput benchmark (not a test): the model's own forward pass, sentence-transformers ``encode`` and
``pairmine mine`` end to end, on the same passages, with ratios.

    python benchmarks/bench_embed.py [--input PATH] [--copies 2] [--batch-size 32] [--max-length 256] [--skip-mine]
                                     [--skip-forward] [--skip-st] [--threads N]

The input is the shipped sample's documents (or ``--input``) plus ``--copies`` copies of each with its sentences
reshuffled into a new text under a new id (seeded), so that start-up is a small share of the run: the default
(2 copies) gives 15,535 passages. Prints passages/s for:
  forward fp32 / bf16   tokenizer + AutoModel forward + mean pooling + L2 norm, batches sorted by length
  Embedder            pairmine's embed operator in this process (the code the Ray actors run; dtype auto)
  sentence-transformers encode fp32 / bf16   the same model folder, same batch size and max length
  pairmine mine       the whole job (Ray start, first pass, the consistency pool, the main pass, commit), and its
                      main pass alone (stats.json ``phases_s``) run again with the consistency filter off, so that
                      the main pass embeds every passage itself
and the ratios the project tracks (issue 15 item 3): the Embedder over sentence-transformers in the same dtype,
the main pass and the whole run over the Embedder. ``--skip-forward`` leaves out the two bare forward passes and
sentence-transformers in the other dtype. ``--threads N`` sets every timed model's torch threads (mine's
``embed.threads``): with fewer threads than cores, mine's other work runs beside the model instead of taking CPU from
it, as on a GPU node (``--threads 1 --skip-st`` on a 2-core machine).
Needs ``pip install sentence-transformers`` (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def reshuffled_corpus(src: str, copies: int, out_dir: str, seed: int = 0) -> str:
    """``src``'s parquet documents plus ``copies`` copies of each whose sentences (pairmine's own splitter) are
    shuffled into a new text, ids suffixed ``-copyN``; written as one parquet file per copy under ``out_dir``."""
    import glob
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairmine.operators.chunk import split_sentences
    from pairmine.pipeline.inputs import SAMPLE_DIR

    files = sorted(glob.glob(os.path.join(src or str(SAMPLE_DIR), "*.parquet")))
    table = pa.concat_tables([pq.read_table(f, columns=["id", "text"]) for f in files])
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(table, os.path.join(out_dir, "part-00000.parquet"), row_group_size=64)
    for c in range(1, copies + 1):
        texts = []
        for t in table.column("text").to_pylist():
            sentences = [t[a:b] for a, b in split_sentences(t or "")]
            rng.shuffle(sentences)
            texts.append(" ".join(sentences))
        ids = [f"{i}-copy{c}" for i in table.column("id").to_pylist()]
        pq.write_table(pa.table({"id": ids, "text": texts}), os.path.join(out_dir, f"part-{c:05d}.parquet"),
                       row_group_size=64)
    return out_dir


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


def mine(input_dir: str, batch_size: int, max_length: int, *extra: str) -> tuple[float, dict]:
    """``pairmine mine`` on ``input_dir`` in a child process: (wall seconds including Ray start, stats.json)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--input", input_dir, "--output", out,
               "--run-id", "bench", "--set", f"embed.batch_size={batch_size}",
               "--set", f"embed.max_length={max_length}"]
        for kv in extra:
            cmd += ["--set", kv]
        seconds = timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
        return seconds, json.load(open(os.path.join(out, "bench", "stats.json")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="",
                    help="parquet documents (id, text) to start from (default: the shipped sample)")
    ap.add_argument("--copies", type=int, default=2, help="reshuffled copies of each document added (default 2)")
    ap.add_argument("--batch-size", type=int, default=32, help="passages per forward pass (default 32)")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per passage (default 256)")
    ap.add_argument("--skip-mine", action="store_true", help="do not run pairmine mine end to end")
    ap.add_argument("--skip-forward", action="store_true", help="do not time the bare forward passes")
    ap.add_argument("--skip-st", action="store_true", help="do not time sentence-transformers' encode")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of every timed model, here and in mine's embed actor (embed.threads); "
                         "0: torch's default here, mine's plan (the node's CPUs) there. With fewer threads than "
                         "cores, mine's other work runs beside the model instead of taking CPU from it")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from pairmine.operators.embed import Embedder, default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    mine_extra = (f"embed.threads={args.threads}",) if args.threads else ()

    model_dir = default_model_path()
    work = tempfile.mkdtemp(prefix="bench_embed_")
    input_dir = reshuffled_corpus(args.input, args.copies, os.path.join(work, "docs"))
    passages = sample_passages(input_dir, args.max_length)
    n = len(passages)
    print(f"{n} passages from {args.input or 'the shipped sample'} + {args.copies} reshuffled copies; model "
          f"all-MiniLM-L6-v2; torch threads {torch.get_num_threads()}; batch {args.batch_size}; max_length "
          f"{args.max_length}", flush=True)
    rows: dict[str, float] = {}
    vecs = {}

    def record(name, seconds, count=n):
        rows[name] = count / seconds
        print(f"  {name:<52} {count / seconds:8.1f} passages/s  ({seconds:.1f} s)", flush=True)

    if not args.skip_forward:
        for bf16 in (False, True):
            name = f"forward {'bf16 autocast' if bf16 else 'fp32'}"
            record(name, timed(lambda: vecs.__setitem__(name, forward(model_dir, passages, args.batch_size,
                                                                      args.max_length, bf16))))

    emb = Embedder(batch_size=args.batch_size, max_length=args.max_length, device="cpu", threads=args.threads)
    emb.setup()
    emb.encode(passages[:64])  # warm-up, as sentence-transformers gets below
    embedder = f"pairmine Embedder ({emb.dtype})"
    record(embedder, timed(lambda: vecs.__setitem__("embedder", emb.encode(passages))))

    st_same = None
    try:
        if args.skip_st:
            raise ImportError
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("  sentence-transformers encode: skipped (" + ("--skip-st)" if args.skip_st else "not installed: pip "
              "install sentence-transformers)"))
    else:
        st = SentenceTransformer(model_dir, device="cpu")
        st.max_seq_length = args.max_length
        st.encode(passages[:64], batch_size=args.batch_size)
        for bf16 in (False, True):
            name = f"sentence-transformers encode {'bf16 autocast' if bf16 else 'fp32'}"
            if bf16 == (emb.dtype == "bfloat16"):
                st_same = name
            elif args.skip_forward:  # only the Embedder's dtype
                continue

            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    vecs[name] = st.encode(passages, batch_size=args.batch_size, normalize_embeddings=True)

            record(name, timed(run))

    if not args.skip_mine:
        seconds, stats = mine(input_dir, args.batch_size, args.max_length, *mine_extra)
        if stats["passages"] != n:
            print(f"  note: mine counted {stats['passages']} passages, the benchmark {n}")
        record("pairmine mine, whole run (wall, incl. Ray start)", seconds, stats["passages"])
        print(f"    phases (s): {stats.get('phases_s')}; main pass took {stats.get('passages_vector_reused')} "
              "vectors from the pool's pass", flush=True)
        seconds, stats = mine(input_dir, args.batch_size, args.max_length, "consistency.enabled=false", *mine_extra)
        phases = stats.get("phases_s", {})
        record("pairmine mine, main pass (filter off: embeds all)", phases["main_pass"], stats["passages"])
        print(f"    phases (s): {phases}; whole run {seconds:.1f} s", flush=True)

    print("\nratios:")
    base = rows[embedder]
    for name, rate in rows.items():
        print(f"  {name:<52} {rate / base:6.2f}x of the Embedder")
    if st_same:
        print(f"  Embedder over {st_same}: {base / rows[st_same]:.2f}x (goal >= 1.1x)")
    if not args.skip_mine:
        print(f"  main pass over the Embedder: {rows['pairmine mine, main pass (filter off: embeds all)'] / base:.2f}x "
              "(goal >= 0.9x)")
        print(f"  whole run over the Embedder: {rows['pairmine mine, whole run (wall, incl. Ray start)'] / base:.2f}x "
              "(goal >= 0.8x)")
    ref = vecs.get("forward fp32", vecs["embedder"])
    print("\nagreement with " + ("forward fp32" if "forward fp32" in vecs else "the Embedder") + " (min cosine):")
    for name, v in vecs.items():
        print(f"  {name:<52} {float(np.min(np.sum(np.asarray(v) * ref, axis=1))):.5f}")
    shutil.rmtree(work, ignore_errors=True)  # the documents written for the run


if __name__ == "__main__":
    main()
