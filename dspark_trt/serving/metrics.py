"""Prometheus metrics of the server (`GET /metrics`).

Speculative-decoding counters reuse vLLM's names so existing dashboards work:
`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}`. They, the token counters
and the running/waiting/KV gauges are read from the engine at scrape time (a custom collector),
so they can never drift from what the engine did. Latencies (time to first token, inter-token
latency, end-to-end) are observed per request by the server into histograms; the verify budget
per step is observed by the engine thread after every step. A policy that weighs costs also shows
what it has learned beyond the latency profile (`dspark:policy_*`): why it drafts, or does not.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dspark_trt.runtime.engine_thread import EngineThread

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineCollector:
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, engine_thread: EngineThread, model_name: str):
        self.engine_thread = engine_thread
        self.model_name = model_name

    def collect(self):
        engine = self.engine_thread.engine
        counters = engine.counters
        labels = ["model_name"]
        values = [self.model_name]

        def counter(name, documentation, value):
            family = CounterMetricFamily(name, documentation, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name, documentation, value):
            family = GaugeMetricFamily(name, documentation, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter("vllm:spec_decode_num_drafts", "Request-steps that verified at least one draft token.",
                      counters.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens sent to verification.",
                      counters.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", counters.num_accepted_tokens)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each block position (1-based).",
                                           labels=labels + ["position"])
        for k, count in enumerate(counters.accepted_per_position, start=1):
            per_position.add_metric(values + [str(k)], count)
        yield per_position
        yield counter("vllm:prompt_tokens", "Prompt tokens admitted.", counters.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", counters.num_generated_tokens)
        finished = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                       labels=labels + ["finished_reason"])
        for reason, count in sorted(counters.finished.items()):
            finished.add_metric(values + [reason], count)
        yield finished
        yield counter("dspark:engine_steps", "Target steps run.", counters.num_steps)
        yield counter("dspark:scheduler_seconds", "Time the verification policy itself took.",
                      counters.scheduler_seconds)
        yield counter("dspark:step_seconds", "Time spent in engine steps.", counters.step_seconds)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", self.engine_thread.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests queued for a KV slot.", self.engine_thread.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV memory (slots) in use.", engine.kv_usage)
        yield gauge("dspark:verify_budget", "Draft tokens verified in the last step (all requests).",
                    engine.last_step.verify_budget)
        costs = engine.policy.costs  # what a cost-weighing policy has learned (None: a policy without a profile)
        if costs is not None:
            yield gauge("dspark:policy_request_overhead_seconds", "A decoding request's step cost beyond the "
                        "latency profile, as the verify policy has learned it.", costs.request_seconds)
            yield gauge("dspark:policy_token_overhead_seconds", "A verified draft token's step cost beyond the "
                        "latency profile, as the verify policy has learned it.", costs.token_seconds)
            yield gauge("dspark:policy_drafter_cost_scale", "Measured / profiled draft time, as the verify "
                        "policy scales the profile's drafter costs.", costs.drafter_scale)


class ServerMetrics:
    def __init__(self, engine_thread: EngineThread, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine_thread, model_name))
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                                             registry=self.registry, buckets=LATENCY_BUCKETS)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Time between streamed tokens (a multi-token step counts its gap once "
                                             "per token).", registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                     registry=self.registry, buckets=LATENCY_BUCKETS)
        self.verify_budget_per_step = Histogram("dspark:verify_budget_per_step",
                                                "Draft tokens verified per engine step, all requests together.",
                                                registry=self.registry, buckets=BUDGET_BUCKETS)
