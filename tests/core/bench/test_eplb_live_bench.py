"""``inferhal bench eplb_live`` end to end on the tiny V4 (narrow experts, few prompts): both modes rebalance with
the single process's tokens; stop-the-world moves every changed layer in one step, live one layer a step over
several steps; the summary's arithmetic on hand-made runs."""

from __future__ import annotations

import json

import pytest

from inferhal.core.bench import eplb_live
from inferhal.core.cli.main import main


def test_summary_separates_steps_that_moved_weights():
    runs = [[{"mode": "stop-the-world", "step_s": [0.01, 0.05, 0.01], "moves": [(2, 4, 0.04)],
              "rebalances": [(2, 2, 3)], "tokens": [[1]]},
             {"mode": "live", "step_s": [0.01, 0.02, 0.02, 0.01], "moves": [(2, 1, 0.01), (3, 1, 0.01)],
              "rebalances": [(1, 3, 3)], "tokens": [[1]]}]]
    s = eplb_live.summarize(runs, [[1]])
    assert s["equal"]
    stw, live = s["stop-the-world"], s["live"]
    assert (stw["normal_ms"], stw["moving_max_ms"], stw["max_layers_per_step"]) == pytest.approx((10, 50, 4))
    assert stw["max_over_normal"] == pytest.approx(5.0) and stw["steps_per_rebalance"] == 1
    assert (live["moving_max_ms"], live["weights_ms_per_rebalance"], live["steps_per_rebalance"]) == \
        pytest.approx((20, 20, 3))
    assert not eplb_live.summarize(runs, [[2]])["equal"]


@pytest.mark.slow
def test_bench_eplb_live_small_run(tmp_path, monkeypatch):
    monkeypatch.setattr(eplb_live, "WIDE", {"model.arch.moe_intermediate_size": 64, "model.arch.n_routed_experts": 16,
                                            "eplb.num_redundant_experts": 4})
    monkeypatch.setattr(eplb_live, "REBALANCE_EVERY", 3)
    assert main(["bench", "eplb_live", "model=deepseek_v4_tiny", "bench.num_prompts=4", "bench.max_tokens=10",
                 "bench.repeats=1", "bench.warmup=0", f"bench.output_dir={tmp_path}"]) == 0
    rep = json.loads((tmp_path / "eplb_live.json").read_text())
    assert rep["equal"]
    stw, live = rep["stop-the-world"], rep["live"]
    assert stw["rebalances"] > 0 and live["rebalances"] > 0
    assert stw["steps_per_rebalance"] == 1 and stw["max_layers_per_step"] > 1
    assert live["max_layers_per_step"] == 1 and live["steps_per_rebalance"] > 1
