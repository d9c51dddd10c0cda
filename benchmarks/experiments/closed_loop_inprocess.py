"""In-process closed loop: N requests always running (a finished one is replaced at once), the
engine stepped directly, `none` against `dspark`, alternated; where does a serving cell's loss
come from when the policy drafts almost nothing? (issue #42, portable_cpu.md "Serving, bf16")

    python benchmarks/experiments/closed_loop_inprocess.py [N]     # default 16; 4 N requests a run

Prints each policy's seconds per run (two runs each, alternated) and the dspark engine's counters
with how many propose calls it made and what they cost.
"""

import dspark_trt  # noqa: F401  (first: the CPU threading policy)

import sys
import time

from dspark_trt import LLM, SamplingParams
from dspark_trt.runtime import dspark_proposer
from dspark_trt.training.prompts import load_prompts

calls = {"propose": 0, "requests": 0, "seconds": 0.0}
_propose = dspark_proposer.DSparkProposer.propose


def counted(self, requests):
    start = time.perf_counter()
    drafts = _propose(self, requests)
    calls["seconds"] += time.perf_counter() - start
    calls["propose"] += 1
    calls["requests"] += len(requests)
    return drafts


def run(llm: LLM, prompts: list[list[int]], running: int) -> float:
    engine, params = llm.engine, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    total, started = 4 * running, 0
    start = time.perf_counter()
    for _ in range(running):
        engine.add_request(prompts[started % len(prompts)], params)
        started += 1
    while engine.has_unfinished():
        for output in engine.step():
            if output.request.finished and started < total:
                engine.add_request(prompts[started % len(prompts)], params)
                started += 1
    return time.perf_counter() - start


def main() -> int:
    running = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    dspark_proposer.DSparkProposer.propose = counted
    llms = {policy: LLM("default", drafter=None if policy == "none" else "default", policy=policy,
                        max_batch_size=running) for policy in ("none", "dspark")}
    prompts = [llms["none"].encode_chat(p.messages) for name in ("mt-bench", "gsm8k", "humaneval")
               for p in load_prompts(name, 40)]
    seconds = {policy: [] for policy in llms}
    for order in (("none", "dspark"), ("dspark", "none")):
        for policy in order:
            seconds[policy].append(run(llms[policy], prompts, running))
    for policy, values in seconds.items():
        print(policy, [round(v, 3) for v in values], "s")
    c = llms["dspark"].engine.counters
    print(f"dspark: steps {c.num_steps}, request-steps that verified drafts {c.num_drafts}, draft tokens verified "
          f"{c.num_draft_tokens}, accepted {c.num_accepted_tokens}; propose calls {calls['propose']} for "
          f"{calls['requests']} request-drafts, {calls['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
