"""More training data, then the four drafters trained on it: one GPU, one wall-clock budget.

    python benchmarks/experiments/scale_on_gpu.py --work /tmp/scale --out $OUT --wall-seconds 560

The lever the offline results point at is data: the committed drafters saw ~2,000 responses
(331k tokens), regenerated on two CPU cores in hours. On a GPU our runtime regenerates the whole
training mix (11.7k prompts) in minutes. What this script does, in order:

1. runs `dspark-trt datagen --device cuda --shard i/N --features-dir WORK/features` in N
   processes at once: each request's sampling and stop checks run in Python on the CPU, so one
   process cannot keep the GPU busy, and N of them share it. At `--datagen-seconds` they are
   stopped; every finished row is already on disk (rows are appended as requests finish), with
   its target features, so training needs no second target pass;
2. joins the shards into WORK/rows.jsonl (one row per prompt id; WORK/rows.jsonl.gz is what
   gets committed) and counts rows and tokens per domain;
3. runs `train_on_gpu.py` on those rows with what is left of `--wall-seconds` (`--train-steps`
   fixes the step count and skips its probe);
4. with `--out`: writes `rows.jsonl.gz` there as soon as the rows are joined, and at the end the
   exported drafters, gzipped, in parts of at most 15 MiB (the device tool's limit per file; 8
   files and 64 MiB a call in all), with `scale_summary.json`. Join the parts with
   `cat drafters.tar.gz.part* | tar xz`.

It does not calibrate or evaluate: do that where the held-out features can be computed
(`dspark-trt calibrate`, `benchmarks/offline.py`). Runs on the CPU too, for a dry run:
`--device cpu --prompts gsm8k-train:8 --datagen-seconds 60 --train-steps 2`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
FULL_MIX = ("gsm8k-train", "t0", "self-instruct", "code-stdlib", "code-stdlib-complete")
PART_BYTES = 15 * 2**20
KEEP = ("config.json", "model.safetensors", "MODEL_CARD.md", "calibration.json")
PACK_SECONDS = 30.0  # gzip and split ~60 MB


def run_datagen(args, deadline: float) -> dict:
    """N datagen shards side by side until they finish or the deadline passes."""
    shard_dir = args.work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, (os.cpu_count() or 2) // args.processes))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
    began = time.monotonic()
    with ExitStack() as logs:
        processes = []
        for shard in range(args.processes):
            command = [sys.executable, "-m", "dspark_trt.cli", "datagen", "--device", args.device,
                       "--shard", f"{shard}/{args.processes}", "--batch-size", str(args.batch_size),
                       "--max-tokens", str(args.max_tokens), "--output", str(shard_dir / f"rows.{shard}.jsonl"),
                       "--features-dir", str(args.work / "features")]
            for spec in args.prompts:
                command += ["--prompts", spec]
            log = logs.enter_context(open(shard_dir / f"datagen.{shard}.log", "w"))
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(1.0)
        running = [p for p in processes if p.poll() is None]
        for process in running:  # all at once: finished rows are on disk already
            process.terminate()
        for process in running:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        stopped = len(running)
    return {"datagen_seconds": round(time.monotonic() - began, 1), "processes": args.processes,
            "stopped_at_deadline": stopped, "returncodes": [p.returncode for p in processes]}


def join_shards(args) -> dict:
    """One row per prompt id, in id order, from every shard file (a line torn by a stop is dropped)."""
    rows = {}
    for path in sorted((args.work / "shards").glob("rows.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.setdefault(row["id"], row)
    ordered = [rows[key] for key in sorted(rows)]
    text = "".join(json.dumps(row) + "\n" for row in ordered)
    (args.work / "rows.jsonl").write_text(text)
    with gzip.open(args.work / "rows.jsonl.gz", "wt") as f:
        f.write(text)
    per_domain = collections.Counter(row["domain"] for row in ordered)
    tokens = collections.Counter()
    for row in ordered:
        tokens[row["domain"]] += len(row["response_ids"])
    return {"num_rows": len(ordered), "rows_per_domain": dict(per_domain),
            "response_tokens_per_domain": dict(tokens), "response_tokens": sum(tokens.values())}


def pack(export_dir: Path, out: Path) -> list[str]:
    """The exported drafters (their checkpoint files only: not the staging folder a stopped export
    may leave) as one gzipped tar in parts of at most PART_BYTES (~57 MiB for the four)."""
    bundle = export_dir.parent / "drafters.tar.gz"
    with tarfile.open(bundle, "w:gz") as tar:
        for path in sorted(export_dir.glob("*/*")):
            if path.name in KEEP and not path.parent.name.startswith("."):
                tar.add(path, arcname=f"export/{path.parent.name}/{path.name}")
    names = []
    with bundle.open("rb") as source:
        while chunk := source.read(PART_BYTES):
            names.append(f"drafters.tar.gz.part{len(names):02d}")
            (out / names[-1]).write_bytes(chunk)
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="shards, features, joined rows, training runs")
    parser.add_argument("--out", type=Path, default=None, help="where the packed drafters and the summary go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--wall-seconds", type=float, default=560.0, help="this script's whole budget")
    parser.add_argument("--datagen-seconds", type=float, default=150.0)
    parser.add_argument("--processes", type=int, default=8, help="datagen shards sharing the GPU")
    parser.add_argument("--batch-size", type=int, default=128, help="requests in flight per shard")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", action="append", default=None,
                        help=f"prompt sets (default: {', '.join(FULL_MIX)})")
    parser.add_argument("--train-steps", type=int, default=1900, help="0: let train_on_gpu.py probe and fit the budget")
    args = parser.parse_args()
    args.prompts = args.prompts or list(FULL_MIX)
    wall_deadline = time.monotonic() + args.wall_seconds
    args.work.mkdir(parents=True, exist_ok=True)

    # Convert the GGUF target once here: N shards converting it at once would race for the cache.
    from dspark_trt.models.loading import resolve_target

    resolve_target("default")
    summary: dict = {"prompts": args.prompts, "device": args.device}
    summary_path = args.work / "scale_summary.json"

    def save_summary():
        summary_path.write_text(json.dumps(summary, indent=2))
        if args.out:
            shutil.copy(summary_path, args.out / summary_path.name)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    summary["datagen"] = run_datagen(args, time.monotonic() + args.datagen_seconds)
    summary["data"] = join_shards(args)
    if args.out:  # the rows come back even if training runs out of time
        shutil.copy(args.work / "rows.jsonl.gz", args.out / "rows.jsonl.gz")
    save_summary()
    print(json.dumps(summary, indent=2), flush=True)

    export_dir = args.work / "export"
    train_seconds = wall_deadline - time.monotonic() - PACK_SECONDS
    command = [sys.executable, str(HERE / "train_on_gpu.py"), "--data", str(args.work / "rows.jsonl"),
               "--features-dir", str(args.work / "features"), "--runs", str(args.work / "runs"),
               "--export-dir", str(export_dir), "--device", args.device, "--steps", str(args.train_steps),
               "--wall-seconds", str(max(60.0, train_seconds - 10)),
               "--summary", str(args.work / "train_summary.json")]
    returncode = 1
    try:
        returncode = subprocess.run(command, timeout=max(60.0, train_seconds), check=False).returncode
    except subprocess.TimeoutExpired:  # its own deadline failed: pack whatever was exported
        summary["training_killed"] = True
    finally:
        if (args.work / "train_summary.json").is_file():
            summary["training"] = json.loads((args.work / "train_summary.json").read_text())
        if args.out and export_dir.is_dir():
            summary["parts"] = pack(export_dir, args.out)
        save_summary()
    return returncode


if __name__ == "__main__":
    sys.exit(main())
