"""Soak: minutes of mixed, partly hostile traffic against one `dspark-trt serve`, checking nothing is lost.

    python benchmarks/soak.py [--duration 300] [--target default] [--drafter auto] [--profile PROFILE]
                              [--clients 12] [--max-batch-size 8] [--max-queue 8]
                              [--output benchmarks/results/soak.json]

`--clients` closed-loop clients (each waits a second after a 429, as Retry-After asks) pick,
request after request: a streamed chat completion read to the end, a non-streamed one (chat or
completion), a stream left after two chunks, a non-streamed request left after a fraction of a
second, an evaluation tool's request (a gzip body, one or two prompts, `n` 1 or 2, `echo` with
`logprobs`, `max_tokens` 0 to 8: every choice checked for its prompt and logprobs), or a hostile
body (deep JSON, lone surrogates, loose types, a wrong route, a body over the size limit). Every
`--burst-every` seconds a burst of max_batch_size + max_queue + 4 requests lands at once, over the
queue limit. Once a second a monitor reads the server's /metrics (KV
usage, running, waiting, finished requests by reason), its RSS and how long /health takes.

Every request ends as exactly one of: completed, cancelled (its client left), refused (429),
rejected (the 4xx a hostile body should get) or failed (anything else: a 5xx, a wrong status, a
broken stream, a connection error). Checks, written with the figures to --output (JSON, PNG
beside it):
  - no request failed;
  - nothing lost: the server finished (stop, length or abort) exactly the requests it admitted,
    between those the clients know were admitted and those plus the ones left before an answer;
  - the server ends idle: no request running or waiting, KV usage 0;
  - RSS growth after warm-up stays under --max-rss-growth-mb;
  - /health never took a second or more;
  - after the soak, exactly max_batch_size + max_queue concurrent requests are admitted again
    (no slot or queue place leaked).
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

OUTCOMES = ("completed", "cancelled", "refused", "rejected", "failed")
ACTIONS = {"stream": 30, "plain": 25, "stream_leave": 10, "plain_leave": 10, "hostile": 15, "evaluation": 10}  # weights
# (path, body bytes given the model name): each must get a 4xx other than 429.
HOSTILE = [
    ("/v1/completions", lambda m: b"[" * 50_000 + b"]" * 50_000),
    ("/v1/completions", lambda m: b'{"model": "%s", "prompt": "x", "seed": %s}' % (m.encode(), b"7" * 5000)),
    ("/v1/chat/completions", lambda m: json.dumps({"model": m, "messages": [{"role": "user", "content": "a\ud800"}]})
     .encode()),
    ("/v1/chat/completions", lambda m: json.dumps({"model": m, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode()),
    ("/v1/completions", lambda m: json.dumps({"model": m, "prompt": "x", "max_tokens": "4"}).encode()),
    ("/v1/completions", lambda m: json.dumps({"model": m, "prompt": [False], "stream": "yes"}).encode()),
    ("/v1/completions", lambda m: json.dumps({"model": m, "prompt": "x", "temperature": 9}).encode()),
    ("/v1/completions", lambda m: json.dumps({"model": m, "prompt": "x", "max_tokens": 10**6}).encode()),
    ("/v1/nowhere", lambda m: b"{}"),
    ("/v1/completions", lambda m: json.dumps({"model": m, "prompt": "x " * 1_600_000}).encode()),  # > 2 MiB: 413
]
METRIC_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$')


def read_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(name, 'label="v",...'): value}."""
    values = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match:
            values[(match[1], match[2] or "")] = float(match[3])
    return values


def finished_by_reason(metrics: dict) -> Counter:
    counts = Counter()
    for (name, labels), value in metrics.items():
        if name == "vllm:request_success_total":
            counts[re.search(r'finished_reason="(\w+)"', labels)[1]] += value
    return counts


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, url: str, model: str, pid: int, args, prompts: list):
        self.url, self.model, self.pid, self.args, self.prompts = url, model, pid, args, prompts
        self.capacity = args.max_batch_size + args.max_queue
        self.counts = Counter()  # (action, outcome)
        self.admitted_sure = 0  # a 200 was seen
        self.left_unanswered = 0  # non-streamed requests left before any answer: admitted or not
        self.failures: list[str] = []
        self.series: list[dict] = []
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=256))

    # ---- one request of each kind; each returns its outcome ------------------------------------

    def _fail(self, detail: str) -> str:
        if len(self.failures) < 50:
            self.failures.append(detail)
        return "failed"

    def _chat_body(self, rng: random.Random, **fields) -> dict:
        return {"model": self.model, "messages": rng.choice(self.prompts), "max_tokens": self.args.max_tokens,
                "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**32), **fields}

    async def stream(self, rng: random.Random, leave_after: int | None = None) -> str:
        body = self._chat_body(rng, stream=True, stream_options={"include_usage": True})
        async with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            if response.status_code == 429:
                return "refused"
            if response.status_code != 200:
                return self._fail(f"stream: HTTP {response.status_code} {(await response.aread())[:200]!r}")
            self.admitted_sure += 1
            chunks, finish = 0, None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "completed" if finish in ("stop", "length") else self._fail(f"stream: no finish ({finish})")
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return self._fail(f"stream error: {chunk['error']}")
                chunks += 1
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                if leave_after is not None and chunks >= leave_after and finish is None:
                    return "cancelled"  # leaving the `async with` closes the connection
            return self._fail("stream: ended without data: [DONE]")

    async def plain(self, rng: random.Random, leave_after_s: float | None = None) -> str:
        if rng.random() < 0.5:
            path, body = "/v1/chat/completions", self._chat_body(rng)
        else:
            path, body = "/v1/completions", {**self._chat_body(rng), "prompt": rng.choice(self.prompts)[-1]["content"]}
            del body["messages"]
        try:
            response = await self.http.post(f"{self.url}{path}", json=body, timeout=leave_after_s or 120.0)
        except httpx.TimeoutException:
            if leave_after_s is None:
                return self._fail("plain: timed out after 120 s")
            self.left_unanswered += 1
            return "cancelled"
        if response.status_code == 429:
            return "refused"
        if response.status_code != 200:
            return self._fail(f"plain: HTTP {response.status_code} {response.text[:200]}")
        self.admitted_sure += 1
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] not in ("stop", "length") or not isinstance(text, str):
            return self._fail(f"plain: bad choice {choice}")
        return "completed"

    async def evaluation(self, rng: random.Random) -> str:
        """What lm-eval and pass@k scripts send: several choices, echoed and scored, gzip-encoded."""
        prompts = [p[-1]["content"] for p in rng.sample(self.prompts, rng.choice([1, 2]))]
        n = rng.choice([1, 2])
        body = {"model": self.model, "prompt": prompts, "n": n, "echo": True, "logprobs": rng.choice([0, 1, 5]),
                "max_tokens": rng.choice([0, 1, 8]), "temperature": rng.choice([0.0, 1.0]),
                "seed": rng.randrange(2**32)}
        response = await self.http.post(f"{self.url}/v1/completions", content=gzip.compress(json.dumps(body).encode()),
                                        headers={"content-type": "application/json", "content-encoding": "gzip"})
        if response.status_code == 429:
            return "refused"
        if response.status_code != 200:
            return self._fail(f"evaluation: HTTP {response.status_code} {response.text[:200]}")
        choices = response.json()["choices"]
        self.admitted_sure += len(choices)  # each choice is a request of the server's
        if sorted(c["index"] for c in choices) != list(range(len(prompts) * n)):
            return self._fail(f"evaluation: choice indices {[c['index'] for c in choices]}")
        for choice in choices:
            logprobs = choice["logprobs"]
            if (not choice["text"].startswith(prompts[choice["index"] // n]) or logprobs["token_logprobs"][0] is not None
                    or any(v is None for v in logprobs["token_logprobs"][1:])):
                return self._fail(f"evaluation: bad choice {str(choice)[:200]}")
        return "completed"

    async def hostile(self, rng: random.Random) -> str:
        path, raw = rng.choice(HOSTILE)
        response = await self.http.post(f"{self.url}{path}", content=raw(self.model),
                                        headers={"content-type": "application/json"})
        error = response.json().get("error") if response.headers.get("content-type", "").startswith(
            "application/json") else None
        if 400 <= response.status_code < 500 and response.status_code != 429 and error and "message" in error:
            return "rejected"
        return self._fail(f"hostile {path}: HTTP {response.status_code} {response.text[:200]}")

    async def act(self, action: str, rng: random.Random) -> str:
        try:
            if action == "stream":
                outcome = await self.stream(rng)
            elif action == "stream_leave":
                outcome = await self.stream(rng, leave_after=2)
            elif action == "plain":
                outcome = await self.plain(rng)
            elif action == "plain_leave":
                outcome = await self.plain(rng, leave_after_s=rng.uniform(0.2, 1.0))
            elif action == "evaluation":
                outcome = await self.evaluation(rng)
            else:
                outcome = await self.hostile(rng)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            outcome = self._fail(f"{action}: {type(e).__name__}: {e}")
        self.counts[(action, outcome)] += 1
        return outcome

    # ---- the loops -----------------------------------------------------------------------------

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        actions, weights = list(ACTIONS), list(ACTIONS.values())
        while time.perf_counter() < deadline:
            if await self.act(rng.choices(actions, weights)[0], rng) == "refused":
                await asyncio.sleep(1.0)  # what the 429's Retry-After asks (clients that ignore it are the bursts)

    async def bursts(self, deadline: float) -> None:
        rng = random.Random(self.args.seed - 1)
        while time.perf_counter() + self.args.burst_every < deadline:
            await asyncio.sleep(self.args.burst_every)
            await asyncio.gather(*(self.act("plain", rng) for _ in range(self.capacity + 4)))
            self.counts[("burst", "sent")] += 1

    async def monitor(self, start: float, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                await self.sample(http, start)
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

    async def sample(self, http: httpx.AsyncClient, start: float) -> dict:
        begin = time.perf_counter()
        healthy = (await http.get(f"{self.url}/health")).status_code == 200
        health_s = time.perf_counter() - begin
        metrics = read_metrics((await http.get(f"{self.url}/metrics")).text)
        point = {"t": round(begin - start, 2), "health_ms": round(health_s * 1000, 1), "healthy": healthy,
                 "kv_usage": metrics.get(("vllm:kv_cache_usage_perc", f'model_name="{self.model}"'), 0.0),
                 "running": metrics.get(("vllm:num_requests_running", f'model_name="{self.model}"'), 0.0),
                 "waiting": metrics.get(("vllm:num_requests_waiting", f'model_name="{self.model}"'), 0.0),
                 "finished": dict(finished_by_reason(metrics)), "rss_mb": round(rss_mb(self.pid), 1),
                 "outcomes": self.totals()}
        self.series.append(point)
        return point

    def totals(self) -> dict:
        totals = {outcome: 0 for outcome in OUTCOMES}
        for (_action, outcome), count in self.counts.items():
            if outcome in totals:
                totals[outcome] += count
        return totals

    async def admission_after(self) -> list[int]:
        """Statuses of capacity + 3 concurrent streams held open: exactly `capacity` 200s expected."""
        release, statuses = asyncio.Event(), []
        body = {"model": self.model, "prompt": "Count slowly from one to a thousand:", "max_tokens": 256,
                "temperature": 0.0, "stream": True}

        async def one():
            async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                statuses.append(response.status_code)
                if response.status_code == 200:
                    await release.wait()

        tasks = [asyncio.create_task(one()) for _ in range(self.capacity + 3)]
        deadline = time.perf_counter() + 60
        while len(statuses) < len(tasks) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return sorted(statuses)

    async def run(self) -> dict:
        async with httpx.AsyncClient(timeout=30) as http:
            start = time.perf_counter()
            before = await self.sample(http, start)
            stop = asyncio.Event()
            monitor = asyncio.create_task(self.monitor(start, stop))
            deadline = start + self.args.duration
            await asyncio.gather(*(self.client(i, deadline) for i in range(self.args.clients)), self.bursts(deadline))
            traffic_s = time.perf_counter() - start
            idle_deadline = time.perf_counter() + 60
            while True:  # every admitted request must finish or be cancelled: wait for an idle engine
                point = await self.sample(http, start)
                if (point["running"], point["waiting"], point["kv_usage"]) == (0, 0, 0) or \
                        time.perf_counter() > idle_deadline:
                    break
                await asyncio.sleep(0.5)
            stop.set()
            await monitor
            after = await self.sample(http, start)
            admission = await self.admission_after()
        await self.http.aclose()
        return self.report(before, after, traffic_s, admission)

    def report(self, before: dict, after: dict, traffic_s: float, admission: list[int]) -> dict:
        finished = Counter(after["finished"])
        finished.subtract(Counter(before["finished"]))
        server_finished = sum(finished.values())
        totals = self.totals()
        warm = [p["rss_mb"] for p in self.series if p["t"] >= 0.25 * traffic_s]
        rss_growth = (max(warm) - warm[0]) if warm else 0.0
        slowest_health = max(p["health_ms"] for p in self.series)
        expected = [200] * self.capacity + [429] * 3
        checks = {
            "no_failed_requests": {"ok": totals["failed"] == 0, "failed": totals["failed"],
                                   "examples": self.failures[:10]},
            "nothing_lost": {"ok": self.admitted_sure <= server_finished <= self.admitted_sure + self.left_unanswered,
                             "server_finished": server_finished, "admitted_for_sure": self.admitted_sure,
                             "left_before_an_answer": self.left_unanswered, "by_reason": dict(finished)},
            "server_ends_idle": {"ok": (after["running"], after["waiting"], after["kv_usage"]) == (0, 0, 0),
                                 "running": after["running"], "waiting": after["waiting"],
                                 "kv_usage": after["kv_usage"]},
            "rss_growth_bounded": {"ok": rss_growth <= self.args.max_rss_growth_mb,
                                   "growth_after_warmup_mb": round(rss_growth, 1),
                                   "limit_mb": self.args.max_rss_growth_mb},
            "health_under_a_second": {"ok": slowest_health < 1000 and all(p["healthy"] for p in self.series),
                                      "slowest_ms": slowest_health},
            "exact_admission_after": {"ok": admission == expected, "statuses": dict(Counter(admission)),
                                      "expected": dict(Counter(expected))},
        }
        by_action = {}
        for (action, outcome), count in sorted(self.counts.items()):
            by_action.setdefault(action, {})[outcome] = count
        return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "model": self.model, "traffic_seconds": round(traffic_s, 1),
                "sent": sum(totals.values()), **totals, "by_action": by_action,
                "ok": all(check["ok"] for check in checks.values()), "checks": checks, "series": self.series}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    t = [p["t"] for p in series]
    fig, ((kv, rss), (outcomes, health)) = plt.subplots(2, 2, figsize=(13, 8))
    kv.plot(t, [p["kv_usage"] for p in series], label="KV usage (fraction of slots)")
    kv.plot(t, [p["running"] / result["config"]["max_batch_size"] for p in series], label="running / batch size",
            linestyle="--")
    kv.plot(t, [p["waiting"] / max(result["config"]["max_queue"], 1) for p in series], label="waiting / max queue",
            alpha=0.6)
    rss.plot(t, [p["rss_mb"] for p in series], color="tab:red")
    for outcome in OUTCOMES:
        outcomes.plot(t, [p["outcomes"][outcome] for p in series], label=outcome)
    health.plot(t, [p["health_ms"] for p in series], color="tab:green")
    kv.set(title="engine occupancy", xlabel="s", ylim=(-0.05, 1.1))
    rss.set(title="server RSS (MB)", xlabel="s")
    outcomes.set(title="requests by outcome (cumulative)", xlabel="s")
    health.set(title="/health answer time (ms)", xlabel="s", yscale="log")
    for ax in (kv, rss, outcomes, health):
        ax.grid(alpha=0.3)
    kv.legend(fontsize=8)
    outcomes.legend(fontsize=8)
    checks = ", ".join(f"{name} {'ok' if c['ok'] else 'FAILED'}" for name, c in result["checks"].items())
    fig.suptitle(f"soak: {result['model']}, {result['traffic_seconds']:.0f} s, {result['sent']} requests, "
                 f"{result['config']['clients']} clients on {result['machine']}\n{checks}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    parser.add_argument("--target", default="default", help="what the server loads (default: the embedded target)")
    parser.add_argument("--drafter", default="auto", help="serve --drafter (default auto)")
    parser.add_argument("--policy", default=None, help="serve --policy (default: the server's)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="serve --profile (default: none, so a policy that needs one measures it at start)")
    parser.add_argument("--clients", type=int, default=12, help="closed-loop clients (default 12)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="serve --max-batch-size (default 8)")
    parser.add_argument("--max-queue", type=int, default=8, help="serve --max-queue (default 8)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="serve --max-model-len (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per ordinary request (default 48)")
    parser.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts (default 20)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                        help="allowed RSS growth after the first quarter of the run (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args(argv)
    for name in ("duration", "clients", "max_batch_size", "max_tokens", "burst_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.max_queue < 0:
        parser.error("--max-queue must be >= 0")

    from dspark_trt.errors import DsparkError
    from dspark_trt.serving.bench import load_prompt_mix
    from dspark_trt.serving.launch import ServeProcess

    serve_args = ["--target", args.target, "--drafter", args.drafter, "--max-batch-size", str(args.max_batch_size),
                  "--max-queue", str(args.max_queue), "--max-model-len", str(args.max_model_len),
                  "--log-level", "warning"]
    if args.policy:
        serve_args += ["--policy", args.policy]
    if args.profile:
        serve_args += ["--profile", str(args.profile)]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    log = args.output.with_suffix(".server.log")
    try:
        server = ServeProcess(serve_args, log)
    except DsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        prompts = load_prompt_mix(64, args.seed)
        print(f"soak: {args.duration:.0f} s of traffic from {args.clients} clients against {model} "
              f"(batch {args.max_batch_size}, queue {args.max_queue})", file=sys.stderr)
        result = asyncio.run(Soak(server.url, model, server.process.pid, args, prompts).run())
    finally:
        server.stop()
    result["server_log_tracebacks"] = log.read_text().count("Traceback")
    result["checks"]["no_server_tracebacks"] = {"ok": result["server_log_tracebacks"] == 0,
                                                "count": result["server_log_tracebacks"]}
    result["ok"] = all(check["ok"] for check in result["checks"].values())
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.output.with_suffix(".png"))
    summary = {k: result[k] for k in ("sent", *OUTCOMES)}
    print(json.dumps(summary), file=sys.stderr)
    for name, check in result["checks"].items():
        print(f"  {'ok    ' if check['ok'] else 'FAILED'} {name}: "
              + ", ".join(f"{k}={v}" for k, v in check.items() if k not in ("ok", "examples")), file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
