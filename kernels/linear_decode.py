"""``linear`` at decode (M <= ``MAX_ROWS`` of the ``gemm_decode`` tuning entry, 128 on the GPU targets): enough
programs for a few rows.

The tiled kernel (:func:`.linear.linear_kernel`) runs a program per (N-tile, M-tile) with 128-wide N tiles, so a
decode projection gets ``N / 128`` programs: 8 for V4-Flash's ``q_a_proj`` (N 1024) on a 132-SM GPU. Here:

- ``linear_decode_kernel``: a program per (N-tile, K-split, M-tile). The N tile (``BLOCK_N``, the widest of the
  target's ``N_TILES``) and the split count come from (N, K) and the target only (:func:`decode_grid`), never
  from M: a row's sums are the same whatever other rows share the call (the M tile is a fixed ``BLOCK_M``, and
  a row of an MMA never mixes with the other rows). Each program sums its split's ``BLOCK_K`` blocks in K order
  into an fp32 accumulator; with one split it adds the bias and rounds once (the tiled kernel's epilogue);
- ``split_reduce_kernel`` (more than one split): the fp32 partials ``[S, M, N]`` summed in split order
  0, 1, ..., S-1 (a fixed, deterministic second pass, no atomics), the bias added, rounded once.

Numerics: the reference's contract (weights rounded to the activation dtype, fp32 accumulation, one output
rounding); a split sums the same fp32 products in another order than the unsplit kernel (partial sums of
``KS`` columns, then the partials in split order), within the conformance tolerance of ``linear`` (fp32:
4 sqrt(K) ulps; bf16/fp16: 4 ulps plain, 8 for a dequantised weight; ``core/qualify/cases/dense.py``).

Batch invariance: for M <= MAX_ROWS. The op switches to the tiled kernel above it (other tiles and other
sums), so ``linear``'s wrapper runs the tiled kernel at every M under ``backend.batch_invariant=true``
(``path="tiled"``; backends/cuda_sm100/ops.py declares linear invariant in that mode only).

Weights: plain, FP8 block-scaled (widened in registers), FP4 dequantised in registers and GGUF integer blocks,
with the tiled kernel's loaders. ue8m0 FP4 weights (``tl.dot_scaled``) stay on the tiled kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.common import interp, launch, round_to, tl_dtype
from inferhal.kernels.linear_k import k_block
from inferhal.kernels.linear_lowp import w8a8_block, w8a8_operands
from inferhal.kernels.tuning import config


@triton.jit
def linear_decode_kernel(x_ptr, w_ptr, ws_ptr, wo_ptr, b_ptr, y_ptr, part_ptr, M, N, K, KS, stride_x,
                         s_wn, s_wk, s_sn, s_sk, blk_n, blk_k, stride_y,
                         W_FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OFFSET: tl.constexpr, DTYPE: tl.constexpr,
                         PREC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, INTERP: tl.constexpr, SCALE_ROW: tl.constexpr):
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    rows = rm.to(tl.int64)
    k_lo = sp * KS  # KS: a multiple of BLOCK_K
    k_hi = tl.minimum(K, k_lo + KS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # the tiled kernel's K block, over this split's columns
        acc = k_block(acc, x_ptr, w_ptr, ws_ptr, wo_ptr, rows, mm, rn, k0, N, K, stride_x, s_wn, s_wk, s_sn, s_sk,
                      blk_n, blk_k, W_FMT, HAS_OFFSET, DTYPE, PREC, BLOCK_K, INTERP, SCALE_ROW)
    out = mm[:, None] & nm[None, :]
    if SPLIT:  # partial sums [S, M, N], summed in split order by split_reduce_kernel
        tl.store(part_ptr + (sp * M + rows)[:, None] * N + rn[None, :], acc, mask=out)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], round_to(acc, DTYPE, INTERP), mask=out)


@triton.jit
def split_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, S, stride_y, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
                        BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """Row ``program_id(0)``, columns ``program_id(1) * BLOCK ...``: sum_s part[s] in order s = 0..S-1, + bias,
    one rounding to DTYPE."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < N
    acc = tl.load(part_ptr + r * N + c, mask=cm, other=0.0)
    for s in range(1, S):
        acc += tl.load(part_ptr + (s * M + r) * N + c, mask=cm, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * stride_y + c, round_to(acc, DTYPE, INTERP), mask=cm)


@triton.jit
def linear_w8a8_decode_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, K, KS, stride_xq, stride_xs, s_wn,
                              s_wk, s_sn, s_sk, blk_n, stride_y, DTYPE: tl.constexpr, SPLIT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              INTERP: tl.constexpr):
    """FP8 x FP8 at decode: :func:`.linear_lowp.linear_w8a8_kernel`'s K blocks over a program per (N-tile, K-split, M-tile) of
    :func:`decode_grid` (from N and K only); with splits the fp32 partials [S, M, N] go to
    :func:`split_reduce_kernel`, else one rounding here."""
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.program_id(1)
    mm, nm = rm < M, rn < N
    rows = rm.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(sp * KS, tl.minimum(K, sp * KS + KS), BLOCK_K):
        acc = w8a8_block(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, rows, mm, rn, nm, k0, K, stride_xq, stride_xs, s_wn, s_wk,
                          s_sn, s_sk, blk_n, BLOCK_K)
    out = mm[:, None] & nm[None, :]
    if SPLIT:
        tl.store(part_ptr + (sp * M + rows)[:, None] * N + rn[None, :], acc, mask=out)
    else:
        tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :], round_to(acc, DTYPE, INTERP), mask=out)


def decode_grid(n: int, k: int, cfg) -> tuple[int, int, int]:
    """(BLOCK_N, splits, KS = K columns per split, a multiple of BLOCK_K) of a decode ``linear`` of N outputs
    over K, from (N, K) and the target's ``gemm_decode`` entry only: the widest tile of ``N_TILES`` whose N-tiles
    times splits reach ``PROGRAMS`` (two programs per SM of the target), splits of at least ``MIN_SPLIT_K``
    columns (the fp32 partials stay a fraction of the weight's bytes), else the narrowest tile with as many
    splits as K allows. The last split may be shorter."""
    bk = cfg["BLOCK_K"]
    kb = triton.cdiv(k, bk)
    min_kb = max(1, cfg["MIN_SPLIT_K"] // bk)
    max_s = max(1, kb // min_kb)
    for bn in cfg["N_TILES"]:
        tiles = triton.cdiv(n, bn)
        per = max(min_kb, kb // min(max_s, triton.cdiv(cfg["PROGRAMS"], tiles)))  # K blocks per split
        if tiles * triton.cdiv(kb, per) >= cfg["PROGRAMS"]:
            break
    return bn, triton.cdiv(kb, per), per * bk


def linear_decode(x2: torch.Tensor, fmt: int, data, scale, offset, block, bias, cfg, *, prec: str, dtype,
                  scale_row_ok: bool, interp: bool) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ w^T (+ bias) with ``linear_decode_kernel`` (and the split reduction); the
    weight as :func:`.linear._weight` returns it."""
    m, k = x2.shape
    n = data.shape[0]
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    bn, splits, ks = decode_grid(n, k, cfg)
    dev = x2.device
    y = torch.empty((m, n), dtype=x2.dtype, device=dev)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=dev) if splits > 1 else scale
    launch(linear_decode_kernel, (triton.cdiv(n, bn), splits, triton.cdiv(m, bm)),
           x2, data, scale, offset if offset is not None else scale, bias if bias is not None else scale, y, part,
           m, n, k, ks, x2.stride(0), *data.stride(), *scale.stride(), block[0], block[1], y.stride(0),
           W_FMT=fmt, HAS_BIAS=bias is not None, HAS_OFFSET=offset is not None, DTYPE=dtype, PREC=prec,
           SPLIT=splits > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERP=interp,
           SCALE_ROW=scale_row_ok and block[1] % bk == 0,
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _sum_splits(part, bias, scale, y, splits, cfg, dtype, interp)
    return y


def _sum_splits(part, bias, dummy, y, splits: int, cfg, dtype, interp: bool) -> None:
    """With more than one split: y = the partials ``part`` [S, M, N] summed in split order (+ ``bias``), rounded
    once (``split_reduce_kernel``); ``dummy``: any tensor, passed where there is no bias."""
    if splits > 1:
        m, n = y.shape
        rb = cfg["REDUCE_BLOCK"]
        split_reduce_kernel[(m, triton.cdiv(n, rb))](part, bias if bias is not None else dummy, y, m, n, splits,
                                                      y.stride(0), HAS_BIAS=bias is not None, DTYPE=dtype, BLOCK=rb,
                                                      INTERP=interp, num_warps=4)


def linear_w8a8_decode(x: torch.Tensor, w, *, target: str | None = None) -> torch.Tensor:
    """FP8 x FP8 ``linear`` at decode rows (x[..., K] with at most the ``gemm_decode`` entry's MAX_ROWS rows):
    :func:`.linear_lowp.linear_w8a8`'s activations and K blocks on this module's grid, the splits whole 128-wide
    scale blocks, the partials summed in split order."""
    x2, xq, xs, fp8 = w8a8_operands(x, w, target)
    cfg = {**config("gemm_decode", target), "BLOCK_K": fp8["BLOCK_K"]}
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x.device)
    if not (m and n):
        return y.reshape(*x.shape[:-1], n)
    bn, splits, ks = decode_grid(n, k, cfg)
    ws = w.scale.float()
    part = torch.empty((splits, m, n), dtype=torch.float32, device=y.device) if splits > 1 else ws
    dtype, intp = tl_dtype(y.dtype), interp()
    launch(linear_w8a8_decode_kernel, (triton.cdiv(n, bn), splits, triton.cdiv(m, cfg["BLOCK_M"])),
           xq, xs, w.data, ws, y, part, m, n, k, ks, xq.stride(0), xs.stride(0), *w.data.stride(), *ws.stride(),
           w.block[0], y.stride(0), DTYPE=dtype, SPLIT=splits > 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
           BLOCK_K=cfg["BLOCK_K"], INTERP=intp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _sum_splits(part, None, ws, y, splits, cfg, dtype, intp)
    return y.reshape(*x.shape[:-1], n)
