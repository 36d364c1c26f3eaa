"""The (token, choice) pairs of a MoE step grouped by expert into M-tiles (launch side, no host read), and a
tile's rows (device side): what the widening kernels (:mod:`.moe_experts`) and the FP8 x FP8 ones (:mod:`.moe_fp8`) share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels import runtime as _runtime  # noqa: F401  (the mode is fixed before the jit below)


@triton.jit
def tile_pairs(pair_ptr, tile_e_ptr, TOPK, BLOCK_M: tl.constexpr):
    """M-tile ``program_id(0)``'s rows, their pairs (-1: padding), validity, tokens (0 for padding) and expert
    (-1 past the step's tiles: the kernel returns at once, see :func:`align_pairs`)."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    rvalid = pair >= 0
    tok = tl.where(rvalid, pair // TOPK, 0).to(tl.int64)
    return rows, pair, rvalid, tok, tl.load(tile_e_ptr + tile).to(tl.int64)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound, known on the host, of the M-tiles ``num_pairs`` pairs fill when each expert's group is
    padded to ``block_m`` rows: sum_e ceil(c_e / BM) <= sum_e (floor(c_e / BM) + 1) over the experts that
    have a pair, <= floor(pairs / BM) + min(E, pairs)."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the (token, choice) pairs by expert, each group padded to ``block_m`` rows, with no host read
    (a CUDA graph can capture it): the buffers have :func:`max_tiles` tiles, a size from ``ids``' shape
    alone, and the tiles past the step's own hold expert -1 (the kernels' programs there return at once).

    -> (pairs[max_tiles * block_m] int32: flat pair index t*K+k or -1 for padding,
    tile_expert[max_tiles] int32: the tile's expert, -1 past the last tile).
    Pairs with an id outside [0, E) (EP-remote experts) are dropped.
    """
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), ids.device
    bound = max_tiles(n, num_experts, block_m)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # [n]: E for a dropped pair
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    tiles = (counts[:num_experts] + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)  # [E]: each expert's last tile + 1
    start_pad = torch.cat((ends - tiles, ends.new_zeros(1))) * block_m  # [E+1]: its first row
    start = torch.cumsum(counts, 0) - counts  # [E+1]: its first pair in sorted order
    order = torch.argsort(key, stable=True)
    ex = key[order]
    dump = bound * block_m  # one spare row takes the dropped pairs' writes
    dest = torch.where(ex < num_experts, start_pad[ex] + torch.arange(n, device=dev) - start[ex], dump)
    pairs = torch.full((dump + 1,), -1, dtype=torch.int32, device=dev)
    pairs[dest] = order.to(torch.int32)
    tile_expert = torch.searchsorted(ends, torch.arange(bound, device=dev), right=True).to(torch.int32)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return pairs[:dump], tile_expert
