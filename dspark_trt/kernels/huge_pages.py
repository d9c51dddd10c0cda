"""Where our kernels' packed weights live: 2 MB-aligned chunks, advised to Linux as huge pages.

A decode step streams every weight once (~269 MB in bf16 for SmolLM2-135M). In 4 KB pages that is
~65,000 pages a step, each a TLB miss and a page walk; in 2 MB pages, ~135. Linux backs an
anonymous mapping with transparent huge pages when asked (`madvise(MADV_HUGEPAGE)`, honoured in
THP's default `madvise` mode) before its pages are first touched, and only over 2 MB-aligned
stretches. Most of a small model's matrices are under 2 MB (SmolLM2's qkv, o and down), so an
allocation each would get no huge page at all: `place` copies each packed weight into a shared
chunk instead, 2 MB aligned and advised before any byte of it is written.

Where the advice is refused or means nothing (THP `never`, not Linux) the chunks are ordinary
memory and nothing else changes: the bytes, and so every result, are the same either way.
`DSPARK_TRT_HUGE_PAGES=off` leaves each weight in its own allocation (for comparisons).

Owns: the chunks and placing a tensor in one. Not: what is packed, or how (`cpu_kernels`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # a chunk's size; a tensor larger than this gets a chunk of its own
SMALLEST = 64 << 10  # smaller tensors stay where they are: a page walk's worth is nothing to them
ALIGNMENT = 64  # each placed tensor starts on a cache line, as the kernels' aligned loads need
MADV_HUGEPAGE = 14  # <linux/mman.h>
VARIABLE = "DSPARK_TRT_HUGE_PAGES"

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the chunk being filled (uint8), and how much of it is used
_used = 0
_libc = None


def enabled() -> bool:
    """Whether `place` moves tensors (not with `DSPARK_TRT_HUGE_PAGES=off`)."""
    return os.environ.get(VARIABLE, "").strip().lower() not in ("off", "0", "false", "no")


def _advise(address: int, length: int) -> None:
    """Ask for huge pages over [address, address + length) (2 MB aligned); a refusal is harmless."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    _libc.madvise(address, length, MADV_HUGEPAGE)


def _new_chunk(size: int) -> torch.Tensor:
    """`size` bytes (a multiple of 2 MB), 2 MB aligned, advised before first touch. An allocation
    of a chunk's size is a fresh mapping of untouched pages (glibc maps anything over 32 MB
    itself); pages touched before the advice would stay 4 KB until khugepaged merges them."""
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # the view below keeps it alive
    start = -raw.data_ptr() % HUGE_PAGE
    chunk = raw[start : start + size]
    _advise(chunk.data_ptr(), size)
    return chunk


def place(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in a huge-page chunk: a contiguous tensor of the same dtype and shape
    (a CPU tensor under 64 KB, or any with `DSPARK_TRT_HUGE_PAGES=off`, comes back contiguous
    where it was). A chunk is freed when no tensor placed in it is left."""
    global _chunk, _used
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_cpu or nbytes < SMALLEST or not enabled():
        return tensor.contiguous()
    size = -(-nbytes // ALIGNMENT) * ALIGNMENT
    with _lock:
        if size > CHUNK:
            memory = _new_chunk(-(-size // HUGE_PAGE) * HUGE_PAGE)[:nbytes]
        else:
            if _chunk is None or _used + size > CHUNK:
                _chunk, _used = _new_chunk(CHUNK), 0
            memory, _used = _chunk[_used : _used + nbytes], _used + size
    placed = memory.view(tensor.dtype).view(tensor.shape)
    placed.copy_(tensor)
    return placed
