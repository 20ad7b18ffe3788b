"""pairmine ablate: every arm trained and evaluated on a tiny run, finite figures, p-values, the table and the page;
a second invocation resumes without retraining; another plan on the same output and bad input are one error line
before any training."""

import json
import math
import shutil
from pathlib import Path

import pytest

from pairmine.pipeline.ablate import ARMS, ablate, parse_arms
from pairmine.pipeline.cli import main
from pairmine.pipeline.config import ConfigError

DATA = Path(__file__).parent / "data"
TINY_PROXY = ["train.scratch_layers=1", "train.scratch_hidden=32", "train.scratch_heads=2",
              "train.scratch_intermediate=64", "train.max_steps=3", "train.batch_size=8", "train.max_length=48"]


@pytest.fixture(scope="module")
def small_beir(tmp_path_factory):
    """40 FiQA queries, their relevant documents and 160 others (a BEIR folder named fiqa-small)."""
    src = DATA / "fiqa-pairs-beir"
    d = tmp_path_factory.mktemp("beir") / "fiqa-small"
    (d / "qrels").mkdir(parents=True)
    lines = (src / "qrels" / "test.tsv").read_text().splitlines()
    header, rows = lines[0], [r.split("\t") for r in lines[1:]]
    queries = sorted({r[0] for r in rows})[:40]
    rel = [r for r in rows if r[0] in queries]
    keep_docs = {r[1] for r in rel}
    corpus = [json.loads(x) for x in (src / "corpus.jsonl").read_text().splitlines()]
    others = [c for c in corpus if c["_id"] not in keep_docs][:160]
    (d / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus if c["_id"] in keep_docs)
                                    + "".join(json.dumps(c) + "\n" for c in others))
    qs = [json.loads(x) for x in (src / "queries.jsonl").read_text().splitlines()]
    (d / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs if q["_id"] in queries))
    (d / "qrels" / "test.tsv").write_text(header + "\n" + "".join("\t".join(r) + "\n" for r in rel))
    sts = d.parent / "sts-small.csv"
    sts.write_text("\n".join((DATA / "stsbenchmark" / "sts-test.csv").read_text().splitlines()[:120]) + "\n")
    return d, sts


def test_parse_arms():
    assert parse_arms("start,xprt,random,crop") == list(ARMS)
    assert parse_arms(" xprt , crop") == ["xprt", "crop"]
    for bad in ("xprt,bogus", "", "xprt,xprt"):
        with pytest.raises(ConfigError, match="--arms"):
            parse_arms(bad)


def test_ablate_quick_trains_every_arm_writes_the_report_and_resumes(tiny_groups, tiny_model_dir, small_beir,
                                                                      tmp_path, ray_local):
    beir, sts = small_beir
    out = tmp_path / "abl"
    over = [f"train.model={tiny_model_dir}", *TINY_PROXY]
    # one seed keeps the default test run short (each unit is a Ray Train job); the seed spread is the same code
    res = ablate(str(tiny_groups), [str(beir)], str(sts), str(out), list(ARMS), "scratch", 1, True, None, over,
                 ["embed.dtype=float32"])
    s = res.summary
    assert res.trained == 3  # xprt, random and crop; start is not trained
    assert s["arms"] == list(ARMS) and s["sets"] == ["fiqa-small", "sts"] and s["seeds"] == 1
    assert s["steps"] == 3 and s["pairs_per_step"] == 8
    for arm in ARMS:
        for seed in (0,):
            unit = s["units"][f"{arm}-s{seed}"]
            assert unit["steps"] == (0 if arm == "start" else 3) and unit["pairs"] == unit["steps"] * 8
            for m in ("ndcg@10", "recall@100"):
                assert 0.0 <= unit["scores"]["fiqa-small"][m] <= 1.0
            assert -1.0 <= unit["scores"]["sts"]["spearman"] <= 1.0
        agg = s["aggregate"][arm]["fiqa-small"]["ndcg@10"]
        assert math.isfinite(agg["mean"]) and agg["std"] == 0.0 and agg["per_seed"] == [agg["mean"]]
    # p-values of every arm against random and start (not against itself)
    for arm in ("xprt", "crop"):
        for base in ("random", "start"):
            p = s["p_values"][arm]["fiqa-small"][base]
            assert 0.0 <= p["p_value"] <= 1.0 and p["n"] == 40 and 0.0 <= p["recall@100"]["p_value"] <= 1.0
    assert set(s["p_values"]["random"]["fiqa-small"]) == {"start"}
    assert set(s["p_values"]["start"]["fiqa-small"]) == {"random"}
    # the crop arm trained on spans, the xprt arm on s1: different models
    assert s["units"]["crop-s0"]["scores"] != s["units"]["xprt-s0"]["scores"]
    md = (out / "ablation.md").read_text()
    assert "| xprt |" in md and "fiqa-small ndcg@10" in md and "vs random" in md
    html = (out / "ablation.html").read_text()
    assert "data:image/png;base64," in html and "| crop |" in html
    assert json.loads((out / "ablation.json").read_text())["aggregate"] == s["aggregate"]
    assert (out / "units" / "xprt-s0" / "export" / "pairmine_model.json").exists()
    # a second invocation: nothing trained, the same figures
    again = ablate(str(tiny_groups), [str(beir)], str(sts), str(out), list(ARMS), "scratch", 1, True, None, over,
                   ["embed.dtype=float32"])
    assert again.trained == 0 and again.summary["aggregate"] == s["aggregate"]
    # another plan on the same output is refused, naming what differs
    with pytest.raises(ConfigError, match=r"another plan: config \(train.max_steps\)"):
        ablate(str(tiny_groups), [str(beir)], str(sts), str(out), list(ARMS), "scratch", 1, True, None,
               [*over, "train.max_steps=4"], ["embed.dtype=float32"])


def test_bad_input_is_one_error_line_before_any_training(tiny_groups, small_beir, tmp_path, capsys):
    beir, sts = small_beir
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_groups, incomplete)
    (incomplete / "_SUCCESS").unlink()
    cases = [
        (["--groups", str(incomplete), "--beir", str(beir)], "_SUCCESS"),
        (["--groups", str(tiny_groups), "--beir", str(tmp_path / "nope")], "nope"),
        (["--groups", str(tiny_groups), "--beir", str(beir), "--arms", "xprt,bogus"], "unknown: bogus"),
        (["--groups", str(tiny_groups)], "nothing to evaluate"),
    ]
    for args, needle in cases:
        out = tmp_path / "abl-bad"
        assert main(["ablate", *args, "--output", str(out), "--quick"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pairmine: error:") and needle in err[0], err
        assert not (out / "units").exists() or not any((out / "units").iterdir())
