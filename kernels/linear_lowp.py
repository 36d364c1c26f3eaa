"""``linear`` with quantised activations: the paths whose products run on the low-precision tensor-core
kinds, beside the op's default (:mod:`.linear`, which keeps the reference's numerics: weights dequantised to
the activation dtype, ``kind::f16``). Their numerics differ from the reference by the activation
quantisation, so they are opt-in; their oracle is the reference product of the dequantised activations
(``tests/kernels/test_linear.py``).

- ``linear_w8a8``: FP8 x FP8 (``tcgen05.mma kind::f8f6f4`` on SM100): activations quantised per token and
  128-column block to e4m3 (amax / 448, DeepSeek's ``act_quant``) by ``act_quant_kernel``, then one e4m3 dot
  per 128-wide K block, scaled by both block scales into the fp32 accumulator (DeepSeek's ``fp8_gemm``); at
  decode rows the same K blocks over :mod:`.linear_decode`'s grid of N tiles and K splits.
- ``linear_w4a4``: FP4 x FP4 through ``tl.dot_scaled``: MXFP4 (ue8m0 scales per 32, ``kind::mxf4``) or
  NVFP4 (e4m3 scales per 16, ``kind::mxf4nvf4``), activations quantised to the weight's layout by
  ``act_quant_fp4_kernel``. The interpreter's ``dot_scaled`` misreads e4m3 scales: there (``INTERP``) NVFP4
  tiles are decoded to fp32 and multiplied by ``tl.dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.common import e2m1, interp, launch, round_to, rows, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


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
def w8a8_block(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, rows, mm, rn, nm, k0, K, stride_xq, stride_xs, s_wn, s_wk, s_sn,
                s_sk, blk_n, BLOCK_K: tl.constexpr):
    """acc + (xq . wq^T) * xs[:, kb] * ws[n // blk_n, kb] over the K block at ``k0`` (BLOCK_K = the 128-wide
    scale block)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    km = rk < K
    xq = tl.load(xq_ptr + rows[:, None] * stride_xq + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
    wq = tl.load(w_ptr + rn[None, :] * s_wn + rk[:, None] * s_wk, mask=nm[None, :] & km[:, None], other=0.0)
    kb = k0 // BLOCK_K
    xs = tl.load(xs_ptr + rows * stride_xs + kb, mask=mm, other=0.0)
    ws = tl.load(ws_ptr + (rn // blk_n) * s_sn + kb * s_sk, mask=nm, other=0.0)
    return acc + tl.dot(xq, wq) * xs[:, None] * ws[None, :]


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
        acc = w8a8_block(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, rows, mm, rn, nm, k0, K, stride_xq, stride_xs, s_wn, s_wk,
                          s_sn, s_sk, blk_n, BLOCK_K)
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
    lo = e2m1((q & 0xF).to(tl.int32))
    hi = e2m1((q >> 4).to(tl.int32))
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


def act_quant(x: torch.Tensor, block: int = 128, *, target: str | None = None):
    """x[M, K] -> (e4m3 codes [M, K], fp32 scales [M, ceil(K/block)]): per token and ``block`` columns, s = amax/448."""
    x2 = rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, triton.cdiv(k, block)), dtype=torch.float32, device=x.device)
    if m and k:
        act_quant_kernel[(m, s.shape[1])](x2, q, s, k, x2.stride(0), q.stride(0), s.stride(0), BLOCK=block,
                                          INTERP=interp(), num_warps=4)
    return q, s


def w8a8_operands(x: torch.Tensor, w: QuantWeight, target: str | None):
    """(x as rows, its e4m3 codes, their scales per 128 columns, the ``gemm_fp8`` config) for an FP8 x FP8
    product with ``w`` (a 2-D fp8_block weight with K blocks as wide as the config's K tile, else refused)."""
    if not isinstance(w, QuantWeight) or w.format != "fp8_block" or len(w.shape) != 2:
        raise ValueError("linear_w8a8: takes a 2-D fp8_block weight")
    cfg = config("gemm_fp8", target)
    if w.block[1] != cfg["BLOCK_K"]:
        raise ValueError(f"linear_w8a8: weight K blocks are {w.block[1]} wide, the kernel's K tile is {cfg['BLOCK_K']}")
    x2 = rows(x)
    xq, xs = act_quant(x2, cfg["BLOCK_K"], target=target)
    return x2, xq, xs, cfg


def linear_w8a8(x: torch.Tensor, w: QuantWeight, *, target: str | None = None) -> torch.Tensor:
    """FP8 x FP8 ``linear`` (see the module docstring): x[..., K] (bf16/fp16/fp32) quantised per token and
    128-column block, w an fp8_block weight with 128-wide K blocks -> [..., N] in x's dtype, through the tiled
    kernel (at decode rows: :func:`.linear_decode.linear_w8a8_decode`)."""
    x2, xq, xs, cfg = w8a8_operands(x, w, target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    m, k = x2.shape
    n = w.shape[0]
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
    x2 = rows(x)
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
    x2 = rows(x)
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
