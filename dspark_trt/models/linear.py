"""A frozen linear layer with the fastest CPU kernel for the number of rows it gets.

Measured on a 2-core AVX2 machine (SmolLM2-135M weights, cold cache, fp32): for one or two
rows, `x @ W_t` with `W_t` stored `[in, out]` runs near memory bandwidth (GEMV); from ~4 rows
on, MKL's small-M SGEMM falls to ~10 GFLOP/s while oneDNN (`mkldnn_linear`) is ~2x faster.
So the layer keeps both layouts (twice the weight memory, a fair price for a CPU reference
backend) and picks by row count. Training never uses this class (it has no gradient path for
the packed copy); the TensorRT backend does not use it at all.
"""

from __future__ import annotations

import torch
from torch import nn

# Row count from which the oneDNN GEMM beats the dense GEMV form (measured; see module doc).
ONEDNN_MIN_ROWS = 4


class FrozenLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.zeros(in_features, out_features))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN copy of the weight, built on first use

    def reset_packed(self) -> None:
        """Drop the oneDNN copy (call after changing the weights)."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if x.shape[0] >= ONEDNN_MIN_ROWS and x.is_cpu and not torch.is_grad_enabled() and torch.backends.mkldnn.is_available():
            if self._packed is None:
                self._packed = self.weight_t.detach().t().contiguous().to_mkldnn()  # [out, in]
            bias = None if self.bias is None else self.bias.detach()
            return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self._packed, bias).to_dense()
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias
