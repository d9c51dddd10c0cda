"""A real `dspark-trt serve` subprocess for the server and bench tests, with a metrics reader."""

from __future__ import annotations

import os

import httpx

from dspark_trt.serving.launch import ServeProcess


class ServerProcess(ServeProcess):
    def __init__(self, *args: str):
        # One BLAS thread: the server shares the 2-core test machine with the test process.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        super().__init__([*args, "--log-level", "warning"], env=env, timeout=180)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
