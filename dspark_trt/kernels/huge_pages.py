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

import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # a chunk's size; a tensor larger than this gets a chunk of its own
SMALLEST = 64 << 10  # smaller tensors stay where they are: a page walk's worth is nothing to them
ALIGNMENT = 64  # each placed tensor starts on a cache line, as the kernels' aligned loads need
VARIABLE = "DSPARK_TRT_HUGE_PAGES"

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the chunk being filled (uint8), and how much of it is used
_used = 0


def enabled() -> bool:
    """Whether `place` moves tensors (not with `DSPARK_TRT_HUGE_PAGES=off`)."""
    return os.environ.get(VARIABLE, "").strip().lower() not in ("off", "0", "false", "no")


def _new_chunk(size: int) -> torch.Tensor:
    """`size` bytes (a multiple of 2 MB), 2 MB aligned, advised before first touch.

    The chunk is an anonymous mapping of its own (`mmap`), never malloc's memory: malloc may hand
    back a stretch of its heap that is already touched (pages touched before the advice stay 4 KB
    until khugepaged merges them), and advising the heap would mark memory that is not ours."""
    # Private: a shared anonymous mapping (mmap's default) is shmem, whose huge pages are a separate
    # setting that is off by default. The tensor below holds a reference, so the mapping stays.
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    mapping = mmap.mmap(-1, size + HUGE_PAGE, **private)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    chunk = raw[start : start + size]
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only; elsewhere the chunk is plain memory
    if advice is not None:
        try:
            mapping.madvise(advice, start, size)
        except OSError:  # THP compiled out: a refusal is harmless
            pass
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
