"""Expert-parallel ``moe.dispatch`` / ``moe.combine``: the index bookkeeping and the row moves in Triton, the
exchange through the communicator's variable-size all-to-all (NCCL on a GPU, gloo in the interpreter).

Plan of a dispatch (oracle: ``backends/reference/ep.py``):

1. ``ep_plan_kernel`` (one program, a loop over the T*K (token, choice) pairs in chunks): the destination
   rank of each routed pair (physical slot // slots per rank; -1 = skipped), the count per rank, then each
   pair's place in the send buffer, grouped by rank and in (t, k) order inside a rank (the reference's
   stable order): ``src[place] = pair``, ``local[place] = slot % slots per rank``, ``inv[pair] = place``
   (or -1). The places come from an exclusive prefix of the counts and, per chunk, a cumsum of the
   one-hot destinations: no sort, no atomics (deterministic).
2. host: the per-rank counts (the all-to-all's split sizes: one synchronisation, as any variable-size
   exchange needs), then ``ep_gather_kernel`` copies the routed rows x[src // K] into the send buffer;
3. the all-to-all of rows and local ids.

A combine sends the expert outputs back along the same splits and ``ep_combine_kernel`` sums, per token,
its K choices in order k = 0..K-1 (fp32, weighted by the routing weights), rounded once: through ``inv``,
no scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import DispatchResult, EPParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def ep_plan_kernel(id_ptr, src_ptr, loc_ptr, inv_ptr, cnt_ptr, NP, SPR, NR, BLOCK_P: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    rk = tl.arange(0, BLOCK_R)
    counts = tl.zeros((BLOCK_R,), tl.int32)
    for p0 in range(0, NP, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        slot = tl.load(id_ptr + i, mask=i < NP, other=-1)
        dest = tl.where(slot >= 0, slot // SPR, -1)
        hot = (dest[:, None] == rk[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_R]
        counts += tl.sum(hot, axis=0)
    tl.store(cnt_ptr + rk, counts, mask=rk < NR)
    running = tl.cumsum(counts, axis=0) - counts  # each rank's first place
    for p0 in range(0, NP, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        ok = i < NP
        slot = tl.load(id_ptr + i, mask=ok, other=-1)
        dest = tl.where(slot >= 0, slot // SPR, -1)
        hot = (dest[:, None] == rk[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # pairs of the same rank earlier in this chunk
        place = tl.sum(hot * (running[None, :] + before), axis=1)
        routed = ok & (dest >= 0)
        tl.store(src_ptr + place, i.to(tl.int64), mask=routed)
        tl.store(loc_ptr + place, (slot % SPR).to(tl.int64), mask=routed)
        tl.store(inv_ptr + i, tl.where(routed, place, -1), mask=ok)
        running += tl.sum(hot, axis=0)


@triton.jit
def ep_gather_kernel(x_ptr, src_ptr, o_ptr, K, D, stride_x, stride_o, BLOCK_D: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.load(src_ptr + j) // K
    tl.store(o_ptr + j * stride_o + d, tl.load(x_ptr + t * stride_x + d, mask=d < D), mask=d < D)


@triton.jit
def ep_combine_kernel(b_ptr, inv_ptr, w_ptr, y_ptr, K, D, stride_b, stride_y, DTYPE: tl.constexpr,
                      BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in range(0, K):
        place = tl.load(inv_ptr + t * K + k).to(tl.int64)
        w = tl.load(w_ptr + t * K + k)
        row = tl.load(b_ptr + tl.maximum(place, 0) * stride_b + d, mask=dm, other=0.0)
        acc += tl.where(place >= 0, row.to(tl.float32) * w, 0.0)  # an unrouted choice adds nothing
    tl.store(y_ptr + t * stride_y + d, round_to(acc, DTYPE, INTERP), mask=dm)


@dataclass
class EPHandle:
    """What combine needs from its dispatch: each routed pair's place in the send buffer (-1 = not routed)
    and the all-to-all's splits."""

    inv: torch.Tensor  # [T*K] int32
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int


def moe_dispatch(x: torch.Tensor, ids: torch.Tensor, comm, p: EPParams, *, target: str | None = None) -> DispatchResult:
    """``moe.dispatch``: x[T, D], ids[T, K] physical slots (-1 = skip) -> the rows this rank runs, their local
    slot ids, and the handle of ``moe.combine``."""
    t, k = ids.shape
    if p.ep_size != comm.layout.world_size:
        raise ValueError(f"moe.dispatch: EPParams.ep_size={p.ep_size} but the communicator has "
                         f"world_size={comm.layout.world_size}")
    dev = x.device
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n = flat.numel()
    src = torch.empty(n, dtype=torch.int64, device=dev)
    loc = torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty(n, dtype=torch.int32, device=dev)
    cnt = torch.zeros(p.ep_size, dtype=torch.int32, device=dev)
    if n and int(flat.max()) >= p.num_physical:
        raise ValueError(f"moe.dispatch: physical id {int(flat.max())} outside [0, {p.num_physical})")
    cfg = config("moe_ep", target)
    if n:
        ep_plan_kernel[(1,)](flat, src, loc, inv, cnt, n, p.slots_per_rank, p.ep_size,
                             BLOCK_P=min(cfg["BLOCK_P"], next_pow2(n)), BLOCK_R=max(2, next_pow2(p.ep_size)),
                             num_warps=cfg["num_warps"])
    send_counts = cnt.tolist()  # the exchange's split sizes (a host synchronisation, as the reference's)
    sent = sum(send_counts)
    d = x.shape[1]
    xs = x if x.stride(1) == 1 else x.contiguous()
    send_x = torch.empty((sent, d), dtype=x.dtype, device=dev)
    if sent and d:
        bd = min(cfg["BLOCK_D"], next_pow2(d))
        ep_gather_kernel[(sent, triton.cdiv(d, bd))](xs, src, send_x, k, d, xs.stride(0), send_x.stride(0), BLOCK_D=bd,
                                                     num_warps=cfg["num_warps"])
    recv_x = comm.all_to_all(list(send_x.split(send_counts)))
    recv_e = comm.all_to_all(list(loc[:sent].split(send_counts)))
    recv_counts = [int(c.shape[0]) for c in recv_x]
    return DispatchResult(torch.cat(recv_x), torch.cat(recv_e), EPHandle(inv, send_counts, recv_counts, t, k))


def moe_combine(y_local: torch.Tensor, weights: torch.Tensor, handle: EPHandle, comm, p: EPParams,
                *, target: str | None = None) -> torch.Tensor:
    """``moe.combine``: y_local[R, D] (dispatch's receive order) back to the source ranks, summed per token
    over its K choices in order, weighted by weights[T, K] -> y[T, D] in y_local's dtype."""
    back = torch.cat(comm.all_to_all(list(y_local.split(handle.recv_counts))))  # [N_sent, D]
    back = back if back.stride(-1) == 1 or back.numel() == 0 else back.contiguous()
    t, k, d = handle.num_tokens, handle.top_k, y_local.shape[1]
    y = torch.empty((t, d), dtype=y_local.dtype, device=y_local.device)
    if t and d:
        cfg = config("moe_ep", target)
        bd = min(cfg["BLOCK_D"], next_pow2(d))
        b = back if back.numel() else y  # every inv is -1: rows are read (row 0) but not added
        ep_combine_kernel[(t, triton.cdiv(d, bd))](b, handle.inv, weights.float().contiguous(), y, k, d,
                                                  b.stride(0), y.stride(0), DTYPE=tl_dtype(y_local.dtype), BLOCK_D=bd,
                                                  INTERP=interp(), num_warps=cfg["num_warps"])
    return y
