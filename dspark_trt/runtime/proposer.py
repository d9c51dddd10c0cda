"""What the step loop asks of a drafter, and what a drafter gets from it.

The contract, in the order the engine calls it:

    observe(request, features)  after every step that kept positions for `request`: the target
                                features of those positions `[num_kept, num_feature_layers * hidden]`
    propose(requests)           a full `Draft` block per request (the engine cuts it to the
                                verify policy's budget afterwards)
    release(request)            the request finished or was aborted: drop its state

`feature_layers` says which target layers' outputs `observe` receives; `has_confidence` says
whether drafts carry confidences (what the DSpark policies need). A proposer sees the
requests' committed tokens and never writes to them.

Synthetic proposers (tests and benchmarks use them to pin down verification) live here too,
with the helpers both trained proposers share (greedy-or-sample over a draft vocabulary).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from dspark_trt.runtime.request import Request
from dspark_trt.runtime.sampling import coupled_tokens, greedy_tokens, sample


@dataclass
class Draft:
    tokens: list[int]  # [l] proposed continuation after the request's pending token
    probs: torch.Tensor | None = None  # [l, vocab] distributions the tokens were drawn from; None = point masses
    confidences: torch.Tensor | None = None  # [l] calibrated c_k = P(x_k survives | x_1..x_{k-1} did)

    def cut(self, num_tokens: int) -> Draft:
        """The first `num_tokens` tokens (what the verify policy chose to check)."""
        return Draft(self.tokens[:num_tokens], None if self.probs is None else self.probs[:num_tokens],
                     None if self.confidences is None else self.confidences[:num_tokens])


class Proposer(ABC):
    """Base of every drafter the engine runs; the defaults suit a drafter that needs no target features."""

    feature_layers: tuple[int, ...] = ()  # target layers whose outputs `observe` receives
    has_confidence: bool = False  # drafts carry `confidences`
    block_size: int = 1  # tokens per full draft block
    # `observe` only queues features, and a draft first catches up on all it missed since the last
    # (what the profile's `catch_up_seconds_per_position` measures, and the policy charges)
    catches_up: bool = False

    @abstractmethod
    def propose(self, requests: list[Request]) -> list[Draft]:
        """One full draft block per request, in the order given."""

    def observe(self, request: Request, features: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Target features `[num_kept, num_feature_layers * hidden]` of the positions the last step
        kept for `request` (its prompt chunk, or its anchor and accepted drafts)."""

    def release(self, request: Request) -> None:  # noqa: B027 (optional hook)
        """`request` is done: forget its state."""


class CallableProposer(Proposer):
    """Wraps `fn(request) -> Draft` (tests use it for random, perfect and mixed drafts)."""

    def __init__(self, fn: Callable[[Request], Draft], block_size: int = 1):
        self.fn = fn
        self.block_size = block_size

    def propose(self, requests: list[Request]) -> list[Draft]:
        return [self.fn(request) for request in requests]


def draw_tokens(logits: torch.Tensor, requests: list[Request], offset: int, draft_vocab: torch.Tensor,
                choice: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft position for each request, `offset` tokens past its committed ones: logits
    `[N, V_d]` -> chosen ids `[N]` and, when any request's verification reads them
    (`reads_draft_probs`), the distributions `[N, V_d]` they were drawn from (rows of the others
    are computed but unused). A seeded request draws with its own noise at that position
    (`sampling.PositionNoise`; `draft_vocab` `[V_d]` maps draft ids to the target's), all of
    them in one kernel call. `choice`, when given, already holds each row's argmax (it is
    overwritten for the rows that sample, and returned)."""
    choice = greedy_tokens(logits) if choice is None else choice
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not sampled:
        return choice, None
    seeded = [i for i in sampled if requests[i].noise is not None]
    if seeded:
        keys = [requests[i].noise_key(offset) for i in seeded]
        scales = [1.0 / requests[i].params.temperature for i in seeded]  # raw logits: log q up to a shift
        choice[seeded] = torch.tensor(coupled_tokens(logits[seeded].float(), keys, draft_vocab, scales))
    if len(seeded) == len(sampled):
        return choice, None
    temperatures = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in requests])
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    for i in sampled:
        if requests[i].noise is None:
            choice[i] = sample(probs[i], requests[i].generator)
    return choice, probs


def reads_draft_probs(request: Request) -> bool:
    """Whether verification reads a draft's distributions q for `request`: only the rejection rule
    does (a sampled request without a seed); greedy and seeded requests compare tokens, so their
    drafts carry none (`Draft.probs` None) and nothing is spent building them."""
    return not request.params.greedy and request.noise is None


def to_target_vocab(draft_probs: torch.Tensor, draft_vocab: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary distributions `[l, V_d]` -> `[l, vocab]`, zero outside the draft vocabulary
    (verification compares them with the target's, so they must live in its vocabulary)."""
    full = torch.zeros(draft_probs.shape[0], target_vocab_size)
    full[:, draft_vocab] = draft_probs
    return full
