"""The Triton Python-backend model that serves dspark-trt (copied to REPO/NAME/1/model.py).

Each model instance is one process that:
- builds `LLM(...)` once from the config.pbtxt parameters (`settings.py`) and runs its engine in
  an `EngineThread`, so all of this instance's requests share one in-flight batch: a request
  Triton hands to `execute` joins the batch at the next engine step, whatever else is running;
- is decoupled: `execute` only checks and submits requests and returns at once; responses go out
  later through each request's response sender, from one sender thread (engine callbacks only
  queue deltas, so a slow client never stalls the batch);
- with `stream=true` sends one response per new piece of text, the last flagged final; with
  `stream=false` one response with the whole completion (what Triton's /generate needs);
- polls Triton's cancellation flag of every running request and cancels it in the engine, which
  frees its KV slot at the next step;
- reports engine counters as Triton custom metrics on Triton's metrics port.

Errors a client causes (bad values) come back as Triton errors (INVALID_ARG); Triton itself
rejects missing inputs and wrong data types before they get here. Nothing here tokenises or
samples: `LLM.encode`, the engine and `protocol.py` do.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dspark_trt.errors import DsparkError, InvalidRequestError
from dspark_trt.runtime.engine_thread import EngineThread, QueueFullError, StreamDelta
from dspark_trt.triton.protocol import INPUT_NAMES, parse_request, response_arrays
from dspark_trt.triton.settings import DeploySettings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
POLL_SECONDS = 0.02  # how often cancellation flags and metrics are checked


@dataclass
class _Active:
    """A request in flight: where its responses go and what it has produced so far."""

    request: object  # pb_utils.InferenceRequest
    sender: object  # its response sender
    stream: bool
    num_input_tokens: int
    return_log_probs: bool = False
    text: list[str] = field(default_factory=list)  # accumulated (non-streaming)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # of token_ids (non-streaming, with return_log_probs)
    cum_log_prob: float = 0.0
    num_output_tokens: int = 0
    peak_running: int = 0
    cancelled: bool = False


def _error(message: str, code: str = "INVALID_ARG"):
    try:
        return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    except (TypeError, AttributeError):  # older backends take no code
        return pb_utils.TritonError(message)


def _pin_gpu(args) -> None:
    """KIND_GPU instances: show this process only the GPU Triton gave the instance.

    Each instance is its own process and nothing has touched CUDA yet, so this is the moment;
    the runtime then uses "the" GPU. Triton's device ids count the GPUs Triton itself sees.
    """
    if args.get("model_instance_kind") != "GPU":
        return
    device = int(args["model_instance_device_id"])
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[device] if device < len(visible) else str(device)


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("this model streams: config.pbtxt needs "
                                                "model_transaction_policy { decoupled: true }")
        parameters = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        self.settings = DeploySettings.from_parameters(parameters)
        self.name = args["model_name"]
        self.logger = pb_utils.Logger
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        _pin_gpu(args)

        # Only now, after the checks above: this loads torch (and, on GPU, must follow _pin_gpu).
        from dspark_trt import LLM

        started = time.perf_counter()
        self.llm = LLM(**self.settings.llm_kwargs(version_dir))
        self.engine = EngineThread(self.llm.engine, max_queue=self.settings.max_queue or None).start()
        self.logger.log_info(f"{args['model_instance_name']}: loaded {self.llm.target.name} in "
                             f"{time.perf_counter() - started:.1f} s ({self.settings.parameters()})")
        self._ids = itertools.count()
        self._active: dict[str, _Active] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._peak_running = 0
        self._metrics = _Metrics(self.name, args["model_version"])
        self._sender = threading.Thread(target=self._send_loop, name="dspark-triton-sender", daemon=True)
        self._sender.start()

    # ---- Triton's thread: check and submit ------------------------------------------------

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        # decoupled: responses go through the senders

    def _submit(self, request) -> None:
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = parse_request(inputs, self.settings.default_max_tokens)
            prompt_ids = self.llm.encode(parsed.prompt, chat=parsed.chat)
            request_id = f"triton-{next(self._ids)}"
            active = _Active(request, sender, parsed.stream, len(prompt_ids), parsed.return_log_probs)
            self._active[request_id] = active
            try:
                self.engine.submit(prompt_ids, parsed.params, self._on_delta, request_id=request_id)
            except BaseException:
                self._active.pop(request_id, None)
                raise
        except InvalidRequestError as exc:
            sender.send(pb_utils.InferenceResponse(error=_error(str(exc))), flags=FINAL)
        except QueueFullError as exc:
            sender.send(pb_utils.InferenceResponse(error=_error(str(exc), "UNAVAILABLE")), flags=FINAL)
        except DsparkError as exc:
            sender.send(pb_utils.InferenceResponse(error=_error(str(exc), "UNAVAILABLE")), flags=FINAL)
        except Exception as exc:  # a bug: answer the client, keep serving
            self.logger.log_error(f"request failed: {type(exc).__name__}: {exc}")
            sender.send(pb_utils.InferenceResponse(error=_error(f"internal error: {exc}", "INTERNAL")), flags=FINAL)

    # ---- the engine thread: only queue ------------------------------------------------------

    def _on_delta(self, delta: StreamDelta) -> None:
        batch = self.llm.engine.last_step.num_running  # requests in the step that made this delta
        self._peak_running = max(self._peak_running, batch)
        active = self._active.get(delta.request_id)
        if active is not None:
            active.peak_running = max(active.peak_running, batch)
        self._outbox.put(delta)

    # ---- the sender thread: responses, cancellation, metrics --------------------------------

    def _send_loop(self) -> None:
        last_poll = 0.0
        while not (self._stopping.is_set() and self._outbox.empty()):
            try:
                delta = self._outbox.get(timeout=POLL_SECONDS)
            except queue.Empty:
                delta = None
            if delta is not None:
                try:
                    self._send(delta)
                except Exception as exc:  # one broken client must not stop the others
                    self.logger.log_error(f"sending a response for {delta.request_id} failed: {exc}")
            now = time.monotonic()
            if now - last_poll >= POLL_SECONDS:
                last_poll = now
                try:
                    self._poll_cancellations()
                    self._update_metrics()
                except Exception as exc:  # keep sending responses whatever happens here
                    self.logger.log_error(f"polling cancellations / metrics failed: {type(exc).__name__}: {exc}")

    def _send(self, delta: StreamDelta) -> None:
        active = self._active.get(delta.request_id)
        if active is None:
            return
        active.num_output_tokens += len(delta.token_ids)
        if delta.finished:
            self._active.pop(delta.request_id, None)
            if delta.finish_reason == "error":
                active.sender.send(pb_utils.InferenceResponse(error=_error(delta.error or "engine error", "INTERNAL")),
                                   flags=FINAL)
                return
            if delta.finish_reason == "abort":
                self._metrics.cancelled += 1
                if active.cancelled:  # the client is gone: just close the request
                    active.sender.send(flags=FINAL)
                else:
                    active.sender.send(pb_utils.InferenceResponse(error=_error("the model is unloading", "UNAVAILABLE")),
                                       flags=FINAL)
                return
        new_log_probs = [entry.logprob for entry in delta.logprobs]
        active.cum_log_prob += sum(new_log_probs)
        if active.stream:
            text, token_ids, log_probs = delta.text, delta.token_ids, new_log_probs
        else:
            active.text.append(delta.text)
            active.token_ids.extend(delta.token_ids)
            active.log_probs.extend(new_log_probs)
            if not delta.finished:
                return
            text, token_ids, log_probs = "".join(active.text), active.token_ids, active.log_probs
        arrays = response_arrays(text, token_ids, active.num_input_tokens, active.num_output_tokens,
                                 active.peak_running, delta.finish_reason, delta.metrics,
                                 log_probs if active.return_log_probs else None, active.cum_log_prob)
        response = pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in arrays.items()])
        active.sender.send(response, flags=FINAL if delta.finished else 0)

    def _poll_cancellations(self) -> None:
        for request_id, active in list(self._active.items()):
            if active.cancelled:
                continue
            is_cancelled = getattr(active.request, "is_cancelled", None) or getattr(active.sender, "is_cancelled", None)
            if is_cancelled is not None and is_cancelled():
                active.cancelled = True
                self.logger.log_info(f"{request_id} cancelled by the client: freeing it")
                self.engine.cancel(request_id)

    def _update_metrics(self) -> None:
        engine = self.llm.engine
        self._metrics.update(engine.counters, running=len(engine.running), waiting=self.engine.num_waiting,
                             peak_running=self._peak_running, kv_usage=engine.kv_usage)

    def finalize(self):
        # Unloading: cancel what runs (clients get an UNAVAILABLE error), then stop the threads.
        self.engine.shutdown(drain=False, timeout=30)
        self._stopping.set()
        self._sender.join(timeout=30)


class _Metrics:
    """Engine counters as Triton custom metrics (Prometheus text on Triton's metrics port).

    Names follow `dspark-trt serve`'s /metrics (vLLM's) with a `dspark_` prefix where Triton's
    metric-name rules need it; see docs/triton.md.
    """

    COUNTERS = {  # metric name -> (EngineCounters field, help)
        "dspark_spec_decode_num_drafts_total": ("num_drafts", "request-steps that verified draft tokens"),
        "dspark_spec_decode_num_draft_tokens_total": ("num_draft_tokens", "draft tokens verified"),
        "dspark_spec_decode_num_accepted_tokens_total": ("num_accepted_tokens", "draft tokens accepted"),
        "dspark_prompt_tokens_total": ("num_prompt_tokens", "prompt tokens admitted"),
        "dspark_generation_tokens_total": ("num_generated_tokens", "tokens generated"),
        "dspark_engine_steps_total": ("num_steps", "target steps"),
    }
    GAUGES = {
        "dspark_requests_running": "requests in the in-flight batch",
        "dspark_requests_waiting": "requests waiting for a KV slot",
        "dspark_requests_running_peak": "most requests in one engine step so far (> 1: requests were batched)",
        "dspark_kv_cache_usage_ratio": "fraction of KV slots in use",
    }

    def __init__(self, model: str, version):
        labels = {"model": model, "version": str(version)}
        self.cancelled = 0
        self._sent: dict[str, int] = {}
        self._metrics = {}
        self._families = []  # a MetricFamily must outlive its Metric objects
        try:
            for name, (_, help_text) in self.COUNTERS.items():
                family = pb_utils.MetricFamily(name=name, description=help_text, kind=pb_utils.MetricFamily.COUNTER)
                self._families.append(family)
                self._metrics[name] = family.Metric(labels=labels)
            family = pb_utils.MetricFamily(name="dspark_requests_cancelled_total", description="requests cancelled",
                                           kind=pb_utils.MetricFamily.COUNTER)
            self._families.append(family)
            self._metrics["dspark_requests_cancelled_total"] = family.Metric(labels=labels)
            for name, help_text in self.GAUGES.items():
                family = pb_utils.MetricFamily(name=name, description=help_text, kind=pb_utils.MetricFamily.GAUGE)
                self._families.append(family)
                self._metrics[name] = family.Metric(labels=labels)
        except Exception as exc:  # metrics off (--allow-metrics=false) or an old backend: serve anyway
            pb_utils.Logger.log_warn(f"custom metrics unavailable: {exc}")
            self._metrics = {}

    def update(self, counters, running: int, waiting: int, peak_running: int, kv_usage: float) -> None:
        if not self._metrics:
            return
        totals = {name: getattr(counters, attribute) for name, (attribute, _) in self.COUNTERS.items()}
        totals["dspark_requests_cancelled_total"] = self.cancelled
        for name, total in totals.items():
            step = total - self._sent.get(name, 0)
            if step > 0:
                self._metrics[name].increment(step)
                self._sent[name] = total
        self._metrics["dspark_requests_running"].set(running)
        self._metrics["dspark_requests_waiting"].set(waiting)
        self._metrics["dspark_requests_running_peak"].set(peak_running)
        self._metrics["dspark_kv_cache_usage_ratio"].set(kv_usage)
