"""CLI commands of the serving side: `serve`, `profile`, `bench` (registered in cli.py).

Flags only; the work happens in `server.py`, `runtime/profile.py` and `bench.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from dspark_trt.cli_options import dtype_option
from dspark_trt.serving.protocol import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CHOICES

POLICY_HELP = ("Verification policy: auto, none, all, fixed:K, threshold:H, dspark, dspark-lagged "
               "[default: auto = dspark with a DSpark drafter, the whole block (all) with other drafters, "
               "none without one].")


def resolve_drafter(target: str, drafter: str | None) -> str | None:
    """`--drafter auto`: the committed DSpark drafter for the default target, none otherwise."""
    if drafter in (None, "auto"):
        return "default" if target == "default" else None
    return None if drafter == "none" else drafter


def load_llm(engine_dir: Path | None, target: str, drafter: str | None, policy: str | None, profile: Path | None,
             max_batch_size: int, max_model_len: int, batch_invariant: bool = False, dtype: str = "auto"):
    from dspark_trt import LLM

    if engine_dir is not None:  # dtype auto: what the directory was built with
        return LLM(engine_dir=engine_dir, policy=policy, max_batch_size=max_batch_size,
                   max_model_len=max_model_len, batch_invariant=batch_invariant, dtype=dtype)
    return LLM(target=target, drafter=resolve_drafter(target, drafter), policy=policy, profile=profile,
               max_batch_size=max_batch_size, max_model_len=max_model_len, batch_invariant=batch_invariant, dtype=dtype)


def runtime_options(command):
    options = [
        click.argument("engine_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path)),
        click.option("--target", default="default", show_default=True,
                     help="'default', a Hugging Face model folder, or a .gguf file (ignored with ENGINE_DIR)."),
        click.option("--drafter", default="auto", show_default=True,
                     help="Drafter checkpoint folder, 'default', 'none', or 'auto' (the default drafter for the "
                          "default target, none for other targets)."),
        click.option("--policy", default=None, help=POLICY_HELP),
        click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="profile.json from `dspark-trt profile` (without one, a quick profile is measured at "
                          "start)."),
        click.option("--max-batch-size", type=int, default=32, show_default=True,
                     help="Requests in the running batch (KV slots); more wait in the queue."),
        click.option("--max-model-len", type=int, default=2048, show_default=True,
                     help="Longest prompt + output per request (sizes each KV slot)."),
        dtype_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("serve")
@runtime_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (0.0.0.0 for all).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="DSPARK_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (also $DSPARK_API_KEY); /health and /metrics stay public.")
@click.option("--max-queue", type=int, default=None,
              help="Most requests waiting for a slot: up to --max-batch-size running plus this many waiting are "
                   "admitted, more get HTTP 429 [default: no limit].")
@click.option("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, show_default=True,
              help="Largest request body accepted; a larger one gets HTTP 413 before it is read.")
@click.option("--max-choices", type=click.IntRange(min=1), default=DEFAULT_MAX_CHOICES, show_default=True,
              help="Most choices one request may ask for (its prompts x n); each runs as a request of its own.")
@click.option("--served-model-name", default=None, help="The model name clients send (default: the target's name).")
@click.option("--batch-invariant", is_flag=True,
              help="Each request's output is what it would be alone (bit-identical logits whatever is batched "
                   "with it). Several times slower: for reproducibility and tests.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve_command(engine_dir, target, drafter, policy, profile_path, max_batch_size, max_model_len, dtype, host, port,
                  api_key, max_queue, max_body_bytes, max_choices, served_model_name, batch_invariant, log_level):
    """Serve an OpenAI-compatible API (completions, chat, streaming, /metrics) with in-flight batching.

    Give an ENGINE_DIR written by `dspark-trt build`, or choose --target/--drafter/--policy.
    """
    from dspark_trt.serving.server import run_server

    if max_queue is not None and max_queue < 0:
        raise click.BadParameter("must be >= 0", param_hint="--max-queue")
    if max_body_bytes < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-body-bytes")
    llm = load_llm(engine_dir, target, drafter, policy, profile_path, max_batch_size, max_model_len, batch_invariant,
                   dtype)
    engine = llm.engine
    click.echo(f"serving {llm.target.name} ({llm.dtype}) with policy {engine.policy.name}"
               + (f", drafter {type(engine.proposer).__name__}" if engine.proposer else "")
               + f" on http://{host}:{port}", err=True)
    run_server(llm, host=host, port=port, api_key=api_key, max_queue=max_queue, model_name=served_model_name,
               log_level=log_level, max_body_bytes=max_body_bytes, max_choices=max_choices)


@click.command("profile")
@click.option("--target", default="default", show_default=True, help="Target to measure.")
@click.option("--drafter", default="auto", show_default=True,
              help="Drafter to measure (a folder, 'default', 'none', or 'auto').")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where profile.json goes.")
@click.option("--max-batch-tokens", type=int, default=256, show_default=True,
              help="Largest target batch (tokens) to measure.")
@click.option("--max-requests", type=int, default=32, show_default=True, help="Most requests to draft for.")
@click.option("--quick", is_flag=True, help="Fewer points, one repeat (what the server does without a profile).")
@dtype_option
def profile_command(target, drafter, output, max_batch_tokens, max_requests, quick, dtype):
    """Measure target step time vs batch tokens and drafter step time vs requests on this machine."""
    from dspark_trt import LLM
    from dspark_trt.runtime.profile import measure_latency_profile

    if max_batch_tokens < 1 or max_requests < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-batch-tokens/--max-requests")
    llm = LLM(target=target, drafter=resolve_drafter(target, drafter), policy="all" if drafter != "none" else None,
              dtype=dtype)
    profile = measure_latency_profile(llm.target, llm.engine.proposer, max_batch_tokens, max_requests, quick,
                                      progress=lambda line: click.echo(f"  {line}", err=True))
    output.parent.mkdir(parents=True, exist_ok=True)
    profile.save(output)
    click.echo(json.dumps(profile.to_json(), indent=2))


def parse_list(text: str, kind, option: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list, got {text!r}", param_hint=option) from None
    if not values:
        raise click.BadParameter("must not be empty", param_hint=option)
    return values


@click.command("bench")
@click.option("--policy", "policies", multiple=True,
              default=("none", "mtp1=fixed:1@checkpoints/smollm2-135m-instruct/mtp1", "fixed:7", "dspark",
                       "dspark-lagged"), show_default=True,
              help="Repeatable: POLICY, LABEL=POLICY or LABEL=POLICY@DRAFTER (one server each).")
@click.option("--target", default="default", show_default=True, help="Target the servers load.")
@click.option("--drafter", default="default", show_default=True, help="Drafter for policies that name none.")
@click.option("--url", default=None, help="Bench this running server instead of starting one per policy.")
@click.option("--api-key", envvar="DSPARK_API_KEY", default=None, help="Bearer key for --url.")
@click.option("--concurrency", default="1,2,4,8,16,32", show_default=True, help="Comma-separated sweep.")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated sampling temperatures.")
@click.option("--num-requests", type=int, default=None, help="Requests per run (default: max(4, 2 x concurrency)).")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--request-rate", type=float, default=None,
              help="Poisson arrivals per second (default: closed loop, `concurrency` clients back to back).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Latency profile for every server (default: measured once, before the first server).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("benchmarks/results/serving.json"), show_default=True, help="JSON; the PNG goes beside it.")
@click.option("--max-model-len", type=int, default=1024, show_default=True,
              help="Each server's context per request (bounds the KV memory of several servers at once).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Measure each point this many times, the policies in alternating order (A B B A ...), and "
                   "report the median round: use 3 or more on a machine whose speed drifts.")
@dtype_option
def bench_command(policies, target, drafter, url, api_key, concurrency, temperatures, num_requests, max_tokens,
                  request_rate, profile_path, output, max_model_len, seed, rounds, dtype):
    """Load-test servers: per-user vs total tok/s across concurrency, several policies side by side."""
    from dspark_trt.serving.bench import PolicySpec, run_bench

    concurrencies = parse_list(concurrency, int, "--concurrency")
    if min(concurrencies) < 1:
        raise click.BadParameter("must be >= 1", param_hint="--concurrency")
    temps = parse_list(temperatures, float, "--temperatures")
    if min(temps) < 0:
        raise click.BadParameter("must be >= 0", param_hint="--temperatures")
    if max_tokens < 1 or (num_requests is not None and num_requests < 1):
        raise click.BadParameter("must be >= 1", param_hint="--max-tokens/--num-requests")
    if request_rate is not None and request_rate <= 0:
        raise click.BadParameter("must be > 0", param_hint="--request-rate")
    specs = [PolicySpec.parse(p, drafter) for p in policies]
    if url is not None and len(specs) > 1:
        raise click.BadParameter("with --url give one --policy (the label for that server)", param_hint="--policy")
    if url is None and profile_path is None and any(s.policy.startswith("dspark") for s in specs):
        from dspark_trt import LLM
        from dspark_trt.runtime.profile import measure_latency_profile

        click.echo("measuring the latency profile shared by all servers", err=True)
        first = next(s for s in specs if s.policy.startswith("dspark"))
        llm = LLM(target=target, drafter=first.drafter, policy="all", dtype=dtype)
        # Measured here, before any server starts: the bench's own servers must not load the machine
        # while the curve that steers them is taken (see run_bench's profile check).
        profile = measure_latency_profile(llm.target, llm.engine.proposer, 256, max(concurrencies),
                                          progress=lambda line: click.echo(f"  {line}", err=True))
        profile_path = output.with_suffix(".profile.json")
        output.parent.mkdir(parents=True, exist_ok=True)
        profile.save(profile_path)
    else:
        llm = profile = None
    run_bench(specs, concurrencies, temps, num_requests, max_tokens, request_rate, target, url, api_key, profile_path,
              output, seed, max_model_len, echo=lambda line: click.echo(line, err=True), dtype=dtype, rounds=rounds)
    if llm is not None:
        check_profile_after(llm, profile, output)


def check_profile_after(llm, profile, output: Path) -> None:
    """Re-measure two target points once the servers are gone and record how far the profile is
    from them: a profile taken on a busy machine would mislead every confidence policy."""
    from dspark_trt.runtime.profile import measure_target_curve

    sizes = [1, 8]
    after = measure_target_curve(llm.target, sizes, repeats=5)
    ratios = [a / profile.target_seconds(b) for a, b in zip(after, sizes)]
    result = json.loads(output.read_text())
    result["profile_check"] = {"batch_tokens": sizes, "profile_seconds": [profile.target_seconds(b) for b in sizes],
                               "after_seconds": after, "after_over_profile": ratios}
    output.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"profile check: target steps now {' / '.join(f'{r:.2f}x' for r in ratios)} the profile's "
               f"(B={sizes})" + ("" if all(0.8 <= r <= 1.25 for r in ratios) else
                                 " -- the machine was not as quiet as when the profile was taken; rerun alone"),
               err=True)
