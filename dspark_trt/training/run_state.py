"""A training run's resumable state on disk, in files small enough to commit.

`run_dir/state/` holds `meta.json` (step, elapsed seconds, the samplers' states, the recipe)
and the tensors (drafter weights, AdamW moments, the batch sampler's generator) in safetensors
shards of at most `MAX_SHARD_BYTES` each, so a long CPU run can be committed to the
repository and continued on a fresh machine (the repository keeps files under 40 MB).

Writes are atomic: the new state is written beside the old one and swapped in with renames,
so a crash mid-save leaves the previous state whole (`state.old/` is used if a crash fell
between the two renames). Older runs' single `training_state.pt` is still read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

MAX_SHARD_BYTES = 32 * 2**20  # under the repository's 40 MB per file


def save_run_state(run_dir: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """`meta` must be JSON-serialisable; `tensors` are written in shards."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    staging = Path(tempfile.mkdtemp(prefix=".state-", dir=run_dir))
    try:
        shards, current, size = [], {}, 0
        for name, tensor in tensors.items():
            tensor = tensor.detach().contiguous().cpu()
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > MAX_SHARD_BYTES:
                shards.append(current)
                current, size = {}, 0
            current[name] = tensor
            size += nbytes
        shards.append(current)
        for index, shard in enumerate(shards):
            save_file(shard, staging / f"tensors-{index:05d}.safetensors")
        (staging / "meta.json").write_text(json.dumps(meta))
        final, old = run_dir / "state", run_dir / "state.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_run_state(run_dir: Path) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(meta, tensors) of the latest saved state, or None when the run has none yet."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    for folder in (run_dir / "state", run_dir / "state.old"):
        if (folder / "meta.json").is_file():
            tensors = {}
            for shard in sorted(folder.glob("tensors-*.safetensors")):
                tensors.update(load_file(shard))
            return json.loads((folder / "meta.json").read_text()), tensors
    return None


def run_progress(run_dir: Path) -> dict:
    """What a run's last checkpoint says (`step`, `elapsed`, `num_blocks`, `train_config`, ...); {} if none."""
    run_dir = Path(run_dir)
    for folder in (run_dir / "state", run_dir / "state.old"):
        if (folder / "meta.json").is_file():
            return json.loads((folder / "meta.json").read_text())
    legacy = run_dir / "training_state.pt"  # runs from before `state/`
    if legacy.is_file():
        state = torch.load(legacy, map_location="cpu", weights_only=False)
        return {k: v for k, v in state.items() if k not in ("drafter", "optimizer", "generator", "rng")}
    return {}


def optimizer_to_files(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """An optimizer `state_dict()` -> (JSON-able param groups, tensors named `optimizer.<param>.<key>`)."""
    tensors = {f"optimizer.{index}.{key}": value for index, per_param in state["state"].items()
               for key, value in per_param.items()}
    return {"param_groups": state["param_groups"]}, tensors


def optimizer_from_files(groups: dict, tensors: dict[str, torch.Tensor]) -> dict:
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = value
    return {"state": per_param, "param_groups": groups["param_groups"]}
