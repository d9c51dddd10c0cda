"""A frozen linear layer that runs its matmul on the fastest CPU BLAS at hand.

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


class FrozenLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.zeros(in_features, out_features))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        y = matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class DraftLinear(nn.Linear):
    """A trained linear layer (drafters): `nn.Linear` for training, `matmul` for inference.

    Drafters train with autograd, so their weights stay `[out, in]` `nn.Linear` parameters (and
    checkpoints keep their names). At inference torch's default small-M SGEMM is the slow MKL
    one of the table above: a DSpark backbone layer on a block of 7 rows took 5.9 ms
    through it and 1.6 ms through OpenBLAS.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.bias is not None:
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])  # [rows, in]: one GEMM (and row by row when batch invariant)
        return matmul(rows, self.weight.t()).view(*x.shape[:-1], self.out_features)
