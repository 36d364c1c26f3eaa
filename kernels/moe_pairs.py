"""The (token, choice) pairs of a MoE step grouped by expert into M-tiles (host side), and a tile's rows (device
side): what the widening kernels (:mod:`.moe_experts`) and the FP8 x FP8 ones (:mod:`.moe_fp8`) share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels import runtime as _runtime  # noqa: F401  (the mode is fixed before the jit below)


@triton.jit
def tile_pairs(pair_ptr, tile_e_ptr, TOPK, BLOCK_M: tl.constexpr):
    """M-tile ``program_id(0)``'s rows, their pairs (-1: padding), validity, tokens (0 for padding) and expert."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    rvalid = pair >= 0
    tok = tl.where(rvalid, pair // TOPK, 0).to(tl.int64)
    return rows, pair, rvalid, tok, tl.load(tile_e_ptr + tile).to(tl.int64)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the (token, choice) pairs by expert, each group padded to ``block_m`` rows.

    -> (pairs[Mpad] int32: flat pair index t*K+k or -1 for padding, tile_expert[Mpad/block_m] int32).
    Pairs with an id outside [0, E) (EP-remote experts) are dropped.
    """
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    nvalid = int(counts.sum())
    start = torch.cumsum(counts, 0) - counts
    start_pad = (torch.cumsum(tiles, 0) - tiles) * block_m
    total = int(tiles.sum()) * block_m
    pairs = torch.full((total,), -1, dtype=torch.int32, device=ids.device)
    srt = order[:nvalid]
    ex = key[srt]
    dest = start_pad[ex] + torch.arange(nvalid, device=ids.device) - start[ex]
    pairs[dest] = srt.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device, dtype=torch.int32), tiles)
    return pairs, tile_expert
