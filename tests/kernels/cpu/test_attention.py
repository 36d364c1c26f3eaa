"""Paged attention over a bf16 cache (kernels/cpu/attention.c) against the reference ``attn.paged``.

Runs where the CPU kernels build, else skips with the reason. Tolerance: both sum in fp32 (the
reference over gathered fp32 keys with batched products, the kernel per key), so they differ by fp32
re-association before the single bf16 rounding of the output: one bf16 ulp, plus 1e-3 absolute for
outputs near zero (sums of terms of both signs). The conformance kit adds its own cases (GQA, MQA at
D=256, soft-capping, windows, prefill) with ``--inferhal-backend=cpu_amx``.
"""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.reference.attention import attn_paged as reference
from inferhal.core.ops.params import AttnBatch, AttnParams
from inferhal.kernels.cpu import attention, lib

ST = lib.avx512_status()
pytestmark = pytest.mark.skipif(not ST.available, reason=f"CPU kernels unavailable here: {ST.reason}")


def _batch(g, new: list[int], ctx: list[int], bs: int, nb: int):
    """Sequences with ``ctx`` keys each, the last ``new`` of them this step's rows, on shuffled blocks."""
    width = max(-(-c // bs) for c in ctx)
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(ctx), width), -1, dtype=torch.int32)
    used = 0
    for b, c in enumerate(ctx):
        n = -(-c // bs)
        table[b, :n] = perm[used: used + n].to(torch.int32)
        used += n
    qsl = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(new, ctx)])
    slots = torch.zeros_like(pos)  # not read by attention
    return AttnBatch(qsl, torch.tensor(ctx, dtype=torch.int32), pos, table, slots)


@pytest.mark.parametrize("new,ctx,window,softcap", [
    ([1] * 32, [40 + 3 * i for i in range(32)], 0, 0.0),  # Gemma 3 decode: 32 rows, MQA, D=256
    ([1] * 5, [700, 20, 513, 512, 1], 512, 0.0),  # a sliding window of 512 across block boundaries
    ([9, 1, 30], [9, 77, 50], 16, 0.0),  # prefill chunks and a decode row in one step
    ([1, 4], [33, 40], 0, 30.0),  # soft-capping
])
def test_matches_the_reference(new, ctx, window, softcap):
    g = torch.Generator().manual_seed(sum(ctx))
    bs, hk, h, d = 16, 1, 4, 256
    nb = sum(-(-c // bs) for c in ctx) + 3
    batch = _batch(g, new, ctx, bs, nb)
    cache = torch.randn(nb, bs, 2, hk, d, generator=g).bfloat16()
    q = torch.randn(sum(new), h, d, generator=g).bfloat16()
    p = AttnParams(scale=d ** -0.5 * 4, num_kv_heads=hk, window=window, softcap=softcap)
    got = attention.attn_paged(q, cache, batch, p)
    want = reference(q, cache, batch, p)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("h,hk,d", [
    (1, 1, 128),  # one head a KV head: 16 keys a tile, 8 of 16 value chunks live (the rest masked off)
    (2, 1, 64),  # 8 keys a tile, 4 of 8 chunks live
    (8, 1, 128),  # 2 keys a tile
    (16, 2, 96),  # 8 heads a KV head, D not a multiple of 32: the second KV head's keys sit D elements in
    (6, 2, 64),  # 3 heads a KV head: the plain loop
    (4, 1, 72),  # D % 16 != 0: the plain loop
])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (200, 50.0)])
def test_every_head_layout_matches_the_reference_past_the_prefetch_threshold(h, hk, d, window, softcap):
    """Spans from 1 key to past attention.c's PF_MIN (128), none a multiple of a key tile, so the tiles'
    short last tile, the prefetch ahead and its end are all reached, with and without a window."""
    g = torch.Generator().manual_seed(h * 1000 + d + window)
    bs, ctx = 16, [1, 7, 130, 333, 129, 290]
    nb = sum(-(-c // bs) for c in ctx) + 2
    batch = _batch(g, [1, 1, 3, 1, 1, 2], ctx, bs, nb)
    cache = torch.randn(nb, bs, 2, hk, d, generator=g).bfloat16()
    q = torch.randn(9, h, d, generator=g).bfloat16()
    p = AttnParams(scale=d ** -0.5, num_kv_heads=hk, window=window, softcap=softcap)
    got, want = attention.attn_paged(q, cache, batch, p), reference(q, cache, batch, p)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got == want).float().mean() > 0.95


def test_gqa_heads_read_their_own_kv_head_and_strided_queries():
    g = torch.Generator().manual_seed(7)
    bs, hk, h, d = 8, 2, 8, 64
    batch = _batch(g, [1, 1, 3], [10, 25, 3], bs, 12)
    cache = torch.randn(12, bs, 2, hk, d, generator=g).bfloat16()
    qk = torch.randn(5, h + hk, d, generator=g).bfloat16()
    q = qk[:, :h]  # a view with a row stride of (h + hk) * d, as the model slices q from q|k
    p = AttnParams(scale=0.125, num_kv_heads=hk)
    torch.testing.assert_close(attention.attn_paged(q, cache, batch, p).float(),
                               reference(q.contiguous(), cache, batch, p).float(), rtol=2 ** -7, atol=1e-3)


def test_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(8)
    batch = _batch(g, [1] * 6, [5, 17, 33, 2, 60, 9], 16, 20)
    cache = torch.randn(20, 16, 2, 1, 256, generator=g).bfloat16()
    q = torch.randn(6, 4, 256, generator=g).bfloat16()
    p = AttnParams(scale=0.0625)
    full = attention.attn_paged(q, cache, batch, p)
    sub = AttnBatch(batch.query_start_loc[2:5] - 2, batch.seq_lens[2:4], batch.positions[2:4], batch.block_table[2:4],
                    batch.slot_mapping[2:4])
    assert torch.equal(attention.attn_paged(q[2:4], cache, sub, p), full[2:4])


def test_unallocated_block_is_an_index_error():
    g = torch.Generator().manual_seed(9)
    batch = _batch(g, [1, 1], [20, 40], 16, 6)
    batch.block_table[1, 1] = -1
    cache = torch.randn(6, 16, 2, 1, 64, generator=g).bfloat16()
    q = torch.randn(2, 4, 64, generator=g).bfloat16()
    with pytest.raises(IndexError, match="query row 1 .position 39. reach a block that is not allocated"):
        attention.attn_paged(q, cache, batch, AttnParams(scale=0.1))


def test_unsupported_calls_are_refused():
    q, cache = torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 16, 2, 1, 64, dtype=torch.bfloat16)
    batch = AttnBatch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                      torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    assert attention.supports(q, cache, batch, AttnParams(scale=1.0))
    assert not attention.supports(q, cache, batch, AttnParams(scale=1.0), sinks=torch.zeros(4))
    assert not attention.supports(q.float(), cache.float(), batch, AttnParams(scale=1.0))
    assert not attention.supports(q, cache[:, :, 0], batch, AttnParams(scale=1.0, shared_kv=True))
    with pytest.raises(ValueError, match="unsupported call"):
        attention.attn_paged(q.float(), cache.float(), batch, AttnParams(scale=1.0))


def test_kv_write_matches_the_reference_on_a_strided_pool():
    from inferhal.backends.reference.ops import kv_write as ref_write

    g = torch.Generator().manual_seed(10)
    pool = torch.zeros(6, 16 * 2 * 1 * 64 + 100, dtype=torch.bfloat16)  # pages wider than this layer's slots
    cache = pool[:, : 16 * 2 * 64].view(6, 16, 2, 1, 64)
    vals = torch.randn(5, 2, 1, 64, generator=g).bfloat16()
    slots = torch.tensor([3, -1, 17, 95, 40])
    want = cache.clone()
    ref_write(vals, want, slots)
    attention.kv_write(vals, cache, slots)
    assert torch.equal(cache, want) and not pool[:, 16 * 2 * 64:].any()  # nothing written past the layer's slots
    with pytest.raises(IndexError, match="slot 96 is past the cache's 96 slots"):
        attention.kv_write(vals[:1], cache, torch.tensor([96]))
    before = cache.clone()
    with pytest.raises(IndexError, match="slot 200 is past"):  # checked before any row is written
        attention.kv_write(vals[:2], cache, torch.tensor([5, 200]))
    assert torch.equal(cache, before)
