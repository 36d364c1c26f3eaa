"""``inferhal bench ep`` runs end to end on the tiny V4 (here dep1 and dep2 only): the ranks' attention tokens
add up to the single process's, the bytes sent are near the planner's uniform-routing figure, the tokens equal;
the two-batch overlap rows time dep2 without and with ``parallel.tbo`` (same tokens, steps split, collective
time hidden only with it)."""

from __future__ import annotations

import json

from inferhal.core.bench import ep
from inferhal.core.cli.main import main


def test_bench_ep_small_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ep, "LAYOUTS", (1, 2))
    assert main(["bench", "ep", "model=deepseek_v4_tiny", "bench.num_prompts=4", "bench.max_tokens=3",
                 "bench.repeats=1", "bench.warmup=0", f"bench.output_dir={tmp_path}"]) == 0
    full = json.loads((tmp_path / "ep.json").read_text())
    rep = full["layouts"]
    one, two = rep["dep1"]["ranks"][0], rep["dep2"]
    assert two["equal"] and sum(r["attn_tokens"] for r in two["ranks"]) == one["attn_tokens"]
    assert all(r["attn_tokens"] < one["attn_tokens"] for r in two["ranks"])  # each rank its own requests
    assert 0.8 < two["sent_over_planned"] < 1.25
    out = capsys.readouterr().out
    assert "not a scaling claim" in out and "with/without overlap: median step" in out
    tbo = full["tbo"]
    assert tbo["equal"] and tbo["off"]["steps"] == tbo["on"]["steps"] > 0
    assert tbo["off"]["split_steps"] == 0 < tbo["on"]["split_steps"]
    assert tbo["off"]["hidden_total_ms"] <= 0 < tbo["on"]["hidden_total_ms"]  # exposed = all of it without overlap
