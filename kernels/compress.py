"""DeepSeek-V4's CSA/HCA compressor: ``attn.compress``.

For each flat row (a token at position (e+1)m-1 that closes window e) one program pools the window's
per-token state ``[kv | gate]`` from the paged state cache: per channel, softmax over the window's
tokens of ``gate + position_bias``, weighted sum of ``kv``. CSA (``overlap``) pools 2m tokens: window
e-1's first half of the channels ``C[:D]`` and window e's second half ``C[D:]`` (D = C/2; e = 0 has
no previous window); HCA pools its m tokens over all C = D channels. Then RMSNorm (norm_weight) and
RoPE at position e*m.

Three phases in one program, each ending in a barrier: (1) channel tiles of ``BLOCK_C`` pooled over
all tokens of the window(s) in fp32, rounded to the cache dtype and stored into the output row, with
the sum of squares of the rounded values; (2) the row normalised and rounded; (3) the rotary pairs
rotated and rounded. The roundings sit where the oracle's do (pooled -> dtype, norm.rms -> dtype,
rope.apply -> dtype). Rows are independent (batch-invariant).
Oracle: ``backends/reference/deepseek.py:attn_compress``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import AttnBatch, CompressParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def _window(st_ptr, bt_row, first, j, jm, BS, stride_sb, stride_ss):
    """Per-token base pointers of the window starting at token ``first`` (j: [BLOCK_M] token offsets)."""
    tok = tl.maximum(first + j, 0)
    blk = tl.load(bt_row + tok // BS, mask=jm, other=0).to(tl.int64)
    return st_ptr + blk * stride_sb + (tok % BS) * stride_ss


@triton.jit
def compress_kernel(st_ptr, bias_ptr, nw_ptr, cs_ptr, o_ptr, bt_ptr, row_ptr, seq_ptr, pos_ptr,
                    D, M, BS, ROT_START, stride_sb, stride_ss, stride_s2, stride_bias, stride_bt, stride_cs,
                    stride_o, eps,
                    OVERLAP: tl.constexpr, R_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, DTYPE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                    INTERP: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(row_ptr + i).to(tl.int64)
    if row < 0:  # a padding row (a captured step's rows past its count): zeros, nothing read
        dz = tl.arange(0, BLOCK_D)
        tl.store(o_ptr + i * stride_o + dz, tl.zeros((BLOCK_D,), tl.float32).to(DTYPE), mask=dz < D)
        return
    b = tl.load(seq_ptr + i).to(tl.int64)
    e = (tl.load(pos_ptr + row).to(tl.int32) + 1) // M - 1
    bt_row = bt_ptr + b * stride_bt
    j = tl.arange(0, BLOCK_M)
    jm = j < M
    cur = _window(st_ptr, bt_row, e * M, j, jm, BS, stride_sb, stride_ss)
    s2 = stride_s2
    off = 0
    if OVERLAP:
        off = D
    pm = jm & ((j * 0 + e) > 0)  # (a scalar bool & a block mask is not a bool mask in the interpreter)
    prev = _window(st_ptr, bt_row, (e - 1) * M, j, pm, BS, stride_sb, stride_ss)
    orow = o_ptr + i * stride_o
    ss = tl.zeros((), tl.float32)
    for c0 in range(0, D, BLOCK_C):  # 1. softmax-gated pooling per channel
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < D
        mk = jm[:, None] & cm[None, :]
        kv = tl.load(cur[:, None] + off + c[None, :], mask=mk, other=0.0).to(tl.float32)
        g = tl.load(cur[:, None] + s2 + off + c[None, :], mask=mk, other=0.0).to(tl.float32)
        g = g + tl.load(bias_ptr + j[:, None] * stride_bias + off + c[None, :], mask=mk, other=0.0).to(tl.float32)
        g = tl.where(mk, g, -float("inf"))
        mx = tl.max(g, axis=0)
        if OVERLAP:
            mp = pm[:, None] & cm[None, :]
            kvp = tl.load(prev[:, None] + c[None, :], mask=mp, other=0.0).to(tl.float32)
            gp = tl.load(prev[:, None] + s2 + c[None, :], mask=mp, other=0.0).to(tl.float32)
            gp = gp + tl.load(bias_ptr + j[:, None] * stride_bias + c[None, :], mask=mp, other=0.0).to(tl.float32)
            gp = tl.where(mp, gp, -float("inf"))
            mx = tl.maximum(mx, tl.max(gp, axis=0))
        mx = tl.where(cm, mx, 0.0)
        w = tl.exp(g - mx[None, :])
        den = tl.sum(w, axis=0)
        num = tl.sum(w * kv, axis=0)
        if OVERLAP:
            wp = tl.exp(gp - mx[None, :])
            den += tl.sum(wp, axis=0)
            num += tl.sum(wp * kvp, axis=0)
        pooled = round_to(num / tl.where(cm, den, 1.0), DTYPE, INTERP)
        tl.store(orow + c, pooled, mask=cm)
        pf = tl.where(cm, pooled.to(tl.float32), 0.0)
        ss += tl.sum(pf * pf, axis=0)
    tl.debug_barrier()
    d = tl.arange(0, BLOCK_D)  # 2. RMSNorm of the rounded row
    dm = d < D
    x = tl.load(orow + d, mask=dm, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(orow + d, round_to(x * tl.rsqrt(ss / D + eps) * nw, DTYPE, INTERP), mask=dm)
    tl.debug_barrier()
    r = tl.arange(0, BLOCK_R)  # 3. RoPE at the window's first position
    rm = r < R_HALF
    cos = tl.load(cs_ptr + (e * M).to(tl.int64) * stride_cs + r, mask=rm, other=1.0)
    sin = tl.load(cs_ptr + (e * M).to(tl.int64) * stride_cs + R_HALF + r, mask=rm, other=0.0)
    if INTERLEAVED:
        ia = ROT_START + 2 * r
        ib = ia + 1
    else:
        ia = ROT_START + r
        ib = ia + R_HALF
    a = tl.load(orow + ia, mask=rm, other=0.0).to(tl.float32)
    bb = tl.load(orow + ib, mask=rm, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(orow + ia, round_to(a * cos - bb * sin, DTYPE, INTERP), mask=rm)
    tl.store(orow + ib, round_to(bb * cos + a * sin, DTYPE, INTERP), mask=rm)


def attn_compress(state_cache: torch.Tensor, batch: AttnBatch, rows: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, cos_sin: torch.Tensor, p: CompressParams, *,
                  target: str | None = None) -> torch.Tensor:
    """``attn.compress``: state_cache[NB, BS, 2, C] (kv | gate per token), rows[N] -> entries[N, D]. A row of -1
    is padding (a step captured as a graph holds a host-known bound of rows, the rows past the step's count
    -1): its entry is zeros, its position unchecked."""
    if state_cache.dim() != 4 or state_cache.shape[2] != 2 or state_cache.stride(-1) != 1:
        raise ValueError(f"attn.compress: state_cache must be [NB, BS, 2, C] contiguous along C, "
                         f"got {tuple(state_cache.shape)}")
    m, c = p.ratio, state_cache.shape[-1]
    if p.overlap and c % 2:
        raise ValueError(f"attn.compress: CSA (overlap) needs an even state width C, got {c}")
    d = c // 2 if p.overlap else c
    if position_bias.shape != (m, c):
        raise ValueError(f"attn.compress: position_bias must be [ratio, C]=({m}, {c}), got {tuple(position_bias.shape)}")
    if norm_weight.numel() != d:
        raise ValueError(f"attn.compress: norm_weight has {norm_weight.numel()} elements, the entries have D={d}")
    r = p.rope.rotary_dim
    if r > d or cos_sin.shape[-1] != r:
        raise ValueError(f"attn.compress: rotary_dim {r} must be <= D={d} and match cos_sin's last dim "
                         f"{cos_sin.shape[-1]}")
    n = rows.numel()
    out = torch.empty((n, d), dtype=state_cache.dtype, device=state_cache.device)
    if n == 0:
        return out
    rows = rows.long().contiguous()
    pos = batch.positions.long()[rows.clamp(min=0)]
    try:  # checked on the device (asynchronously there): no host read of the positions
        torch._assert_async((((pos + 1) % m == 0) | (rows < 0)).all(), f"attn.compress: a row does not close a "
                            f"window of {m}")
    except RuntimeError as exc:  # the CPU checks at once
        raise ValueError(f"attn.compress: a row's position + 1 is not a multiple of {m}: it does not close a "
                         f"window of {m}") from exc
    seq = torch.searchsorted(batch.query_start_loc[1:].long().to(rows.device), rows.clamp(min=0), right=True)
    cfg = config("attn_compress", target)
    bias = position_bias.float().contiguous()
    cs = cos_sin.float().contiguous()
    bt = batch.block_table.contiguous()
    compress_kernel[(n,)](
        state_cache, bias, norm_weight.contiguous(), cs, out, bt, rows, seq.contiguous(), batch.positions.contiguous(),
        d, m, state_cache.shape[1], 0 if p.rope.placement == "head" else d - r, state_cache.stride(0),
        state_cache.stride(1), state_cache.stride(2), bias.stride(0), bt.stride(0), cs.stride(0), out.stride(0),
        float(p.eps), OVERLAP=p.overlap, R_HALF=r // 2, INTERLEAVED=p.rope.style == "interleaved",
        DTYPE=tl_dtype(state_cache.dtype), BLOCK_M=max(2, next_pow2(m)), BLOCK_C=min(cfg["BLOCK_C"], next_pow2(d)),
        BLOCK_D=next_pow2(d), BLOCK_R=max(2, next_pow2(r // 2)), INTERP=interp(), num_warps=cfg["num_warps"])
    return out
