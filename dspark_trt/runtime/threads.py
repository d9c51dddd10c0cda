"""Keep PyTorch's OpenMP threads from fighting the other threads of the CPU runtime.

`dspark_trt/thread_env.py` (imported first by the package root) sets `OMP_WAIT_POLICY=PASSIVE`
before torch loads. When the user
imported torch first, that is too late, and the only safe choice left is to give PyTorch a
single thread (its own ops in the CPU runtime are small; the big matmuls run on OpenBLAS).

`torch_on_calling_thread` is the same idea for a stretch of small ops that follows one of our C
kernels' calls (`kernels/cpu_kernels.c`): its workers spin on the other cores for a moment after
each call (so that the next call does not pay a wake-up), and an op PyTorch splits over its
OpenMP threads (past ~32k elements) then waits for a core.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

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


@contextmanager
def torch_on_calling_thread(active: bool = True):
    """PyTorch ops inside run on the calling thread only (when `active`). Measured: the draft's
    top-probability reduction over a [1, 7, 8192] block took 0.35 ms right after the backbone's C
    call, against ~0.05 ms alone; toggling the thread count costs ~0.3 us."""
    previous = torch.get_num_threads()
    if not active or previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
