"""Frozen and draft linear layers, and the matmul each runs on the fastest CPU path at hand.

Measured on a 2-core AMD EPYC (AVX2) machine, SmolLM2-135M's 121 weight matrices, cold cache,
fp32 (ms per pass over all of them):

| rows | torch `x @ W_t` (MKL) | oneDNN `mkldnn_linear` | numpy `x @ W_t` (OpenBLAS) |
| ---- | --------------------- | ---------------------- | -------------------------- |
| 1    | 42                    | 44                     | 28                         |
| 8    | 206                   | 88                     | 56                         |
| 64   | -                     | 226                    | 182                        |

MKL's small-M SGEMM is slow on AMD CPUs; numpy's bundled OpenBLAS is not. So inference on CPU
in fp32 goes through numpy (zero-copy views of the same memory); anything else (training with
gradients, other dtypes, GPU tensors) goes through torch. The weight is stored `[in, out]`, the
layout that makes one-row products a straight GEMV.

Batch invariance. A BLAS picks its kernel and blocking by the number of rows, so the same row
multiplied alone or inside a batch of 8 can differ in the last bits (measured: up to 4e-5 on
SmolLM2's shapes, with OpenBLAS from numpy 1.26 and 2.4 alike). Near-tied logits then flip a
greedy token depending on what else was in the batch. Inside `one_row_at_a_time()` every
product runs row by row: a row's result depends on that row alone (and is bit-identical across
those two OpenBLAS builds). It is slow (no GEMM), so it is for reproducibility, not throughput.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

_mode = threading.local()


@contextmanager
def one_row_at_a_time():
    """Within this block (this thread only), `matmul` multiplies row by row (batch invariant)."""
    previous = getattr(_mode, "row_by_row", False)
    _mode.row_by_row = True
    try:
        yield
    finally:
        _mode.row_by_row = previous


def in_row_by_row_mode() -> bool:
    """Whether this thread is inside `one_row_at_a_time()`."""
    return getattr(_mode, "row_by_row", False)


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.is_cpu and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled():
        return torch.from_numpy(x.detach().contiguous().numpy() @ weight.detach().numpy())
    return x @ weight


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight`, through numpy's OpenBLAS for CPU fp32 inference (see the table above)."""
    if in_row_by_row_mode() and x.dim() == 2 and x.shape[0] > 1:
        return torch.cat([_matmul(x[i : i + 1], weight) for i in range(x.shape[0])])
    return _matmul(x, weight)


# ---- bf16 weights, fp32 activations ----------------------------------------------------------
#
# `--dtype bfloat16` means: every weight matrix is rounded to bf16 once, everything else
# (activations, norms, attention, softmax, the KV cache) stays fp32. On CPU the products run
# through our packed kernel (`kernels/cpu_kernels.py`), which streams each weight once per call
# whatever the row count and is batch invariant by construction. Its AMX build (Intel Sapphire
# Rapids and later) also rounds each matmul's input to bf16, as AMX tiles need (fp32 accumulation;
# the rest stays fp32); its AVX-512 and AVX2 builds multiply the fp32 activations. Without the
# kernel (no AVX2+FMA, no compiler, a GPU tensor) the products run through torch in bf16 (oneDNN on
# CPU), which also rounds the activations to bf16 at each matmul and, like any BLAS, is not batch
# invariant (row by row it is).


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int4")
DEFAULT_DTYPE = "auto"


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """A `--dtype` choice -> the target's weight dtype (`torch.int4` for int4: 4-bit layer matrices).

    `auto` (the default) is bfloat16 on a CPU where our bf16 kernel runs (it is faster there at
    every row count, measured: `benchmarks/matmul_kernels.py`) and float32 elsewhere: through
    oneDNN a 1-row bf16 step cost 1.7x an fp32 one on the same CPU, and on a GPU the PyTorch
    target keeps its fp32 behaviour unless asked. float32 is also the parity oracle against
    transformers.
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if name == "int4":  # the layers' matrices in 4 bits (`TargetModel.use_int4_weights`): our AMX-INT8 kernels only
        from dspark_trt.kernels import cpu_kernels

        on_cpu = torch.device(device).type == "cpu"
        if not on_cpu or not cpu_kernels.q4_available():
            why = cpu_kernels.q4_unavailable_reason() if on_cpu else "it runs on the CPU"
            raise ValueError(f"dtype int4 is not available here: {why}; use bfloat16 (or auto)")
        return torch.int4
    if name == "auto":
        from dspark_trt.kernels import cpu_kernels

        return torch.bfloat16 if torch.device(device).type == "cpu" and cpu_kernels.available() else torch.float32
    return torch.float32 if name == "float32" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PackedCache:
    """The kernel's packed copy of one weight, rebuilt only when the weight changes."""

    def __init__(self):
        self._key = None
        self._packed = None

    def get(self, weight_t: torch.Tensor):
        """`weight_t` `[in, out]` (a view is fine) -> its `PackedWeight`."""
        key = (weight_t.data_ptr(), weight_t._version, tuple(weight_t.shape), weight_t.stride(), weight_t.device)
        if key != self._key:
            from dspark_trt.kernels.cpu_kernels import PackedWeight

            self._packed, self._key = PackedWeight(weight_t), key
        return self._packed


class DerivedFromWeights:
    """Something built from a module's parameters (our kernels' description of them), rebuilt
    only when one of them is replaced or written in place. `parameters()` walks the module tree
    (~2 ms a step for the target, measured), so the list is taken once."""

    def __init__(self):
        self._parameters = None
        self._key = None
        self._value = None

    def get(self, module: nn.Module, build, *also) -> object:
        """`build()`'s result, rebuilt when a parameter of `module` (or a tensor in `also`:
        borrowed weights that are not its parameters) changed since the last build."""
        if self._parameters is None:
            self._parameters = list(module.parameters())
        key = tuple((p.data_ptr(), p._version) for p in (*self._parameters, *also))
        if key != self._key:
            self._value, self._key = build(), key
        return self._value


def bf16_matmul(x: torch.Tensor, weight_t: torch.Tensor, cache: PackedCache,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., in]` @ `weight_t [in, out]` rounded to bf16 (+ bias), in x's dtype."""
    from dspark_trt.kernels import cpu_kernels

    if x.is_cpu and x.dtype == torch.float32 and not torch.is_grad_enabled() and cpu_kernels.available():
        rows = x.reshape(-1, x.shape[-1])
        return cpu_kernels.matmul(rows, cache.get(weight_t), bias).view(*x.shape[:-1], weight_t.shape[1])
    weight = weight_t.to(torch.bfloat16)
    low = x.to(torch.bfloat16)
    if in_row_by_row_mode() and low.dim() == 2 and low.shape[0] > 1:  # oneDNN picks kernels by rows
        y = torch.cat([low[i : i + 1] @ weight for i in range(low.shape[0])])
    else:
        y = low @ weight
    y = y.to(x.dtype)
    return y if bias is None else y + bias


class FrozenLinear(nn.Module):
    """A frozen `[in, out]` weight: fp32 through `matmul`, or bf16 through `bf16_matmul`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.zeros(in_features, out_features))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed = PackedCache()

    def packed(self):
        """The kernel's packed bf16 copy of this weight (`cpu_kernels.PackedWeight`)."""
        return self._packed.get(self.weight_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if self.weight_t.dtype == torch.bfloat16 and x.dtype != torch.bfloat16:
            return bf16_matmul(x, self.weight_t, self._packed, self.bias)
        y = matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class DraftLinear(nn.Linear):
    """A trained linear layer (drafters): `nn.Linear` for training, `matmul` for inference.

    Drafters train with autograd, so their weights stay `[out, in]` `nn.Linear` parameters (and
    checkpoints keep their names). At inference torch's default small-M SGEMM is the slow MKL
    one of the table above: a DSpark backbone layer on a block of 7 rows took 5.9 ms
    through it and 1.6 ms through OpenBLAS. With `bf16_cache` set (`use_bf16_weights`),
    inference runs through `bf16_matmul` on a bf16 copy; training keeps the fp32 weights.
    """

    bf16_cache: PackedCache | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.bias is not None:
            return super().forward(x)
        if self.bf16_cache is not None:
            return bf16_matmul(x, self.weight.t(), self.bf16_cache)
        rows = x.reshape(-1, x.shape[-1])  # [rows, in]: one GEMM (and row by row when batch invariant)
        return matmul(rows, self.weight.t()).view(*x.shape[:-1], self.out_features)


def use_bf16_weights(module: nn.Module) -> None:
    """Run every linear layer under `module` with bf16 weights and fp32 activations (inference).

    `FrozenLinear` weights are converted in place (they are never trained); `DraftLinear` ones
    keep their fp32 master copy and use a bf16 one for inference.
    """
    for layer in module.modules():
        if isinstance(layer, FrozenLinear):
            layer.weight_t.data = layer.weight_t.data.to(torch.bfloat16)
        elif isinstance(layer, DraftLinear):
            layer.bf16_cache = PackedCache()
