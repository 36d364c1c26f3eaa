"""Quantised weights as plain data. Loaders build them; ops that understand the format consume them;
the reference backend dequantises them inside its ops (``backends/reference/quant.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp8_block", "fp4_group")


@dataclass(frozen=True)
class QuantWeight:
    """A quantised ``[..., N, K]`` weight.

    - ``fp8_block``: ``data`` float8_e4m3fn ``[..., N, K]``; ``scale`` fp32 (or ue8m0 as float8_e8m0fnu)
      ``[..., ceil(N/block[0]), ceil(K/block[1])]``, w = data * scale per block (DeepSeek's 128x128).
    - ``fp4_group``: ``data`` uint8 ``[..., N, K/2]``, two e2m1 codes per byte (low nibble = even
      column); ``scale`` ``[..., N, K/group]`` (fp32 or float8_e8m0fnu), one per ``block[1]`` elements.
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    shape: tuple[int, ...]
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantisation format {self.format!r}; known: {', '.join(FORMATS)}")

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
