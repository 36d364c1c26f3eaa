"""How the ascend950 backend pages FP8 KV records (``cache.kv_dtype=fp8``) for the 950's quantised operators.

The core's FP8 main record (``fp8_ds_mla``, :mod:`inferhal.core.paging.formats`) and the record that
``kv_compress_epilog`` writes and ``npu_kv_quant_sparse_attn_sharedkv`` reads (contract.CITATIONS) hold the
same values: 448 e4m3 no-RoPE codes with one e8m0 scale per 64, and 64 RoPE channels in bf16. Only the bytes
lie differently:

===========  =================================================================================  ======
record       bytes                                                                              size
===========  =================================================================================  ======
core         codes 448 | RoPE bf16 128 | scales 7 | pad 1                                       584 B
operator     RoPE bf16 128 | codes 448 | scales 7 | zero pad                                    640 B
===========  =================================================================================  ======

So on a generation with the quantised operators (profile feature ``kv_quant_sparse_attn_sharedkv``) the
backend's KV storage gives every 584-byte uint8 group 640-byte slots, and hands the pool out as the
``[NB, BS, 584]`` view of each slot's first 584 bytes, as the storage contract wants (every meaningful byte
of the operator's record, 583 of them, lies there; the rest is padding). The bytes in those pages are in the
**operator's** order: only this backend's ops read them (:func:`operator_pages` finds the full rows), and
when one of them falls back to the reference it hands over a copy in the core's order (:func:`to_core`).
Costs: 640 / 584 = 1.096x the planned bytes of those groups (``AscendKVStorage.nbytes`` reports the truth),
and a page copied to an engine on another backend (PD hand-off) would be read in the wrong order.
"""

from __future__ import annotations

import torch

from inferhal.core.paging.formats import KVFormat

ROW = 640  # bytes per slot the operators read (README: D 640, rope | nope | scales, padded)
CORE_ROW = 584  # the core's fp8_ds_mla record of a 512-dim latent with 64 RoPE channels
NOPE, ROPE, TILE = 448, 64, 64


def is_operator_record(fmt: KVFormat | None) -> bool:
    """Whether ``fmt`` is the record the 950's operators take: 448 e4m3 channels with ue8m0 scales per 64 and
    64 bf16 RoPE channels (DeepSeek-V4's 512-dim latent)."""
    return (fmt is not None and fmt.code == "e4m3" and fmt.scale == "ue8m0" and fmt.block == TILE
            and fmt.coded == NOPE and fmt.raw_dims == ROPE)


def arranged(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is a ``[NB, BS, W < 640]`` uint8 view over 640-byte slots (this backend's storage)."""
    return (cache.dim() == 3 and cache.dtype == torch.uint8 and cache.shape[2] < ROW
            and cache.stride() == (cache.shape[1] * ROW, ROW, 1))


def operator_pages(cache: torch.Tensor) -> torch.Tensor:
    """The full ``[NB, BS, 640]`` uint8 rows behind an :func:`arranged` view (same memory)."""
    nb, bs = cache.shape[:2]
    return cache.as_strided((nb, bs, ROW), (bs * ROW, ROW, 1), cache.storage_offset())


def _positions(fmt: KVFormat) -> torch.Tensor:
    """For each byte of the core record, where it lies in the operator's row (pad bytes: the last, zero)."""
    raw, codes = 2 * fmt.raw_dims, fmt.code_bytes
    used = fmt.scales_at + fmt.num_scales * (4 if fmt.scale == "fp32" else 1)  # the bytes before the padding
    if used > ROW - 1:
        raise ValueError(f"{fmt.name}: {used} bytes do not fit a {ROW}-byte row with a zero byte to spare")
    pos = torch.full((fmt.nbytes,), ROW - 1, dtype=torch.long)
    pos[:codes] = raw + torch.arange(codes)
    pos[fmt.raw_at:fmt.scales_at] = torch.arange(raw)
    pos[fmt.scales_at:used] = raw + codes + torch.arange(used - fmt.scales_at)
    return pos


def to_core(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Operator rows ``[..., 640]`` → the core's records ``[..., fmt.nbytes]`` (a copy; exact)."""
    return rows[..., _positions(fmt).to(rows.device)].contiguous()


def from_core(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The core's records ``[..., fmt.nbytes]`` → operator rows ``[..., 640]`` (zero padded; exact)."""
    pos = _positions(fmt).to(records.device)
    used = pos != ROW - 1
    out = records.new_zeros(*records.shape[:-1], ROW)
    out[..., pos[used]] = records[..., used]
    return out


def core_view(cache: torch.Tensor, fmt: KVFormat | None) -> torch.Tensor:
    """What the reference reads: ``cache`` itself unless it is :func:`arranged`, else a core-order copy."""
    if fmt is None or not arranged(cache) or cache.shape[2] != fmt.nbytes:
        return cache
    return to_core(operator_pages(cache), fmt)


def repage(cache: torch.Tensor, batch, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries ``batch`` reads from an :func:`arranged` cache, copied into fresh ``block``-entry pages:
    ``(rows [B * M, block, 640] uint8, block_table int32 [B, M])``, sequence b's entry e at page ``b * M + e //
    block``. For pages the operators cannot take (HCA at 128 tokens per entry leaves one entry per 128-token
    block; they want 16-aligned blocks); costs one 640-byte copy per entry read."""
    full = operator_pages(cache)
    bs = full.shape[1]
    lens = batch.seq_lens.long()
    nseq = lens.numel()
    m = max(1, -(-int(lens.max()) // block)) if nseq else 1
    e = torch.arange(m * block, device=cache.device)
    keep = e[None, :] < lens[:, None]  # [B, M * block]
    src = batch.block_table.long().gather(1, (e // bs).clamp(max=batch.block_table.shape[1] - 1)[None, :].expand(nseq, -1))
    out = torch.zeros(nseq, m * block, ROW, dtype=torch.uint8, device=cache.device)
    out[keep] = full[src[keep], (e % bs)[None, :].expand(nseq, -1)[keep]]
    table = torch.arange(nseq * m, dtype=torch.int32, device=cache.device).view(nseq, m)
    return out.view(nseq * m, block, ROW), table


def compact_core(cache: torch.Tensor, batch, fmt: KVFormat):
    """For a fallback: the blocks ``batch`` lists, copied in the core's byte order, and ``batch`` with its block
    table renumbered to them (cost: the blocks read, not the pool). Caches not :func:`arranged` pass through."""
    if not arranged(cache) or cache.shape[2] != fmt.nbytes:
        return cache, batch
    import dataclasses

    t = batch.block_table.long()
    used = t[t >= 0].unique()
    remap = torch.full((cache.shape[0],), -1, dtype=torch.long, device=cache.device)
    remap[used] = torch.arange(used.numel(), device=cache.device)
    table = torch.where(t >= 0, remap[t.clamp(min=0)], t)
    return to_core(operator_pages(cache)[used], fmt), dataclasses.replace(batch, block_table=table)
