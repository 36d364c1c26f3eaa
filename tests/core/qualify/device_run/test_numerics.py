"""The end-to-end verdicts tell a near tie from a real divergence; the conformance ops are spread over the
workers with the heavy ones first."""

from __future__ import annotations

from inferhal.core.qualify.device_run import numerics as nm


def test_e2e_verdicts():
    want, got = [[1, 2, 3]], [[1, 2, 4]]
    want_lp = [[{1: -0.1}, {2: -0.2}, {3: -0.7000, 4: -0.7004}]]
    got_lp = [[{1: -0.1001}, {2: -0.2003}, {4: -0.69, 3: -0.70}]]
    d = nm.divergence(got, want, want_lp, got_lp)
    assert d["position"] == 2 and d["near_tie"]  # a 4e-4 gap against 3e-4 of noise before it
    assert nm.verdict({"deterministic": True, "tokens_equal": False, "divergence": d}) == "diverged"
    far = dict(d, near_tie=False)
    assert nm.verdict({"deterministic": True, "tokens_equal": False, "divergence": far}) == "fail"
    assert nm.verdict({"deterministic": False, "tokens_equal": True}) == "fail"
    assert nm.verdict({"deterministic": True, "tokens_equal": True}) == "pass"
    assert nm.divergence(want, want, want_lp, want_lp) is None


def test_split_ops_spreads_the_heavy_ops():
    groups = nm.split_ops(["norm.rms", "moe.experts", "attn.paged", "sample", "rope.apply"], 2)
    assert sorted(op for g in groups for op in g) == sorted(["norm.rms", "moe.experts", "attn.paged", "sample", "rope.apply"])
    assert {"moe.experts", "attn.paged"} & set(groups[0]) and {"moe.experts", "attn.paged"} & set(groups[1])
    assert nm.split_ops(["a"], 4) == [["a"]]
