"""Greedy decoding speed: our runtime against transformers' `generate`, side by side.

    python benchmarks/decode_speed.py [--target default] [--max-tokens 64] [--output benchmarks/results/decode_speed.json]

Same prompts (MT-Bench turn 1, chat template), same checkpoint, greedy, a fixed number of new
tokens (EOS ignored, so both do the same work). Ours runs in `--dtype` (default auto: bf16
weights where our kernel runs); transformers runs in fp32 *and* bf16 and is compared at its
faster one. Batch 1 runs prompts one after another; batch 8 runs 8 prompts together
(transformers with left padding). transformers runs in a child process with PyTorch's default
threading, at whichever of 1 or 2 threads is faster for it (a short probe decides), so it is
measured at its best, not under our settings. Reports tok/s for all, the ratios, whether the
generated token ids are identical to transformers' fp32 ones, and our batch-1
decode step time against the memory-bandwidth floor of the dtype used (bytes of weights read per
step / measured read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import subprocess


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained read bandwidth of this machine: the best of a torch reduction and a BLAS GEMV
    over a buffer far larger than the caches, in 4 KB pages and in huge pages (where our packed
    weights live, `kernels/huge_pages.py`: ~4% faster to read on the Xeon SPR); the best one
    gives the strictest floor."""
    import torch

    from dspark_trt.kernels import huge_pages

    def best_read(buffer) -> float:
        matrix, vector = buffer.numpy().reshape(-1, 4096), torch.ones(4096).numpy()
        best = 0.0
        for read in (buffer.sum, lambda: matrix @ vector):
            read()
            start = time.perf_counter()
            for _ in range(repeats):
                read()
            best = max(best, buffer.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9)
        return best

    elements = megabytes * 2**20 // 4
    return max(best_read(torch.ones(elements)), best_read(huge_pages.place(torch.ones(elements))))


def transformers_worker(job_path: Path) -> None:
    """Child process: time transformers' generate on the job's prompt groups, write the results."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(job_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=getattr(torch, job["dtype"])).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    probe = job["groups"][0][:1]
    timings = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        hf_generate(model, tokenizer, probe, 4)
        timings[threads] = hf_generate(model, tokenizer, probe, 16)[1]
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    runs = [hf_generate(model, tokenizer, group, job["max_tokens"]) for group in job["groups"]]
    job_path.write_text(json.dumps({"threads": best, "ids": [ids for r in runs for ids in r[0]],
                                    "seconds": sum(r[1] for r in runs)}))


def run_transformers(folder: Path, groups: list[list[list[int]]], max_tokens: int, dtype: str) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"folder": str(folder), "groups": groups, "max_tokens": max_tokens, "dtype": dtype}))
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        subprocess.run([sys.executable, __file__, "--transformers-worker", str(job)], check=True, env=env)
        return json.loads(job.read_text())


def ours_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from dspark_trt import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], time.perf_counter() - start


def hf_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    import torch

    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist(), time.perf_counter() - start


def decode_step_ms(llm, prompt: list[int], steps: int = 32) -> float:
    """Median time of one batch-1 decode step of our engine (prefill excluded)."""
    from dspark_trt import SamplingParams

    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort(request)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts for the batch-1 run (batch 8 uses 8)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/decode_speed.json"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="our weights")
    parser.add_argument("--transformers-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_worker:
        transformers_worker(args.transformers_worker)
        return 0

    from dspark_trt import LLM  # before torch: it sets the threading policy our runtime needs
    from dspark_trt.training.prompts import load_prompts
    import torch

    llm = LLM(target=args.target, max_batch_size=8, dtype=args.dtype)
    prompts = [llm.encode_chat(p.messages) for p in load_prompts("mt-bench", max(8, args.num_prompts))]
    ours_generate(llm, prompts[:1], 4)  # warm-up

    results = {"command": f"python benchmarks/decode_speed.py --max-tokens {args.max_tokens} --num-prompts "
                          f"{args.num_prompts} --dtype {args.dtype}",
               "target": llm.target.name, "max_tokens": args.max_tokens, "dtype": llm.dtype,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
               "ours_threads": torch.get_num_threads()}
    for batch in (1, 8):
        groups = [[p] for p in prompts[: args.num_prompts]] if batch == 1 else [prompts[:8]]
        ours_ids, ours_time = [], 0.0
        for group in groups:
            ids, seconds = ours_generate(llm, group, args.max_tokens)
            ours_ids += ids
            ours_time += seconds
        baselines = {dtype: run_transformers(llm.target.folder, groups, args.max_tokens, dtype)
                     for dtype in ("float32", "bfloat16")}
        best = min(baselines, key=lambda d: baselines[d]["seconds"])
        tokens = sum(map(len, ours_ids))
        results[f"batch_{batch}"] = {
            "ours_tok_s": tokens / ours_time,
            **{f"transformers_{d}_tok_s": tokens / b["seconds"] for d, b in baselines.items()},
            "transformers_best_dtype": best, "speedup": baselines[best]["seconds"] / ours_time,
            "identical_outputs_with_transformers_fp32": sum(a == b for a, b in
                                                            zip(ours_ids, baselines["float32"]["ids"])),
            "num_prompts": len(ours_ids), "transformers_threads": {d: b["threads"] for d, b in baselines.items()},
        }

    bandwidth = read_bandwidth_gbs()
    weight_bytes = llm.target.model.weight_bytes()
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    step_ms = decode_step_ms(llm, prompts[0])
    results["batch_1_step"] = {"ours_step_ms": step_ms, "weight_bytes_per_step": weight_bytes,
                               "read_bandwidth_gb_s": bandwidth, "bandwidth_floor_ms": floor_ms,
                               "ratio_to_floor": step_ms / floor_ms}

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    for batch in (1, 8):
        r = results[f"batch_{batch}"]
        print(f"batch {batch}: ours ({llm.dtype}) {r['ours_tok_s']:.1f} tok/s, transformers fp32 "
              f"{r['transformers_float32_tok_s']:.1f} / bf16 {r['transformers_bfloat16_tok_s']:.1f} tok/s, speed-up "
              f"{r['speedup']:.2f}x over its faster one; identical outputs "
              f"{r['identical_outputs_with_transformers_fp32']}/{r['num_prompts']}")
    s = results["batch_1_step"]
    print(f"batch-1 decode step {s['ours_step_ms']:.1f} ms; floor {s['bandwidth_floor_ms']:.1f} ms "
          f"({s['weight_bytes_per_step'] / 1e6:.0f} MB at {s['read_bandwidth_gb_s']:.1f} GB/s): "
          f"{s['ratio_to_floor']:.2f}x the floor")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
