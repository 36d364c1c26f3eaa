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

The paths with quantised activations (FP8 x FP8, FP4 x FP4: other tcgen05 kinds, other numerics) are in
:mod:`.linear_lowp`.

Interpreter: bf16 ``tl.dot`` operands are upcast to fp32 (``common.dot_operand``, FACTS: the interpreter's
bf16 dot multiplies bit patterns), roundings go through ``common.round_to``; compiled kernels keep bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.common import dot_operand, interp, launch, round_to, rows, tl_dtype
from inferhal.kernels.linear_k import k_block
from inferhal.kernels.moe_experts import FP4_DEQUANT, FP4_SCALED, FP8_BLOCK, PLAIN, _load_fp4_scaled
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import FP8_PATHS, LINEAR_PATHS, config

INT_BLOCK = 4
LINEAR, LOGITS, ARGMAX = 0, 1, 2


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
        if W_FMT == 3:
            rk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[:, None] * stride_x + rk[None, :], mask=mm[:, None] & (rk < K)[None, :],
                         other=0.0)
            q, s = _load_fp4_scaled(w_ptr, ws_ptr, 0, rn, k0, N, K, 0, s_wn, s_wk, 0, s_sn, s_sk, BLOCK_K)
            acc = tl.dot_scaled(xt, None, LHS_FMT, q, s, "e2m1", acc=acc)
        else:
            acc = k_block(acc, x_ptr, w_ptr, ws_ptr, wo_ptr, rows, mm, rn, k0, N, K, stride_x, s_wn, s_wk, s_sn, s_sk,
                          blk_n, blk_k, W_FMT, HAS_OFFSET, DTYPE, PREC, BLOCK_K, INTERP, SCALE_ROW)
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


def _prec(dtype: torch.dtype) -> str:
    """fp32 activations: IEEE fp32 dots (never tf32); half dtypes' products are exact in fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
           DTYPE=tl_dtype(x2.dtype), PREC=_prec(x2.dtype),
           LHS_FMT="fp16" if x2.dtype == torch.float16 else "bf16", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
           INTERP=interp(), SCALE_ROW=fmt == FP8_BLOCK and block[1] % bk == 0,
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if mode == ARGMAX:
        argmax_reduce_kernel[(m,)](pv, pi, out, nt, n, BLOCK_T=next_pow2(nt), num_warps=4)
    return out


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, target: str | None = None,
           fp8: str = "widen", path: str = "decode") -> torch.Tensor:
    """``linear``: x[..., K] @ w[N, K]^T (+ bias) -> [..., N] in x's dtype. ``fp8``: how an fp8_block weight
    multiplies: ``widen`` (to x's dtype in registers) or ``w8a8`` (FP8 x FP8, :func:`.linear_lowp.linear_w8a8`,
    where the weight's K blocks are 128 wide and there is no bias; otherwise widened). ``path``: ``decode``
    runs up to the ``gemm_decode`` entry's MAX_ROWS rows through :mod:`.linear_decode` (tiles and K splits
    from N and K), more rows through the tiled kernel; ``tiled``: the tiled kernel at every M (one summation
    order whatever the batch: the batch-invariant mode's path)."""
    if fp8 not in FP8_PATHS:
        raise ValueError(f"linear: fp8={fp8!r}; known: {', '.join(FP8_PATHS)}")
    if path not in LINEAR_PATHS:
        raise ValueError(f"linear: path={path!r}; known: {', '.join(LINEAR_PATHS)}")
    if (fp8 == "w8a8" and bias is None and isinstance(w, QuantWeight) and w.format == "fp8_block"
            and len(w.shape) == 2 and w.block[1] == 128):
        from inferhal.kernels.linear_lowp import linear_w8a8

        if path == "decode" and 0 < rows(x).shape[0] <= config("gemm_decode", target)["MAX_ROWS"]:
            from inferhal.kernels.linear_decode import linear_w8a8_decode

            return linear_w8a8_decode(x, w, target=target)
        return linear_w8a8(x, w, target=target)
    x2 = rows(x)
    b = None if bias is None else bias.contiguous()
    if b is not None and b.numel() != w.shape[0]:
        raise ValueError(f"linear: bias has {b.numel()} elements, weight has N={w.shape[0]}")
    dec = config("gemm_decode", target) if path == "decode" else None
    if dec is not None and 0 < x2.shape[0] <= dec["MAX_ROWS"] and w.shape[0] and x2.shape[1]:
        fmt, data, scale, offset, block = _weight(w, x2.shape[1], x2.dtype, "linear")
        if fmt != FP4_SCALED:  # dot_scaled weights stay on the tiled kernel
            from inferhal.kernels.linear_decode import linear_decode

            y = linear_decode(x2, fmt, data, scale, offset, block, b, dec, prec=_prec(x2.dtype),
                              dtype=tl_dtype(x2.dtype), scale_row_ok=fmt == FP8_BLOCK, interp=interp())
            return y.reshape(*x.shape[:-1], w.shape[0])
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
    _gemm(rows(x), w, None, LOGITS, out, target, "lm_head")
    return out


def lm_head_argmax(x: torch.Tensor, w, *, target: str | None = None) -> torch.Tensor:
    """``lm_head.argmax``: each row's first argmax (NaN the largest) of lm_head(x, w), without the logits."""
    return _gemm(rows(x), w, None, ARGMAX, None, target, "lm_head.argmax")
