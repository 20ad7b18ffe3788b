"""Which Ray pairmine uses (issue 14, item 7): a ``ray start`` cluster running on the machine is joined only when
asked for, by ``ray.address`` or ``$RAY_ADDRESS``; otherwise pairmine starts a private local Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.raycluster import RayNode

PROBE = ("import ray, sys; from pairmine.pipeline.ray_adapter import init_ray; "
         "where = init_ray(*sys.argv[1:]); print(where); print(ray.get_runtime_context().gcs_address)")


def _run(code: str, *args: str, env_extra: dict | None = None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env_extra or {})
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, gcs = proc.stdout.strip().splitlines()[-2:]
    return where, gcs


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    node = RayNode(num_cpus=1, log_dir=tmp_path_factory.mktemp("ray-head")).start()
    yield node
    node.stop()


def test_a_cluster_on_the_machine_is_joined_only_when_asked(head):
    # The fault: a plain ray.init() joins the latest Ray started on the machine (here, most likely this head).
    # pairmine with no address: a private Ray of its own, and it says so.
    where, gcs = _run(PROBE)
    assert where.startswith("local (") and _port(gcs) != head.port
    # Asked for by $RAY_ADDRESS or by ray.address: that cluster, described truthfully.
    for args, env in (((), {"RAY_ADDRESS": head.address}), ((head.address,), None)):
        where, gcs = _run(PROBE, *args, env_extra=env)
        assert _port(gcs) == head.port  # Ray reports the machine's address for 127.0.0.1
        assert where == f"cluster {gcs} (1 node(s), 1 CPUs, 0 GPUs)"


REUSE = """
import os, sys, time, ray
from pairmine.pipeline.ray_adapter import init_ray
init_ray(num_cpus=1)

@ray.remote(num_cpus=0.25)
def task():
    time.sleep(1)
    return os.getpid()

first = set(ray.get([task.remote() for _ in range(4)]))  # tasks at once: several worker processes on 1 CPU
time.sleep(5)  # all idle, longer than Ray's default 1 s


def alive(pid):  # running, not a zombie left for its parent to reap
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


print(os.environ.get("RAY_idle_worker_killing_time_threshold_ms"))
print(f"{len(first)} workers, {sum(map(alive, first))} alive")
"""


def test_a_private_ray_keeps_idle_task_workers():
    # The fault: Ray ends a task worker after 1 s idle once a node has more workers than CPUs (light tasks take
    # 0.5 CPU, actors hold workers too), so a pipeline whose tasks came seconds apart paid a new worker process
    # (~1 s of CPU) for nearly every task: 18 worker processes in one negatives run on 2 CPUs.
    setting, workers = _run(REUSE)
    n, alive = map(int, workers.replace(" workers,", "").replace(" alive", "").split())
    assert setting == "60000" and n >= 2 and alive == n
    # Ray's default, for contrast: idle workers beyond the node's one CPU were ended.
    setting, workers = _run(REUSE, env_extra={"RAY_idle_worker_killing_time_threshold_ms": "1000"})
    n, alive = map(int, workers.replace(" workers,", "").replace(" alive", "").split())
    assert setting == "1000" and n >= 2 and alive < n


WARM = """
import os, time, psutil, ray
from pairmine.pipeline.ray_adapter import init_ray
init_ray(num_cpus=2)
time.sleep(3)  # the node's own workers start with it
started = {p.pid for p in psutil.Process().children(recursive=True) if p.name() == "ray::IDLE"}  # idle workers

@ray.remote(num_cpus=1)
def task():
    return os.getpid(), os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TOKENIZERS_PARALLELISM")

@ray.remote(num_cpus=1)
class Actor:
    def where(self):
        return os.getpid()

pid, offline, parallel = ray.get(task.remote())
actor = Actor.remote()
print(offline, parallel, len(started), pid in started, ray.get(actor.where.remote()) in started)
"""


def test_a_private_rays_first_task_and_actor_take_the_workers_it_started():
    # The fault: init_ray gave the job a runtime_env (its worker variables), and Ray gives a job with a runtime_env
    # none of the workers a node starts with, which have no such env: every task and actor of a run waited for a new
    # worker process (~1 s of CPU each, on the cores the first embed actor was starting on) while those idled.
    out = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=240,
                         env={k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HF_HUB_OFFLINE",
                                                                                 "TOKENIZERS_PARALLELISM")})
    assert out.returncode == 0, out.stderr[-3000:]
    offline, parallel, started, task_warm, actor_warm = out.stdout.split()
    assert (offline, parallel) == ("1", "false")  # the workers' variables still reach them
    assert int(started) >= 2 and task_warm == actor_warm == "True"


@pytest.mark.parametrize("variable,value,where", [
    ("RAY_JOB_SUBMISSION_ID", "pairmine-mine-7x2kq", "a KubeRay RayJob's submitter pod"),
    ("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}', "a Ray job's driver"),
])
def test_no_private_ray_inside_a_kuberay_submitter_or_a_ray_job(variable, value, where, tiny_model_dir, sample_dir,
                                                                tmp_path):
    # The fault (ray-project/kuberay#3929, #3802): KubeRay runs `ray job submit --no-wait -- <entrypoint> ; ray job
    # logs --follow` in the submitter pod's shell, so `pairmine mine ... && pairmine ...` ran the second command in
    # that pod, where pairmine started a private 1-CPU Ray without a word.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        variable: value, "RAY_DASHBOARD_ADDRESS": "pairmine-head-svc.default.svc.cluster.local:8265"}
    proc = subprocess.run([sys.executable, "-m", "pairmine.pipeline.cli", "mine", "--input",
                           str(sample_dir / "000_00000.parquet"), "--output", str(tmp_path / "runs"), "--run-id", "x",
                           "--set", f"embed.model={tiny_model_dir}"], env=env, capture_output=True, text=True,
                          timeout=240)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith(f"pairmine: error: no Ray address is set and this process runs in {where} "
                                f"(${variable} is set)")
    assert "--ray-address local" in lines[-1] and not (tmp_path / "runs" / "x").exists()
    # Asked for, a private Ray starts there as anywhere else.
    where, _ = _run(PROBE, "local", env_extra={variable: value})
    assert where.startswith("local (")
