"""KV memory: a pool of fixed-size slots, one slot per running request.

`KVPool` holds keys and values of every running request in two tensors
`[num_layers, num_slots, kv_heads, slot_capacity, head_dim]` (the static-batch layout of
gpt-fast and TensorRT-LLM's non-paged mode). A request's `KVCache` is its slot plus a
`length`: the target writes new keys/values at `[length, length + n)` and then advances
`length`; a rejected draft is rolled back by `truncate`, which only moves `length` (stale
entries are overwritten by the next forward).

Why slots rather than one tensor per request: the short feeds of a decode step (one token, or
an anchor plus a draft block) of *all* requests then attend in one batched matmul over a view
of the pool, with no copying; per-request attention cost ~0.1 ms of Python and kernel
overhead per request per layer on CPU, which dominated steps at batch 32.

The pool's size is the KV-memory budget: `allocate` fails when every slot is taken, and the
scheduler decides who waits. This module does not decide what goes into a cache.
"""

from __future__ import annotations

import torch


class KVPoolFull(RuntimeError):
    """Every slot of the pool is in use."""


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, slot_capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, slot_capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_capacity = slot_capacity
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.in_use: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def allocate(self) -> "KVCache":
        if not self._free:
            raise KVPoolFull(f"all {self.num_slots} KV slots are in use")
        # Lowest free slot first keeps running requests in a compact slot range, so batched
        # attention scans few idle slots.
        self._free.sort(reverse=True)
        slot = self._free.pop()
        self.in_use.add(slot)
        return KVCache(self, slot)

    def free(self, cache: "KVCache") -> None:
        if cache.slot in self.in_use:
            self.in_use.remove(cache.slot)
            self._free.append(cache.slot)
        cache.length = 0


class KVCache:
    """One request's slot in a `KVPool` and how many of its positions are valid."""

    def __init__(self, pool: KVPool, slot: int):
        self.pool = pool
        self.slot = slot
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.pool.slot_capacity

    def layer_view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[kv_heads, end, head_dim]` of this slot (views, no copy)."""
        return self.pool.keys[layer, self.slot, :, :end], self.pool.values[layer, self.slot, :, :end]

    def advance(self, num_new_tokens: int) -> None:
        if self.length + num_new_tokens > self.capacity:
            raise ValueError(f"KV slot overflow: {self.length} + {num_new_tokens} > capacity {self.capacity}")
        self.length += num_new_tokens

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (rejected draft tokens are forgotten)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
