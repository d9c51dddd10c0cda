"""The data dspark-trt ships with: the default DSpark drafter, the default build configs and the
prompt sets. Every lookup of them goes through this module.

| name      | what                          | in the repository                          | in a wheel                      |
| --------- | ----------------------------- | ------------------------------------------ | ------------------------------- |
| `drafter` | the default DSpark drafter    | `checkpoints/smollm2-135m-instruct/dspark/` | `dspark_trt/_data/drafter/`     |
| `configs` | the named build configs       | `configs/`                                 | `dspark_trt/_data/configs/`     |
| `prompts` | the prompt sets (no `train/`) | `data/`                                    | `dspark_trt/_data/prompts/`     |

pyproject.toml maps each repository folder onto a data sub-package (`package-dir`), so a wheel
carries a copy as package data, found here through `importlib.resources`. An editable install
(`pip install -e .`) has no such copy, and setuptools' editable finder does not expose a folder
without an `__init__.py` under a mapped name, so in a checkout the same names resolve to the
repository's own folders (recognised by the dspark-trt `pyproject.toml` beside the package).
The table above and pyproject.toml must agree; tests/test_wheel.py checks that they do.

`locate(name)` never raises (module-level constants use it); `find(name)` raises
`ResourceNotFoundError` naming the resource and the folders it looked in.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from dspark_trt.errors import DsparkError

PACKAGE = "dspark_trt"
PACKAGED = "_data"  # the package's sub-folder that holds the bundled copies in a wheel


@dataclass(frozen=True)
class Resource:
    name: str  # its folder under dspark_trt/_data/ in a wheel, and the key of RESOURCES
    what: str  # for error messages
    checkout: str  # its folder in the repository, relative to the repository root


RESOURCES = {
    "drafter": Resource("drafter", "the default DSpark drafter", "checkpoints/smollm2-135m-instruct/dspark"),
    "configs": Resource("configs", "the named build configs", "configs"),
    "prompts": Resource("prompts", "the prompt sets", "data"),
}


class ResourceNotFoundError(DsparkError):
    """A bundled resource (drafter, configs, prompt sets) is missing from this install."""

    def __init__(self, name: str, paths: list[Path]):
        super().__init__(missing_message(name, paths))
        self.resource = name
        self.paths = paths


def _resource(name: str) -> Resource:
    try:
        return RESOURCES[name]
    except KeyError:
        raise DsparkError(f"unknown bundled resource {name!r}: give one of {', '.join(RESOURCES)}") from None


def package_root() -> Path:
    """The installed `dspark_trt` package folder."""
    root = files(PACKAGE)
    return root if isinstance(root, Path) else Path(str(root))


def checkout_root() -> Path | None:
    """The repository root when dspark_trt runs from a checkout (editable install), else None."""
    root = package_root().parent
    try:
        pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "dspark-trt"' in pyproject else None


def candidates(name: str) -> list[Path]:
    """Where resource `name` may be, in order: the wheel's package data, then the checkout's folder."""
    resource = _resource(name)
    paths = [package_root() / PACKAGED / resource.name]
    checkout = checkout_root()
    if checkout is not None:
        paths.append(checkout / resource.checkout)
    return paths


def locate(name: str) -> Path:
    """The folder of resource `name`: the first candidate that exists, else the first candidate
    (so a missing resource fails where it is used, with that path in the message)."""
    paths = candidates(name)
    return next((p for p in paths if p.is_dir()), paths[0])


def find(name: str) -> Path:
    """The folder of resource `name`; `ResourceNotFoundError` when this install lacks it."""
    paths = candidates(name)
    for path in paths:
        if path.is_dir():
            return path
    raise ResourceNotFoundError(name, paths)


def missing_message(name: str, paths: Path | list[Path]) -> str:
    """What to tell a user whose install lacks resource `name` (looked for at `paths`)."""
    resource = _resource(name)
    paths = [paths] if isinstance(paths, Path) else paths
    looked = " or ".join(str(p) for p in paths)
    return (f"{resource.what} (bundled resource {name!r}) not found: no folder {looked}; this dspark-trt "
            f"install lacks its package data: reinstall it from a wheel built from the repository, or "
            f"`pip install -e .` in a checkout")
