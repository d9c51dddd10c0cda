"""The SequentialDraft CUDA kernel (`sequential_draft_kernel.cu`): its PTX for TensorRT's
ahead-of-time plugin, and the same source built for the host so that CPU tests can hold it to the
torch reference.

    ptx(arch)                      PTX of the kernel `sequential_draft` (nvcc, cached): what
                                   `sequential_draft_trt.aot_impl` hands TensorRT
    run_on_host(*inputs, **attrs)  the kernel's row routine on the CPU (g++, cached), with
                                   `sequential_draft.reference`'s signature and outputs

Both builds are cached under `$DSPARK_TRT_CACHE/kernels` (`kernels/build_cache.py`). Launch shape
(`launch_shape`): one block per row, `THREADS` threads, dynamic shared memory for the per-thread
partials and the row's state. It knows nothing of TensorRT.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import torch

from dspark_trt.errors import DsparkError
from dspark_trt.kernels.build_cache import CompileError, built

SOURCE = Path(__file__).with_name("sequential_draft_kernel.cu")
KERNEL_NAME = "sequential_draft"
THREADS = 256
MAX_NGRAM = 8  # the kernel's bound on copy n-gram lengths (longer: the drafter exports without the plugin)
MAX_SHARED_BYTES = 48 * 1024  # what a kernel may use without cudaFuncSetAttribute
# The oldest architecture the PTX targets: the driver compiles it for the GPU it runs on (Turing on).
DEFAULT_ARCH = "compute_75"


class KernelBuildError(DsparkError):
    """The kernel could not be compiled here (no compiler, or it failed)."""


def _build(command: list[str], suffix: str, compiler: str) -> Path:
    try:
        return built(SOURCE, command, "sequential_draft", suffix, compiler)
    except CompileError as exc:
        raise KernelBuildError(str(exc)) from None


def ptx(arch: str = DEFAULT_ARCH) -> str:
    """The kernel's PTX for `arch` (a virtual architecture, `compute_XY`), built by nvcc."""
    nvcc = shutil.which(os.environ.get("NVCC", "nvcc"))
    if nvcc is None:
        raise KernelBuildError("nvcc is not installed, so the ahead-of-time SequentialDraft kernel cannot be built "
                               "(install the CUDA toolkit, or serve with the JIT plugin)")
    path = _build([nvcc, "--ptx", f"-arch={arch}", "-O3", "-x", "cu", str(SOURCE)], f"-{arch}.ptx", nvcc)
    return path.read_text()


def launch_shape(rank: int) -> tuple[int, int]:
    """(threads per block, dynamic shared memory bytes) for a head of rank `rank`."""
    words = 2 * THREADS + 8 * rank + MAX_NGRAM + 4
    return THREADS, 4 * words


_host_library = None


def _host() -> ctypes.CDLL:
    global _host_library
    if _host_library is None:
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        if compiler is None:
            raise KernelBuildError("no C++ compiler (g++) to build the kernel for the host")
        path = _build([compiler, "-x", "c++", "-DDSPARK_HOST", "-O2", "-shared", "-fPIC", str(SOURCE)], ".so",
                      compiler)
        _host_library = ctypes.CDLL(str(path))
        _host_library.sequential_draft_host.restype = ctypes.c_int
    return _host_library


def run_on_host(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                top_prob_w, head: int, has_confidence: int, copy_ngram: int = 0, copy_confidence: int = 0,
                top_prob: int = 0):
    """The kernel's row routine on the CPU, one row after another (`sequential_draft.reference`'s
    arguments and outputs: draft_ids, token_probs, confidences, distributions)."""
    if copy_ngram > MAX_NGRAM:
        raise KernelBuildError(f"the kernel takes copy n-grams up to {MAX_NGRAM}, got {copy_ngram}")
    batch, block, vocab = logits.shape
    rank = w1.shape[1] if w1.dim() == 2 else 0
    floats = [t.detach().float().contiguous() for t in (logits, hidden)]
    longs = [anchor_ids.long().contiguous()]
    weights = [t.detach().float().contiguous() for t in (w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w,
                                                          conf_b, conf_inv_temps, temperatures, uniforms)]
    lookups = [t.long().contiguous() for t in (history, draft_vocab, to_draft)]
    copy = [t.detach().float().contiguous() for t in (copy_alpha, copy_beta, top_prob_w)]
    ngram_columns = copy_alpha.shape[1] if copy_alpha.dim() == 2 else 0
    outputs = (torch.zeros(batch, block, dtype=torch.long), torch.zeros(batch, block), torch.zeros(batch, block),
               torch.zeros(batch, block, vocab))
    inputs = [*floats, *longs, *weights, *lookups, *copy]
    scalars = [batch, block, vocab, hidden.shape[-1], rank, history.shape[1] if history.dim() == 2 else 0,
               ngram_columns, to_draft.numel(), head, has_confidence, copy_ngram, copy_confidence, top_prob]
    status = _host().sequential_draft_host(*[ctypes.c_void_p(t.data_ptr()) for t in inputs],
                                           *[ctypes.c_int(int(v)) for v in scalars],
                                           *[ctypes.c_void_p(t.data_ptr()) for t in outputs])
    if status != 0:
        raise KernelBuildError(f"the host kernel refused its arguments (status {status})")
    return outputs
