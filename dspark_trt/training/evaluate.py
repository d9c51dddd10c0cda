"""Offline acceptance and speed of a drafter on a prompt set (`dspark-trt eval`).

Runs real speculative decoding through `LLM` and, on the same prompts with the same sampling
parameters, plain decoding, and reports:
- `accept_length` (tau): tokens committed per verification step, counting the bonus token,
  `1 + accepted / steps` summed over all requests;
- `per_position_acceptance`: conditional acceptance of draft slot k given slots 1..k-1 were
  accepted (the paper's figure 2), `accepted_k / accepted_{k-1}`;
- tokens/s of both, their ratio, and (at temperature 0) how many outputs are identical.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from dspark_trt.runtime.engine import Engine
from dspark_trt.runtime.in_flight import Job, run_in_flight
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.request import AcceptanceCounts, Request
from dspark_trt.runtime.sampling import SamplingParams


def run_engine(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], batch_size: int,
               desc: str) -> tuple[list[Request], float]:
    """Generate with at most `batch_size` requests in flight; return requests and seconds."""
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    start = time.perf_counter()
    requests = run_in_flight(engine, (Job(ids, p) for ids, p in zip(prompts, params)), batch_size, progress=bar)
    bar.close()
    return requests, time.perf_counter() - start


def summarise(requests: list[Request], block_size: int) -> dict:
    steps = sum(r.stats.num_steps for r in requests)
    accepted = sum(r.stats.num_accepted_tokens for r in requests)
    drafted = sum(r.stats.num_draft_tokens for r in requests)
    total = AcceptanceCounts()
    for r in requests:
        total.add(r.stats)
    conditional = total.conditional_acceptance(block_size)
    return {"accept_length": 1.0 + accepted / steps if steps else 1.0, "num_steps": steps,
            "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "per_position_acceptance": conditional}


def evaluate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], batch_size: int = 1,
             compare_plain: bool = True) -> dict:
    block_size = llm.engine.proposer.block_size if llm.engine.proposer is not None else 1
    speculative, spec_seconds = run_engine(llm.engine, prompts, params, batch_size, "speculative")
    result = summarise(speculative, block_size)
    spec_tokens = sum(len(r.output_token_ids) for r in speculative)
    result.update({"num_prompts": len(prompts), "batch_size": batch_size, "generated_tokens": spec_tokens,
                   "speculative_tok_s": spec_tokens / spec_seconds})
    if compare_plain:
        plain_engine = Engine(llm.target, None, max_batch_size=llm.engine.max_batch_size,
                              max_model_len=llm.engine.context_length)
        plain, plain_seconds = run_engine(plain_engine, prompts, params, batch_size, "plain")
        plain_tokens = sum(len(r.output_token_ids) for r in plain)
        result["plain_tok_s"] = plain_tokens / plain_seconds
        result["speedup"] = result["speculative_tok_s"] / result["plain_tok_s"]
        if all(p.greedy for p in params):
            result["identical_outputs"] = sum(a.output_token_ids == b.output_token_ids
                                              for a, b in zip(speculative, plain))
    return result
