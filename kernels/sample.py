"""Token sampling: ``sample`` (greedy, temperature, top-k, top-p, min-p) with per-row counter-based RNG.

What matches the reference (``backends/reference/ops.py:sample``) and what cannot:

- **greedy** rows (temperature <= 0) are identical: the first index of the row's maximum logit.
- **random** rows cannot reproduce ``torch.multinomial`` draws from a ``torch.Generator`` inside a
  kernel. Instead each row draws from a Philox stream keyed by ``(seed, step)``: the token is the
  Gumbel-max ``argmax_i (x_i / T + G_i)`` over the allowed tokens, ``G_i = -log(-log(u_i))`` with
  ``u_i = philox(seed, counter=(i, step))``. That is an exact sample of the filtered distribution
  (softmax of the allowed scaled logits), deterministic per (seed, step), independent of the other
  rows of the batch and of the tile sizes (the counter is the token index, not a tile offset).
  The row's key: ``p.seeds[i]`` and ``p.steps[i]`` when the batch carries them (a device engine that
  captures graphs passes them); otherwise one 62-bit integer drawn from the row's own generator
  (step 0), so the engine's generator still carries the per-step state and a seeded request repeats;
  rows without a generator draw their key from torch's default generator, as the reference does.
- **filters** are the reference's, computed without a sort: top-k keeps ``x >= kth largest`` (ties
  kept, as the reference's ``row < kth`` mask); top-p keeps the smallest prefix of the descending
  (stable: ties by lower index) order whose exclusive mass is <= top_p; min-p keeps
  ``p >= min_p * p_max``. Thresholds are exact 32-step bisections on the order-preserving int32 keys
  of the scaled logits, so only allowed tokens are ever drawn; the top-p masses are summed in
  another order than the reference's cumsum, so a token whose exclusive mass is within fp32
  rounding of top_p may be kept by one and dropped by the other.

Tiles: ``BLOCK_R`` rows x ``BLOCK_V`` tokens per program (one row per program for real vocabularies,
many for small ones); passes over the row: max, top-k bisection (skipped when no row of the tile
uses top-k), normaliser, top-p bisection (skipped likewise), draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

from inferhal.core.ops.params import SampleBatch
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.topk import ordered_key
from inferhal.kernels.tuning import config


@triton.jit
def _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V: tl.constexpr):
    c = v0 + tl.arange(0, BLOCK_V)
    ok = rm[:, None] & (c < V)[None, :]
    raw = tl.load(l_ptr + r[:, None] * stride_l + c[None, :], mask=ok, other=-float("inf"))
    x = raw * inv_t[:, None]
    return c, ok, raw, x, tl.where(ok, ordered_key(x), -2139095041).to(tl.int64)


@triton.jit
def sample_kernel(l_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, seed_ptr, step_ptr, out_ptr, B, V, stride_l,
                  BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < B
    r = r.to(tl.int64)
    temp = tl.load(t_ptr + r, mask=rm, other=0.0)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    topk = tl.load(k_ptr + r, mask=rm, other=0)
    topk = tl.where((topk > 0) & (topk < V), topk, V)
    top_p = tl.load(p_ptr + r, mask=rm, other=2.0)
    top_p = tl.where(top_p < 1.0, top_p, 2.0)  # off: every mass passes
    min_p = tl.load(mp_ptr + r, mask=rm, other=0.0)
    seed = tl.load(seed_ptr + r, mask=rm, other=0)
    step = tl.load(step_ptr + r, mask=rm, other=0).to(tl.uint32)
    # 1. row max of the scaled logits, and the greedy argmax of the raw logits (first index)
    mx = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    best = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    best_i = tl.zeros((BLOCK_R,), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
        mx = tl.maximum(mx, tl.max(x, axis=1))
        bm = tl.max(raw, axis=1)
        bi = tl.min(tl.where(raw == bm[:, None], c[None, :], V), axis=1).to(tl.int64)
        upd = bm > best
        best_i = tl.where(upd, bi, best_i)
        best = tl.where(upd, bm, best)
    mx = tl.where(mx > -float("inf"), mx, 0.0)  # padding rows / all -inf rows: no -inf - -inf below
    # 2. top-k: the k-th largest key (largest K with #(key >= K) >= k)
    kth = tl.full((BLOCK_R,), -2147483648, tl.int64)
    need_k = tl.max((rm & ~greedy & (topk < V)).to(tl.int32), axis=0)
    if need_k > 0:
        hi = tl.full((BLOCK_R,), 2147483647, tl.int64)
        for _ in range(32):
            mid = (kth + hi + 1) >> 1
            cnt = tl.zeros((BLOCK_R,), tl.int32)
            for v0 in range(0, V, BLOCK_V):
                c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
                cnt += tl.sum((ok & (key >= mid[:, None])).to(tl.int32), axis=1)
            good = cnt >= topk
            kth = tl.where(good, mid, kth)
            hi = tl.where(good, hi, mid - 1)
    # 3. normaliser of the top-k survivors
    z = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
        z += tl.sum(tl.where(ok & (key >= kth[:, None]), tl.exp(x - mx[:, None]), 0.0), axis=1)
    inv_z = 1.0 / tl.where(z > 0, z, 1.0)
    # 4. top-p: the smallest K with mass(key > K) <= top_p (a token key); its ties go in index order
    k0 = tl.full((BLOCK_R,), -2147483648, tl.int64)
    need_p = tl.max((rm & ~greedy & (top_p < 1.0)).to(tl.int32), axis=0)
    if need_p > 0:
        hi = tl.full((BLOCK_R,), 2147483647, tl.int64)
        for _ in range(32):
            mid = (k0 + hi) >> 1
            mass = tl.zeros((BLOCK_R,), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
                keep = ok & (key >= kth[:, None]) & (key > mid[:, None])
                mass += tl.sum(tl.where(keep, tl.exp(x - mx[:, None]), 0.0), axis=1) * inv_z
            good = mass <= top_p
            hi = tl.where(good, mid, hi)
            k0 = tl.where(good, k0, mid + 1)
    above = tl.zeros((BLOCK_R,), tl.float32)  # mass strictly above k0
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
        keep = ok & (key >= kth[:, None]) & (key > k0[:, None])
        above += tl.sum(tl.where(keep, tl.exp(x - mx[:, None]), 0.0), axis=1) * inv_z
    # 5. draw: Gumbel-max over the allowed tokens, counter = (token, step) in the row's Philox stream
    win = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    win_i = tl.full((BLOCK_R,), -1, tl.int64)
    ties = tl.zeros((BLOCK_R,), tl.int32)
    zero = tl.zeros((BLOCK_R, BLOCK_V), tl.uint32)
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _keys(l_ptr, r, rm, v0, B, V, stride_l, inv_t, BLOCK_V)
        e = tl.exp(x - mx[:, None])
        tie = ok & (key == k0[:, None])
        rank = ties[:, None] + tl.cumsum(tie.to(tl.int32), axis=1) - tie.to(tl.int32)
        allowed = ok & (key >= kth[:, None]) & ((key > k0[:, None]) | (tie & (above[:, None] + rank.to(tl.float32) *
                                                                            e * inv_z[:, None] <= top_p[:, None])))
        allowed = allowed & (e >= min_p[:, None])
        ties += tl.sum(tie.to(tl.int32), axis=1)
        cnt = (zero + c[None, :].to(tl.uint32))
        u, _, _, _ = philox(seed[:, None] + zero.to(tl.int64), cnt, zero + step[:, None], zero, zero)
        uf = uint_to_uniform_float(u)
        g = -tl.log(-tl.log(uf))
        s = tl.where(allowed, x + g, -float("inf"))
        bm = tl.max(s, axis=1)
        bi = tl.min(tl.where((s == bm[:, None]) & allowed, c[None, :], V), axis=1).to(tl.int64)
        upd = (bm > win) | ((win_i < 0) & (bi < V))
        win_i = tl.where(upd, bi, win_i)
        win = tl.where(upd, bm, win)
    tok = tl.where(greedy, best_i, win_i)
    tl.store(out_ptr + r, tok, mask=rm)


def _row_keys(p: SampleBatch, b: int) -> tuple[list[int], list[int]]:
    """(seed, step) per row: p.seeds/p.steps, else one draw from the row's generator (or the default one)."""
    if p.seeds:
        return [int(s) & (2**63 - 1) for s in p.seeds], [int(s) & 0xFFFFFFFF for s in (p.steps or (0,) * b)]
    seeds = []
    for i in range(b):
        if p.temperature[i] <= 0:
            seeds.append(0)
            continue
        gen = p.generators[i] if p.generators else None
        dev = gen.device if gen is not None else "cpu"
        seeds.append(int(torch.randint(0, 2**62, (1,), generator=gen, device=dev)))
    return seeds, [0] * b


def sample(logits: torch.Tensor, p: SampleBatch, *, target: str | None = None) -> torch.Tensor:
    """``sample``: logits[B, V] -> tokens[B] int64 (see the module docstring for the RNG contract)."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got shape {tuple(logits.shape)}")
    b, v = logits.shape
    if len(p.temperature) != b:
        raise ValueError(f"sample: SampleBatch has {len(p.temperature)} rows, logits {b}")
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    if b == 0:
        return out
    if v == 0:
        raise ValueError("sample: logits have an empty vocabulary (V = 0)")
    dev = logits.device
    x = logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    seeds, steps = _row_keys(p, b)
    cfg = config("sample", target)
    br = cfg["BLOCK_R"]  # fixed, never from the batch: a row's reductions keep their tile shape (batch-invariant)
    sample_kernel[(triton.cdiv(b, br),)](
        x, torch.tensor(p.temperature, dtype=torch.float32, device=dev),
        torch.tensor(p.top_k, dtype=torch.int32, device=dev), torch.tensor(p.top_p, dtype=torch.float32, device=dev),
        torch.tensor(p.min_p or (0.0,) * b, dtype=torch.float32, device=dev),
        torch.tensor(seeds, dtype=torch.int64, device=dev), torch.tensor(steps, dtype=torch.int64, device=dev),
        out, b, v, x.stride(0), BLOCK_R=br, BLOCK_V=min(cfg["BLOCK_V"], max(16, next_pow2(v))),
        num_warps=cfg["num_warps"])
    return out
