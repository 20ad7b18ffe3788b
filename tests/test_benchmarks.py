"""benchmarks/gpu_all.sh: its CPU smoke mode (the same code as on a GPU, tiny sizes) writes one JSON file with every
figure; the GPU peak table. (~40 s on 2 cores: four processes that import torch, the sample chunked once.)"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_all_cpu_smoke_writes_one_json_with_every_figure(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_all.sh"), "--cpu-smoke", str(out), "--peak-tflops", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["mode"] == "cpu-smoke" and r["ok"] is True
    assert r["env"]["torch"] and "gpu" in r["env"] and "cuda" in r["env"]
    assert r["peak_bf16_tflops"] == 1.0 and r["peak_source"] == "--peak-tflops"
    assert r["wall_s_total"] > 0
    e, c, t = r["embed"], r["consistency"], r["train"]
    for part, figure, units in [(e, "passages_per_s", "passages/s"), (c, "queries_per_s", "queries/s"),
                                (t, "groups_per_s", "groups/s")]:
        assert part["ok"] is True and part["units"] == units, part
        assert part[figure] > 0 and part["wall_s"] > 0 and part["sizes"], part
    assert e["forward_only_passages_per_s"] > 0 and e["sizes"]["tokens_per_passage"] == 256
    assert e["sizes"]["passages"] == 32 and e["dtype"] == "float32" and e["device"] == "cpu"
    assert c["sizes"]["pool"] == 20_000 and c["matmul_floor_queries_per_s"] > 0
    assert t["encoder_params"] > 0 and t["tokens_per_group"] > 0 and t["model_gflops_per_group"] > 0
    # the MFU arithmetic, against the peak given
    assert t["mfu_pct"] > 0 and t["mfu_counted_pct"] > 0
    assert abs(t["mfu_pct"] - 100 * 6 * t["encoder_params"] * t["tokens_per_group"] * t["groups_per_s"] / 1e12) \
        <= 1e-3 * t["mfu_pct"]
    x, rv = r["train_xtr"], r["train_revela"]  # the other objectives' steps, same encoder
    assert x["ok"] is True and x["objective"] == "xtr" and x["groups_per_s"] > 0 and x["mfu_pct"] > 0
    assert x["tokens_per_group"] < t["tokens_per_group"]  # XTR encodes the anchor and the positive only
    assert rv["ok"] is True and rv["objective"] == "revela" and rv["groups_per_s"] > 0
    assert rv["mfu_counted_pct"] > 0 and "mfu_pct" not in rv and rv["lm_params"] > 0


def test_gpu_peak_table_by_device_name():
    spec = importlib.util.spec_from_file_location("gpu_all", ROOT / "benchmarks" / "gpu_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mod.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert mod.peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mod.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert mod.peak_bf16_tflops("Tesla T4") is None


def test_gpu_all_negatives_part_on_cpu_finds_the_lists_of_faiss(tmp_path):
    # The optional sixth part, smoke sizes: the torch engine (on the CPU here) and faiss IndexFlatIP agree.
    out = tmp_path / "neg.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_all.py"), "--cpu-smoke", "--parts", "negatives",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    n = json.loads(out.read_text())["negatives"]
    assert n["ok"] is True and n["units"] == "queries/s" and n["device"] == "cpu"
    assert n["queries_per_s"] > 0 and n["faiss_cpu_queries_per_s"] > 0 and n["torch_over_faiss_cpu"] > 0
    assert n["sizes"]["shard"] == 20_000 and n["sizes"]["depth"] == 200
    assert n["same_rows_pct"] >= 99.0 and n["max_score_diff"] < 1e-4
