"""DeepSeek-V4 hybrid attention: ``attn.sparse_topk`` (CSA with the indexer's top-k, HCA with every
visible entry, sliding-window layers with none).

One program per query token, all H heads of the one shared latent KV head (K = V) as the M side of
``tl.dot``. One online softmax in fp32 runs over two key sources, then the learned sinks join the
denominator only:

1. the token's sliding-window keys ``[max(0, pos - window + 1), min(pos + 1, ctx))`` of ``kv_cache``,
   walked in ``BLOCK_N`` tiles through the sliding group's block table;
2. the compressed entries ``topk_idx[t, :]`` of ``comp_cache`` (logical entry indices of the token's
   sequence, gathered through the compressed group's block table), ``BLOCK_N`` at a time; an index is
   used iff ``0 <= e < min(comp_len, (pos + 1) // ratio)`` (causally closed), else skipped.

Indices in one row are assumed distinct (topk.select and the HCA "all visible" list are): the oracle
builds a set, this kernel would count a duplicate twice. Nothing depends on the other tokens of the
batch (batch-invariant). P is cast to the KV dtype before the P.V dot, as in ``attn_paged``.
Two kernels, selected by the wrapper's ``decode`` argument (the cuda_sm100 backend passes
``backend.options.attn_decode``):

- ``split`` (default): split-KV (:mod:`inferhal.kernels.attn_split`): a program per (token, group of
  ``BLOCK_H`` heads, split); the window is one key range cut by the token's own key count, the top-k
  row is cut every ``SPLIT`` entries; a combine kernel merges the partials and adds the sinks;
- ``single``: one program per token holding all heads (kept to compare on a device); with FP8 / FP4 records
  two or four (the ``attn_sparse_records`` entry's ``CHANNEL_SPLIT``), each holding its part of the value
  channels.

Oracle: ``backends/reference/deepseek.py:attn_sparse_topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import AttnBatch, AttnParams
from inferhal.kernels import attn_split
from inferhal.kernels.attn_split import online_block_t, range_split, split_start, store_partial
from inferhal.kernels.common import (dot_operand, interp, launch, query_span, round_to, seq_of_token, softmax_out,
                                     tl_dtype)
from inferhal.kernels.kv_records import check_record_cache, decode_tile, record_args, tile_args
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def _channels(k, c, BLOCK_DV: tl.constexpr):
    """The values of program ``c``: all channels of ``k [N, W]`` (``BLOCK_DV == W``), or its half or quarter
    ``c`` (channels ``[c * BLOCK_DV, (c + 1) * BLOCK_DV)``)."""
    v = k
    if BLOCK_DV * 2 == k.shape[1]:
        lo, hi = tl.split(tl.permute(tl.reshape(k, (k.shape[0], 2, BLOCK_DV)), (0, 2, 1)))
        v = tl.where(c == 0, lo, hi)
    elif BLOCK_DV * 4 == k.shape[1]:  # channel (2a + b) * BLOCK_DV + j at [n, a, b, j]: c = 2a + b
        a0, a1 = tl.split(tl.permute(tl.reshape(k, (k.shape[0], 2, 2, BLOCK_DV)), (0, 3, 2, 1)))  # [N, DV, b]
        lo, hi = tl.split(tl.where(c // 2 == 0, a0, a1))
        v = tl.where(c % 2 == 0, lo, hi)
    return v


def channel_split(want: int, block_d: int) -> int:
    """Programs a token of the ``single`` kernel: ``want`` (1, 2 or 4), halved until each holds 16 channels."""
    if want not in (1, 2, 4):
        raise ValueError(f"attn_sparse_records: CHANNEL_SPLIT must be 1, 2 or 4, got {want}")
    while want > 1 and block_d // want < 16:
        want //= 2
    return want


@triton.jit
def _online_block(q, k, ok, m_i, l_i, acc, c, scale, PREC: tl.constexpr, INTERP: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    """One tile of keys (K = V) into the running (max, denominator, accumulator) of all heads; the values are
    the key channels ``[c * BLOCK_DV, (c + 1) * BLOCK_DV)`` (all of them, or one half)."""
    s = tl.dot(q, dot_operand(tl.trans(k), INTERP), input_precision=PREC) * scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(ok[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _channels(k, c, BLOCK_DV)
    acc = acc * alpha[:, None] + tl.dot(dot_operand(p.to(v.dtype), INTERP), dot_operand(v, INTERP),
                                        input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _key_tile(ptr, blk, slot, stride_b, stride_s, ok, d, dm, D, DTYPE: tl.constexpr, RECORD: tl.constexpr,
              CODE: tl.constexpr, SCALE: tl.constexpr, RBLOCK: tl.constexpr, CODED: tl.constexpr,
              RAW_AT: tl.constexpr, SCALES_AT: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
              ALIGN: tl.constexpr):
    """Keys ``[BLOCK_N, BLOCK_D]`` at (block, slot) for the split kernel: a value cache's rows, or FP8/FP4
    records through :func:`~inferhal.kernels.kv_records.decode_tile`; zeros where not ``ok``."""
    if RECORD:
        k = decode_tile(ptr, blk * stride_b + slot * stride_s, ok, D, DTYPE, CODE, SCALE, RBLOCK, CODED, RAW_AT,
                        SCALES_AT, BLOCK_D, GROUP, ALIGN)
    else:
        k = tl.load(ptr + blk[:, None] * stride_b + slot[:, None] * stride_s + d[None, :],
                    mask=ok[:, None] & dm[None, :], other=0.0)
    return k


@triton.jit
def sparse_attn_kernel(q_ptr, kv_ptr, c_ptr, idx_ptr, o_ptr, sink_ptr, bt_ptr, cbt_ptr, seq_ptr, pos_ptr, len_ptr,
                       clen_ptr, H, D, BS, CBS, NK, RATIO, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb,
                       stride_ks, stride_cb, stride_cs, stride_it, stride_bt, stride_cbt, scale, window,
                       HAS_COMP: tl.constexpr, HAS_SINKS: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
                       RECORD: tl.constexpr = False, CODE: tl.constexpr = 0, SCALE: tl.constexpr = 0,
                       RBLOCK: tl.constexpr = 1, CODED: tl.constexpr = 0, RAW_AT: tl.constexpr = 0,
                       SCALES_AT: tl.constexpr = 0, GROUP: tl.constexpr = 16, ALIGN: tl.constexpr = 1,
                       BLOCK_DV: tl.constexpr = 0):
    """``single``: one program per token, all heads as the M side of ``tl.dot``; with ``BLOCK_DV`` a half or a
    quarter of ``BLOCK_D``, two or four per token (``pid(1)``), each scoring the whole keys and holding its part
    of the value channels (the same scores and softmax statistics in each). ``BLOCK_DV`` 0: all ``BLOCK_D``."""
    DV: tl.constexpr = BLOCK_D if BLOCK_DV == 0 else BLOCK_DV
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b, qpos, first, last = query_span(seq_ptr, pos_ptr, len_ptr, t, window)
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = dot_operand(q, INTERP)
    m_i = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DV), dtype=tl.float32)
    j = tl.arange(0, BLOCK_N)
    for n0 in range((first // BLOCK_N) * BLOCK_N, last, BLOCK_N):  # 1. sliding window
        kpos = n0 + j
        ok = (kpos >= first) & (kpos < last)
        blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=ok, other=0).to(tl.int64)
        if RECORD:  # FP8/FP4 records decoded in the tile (kernels/kv_records.py); exact in bf16 for main records
            k = decode_tile(kv_ptr, blk * stride_kb + (kpos % BS) * stride_ks, ok, D, DTYPE, CODE, SCALE, RBLOCK, CODED,
                            RAW_AT, SCALES_AT, BLOCK_D, GROUP, ALIGN)
        else:
            k = tl.load(kv_ptr + blk[:, None] * stride_kb + (kpos % BS)[:, None] * stride_ks + d[None, :],
                        mask=ok[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _online_block(q, k, ok, m_i, l_i, acc, c, scale, PREC, INTERP, DV)
    if HAS_COMP:  # 2. the selected compressed entries
        n_vis = tl.minimum(tl.load(clen_ptr + b).to(tl.int32), (qpos + 1) // RATIO)
        for i0 in range(0, NK, BLOCK_N):
            e = tl.load(idx_ptr + t * stride_it + i0 + j, mask=i0 + j < NK, other=-1).to(tl.int32)
            ok = (e >= 0) & (e < n_vis)
            blk = tl.load(cbt_ptr + b * stride_cbt + e // CBS, mask=ok, other=0).to(tl.int64)
            if RECORD:
                k = decode_tile(c_ptr, blk * stride_cb + (e % CBS) * stride_cs, ok, D, DTYPE, CODE, SCALE, RBLOCK,
                                CODED, RAW_AT, SCALES_AT, BLOCK_D, GROUP, ALIGN)
            else:
                k = tl.load(c_ptr + blk[:, None] * stride_cb + (e % CBS)[:, None] * stride_cs + d[None, :],
                            mask=ok[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _online_block(q, k, ok, m_i, l_i, acc, c, scale, PREC, INTERP, DV)
    out = softmax_out(m_i, l_i, acc, sink_ptr, h, hm, HAS_SINKS)
    dv = c * DV + tl.arange(0, DV)
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + dv[None, :], round_to(out, DTYPE, INTERP),
             mask=hm[:, None] & (dv < D)[None, :])


@triton.jit
def sparse_attn_split_kernel(q_ptr, kv_ptr, c_ptr, idx_ptr, acc_ptr, ml_ptr, bt_ptr, cbt_ptr, seq_ptr, pos_ptr,
                             len_ptr, clen_ptr, t0, H, D, BS, CBS, NK, RATIO, NSW, WS, SPLIT, stride_qt, stride_qh,
                             stride_kb, stride_ks, stride_cb, stride_cs, stride_it, stride_bt, stride_cbt, stride_at,
                             stride_as, stride_ah, stride_mt, stride_ms, scale, window,
                             HAS_COMP: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
                             RECORD: tl.constexpr = False, CODE: tl.constexpr = 0, SCALE: tl.constexpr = 0,
                             RBLOCK: tl.constexpr = 1, CODED: tl.constexpr = 0, RAW_AT: tl.constexpr = 0,
                             SCALES_AT: tl.constexpr = 0, GROUP: tl.constexpr = 16, ALIGN: tl.constexpr = 1):
    """``split``: program (head group, row, split) of token ``t0 + row``. Splits ``s < WS`` cut the window
    range (``NSW`` the constant of :func:`~inferhal.kernels.attn_split.range_split`), the next ones the
    top-k row every ``SPLIT`` entries."""
    row = tl.program_id(1).to(tl.int64)
    t = t0 + row
    s = tl.program_id(2)
    b, qpos, first, last = query_span(seq_ptr, pos_ptr, len_ptr, t, window)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    d, dm, qt, m_i, l_i, acc = split_start(q_ptr, t, heads, hm, D, stride_qt, stride_qh, BLOCK_H, BLOCK_D, INTERP)
    j = tl.arange(0, BLOCK_N)
    if s < WS:  # 1. a split of the sliding window
        lo, hi = range_split(s, last - first, NSW, SPLIT, BLOCK_N)
        for n0 in range(first + lo, first + hi, BLOCK_N):
            kpos = n0 + j
            ok = kpos < first + hi
            blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=ok, other=0).to(tl.int64)
            k = _key_tile(kv_ptr, blk, kpos % BS, stride_kb, stride_ks, ok, d, dm, D, DTYPE, RECORD, CODE, SCALE,
                          RBLOCK, CODED, RAW_AT, SCALES_AT, BLOCK_D, GROUP, ALIGN)
            m_i, l_i, acc = online_block_t(qt, k, k, ok, m_i, l_i, acc, scale, 0.0, False, PREC, INTERP)
    elif HAS_COMP:  # 2. SPLIT entries of the top-k row
        n_vis = tl.minimum(tl.load(clen_ptr + b).to(tl.int32), (qpos + 1) // RATIO)
        i_lo = (s - WS) * SPLIT
        i_hi = tl.minimum(i_lo + SPLIT, NK)
        for i0 in range(i_lo, i_hi, BLOCK_N):
            e = tl.load(idx_ptr + t * stride_it + i0 + j, mask=i0 + j < i_hi, other=-1).to(tl.int32)
            ok = (e >= 0) & (e < n_vis)
            blk = tl.load(cbt_ptr + b * stride_cbt + e // CBS, mask=ok, other=0).to(tl.int64)
            k = _key_tile(c_ptr, blk, e % CBS, stride_cb, stride_cs, ok, d, dm, D, DTYPE, RECORD, CODE, SCALE,
                          RBLOCK, CODED, RAW_AT, SCALES_AT, BLOCK_D, GROUP, ALIGN)
            m_i, l_i, acc = online_block_t(qt, k, k, ok, m_i, l_i, acc, scale, 0.0, False, PREC, INTERP)
    store_partial(acc_ptr, ml_ptr, row, s, heads, hm, d, dm, m_i, l_i, acc, stride_at, stride_as, stride_ah,
                  stride_mt, stride_ms)


def attn_sparse_topk(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, comp_cache: torch.Tensor | None,
                     comp_batch: AttnBatch | None, topk_idx: torch.Tensor | None, p: AttnParams,
                     sinks: torch.Tensor | None = None, *, target: str | None = None,
                     decode: str = "split") -> torch.Tensor:
    """``attn.sparse_topk``: q[T, H, D] over kv_cache[NB, BS, D] and comp_cache[NB', BS', D] entries topk_idx[T, K].
    ``decode``: ``split`` (split-KV and a combine) or ``single`` (one program per token)."""
    if decode not in attn_split.DECODES:
        raise ValueError(f"attn.sparse_topk: decode={decode!r}; known: {', '.join(attn_split.DECODES)}")
    if q.dim() != 3:
        raise ValueError(f"attn.sparse_topk: q must be [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    fmt = p.kv_format
    if fmt is not None:  # both caches hold records of fmt (d channels each)
        if fmt.dims != d:
            raise ValueError(f"attn.sparse_topk: records of {fmt.dims} channels for q of {d}")
        check_record_cache(kv_cache, fmt, "attn.sparse_topk")
        if comp_cache is not None:
            check_record_cache(comp_cache, fmt, "attn.sparse_topk")
    elif kv_cache.dim() != 3 or kv_cache.shape[-1] != d or kv_cache.stride(-1) != 1:
        raise ValueError(f"attn.sparse_topk: kv_cache must be [NB, BS, {d}] contiguous along D, got {tuple(kv_cache.shape)}")
    if p.num_kv_heads != 1 or p.softcap > 0:
        raise ValueError(f"attn.sparse_topk: the kernel takes one shared latent KV head without softcap, got "
                         f"num_kv_heads={p.num_kv_heads}, softcap={p.softcap}")
    has_comp = comp_cache is not None and comp_batch is not None and topk_idx is not None
    if has_comp:
        if fmt is None and (comp_cache.dim() != 3 or comp_cache.shape[-1] != d or comp_cache.stride(-1) != 1):
            raise ValueError(f"attn.sparse_topk: comp_cache must be [NB', BS', {d}] contiguous along D, "
                             f"got {tuple(comp_cache.shape)}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != t:
            raise ValueError(f"attn.sparse_topk: topk_idx must be [T={t}, K], got {tuple(topk_idx.shape)}")
        has_comp = topk_idx.shape[1] > 0
    out = torch.zeros((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tok_seq = seq_of_token(batch, t, q.device, "attn.sparse_topk")
    bt = batch.block_table.contiguous()
    if has_comp:
        idx = topk_idx.contiguous()
        cbt, clen, cc = comp_batch.block_table.contiguous(), comp_batch.seq_lens.contiguous(), comp_cache
        c_args = (cc.shape[1], idx.shape[1], comp_batch.tokens_per_slot)
    else:
        idx, cbt, clen, cc = bt, bt, batch.seq_lens, kv_cache  # unused placeholders
        c_args = (1, 0, 1)
    sink_arg = sinks.float().contiguous() if sinks is not None else None
    common = dict(DTYPE=tl_dtype(q.dtype), PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  BLOCK_D=max(16, next_pow2(d)), INTERP=interp(), **record_args(fmt))
    ptrs = (bt, cbt, tok_seq, batch.positions.contiguous(), batch.seq_lens.contiguous(), clen)
    tile = tile_args(fmt, common["BLOCK_D"], kv_cache)  # the decode_tile constexprs both kernels take
    if has_comp and fmt is not None:
        tile["ALIGN"] = min(tile["ALIGN"], tile_args(fmt, common["BLOCK_D"], cc)["ALIGN"])
    if decode == "single":
        cfg = config("attn_sparse" if fmt is None else "attn_sparse_records", target)
        cs = channel_split(cfg.get("CHANNEL_SPLIT", 1), common["BLOCK_D"])
        launch(sparse_attn_kernel, (t, cs),
            q, kv_cache, cc, idx, out, sink_arg if sinks is not None else q, *ptrs, h, d, kv_cache.shape[1], *c_args,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            cc.stride(0), cc.stride(1), idx.stride(0), bt.stride(0), cbt.stride(0), float(p.scale), int(p.window),
            HAS_COMP=has_comp, HAS_SINKS=sinks is not None, BLOCK_H=max(16, next_pow2(h)), BLOCK_N=cfg["BLOCK_N"],
            BLOCK_DV=common["BLOCK_D"] // cs, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], **common, **tile)
        return out
    cfg = config("attn_sparse_split" if fmt is None else "attn_sparse_split_records", target)
    sp = attn_split.plan(t, h, d, cfg, window=int(p.window), reach=bt.shape[1] * kv_cache.shape[1],
                         list_len=c_args[1] if has_comp else 0)
    acc, ml = attn_split.partials(sp.chunk, sp.num_splits, h, d, q.device)
    for t0 in range(0, t, sp.chunk):
        rows = min(sp.chunk, t - t0)
        launch(sparse_attn_split_kernel, sp.grid(rows),
            q, kv_cache, cc, idx, acc, ml, *ptrs, t0, h, d, kv_cache.shape[1], *c_args, sp.nsw, sp.ws, cfg["SPLIT"],
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), cc.stride(0), cc.stride(1),
            idx.stride(0), bt.stride(0), cbt.stride(0), *attn_split.partial_strides(acc, ml), float(p.scale),
            int(p.window), HAS_COMP=has_comp, BLOCK_H=sp.block_h, BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common, **tile)
        attn_split.combine(acc, ml, out, t0, rows, sink_arg, common["DTYPE"], config("attn_combine", target),
                           common["INTERP"])
    return out
