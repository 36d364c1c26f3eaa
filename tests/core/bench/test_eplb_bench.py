import json

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


# --- DeepSeek's EPLB as a peer: loading (hermetic: never downloads) and the comparison -------------------

import subprocess
import types
import zipfile

from inferhal.core.bench import _eplb_peer, eplb
from inferhal.core.bench._eplb_peer import MEMBER, Peer, load_deepseek
from inferhal.core.eplb import rebalance_experts
from inferhal.core.eplb.baseline import rebalance_greedy
from inferhal.core.eplb.metrics import balancedness_per_layer


def _wheel(tmp_path, source: str):
    path = tmp_path / f"{_eplb_peer.DIST}-{_eplb_peer.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, source)
    return path


FAKE = '''
from typing import Tuple
import torch
def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, enable_hierarchical):
    L, E = weight.shape
    p2l = (torch.arange(num_replicas) % E).expand(L, num_replicas)
    return p2l, enable_hierarchical, torch.zeros(L, E, dtype=torch.long).scatter_add_(1, p2l, torch.ones_like(p2l))
'''


def test_peer_without_a_wheel_is_not_run_and_says_why(tmp_path):
    peer = load_deepseek(tmp_path / "empty", download=False)
    assert peer.fn is None and peer.reason.startswith("not run") and "no sglang-0.5.23 wheel" in peer.reason


def test_peer_download_failure_is_reported_not_raised(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for sglang==0.5.23\n")

    monkeypatch.setattr(_eplb_peer.subprocess, "run", fake_run)
    peer = load_deepseek(tmp_path, download=True)
    assert peer.fn is None and "No matching distribution" in peer.reason
    assert "--no-deps" in seen[0] and "sglang==0.5.23" in seen[0]


def test_peer_is_imported_from_the_wheel_with_deepseeks_hierarchy_rule(tmp_path):
    _wheel(tmp_path, FAKE)
    peer = load_deepseek(tmp_path, download=False)
    assert peer.fn is not None and peer.reason == "" and "sha256" in peer.source
    assert peer.fn(torch.ones(2, 16), 24, 4, 2, 8)[1] is True  # 4 groups on 2 nodes: hierarchical
    assert peer.fn(torch.ones(2, 16), 24, 4, 3, 6)[1] is False  # 4 groups on 3 nodes: global
    assert (tmp_path / "sglang-0.5.23" / "deepseek.py").exists()  # extracted once, reused


def test_peer_module_with_other_imports_is_refused_before_it_runs(tmp_path):
    _wheel(tmp_path, "import sglang.srt.utils\nraise SystemExit('executed')\n")
    peer = load_deepseek(tmp_path, download=False)
    assert peer.fn is None and "imports sglang" in peer.reason


def test_measure_scores_every_policy_alike_and_summarizes():
    pols = {"inferhal": rebalance_experts, "other": rebalance_greedy}
    rows = eplb.measure(("lognormal",), ((288, 1, 8), (320, 4, 32)), repeats=1, pols=pols, layers=3)
    assert [(r.policy, r.slots) for r in rows] == [("inferhal", 288), ("other", 288), ("inferhal", 320),
                                                   ("other", 320)]
    assert all(not r.invalid and r.seconds > 0 and r.balancedness >= r.lower_bound - 1e-6 for r in rows)
    s = eplb.summarize(rows)
    assert s["cases"] == 2 and s["inferhal_vs_other"]["worse"] == 0
    assert set(s["inferhal_vs_other"]) >= {"better", "drifted_better", "time_ratio_median", "slower_cases"}


def test_invalid_peer_plan_is_flagged():
    def broken(weight, R, G, N, P):
        p2l, l2p, cnt = rebalance_experts(weight, R, G, N, P)
        return p2l.roll(1, dims=1), l2p, cnt  # a group now straddles two nodes

    rows = eplb.measure(("hot_groups",), ((320, 4, 32),), repeats=1, pols={"inferhal": rebalance_experts,
                                                                          "broken": broken}, layers=2)
    assert rows[0].invalid == "" and "spans nodes" in rows[1].invalid


@pytest.mark.parametrize("output", [None, "new/dir/run.json"])
def test_run_small_without_a_peer_writes_table_json_and_plot(tmp_path, monkeypatch, capsys, output):
    monkeypatch.setattr(eplb, "KINDS", ("zipf",))
    monkeypatch.setattr(eplb, "LAYOUTS", ((288, 1, 8),))
    monkeypatch.setattr(eplb, "SPEED_LAYOUTS", ((288, 1, 8),))
    monkeypatch.setattr(eplb, "LAYERS", 2)
    monkeypatch.setattr(eplb, "load_deepseek", lambda: Peer("deepseek", reason="not run: offline (test)"))
    cfg = types.SimpleNamespace(bench=types.SimpleNamespace(output_dir=str(tmp_path), repeats=1, peers=[]),
                                seed=0, output=output and str(tmp_path / output))
    assert eplb.run(cfg) == 0
    out = capsys.readouterr().out
    assert "not run: offline (test)" in out
    json_path = tmp_path / (output or "eplb.json")  # output= may name a folder that does not exist yet
    data = json.loads(json_path.read_text())
    assert data["summary"]["deepseek_source"] == "not run: offline (test)"
    assert {r["policy"] for r in data["rows"]} == {"inferhal", "greedy", "inferhal-drift0"}
    assert json_path.with_suffix(".png").stat().st_size > 0


def test_bench_peers_without_deepseek_skips_it():
    cfg = types.SimpleNamespace(bench=types.SimpleNamespace(peers=["transformers"]))
    peer = eplb.peer_for(cfg)
    assert peer.fn is None and "does not name deepseek" in peer.reason


_CACHED = load_deepseek(download=False)


@pytest.mark.skipif(_CACHED.fn is None, reason=f"DeepSeek EPLB {_CACHED.reason} (run `inferhal bench eplb` once)")
@pytest.mark.parametrize("slots,nodes,gpus", [(288, 1, 8), (320, 4, 32), (384, 1, 64)])
def test_ours_balances_at_least_as_well_as_deepseeks_public_eplb(slots, nodes, gpus):
    for ki, kind in enumerate(("lognormal", "hot_experts")):
        w = synthetic_load(kind, ki, layers=6)
        ours, theirs = rebalance_experts(w, slots, 8, nodes, gpus), _CACHED.fn(w, slots, 8, nodes, gpus)
        b_ours = balancedness_per_layer(w, ours[0], ours[2], gpus)
        b_theirs = balancedness_per_layer(w, theirs[0], theirs[2].long(), gpus)
        assert float(b_ours.mean()) <= float(b_theirs.mean()) + 1e-6


def test_drifted_is_compared_window_by_window_with_its_standard_error():
    a = eplb.Row("zipf", 8, 1, 2, "a", 1.0, 1.2, 1.0, 0.1, drifted_windows=[1.1, 1.3, 1.2])
    b = eplb.Row("zipf", 8, 1, 2, "b", 1.0, 1.25, 1.0, 0.1, drifted_windows=[1.2, 1.35, 1.2])
    d, se = eplb.paired_drift(a, b)
    assert d == pytest.approx(-0.05) and se == pytest.approx(0.05 / 3 ** 0.5)  # differences -0.1, -0.05, 0
    s = eplb.summarize([a, b], ours="a")
    assert s["a_vs_b"]["drifted_better"] == 1 and s["a_vs_b"]["drifted_better_2se"] == 0  # noisy: not 2 s.e.
    rows = eplb.measure(("lognormal",), ((288, 1, 8),), repeats=1,
                        pols={"inferhal": rebalance_experts, "greedy": rebalance_greedy}, layers=2)
    assert all(len(r.drifted_windows) == eplb.DRIFTS for r in rows)
    assert rows[0].drifted == pytest.approx(sum(rows[0].drifted_windows) / eplb.DRIFTS)
