"""Grouped expert GEMMs with SwiGLU fused in: ``moe.experts``, for bf16/fp16/fp32, FP8 block-scaled
(``fp8_block``) and FP4 (``fp4_group``: e2m1 through ``tl.dot_scaled`` when the scales are ue8m0,
dequantised in registers when they are fp32) expert weights.

Plan of one call:

1. launch side, on the device (no host read): the (token, choice) pairs are grouped by expert and each
   group padded to ``BLOCK_M`` rows (:func:`align_pairs`); every M-tile then belongs to one expert
   (``tile_expert``); the grid has :func:`~inferhal.kernels.moe_pairs.max_tiles` M-tiles, a bound from the
   pair count alone, and the programs past the step's own tiles (expert -1) return at once;
2. ``moe_gate_up_kernel``: per (M-tile, N-tile of I) both GEMMs x @ W_gate^T and x @ W_up^T share the
   loads of x, and the epilogue applies the clamp and SiLU(gate) * up -> h[Mpad, I];
3. ``moe_down_kernel``: h @ W_down^T per tile, times the routing weight, into one fp32 row per pair;
4. host: the K rows of each token are summed in the order k = 0..K-1 by elementwise adds
   (:func:`ordered_sum`: deterministic, batch-invariant).

Rounding mirrors the oracle (``backends/reference/moe.py``): the gate/up and down GEMM results are
rounded to the activation dtype (as F.linear in that dtype does), h is rounded before the down GEMM,
and dequantised weights are rounded to the activation dtype. fp32 activations use IEEE fp32 dots
(never tf32). No split-K, one fixed tile per target and shape class: a step of few pairs an expert
(decode) takes swap-AB tiles (:func:`decode_tiles`: the weight rows on the MMA's M side, BLOCK_M pairs on its
N side), a larger one the tiled kernels; ``path="tiled"`` takes the tiled kernels at every size
(batch-invariant across sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import ExpertsParams
from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.common import dot_operand, e2m1, interp, launch, round_to, tl_dtype
from inferhal.kernels.moe_pairs import align_pairs, tile_pairs
from inferhal.kernels.tuning import FP8_PATHS, MOE_PATHS, config

PLAIN, FP8_BLOCK, FP4_DEQUANT, FP4_SCALED = 0, 1, 2, 3


@triton.jit
def _load_w(w_ptr, s_ptr, e, rn, k0, rk, N, K, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k,
            W_FMT: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr, SCALE_ROW: tl.constexpr):
    """Weight tile rows ``rn`` x cols ``rk = k0 + arange(BK)`` of expert ``e``, dequantised to DTYPE: [BN, BK].

    ``SCALE_ROW`` (FP8 blocks whose K extent is a multiple of BK): the tile lies in one scale column, so
    the scales load as one [BN] vector instead of a [BN, BK] gather (which the pipeliner also staged in
    shared memory: 245 KB at 3 stages on an H200, and 16x the bf16 kernel's time). Same products."""
    m = (rn < N)[:, None] & (rk < K)[None, :]
    base = w_ptr + e * s_we + rn[:, None] * s_wn
    if W_FMT == 0:
        w = tl.load(base + rk[None, :] * s_wk, mask=m, other=0.0)
        return round_to(w.to(tl.float32), DTYPE, INTERP)
    elif W_FMT == 1:
        q = tl.load(base + rk[None, :] * s_wk, mask=m, other=0.0).to(tl.float32)
        if SCALE_ROW:
            s = tl.load(s_ptr + e * s_se + (rn // blk_n) * s_sn + (k0 // blk_k) * s_sk, mask=rn < N, other=0.0)
            return round_to(q * s[:, None], DTYPE, INTERP)
        s = tl.load(s_ptr + e * s_se + (rn // blk_n)[:, None] * s_sn + (rk // blk_k)[None, :] * s_sk, mask=m, other=0.0)
        return round_to(q * s, DTYPE, INTERP)
    else:
        byte = tl.load(base + (rk // 2)[None, :] * s_wk, mask=m, other=0).to(tl.int32)
        nib = (byte >> ((rk % 2) * 4)[None, :]) & 0xF
        s = tl.load(s_ptr + e * s_se + rn[:, None] * s_sn + (rk // blk_k)[None, :] * s_sk, mask=m, other=0.0)
        return round_to(e2m1(nib) * s, DTYPE, INTERP)


@triton.jit
def _load_fp4_scaled(w_ptr, s_ptr, e, rn, k0, N, K, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                     BLOCK_K: tl.constexpr):
    """Packed e2m1 tile as dot_scaled's rhs [BK/2, BN] and its ue8m0 scales [BN, BK/32]."""
    kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    nm = rn < N
    q = tl.load(w_ptr + e * s_we + rn[None, :] * s_wn + kh[:, None] * s_wk,
                mask=nm[None, :] & (kh < K // 2)[:, None], other=0)
    s = tl.load(s_ptr + e * s_se + rn[:, None] * s_sn + ks[None, :] * s_sk,
                mask=nm[:, None] & (ks < K // 32)[None, :], other=127)
    return q, s


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, ws_ptr, pair_ptr, tile_e_ptr, h_ptr, D, I, TOPK, stride_x,
                       s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k, limit,
                       W_FMT: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr, LHS_FMT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr,
                       SCALE_ROW: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    rows, pair, rvalid, tok, e = tile_pairs(pair_ptr, tile_e_ptr, TOPK, BLOCK_M)
    if e < 0:  # past the step's tiles (align_pairs sizes the grid by a bound)
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h (rows of W_gate; W_up at +I)
    if SWAP_AB:  # decode: the weight rows are the MMA's M side, the tile's few pairs its N side
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + tok[:, None] * stride_x + rk[None, :], mask=rvalid[:, None] & (rk < D)[None, :], other=0.0)
        if W_FMT == 3:
            qg, sg = _load_fp4_scaled(w_ptr, ws_ptr, e, rn, k0, I, D, s_we, s_wn, s_wk, s_se, s_sn, s_sk, BLOCK_K)
            qu, su = _load_fp4_scaled(w_ptr, ws_ptr, e, I + rn, k0, 2 * I, D, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                                      BLOCK_K)
            if SWAP_AB:  # the packed weight as the scaled lhs [BN, BK/2], x^T the rhs
                xo = tl.trans(xt)
                acc_g = tl.dot_scaled(tl.trans(qg), sg, "e2m1", xo, None, LHS_FMT, acc=acc_g)
                acc_u = tl.dot_scaled(tl.trans(qu), su, "e2m1", xo, None, LHS_FMT, acc=acc_u)
            else:
                acc_g = tl.dot_scaled(xt, None, LHS_FMT, qg, sg, "e2m1", acc=acc_g)
                acc_u = tl.dot_scaled(xt, None, LHS_FMT, qu, su, "e2m1", acc=acc_u)
        else:
            wg = _load_w(w_ptr, ws_ptr, e, rn, k0, rk, I, D, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k,
                         W_FMT, DTYPE, INTERP, SCALE_ROW)
            wu = _load_w(w_ptr, ws_ptr, e, I + rn, k0, rk, 2 * I, D, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k,
                         W_FMT, DTYPE, INTERP, SCALE_ROW)
            if SWAP_AB:
                xo = dot_operand(tl.trans(xt), INTERP)
                acc_g = tl.dot(dot_operand(wg, INTERP), xo, acc_g, input_precision=PREC)
                acc_u = tl.dot(dot_operand(wu, INTERP), xo, acc_u, input_precision=PREC)
            else:
                xo = dot_operand(xt, INTERP)
                acc_g = tl.dot(xo, dot_operand(tl.trans(wg), INTERP), acc_g, input_precision=PREC)
                acc_u = tl.dot(xo, dot_operand(tl.trans(wu), INTERP), acc_u, input_precision=PREC)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    g = round_to(acc_g, DTYPE, INTERP).to(tl.float32)  # F.linear output in the activation dtype
    u = round_to(acc_u, DTYPE, INTERP).to(tl.float32)
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + rn[None, :], round_to(h, DTYPE, INTERP),
             mask=(rn < I)[None, :])


@triton.jit
def moe_down_kernel(h_ptr, w_ptr, ws_ptr, pair_ptr, tile_e_ptr, rw_ptr, y_ptr, D, I,
                    s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k,
                    W_FMT: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr, LHS_FMT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr,
                    SCALE_ROW: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    rows, pair, rvalid, _, e = tile_pairs(pair_ptr, tile_e_ptr, 1, BLOCK_M)
    if e < 0:  # past the step's tiles (align_pairs sizes the grid by a bound)
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (rows of W_down)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + rk[None, :], mask=(rk < I)[None, :], other=0.0)
        if W_FMT == 3:
            q, s = _load_fp4_scaled(w_ptr, ws_ptr, e, rn, k0, D, I, s_we, s_wn, s_wk, s_se, s_sn, s_sk, BLOCK_K)
            if SWAP_AB:
                acc = tl.dot_scaled(tl.trans(q), s, "e2m1", tl.trans(ht), None, LHS_FMT, acc=acc)
            else:
                acc = tl.dot_scaled(ht, None, LHS_FMT, q, s, "e2m1", acc=acc)
        else:
            w = _load_w(w_ptr, ws_ptr, e, rn, k0, rk, D, I, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, blk_k,
                        W_FMT, DTYPE, INTERP, SCALE_ROW)
            if SWAP_AB:
                acc = tl.dot(dot_operand(w, INTERP), dot_operand(tl.trans(ht), INTERP), acc, input_precision=PREC)
            else:
                acc = tl.dot(dot_operand(ht, INTERP), dot_operand(tl.trans(w), INTERP), acc, input_precision=PREC)
    if SWAP_AB:
        acc = tl.trans(acc)
    rw = tl.load(rw_ptr + tl.where(rvalid, pair, 0), mask=rvalid, other=0.0)
    y = round_to(acc, DTYPE, INTERP).to(tl.float32) * rw[:, None]
    pr = tl.where(rvalid, pair, 0).to(tl.int64)
    tl.store(y_ptr + pr[:, None] * D + rn[None, :], y, mask=rvalid[:, None] & (rn < D)[None, :])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Weight:
    data: torch.Tensor
    scale: torch.Tensor
    fmt: int
    block: tuple[int, int]

    def strides(self) -> tuple[int, ...]:
        return (*self.data.stride(), *self.scale.stride())

    def scale_row(self, block_k: int) -> bool:
        """FP8 blocks spanning whole K tiles: one scale per row of each weight tile."""
        return self.fmt == FP8_BLOCK and self.block[1] % block_k == 0


def _weight(w, num_rows: int, k: int, name: str, act: torch.dtype) -> _Weight:
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or tuple(w.shape[1:]) != (num_rows, k):
            raise ValueError(f"moe.experts: {name} must be [E, {num_rows}, {k}], got {tuple(w.shape)}")
        return _Weight(w, w.new_zeros((1, 1, 1), dtype=torch.float32), PLAIN, (1, 1))
    if not isinstance(w, QuantWeight):
        raise TypeError(f"moe.experts: {name} must be a tensor or a QuantWeight, got {type(w).__name__}")
    if tuple(w.shape[1:]) != (num_rows, k):
        raise ValueError(f"moe.experts: {name} must be [E, {num_rows}, {k}], got {tuple(w.shape)}")
    e8m0 = w.scale.dtype == getattr(torch, "float8_e8m0fnu", None)
    if w.format == "fp8_block":
        return _Weight(w.data, w.scale.float(), FP8_BLOCK, w.block)
    group = w.block[1]
    if e8m0 and group == 32 and act in (torch.bfloat16, torch.float16):
        return _Weight(w.data, w.scale.view(torch.uint8), FP4_SCALED, w.block)
    return _Weight(w.data, w.scale.float(), FP4_DEQUANT, w.block)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down, p: ExpertsParams,
                *, target: str | None = None, fp8: str = "widen", path: str = "decode") -> torch.Tensor:
    """``moe.experts``: x[T, D], routing weights/ids [T, K], w_gate_up [E, 2I, D], w_down [E, D, I] -> y[T, D].
    ``fp8``: how fp8_block weights multiply: ``widen`` (to the activation dtype, here) or ``w8a8`` (FP8 x FP8,
    :mod:`.moe_fp8`; both weights fp8_block with 128-wide K blocks, else refused). ``path``: ``decode`` runs
    steps of at most ``moe_gemm_decode``'s MAX_PAIRS_PER_EXPERT pairs an expert on average (T x K <= E x that)
    through swap-AB tiles of few pairs (:func:`decode_tiles`), larger ones through the tiled kernels; ``tiled``
    runs the tiled kernels at every T (what cuda_sm100 runs under backend.batch_invariant=true)."""
    if fp8 not in FP8_PATHS:
        raise ValueError(f"moe.experts: fp8={fp8!r}; known: {', '.join(FP8_PATHS)}")
    if path not in MOE_PATHS:
        raise ValueError(f"moe.experts: path={path!r}; known: {', '.join(MOE_PATHS)}")
    t, d = x.shape
    num_experts = w_gate_up.shape[0]
    two_i = w_gate_up.shape[1]
    if two_i % 2:
        raise ValueError(f"moe.experts: w_gate_up has an odd number of rows ({two_i}); expected 2I")
    inter = two_i // 2
    if tuple(ids.shape) != tuple(weights.shape) or ids.shape[0] != t:
        raise ValueError(f"moe.experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={t}, K]")
    wgu = _weight(w_gate_up, two_i, d, "w_gate_up", x.dtype)
    wdn = _weight(w_down, d, inter, "w_down", x.dtype)
    topk = ids.shape[1]
    swap = path == "decode" and decode_tiles(t * topk, num_experts, target)
    if fp8 == "w8a8" and FP8_BLOCK in (wgu.fmt, wdn.fmt):
        from inferhal.kernels.moe_fp8 import moe_experts_w8a8, w8a8_blocks_ok

        why = w8a8_blocks_ok(w_gate_up, w_down)
        if why:
            raise ValueError(f"moe.experts fp8=w8a8: {why}")
        y_pairs = moe_experts_w8a8(x.contiguous(), weights, ids, w_gate_up, w_down, p.swiglu_limit, target, swap)
        return ordered_sum(y_pairs.view(t, topk, d)).to(x.dtype)
    quant = max(wgu.fmt, wdn.fmt)
    cfg = config("moe_gemm_decode" if swap else "moe_gemm_fp4" if quant == FP4_SCALED else "moe_gemm", target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    x = x.contiguous()
    y_pairs = torch.zeros((t * topk, d), dtype=torch.float32, device=x.device)
    pairs, tile_expert = align_pairs(ids, num_experts, bm)
    n_tiles = tile_expert.numel()
    if n_tiles:
        h = torch.empty((n_tiles * bm, inter), dtype=x.dtype, device=x.device)
        common = dict(DTYPE=tl_dtype(x.dtype), PREC="ieee" if x.dtype == torch.float32 else "tf32",
                      LHS_FMT="fp16" if x.dtype == torch.float16 else "bf16", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      INTERP=interp(), SWAP_AB=swap, **opts)
        launch(moe_gate_up_kernel, (n_tiles, triton.cdiv(inter, bn)),
            x, wgu.data, wgu.scale, pairs, tile_expert, h, d, inter, topk, x.stride(0), *wgu.strides(),
            wgu.block[0], wgu.block[1], float(p.swiglu_limit), W_FMT=wgu.fmt, SCALE_ROW=wgu.scale_row(bk), **common)
        launch(moe_down_kernel, (n_tiles, triton.cdiv(d, bn)),
            h, wdn.data, wdn.scale, pairs, tile_expert, weights.float().contiguous(), y_pairs, d, inter,
            *wdn.strides(), wdn.block[0], wdn.block[1], W_FMT=wdn.fmt, SCALE_ROW=wdn.scale_row(bk), **common)
    return ordered_sum(y_pairs.view(t, topk, d)).to(x.dtype)


def decode_tiles(num_pairs: int, num_experts: int, target: str | None = None) -> bool:
    """Whether a step of ``num_pairs`` (token, choice) pairs takes the decode tiles: at most
    MAX_PAIRS_PER_EXPERT pairs an expert on average, where the tiled kernels' 64- or 128-row tiles would hold a
    few real rows each. The decode tiles hold BLOCK_M pairs (16 on the GPU targets) on the N side of swapped
    dots, the weight rows on the M side (an MMA's M is 64 or 128). A shape class from T alone, like linear's
    decode rows (not batch-invariant across the bound: backend.batch_invariant=true runs ``path="tiled"``).
    Every weight format: FP4 with ue8m0 scales swaps too (the packed weight as ``tl.dot_scaled``'s scaled lhs)."""
    cfg = config("moe_gemm_decode", target)
    return 0 < num_pairs <= num_experts * cfg["MAX_PAIRS_PER_EXPERT"]


def ordered_sum(y: torch.Tensor) -> torch.Tensor:
    """y[T, K, D] -> y[:, 0] + y[:, 1] + ... + y[:, K-1], added in that order: elementwise adds, so a token's
    sum never depends on T (a reduction kernel, ``sum(dim=1)``, may split K by the output count it sees)."""
    if y.shape[1] == 0:
        return y.new_zeros((y.shape[0], y.shape[2]))
    out = y[:, 0].clone()
    for k in range(1, y.shape[1]):
        out += y[:, k]
    return out
