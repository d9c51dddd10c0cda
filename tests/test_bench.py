"""`dspark-trt bench`: the summary arithmetic on hand-made records, and a real sweep against a
real tiny server that writes the documented JSON schema and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.serving.bench import PolicySpec, RequestRecord, median_run, percentiles, summarize
from servers import ServerProcess


def test_policy_specs():
    assert PolicySpec.parse("dspark", "d") == PolicySpec("dspark", "dspark", "d")
    assert PolicySpec.parse("none", "d") == PolicySpec("none", "none", None)
    assert PolicySpec.parse("mtp1=fixed:1@ckpt/mtp1", "d") == PolicySpec("mtp1", "fixed:1", "ckpt/mtp1")
    with pytest.raises(DsparkError):
        PolicySpec.parse("label=", "d")


def test_summary_arithmetic():
    records = [
        RequestRecord(start=0.0, first_token=0.5, last_token=2.5, end=2.5, completion_tokens=11,
                      token_gaps=[0.2] * 10, stats={"num_steps": 4, "num_accepted_tokens": 6, "mean_verify_budget": 3.0}),
        RequestRecord(start=1.0, first_token=1.2, last_token=2.2, end=2.2, completion_tokens=6,
                      token_gaps=[0.2] * 5, stats={"num_steps": 4, "num_accepted_tokens": 1, "mean_verify_budget": 1.0}),
        RequestRecord(start=1.0, error="HTTP 429"),
    ]
    run = summarize("p", 2, 0.0, records, wall=4.0, scheduler=0.1, steps=2.0)
    assert run["num_requests"] == 2 and run["num_failed"] == 1
    assert run["total_tok_s"] == pytest.approx(17 / 4.0)
    assert run["per_user_tok_s"] == pytest.approx((10 / 2.0 + 5 / 1.0) / 2)
    assert run["accept_length"] == pytest.approx(1 + 7 / 8)
    assert run["mean_verify_budget"] == pytest.approx(2.0)
    assert run["scheduler_fraction"] == pytest.approx(0.05)
    assert run["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert run["itl_ms"]["p50"] == pytest.approx(200.0)
    assert percentiles([]) == {"mean": None, "p50": None, "p99": None}


def test_rounds_report_the_median_round_and_every_failure():
    runs = [{"per_user_tok_s": speed, "total_tok_s": total, "accept_length": tau, "num_failed": failed, "ttft_ms": speed}
            for speed, total, tau, failed in ((30.0, 100.0, 1.5, 0), (10.0, 300.0, 1.1, 2), (20.0, 200.0, 1.3, 0))]
    median = median_run(runs)
    assert median["per_user_tok_s"] == 20.0 and median["accept_length"] == 1.3 and median["ttft_ms"] == 20.0
    assert median["total_tok_s"] == 200.0 and median["num_failed"] == 2
    assert [r["per_user_tok_s"] for r in median["rounds"]] == [30.0, 10.0, 20.0]
    assert "rounds" not in runs[0] and median_run(runs[:1]) is runs[0]  # one round: the run itself
    even = median_run(runs[:2])  # two rounds: the lower of each, as measured (no mean of two)
    assert even["per_user_tok_s"] == 10.0 and even["total_tok_s"] == 100.0


def test_bench_against_a_real_server(tiny_factory, tmp_path):
    target = tiny_factory("llama", max_position_embeddings=2048)
    server = ServerProcess("--target", str(target), "--drafter", "none")
    try:
        output = tmp_path / "serving.json"
        result = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "bench", "--url", server.url, "--policy",
                                 "none", "--concurrency", "1,3", "--temperatures", "0,1", "--num-requests", "3",
                                 "--max-tokens", "8", "--rounds", "2", "--output", str(output)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
    finally:
        server.stop()
    data = json.loads(output.read_text())
    assert set(data) >= {"model", "drafter", "machine", "runs"} and data["rounds"] == 2
    assert [(r["concurrency"], r["temperature"]) for r in data["runs"]] == [(1, 0.0), (3, 0.0), (1, 1.0), (3, 1.0)]
    for run in data["runs"]:
        assert set(run) >= {"policy", "concurrency", "temperature", "num_requests", "total_tok_s", "per_user_tok_s",
                            "accept_length", "mean_verify_budget", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}
        assert run["num_requests"] == 3 and run["total_tok_s"] > 0
        assert len(run["rounds"]) == 2 and run["num_failed"] == 0
        assert run["accept_length"] == 1.0 and run["mean_verify_budget"] == 0.0  # plain decoding
        assert set(run["ttft_ms"]) == {"mean", "p50", "p99"}
    assert output.with_suffix(".png").stat().st_size > 10_000
