"""Lightning indexer scores of DeepSeek-V4's CSA layers: ``indexer.scores``.

score[t, s] = sum_h weights[t, h] * weight_scale * relu(q[t, h] . key[s]) * scale over the paged
compressed keys of token t's sequence; -inf where entry s is not yet closed for t
(s >= (pos + 1) // m) or past the sequence (s >= seq_len), so ``topk.select`` pads those with -1.
The width S is the block table's reach (its columns x BS), read from shapes: the launch reads no device
value, and a tile wholly past a token's visible entries only stores -inf.

One program per (query token, tile of ``BLOCK_N`` entries): the tile's keys (gathered through the block
table) times all indexer heads of the token, ``keys[BLOCK_N, Di] @ q^T[Di, Hi]`` on the tensor cores
(M = 128 entries, N = 64 heads in V4), fp32 accumulation, then ReLU and the weighted head sum in fp32.
bf16 products are exact in fp32, so the only difference from the oracle (fp32 einsum) is the
summation order.

Two kernels, selected by the wrapper's ``decode`` argument (the cuda_sm100 backend passes
``backend.options.attn_decode``): ``split`` (default) launches ``ceil(width / (tiles * BLOCK_N))`` programs
per token, ``tiles`` growing with the width (up to ``MAX_TILES``) so that a launch keeps about
``PROGRAMS`` programs; each loads the token's queries and head weights once, scores an even share of the
tiles that hold the token's visible entries (records decoded by
:func:`~inferhal.kernels.kv_records.decode_tile`) and stores -inf over the rest of its run of ``tiles``.
The shares are cut from the visible entries, not from the width: under a CUDA graph the table (and so
the width) reaches ``max_model_len`` (16,384 columns for V4-Flash at 64K) while a short context has a few
tiles, which then go to as many programs instead of all to the first. A score never sums across entries
and each tile is the same dot wherever it runs, so the shares change no bit (batch-invariant).
``single``: one program per tile (kept to compare). Oracle: ``backends/reference/deepseek.py:indexer_scores``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import AttnBatch, IndexerParams
from inferhal.kernels.common import dot_operand, interp, launch, seq_of_token
from inferhal.kernels.kv_records import check_record_cache, decode_tile, record_args, record_row_scale, tile_args
from inferhal.kernels.tuning import DECODES
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def indexer_scores_kernel(q_ptr, k_ptr, w_ptr, o_ptr, bt_ptr, seq_ptr, pos_ptr, len_ptr,
                          H, D, BS, M_RATIO, W, stride_qt, stride_qh, stride_kb, stride_ks, stride_wt, stride_ot,
                          stride_bt, scale, weight_scale,
                          PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          INTERP: tl.constexpr, RECORD: tl.constexpr = False, CODE: tl.constexpr = 0,
                          SCALE: tl.constexpr = 0, RBLOCK: tl.constexpr = 1, CODED: tl.constexpr = 0,
                          RAW_AT: tl.constexpr = 0, SCALES_AT: tl.constexpr = 0, GROUP: tl.constexpr = 16,
                          ALIGN: tl.constexpr = 1):
    """``single``: one program per (token, tile of ``BLOCK_N`` entries)."""
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    b = tl.load(seq_ptr + t).to(tl.int64)
    qpos = tl.load(pos_ptr + t).to(tl.int32)
    n = tl.minimum(tl.load(len_ptr + b).to(tl.int32), (qpos + 1) // M_RATIO)  # visible entries
    s = n0 + tl.arange(0, BLOCK_N)
    ok = s < n
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if n0 < n:
        q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :],
                    other=0.0)  # [BLOCK_H, BLOCK_D]
        blk = tl.load(bt_ptr + b * stride_bt + s // BS, mask=ok, other=0).to(tl.int64)
        row = blk * stride_kb + (s % BS) * stride_ks
        if RECORD:  # as the split kernel: FP8 codes (exact in q's dtype) on the tensor cores, then each key's one
            # scale; FP4 keys (e2m1 x ue8m0) decode exactly into q's dtype (load_records here spilled 344 / 240 B of
            # stack on sm_90a / sm_100a for mxfp4 keys)
            k = decode_tile(k_ptr, row, ok, D, q.dtype, CODE, SCALE, RBLOCK, CODED, RAW_AT, SCALES_AT, BLOCK_D, GROUP,
                            ALIGN, SCALE == 1)
            dots = tl.dot(dot_operand(k, INTERP), dot_operand(tl.trans(q), INTERP), input_precision=PREC)
            if SCALE == 1:
                dots = dots * record_row_scale(k_ptr, row, ok, SCALES_AT)[:, None]
        else:
            k = tl.load(k_ptr + blk[:, None] * stride_kb + (s % BS)[:, None] * stride_ks + d[None, :],
                        mask=ok[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            dots = tl.dot(dot_operand(k, INTERP), dot_operand(tl.trans(q), INTERP), input_precision=PREC)  # [N, H]
        w = tl.load(w_ptr + t * stride_wt + h, mask=hm, other=0.0).to(tl.float32) * weight_scale
        acc = tl.sum(tl.maximum(dots, 0.0) * scale * w[None, :], axis=1)
    tl.store(o_ptr + t * stride_ot + s, tl.where(ok, acc, -float("inf")), mask=s < W)


@triton.jit
def indexer_split_kernel(q_ptr, k_ptr, w_ptr, o_ptr, bt_ptr, seq_ptr, pos_ptr, len_ptr, H, D, BS, M_RATIO, W, TILES,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_wt, stride_ot, stride_bt, scale,
                         weight_scale, PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, INTERP: tl.constexpr, RECORD: tl.constexpr = False,
                         CODE: tl.constexpr = 0, SCALE: tl.constexpr = 0, RBLOCK: tl.constexpr = 1,
                         CODED: tl.constexpr = 0, RAW_AT: tl.constexpr = 0, SCALES_AT: tl.constexpr = 0,
                         GROUP: tl.constexpr = 16, ALIGN: tl.constexpr = 1):
    """``split``: of token ``t``'s tiles of ``BLOCK_N`` entries, program ``pid(1)`` scores the ``pid(1)``-th of
    even runs of the tiles that hold visible entries (keys ``[BLOCK_N, D]`` times its queries ``[D, H]``, loaded
    once; ReLU, the weighted head sum in fp32) and stores -inf in the rest of its grid run ``[pid(1) * TILES,
    ...)``."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.load(seq_ptr + t).to(tl.int64)
    qpos = tl.load(pos_ptr + t).to(tl.int32)
    n = tl.minimum(tl.load(len_ptr + b).to(tl.int32), (qpos + 1) // M_RATIO)  # visible entries
    # the tiles holding visible entries are shared out over the token's programs in even runs (a short context
    # in a wide table keeps as many programs busy as it has tiles); the -inf tiles past them by the grid's runs
    j = tl.program_id(1)
    need = tl.cdiv(n, BLOCK_N)
    per = tl.cdiv(need, tl.num_programs(1))
    lo = j * per * BLOCK_N
    mid = tl.maximum(tl.minimum(tl.minimum(lo + per * BLOCK_N, W), need * BLOCK_N), lo)
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qt = tl.load(q_ptr + t * stride_qt + h[None, :] * stride_qh + d[:, None], mask=dm[:, None] & hm[None, :],
                 other=0.0)  # [BLOCK_D, BLOCK_H]
    qt = dot_operand(qt, INTERP)
    w = tl.load(w_ptr + t * stride_wt + h, mask=hm, other=0.0).to(tl.float32) * weight_scale * scale
    for n0 in range(lo, mid, BLOCK_N):
        s = n0 + tl.arange(0, BLOCK_N)
        ok = s < n
        blk = tl.load(bt_ptr + b * stride_bt + s // BS, mask=ok, other=0).to(tl.int64)
        row = blk * stride_kb + (s % BS) * stride_ks
        if RECORD:  # FP8 keys: their codes on the tensor cores, then each key's one scale; FP4: exact values
            k = decode_tile(k_ptr, row, ok, D, qt.dtype, CODE, SCALE, RBLOCK, CODED, RAW_AT, SCALES_AT, BLOCK_D,
                            GROUP, ALIGN, SCALE == 1)
        else:
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        dots = tl.dot(dot_operand(k, INTERP), qt, input_precision=PREC)  # [BLOCK_N, BLOCK_H]
        if RECORD:
            if SCALE == 1:
                dots = dots * record_row_scale(k_ptr, row, ok, SCALES_AT)[:, None]
        acc = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        tl.store(o_ptr + t * stride_ot + s, tl.where(ok, acc, -float("inf")), mask=s < W)
    hi = tl.minimum(j * TILES * BLOCK_N + TILES * BLOCK_N, W)  # the grid's run of this program
    for n0 in range(tl.minimum(tl.maximum(j * TILES, need) * BLOCK_N, hi), hi, BLOCK_N):
        s = n0 + tl.arange(0, BLOCK_N)
        tl.store(o_ptr + t * stride_ot + s, tl.full((BLOCK_N,), -float("inf"), tl.float32), mask=s < W)


def indexer_scores(q: torch.Tensor, key_cache: torch.Tensor, batch: AttnBatch, weights: torch.Tensor,
                   p: IndexerParams, *, target: str | None = None, decode: str = "split") -> torch.Tensor:
    """``indexer.scores``: q[T, Hi, Di], key_cache[NB, BS, Di], weights[T, Hi] -> scores[T, S] fp32 with
    S = block_table.shape[1] * BS (host-known, fixed under a CUDA graph's padded table); tiles past a token's
    visible entries load nothing and store -inf. ``decode``: ``split`` (runs of tiles per program) or
    ``single`` (a program per tile)."""
    if decode not in DECODES:
        raise ValueError(f"indexer.scores: decode={decode!r}; known: {', '.join(DECODES)}")
    if q.dim() != 3:
        raise ValueError(f"indexer.scores: q must be [T, Hi, Di], got shape {tuple(q.shape)}")
    t, hi, di = q.shape
    fmt = p.key_format
    if fmt is not None:
        if fmt.dims != di:
            raise ValueError(f"indexer.scores: key records of {fmt.dims} channels for q of {di}")
        check_record_cache(key_cache, fmt, "indexer.scores")
        if fmt.scale == "fp32" and fmt.num_scales != 1:
            raise ValueError(f"indexer.scores: {fmt.name} keys of {fmt.dims} channels have {fmt.num_scales} scales; the "
                             f"kernel takes one per key (at most {fmt.block} channels)")
    elif key_cache.dim() != 3 or key_cache.shape[-1] != di:
        raise ValueError(f"indexer.scores: key_cache must be [NB, BS, {di}], got {tuple(key_cache.shape)}")
    if weights.shape != (t, hi):
        raise ValueError(f"indexer.scores: weights must be [T, Hi]=({t}, {hi}), got {tuple(weights.shape)}")
    width = batch.block_table.shape[1] * key_cache.shape[1]  # the table's reach: a shape, no device read
    out = torch.empty((t, width), dtype=torch.float32, device=q.device)
    if t == 0 or width == 0 or batch.num_seqs == 0:
        return out.fill_(float("-inf"))
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key_cache.stride(-1) != 1:
        raise ValueError("indexer.scores: key_cache entries must be contiguous along Di")
    tok_seq = seq_of_token(batch, t, q.device, "indexer.scores")
    w = weights.contiguous()
    bt = batch.block_table.contiguous()
    if decode == "split":
        cfg = config("indexer_split", target)
        bn, bd = cfg["BLOCK_N"], max(16, next_pow2(di))
        tiles = split_tiles(t, triton.cdiv(width, bn), cfg)
        launch(indexer_split_kernel, (t, triton.cdiv(width, tiles * bn)),
            q, key_cache, w, out, bt, tok_seq, batch.positions.contiguous(), batch.seq_lens.contiguous(),
            hi, di, key_cache.shape[1], batch.tokens_per_slot, width, tiles, q.stride(0), q.stride(1),
            key_cache.stride(0), key_cache.stride(1), w.stride(0), out.stride(0), bt.stride(0), float(p.scale),
            float(p.weight_scale), PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_H=max(16, next_pow2(hi)),
            BLOCK_N=bn, BLOCK_D=bd, INTERP=interp(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **record_args(fmt), **tile_args(fmt, bd, key_cache))
        return out
    cfg = config("indexer_scores", target)
    bn = cfg["BLOCK_N"]
    launch(indexer_scores_kernel, (t, triton.cdiv(width, bn)),
        q, key_cache, w, out, bt, tok_seq, batch.positions.contiguous(), batch.seq_lens.contiguous(),
        hi, di, key_cache.shape[1], batch.tokens_per_slot, width, q.stride(0), q.stride(1), key_cache.stride(0),
        key_cache.stride(1), w.stride(0), out.stride(0), bt.stride(0), float(p.scale), float(p.weight_scale),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_H=max(16, next_pow2(hi)), BLOCK_N=bn,
        BLOCK_D=max(16, next_pow2(di)), INTERP=interp(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **record_args(fmt), **tile_args(fmt, max(16, next_pow2(di)), key_cache))
    return out


def split_tiles(t: int, tiles: int, cfg) -> int:
    """Tiles per program: as many as keep about ``PROGRAMS`` programs for ``t`` tokens of ``tiles`` tiles each,
    between 1 and ``MAX_TILES`` (any count gives the same bits: no score sums across tiles)."""
    return max(1, min(cfg["MAX_TILES"], (t * tiles) // cfg["PROGRAMS"]))
