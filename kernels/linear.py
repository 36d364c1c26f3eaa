"""Dense GEMMs: ``linear``, ``lm_head`` and ``lm_head.argmax`` (fused: no logits written), for plain
bf16/fp16/fp32 weights, FP8 with block scales (``fp8_block``, DeepSeek's 128x128), FP4 e2m1 (``fp4_group``:
through ``tl.dot_scaled`` when the scales are ue8m0 and the groups 32 wide, else dequantised in registers)
and GGUF's integer blocks (``int_block``).

One kernel, ``linear_kernel``: a program per (N-tile, M-tile), a K loop with no split (batch-invariant), the
weight tile loaded and dequantised in registers by the loaders :mod:`.moe_experts` uses for expert weights
(one expert here), one epilogue by ``MODE``:

- ``MODE = 0`` (linear): ``y = round(acc + bias)`` in the activation dtype;
- ``MODE = 1`` (lm_head): the same rounded value widened to fp32 into the caller's ``[B, V]`` buffer;
- ``MODE = 2`` (lm_head.argmax): each row's max of the rounded values in the tile and its first column
  (NaN the largest), one (value, index) per (row, N-tile); ``argmax_reduce_kernel`` then picks each row's
  first best tile. The logits never reach memory: ``[B, V/BLOCK_N]`` partials do.

Rounding mirrors the oracle (``backends/reference/ops.py:linear``): dequantised weights are rounded to the
activation dtype, products accumulate in fp32, the output is rounded once to the activation dtype (the
argmax sees the same rounded logits, so ties after rounding resolve as the reference's). fp32 activations
use IEEE fp32 dots (never tf32).

``linear_w8a8`` is the FP8 x FP8 path (``tcgen05.mma kind::f8f6f4`` on SM100): activations quantised per
token and 128-column block to e4m3 (amax / 448, DeepSeek's ``act_quant``) by ``act_quant_kernel``, then one
e4m3 dot per 128-wide K block, scaled by both block scales into the fp32 accumulator (DeepSeek's
``fp8_gemm``). Its numerics differ from the reference by the activation quantisation, so it is not the
op's default; its oracle is the reference product of the dequantised activations
(``tests/kernels/test_linear.py``).

Interpreter: bf16 ``tl.dot`` operands are upcast to fp32 (``common.dot_operand``, FACTS: the interpreter's
bf16 dot multiplies bit patterns), roundings go through ``common.round_to``; compiled kernels keep bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.common import dot_operand, interp, launch, round_to, tl_dtype
from inferhal.kernels.moe_experts import FP4_DEQUANT, FP4_SCALED, FP8_BLOCK, PLAIN, _e2m1, _load_fp4_scaled, _load_w
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config

INT_BLOCK = 4
LINEAR, LOGITS, ARGMAX = 0, 1, 2


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
def linear_kernel(x_ptr, w_ptr, ws_ptr, wo_ptr, b_ptr, y_ptr, pv_ptr, pi_ptr, M, N, K, stride_x,
                  s_wn, s_wk, s_sn, s_sk, blk_n, blk_k, stride_y,
                  W_FMT: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                  DTYPE: tl.constexpr, PREC: tl.constexpr, LHS_FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr, SCALE_ROW: tl.constexpr):
    pid_n = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    rows = rm.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[:, None] * stride_x + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0)
        if W_FMT == 3:
            q, s = _load_fp4_scaled(w_ptr, ws_ptr, 0, rn, k0, N, K, 0, s_wn, s_wk, 0, s_sn, s_sk, BLOCK_K)
            acc = tl.dot_scaled(xt, None, LHS_FMT, q, s, "e2m1", acc=acc)
        else:
            if W_FMT == 4:
                w = _load_int_block(w_ptr, ws_ptr, wo_ptr, rn, rk, N, K, s_wn, s_wk, s_sn, s_sk, blk_k, HAS_OFFSET,
                                    DTYPE, INTERP)
            else:
                w = _load_w(w_ptr, ws_ptr, 0, rn, k0, rk, N, K, 0, s_wn, s_wk, 0, s_sn, s_sk, blk_n, blk_k,
                            W_FMT, DTYPE, INTERP, SCALE_ROW)
            acc = tl.dot(dot_operand(xt, INTERP), dot_operand(tl.trans(w), INTERP), acc, input_precision=PREC)
    nm = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = round_to(acc, DTYPE, INTERP)
    if MODE == 0:
        tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], y, mask=mm[:, None] & nm[None, :])
    elif MODE == 1:
        tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], y.to(tl.float32), mask=mm[:, None] & nm[None, :])
    else:
        v = tl.where(nm[None, :], y.to(tl.float32), -float("inf"))
        best, col = _tile_argmax(v, rn[None, :] + tl.zeros((BLOCK_M, BLOCK_N), tl.int32), N)
        nt = tl.num_programs(0)
        tl.store(pv_ptr + rows * nt + pid_n, best, mask=mm)
        tl.store(pi_ptr + rows * nt + pid_n, col, mask=mm)


@triton.jit
def _tile_argmax(v, col, BIG):
    """Per row of ``v [R, C]``: (max, its first ``col``), NaN the largest (then its first NaN's column)."""
    nan = v != v
    anynan = tl.max(nan.to(tl.int32), axis=1) > 0
    mx = tl.max(tl.where(nan, -float("inf"), v), axis=1)
    first = tl.min(tl.where(v == mx[:, None], col, BIG), axis=1)
    first_nan = tl.min(tl.where(nan, col, BIG), axis=1)
    return tl.where(anynan, float("nan"), mx), tl.where(anynan, first_nan, first)


@triton.jit
def argmax_reduce_kernel(pv_ptr, pi_ptr, out_ptr, NT, BIG, BLOCK_T: tl.constexpr):
    """One row's (value, column) partials over its NT tiles -> the first column of the row's max."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    ok = t < NT
    v = tl.load(pv_ptr + r * NT + t, mask=ok, other=-float("inf"))
    c = tl.load(pi_ptr + r * NT + t, mask=ok, other=BIG)
    # a tile's column grows with the tile: the first best column is the min column among the best tiles
    _, col = _tile_argmax(v[None, :], c[None, :], BIG)
    tl.store(out_ptr + r + tl.arange(0, 1), col.to(tl.int64))


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, BLOCK: tl.constexpr,
                     INTERP: tl.constexpr):
    """Row ``program_id(0)``, K block ``program_id(1)`` of ``BLOCK`` columns: e4m3 codes of x / s, s = amax / 448."""
    r = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    c = kb * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
    tl.store(q_ptr + r * stride_q + c, round_to(q, tl.float8e4nv, INTERP), mask=c < K)
    tl.store(s_ptr + r * stride_s + kb + tl.arange(0, 1), s + tl.zeros((1,), tl.float32))


@triton.jit
def linear_w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xq, stride_xs, s_wn, s_wk, s_sn, s_sk,
                       blk_n, stride_y, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """FP8 x FP8 with block scales: acc += (xq . wq^T) * xs[:, kb] * ws[n // blk_n, kb] per BLOCK_K (= the
    128-wide scale block) along K; one rounding of the output to DTYPE."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    rows = rm.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        xq = tl.load(xq_ptr + rows[:, None] * stride_xq + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        wq = tl.load(w_ptr + rn[None, :] * s_wn + rk[:, None] * s_wk, mask=nm[None, :] & km[:, None], other=0.0)
        kb = k0 // BLOCK_K
        xs = tl.load(xs_ptr + rows * stride_xs + kb, mask=mm, other=0.0)
        ws = tl.load(ws_ptr + (rn // blk_n) * s_sn + kb * s_sk, mask=nm, other=0.0)
        part = tl.dot(xq, wq)
        acc += part * xs[:, None] * ws[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], round_to(acc, DTYPE, INTERP), mask=mm[:, None] & nm[None, :])


@triton.jit
def act_quant_fp4_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                         BLOCK_G: tl.constexpr, INTERP: tl.constexpr):
    """Row ``program_id(0)``, ``BLOCK_G`` groups of ``GROUP`` columns to FP4: e2m1 codes of x / scale rounded to
    nearest (ties to the even code), saturated at +-6, packed two per byte (low nibble = even column).
    GROUP 32 = MXFP4 (OCP MX v1.0): a ue8m0 scale 2^(floor(log2 amax) - 2); GROUP 16 = NVFP4: an e4m3 scale
    amax / 6 (rounded to e4m3)."""
    r = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    c = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    x = tl.load(x_ptr + r * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if GROUP == 32:
        biased = ((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)  # floor(log2 amax) + 127
        sbyte = tl.maximum(biased - 2, 0)
        inv = ((254 - sbyte).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-(sbyte - 127), exact
        inv = tl.where(sbyte > 0, inv, 0.0)
        sc = sbyte.to(tl.uint8)
    else:
        sc = round_to(tl.minimum(amax / 6.0, 448.0), tl.float8e4nv, INTERP)
        sv = sc.to(tl.float32)
        inv = tl.where(sv > 0, 1.0 / tl.where(sv > 0, sv, 1.0), 0.0)
    a = tl.abs(x) * inv[:, None]
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    code = code + tl.where(x < 0, 8, 0)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_G, GROUP // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)  # [BLOCK_G, GROUP / 2]
    cb = gi[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    tl.store(q_ptr + r * stride_q + cb, packed, mask=cb < K // 2)
    tl.store(s_ptr + r * stride_s + gi, sc, mask=gi < K // GROUP)


@triton.jit
def _fp4_values(q, s, R: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """Packed e2m1 codes q [R, BK/2] and their scales s [R, BK/GROUP] -> fp32 values [R, BK] (the
    interpreter's way: its dot_scaled misreads e4m3 scales)."""
    lo = _e2m1((q & 0xF).to(tl.int32))
    hi = _e2m1((q >> 4).to(tl.int32))
    v = tl.reshape(tl.join(lo, hi), (R, BK))
    sc = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (R, BK // GROUP, GROUP)), (R, BK))
    return v * sc


@triton.jit
def linear_fp4_w4a4_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xq, stride_xs, s_wn, s_wk, s_sn,
                           s_sk, stride_y, GROUP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """FP4 x FP4 with ``tl.dot_scaled``: e2m1 activations and weights, scales per GROUP along K: ue8m0 per 32
    (MXFP4, ``tcgen05.mma kind::mxf4``) or e4m3 per 16 (NVFP4, ``kind::mxf4nvf4``); one output rounding.
    Under the interpreter NVFP4 tiles are decoded to fp32 and multiplied by ``tl.dot`` (exact products)."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    rows = rm.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        khm, ksm = kh < K // 2, ks < K // GROUP
        xq = tl.load(xq_ptr + rows[:, None] * stride_xq + kh[None, :], mask=mm[:, None] & khm[None, :], other=0)
        xs = tl.load(xs_ptr + rows[:, None] * stride_xs + ks[None, :], mask=mm[:, None] & ksm[None, :])
        wq = tl.load(w_ptr + rn[None, :] * s_wn + kh[:, None] * s_wk, mask=nm[None, :] & khm[:, None], other=0)
        ws = tl.load(ws_ptr + rn[:, None] * s_sn + ks[None, :] * s_sk, mask=nm[:, None] & ksm[None, :])
        if INTERP and GROUP == 16:
            xv = _fp4_values(xq, xs, BLOCK_M, BLOCK_K, GROUP)
            wv = _fp4_values(tl.trans(wq), ws, BLOCK_N, BLOCK_K, GROUP)
            acc = tl.dot(xv, tl.trans(wv), acc, input_precision="ieee")
        else:
            acc = tl.dot_scaled(xq, xs, "e2m1", wq, ws, "e2m1", acc=acc)
    tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], round_to(acc, DTYPE, INTERP), mask=mm[:, None] & nm[None, :])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------


def _weight(w, k: int, act: torch.dtype, op: str):
    """-> (fmt, data, scale, offset or None, block) of a [N, K] weight for ``linear_kernel``."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"{op}: weight must be [N, K={k}], got {tuple(w.shape)}")
        return PLAIN, w, w.new_zeros((1, 1), dtype=torch.float32), None, (1, 1)
    if not isinstance(w, QuantWeight):
        raise TypeError(f"{op}: weight must be a tensor or a QuantWeight, got {type(w).__name__}")
    if len(w.shape) != 2 or w.shape[1] != k:
        raise ValueError(f"{op}: weight must be [N, K={k}], got {w.format} {tuple(w.shape)}")
    if w.format == "fp8_block":
        return FP8_BLOCK, w.data, w.scale.float(), None, w.block
    if w.format == "int_block":
        return INT_BLOCK, w.data, w.scale.float(), None if w.offset is None else w.offset.float(), w.block
    e8m0 = w.scale.dtype == getattr(torch, "float8_e8m0fnu", None)
    if e8m0 and w.block[1] == 32 and act in (torch.bfloat16, torch.float16) and k % 32 == 0:
        return FP4_SCALED, w.data, w.scale.view(torch.uint8), None, w.block
    return FP4_DEQUANT, w.data, w.scale.float(), None, w.block


def _gemm(x2: torch.Tensor, w, bias, mode: int, out: torch.Tensor | None, target: str | None, op: str):
    """Launch ``linear_kernel`` on x2 [M, K] (contiguous rows); returns what ``mode`` produces."""
    m, k = x2.shape
    fmt, data, scale, offset, block = _weight(w, k, x2.dtype, op)
    n = w.shape[0]
    cfg = config("gemm_fp4" if fmt == FP4_SCALED else "gemm_int" if fmt == INT_BLOCK else "gemm", target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    dev = x2.device
    nt = triton.cdiv(n, bn)
    pv = pi = None
    if mode == LINEAR:
        out = torch.empty((m, n), dtype=x2.dtype, device=dev)
    elif mode == ARGMAX:
        out = torch.empty((m,), dtype=torch.int64, device=dev)
        pv = torch.empty((m, nt), dtype=torch.float32, device=dev)
        pi = torch.empty((m, nt), dtype=torch.int32, device=dev)
    if m == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError(f"{op}: K = 0")
    launch(linear_kernel, (nt, triton.cdiv(m, bm)),
           x2, data, scale, offset if offset is not None else scale, bias if bias is not None else scale,
           out if mode != ARGMAX else pv, pv if pv is not None else scale, pi if pi is not None else scale,
           m, n, k, x2.stride(0), *data.stride(), *scale.stride(), block[0], block[1],
           out.stride(0) if mode != ARGMAX else 0,
           W_FMT=fmt, MODE=mode, HAS_BIAS=bias is not None, HAS_OFFSET=offset is not None,
           DTYPE=tl_dtype(x2.dtype), PREC="ieee" if x2.dtype == torch.float32 else "tf32",
           LHS_FMT="fp16" if x2.dtype == torch.float16 else "bf16", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           INTERP=interp(), SCALE_ROW=fmt == FP8_BLOCK and block[1] % bk == 0,
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if mode == ARGMAX:
        argmax_reduce_kernel[(m,)](pv, pi, out, nt, n, BLOCK_T=next_pow2(nt), num_warps=4)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, target: str | None = None) -> torch.Tensor:
    """``linear``: x[..., K] @ w[N, K]^T (+ bias) -> [..., N] in x's dtype."""
    x2 = _rows(x)
    b = None if bias is None else bias.contiguous()
    if b is not None and b.numel() != w.shape[0]:
        raise ValueError(f"linear: bias has {b.numel()} elements, weight has N={w.shape[0]}")
    y = _gemm(x2, w, b, LINEAR, None, target, "linear")
    return y.reshape(*x.shape[:-1], w.shape[0])


def lm_head(x: torch.Tensor, w, out: torch.Tensor | None = None, *, target: str | None = None) -> torch.Tensor:
    """``lm_head``: fp32 logits [B, V] of linear(x, w) (rounded to x's dtype), written into ``out`` when given."""
    v = w.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], v, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (x.shape[0], v) or out.dtype != torch.float32 or (v and out.stride(1) != 1):
        raise ValueError(f"lm_head: logits buffer is {out.dtype} {tuple(out.shape)}, needs float32 {(x.shape[0], v)} "
                         "with contiguous rows")
    _gemm(_rows(x), w, None, LOGITS, out, target, "lm_head")
    return out


def lm_head_argmax(x: torch.Tensor, w, *, target: str | None = None) -> torch.Tensor:
    """``lm_head.argmax``: each row's first argmax (NaN the largest) of lm_head(x, w), without the logits."""
    return _gemm(_rows(x), w, None, ARGMAX, None, target, "lm_head.argmax")


def act_quant(x: torch.Tensor, block: int = 128, *, target: str | None = None):
    """x[M, K] -> (e4m3 codes [M, K], fp32 scales [M, ceil(K/block)]): per token and ``block`` columns, s = amax/448."""
    x2 = _rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, triton.cdiv(k, block)), dtype=torch.float32, device=x.device)
    if m and k:
        act_quant_kernel[(m, s.shape[1])](x2, q, s, k, x2.stride(0), q.stride(0), s.stride(0), BLOCK=block,
                                          INTERP=interp(), num_warps=4)
    return q, s


def linear_w8a8(x: torch.Tensor, w: QuantWeight, *, target: str | None = None) -> torch.Tensor:
    """FP8 x FP8 ``linear`` (see the module docstring): x[..., K] (bf16/fp16/fp32) quantised per token and
    128-column block, w an fp8_block weight with 128-wide K blocks -> [..., N] in x's dtype."""
    if not isinstance(w, QuantWeight) or w.format != "fp8_block" or len(w.shape) != 2:
        raise ValueError("linear_w8a8: takes a 2-D fp8_block weight")
    cfg = config("gemm_fp8", target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if w.block[1] != bk:
        raise ValueError(f"linear_w8a8: weight K blocks are {w.block[1]} wide, the kernel's K tile is {bk}")
    x2 = _rows(x)
    m, k = x2.shape
    n = w.shape[0]
    xq, xs = act_quant(x2, bk, target=target)
    y = torch.empty((m, n), dtype=x2.dtype, device=x.device)
    if m and n:
        ws = w.scale.float()
        launch(linear_w8a8_kernel, (triton.cdiv(n, bn), triton.cdiv(m, bm)),
               xq, xs, w.data, ws, y, m, n, k, xq.stride(0), xs.stride(0), *w.data.stride(), *ws.stride(),
               w.block[0], y.stride(0), DTYPE=tl_dtype(x2.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
               INTERP=interp(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], n)


def _fp4_group(w) -> int:
    """32 for an MXFP4 weight (fp4_group, ue8m0 scales per 32), 16 for NVFP4 (e4m3 scales per 16), else 0."""
    if not isinstance(w, QuantWeight) or w.format != "fp4_group" or len(w.shape) != 2:
        return 0
    if w.block[1] == 32 and w.scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return 32
    return 16 if w.block[1] == 16 and w.scale.dtype == torch.float8_e4m3fn else 0


def act_quant_fp4(x: torch.Tensor, group: int = 32, *, target: str | None = None):
    """x[M, K] (K % group == 0) -> (packed e2m1 codes uint8 [M, K/2], scales [M, K/group]): MXFP4 (group 32,
    ue8m0 scales as uint8) or NVFP4 (group 16, float8_e4m3fn scales)."""
    if group not in (16, 32):
        raise ValueError(f"act_quant_fp4: group must be 32 (MXFP4) or 16 (NVFP4), got {group}")
    x2 = _rows(x)
    m, k = x2.shape
    if k % group:
        raise ValueError(f"act_quant_fp4: K must be a multiple of {group}, got {k}")
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, k // group), dtype=torch.uint8 if group == 32 else torch.float8_e4m3fn, device=x.device)
    if m and k:
        bg = min(8, next_pow2(k // group))
        act_quant_fp4_kernel[(m, triton.cdiv(k // group, bg))](x2, q, s, k, x2.stride(0), q.stride(0), s.stride(0),
                                                               GROUP=group, BLOCK_G=bg, INTERP=interp(), num_warps=4)
    return q, s


def linear_w4a4(x: torch.Tensor, w: QuantWeight, *, target: str | None = None) -> torch.Tensor:
    """FP4 x FP4 ``linear``: x[..., K] quantised per token to the weight's FP4 layout (:func:`act_quant_fp4`),
    w an fp4_group weight with ue8m0 scales per 32 (MXFP4, ``kind::mxf4``) or e4m3 scales per 16 (NVFP4,
    ``kind::mxf4nvf4``; a per-tensor global scale, if any, folded into the block scales) -> [..., N] in x's
    dtype. Not the op's default: the activation quantisation changes the numerics (oracle: the reference
    product of the dequantised activations, ``tests/kernels/test_linear.py``)."""
    group = _fp4_group(w)
    if not group:
        raise ValueError("linear_w4a4: takes a 2-D fp4_group weight, MXFP4 (ue8m0 scales per 32) or NVFP4 (e4m3 per 16)")
    cfg = config("gemm_fp4", target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x2 = _rows(x)
    m, k = x2.shape
    n = w.shape[0]
    xq, xs = act_quant_fp4(x2, group, target=target)
    y = torch.empty((m, n), dtype=x2.dtype, device=x.device)
    if m and n:
        ws = w.scale.view(torch.uint8) if group == 32 else w.scale
        launch(linear_fp4_w4a4_kernel, (triton.cdiv(n, bn), triton.cdiv(m, bm)),
               xq, xs, w.data, ws, y, m, n, k, xq.stride(0), xs.stride(0), *w.data.stride(), *ws.stride(), y.stride(0),
               GROUP=group, DTYPE=tl_dtype(x2.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERP=interp(),
               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], n)
