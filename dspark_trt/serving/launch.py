"""`dspark-trt serve` in a subprocess on a free 127.0.0.1 port (used by `bench` and the tests).

Starts the server, waits until `/health` answers, and stops it with SIGTERM (the graceful path
users get), killing it only if it does not exit within a minute. Output goes to a log file, never
to an unread pipe that could fill and stall the server.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dspark_trt.errors import DsparkError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, args: list[str], log_path: Path | None = None, env: dict | None = None,
                 timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="dspark-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        command = [sys.executable, "-m", "dspark_trt.cli", "serve", *args, "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                self._log.close()
                raise DsparkError(f"the server exited with status {self.process.returncode}: "
                                  f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise DsparkError(f"the server did not become healthy within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
