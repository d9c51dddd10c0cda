"""`dspark-trt bench`: an async load generator for the OpenAI server, several policies side by side.

It starts one server per policy (`dspark-trt serve ... --policy P`, all with one latency
profile measured first, all up at once) or uses `--url`; then for each (temperature,
concurrency), policy after policy, it sends a
prompt mix from the chat, code and math sets through streamed chat completions: either
`concurrency` clients back to back, or Poisson arrivals at `--request-rate` with at most
`concurrency` in flight. Per request it records time to first token (TTFT), inter-token
latency (ITL, per token: a chunk of k tokens spreads its gap over k), time per output token
(TPOT), end-to-end latency, and the server's speculative statistics (tau, verify budget).

Per run (policy, concurrency, temperature):
  total_tok_s     all completion tokens / wall time of the run
  per_user_tok_s  mean over requests of (completion tokens - 1) / (last token - first token)
  accept_length   committed tokens per verification step (tau), pooled over requests
  mean_verify_budget  mean over requests of draft tokens verified per step
  scheduler_fraction  the policy's own time / engine step time (from /metrics)

Writes `{"model", "drafter", "machine", "runs": [...]}` (the issue's schema) and a PNG: per-user
tok/s against total tok/s, one curve per policy, points labelled by concurrency, plus the mean
verify budget against concurrency.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dspark_trt.errors import DsparkError


@dataclass
class PolicySpec:
    """`label=policy@drafter`, e.g. `mtp1=fixed:1@checkpoints/.../mtp1`; `dspark` alone is fine."""

    label: str
    policy: str
    drafter: str | None

    @classmethod
    def parse(cls, text: str, default_drafter: str | None) -> "PolicySpec":
        label, _, rest = text.partition("=") if "=" in text else (text, "", text)
        policy, _, drafter = rest.partition("@")
        if not policy:
            raise DsparkError(f"bad --policy {text!r}: expected POLICY, LABEL=POLICY or LABEL=POLICY@DRAFTER")
        drafter = drafter or (None if policy == "none" else default_drafter)
        return cls(label.strip(), policy.strip(), drafter)


@dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    last_token: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    error: str | None = None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p99": at(0.99)}


def load_prompt_mix(num: int, seed: int) -> list[list[dict]]:
    """Chat (MT-Bench), code (HumanEval) and math (GSM8K) prompts, interleaved and shuffled."""
    from dspark_trt.training.prompts import load_prompts

    sets = [load_prompts(name) for name in ("mt-bench", "humaneval", "gsm8k")]
    mix = [p.messages for group in zip(*sets) for p in group]
    random.Random(seed).shuffle(mix)
    return [mix[i % len(mix)] for i in range(num)]


async def one_request(http: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int, temperature: float,
                      seed: int, headers: dict) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server reports a failure inside the stream
                    record.error = f"stream error: {chunk['error'].get('message')}"
                    break
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                extra = chunk.get("dspark") or {}
                if extra.get("num_steps") is not None:
                    record.stats = extra
                tokens = extra.get("num_tokens", 0)
                if tokens:
                    if record.first_token is None:
                        record.first_token = now
                        tokens -= 1  # the first token's wait is TTFT, not ITL
                    if tokens > 0:
                        gap = (now - record.last_token) / tokens
                        record.token_gaps.extend([gap] * tokens)
                    record.last_token = now
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    return record


async def run_load(url: str, model: str, prompts, concurrency: int, temperature: float, max_tokens: int,
                   request_rate: float | None, seed: int, headers: dict) -> tuple[list[RequestRecord], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        semaphore = asyncio.Semaphore(concurrency)
        arrivals = random.Random(seed)

        async def limited(i, messages):
            async with semaphore:
                return await one_request(http, url, model, messages, max_tokens, temperature, seed + i, headers)

        started = time.perf_counter()
        tasks = []
        for i, messages in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, messages)))
            if request_rate:  # Poisson arrivals
                await asyncio.sleep(arrivals.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - started


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {name: 0.0 for name in names}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def summarize(label: str, concurrency: int, temperature: float, records: list[RequestRecord], wall: float,
              scheduler: float, steps: float) -> dict:
    ok = [r for r in records if r.error is None and r.first_token is not None]
    failed = [r.error for r in records if r.error is not None]
    if failed and not ok:
        raise DsparkError(f"every request of {label} at concurrency {concurrency} failed, e.g. {failed[0]}")
    tokens = sum(r.completion_tokens for r in ok)
    per_user = [(r.completion_tokens - 1) / (r.last_token - r.first_token)
                for r in ok if r.completion_tokens > 1 and r.last_token > r.first_token]
    steps_total = sum(r.stats.get("num_steps", 0) for r in ok)
    accepted = sum(r.stats.get("num_accepted_tokens", 0) for r in ok)
    # Requests that never reached a verification step (one-token answers) have no budget to average.
    budgets = [r.stats.get("mean_verify_budget", 0.0) for r in ok if r.stats.get("num_steps", 0) > 0]
    tpot = [(r.end - r.first_token) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {"policy": label, "concurrency": concurrency, "temperature": temperature, "num_requests": len(ok),
            "num_failed": len(failed), "total_tok_s": tokens / wall if wall else 0.0,
            "per_user_tok_s": statistics.fmean(per_user) if per_user else None,
            "accept_length": 1.0 + accepted / steps_total if steps_total else 1.0,
            "mean_verify_budget": statistics.fmean(budgets) if budgets else 0.0,
            "scheduler_fraction": scheduler / steps if steps else 0.0,
            "ttft_ms": _ms(percentiles([r.first_token - r.start for r in ok])),
            "tpot_ms": _ms(percentiles(tpot)),
            "itl_ms": _ms(percentiles([g for r in ok for g in r.token_gaps])),
            "e2e_ms": _ms(percentiles([r.end - r.start for r in ok]))}


def measure_run(base: str, model: str, label: str, prompts, concurrency: int, temperature: float, max_tokens: int,
                request_rate: float | None, seed: int, headers: dict) -> dict:
    """One policy's run at one point: the load, and the server's scheduler/step seconds around it."""
    names = ("dspark:scheduler_seconds_total", "dspark:step_seconds_total")
    before = scrape(base, names)
    records, wall = asyncio.run(run_load(base, model, prompts, concurrency, temperature, max_tokens, request_rate,
                                         seed, headers))
    after = scrape(base, names)
    return summarize(label, concurrency, temperature, records, wall, *(after[n] - before[n] for n in names))


def median_run(runs: list[dict]) -> dict:
    """One point's rounds -> the round with the median per-user speed (its latencies and tau), with
    the median total speed, every round's two speeds, and the failures of all rounds (none hidden).
    With an even number of rounds both medians are the lower one: a speed some round measured,
    never the mean of two (which the per-user median could not be, being a whole round)."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r["per_user_tok_s"] or 0.0)
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["total_tok_s"] = statistics.median_low(r["total_tok_s"] for r in runs)
    median["num_failed"] = sum(r["num_failed"] for r in runs)
    median["rounds"] = [{"per_user_tok_s": r["per_user_tok_s"], "total_tok_s": r["total_tok_s"],
                         "accept_length": r["accept_length"]} for r in runs]
    return median


def _ms(stats: dict) -> dict:
    return {k: (v * 1000 if v is not None else None) for k, v in stats.items()}


def start_server(target: str, spec: PolicySpec, profile: Path | None, max_batch_size: int, max_model_len: int,
                 log: Path, dtype: str = "auto"):
    """One `dspark-trt serve` subprocess for a policy (see `launch.py`)."""
    from dspark_trt.serving.launch import ServeProcess

    args = ["--target", target, "--policy", spec.policy, "--drafter", spec.drafter or "none",
            "--max-batch-size", str(max_batch_size), "--max-model-len", str(max_model_len), "--log-level", "warning",
            "--dtype", dtype]
    if profile is not None:
        args += ["--profile", str(profile)]
    return ServeProcess(args, log)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in result["runs"]})
    labels = list(dict.fromkeys(r["policy"] for r in result["runs"]))
    fig, axes = plt.subplots(2, len(temperatures), figsize=(6.5 * len(temperatures), 10), squeeze=False)
    for column, temperature in enumerate(temperatures):
        pareto, budget = axes[0][column], axes[1][column]
        for label in labels:
            runs = sorted((r for r in result["runs"] if r["policy"] == label and r["temperature"] == temperature
                           and r["per_user_tok_s"] and not r.get("invalid")), key=lambda r: r["concurrency"])
            if not runs:
                continue
            xs, ys = [r["total_tok_s"] for r in runs], [r["per_user_tok_s"] for r in runs]
            line, = pareto.plot(xs, ys, marker="o", label=label)
            for r, x, y in zip(runs, xs, ys):
                pareto.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=line.get_color())
            budget.plot([r["concurrency"] for r in runs], [r["mean_verify_budget"] for r in runs], marker="o",
                        label=label)
        pareto.set(title=f"T={temperature:g}: per-user vs total throughput (labels: concurrency)",
                   xlabel="total output tok/s", ylabel="per-user tok/s")
        budget.set(title=f"T={temperature:g}: verify budget per request", xlabel="concurrency",
                   ylabel="draft tokens verified per step", xscale="log")
        for ax in (pareto, budget):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']} on {result['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def served_dtype(dtype: str) -> str:
    """What `--dtype` becomes in the servers this bench starts (on this machine)."""
    from dspark_trt.models.linear import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(dtype))


def run_bench(specs: list[PolicySpec], concurrencies: list[int], temperatures: list[float], num_requests: int | None,
              max_tokens: int, request_rate: float | None, target: str, url: str | None, api_key: str | None,
              profile: Path | None, output: Path, seed: int = 0, max_model_len: int = 1024, echo=print,
              dtype: str = "auto", rounds: int = 1) -> dict:
    """All policies' servers run at once, and each (temperature, concurrency) point is measured for
    every policy back to back, `rounds` times in alternating order (A B B A ...): whatever else
    loads the machine then loads every policy alike. Each point reports its median round."""
    from dspark_trt.runtime.device import cpu_device_name

    output.parent.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = {"model": target, "drafter": ", ".join(sorted({s.drafter for s in specs if s.drafter})) or None,
              "machine": cpu_device_name(), "dtype": served_dtype(dtype) if url is None else "of the server",
              "max_tokens": max_tokens, "request_rate": request_rate, "rounds": rounds,
              "runs": []}
    servers, bases = [], {}
    try:
        for spec in specs:
            if url is None:
                echo(f"[{spec.label}] starting server (policy {spec.policy}, drafter {spec.drafter})")
                server = start_server(target, spec, profile, max(concurrencies), max_model_len,
                                      output.with_suffix(f".{spec.label}.log"), dtype)
                servers.append(server)
                bases[spec.label] = server.url
            else:
                bases[spec.label] = url
        models = {label: httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
                  for label, base in bases.items()}
        result["model"] = next(iter(models.values()))
        for temperature in temperatures:
            for concurrency in concurrencies:
                count = num_requests or max(4, 2 * concurrency)
                prompts = load_prompt_mix(count, seed)
                per_round: dict[str, list[dict]] = {spec.label: [] for spec in specs}
                for round_index in range(rounds):
                    # A B, then B A: drift on a shared machine falls on every policy alike
                    for spec in specs if round_index % 2 == 0 else specs[::-1]:
                        run = measure_run(bases[spec.label], models[spec.label], spec.label, prompts, concurrency,
                                          temperature, max_tokens, request_rate, seed, headers)
                        per_round[spec.label].append(run)
                        echo(f"[{spec.label}] T={temperature:g} c={concurrency:>3}"
                             f"{f' round {round_index + 1}/{rounds}' if rounds > 1 else ''}: "
                             f"total {run['total_tok_s']:7.1f} tok/s, per-user {run['per_user_tok_s'] or 0:6.1f} tok/s, "
                             f"tau {run['accept_length']:.2f}, budget {run['mean_verify_budget']:.2f}, "
                             f"failed {run['num_failed']}")
                result["runs"] += [median_run(per_round[spec.label]) for spec in specs]
                output.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive a crash
    finally:
        for server in servers:
            server.stop()
    png = output.with_suffix(".png")
    plot(result, png)
    echo(f"wrote {output} and {png}")
    return result
