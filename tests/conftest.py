"""Shared fixtures: a local Ray (started once), the shipped sample, and a tiny BERT built from a config with the
real tokenizer of the default model (fast enough to run the whole pipeline in seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def sample_dir():
    from pipeline.inputs import SAMPLE_DIR

    return SAMPLE_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 64-dim BERT with the real all-MiniLM-L6-v2 tokenizer, random weights (seeded)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from operators.embed import default_model_path

    path = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
