"""pairmine's import names live under ``pairmine.`` (issue 13, item 1): a Ray job whose working directory holds
packages of its own named ``pipeline`` and ``operators`` (the folder names of pairmine's source tree, and common
names in any project) still runs pairmine's code, on the driver and on the Ray workers that unpickle its functions
by module name."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.raycluster import RayNode

SHADOW = 'raise ImportError("the job\'s own {name} package was imported instead of pairmine\'s")\n'


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """One Ray node (2 CPUs) with its job server on 127.0.0.1, stopped by PID."""
    from ray.job_submission import JobSubmissionClient

    node = RayNode(num_cpus=2, log_dir=tmp_path_factory.mktemp("ray-head"), dashboard=True).start()
    try:
        deadline = time.time() + 300
        while True:
            try:
                client = JobSubmissionClient(node.dashboard_url)
                break
            except Exception:  # noqa: BLE001 - the job server is still starting
                if time.time() > deadline:
                    raise
                time.sleep(1)
        yield client
    finally:
        node.stop()


def test_a_job_with_its_own_pipeline_package_mines_with_pairmine(head, tiny_run, tiny_model_dir, sample_dir,
                                                                 tmp_path):
    from ray.job_submission import JobStatus

    job_dir = tmp_path / "job"
    for name in ("pipeline", "operators"):
        (job_dir / name).mkdir(parents=True)
        (job_dir / name / "__init__.py").write_text(SHADOW.format(name=name))
    (job_dir / "mine.toml").write_text("")  # a job folder holds its own files; nothing of pairmine's
    settings = [f"input.path={sample_dir}/000_00000.parquet", f"output.path={tmp_path / 'out'}",
                "output.run_id=tiny", f"embed.model={tiny_model_dir}", "embed.dtype=float32",
                "anchors.threshold=0.995", "consistency.k=100000"]
    entrypoint = " ".join([str(Path(sys.executable).parent / "pairmine"), "mine",
                           *[a for s in settings for a in ("--set", s)]])
    # working_dir: the job's cwd and the head of sys.path on the driver and on every worker; PYTHONPATH makes sure.
    job = head.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(job_dir), "env_vars": {
        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": "."}})
    deadline = time.time() + 600
    while (status := head.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.time() < deadline, "the job did not end within 600 s"
        time.sleep(2)
    logs = head.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert "instead of pairmine's" not in logs
    reference_dir, _ = tiny_run
    job_groups = pq.read_table(tmp_path / "out" / "tiny" / "groups").drop_columns(["run_id"]).sort_by("group_id")
    local = pq.read_table(reference_dir / "groups").drop_columns(["run_id"]).sort_by("group_id")
    exact = ["group_id", "doc_id", "anchor_index", "anchor_text", "related_indices", "related_texts", "n_above"]
    assert job_groups.num_rows == local.num_rows > 0
    assert job_groups.select(exact).equals(local.select(exact))
