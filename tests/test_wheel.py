"""A wheel built from the repository works outside the checkout, and `dspark_trt.resources`
finds the bundled drafter, configs and prompt sets in a wheel and in a checkout alike.

The slow test builds the wheel from a copy of the working tree (setuptools writes build/ and
*.egg-info into the tree it builds), installs it with --no-deps into a fresh venv outside the
checkout, makes this environment's third-party packages importable there through a `.pth` file
that lists their site-packages folders (a path line in a .pth does not process the .pth files
inside that folder, so the checkout's editable finder is not loaded), and runs `dspark-trt
generate --drafter default` from a folder outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

from dspark_trt import resources
from dspark_trt.errors import DsparkError, ModelLoadError
from dspark_trt.training import prompts

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DATA_PACKAGE = f"{resources.PACKAGE}.{resources.PACKAGED}."
WHEEL_LIMIT_MB = 40  # the default drafter (~25 MB) plus the compressed prompt sets and the code
IGNORED_IN_COPY = {".git", ".venv", "build", "dist", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}  # without git


# --- the resources module in this (editable) install -------------------------------------------

def test_resources_resolve_to_the_checkout_folders():
    from dspark_trt.config import CONFIG_DIR, load_build_config
    from dspark_trt.models.drafter_io import DEFAULT_DRAFTER_DIR

    assert resources.checkout_root() == REPO
    for name, resource in resources.RESOURCES.items():
        assert resources.find(name) == resources.locate(name) == REPO / resource.checkout
    assert DEFAULT_DRAFTER_DIR == REPO / "checkpoints" / "smollm2-135m-instruct" / "dspark"
    assert (DEFAULT_DRAFTER_DIR / "model.safetensors").is_file()
    assert CONFIG_DIR == REPO / "configs" and (CONFIG_DIR / "default.yaml").is_file()
    assert load_build_config("default").drafter == "default"
    if not os.environ.get("DSPARK_TRT_DATA"):
        assert prompts.DATA_DIR == REPO / "data"
    assert len(prompts.load_prompts("mt-bench", limit=3)) == 3


def test_resource_table_matches_pyproject():
    """resources.RESOURCES and pyproject's package-dir name the same folders, and the explicit
    package list names every code package (a new sub-package must be added there)."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    mapped = {pkg.removeprefix(DATA_PACKAGE): folder for pkg, folder in setuptools["package-dir"].items()
              if pkg.startswith(DATA_PACKAGE)}
    assert mapped == {name: r.checkout for name, r in resources.RESOURCES.items()}
    for folder in mapped.values():
        assert (REPO / folder).is_dir()
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dspark_trt").rglob("__init__.py")}
    listed = set(setuptools["packages"])
    assert on_disk <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
    assert {p.split(".")[2] for p in listed - on_disk} == set(resources.RESOURCES)
    assert all(p.startswith(DATA_PACKAGE) for p in listed - on_disk)


def test_a_missing_resource_is_a_clear_error(tmp_path, monkeypatch):
    from dspark_trt import config
    from dspark_trt.config import ConfigError
    from dspark_trt.models import drafter_io

    missing = tmp_path / "missing"
    monkeypatch.setattr(resources, "candidates", lambda name: [missing / name])
    with pytest.raises(resources.ResourceNotFoundError, match="bundled resource 'drafter'") as caught:
        resources.find("drafter")
    assert isinstance(caught.value, DsparkError)
    assert caught.value.resource == "drafter" and caught.value.paths == [missing / "drafter"]
    assert str(missing / "drafter") in str(caught.value)
    assert resources.locate("configs") == missing / "configs"
    with pytest.raises(DsparkError, match="unknown bundled resource 'weights'"):
        resources.missing_message("weights", missing)

    monkeypatch.setattr(drafter_io, "DEFAULT_DRAFTER_DIR", missing / "drafter")
    with pytest.raises(ModelLoadError, match=r"drafter 'default': the default DSpark drafter .* not found: no folder"):
        drafter_io.load_drafter("default", target=None)
    monkeypatch.setattr(config, "CONFIG_DIR", missing / "configs")
    with pytest.raises(ConfigError, match=r"'default' is not a file, and the named build configs .*missing/configs"):
        config.load_build_config("default")
    monkeypatch.setattr(prompts, "DATA_DIR", missing / "prompts")
    monkeypatch.setattr(prompts, "DATA_OVERRIDE", None)
    with pytest.raises(DsparkError, match=r"prompt set 'gsm8k': the prompt sets .*missing/prompts"):
        prompts.load_prompts("gsm8k")


def test_a_site_packages_folder_is_not_a_checkout(tmp_path, monkeypatch):
    """Only a dspark-trt pyproject.toml beside the package makes its parent a checkout."""
    package = tmp_path / "site-packages" / "dspark_trt"
    package.mkdir(parents=True)
    (tmp_path / "site-packages" / "configs").mkdir()  # some other distribution's folder
    monkeypatch.setattr(resources, "package_root", lambda: package)
    assert resources.checkout_root() is None
    assert resources.candidates("configs") == [package / "_data" / "configs"]
    (tmp_path / "site-packages" / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert resources.checkout_root() is None


# --- a wheel, installed into a fresh venv outside the checkout ----------------------------------

def working_tree_files() -> list[str]:
    """What a checkout holds: tracked and untracked-but-not-ignored files (no .venv, runs/, build/)."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the usual outputs
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                and not any(part in IGNORED_IN_COPY or part.endswith(".egg-info") for part in p.relative_to(REPO).parts)]
    return [name for name in listed.split("\0") if name]


def copy_working_tree(destination: Path) -> None:
    """The checkout's files, hard-linked where possible (setuptools writes into the tree it builds)."""
    for name in working_tree_files():
        source, target = REPO / name, destination / name
        if not source.is_file():  # deleted in the working tree, not yet in git
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def setuptools_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], check=False, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel with `pip wheel --no-deps` from a copy of the working tree."""
    root = tmp_path_factory.mktemp("wheel")
    source, out = root / "source", root / "dist"
    copy_working_tree(source)
    # This environment's setuptools when it satisfies [build-system]; else pip's isolated build.
    isolation = ["--no-build-isolation"] if setuptools_version() >= (68,) else []
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", source, "-w", out])
    (built,) = out.glob("dspark_trt-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_package_and_only_the_bundled_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "dspark_trt/_data/"
    assert {data + "drafter/" + f for f in ("model.safetensors", "config.json", "calibration.json",
                                             "MODEL_CARD.md")} <= names
    assert {data + "configs/default.yaml", data + "configs/tiny.yaml"} <= names
    sets = [relative for relative, _ in {**prompts.TRAINING_SETS, **prompts.EVALUATION_SETS}.values() if relative]
    for relative in [*sets, *{s.split("/")[0] + "/LICENSE" for s in sets}, "SOURCES.md"]:
        assert data + "prompts/" + relative in names
    assert {"dspark_trt/kernels/cpu_kernels.c", "dspark_trt/plugins/sequential_draft_kernel.cu",
            "dspark_trt/resources.py", "dspark_trt/cli.py"} <= names
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"dspark_trt", wheel.name.split("-py")[0] + ".dist-info"}, top_level  # no tests/, data/
    assert not [n for n in names if "/train/" in n or "eagle3" in n or "mtp1" in n or "dflash" in n
                or "__pycache__" in n or n.endswith(".egg-info")]
    size_mb = wheel.stat().st_size / 2**20
    print(f"\n{wheel.name}: {size_mb:.1f} MiB")
    assert size_mb < WHEEL_LIMIT_MB


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; this environment's third-party packages importable."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env_dir, with_pip=False, symlinks=os.name != "nt")
    python = env_dir / "bin" / "python"
    # Installed before the .pth below exists, so pip sees no other dspark-trt.
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel])
    site_packages = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    outer = list(dict.fromkeys(p for p in sys.path
                               if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()))
    assert outer, sys.path
    (site_packages / "outer_environment.pth").write_text("".join(p + "\n" for p in outer))
    return env_dir


def venv_env() -> dict:
    from dspark_trt.models.loading import cache_root

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DSPARK_TRT_DATA", "VIRTUAL_ENV")}
    env["DSPARK_TRT_CACHE"] = str(cache_root())  # reuse the converted default target
    return env


PROBE = """
import importlib.metadata, json, sys
import dspark_trt
from dspark_trt import resources
from dspark_trt.config import CONFIG_DIR, load_build_config
from dspark_trt.models.drafter_io import DEFAULT_DRAFTER_DIR
from dspark_trt.training.prompts import DATA_DIR, load_prompts
print(json.dumps({
    "package": dspark_trt.__file__,
    "checkout": str(resources.checkout_root()),
    "found": {name: str(resources.find(name)) for name in resources.RESOURCES},
    "constants": [str(DEFAULT_DRAFTER_DIR), str(CONFIG_DIR), str(DATA_DIR)],
    "config_drafter": load_build_config("default").drafter,
    "prompts": {name: len(load_prompts(name, limit=2)) for name in ("gsm8k", "mt-bench", "humaneval", "t0")},
    "distribution": str(importlib.metadata.distribution("dspark-trt").locate_file("")),
    "editable_finder": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()]
                       + [m for m in sys.modules if "__editable__" in m],
}))
"""


@pytest.mark.slow
def test_the_installed_wheel_finds_its_bundled_data(wheel_venv, tmp_path):
    result = run([wheel_venv / "bin" / "python", "-c", PROBE], cwd=tmp_path, env=venv_env())
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    inside = wheel_venv.resolve()
    package = Path(probe["package"]).resolve()
    assert package.is_relative_to(inside) and not package.is_relative_to(REPO), probe
    assert probe["checkout"] == "None" and probe["editable_finder"] == [], probe
    assert Path(probe["distribution"]).resolve().is_relative_to(inside), probe
    for name, folder in probe["found"].items():
        assert Path(folder).resolve() == package.parent / "_data" / name, probe
    assert [Path(p).resolve() for p in probe["constants"]] == [Path(probe["found"][n]).resolve()
                                                              for n in ("drafter", "configs", "prompts")]
    assert probe["config_drafter"] == "default"
    assert probe["prompts"] == {"gsm8k": 2, "mt-bench": 2, "humaneval": 2, "t0": 2}


@pytest.mark.slow
def test_the_installed_wheel_generates_with_the_default_drafter(wheel_venv, tmp_path):
    result = run([wheel_venv / "bin" / "dspark-trt", "generate", "--drafter", "default",
                  "--prompt", "What is the capital of France?", "--max-tokens", "8"],
                 cwd=tmp_path, env=venv_env(), timeout=300)
    assert result.stdout.strip(), result.stderr
