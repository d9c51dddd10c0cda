"""Do the committed drafters fit their training rows better than rows they never saw?

    python benchmarks/experiments/generalization_gap.py --features-dir runs/features --features-dtype float32 \
        --output benchmarks/results/experiments/generalization_gap.json
    # another drafter on the data it trained on (--drafter is repeatable; default: the committed four)
    python benchmarks/experiments/generalization_gap.py --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
        --features-dir ~/.cache/dspark-trt/features-bf16 --drafter NAME=FOLDER --output FILE.json

For each drafter, the teacher-forced acceptance per block slot (the mean of 1 - 0.5 * L1 between
draft and target distributions: the chance that rejection sampling at temperature 1 accepts slot
k when slots 1..k-1 were right, as in the train logs) on two sets of rows from the same data
file: the 5% held out from training (chosen by id; the DSpark calibration set, never trained on)
and as many training rows, with the same number of anchors per row drawn by the same seeded
sampler. A large gap says the drafters memorise their ~2,000 responses and more data is the
lever; no gap says capacity or steps are. Target features missing from `--features-dir` are
computed first (one target pass per row).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

KINDS = ("dspark", "dflash", "eagle3", "mtp1")


def named_drafters(specs: list[str] | None, checkpoints: Path) -> dict[str, Path]:
    """`NAME=FOLDER` specs as {name: folder}; without any, the committed drafter of each kind."""
    if not specs:
        return {kind: checkpoints / kind for kind in KINDS}
    named = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--drafter: expected NAME=FOLDER, got {spec!r}")
        named[name] = Path(folder)
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/train/smollm2-135m-instruct.jsonl"))
    parser.add_argument("--features-dir", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints/smollm2-135m-instruct"),
                        help="where the committed drafters are (used when no --drafter is given)")
    parser.add_argument("--drafter", action="append", default=None,
                        help="NAME=FOLDER (repeatable); default: the committed " + ", ".join(KINDS))
    parser.add_argument("--max-rows", type=int, default=2008,
                        help="only the first N rows of the data file (the ones the committed drafters saw)")
    parser.add_argument("--features-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights of the target that computes missing features (auto: the serving dtype); "
                             "the committed four trained on float32 features")
    parser.add_argument("--anchors", type=int, default=32, help="blocks per row")
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    import dspark_trt  # noqa: F401  (first: it sets torch's thread policy)

    # isort: split
    import torch
    from tqdm import tqdm

    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import ensure_features, features_target, load_sequences, make_batch, read_rows
    from dspark_trt.training.losses import drafter_loss
    from dspark_trt.training.trainer import is_held_out

    rows = read_rows(args.data)[: args.max_rows]
    held_out = [r for r in rows if is_held_out(r["id"])]
    trained = random.Random(args.seed).sample([r for r in rows if not is_held_out(r["id"])], len(held_out))
    target = load_target("default")
    ensure_features(features_target(target, "default", args.features_dtype), held_out + trained, args.features_dir,
                    default_feature_layers(target.config.num_layers))
    sets = {"held_out": load_sequences(held_out, args.features_dir),
            "trained": load_sequences(trained, args.features_dir)}
    final_norm, eps = target.model.final_norm.detach(), target.config.rms_norm_eps

    result: dict = {"data": str(args.data), "rows_per_set": len(held_out), "anchors_per_row": args.anchors,
                    "drafters": {}}
    for drafter_name, folder in named_drafters(args.drafter, args.checkpoints).items():
        drafter = load_drafter(folder, target).float()
        config = drafter.config
        per_set = {}
        for name, sequences in sets.items():
            generator = torch.Generator().manual_seed(args.seed)  # the same anchors for every drafter
            weighted, blocks = [0.0] * config.block_size, [0.0] * config.block_size
            for start in tqdm(range(0, len(sequences), args.rows_per_batch), desc=f"{drafter_name} {name}", leave=False):
                batch = make_batch(sequences[start : start + args.rows_per_batch], args.anchors, config.block_size,
                                   len(config.feature_layers), config.hidden_size, generator)
                with torch.no_grad():
                    terms = drafter_loss(drafter, batch, final_norm, eps)
                counts = batch.valid.sum((0, 1)).tolist()  # supervised blocks per slot
                for k, (rate, count) in enumerate(zip(terms.acceptance_per_position, counts)):
                    weighted[k] += rate * count
                    blocks[k] += count
            per_set[name] = [w / b if b else 0.0 for w, b in zip(weighted, blocks)]
        gap = [t - h for t, h in zip(per_set["trained"], per_set["held_out"])]
        result["drafters"][drafter_name] = {**per_set, "gap": gap}
        print(f"{drafter_name:7s} trained  {' '.join(f'{x:.3f}' for x in per_set['trained'])}")
        print(f"{'':7s} held out {' '.join(f'{x:.3f}' for x in per_set['held_out'])}")
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
