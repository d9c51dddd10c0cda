"""What a decoding step costs in the engine, against what the latency profile says it costs.

    python benchmarks/step_costs.py [--dataset gsm8k] [--batch-size 8] [--num-prompts 64]
                                    [--temperature 0] [--max-tokens 64] [--dtype auto]
                                    [--output benchmarks/results/step_costs.json]

The dspark policy decides whether to draft from step times: the profile's curves (`dspark-trt
profile`: one request's blocks, nothing around the forward) corrected online by what the engine's
own decoding steps measured (`verify_policy.Costs.observe_step`). This runs `--num-prompts`
prompts through the default target and drafter with `--batch-size` requests in flight (policy
dspark), and for every decoding step without a prompt chunk records what it took against what the
profile alone predicts (target at its batch tokens + the drafter for the requests drafting), by
(decoding requests, requests drafting). It also writes what the policy learned by the end: the
overhead per decoding request and per verified draft token, and the drafter-cost scale. Medians per
group; wall-clock figures, so run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

from cpu_engines import cpu_summary, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/step_costs.json"))
    args = parser.parse_args()

    import dspark_trt  # noqa: F401  (before torch: our kernels' thread settings)
    from dspark_trt.runtime import engine as engine_module
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.runtime.sampling import SamplingParams
    from dspark_trt.training.evaluate import run_engine
    from dspark_trt.training.prompts import load_prompts

    llm = LLM(drafter="default", policy="dspark", dtype=args.dtype, max_batch_size=args.batch_size)
    engine, costs = llm.engine, llm.engine.policy.costs
    groups: dict[tuple[int, int], list[tuple[float, float, float]]] = defaultdict(list)
    finish_step = engine_module.Engine._finish_step

    def recording(self, stats, step_start):  # the engine's own bookkeeping, then one row per decoding step
        finish_step(self, stats, step_start)
        if self is engine and stats.decoding_only:
            profile = costs.profile  # the profile alone, not what the policy has learned on top of it
            predicted = profile.target_seconds(stats.batch_tokens) + profile.drafter_seconds(stats.num_drafting)
            groups[(stats.num_decoding, stats.num_drafting)].append(
                (stats.step_seconds, predicted, stats.batch_tokens - stats.num_decoding))

    engine_module.Engine._finish_step = recording
    prompts = [llm.encode_chat(p.messages) for p in load_prompts(args.dataset, args.num_prompts)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i)
              for i in range(len(prompts))]
    start = time.perf_counter()
    requests, seconds = run_engine(engine, prompts, params, args.batch_size, None)
    engine_module.Engine._finish_step = finish_step
    counters = engine.counters
    rows = [{"decoding": decoding, "drafting": drafting, "steps": len(samples),
             "draft_tokens": round(statistics.mean(s[2] for s in samples), 2),
             "measured_ms": round(1e3 * statistics.median(s[0] for s in samples), 3),
             "profile_ms": round(1e3 * statistics.median(s[1] for s in samples), 3)}
            for (decoding, drafting), samples in sorted(groups.items())]
    data = {"command": "python benchmarks/step_costs.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
            "cpu": cpu_summary(), "dataset": args.dataset, "batch_size": args.batch_size,
            "temperature": args.temperature, "max_tokens": args.max_tokens,
            "tok_s": sum(len(r.output_token_ids) for r in requests) / seconds,
            "wall_s": time.perf_counter() - start,
            "num_draft_tokens": counters.num_draft_tokens, "num_accepted_tokens": counters.num_accepted_tokens,
            "learned": {"request_ms": 1e3 * costs.request_seconds, "token_ms": 1e3 * costs.token_seconds,
                        "drafter_scale": costs.drafter_scale},
            "steps": rows}
    write_json(args.output, data)
    for row in rows:
        print(f"{row['decoding']:3d} decoding, {row['drafting']:2d} drafting, {row['steps']:4d} steps: "
              f"{row['measured_ms']:7.2f} ms measured, {row['profile_ms']:7.2f} ms by the profile "
              f"({row['draft_tokens']:.1f} draft tokens)")
    print(f"learned: {data['learned']}; wrote {args.output}")


if __name__ == "__main__":
    main()
