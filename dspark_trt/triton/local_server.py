"""Run the `tritonserver` that the `nvidia-pytriton` wheel ships, on a model repository (CPU hosts, CI).

    python -m dspark_trt.triton.local_server --model-repository REPO [--http-port 8000 ...]

On a GPU host use the official Triton container instead (docs/triton.md). The wheel ships the
server, the Python backend and one backend "stub" per Python version, but does not arrange them
the way a bare `tritonserver` expects; this module does what pytriton does for its own models:
- a backend folder (cached) with the Python backend and the stub built for this interpreter;
- `LD_LIBRARY_PATH` with the wheel's bundled libraries and this interpreter's libpython;
- a Python environment for the model: the stub embeds Python and finds its environment through
  the first `python3` on `PATH`. It needs numpy < 2 (with numpy 2 it fails on string tensors),
  so when this environment has numpy 2 the model runs in a small cached overlay venv that holds
  numpy < 2 and sees this environment's packages (torch, dspark_trt) behind it.

It does not write repositories (`writer.py`) and starts nothing on import.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dspark_trt.errors import DsparkError

NUMPY_FOR_STUB = "numpy<2"
INSTALL_HINT = "pip install --no-deps nvidia-pytriton  (it ships tritonserver and the Python backend)"


@dataclass
class TritonDist:
    server: Path  # the tritonserver binary
    backends: Path  # backends/ (python/libtriton_python.so, triton_python_backend_utils.py)
    stub: Path  # triton_python_backend_stub for this Python version
    libs: Path  # the wheel's bundled shared libraries
    version: str


def find_triton() -> TritonDist:
    """Locate the server inside the installed `nvidia-pytriton` wheel (without importing pytriton)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise DsparkError(f"tritonserver not found: {INSTALL_HINT}")
    root = Path(next(iter(spec.submodule_search_locations)))
    dist = root / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = TritonDist(dist / "bin" / "tritonserver", dist / "backends",
                       dist / "python_backend_stubs" / python / "triton_python_backend_stub",
                       root.parent / "nvidia_pytriton.libs", importlib.metadata.version("nvidia-pytriton"))
    if not found.server.is_file():
        raise DsparkError(f"{found.server} is missing: reinstall it ({INSTALL_HINT})")
    if not found.stub.is_file():
        raise DsparkError(f"nvidia-pytriton {found.version} has no Python backend stub for Python {python}")
    return found


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_TRT_CACHE", Path.home() / ".cache" / "dspark-trt")) / "triton"


def _build_once(final: Path, build) -> Path:
    """Build into a temporary folder and rename it into place, so a crash never leaves half of it."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging)
        try:
            staging.rename(final)
        except OSError:  # another process built it first
            if not final.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def backend_dir(triton: TritonDist) -> Path:
    """A backends/ folder with the stub for this Python where the Python backend looks for it."""
    key = f"backends-{triton.version}-py{sys.version_info.major}.{sys.version_info.minor}"

    def build(folder: Path) -> None:
        shutil.copytree(triton.backends, folder, dirs_exist_ok=True)
        shutil.copy2(triton.stub, folder / "python" / "triton_python_backend_stub")

    return _build_once(cache_dir() / key, build)


def _numpy_major() -> int:
    try:
        return int(importlib.metadata.version("numpy").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def model_env() -> Path:
    """A folder whose `bin/python3` is the model's Python: this environment, or an overlay with numpy < 2."""
    here = Path(sys.prefix)
    if _numpy_major() < 2 and (here / "bin" / "python3").exists():
        return here
    paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
    key = hashlib.sha256("\n".join([sys.executable, *paths]).encode()).hexdigest()[:12]

    def build(folder: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        python = folder / "bin" / "python3"
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", NUMPY_FOR_STUB],
                       check=True)
        # After the overlay's own site-packages, so its numpy wins; addsitedir also runs the
        # .pth files there (editable installs such as dspark_trt's).
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in paths)
        (Path(purelib) / "zz_dspark_trt_base_env.pth").write_text(lines)

    try:
        return _build_once(cache_dir() / f"model-env-{key}", build)
    except subprocess.CalledProcessError as exc:
        raise DsparkError(f"could not build the Triton model environment ({' '.join(map(str, exc.cmd))} "
                          f"failed); install {NUMPY_FOR_STUB!r} in this environment instead") from None


def server_env(triton: TritonDist, python_env: Path, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    libs = [str(triton.libs), sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = f"{python_env / 'bin'}:{env.get('PATH', '')}"
    # The model's CPU threads: numpy's BLAS and torch, as in the rest of dspark-trt.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def server_command(triton: TritonDist, repository: Path, http_port: int = 8000, grpc_port: int = 8001,
                   metrics_port: int = 8002, address: str = "127.0.0.1", extra: list[str] | None = None) -> list[str]:
    return [str(triton.server), f"--model-repository={repository}", f"--backend-directory={backend_dir(triton)}",
            f"--http-address={address}", f"--http-port={http_port}", f"--grpc-address={address}",
            f"--grpc-port={grpc_port}", f"--metrics-address={address}", f"--metrics-port={metrics_port}",
            *(extra or [])]


def prepare(repository: str | Path, http_port: int, grpc_port: int, metrics_port: int, address: str = "127.0.0.1",
            extra: list[str] | None = None) -> tuple[list[str], dict]:
    """The tritonserver command line and environment for `repository` (builds the cached parts once)."""
    repository = Path(repository).resolve()
    if not repository.is_dir():
        raise DsparkError(f"model repository {repository} does not exist (write one with `dspark-trt triton`)")
    triton = find_triton()
    command = server_command(triton, repository, http_port, grpc_port, metrics_port, address, extra)
    return command, server_env(triton, model_env())


def start(repository: str | Path, http_port: int, grpc_port: int, metrics_port: int, address: str = "127.0.0.1",
          extra: list[str] | None = None, **popen) -> subprocess.Popen:
    """Start tritonserver on `repository` (returns at once; poll /v2/health/ready)."""
    command, env = prepare(repository, http_port, grpc_port, metrics_port, address, extra)
    return subprocess.Popen(command, env=env, **popen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_trt.triton.local_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", required=True, type=Path)
    parser.add_argument("--address", default="127.0.0.1", help="address of all endpoints (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args, extra = parser.parse_known_args(argv)  # anything else goes to tritonserver as is
    try:
        command, env = prepare(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                               args.address, extra)
    except DsparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.execve(command[0], command, env)  # become the server: signals (Ctrl-C, SIGTERM) reach it directly


if __name__ == "__main__":
    sys.exit(main())
