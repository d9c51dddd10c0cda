"""Offline acceptance and speed of a drafter on a prompt set (`dspark-trt eval`).

Runs real speculative decoding through `LLM` and, on the same prompts with the same sampling
parameters, plain decoding beside it (alternating, round by round), and reports:
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
               progress=None) -> tuple[list[Request], float]:
    """Generate with at most `batch_size` requests in flight; return requests and seconds."""
    start = time.perf_counter()
    requests = run_in_flight(engine, (Job(ids, p) for ids, p in zip(prompts, params)), batch_size, progress=progress)
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


def round_size(batch_size: int) -> int:
    """Prompts per round of the side-by-side comparison: one at batch 1; four batches' worth above,
    so the batch stays full for most of a round."""
    return 1 if batch_size <= 1 else 4 * batch_size


def evaluate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], batch_size: int = 1,
             compare_plain: bool = True) -> dict:
    """Speculative decoding through `llm` and, with `compare_plain`, plain decoding beside it: the
    prompts go in rounds (`round_size`), each round through both engines, speculative first in one
    round and plain first in the next (A B B A ...), so that drift on a shared machine, and any
    advantage of running first, falls on both alike."""
    block_size = llm.engine.proposer.block_size if llm.engine.proposer is not None else 1
    engines = {"speculative": llm.engine}
    if compare_plain:
        engines["plain"] = Engine(llm.target, None, max_batch_size=llm.engine.max_batch_size,
                                  max_model_len=llm.engine.context_length)
    requests = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    size = round_size(batch_size) if compare_plain else max(len(prompts), 1)
    bar = tqdm(total=len(prompts) * len(engines), desc=" + ".join(engines), unit="prompt", leave=False)
    for index, start in enumerate(range(0, len(prompts), size)):
        names = list(engines) if index % 2 == 0 else list(engines)[::-1]
        for name in names:
            done, elapsed = run_engine(engines[name], prompts[start : start + size], params[start : start + size],
                                       batch_size, bar)
            requests[name].extend(done)
            seconds[name] += elapsed
    bar.close()
    speculative = requests["speculative"]
    result = summarise(speculative, block_size)
    spec_tokens = sum(len(r.output_token_ids) for r in speculative)
    result.update({"num_prompts": len(prompts), "batch_size": batch_size, "generated_tokens": spec_tokens,
                   "speculative_tok_s": spec_tokens / seconds["speculative"]})
    if compare_plain:
        plain = requests["plain"]
        result["plain_tok_s"] = sum(len(r.output_token_ids) for r in plain) / seconds["plain"]
        result["speedup"] = result["speculative_tok_s"] / result["plain_tok_s"]
        result["comparison"] = f"side by side, in rounds of {size} prompt(s), alternating which runs first"
        if all(p.greedy for p in params):
            result["identical_outputs"] = sum(a.output_token_ids == b.output_token_ids
                                              for a, b in zip(speculative, plain))
    return result
