"""One K block of a dense GEMM whose weight is widened in registers (plain, FP8 blocks, dequantised FP4, GGUF's
integer blocks): the jit helpers the tiled kernel (:mod:`.linear`) and the decode kernel (:mod:`.linear_decode`)
share, in a module of their own so that neither kernel module imports the other."""

from __future__ import annotations

import triton
import triton.language as tl

from inferhal.kernels.common import dot_operand, round_to
from inferhal.kernels.moe_experts import _load_w


@triton.jit
def _load_int_block(w_ptr, s_ptr, o_ptr, rn, rk, N, K, s_wn, s_wk, s_sn, s_sk, blk_k,
                    HAS_OFFSET: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """int_block tile [BN, BK]: fl(fl(data * scale) - offset) per block of ``blk_k`` along K (GGUF's blocks),
    rounded to DTYPE. (Compiled, the multiply-subtract may fuse into one FMA: one fp32 rounding fewer.)"""
    m = (rn < N)[:, None] & (rk < K)[None, :]
    q = tl.load(w_ptr + rn[:, None] * s_wn + rk[None, :] * s_wk, mask=m, other=0).to(tl.float32)
    so = rn[:, None] * s_sn + (rk // blk_k)[None, :] * s_sk
    v = q * tl.load(s_ptr + so, mask=m, other=0.0)
    if HAS_OFFSET:
        v = v - tl.load(o_ptr + so, mask=m, other=0.0)
    return round_to(v, DTYPE, INTERP)


@triton.jit
def k_block(acc, x_ptr, w_ptr, ws_ptr, wo_ptr, rows, mm, rn, k0, N, K, stride_x, s_wn, s_wk, s_sn, s_sk, blk_n, blk_k,
            W_FMT: tl.constexpr, HAS_OFFSET: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
            BLOCK_K: tl.constexpr, INTERP: tl.constexpr, SCALE_ROW: tl.constexpr):
    """``acc + x[rows, k0:k0+BK] . w[rn, k0:k0+BK]^T`` for a weight widened in registers (plain, FP8 blocks,
    dequantised FP4, integer blocks): one K block of the tiled and the decode kernels."""
    rk = k0 + tl.arange(0, BLOCK_K)
    xt = tl.load(x_ptr + rows[:, None] * stride_x + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0)
    if W_FMT == 4:
        w = _load_int_block(w_ptr, ws_ptr, wo_ptr, rn, rk, N, K, s_wn, s_wk, s_sn, s_sk, blk_k, HAS_OFFSET, DTYPE,
                            INTERP)
    else:
        w = _load_w(w_ptr, ws_ptr, 0, rn, k0, rk, N, K, 0, s_wn, s_wk, 0, s_sn, s_sk, blk_n, blk_k, W_FMT, DTYPE,
                    INTERP, SCALE_ROW)
    return tl.dot(dot_operand(xt, INTERP), dot_operand(tl.trans(w), INTERP), acc, input_precision=PREC)
