"""What the sequential head costs: DSpark drafter latency per block with and without it.

The head here is every part that runs slot by slot: the Markov (or RNN) head and, where the
drafter has one, the prefix layer (`--prefix-layer`); without them, slots read straight from the
backbone logits.

    python benchmarks/drafter_latency.py [--drafter default] [--dataset gsm8k] [--num-prompts 5]
                                         [--max-tokens 64]

Decodes real prompts speculatively at batch 1, greedy. At every draft the proposer is called
twice on the same state: once with the sequential head, once with it removed (slots read
straight from the backbone logits), in alternating order so that both share machine noise
and cache warmth; the block with the head is the one decoding goes on with. Every cost of the
head is in the figures, including computing a Markov head's bias row the first time a
previous token is seen (`MarkovRows` in the proposer). Writes
benchmarks/results/drafter_latency.json: mean and median per block, and the overhead of the
head relative to the drafter without it (mean: the total cost over the run).
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
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams  # before torch: it sets the CPU threading policy
    from dspark_trt.training.prompts import load_prompts
    import torch

    llm = LLM(target="default", drafter=args.drafter, dtype=args.dtype, policy="all")  # every step drafts
    proposer = llm.engine.proposer
    drafter = proposer.drafter
    head, prefix = drafter.sequential, drafter.prefix
    propose = proposer.propose
    times = {"with_head": [], "without_head": []}

    def timed_propose(requests):
        proposer._catch_up(requests)  # new target features: paid once, by neither variant
        names = ["with_head", "without_head"]
        if len(times["with_head"]) % 2:
            names.reverse()
        for name in names:
            drafter.sequential, drafter.prefix = (head, prefix) if name == "with_head" else (None, None)
            start = time.perf_counter()
            drafts = propose(requests)
            times[name].append(time.perf_counter() - start)
            if name == "with_head":  # the head-less block (and its confidences) is dropped
                kept_drafts = drafts
        drafter.sequential, drafter.prefix = head, prefix
        return kept_drafts

    proposer.propose = timed_propose
    prompts = [llm.encode_chat(p.messages) for p in load_prompts(args.dataset, args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:  # one at a time: batch 1
        llm.generate([prompt], params, use_tqdm=False)

    def per_block(name: str) -> dict:
        return {"mean_ms": statistics.fmean(times[name]) * 1e3, "median_ms": statistics.median(times[name]) * 1e3}

    with_head, without = per_block("with_head"), per_block("without_head")
    result = {"drafter": args.drafter, "dtype": llm.dtype, "block_size": drafter.config.block_size,
              "head": drafter.config.head, "prefix_layer": drafter.config.prefix_layer,
              "dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
              "num_blocks": len(times["with_head"]), "with_head": with_head, "without_head": without,
              "head_overhead": with_head["mean_ms"] / without["mean_ms"] - 1,
              "head_overhead_median": with_head["median_ms"] / without["median_ms"] - 1,
              "torch_threads": torch.get_num_threads()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    parts = f"{result['head']} head" + (" and prefix layer" if prefix is not None else "")
    print(f"{result['num_blocks']} blocks of {result['block_size']}: {with_head['mean_ms']:.2f} ms mean with the "
          f"{parts}, {without['mean_ms']:.2f} ms without: +{result['head_overhead']:.1%} "
          f"(median +{result['head_overhead_median']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
