"""Batch-invariant mode: a request's output does not depend on what else shares its steps.

Without it, a BLAS rounds a row differently depending on how many rows the product has, so a
near-tied greedy choice can flip with the batch. These tests check the guarantee directly:
bit-identical target logits for a sequence alone and inside mixed batches, and identical engine outputs
(greedy, and seeded samples with the default fixed-block policy) under random arrival orders.
"""

import random

import pytest
import torch
from tiny_drafters import make_drafter

from dspark_trt import LLM, SamplingParams
from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.dspark_proposer import DSparkProposer
from dspark_trt.runtime.engine import Engine


def _logits_alone(model, tokens: list[int], split: int) -> torch.Tensor:
    """Prefill `tokens[:split]`, then feed the rest as one decode block, alone."""
    pool = model.new_pool(1, 64)
    cache = pool.allocate()
    model(torch.tensor(tokens[:split]), [split], [cache], batch_invariant=True)
    return model(torch.tensor(tokens[split:]), [len(tokens) - split], [cache], batch_invariant=True).logits


def test_a_sequences_logits_are_bit_identical_alone_and_in_any_batch(tiny_llama):
    model = load_target(tiny_llama).model
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (20,), generator=generator).tolist()
    alone = _logits_alone(model, tokens, 12)  # [8, vocab]: positions 12..19
    # The same sequence split into other chunks, batched with short and long neighbours (three or
    # more short feeds take the padded batched-attention path when the mode is off).
    pool = model.new_pool(5, 64)
    ours, *others = [pool.allocate() for _ in range(5)]
    neighbours = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (3, 30, 2, 1)]
    model(torch.tensor(tokens[:5] + neighbours[1]), [5, 30], [ours, others[1]], batch_invariant=True)
    feeds = [tokens[5:12], neighbours[0], neighbours[2]]
    model(torch.tensor(sum(feeds, [])), [len(f) for f in feeds], [ours, others[0], others[2]], batch_invariant=True)
    feeds = [neighbours[3], tokens[12:], neighbours[0][:2]]
    batched = model(torch.tensor(sum(feeds, [])), [len(f) for f in feeds], [others[3], ours, others[0]],
                    batch_invariant=True).logits
    assert torch.equal(batched[1:9], alone)
    # And the mode computes the same model: equal to the fast path up to rounding.
    pool = model.new_pool(1, 64)
    fast = model(torch.tensor(tokens), [20], [pool.allocate()]).logits[12:]
    torch.testing.assert_close(fast, alone, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def invariant_engine_parts(tiny_llama):
    target = load_target(tiny_llama)
    return target, make_drafter(target)


def _random_arrivals(num_jobs: int, seed: int) -> dict[int, list[int]]:
    """Step -> the jobs that arrive at it: a random order over the first 12 steps."""
    rng = random.Random(seed)
    arrivals: dict[int, list[int]] = {}
    for index in rng.sample(range(num_jobs), num_jobs):
        arrivals.setdefault(rng.randrange(0, 12), []).append(index)
    return arrivals


def _run_many(target, drafter, jobs, arrivals: dict[int, list[int]]) -> dict[int, list[int]]:
    """Run `jobs` (index, prompt, params) through one batch-invariant engine, each arriving at
    its step in `arrivals`; returns every job's output tokens."""
    engine = Engine(target, DSparkProposer(drafter), max_batch_size=4, max_batch_tokens=24, max_model_len=128,
                    batch_invariant=True, policy="all")
    by_index = {index: (prompt, params) for index, prompt, params in jobs}
    requests, step = {}, 0
    pending = {s: list(v) for s, v in arrivals.items()}
    while pending or engine.has_unfinished():
        for index in pending.pop(step, []):
            requests[index] = engine.add_request(*by_index[index])
        engine.step()
        step += 1
    return {index: request.output_token_ids for index, request in requests.items()}


def test_engine_outputs_do_not_depend_on_the_batch(invariant_engine_parts):
    target, drafter = invariant_engine_parts
    generator = torch.Generator().manual_seed(1)
    jobs = []
    for i in range(6):
        prompt = torch.randint(0, 1000, (int(torch.randint(2, 40, (1,), generator=generator)),),
                               generator=generator).tolist()
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i, ignore_eos=True)
        jobs.append((prompt, params))
    alone = {i: _run_many(target, drafter, [(i, *jobs[i])], {0: [i]})[i] for i in range(len(jobs))}
    indexed = [(i, *job) for i, job in enumerate(jobs)]
    for order_seed in range(3):
        assert _run_many(target, drafter, indexed, _random_arrivals(len(jobs), order_seed)) == alone, order_seed


def test_batch_invariant_llm_runs_and_rejects_other_backends(tiny_llama):
    llm = LLM(target=tiny_llama, batch_invariant=True)
    out = llm.generate(["Hello there", "A longer prompt about many things"],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    plain = LLM(target=tiny_llama).generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))
    assert len(out[0].token_ids) == 8 and len(out[1].token_ids) == 8
    assert out[0].token_ids == plain[0].token_ids  # the same model, not just a stable one

    class OtherBackend:
        pass

    target = load_target(tiny_llama)
    target.model = OtherBackend()
    with pytest.raises(InvalidRequestError, match="batch_invariant"):
        Engine(target, batch_invariant=True)
