"""Peak memory of the chunk operator on one huge document (issue 39 item 10: "One huge document").

Builds one JSONL record whose text is the real FineWeb text of ``../shared/data/fineweb-long`` (2,000 documents,
13.9 MB), joined by blank lines and repeated up to ``--mb`` megabytes, then, in a fresh process, reads it into a
one-row table (``id``, ``text``, ``skip_reason``) and runs :class:`operators.chunk.Chunker` over it with the
defaults of ``pairmine mine`` (120 words, 256 passages, the default model's token limit). Prints one JSON line:
``rss_input_mib`` (resident set with the input loaded, before chunking), ``peak_rss_mib`` (the peak resident set
while chunking: Linux's VmHWM, reset before the call by writing 5 to /proc/self/clear_refs), ``seconds`` (wall time
of the call) and the counters of the document.

    python benchmarks/bench_chunk_memory.py                      # 150 MB record, this checkout's chunk.py
    python benchmarks/bench_chunk_memory.py --max-chars 0        # no chunk.max_chars cut: the window alone
    python benchmarks/bench_chunk_memory.py --module old/chunk.py  # another version of operators/chunk.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "fineweb-long"


def make_record(path: Path, mb: float, data: Path = DATA) -> int:
    """Write one JSONL record ``{"id": "huge", "text": ...}`` of about ``mb`` MB of text to ``path``; returns the
    text's length in characters."""
    import pyarrow.parquet as pq

    texts = [t for f in sorted(data.glob("*.parquet")) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]
    base = "\n\n".join(texts)
    text = (base + "\n\n") * int(mb * 1e6 // (len(base) + 2) + 1)
    text = text[: int(mb * 1e6)]
    path.write_text(json.dumps({"id": "huge", "text": text}) + "\n", encoding="utf-8")
    return len(text)


def _status(key: str) -> float:
    """A field of /proc/self/status in MiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def measure(path: Path, module: str, token_limit: bool, max_chars: int | None = None) -> dict:
    """Chunk the record at ``path`` with the ``Chunker`` of ``module`` (a path to a chunk.py; "" : pairmine's);
    ``max_chars`` None: the Chunker's default (a Chunker from before chunk.max_chars takes none)."""
    import pyarrow as pa

    if module:
        spec = importlib.util.spec_from_file_location("chunk_under_test", module)
        chunk = sys.modules["chunk_under_test"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(chunk)
    else:
        from pairmine.operators import chunk
    limit = chunk.TokenLimit("", 256, "") if token_limit else None
    if limit is not None:
        limit.lengths(["warm the tokenizer up"])  # loaded once per process, as in a chunk task
    record = json.loads(path.read_text(encoding="utf-8"))
    batch = pa.table({"id": [record["id"]], "text": [record["text"]], "skip_reason": pa.nulls(1, pa.string())})
    chars = len(record["text"])
    del record
    rss_input = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    extra = {} if max_chars is None else {"max_chars": max_chars}
    out = chunk.Chunker(token_limit=limit, **extra)(batch)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    row = out.drop_columns(["passages", "passage_start", "passage_end", "passage_words"]).to_pylist()[0]
    return {"chars": chars, "rss_input_mib": round(rss_input), "peak_rss_mib": round(peak),
            "seconds": round(seconds, 1), "passages": len(out.column("passages")[0]),
            **{k: v for k, v in row.items() if k.startswith("n_")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=150, help="megabytes of text in the record (default 150)")
    ap.add_argument("--record", default="/tmp/pairmine-huge-record.jsonl", help="the JSONL file (made if missing)")
    ap.add_argument("--module", default="", help="path of the chunk.py to measure; empty: this checkout's")
    ap.add_argument("--max-chars", type=int, default=None, help="chunk.max_chars (0: no cut); default: the Chunker's")
    ap.add_argument("--no-token-limit", action="store_true", help="chunk by words only (chunk.fit_model_length=false)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    path = Path(a.record)
    if a.child:
        print(json.dumps(measure(path, a.module, not a.no_token_limit, a.max_chars)))
        return
    if not path.exists():
        make_record(path, a.mb)
    cmd = [sys.executable, __file__, "--child", "--record", str(path), "--module", a.module]
    cmd += ["--no-token-limit"] if a.no_token_limit else []
    cmd += [] if a.max_chars is None else ["--max-chars", str(a.max_chars)]
    sys.exit(subprocess.run(cmd).returncode)  # a fresh process: its peak is the chunk call's alone


if __name__ == "__main__":
    main()
