"""The reference ops against independent formulations (torch SDPA, closed forms, round trips)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferhal.backends.reference import ops as R
from inferhal.backends.reference import sampling as S
from inferhal.backends.reference import attention
from inferhal.backends.reference.attention import attn_paged
from inferhal.backends.reference.spec import spec_verify
from inferhal.core.ops.params import AttnParams, KVWriteParams, RmsNormParams, RopeParams, SampleBatch
from inferhal.core.ops.quantize import dequantize, quantize_fp8_block
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_and_unit_offset(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=g)
    y, h = R.norm_rms(x, w, RmsNormParams(eps=1e-5, unit_offset=True), residual=r)
    hf = x.float() + r.float()
    ref = hf / torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + w)
    assert h.dtype == dtype and y.dtype == dtype
    # bf16: one rounding of the output (8 mantissa bits) plus the residual add in bf16
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_rope_rows_kept_for_a_step_follow_positions_and_tables_changed_in_place():
    # every layer of a step rotates at the same positions, so their cos/sin rows are gathered once and kept;
    # a positions tensor or table written in place (a caller reusing buffers) must be gathered afresh
    ang = torch.arange(32).float()[:, None] * torch.tensor([1.0, 0.1])[None]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    x = torch.randn(4, 2, 4)
    p = RopeParams(rotary_dim=4)
    pos = torch.tensor([0, 5, 9, 17])
    first = R.rope_apply(x, pos, cos_sin, p)
    assert torch.equal(R.rope_apply(x, pos, cos_sin, p), first)
    pos += 3
    torch.testing.assert_close(R.rope_apply(x, pos, cos_sin, p), R.rope_apply(x, pos.clone(), cos_sin, p), rtol=0, atol=0)
    assert not torch.equal(R.rope_apply(x, pos, cos_sin, p), first)
    cos_sin[:, :2] = 1.0
    cos_sin[:, 2:] = 0.0  # the identity rotation
    torch.testing.assert_close(R.rope_apply(x, pos, cos_sin, p), x, rtol=0, atol=0)


def test_rope_neox_matches_complex_rotation_and_inverse_undoes_it():
    t, h, d, r = 7, 3, 16, 8
    pos = torch.arange(t) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    ang = torch.arange(64).float()[:, None] * inv[None]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    x = torch.randn(t, h, d)
    for style in ("neox", "interleaved"):
        for placement in ("head", "tail"):
            p = RopeParams(rotary_dim=r, style=style, placement=placement)
            y = R.rope_apply(x, pos, cos_sin, p)
            back = R.rope_apply(y, pos, cos_sin, RopeParams(r, style, placement, inverse=True))
            torch.testing.assert_close(back, x, atol=1e-5, rtol=0)
            rot = x[..., :r] if placement == "head" else x[..., -r:]
            if style == "neox":
                z = torch.complex(rot[..., : r // 2], rot[..., r // 2 :])
            else:
                z = torch.complex(rot[..., 0::2], rot[..., 1::2])
            zr = z * torch.polar(torch.ones_like(ang[pos]), ang[pos])[:, None]
            got = y[..., :r] if placement == "head" else y[..., -r:]
            want = torch.cat((zr.real, zr.imag), -1) if style == "neox" else torch.stack((zr.real, zr.imag), -1).flatten(-2)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gather", ["every row", "decode rows"])
@pytest.mark.parametrize("window,shared,sinks", [(0, False, False), (5, False, True), (0, True, True), (3, True, False)])
def test_paged_attention_equals_dense_masked_attention(window, shared, sinks, gather, monkeypatch):
    # "every row": the whole batch in one padded gather (small batches); "decode rows": a gather budget so
    # small that only single-token rows are gathered together and each prefill chunk runs on its own
    if gather == "decode rows":
        monkeypatch.setattr(attention, "GATHER_BYTES", 4 * 64 * 4)
    g = torch.Generator().manual_seed(1)
    bs, h, hk, d = 4, 4, 2 if not shared else 1, 8
    slot = (hk, d) if shared else (2, hk, d)
    spec = KVGroupSpec("g", "full", (0,), slot, torch.float32)
    # (cached, new) per sequence: prefill chunks and decode rows (one new token) of different spans, so the
    # per-sequence path and the padded decode gather (window-clipped per row) run in one call
    lens = [(0, 11), (6, 1), (3, 5), (9, 1), (0, 1)]
    blocks = [[7, 2, 5], [1, 4], [0, 3], [8, 10, 9], [11]]
    seqs = [SeqSlice(c, n, {"g": b}) for (c, n), b in zip(lens, blocks)]
    _, _, ab = build_attn_batches([spec], bs, seqs)
    cache = torch.zeros(12, bs, *slot)
    full_kv = [torch.randn(c + n, *slot, generator=g) for c, n in lens]
    for (c, n), b, kv in zip(lens, blocks, full_kv):  # write the whole context (cached + new) into the pages
        _, _, one = build_attn_batches([spec], bs, [SeqSlice(0, c + n, {"g": b})])
        R.kv_write(kv, cache, one["g"].slot_mapping)
    t = sum(n for _, n in lens)
    q = torch.randn(t, h, d, generator=g)
    sink = torch.randn(h, generator=g) if sinks else None
    p = AttnParams(scale=d ** -0.5, num_kv_heads=hk, window=window, shared_kv=shared)
    out = attn_paged(q, cache, ab["g"], p, sink)
    assert attention._plan(ab["g"], window, cache).all_rows == (gather == "every row")
    start = 0
    for (c, n), kv in zip(lens, full_kv):
        k, v = (kv, kv) if shared else (kv[:, 0], kv[:, 1])
        qq = q[start : start + n]
        logits = torch.einsum("thd,shd->hts", qq, k.repeat_interleave(h // hk, 1)) * p.scale
        qpos = torch.arange(c, c + n)[:, None]
        kpos = torch.arange(c + n)[None]
        mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks:
            logits = torch.cat((logits, sink.view(h, 1, 1).expand(h, n, 1)), -1)
        probs = logits.softmax(-1)[..., : c + n]
        ref = torch.einsum("hts,shd->thd", probs, v.repeat_interleave(h // hk, 1))
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_paged_attention_without_sinks_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    spec = KVGroupSpec("g", "full", (0,), (2, 2, 16), torch.float32)
    _, _, ab = build_attn_batches([spec], 8, [SeqSlice(0, 19, {"g": [2, 0, 1]})])
    cache = torch.zeros(3, 8, 2, 2, 16)
    kv = torch.randn(19, 2, 2, 16, generator=g)
    R.kv_write(kv, cache, ab["g"].slot_mapping)
    q = torch.randn(19, 4, 16, generator=g)
    out = attn_paged(q, cache, ab["g"], AttnParams(scale=0.25, num_kv_heads=2))
    k = kv[:, 0].repeat_interleave(2, 1).transpose(0, 1)
    v = kv[:, 1].repeat_interleave(2, 1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_decode_plan_follows_batches_changed_in_place_and_garbage_in_masked_slots():
    # The decode gather plan is shared by the layers of one batch; a batch whose tensors change in place
    # (a caller reusing its buffers) must be planned afresh, and under inference mode (no version counters)
    # every call plans for itself. NaN in slots no row may see must not reach the output.
    g = torch.Generator().manual_seed(3)
    spec = KVGroupSpec("g", "full", (0,), (2, 1, 8), torch.float32)
    seqs = [SeqSlice(5, 1, {"g": [0, 1]}), SeqSlice(2, 1, {"g": [2]})]
    _, _, ab = build_attn_batches([spec], 4, seqs)
    cache = torch.randn(4, 4, 2, 1, 8, generator=g)
    cache[2, 3:] = float("nan")  # past sequence 1's 3 entries, inside the padded span of the batch
    q = torch.randn(2, 2, 8, generator=g)
    p = AttnParams(scale=0.3, num_kv_heads=1)

    def fresh():
        _, _, again = build_attn_batches([spec], 4, [SeqSlice(5, 1, {"g": list(b)}) if i == 0 else s
                                                     for i, (s, b) in enumerate(zip(seqs, ([3, 1], None)))])
        return attn_paged(q, cache, again["g"], p)

    first = attn_paged(q, cache, ab["g"], p)
    assert torch.isfinite(first).all()
    ab["g"].block_table[0, 0] = 3  # in place: sequence 0's first block is now block 3
    moved = attn_paged(q, cache, ab["g"], p)
    assert not torch.equal(moved, first)
    torch.testing.assert_close(moved, fresh(), rtol=0, atol=0)
    with torch.inference_mode():
        _, _, inf = build_attn_batches([spec], 4, seqs)
        torch.testing.assert_close(attn_paged(q, cache, inf["g"], p), first, rtol=0, atol=0)


def test_paged_attention_refuses_a_released_block_it_needs():
    spec = KVGroupSpec("g", "full", (0,), (1, 4), torch.float32)
    _, _, ab = build_attn_batches([spec], 4, [SeqSlice(8, 1, {"g": [-1, -1, 0]})])
    with pytest.raises(IndexError, match="not allocated"):
        attn_paged(torch.randn(1, 1, 4), torch.zeros(1, 4, 1, 4), ab["g"], AttnParams(scale=1.0, shared_kv=True))
    # with a window that stays inside the live block it runs
    attn_paged(torch.randn(1, 1, 4), torch.zeros(1, 4, 1, 4), ab["g"], AttnParams(scale=1.0, shared_kv=True, window=1))


def test_linear_dequantises_quantised_weights():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 256, generator=g), torch.randn(64, 256, generator=g)
    q = quantize_fp8_block(w)
    torch.testing.assert_close(R.linear(x, q), x @ dequantize(q).T, atol=1e-4, rtol=1e-4)


def test_kv_write_fp8_stores_scaled_entries_and_skips_minus_one():
    cache = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(2, 4)
    v = torch.randn(3, 8) * 10
    R.kv_write(v, cache, torch.tensor([5, -1, 0]), KVWriteParams(quant="fp8"), scale_cache=scales)
    back = cache.float() * scales[..., None]
    torch.testing.assert_close(back[1, 1], v[0], atol=0, rtol=2 ** -3)
    torch.testing.assert_close(back[0, 0], v[2], atol=0, rtol=2 ** -3)
    assert scales.count_nonzero() == 2


def test_topk_select_breaks_ties_by_lower_index_and_pads():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 9.0]])
    assert R.topk_select(s, 2).tolist() == [[1, 2], [3, 0]]
    assert R.topk_select(s, 3, valid_len=torch.tensor([2, 4])).tolist() == [[1, 0, -1], [3, 0, 2]]


def test_sample_is_greedy_at_zero_temperature_and_seeded_rows_ignore_the_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g)
    greedy = R.sample(logits, SampleBatch((0.0,) * 3, (0,) * 3, (1.0,) * 3))
    assert torch.equal(greedy, logits.argmax(-1))

    def draw(rows):
        gens = tuple(torch.Generator().manual_seed(42) for _ in rows)
        return R.sample(logits[rows], SampleBatch((0.8,) * len(rows), (10,) * len(rows), (0.9,) * len(rows), gens))

    alone = draw([1])
    in_batch = draw([0, 1, 2])
    assert alone[0] == in_batch[1]


@pytest.mark.parametrize("v", [10, S.ARGMAX_CHUNK, 3 * S.ARGMAX_CHUNK, 3 * S.ARGMAX_CHUNK + 17])
def test_argmax_rows_equals_torch_argmax_with_ties_tails_and_nan(v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g)
    x[1] = 0.0  # all tied: index 0
    x[2, [3, v - 1]] = 50.0  # tie across chunks (and the tail): the first
    x[3, v - 1] = 60.0  # the max in the last element (the tail when there is one)
    x[4, [v // 2, v - 2]] = float("nan")  # NaN wins, the first one
    x[5, -1] = float("nan")
    x[6, 0] = float("inf")
    x[7, [v - 1, v // 3]] = float("inf")
    x[8] = float("-inf")
    torch.testing.assert_close(R.argmax_rows(x), torch.argmax(x, dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(R.argmax_rows(x[:, : v - 1]), torch.argmax(x[:, : v - 1], dim=-1), rtol=0, atol=0)


def test_sample_top_k_and_top_p_only_draw_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(R.sample(logits, SampleBatch((1.0,), (0,), (0.7,), (gen,)))) for _ in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut
    seen = {int(R.sample(logits, SampleBatch((1.0,), (1,), (1.0,), (gen,)))) for _ in range(50)}
    assert seen == {0}


def test_moe_route_scorings_and_hash():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus"):
        w, ids = R.OPS["moe.route"](logits, __import__("inferhal.core.ops.params", fromlist=["RouteParams"]).RouteParams(
            top_k=2, scoring=scoring, routed_scaling=1.5))
        assert sorted(ids[0].tolist()) == [1, 3]
        torch.testing.assert_close(w.sum(), torch.tensor(1.5))
    from inferhal.core.ops.params import RouteParams

    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])
    w, ids = R.OPS["moe.route"](logits, RouteParams(top_k=1, scoring="sigmoid", renormalize=False), bias=bias)
    assert ids.tolist() == [[2]] and torch.allclose(w, torch.sigmoid(torch.tensor([[-1.0]])))  # bias only chooses
    w, ids = R.OPS["moe.route"](logits, RouteParams(top_k=2), hash_ids=torch.tensor([[0, 2]]))
    assert ids.tolist() == [[0, 2]]


def test_spec_verify_greedy_accepts_the_matching_prefix():
    v = 6
    target = torch.full((1, 4, v), -5.0)
    for i, t in enumerate([2, 4, 1, 3]):
        target[0, i, t] = 5.0
    out, n = spec_verify(torch.tensor([[2, 4, 0]]), None, target, SampleBatch((0.0,), (0,), (1.0,)))
    assert n.tolist() == [3] and out.tolist() == [[2, 4, 1, -1]]
    out, n = spec_verify(torch.tensor([[2, 4, 1]]), None, target, SampleBatch((0.0,), (0,), (1.0,)))
    assert n.tolist() == [4] and out.tolist() == [[2, 4, 1, 3]]


def test_spec_verify_sampling_preserves_the_target_distribution():
    torch.manual_seed(0)
    p_target = torch.tensor([0.6, 0.3, 0.1])
    q_draft = torch.tensor([0.2, 0.2, 0.6])
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(3)
    for _ in range(3000):
        d = torch.multinomial(q_draft, 1, generator=gen)
        out, _ = spec_verify(d.view(1, 1), q_draft.view(1, 1, 3), p_target.log().view(1, 1, 3).expand(1, 2, 3),
                             SampleBatch((1.0,), (0,), (1.0,), (gen,)))
        counts[out[0, 0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, p_target, atol=0.03), freq  # 3000 draws: 3 sigma ~ 0.027


@pytest.mark.parametrize("draft, top_k, top_p", [(0, 0, 1.0), (3, 2, 1.0), (1, 0, 0.7)])
def test_spec_verify_one_hot_drafts_keep_the_filtered_distribution(draft, top_k, top_p):
    # an n-gram draft is deterministic (q = one-hot); what comes out must be what `sample` would draw with
    # the same temperature, top-k and top-p, whether the draft is likely, filtered out or cut by top-p
    logits = torch.tensor([1.2, 0.9, 0.1, -0.4]) * 2.0
    p = SampleBatch((0.7,), (top_k,), (top_p,), (torch.Generator().manual_seed(3),))
    want = R.filtered_probs(logits, p, 0)
    counts = torch.zeros(4)
    for _ in range(3000):
        out, n = spec_verify(torch.tensor([[draft]]), None, logits.expand(1, 2, 4), p)
        counts[out[0, 0]] += 1
        assert (out[0, 0] == draft) == (n[0] == 2)
    freq = counts / counts.sum()
    assert torch.allclose(freq, want, atol=0.03), (freq, want)  # 3000 draws: 3 sigma <= 0.027
    assert all(freq[i] == 0 for i in range(4) if want[i] == 0)  # filtered tokens never appear, drafted or not


def test_sample_mask_sets_minus_inf_where_the_bit_is_zero():
    from inferhal.backends.reference.ops import sample_mask

    logits = torch.arange(2 * 40, dtype=torch.float32).view(2, 40)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | -(1 << 31)  # tokens 3 and 31 (bit 31 is the int32 sign bit)
    mask[0, 1] = 1 << 5  # token 37
    sample_mask(logits, mask, torch.tensor([1]))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [3, 31, 37] and logits[1, 37] == 77 and torch.isfinite(logits[0]).all()
