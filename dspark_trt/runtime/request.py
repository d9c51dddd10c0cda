"""One generation request as it moves through the step loop.

A request's tokens live in three places: `prompt_token_ids` (given), `output_token_ids`
(committed), and its `KVCache`, which holds every token but the last committed one: that
`pending_token` is fed at the next step as the *anchor* of the draft block, and its logits
verify the draft. `RequestStats` counts what speculation did for this request.

A request carries what it asked for and what it has committed (with the logprobs of what it
committed, when asked for, and a seeded request's per-position noise, which is part of what it
asked for); what a step computed for it (logits, target features) travels as arguments
(`engine.StepOutput`, `Proposer.observe`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from dspark_trt.models.kv_cache import KVCache
from dspark_trt.runtime.logprobs import TokenLogprob
from dspark_trt.runtime.sampling import PositionNoise, SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


@dataclass
class AcceptanceCounts:
    """Per draft slot: how often it was verified and how often accepted (a request's, or the engine's total)."""

    drafted_per_position: list[int] = field(default_factory=list)  # [k] = times draft slot k+1 was verified
    accepted_per_position: list[int] = field(default_factory=list)  # [k] = times draft slot k+1 was accepted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for k in range(num_drafted):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += int(k < num_accepted)

    def add(self, other: AcceptanceCounts) -> None:
        """Add another's counts slot by slot (totals over requests)."""
        for name in ("drafted_per_position", "accepted_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for k, count in enumerate(theirs):
                mine[k] += count

    def conditional_acceptance(self, num_positions: int) -> list[float]:
        """[k] = P(slot k+1 accepted | slots 1..k were), as `accepted_{k+1} / accepted_k` (slot 1:
        over the times it was verified): the paper's figure 2."""
        conditional, reached = [], self.drafted_per_position[0] if self.drafted_per_position else 0
        for k in range(num_positions):
            count = self.accepted_per_position[k] if k < len(self.accepted_per_position) else 0
            conditional.append(count / reached if reached else 0.0)
            reached = count
        return conditional


@dataclass
class RequestStats(AcceptanceCounts):
    num_steps: int = 0  # target verification steps after prefill
    num_draft_tokens: int = 0  # draft tokens sent to verification
    num_accepted_tokens: int = 0  # draft tokens accepted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        super().record(num_drafted, num_accepted)

    @property
    def accept_length(self) -> float:
        """tau: tokens committed per verification step, counting the bonus/corrected token."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 1.0

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accept_length": self.accept_length,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    cache: KVCache | None = None  # a KV-pool slot while running
    output_token_ids: list[int] = field(default_factory=list)
    num_prompt_computed: int = 0  # prompt tokens already in the cache (chunked prefill)
    finish_reason: FinishReason | None = None
    output_text: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    # With params.logprobs: one per output token. With params.prompt_logprobs: one per prompt token,
    # None for the first (nothing precedes it).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    noise: PositionNoise | None = None  # a seeded sampled request's per-position noise keys (sampling.py)

    def noise_key(self, offset: int) -> int | None:
        """The noise key of the output position `offset` tokens past the committed ones (None: not seeded)."""
        return None if self.noise is None else self.noise.key(len(self.output_token_ids) + offset)

    @property
    def in_prefill(self) -> bool:
        return self.num_prompt_computed < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_token(self) -> int:
        """The last committed token: not yet in the cache, it anchors the next draft block."""
        return self.output_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def metrics(self) -> dict:
        """What a finished request reports (API outputs, stream ends): its speculation stats and token counts."""
        return {**self.stats.as_dict(), "prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": len(self.output_token_ids)}
