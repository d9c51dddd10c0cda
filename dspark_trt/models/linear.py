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
"""

from __future__ import annotations

import torch
from torch import nn


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight`, through numpy's OpenBLAS for CPU fp32 inference (see the table above)."""
    if x.is_cpu and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled():
        return torch.from_numpy(x.detach().contiguous().numpy() @ weight.detach().numpy())
    return x @ weight


class FrozenLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.zeros(in_features, out_features))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        y = matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias
