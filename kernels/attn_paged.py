"""Paged attention over the KV pool: ``attn.paged`` (decode and chunked prefill), with MQA/GQA, the
shared latent KV of DeepSeek-V4 (K = V), learned sinks in the softmax denominator, a sliding window
and an optional tanh soft cap.

One program per (query token, KV head): the query heads sharing that KV head form the M side of
``tl.dot`` (64 heads on one latent KV head in V4: one 64-row tile), the keys are walked in blocks of
``BLOCK_N`` through the block table with an online softmax in fp32. The key range of a token is
``[max(0, pos - window + 1), pos]``, clipped to the sequence's context; nothing depends on the other
sequences of the batch (batch-invariant). P is cast to the KV dtype before the P·V dot (the tensor
cores take bf16), where the oracle keeps fp32: see the test's tolerance.

Two kernels, selected by the wrapper's ``decode`` argument (the cuda_sm100 backend passes
``backend.options.attn_decode``): ``split`` (default), split-KV (:mod:`inferhal.kernels.attn_split`): a
program per (token, ``BLOCK_H`` query heads of one KV head, split of the token's own key range) and a
combine; ``single``: the program per (token, KV head) described above (kept to compare on a device).
Oracle: ``backends/reference/attention.py:attn_paged``.
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
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def attn_paged_kernel(q_ptr, kv_ptr, o_ptr, sink_ptr, bt_ptr, seq_ptr, pos_ptr, len_ptr,
                      REP, D, BS, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ckv,
                      stride_ch, stride_bt, scale, softcap, window,
                      SHARED_KV: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
                      DTYPE: tl.constexpr, PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    groups = tl.cdiv(REP, BLOCK_H)  # programs per KV head, BLOCK_H of its REP query heads each
    hk = tl.program_id(1).to(tl.int64) // groups
    b, qpos, first, last = query_span(seq_ptr, pos_ptr, len_ptr, t, window)
    hi = (tl.program_id(1) % groups) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hi < REP
    heads = hk * REP + hi
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = dot_operand(q, INTERP)
    m_i = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for n0 in range((first // BLOCK_N) * BLOCK_N, last, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (kpos >= first) & (kpos < last)
        blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=kv_ok, other=0).to(tl.int64)
        base = kv_ptr + blk[:, None] * stride_cb + (kpos % BS)[:, None] * stride_cs + hk * stride_ch + d[None, :]
        k = tl.load(base, mask=kv_ok[:, None] & dm[None, :], other=0.0)
        s = tl.dot(q, dot_operand(tl.trans(k), INTERP), input_precision=PREC) * scale  # [BLOCK_H, BLOCK_N]
        if SOFTCAP:
            e2 = tl.exp(2.0 * s / softcap)
            s = softcap * (1.0 - 2.0 / (e2 + 1.0))  # softcap * tanh(s / softcap)
        s = tl.where(kv_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SHARED_KV:
            v = k
        else:
            v = tl.load(base + stride_ckv, mask=kv_ok[:, None] & dm[None, :], other=0.0)
        pv = dot_operand(p.to(v.dtype), INTERP)
        acc = acc * alpha[:, None] + tl.dot(pv, dot_operand(v, INTERP), input_precision=PREC)
        m_i = m_new
    out = softmax_out(m_i, l_i, acc, sink_ptr, heads, hm, HAS_SINKS)
    tl.store(o_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], round_to(out, DTYPE, INTERP),
             mask=hm[:, None] & dm[None, :])


@triton.jit
def attn_paged_split_kernel(q_ptr, kv_ptr, acc_ptr, ml_ptr, bt_ptr, seq_ptr, pos_ptr, len_ptr, t0, REP, HG, D, BS,
                            NSW, SPLIT, stride_qt, stride_qh, stride_cb, stride_cs, stride_ckv, stride_ch, stride_bt,
                            stride_at, stride_as, stride_ah, stride_mt, stride_ms, scale, softcap, window,
                            SHARED_KV: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            INTERP: tl.constexpr):
    """``split``: program (head group, row, split) of token ``t0 + row``; head group ``g`` = query heads
    ``[(g % HG) * BLOCK_H, ...)`` of KV head ``g // HG``; split ``s`` of the token's key range."""
    row = tl.program_id(1).to(tl.int64)
    t = t0 + row
    hk = (tl.program_id(0) // HG).to(tl.int64)
    hi = (tl.program_id(0) % HG) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hi < REP
    heads = hk * REP + hi
    s = tl.program_id(2)
    b, qpos, first, last = query_span(seq_ptr, pos_ptr, len_ptr, t, window)
    d, dm, qt, m_i, l_i, acc = split_start(q_ptr, t, heads, hm, D, stride_qt, stride_qh, BLOCK_H, BLOCK_D, INTERP)
    lo, hi_ = range_split(s, last - first, NSW, SPLIT, BLOCK_N)
    for n0 in range(first + lo, first + hi_, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        ok = kpos < first + hi_
        blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=ok, other=0).to(tl.int64)
        base = kv_ptr + blk[:, None] * stride_cb + (kpos % BS)[:, None] * stride_cs + hk * stride_ch + d[None, :]
        k = tl.load(base, mask=ok[:, None] & dm[None, :], other=0.0)
        if SHARED_KV:
            v = k
        else:
            v = tl.load(base + stride_ckv, mask=ok[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = online_block_t(qt, k, v, ok, m_i, l_i, acc, scale, softcap, SOFTCAP, PREC, INTERP)
    store_partial(acc_ptr, ml_ptr, row, s, heads, hm, d, dm, m_i, l_i, acc, stride_at, stride_as, stride_ah,
                  stride_mt, stride_ms)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               sinks: torch.Tensor | None = None, *, target: str | None = None, decode: str = "split") -> torch.Tensor:
    """``attn.paged``: q[T, H, D] over kv_cache [NB, BS, 2, Hk, D] (or [NB, BS, Hk, D] with shared_kv).
    ``decode``: ``split`` (split-KV and a combine) or ``single`` (a program per token and KV head)."""
    if decode not in attn_split.DECODES:
        raise ValueError(f"attn.paged: decode={decode!r}; known: {', '.join(attn_split.DECODES)}")
    t, h, d = q.shape
    hk = p.num_kv_heads
    if h % hk:
        raise ValueError(f"attn.paged: {h} query heads are not a multiple of num_kv_heads={hk}")
    want = 4 if p.shared_kv else 5
    if kv_cache.dim() != want or kv_cache.shape[-2] != hk or kv_cache.shape[-1] != d:
        raise ValueError(f"attn.paged: kv_cache must be [NB, BS, {'' if p.shared_kv else '2, '}{hk}, {d}], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("attn.paged: kv_cache entries must be contiguous along D")
    out = torch.zeros((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    tok_seq = seq_of_token(batch, t, q.device, "attn.paged")
    rep = h // hk
    bt = batch.block_table.contiguous()
    stride_ckv = 0 if p.shared_kv else kv_cache.stride(2)
    stride_ch = kv_cache.stride(-2)
    if decode == "split":
        return _split(q, kv_cache, batch, p, sinks, target, out, tok_seq, bt, stride_ckv, stride_ch)
    cfg = config("attn_paged", target)
    bh = min(max(16, next_pow2(rep)), max(16, cfg["BLOCK_H"]))  # query heads of one KV head a tile (tl.dot: M >= 16)
    launch(attn_paged_kernel, (t, hk * triton.cdiv(rep, bh)),
        q, kv_cache, out, sinks.float().contiguous() if sinks is not None else q, bt, tok_seq.contiguous(),
        batch.positions.contiguous(), batch.seq_lens.contiguous(), rep, d, kv_cache.shape[1], q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1), stride_ckv, stride_ch, bt.stride(0),
        float(p.scale), float(p.softcap), int(p.window),
        SHARED_KV=p.shared_kv, HAS_SINKS=sinks is not None, SOFTCAP=p.softcap > 0, DTYPE=tl_dtype(q.dtype),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=max(16, next_pow2(d)), INTERP=interp(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _split(q, kv_cache, batch, p, sinks, target, out, tok_seq, bt, stride_ckv, stride_ch):
    t, h, d = q.shape
    hk = p.num_kv_heads
    rep = h // hk
    cfg = config("attn_paged_split", target)
    sp = attn_split.plan(t, h, d, cfg, window=int(p.window), reach=bt.shape[1] * kv_cache.shape[1], kv_heads=hk)
    acc, ml = attn_split.partials(sp.chunk, sp.num_splits, h, d, q.device)
    dtype, intp = tl_dtype(q.dtype), interp()
    sink_arg = sinks.float().contiguous() if sinks is not None else None
    for t0 in range(0, t, sp.chunk):
        rows = min(sp.chunk, t - t0)
        launch(attn_paged_split_kernel, sp.grid(rows),
            q, kv_cache, acc, ml, bt, tok_seq.contiguous(), batch.positions.contiguous(),
            batch.seq_lens.contiguous(), t0, rep, sp.groups // hk, d, kv_cache.shape[1], sp.nsw, cfg["SPLIT"],
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), stride_ckv, stride_ch, bt.stride(0),
            *attn_split.partial_strides(acc, ml), float(p.scale), float(p.softcap), int(p.window),
            SHARED_KV=p.shared_kv, SOFTCAP=p.softcap > 0, PREC="ieee" if q.dtype == torch.float32 else "tf32",
            BLOCK_H=sp.block_h, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=max(16, next_pow2(d)), INTERP=intp,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        attn_split.combine(acc, ml, out, t0, rows, sink_arg, dtype, config("attn_combine", target), intp)
    return out
