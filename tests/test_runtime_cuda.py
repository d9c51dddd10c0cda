"""The PyTorch target on a CUDA GPU: `LLM`, speculative decoding, datagen and the latency
profile give what they give on the CPU (marked `cuda`: skipped without a GPU that PyTorch
sees; TensorRT is not needed). The drafter, sampling and verification stay on the CPU."""

import pytest
import torch
from tiny_drafters import FEATURE_LAYERS, make_drafter

from dspark_trt import LLM, SamplingParams
from dspark_trt.models.drafter_io import save_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.profile import measure_latency_profile
from dspark_trt.training.data import load_sequences, read_rows
from dspark_trt.training.datagen import DatagenConfig, generate_dataset
from dspark_trt.training.prompts import load_prompts

pytestmark = pytest.mark.cuda

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafters(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-drafters")
    target = load_target(tiny_llama)
    for kind, head in (("dspark", "markov"), ("eagle3", "none")):
        save_drafter(make_drafter(target, kind=kind, head=head), folder / kind)
    return folder


def test_a_gpu_target_computes_what_the_cpu_target_computes(tiny_llama):
    cpu = LLM(target=tiny_llama)
    gpu = LLM(target=tiny_llama, device="cuda")
    assert gpu.target.model.embed.device.type == "cuda" and gpu.engine.pool.keys.device.type == "cuda"
    ids = torch.tensor(cpu.encode(PROMPTS[0]))
    logits = {}
    for name, llm in (("cpu", cpu), ("gpu", gpu)):
        pool = llm.target.model.new_pool(1, 64)
        logits[name] = llm.target.model(ids, [len(ids)], [pool.allocate()]).logits.cpu()  # [tokens, vocab]
    assert (logits["gpu"] - logits["cpu"]).abs().max() < 1e-3
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu.generate(PROMPTS, GREEDY), gpu.generate(PROMPTS, GREEDY)))
    assert same >= len(PROMPTS) - 1  # both fp32; a near-tied logit may still flip one greedy token


@pytest.mark.parametrize("kind, policy", [("dspark", "all"), ("dspark", "dspark"), ("eagle3", "all")])
def test_speculative_decoding_with_a_gpu_target_equals_plain(tiny_llama, drafters, kind, policy):
    # batch_invariant: the GPU's kernels, like the CPU's BLAS, round by batch shape, and the two
    # runs batch differently; row by row the comparison is exact.
    speculative = LLM(target=tiny_llama, drafter=drafters / kind, device="cuda", policy=policy, batch_invariant=True)
    drafter = speculative.engine.proposer.drafter
    assert drafter.embed.device.type == "cpu" and all(p.device.type == "cpu" for p in drafter.parameters())
    plain = LLM(target=tiny_llama, device="cuda", batch_invariant=True).generate(PROMPTS, GREEDY)
    for a, b in zip(plain, speculative.generate(PROMPTS, GREEDY)):
        assert a.token_ids == b.token_ids
    if policy == "dspark":  # drafting is its choice from the measured profile: a tiny target may not pay for it
        assert speculative.engine.profile.backend == "torch-cuda"
    else:
        assert speculative.engine.counters.num_draft_tokens > 0


def test_datagen_on_the_gpu_writes_what_the_cpu_writes(tiny_llama, tmp_path):
    prompts = load_prompts("gsm8k-train", 4)
    config = DatagenConfig(max_tokens=16, batch_size=4, temperatures=(0.0,), feature_layers=FEATURE_LAYERS)
    rows, sequences = {}, {}
    for device in ("cpu", "cuda"):
        target = load_target(tiny_llama)
        target.model.to(device)
        generate_dataset(target, prompts, tmp_path / device / "rows.jsonl", config, tmp_path / device / "features")
        rows[device] = sorted(read_rows(tmp_path / device / "rows.jsonl"), key=lambda r: r["id"])
        sequences[device] = load_sequences(rows[device], tmp_path / device / "features")
    assert [r["id"] for r in rows["cuda"]] == [r["id"] for r in rows["cpu"]]
    agree = 0
    for cpu_row, gpu_row, cpu_seq, gpu_seq in zip(rows["cpu"], rows["cuda"], sequences["cpu"], sequences["cuda"]):
        assert gpu_row["prompt_ids"] == cpu_row["prompt_ids"]
        if gpu_row["response_ids"] != cpu_row["response_ids"]:
            continue  # a flipped near-tie (see above); its features follow other tokens
        agree += 1
        assert (gpu_seq.features.float() - cpu_seq.features.float()).abs().max() < 2e-2
        assert (gpu_seq.logsumexp - cpu_seq.logsumexp).abs().max() < 1e-3
    assert agree >= len(prompts) - 1


def test_the_latency_profile_of_a_gpu_target_names_the_gpu(tiny_llama):
    target = load_target(tiny_llama)
    target.model.to("cuda")
    profile = measure_latency_profile(target, None, max_batch_tokens=16, quick=True)
    assert profile.backend == "torch-cuda" and profile.device.startswith("cuda:")
    assert all(seconds > 0 for seconds in profile.target_step_seconds)
