"""Our forward pass against transformers on the same checkpoint (fp32)."""

import pytest
import torch

from dspark_trt.models.loading import load_target

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def reference_logits(folder, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def assert_close(ours: torch.Tensor, reference: torch.Tensor):
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_full_prefill_matches_transformers(tiny_factory, architecture):
    folder = tiny_factory(architecture)
    target = load_target(folder)
    tokens = torch.randint(0, target.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = target.model.new_pool(2, 64)
    ours = target.model(torch.tensor(tokens), [len(tokens)], [pool.allocate()]).logits
    assert_close(ours, reference_logits(folder, tokens))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_ragged_batch_chunks_and_decode_match_transformers(tiny_factory, architecture):
    """Five requests of different lengths, fed as chunks, single tokens and small blocks in one
    batch (so both the per-request and the batched attention paths run)."""
    folder = tiny_factory(architecture)
    target = load_target(folder)
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, target.config.vocab_size, (n,), generator=gen).tolist() for n in (50, 9, 33, 12, 7)]
    pool = target.model.new_pool(8, 64)
    caches = [pool.allocate() for _ in sequences]
    collected = [[] for _ in sequences]
    fed = [0] * len(sequences)
    # Each round, request r feeds a different amount: long chunks for some, 1-3 tokens for others.
    schedule = [[40, 1, 20, 3, 2], [1, 2, 5, 1, 1], [4, 3, 8, 8, 4], [5, 3, 0, 0, 0]]
    for amounts in schedule:
        tokens, counts, active = [], [], []
        for r, amount in enumerate(amounts):
            amount = min(amount, len(sequences[r]) - fed[r])
            if amount:
                tokens += sequences[r][fed[r] : fed[r] + amount]
                counts.append(amount)
                active.append(r)
        logits = target.model(torch.tensor(tokens), counts, [caches[r] for r in active]).logits
        for r, chunk in zip(active, logits.split(counts)):
            collected[r].append(chunk)
            fed[r] += chunk.shape[0]
    assert fed == [len(s) for s in sequences]
    for r, sequence in enumerate(sequences):
        assert_close(torch.cat(collected[r]), reference_logits(folder, sequence))


def test_rollback_and_re_extend_matches_transformers(tiny_llama):
    target = load_target(tiny_llama)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, target.config.vocab_size, (20,), generator=gen).tolist()
    rejected = torch.randint(0, target.config.vocab_size, (6,), generator=gen).tolist()
    replacement = torch.randint(0, target.config.vocab_size, (9,), generator=gen).tolist()
    pool = target.model.new_pool(4, 64)
    cache = pool.allocate()
    other = pool.allocate()  # a neighbour in the batch, so the batched path runs too
    third = pool.allocate()
    target.model(torch.tensor(prefix), [20], [cache])
    target.model(torch.tensor(rejected + [5, 6, 7]), [6, 2, 1], [cache, other, third])
    cache.truncate(20 + 2)  # keep two of the six "draft" tokens
    kept = prefix + rejected[:2]
    logits = target.model(torch.tensor(replacement), [len(replacement)], [cache]).logits
    reference = reference_logits(tiny_llama, kept + replacement)
    assert_close(logits, reference[len(kept):])


def test_logits_indices_and_features(tiny_llama):
    """Logits at chosen positions only; features are transformers' hidden_states[i + 1]."""
    from transformers import AutoModelForCausalLM

    target = load_target(tiny_llama)
    tokens = list(range(100, 130))
    pool = target.model.new_pool(1, 64)
    out = target.model(torch.tensor(tokens), [30], [pool.allocate()], torch.tensor([4, 29]), feature_layers=(2, 0))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([tokens]), output_hidden_states=True)
    assert_close(out.logits, ref.logits[0, [4, 29]])
    expected = torch.cat([ref.hidden_states[3][0], ref.hidden_states[1][0]], dim=-1)
    assert out.features.shape == (30, 2 * target.config.hidden_size)
    assert (out.features - expected).abs().max() <= 1e-3


def test_llama3_rope_scaling_matches_transformers(tiny_factory):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    folder = tiny_factory("llama", rope_parameters=scaling)
    target = load_target(folder)
    assert target.config.rope_scaling is not None
    tokens = list(range(200, 260))
    pool = target.model.new_pool(1, 64)
    ours = target.model(torch.tensor(tokens), [60], [pool.allocate()]).logits
    assert_close(ours, reference_logits(folder, tokens))


def test_kv_slot_overflow_is_refused(tiny_llama):
    target = load_target(tiny_llama)
    pool = target.model.new_pool(1, 8)
    with pytest.raises(ValueError, match="overflow"):
        target.model(torch.arange(9), [9], [pool.allocate()])
