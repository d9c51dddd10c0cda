"""The step loop's own cost, two checkouts side by side (a refactor must not make it slower).

    python benchmarks/step_overhead.py --before /path/to/old/checkout [--rounds 2]

Runs the same measurement in a fresh process of each checkout, alternating in ABBA order
(before, after, after, before, ...) so that drift on a shared machine, and any advantage of
running first or second, falls on both alike: greedy decoding of
`--num-prompts` MT-Bench prompts, `--max-tokens` each, plain at batch 1 and batch 8, and with the
committed DSpark drafter verifying whole blocks at batch 1 (every step drafts: the proposer,
verification and commit paths all run). Per run it records tokens/s, the engine's mean step
seconds and the loop's own share of them (`loop_overhead_ms`: step time outside the target's
forward pass, i.e. scheduling, drafting, sampling, verification, commits; the forward pass's
own time varies by a few percent between processes with where its buffers land), and writes
`benchmarks/results/step_overhead.json` with the medians and the after/before ratios. Only the
public API both checkouts share is used (`LLM`, `generate`, `engine.counters`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
import dspark_trt
from dspark_trt import LLM, SamplingParams
from dspark_trt.models.target import TargetModel
from dspark_trt.training.prompts import load_prompts
num_prompts, max_tokens = int(sys.argv[1]), int(sys.argv[2])
forward_seconds = [0.0]  # time inside the target's forward pass: what the loop's own cost excludes
plain_forward = TargetModel.forward
def timed_forward(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return plain_forward(self, *args, **kwargs)
    finally:
        forward_seconds[0] += time.perf_counter() - start
TargetModel.forward = timed_forward
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
result = {"module": dspark_trt.__file__}
for name, drafter, batch in (("plain_b1", None, 1), ("plain_b8", None, 8), ("dspark_all_b1", "default", 1)):
    llm = LLM(target="default", drafter=drafter, policy="all" if drafter else "none", max_batch_size=8)
    prompts = [llm.encode_chat(p.messages) for p in load_prompts("mt-bench", num_prompts)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up: kernels, tables
    steps0, seconds0, forward0 = llm.engine.counters.num_steps, llm.engine.counters.step_seconds, forward_seconds[0]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + batch], params))
    wall = time.perf_counter() - start
    counters = llm.engine.counters
    steps, step_seconds = max(1, counters.num_steps - steps0), counters.step_seconds - seconds0
    result[name] = {"tok_s": tokens / wall, "mean_step_ms": 1e3 * step_seconds / steps,
                    "loop_overhead_ms": 1e3 * (step_seconds - (forward_seconds[0] - forward0)) / steps}
print(json.dumps(result))
"""


def run(checkout: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", WORKER, str(args.num_prompts), str(args.max_tokens)], cwd=checkout,
                          env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["module"].startswith(str(checkout)):
        raise SystemExit(f"{checkout}: imported dspark_trt from {result['module']}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--after", type=Path, default=HERE)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/step_overhead.json"))
    args = parser.parse_args()
    runs = {"before": [], "after": []}
    for round_index in range(args.rounds):
        for label in (("before", "after") if round_index % 2 == 0 else ("after", "before")):
            runs[label].append(run(getattr(args, label).resolve(), args))
            print(f"round {round_index + 1} {label}: {json.dumps(runs[label][-1])}", file=sys.stderr, flush=True)
    summary = {}
    for case in ("plain_b1", "plain_b8", "dspark_all_b1"):
        row = {}
        for metric in ("tok_s", "mean_step_ms", "loop_overhead_ms"):
            before = statistics.median(r[case][metric] for r in runs["before"])
            after = statistics.median(r[case][metric] for r in runs["after"])
            row[metric] = {"before": before, "after": after, "after_over_before": after / before}
        summary[case] = row
    out = {"command": "python benchmarks/step_overhead.py " + " ".join(sys.argv[1:]), "rounds": args.rounds,
           "summary": summary, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
