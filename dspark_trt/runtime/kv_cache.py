"""Per-request KV cache: appended in place, truncated to roll back rejected drafts.

Each request owns one `KVCache`: keys and values of every layer, `[num_layers, num_kv_heads,
capacity, head_dim]`, of which the first `length` positions are valid. The target writes new
keys/values at `[length, length + n)` during a forward pass and then advances `length`; a
rejected draft is rolled back by `truncate`, which only moves `length` (the stale entries are
overwritten by the next forward). Capacity grows by doubling, so appends are amortised O(1).

This module does not decide *what* goes into the cache (that is the step loop) nor how much
memory all caches may use together (that is the scheduler's budget).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int = 256,
                 dtype: torch.dtype = torch.float32):
        shape = (num_layers, num_kv_heads, max(1, capacity), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)  # [layers, kv_heads, capacity, head_dim]
        self.values = torch.zeros(shape, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def reserve(self, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more positions (called before a forward pass)."""
        needed = self.length + num_new_tokens
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `keys`/`values` `[kv_heads, n, head_dim]` after the valid prefix of `layer`.

        Returns views of all keys/values the new tokens attend to, `[kv_heads, length + n, head_dim]`.
        `length` is advanced separately by `advance`, once every layer has been written.
        """
        end = self.length + keys.shape[1]
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, num_new_tokens: int) -> None:
        self.length += num_new_tokens

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (rejected draft tokens are forgotten)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
