"""spec.verify kernel in the interpreter vs the reference rejection sampler.

Contract (kernels/spec_verify.py): greedy rows equal the reference exactly; random rows emit an accepted
draft prefix plus one token, -1 padded, only ever tokens the filters allow, deterministic per (seed, step),
and distributed as the reference's sampler: checked by the acceptance rate of one draft (its expectation
is sum_x min(p(x), q(x))) and by a chi-square test of the emitted first token's distribution.
"""

import pytest
import torch

from inferhal.backends.reference.spec import spec_verify as ref_verify
from inferhal.core.ops.params import SampleBatch
from inferhal.kernels.spec_verify import spec_verify
from inferhal.kernels.tuning import register_target

register_target("test_verify_small_v", {"spec_verify": {"BLOCK_V": 16, "num_warps": 4}})


def greedy_batch(b):
    return SampleBatch((0.0,) * b, (0,) * b, (1.0,) * b)


@pytest.mark.parametrize("b,s,v", [(4, 3, 64), (6, 2, 300), (3, 0, 50)])
def test_greedy_rows_equal_reference(b, s, v):
    g = torch.Generator().manual_seed(b * s + v)
    logits = torch.randn(b, s + 1, v, generator=g) * 3
    draft = torch.randint(0, v, (b, s), generator=g)
    for r in range(b):  # row r agrees with the target for r steps (all of them for the last rows)
        a = min(r, s)
        draft[r, :a] = logits[r, :a].argmax(-1)
    if s:
        logits[0, 0, [5, 9]] = 100.0  # a tie: the first index is the target's token
        draft[0, 0] = 5
    p = greedy_batch(b)
    got, want = spec_verify(draft, None, logits, p), ref_verify(draft, None, logits, p)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_random_rows_emit_an_allowed_prefix_plus_one_and_are_deterministic():
    b, s, v = 5, 3, 40
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(b, s + 1, v, generator=g) * 2
    draft = logits[:, :s].argmax(-1)  # likely drafts: several get accepted
    q = torch.softmax(torch.randn(b, s, v, generator=g), -1)
    p = SampleBatch((0.0, 0.8, 1.0, 1.2, 0.7), (0, 5, 0, 3, 0), (1.0, 1.0, 0.9, 1.0, 1.0), min_p=(0, 0, 0, 0, 0.2),
                    seeds=tuple(range(b)), steps=(7,) * b)
    for probs in (None, q):
        toks, n = spec_verify(draft, probs, logits, p)
        again = spec_verify(draft, probs, logits, p)
        assert torch.equal(toks, again[0]) and torch.equal(n, again[1])
        ref_toks, ref_n = ref_verify(draft, probs, logits, greedy_batch(b))
        assert torch.equal(toks[0], ref_toks[0]) and n[0] == ref_n[0]  # the greedy row
        for r in range(1, b):
            k = int(n[r])
            assert 1 <= k <= s + 1
            assert torch.equal(toks[r, : k - 1], draft[r, : k - 1]) and bool((toks[r, k:] == -1).all())
            top_k = p.top_k[r]
            if top_k:  # the emitted token is among the top-k of its position
                allowed = torch.topk(logits[r, k - 1], top_k).indices
                assert int(toks[r, k - 1]) in allowed.tolist()


def test_random_acceptance_and_residual_follow_the_rejection_sampler():
    """One draft position, N rows of the same logits and draft distribution q, draft tokens drawn from q:
    P(accept) = sum_x min(p, q), and the emitted first token is distributed as p (the sampler is exact)."""
    n, v = 256, 6  # the interpreter runs ~40 ms per row: a small N, a 99.9 % bound
    g = torch.Generator().manual_seed(11)
    lrow = torch.randn(v, generator=g)
    qrow = torch.softmax(torch.randn(v, generator=g), -1)
    prow = torch.softmax(lrow, -1)
    logits = lrow.expand(n, 2, v).contiguous()
    q = qrow.expand(n, 1, v).contiguous()
    draft = torch.multinomial(qrow, n, replacement=True, generator=g)[:, None]
    p = SampleBatch((1.0,) * n, (0,) * n, (1.0,) * n, seeds=tuple(range(n)), steps=(1,) * n)
    toks, k = spec_verify(draft, q, logits, p, target="test_verify_small_v")
    rate = float((k == 2).float().mean())
    want = float(torch.minimum(prow, qrow).sum())
    assert abs(rate - want) < 3.3 * (want * (1 - want) / n) ** 0.5 + 1e-3, (rate, want)  # 99.9 %
    counts = torch.bincount(toks[:, 0], minlength=v).double()
    exp = prow.double() * n
    stat = float(((counts - exp) ** 2 / exp).sum())
    assert stat < 20.52, stat  # chi2, 5 degrees of freedom, 99.9 %
