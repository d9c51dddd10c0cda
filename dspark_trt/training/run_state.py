"""A training run's resumable state on disk: an exact copy for this machine, a compact one to commit.

Each checkpoint writes two folders, each `meta.json` (step, elapsed seconds, the samplers'
states, the recipe) plus safetensors shards of at most `MAX_SHARD_BYTES` (the repository keeps
files under 40 MB):

- `state/`: everything, exactly (fp32 weights, both AdamW moments, the batch sampler's
  generator). A run resumed from it continues bit for bit. It is 3x the weights' size (~150 MB
  for the default DSpark drafter), too big to commit at every session: not committed.
- `state-compact/` (`COMPACT`): what the repository keeps, so that a long CPU run continues on
  a fresh machine. The weights are exact; AdamW's moments are shrunk (`compact_moments`): a
  matrix's second moment as its row and column sums (Adafactor's factorisation), its first
  moment dropped. ~1.0x the weights' size. A run resumed from it is not bit-exact: its first
  moments restart at zero (with beta1 = 0.9 they are rebuilt within ~20 steps, so the first
  updates are smaller, never larger) and its second moments start from the rank-1 estimate.

A resume reads the state at the latest step, the exact one where both are at the same step.

Writes are atomic: a new state is written beside the old one and swapped in with renames, so a
crash mid-save leaves the previous state whole (`<folder>.old/` is used if a crash fell between
the two renames). Older runs' single `training_state.pt` is still read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

MAX_SHARD_BYTES = 32 * 2**20  # under the repository's 40 MB per file
EXACT, COMPACT = "state", "state-compact"
# Where a resume looks; among states at the same step, the first here (the exact one).
STATE_FOLDERS = (EXACT, f"{EXACT}.old", COMPACT, f"{COMPACT}.old")


def save_run_state(run_dir: Path, meta: dict, tensors: dict[str, torch.Tensor], folder: str = EXACT) -> None:
    """`meta` must be JSON-serialisable; `tensors` are written in shards to `run_dir/folder`."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=run_dir))
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
        final, old = run_dir / folder, run_dir / f"{folder}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_compact_run_state(run_dir: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The exact state's `meta` and `tensors`, written as the repository's copy (`COMPACT`)."""
    save_run_state(run_dir, {**meta, "moments": "factored"}, compact_moments(tensors), folder=COMPACT)


def _latest_state(run_dir: Path) -> tuple[Path, dict] | None:
    """(folder, meta) of the state a resume reads, or None when the run has none yet: the one at
    the latest step (a stale exact state left on a machine loses to a newer compact one from the
    repository), the first in STATE_FOLDERS' order among equals."""
    found = []
    for order, name in enumerate(STATE_FOLDERS):
        if (Path(run_dir) / name / "meta.json").is_file():
            meta = json.loads((Path(run_dir) / name / "meta.json").read_text())
            found.append((meta["step"], -order, Path(run_dir) / name, meta))
    if not found:
        return None
    *_, folder, meta = max(found, key=lambda entry: entry[:2])
    return folder, meta


def load_run_state(run_dir: Path) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(meta, tensors) of the latest saved state, or None when the run has none yet. From a compact
    state the moments come back expanded (`expand_moments`) and `meta["resumed_from"]` says so."""
    from safetensors.torch import load_file

    latest = _latest_state(run_dir)
    if latest is None:
        return None
    folder, meta = latest
    tensors = {}
    for shard in sorted(folder.glob("tensors-*.safetensors")):
        tensors.update(load_file(shard))
    meta["resumed_from"] = folder.name
    if meta.get("moments") == "factored":
        tensors = expand_moments(tensors)
    return meta, tensors


def run_progress(run_dir: Path) -> dict:
    """What a run's last checkpoint says (`step`, `elapsed`, `num_blocks`, `train_config`, ...); {} if none."""
    run_dir = Path(run_dir)
    latest = _latest_state(run_dir)
    if latest is not None:
        return latest[1]
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


def compact_moments(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with AdamW's moments of every matrix shrunk for the repository (see the module
    docstring): `optimizer.<i>.exp_avg_sq` [R, C] -> `...exp_avg_sq_rows` [R] and
    `...exp_avg_sq_cols` [C] (its row and column sums), `optimizer.<i>.exp_avg` dropped. Vectors'
    moments, the weights and everything else are kept as they are."""
    out = {}
    for name, value in tensors.items():
        is_matrix_moment = name.startswith("optimizer.") and value.dim() == 2
        if is_matrix_moment and name.endswith(".exp_avg_sq"):
            out[f"{name}_rows"], out[f"{name}_cols"] = value.sum(dim=1), value.sum(dim=0)
        elif not (is_matrix_moment and name.endswith(".exp_avg")):
            out[name] = value
    return out


def expand_moments(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `compact_moments`, as far as it goes: each second moment is Adafactor's rank-1
    estimate rows x cols / sum(rows) (exact when the moment was rank 1; it keeps every row's and
    column's sum either way), its first moment zeros."""
    out = {}
    for name, value in tensors.items():
        if name.endswith(".exp_avg_sq_cols"):
            continue
        if name.endswith(".exp_avg_sq_rows"):
            prefix = name[: -len(".exp_avg_sq_rows")]
            rows, cols = value, tensors[f"{prefix}.exp_avg_sq_cols"]
            second = torch.outer(rows, cols) / rows.sum().clamp_min(torch.finfo(rows.dtype).tiny)
            out[f"{prefix}.exp_avg_sq"], out[f"{prefix}.exp_avg"] = second, torch.zeros_like(second)
        else:
            out[name] = value
    return out
