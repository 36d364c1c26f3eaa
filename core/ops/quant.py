"""Quantised weights as plain data. Loaders build them; ops that understand the format consume them;
the reference backend dequantises them inside its ops (:mod:`inferhal.core.ops.quantize`: each format's
encoding and decoding in plain torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferhal.core.ops import mapped

FORMATS = ("fp8_block", "fp4_group", "int_block")


@dataclass(frozen=True)
class QuantWeight:
    """A quantised ``[..., N, K]`` weight.

    - ``fp8_block``: ``data`` float8_e4m3fn ``[..., N, K]``; ``scale`` fp32 (or ue8m0 as float8_e8m0fnu)
      ``[..., ceil(N/block[0]), ceil(K/block[1])]``, w = data * scale per block (DeepSeek's 128x128).
    - ``fp4_group``: ``data`` uint8 ``[..., N, K/2]``, two e2m1 codes per byte (low nibble = even
      column); ``scale`` ``[..., N, K/group]`` (fp32 or float8_e8m0fnu), one per ``block[1]`` elements.
    - ``int_block``: ``data`` int8 ``[N, K]``; ``scale`` fp32 ``[N, K/block[1]]`` and ``offset`` fp32 of the
      same shape or None; w = fl(fl(data * scale) - offset) per block of ``block[1]`` (16 or 32) along K,
      two fp32 roundings (w = fl(data * scale) without an offset). This is how GGUF's Q8_0, Q5_0, Q6_K and
      Q4_K blocks dequantise (``gguf.quants``), so a GGUF loader can keep their integers exactly.
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    shape: tuple[int, ...]
    block: tuple[int, int] = (128, 128)
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantisation format {self.format!r}; known: {', '.join(FORMATS)}")
        if self.offset is not None and self.format != "int_block":
            raise ValueError(f"a {self.format} weight has no offset; only int_block weights take one")

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        parts = (self.data, self.scale) + (() if self.offset is None else (self.offset,))
        return sum(t.numel() * t.element_size() for t in parts)

    def rows(self, start: int, stop: int) -> "QuantWeight":
        """Output rows ``[start, stop)`` of a 2-D int_block weight, as views."""
        if self.format != "int_block" or len(self.shape) != 2:
            raise ValueError(f"rows: takes a 2-D int_block weight, got {self.format} {self.shape}")
        cut = (lambda t: None if t is None else t[start:stop])
        return QuantWeight(self.data[start:stop], self.scale[start:stop], self.format, (stop - start, self.shape[1]),
                           self.block, cut(self.offset))


def int_block(data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> QuantWeight:
    """An int_block weight ``[N, K]`` from int8 ``data [N, K]`` and fp32 ``scale`` (and ``offset``) ``[N, K/bk]``,
    checked (bk = K / scale's columns: 16 or 32)."""
    if data.dtype != torch.int8 or data.dim() != 2:
        raise ValueError(f"int_block: data must be int8 [N, K], got {data.dtype} {tuple(data.shape)}")
    n, k = data.shape
    for name, t in (("scale", scale), ("offset", offset)):
        if t is not None and (t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] != n or t.shape[1] == 0
                              or k % t.shape[1] or k // t.shape[1] not in (16, 32)):
            raise ValueError(f"int_block: {name} must be fp32 [{n}, K/16 or K/32] for data [{n}, {k}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"int_block: offset {tuple(offset.shape)} and scale {tuple(scale.shape)} differ")
    return QuantWeight(data, scale, "int_block", (n, k), (1, k // scale.shape[1]), offset)


def int_block_values(w: QuantWeight) -> torch.Tensor:
    """An int_block weight's fp32 values, fl(fl(data * scale) - offset) per block (the format's definition)."""
    n, k = w.shape
    bk = w.block[1]
    v = w.data.float().view(n, k // bk, bk) * w.scale[..., None]
    if w.offset is not None:
        v = v - w.offset[..., None]
    return v.view(n, k)


def _back_to_back(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """``ws`` stacked along N as a view, without a copy, where they are contiguous row blocks lying back to back in
    one storage of a read-only weight mapping (the disk weight cache writes a layer's q, k, v and gate, up so,
    and maps them as one storage); None otherwise. Only for such mappings: nothing can write them, so the view
    aliasing its parts changes nothing, and its pages stay file-backed (a backend's packed copy gives them back)."""
    first = ws[0]
    if len(ws) < 2 or not all(w.is_contiguous() and w.dim() >= 1 and w.dtype == first.dtype and w.device == first.device
                              and w.shape[1:] == first.shape[1:] for w in ws):
        return None
    base = first.untyped_storage().data_ptr()
    off = first.storage_offset()
    for w in ws:
        if w.untyped_storage().data_ptr() != base or w.storage_offset() != off:
            return None
        off += w.numel()
    joined = first.as_strided((sum(w.shape[0] for w in ws), *first.shape[1:]), first.stride(), first.storage_offset())
    return joined if mapped.is_mapped(joined) else None


def cat_rows(ws) -> torch.Tensor | QuantWeight:
    """Weights ``[N_i, K]`` stacked along N: ``torch.cat`` for tensors; int_block weights of one block size
    (a zero offset stands in where one has none and another has one: fl(v - 0) = v). Tensors lying back to back
    in a mapped weight file are joined as a view of it (:func:`_back_to_back`); otherwise the parts' pages go
    back where they view a mapped weight file (:func:`~inferhal.core.ops.mapped.release`): the fused copy is
    what a model keeps and reads."""
    ws = list(ws)
    if all(isinstance(w, torch.Tensor) for w in ws):
        joined = _back_to_back(ws)
        if joined is not None:
            return joined
        out = torch.cat(ws)
        for w in ws:
            mapped.release(w)
        return out
    if not all(isinstance(w, QuantWeight) and w.format == "int_block" for w in ws) or len({w.block for w in ws}) != 1:
        raise ValueError(f"cat_rows: takes tensors, or int_block weights of one block size; got "
                         f"{[type(w).__name__ if isinstance(w, torch.Tensor) else (w.format, w.block) for w in ws]}")
    off = None
    if any(w.offset is not None for w in ws):
        off = torch.cat([torch.zeros_like(w.scale) if w.offset is None else w.offset for w in ws])
    out = int_block(torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]), off)
    for w in ws:
        for t in (w.data, w.scale, w.offset):
            if t is not None:
                mapped.release(t)
    return out
