"""Latency profile: how long a target step and a drafter step take on *this* machine.

The verification scheduler maximises expected committed tokens per second, so it needs the
step time of the target as a function of the batch tokens it verifies (`B = sum_r (1 + l_r)`)
and of the drafter as a function of the number of requests it drafts for. Both are measured,
never modelled: the curve is jagged (SIMD widths, cache sizes, kernel choices), and a jump
in it is exactly what the scheduler should exploit.

`profile.json` (DESIGN.md section 4):

    {"backend": "...", "device": "...",
     "target":  {"batch_tokens": [1, 2, 4, ...], "step_seconds": [...]},
     "drafter": {"num_requests": [1, 2, 4, ...], "step_seconds": [...],
                 "catch_up_seconds_per_position": ...}}

A drafter step's curve is timed with `KEPT_PER_STEP` new positions per request, what a request
that drafted last step brings; one that has not drafted for a while first catches up on every
position since (its prompt, if it never drafted): `catch_up_seconds_per_position` is what each
further position adds (measured; 0 in profiles written before it was).

Between measured points step time is interpolated linearly; past the last point it is
extrapolated along the last segment (never below the last value).

This module measures and looks up; it does not decide anything (see `verify_policy.py`).
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.device import device_name

PROFILE_FORMAT_KEYS = ("backend", "device", "target", "drafter")


def _powers_of_two(limit: int) -> list[int]:
    values, v = [], 1
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


def torch_backend_name(device: torch.device, weight_dtype: torch.dtype) -> str:
    """The profile's `backend` for the PyTorch target: `torch-cpu` (fp32), `torch-cpu-bfloat16`, ...
    A step's cost depends on both, so a profile is only valid for the pair it was measured with."""
    from dspark_trt.models.linear import dtype_name

    suffix = "" if weight_dtype == torch.float32 else "-" + dtype_name(weight_dtype)
    return f"torch-{torch.device(device).type}{suffix}"


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    if not xs:
        return 0.0
    if x <= xs[0]:
        return ys[0]
    i = bisect_left(xs, x)
    if i < len(xs):
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    else:  # extrapolate along the last segment
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
    slope = (y1 - y0) / (x1 - x0)
    value = y0 + slope * (x - x0)
    return max(value, ys[-1]) if x > xs[-1] else value


@dataclass
class LatencyProfile:
    backend: str
    device: str
    target_batch_tokens: list[int]
    target_step_seconds: list[float]
    drafter_num_requests: list[int] = field(default_factory=list)
    drafter_step_seconds: list[float] = field(default_factory=list)
    catch_up_seconds_per_position: float = 0.0  # beyond the curve's KEPT_PER_STEP positions a request

    def __post_init__(self):
        for xs, ys, what in ((self.target_batch_tokens, self.target_step_seconds, "target"),
                             (self.drafter_num_requests, self.drafter_step_seconds, "drafter")):
            if len(xs) != len(ys):
                raise DsparkError(f"latency profile: {what} has {len(xs)} sizes but {len(ys)} step times")
            if list(xs) != sorted(set(xs)) or any(x < 1 for x in xs):
                raise DsparkError(f"latency profile: {what} sizes must be increasing positive integers, got {list(xs)}")
            if any(not (y > 0) for y in ys):
                raise DsparkError(f"latency profile: {what} step times must be positive, got {list(ys)}")
        if not self.target_batch_tokens:
            raise DsparkError("latency profile: the target curve is empty")
        if not self.catch_up_seconds_per_position >= 0:
            raise DsparkError(f"latency profile: catch_up_seconds_per_position must be >= 0, got "
                              f"{self.catch_up_seconds_per_position}")

    # ---- lookups ------------------------------------------------------------------------------

    def target_seconds(self, batch_tokens: int) -> float:
        """Seconds of one target step verifying `batch_tokens` tokens."""
        return _interpolate(self.target_batch_tokens, self.target_step_seconds, batch_tokens)

    def drafter_seconds(self, num_requests: int) -> float:
        """Seconds of one drafter step for `num_requests` requests (0 when nobody drafts)."""
        if num_requests <= 0 or not self.drafter_num_requests:
            return 0.0
        return _interpolate(self.drafter_num_requests, self.drafter_step_seconds, num_requests)

    def catch_up_seconds(self, positions: int) -> float:
        """What a draft adds for `positions` positions to catch up on beyond the curve's own."""
        return self.catch_up_seconds_per_position * max(0, positions)

    # ---- files --------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"backend": self.backend, "device": self.device,
                "target": {"batch_tokens": list(self.target_batch_tokens), "step_seconds": list(self.target_step_seconds)},
                "drafter": {"num_requests": list(self.drafter_num_requests),
                            "step_seconds": list(self.drafter_step_seconds),
                            "catch_up_seconds_per_position": self.catch_up_seconds_per_position}}

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LatencyProfile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DsparkError(f"latency profile {path} does not exist (write one with `dspark-trt profile`)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise DsparkError(f"latency profile {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise DsparkError(f"latency profile {path}: expected a JSON object")
        missing = [k for k in ("backend", "device", "target") if k not in data]
        unknown = sorted(set(data) - set(PROFILE_FORMAT_KEYS))
        if missing or unknown:
            problem = f"missing keys {missing}" if missing else f"unknown keys {unknown}"
            raise DsparkError(f"latency profile {path}: {problem}")
        try:
            drafter = data.get("drafter") or {}
            return cls(backend=str(data["backend"]), device=str(data["device"]),
                       target_batch_tokens=[int(x) for x in data["target"]["batch_tokens"]],
                       target_step_seconds=[float(x) for x in data["target"]["step_seconds"]],
                       drafter_num_requests=[int(x) for x in drafter.get("num_requests", [])],
                       drafter_step_seconds=[float(x) for x in drafter.get("step_seconds", [])],
                       catch_up_seconds_per_position=float(drafter.get("catch_up_seconds_per_position", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise DsparkError(f"latency profile {path}: malformed curve ({e})") from None


# ---- measuring ----------------------------------------------------------------------------------


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls after a warm-up: on a shared machine the slow calls are
    other processes' noise, and the fastest is what the step can cost."""
    fn()  # warm-up: first calls allocate and pick kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_target_curve(target, batch_tokens: list[int], context_length: int = 128, block: int = 8,
                         repeats: int = 3, progress=None) -> list[float]:
    """Target step seconds for each batch size: B tokens spread over requests as verification
    blocks of up to `block` tokens, each request `context_length` tokens deep."""
    model, config = target.model, target.config
    num_slots = max(1, -(-max(batch_tokens) // block))
    pool = model.new_pool(num_slots, context_length + block + 1)
    caches = [pool.allocate() for _ in range(num_slots)]
    generator = torch.Generator().manual_seed(0)
    for cache in caches:  # fill every slot's context once (one prefill per slot)
        ids = torch.randint(0, config.vocab_size, (context_length,), generator=generator)
        model(ids, [context_length], [cache], torch.tensor([context_length - 1]), ())
    seconds = []
    for size in batch_tokens:
        lengths = [block] * (size // block) + ([size % block] if size % block else [])
        used = caches[: len(lengths)]
        ids = torch.randint(0, config.vocab_size, (size,), generator=generator)
        logits_at = torch.arange(size)

        def step(ids=ids, lengths=lengths, used=used, logits_at=logits_at):  # this size's batch
            model(ids, lengths, used, logits_at, ()).logits.cpu()  # what the engine does: GPU rows come back
            for cache in used:
                cache.truncate(context_length)

        seconds.append(_best_seconds(step, repeats))
        if progress is not None:
            progress(f"target B={size}: {seconds[-1] * 1e3:.1f} ms")
    return seconds


KEPT_PER_STEP = 2  # positions a decoding step keeps per request (the accepted drafts and the bonus): ~tau


def _profile_request(proposer, request_id: str, context_length: int, width: int, generator: torch.Generator):
    """A greedy request `context_length` tokens deep whose features (random, `width` wide) the
    proposer has been handed: what a drafter timing starts from."""
    from dspark_trt.runtime.request import Request
    from dspark_trt.runtime.sampling import SamplingParams

    request = Request(request_id, list(range(1, context_length)), SamplingParams(temperature=0.0), torch.Generator())
    request.output_token_ids = [1]
    proposer.observe(request, torch.randn(context_length, width, generator=generator))
    return request


@torch.inference_mode()
def measure_drafter_curve(target, proposer, num_requests: list[int], context_length: int = 128,
                          repeats: int = 3, progress=None) -> list[float]:
    """Drafter step seconds (`propose`, one full block each) for each number of requests.

    Each timed call first hands the proposer `KEPT_PER_STEP` new positions of target features
    per request, as a decoding step does (its catch-up, fusing them into the context, is part
    of what a draft costs the step)."""
    width = len(proposer.feature_layers) * target.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    requests = [_profile_request(proposer, f"profile-{i}", context_length, width, generator)
                for i in range(max(num_requests))]
    seconds = []
    try:
        kept = torch.randn(KEPT_PER_STEP, width, generator=generator)

        def step(batch):
            for request in batch:
                proposer.observe(request, kept)
            proposer.propose(batch)

        for count in num_requests:
            seconds.append(_best_seconds(lambda: step(requests[:count]), repeats))  # noqa: B023 (timed now)
            if progress is not None:
                progress(f"drafter n={count}: {seconds[-1] * 1e3:.1f} ms")
    finally:
        for request in requests:
            proposer.release(request)
    return seconds


CATCH_UP_POSITIONS = 256  # positions a timed long catch-up brings (a prompt's worth)


@torch.inference_mode()
def measure_catch_up(target, proposer, context_length: int = 128, repeats: int = 3) -> float:
    """Seconds each position beyond `KEPT_PER_STEP` adds to a 1-request draft: a draft after
    `CATCH_UP_POSITIONS` new positions against one after `KEPT_PER_STEP`, each on a fresh request
    whose context was caught up first, fastest of at least 3 (a first long catch-up grows the
    drafter's pool: a warm-up does that, untimed)."""
    width = len(proposer.feature_layers) * target.config.hidden_size
    generator = torch.Generator().manual_seed(0)

    def draft_after(count: int) -> float:
        request = _profile_request(proposer, "profile-catch-up", context_length, width, generator)
        try:
            proposer.propose([request])  # its context caught up, untimed
            proposer.observe(request, torch.randn(count, width, generator=generator))
            start = time.perf_counter()
            proposer.propose([request])
            return time.perf_counter() - start
        finally:
            proposer.release(request)

    draft_after(CATCH_UP_POSITIONS)
    short, long = (min(draft_after(count) for _ in range(max(repeats, 3))) for count in (KEPT_PER_STEP,
                                                                                        CATCH_UP_POSITIONS))
    return max(0.0, (long - short) / (CATCH_UP_POSITIONS - KEPT_PER_STEP))


def suffix_minimum(seconds: list[float]) -> list[float]:
    """t(B) = min over B' >= B of the measured t(B'): a bigger batch that measured faster bounds a
    smaller one (noise from other processes only ever adds time). On a quiet machine this changes
    little; on a shared one it removes the spikes that would mislead the scheduler."""
    result, running = [], float("inf")
    for value in reversed(seconds):
        running = min(running, value)
        result.append(running)
    return result[::-1]


def measure_latency_profile(target, proposer=None, max_batch_tokens: int = 256, max_requests: int = 32,
                            quick: bool = False, progress=None) -> LatencyProfile:
    """Measure this machine's target and drafter curves (PyTorch backend, on the target's device).

    `quick` (used at start-up when no profile was given) measures fewer points with one
    repeat: a few seconds instead of a minute, coarse but far better than no curve.
    """
    repeats = 1 if quick else 5
    batch_tokens = _powers_of_two(max_batch_tokens)
    if not quick:  # odd sizes between the powers show the jaggedness the scheduler exploits
        batch_tokens = sorted(set(batch_tokens) | {b + b // 2 for b in batch_tokens if 2 < b < max_batch_tokens})
    target_seconds = suffix_minimum(measure_target_curve(target, batch_tokens, repeats=repeats, progress=progress))
    num_requests, drafter_seconds, catch_up = [], [], 0.0
    if proposer is not None:
        num_requests = _powers_of_two(max_requests)
        drafter_seconds = suffix_minimum(measure_drafter_curve(target, proposer, num_requests, repeats=repeats,
                                                               progress=progress))
        if proposer.catches_up:  # the others' drafts cost the same however long since the last
            catch_up = measure_catch_up(target, proposer, repeats=repeats)
            if progress is not None:
                progress(f"drafter catch-up: {catch_up * 1e6:.1f} us a position")
    device = target.model.embed.device
    weight_dtype = getattr(target.model, "weight_dtype", torch.float32)  # other backends: their own name
    return LatencyProfile(backend=torch_backend_name(device, weight_dtype), device=device_name(device),
                          target_batch_tokens=batch_tokens, target_step_seconds=target_seconds,
                          drafter_num_requests=num_requests, drafter_step_seconds=drafter_seconds,
                          catch_up_seconds_per_position=catch_up)
