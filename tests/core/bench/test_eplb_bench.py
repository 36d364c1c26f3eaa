import pytest
import torch

from inferhal.core.bench.eplb import drifted, synthetic_load


@pytest.mark.parametrize("kind", ["zipf", "lognormal", "hot_experts", "hot_groups"])
def test_synthetic_loads_are_skewed_valid_counts(kind):
    w = synthetic_load(kind, 0, layers=3, experts=64, groups=8)
    assert w.shape == (3, 64) and (w >= 0).all() and torch.isfinite(w).all()
    assert float((w.amax(1) / w.mean(1)).min()) > 2.0  # skewed
    nxt = drifted(w, 1)
    assert not torch.equal(nxt, w)
    torch.testing.assert_close(nxt.sum(1), w.sum(1), rtol=1e-3, atol=64)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown load kind"):
        synthetic_load("uniformish", 0)
