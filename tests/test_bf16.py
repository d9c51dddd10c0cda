"""The bf16 engine: our packed kernel, bf16-vs-fp32 accuracy, and batch invariance at full speed.

`--dtype bfloat16` rounds weight matrices to bf16 and keeps activations in fp32. On a CPU with
AVX-512 or AVX2 the products and the attention run through `kernels/cpu_kernels.c` (one source,
built per ISA, bit-identical results on both: checked here), whose results for one token do not
depend on the other tokens of a call; with the rest of the CPU forward pass
(row-wise norms and elementwise ops, checked here) that makes a request's logits bit-identical
whatever else shares its steps, so greedy speculative output equals plain decoding under any
load without the slow `--batch-invariant` mode.
"""

import json
import os
import random
import subprocess
import sys

import numpy
import pytest
import torch
from click.testing import CliRunner
from tiny_drafters import make_drafter

from dspark_trt import LLM, SamplingParams
from dspark_trt.cli import main
from dspark_trt.errors import InvalidRequestError
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.linear import resolve_dtype
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.dspark_proposer import DSparkProposer
from dspark_trt.runtime.engine import Engine
from dspark_trt.runtime.profile import LatencyProfile

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")


# ---- the kernel ------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (577, 33), (64, 100), (1536, 576), (16, 4096)])
def test_kernel_computes_fp32_rows_times_bf16_weights(in_features, out_features):
    generator = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(in_features, out_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    packed = cpu_kernels.PackedWeight(weight)
    assert torch.equal(packed.unpack(), weight.bfloat16())
    for rows in (1, 5, 6, 7, 13, 40):
        x = torch.randn(rows, in_features, generator=generator)
        exact = cpu_kernels.matmul_inputs(x).double() @ weight.bfloat16().double() + bias.double()
        got = cpu_kernels.matmul(x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        # one fp32 sum per output (after the AMX build's rounding of x to bf16): fp32 rounding of a K-term sum
        scale = (x.double().abs() @ weight.bfloat16().double().abs()).max()
        assert (got.double() - exact).abs().max() <= 1e-6 * scale + 1e-6


@needs_kernel
def test_kernel_rows_do_not_depend_on_the_other_rows():
    generator = torch.Generator().manual_seed(0)
    packed = cpu_kernels.PackedWeight(torch.randn(576, 3072, generator=generator))
    x = torch.randn(64, 576, generator=generator)
    alone = torch.cat([cpu_kernels.matmul(x[i : i + 1], packed) for i in range(64)])
    for rows in (2, 3, 6, 8, 17, 64):
        for start in range(0, 64 - rows + 1, rows):
            assert torch.equal(cpu_kernels.matmul(x[start : start + rows], packed), alone[start : start + rows])
    strided = torch.randn(64, 1000, generator=generator)[:, :576]  # a view with a row stride
    rows = torch.cat([cpu_kernels.matmul(r[None], packed) for r in strided])
    assert torch.equal(cpu_kernels.matmul(strided, packed), rows)
    wide = cpu_kernels.PackedWeight(torch.randn(64, 64 * 40, generator=generator))  # 40 groups: every thread works
    x = torch.randn(9, 64, generator=generator)
    assert torch.equal(cpu_kernels.matmul(x, wide), torch.cat([cpu_kernels.matmul(r[None], wide) for r in x]))


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64, 80, 144])
def test_attention_kernel_matches_torch_attention_and_ignores_the_rest_of_the_call(head_dim):
    """Each token over exactly its visible keys: equal to torch's causal attention within fp32
    rounding, and bit-identical whether it comes alone or with other tokens and slots (head dims
    that are not a multiple of 16, or above 128, take the masked and multi-pass paths)."""
    from dspark_trt.models.target import grouped_attention

    generator = torch.Generator().manual_seed(head_dim)
    slots, kv_heads, heads, capacity = 3, 2, 6, 96
    keys = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator)
    values = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator)
    lengths = [40, 7, 90]  # each slot's tokens before the new ones
    counts = [5, 1, 6]
    q = torch.randn(sum(counts), heads, head_dim, generator=generator)
    slot_index = torch.cat([torch.full((n,), s) for s, n in enumerate(counts)])
    positions = torch.cat([torch.arange(length, length + n) for length, n in zip(lengths, counts)])
    together = cpu_kernels.attention(q, keys, values, slot_index, positions)
    alone = torch.cat([cpu_kernels.attention(q[t : t + 1], keys, values, slot_index[t : t + 1], positions[t : t + 1])
                       for t in range(len(q))])
    assert torch.equal(together, alone)
    start = 0
    for slot, (length, count) in enumerate(zip(lengths, counts)):
        reference = grouped_attention(q[start : start + count].transpose(0, 1), keys[slot, :, : length + count],
                                      values[slot, :, : length + count], length)
        torch.testing.assert_close(together[start : start + count], reference, rtol=1e-5, atol=1e-5)
        start += count


@needs_kernel
def test_argmax_kernel_returns_what_torch_argmax_returns():
    """First maximum on ties, NaN as the maximum, all -inf rows, row slices of wider tensors."""
    from dspark_trt.runtime.sampling import greedy_tokens

    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(*shape, generator=generator) for shape in ((8, 49152), (1, 8192), (3, 17), (5, 1), (2, 49153))]
    ties = torch.randint(0, 3, (50, 1000), generator=generator).float()
    ties[3, 500] = ties[3, 700] = float("nan")
    ties[4] = float("-inf")
    ties[5, -1] = float("inf")
    cases += [ties, torch.randn(2, 7, 100, generator=generator)[:, 3]]
    for logits in cases:
        assert torch.equal(cpu_kernels.argmax(logits), logits.argmax(-1)), logits.shape
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


@needs_kernel
def test_top_probability_kernel_matches_the_definition():
    """The C pass the proposer runs gives `top_probability_logit` within fp32 rounding: ties (the
    other maxima count), p_top within 1e-6 of 1 (the cap), NaN rows, strided slot views, tails."""
    from dspark_trt.models.drafter import TOP_PROBABILITY_LOGIT_CAP, top_probability_logit

    generator = torch.Generator().manual_seed(0)
    block = torch.randn(3, 7, 8192, generator=generator) * 3
    block[0, 2, 11] += 30.0  # p_top ~1: capped
    block[1, 4, 5] += 9.0
    ties = torch.randint(0, 3, (6, 1001), generator=generator).float()
    cases = [block, block[:, 3], torch.randn(4, 17, generator=generator), torch.zeros(2, 16), ties]
    for logits in cases:
        got = cpu_kernels.top_probability_logit(logits, TOP_PROBABILITY_LOGIT_CAP)
        torch.testing.assert_close(got, top_probability_logit(logits), rtol=1e-5, atol=2e-6)
    assert got.shape == ties.shape[:-1]
    with_nan = torch.randn(2, 40, generator=generator)
    with_nan[1, 9] = float("nan")
    got = cpu_kernels.top_probability_logit(with_nan, TOP_PROBABILITY_LOGIT_CAP)
    assert torch.isfinite(got[0]) and torch.isnan(got[1])


@needs_kernel
def test_the_draft_slot_kernel_does_the_slots_pytorch_ops_bit_for_bit():
    """`draft_slot` adds the Markov rows and then the sparse copy-bias terms (in order, a repeated
    cell twice) to one slot of a block as PyTorch's fp32 adds do, then takes the argmax and
    top-probability logit of what it made: bit-identical to the ops the proposer ran before, with
    no table or no terms, and with a NaN row; other slots are left alone."""
    from dspark_trt.models.drafter import TOP_PROBABILITY_LOGIT_CAP

    generator = torch.Generator().manual_seed(4)
    block = torch.randn(3, 7, 1000, generator=generator) * 4  # [N, gamma, V]
    table = torch.randn(1001, 1000, generator=generator)
    previous = torch.tensor([5, 1000, 5])
    terms = ([0, 2, 0, 1], [17, 999, 17, 3], [2.5, 1.0, 0.1, 40.0])  # row 1's term makes it the argmax
    block[2, 4, 11] = float("nan")
    for k, use_table, use_terms in ((4, True, True), (0, False, True), (6, True, False)):
        expected, others = block[:, k].clone(), block[:, [j for j in range(7) if j != k]].clone()
        if use_table:
            expected.add_(table.index_select(0, previous))
        if use_terms:
            values = expected.numpy()
            for row, column, weight in zip(*terms):
                values[row, column] += numpy.float32(weight)
        top = torch.full((3, 7), -1.0)
        ids = torch.full((8, 3), -1, dtype=torch.long)
        ids[k] = previous
        cpu_kernels.draft_slot(block, k, table if use_table else None, ids, terms if use_terms else None, top,
                               TOP_PROBABILITY_LOGIT_CAP)
        got, chosen = block[:, k], ids[k + 1]
        assert (ids[[j for j in range(8) if j not in (k, k + 1)]] == -1).all()  # only slot k's row is written
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(chosen, expected.argmax(-1))
        if use_terms:
            assert chosen[1] == 3
        if k == 4:
            assert chosen[2] == 11  # the NaN counts as the maximum
        torch.testing.assert_close(top[:, k], cpu_kernels.top_probability_logit(expected, TOP_PROBABILITY_LOGIT_CAP),
                                   rtol=0, atol=0, equal_nan=True)
        assert (top[:, [j for j in range(7) if j != k]] == -1.0).all()  # only slot k's column is written
        torch.testing.assert_close(block[:, [j for j in range(7) if j != k]], others, rtol=0, atol=0, equal_nan=True)


@needs_kernel  # compares the fallback with the kernel path
def test_without_the_kernel_bf16_falls_back_to_torch_and_auto_to_float32(tiny_llama):
    """DSPARK_TRT_BF16_KERNEL=off (or no avx512_bf16 / compiler): bfloat16 runs through torch
    (oneDNN) with the same numerics up to the activations' rounding, and `auto` means float32."""
    code = f"""
import torch, dspark_trt
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.linear import resolve_dtype
from dspark_trt.models.loading import load_target
assert not cpu_kernels.available() and "DSPARK_TRT_BF16_KERNEL" in cpu_kernels.unavailable_reason()
assert resolve_dtype("auto") == torch.float32
model = load_target({str(tiny_llama)!r}, torch.bfloat16).model
pool = model.new_pool(1, 64)
print(model(torch.arange(1, 20), [19], [pool.allocate()]).logits.tolist())
"""
    env = {**os.environ, "DSPARK_TRT_BF16_KERNEL": "off"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    fallback = torch.tensor(eval(result.stdout))
    model = load_target(tiny_llama, torch.bfloat16).model
    ours = model(torch.arange(1, 20), [19], [model.new_pool(1, 64).allocate()]).logits
    # The fallback also rounds activations to bf16 (oneDNN): close, not equal.
    assert not torch.equal(fallback, ours)
    torch.testing.assert_close(fallback, ours, rtol=0.02, atol=0.02 * float(ours.abs().max()))


# ---- one kernel source, two ISAs ------------------------------------------------------------

# Run in a child process per ISA (`DSPARK_TRT_KERNEL_ISA` is read once per process): matmuls over
# 1-16 rows and odd shapes (row and column tails, a group's unused half), attention over head
# dims that take the masked and multi-pass paths, argmax, and whole decoder passes (prefill chunks
# beside decode tokens, biased qkv) of tiny targets. Saves every output.
ISA_WORKLOAD = r"""
import json, sys
import dspark_trt
import torch
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.loading import load_target

wanted, folders, output = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
assert cpu_kernels.isa() == wanted, (cpu_kernels.isa(), cpu_kernels.unavailable_reason())
generator = torch.Generator().manual_seed(0)
results = {}
for in_features, out_features in ((577, 33), (64, 97), (130, 1000), (31, 161)):
    weight = torch.randn(in_features, out_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    packed = cpu_kernels.PackedWeight(weight)
    for rows in range(1, 17):
        results[f"matmul {in_features}x{out_features} rows {rows}"] = cpu_kernels.matmul(
            torch.randn(rows, in_features, generator=generator), packed, bias)
for head_dim in (16, 80, 144):
    keys, values = (torch.randn(3, 2, 96, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(12, 6, head_dim, generator=generator)
    slots = torch.tensor([0] * 5 + [1] + [2] * 6)
    positions = torch.cat([torch.arange(40, 45), torch.tensor([7]), torch.arange(85, 91)])
    results[f"attention {head_dim}"] = cpu_kernels.attention(q, keys, values, slots, positions)
logits = torch.randn(5, 4099, generator=generator)
logits[1, 7] = float("nan")
logits[3, 100:200] = 5.0
results["argmax"] = cpu_kernels.argmax(logits)
results["top probability logit"] = cpu_kernels.top_probability_logit(logits, 13.8)
from dspark_trt.runtime.sampling import mixed_seed
ids = torch.randperm(50000, generator=generator)[:20003]
results["gumbel noise"] = cpu_kernels.gumbel_noise(mixed_seed(11, 3), ids)
scores = torch.log_softmax(torch.randn(6, 20003, generator=generator) * 3, -1)
scores[2] = float("-inf")
scores[4, 17] = float("nan")
keys = [mixed_seed(seed, 5) for seed in range(6)]
results["gumbel argmax"] = torch.tensor(cpu_kernels.gumbel_argmax(scores, keys))
results["gumbel argmax ids"] = torch.tensor(cpu_kernels.gumbel_argmax(scores, keys, ids))
for name, folder in folders.items():
    model = load_target(folder, torch.bfloat16).model
    assert model._runs_cpu_kernels()  # one C pass per step
    pool = model.new_pool(2, 64)
    caches = [pool.allocate(), pool.allocate()]
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=generator)
    steps = []
    for counts, chunk in (([23, 5], tokens[:28]), ([1, 7], tokens[28:36]), ([3, 1], tokens[36:40])):
        out = model(chunk, counts, caches, feature_layers=(1,))
        steps.append((out.logits, out.features))
    results[f"decoder {name}"] = steps
    results[f"decoder {name} keys"] = pool.keys.clone()
torch.save(results, output)
"""


@pytest.fixture(scope="module")
def isa_outputs(tiny_factory, tmp_path_factory):
    """ISA -> its child's outputs, or the reason this CPU cannot run it (each child runs once)."""
    folders = {architecture: str(tiny_factory(architecture)) for architecture in ("llama", "qwen2")}
    found = {}

    def outputs(isa: str) -> dict:
        if isa not in found:
            chosen, why_not = cpu_kernels.choose_isa(isa)
            if chosen is None:
                found[isa] = why_not
            else:
                path = tmp_path_factory.mktemp("isa") / f"{isa}.pt"
                env = {**os.environ, "DSPARK_TRT_KERNEL_ISA": isa}
                env.pop("DSPARK_TRT_BF16_KERNEL", None)
                result = subprocess.run([sys.executable, "-c", ISA_WORKLOAD, isa, json.dumps(folders), str(path)],
                                        capture_output=True, text=True, env=env, timeout=300)
                assert result.returncode == 0, result.stderr[-3000:]
                found[isa] = torch.load(path)
        if isinstance(found[isa], str):
            pytest.skip(f"this CPU cannot run the {isa} build: {found[isa]}")
        return found[isa]

    outputs.folders = folders
    return outputs


@needs_kernel
@pytest.mark.parametrize("isa", list(cpu_kernels.ISAS))
def test_each_isa_build_computes_the_fp32_reference(isa_outputs, isa):
    """Each ISA's build against PyTorch in fp32 (float64 for the matmuls) on the same bf16-rounded
    weights: within fp32 rounding everywhere, the same argmax as torch. The AMX build's matmuls
    multiply inputs rounded to bf16: its matmuls are checked against that (within fp32 rounding),
    its whole decoder passes against the fp32 model within bf16's precision."""
    from dspark_trt.models.drafter import top_probability_logit
    from dspark_trt.models.target import grouped_attention
    from dspark_trt.runtime.sampling import gumbel_noise, mixed_seed

    got = isa_outputs(isa)
    rounds_inputs = isa == "amx"
    decoder_tolerance = 2e-2 if rounds_inputs else 1e-4
    generator = torch.Generator().manual_seed(0)  # the child's draws, in its order
    for in_features, out_features in ((577, 33), (64, 97), (130, 1000), (31, 161)):
        weight = torch.randn(in_features, out_features, generator=generator) * 0.05
        bias = torch.randn(out_features, generator=generator)
        rounded = weight.bfloat16().double()
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=generator)
            x = (x.bfloat16() if rounds_inputs else x).double()
            out = got[f"matmul {in_features}x{out_features} rows {rows}"]
            assert out.shape == (rows, out_features)
            scale = (x.abs() @ rounded.abs()).max()  # one fp32 FMA chain per output: K roundings at most
            assert (out.double() - (x @ rounded + bias.double())).abs().max() <= 1e-6 * scale + 1e-6, (rows, out_features)
    for head_dim in (16, 80, 144):
        keys, values = (torch.randn(3, 2, 96, head_dim, generator=generator) for _ in range(2))
        q = torch.randn(12, 6, head_dim, generator=generator)
        start = 0
        for slot, (length, count) in enumerate(((40, 5), (7, 1), (85, 6))):
            reference = grouped_attention(q[start : start + count].transpose(0, 1), keys[slot, :, : length + count],
                                          values[slot, :, : length + count], length)
            torch.testing.assert_close(got[f"attention {head_dim}"][start : start + count], reference, rtol=1e-5,
                                       atol=1e-5)
            start += count
    logits = torch.randn(5, 4099, generator=generator)
    logits[1, 7] = float("nan")
    logits[3, 100:200] = 5.0
    assert torch.equal(got["argmax"], logits.argmax(-1))
    top = got["top probability logit"]
    assert torch.isnan(top[1]) and not torch.isnan(top[[0, 2, 3, 4]]).any()
    torch.testing.assert_close(top[[0, 2, 3, 4]], top_probability_logit(logits[[0, 2, 3, 4]]).clamp(max=13.8),
                               rtol=1e-5, atol=2e-6)
    # Seeded sampling's noise: the hash bit for bit, the logs within an ulp or two of PyTorch's;
    # the Gumbel-max token over 3 of the kernel's chunks, with and without column ids, an all -inf
    # row (index 0) and a NaN (its index), as torch.argmax gives them.
    ids = torch.randperm(50000, generator=generator)[:20003]
    torch.testing.assert_close(got["gumbel noise"], gumbel_noise(mixed_seed(11, 3), ids), rtol=1e-12, atol=1e-14)
    scores = torch.log_softmax(torch.randn(6, 20003, generator=generator) * 3, -1)
    scores[2] = float("-inf")
    scores[4, 17] = float("nan")
    keys = [mixed_seed(seed, 5) for seed in range(6)]
    for name, column_ids in (("gumbel argmax", torch.arange(20003)), ("gumbel argmax ids", ids)):
        expected = [int(torch.argmax(row.double() + gumbel_noise(key, column_ids))) for row, key in zip(scores, keys)]
        assert got[name].tolist() == expected and expected[2] == 0 and expected[4] == 17, name
    for name, folder in isa_outputs.folders.items():
        model = load_target(folder, torch.bfloat16).model.float()  # the same rounded weights, PyTorch fp32 ops
        assert not model._runs_cpu_kernels()
        pool = model.new_pool(2, 64)
        caches = [pool.allocate(), pool.allocate()]
        tokens = torch.randint(0, model.config.vocab_size, (40,), generator=generator)
        chunks = (([23, 5], tokens[:28]), ([1, 7], tokens[28:36]), ([3, 1], tokens[36:40]))
        for (counts, chunk), (logits, features) in zip(chunks, got[f"decoder {name}"]):
            reference = model(chunk, counts, caches, feature_layers=(1,))
            assert (logits - reference.logits).abs().max() < decoder_tolerance * reference.logits.abs().max(), name
            if not rounds_inputs:
                assert torch.equal(logits.argmax(-1), reference.logits.argmax(-1)), name
            assert (features - reference.features).abs().max() < decoder_tolerance * reference.features.abs().max()
        assert (got[f"decoder {name} keys"] - pool.keys).abs().max() < decoder_tolerance * pool.keys.abs().max()


@needs_kernel
def test_the_avx2_and_avx512_builds_give_bit_identical_results(isa_outputs):
    """The same operations in the same order on both ISAs (a 16-lane vector is one zmm or two ymm;
    the reductions and exp are built to match), and one packed weight layout: every output of
    the workload, bit for bit."""
    avx512, avx2 = isa_outputs("avx512"), isa_outputs("avx2")
    assert avx512.keys() == avx2.keys()
    for name in avx512:
        if name.startswith("decoder") and not name.endswith("keys"):
            for (logits, features), (logits2, features2) in zip(avx512[name], avx2[name]):
                assert torch.equal(logits, logits2) and torch.equal(features, features2), name
        else:  # NaN where the input had one (the top-probability logit's NaN row) counts as equal
            torch.testing.assert_close(avx512[name], avx2[name], rtol=0, atol=0, equal_nan=True, msg=name)


def test_the_kernel_isa_is_the_best_the_cpu_has_or_the_one_asked_for():
    """avx512 needs F and BW, avx2 needs AVX2 and FMA; `auto` takes the best present; a forced ISA
    the CPU lacks, or an unknown name, leaves the kernels off with a reason that names it."""
    zen4 = {"sse2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    zen3 = {"sse2", "avx", "avx2", "fma"}
    assert cpu_kernels.choose_isa("auto", zen4) == ("avx512", None)
    assert cpu_kernels.choose_isa("", zen4) == ("avx512", None)
    assert cpu_kernels.choose_isa("avx2", zen4) == ("avx2", None)
    assert cpu_kernels.choose_isa("AVX2", zen4) == ("avx2", None)
    assert cpu_kernels.choose_isa("auto", zen3) == ("avx2", None)
    assert cpu_kernels.choose_isa("auto", zen4 - {"avx512bw"}) == ("avx2", None)  # Knights Landing: F, no BW
    assert cpu_kernels.choose_isa("auto", {"sse2", "avx", "avx2"})[0] is None  # AVX2 without FMA: none
    isa, why = cpu_kernels.choose_isa("avx512", zen3)
    assert isa is None and "DSPARK_TRT_KERNEL_ISA=avx512" in why and "avx512f, avx512bw" in why
    isa, why = cpu_kernels.choose_isa("auto", {"sse2", "avx"})
    assert isa is None and "avx2 and fma" in why and "avx512f and avx512bw" in why
    isa, why = cpu_kernels.choose_isa("neon", zen4)
    assert isa is None and "'neon'" in why and "auto, amx, avx512, avx2" in why
    assert cpu_kernels.supported_isas(zen4) == ["avx512", "avx2"]
    sapphire_rapids = zen4 | {"avx512_bf16", "amx_tile", "amx_bf16"}
    assert cpu_kernels.choose_isa("auto", sapphire_rapids) == ("amx", None)
    assert cpu_kernels.supported_isas(sapphire_rapids) == ["amx", "avx512", "avx2"]
    assert cpu_kernels.choose_isa("auto", zen4 | {"avx512_bf16"}) == ("avx512", None)  # Zen 4: no AMX
    isa, why = cpu_kernels.choose_isa("amx", zen4)
    assert isa is None and "amx_tile, amx_bf16" in why
    assert cpu_kernels.supported_isas(zen3) == ["avx2"]
    assert cpu_kernels.supported_isas({"sse2", "avx"}) == []
    code = """
import warnings
import dspark_trt
from dspark_trt.kernels import cpu_kernels
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert not cpu_kernels.available() and cpu_kernels.isa() is None
assert "DSPARK_TRT_KERNEL_ISA='sse9'" in cpu_kernels.unavailable_reason(), cpu_kernels.unavailable_reason()
assert any("sse9" in str(w.message) for w in caught), [str(w.message) for w in caught]
"""
    env = {**os.environ, "DSPARK_TRT_KERNEL_ISA": "sse9"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    if cpu_kernels.available():
        assert cpu_kernels.isa() == cpu_kernels.choose_isa()[0]


# ---- the model in bf16 ------------------------------------------------------------------------


def test_bf16_weights_keep_activations_norms_and_cache_in_fp32(tiny_llama):
    target = load_target(tiny_llama, torch.bfloat16)
    model = target.model
    assert model.weight_dtype == torch.bfloat16
    assert all(layer.qkv.weight_t.dtype == torch.bfloat16 and layer.attn_norm.dtype == torch.float32
               for layer in model.layers)
    pool = model.new_pool(1, 64)
    assert pool.keys.dtype == torch.float32
    out = model(torch.arange(1, 20), [19], [pool.allocate()], feature_layers=(1,))
    assert out.logits.dtype == out.features.dtype == torch.float32
    exact = load_target(tiny_llama).model
    reference = exact(torch.arange(1, 20), [19], [exact.new_pool(1, 64).allocate()]).logits
    # Weight rounding to bf16 (8 bits of mantissa) moves logits by a few percent, never more.
    assert (out.logits - reference).abs().max() <= 0.05 * reference.abs().max()
    assert model.weight_bytes() < 0.6 * exact.weight_bytes()


def test_dtype_choices_are_checked_and_named(tiny_llama):
    with pytest.raises(InvalidRequestError, match="dtype must be one of auto, float32, bfloat16") as error:
        LLM(target=tiny_llama, dtype="float16")
    assert error.value.param == "dtype"
    llm = LLM(target=tiny_llama, dtype="float32")
    assert llm.dtype == "float32" and llm.target.model.weight_dtype == torch.float32
    assert LLM(target=tiny_llama).dtype == str(resolve_dtype("auto")).removeprefix("torch.")
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--target", str(tiny_llama), "--dtype", "fp8"])
    assert result.exit_code == 2 and "'fp8' is not one of 'auto', 'float32', 'bfloat16'" in result.output
    runs = {dtype: CliRunner().invoke(main, ["generate", "--prompt", "hi", "--target", str(tiny_llama), "--dtype",
                                             dtype, "--max-tokens", "3", "--raw", "--json"])
            for dtype in ("float32", "bfloat16")}
    assert all(run.exit_code == 0 for run in runs.values()), {d: r.output for d, r in runs.items()}


def test_a_profile_is_only_used_with_the_dtype_it_was_measured_in(tiny_llama, tmp_path):
    from dspark_trt.runtime.profile import measure_latency_profile

    fp32 = LLM(target=tiny_llama, dtype="float32")
    profile = measure_latency_profile(fp32.target, max_batch_tokens=4, quick=True)
    assert profile.backend == "torch-cpu"
    profile.save(tmp_path / "profile.json")
    with pytest.raises(InvalidRequestError, match="measured for torch-cpu .* runs as torch-cpu-bfloat16") as error:
        LLM(target=tiny_llama, dtype="bfloat16", profile=tmp_path / "profile.json")
    assert error.value.param == "profile"
    bf16 = LLM(target=tiny_llama, dtype="bfloat16")
    measured = measure_latency_profile(bf16.target, max_batch_tokens=4, quick=True)
    assert measured.backend == "torch-cpu-bfloat16"
    measured.save(tmp_path / "bf16.json")
    assert LatencyProfile.load(tmp_path / "bf16.json") == measured
    assert LLM(target=tiny_llama, dtype="bfloat16", profile=tmp_path / "bf16.json").engine.profile == measured


@needs_kernel
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_fused_pass_computes_what_the_layer_by_layer_pass_computes(tiny_factory, architecture):
    """The bf16 target's one-call C pass (norms, RoPE, KV writes, attention, SiLU, residuals,
    final norm and LM head) against the same weights through PyTorch ops, layer by layer: the
    same logits, features and cache contents within fp32 rounding, over ragged steps (prefill
    chunks beside decode tokens and blocks), biased (Qwen2) and qk-normed (Qwen3) layers. Where
    the build rounds matmul inputs to bf16 (AMX), two fp32 computations that differ in their last
    bit can round an input apart by one bf16 step (2^-8 relative), so the two passes then agree
    to bf16's precision, not fp32's."""
    tolerance = 1e-2 if cpu_kernels.rounds_matmul_inputs() else 1e-4
    model = load_target(tiny_factory(architecture), torch.bfloat16).model
    generator = torch.Generator().manual_seed(7)
    fused_pool, layerwise_pool = model.new_pool(3, 96), model.new_pool(3, 96)
    fused_caches = [fused_pool.allocate() for _ in range(3)]
    layerwise_caches = [layerwise_pool.allocate() for _ in range(3)]
    for counts, rows, layers in (([30, 7, 1], None, (0, 3)), ([1, 8, 12], torch.tensor([0, 3, 20]), (2,)),
                                 ([5, 1, 1], torch.tensor([6]), ())):
        tokens = torch.randint(0, model.config.vocab_size, (sum(counts),), generator=generator)
        fused = model.forward(tokens, counts, fused_caches, logits_indices=rows, feature_layers=layers)
        layerwise = model.layerwise_forward(tokens, counts, layerwise_caches, logits_indices=rows,
                                            feature_layers=layers)
        scale = layerwise.logits.abs().max()
        assert fused.logits.shape == layerwise.logits.shape
        assert (fused.logits - layerwise.logits).abs().max() < tolerance * scale
        if not cpu_kernels.rounds_matmul_inputs():
            assert torch.equal(fused.logits.argmax(-1), layerwise.logits.argmax(-1))
        if layers:
            assert (fused.features - layerwise.features).abs().max() < tolerance * layerwise.features.abs().max()
        else:
            assert fused.features is None and layerwise.features is None
        assert [c.length for c in fused_caches] == [c.length for c in layerwise_caches]
        assert (fused_pool.keys - layerwise_pool.keys).abs().max() < tolerance * layerwise_pool.keys.abs().max()
        assert (fused_pool.values - layerwise_pool.values).abs().max() < tolerance * layerwise_pool.values.abs().max()


@needs_kernel
def test_the_fused_pass_refuses_rows_and_layers_outside_the_pass(tiny_llama):
    """Out-of-range logit rows or feature layers are an error before anything is written (the C
    side would read past the pass, or leave features unwritten), and the cache does not move."""
    model = load_target(tiny_llama, torch.bfloat16).model
    cache = model.new_pool(1, 32).allocate()
    for options in (dict(logits_indices=torch.tensor([3])), dict(logits_indices=torch.tensor([-1])),
                    dict(feature_layers=(model.config.num_layers,))):
        with pytest.raises(ValueError):
            model(torch.tensor([1, 2, 3]), [3], [cache], **options)
        assert cache.length == 0
    assert model(torch.tensor([1, 2, 3]), [3], [cache], logits_indices=torch.tensor([2])).logits.shape[0] == 1


@needs_kernel
def test_an_engine_packs_the_kernels_weights_before_its_first_request(tiny_llama):
    """The description of the weights the fused pass reads is built when the engine is, not in the
    first request's step (~0.25 s for SmolLM2-135M), and the first step reuses it."""
    from dspark_trt.runtime.engine import Engine

    target = load_target(tiny_llama, torch.bfloat16)
    assert target.model._fused._value is None
    engine = Engine(target, max_batch_size=2, max_model_len=64, policy="none")
    prepared = target.model._fused._value
    assert isinstance(prepared, cpu_kernels.FusedDecoder)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert target.model._fused._value is prepared


@needs_kernel
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_the_drafter_backbone_in_one_c_pass_matches_its_pytorch_layers(tiny_llama, kind):
    """The drafter's backbone, final norm and LM head through the fused C pass (block keys written
    past each context, every block token seeing its context and whole block) against the
    PyTorch layers with their masks: same hidden states and logits within fp32 rounding, for
    requests of different context lengths in non-adjacent slots; and the pass leaves the
    context (keys, values and lengths) as it found it."""
    from types import SimpleNamespace

    target = load_target(tiny_llama, torch.bfloat16)
    drafter = make_drafter(target, kind=kind, num_layers=2).use_bf16_weights()
    proposer = DSparkProposer(drafter)
    generator = torch.Generator().manual_seed(1)
    width = len(drafter.config.feature_layers) * target.config.hidden_size
    for request_id, length in (("a", 50), ("b", 3), ("c", 70), ("d", 20)):
        proposer.queued[request_id] = [torch.randn(length, width, generator=generator)]
    with torch.inference_mode():
        proposer._catch_up([SimpleNamespace(request_id=r) for r in "abcd"])
        proposer.pool.release("b")  # a hole between the slots that draft
        slots = [proposer.pool.slot(r) for r in "acd"]
        block = drafter.block_inputs(torch.tensor([5, 17, 300]), (3,))
        context = [(k.clone(), v.clone()) for k, v in proposer.pool.gather(slots)[0]]
        hidden, logits = proposer._torch_backbone(block.clone(), slots)
        fused_hidden, fused_logits = proposer._kernel_backbone(drafter.kernel_backbone(), block.clone(), slots)
        after, lengths = proposer.pool.gather(slots)
    assert (fused_hidden - hidden).abs().max() < 1e-4 * hidden.abs().max()
    assert (fused_logits - logits).abs().max() < 1e-4 * logits.abs().max()
    assert torch.equal(fused_logits.argmax(-1), logits.argmax(-1))
    assert lengths.tolist() == [50, 70, 20]
    for (keys, values), (keys_after, values_after) in zip(context, after):
        for row, length in enumerate(lengths.tolist()):
            assert torch.equal(keys[row, :, :length], keys_after[row, :, :length])
            assert torch.equal(values[row, :, :length], values_after[row, :, :length])


@needs_kernel
@pytest.mark.parametrize("context_norm", [False, True])
def test_the_drafter_context_in_one_c_call_matches_its_pytorch_layers(tiny_llama, context_norm):
    """Catch-up through the C call (feature norms, projection, norm, each layer's own norm of the
    context with `context_norm`, every layer's rotated keys and values written into the pool)
    against the PyTorch modules: same pool contents within fp32 rounding, for several requests
    with different context lengths in one call."""
    target = load_target(tiny_llama, torch.bfloat16)
    drafter = make_drafter(target, num_layers=2, context_norm=context_norm)
    with torch.no_grad():  # per-channel scales unlike the fused context's, so the layers' norms matter
        for layer in drafter.layers:
            layer.attn_norm.weight.uniform_(0.2, 3.0)
    drafter.use_bf16_weights()
    width = len(drafter.config.feature_layers) * target.config.hidden_size
    pools = []
    for run in ("torch", "kernel"):
        proposer = DSparkProposer(drafter)
        for request_id, length in (("a", 30), ("b", 1), ("c", 9)):
            proposer.pool.slot(request_id)
            proposer.pool.lengths[proposer.pool.slot_of[request_id]] = length  # as if that much context were there
        owners = [(proposer.pool.slot_of[r], count) for r, count in (("a", 3), ("b", 1), ("c", 12))]
        features = torch.randn(16, width, generator=torch.Generator().manual_seed(3))
        positions = torch.cat([torch.arange(proposer.pool.lengths[s], proposer.pool.lengths[s] + n) for s, n in owners])
        with torch.inference_mode():
            if run == "torch":
                proposer._torch_context(features, positions, owners)
            else:
                proposer._kernel_context(drafter.kernel_context(), features, positions, owners)
        pools.append(proposer.pool)
    reference, fused = pools
    assert reference.lengths == fused.lengths == [33, 2, 21, 0]
    for name in ("keys", "values"):
        expected = getattr(reference, name)
        got = getattr(fused, name)[:, :, :, : expected.shape[3]]
        assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
        assert got.abs().sum() > 0


# ---- batch invariance at full speed -------------------------------------------------------------


def _decode_alone(model, tokens: list[int], split: int) -> torch.Tensor:
    """Prefill `tokens[:split]`, then decode the rest one token per step: the reference."""
    cache = model.new_pool(1, len(tokens) + 1).allocate()
    model(torch.tensor(tokens[:split]), [split], [cache])
    return torch.cat([model(torch.tensor([t]), [1], [cache]).logits for t in tokens[split:]])


@needs_kernel
@pytest.mark.parametrize("context", [40, 200])
def test_logits_are_bit_identical_alone_and_in_any_mixed_batch(tiny_llama, context):
    """Our sequence, fed in random chunks (prefill pieces, verify blocks, single tokens) beside random
    neighbours (prefills, decode tokens, draft blocks) in random orders, gets exactly the logits it
    gets decoding alone."""
    model = load_target(tiny_llama, torch.bfloat16).model
    rng = random.Random(context)
    vocab = model.config.vocab_size
    tokens = [rng.randrange(vocab) for _ in range(context + 24)]
    alone = _decode_alone(model, tokens, context)
    for trial in range(4):
        pool = model.new_pool(6, context + 64)
        ours, *others = [pool.allocate() for _ in range(6)]
        position = 0
        while position < context:  # our prompt in random chunks, each beside a neighbour's prefill
            count = min(rng.randrange(1, 40), context - position)
            neighbour = others[rng.randrange(5)]
            other = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            if neighbour.length + len(other) > neighbour.capacity:
                neighbour.truncate(0)
            model(torch.tensor(tokens[position : position + count] + other), [count, len(other)], [ours, neighbour])
            position += count
        rows = []
        while position < len(tokens):  # then random blocks among random short and long feeds
            count = min(rng.randrange(1, 9), len(tokens) - position)
            feeds = [(ours, tokens[position : position + count])]
            for neighbour in rng.sample(others, rng.randrange(0, 6)):
                feeds.append((neighbour, [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 8, 40]))]))
            rng.shuffle(feeds)
            for cache, feed in feeds:
                if cache is not ours and cache.length + len(feed) > cache.capacity:
                    cache.truncate(0)
            logits = model(torch.tensor([t for _, feed in feeds for t in feed]), [len(f) for _, f in feeds],
                           [c for c, _ in feeds]).logits
            start = sum(len(f) for c, f in feeds[: [c for c, _ in feeds].index(ours)])
            rows.append(logits[start : start + count])
            position += count
        assert torch.equal(torch.cat(rows), alone), trial


# A flat target curve and nearly free drafts: every draft pays.
DRAFTS_PAY = LatencyProfile("test", "cpu", [1, 256], [1.0, 1.0], [1, 64], [1e-3, 1e-3])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.int4, marks=pytest.mark.skipif(
    not cpu_kernels.q4_available(), reason=f"int4 kernel: {cpu_kernels.q4_unavailable_reason()}"))])
@pytest.mark.parametrize("options", [{}, {"prefix_layer": True, "shuffled_vocab": True}])
def test_every_policy_equals_plain_decoding_under_random_load(tiny_llama, options, dtype):
    """Greedy speculative output equals plain decoding request by request, whatever arrives when,
    in the default (fast) mode; with a prefix layer too (its linears on bf16 weights); on the bf16
    engine and on the int4 one (`--dtype int4`: 4-bit layers, int8 inputs, the drafter in bf16)."""
    target = load_target(tiny_llama, dtype)
    drafter = make_drafter(target, **options).use_bf16_weights()
    if drafter.prefix is not None:
        assert drafter.prefix.project.bf16_cache is not None and drafter.prefix.layer.q.bf16_cache is not None
    rng = random.Random(3)
    jobs = [([rng.randrange(1, 1000) for _ in range(rng.randrange(2, 60))],
             SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for _ in range(8)]
    plain = Engine(target, None, max_batch_size=8, max_model_len=128)
    expected = [plain.add_request(*job) for job in jobs]
    while plain.has_unfinished():
        plain.step()
    for policy, seed in (("all", 0), ("fixed:2", 1), ("dspark", 2)):
        # Under DRAFTS_PAY the dspark policy drafts whatever this machine's timings (a tiny target's
        # measured step can make any draft too dear): the test checks speculation, not the clock.
        engine = Engine(target, DSparkProposer(drafter), max_batch_size=4, max_batch_tokens=40, max_model_len=128,
                        policy=policy, profile=DRAFTS_PAY)
        order = random.Random(seed).sample(range(len(jobs)), len(jobs))
        requests, step = {}, 0
        while order or engine.has_unfinished():
            for _ in range(random.Random(seed * 100 + step).randrange(0, 3)):
                if order:
                    index = order.pop()
                    requests[index] = engine.add_request(*jobs[index])
            engine.step()
            step += 1
        for index, request in requests.items():
            assert request.output_token_ids == expected[index].output_token_ids, (policy, index)
        assert engine.counters.num_draft_tokens > 0


# ---- accuracy on real prompts -------------------------------------------------------------------


@pytest.mark.slow
@needs_kernel
def test_bf16_stays_close_to_fp32_on_evaluation_prompts():
    """The embedded SmolLM2 target on evaluation prompts (teacher-forced on fp32's own greedy
    output): next-token distributions within a small KL, the same greedy token almost everywhere.
    Bounds: about 3x what `benchmarks/dtype_accuracy.py` measured."""
    from dspark_trt.training.prompts import load_prompts

    sys.path.insert(0, "benchmarks")
    from dtype_accuracy import response_log_probs

    reference = LLM(target="default", dtype="float32", max_batch_size=6)
    rounded = load_target("default", torch.bfloat16).model
    prompts = [reference.encode_chat(p.messages) for name in ("mt-bench", "humaneval", "gsm8k")
               for p in load_prompts(name, 2)]
    outputs = reference.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    kls, same = [], []
    for prompt, output in zip(prompts, outputs):
        exact = response_log_probs(reference.target.model, prompt, output.token_ids)
        approx = response_log_probs(rounded, prompt, output.token_ids)
        kls.append((exact.exp() * (exact - approx)).sum(-1))
        same.append((exact.argmax(-1) == approx.argmax(-1)).double())
    assert float(torch.cat(kls).mean()) < 0.02
    assert float(torch.cat(same).mean()) > 0.9


def test_the_cli_offers_the_dtypes_the_models_know():
    from dspark_trt import cli_options
    from dspark_trt.models import linear

    assert cli_options.DTYPE_CHOICES == linear.DTYPE_CHOICES and cli_options.DEFAULT_DTYPE == linear.DEFAULT_DTYPE
