"""The engine's step loop in a background thread, for servers (HTTP, Triton).

Callers in any thread `submit` a request with a callback and get every committed token back as
a `StreamDelta` (text and ids since the last delta; the last one carries the finish reason and
the request's metrics). All running requests share one in-flight batch: the thread admits new
requests and applies cancellations between steps, so a request joins or leaves at the next step.

    submit(ids, params, on_delta) -> request id      (checks and queues; raises when full: at most
                                                      max_batch_size running + max_queue waiting)
    submit_all([(ids, params, on_delta), ...])        (several at once, all or none: a request's choices)
    cancel(request id)                                (frees its KV memory at the next step)
    shutdown(drain=True)                              (refuse new work, finish what runs, stop)

Callbacks run on the engine thread: keep them short (hand the delta to your own loop). This
module does no HTTP and no tokenisation of prompts.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from dspark_trt.errors import DsparkError, InvalidRequestError
from dspark_trt.runtime.engine import Engine, StepStats
from dspark_trt.runtime.logprobs import TokenLogprob
from dspark_trt.runtime.request import FinishReason, Request
from dspark_trt.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(DsparkError):
    """Every KV slot runs a request and `max_queue` more are waiting: retry later."""


class ShuttingDownError(DsparkError):
    """The engine is draining for shutdown and takes no new requests."""


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]  # committed since the previous delta
    text: str  # text since the previous delta (held back while it ends in a partial character)
    finish_reason: str | None = None  # set on the last delta: stop | length | abort | error
    metrics: dict | None = None  # on the last delta: RequestOutput.metrics
    error: str | None = None  # set with finish_reason "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Stream:
    request: Request
    on_delta: Callable[[StreamDelta], None]
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_any: bool = False


def longest_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class EngineThread:
    def __init__(self, engine: Engine, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", _Stream) | ("cancel", request id)
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._draining = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self.on_step: Callable[[StepStats], None] | None = None  # called after every step (metrics)

    # ---- callers' side ------------------------------------------------------------------------

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    @property
    def capacity(self) -> int | None:
        """How many requests may be unfinished at once: every KV slot running one, plus the queue."""
        return None if self.max_queue is None else self.engine.pool.num_slots + self.max_queue

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished: in the inbox, waiting, running, or cancelled but
        not yet released (a cancelled request holds its slot until the next step frees it)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting) + sum(1 for kind, _ in self._inbox if kind == "add")

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_delta: Callable[[StreamDelta], None],
               request_id: str | None = None) -> str:
        """Check and queue a request; raise `InvalidRequestError`, `QueueFullError` or `ShuttingDownError`."""
        return self.submit_all([(prompt_token_ids, params, on_delta)], [request_id])[0]

    def submit_all(self, jobs: list[tuple[list[int], SamplingParams, Callable[[StreamDelta], None]]],
                   request_ids: list[str | None] | None = None) -> list[str]:
        """Check and queue several requests (one HTTP request's choices): all of them, or none and
        the error `submit` would raise."""
        for prompt_token_ids, _, _ in jobs:
            self.engine.check_prompt(prompt_token_ids)
        request_ids = request_ids or [None] * len(jobs)
        with self._lock:
            if self._draining:
                raise ShuttingDownError("the server is shutting down and takes no new requests")
            # One count for the rule: every unfinished request, wherever it is now (inbox, queue or
            # batch). Counting the inbox as waiting *and* subtracting it from free slots refused
            # requests long before the queue was full.
            if self.capacity is not None and self.num_unfinished + len(jobs) > self.capacity:
                raise QueueFullError(f"the server is full: {self.engine.pool.num_slots} requests running and "
                                     f"{self.max_queue} waiting (max_queue={self.max_queue})")
            chosen = [rid if rid is not None else f"req-{next(self._ids)}" for rid in request_ids]
            for request_id in chosen:
                if request_id in self._streams or chosen.count(request_id) > 1:
                    raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
            for (prompt_token_ids, params, on_delta), request_id in zip(jobs, chosen):
                stream = _Stream(self.engine.new_request(prompt_token_ids, params, request_id), on_delta)
                self._streams[request_id] = stream
                self._inbox.append(("add", stream))
            self._lock.notify()
        return chosen

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("cancel", request_id))
            self._lock.notify()

    def refuse_new(self) -> None:
        """Start draining: `submit` raises `ShuttingDownError` from now on."""
        with self._lock:
            self._draining = True

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with `drain`, let running and queued ones finish first."""
        with self._lock:
            self._draining = True
            if not drain:
                for request_id in list(self._streams):
                    self._inbox.append(("cancel", request_id))
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self.engine.has_unfinished() and not self._stopping:
                    self._lock.wait()
                inbox, self._inbox = self._inbox, []
                if self._stopping and not inbox and not self.engine.has_unfinished():
                    return
            for kind, item in inbox:
                if kind == "add":
                    if item.request.finished:  # cancelled before it was admitted
                        continue
                    self.engine.enqueue(item.request)
                else:
                    self._cancel_now(item)
            if not self.engine.has_unfinished():
                continue
            try:
                updated = self.engine.step()
            except Exception as e:  # never die silently: fail what runs, keep serving
                log.exception("engine step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            for output in updated:
                self._emit(output.request)
            if self.on_step is not None:
                self.on_step(self.engine.last_step)

    def _cancel_now(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.request.finished:
            return
        self.engine.abort(stream.request)
        self._emit(stream.request)

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            request = stream.request
            if not request.finished:
                self.engine.abort(request)
            self._streams.pop(request.request_id, None)
            self._deliver(stream, StreamDelta(request.request_id, [], "", "error", request.stats.as_dict(), message))

    def _emit(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        new_ids = request.output_token_ids[stream.num_sent_tokens:]
        text = request.output_text
        end = len(text)
        if not request.finished:  # a token may end inside a multi-byte character: wait for the rest
            while end > stream.num_sent_chars and text[end - 1] == "\ufffd":
                end -= 1
            # Hold back a tail that may be the start of a stop string: if the stop completes, that
            # tail is cut from the output and must never have been sent.
            end -= longest_stop_prefix(text[:end], request.params.stop)
        new_text = text[stream.num_sent_chars : end] if end > stream.num_sent_chars else ""
        if not (new_ids or new_text or request.finished):
            return
        delta = StreamDelta(request.request_id, list(new_ids), new_text,
                            logprobs=request.output_logprobs[stream.num_sent_tokens:])
        if not stream.sent_any and request.params.prompt_logprobs is not None:
            delta.prompt_logprobs = list(request.prompt_logprobs)
        stream.num_sent_tokens = len(request.output_token_ids)
        stream.num_sent_chars = max(stream.num_sent_chars, end)
        stream.sent_any = True
        if request.finished:
            self._streams.pop(request.request_id, None)
            delta.finish_reason = request.finish_reason.value
            delta.metrics = request.metrics()
        self._deliver(stream, delta)

    @staticmethod
    def _deliver(stream: _Stream, delta: StreamDelta) -> None:
        try:
            stream.on_delta(delta)
        except Exception:  # a broken callback must not stop the batch
            log.exception("stream callback failed for %s", delta.request_id)


__all__ = ["EngineThread", "StreamDelta", "QueueFullError", "ShuttingDownError", "FinishReason"]
