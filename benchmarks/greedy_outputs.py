"""Greedy outputs of every drafter under every policy it supports, on the evaluation sets.

A regression check for changes to the step loop: speculation is lossless, so at temperature 0
every (drafter, policy) must give plain decoding's tokens, and a refactor must give the same
tokens as before it. One run writes the token ids of each configuration; `--compare` checks
two such files against each other and every configuration against plain decoding.

    python benchmarks/greedy_outputs.py --output /tmp/after.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/greedy_outputs.py --output /tmp/before.json
    python benchmarks/greedy_outputs.py --compare /tmp/before.json /tmp/after.json

All prompts of a configuration run in one batch (so batching is exercised too); the DSpark
policies read the committed latency profile, so both runs decide alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)

CHECKPOINTS = Path("checkpoints/smollm2-135m-instruct")
DRAFTERS = ("dspark", "dflash", "eagle3", "mtp1")
CONFIDENCE_POLICIES = ("all", "fixed:2", "threshold:0.5", "dspark", "dspark-lagged")
PLAIN_POLICIES = ("all", "fixed:2")


def generate_all(args) -> dict:
    from dspark_trt import LLM, SamplingParams
    from dspark_trt.training.prompts import load_prompts

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    plain = LLM(target="default", max_batch_size=32)
    prompts = [plain.encode_chat(p.messages) for name in ("mt-bench", "humaneval", "gsm8k")
               for p in load_prompts(name, args.num_prompts)]
    results = {"plain": [o.token_ids for o in plain.generate(prompts, params)]}
    for name in DRAFTERS:
        folder = CHECKPOINTS / name
        probe = LLM(target="default", drafter=str(folder), policy="all", max_batch_size=32)
        policies = CONFIDENCE_POLICIES if probe.engine.proposer.has_confidence else PLAIN_POLICIES
        for policy in policies:
            llm = LLM(target="default", drafter=str(folder), policy=policy, profile=args.profile, max_batch_size=32)
            outputs = llm.generate(prompts, params)
            results[f"{name}/{policy}"] = [o.token_ids for o in outputs]
            drafted = sum(o.metrics["num_draft_tokens"] for o in outputs)
            print(f"{name}/{policy}: {drafted} draft tokens verified", file=sys.stderr)
    return results


def compare(before_path: Path, after_path: Path) -> int:
    before, after = (json.loads(p.read_text()) for p in (before_path, after_path))
    # the committed result wraps the ids with its command and comparison
    before, after = (d.get("token_ids", d) for d in (before, after))
    failures = 0
    for key in sorted(set(before) | set(after)):
        same = before.get(key) == after.get(key)
        lossless = after.get(key) == after["plain"]
        failures += (not same) + (not lossless)
        print(f"{key:28s} before==after: {same}   ==plain: {lossless}")
    print("all identical" if failures == 0 else f"{failures} mismatches")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--num-prompts", type=int, default=4, help="per evaluation set (MT-Bench, HumanEval, GSM8K)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--profile", default="benchmarks/results/profile.json")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.output is None:
        parser.error("give --output (or --compare BEFORE AFTER)")
    args.output.write_text(json.dumps(generate_all(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
