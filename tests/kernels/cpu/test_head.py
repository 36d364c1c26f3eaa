"""The greedy LM head (kernels/cpu/head.py, head_argmax.c) against the full head it replaces: the argmax
(first index on ties) of the bf16-rounded logits the AVX-512 product writes. Its int8 screen only narrows
the columns; the result must be equal, token for token, never merely close.

These run the kernel for real where the CPU has AVX512-BF16 and AVX512-VNNI and a C compiler builds it;
elsewhere they skip with the reason.
"""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.reference.ops import argmax_rows
from inferhal.kernels.cpu import amx, head, lib

_ST = lib.avx512_status()
pytestmark = pytest.mark.skipif(not (_ST.available and head.available()),
                                reason=f"the greedy head's kernels are unavailable here: "
                                       f"{_ST.reason if not _ST.available else 'this CPU lacks avx512_vnni'}")


def _full(x: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
    return argmax_rows(amx.linear(x, wp, n, torch.float32, bf16_values=True, kernel="avx512"))


def _check(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    wp, qh = amx.pack(w), head.quantize(w)
    tokens, overflow = head.argmax(x, w, qh)
    assert not overflow.any()
    assert torch.equal(tokens, _full(x, wp, w.shape[0]))
    return tokens


@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (1, 33, 128), (2, 1000, 64), (5, 31, 640), (6, 4096, 640),
                                   (7, 40000, 640), (13, 2049, 256), (32, 40000, 640)])
def test_tokens_equal_the_full_heads_argmax(m, n, k):
    g = torch.Generator().manual_seed(m * 100003 + n + k)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    x[:, 3] *= 40  # an outlier channel, as final-normed hidden states have
    w = (torch.randn(n, k, generator=g) * 0.03).bfloat16()
    _check(x, w)


def test_exact_ties_go_to_the_lowest_index():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 640, generator=g).bfloat16()
    w = (torch.randn(5000, 640, generator=g) * 0.03).bfloat16()
    for i in range(4):  # row i's winner at 4000 + i, copied to 3000 + i and 100 + i: the copy at 100 + i wins
        w[4000 + i] = (x[i].float() / x[i].float().norm()).bfloat16()
        w[3000 + i] = w[4000 + i]
        w[100 + i] = w[4000 + i]
    assert _check(x, w).tolist() == [100, 101, 102, 103]


def test_logits_that_round_to_the_same_bf16_tie_and_the_lowest_index_wins():
    """Columns whose fp32 logits differ but round to one bf16 value: the screen must keep all of them
    (its slack covers the rounding) and the lowest index wins, as it does over the full logits, although
    its fp32 logit is the smallest of them."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 640, generator=g).bfloat16()
    w = (torch.randn(3000, 640, generator=g) * 0.03).bfloat16()
    top = (x[0].float() / x[0].float().norm() * 2).bfloat16()
    w[300] = top
    for j, c in enumerate((2500, 1500, 700, 2900)):  # nudged copies: fp32 logits a hair above column 300's
        wc = top.clone()
        wc[j] = (wc[j].float() * (1 + 2 ** -7)).bfloat16()
        w[c] = wc
    fp32 = amx.linear(x, amx.pack(w), w.shape[0], torch.float32, kernel="avx512")[0]
    near = fp32[[300, 700, 1500, 2500, 2900]]
    assert near.unique().numel() == 5 and int(fp32.argmax()) != 300  # apart in fp32 ...
    assert near.bfloat16().unique().numel() == 1  # ... one value in bf16
    assert int(_check(x, w)[0]) == 300


def test_zero_rows_and_zero_weights():
    w = (torch.randn(300, 64) * 0.03).bfloat16()
    w[:10] = 0
    x = torch.zeros(2, 64).bfloat16()  # every logit 0: the first column
    assert _check(x, w).tolist() == [0, 0]
    x[1, 5] = 1.0
    _check(x, w)


def test_rows_past_the_candidate_capacity_are_flagged_not_guessed(monkeypatch):
    """Every logit equal: each column is a candidate. Past the capacity the row is flagged for the caller
    (which runs the full head), not given a token."""
    w = torch.full((40000, 64), 0.5).bfloat16()
    x = torch.ones(2, 64).bfloat16()
    x[1] = 0.0
    monkeypatch.setattr(head, "CAPACITY", 1024)
    tokens, overflow = head.argmax(x, w, head.quantize(w))
    assert overflow.tolist() == [True, True]  # row 1: all logits 0, a tie too
    monkeypatch.setattr(head, "CAPACITY", 65536)
    tokens, overflow = head.argmax(x, w, head.quantize(w))
    assert overflow.tolist() == [False, False] and tokens.tolist() == [0, 0]


def test_logits_past_fp32s_range_are_flagged_and_the_op_falls_back_to_the_full_head():
    from inferhal.backends.cpu_avx512 import ops as avx

    g = torch.Generator().manual_seed(4)
    big = 1.5 * 2.0 ** 59  # within MAX_ABS, but 1024 aligned products pass fp32's 3.4e38
    w = (torch.randint(0, 2, (500, 1024), generator=g) * 2 - 1).float().mul(big).bfloat16()
    x = torch.stack((w[7], torch.randn(1024, generator=g).bfloat16(), -w[3]))
    tokens, overflow = head.argmax(x, w, head.quantize(w))
    assert overflow.tolist() == [True, False, True]
    full = _full(x, amx.pack(w), 500)
    assert torch.equal(avx.lm_head_argmax(x, w), full) and int(tokens[1]) == int(full[1])


def test_strided_rows_and_batch_invariance():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 1280, generator=g).bfloat16()
    x = wide[:, 640:]  # rows of stride 1280
    w = (torch.randn(3000, 640, generator=g) * 0.05).bfloat16()
    tokens = _check(x, w)
    qh = head.quantize(w)
    alone = torch.cat([head.argmax(x[i : i + 1], w, qh)[0] for i in range(9)])
    assert torch.equal(tokens, alone)


def test_a_head_viewed_from_a_wider_tensor_reads_its_rows_at_their_stride():
    """The exact step reads candidates' values from w's own rows: at a row stride past k, the values
    between the rows (here large, so any misread would win) are never taken."""
    g = torch.Generator().manual_seed(7)
    wide = torch.full((4000, 704), 50.0).bfloat16()
    wide[:, :640] = (torch.randn(4000, 640, generator=g) * 0.05).bfloat16()
    w = wide[:, :640]
    x = torch.randn(6, 640, generator=g).bfloat16()
    assert w.stride(0) == 704 and head.supports(x, w)
    tokens, overflow = head.argmax(x, w, head.quantize(w))
    assert not overflow.any() and torch.equal(tokens, _full(x, amx.pack(w.contiguous()), 4000))


def test_heads_the_exact_step_cannot_index_are_not_taken():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(100, 64).bfloat16()
    assert head.supports(x, w)
    assert not head.supports(x, torch.randn(64, 100).bfloat16().t())  # columns, not rows, contiguous
    assert not head.supports(x, torch.randn(100, 65).bfloat16()[:, :64])  # an odd row stride: no k pairs


def test_a_head_with_a_value_the_bound_does_not_cover_has_no_screen():
    w = torch.randn(100, 64).bfloat16()
    w[37, 5] = float("inf")
    assert head.quantize(w) is None
    w[37, 5] = 2.0 ** 61  # past MAX_ABS
    assert head.quantize(w) is None
    w[37, 5] = 2.0 ** 60
    assert head.quantize(w) is not None


def _rows_reference(x):
    """head.rows' formulas in torch float64 (torch.round: half to even)."""
    m, k = x.shape
    groups = k // head.GROUP
    xf = x.double().view(m, groups, head.GROUP)
    sx = (xf.abs().amax(dim=2) / 127).float()
    s = sx.double()[:, :, None]
    xq = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1.0)), 0.0).clamp_(-127, 127)
    dx = xf - xq * s
    c = (s[:, :, 0] * 128 * xq.sum(dim=2)).sum(dim=1)
    p = (s[:, :, 0] * 255 * xq.abs().sum(dim=2)).sum(dim=1)
    up = 1 + 2.0 ** -20
    e = (groups + 6) * 2.0 ** -24 * 1.02 * (p + c.abs()) * up
    norms = (xf.reshape(m, k).norm(dim=1) * up, dx.reshape(m, k).norm(dim=1) * up)
    return xq.reshape(m, k).to(torch.int8), sx, torch.stack((c, *norms, e), dim=1).float()


def test_rows_quantise_as_the_bound_assumes_and_flag_the_rows_it_does_not_cover():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 640, generator=g) * torch.logspace(-3, 2, 640)).bfloat16()
    x[2, 64:128] = 0  # a group of zeros: scale 0
    x[3, 10] = 2.0 ** 60  # the largest value covered
    x[4, 7] = 2.0 ** 61  # past MAX_ABS
    x[5, 600] = float("nan")
    x[6, 0] = float("-inf")
    xq, sx, consts, bad = head.rows(x)
    assert bad.tolist() == [False, False, False, False, True, True, True]
    want_q, want_s, want_c = _rows_reference(x[:4])
    assert torch.equal(xq[:4], want_q) and torch.equal(sx[:4], want_s)
    torch.testing.assert_close(consts[:4], want_c, rtol=2 ** -22, atol=0)  # float64 sums in another order
    assert not xq[4:].any() and not sx[4:].any() and not consts[4:].any()
    strided = torch.cat((x, x), dim=1)[:, 640:]
    assert all(torch.equal(a, b) for a, b in zip(head.rows(strided), (xq, sx, consts, bad)))


def test_rows_the_bound_does_not_cover_are_handed_back_and_the_others_screened():
    from inferhal.backends.cpu_avx512 import ops as avx

    g = torch.Generator().manual_seed(6)
    w = (torch.randn(3000, 640, generator=g) * 0.05).bfloat16()
    x = torch.randn(5, 640, generator=g).bfloat16()
    x[1, 3], x[3, 9] = float("nan"), 2.0 ** 62
    wp, qh = amx.pack(w), head.quantize(w)
    tokens, overflow = head.argmax(x, w, qh)
    assert overflow.tolist() == [False, True, False, True, False]
    full = _full(x, wp, 3000)
    keep = [0, 2, 4]
    assert torch.equal(tokens[keep], full[keep])
    assert torch.equal(avx.lm_head_argmax(x, w), full)  # the op gives the handed-back rows the full head's token
    tokens, overflow = head.argmax(x[[1, 3]], w, qh)
    assert overflow.tolist() == [True, True]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="k % 64"):
        head.quantize(torch.randn(10, 96).bfloat16())
    with pytest.raises(ValueError, match="bf16 CPU head"):
        head.quantize(torch.randn(10, 64))
    with pytest.raises(ValueError, match="contiguous rows"):
        head.quantize(torch.randn(64, 10).bfloat16().t())
    w = torch.randn(10, 64).bfloat16()
    with pytest.raises(ValueError, match=r"x \[m, 64\]"):
        head.argmax(torch.randn(2, 64), w, head.quantize(w))
    with pytest.raises(ValueError, match=r"own bf16 CPU w \[10, 64\]"):
        head.argmax(torch.randn(2, 64).bfloat16(), w[:9], head.quantize(w))
    with pytest.raises(ValueError, match="even stride"):
        head.argmax(torch.randn(2, 64).bfloat16(), torch.randn(10, 65).bfloat16()[:, :64], head.quantize(w))
