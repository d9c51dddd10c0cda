"""The copy bias (`models/copy_bias.py`): the lookup, the bias it makes, where it may be set.
(That the proposer adds what training adds is `test_dspark_proposer_drafts_what_training_trains`;
the fit is exercised through `dspark-trt calibrate` in `test_training_scale.py`.)"""

import random

import pytest
import torch

from dspark_trt import ModelLoadError
from dspark_trt.models.copy_bias import (NO_CANDIDATE, BlockCopyBias, CopyIndex, batch_copy_candidates,
                                         copy_candidates, dense_copy_bias)
from dspark_trt.models.drafter_config import DrafterConfig


def test_copy_candidates_take_the_most_recent_earlier_match_of_each_length():
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    # q = 7 (..., 5, 6): 6 was last followed by 8 (j = 4), (5, 6) too; (8, 5, 6) never occurred before.
    # q = 3 (7, 5): 5 was followed by 6 (j = 0), (7, 5) never occurred. q = 4 (5, 6): 7 (j = 1), twice.
    assert copy_candidates(tokens, [7, 3, 4], 3) == [[8, 8, NO_CANDIDATE], [6, NO_CANDIDATE, NO_CANDIDATE],
                                                     [7, 7, NO_CANDIDATE]]
    # An occurrence ending at q itself is not earlier: the follower would be the token being predicted.
    assert copy_candidates([1, 1], [1], 2) == [[1, NO_CANDIDATE]]
    assert copy_candidates([1, 2], [0], 2) == [[NO_CANDIDATE, NO_CANDIDATE]]


def test_batch_candidates_are_draft_ids_and_drop_tokens_outside_the_draft_vocabulary():
    tokens = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6, 0, 0]])  # padded row
    positions = torch.tensor([[[7, 4]]])  # one anchor, two slots
    to_draft = torch.full((20,), 3)  # draft vocabulary: target 7 -> 0, 8 -> 1, 6 -> 2; the rest outside (3)
    to_draft[7], to_draft[8], to_draft[6] = 0, 1, 2
    found = batch_copy_candidates(tokens, positions, to_draft, 3)
    assert found.tolist() == [[[[1, 1, NO_CANDIDATE], [0, 0, NO_CANDIDATE]]]]
    to_draft[8] = 3  # 8 leaves the draft vocabulary: no candidate, not a wrong one
    assert batch_copy_candidates(tokens, positions, to_draft, 3)[0, 0, 0].tolist() == [NO_CANDIDATE] * 3


def test_dense_bias_adds_up_when_two_lengths_name_the_same_token():
    alpha = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    candidates = torch.tensor([[[3, 3, NO_CANDIDATE], [0, 2, 1]]])  # [1, gamma = 2, N = 3]
    bias = dense_copy_bias(alpha, candidates, 5)
    assert bias.tolist() == [[[0, 0, 0, 3.0, 0], [0.5, 8.0, 0.25, 0, 0]]]


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_answers_what_the_batch_lookup_answers(seed):
    """A request's `CopyIndex`, grown as tokens are committed, and the block's own pairs, as the
    proposer drafts slot after slot, give each slot the candidates `copy_candidates` gives at the
    same position of the finished sequence: the step loop and training see the same bias."""
    rng = random.Random(seed)
    committed = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]  # a small vocabulary: many repeats
    block = [rng.randrange(6) for _ in range(5)]
    index = CopyIndex(4)
    for start in range(0, len(committed), 7):  # committed a few tokens at a time
        index.extend(committed[start : start + 7])
    pairs, tail = index.block_pairs(), committed[-4:]
    full = committed + block
    for k, token in enumerate(block):
        q = len(committed) - 1 + k  # where slot k's previous token sits
        assert index.candidates(tail, pairs) == copy_candidates(full, [q], 4)[0], (committed, block, k)
        index.add_block_pair(pairs, tail, token)
        tail = (tail + [token])[-4:]
    assert index.tokens == committed  # the block's tokens stay out of the request's own lookup


def test_block_copy_bias_adds_the_fitted_weights_to_each_requests_row():
    """Two requests drafted together: each row gets its own candidates' weights, in draft ids,
    and a candidate outside the draft vocabulary adds nothing."""
    alpha = [[1.0, 10.0], [2.0, 20.0]]
    first, second = CopyIndex(2), CopyIndex(2)
    first.extend([4, 5, 4])  # 4 -> 5: slot 1 of the first request copies 5 (n = 1 only: (5, 4) is new)
    second.extend([7, 9, 7])  # 7 -> 9, but 9 is outside the draft vocabulary
    to_draft = [6] * 10
    to_draft[4], to_draft[5], to_draft[7] = 0, 1, 2
    copy = BlockCopyBias(alpha, [first, second], to_draft, 6)
    logits = torch.zeros(2, 6)
    copy.add_to(logits, 0)
    assert logits.tolist() == [[0, 1.0, 0, 0, 0, 0], [0] * 6]
    copy.advance([5, 7])  # slot 1 drew 5 and 7
    logits = torch.zeros(2, 6)
    copy.add_to(logits, 1)  # slot 2's weights
    # First: 5 and (4, 5) were both followed by 4. Second: 7 was last followed by 7, the draft token
    # itself (a pair made inside the block), and (7, 7) is new.
    assert logits.tolist() == [[2.0 + 20.0, 0, 0, 0, 0, 0], [0, 0, 2.0, 0, 0, 0]]
    block = torch.zeros(2, 3, 6)  # the proposer's slot view [N, V] of its block's logits: strided
    copy.found.pop()
    copy.add_to(block[:, 1], 1)
    assert block[:, 1].tolist() == logits.tolist() and not block[:, [0, 2]].any()
    copy.found.pop()
    doubled = torch.zeros(2, 6, dtype=torch.float64)
    copy.add_to(doubled, 1)  # other dtypes take index_put_
    assert doubled.tolist() == logits.tolist()


def test_config_refuses_a_copy_bias_or_confidence_offsets_of_the_wrong_shape_or_kind():
    base = dict(block_size=2, kind="dspark")
    assert DrafterConfig(**base, copy_bias=[[1.0, 2.0], [3.0, 4.0]]).copy_ngram == 2
    assert DrafterConfig(**base).copy_ngram == 0
    for bad in ([[1.0, 2.0]], [[1.0, 2.0], [3.0]], [[], []]):
        with pytest.raises(ModelLoadError, match="copy_bias must be 2 rows"):
            DrafterConfig(**base, copy_bias=bad)
    for bad in ([[1.0, 2.0], [3.0, 4.0]], [[1.0], [2.0]]):  # without a copy bias; not its shape
        with pytest.raises(ModelLoadError, match="copy_confidence must have copy_bias's shape"):
            DrafterConfig(**base, copy_bias=[[1.0, 2.0]] * 2 if len(bad[0]) == 1 else [], copy_confidence=bad)
    with pytest.raises(ModelLoadError, match="one weight per slot"):
        DrafterConfig(**base, confidence_top_prob=[1.0, 2.0, 3.0])
    with pytest.raises(ModelLoadError, match="not a eagle3 drafter"):
        DrafterConfig(kind="eagle3", block_size=2, copy_bias=[[1.0], [1.0]])


def test_top_probability_logit_is_the_logit_of_the_largest_probability_and_stays_finite():
    from dspark_trt.models.drafter import top_probability_logit

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [80.0, 0.0, 0.0, 0.0]])
    top = torch.softmax(logits, -1).max(-1).values
    got = top_probability_logit(logits)
    assert torch.allclose(got[:2], torch.log(top[:2] / (1 - top[:2])), atol=1e-5)  # 1/4 -> log(1/3)
    assert torch.isfinite(got[2]) and got[2] > 10  # p = 1 - 1e-34: large, not inf


def test_top_probability_logit_is_accurate_near_one():
    # A strong copy bias puts p_top within 1e-4 of 1; there `max - logsumexp` then log1p(-exp(.))
    # in fp32 cancels to ~1e-3 of noise in the confidence (ONNX Runtime and PyTorch disagreed). The
    # fp32 result must match the float64 truth to fp32 accuracy.
    from dspark_trt.models.drafter import TOP_PROBABILITY_LOGIT_CAP, top_probability_logit

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8192, generator=generator)
    logits[torch.arange(64), torch.arange(64)] += torch.linspace(5.0, 22.0, 64)  # p_top from ~0.02 to ~1 - 1e-6
    exact = logits.double().log_softmax(-1).max(-1).values
    exact = (exact - torch.log(-torch.expm1(exact))).clamp(max=TOP_PROBABILITY_LOGIT_CAP)
    assert (top_probability_logit(logits).double() - exact).abs().max() < 1e-5


@pytest.mark.parametrize("seed", range(6))
def test_the_tensor_lookup_answers_what_the_runtime_lookup_answers(seed):
    """`right_aligned_history` + `sequence_copy_candidates` + `draft_copy_candidates` (the tensor
    ops the exported drafter graph runs) give every slot of a batched block what the runtime's
    `BlockCopyBias` (`CopyIndex` with the block's own pairs) gives: histories of different lengths
    (padding of arbitrary values), many repeats, in-block pairs and followers outside the draft
    vocabulary; and `add_copy_bias` adds what `add_to` adds."""
    from dspark_trt.models.copy_bias import (add_copy_bias, draft_copy_candidates, right_aligned_history,
                                             sequence_copy_candidates)

    rng = random.Random(seed)
    max_ngram, gamma, vocab_size, batch = rng.randrange(1, 5), 5, 6, 4
    to_draft = [vocab_size] * 9  # target ids 0..8: 5 or 6 of them have draft ids, the others are outside
    for draft_id, token in enumerate(rng.sample(range(9), vocab_size - 1) if seed % 2 else range(vocab_size)):
        to_draft[token] = draft_id
    histories = [[rng.randrange(9) for _ in range(rng.randrange(0, 25))] for _ in range(batch)]
    anchors = [rng.randrange(9) for _ in range(batch)]
    blocks = [[rng.randrange(9) for _ in range(gamma)] for _ in range(batch)]  # repeats: in-block pairs
    width = max(1, max(map(len, histories)))
    tokens = torch.tensor([h + [rng.randrange(100)] * (width - len(h)) for h in histories])
    sequence = right_aligned_history(tokens, torch.tensor([len(h) for h in histories]), torch.tensor(anchors))
    indexes = []
    for history, anchor in zip(histories, anchors):
        indexes.append(CopyIndex(max_ngram))
        indexes[-1].extend(history + [anchor])
    alpha = [[rng.uniform(-2, 5) for _ in range(max_ngram)] for _ in range(gamma)]
    runtime = BlockCopyBias(alpha, indexes, to_draft, vocab_size)
    for k in range(gamma):
        logits = torch.randn(batch, vocab_size)
        want_logits = logits.clone()
        runtime.add_to(want_logits, k)
        got = draft_copy_candidates(sequence_copy_candidates(sequence, max_ngram), torch.tensor(to_draft), vocab_size)
        assert got.tolist() == torch.tensor(runtime.found[-1]).view(batch, max_ngram).tolist(), (seed, k)
        assert torch.equal(add_copy_bias(logits, torch.tensor(alpha[k]), got), want_logits)
        drawn = [block[k] for block in blocks]
        runtime.advance(drawn)
        sequence = torch.cat([sequence, torch.tensor(drawn)[:, None]], dim=1)
    found = runtime.candidates()
    assert (found != NO_CANDIDATE).any() and (found == NO_CANDIDATE).any()  # not vacuous either way


def test_the_tensor_lookup_is_the_batch_lookup_at_the_last_position():
    """The worked example of `copy_candidates`, as one right-aligned row among shorter ones."""
    from dspark_trt.models.copy_bias import sequence_copy_candidates

    rows = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6], [-1, -1, -1, -1, -1, -1, 1, 1], [-1] * 7 + [4]])
    assert sequence_copy_candidates(rows, 3).tolist() == [
        copy_candidates([5, 6, 7, 5, 6, 8, 5, 6], [7], 3)[0], [1, NO_CANDIDATE, NO_CANDIDATE], [NO_CANDIDATE] * 3]
