"""Does a training run still learn? Teacher-forced acceptance along a run, from its log alone.

    python benchmarks/experiments/learning_curve.py \
        --log cpu-11k-rows=checkpoints/smollm2-135m-instruct/runs/dspark/train_log.jsonl \
        --log gpu-2k-rows=benchmarks/results/train_logs/gpu/dspark.jsonl \
        --window 100 --output benchmarks/results/experiments/learning_curve_dspark.json

Reads nothing but `train_log.jsonl` files (no model, no CPU time). For each window of logged
steps: the mean teacher-forced acceptance per draft slot (the chance that rejection sampling at
T=1 accepts slot k when slots 1..k-1 were right, on that step's training batch) and the block
tau those rates imply, 1 + sum_k prod_{j<=k} a_j (whole block verified, slots independent given
their prefix: an estimate of decoding's T=1 tau, which runs lower because decoding's anchors
are harder positions; `anchor_selection.py`). Runs on the same step schedule compare step for
step. A flat tail at a learning rate still well above zero says the recipe, not the step budget,
sets the ceiling; a rise that stops only as the learning rate reaches zero says more steps help.
Writes the windows as JSON and, beside it, a PNG of implied tau by step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def implied_block_tau(acceptance: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: expected tokens per verified block, the bonus token counted."""
    tau, survive = 1.0, 1.0
    for rate in acceptance:
        survive *= rate
        tau += survive
    return tau


def windows(log: list[dict], window: int) -> list[dict]:
    """Mean per-slot acceptance, implied tau and the last learning rate over each `window` steps."""
    out = []
    last_step = max(row["step"] for row in log)
    for start in range(0, last_step, window):
        rows = [row for row in log if start < row["step"] <= start + window]
        if not rows:
            continue
        slots = len(rows[0]["acceptance_per_position"])
        acceptance = [statistics.mean(row["acceptance_per_position"][k] for row in rows) for k in range(slots)]
        out.append({"step": start + window, "num_logged": len(rows), "acceptance_per_position": acceptance,
                    "implied_tau": implied_block_tau(acceptance), "lr": rows[-1]["lr"]})
    return out


def read_log(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"--log {path}: no logged steps")
    return rows


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        ax.plot([p["step"] for p in points], [p["implied_tau"] for p in points], marker="o", label=name)
    ax.set_xlabel("training step (16 sequences x 64 anchors each)")
    ax.set_ylabel("implied block tau at T=1 (training batches)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", action="append", required=True, help="NAME=train_log.jsonl (repeatable)")
    parser.add_argument("--window", type=int, default=100, help="steps per averaged point")
    parser.add_argument("--output", type=Path, default=None, help="JSON file (a PNG is written beside it)")
    args = parser.parse_args()
    if args.window < 1:
        raise SystemExit("--window must be >= 1")

    paths = {}
    for spec in args.log:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--log: expected NAME=FILE, got {spec!r}")
        paths[name] = path
    curves = {name: windows(read_log(Path(path)), args.window) for name, path in paths.items()}
    for name, points in curves.items():
        print(name)
        for p in points:
            slots = " ".join(f"{a:.3f}" for a in p["acceptance_per_position"])
            print(f"  step {p['step']:5d}  {slots}  implied tau {p['implied_tau']:.2f}  lr {p['lr']:.1e}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"window": args.window, "logs": paths,
                                           "curves": curves}, indent=2) + "\n")
        plot(curves, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
