"""Compile a kernel source once: `built(source, command, prefix, suffix, compiler)` runs
`command + ["-o", output]` the first time a (source text, compiler version, command) is seen and
returns the cached output after that, under `$DSPARK_TRT_CACHE/kernels`. Written atomically (built
in a temporary folder beside it, then renamed), so concurrent processes never load a half-written
file. Our CPU kernels (`cpu_kernels.py`) and the SequentialDraft plugin's CUDA kernel
(`plugins/sequential_draft_kernel.py`) are built through it. It runs compilers and nothing else.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from dspark_trt.cache import cache_root


class CompileError(RuntimeError):
    """The compiler failed (its stderr's tail is the message)."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


def built(source: Path, command: list[str], prefix: str, suffix: str, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256((source.read_text() + version + " ".join(command)).encode()).hexdigest()[:16]
    output = cache_dir() / f"{prefix}-{key}{suffix}"
    if output.is_file():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as staging:
        target = Path(staging) / output.name
        result = subprocess.run([*command, "-o", str(target)], capture_output=True, text=True)
        if result.returncode != 0:
            raise CompileError(f"{Path(compiler).name} failed on {source.name}: {result.stderr.strip()[-600:]}")
        os.replace(target, output)
    return output
