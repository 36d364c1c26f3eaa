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

That is the ``exact`` exchange. The ``padded`` one (``exchange=``, chosen by :func:`pick_exchange`) is what a
CUDA graph can hold, DeepEP's low-latency layout: rank r's pairs start at ``r * capacity`` instead of after the
other ranks' (the same kernel, ``CAP`` > 0), so step 2 reads nothing on the host, and one equal-split
``all_to_all_single`` moves ``[ep_size * capacity]`` rows and local ids each way; the places past a rank's
count carry local id -1 and zeros (moe.experts skips id -1; combine never reads them). The id range check is
a device assert there (:func:`_device_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import DispatchResult, EPParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import EP_EXCHANGES, config


@triton.jit
def ep_plan_kernel(id_ptr, src_ptr, loc_ptr, inv_ptr, cnt_ptr, NP, SPR, NR, CAP, BLOCK_P: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """CAP = 0: rank r's pairs start after the pairs of ranks < r (the exact layout); CAP > 0: at r * CAP (the
    padded layout), a pair past its rank's CAP places not placed (inv -1; the wrapper's device assert)."""
    rk = tl.arange(0, BLOCK_R)
    counts = tl.zeros((BLOCK_R,), tl.int32)
    for p0 in range(0, NP, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        slot = tl.load(id_ptr + i, mask=i < NP, other=-1)
        dest = tl.where(slot >= 0, slot // SPR, -1)
        hot = (dest[:, None] == rk[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_R]
        counts += tl.sum(hot, axis=0)
    tl.store(cnt_ptr + rk, counts, mask=rk < NR)
    base = tl.where(CAP > 0, rk * CAP, tl.cumsum(counts, axis=0) - counts)  # each rank's first place
    seen = tl.zeros((BLOCK_R,), tl.int32)  # pairs placed so far per rank
    for p0 in range(0, NP, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        ok = i < NP
        slot = tl.load(id_ptr + i, mask=ok, other=-1)
        dest = tl.where(slot >= 0, slot // SPR, -1)
        hot = (dest[:, None] == rk[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # pairs of the same rank earlier in this chunk
        within = tl.sum(hot * (seen[None, :] + before), axis=1)  # the pair's index among its rank's pairs
        place = tl.sum(hot * base[None, :], axis=1) + within
        routed = ok & (dest >= 0) & (within < tl.where(CAP > 0, CAP, NP + 1))
        tl.store(src_ptr + place, i.to(tl.int64), mask=routed)
        tl.store(loc_ptr + place, (slot % SPR).to(tl.int64), mask=routed)
        tl.store(inv_ptr + i, tl.where(routed, place, -1), mask=ok)
        seen += tl.sum(hot, axis=0)


@triton.jit
def ep_gather_kernel(x_ptr, src_ptr, o_ptr, K, D, stride_x, stride_o, BLOCK_D: tl.constexpr):
    """Send-buffer row ``program_id(0)``: x[src // K], or zeros where src is -1 (a padded layout's empty place)."""
    j = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    src = tl.load(src_ptr + j + tl.zeros((BLOCK_D,), tl.int64))  # the row's source, broadcast along D
    t = tl.maximum(src, 0) // K
    tl.store(o_ptr + j * stride_o + d, tl.load(x_ptr + t * stride_x + d, mask=(d < D) & (src >= 0), other=0.0),
             mask=d < D)


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
    and the all-to-all's splits (exact), or the capacity per rank (padded; the splits are then None)."""

    inv: torch.Tensor  # [T*K] int32
    send_counts: list[int] | None
    recv_counts: list[int] | None
    num_tokens: int
    top_k: int
    capacity: int = 0  # > 0: the padded exchange of [ep_size, capacity] rows


def exchange_equal(comm, buf: torch.Tensor) -> torch.Tensor:
    """buf [n * cap, ...] in n equal blocks, block r to rank r -> [n * cap, ...], block r from rank r: one
    ``all_to_all_single`` without split sizes (NCCL on a GPU, gloo on the CPU), no host read."""
    if comm.layout.world_size == 1:
        return buf
    import torch.distributed as dist

    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf.contiguous(), group=comm.group)
    return out


def pick_exchange(exchange: str, x: torch.Tensor) -> str:
    """``auto``: ``padded`` while a CUDA graph is being captured (the exact exchange's host read of the split
    sizes cannot be captured), else ``exact`` (it sends only the routed rows: ``padded`` moves ep_size x T x K
    rows, ep_size times what a balanced step routes)."""
    if exchange not in EP_EXCHANGES:
        raise ValueError(f"moe.dispatch: exchange={exchange!r}; known: {', '.join(EP_EXCHANGES)}")
    if exchange != "auto":
        return exchange
    return "padded" if x.is_cuda and torch.cuda.is_current_stream_capturing() else "exact"


def moe_dispatch(x: torch.Tensor, ids: torch.Tensor, comm, p: EPParams, *, target: str | None = None,
                 exchange: str = "auto", capacity: int | None = None) -> DispatchResult:
    """``moe.dispatch``: x[T, D], ids[T, K] physical slots (-1 = skip) -> the rows this rank runs, their local
    slot ids, and the handle of ``moe.combine``.

    ``exchange`` (:func:`pick_exchange`): ``exact`` sends each rank its routed rows, the split sizes read on the
    host; ``padded`` (capturable, DeepEP's low-latency layout) sends ``[ep_size, capacity]`` rows to every rank
    with one equal-split all-to-all, ``capacity`` = T x K (every pair could go to one rank) unless a bound is
    given (a rank's pairs past it: a device assert). Every rank must use the same capacity (the blocks are
    equal): the default needs the same T on every rank (a captured step's padded batch); shards of uneven
    sizes pass the largest shard's T x K (or a configured bound) on every rank. The received rows then hold every source rank's
    block of ``capacity`` rows, the rows past a block's count with local id -1 (and zeros), which moe.experts
    skips; a routed row's values and its expert are those of the exact exchange, so combine's output is the
    same bit for bit."""
    t, k = ids.shape
    if p.ep_size != comm.layout.world_size:
        raise ValueError(f"moe.dispatch: EPParams.ep_size={p.ep_size} but the communicator has "
                         f"world_size={comm.layout.world_size}")
    mode = pick_exchange(exchange, x)
    dev = x.device
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n = flat.numel()
    cap = 0
    if mode == "padded":
        cap = n if capacity is None else int(capacity)
        if cap < 1:
            raise ValueError(f"moe.dispatch: capacity must be >= 1, got {capacity}")
    size = p.ep_size * cap if cap else n
    src = torch.full((size,), -1, dtype=torch.int64, device=dev) if cap else torch.empty(n, dtype=torch.int64, device=dev)
    loc = torch.full((size,), -1, dtype=torch.int64, device=dev) if cap else torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty(n, dtype=torch.int32, device=dev)
    cnt = torch.zeros(p.ep_size, dtype=torch.int32, device=dev)
    if cap:
        _device_check(flat < p.num_physical, f"moe.dispatch: a physical id outside [0, {p.num_physical})")
    elif n and int(flat.max()) >= p.num_physical:
        raise ValueError(f"moe.dispatch: physical id {int(flat.max())} outside [0, {p.num_physical})")
    cfg = config("moe_ep", target)
    if n:
        ep_plan_kernel[(1,)](flat, src, loc, inv, cnt, n, p.slots_per_rank, p.ep_size, cap,
                             BLOCK_P=min(cfg["BLOCK_P"], next_pow2(n)), BLOCK_R=max(2, next_pow2(p.ep_size)),
                             num_warps=cfg["num_warps"])
    if cap:
        if capacity is not None:
            _device_check(cnt <= cap, f"moe.dispatch: a rank gets more pairs than capacity={cap}")
        return _dispatch_padded(x, src, loc, inv, comm, cap, t, k, cfg)
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


def _device_check(ok: torch.Tensor, what: str) -> None:
    """A value check without a host read: an asynchronous device assert on a GPU; the CPU checks at once."""
    try:
        torch._assert_async(ok.all(), what)
    except RuntimeError as exc:
        raise ValueError(what) from exc


def _dispatch_padded(x, src, loc, inv, comm, cap: int, t: int, k: int, cfg) -> DispatchResult:
    """The padded layout's gather and exchange: [ep_size * cap, D] rows (zeros and local id -1 past each
    rank's count) to every rank and back, shapes from T, K and ep_size only."""
    d = x.shape[1]
    xs = x if x.stride(1) == 1 else x.contiguous()
    send_x = torch.empty((src.numel(), d), dtype=x.dtype, device=x.device)
    if send_x.numel():
        bd = min(cfg["BLOCK_D"], next_pow2(d))
        ep_gather_kernel[(src.numel(), triton.cdiv(d, bd))](xs, src, send_x, k, d, xs.stride(0), send_x.stride(0),
                                                           BLOCK_D=bd, num_warps=cfg["num_warps"])
    recv_x, recv_e = exchange_equal(comm, send_x), exchange_equal(comm, loc)
    return DispatchResult(recv_x, recv_e, EPHandle(inv, None, None, t, k, capacity=cap))


def moe_combine(y_local: torch.Tensor, weights: torch.Tensor, handle: EPHandle, comm, p: EPParams,
                *, target: str | None = None) -> torch.Tensor:
    """``moe.combine``: y_local[R, D] (dispatch's receive order) back to the source ranks, summed per token
    over its K choices in order, weighted by weights[T, K] -> y[T, D] in y_local's dtype."""
    if handle.capacity:  # padded: the same equal blocks back (rows past a block's count are never read)
        back = exchange_equal(comm, y_local)
    else:
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
