"""Compare drafters by real speculative decoding on the held-out 5% of the training data.

    python benchmarks/experiments/heldout_tau.py --drafter NAME=FOLDER [--drafter ...] \
        [--data data/train/smollm2-135m-instruct.jsonl] [--max-tokens 32] [--temperature 0 --temperature 1] \
        [--domain chat] [--max-prompts 24] [--output FILE.json]

For choosing a training recipe (a loss weight, say) without looking at the evaluation sets:
the prompts are the rows `dspark-trt train` holds out by id (the ones `calibrate` uses), their
prompt token ids as the data has them (chat template applied). `--domain chat --max-prompts 24
--max-tokens 96 --temperature 0` is the nearest we have to the issue's held-out chat set (24
prompts we never see): chat rows no drafter trained on. Prints and writes tau and the
conditional per-position acceptance per drafter and temperature, whole block verified.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--data", type=Path, default=Path("data/train/smollm2-135m-instruct.jsonl"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, action="append", default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--domain", default=None, help="only held-out rows of this domain (math, chat, code)")
    parser.add_argument("--max-prompts", type=int, default=None, help="the first N held-out rows (file order)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams
    from dspark_trt.training.data import read_rows
    from dspark_trt.training.evaluate import evaluate
    from dspark_trt.training.trainer import is_held_out

    rows = [row for row in read_rows(args.data)
            if is_held_out(row["id"]) and args.domain in (None, row.get("domain"))]
    if not rows:
        parser.error(f"--domain {args.domain!r}: no held-out row of {args.data} has that domain" if args.domain
                     else f"--data {args.data}: it has no held-out rows")
    prompts = [row["prompt_ids"] for row in rows[:args.max_prompts]]
    results = []
    for spec in args.drafter:
        name, _, folder = spec.partition("=")
        llm = LLM(target="default", drafter=folder, max_batch_size=args.batch_size, policy="all")
        for temperature in args.temperature or [0.0, 1.0]:
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i)
                      for i in range(len(prompts))]
            result = {"drafter": name, "folder": folder, "temperature": temperature, "num_prompts": len(prompts),
                      **evaluate(llm, prompts, params, args.batch_size, compare_plain=False)}
            results.append(result)
            acceptance = ", ".join(f"{a:.3f}" for a in result["per_position_acceptance"])
            print(f"{name} T={temperature:g}: tau {result['accept_length']:.3f}  per position {acceptance}", flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
