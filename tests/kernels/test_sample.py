"""sample kernel in the interpreter vs the reference sampler.

A kernel cannot reproduce torch.Generator draws, so the contract tested here (kernels/sample.py) is:
- greedy rows (temperature 0) give exactly the reference's tokens;
- random rows only ever draw tokens the reference's filters allow (top-k, top-p, min-p);
- draws are deterministic per (seed, step) and independent of the batch around the row;
- their distribution is the reference's filtered distribution: a chi-square goodness-of-fit test on
  N = 4096 draws over a small vocabulary. The test statistic's 99.9 % quantile (chi2 with df = number
  of allowed tokens - 1, hard-coded below, no scipy) bounds it; a correct sampler fails 1 run in 1000
  per case, and the seeds are fixed, so the outcome is reproducible. The same test applied to the
  reference's own draws checks the helper that computes the filtered distribution.
"""

import pytest
import torch

from inferhal.backends.reference.ops import sample as ref_sample
from inferhal.core.ops.params import SampleBatch
from inferhal.kernels.sample import sample
from inferhal.kernels.tuning import register_target

#: many rows per program for the 4096-row distribution tests (the interpreter pays per program and per op)
register_target("test_sample_rows", {"sample": {"BLOCK_R": 1024, "BLOCK_V": 16, "num_warps": 4}})

#: chi-square 99.9 % quantiles by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def filtered_probs(row, temp, top_k, top_p, min_p=0.0):
    """The reference's filtered distribution of one row (its formulas, written out for the test)."""
    x = row.float() / temp
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, -1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True, stable=True)
        sp = sp.masked_fill(torch.cumsum(sp, -1) - sp > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, si, sp)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def chi2(tokens, probs):
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "drew a token outside the allowed set"
    keep = probs > 0
    exp = probs.double()[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 6, 0.9, 0.0), (1.0, 0, 1.0, 0.1)]


@pytest.mark.parametrize("temp,top_k,top_p,min_p", SETTINGS)
def test_sample_distribution_matches_reference_filtered_distribution(temp, top_k, top_p, min_p):
    v, n = 12, 4096
    g = torch.Generator().manual_seed(7)
    row = torch.randn(v, generator=g) * 1.5
    logits = row[None].expand(n, v).contiguous()
    mp = (min_p,) * n if min_p else ()
    p = SampleBatch((temp,) * n, (top_k,) * n, (top_p,) * n, min_p=mp, seeds=tuple(range(n)), steps=(3,) * n)
    probs = filtered_probs(row, temp, top_k, top_p, min_p)
    stat, df = chi2(sample(logits, p, target="test_sample_rows"), probs)
    assert stat < CHI2_999[df], (stat, df)
    # the helper is the reference's distribution: the reference's own draws pass the same test
    gens = tuple(torch.Generator().manual_seed(100 + i) for i in range(n))
    ref = ref_sample(logits, SampleBatch((temp,) * n, (top_k,) * n, (top_p,) * n, gens, mp))
    rstat, _ = chi2(ref, probs)
    assert rstat < CHI2_999[df], (rstat, df)


def test_greedy_rows_equal_reference_and_ties_take_the_first_index():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 300, generator=g) * 3
    logits[2, [17, 40]] = 50.0  # tie: first index wins, as torch.argmax
    p = SampleBatch((0.0,) * 9, (0,) * 9, (1.0,) * 9)
    assert torch.equal(sample(logits, p), ref_sample(logits, p))


def test_seeded_draws_are_deterministic_batch_invariant_and_allowed():
    g = torch.Generator().manual_seed(2)
    v = 200  # one interpreter tile; test_tiles_cross_the_vocabulary_edge crosses tile edges
    logits = torch.randn(6, v, generator=g) * 2
    temps, ks, ps = (0.0, 0.8, 1.0, 1.2, 0.9, 1.0), (0, 20, 0, 50, 5, 3), (1.0, 0.9, 0.7, 1.0, 0.95, 1.0)
    seeds, steps = (11, 12, 13, 14, 15, 16), (0, 1, 2, 3, 4, 5)
    full = sample(logits, SampleBatch(temps, ks, ps, seeds=seeds, steps=steps))
    assert torch.equal(full, sample(logits, SampleBatch(temps, ks, ps, seeds=seeds, steps=steps)))
    # row 3 alone, and inside a different batch, draws the same token
    alone = sample(logits[3:4], SampleBatch(temps[3:4], ks[3:4], ps[3:4], seeds=seeds[3:4], steps=steps[3:4]))
    assert int(alone[0]) == int(full[3])
    perm = [5, 3, 0]
    other = sample(logits[perm], SampleBatch(tuple(temps[i] for i in perm), tuple(ks[i] for i in perm),
                                             tuple(ps[i] for i in perm), seeds=tuple(seeds[i] for i in perm),
                                             steps=tuple(steps[i] for i in perm)))
    assert other.tolist() == [int(full[i]) for i in perm]
    for i in range(6):
        if temps[i] > 0:
            assert filtered_probs(logits[i], temps[i], ks[i], ps[i])[full[i]] > 0, i
    # another step of the same seed is another draw stream: over 64 steps the tokens are not all equal
    many = sample(logits[1:2].expand(64, v).contiguous(),
                  SampleBatch((1.0,) * 64, (0,) * 64, (1.0,) * 64, seeds=(12,) * 64, steps=tuple(range(64))))
    assert len(set(many.tolist())) > 1


def test_generator_rows_repeat_with_the_same_seed():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    mk = lambda: SampleBatch((1.0,) * 4, (10,) * 4, (0.9,) * 4,  # noqa: E731
                             tuple(torch.Generator().manual_seed(5 + i) for i in range(4)))
    a, b = mk(), mk()
    first = [sample(logits, a).tolist() for _ in range(3)]  # the generators advance: step by step
    assert first == [sample(logits, b).tolist() for _ in range(3)]


def test_tiles_cross_the_vocabulary_edge():
    # V = 600 crosses 256-token tiles (interpreter tuning) with a ragged last tile; top-k/top-p exact ties
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-4, 4, (5, 600), generator=g).float()
    logits[:, 599] = 9.0  # the maximum sits in the last, ragged tile
    p = SampleBatch((0.0, 1.0, 1.0, 0.5, 1.0), (0, 7, 0, 3, 600), (1.0, 1.0, 0.5, 0.9, 0.3), seeds=(1, 2, 3, 4, 5))
    out = sample(logits, p)
    assert int(out[0]) == 599
    for i in range(1, 5):
        assert filtered_probs(logits[i], p.temperature[i], p.top_k[i], p.top_p[i])[out[i]] > 0, i
