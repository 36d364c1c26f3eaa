"""moe.route kernel vs the reference, in the interpreter.

Routing weights are fp32 throughout (scores, renormalisation): tolerance 1e-5 relative covers exp/log
implementations differing by a few ulps. Ids must be identical as sets per token (random logits: no ties).
"""

import pytest
import torch

from inferhal.backends.reference.moe import moe_route as ref_route
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
    logits = torch.randn(t, e, generator=g) * 4  # wide range: softplus linear region and tails
    bias = torch.randn(e, generator=g) * 0.5 if with_bias else None
    p = RouteParams(top_k=k, scoring=scoring, renormalize=renorm, routed_scaling=1.5)
    w, ids = by_id(*moe_route(logits, p, bias))
    rw, rids = by_id(*ref_route(logits, p, bias))
    assert torch.equal(ids, rids)
    close(w, rw, name=f"moe.route {scoring}")


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
