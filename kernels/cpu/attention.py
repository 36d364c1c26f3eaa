"""Paged attention and KV writes over a bf16 cache (``attention.c``, built by :mod:`inferhal.kernels.cpu.lib`):
``attn.paged`` for separate K and V without sinks, every row of a step in one call, and ``kv.write``."""

from __future__ import annotations

import torch

from inferhal.core.ops.params import AttnBatch, AttnParams
from inferhal.kernels.cpu.lib import library

MAX_REP = 8  # query heads per KV head (attention.c)
MAX_D = 512


def _packed_slots(cache: torch.Tensor) -> bool:
    """Each block's slots packed (the pool may stride its blocks: per-layer views of a shared page)."""
    return cache.numel() > 0 and cache[0].is_contiguous()


def supports(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
             sinks: torch.Tensor | None = None) -> bool:
    """Whether :func:`attn_paged` runs this call (else the caller uses the reference)."""
    if sinks is not None or p.shared_kv or batch.tokens_per_slot != 1:
        return False
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or q.device.type != "cpu" or q.dim() != 3:
        return False
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2 or not _packed_slots(kv_cache):
        return False
    t, h, d = q.shape
    hk = kv_cache.shape[3]
    return (kv_cache.shape[4] == d and h % hk == 0 and h // hk <= MAX_REP and 0 < d <= MAX_D
            and q.stride(2) == 1 and hk == p.num_kv_heads)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               checked: bool = False) -> torch.Tensor:
    """``[T, H, D]`` bf16 attention of every row of ``batch`` over its visible keys (see attention.c).
    ``checked``: the caller already asked :func:`supports` (the backend does, at every layer)."""
    if not checked and not supports(q, kv_cache, batch, p):
        raise ValueError(f"attn_paged: unsupported call: q {q.dtype} {tuple(q.shape)}, cache {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}, {p}")
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=q.dtype)
    if t == 0:
        return out
    qsl = batch.query_start_loc.to(torch.int32).contiguous()
    table = batch.block_table.to(torch.int32).contiguous()
    pos = batch.positions[:t].to(torch.int64).contiguous()
    bad = library().ih_attn_paged_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), t, h, d, kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.stride(0), kv_cache.shape[3],
        table.data_ptr(), table.shape[1], qsl.data_ptr(), qsl.numel() - 1, pos.data_ptr(), p.window, p.scale,
        p.softcap, out.data_ptr())
    if bad == -2:
        raise MemoryError(f"attn_paged: could not allocate the logits of a row ({h // kv_cache.shape[3]} heads x up "
                          f"to {int(pos.max()) + 1} keys, fp32)")
    if bad >= 0:
        raise IndexError(f"KV positions of query row {bad} (position {int(pos[bad])}) reach a block that is not "
                         f"allocated (-1 in the block table)")
    return out


def supports_write(values: torch.Tensor, cache: torch.Tensor, quant: str) -> bool:
    return (quant == "none" and values.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
            and values.device.type == "cpu" and cache.dim() >= 3 and values.dim() == cache.dim() - 1
            and values.shape[1:] == cache.shape[2:] and _packed_slots(cache) and values[0:1].is_contiguous())


def kv_write(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, checked: bool = False) -> None:
    """``cache[slot // bs, slot % bs] = values[i]`` for every ``slot = slot_mapping[i] >= 0``. A slot past the
    cache is an IndexError, as in the reference, and then nothing is written. ``checked``: the caller already
    asked :func:`supports_write`."""
    if not checked and not supports_write(values, cache, "none"):
        raise ValueError(f"kv_write: unsupported call: values {values.dtype} {tuple(values.shape)}, cache "
                         f"{cache.dtype} {tuple(cache.shape)}")
    t = values.shape[0]
    slots = slot_mapping[:t].to(torch.int64).contiguous()
    v2 = values.reshape(t, -1)
    if t:
        bad = library().ih_kv_write_bf16(v2.data_ptr(), v2.stride(0), t, v2.shape[1], slots.data_ptr(),
                                         cache.data_ptr(), cache.shape[0], cache.shape[1], cache.stride(0))
        if bad >= 0:
            raise IndexError(f"kv_write: slot {int(slots[bad])} is past the cache's "
                             f"{cache.shape[0] * cache.shape[1]} slots")
