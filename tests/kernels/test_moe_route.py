"""moe.route kernel vs the reference, in the interpreter.

Routing weights are fp32 throughout (scores, renormalisation): tolerance 1e-5 relative covers exp/log
implementations differing by a few ulps. Ids: the kernel's choice must be *a* top-k of the reference's
choice values (scores + bias): its values equal the reference's top-k values within 1e-6 (two experts
whose choice values are within fp32 rounding of each other may swap; with 256 saturating sigmoids this
happens), and the weights are checked at the kernel's ids.
"""

import pytest
import torch

from inferhal.backends.reference.moe import moe_route as ref_route
from inferhal.backends.reference.moe import score
from inferhal.core.ops.params import RouteParams
from inferhal.kernels.moe_route import moe_route


def by_id(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("t,e,k", [(1, 8, 1), (7, 16, 6), (9, 64, 8), (2, 256, 6), (3, 10, 10), (0, 8, 2)])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias,renorm", [(False, True), (True, True), (True, False)])
def test_route_matches_reference(t, e, k, scoring, with_bias, renorm, close):
    g = torch.Generator().manual_seed(t * 7 + e + k)
    # x2.5: reaches softplus' tails, but keeps sigmoid away from saturation, where scores of different
    # experts come within one fp32 ulp of 1.0 and the choice between them is rounding noise
    logits = torch.randn(t, e, generator=g) * 2.5
    bias = torch.randn(e, generator=g) * 0.5 if with_bias else None
    p = RouteParams(top_k=k, scoring=scoring, renormalize=renorm, routed_scaling=1.5)
    w, ids = by_id(*moe_route(logits, p, bias))
    scores = score(logits, scoring)
    choose = scores if bias is None else scores + bias
    top = torch.topk(choose, k, dim=-1).values
    picked = choose.gather(1, ids).sort(dim=-1, descending=True).values
    torch.testing.assert_close(picked, top, rtol=0, atol=1e-6)
    assert all(len(set(r)) == k for r in ids.tolist())  # k distinct experts
    rw = scores.gather(1, ids)
    if renorm:
        rw = rw / (rw.sum(-1, keepdim=True) + 1e-20)
    close(w, rw * 1.5, name=f"moe.route {scoring}")
    exact = by_id(*ref_route(logits, p, bias))[1]
    assert t == 0 or (ids == exact).all(dim=1).float().mean() >= 0.5  # most tokens: no near-tie at all


def test_route_bf16_logits_and_hash(close):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 32, generator=g) * 2).to(torch.bfloat16)
    hash_ids = torch.randint(0, 32, (9, 6), generator=g)
    p = RouteParams(top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5)
    w, ids = moe_route(logits, p, hash_ids=hash_ids)
    rw, rids = ref_route(logits, p, hash_ids=hash_ids)
    assert torch.equal(ids, rids)  # hash routing keeps the table's order
    close(w, rw, name="moe.route hash")
    wb, idb = by_id(*moe_route(logits, p))
    rwb, ridb = by_id(*ref_route(logits, p))
    assert torch.equal(idb, ridb)
    close(wb, rwb, name="moe.route bf16 logits")


def test_route_ties_break_to_lower_id():
    logits = torch.zeros(2, 8)
    _, ids = moe_route(logits, RouteParams(top_k=3, scoring="sigmoid"))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, RouteParams(top_k=9))
