"""The training job end to end on CPU (SPEC "Training job (Ray Train)"): groups mined from the shipped sample with a
tiny BERT, `pairmine train` with 2 DDP workers (gloo) run as a user runs it, SIGKILLed after its first checkpoint and
run again: it continues from the saved step, the loss falls, the exported encoder loads and embeds. Plus the random
positives, the model's passes and bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pairmine.operators.chunk import chunk_text
from pairmine.pipeline.config import load_config
from pairmine.pipeline.mine import mine
from pairmine.pipeline.positives import ROW_SCHEMA, check_inputs_unchanged, draw_random_positives, with_random_positives

STEPS, EVERY = 12, 3
TRAIN_ARGS = ["--set", "scaling.num_workers=2", "--set", "train.batch_size=8", "--set", f"train.max_steps={STEPS}",
              "--set", f"checkpoint.every_steps={EVERY}", "--set", "train.max_length=64", "--set", "train.lr=1e-3",
              "--set", "train.lr_new=1e-3", "--set", "train.warmup_ratio=0", "--set", "train.shuffle_buffer=64"]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "pairmine.pipeline.cli", *args]


@pytest.fixture(scope="module")
def tiny_groups(tmp_path_factory, sample_dir, tiny_model_dir):
    """A committed mining run: the 24 documents of the first sample shard with the most passages, tiny model."""
    d = tmp_path_factory.mktemp("train-input")
    t = pq.read_table(sample_dir / "000_00000.parquet", columns=["id", "text", "url"])
    n = [len(chunk_text(x).passages) for x in t.column("text").to_pylist()]
    keep = sorted(np.argsort(n)[::-1][:24].tolist())
    pq.write_table(t.take(keep), d / "docs.parquet")
    cfg = load_config(overrides=[f"input.path={d / 'docs.parquet'}", f"output.path={d / 'runs'}", "output.run_id=tiny",
                                 f"embed.model={tiny_model_dir}", "embed.dtype=float32", "anchors.threshold=0.99",
                                 "consistency.enabled=false"])
    stats = mine(cfg).stats
    assert stats["groups"] >= 100
    return d / "runs" / "tiny"


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def tiny_e5_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny BERT in a folder named like an E5 model and without a pairmine_model.json: pairmine knows it as E5
    by its name only (prefixes "query: " / "passage: ", threshold 0.825)."""
    import shutil

    path = tmp_path_factory.mktemp("base") / "tiny-e5-base"
    shutil.copytree(tiny_model_dir, path, ignore=shutil.ignore_patterns("pairmine_model.json"))
    return str(path)


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_groups, tiny_e5_dir, tmp_path_factory):
    """`pairmine train` from an E5-named tiny BERT, SIGKILLed (with its local Ray) once the first checkpoint is
    registered and a later step is logged, then the same command again."""
    out = tmp_path_factory.mktemp("train") / "xprt"
    cmd = _cli("train", "--groups", str(tiny_groups), "--output", str(out), "--model", tiny_e5_dir, *TRAIN_ARGS)
    log1 = open(out.parent / "first.log", "w")
    proc = subprocess.Popen(cmd, stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    snapshot = out / "ray-train" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 400
    try:
        while time.time() < deadline and proc.poll() is None:
            if snapshot.exists() and len(_metrics(out)) >= EVERY + 1:
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the first run ended before it could be killed: " + (out.parent / "first.log").read_text()[-3000:]
        assert snapshot.exists(), "no checkpoint within the time limit"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started (same session)
        proc.wait()
        log1.close()
    killed_at = len(_metrics(out))
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    return out, killed_at, second


def test_killed_run_resumes_from_its_checkpoint(killed_and_resumed):
    out, killed_at, second = killed_and_resumed
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, none restarted
    resumed = {r["start_step"] for r in rows if r["start_step"] > 0}
    assert len(resumed) == 1
    start = resumed.pop()
    assert start % EVERY == 0 and EVERY <= start <= killed_at  # a saved step, not step 0
    assert all(r["start_step"] == 0 for r in rows if r["step"] <= start)
    assert all(r["start_step"] == start for r in rows if r["step"] > start)
    assert f"resumed from checkpoint at step {start} of {STEPS}" in second.stdout + second.stderr
    ckpts = sorted(p for p in (out / "ray-train").glob("checkpoint_*") if p.is_dir())
    assert 1 <= len(ckpts) <= 2 and all((c / "state.pt").exists() for c in ckpts)  # checkpoint.keep = 2
    state = torch.load(ckpts[-1] / "state.pt", map_location="cpu", weights_only=False)
    assert state["step"] == STEPS


def test_every_term_is_reported_and_the_loss_falls(killed_and_resumed):
    out, _, second = killed_and_resumed
    rows = _metrics(out)
    for r in rows:
        assert {"loss", "l_xp", "l_cross", "l_self", "l_mlm", "l_unif", "l_retention", "w_retention", "lr",
                "grad_norm", "groups_per_s", "p_positive"} <= set(r)
        assert all(np.isfinite(r[k]) for k in ("loss", "l_xp", "l_cross", "l_self", "l_mlm", "l_unif", "l_retention"))
        assert r["groups"] == 8
    assert rows[0]["w_retention"] == 40.0 and rows[-1]["w_retention"] == 0.0
    first, last = rows[:3], rows[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "loss") < mean(first, "loss")
    assert mean(last, "l_mlm") < mean(first, "l_mlm") and mean(last, "l_cross") < mean(first, "l_cross")
    manifest = json.loads((out / "train_manifest.json").read_text())
    assert manifest["resolved"]["workers"] == 2 and manifest["resolved"]["backend"] == "gloo"
    assert manifest["resolved"]["total_steps"] == STEPS and manifest["config"]["loss"]["w_cross"] == 0.1
    assert "exported encoder:" in second.stdout
    assert "Reporting training result" not in second.stdout + second.stderr  # Ray Train's per-report line is dropped


def test_exported_encoder_loads_and_embeds(killed_and_resumed, tiny_e5_dir):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from pairmine.operators.embed import Embedder
    from pairmine.pipeline.model_description import describe_model

    out, _, _ = killed_and_resumed
    export = out / "export"
    model = AutoModel.from_pretrained(export)
    assert type(model).__name__ == "BertModel" and model.config.hidden_size == 64
    texts = ["The perfect game is a rare feat in baseball.", "A pitcher retires all 27 batters."]
    trained = Embedder(str(export), "passage: ", dtype="float32").encode(texts)
    start = Embedder(tiny_e5_dir, "passage: ", dtype="float32").encode(texts)
    assert trained.shape == (2, 64) and np.allclose(np.linalg.norm(trained, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(trained, start, atol=1e-4)  # training changed the encoder
    # The E5 base's prefixes survive the export (its folder is named "export"): mine, filter-pairs and eval read
    # them, and the threshold, from the export's pairmine_model.json.
    d = describe_model(str(export))
    assert (d.query_prefix, d.passage_prefix, d.anchor_threshold, d.base_model) == ("query: ", "passage: ", 0.825,
                                                                                    tiny_e5_dir)
    cfg = load_config(overrides=[f"embed.model={export}"])  # the config of mine, filter-pairs and eval
    assert (cfg.resolved_query_prefix(), cfg.resolved_prefix(), cfg.resolved_threshold()) == ("query: ", "passage: ",
                                                                                             0.825)
    assert cfg.threshold_source().endswith(f"({export / 'pairmine_model.json'})")
    # It loads as a sentence-transformers model whose prompts are the prefixes, with pairmine's vectors.
    st = SentenceTransformer(str(export), device="cpu")
    assert st.prompts["query"] == "query: " and st.prompts["passage"] == "passage: "
    v = st.encode(texts, prompt_name="passage", convert_to_numpy=True)
    assert np.all(np.sum(v * trained, axis=1) > 0.9999)
    q = st.encode_query(texts, convert_to_numpy=True)
    assert np.all(np.sum(q * Embedder(str(export), "query: ", dtype="float32").encode(texts), axis=1) > 0.9999)


def _doc_rows(groups: list[tuple[str, int, list[int]]], passages_lists: list[list[str]]) -> pa.Table:
    """ROW_SCHEMA rows of document "d": its groups (id, anchor index, related indices over p0..p9) and its
    re-chunked passage lists."""
    rows = [{"doc_id": "d", "group_id": g, "anchor_index": a, "anchor_text": f"p{a}", "related_indices": r,
             "related_texts": [f"p{i}" for i in r], "passages": None} for g, a, r in groups]
    rows += [{"doc_id": "d", "group_id": None, "anchor_index": None, "anchor_text": None, "related_indices": None,
              "related_texts": None, "passages": p} for p in passages_lists]
    return pa.Table.from_pylist(rows, schema=ROW_SCHEMA)


def test_random_positives_are_drawn_from_all_passages_of_the_document():
    doc = [f"p{i}" for i in range(10)]  # p9 is in no group: the paper's random spans could pick it, so must we
    groups = [("g0", 0, [1, 2, 3, 4]), ("g1", 5, [6, 7, 8, 0])]
    out = draw_random_positives(_doc_rows(groups, [doc]), seed=0)
    assert out.column("group_id").to_pylist() == ["g0", "g1"]
    texts, index = out.column("positive_text").to_pylist(), out.column("positive_index").to_pylist()
    assert texts == [doc[i] for i in index] and texts[0] != "p0" and texts[1] != "p5"  # never the group's anchor
    assert draw_random_positives(_doc_rows(groups, [doc]), seed=0).equals(out)  # seeded per group
    draws = {draw_random_positives(_doc_rows(groups, [doc]), seed=s).column("positive_text")[0].as_py()
             for s in range(80)}
    assert draws == set(doc) - {"p0"}  # uniform over the document's other passages, p9 included
    # An id the input holds twice (mining kept the copy whose passages agree with the groups): that copy is used.
    other_copy = [f"x{i}" for i in range(12)]
    assert draw_random_positives(_doc_rows(groups, [other_copy, doc]), seed=0).equals(out)
    # No copy agrees (the file changed in place): the passages the groups hold, index -1.
    fallback = draw_random_positives(_doc_rows(groups, [other_copy]), seed=0)
    assert fallback.column("positive_index").to_pylist() == [-1, -1]
    assert all(t in {f"p{i}" for i in range(9)} for t in fallback.column("positive_text").to_pylist())
    assert draw_random_positives(_doc_rows([], [doc]), seed=0).num_rows == 0  # a document without groups


def test_model_passes_shapes_on_a_tiny_bert(tiny_model_dir):
    from transformers import AutoTokenizer

    from pairmine.pipeline.xprt import mask_tokens
    from pairmine.pipeline.xprt_model import XPRTModel, load_encoder_and_head

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoder, head, fresh = load_encoder_and_head(tiny_model_dir)
    assert fresh  # the tiny checkpoint is a BertModel: no MLM head
    model = XPRTModel(encoder, head, n_cond=4).eval()
    assert head.predictions.decoder.weight is encoder.embeddings.word_embeddings.weight  # shared token table
    g = 3
    texts = [f"passage number {i} of group {j} with some words" for i in range(5) for j in range(g)]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]
    special = torch.isin(ids, torch.tensor(tok.all_special_ids)) | (attn == 0)
    gen = torch.Generator().manual_seed(0)
    e_ids, e_ch = mask_tokens(ids, special, 0.15, gen, tok.mask_token_id, len(tok), 0.1, 0.1)
    d_ids, d_ch = mask_tokens(ids, special, 0.6, gen, tok.mask_token_id, len(tok))
    out = model(e_ids, attn, e_ch, ids, d_ids, d_ch, g)
    assert out.pooled.shape == (5 * g, 64)
    assert out.mlm_logits.shape == (int(e_ch.sum()), len(tok))
    # 8 cross passes: related 1..4 filled from the anchor vector, the anchor filled from each related vector
    n_cross = sum(int(d_ch[k * g: (k + 1) * g].sum()) for k in range(1, 5)) + 4 * int(d_ch[:g].sum())
    assert out.cross_logits.shape == (n_cross, len(tok)) and out.cross_labels.shape == (n_cross,)
    assert out.self_logits.shape == out.self_teacher.shape == (int(d_ch[: 2 * g].sum()), len(tok))
    # the sentence vectors are mining's: mean pooling of the encoder (here of the masked passes)
    from pairmine.operators.embed import mean_pool
    with torch.no_grad():
        hidden = encoder(input_ids=e_ids, attention_mask=attn).last_hidden_state
    assert torch.allclose(out.pooled, mean_pool(hidden, attn), atol=1e-5)
    # retention is 0 when the model equals its frozen copy: no masking, no dropout, the copy on the same text
    import copy

    import torch.nn.functional as F

    from pairmine.pipeline.xprt import retention_kl
    frozen = copy.deepcopy(encoder).eval()
    no_mask = torch.zeros_like(e_ch)
    with torch.no_grad():
        cur = F.normalize(model(ids, attn, no_mask, ids, d_ids, d_ch, g).pooled, dim=-1)
        frz = F.normalize(mean_pool(frozen(input_ids=ids, attention_mask=attn).last_hidden_state, attn), dim=-1)
    assert retention_kl(cur[:g], cur[g:2 * g], frz[:g], frz[g:2 * g]).item() == pytest.approx(0.0, abs=1e-6)


def test_random_positives_through_ray_data(tiny_groups):
    import ray.data  # Ray is up: mining the tiny groups started it (or found the session's)

    from pairmine.operators.read import InputError
    from pairmine.operators.storage import LOCAL

    manifest = json.loads((tiny_groups / "manifest.json").read_text())
    ds = ray.data.read_parquet(str(tiny_groups / "groups"))
    rows = with_random_positives(ds, manifest, LOCAL, seed=0, num_partitions=2).take_all()
    assert sorted(r["group_id"] for r in rows) == sorted(ds.unique("group_id"))  # one row per group, none lost
    docs = pq.read_table(tiny_groups.parent.parent / "docs.parquet", columns=["id", "text"]).to_pylist()
    passages = {d["id"]: chunk_text(d["text"]).passages for d in docs}  # the default chunk settings, as mined
    held: dict[str, set[int]] = {}
    for r in rows:
        held.setdefault(r["doc_id"], set()).update([r["anchor_index"], *r["related_indices"]])
    never_grouped = 0
    for r in rows:
        assert r["positive_index"] >= 0 and r["positive_index"] != r["anchor_index"]
        assert r["positive_text"] == passages[r["doc_id"]][r["positive_index"]]
        never_grouped += r["positive_index"] not in held[r["doc_id"]]
    assert never_grouped > 0, "no positive was a passage that no group holds"
    # An input that changed since mining is refused before any work.
    changed = [dict(manifest["inputs"][0], size=manifest["inputs"][0]["size"] + 1)]
    with pytest.raises(InputError, match="changed since it was mined"):
        check_inputs_unchanged(changed, LOCAL)
    with pytest.raises(InputError, match="is gone"):
        check_inputs_unchanged([dict(manifest["inputs"][0], path=str(tiny_groups / "nowhere.parquet"))], LOCAL)


@pytest.mark.parametrize("case", ["missing", "no-success", "wrong-schema", "too-few", "bad-positives"])
def test_train_bad_input_is_one_line(case, tmp_path, tiny_groups):
    groups = tmp_path / "run"
    extra = []
    if case == "missing":
        expected = "does not exist"
    elif case == "no-success":
        (groups / "groups").mkdir(parents=True)
        pq.write_table(pq.read_table(next((tiny_groups / "groups").glob("*.parquet"))), groups / "groups" / "part-00000.parquet")
        expected = "no _SUCCESS marker"
    elif case == "wrong-schema":
        (groups / "groups").mkdir(parents=True)
        (groups / "_SUCCESS").write_text("x\n")
        pq.write_table(pa.table({"doc_id": ["a"], "text": ["b"]}), groups / "groups" / "part-00000.parquet")
        expected = "has no column 'group_id'"
    elif case == "too-few":
        groups = tiny_groups
        extra = ["--set", "train.batch_size=100000"]
        expected = "too few for one batch of train.batch_size = 100000"
    else:
        groups = tiny_groups
        extra = ["--positives", "spans"]
        expected = "invalid choice: 'spans'"
    proc = subprocess.run(_cli("train", "--groups", str(groups), "--output", str(tmp_path / "out"), *extra),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_train_reads_groups_from_s3_and_writes_checkpoints_and_export_there(tiny_groups, tiny_model_dir, s3_server,
                                                                             tmp_path):
    """The same job with --groups and --output on the test S3 server (endpoint from storage.endpoint_url only)."""
    from tests.conftest import S3_SECRET, Out

    o = Out(f"s3://pairmine-test/train-{time.time_ns()}", s3_server.endpoint)
    for f in Path(tiny_groups).rglob("*"):  # the committed mining run, uploaded as-is
        if f.is_file():
            o.storage.write_bytes(o.path("runs", "tiny", str(f.relative_to(tiny_groups))), f.read_bytes())
    args = [a.replace(f"train.max_steps={STEPS}", "train.max_steps=4").replace(f"checkpoint.every_steps={EVERY}",
                                                                               "checkpoint.every_steps=2")
            for a in TRAIN_ARGS]
    # The endpoint only in [storage] (as pairmine mine takes it): groups, Ray Train's checkpoints, metrics and export.
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    proc = subprocess.run(_cli("train", "--groups", o.path("runs", "tiny"), "--output", o.path("train"),
                               "--model", tiny_model_dir, "--set", f"storage.endpoint_url={s3_server.endpoint}", *args),
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert S3_SECRET not in proc.stdout + proc.stderr
    metrics = [json.loads(x) for x in o.storage.read_bytes(o.path("train", "metrics.jsonl")).decode().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert sum(n.startswith("checkpoint_") for n in o.names("train", "ray-train")) >= 1
    local = tmp_path / "export"
    fs, root = o.storage.fs(o.path("train", "export"))
    fs.invalidate_cache()
    for f in fs.find(root):  # the export holds folders too (sentence-transformers' 1_Pooling/, 2_Normalize/)
        name = f[len(root):].strip("/")
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(fs.cat_file(f))
    assert (local / "pairmine_model.json").exists() and (local / "modules.json").exists()
    from pairmine.operators.embed import Embedder

    v = Embedder(str(local)).encode(["a passage about rockets", "a passage about cooking"])
    assert v.shape == (2, 64) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
