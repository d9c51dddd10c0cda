"""The ahead-of-time SequentialDraft kernel (`plugins/sequential_draft_kernel.cu`): built by nvcc to
the PTX TensorRT embeds where nvcc exists, and built for the host from the same source and held to
the torch reference (`sequential_draft.reference`) on CPU, for every head, with and without the
confidence head, the copy bias, the top-probability offset, greedy and sampled rows."""

from __future__ import annotations

import shutil

import pytest
import torch

from dspark_trt.plugins import sequential_draft as sd
from dspark_trt.plugins import sequential_draft_kernel as kernel


def make_inputs(head: int, confidence: bool, copy_ngram: int, top_prob: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch, block, vocab, hidden, rank, target_vocab, history_length = 5, 4, 97, 12, 6, 140, 10

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=generator) * std

    draft_vocab = torch.randperm(target_vocab, generator=generator)[:vocab]
    to_draft = torch.full((target_vocab,), vocab, dtype=torch.long)
    to_draft[draft_vocab] = torch.arange(vocab)
    # right-aligned histories with left padding, built from a few tokens so that n-grams repeat
    history = torch.full((batch, history_length), sd_no_candidate(), dtype=torch.long)
    for b in range(batch):
        length = history_length - b
        pool = draft_vocab[:6] if b % 2 == 0 else torch.randint(0, target_vocab, (6,), generator=generator)
        history[b, history_length - length :] = pool[torch.randint(0, 6, (length,), generator=generator)]
    anchors = to_draft[history[:, -1]].clamp(max=vocab)  # the anchor's draft id (V: outside)
    inputs = dict(
        logits=randn(batch, block, vocab, std=3.0), hidden=randn(batch, block, hidden), anchor_ids=anchors,
        w1=randn(vocab + 1, rank), w2=randn(rank, vocab, std=0.5),
        gru_w_ih=randn(3 * rank, rank + hidden, std=0.3), gru_w_hh=randn(3 * rank, rank, std=0.3),
        gru_b_ih=randn(3 * rank, std=0.1), gru_b_hh=randn(3 * rank, std=0.1),
        conf_w=randn(hidden + rank, std=0.3), conf_b=randn(1), conf_inv_temps=torch.tensor([0.5, 1.0, 2.0, 1.5]),
        temperatures=torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3]), uniforms=torch.rand(batch, block, generator=generator),
        history=history, draft_vocab=draft_vocab, to_draft=to_draft,
        copy_alpha=randn(block, max(copy_ngram, 1)).abs() * 4, copy_beta=randn(block, max(copy_ngram, 1)),
        top_prob_w=randn(block))
    attributes = dict(head=head, has_confidence=int(confidence), copy_ngram=copy_ngram,
                      copy_confidence=int(copy_ngram > 0), top_prob=int(top_prob))
    return inputs, attributes


def sd_no_candidate() -> int:
    from dspark_trt.models.copy_bias import NO_CANDIDATE

    return NO_CANDIDATE


CASES = [(head, confidence, copy_ngram, top_prob)
         for head in (sd.HEAD_NONE, sd.HEAD_MARKOV, sd.HEAD_RNN)
         for confidence, copy_ngram, top_prob in ((False, 0, False), (True, 0, False), (True, 3, True))]


@pytest.mark.parametrize("head, confidence, copy_ngram, top_prob", CASES)
def test_the_kernel_computes_the_reference_on_the_host(head, confidence, copy_ngram, top_prob):
    for seed in range(3):
        inputs, attributes = make_inputs(head, confidence, copy_ngram, top_prob, seed)
        expected = sd.reference(*inputs.values(), **attributes)
        got = kernel.run_on_host(*inputs.values(), **attributes)
        ids, probs, confidences, distributions = got
        assert torch.equal(ids, expected[0]), (seed, ids, expected[0])  # every row, greedy and sampled
        torch.testing.assert_close(distributions, expected[3], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(probs, expected[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(confidences, expected[2], rtol=1e-5, atol=1e-6)


def test_the_copy_bias_matters_in_these_cases():
    """The cases above would pass vacuously if no copy candidate were ever found: they are."""
    inputs, attributes = make_inputs(sd.HEAD_MARKOV, True, 3, False)
    without = kernel.run_on_host(*inputs.values(), **{**attributes, "copy_ngram": 0, "copy_confidence": 0})
    with_copy = kernel.run_on_host(*inputs.values(), **attributes)
    assert not torch.equal(without[3], with_copy[3])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_nvcc_builds_the_ptx_tensorrt_embeds():
    ptx = kernel.ptx()
    assert f".visible .entry {kernel.KERNEL_NAME}(" in ptx
    assert ".target sm_75" in ptx  # the oldest architecture it runs on; the driver compiles it for the GPU
    threads, shared = kernel.launch_shape(rank=16)
    assert threads == kernel.THREADS and shared == 4 * (2 * threads + 8 * 16 + kernel.MAX_NGRAM + 4)


def test_copy_ngrams_past_the_kernels_bound_export_without_the_plugin():
    from types import SimpleNamespace

    from dspark_trt.builder.export_drafter import plugin_supported

    assert plugin_supported(SimpleNamespace(prefix_layer=False, copy_ngram=kernel.MAX_NGRAM))
    assert not plugin_supported(SimpleNamespace(prefix_layer=False, copy_ngram=kernel.MAX_NGRAM + 1))
