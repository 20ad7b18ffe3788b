"""The stage plan (issue 14, item 8): stages are fitted to the cluster's CPUs, or a plan that could never be placed is
refused before any work, instead of a pipeline that waits forever for resources that do not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from pairmine.pipeline.ray_adapter import PlanError, plan_stages


def test_cpu_shares_fit_the_cluster():
    # 2 CPUs hold 1 embed actor (1) + 1 filter actor (0.5) + the tasks (0.5): nothing to scale.
    p = plan_stages("auto", cpus=2, gpus=0, cpus_per_node=2)
    assert (p.device, p.embed_actors, p.filter_actors, p.threads) == ("cpu", 1, 1, 2)
    assert (p.embed_cpus, p.light_cpus, p.scaled) == (1.0, 0.5, False)
    # 1 CPU: every share scaled by 1 / 2.
    p = plan_stages("auto", cpus=1, gpus=0, cpus_per_node=1)
    assert (p.embed_cpus, p.light_cpus, p.scaled) == (0.5, 0.25, True)
    assert p.embed_cpus * p.embed_actors + p.light_cpus * (p.filter_actors + 1) == pytest.approx(1.0)
    # Without the filter: 1 embed actor + tasks = 1.5 CPUs wanted of 1 -> 2/3.
    p = plan_stages("cpu", filter_enabled=False, cpus=1, gpus=0, cpus_per_node=1)
    assert p.filter_actors == 0 and p.embed_cpus == pytest.approx(0.6667) and p.light_cpus == pytest.approx(0.3333)
    # Two embed actors on 4 CPUs share the node's threads.
    assert plan_stages("cpu", embed_actors=2, cpus=4, gpus=0, cpus_per_node=4).threads == 2


def test_gpu_plans():
    p = plan_stages("auto", cpus=16, gpus=2, cpus_per_node=8)
    assert (p.device, p.embed_actors, p.filter_actors, p.embed_gpus, p.filter_gpus) == ("cuda", 2, 2, 0.75, 0.25)
    assert plan_stages("cpu", cpus=16, gpus=2, cpus_per_node=8).device == "cpu"
    with pytest.raises(PlanError, match="no GPU"):
        plan_stages("cuda", cpus=4, gpus=0)
    with pytest.raises(PlanError, match="do not fit the cluster's 1 GPU"):
        plan_stages("cuda", embed_actors=2, cpus=4, gpus=1)
    with pytest.raises(PlanError, match="actors per CPU"):
        plan_stages("cpu", embed_actors=11, cpus=1, gpus=0)


def test_the_shares_come_from_the_config_for_every_job():
    """One stage plan (issue 13 item 3): ray.embed_cpus / ray.task_cpus / ray.embed_gpu_share, documented in
    pairmine's --help, are what mine, filter-pairs and negatives plan with (pipeline.ray_adapter.plan_for)."""
    from pairmine.pipeline.config import ConfigError, load_config
    from pairmine.pipeline.ray_adapter import plan_for

    cfg = load_config()
    p = plan_for(cfg, cfg.consistency.num_actors, cpus=2, gpus=0, cpus_per_node=2)
    assert (p.embed_cpus, p.light_cpus, p.scaled) == (1.0, 0.5, False)  # the defaults
    cfg = load_config(overrides=["ray.embed_cpus=2", "ray.task_cpus=0.25", "ray.embed_gpu_share=0.5"])
    # 2 + 0.25 (filter actor) + 0.25 (tasks) = 2.5 CPUs wanted of 5: as configured.
    p = plan_for(cfg, 1, cpus=5, gpus=0, cpus_per_node=5)
    assert (p.embed_cpus, p.light_cpus, p.scaled) == (2.0, 0.25, False)
    # ... of 1.25: every share halved.
    p = plan_for(cfg, 1, cpus=1.25, gpus=0, cpus_per_node=1)
    assert (p.embed_cpus, p.light_cpus, p.scaled) == (1.0, 0.125, True)
    p = plan_for(cfg, 0, cpus=8, gpus=1, cpus_per_node=8)
    assert (p.device, p.embed_gpus, p.filter_gpus) == ("cuda", 0.5, 0.5)
    # negatives with a teacher plans twice the embed actors through the same function
    assert plan_for(cfg, 1, embed_actors=2, cpus=5, gpus=0, cpus_per_node=5).embed_actors == 2
    for bad in ("ray.embed_cpus=0", "ray.task_cpus=-1", "ray.embed_gpu_share=1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=[bad])


def _cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "mine", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_one_cpu_ray_completes_and_impossible_plans_are_refused(tiny_model_dir, sample_dir, tmp_path):
    pq.write_table(pq.read_table(sample_dir / "000_00000.parquet").slice(0, 40), tmp_path / "docs.parquet")
    common = ["--input", str(tmp_path / "docs.parquet"), "--output", str(tmp_path / "runs"),
              "--set", f"embed.model={tiny_model_dir}", "--set", "embed.dtype=float32"]
    # It used to hang after "mining 1 shard(s)" for as long as one waited (11 minutes observed).
    proc = _cli(*common, "--run-id", "one-cpu", "--set", "ray.num_cpus=1", timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "one-cpu" / "manifest.json").read_text())
    assert manifest["resolved"]["ray"] == "local (1 CPUs)"
    assert manifest["resolved"]["stage_plan"].endswith("cluster 1 CPUs, 0 GPUs (CPU shares scaled down to fit)")
    assert "0.5 CPU" in manifest["resolved"]["stage_plan"] and "tasks 0.25 CPU" in manifest["resolved"]["stage_plan"]
    assert json.loads((tmp_path / "runs" / "one-cpu" / "stats.json").read_text())["docs_in"] == 40
    # A GPU asked for on a machine without one: one line, exit 2, no run folder.
    proc = _cli(*common, "--run-id", "cuda", "--set", "embed.device=cuda", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pairmine: error: embed.device is 'cuda' but the Ray cluster has no GPU" in proc.stderr
    assert not (tmp_path / "runs" / "cuda").exists()
