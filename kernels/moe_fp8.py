"""``moe.experts`` on the FP8 tensor cores (``fp8="w8a8"``): FP8 x FP8 block-scaled grouped GEMMs, the
other way to run FP8 expert weights beside :mod:`.moe_experts`, which widens them to the activation dtype
in registers (the numerically closest path, the default).

DeepSeek's recipe (DeepSeek-V3 report, section 3.3; DeepGEMM): activations quantised per token and 128
channels to e4m3 (scale amax / 448), weights in 128 x 128 blocks, one e4m3 dot per 128-wide K block into a
fresh fp32 partial that is multiplied by both scales and added to the fp32 accumulator (so the tensor
cores' limited FP8 accumulation never spans more than one block).

1. host: ``act_quant`` (:mod:`.linear_lowp`) quantises x; the pairs are grouped by expert as for the
   widening path (:func:`~inferhal.kernels.moe_pairs.align_pairs`);
2. ``moe_gate_up_w8a8_kernel``: per (M-tile, 128 columns of I) both GEMMs share the loads of x's codes;
   the epilogue rounds gate and up to the activation dtype, clamps, applies SiLU(gate) * up, rounds h to
   the activation dtype and quantises it to e4m3 with one scale per row of the tile (the tile's 128
   columns are h's quantisation block): h never reaches memory in bf16;
3. ``moe_down_w8a8_kernel``: h's codes times W_down per 128-wide K block, rounded, times the routing
   weight, into one fp32 row per pair; the K rows of a token summed in order (``ordered_sum``).

Padding rows of a tile (an expert with fewer pairs than ``BLOCK_M``) load nothing and store nothing. One
fixed tile per target and shape class, no split-K: steps of few pairs an expert take decode tiles (swap-AB, as
:mod:`.moe_experts`'s: ``moe_gemm_fp8_decode``), larger ones the tiled kernels (``path="tiled"``: always). Oracle: the reference grouped GEMM on the dequantised
activations and fp32-dequantised weights (``tests/kernels/test_moe_fp8.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.common import interp, launch, round_to, tl_dtype
from inferhal.kernels.kv_records import _div
from inferhal.kernels.moe_pairs import align_pairs, tile_pairs
from inferhal.kernels.tuning import config


@triton.jit
def _w_tile(w_ptr, ws_ptr, e, rn, nm, k0, rk, km, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, BLOCK_K: tl.constexpr):
    """e4m3 codes of expert ``e``'s rows ``rn`` x columns ``rk`` as the dot's rhs ``[BLOCK_K, BLOCK_N]``, and
    the rows' block scales for K block ``k0 // BLOCK_K`` ``[BLOCK_N]``."""
    w = tl.load(w_ptr + e * s_we + rn[None, :] * s_wn + rk[:, None] * s_wk, mask=nm[None, :] & km[:, None], other=0.0)
    s = tl.load(ws_ptr + e * s_se + (rn // blk_n) * s_sn + (k0 // BLOCK_K) * s_sk, mask=nm, other=0.0)
    return w, s


@triton.jit
def _rows_gemm(a_ptr, as_ptr, w_ptr, ws_ptr, row, rvalid, e, rn, nm, K, stride_a, stride_as, s_we, s_wn, s_wk, s_se,
               s_sn, s_sk, blk_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SWAP_AB: tl.constexpr = False):
    """fp32 ``[BLOCK_M, BLOCK_N]``: rows ``row`` of the e4m3 codes ``a`` (scales ``as`` per 128 columns) times
    expert ``e``'s weight rows ``rn``, one fresh e4m3 dot per 128-wide K block scaled into the accumulator.
    ``SWAP_AB`` (decode tiles of few pairs): the weight rows on the dot's M side, the pairs on its N side, the
    accumulator transposed once at the end."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = tl.load(a_ptr + row[:, None] * stride_a + rk[None, :], mask=rvalid[:, None] & km[None, :], other=0.0)
        sa = tl.load(as_ptr + row * stride_as + k0 // BLOCK_K, mask=rvalid, other=0.0)
        w, sw = _w_tile(w_ptr, ws_ptr, e, rn, nm, k0, rk, km, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, BLOCK_K)
        if SWAP_AB:
            acc += tl.dot(tl.trans(w), tl.trans(a)) * sw[:, None] * sa[None, :]
        else:
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def moe_gate_up_w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, pair_ptr, tile_e_ptr, hq_ptr, hs_ptr, D, I, TOPK,
                            stride_xq, stride_xs, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, stride_hq, stride_hs,
                            limit, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, INTERP: tl.constexpr, SWAP_AB: tl.constexpr = False):
    rows, pair, rvalid, tok, e = tile_pairs(pair_ptr, tile_e_ptr, TOPK, BLOCK_M)
    if e < 0:  # past the step's tiles (align_pairs sizes the grid by a bound)
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h (rows of W_gate; W_up at +I)
    nm = rn < I
    # gate, then up: one K loop each (x's codes read twice, from L2) so that one accumulator and one partial
    # are live at a time (both GEMMs in one loop spilled 2.8-3.1 KB at 4 warps on sm_90a / sm_100a)
    g = round_to(_rows_gemm(xq_ptr, xs_ptr, w_ptr, ws_ptr, tok, rvalid, e, rn, nm, D, stride_xq, stride_xs, s_we,
                            s_wn, s_wk, s_se, s_sn, s_sk, blk_n, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB), DTYPE, INTERP)
    u = round_to(_rows_gemm(xq_ptr, xs_ptr, w_ptr, ws_ptr, tok, rvalid, e, I + rn, nm, D, stride_xq, stride_xs, s_we,
                            s_wn, s_wk, s_se, s_sn, s_sk, blk_n, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB), DTYPE, INTERP)
    g = g.to(tl.float32)  # the GEMM outputs in the activation dtype
    u = u.to(tl.float32)
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = round_to(g / (1.0 + tl.exp(-g)) * u, DTYPE, INTERP).to(tl.float32)
    h = tl.where(nm[None, :], h, 0.0)
    s = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12) / 448.0  # [BLOCK_M]: this tile is one quantisation block
    q = tl.minimum(tl.maximum(_div(h, s[:, None] + tl.zeros(h.shape, tl.float32), INTERP), -448.0), 448.0)
    r64 = rows.to(tl.int64)
    tl.store(hq_ptr + r64[:, None] * stride_hq + rn[None, :], round_to(q, tl.float8e4nv, INTERP),
             mask=rvalid[:, None] & nm[None, :])
    tl.store(hs_ptr + r64 * stride_hs + tl.program_id(1), s, mask=rvalid)


@triton.jit
def moe_down_w8a8_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, pair_ptr, tile_e_ptr, rw_ptr, y_ptr, D, I, stride_hq,
                         stride_hs, s_we, s_wn, s_wk, s_se, s_sn, s_sk, blk_n, DTYPE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr,
                         SWAP_AB: tl.constexpr = False):
    rows, pair, rvalid, _, e = tile_pairs(pair_ptr, tile_e_ptr, 1, BLOCK_M)
    if e < 0:  # past the step's tiles (align_pairs sizes the grid by a bound)
        return
    r64 = rows.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (rows of W_down)
    nm = rn < D
    acc = _rows_gemm(hq_ptr, hs_ptr, w_ptr, ws_ptr, r64, rvalid, e, rn, nm, I, stride_hq, stride_hs, s_we, s_wn, s_wk,
                     s_se, s_sn, s_sk, blk_n, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
    rw = tl.load(rw_ptr + tl.where(rvalid, pair, 0), mask=rvalid, other=0.0)
    y = round_to(acc, DTYPE, INTERP).to(tl.float32) * rw[:, None]
    pr = tl.where(rvalid, pair, 0).to(tl.int64)
    tl.store(y_ptr + pr[:, None] * D + rn[None, :], y, mask=rvalid[:, None] & nm[None, :])


def w8a8_blocks_ok(w_gate_up, w_down) -> str:
    """"" when both weights suit the FP8 x FP8 kernels (fp8_block, 128-wide K blocks), else why not."""
    from inferhal.core.ops.quant import QuantWeight

    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, QuantWeight) or w.format != "fp8_block":
            return f"{name} is not an fp8_block weight"
        if w.block[1] != 128:
            return f"{name} has {w.block[1]}-wide K blocks (the kernels take 128)"
    return ""


def moe_experts_w8a8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down, limit: float,
                     target: str | None, swap: bool = False) -> torch.Tensor:
    """The fp32 pair rows ``[T * K, D]`` of ``moe.experts`` on FP8 x FP8 (shapes checked by the caller).
    ``swap``: the decode tiles (``moe_gemm_fp8_decode``: few pairs a tile on the N side of swapped dots)."""
    from inferhal.kernels.linear_lowp import act_quant

    t, d = x.shape
    num_experts, two_i = w_gate_up.shape[0], w_gate_up.shape[1]
    inter, topk = two_i // 2, ids.shape[1]
    cfg = config("moe_gemm_fp8_decode" if swap else "moe_gemm_fp8", target)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if bn != 128 or bk != 128:
        raise ValueError(f"moe.experts w8a8: the tuning must give 128-wide N and K tiles (h's and the weights' "
                         f"quantisation blocks), got BLOCK_N={bn}, BLOCK_K={bk}")
    y_pairs = torch.zeros((t * topk, d), dtype=torch.float32, device=x.device)
    pairs, tile_expert = align_pairs(ids, num_experts, bm)
    n_tiles = tile_expert.numel()
    if not n_tiles:
        return y_pairs
    xq, xs = act_quant(x, bk, target=target)
    hq = torch.empty((n_tiles * bm, inter), dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty((n_tiles * bm, triton.cdiv(inter, bn)), dtype=torch.float32, device=x.device)
    common = dict(DTYPE=tl_dtype(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERP=interp(), SWAP_AB=swap,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    gs, ds = w_gate_up.scale.float(), w_down.scale.float()
    launch(moe_gate_up_w8a8_kernel, (n_tiles, triton.cdiv(inter, bn)),
           xq, xs, w_gate_up.data, gs, pairs, tile_expert, hq, hs, d, inter, topk, xq.stride(0), xs.stride(0),
           *w_gate_up.data.stride(), *gs.stride(), w_gate_up.block[0], hq.stride(0), hs.stride(0), float(limit),
           **common)
    launch(moe_down_w8a8_kernel, (n_tiles, triton.cdiv(d, bn)),
           hq, hs, w_down.data, ds, pairs, tile_expert, weights.float().contiguous(), y_pairs, d, inter, hq.stride(0),
           hs.stride(0), *w_down.data.stride(), *ds.stride(), w_down.block[0], **common)
    return y_pairs
