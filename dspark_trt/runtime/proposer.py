"""What the step loop asks of a drafter: a `Draft` block per request.

A proposer sees the running requests (their committed tokens) and returns, for each, the
draft tokens to verify this step and, for sampled drafting, the distributions they were drawn
from. Synthetic proposers (used in tests and benchmarks to pin down verification) live here
too; the trained drafters implement the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dspark_trt.runtime.request import Request


@dataclass
class Draft:
    tokens: list[int]  # [l] proposed continuation after the request's pending token
    probs: torch.Tensor | None = None  # [l, vocab] distributions the tokens were drawn from; None = point masses


class Proposer(Protocol):
    def propose(self, requests: list[Request]) -> list[Draft]: ...


class CallableProposer:
    """Wraps `fn(request) -> Draft` (tests use it for random, perfect and mixed drafts)."""

    def __init__(self, fn: Callable[[Request], Draft]):
        self.fn = fn

    def propose(self, requests: list[Request]) -> list[Draft]:
        return [self.fn(request) for request in requests]
