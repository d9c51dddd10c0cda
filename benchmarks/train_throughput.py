"""Drafter training throughput on this machine: blocks/s in fp32, bf16 autocast, and bf16 with the
compiled loss, side by side.

    python benchmarks/train_throughput.py [--kinds dspark,eagle3,mtp1] [--steps 6]

For each drafter kind and setting (`fp32`, `bf16`, `bf16+compile`) it trains `--steps` steps (after `--warmup` untimed ones)
at the committed GPU run's batch shape (16 sequences x 64 anchors, `train_on_gpu.py`) on rows
of the bf16 training set, whose features the bf16 target computes first (cached in
`--features-dir`). One block = one anchor's gamma draft slots. Writes
`benchmarks/results/train_throughput.json` with blocks/s per (kind, precision) and the
bf16/fp32 ratio, and what 1.9M blocks (the GPU run's budget) would take here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)

GPU_RUN_BLOCKS = 1_945_600  # 1,900 steps x 16 sequences x 64 anchors (checkpoints/*/MODEL_CARD.md)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/train/smollm2-135m-instruct.bf16.jsonl.gz"))
    parser.add_argument("--features-dir", type=Path, default=Path("runs/features-bf16"))
    parser.add_argument("--num-rows", type=int, default=96, help="rows to sample batches from")
    parser.add_argument("--kinds", default="dspark,eagle3,mtp1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/train_throughput.json"))
    args = parser.parse_args()

    import torch

    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.runtime.device import cpu_device_name
    from dspark_trt.training.data import ensure_features, load_sequences, read_rows
    from dspark_trt.training.run_state import run_progress
    from dspark_trt.training.trainer import TrainConfig, build_draft_vocab, drafter_config_for, train_drafter

    target = load_target("default")
    layers = default_feature_layers(target.config.num_layers)
    rows = read_rows(args.data)[: args.num_rows]
    ensure_features(load_target("default", torch.bfloat16), rows, args.features_dir, layers)
    sequences = load_sequences(rows, args.features_dir)
    vocab = build_draft_vocab(rows, 8192, target.config.vocab_size, set(target.eos_token_ids))
    results = []
    for kind in args.kinds.split(","):
        for setting in ("fp32", "bf16", "bf16+compile"):
            precision, compile_loss = setting.split("+")[0], setting.endswith("+compile")
            with tempfile.TemporaryDirectory() as scratch:
                config = TrainConfig(steps=args.warmup + args.steps, sequences_per_batch=args.batch_size,
                                     anchors_per_sequence=args.anchors, precision=precision, compile_loss=compile_loss,
                                     checkpoint_every=10**9)
                run = Path(scratch)
                drafter_config = drafter_config_for(kind, target, layers)
                train_drafter(target, sequences, drafter_config, vocab, config, run, progress=False,
                              stop_at=args.warmup)
                warm = run_progress(run)
                start = time.perf_counter()
                train_drafter(target, sequences, drafter_config, vocab, config, run, progress=False)
                wall = time.perf_counter() - start
                done = run_progress(run)
            blocks = done["num_blocks"] - warm["num_blocks"]
            seconds = done["elapsed"] - warm["elapsed"]
            results.append({"kind": kind, "setting": setting, "steps": args.steps, "blocks": blocks,
                            "step_seconds": seconds / args.steps, "blocks_per_s": blocks / seconds,
                            "hours_for_gpu_budget": GPU_RUN_BLOCKS / (blocks / seconds) / 3600,
                            "wall_seconds_with_resume": wall})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    ratios = {}
    for kind in args.kinds.split(","):
        rate = {r["setting"]: r["blocks_per_s"] for r in results if r["kind"] == kind}
        ratios[kind] = {"bf16": rate["bf16"] / rate["fp32"], "bf16+compile": rate["bf16+compile"] / rate["fp32"]}
    out = {"machine": cpu_device_name(), "batch": f"{args.batch_size} sequences x {args.anchors} anchors",
           "rows": len(rows), "results": results, "over_fp32": ratios,
           "command": "python benchmarks/train_throughput.py " + " ".join(sys.argv[1:])}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
