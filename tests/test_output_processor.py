"""Incremental detokenisation equals decoding the whole output, on the real SmolLM2 tokenizer,
whatever the chunks tokens are committed in (speculative steps commit several at once), for
multi-byte characters split across tokens, special tokens and random id sequences; stop
strings end the text exactly where decoding everything at each token would."""

import random

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_trt.runtime.output_processor import OutputProcessor
from dspark_trt.runtime.request import FinishReason, Request
from dspark_trt.runtime.sampling import SamplingParams

TEXTS = [
    "Hello, world! The answer is 42.",
    "Émilie a mangé 3 crêpes — très bon. 日本語のテキストも大丈夫です。",
    "Emoji: 🚀🔥👍🏽 and a flag 🇫🇷, then math: ∑ᵢ xᵢ² ≤ ∞.",
    "def f(x):\n    return {'a': x ** 2}  # 한국어 주석\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_folder):
    return transformers.AutoTokenizer.from_pretrained(default_folder)


def run(tokenizer, ids: list[int], chunks: list[int], params: SamplingParams, eos=frozenset()) -> Request:
    processor = OutputProcessor(tokenizer, set(eos), context_length=10_000)
    request = Request("r", [1], params, torch.Generator())
    position = 0
    for size in chunks:
        if request.finished or position >= len(ids):
            break
        position += processor.commit(request, ids[position : position + size])
    return request


def chunking(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.randint(1, 8))
    return sizes


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_the_whole_decode(tokenizer, text, seed):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    request = run(tokenizer, ids, chunking(rng, len(ids)), SamplingParams(max_tokens=len(ids)))
    assert request.finish_reason == FinishReason.LENGTH
    assert request.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=40), st.integers(0, 2**31))
def test_random_ids_with_special_tokens_and_broken_bytes(tokenizer, ids, seed):
    """Arbitrary ids (special tokens, lone UTF-8 continuation bytes...) still decode as a whole
    decode does, and the text so far is always a prefix of the final text."""
    special = tokenizer.all_special_ids
    ids = [special[i % len(special)] if i % 7 == 0 else i for i in ids]
    rng = random.Random(seed)
    processor = OutputProcessor(tokenizer, set(), context_length=10_000)
    request = Request("r", [1], SamplingParams(max_tokens=len(ids)), torch.Generator())
    seen, position = [], 0
    for size in chunking(rng, len(ids)):
        if position >= len(ids):
            break
        position += processor.commit(request, ids[position : position + size])
        seen.append(request.output_text)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert request.output_text == final
    assert all(final.startswith(text) for text in seen)


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_cut_where_whole_decoding_would(tokenizer, seed):
    text = TEXTS[1] + " " + TEXTS[2]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    stop = text[rng.randint(5, len(text) - 4):][:2]
    request = run(tokenizer, ids, chunking(rng, len(ids)), SamplingParams(max_tokens=len(ids), stop=[stop]))
    # The reference: decode everything after every token and cut at the first stop.
    expected, count = None, 0
    for count in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:count], skip_special_tokens=True)
        if stop in whole:
            expected = whole[: whole.find(stop)]
            break
    assert request.finish_reason == FinishReason.STOP
    assert request.output_text == expected and len(request.output_token_ids) == count


def test_eos_ends_the_request_and_its_text(tokenizer):
    ids = tokenizer(TEXTS[0], add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    request = run(tokenizer, ids[:3] + [eos] + ids[3:], [2, 5], SamplingParams(max_tokens=50), eos={eos})
    assert request.finish_reason == FinishReason.STOP and request.output_token_ids == ids[:3] + [eos]
    assert request.output_text == tokenizer.decode(ids[:3], skip_special_tokens=True)
