"""Does lm-eval-harness score the same through `dspark-trt serve` as through its own HF backend?

    python benchmarks/lm_eval_parity.py [--limit 200] [--dtype float32] \
        [--output benchmarks/results/lm_eval_parity.json]

A loglikelihood task (multiple choice, HellaSwag's form) is written from GSM8K's *training*
split, never its test split: a word problem without its last sentence (the question), and four
continuations, its own last sentence and those of three other problems, in a seeded order. A
135M model gets most of them right (the true question names the problem's people and things),
so the accuracies compared are far from chance. Its YAML and JSONL go to a folder given to
lm-eval (`TaskManager(include_path=...)`).

The task then runs three ways on the same model (the embedded default target's folder, which
transformers loads as it is):
1. lm-eval's `hf` backend (transformers, in fp32);
2. lm-eval's `local-completions` against `dspark-trt serve --policy none` (plain decoding);
3. the same against `dspark-trt serve --policy all` (speculative decoding with the default
   drafter, every draft token verified: the policy that reports the most accepted drafts; with
   fp32 weights the load-aware `dspark` policy finds drafting does not pay on a CPU and would
   hardly draft; `--speculative-policy` picks another).
`local-completions` sends what it sends to vLLM: token-id prompts with `echo`, `logprobs: 1` and
`max_tokens: 1`, and reads the prompt tokens' logprobs back.

Written: each run's accuracy (`acc`, `acc_norm`), how many documents' answers differ from the HF
backend's, the largest difference of any choice's loglikelihood from HF's, whether the plain and
speculative servers gave identical loglikelihoods, and the wall time of each run. Scoring a
prompt never drafts (`max_tokens: 1` ends at the prompt), so that identity holds by
construction; what speculation could change is the logprobs of *generated* tokens, so each
server also completes 10 training-set questions greedily with `logprobs` (48 tokens), and the
largest difference between the two servers' token logprobs is written beside the number of
tokens the speculative one accepted from drafts. The exit status is 1 when the servers disagree
with each other or with HF beyond `--tolerance` (tests call this).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)
from dspark_trt.models.loading import resolve_target
from dspark_trt.serving.launch import ServeProcess
from dspark_trt.training.prompts import DATA_DIR, TRAINING_SETS, read_jsonl

TASK = "dspark_gsm8k_train_next_sentence"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def write_task(folder: Path, num_docs: int, seed: int = 0) -> Path:
    """The task's JSONL and YAML in `folder`; returns the JSONL."""
    rows = read_jsonl(DATA_DIR / TRAINING_SETS["gsm8k-train"][0])  # the repository's copy (data/)
    problems = [SENTENCE_END.split(row["question"].strip()) for row in rows]
    problems = [sentences for sentences in problems if len(sentences) >= 2]
    rng = random.Random(seed)
    docs = []
    for sentences in problems[:num_docs]:
        others = [other[-1] for other in rng.sample(problems, 4) if other is not sentences][:3]
        choices = [sentences[-1], *others]
        rng.shuffle(choices)
        docs.append({"context": " ".join(sentences[:-1]), "choices": [f" {c}" for c in choices],
                     "label": choices.index(sentences[-1])})
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return data


def evaluate(model: str, model_args: str, task_folder: Path) -> dict:
    """One lm-eval run: accuracies and every document's choice loglikelihoods."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=TaskManager(include_path=str(task_folder)),
                                      log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                                      torch_random_seed=0, fewshot_random_seed=0)
    seconds = time.perf_counter() - start
    metrics = results["results"][TASK]
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "seconds": seconds,
            "loglikelihoods": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}


def served(args: argparse.Namespace, policy: str, task_folder: Path, model_folder: Path, name: str) -> dict:
    server = ServeProcess(["--target", "default", "--drafter", "default", "--policy", policy, "--dtype", args.dtype,
                           "--served-model-name", name, "--log-level", "warning"])
    try:
        model_args = (f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={model_folder},tokenized_requests=True,num_concurrent=1,max_retries=1,"
                      f"max_length={args.max_length}")
        run = evaluate("local-completions", model_args, task_folder)
        run["generated"] = generate_with_logprobs(server.url, name)
        return run
    finally:
        server.stop()


def generate_with_logprobs(url: str, name: str, num_prompts: int = 10, max_tokens: int = 48) -> list[dict]:
    """Greedy completions of training-set questions with their token logprobs (one request each)."""
    import httpx

    questions = [row["question"] for row in read_jsonl(DATA_DIR / TRAINING_SETS["gsm8k-train"][0])[-num_prompts:]]
    outputs = []
    for question in questions:
        answer = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": name, "prompt": f"Question: {question}\nAnswer:", "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1}).json()
        logprobs = answer["choices"][0]["logprobs"]
        outputs.append({"tokens": logprobs["tokens"], "logprobs": logprobs["token_logprobs"],
                        "accepted": answer["dspark"]["num_accepted_tokens"]})
    return outputs


def compare_generated(speculative: list[dict], plain: list[dict]) -> dict:
    same = all(a["tokens"] == b["tokens"] for a, b in zip(speculative, plain))
    return {"same_tokens": same, "num_tokens": sum(len(a["tokens"]) for a in speculative),
            "num_accepted_draft_tokens": sum(a["accepted"] for a in speculative),
            "max_abs_logprob_difference": max(abs(x - y) for a, b in zip(speculative, plain)
                                              for x, y in zip(a["logprobs"], b["logprobs"]))}


def compare(run: dict, reference: dict) -> dict:
    pairs = list(zip(run["loglikelihoods"], reference["loglikelihoods"]))
    choice = [max(range(len(a)), key=a.__getitem__) for a, _ in pairs]
    reference_choice = [max(range(len(b)), key=b.__getitem__) for _, b in pairs]
    return {"max_abs_loglikelihood_difference": max(abs(x - y) for a, b in pairs for x, y in zip(a, b)),
            "documents_answered_differently": sum(c != r for c, r in zip(choice, reference_choice))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=200, help="documents in the task")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="the servers' dtype (the HF backend runs fp32)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest loglikelihood difference from HF that counts as numerical noise")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--speculative-policy", default="all", help="the speculative server's --policy")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/lm_eval_parity.json"))
    args = parser.parse_args()

    import torch

    model_folder = resolve_target("default")[1]
    with tempfile.TemporaryDirectory(prefix="dspark-lm-eval-") as tmp:
        task_folder = Path(tmp)
        data = write_task(task_folder, args.limit)
        runs = {"hf": evaluate("hf", f"pretrained={model_folder},dtype=float32,device=cpu,max_length={args.max_length}",
                               task_folder)}
        runs["served_plain"] = served(args, "none", task_folder, model_folder, "SmolLM2-135M-Instruct")
        runs["served_speculative"] = served(args, args.speculative_policy, task_folder, model_folder,
                                            "SmolLM2-135M-Instruct")
        task_sha = hashlib.sha256(data.read_bytes()).hexdigest()
    report = {
        "task": {"name": TASK, "source": "GSM8K train split", "documents": args.limit, "jsonl_sha256": task_sha},
        "model": str(model_folder.name), "server_dtype": args.dtype, "speculative_policy": args.speculative_policy,
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "runs": {name: {k: v for k, v in run.items() if k not in ("loglikelihoods", "generated")}
                 for name, run in runs.items()},
        "served_plain_vs_hf": compare(runs["served_plain"], runs["hf"]),
        "served_speculative_vs_hf": compare(runs["served_speculative"], runs["hf"]),
        "speculative_identical_to_plain": (runs["served_speculative"]["loglikelihoods"]
                                           == runs["served_plain"]["loglikelihoods"]),
        "generated_speculative_vs_plain": compare_generated(runs["served_speculative"]["generated"],
                                                            runs["served_plain"]["generated"]),
        "tolerance": args.tolerance,
    }
    generated = report["generated_speculative_vs_plain"]
    report["passed"] = (report["speculative_identical_to_plain"]
                        and report["served_plain_vs_hf"]["max_abs_loglikelihood_difference"] <= args.tolerance
                        and generated["same_tokens"] and generated["max_abs_logprob_difference"] <= args.tolerance)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("served_plain_vs_hf", "served_speculative_vs_hf",
                                             "speculative_identical_to_plain", "generated_speculative_vs_plain",
                                             "passed")}, indent=2))
    for name, run in report["runs"].items():
        print(f"{name}: acc {run['acc']:.4f}  acc_norm {run['acc_norm']:.4f}  ({run['seconds']:.1f} s)")
    return 0 if report["passed"] else 1


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
