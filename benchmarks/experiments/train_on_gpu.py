"""Train the four drafters (DSpark, DFlash, EAGLE-3-style, MTP-1) on one GPU, same data, same steps.

    python benchmarks/experiments/train_on_gpu.py --data data/train/smollm2-135m-instruct.jsonl \
        --features-dir /tmp/features --runs /tmp/runs --export-dir /tmp/export --wall-seconds 480

`--kinds dspark,eagle3` trains only those, `dspark:5` a DSpark with a 5-layer backbone (run
`dspark-5layer`) beside them; `--prefix-layer` gives the DSpark runs their prefix layer; `--data`
repeats for several files (as `dspark-trt train --data`); `--feature-processes N` computes the
features in N processes sharing the GPU (one row per target pass is Python-bound: ~26 ms a row on
an H200 from one process).

What it does, in order:
1. computes the target features of every training row on the GPU (`ensure_features`), and, when
   `--reference` names an .npz of per-row target normalisers computed elsewhere (on the CPU),
   checks that the GPU agrees with it, so a wrong target is caught before minutes of training;
2. times 10 training steps of each kind alone, and picks one step count for all four that fits
   what is left of `--wall-seconds` when they train side by side (`--overlap`: how much faster
   four processes sharing the GPU are than the same steps run one after another; 1.0 assumes
   no gain); `--steps N` skips this and trains N steps;
3. runs `dspark-trt train --device cuda --export ...` for the four kinds at once and waits. A run
   still going near the end of `--wall-seconds` is stopped and exported from its last checkpoint
   (its model card then shows fewer steps), so a slow guess never loses the rest;
4. writes `summary.json` (feature time, probe times, chosen steps, each run's steps and minutes).

It does not calibrate (do that where the held-out features are: `dspark-trt calibrate`) or
evaluate. Works on the CPU too (`--device cpu`, for a dry run with `--limit-rows`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

KINDS = ("dspark", "dflash", "eagle3", "mtp1")
PROBE_ROWS = 512


@dataclass(frozen=True)
class RunSpec:
    """One training run: a drafter kind, and its backbone depth when not the kind's default."""

    kind: str
    num_layers: int | None = None

    @property
    def name(self) -> str:  # the run's folder and export name
        return self.kind if self.num_layers is None else f"{self.kind}-{self.num_layers}layer"


def parse_runs(text: str) -> tuple[RunSpec, ...]:
    """`dspark,eagle3,dspark:5` -> run specs; raises ValueError naming what is wrong."""
    specs = []
    for item in text.split(","):
        kind, _, layers = item.partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
        if layers and not (layers.isdigit() and int(layers) >= 1):
            raise ValueError(f"{item!r}: the layer count after ':' must be a positive integer")
        specs.append(RunSpec(kind, int(layers) if layers else None))
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError(f"{text!r} names a run twice")
    return tuple(specs)


def wait_or_kill(process: subprocess.Popen, deadline: float) -> None:
    """Wait for `process` until the monotonic `deadline`, then kill it."""
    try:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def features_in_processes(rows: list[dict], args) -> None:
    """`--feature-processes` shards of this script, each computing the features of every N-th row."""
    command = [sys.executable, __file__, *data_arguments(args.data), "--features-dir", str(args.features_dir),
               "--runs", str(args.runs), "--export-dir", str(args.export_dir), "--device", args.device]
    if args.limit_rows:
        command += ["--limit-rows", str(args.limit_rows)]
    shards = [subprocess.Popen([*command, "--features-shard", f"{i}/{args.feature_processes}"])
              for i in range(args.feature_processes)]
    failed = [i for i, shard in enumerate(shards) if shard.wait() != 0]
    if failed:
        raise SystemExit(f"feature shards {failed} failed")


def data_arguments(paths: list[Path]) -> list[str]:
    return [arg for path in paths for arg in ("--data", str(path))]


def probe_seconds_per_step(target, rows: list[dict], layers: tuple[int, ...], run_specs: tuple[RunSpec, ...],
                           args) -> dict[str, float]:
    """Seconds per training step of each kind alone: 10 steps timed after 3 warm-up steps."""
    from dspark_trt.training.data import load_sequences
    from dspark_trt.training.run_state import run_progress
    from dspark_trt.training.trainer import (
        TrainConfig,
        build_draft_vocab,
        drafter_config_for,
        train_drafter,
    )

    sequences = load_sequences(rows[:PROBE_ROWS], args.features_dir)  # a step costs the same on any rows
    vocab = build_draft_vocab(rows, 8192, target.config.vocab_size, set(target.eos_token_ids))
    probe = {}
    with tempfile.TemporaryDirectory() as scratch:
        for spec in run_specs:
            config = TrainConfig(steps=max(args.max_steps, 13),  # (a schedule that reaches the timed steps)
                                 sequences_per_batch=args.batch_size,
                                 anchors_per_sequence=args.anchors, learning_rate=args.lr)
            run = Path(scratch) / spec.name
            drafter_config = drafter_config_for(spec.kind, target, layers, num_layers=spec.num_layers or 2,
                                                prefix_layer=args.prefix_layer and spec.kind == "dspark")
            train_drafter(target, sequences, drafter_config, vocab, config, run, progress=False, stop_at=3,
                          device=args.device)
            warm = run_progress(run)["elapsed"]
            train_drafter(target, sequences, drafter_config, vocab, config, run, progress=False, stop_at=13,
                          device=args.device)
            done = run_progress(run)["elapsed"]
            probe[spec.name] = (done - warm) / 10
            print(f"probe {spec.name}: {probe[spec.name] * 1000:.0f} ms/step", flush=True)
    return probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, action="append",
                        help="datagen rows (repeat for several files; default: data/train/smollm2-135m-instruct.jsonl)")
    parser.add_argument("--features-dir", type=Path, required=True)
    parser.add_argument("--runs", type=Path, required=True, help="one run folder per kind is made here")
    parser.add_argument("--export-dir", type=Path, required=True, help="fp16 drafters + model cards, one per kind")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--wall-seconds", type=float, default=480.0, help="this script's whole wall-clock budget")
    parser.add_argument("--overlap", type=float, default=1.4)
    parser.add_argument("--startup-seconds", type=float, default=60.0,
                        help="what a training process takes to load the target and features")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=0,
                        help="train this many steps and skip the probe (0: probe, then fit the budget)")
    parser.add_argument("--limit-rows", type=int, default=0, help="dry runs: use only this many rows")
    parser.add_argument("--reference", type=Path, default=None, help=".npz: row id -> target logsumexp")
    parser.add_argument("--summary", type=Path, default=None, help="default: RUNS/summary.json")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma-separated runs KIND[:LAYERS] (default: the four kinds at their default depth)")
    parser.add_argument("--prefix-layer", action="store_true", help="the DSpark run gets a prefix layer")
    parser.add_argument("--feature-processes", type=int, default=1, help="compute the features in N processes")
    parser.add_argument("--features-shard", default=None, help=argparse.SUPPRESS)  # I/N: one feature process
    args = parser.parse_args()
    args.data = args.data or [Path("data/train/smollm2-135m-instruct.jsonl")]
    try:
        run_specs = parse_runs(args.kinds)
    except ValueError as exc:
        parser.error(f"--kinds: {exc}")
    wall_deadline = time.monotonic() + args.wall_seconds
    # A stopped run's export from its checkpoint is a whole `dspark-trt train` start-up (target
    # and every row's features loaded), side by side for the four.
    export_seconds = args.startup_seconds + 30.0

    import dspark_trt  # noqa: F401  (first: it sets torch's thread policy, runtime/threads.py)

    # isort: split
    import numpy as np
    import torch
    from dspark_trt.training.run_state import run_progress

    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import check_feature_cache, ensure_features, read_datasets
    from dspark_trt.training.datagen import feature_file
    from dspark_trt.training.trainer import is_held_out

    summary: dict = {"device": args.device, "data": [str(path) for path in args.data],
                     "runs_trained": [spec.name for spec in run_specs],
                     "prefix_layer": args.prefix_layer, "batch_size": args.batch_size, "anchors": args.anchors,
                     "lr": args.lr, "feature_processes": args.feature_processes}
    summary_path = args.summary or args.runs / "summary.json"
    args.runs.mkdir(parents=True, exist_ok=True)

    def save_summary():
        summary_path.write_text(json.dumps(summary, indent=2))

    target = load_target("default")
    target.model.to(args.device)
    layers = default_feature_layers(target.config.num_layers)
    rows = [r for r in read_datasets(args.data) if not is_held_out(r["id"])]
    data_paths = args.data
    if args.limit_rows:
        rows = rows[: args.limit_rows]
        data_paths = [args.runs / "rows.jsonl"]  # the subprocesses read exactly these rows
        if not args.features_shard:
            data_paths[0].write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.features_shard:  # one of --feature-processes: its rows' features, then exit
        index, count = (int(x) for x in args.features_shard.split("/"))
        ensure_features(target, rows[index::count], args.features_dir, layers)
        return 0
    began = time.perf_counter()
    if args.feature_processes > 1:
        check_feature_cache(args.features_dir, target, layers)  # writes its manifest, before the shards do
        features_in_processes(rows, args)
    ensure_features(target, rows, args.features_dir, layers)  # (any a shard left, none after a clean run)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    summary["feature_seconds"] = round(time.perf_counter() - began, 1)
    summary["num_rows"] = len(rows)
    print(f"features of {len(rows)} rows: {summary['feature_seconds']} s", flush=True)

    if args.reference:  # the GPU's target must be the CPU's target
        reference = np.load(args.reference)
        worst = 0.0
        for row_id in reference.files:
            if any(r["id"] == row_id for r in rows):
                here = np.load(feature_file(args.features_dir, row_id))["logsumexp"]
                worst = max(worst, float(np.abs(here - reference[row_id]).max()))
        summary["reference_max_abs_diff"] = worst
        print(f"target normalisers vs reference: max |diff| {worst:.2e}", flush=True)
        save_summary()
        if worst > 1e-2:
            print("the target here disagrees with the reference: stopping", file=sys.stderr)
            return 1

    probe = {} if args.steps else probe_seconds_per_step(target, rows, layers, run_specs, args)
    # Hand the GPU to the four runs: this process's cached blocks (~70 GB after the probes) made
    # the EAGLE-3-style run fail for want of memory on the first try.
    target.model.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    summary["probe_seconds_per_step"] = probe
    train_seconds = wall_deadline - time.monotonic() - args.startup_seconds - export_seconds
    summary["train_seconds_planned"] = round(train_seconds, 1)
    if args.steps:
        steps = args.steps
    else:
        steps = int(train_seconds * args.overlap / sum(probe.values()))
        steps = min(args.max_steps, max(50, steps // 50 * 50))  # --max-steps caps even the 50-step floor
    summary["steps"] = steps
    save_summary()
    print(f"training {', '.join(spec.name for spec in run_specs)} for {steps} steps", flush=True)

    # All four at once; each is a plain `dspark-trt train` run.
    deadline = wall_deadline - export_seconds
    began = time.perf_counter()
    with ExitStack() as logs:
        processes = {}
        for spec in run_specs:
            name = spec.name
            command = [sys.executable, "-m", "dspark_trt.cli", "train", *data_arguments(data_paths),
                       "--features-dir", str(args.features_dir), "--output", str(args.runs / name), "--kind", spec.kind,
                       "--steps", str(steps), "--batch-size", str(args.batch_size), "--anchors", str(args.anchors),
                       "--lr", str(args.lr), "--device", args.device, "--export", str(args.export_dir / name),
                       "--features-dtype", "float32",  # what this script's fp32 target computed
                       "--no-compile-loss"]  # eager, as the probe timed it (and no compile to wait for)
            if spec.num_layers is not None:
                command += ["--num-layers", str(spec.num_layers)]
            if args.prefix_layer and spec.kind == "dspark":
                command.append("--prefix-layer")
            log = logs.enter_context(open(args.runs / f"{name}.log", "w"))
            processes[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), command, log)
        for process, _, _ in processes.values():
            wait_or_kill(process, deadline)
        exports = []  # stopped runs: export what their last checkpoint holds, side by side
        for name, (process, command, log) in processes.items():
            step = run_progress(args.runs / name).get("step")
            if process.returncode != 0 and step:
                exports.append(subprocess.Popen([*command, "--stop-at", str(step)], stdout=log,
                                                stderr=subprocess.STDOUT))
        for process in exports:
            wait_or_kill(process, wall_deadline)
    runs = {}
    for name, (process, _, _) in processes.items():
        state = run_progress(args.runs / name)
        runs[name] = {"returncode": process.returncode, "steps": state.get("step", 0),
                      "train_minutes": round(state.get("elapsed", 0.0) / 60, 2),
                      "exported": (args.export_dir / name / "model.safetensors").is_file()}
        print(f"{name}: {runs[name]}", flush=True)
    summary["runs"] = runs
    summary["training_wall_seconds"] = round(time.perf_counter() - began, 1)
    save_summary()
    return 0 if all(r["exported"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
