"""What the sequential head costs: DSpark drafter latency per block with and without it.

    python benchmarks/drafter_latency.py [--drafter default] [--context 256] [--repeats 50]

Times one block proposal (backbone + left-to-right head over gamma slots, greedy) for one
request with a context of `--context` tokens, with the Markov head, then with the head removed
(slots read straight from the backbone logits), alternating the two to share machine noise.
Writes benchmarks/results/drafter_latency.json.
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
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/drafter_latency.json"))
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams  # before torch: it sets the CPU threading policy
    import torch

    llm = LLM(target="default", drafter=args.drafter)
    proposer = llm.engine.proposer
    drafter = proposer.drafter
    request = llm.engine.add_request(list(range(1000, 1000 + args.context)),
                                     SamplingParams(max_tokens=4, temperature=0.0))
    llm.engine.step()  # prefill: the proposer now holds the request's context
    head = drafter.sequential
    times = {"with_head": [], "without_head": []}
    for _ in range(args.repeats):
        for name in times:
            drafter.sequential = head if name == "with_head" else None
            start = time.perf_counter()
            proposer.propose([request])
            times[name].append(time.perf_counter() - start)
    drafter.sequential = head
    llm.engine.abort(request)
    with_head = statistics.median(times["with_head"]) * 1e3
    without = statistics.median(times["without_head"]) * 1e3
    result = {"drafter": args.drafter, "block_size": drafter.config.block_size, "context_tokens": args.context,
              "head": drafter.config.head, "with_head_ms": with_head, "without_head_ms": without,
              "head_overhead": with_head / without - 1, "torch_threads": torch.get_num_threads()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"block of {result['block_size']}: {with_head:.2f} ms with the {result['head']} head, {without:.2f} ms "
          f"without: +{result['head_overhead']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
