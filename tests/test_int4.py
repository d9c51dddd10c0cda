"""The int4 engine (`--dtype int4`): 4-bit Q4_1 layer matrices and a Q8_0 LM head, each matmul's input quantized to int8.

The weights are the GGUF's own blocks (checked on the embedded default's real weights); the kernel
computes its stated arithmetic (checked against the same arithmetic in PyTorch) row by row, so a
token's logits do not depend on what shares its step, and greedy speculation equals plain
decoding (`test_bf16.py`'s random-load test, run on int4 too). The kernel needs AMX-INT8 (Intel
Xeon Sapphire Rapids or later): those tests skip elsewhere and say so; that int4 is refused
elsewhere, with the reason, is tested everywhere.
"""

import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from dspark_trt import LLM
from dspark_trt.cli import main
from dspark_trt.errors import InvalidRequestError
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.loading import load_target

needs_int4 = pytest.mark.skipif(not cpu_kernels.q4_available(),
                                reason=f"int4 kernel: {cpu_kernels.q4_unavailable_reason()}")


def quantized_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """What the kernel states it computes, in float64: each row's input quantized to int8 per block
    of 32 (a = round(x * 127 / max|x|), s = max|x| / 127), times the 4-bit blocks' weights."""
    rows, in_features = x.shape
    blocks = x.view(rows, in_features // 32, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    a = torch.round(blocks * torch.where(top > 0, 127 / top, torch.zeros_like(top)))
    return ((a * (top / 127)).view(rows, in_features).double() @ weight.dequantize().double())


def test_4bit_blocks_hold_the_weights_they_came_from():
    """Q4_1 blocks de-quantised and quantized again give the same blocks: a weight that came from
    the GGUF's blocks is represented exactly."""
    generator = torch.Generator().manual_seed(0)
    weight = cpu_kernels.Q4Weight(torch.randn(96, 130, generator=generator) * 0.05)
    again = cpu_kernels.Q4Weight(weight.dequantize())
    assert torch.equal(again.data, weight.data) and torch.equal(again.dequantize(), weight.dequantize())
    assert weight.dequantize().shape == (96, 130)
    assert (weight.dequantize() - torch.randn(96, 130, generator=torch.Generator().manual_seed(0)) * 0.05).abs().max() < 0.02
    constant = cpu_kernels.Q4Weight(torch.full((32, 64), 0.25))  # max == min: step 0, weights kept
    assert torch.equal(constant.dequantize(), torch.full((32, 64), 0.25))


def test_8bit_blocks_hold_the_weights_they_came_from():
    generator = torch.Generator().manual_seed(3)
    weight = cpu_kernels.Q8Weight(torch.randn(64, 200, generator=generator) * 0.05)
    again = cpu_kernels.Q8Weight(weight.dequantize())
    assert torch.equal(again.data, weight.data) and torch.equal(again.dequantize(), weight.dequantize())
    assert weight.q.abs().max() == 127 and weight.dequantize().shape == (64, 200)


def test_the_default_targets_matrices_are_its_gguf_blocks():
    """SmolLM2's decoder matrices come from Q4_1 blocks in its GGUF and its tied LM head from Q8_0
    ones: every weight of a layer's four matrices and of the LM head (de-quantised by transformers,
    cached as safetensors) quantizes back exactly."""
    model = load_target("default", torch.float32).model
    for layer in (model.layers[0], model.layers[-1]):
        for name in ("qkv", "o", "gate_up", "down"):
            weight = getattr(layer, name).weight_t.detach()
            assert torch.equal(cpu_kernels.Q4Weight(weight).dequantize(), weight), name
    head = model.lm_head.weight_t.detach()
    assert torch.equal(cpu_kernels.Q8Weight(head).dequantize(), head)


@needs_int4
@pytest.mark.parametrize("in_features, out_features", [(64, 33), (576, 97), (128, 1000), (1536, 64)])
def test_the_int4_kernel_computes_its_stated_arithmetic(in_features, out_features):
    """Row tails of 1-40 rows (more than one 16-row tile), column tails, bias: within fp32
    accumulation of the float64 reference of the same quantized inputs and 4-bit weights."""
    generator = torch.Generator().manual_seed(in_features + out_features)
    weight = cpu_kernels.Q4Weight(torch.randn(in_features, out_features, generator=generator) * 0.05)
    bias = torch.randn(out_features, generator=generator)
    for rows in (1, 2, 7, 16, 17, 40):
        x = torch.randn(rows, in_features, generator=generator)
        x[0, :32] = 0  # an all-zero block: scale 0
        reference = quantized_reference(x, weight)
        got = cpu_kernels.q4_matmul(x, weight)
        assert (got.double() - reference).abs().max() < 1e-5 * (1 + reference.abs().max()), rows
        assert torch.equal(cpu_kernels.q4_matmul(x, weight, bias), got + bias)
        eight = cpu_kernels.Q8Weight(weight.dequantize())
        reference = quantized_reference(x, eight)
        got = cpu_kernels.q8_matmul(x, eight)
        assert (got.double() - reference).abs().max() < 1e-5 * (1 + reference.abs().max()), rows
        # and near the fp32 product: the int8 inputs are the only approximation
        exact = x @ weight.dequantize()
        assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@needs_int4
def test_int4_rows_do_not_depend_on_the_other_rows():
    """A row's bits are the same alone, in two (calls of up to two rows take the 4-bit matmul through
    AVX-512 VNNI rather than AMX tiles) and among many."""
    generator = torch.Generator().manual_seed(1)
    weight = cpu_kernels.Q4Weight(torch.randn(256, 64 * 40, generator=generator) * 0.05)  # 40 groups: both threads
    x = torch.randn(37, 256, generator=generator) * torch.rand(37, 1, generator=generator) * 10
    eight = cpu_kernels.Q8Weight(weight.dequantize())
    for matmul, packed in ((cpu_kernels.q4_matmul, weight), (cpu_kernels.q8_matmul, eight)):
        alone = torch.cat([matmul(row[None], packed) for row in x])
        assert torch.equal(matmul(x, packed), alone)
        assert torch.equal(matmul(x[5:11], packed), alone[5:11])
        assert torch.equal(matmul(x[3:5], packed), alone[3:5])  # two rows: the 4-bit VNNI path, as one row is


@needs_int4
def test_the_int4_target_runs_its_4bit_weights_in_one_c_pass(tiny_llama):
    """`dtype int4`: the layers' matrices become their 4-bit blocks and the LM head its 8-bit ones
    (the PyTorch path then holds the same weights); the fused pass stays within int8 rounding of
    that path, and a step reads fewer bytes than bf16's."""
    exact = load_target(tiny_llama, torch.float32).model
    model = load_target(tiny_llama, torch.int4).model
    assert model.weight_dtype == torch.int4 and model._runs_cpu_kernels()
    head = exact.lm_head.weight_t.detach()
    assert torch.equal(model.lm_head.weight_t, cpu_kernels.Q8Weight(head).dequantize())
    for ours, theirs in zip(model.layers, exact.layers):
        weight = theirs.down.weight_t.detach()
        assert torch.equal(ours.down.weight_t, cpu_kernels.Q4Weight(weight).dequantize())
    pool_a, pool_b = model.new_pool(2, 64), model.new_pool(2, 64)
    caches_a, caches_b = [pool_a.allocate(), pool_a.allocate()], [pool_b.allocate(), pool_b.allocate()]
    tokens = torch.randint(0, model.config.vocab_size, (27,), generator=torch.Generator().manual_seed(2))
    fused = model(tokens, [20, 7], caches_a, feature_layers=(1,))
    layerwise = model.layerwise_forward(tokens, [20, 7], caches_b, feature_layers=(1,))
    scale = layerwise.logits.abs().max()
    assert (fused.logits - layerwise.logits).abs().max() < 0.1 * scale
    assert (fused.features - layerwise.features).abs().max() < 0.1 * layerwise.features.abs().max()
    bf16 = load_target(tiny_llama, torch.bfloat16).model
    assert model.weight_bytes() < bf16.weight_bytes()


@needs_int4
def test_llm_and_the_cli_serve_int4(tiny_llama):
    llm = LLM(target=tiny_llama, dtype="int4")
    assert llm.dtype == "int4" and llm.target.model.weight_dtype == torch.int4
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--target", str(tiny_llama), "--dtype", "int4",
                                       "--max-tokens", "3", "--raw", "--json"])
    assert result.exit_code == 0, result.output


def test_int4_is_refused_where_it_cannot_run_and_says_why(tiny_llama):
    """A CPU (or a forced build) without AMX-INT8: `dtype int4` is a clear error naming the field
    and the reason, never a silent fallback to other numerics."""
    code = f"""
import dspark_trt
from dspark_trt import LLM
from dspark_trt.errors import InvalidRequestError
try:
    LLM(target={str(tiny_llama)!r}, dtype="int4")
except InvalidRequestError as exc:
    print("REFUSED", exc.param, "|", exc)
"""
    env = {**os.environ, "DSPARK_TRT_KERNEL_ISA": "avx2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED dtype |" in result.stdout and "AMX-INT8" in result.stdout, result.stdout
    with pytest.raises(InvalidRequestError, match="dtype must be one of auto, float32, bfloat16, int4"):
        LLM(target=tiny_llama, dtype="int8")
