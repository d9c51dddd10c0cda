"""Packed weights in huge-page chunks (`kernels/huge_pages.py`): the same values wherever they live,
each placement cache-line aligned inside a shared 2 MB-aligned chunk that Linux was asked to back
with huge pages, and nothing moved when that is turned off."""

import mmap
from pathlib import Path

import pytest
import torch

from dspark_trt.kernels import cpu_kernels, huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def fresh_chunks(monkeypatch):
    """A fresh arena (small chunks, so that the test sees several), on."""
    monkeypatch.setattr(huge_pages, "_chunk", None)
    monkeypatch.setattr(huge_pages, "_used", 0)
    monkeypatch.setattr(huge_pages, "CHUNK", 4 * huge_pages.HUGE_PAGE)
    monkeypatch.delenv(huge_pages.VARIABLE, raising=False)


def test_placed_tensors_keep_their_values_and_share_aligned_chunks(fresh_chunks):
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(300, 257, generator=generator).bfloat16()  # 154,200 bytes: not a multiple of 64
    second = torch.randint(0, 255, (70_001,), dtype=torch.uint8, generator=generator)
    transposed = torch.randn(512, 96, generator=generator).t()  # not contiguous
    placed = [huge_pages.place(t) for t in (first, second, transposed)]
    for original, copy in zip((first, second, transposed), placed):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % huge_pages.ALIGNMENT == 0
    start = placed[0].data_ptr()
    assert start % huge_pages.HUGE_PAGE == 0  # the first placement opens a chunk
    assert placed[1].data_ptr() == start + 154_240  # the next cache line after the first
    assert placed[2].data_ptr() == start + 154_240 + 70_016
    big = huge_pages.place(torch.ones(5 * huge_pages.HUGE_PAGE, dtype=torch.uint8))  # over a chunk: its own
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and bool(big.all())
    after = huge_pages.place(torch.zeros(100_000, dtype=torch.uint8))
    assert after.data_ptr() == start + 154_240 + 70_016 + 196_608  # back in the shared chunk


def test_small_tensors_and_off_leave_tensors_where_they_are(fresh_chunks, monkeypatch):
    small = torch.randn(100, 10)
    assert huge_pages.place(small).data_ptr() == small.data_ptr()
    monkeypatch.setenv(huge_pages.VARIABLE, "off")
    large = torch.randn(1000, 100)
    assert huge_pages.place(large).data_ptr() == large.data_ptr()
    strided = large.t()
    assert torch.equal(huge_pages.place(strided), strided) and huge_pages.place(strided).is_contiguous()


@pytest.mark.skipif(not THP.exists(), reason="this Linux has no transparent huge pages")
def test_chunks_are_advised_as_huge_pages(fresh_chunks, monkeypatch):
    """madvise(MADV_HUGEPAGE) marks the chunk's mapping `hg` whatever THP's mode (whether Linux then
    finds free 2 MB pages is its business: the benchmark reports how much it did). A chunk is an
    anonymous mapping of its own, never a stretch of malloc's heap, so the advice marks nothing
    else: an ordinary mapping of the same size beside it is not advised."""
    monkeypatch.setattr(huge_pages, "CHUNK", 64 << 20)
    placed = huge_pages.place(torch.ones(3 * huge_pages.HUGE_PAGE, dtype=torch.uint8))
    assert "hg" in vma_flags(placed.data_ptr())
    assert placed.data_ptr() % huge_pages.HUGE_PAGE == 0
    ordinary = torch.frombuffer(mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    assert "sh" not in vma_flags(placed.data_ptr())  # private: shared (shmem) memory has huge pages off
    assert "hg" not in vma_flags(ordinary.data_ptr() + huge_pages.HUGE_PAGE)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")
def test_packed_weights_in_chunks_compute_what_they_compute_in_place(fresh_chunks, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(576, 1536, generator=generator)
    x = torch.randn(7, 576, generator=generator)
    in_chunk = cpu_kernels.PackedWeight(weight)
    monkeypatch.setenv(huge_pages.VARIABLE, "off")
    in_place = cpu_kernels.PackedWeight(weight)
    assert in_chunk.data.data_ptr() % huge_pages.ALIGNMENT == 0
    assert torch.equal(in_chunk.data, in_place.data)
    assert torch.equal(cpu_kernels.matmul(x, in_chunk), cpu_kernels.matmul(x, in_place))
