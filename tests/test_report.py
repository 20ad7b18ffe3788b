"""pairmine report on a mined run (tiny model, one shard): the page, its plots, the example tables and the
passages never used (re-chunked and re-embedded from the run's input), bad runs, and the page in headless Chromium."""

import html
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pairmine.pipeline.cli import main
from pairmine.pipeline.evaluate import EvalInputError
from pairmine.pipeline.report import PLOTS, build_report

ROOT = Path(__file__).resolve().parent.parent


def test_report_on_a_mined_run(tiny_run, tmp_path):
    run, mined = tiny_run
    res = build_report(str(run), str(tmp_path / "rep"), examples=3, seed=0, groups_per_doc=2)
    page = Path(res.html).read_text()
    for name in PLOTS:
        data = (tmp_path / "rep" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert f'<img src="{name}"' in page
    s = mined.stats
    assert "anchor threshold (centrality)" in page and "0.995" in page
    assert f"{s['passage_coverage_pct']:.1f}%" in page and f"{s['groups']} / {s['groups_per_doc']:.2f}" in page
    # Every count a user needs to trust the run is on the page (issue 14 items 4 and 5), with stats.json's values.
    assert ('passages cut to embed.max_length tokens (the model saw only their start)</td>'
            f'<td class="n">{s["passages_token_truncated"]}</td>') in page
    skipped = ", ".join(f"{r} {n}" for r, n in s["docs_skipped"].items() if n) or "none"
    assert f'documents skipped, by reason</td><td class="n">{skipped}</td>' in page
    # The figures before the consistency filter sit beside the paper's column (seed 000 has no filter).
    b = s["before_consistency_filter"]
    assert "<b>before the consistency filter</b>" in page and "<b>after the consistency filter</b>" in page
    assert (f'<td class="n">{b["groups"]} / {b["groups_per_doc"]:.2f}</td><td class="n">7.0 per document</td>' in page)
    assert f'<td class="n">{b["passage_coverage_pct"]:.1f}%</td><td class="n">68%</td>' in page
    assert len(res.docs) == 3 and page.count("Passages never used</b>") == 3
    # The per-stage figures of stats.json, one table row per stage (issue 15 item 5).
    first = s["stages"][0]
    assert "<h2>Stages</h2>" in page and (f'<tr><td>first pass</td><td class="n">{first["wall_s"]:.1f}</td>' in page)
    assert page.count("</td></tr>", page.index("<h2>Stages</h2>")) >= len(s["stages"])
    groups = pq.read_table(run / "groups" / "part-00000.parquet").to_pylist()
    for d in res.docs:
        assert f"<h3>{html.escape(d['doc_id'])}</h3>" in page
        assert "anchor and related texts identical to the run's" in d["check"]
        rows = [g for g in groups if g["doc_id"] == d["doc_id"]]
        assert d["n_groups"] == len(rows) and len(d["groups"]) == min(2, len(rows))
        used = {g["anchor_index"] for g in rows} | {j for g in rows for j in g["related_indices"]}
        assert {p["index"] for p in d["passages"] if not p["used"]} == set(range(len(d["passages"]))) - used
        # Re-embedding reproduces the stored anchor centrality (same model, fp32); every passage at or above the
        # threshold is an anchor, so every unused passage is below it (the filter kept every group in this run).
        for g in rows:
            assert d["passages"][g["anchor_index"]]["centrality"] == pytest.approx(g["anchor_centrality"], abs=1e-4)
        assert all(p["centrality"] < 0.995 + 1e-5 for p in d["passages"] if not p["used"])
    assert any("largest difference to the run's stored anchor centrality" in n for n in res.notes)


def test_report_when_the_input_is_gone_and_without_reembedding(tiny_run, tmp_path):
    run, _ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["inputs"][0]["path"] = str(tmp_path / "moved.parquet")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    res = build_report(str(copy), examples=2)
    assert Path(res.html) == copy / "report" / "report.html"  # default output: RUN/report
    assert any("could not be read again" in n for n in res.notes)
    assert all(d["passages"] is None for d in res.docs) and "groups only" in res.docs[0]["check"]
    res = build_report(str(run), str(tmp_path / "r2"), examples=2, reembed=False)
    assert all(p["centrality"] is None for d in res.docs for p in d["passages"])
    assert any("--no-reembed" in n for n in res.notes)


def test_bad_run_folders(tmp_path, capsys):
    with pytest.raises(EvalInputError, match="does not exist"):
        build_report(str(tmp_path / "nope"))
    (tmp_path / "half").mkdir()
    with pytest.raises(EvalInputError, match="not a committed run folder"):
        build_report(str(tmp_path / "half"))
    assert main(["report", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pairmine: error:") and "Traceback" not in err


def test_report_on_an_s3_run_with_the_endpoint_only_in_storage(tiny_run, s3_server, tmp_path):
    """`pairmine report s3://...` on the tiny run uploaded with its input: the endpoint only in the config file's
    [storage] (AWS_ENDPOINT_URL unset), the run, its input and the page all on S3."""
    from tests.conftest import S3_SECRET, Out

    run, _ = tiny_run
    o = Out(f"s3://pairmine-test/report-{time.time_ns()}", s3_server.endpoint)
    for f in run.rglob("*"):  # the committed run as-is (a report an earlier test wrote into it left out)
        rel = f.relative_to(run)
        if f.is_file() and rel.parts[0] != "report":
            o.storage.write_bytes(o.path("runs", "tiny", *rel.parts), f.read_bytes())
    manifest = json.loads((run / "manifest.json").read_text())
    shard = manifest["inputs"][0]
    o.storage.write_bytes(o.path("input", "docs.parquet"), Path(shard["path"]).read_bytes())
    shard["path"] = o.path("input", "docs.parquet")  # the input too is read again from S3
    o.storage.write_bytes(o.path("runs", "tiny", "manifest.json"), json.dumps(manifest).encode())
    config = tmp_path / "s3.toml"
    config.write_text(f'[storage]\nendpoint_url = "{s3_server.endpoint}"\n')
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "report", o.path("runs", "tiny"),
                           "--config", str(config), "--examples", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert S3_SECRET not in proc.stdout + proc.stderr
    assert f"report: {o.path('runs', 'tiny', 'report', 'report.html')}" in proc.stdout
    page = o.storage.read_bytes(o.path("runs", "tiny", "report", "report.html")).decode()
    s = o.json("runs", "tiny", "stats.json")
    assert f'groups (kept) / groups per document with groups</td><td class="n">{s["groups"]} / ' \
           f'{s["groups_per_doc"]:.2f}</td>' in page
    assert f"{s['passage_coverage_pct']:.1f}%" in page and o.path("runs", "tiny") in page
    # Both sampled documents re-read from the S3 input, re-chunked and checked against the run's groups.
    assert page.count("anchor and related texts identical to the run&#x27;s") == 2, page[-4000:]
    for name in PLOTS:
        assert o.storage.read_bytes(o.path("runs", "tiny", "report", name))[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(tiny_run, tmp_path):
    from PIL import Image

    run, _ = tiny_run
    res = build_report(str(run), str(tmp_path / "rep"), examples=2)
    shot = tmp_path / "shot.png"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "report_screenshot.sh"), res.html, str(shot), "1000", "1400"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    image = Image.open(shot)
    assert image.size == (1000, 1400)
    # A blank or error page has a handful of colours; the page with its plots has many.
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 200
