"""Write a Triton model repository that serves a dspark-trt model.

    REPO/NAME/config.pbtxt     decoupled Python-backend model, TensorRT-LLM-style inputs/outputs,
                               parameters naming the engine directory (or target/drafter/policy)
    REPO/NAME/1/model.py       a copy of dspark_trt/triton/model.py

The repository holds no weights: the parameters name the engine directory, target and drafter by
absolute path, so they must exist at the same paths where Triton runs (mount them there in a
container). The model folder is written next to its final place and renamed into it, so a
crash never leaves a half-written model that Triton would try to load. Checks paths and
settings before writing; loads no model.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.triton.model_config import check_model_config, render_model_config
from dspark_trt.triton.settings import DeploySettings

MODEL_FILE = Path(__file__).with_name("model.py")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def instance_kind_for(engine_dir: str | Path | None, kind: str) -> str:
    """`auto`: gpu for an engine directory built for TensorRT (its engines run on a GPU), else cpu."""
    if kind != "auto":
        return kind
    if engine_dir is None:
        return "cpu"
    from dspark_trt.runtime.engine_dir import open_engine_dir

    return "gpu" if open_engine_dir(engine_dir, check_device=False).backend == "tensorrt" else "cpu"


def resolve_settings(engine_dir: str | Path | None, target: str | None, drafter: str | None,
                     policy: str | None, **options) -> DeploySettings:
    """Check the user's choices and make every path absolute."""
    if engine_dir is not None and (target is not None or drafter is not None):
        raise DsparkError("give an ENGINE_DIR or --target/--drafter, not both (the engine directory names them)")
    if policy:
        from dspark_trt.runtime.verify_policy import make_policy

        make_policy(policy)  # raises naming the policy
    if engine_dir is not None:
        from dspark_trt.runtime.engine_dir import open_engine_dir

        # The device is checked where the model runs (Triton's host), not here.
        engine = open_engine_dir(engine_dir, check_device=False)
        return DeploySettings(engine_dir=str(engine.path), policy=policy or "", **options)

    def absolute(spec: str, what: str) -> str:
        if spec == "default":
            return spec
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise DsparkError(f"{what} {spec!r} does not exist")
        return str(path)

    return DeploySettings(target=absolute(target or "default", "--target"),
                          drafter=absolute(drafter, "--drafter") if drafter else "", policy=policy or "", **options)


def write_repository(repo: str | Path, settings: DeploySettings, model_name: str = "dspark", instances: int = 1,
                     instance_kind: str = "cpu", overwrite: bool = False, execution_env: str | Path | None = None) -> Path:
    """Write REPO/NAME (see the module docstring); return the model folder. `execution_env`: the
    Python backend's EXECUTION_ENV_PATH (a conda-pack archive or an unpacked environment folder
    with `bin/activate`) the model runs in."""
    if not NAME_PATTERN.fullmatch(model_name):
        raise DsparkError(f"--model-name {model_name!r}: use letters, digits, '_', '.' and '-' (a folder name)")
    if instances < 1:
        raise DsparkError(f"--instances must be >= 1, got {instances}")
    repo = Path(repo).expanduser().resolve()
    final = repo / model_name
    if final.exists() and not overwrite:
        raise DsparkError(f"{final} already exists (give --overwrite to replace it)")
    parameters = settings.parameters()
    if execution_env is not None:
        env = Path(execution_env).expanduser().resolve()
        if not (env.is_file() or (env / "bin" / "activate").is_file()):
            raise DsparkError(f"--execution-env {execution_env}: not a conda-pack archive nor an environment folder "
                              "with bin/activate")
        parameters["EXECUTION_ENV_PATH"] = str(env)
    text = render_model_config(model_name, parameters, instances, instance_kind)
    check_model_config(text)
    repo.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_name}.", dir=repo))  # same filesystem: rename is atomic
    try:
        (staging / "config.pbtxt").write_text(text)
        (staging / "1").mkdir()
        shutil.copyfile(MODEL_FILE, staging / "1" / "model.py")
        staging.chmod(0o755)  # mkdtemp makes it 0700; the server may run as another user
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
