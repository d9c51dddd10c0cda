"""What a draft costs where decoding pays for it: right after a target step, against that step.

    python benchmarks/draft_cost.py [--dtype auto|bfloat16|int4|float32] [--requests 1,4]
                                    [--context 300] [--samples 300]
                                    [--output benchmarks/results/draft_cost.json]

Issue #42's line "a draft for one request costs <= 0.15x a one-token step". `dspark-trt profile`
times drafts back to back, where the drafter's weights and the interpreter's paths stay in
cache; in decoding every draft follows a target step that has streamed the target's weights
through the caches, so the draft finds them cold. This measures both, alternating, on the
default target and drafter:

- `step_ms`: a one-token target step, one request with a `--context`-token context;
- `draft_after_step_ms`: `propose` for N requests, each with `KEPT_PER_STEP` new positions to
  catch up (as after a decoding step), timed right after such a target step;
- `draft_back_to_back_ms`: the same draft timed right after another draft (what the profile sees).

Medians over `--samples` pairs. Requests are replaced every 50 samples so that contexts stay near
`--context`. The drafter's inputs are random features, so its tokens (and how often the Markov
head meets a previous token for the first time) are not a real decode's. Writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from cpu_engines import cpu_summary, parse_counts, write_json


def measure(llm, num_requests: int, context: int, samples: int) -> dict:
    import torch

    from dspark_trt.runtime.profile import KEPT_PER_STEP, _profile_request

    proposer, target = llm.engine.proposer, llm.engine.runner.target
    model, config = target.model, target.config
    cache = model.new_pool(1, context + 16).allocate()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, config.vocab_size, (context,), generator=generator), [context], [cache],
              torch.tensor([context - 1]), ())
    width = len(proposer.feature_layers) * config.hidden_size
    kept = torch.randn(KEPT_PER_STEP, width, generator=generator)
    one_token, logit_row = torch.tensor([5]), torch.tensor([0])

    def fresh_requests(tag: int) -> list:
        made = [_profile_request(proposer, f"cost-{tag}-{i}", context, width, generator) for i in range(num_requests)]
        proposer.propose(made)  # their contexts caught up, untimed
        return made

    def target_step() -> None:
        with torch.inference_mode():
            model(one_token, [1], [cache], logit_row, ())
            cache.truncate(context)

    def draft(requests: list) -> float:
        for request in requests:
            proposer.observe(request, kept)
        start = time.perf_counter()
        proposer.propose(requests)
        return time.perf_counter() - start

    requests = fresh_requests(0)
    steps, after_step, back_to_back = [], [], []
    for sample in range(samples + 5):
        if sample % 50 == 0:
            for request in requests:
                proposer.release(request)
            requests = fresh_requests(sample)
        start = time.perf_counter()
        target_step()
        step_seconds = time.perf_counter() - start
        cold = draft(requests)
        warm = draft(requests)
        if sample >= 5:  # warm-up
            steps.append(step_seconds)
            after_step.append(cold)
            back_to_back.append(warm)
    for request in requests:
        proposer.release(request)
    step_ms = statistics.median(steps) * 1e3
    cold_ms, warm_ms = statistics.median(after_step) * 1e3, statistics.median(back_to_back) * 1e3
    return {"num_requests": num_requests, "step_ms": round(step_ms, 3),
            "draft_after_step_ms": round(cold_ms, 3), "draft_back_to_back_ms": round(warm_ms, 3),
            "after_step_ratio": round(cold_ms / step_ms, 3), "back_to_back_ratio": round(warm_ms / step_ms, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="target weights (the drafter follows as in `LLM`)")
    parser.add_argument("--requests", default="1,4", help="comma-separated numbers of requests drafted together")
    parser.add_argument("--context", type=int, default=300, help="context tokens per request")
    parser.add_argument("--samples", type=int, default=300, help="timed (step, draft, draft) triples per count")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/draft_cost.json"))
    args = parser.parse_args()
    counts = parse_counts(parser, "--requests", args.requests)
    if args.context < 16 or args.samples < 1:
        parser.error("--context must be >= 16 and --samples >= 1")

    from dspark_trt import LLM  # before torch: it sets the CPU threading policy
    from dspark_trt.kernels import cpu_kernels

    llm = LLM(target="default", drafter="default", dtype=args.dtype, policy="all")
    rows = [measure(llm, count, args.context, args.samples) for count in counts]
    for row in rows:
        print(f"N={row['num_requests']}: step {row['step_ms']:.2f} ms, "
              f"draft after a step {row['draft_after_step_ms']:.2f} ms ({row['after_step_ratio']:.3f}x), "
              f"back to back {row['draft_back_to_back_ms']:.2f} ms ({row['back_to_back_ratio']:.3f}x)")
    result = {"cpu": cpu_summary(), "kernel_isa": cpu_kernels.isa(), "dtype": args.dtype, "context": args.context,
              "samples": args.samples, "rows": rows}
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
