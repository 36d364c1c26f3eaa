"""``spec.verify``: speculative decoding's verification of S draft tokens against the target's S+1 logits,
one program per row (a row never sees the batch: batch-invariant). Oracle:
``backends/reference/spec.py:spec_verify``.

- **greedy** rows (temperature <= 0) equal the reference exactly: the longest draft prefix equal to the
  target's argmax (first index on ties, NaN the largest), then the argmax at the first mismatch, or the
  bonus argmax when every draft stands.
- **random** rows run the standard rejection sampler against the distribution ``sample`` draws from
  (temperature, then top-k, top-p, min-p, renormalised; the filters computed as :mod:`.sample` computes
  them, by exact bisections on order-preserving int32 keys): accept draft d with probability
  min(1, p(d) / q(d)) (q = the draft's distribution, or one-hot for a deterministic drafter), else draw
  from norm(max(0, p - q)) (p itself when that is empty); the bonus token draws from p. A kernel cannot
  reproduce ``torch.Generator`` draws: the uniforms come from the row's Philox stream keyed as in
  :mod:`.sample` (``p.seeds`` / ``p.steps``, else one key drawn from the row's generator), counter
  (position, step, 0xFFFFFFFF) for acceptance and (token, step, 1 + position) for the Gumbel-max draws.
  The output is distributed as the reference's (an exact sampler), not equal draw for draw; greedy rows are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

from inferhal.core.ops.params import SampleBatch
from inferhal.kernels.linear import _tile_argmax
from inferhal.kernels.sample import _row_keys
from inferhal.kernels.topk import ordered_key
from inferhal.kernels.tuning import config

_LOWEST_KEY = tl.constexpr(-2139095041)  # ordered_key(-inf)


@triton.jit
def _chunk(l_ptr, v0, V, inv_t, BLOCK_V: tl.constexpr):
    c = v0 + tl.arange(0, BLOCK_V)
    ok = c < V
    raw = tl.load(l_ptr + c, mask=ok, other=-float("inf"))
    x = raw * inv_t
    return c, ok, raw, x, tl.where(ok, ordered_key(x), _LOWEST_KEY).to(tl.int64)


@triton.jit
def _argmax(l_ptr, V, BLOCK_V: tl.constexpr):
    """First index of the row's max (NaN the largest) over V logits."""
    best = -float("inf")
    best_i = V
    nan_i = V
    for v0 in range(0, V, BLOCK_V):
        c = v0 + tl.arange(0, BLOCK_V)
        raw = tl.load(l_ptr + c, mask=c < V, other=-float("inf"))
        m, i = _tile_argmax(raw[None, :], c[None, :], V)
        m = tl.sum(m, axis=0)
        i = tl.sum(i, axis=0)
        nan_i = tl.where((m != m) & (nan_i == V), i, nan_i)
        upd = (m == m) & (m > best)
        best_i = tl.where(upd, i, best_i)
        best = tl.where(upd, m, best)
    return tl.where(nan_i < V, nan_i, best_i)


@triton.jit
def _filter(l_ptr, V, inv_t, topk, top_p, BLOCK_V: tl.constexpr):
    """The filters of ``sample`` for one row: (max of x = logit / T, top-k's k-th key, top-p's key and the
    mass strictly above it, 1 / the top-k normaliser)."""
    mx = -float("inf")
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _chunk(l_ptr, v0, V, inv_t, BLOCK_V)
        mx = tl.maximum(mx, tl.max(x, axis=0))
    mx = tl.where(mx > -float("inf"), mx, 0.0)
    kth = tl.full((), -2147483648, tl.int64)
    if topk < V:
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(32):
            mid = (kth + hi + 1) >> 1
            cnt = 0
            for v0 in range(0, V, BLOCK_V):
                c, ok, raw, x, key = _chunk(l_ptr, v0, V, inv_t, BLOCK_V)
                cnt += tl.sum((ok & (key >= mid)).to(tl.int32), axis=0)
            good = cnt >= topk
            kth = tl.where(good, mid, kth)
            hi = tl.where(good, hi, mid - 1)
    z = 0.0
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _chunk(l_ptr, v0, V, inv_t, BLOCK_V)
        z += tl.sum(tl.where(ok & (key >= kth), tl.exp(x - mx), 0.0), axis=0)
    inv_z = 1.0 / tl.where(z > 0, z, 1.0)
    k0 = tl.full((), -2147483648, tl.int64)
    if top_p < 1.0:
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(32):
            mid = (k0 + hi) >> 1
            mass = 0.0
            for v0 in range(0, V, BLOCK_V):
                c, ok, raw, x, key = _chunk(l_ptr, v0, V, inv_t, BLOCK_V)
                keep = ok & (key >= kth) & (key > mid)
                mass += tl.sum(tl.where(keep, tl.exp(x - mx), 0.0), axis=0) * inv_z
            good = mass <= top_p
            hi = tl.where(good, mid, hi)
            k0 = tl.where(good, k0, mid + 1)
    above = 0.0
    for v0 in range(0, V, BLOCK_V):
        c, ok, raw, x, key = _chunk(l_ptr, v0, V, inv_t, BLOCK_V)
        keep = ok & (key >= kth) & (key > k0)
        above += tl.sum(tl.where(keep, tl.exp(x - mx), 0.0), axis=0) * inv_z
    return mx, kth, k0, above, inv_z


@triton.jit
def _allowed(ok, key, e, ties, kth, k0, above, inv_z, top_p, min_p):
    """The tokens ``sample`` may draw in one chunk (top-k, top-p with its ties in index order, min-p), and
    the running count of top-p's tied keys."""
    tie = ok & (key == k0)
    rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
    allowed = ok & (key >= kth) & ((key > k0) | (tie & (above + rank.to(tl.float32) * e * inv_z <= top_p)))
    return allowed & (e >= min_p), ties + tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _gumbel(seed, c, step, pos):
    zero = c.to(tl.uint32) * 0
    u, _, _, _ = philox(seed + zero.to(tl.int64), c.to(tl.uint32), zero + step, zero + 1 + pos, zero)
    return -tl.log(-tl.log(uint_to_uniform_float(u)))


@triton.jit
def spec_verify_kernel(d_ptr, q_ptr, l_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, seed_ptr, step_ptr, out_ptr, n_ptr,
                       S, V, stride_db, stride_qb, stride_qs, stride_lb, stride_ls, HAS_Q: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    temp = tl.load(t_ptr + r)
    greedy = temp <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    topk = tl.load(k_ptr + r)
    topk = tl.where((topk > 0) & (topk < V), topk, V)
    top_p = tl.load(p_ptr + r)
    top_p = tl.where(top_p < 1.0, top_p, 2.0)  # off: every mass passes
    min_p = tl.load(mp_ptr + r)
    seed = tl.load(seed_ptr + r)
    step = tl.load(step_ptr + r).to(tl.uint32)
    alive = 1
    n = tl.zeros((), tl.int64)
    for k in range(0, S + 1):
        if alive != 0:
            row = l_ptr + r * stride_lb + k * stride_ls
            live = (tl.zeros((), tl.int32) + k) < S  # a draft position (else the bonus)
            kq = tl.maximum(tl.minimum(k, S - 1), 0)
            d = tl.load(d_ptr + r * stride_db + kq, mask=live, other=-1)
            if greedy:
                tok = _argmax(row, V, BLOCK_V).to(tl.int64)
                stop = ~live | (tok != d)
            else:
                mx, kth, k0, above, inv_z = _filter(row, V, inv_t, topk, top_p, BLOCK_V)
                # the allowed mass (p's normaliser after every filter) and p(d) before normalising
                za = 0.0
                ed = 0.0
                ties = 0
                for v0 in range(0, V, BLOCK_V):
                    c, ok, raw, x, key = _chunk(row, v0, V, inv_t, BLOCK_V)
                    e = tl.exp(x - mx)
                    allowed, ties = _allowed(ok, key, e, ties, kth, k0, above, inv_z, top_p, min_p)
                    za += tl.sum(tl.where(allowed, e, 0.0), axis=0)
                    ed += tl.sum(tl.where(allowed & (c == d), e, 0.0), axis=0)
                inv_za = 1.0 / tl.where(za > 0, za, 1.0)
                qd = 1.0
                if HAS_Q:
                    qd = tl.load(q_ptr + r * stride_qb + kq * stride_qs + tl.maximum(d, 0), mask=live, other=1.0)
                cnt = (tl.zeros((), tl.int32) + k).to(tl.uint32)
                u, _, _, _ = philox(seed, cnt, step, tl.full((), 0xFFFFFFFF, tl.uint32), tl.full((), 0, tl.uint32))
                accept = live & (uint_to_uniform_float(u) * qd < ed * inv_za)
                rejected = ~accept
                # not accepted: a draw from norm(max(0, p - q)) (the bonus: from p), by Gumbel-max over its logs
                win = -float("inf")
                win_i = -1
                pwin = -float("inf")
                pwin_i = -1
                ties = 0
                if rejected:
                    for v0 in range(0, V, BLOCK_V):
                        c, ok, raw, x, key = _chunk(row, v0, V, inv_t, BLOCK_V)
                        e = tl.exp(x - mx)
                        allowed, ties = _allowed(ok, key, e, ties, kth, k0, above, inv_z, top_p, min_p)
                        pr = tl.where(allowed, e * inv_za, 0.0)
                        if HAS_Q:
                            q = tl.load(q_ptr + r * stride_qb + kq * stride_qs + c, mask=ok, other=0.0)
                            q = tl.where(live, q, 0.0)
                        else:
                            q = tl.where((c == d) & live, 1.0, 0.0)
                        res = tl.maximum(pr - q, 0.0)
                        g = _gumbel(seed, c, step, k)
                        s = tl.where(res > 0, tl.log(tl.where(res > 0, res, 1.0)) + g, -float("inf"))
                        bm = tl.max(s, axis=0)
                        bi = tl.min(tl.where((s == bm) & (res > 0), c, V), axis=0)
                        upd = (bm > win) | ((win_i < 0) & (bi < V))
                        win_i = tl.where(upd, bi, win_i)
                        win = tl.where(upd, bm, win)
                        sp = tl.where(allowed, x + g, -float("inf"))  # p itself, when the residual is empty
                        bm = tl.max(sp, axis=0)
                        bi = tl.min(tl.where((sp == bm) & allowed, c, V), axis=0)
                        upd = (bm > pwin) | ((pwin_i < 0) & (bi < V))
                        pwin_i = tl.where(upd, bi, pwin_i)
                        pwin = tl.where(upd, bm, pwin)
                tok = tl.where(accept, d, tl.where(win_i >= 0, win_i, pwin_i).to(tl.int64))
                stop = rejected
            tl.store(out_ptr + r * (S + 1) + k, tok)
            n = tl.zeros((), tl.int64) + k + 1
            alive = tl.where(stop, 0, 1)
    tl.store(n_ptr + r, n)


def spec_verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                p: SampleBatch, *, target: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec.verify``: draft_ids [B, S], draft_probs [B, S, V] | None, target_logits [B, S+1, V] ->
    (tokens [B, S+1] int64, -1 padded; n_emitted [B] int64 = accepted drafts + 1)."""
    b, s = draft_ids.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (b, s + 1):
        raise ValueError(f"spec.verify: target_logits must be [B={b}, S+1={s + 1}, V], got {tuple(target_logits.shape)}")
    if len(p.temperature) != b:
        raise ValueError(f"spec.verify: SampleBatch has {len(p.temperature)} rows, drafts {b}")
    v = target_logits.shape[2]
    dev = target_logits.device
    out = torch.full((b, s + 1), -1, dtype=torch.long, device=dev)
    n = torch.zeros(b, dtype=torch.long, device=dev)
    if b == 0:
        return out, n
    lg = target_logits.float()
    if lg.stride(2) != 1:
        lg = lg.contiguous()
    drafts = draft_ids.to(torch.long).contiguous()
    q = None
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (b, s, v):
            raise ValueError(f"spec.verify: draft_probs must be [B={b}, S={s}, V={v}], got {tuple(draft_probs.shape)}")
        q = draft_probs.float().contiguous()
    seeds, steps = _row_keys(p, b)
    cfg = config("spec_verify", target)
    f32 = lambda vals: torch.tensor(vals, dtype=torch.float32, device=dev)  # noqa: E731
    spec_verify_kernel[(b,)](
        drafts, q if q is not None else lg, lg, f32(p.temperature), torch.tensor(p.top_k, dtype=torch.int32, device=dev),
        f32(p.top_p), f32(p.min_p or (0.0,) * b), torch.tensor(seeds, dtype=torch.int64, device=dev),
        torch.tensor(steps, dtype=torch.int64, device=dev), out, n, s, v, drafts.stride(0),
        q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0, lg.stride(0), lg.stride(1),
        HAS_Q=q is not None, BLOCK_V=min(cfg["BLOCK_V"], max(16, triton.next_power_of_2(v))),
        num_warps=cfg["num_warps"])
    return out, n
