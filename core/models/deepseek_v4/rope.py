"""Rotary tables for ``rope.apply``: ``cos_sin[P, R] = [cos(R/2) | sin(R/2)]`` per position.

Plain RoPE and YaRN (NTK-by-parts with a linear ramp between ``beta_fast`` and ``beta_slow`` rotations),
computed in fp32 exactly as transformers' rope utilities do, so tables match the oracle bit for bit.
"""

from __future__ import annotations

import math

import torch

from inferhal.core.models.deepseek_v4.config import RopeSpec


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """``[R/2]`` fp32 inverse frequencies."""
    dim = spec.rotary_dim
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if spec.rope_type == "default":
        return 1.0 / pos_freqs

    def corr_dim(rot: float) -> float:
        return dim * math.log(spec.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = corr_dim(spec.beta_fast), corr_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    return (1.0 / (spec.factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra


def cos_sin_table(spec: RopeSpec, num_positions: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """``[num_positions, R]`` fp32 table for ``rope.apply`` (cos and sin times the attention factor)."""
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq(spec)[None, :]
    table = torch.cat((freqs.cos() * spec.attention_factor, freqs.sin() * spec.attention_factor), dim=-1)
    return table.to(device)


class RopeCache:
    """A table that grows on demand (capped at ``limit`` positions), so 1M-position models stay cheap."""

    def __init__(self, spec: RopeSpec, initial: int, limit: int, device: str | torch.device = "cpu") -> None:
        self.spec, self.limit, self.device = spec, limit, device
        self.table = cos_sin_table(spec, min(initial, limit), device)

    def get(self, max_position: int) -> torch.Tensor:
        if max_position >= self.table.shape[0]:
            if max_position >= self.limit:
                raise ValueError(f"position {max_position} exceeds max_position_embeddings={self.limit}")
            n = min(self.limit, max(2 * self.table.shape[0], max_position + 1))
            self.table = cos_sin_table(self.spec, n, self.device)
        return self.table
