"""How close is the bf16 (or int4) target to the fp32 one? Greedy agreement and next-token KL on the evaluation sets.

    python benchmarks/dtype_accuracy.py [--dtype bfloat16|int4] [--num-prompts 20] [--max-tokens 64] \
        [--output benchmarks/results/dtype_accuracy.json]

`--dtype bfloat16` rounds every weight matrix to bf16 and keeps everything else in fp32
(`models/linear.py`); `--dtype int4` holds the layers' matrices in their 4-bit Q4_1 blocks and
quantizes each matmul's input to int8 (`TargetModel.use_int4_weights`; AMX-INT8 CPUs). In what
follows "bf16" stands for the dtype compared. For the first N prompts of MT-Bench, HumanEval and
GSM8K (chat template):
1. fp32 decodes greedily (the reference, itself checked against transformers by the tests);
2. both dtypes then score that same sequence (teacher forcing): the mean and largest KL(fp32 ||
   bf16) of the next-token distributions at every response position, and how often the two
   pick the same greedy token there;
3. bf16 decodes greedily on its own: how many leading tokens equal fp32's (a first difference
   sends the two down different but equally valid continuations, so free-running agreement
   counts the prefix only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)
import torch

from dspark_trt import LLM, SamplingParams
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.device import cpu_device_name
from dspark_trt.training.prompts import load_prompts

DATASETS = ("mt-bench", "humaneval", "gsm8k")


@torch.inference_mode()
def response_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probabilities `[len(response), vocab]` of each response token's position (teacher forced)."""
    tokens = prompt + response
    pool = model.new_pool(1, len(tokens) + 1)
    positions = torch.arange(len(prompt) - 1, len(tokens) - 1)  # the row that predicts response[i]
    logits = model(torch.tensor(tokens), [len(tokens)], [pool.allocate()], positions).logits
    return torch.log_softmax(logits.double(), dim=-1)


def common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# What `--dtype bfloat16` computes, by the kernel build that ran it (DSPARK_TRT_KERNEL_ISA picks one).
WHAT = {"amx": "bfloat16 on the AMX build = bf16 weight matrices, each matmul's input rounded to bf16, fp32 "
               "accumulation, norms, attention and residual stream; against float32",
        None: "bfloat16 = bf16 weight matrices, fp32 activations, against float32",
        "int4": "int4 = the layers' matrices in their GGUF Q4_1 blocks (4-bit), each matmul's input quantized "
                "to int8 per block of 32, the LM head bf16 (its input rounded to bf16 on AMX); against float32"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", choices=("bfloat16", "int4"), default="bfloat16", help="the dtype compared with float32")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/dtype_accuracy.json"))
    args = parser.parse_args()

    reference = LLM(target=args.target, dtype="float32", max_batch_size=args.num_prompts)
    fast = LLM(target=args.target, dtype=args.dtype, max_batch_size=args.num_prompts)
    compared = torch.int4 if args.dtype == "int4" else torch.bfloat16
    models = {"float32": reference.target.model, "bfloat16": load_target(args.target, compared).model}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for dataset in DATASETS:
        start = time.perf_counter()
        prompts = [reference.encode_chat(p.messages) for p in load_prompts(dataset, args.num_prompts)]
        reference_out = [o.token_ids for o in reference.generate(prompts, params)]
        fast_out = [o.token_ids for o in fast.generate(prompts, params)]
        kls, agree, prefixes = [], [], []
        for prompt, response, own in zip(prompts, reference_out, fast_out):
            exact = response_log_probs(models["float32"], prompt, response)
            rounded = response_log_probs(models["bfloat16"], prompt, response)
            kls.append((exact.exp() * (exact - rounded)).sum(-1))  # KL(fp32 || bf16) per position
            agree.append(exact.argmax(-1) == rounded.argmax(-1))
            prefixes.append(common_prefix(response, own))
        kl, same = torch.cat(kls), torch.cat(agree).double()
        results[dataset] = {
            "num_prompts": len(prompts), "positions": int(kl.numel()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "teacher_forced_top1_agreement": float(same.mean()),
            "free_running_mean_common_prefix": sum(prefixes) / len(prefixes),
            "free_running_identical_prompts": sum(p == args.max_tokens for p in prefixes),
            "free_running_prefixes": prefixes,
        }
        r = results[dataset]
        print(f"{dataset}: mean KL {r['mean_kl']:.2e} (max {r['max_kl']:.2e}), top-1 agreement "
              f"{r['teacher_forced_top1_agreement']:.4f} over {r['positions']} positions; free-running: "
              f"{r['free_running_identical_prompts']}/{len(prompts)} identical for {args.max_tokens} tokens, "
              f"mean common prefix {r['free_running_mean_common_prefix']:.1f} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    report = {"command": "python benchmarks/dtype_accuracy.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "target": reference.target.name, "max_tokens": args.max_tokens,
              "dtype": args.dtype, "what": WHAT["int4"] if args.dtype == "int4" else WHAT.get(cpu_kernels.isa(), WHAT[None]),
              "kernel_isa": cpu_kernels.isa(),
              "cpu": cpu_device_name(), "datasets": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
