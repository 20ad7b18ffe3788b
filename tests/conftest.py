"""Shared fixtures: a local Ray (started once), the shipped sample, and a tiny BERT built from a config with the
real tokenizer of the default model (fast enough to run the whole pipeline in seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Credentials of the tests' own S3 server, set before Ray starts so that every Ray worker has them; the secret is
# what test_storage scans logs, manifests, stats and errors for.
S3_ACCESS_KEY = "pairmine-test-key"
S3_SECRET = "pm-test-secret-4f1c9e2b7a"
os.environ["AWS_ACCESS_KEY_ID"] = S3_ACCESS_KEY
os.environ["AWS_SECRET_ACCESS_KEY"] = S3_SECRET
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_ENDPOINT_URL", None)
os.environ.pop("AWS_PROFILE", None)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():  # an earlier test may have started it through pipeline.mine's init_ray
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def sample_dir():
    from pairmine.pipeline.inputs import SAMPLE_DIR

    return SAMPLE_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 64-dim BERT with the real all-MiniLM-L6-v2 tokenizer, random weights (seeded)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pairmine.operators.embed import default_model_path
    from pairmine.pipeline.model_description import ModelDescription, write_description

    path = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Random weights have no measured anchor threshold; the tests use E5's 0.825 (SPEC's hand-checked scale).
    write_description(str(path), ModelDescription(anchor_threshold=0.825, threshold_source="tests: E5's value"))
    return str(path)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS serving S3 on 127.0.0.1 for the whole session, with the bucket ``pairmine-test``."""
    from tests.s3server import S3Server

    server = S3Server(tmp_path_factory.mktemp("seaweedfs") / "data").start()
    server.make_bucket("pairmine-test")
    yield server
    server.stop()


class Out:
    """Where a test writes runs: a local folder or a prefix in the test S3 bucket, with the config overrides that
    point pairmine at it and readers for what lands there."""

    def __init__(self, root: str, endpoint: str | None):
        from pairmine.operators.storage import Storage

        self.root, self.endpoint = root.rstrip("/"), endpoint
        self.overrides = [f"output.path={self.root}"] + ([f"storage.endpoint_url={endpoint}"] if endpoint else [])
        self.storage = Storage(endpoint_url=endpoint or "")
        self.is_s3 = endpoint is not None

    def __str__(self) -> str:
        return self.root

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def exists(self, *parts: str) -> bool:
        return self.storage.exists(self.path(*parts))

    def names(self, *parts: str) -> list[str]:
        """Names directly under ``parts`` that hold at least one file (SeaweedFS keeps an emptied folder as a
        prefix; on S3 a prefix exists only while objects are under it)."""
        fs, root = self.storage.fs(self.path(*parts))
        fs.invalidate_cache()
        try:
            files = fs.find(root)
        except FileNotFoundError:
            return []
        return sorted({f[len(root):].strip("/").split("/", 1)[0] for f in files if f.startswith(root + "/")})

    def json(self, *parts: str):
        import json

        return json.loads(self.storage.read_bytes(self.path(*parts)))

    def filesystem(self):
        """A pyarrow filesystem and the path to give it (pyarrow's S3FileSystem does not read AWS_ENDPOINT_URL)."""
        import pyarrow.fs as pafs

        if not self.is_s3:
            return pafs.LocalFileSystem(), lambda p: p
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1")
        return fs, lambda p: p.split("://", 1)[1]

    def table(self, *parts: str):
        """The parquet dataset at ``parts`` (e.g. run_id, "groups"), read with pyarrow.dataset."""
        import pyarrow.dataset as pads

        fs, strip = self.filesystem()
        return pads.dataset(strip(self.path(*parts)), format="parquet", filesystem=fs).to_table()


def out_for(request, root: str) -> Out:
    """An ``Out`` at ``root`` (local) or at a fresh prefix of the test S3 bucket, by ``request.param`` ("local" or
    "s3"), for module-scoped fixtures that run once per storage."""
    if request.param == "local":
        return Out(root, None)
    server = request.getfixturevalue("s3_server")
    return Out(f"s3://pairmine-test/{request.fixturename}-{request.param}-{id(request)}", server.endpoint)


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path):
    """Every test that writes output runs twice: into a local folder and into the test S3 server."""
    if request.param == "local":
        return Out(str(tmp_path / "runs"), None)
    import uuid

    server = request.getfixturevalue("s3_server")
    return Out(f"s3://pairmine-test/{request.node.name.replace('[', '-').rstrip(']')}-{uuid.uuid4().hex[:8]}",
               server.endpoint)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model_dir, sample_dir):
    """A committed run of the tiny model on one shard of the sample (207 documents), for report and calibrate.

    fp32 and a threshold inside the tiny model's centrality range (its centralities are all ~0.99); consistency.k is
    larger than the pool, so the filter runs (n_above is counted) but keeps every group."""
    from pairmine.pipeline.config import load_config
    from pairmine.pipeline.mine import mine

    out = tmp_path_factory.mktemp("tiny-runs")
    cfg = load_config(overrides=[f"input.path={sample_dir}/000_00000.parquet", f"output.path={out}",
                                 "output.run_id=tiny", f"embed.model={tiny_model_dir}", "embed.dtype=float32",
                                 "anchors.threshold=0.995", "consistency.k=100000"])
    return out / "tiny", mine(cfg)


SCORE_ATOL = 1e-5
"""How far a score column of two runs of the same input may differ. A passage's vector is the same to ~1e-7 whatever
its batch (a batch holds passages of one padded length, but the matmul kernels a CPU picks for other batch sizes may
sum in another order; bitwise on some CPUs, not on all, as a clean-clone CI showed), so scores are compared within
this and everything else (ids, texts, related indices, counts) exactly."""


@pytest.fixture(scope="session")
def tiny_groups(tmp_path_factory, sample_dir, tiny_model_dir):
    """A committed mining run: the 24 documents of the first sample shard with the most passages, tiny model (the
    groups that test_train and test_xtr train on)."""
    import numpy as np
    import pyarrow.parquet as pq

    from pairmine.operators.chunk import chunk_text
    from pairmine.pipeline.config import load_config
    from pairmine.pipeline.mine import mine

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


def assert_same_groups(a, b, atol: float = SCORE_ATOL) -> None:
    """Two group tables hold the same groups: the same rows in the same order, every non-float column equal, every
    float column (or list of floats) within ``atol``.

    Raises:
        AssertionError: naming the first column that differs.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    assert a.num_rows == b.num_rows > 0 and a.schema.names == b.schema.names, (a.num_rows, b.num_rows, a.schema.names)
    for name in a.schema.names:
        col_a, col_b = a.column(name), b.column(name)
        t = col_a.type
        floating = pa.types.is_floating(t) or (pa.types.is_list(t) and pa.types.is_floating(t.value_type))
        if not floating:
            assert col_a.equals(col_b), f"column {name} differs"
            continue
        if pa.types.is_list(t):
            assert pc.list_value_length(col_a).equals(pc.list_value_length(col_b)), f"column {name}: list lengths differ"
            col_a, col_b = pc.list_flatten(col_a), pc.list_flatten(col_b)
        va, vb = col_a.to_numpy(zero_copy_only=False), col_b.to_numpy(zero_copy_only=False)
        assert np.allclose(va, vb, atol=atol, rtol=0, equal_nan=True), \
            f"column {name}: largest difference {np.nanmax(np.abs(va - vb)):.3g} > {atol}"
