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
