"""Real Ray nodes for the tests, started with ``ray start --block`` on 127.0.0.1 and stopped by PID.

Only what a node started is stopped, by PID (Ray's own stop command would end every Ray process on the machine,
other people's included): each node runs in its own session (process group), and :meth:`RayNode.stop` signals
exactly the processes that node started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.s3server import free_port

RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # where `ray start` records the latest cluster's address


def ray_binary() -> str:
    found = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    if not Path(found).exists():
        raise RuntimeError("the ray command is missing (it comes with the ray package)")
    return found


def venv_path() -> str:
    """$PATH with this Python's bin folder first (``ray``, ``pairmine``), as in an activated venv."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


class RayNode:
    """One Ray node: a head (``address=None``) or a worker joining ``address``.

    Args:
        num_cpus: CPUs the node offers.
        address: the head's ``127.0.0.1:port`` for a worker node; None starts a head.
        log_dir: where the node's ``ray start`` output goes.
    """

    def __init__(self, num_cpus: int = 1, address: str | None = None, log_dir: Path | None = None,
                 dashboard: bool = False, memory: int = 0):
        self.num_cpus, self.head_address, self.dashboard, self.memory = num_cpus, address, dashboard, memory
        self.port = free_port() if address is None else None
        self.address = address or f"127.0.0.1:{self.port}"
        self.dashboard_port = free_port() if dashboard and address is None else None
        self.log_dir = Path(log_dir or "/tmp")
        self.proc: subprocess.Popen | None = None

    @property
    def dashboard_url(self) -> str:
        """The head's dashboard (and job server) address, for ``JobSubmissionClient``."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 90.0) -> "RayNode":
        cmd = [ray_binary(), "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}",
               "--num-gpus=0", "--disable-usage-stats"]
        if self.memory:  # the node's "memory" resource, in bytes (what tasks and actors may reserve)
            cmd.append(f"--memory={self.memory}")
        # Every port of its own, so that several nodes (and other Rays) live side by side on one machine.
        for flag in ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"):
            cmd.append(f"--{flag}={free_port()}")
        if self.head_address is None:
            cmd += ["--head", f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}"]
            cmd += [f"--include-dashboard={'true' if self.dashboard else 'false'}"]
            if self.dashboard:
                cmd.append(f"--dashboard-port={self.dashboard_port}")
        else:
            cmd += [f"--address={self.head_address}"]
        log = open(self.log_dir / f"ray-node-{os.getpid()}-{time.time_ns()}.log", "ab")
        # RAY_ADDRESS names this cluster in every process of the node: Ray Train's PlacementGroupCleaner actor
        # asks the state API without an address, which otherwise picks "the latest cluster" of the machine,
        # another test's or another user's Ray ("Found multiple active Ray instances", logged every second).
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": self.head_address or self.address}
        # A job's entrypoint runs in a shell with the node's environment: `pairmine` (deploy/submit.sh's command) is
        # on PATH there as on a cluster node with pairmine installed, even when the tests run without an activated venv.
        env["PATH"] = venv_path()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if self.head_address is None:
            deadline = time.time() + timeout
            while not self._gcs_answers():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {self.proc.returncode}; see {log.name}")
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"the Ray head did not answer on {self.address} within {timeout} s")
                time.sleep(0.3)
        return self

    def _gcs_answers(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def pids(self) -> list[int]:
        """PIDs of ``ray start`` and every process under it (GCS, raylet, workers...)."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [self.proc.pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the node's process group, SIGKILL what is left after ``timeout`` s (by the PIDs recorded before),
        and remove Ray's "latest cluster" file when it names this head (else a plain ``ray.init()`` on the machine
        would try to join a dead cluster)."""
        if self.proc is None:
            return
        pids = self.pids()
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for pid in pids:
                if sig == signal.SIGKILL:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.time() + wait
            while time.time() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)
            if not any(_alive(p) for p in pids):
                break
        self.proc.wait(timeout=10)
        if self.head_address is None:
            try:
                if RAY_ADDRESS_FILE.read_text().strip().endswith(f":{self.port}"):  # Ray writes the machine's IP
                    RAY_ADDRESS_FILE.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
