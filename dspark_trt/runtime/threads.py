"""Keep PyTorch's OpenMP threads from fighting numpy's BLAS threads on CPU.

`dspark_trt/thread_env.py` (imported first by the package root) sets `OMP_WAIT_POLICY=PASSIVE`
before torch loads. When the user
imported torch first, that is too late, and the only safe choice left is to give PyTorch a
single thread (its own ops in the CPU runtime are small; the big matmuls run on OpenBLAS).
"""

from __future__ import annotations

import warnings

import torch

from dspark_trt.thread_env import TORCH_IMPORTED_FIRST

_checked = False


def ensure_cpu_threads_cooperate() -> None:
    global _checked
    if _checked:
        return
    _checked = True
    if TORCH_IMPORTED_FIRST and torch.get_num_threads() > 1:
        warnings.warn("torch was imported before dspark_trt without OMP_WAIT_POLICY=PASSIVE; using one PyTorch "
                      "thread so that it does not contend with the BLAS threads (set OMP_WAIT_POLICY=PASSIVE "
                      "or import dspark_trt first to keep more)", RuntimeWarning, stacklevel=3)
        torch.set_num_threads(1)
