"""KV record formats as data: how one cached entry of ``dims`` channels lies in bytes (``cache.kv_dtype``).

- ``auto``: the model's dtype, ``dims`` elements.
- ``fp8``: vLLM's DeepSeek-V4 layout (``fp8_ds_mla``): the no-RoPE channels in e4m3 with one ue8m0 scale per
  64, the RoPE channels in bf16, padded to 8 bytes: a 512-dim latent with 64 RoPE dims is 448 + 128 + 7 + 1
  = **584 B**. A record without RoPE channels (indexer keys) is e4m3 with one fp32 scale per 128 channels.
- ``fp4``: e2m1 codes, two per byte, with block scales: main records as NVFP4 (16-channel blocks, e4m3
  scales; 512 dims = 256 + 32 = **288 B**), indexer keys as MXFP4 (32-channel blocks, ue8m0 scales; 128 dims
  = 64 + 4 = **68 B**). The seeds' 890 B per token reads as 10 source layers x (288 + 68) / 4.

A quantised group is paged as raw bytes (``uint8``, one record per slot). Today only the planner reads
these formats (``inferhal plan kv cache.kv_dtype=fp8|fp4``); running a model with a quantised KV cache is
refused until its write and attention ops read the records (core/config/refusals.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "fp8", "fp4")


@dataclass(frozen=True)
class KVRecord:
    """One record: its bytes and a description of how they lie."""

    nbytes: int
    layout: str


def _pad(n: int, align: int) -> int:
    return n + (-n % align)


def record(kv_dtype: str, dims: int, rope_dims: int = 0, model_dtype: torch.dtype = torch.bfloat16,
           role: str = "main") -> KVRecord:
    """The record of ``dims`` channels (``rope_dims`` of them rotary) in ``kv_dtype``; ``role`` is ``main``
    (latent or compressed KV) or ``index`` (lightning-indexer keys)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"cache.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        size = torch.empty((), dtype=model_dtype).element_size()
        return KVRecord(dims * size, f"{dims} x {str(model_dtype).replace('torch.', '')}")
    if kv_dtype == "fp8":
        if role == "index" or not rope_dims:
            scales = -(-dims // 128)
            return KVRecord(dims + 4 * scales, f"{dims} e4m3 + {scales} fp32 scale(s)")
        nope = dims - rope_dims
        scales = -(-nope // 64)
        raw = nope + 2 * rope_dims + scales
        return KVRecord(_pad(raw, 8), f"{nope} e4m3 + {rope_dims} bf16 RoPE + {scales} ue8m0 scales, padded to 8 B")
    block, scale = (32, "ue8m0") if role == "index" else (16, "e4m3")
    codes, scales = -(-dims // 2), -(-dims // block)
    name = "MXFP4" if role == "index" else "NVFP4"
    return KVRecord(codes + scales, f"{name}: {dims} e2m1 ({codes} B) + {scales} {scale} scales")
