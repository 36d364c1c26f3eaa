"""``inferhal bench ep`` runs end to end on the tiny V4 (here dep1 and dep2 only): the ranks' attention tokens
add up to the single process's, the bytes sent are near the planner's uniform-routing figure, the tokens equal."""

from __future__ import annotations

import json

from inferhal.core.bench import ep
from inferhal.core.cli.main import main


def test_bench_ep_small_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ep, "LAYOUTS", (1, 2))
    assert main(["bench", "ep", "model=deepseek_v4_tiny", "bench.num_prompts=4", "bench.max_tokens=3",
                 f"bench.output_dir={tmp_path}"]) == 0
    rep = json.loads((tmp_path / "ep.json").read_text())["layouts"]
    one, two = rep["dep1"]["ranks"][0], rep["dep2"]
    assert two["equal"] and sum(r["attn_tokens"] for r in two["ranks"]) == one["attn_tokens"]
    assert all(r["attn_tokens"] < one["attn_tokens"] for r in two["ranks"])  # each rank its own requests
    assert 0.8 < two["sent_over_planned"] < 1.25
    assert "not a scaling claim" in capsys.readouterr().out
