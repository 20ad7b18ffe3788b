"""pairmine on a real two-node Ray cluster started by the test on 127.0.0.1 (issue 10, items 2a and 2b): a mining run
submitted through Ray's job-submission API (what ``deploy/submit.sh`` and KubeRay's RayJob use) writes the same
groups as the same command run locally, and a run whose worker node is SIGKILLed ends with one error line and
resumes with the same groups. Both compare with the session's ``tiny_run`` (the same shard and settings, mined
locally), so the module costs a cluster start and three jobs (~4 minutes on 2 cores). The nodes are stopped by PID
(only the processes they started)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import assert_same_groups
from tests.raycluster import RayNode, venv_path

REPO = Path(__file__).resolve().parents[1]


def wait_for(check, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except RuntimeError:  # a process that died: no point in waiting
            raise
        except Exception:  # noqa: BLE001 - the server is still starting
            if time.time() > deadline:
                raise
        if time.time() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (1 CPU, dashboard and job server on 127.0.0.1) and a worker node (1 CPU)."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_nodes

    logs = tmp_path_factory.mktemp("ray-cluster")
    head = RayNode(num_cpus=1, log_dir=logs, dashboard=True).start()
    worker = None
    try:
        client = wait_for(lambda: JobSubmissionClient(head.dashboard_url), 300, "the job server did not answer")

        def alive() -> int:
            if worker is not None and worker.proc.poll() is not None:
                raise RuntimeError(f"the worker node exited with {worker.proc.returncode}; see the logs in {logs}")
            return len([n for n in list_nodes(address=head.dashboard_url) if n.state == "ALIVE"])

        wait_for(lambda: alive() == 1, 300, "the head node did not register")  # a worker needs the head's node info
        worker = RayNode(num_cpus=1, address=head.address, log_dir=logs).start()
        wait_for(lambda: alive() == 2, 300, "the worker node did not join")
        yield head, worker, client
    finally:
        if worker is not None:
            worker.stop()
        head.stop()


def submit(client, args: list[str]) -> str:
    """Submit ``pairmine <args>`` as a Ray job; its id."""
    entrypoint = " ".join([sys.executable, "-m", "pairmine.pipeline.cli", *args])
    return client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": {
        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}})


def run_job(client, args: list[str], timeout: float = 600, job: str | None = None) -> tuple[str, str]:
    """Submit ``pairmine <args>`` as a Ray job (or follow ``job``); wait for it; (status, logs)."""
    from ray.job_submission import JobStatus

    job = job or submit(client, args)
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    status = wait_for(lambda: (s := client.get_job_status(job)) in terminal and s, timeout, f"job {job} did not end")
    return str(status), client.get_job_logs(job)


# The settings of conftest's tiny_run (shard 000_00000 of the sample), as CLI flags.
TINY_RUN_SETTINGS = ["embed.dtype=float32", "anchors.threshold=0.995", "consistency.k=100000"]


def tiny_run_args(tiny_model_dir, sample_dir, output, run_id: str) -> list[str]:
    settings = [f"embed.model={tiny_model_dir}", *TINY_RUN_SETTINGS]
    return ["mine", "--input", str(sample_dir / "000_00000.parquet"), "--output", str(output), "--run-id", run_id,
            *[a for s in settings for a in ("--set", s)]]


def tiny_run_groups(tiny_run):
    return pq.read_table(tiny_run[0] / "groups").drop_columns(["run_id"])


def test_submitted_job_mines_what_a_local_run_mines(cluster, ray_local, tiny_run, tiny_model_dir, sample_dir,
                                                    tmp_path):
    """``deploy/submit.sh`` (``ray job submit -- pairmine mine ...``, as a user runs it) against the running cluster:
    it follows the job's log, exits 0 when the job succeeded, and the job's groups are those of the same command run
    locally (``tiny_run``): ids, texts, related indices exactly, scores within 1e-4."""
    import subprocess

    head, _, client = cluster
    t0 = time.time()
    args = tiny_run_args(tiny_model_dir, sample_dir, tmp_path / "cluster", "job")[1:]  # submit.sh adds `pairmine mine`
    proc = subprocess.run(["bash", str(REPO / "deploy" / "submit.sh"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RAY_ADDRESS": head.dashboard_url, "PATH": venv_path()})
    job_s = time.time() - t0
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    followed = proc.stdout + proc.stderr
    assert "succeeded" in followed and "groups from 207 documents" in followed, followed[-3000:]  # the job's log
    manifest = json.loads((tmp_path / "cluster" / "job" / "manifest.json").read_text())
    assert manifest["resolved"]["ray"].startswith("cluster ")
    assert manifest["resolved"]["ray"].endswith("(2 node(s), 2 CPUs, 0 GPUs)")
    print(f"\ntwo-node job {job_s:.1f} s (deploy/submit.sh, submission to end); the same command run locally "
          f"(tiny_run) {tiny_run[1].stats['elapsed_s']:.1f} s")
    job = pq.read_table(tmp_path / "cluster" / "job" / "groups").drop_columns(["run_id"])
    local = tiny_run_groups(tiny_run)
    assert_same_groups(job, local, atol=1e-4)
    assert json.loads((tmp_path / "cluster" / "job" / "stats.json").read_text())["groups"] == local.num_rows


def test_submit_script_exits_with_pairmines_own_code_when_the_job_fails(cluster, tmp_path):
    """Issue 39 item 4 (kuberay#3211/#3216): `ray job submit` exits 0 for a STOPPED job and 1 for every failure, so a
    scheduler could not tell a user error from a crash. deploy/submit.sh exits with the job's result: pairmine's own
    exit code 2 (a user error, its one error line in the followed log) where Ray recorded it."""
    import subprocess

    head, _, _ = cluster
    proc = subprocess.run(["bash", str(REPO / "deploy" / "submit.sh"), "--input", str(tmp_path / "missing"),
                           "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": head.dashboard_url, "PATH": venv_path()})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert f"pairmine: error: input {tmp_path / 'missing'} does not exist" in text
    assert "ended FAILED (driver exit code 2;" in text and "exiting 2" in text


# The training of tests/test_train.py, shortened: 2 workers, 4 steps of 8 groups, a checkpoint every 2 steps.
TWO_NODE_TRAIN = ["--set", "scaling.num_workers=2", "--set", "train.batch_size=8", "--set", "train.max_steps=4",
                  "--set", "checkpoint.every_steps=2", "--set", "train.max_length=64", "--set", "train.lr=1e-3",
                  "--set", "train.lr_new=1e-3", "--set", "train.warmup_ratio=0", "--set", "train.shuffle_buffer=64"]


def test_training_on_two_nodes_steps_as_two_workers_on_one_node(cluster, tiny_groups, tiny_model_dir, s3_server,
                                                                tmp_path):
    """Issue 40 item 2: ``deploy/submit.sh train`` on the two-node cluster with ``scaling.placement=STRICT_SPREAD``,
    groups read from and checkpoints written to the test S3 server. ``train_manifest.json`` records a worker on each
    node. Against the same command with its 2 workers on one node (a local Ray of 2 CPUs, local folders): the same
    batch digests at every step (the same groups), step 1's terms over the whole global batch (L_xp, uniformity,
    retention, p+) within 1e-5, every step's loss within 1%. Not closer: which groups of a global batch each rank
    gets is Ray Data's streaming split's choice, made anew in every run (two runs on one node differ as much), and
    the masked terms are means over each rank's own groups."""
    import subprocess

    from tests.conftest import Out

    head, _, _ = cluster
    o = Out(f"s3://pairmine-test/two-node-train-{time.time_ns()}", s3_server.endpoint)
    for f in Path(tiny_groups).rglob("*"):  # the committed mining run, uploaded as-is
        if f.is_file():
            o.storage.write_bytes(o.path("runs", "tiny", str(f.relative_to(tiny_groups))), f.read_bytes())
    t0 = time.time()
    proc = subprocess.run(["bash", str(REPO / "deploy" / "submit.sh"), "train", "--groups", o.path("runs", "tiny"),
                           "--output", o.path("train"), "--model", tiny_model_dir, *TWO_NODE_TRAIN,
                           "--set", "scaling.placement=STRICT_SPREAD",
                           "--set", f"storage.endpoint_url={s3_server.endpoint}"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_ADDRESS": head.dashboard_url, "PATH": venv_path()})
    two_nodes_s = time.time() - t0
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    manifest = o.json("train", "train_manifest.json")
    workers = manifest["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert len({w["node_id"] for w in workers}) == 2 and manifest["resolved"]["nodes"] == 2
    assert manifest["resolved"]["ray"].endswith("(2 node(s), 2 CPUs, 0 GPUs)")
    assert sum(n.startswith("checkpoint_") for n in o.names("train", "ray-train")) >= 1
    spread = [json.loads(x) for x in o.storage.read_bytes(o.path("train", "metrics.jsonl")).decode().splitlines()]

    t0 = time.time()
    local = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "train", "--groups", str(tiny_groups),
                            "--output", str(tmp_path / "train"), "--model", tiny_model_dir, *TWO_NODE_TRAIN,
                            "--set", "ray.num_cpus=2"],
                           capture_output=True, text=True, timeout=900,
                           env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    one_node_s = time.time() - t0
    assert local.returncode == 0, local.stderr[-4000:]
    packed = json.loads((tmp_path / "train" / "train_manifest.json").read_text())
    assert len({w["node_id"] for w in packed["workers"]}) == 1
    packed_metrics = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    print(f"\ntraining, 2 workers, 4 steps: on two nodes (submit.sh, S3) {two_nodes_s:.1f} s, on one node "
          f"(local) {one_node_s:.1f} s")
    assert [m["step"] for m in spread] == [m["step"] for m in packed_metrics] == [1, 2, 3, 4]
    assert [m["batch"] for m in spread] == [m["batch"] for m in packed_metrics]
    for a, b in zip(spread, packed_metrics):
        assert sorted(a) == sorted(b) and "loss" in a, (a, b)
        assert abs(a["loss"] - b["loss"]) <= 0.01 * abs(b["loss"]), (a, b)
        assert a["lr"] == b["lr"] and a["groups"] == b["groups"] and a["start_step"] == b["start_step"]
    for k in ("l_xp", "l_unif", "l_retention", "p_positive"):  # before any update, over the whole global batch
        assert abs(spread[0][k] - packed_metrics[0][k]) <= 1e-5, (k, spread[0], packed_metrics[0])


@pytest.mark.slow  # ~3 min on CI; the submitted two-node job stays in the default run
def test_a_lost_worker_node_ends_with_an_error_and_the_run_id_resumes(cluster, ray_local, tiny_run, tiny_model_dir,
                                                                      sample_dir, tmp_path):
    """The worker node's raylet is SIGKILLed in the main pass. The stage plan asked for both nodes' CPUs, so the
    remaining node cannot place the work: the job reports what Ray cannot place and ends after ray.stall_limit_s
    with one error line. The same command with the same --run-id, on the one node left, completes with exactly the
    groups of an uninterrupted run."""
    import os
    import signal

    import psutil

    head, worker, client = cluster
    args = tiny_run_args(tiny_model_dir, sample_dir, tmp_path / "cluster", "lost")
    job = submit(client, [*args, "--set", "ray.stall_warn_s=5", "--set", "ray.stall_limit_s=60"])
    wait_for(lambda: "mining 1 shard(s)" in client.get_job_logs(job), 300, "the main pass did not start")
    raylets = [p for p in map(psutil.Process, worker.pids()) if p.name() == "raylet"]
    assert len(raylets) == 1
    os.kill(raylets[0].pid, signal.SIGKILL)
    t_kill = time.time()
    status, logs = run_job(client, [], job=job)
    print(f"\nworker raylet killed; the job ended {time.time() - t_kill:.0f} s later with {status}")
    assert status == "FAILED", logs[-3000:]
    error = [line for line in logs.splitlines() if line.startswith("pairmine: error:")]
    assert len(error) == 1 and error[0].startswith("pairmine: error: stalled: nothing completed for"), logs[-3000:]
    assert "--run-id lost" in error[0]
    print(error[0])

    t0 = time.time()
    status, logs = run_job(client, args)  # the same command, the same run id, one node left
    assert status == "SUCCEEDED", logs[-4000:]
    print(f"resumed on one node in {time.time() - t0:.1f} s")
    manifest = json.loads((tmp_path / "cluster" / "lost" / "manifest.json").read_text())
    assert manifest["resolved"]["ray"].endswith("(1 node(s), 1 CPUs, 0 GPUs)")
    assert manifest["resolved"]["stage_plan"].endswith("(CPU shares scaled down to fit)")
    lost = pq.read_table(tmp_path / "cluster" / "lost" / "groups").drop_columns(["run_id"])
    assert_same_groups(lost, tiny_run_groups(tiny_run))  # none lost, none duplicated, the same scores


@pytest.mark.slow  # its own two-node cluster, two training runs: ~4 minutes on 2 cores
def test_a_node_lost_during_training_ends_with_one_error_line_and_the_same_command_resumes(tiny_groups,
                                                                                          tiny_model_dir, tmp_path):
    """Issue 40 item 3: 2 workers on a two-node cluster (SPREAD: one on each node); the worker
    node's raylet is SIGKILLed between the checkpoints of steps 6 and 12. With checkpoint.max_failures = 0 (the
    default) the run ends with one ``pairmine: error:`` line naming the lost worker's rank and node and the
    checkpoint to resume from; the same command on the node left resumes from it and trains every step once, the
    steps both attempts trained on the same groups, no two steps on the same groups."""
    import signal
    import subprocess

    import psutil

    steps, every = 24, 6
    out = tmp_path / "train"
    head = RayNode(num_cpus=1, log_dir=tmp_path, dashboard=True).start()
    worker = None
    try:
        wait_for(lambda: len(list_nodes_alive(head)) == 1, 300, "the head node did not register")
        worker = RayNode(num_cpus=1, address=head.address, log_dir=tmp_path).start()
        nodes = wait_for(lambda: len(n := list_nodes_alive(head)) == 2 and n, 300, "the worker node did not join")
        worker_node = next(n.node_id for n in nodes if not n.is_head_node)
        cmd = [sys.executable, "-m", "pairmine.pipeline.cli", "train", "--groups", str(tiny_groups), "--output",
               str(out), "--model", tiny_model_dir, *TWO_NODE_TRAIN, "--set", f"train.max_steps={steps}",
               "--set", f"checkpoint.every_steps={every}", "--set", "scaling.placement=SPREAD",
               "--set", f"ray.address={head.address}"]
        log_path = tmp_path / "first.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        metrics = lambda: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
        try:
            def between_checkpoints():
                if proc.poll() is not None:
                    raise RuntimeError("the run ended before its node was lost: " + log_path.read_text()[-3000:])
                return (out / "ray-train" / "checkpoint_step_00000006").exists() and len(metrics()) > every

            wait_for(between_checkpoints, 600, "step 7 not reached")
            raylets = [p for p in map(psutil.Process, worker.pids()) if p.name() == "raylet"]
            assert len(raylets) == 1
            os.kill(raylets[0].pid, signal.SIGKILL)
            t_kill, killed_at = time.time(), len(metrics())
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = log_path.read_text()
        print(f"\nworker node's raylet killed after step {killed_at}; the run ended {time.time() - t_kill:.0f} s "
              f"later with exit code {proc.returncode}")
        assert proc.returncode == 2, text[-4000:]
        # The workers' and Ray Train's controller's own logs ("(RayTrainWorker pid=...)" lines) carry their
        # tracebacks, and Ray's log monitor prints the dead raylet's last lines; the driver's output has none.
        lines = text.splitlines()
        errors = [ln for ln in lines if ln.startswith("pairmine: error:")]
        assert len(errors) == 1, text[-4000:]
        assert not [ln for ln in lines if ln.startswith("Traceback")], text[-4000:]
        print(errors[0])
        lost = [w for w in json.loads((out / "train_manifest.json").read_text())["workers"]
                if w["node_id"] == worker_node]
        assert len(lost) == 1
        assert errors[0].startswith(f"pairmine: error: training worker rank {lost[0]['rank']} (node "
                                    f"{worker_node[:8]} at {lost[0]['node_ip']}, pid {lost[0]['pid']}) was lost ("), errors[0]
        assert "the latest checkpoint is step " in errors[0] and "the same command with the same --output resumes " \
            "from it, on the nodes that are left" in errors[0]
        start = int(errors[0].split("the latest checkpoint is step ")[1].split()[0])
        assert start >= every and start % every == 0
        first = metrics()
        # Until Ray's health check marks the node dead (~30 s), it still counts its CPUs: the workers' share would be
        # sized for two nodes and wait for the one that is gone.
        wait_for(lambda: len(list_nodes_alive(head)) == 1, 300, "the lost node still counted")

        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)  # the same command, one node left
        print(f"resumed on the node left in {time.time() - t0:.1f} s")
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"resumed from checkpoint at step {start} of {steps}" in proc.stdout + proc.stderr
    finally:
        if worker is not None:
            worker.stop()
        head.stop()
    rows = metrics()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step lost, none twice
    assert rows[:start] == first[:start]
    assert len({r["batch"] for r in rows}) == steps
    manifest = json.loads((out / "train_manifest.json").read_text())
    assert manifest["resolved"]["nodes"] == 1 and len(manifest["workers"]) == 2
    if [r["batch"] for r in rows[start:len(first)]] != [r["batch"] for r in first[start:]]:
        # Open (seen 2026-12-08): resumed on one node after training on two, step 7 trained other groups than
        # the first attempt's step 7 (on one node a resume keeps them: test_train.py's kill test), so the
        # batches skipped on resume are not exactly the groups steps 1-6 trained.
        pytest.xfail("the steps both attempts trained differ in their groups after the layout changed from two "
                     "nodes to one (exactly-once across a layout change is open)")


@pytest.mark.slow  # its own two-node cluster and a negatives run: ~3 minutes on 2 cores
def test_index_shards_are_placed_on_the_nodes_where_they_fit(tiny_run, tmp_path):
    """``pairmine negatives`` with two index shards on a two-node cluster whose nodes each offer memory for one
    shard's search actor (each reserves twice its shard's bytes, ~1 MB here; a node offers 1.6 MB): Ray places one
    shard on each node, and the negatives are those of the same command on one index, locally."""
    import subprocess

    from ray.util.state import list_actors

    run_dir, _ = tiny_run
    head = RayNode(num_cpus=1, log_dir=tmp_path, dashboard=True, memory=1_600_000).start()
    worker = None
    try:
        wait_for(lambda: len(list_nodes_alive(head)) == 1, 300, "the head node did not register")
        worker = RayNode(num_cpus=1, address=head.address, log_dir=tmp_path, memory=1_600_000).start()
        wait_for(lambda: len(list_nodes_alive(head)) == 2, 300, "the worker node did not join")
        cli = [sys.executable, "-m", "pairmine.pipeline.cli", "negatives", "--input", str(run_dir), "--corpus",
               str(run_dir), "--output", str(tmp_path)]
        proc = subprocess.run([*cli, "--run-id", "sharded", "--set", "negatives.index_shards=2", "--set",
                               f"ray.address={head.address}"], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        shards = [a for a in list_actors(address=head.dashboard_url, detail=True, limit=1000)
                  if "Search_Shard" in a.class_name]
        assert sorted(a.class_name.split("(")[-1].rstrip(")") for a in shards) == ["Search_Shard_0", "Search_Shard_1"]
        assert len({a.node_id for a in shards}) == 2, [(a.class_name, a.node_id) for a in shards]
    finally:
        if worker is not None:
            worker.stop()
        head.stop()
    stats = json.loads((tmp_path / "sharded" / "stats.json").read_text())
    assert stats["index"].startswith("exact (faiss IndexFlatIP), 2 shards of ") and stats["reconciled"]
    proc = subprocess.run([*cli, "--run-id", "one", "--set", "negatives.index_shards=1"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = pq.read_table(tmp_path / "sharded" / "negatives").to_pylist()
    one = pq.read_table(tmp_path / "one" / "negatives").to_pylist()
    # Near-ties of the tiny model's cosines may swap (see test_negatives' sharded test): the scores at every kept
    # place agree, and almost every row is identical.
    assert [r["pair_id"] for r in sharded] == [r["pair_id"] for r in one]
    same = 0
    for a, b in zip(sharded, one):
        assert np.allclose(a["negative_scores"], b["negative_scores"], atol=1e-5)
        same += (a["negatives"], a["negative_ranks"]) == (b["negatives"], b["negative_ranks"])
    assert same >= 0.98 * len(one), (same, len(one))


def list_nodes_alive(head) -> list:
    from ray.util.state import list_nodes

    return [n for n in list_nodes(address=head.dashboard_url) if n.state == "ALIVE"]
