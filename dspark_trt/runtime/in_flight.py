"""Keep up to N requests in the engine until every job is done (in-flight batching offline).

`LLM.generate`, `dspark-trt eval` and `dspark-trt datagen` all run a list of prompts this way:
a finished request is replaced by the next job at once, so the batch stays full. If anything
raises (Ctrl-C included), the requests still running are aborted, leaving the engine clean
for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from dspark_trt.runtime.engine import Engine, StepOutput
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.sampling import SamplingParams


@dataclass
class Job:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None


def run_in_flight(engine: Engine, jobs: Iterable[Job], max_in_flight: int,
                  on_output: Callable[[StepOutput], None] | None = None, progress=None) -> list[Request]:
    """Run every job with at most `max_in_flight` requests in the engine; return the requests in
    job order. `on_output` sees every `StepOutput`; `progress` (a tqdm bar) counts finished requests."""
    pending = iter(jobs)
    requests: list[Request] = []
    try:
        while True:
            while len(engine.running) + len(engine.waiting) < max_in_flight:
                job = next(pending, None)
                if job is None:
                    break
                requests.append(engine.add_request(job.prompt_token_ids, job.params, job.request_id))
            if not engine.has_unfinished():
                return requests
            for output in engine.step():
                if on_output is not None:
                    on_output(output)
                if output.request.finished and progress is not None:
                    progress.update(1)
    except BaseException:
        for request in requests:
            if not request.finished:
                engine.abort(request)
        raise
