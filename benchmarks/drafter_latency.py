"""What the sequential head (or the copy bias) costs: DSpark drafter latency per block with and without it.

The head here is every part that runs slot by slot: the Markov (or RNN) head and, where the
drafter has one, the prefix layer (`--prefix-layer`); without them, slots read straight from the
backbone logits. With `--part copy-bias` the part removed is the copy bias instead (its n-gram
lookups and the logit bias; `models/copy_bias.py`), the head staying.

    python benchmarks/drafter_latency.py [--drafter default] [--dataset gsm8k] [--num-prompts 5]
                                         [--max-tokens 64] [--part head|copy-bias]

Decodes real prompts speculatively at batch 1, greedy. At every draft the proposer is called
twice on the same state: once with the part, once with it removed, in alternating order so
that both share machine noise and cache warmth; the block with the part is the one decoding
goes on with. Every cost of the part is in the figures: for the head, computing a Markov head's
bias row the first time a previous token is seen (`MarkovRows` in the proposer); for the copy
bias, bringing each request's n-gram index up to its committed tokens. Writes
benchmarks/results/drafter_latency.json (or --output): mean and median per block, and the
overhead of the part relative to the drafter without it (mean: the total cost over the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--dataset", default="gsm8k", help="prompt set (as for `dspark-trt eval`)")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/drafter_latency.json"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="target and drafter weights")
    parser.add_argument("--part", default="head", choices=("head", "copy-bias"),
                        help="what the variant without it lacks (the JSON's keys name it: with_head, with_copy_bias)")
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams  # before torch: it sets the CPU threading policy
    from dspark_trt.training.prompts import load_prompts
    import torch

    llm = LLM(target="default", drafter=args.drafter, dtype=args.dtype, policy="all")  # every step drafts
    proposer = llm.engine.proposer
    drafter = proposer.drafter
    head, prefix = drafter.sequential, drafter.prefix
    propose, copy_bias = proposer.propose, proposer._copy_bias
    if args.part == "copy-bias" and not drafter.config.copy_bias:
        print(f"error: --part copy-bias: the drafter {args.drafter} has no copy bias (`dspark-trt calibrate`)",
              file=sys.stderr)
        return 2

    def use_part(present: bool) -> None:
        if args.part == "head":
            drafter.sequential, drafter.prefix = (head, prefix) if present else (None, None)
        else:  # a request's lookup catches up on the next call that uses it: skipping one is safe
            proposer._copy_bias = copy_bias if present else (lambda requests: None)

    part = args.part.replace("-", "_")
    present, absent = f"with_{part}", f"without_{part}"
    times = {present: [], absent: []}

    def timed_propose(requests):
        proposer._catch_up(requests)  # new target features: paid once, by neither variant
        names = [present, absent]
        if len(times[present]) % 2:
            names.reverse()
        for name in names:
            use_part(name == present)
            start = time.perf_counter()
            drafts = propose(requests)
            times[name].append(time.perf_counter() - start)
            if name == present:  # the block without the part (and its confidences) is dropped
                kept_drafts = drafts
        use_part(True)
        return kept_drafts

    proposer.propose = timed_propose
    prompts = [llm.encode_chat(p.messages) for p in load_prompts(args.dataset, args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:  # one at a time: batch 1
        llm.generate([prompt], params, use_tqdm=False)

    def per_block(name: str) -> dict:
        return {"mean_ms": statistics.fmean(times[name]) * 1e3, "median_ms": statistics.median(times[name]) * 1e3}

    with_part, without = per_block(present), per_block(absent)
    result = {"drafter": args.drafter, "dtype": llm.dtype, "block_size": drafter.config.block_size,
              "head": drafter.config.head, "prefix_layer": drafter.config.prefix_layer,
              "part": args.part, "dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
              "num_blocks": len(times[present]), present: with_part, absent: without,
              f"{part}_overhead": with_part["mean_ms"] / without["mean_ms"] - 1,
              f"{part}_overhead_median": with_part["median_ms"] / without["median_ms"] - 1,
              "torch_threads": torch.get_num_threads()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    parts = ("copy bias" if args.part == "copy-bias"
             else f"{result['head']} head" + (" and prefix layer" if prefix is not None else ""))
    print(f"{result['num_blocks']} blocks of {result['block_size']}: {with_part['mean_ms']:.2f} ms mean with the "
          f"{parts}, {without['mean_ms']:.2f} ms without: +{result[f'{part}_overhead']:.1%} "
          f"(median +{result[f'{part}_overhead_median']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
