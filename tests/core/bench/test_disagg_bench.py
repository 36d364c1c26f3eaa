"""``inferhal bench disagg`` runs end to end on the tiny V4 and reports both sides, the bytes against plan kv."""

from __future__ import annotations

import json

from inferhal.core.cli.main import main


def test_bench_disagg_small_run(tmp_path, capsys):
    assert main(["bench", "disagg", "model=deepseek_v4_tiny", "bench.num_prompts=4", "bench.max_tokens=6",
                 "bench.repeats=1", f"bench.output_dir={tmp_path}"]) == 0
    rep = json.loads((tmp_path / "disagg.json").read_text())
    assert rep["outputs_equal"] and set(rep["rows"]) == {"colocated", "disaggregated"}
    assert len(rep["requests"]) == 4 and all(1.0 <= r["ratio"] < 2.0 for r in rep["requests"])
    for r in rep["rows"].values():
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
    assert "not a speed claim" in capsys.readouterr().out
