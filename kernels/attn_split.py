"""Split-KV decode for the attention ops (``attn.sparse_topk``, ``attn.paged``): the keys of each query
token cut into splits, a program per (token, head group, split) writing an unnormalised partial
(running max ``m``, denominator ``l``, accumulator ``acc``), and a combine kernel merging a token's
partials by log-sum-exp, with the learned sinks joining the denominator once, there.

Batch invariance (``deterministic=true``): a split's keys depend only on its own token (its position,
its sequence's length, its top-k row, the layer's window), never on the batch:

- a *range* of ``n`` keys (a causal span, a sliding window) is cut into at most ``MAX_SPLITS`` splits
  of ``span(n) = max(SPLIT, ceil(n / MAX_SPLITS) rounded up to BLOCK_N)`` keys from its first key;
  ``n`` is the token's own key count and ``MAX_SPLITS`` a constant of the layer (tuning data), so the
  boundaries move only with the token's own length;
- a *list* of entries (the top-k row) is cut every ``SPLIT`` positions of the row.

The grid takes as many splits as the widest token of the launch may need; the others' extra splits
are empty (``l = 0``) and the combine adds them as exact zeros, in split order, so a token's output
is bitwise the same in any batch. Tokens are launched in chunks sized from the partials' bytes
(:func:`plan`), never from their number, so prefill batches do not grow the partials without
bound; each chunk computes each token exactly as alone.

``tl.dot`` runs "swap-AB": keys on the M side (``BLOCK_N`` rows, what wgmma and tcgen05 need), the
group's ``BLOCK_H`` heads on N, so a 16-head group keeps its ``[D, 16]`` fp32 accumulator in registers
(64 a thread at 4 warps for D = 512) where the one-program-per-token kernels held ``[64, 512]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inferhal.kernels.common import dot_operand, launch, round_to
from inferhal.kernels.tuning import DECODES  # noqa: F401  (the wrappers' decode= values)

#: bytes of fp32 partials one launch may hold (acc + m/l): tokens beyond it go to a further launch
PARTIAL_BYTES = 128 << 20


@triton.jit
def split_start(q_ptr, t, heads, hm, D, stride_qt, stride_qh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                INTERP: tl.constexpr):
    """A split program's start: channels ``d`` (and mask), the group's queries transposed ``qt [BLOCK_D,
    BLOCK_H]``, and an empty running softmax ``m_i, l_i [BLOCK_H]``, ``acc [BLOCK_D, BLOCK_H]``."""
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qt = tl.load(q_ptr + t * stride_qt + heads[None, :] * stride_qh + d[:, None], mask=dm[:, None] & hm[None, :],
                 other=0.0)
    m_i = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    return d, dm, dot_operand(qt, INTERP), m_i, l_i, tl.zeros((BLOCK_D, BLOCK_H), dtype=tl.float32)


@triton.jit
def online_block_t(qt, k, v, ok, m_i, l_i, acc_t, scale, softcap, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                   INTERP: tl.constexpr):
    """One tile of keys into a running softmax, transposed: ``k, v [BLOCK_N, D]``, ``qt [D, BLOCK_H]``,
    ``acc_t [D, BLOCK_H]``, ``m_i, l_i [BLOCK_H]``. ``ok [BLOCK_N]`` masks keys out."""
    s = tl.dot(dot_operand(k, INTERP), qt, input_precision=PREC) * scale  # [BLOCK_N, BLOCK_H]
    if SOFTCAP:
        e2 = tl.exp(2.0 * s / softcap)
        s = softcap * (1.0 - 2.0 / (e2 + 1.0))  # softcap * tanh(s / softcap)
    s = tl.where(ok[:, None], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    pv = tl.dot(dot_operand(tl.trans(v), INTERP), dot_operand(p.to(v.dtype), INTERP), input_precision=PREC)
    return m_new, l_i, acc_t * alpha[None, :] + pv


@triton.jit
def range_split(s, n, MAX_SPLITS, SPLIT, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` (offsets from the range's first key) of split ``s`` of a range of ``n`` keys."""
    span = tl.maximum(SPLIT, tl.cdiv(tl.cdiv(n, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    lo = s * span
    return lo, tl.minimum(lo + span, n)


@triton.jit
def store_partial(acc_ptr, ml_ptr, row, s, heads, hm, d, dm, m_i, l_i, acc_t, stride_at, stride_as, stride_ah,
                  stride_mt, stride_ms):
    """Partial ``s`` of chunk row ``row``: ``acc [.., s, h, d]`` (fp32), ``ml [.., s, h, 0 | 1] = m, l``."""
    base = ml_ptr + row * stride_mt + s * stride_ms + 2 * heads
    tl.store(base, m_i, mask=hm)
    tl.store(base + 1, l_i, mask=hm)
    ptrs = acc_ptr + row * stride_at + s * stride_as + heads[None, :] * stride_ah + d[:, None]
    tl.store(ptrs, acc_t, mask=dm[:, None] & hm[None, :])


@triton.jit
def split_combine_kernel(acc_ptr, ml_ptr, o_ptr, sink_ptr, t0, H, D, NS, stride_at, stride_as, stride_ah, stride_mt,
                         stride_ms, stride_ot, stride_oh, HAS_SINKS: tl.constexpr, DTYPE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    """out[t0 + row, h, d] = (sum_s acc_s e^(m_s - M)) / (sum_s l_s e^(m_s - M) + e^(sink_h - M)), the splits
    in order s = 0..NS-1; an empty split (l = 0) adds exact zeros."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    ml = ml_ptr + row * stride_mt + 2 * h
    big = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    for s in range(NS):  # 1. the largest max over the non-empty splits (and the sink)
        m_s = tl.load(ml + s * stride_ms, mask=hm, other=-1.0e30)
        l_s = tl.load(ml + s * stride_ms + 1, mask=hm, other=0.0)
        big = tl.where(l_s > 0, tl.maximum(big, m_s), big)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
        big = tl.maximum(big, sink)
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    num = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for s in range(NS):  # 2. the rescaled sums, in split order
        m_s = tl.load(ml + s * stride_ms, mask=hm, other=-1.0e30)
        l_s = tl.load(ml + s * stride_ms + 1, mask=hm, other=0.0)
        live = l_s > 0
        w = tl.where(live, tl.exp(m_s - big), 0.0)
        den += l_s * w
        a = tl.load(acc_ptr + row * stride_at + s * stride_as + h[:, None] * stride_ah + d[None, :],
                    mask=(live & hm)[:, None] & dm[None, :], other=0.0)
        num += a * w[:, None]
    if HAS_SINKS:
        den += tl.exp(sink - big)
    out = num / tl.maximum(den, 1e-30)[:, None]
    tl.store(o_ptr + (t0 + row) * stride_ot + h[:, None] * stride_oh + d[None, :], round_to(out, DTYPE, INTERP),
             mask=hm[:, None] & dm[None, :])


@dataclass(frozen=True)
class SplitPlan:
    """How one split-KV launch cuts its work: ``nsw`` (the constant a token's key range is cut by, from the
    layer and the tuning only), ``ws`` range splits and ``nsk`` list splits per token (the launch's widest
    token decides how many; the others' extra splits are empty), ``block_h`` heads per program in ``groups``
    head groups, ``chunk`` tokens per launch."""

    nsw: int
    ws: int
    nsk: int
    block_h: int
    groups: int
    chunk: int

    @property
    def num_splits(self) -> int:
        return self.ws + self.nsk

    def grid(self, rows: int) -> tuple[int, int, int]:
        """(head groups, tokens, splits): the groups that read the same keys are launched side by side."""
        return self.groups, rows, self.num_splits


def plan(t: int, h: int, d: int, cfg, *, window: int, reach: int, list_len: int = 0, kv_heads: int = 1) -> SplitPlan:
    """The split plan of ``t`` tokens of ``h`` query heads (``kv_heads`` KV heads) and ``d`` channels: a key
    range of at most ``reach`` keys (the block table's) under a sliding ``window`` (0: none), and a list of
    ``list_len`` entries per token (the top-k row; 0: none)."""
    split, most = cfg["SPLIT"], cfg["MAX_SPLITS"]
    nsw = min(triton.cdiv(window, split), most) if window > 0 else most
    reach = min(window, reach) if window > 0 else reach
    ws = max(1, min(nsw, triton.cdiv(reach, split)))
    nsk = triton.cdiv(list_len, split)
    rep = h // kv_heads
    bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(rep)))  # the N side of the swap-AB dots (>= 16)
    chunk = min(t, max(1, PARTIAL_BYTES // ((ws + nsk) * h * (d + 2) * 4)))
    return SplitPlan(nsw, ws, nsk, bh, kv_heads * triton.cdiv(rep, bh), max(chunk, 1))


def partials(rows: int, num_splits: int, h: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised partials: ``acc [rows, NS, H, D]`` and ``ml [rows, NS, H, 2]`` fp32 (every program
    writes its ``m, l``; the combine reads ``acc`` only where ``l > 0``)."""
    acc = torch.empty((rows, num_splits, h, d), dtype=torch.float32, device=device)
    ml = torch.empty((rows, num_splits, h, 2), dtype=torch.float32, device=device)
    return acc, ml


def partial_strides(acc: torch.Tensor, ml: torch.Tensor) -> tuple[int, ...]:
    """``stride_at, stride_as, stride_ah, stride_mt, stride_ms`` as the split kernels take them."""
    return acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1)


def combine(acc: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, t0: int, rows: int, sinks, dtype_tl, cfg: dict,
            interp: bool) -> None:
    """Merge the partials of tokens ``t0 .. t0 + rows - 1`` into ``out [T, H, D]``."""
    h, d = out.shape[1], out.shape[2]
    bh, bd = cfg["BLOCK_H"], min(cfg["BLOCK_D"], triton.next_power_of_2(d))
    launch(split_combine_kernel, (rows, triton.cdiv(h, bh), triton.cdiv(d, bd)),
           acc, ml, out, sinks if sinks is not None else ml, t0, h, d, acc.shape[1], *partial_strides(acc, ml),
           out.stride(0), out.stride(1), HAS_SINKS=sinks is not None, DTYPE=dtype_tl, BLOCK_H=bh, BLOCK_D=bd,
           INTERP=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
