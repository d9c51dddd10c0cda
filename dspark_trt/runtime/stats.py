"""What the engine counts: one step's figures (`StepStats`) and totals since start (`EngineCounters`).

The server's gauges, Prometheus counters and the benchmarks read these; nothing in the step
loop decides anything from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_trt.runtime.request import AcceptanceCounts, FinishReason


@dataclass
class StepStats:
    """What one step did."""

    num_running: int = 0
    num_waiting: int = 0
    num_decoding: int = 0
    num_drafting: int = 0  # requests the drafter ran for (0 when the policy skipped drafting)
    batch_tokens: int = 0  # tokens the target processed (prefill chunks included)
    verify_budget: int = 0  # draft tokens sent to verification, summed over requests
    admitted_prompt_tokens: int = 0  # prompt tokens of the requests admitted this step
    scheduler_seconds: float = 0.0  # the verify policy's own time
    drafter_seconds: float = 0.0
    step_seconds: float = 0.0

    @property
    def decoding_only(self) -> bool:
        """Whether the step decoded and nothing else: no prompt chunk among its tokens."""
        return bool(self.num_decoding) and self.batch_tokens == self.num_decoding + self.verify_budget


@dataclass
class EngineCounters(AcceptanceCounts):
    """Totals since start (per draft slot too, from `AcceptanceCounts`)."""

    num_steps: int = 0
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    scheduler_seconds: float = 0.0
    step_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    def record_finish(self, reason: FinishReason) -> None:
        self.finished[reason.value] = self.finished.get(reason.value, 0) + 1

    def record_verification(self, num_verified: int, num_accepted: int) -> None:
        if num_verified == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        self.record(num_verified, num_accepted)

    def record_step(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.num_prompt_tokens += stats.admitted_prompt_tokens
        self.scheduler_seconds += stats.scheduler_seconds
        self.step_seconds += stats.step_seconds
