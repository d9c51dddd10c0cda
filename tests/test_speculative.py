"""Speculative decoding with synthetic drafts is exactly plain decoding (greedy), and keeps the
target distribution (sampled)."""

import json

import pytest
import torch
from scipy.stats import chisquare

from dspark_trt import LLM, SamplingParams
from dspark_trt.runtime.engine import Engine
from dspark_trt.runtime.proposer import CallableProposer, Draft

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "Paris is the capital of"]
BLOCK = 5


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(target=tiny_llama)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    return {tuple(o.prompt_token_ids): o.token_ids for o in outputs}


def random_wrong(vocab: int):
    generator = torch.Generator().manual_seed(7)
    return lambda request: Draft(torch.randint(0, vocab, (BLOCK,), generator=generator).tolist())


def perfect(plain_outputs):
    def propose(request):
        continuation = plain_outputs[tuple(request.prompt_token_ids)]
        done = len(request.output_token_ids)
        return Draft(continuation[done : done + BLOCK])
    return propose


def mixed(plain_outputs, vocab: int):
    """Right for a random number of tokens, then wrong: every acceptance length occurs."""
    generator = torch.Generator().manual_seed(3)

    def propose(request):
        right = perfect(plain_outputs)(request).tokens
        keep = int(torch.randint(0, BLOCK + 1, (1,), generator=generator))
        wrong = [(t + 1) % vocab for t in right[keep:]]
        return Draft(right[:keep] + wrong)
    return propose


@pytest.mark.parametrize("kind", ["random_wrong", "perfect", "mixed"])
def test_greedy_speculative_output_equals_plain_output(tiny_llama, plain, kind):
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    proposer = {"random_wrong": lambda: random_wrong(vocab), "perfect": lambda: perfect(plain),
                "mixed": lambda: mixed(plain, vocab)}[kind]()
    llm = LLM(target=tiny_llama, drafter=CallableProposer(proposer))
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for output in outputs:
        assert output.token_ids == plain[tuple(output.prompt_token_ids)]
        m = output.metrics
        assert m["num_steps"] >= 1 and m["num_draft_tokens"] >= m["num_accepted_tokens"]
        if kind == "perfect":  # every draft accepted: 1 + BLOCK tokens a step (the last may be cut)
            assert m["num_accepted_tokens"] == m["num_draft_tokens"]
            assert m["accept_length"] > BLOCK
        if kind == "random_wrong":
            assert m["accept_length"] < 1.2
    if kind == "mixed":
        total = outputs[0].metrics
        assert 1.5 < total["accept_length"] < BLOCK + 1


def test_sampled_speculative_decoding_keeps_the_target_distribution(tiny_llama):
    """Joint distribution of the first two generated tokens (the second is always drafted),
    with an adversarial sampled drafter, against the target's own probabilities."""
    llm = LLM(target=tiny_llama, max_batch_size=64)
    vocab = llm.target.config.vocab_size
    prompt = llm.encode("Once upon a time")
    top_k = 3
    params = [SamplingParams(max_tokens=3, temperature=6.0, top_k=top_k, seed=s, ignore_eos=True) for s in range(1000)]

    first = target_probs_after(llm, prompt, params[0])
    support = first.nonzero().flatten().tolist()
    expected = {}  # (t1, t2) -> probability
    for t1 in support:
        second = target_probs_after(llm, prompt + [t1], params[0])
        for t2 in second.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(first[t1] * second[t2])

    # The drafter favours the likeliest second token (so drafts do get accepted), and puts 30%
    # on a token the target never samples.
    second_mass = {}
    for (_, t2), prob in expected.items():
        second_mass[t2] = second_mass.get(t2, 0.0) + prob
    favourite = max(second_mass, key=second_mass.get)
    junk = next(t for t in range(vocab) if all(t != a and t != b for a, b in expected))
    draft_probs = torch.zeros(2, vocab)
    draft_probs[:, favourite] = 0.7
    draft_probs[:, junk] = 0.3
    generator = torch.Generator().manual_seed(1)

    def propose(request):
        tokens = [int(torch.multinomial(draft_probs[k], 1, generator=generator)) for k in range(2)]
        return Draft(tokens, draft_probs)

    llm.engine = Engine(llm.target, CallableProposer(propose))  # verify-all with the synthetic drafts
    outputs = llm.generate([prompt] * len(params), params)
    pairs = [tuple(o.token_ids[:2]) for o in outputs]
    assert all(pair in expected for pair in pairs), "sampled a pair the target gives zero probability"
    assert sum(o.metrics["num_accepted_tokens"] for o in outputs) > 100  # the drafts did get accepted
    cells = sorted(expected)
    observed = [pairs.count(cell) for cell in cells]
    probs = torch.tensor([expected[c] for c in cells], dtype=torch.float64)
    assert chisquare(observed, (probs / probs.sum() * len(pairs)).numpy()).pvalue > 1e-4


def target_probs_after(llm, tokens, params) -> torch.Tensor:
    from dspark_trt.runtime.sampling import target_probs

    pool = llm.target.model.new_pool(1, 64)
    logits = llm.target.model(torch.tensor(tokens), [len(tokens)], [pool.allocate()],
                              torch.tensor([len(tokens) - 1])).logits
    return target_probs(logits, params)[0].double()


def test_a_stop_inside_accepted_drafts_ends_cleanly(tiny_llama, plain):
    """A stop string completed by an accepted draft token ends the request mid-commit: the kept
    positions outnumber the committed tokens, so the drafter must not be fed that step (an EAGLE
    drafter would find no token for its last position)."""

    class Recording(CallableProposer):
        def observe(self, request):
            assert not request.finished, "observe() on a finished request"

    prompt, continuation = next(iter(plain.items()))
    llm = LLM(target=tiny_llama, drafter=Recording(perfect(plain)))
    free = llm.tokenizer.decode(list(continuation), skip_special_tokens=True)
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    expected = LLM(target=tiny_llama).generate(list(prompt), params)[0]
    output = llm.generate(list(prompt), params)[0]
    assert output.finish_reason == "stop" and output.text == expected.text
