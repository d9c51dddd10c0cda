"""Rotary position embeddings (rotate-half convention), for the target and every drafter.

One implementation, so that a drafter's positions rotate exactly as its target's: inverse
frequencies (with Llama-3 frequency scaling when a config asks for it), cos/sin of integer
positions, and the rotation itself. The C kernels read tables made here.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32), with Llama-3 frequency scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling:  # llama3: long wavelengths are slowed down, short ones kept, a smooth ramp between
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., head_dim]` (float32) for integer positions `[...]`."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[tokens, heads, head_dim]` by per-token angles (`cos`/`sin`: `[tokens, 1, head_dim]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
