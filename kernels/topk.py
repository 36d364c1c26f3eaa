"""``topk.select``: the k largest scores of each row, ties broken by the lower index, in descending order;
positions >= valid_len[t] and -inf scores come out as -1 (oracle: ``backends/reference/ops.py:topk_select``).

One program per row; nothing depends on the other rows (batch-invariant). A row that fits in one
``BLOCK_SORT`` tile is sorted whole (``tl.sort`` of the composite keys below). A longer row (S up to
1M / 4 compressed entries in V4) takes three phases:

1. the k-th largest score is found *exactly* by a 32-step bisection on the order-preserving int32 key
   of the fp32 scores (``ordered_key``): each step counts ``key >= mid`` over the row in ``BLOCK_S``
   chunks. Then ``c_gt`` = #(key > kth) and the first ``k - c_gt`` entries equal to kth (in index
   order) complete the selection: exactly min(k, S) entries;
2. the selected entries are compacted (running prefix sums) into the row's scratch as 64-bit
   composite keys ``(score key << 32) | (2**32 - 1 - index)``, unique per entry;
3. one ``tl.sort`` of the ``BLOCK_K`` scratch keys (descending) gives score-descending,
   index-ascending order; -inf scores decode to -1, as does the padding when S < k.

Cost per row: ~34 passes over min(S, valid_len) (positions past valid_len are -inf keys: counted, never read,
so a row as wide as a captured graph's table costs its visible length) plus one bitonic sort of next_pow2(k)
keys (k = 512 in V4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config

#: the ordered key of fp32 -inf (bits 0xFF800000 with the low 31 bits flipped)
NEG_INF_KEY = -2139095041


@triton.jit
def ordered_key(x):
    """fp32 -> int32 with the same order (negative floats get their magnitude bits flipped); -0.0 and
    0.0 get the same key, as they compare equal."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def topk_select_kernel(s_ptr, vl_ptr, out_ptr, scratch_ptr, S, K, stride_s, stride_o,
                       HAS_VL: tl.constexpr, SINGLE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = S
    if HAS_VL:
        n = tl.minimum(tl.load(vl_ptr + row).to(tl.int32), S)
    n = tl.maximum(n, 0)
    kk = tl.minimum(K, S)  # entries selected (valid or not: positions >= n count as -inf, as in the oracle)
    srow = s_ptr + row * stride_s
    cols = tl.arange(0, BLOCK_S)
    if SINGLE:  # the whole row in one tile: sort it (BLOCK_S >= BLOCK_K)
        x = tl.load(srow + cols, mask=cols < n, other=-float("inf"))
        key = tl.where(cols < n, ordered_key(x), -2139095041).to(tl.int64)
        comp = (key << 32) | (4294967295 - cols.to(tl.int64))
        comp = tl.sort(tl.where(cols < S, comp, -9223372036854775807 - 1), descending=True)
        idx = 4294967295 - (comp & 4294967295)
        idx = tl.where((cols < kk) & ((comp >> 32) != -2139095041), idx, -1)
        tl.store(out_ptr + row * stride_o + cols, idx, mask=(cols < K) & (cols < kk))
        return
    # 1. the kk-th largest key: the largest K* with #(key >= K*) >= kk (bisection on int64 bounds)
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        cnt = tl.where(mid <= -2139095041, S - n, 0)  # the positions >= n: -inf keys, never read
        for s0 in range(0, n, BLOCK_S):
            c = s0 + cols
            x = tl.load(srow + c, mask=c < n, other=-float("inf"))
            key = tl.where(c < n, ordered_key(x), -2139095041).to(tl.int64)
            cnt += tl.sum(((key >= mid) & (c < S)).to(tl.int32), axis=0)
        ok = cnt >= kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    kth = lo
    c_gt = tl.zeros((), tl.int32)
    for s0 in range(0, n, BLOCK_S):
        c = s0 + cols
        x = tl.load(srow + c, mask=c < n, other=-float("inf"))
        key = tl.where(c < n, ordered_key(x), -2139095041).to(tl.int64)
        c_gt += tl.sum(((key > kth) & (c < S)).to(tl.int32), axis=0)
    ties_wanted = kk - c_gt
    # 2. compaction into the scratch row as unique composite keys
    sc_row = scratch_ptr + row * BLOCK_K
    written = tl.zeros((), tl.int32)
    ties_seen = tl.zeros((), tl.int32)
    for s0 in range(0, n, BLOCK_S):  # positions >= n would only add -inf keys, which decode to -1
        c = s0 + cols
        inb = c < S
        x = tl.load(srow + c, mask=c < n, other=-float("inf"))
        key = tl.where(c < n, ordered_key(x), -2139095041).to(tl.int64)
        tie = (key == kth) & inb
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
        pick = ((key > kth) & inb) | (tie & (tie_rank < ties_wanted))
        slot = written + tl.cumsum(pick.to(tl.int32), axis=0) - pick.to(tl.int32)
        comp = (key << 32) | (4294967295 - c.to(tl.int64))
        tl.store(sc_row + slot, comp, mask=pick)
        written += tl.sum(pick.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 3. sort the selection; padding slots (>= kk) get the smallest key and land at the end
    j = tl.arange(0, BLOCK_K)
    comp = tl.load(sc_row + j, mask=j < written, other=-9223372036854775807 - 1)
    comp = tl.sort(comp, descending=True)
    idx = 4294967295 - (comp & 4294967295)
    skey = comp >> 32
    idx = tl.where((j < written) & (skey != -2139095041), idx, -1)
    tl.store(out_ptr + row * stride_o + j, idx, mask=j < K)


def topk_select(scores: torch.Tensor, k: int, valid_len: torch.Tensor | None = None, *,
                target: str | None = None) -> torch.Tensor:
    """``topk.select``: scores[T, S] -> idx[T, k] int64 (descending score, ties by lower index, -1 padded)."""
    if scores.dim() != 2:
        raise ValueError(f"topk.select: scores must be [T, S], got shape {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"topk.select: k must be >= 1, got {k}")
    t, s = scores.shape
    if valid_len is not None and valid_len.shape != (t,):
        raise ValueError(f"topk.select: valid_len must be [T]={t}, got shape {tuple(valid_len.shape)}")
    out = torch.full((t, k), -1, dtype=torch.long, device=scores.device)
    if t == 0 or s == 0:
        return out
    sc = scores.float()
    if sc.stride(-1) != 1:
        sc = sc.contiguous()
    cfg = config("topk_select", target)
    bk = max(16, next_pow2(min(k, s)))
    single = max(16, next_pow2(s)) <= cfg["BLOCK_SORT"]  # both paths select exactly the same entries
    bs = max(16, next_pow2(s)) if single else cfg["BLOCK_S"]
    scratch = torch.empty((t, 1 if single else bk), dtype=torch.long, device=scores.device)
    topk_select_kernel[(t,)](
        sc, valid_len.contiguous() if valid_len is not None else sc, out, scratch, s, k, sc.stride(0), out.stride(0),
        HAS_VL=valid_len is not None, SINGLE=single, BLOCK_S=bs, BLOCK_K=bk,
        num_warps=cfg["num_warps"])
    return out
